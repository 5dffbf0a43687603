#!/usr/bin/env bash
# Every GPU measurement of the megatron-core engine in one call on a 2 x H200 machine.
# Needs TE 2.20.2 + megatron-core 0.19.2 importable (staged by benchmarks/scripts/stage-gpu.sh into
# /tmp/site). Writes everything under ${OUT:-bench-out}; each step's result folder is in benchmarks/index.yaml.
#   usage: bash benchmarks/scripts/h200.sh STEP...   (default: smoke)
#   all of benchmarks/: fingerprint parity proxy1 slice slice1 slice2 slicee slicee2 overhead proxy2 proxy2c
#                       parity2 tp2 parity3 pp2 cp2 etp2 packed packedcp recompute resume resumectl ckptsave
#                       export peftparity peftslice strict det profile peftrun detprobe levers levers2 bridge
#                       levers3 resume1 resumedrop slice8 levers4 profile2 (INTO=remeasure/eager-restored/ ... proxy1 packed)
#                       levers5 (issue 34's engine levers: each alone against the shipped slice, one call, ~6 min)
#                       levers6 (the clip scale that skips unclipped steps, the gated residual's compile fix; BEFORE=dir)
#                       levers7 (the experts' counts read early, the pre-MLP norm in the residual's chain)
#                       levers8gpu levers8 (TE's SwiGLU for the experts, the first micro-batch's gradient writes)
#                       normbwd (the post-expert norm's one-pass backward: its launch, then kept or not by the step)
#                       adam (the Triton Adam step: its launch, then kept or not by the step)
#                       embedgrad (the word embedding's gradient into main_grad, with and without the norm backward)
#                       plansweep (the planner's refit: the shipped slice and its neighbours, one machine, one call)
#   (resume-ep2 / resume-pp2: one layout of resume; the planner's calibration: benchmarks/results/plan/run.sh, CPU)
#   ($OUT holds at most 8 files per device call: split the steps over calls, or tar $OUT)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}:.:benchmarks
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
OUT=${OUT:-bench-out}
mkdir -p "$OUT" runs
MS="python3 -m muse_stack.cli"
# packed rows (THD): the shipped chat fixture, packed into 1,024-token rows
PACKED="data.kind=sft data.builder=packed data.files=[data/tiny-chat.jsonl] data.tokenizer=data/tiny-tokenizer
  data.loss_mask=muse_spark batch.packed=true batch.seq_length=1024"
# a smaller proxy for checkpoint round trips (8 experts, top 2): a quick dist-checkpoint save
# slice-1gpu as its MBS 1 / MBS 2 rows ran (the recipe ships MBS 4 with the allgather dispatcher and the
# precision-aware optimizer since)
ASRAN="batch.mbs=1 layout.dispatcher=alltoall optimizer.precision_aware=null optimizer.param_remainders=null"
# the elementwise chains fused by torch.compile (the slice's own setting), or not
FUSED="engine_options.compile_elementwise=true" EAGER="engine_options.compile_elementwise=false"
SMALL="model.overrides.num_local_experts=8 model.overrides.num_experts_per_tok=2"
# lora-64's adapters (its peft block) on the slice, at lora-64's micro-batching (MBS 1, alltoall)
LORA64="batch.mbs=1 layout.dispatcher=alltoall optimizer.precision_aware=null optimizer.param_remainders=null peft.scheme=lora peft.rank=32 peft.alpha=32 peft.dropout=0.0 peft.per_expert=true
  peft.targets=[self_attn.q_proj,self_attn.k_proj,self_attn.v_proj,self_attn.o_proj,mlp.experts.gate_up_proj,mlp.experts.down_proj,mlp.pre_expert_proj,mlp.post_expert_proj]"
# dense adapters whose input dropout draws a mask every micro-batch (resumedrop)
DROP="peft.scheme=lora peft.rank=8 peft.alpha=16 peft.dropout=0.1 peft.per_expert=false
  peft.targets=[self_attn.q_proj,self_attn.v_proj,self_attn.o_proj]"
# megatron-core's precision-aware optimizer with the master weights as bf16 weight + int16 remainder
PA="optimizer.precision_aware=true optimizer.param_remainders=true"
T=${STEP_TIMEOUT:-900}  # seconds any one command may take (a hung collective must not eat the call)
one() { CUDA_VISIBLE_DEVICES=${GPU:-0} timeout "$T" "$@"; }  # GPU=1 MASTER_PORT=29600: a second one beside
two() { timeout "$T" torchrun --standalone --nproc-per-node 2 "$@"; }
keep() { # keep a run directory's small files under $OUT/$INTO$1 (INTO: a folder prefix, e.g. remeasure/x/)
  mkdir -p "$OUT/${INTO:-}$1"; cp "$2"/results.json "$2"/metrics.jsonl "$2"/fingerprint.json "$2"/recipe.yaml \
    "$OUT/${INTO:-}$1/" 2>/dev/null; }
round_trip() { # NAME LAUNCH... -- OVERRIDES...: the run uninterrupted (NAME-full), and interrupted after step 3 then
  # resumed (NAME-part), 6 steps each, compared; the interrupted run's checkpoint size in NAME-sizes.txt
  local name=$1 launch=(); shift
  while [ "$1" != "--" ]; do launch+=("$1"); shift; done; shift
  rm -rf "runs/$name-full" "runs/$name-part"
  "${launch[@]}" run "$@" --steps 6 --out "runs/$name-full" --no-progress
  "${launch[@]}" run "$@" --steps 6 --stop-after 3 --out "runs/$name-part" --no-progress
  echo "stop-after rc=$? (1: interrupted)"; du -sb "runs/$name-part"/checkpoints/*/ | tee "$OUT/$name-sizes.txt"
  "${launch[@]}" run --resume "runs/$name-part" --no-progress
  $MS compare "runs/$name-full" "runs/$name-part" --json --no-plot > "$OUT/$name-compare.json"
  keep "$name-full" "runs/$name-full"; keep "$name-part" "runs/$name-part"
  cp "runs/$name-part/fingerprint.resumed.json" "$OUT/${INTO:-}$name-part/" 2>/dev/null; }
for what in "${@:-smoke}"; do
  echo "=== $what $(date +%T)"
  case "$what" in
  fingerprint) one $MS fingerprint -o "$OUT/fingerprint-h200.json" ;;
  parity) one python3 -m lab.verify.parity --train-steps 3 --out "$OUT/parity-tp1.json" ;;
  parity2)
    two -m lab.verify.parity --tp 2 --out "$OUT/parity-tp2.json"
    two -m lab.verify.parity --ep 2 --out "$OUT/parity-ep2.json" ;;
  smoke)
    rm -rf runs/smoke-proxy1 runs/smoke-slice; one $MS run proxy-1gpu --steps 3 --out runs/smoke-proxy1 --no-progress && tail -3 runs/smoke-proxy1/metrics.jsonl
    one $MS run slice-1gpu --steps 2 --out runs/smoke-slice --no-progress && tail -2 runs/smoke-slice/metrics.jsonl ;;
  proxy1) rm -rf runs/proxy-1gpu; one $MS run proxy-1gpu --out runs/proxy-1gpu --no-progress; keep proxy-1gpu runs/proxy-1gpu ;;
  slice) rm -rf runs/slice-1gpu; one $MS run slice-1gpu --out runs/slice-1gpu --no-progress; keep slice-1gpu-mbs4-precision-aware runs/slice-1gpu ;;
  slice8) # the slice at MBS 8 (one micro-batch) with the int16 remainders, which free the memory MBS 8 needs
    rm -rf runs/slice-1gpu8; one $MS run slice-1gpu batch.mbs=8 optimizer.param_remainders=true --out runs/slice-1gpu8 \
      --no-progress; keep slice-1gpu-mbs8 runs/slice-1gpu8 ;;
  levers4) # the precision-aware optimizer with a separate fp32 master (the recipe's setting), by engine_steps.py
    one python3 benchmarks/scripts/engine_steps.py slice-1gpu --steps 30 --warmup 10 --out "$OUT/lever3-precision-aware-fp32.json" ;;
  levers6) # the clip scale that skips unclipped steps and the gated residual compiled on its direct calls, attributed
    # on slice-1gpu (engine_steps.py, 20 steps, window 9-20, one process each): shipped; the tree before both (BEFORE:
    # a folder holding an earlier commit's muse_stack/, benchmarks/scripts/, recipes/ and data/, e.g. `git archive 978a570 muse_stack
    # benchmarks/scripts recipes data`); shipped with TE's scale every step (--te-clip-scale); shipped again (the drift). Then the
    # clip kernel's GPU test and GPU time, and a profile of the shipped step. Outputs: $OUT/clip-skip-and-gated-residual.tgz.
    ES="python3 benchmarks/scripts/engine_steps.py slice-1gpu"; W="--steps 20 --warmup 8"
    D=$(realpath -m "$OUT/clip-skip-and-gated-residual"); mkdir -p "$D"
    one $MS fingerprint -o "$D/fingerprint.json"
    one python3 -m pytest -q -p no:cacheprovider tests/gpu/test_clip_scale_gpu.py 2>&1 | tail -3 | tee "$D/gpu-test.txt"
    one python3 benchmarks/scripts/clip_scale_bench.py --out "$D/clip-scale.json"
    one $ES $W --out "$D/shipped.json"
    if [ -n "${BEFORE:-}" ]; then (cd "$BEFORE" && PYTHONPATH=/tmp/site:. one $ES $W --out "$D/before.json"); fi
    one $ES --te-clip-scale $W --out "$D/te-clip-scale.json"
    one $ES $W --out "$D/shipped-again.json"
    one python3 benchmarks/scripts/profile_step.py slice-1gpu --warmup 5 --steps 2 --shapes --out "$D/profile-shipped.json"
    tar czf "$OUT/clip-skip-and-gated-residual.tgz" -C "$(dirname "$D")" clip-skip-and-gated-residual ;;
  levers7) # the experts' token counts read before the latent GEMM and the pre-MLP norm in the post-attention
    # residual's chain, attributed on slice-1gpu (engine_steps.py, 20 steps, window 9-20, one process each): shipped;
    # both off (the engine before them); each off alone; shipped again (the drift). Then the dispatcher's GPU test
    # and a profile of the shipped step. Outputs: $OUT/early-expert-counts-and-pre-mlp-norm.tgz.
    ES="python3 benchmarks/scripts/engine_steps.py slice-1gpu"; W="--steps 20 --warmup 8"
    D=$(realpath -m "$OUT/early-expert-counts-and-pre-mlp-norm"); mkdir -p "$D"
    one $MS fingerprint -o "$D/fingerprint.json"
    one python3 -m pytest -q -p no:cacheprovider tests/gpu/test_dispatch_gpu.py 2>&1 | tail -15 | tee "$D/gpu-test.txt"
    one $ES $W --out "$D/shipped.json"
    one $ES --late-counts --separate-pre-mlp-norm $W --out "$D/before.json"
    one $ES --late-counts $W --out "$D/late-counts.json"
    one $ES --separate-pre-mlp-norm $W --out "$D/separate-pre-mlp-norm.json"
    one $ES $W --out "$D/shipped-again.json"
    one python3 benchmarks/scripts/profile_step.py slice-1gpu --warmup 5 --steps 2 --shapes --out "$D/profile-shipped.json"
    tar czf "$OUT/early-expert-counts-and-pre-mlp-norm.tgz" -C "$(dirname "$D")" early-expert-counts-and-pre-mlp-norm ;;
  levers8gpu) # the GPU tests of the first micro-batch's gradient writes and of the experts' SwiGLU, then the slice's largest
    # memory-bound passes alone (benchmarks/scripts/kernels.py). Outputs: $OUT/te-swiglu-backward-and-first-microbatch-writes/{gpu-test.txt,kernels.json}
    D=$(realpath -m "$OUT/te-swiglu-backward-and-first-microbatch-writes"); mkdir -p "$D"
    one python3 -m pytest -q -p no:cacheprovider tests/gpu/test_first_write_gpu.py tests/gpu/test_dispatch_gpu.py 2>&1 \
      | tail -25 | tee "$D/gpu-test.txt"
    one python3 benchmarks/scripts/kernels.py --out "$D/kernels.json" > /dev/null ;;
  levers8) # the experts' SwiGLU as TE's kernels and the first micro-batch's gradient writes, attributed on slice-1gpu
    # (engine_steps.py, 20 steps, window 9-20, one process each): shipped; both off (the engine before them); each
    # off alone; shipped again (the drift); a candidate (the chains under Inductor's multi-kernel). Then a profile of
    # the shipped step. Outputs: $OUT/te-swiglu-backward-and-first-microbatch-writes.tgz.
    ES="python3 benchmarks/scripts/engine_steps.py slice-1gpu"; W="--steps 20 --warmup 8"
    WHOLE="engine_options.first_micro_batch_writes=false"
    D=$(realpath -m "$OUT/te-swiglu-backward-and-first-microbatch-writes"); mkdir -p "$D"
    one $MS fingerprint -o "$D/fingerprint.json"
    one $ES $W --out "$D/shipped.json"
    one $ES $WHOLE --mcore-swiglu $W --out "$D/before.json"
    one $ES --mcore-swiglu $W --out "$D/mcore-swiglu.json"
    one $ES $WHOLE $W --out "$D/whole-buffer.json"
    one $ES $W --out "$D/shipped-again.json"
    one $ES --inductor-multi-kernel $W --out "$D/candidate-multi-kernel.json"
    one python3 benchmarks/scripts/profile_step.py slice-1gpu --warmup 5 --steps 2 --shapes --out "$D/profile-shipped.json"
    tar czf "$OUT/te-swiglu-backward-and-first-microbatch-writes.tgz" -C "$(dirname "$D")" te-swiglu-backward-and-first-microbatch-writes ;;
  normbwd) # the post-expert norm's one-pass backward (norm_backward.py, off as shipped): its GPU test, the norm's
    # kernels alone (the launch grid), the fastest launch written into the engine's launch.json (normbwd_choose.py launch),
    # then slice-1gpu with it / without it (as shipped) / with it again (engine_steps.py, 20 steps, window 9-20), and
    # the verdict by levers_choose.py's rule (normbwd_choose.py keep). Outputs: $OUT/normbwd.tgz
    ES="python3 benchmarks/scripts/engine_steps.py slice-1gpu"; W="--steps 20 --warmup 8"
    D=$(realpath -m "$OUT/normbwd"); mkdir -p "$D"
    one $MS fingerprint -o "$D/fingerprint.json"
    one python3 -m pytest -q -p no:cacheprovider tests/gpu/test_norm_backward_gpu.py 2>&1 | tail -5 | tee "$D/gpu-test.txt"
    one python3 benchmarks/scripts/kernels.py --only post_expert_norm --out "$D/kernels.json" > /dev/null
    python3 benchmarks/scripts/normbwd_choose.py launch "$D/kernels.json" --write | tee "$D/launch.txt"
    one $ES --fused-norm-backward $W --out "$D/with.json"
    one $ES $W --out "$D/without.json"
    one $ES --fused-norm-backward $W --out "$D/with-again.json"
    python3 benchmarks/scripts/normbwd_choose.py keep "$D" | tee "$D/verdict.txt"
    tar czf "$OUT/normbwd.tgz" -C "$(dirname "$D")" normbwd ;;
  adam) # the Triton Adam step (adam_step.py, on as shipped): the GPU tests (its own, and the engine-side ones of the
    # first writes, the norm backward and the dispatcher), TE's FusedAdam alone stepped by TE and by the Triton step
    # over the launch grid (kernels.py --only adam), the fastest launch written into the engine's launch.json
    # (adam_choose.py launch), then slice-1gpu as shipped / with TE's step (--te-adam) / as shipped again / with the one-pass norm
    # backward too (engine_steps.py, 20 steps, window 9-20), and the verdict by levers_choose.py's rule
    # (adam_choose.py keep). Outputs: $OUT/adam.tgz
    ES="python3 benchmarks/scripts/engine_steps.py slice-1gpu"; W="--steps 20 --warmup 8"
    D=$(realpath -m "$OUT/adam"); mkdir -p "$D"
    one $MS fingerprint -o "$D/fingerprint.json"
    one python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_adam_step_gpu.py tests/gpu/test_first_write_gpu.py \
      tests/gpu/test_norm_backward_gpu.py tests/gpu/test_dispatch_gpu.py 2>&1 | grep -E "differ from TE|passed|failed|Error" \
      | tee "$D/gpu-test.txt"
    one python3 benchmarks/scripts/kernels.py --only adam --out "$D/kernels.json" > /dev/null
    python3 benchmarks/scripts/adam_choose.py launch "$D/kernels.json" --write | tee "$D/launch.txt"
    one $ES $W --out "$D/with.json"
    one $ES --te-adam $W --out "$D/without.json"
    one $ES $W --out "$D/with-again.json"
    one $ES --fused-norm-backward $W --out "$D/with-norm-backward.json"
    python3 benchmarks/scripts/adam_choose.py keep "$D" | tee "$D/verdict.txt"
    cp muse_stack/engines/mcore/adam_step.py "$D/adam_step.py"; cp muse_stack/engines/mcore/adam_step.py /tmp/adam_step.py
    tar czf "$OUT/adam.tgz" -C "$(dirname "$D")" adam ;;
  embedgrad) # the word embedding's gradient added into main_grad (embedding_grad.py): the GPU tests (its own and
    # the norm backward's), then slice-1gpu with it / with megatron-core's dense lookup (--dense-embedding-grad) /
    # with it again, each with the norm backward as the compiled chain's (--compiled-norm-backward), then with both
    # (engine_steps.py, 20 steps, window 9-20), and the verdict (embedgrad_choose.py: the embedding alone, the pair,
    # the norm backward on top; the engine option table's defaults follow it, checked by tests/lab/test_benchmarks_embedgrad.py);
    # the folder also stays in /tmp/embedgrad for a side-by-side sitting in the next call. Outputs: $OUT/embedgrad.tgz
    ES="python3 benchmarks/scripts/engine_steps.py slice-1gpu"; W="--steps 20 --warmup 8"; C=--compiled-norm-backward
    D=$(realpath -m "$OUT/embedgrad"); mkdir -p "$D"
    one $MS fingerprint -o "$D/fingerprint.json"
    one python3 -m pytest -q -p no:cacheprovider tests/gpu/test_embedding_grad_gpu.py tests/gpu/test_norm_backward_gpu.py 2>&1 \
      | tail -3 | tee "$D/gpu-test.txt"
    one $ES $C $W --out "$D/with.json"
    one $ES $C --dense-embedding-grad $W --out "$D/without.json"
    one $ES $C $W --out "$D/with-again.json"
    one $ES --fused-norm-backward $W --out "$D/both.json"
    python3 benchmarks/scripts/embedgrad_choose.py "$D" --write "$D/verdict.json" | tee "$D/verdict.txt"
    rm -rf /tmp/embedgrad && cp -r "$D" /tmp/embedgrad
    tar czf "$OUT/embedgrad.tgz" -C "$(dirname "$D")" embedgrad ;;
  profile2) # one step of the slice as shipped by class of GPU work, with operator shapes
    one python3 benchmarks/scripts/profile_step.py slice-1gpu --warmup 5 --steps 2 --shapes --out "$OUT/profile-shipped.json" ;;
  levers5) # issue 34's levers on slice-1gpu, each alone as a recipe override against the shipped recipe, one process
    # each, 20 steps, window 9-20 (engine_steps.py; each file's "levers" reads the setting back off megatron-core):
    # the weight-gradient accumulation into main_grad off (on as shipped), the clip's host path (the norm read with
    # .item(); on the GPU as shipped), megatron-core's optimizer CUDA graph, TE's fused router, the unfused token
    # permutation (fused as shipped), DDP's overlapped gradient reduce; then the shipped recipe again (the drift).
    # Outputs: $OUT/engine-options-each-alone/NAME.json, the stack's $OUT/engine-options-each-alone/fingerprint.json, all in $OUT/engine-options-each-alone.tgz.
    ES="python3 benchmarks/scripts/engine_steps.py slice-1gpu"; W="--steps 20 --warmup 8"; D="$OUT/engine-options-each-alone"
    mkdir -p "$D"
    one $MS fingerprint -o "$D/fingerprint.json"
    one $ES $W --out "$D/shipped.json"
    while read -r name override; do  # the levers, as levers_choose.py names them
      one $ES "$override" $W --out "$D/$name.json" </dev/null
    done < <(python3 benchmarks/scripts/levers_choose.py --list)
    one $ES $W --out "$D/shipped-again.json"
    python3 benchmarks/scripts/levers_choose.py "$D" --write "$D/kept.txt" | tee "$D/choice.txt"
    cp "$D/kept.txt" /tmp/levers-kept.txt  # for side-by-side/run.sh in the next call on this machine
    tar czf "$OUT/engine-options-each-alone.tgz" -C "$OUT" engine-options-each-alone ;;
  slice1) rm -rf runs/slice-1gpu1; one $MS run slice-1gpu $ASRAN --out runs/slice-1gpu1 --no-progress; keep slice-1gpu-mbs1-compiled runs/slice-1gpu1 ;;
  slice2) rm -rf runs/slice-1gpu-mbs2; one $MS run slice-1gpu $ASRAN batch.mbs=2 --out runs/slice-1gpu-mbs2 --no-progress
          keep slice-1gpu-mbs2-compiled runs/slice-1gpu-mbs2 ;;
  slicee) rm -rf runs/slice-e; one $MS run slice-1gpu $ASRAN $EAGER --out runs/slice-e --no-progress; keep slice-1gpu-mbs1-eager runs/slice-e ;;
  slicee2) rm -rf runs/slice-e2; one $MS run slice-1gpu $ASRAN batch.mbs=2 $EAGER --out runs/slice-e2 --no-progress
           keep slice-1gpu-mbs2-eager runs/slice-e2 ;;
  overhead|overheadc) # overheadc: only the compiled MBS 2 half
    [ "$what" = overhead ] && one python3 benchmarks/scripts/overhead.py slice-1gpu $ASRAN $EAGER --steps 8 --warmup 3 \
      --out "$OUT/overhead-slice-mbs1.json"
    one python3 benchmarks/scripts/overhead.py slice-1gpu $ASRAN batch.mbs=2 --steps 8 --warmup 3 --out "$OUT/overhead-slice-mbs2-compiled.json" ;;
  proxy2) rm -rf runs/proxy-2gpu; two -m muse_stack.cli run proxy-2gpu --out runs/proxy-2gpu --no-progress; keep proxy-2gpu runs/proxy-2gpu ;;
  proxy2c) # EP 2 compiled: each rank's expert token count changes every step (automatic dynamic shapes)
    rm -rf runs/proxy-2gpu-c; two -m muse_stack.cli run proxy-2gpu $FUSED --out runs/proxy-2gpu-c --no-progress
    keep proxy-2gpu-compiled runs/proxy-2gpu-c ;;
  tp2) # TP 2 with sequence parallelism and full recompute (6 steps)
    rm -rf runs/tp2; two -m muse_stack.cli run proxy-2gpu layout.ep=1 layout.tp=2 recompute.granularity=full --steps 6 \
      --out runs/tp2 --no-progress; keep tp2-recompute runs/tp2 ;;
  parity3) # packed rows, PP, CP, ETP against the reference model
    mkdir -p "$OUT/parity"
    one python3 -m lab.verify.parity --packed --train-steps 3 --out "$OUT/parity/parity-tp1-packed.json"
    two -m lab.verify.parity --pp 2 --train-steps 3 --out "$OUT/parity/parity-pp2.json"
    two -m lab.verify.parity --cp 2 --train-steps 3 --out "$OUT/parity/parity-cp2.json"
    two -m lab.verify.parity --cp 2 --packed --train-steps 3 --out "$OUT/parity/parity-cp2-packed.json"
    two -m lab.verify.parity --etp 2 --train-steps 3 --out "$OUT/parity/parity-etp2.json"
    two -m lab.verify.parity --tp 2 --packed --train-steps 3 --out "$OUT/parity/parity-tp2-packed.json" ;;
  ckptsave) # step-time cost of a dist-checkpoint save on slice-1gpu, synchronous then asynchronous, through the
    # runner's checkpoint manager (benchmarks/scripts/ckpt_save.py); the checkpoints go to CKPT_DIR (one at a time)
    df -h "${CKPT_DIR:-/tmp}" /dev/shm; free -g
    rm -rf "${CKPT_DIR:-/tmp}/ckpt-bench"
    one python3 benchmarks/scripts/ckpt_save.py slice-1gpu --dir "${CKPT_DIR:-/tmp}/ckpt-bench" --out "$OUT/ckpt-save.json" ;;
  export) # export round trip of a megatron-engine run (EP 1, PP 1): dist-checkpoint -> HF safetensors -> back
    rm -rf runs/export-src runs/export-hf
    one $MS run proxy-1gpu $SMALL --steps 4 training.measure_warmup_steps=1 --out runs/export-src --no-progress
    $MS export runs/export-src --hf runs/export-hf
    one python3 benchmarks/scripts/export_roundtrip.py runs/export-src runs/export-hf --out "$OUT/export-roundtrip.json"
    keep export-src runs/export-src ;;
  peftparity) # adapters on the megatron engine against the reference engine, TP 1 (fp32 grads, bf16 training)
    one python3 -m lab.verify.peft_parity --scheme lora --out "$OUT/peft-parity-lora.json"
    one python3 -m lab.verify.peft_parity --scheme dora --out "$OUT/peft-parity-dora.json" ;;
  peftslice) # slice-1gpu with lora-64's adapters (rank 32), against full SFT of the same slice, same process kind
    one python3 benchmarks/scripts/engine_steps.py slice-1gpu $LORA64 --steps 30 --warmup 10 --out "$OUT/slice-lora64.json"
    one python3 benchmarks/scripts/engine_steps.py slice-1gpu $ASRAN --steps 30 --warmup 10 --out "$OUT/slice-full.json" ;;
  peftrun) # muse-stack run with lora-64's adapters on the slice: train, interrupt + resume, export the adapters
    rm -rf runs/peft-full runs/peft-part runs/peft-export
    one $MS run slice-1gpu $LORA64 "frozen=[base]" training.checkpoint_interval=10 --steps 20 --out runs/peft-full --no-progress
    keep peft/full runs/peft-full
    one $MS run slice-1gpu $LORA64 "frozen=[base]" training.checkpoint_interval=10 --steps 20 --stop-after 10 \
      --out runs/peft-part --no-progress; echo "stop-after rc=$? (1: interrupted)"
    ls -la runs/peft-part/checkpoints/*/; cat runs/peft-part/checkpoints/step-00000010/adapter_base.json
    one $MS run --resume runs/peft-part --no-progress
    keep peft/part runs/peft-part
    $MS compare runs/peft-full runs/peft-part --json --no-plot > "$OUT/peft/resume-compare.json"
    $MS export runs/peft-full --hf runs/peft-export --adapters-only && ls -la runs/peft-export && \
      cp runs/peft-export/adapter_config.json "$OUT/peft/"
    $MS export runs/peft-full --hf runs/peft-merged --merge; echo "merge rc=$? (2: refused, a seeded base is not on disk)" ;;
  levers|levers2) # slice-1gpu step time under candidate settings, 30 steps each (window 11-30), one process each:
    # levers: MBS 1 / 2 / 4 (GBS 8 stays), and at MBS 4 TE's CUTLASS grouped GEMM for the experts and more CUDA
    # hardware queues for TE's multi-stream grouped GEMM; levers2: MBS 8, the allgather dispatcher at MBS 4
    # (no token exchange at EP 1, so no chunk sort), then a profile of the MBS 4 step with operator shapes
    # (the recipe's settings when these ran: MBS 1, alltoall; it now ships MBS 4 with the allgather dispatcher)
    ES="python3 benchmarks/scripts/engine_steps.py slice-1gpu layout.dispatcher=alltoall"; W="--steps 30 --warmup 10"
    if [ "$what" = levers ]; then
      one $ES batch.mbs=1 $W --out "$OUT/lever-base.json"
      one $ES batch.mbs=2 $W --out "$OUT/lever-mbs2.json"
      one $ES batch.mbs=4 $W --out "$OUT/lever-mbs4.json"
      NVTE_USE_CUTLASS_GROUPED_GEMM=1 NVTE_CUTLASS_GROUPED_GEMM_WARN_FALLBACK=1 \
        one $ES batch.mbs=4 $W --out "$OUT/lever-mbs4-cutlass.json"
      CUDA_DEVICE_MAX_CONNECTIONS=8 one $ES batch.mbs=4 $W --out "$OUT/lever-mbs4-connections8.json"
    else
      one $ES batch.mbs=8 $W --out "$OUT/lever-mbs8.json"
      one $ES batch.mbs=4 layout.dispatcher=allgather $W --out "$OUT/lever-mbs4-allgather.json"
      one python3 benchmarks/scripts/profile_step.py slice-1gpu batch.mbs=4 layout.dispatcher=alltoall --warmup 5 --steps 2 \
        --shapes --out "$OUT/profile-mbs4.json"
    fi ;;
  levers3) # slice-1gpu as shipped with the experts' SwiGLU as it ran before (weighted, given ones), then unweighted,
    # then + the precision-aware optimizer with int16 remainders, then that at MBS 8 (30 steps each, window 11-30)
    ES="python3 benchmarks/scripts/engine_steps.py slice-1gpu"; W="--steps 30 --warmup 10"
    one $ES $W --weighted-swiglu --out "$OUT/lever3-base.json"
    one $ES $W --out "$OUT/lever3-swiglu.json"
    one $ES $PA $W --out "$OUT/lever3-precision-aware.json"
    one $ES $PA batch.mbs=8 $W --out "$OUT/lever3-mbs8.json" ;;
  plansweep) # the planner's step-time refit (issue 34): slice-1gpu as shipped and each neighbour of its settings, on
    # one machine (~11 min): MBS 2 / 8 (8 with the int16 remainders, as lever3-mbs8 ran), sequence 2048 / 8192 (MBS 2 at
    # 8192), full recompute, top-k 2 / 4, the alltoall dispatcher, the plain distributed optimizer and the int16
    # remainders; 16 steps, window 7-16. More than one device call's 10 minutes: PART=1 runs the first six, PART=2 (the
    # next call on the same machine) the other five and the fingerprint; unset, all eleven in one call.
    # Outputs: $OUT/plan-sweep/runs/NAME.json (engine_steps.py) and the stack's $OUT/plan-sweep/fingerprint.json,
    # as benchmarks/results/plan-sweep/ keeps them; then (CPU) fit_time.py --sweep benchmarks/results/plan-sweep/runs.
    ES="python3 benchmarks/scripts/engine_steps.py slice-1gpu"; W="--steps 16 --warmup 6"; D="$OUT/plan-sweep/runs"
    mkdir -p "$D"; k=0
    while read -r name overrides; do
      k=$((k + 1))
      [ "${PART:-}" = 1 ] && [ $k -gt 6 ] && continue
      [ "${PART:-}" = 2 ] && [ $k -le 6 ] && continue
      # shellcheck disable=SC2086  # the overrides are words
      one $ES $overrides $W --out "$D/$name.json" </dev/null
    done <<RUNS
shipped
mbs2 batch.mbs=2
mbs8-remainders $PA batch.mbs=8
seq2048 batch.seq_length=2048
seq8192-mbs2 batch.seq_length=8192 batch.mbs=2
recompute-full recompute.granularity=full
topk2 model.overrides.num_experts_per_tok=2
topk4 model.overrides.num_experts_per_tok=4
alltoall layout.dispatcher=alltoall
plain-dist-opt optimizer.precision_aware=false optimizer.param_remainders=null
remainders $PA
RUNS
    if [ "${PART:-2}" = 2 ]; then
      one $MS fingerprint -o "$OUT/plan-sweep/fingerprint.json"
      tar czf "$OUT/plan-sweep.tgz" -C "$OUT" plan-sweep
    fi ;;
  resume1) # dist-checkpoint round trip on one GPU under the precision-aware optimizer (the checkpoint holds the
    # int16 remainders): interrupted at step 3 and resumed == uninterrupted (proxy-1gpu, 8 experts, 6 steps)
    round_trip resume1 one $MS -- proxy-1gpu $SMALL $PA ;;
  resumeadam) # the same round trip with a fp32 master (optimizer.param_remainders=false), whose FusedAdam steps
    # through the Triton Adam step (adam_step.py): interrupted at step 3 and resumed == uninterrupted
    round_trip resumeadam one $MS -- proxy-1gpu $SMALL optimizer.precision_aware=true optimizer.param_remainders=false ;;
  resumedrop) # an adapter run with dropout (peft.dropout=0.1) under deterministic kernels, interrupted at step 3
    # and resumed, against the uninterrupted run: every step's loss and gradient norm bitwise equal (the checkpoint's
    # CUDA and megatron-core tracker RNG states and data position; tests/gpu/test_resume_gpu.py runs the same)
    round_trip resumedrop one $MS -- proxy-1gpu $SMALL $DROP numerics.deterministic=true training.checkpoint_interval=null
    python3 -c 'import json, sys
r = lambda d: [(j["step"], j["loss"], j["grad_norm"]) for j in map(json.loads, open(d + "/metrics.jsonl"))]
a, b = r(sys.argv[1]), r(sys.argv[2]); print(json.dumps({"bitwise": a == b, "steps": len(a), "full": a, "resumed": b}))
sys.exit(a != b)' runs/resumedrop-full runs/resumedrop-part | tee "$OUT/resumedrop-bitwise.json"
    one python3 -m pytest -q -m gpu tests/gpu/test_resume_gpu.py ;;
  bridge) # the peer: Megatron-Bridge's own pretrain loop on the slice's shapes and settings (benchmarks/scripts/bridge_slice.py);
    # its wheelhouse (benchmarks/scripts/bridge/stage.sh download: ~46 MB) carried in a call of its own and copied to
    # /tmp, then BRIDGE_WHEELS=/tmp/bridge
    bash benchmarks/scripts/bridge/stage.sh install "${BRIDGE_WHEELS:-.whl/bridge}" && \
      PYTHONPATH=/tmp/site-bridge:$PYTHONPATH one python3 benchmarks/scripts/bridge_slice.py slice-1gpu --steps 30 --warmup 10 \
        --out "$OUT/bridge-slice.json" ;;
  detprobe) # where two deterministic runs part ways: weights, each module's forward output, each gradient
    for k in a b; do one python3 benchmarks/scripts/det_probe.py proxy-1gpu numerics.deterministic=true --out "$OUT/probe-$k.json"; done
    python3 benchmarks/scripts/det_probe.py --diff "$OUT/probe-a.json" "$OUT/probe-b.json" | tee "$OUT/probe-diff.json" ;;
  profile) # one slice-1gpu step by class of GPU work (benchmarks/scripts/profile_step.py)
    one python3 benchmarks/scripts/profile_step.py slice-1gpu $ASRAN --warmup 5 --steps 2 --out "$OUT/profile.json" \
      --trace "$OUT/profile-trace.json.gz" ;;
  strict) # parity that can fail: fp32 engine vs fp32 reference at trained weights, negative controls, bf16 floor
    one python3 -m lab.verify.parity_strict --out "$OUT/parity-strict.json" ;;
  det|det-proxy|det-slice) # numerics.deterministic: two runs each, bitwise compare, cost against the default mode
    recs=(proxy-1gpu slice-1gpu); [ "$what" = det-proxy ] && recs=(proxy-1gpu); [ "$what" = det-slice ] && recs=(slice-1gpu)
    for r in "${recs[@]}"; do
      for tag in det-a det-b default-a; do
        ov=""; [ "${tag%-?}" = det ] && ov="numerics.deterministic=true"
        rm -rf runs/$r-$tag
        one $MS run $r $ov training.final_checkpoint=false --steps 20 --out runs/$r-$tag --no-progress
        keep det/$r-$tag runs/$r-$tag
      done
      $MS compare runs/$r-det-a runs/$r-det-b --json --no-plot > "$OUT/det/$r-det-compare.json"
      $MS compare runs/$r-default-a runs/$r-det-a --json --no-plot > "$OUT/det/$r-default-vs-det.json"
    done ;;
  resume|resume-ep2|resume-pp2) # dist-checkpoint round trip: interrupted at step 3 and resumed == uninterrupted
    lays=("layout.ep=2" "layout.ep=1 layout.pp=2 layout.pp_layers=[1,3]")
    [ "$what" = resume-ep2 ] && lays=("layout.ep=2"); [ "$what" = resume-pp2 ] && lays=("${lays[1]}")
    for lay in "${lays[@]}"; do
      tag=$(echo "$lay" | grep -q pp=2 && echo pp2 || echo ep2)
      round_trip resume-$tag two -m muse_stack.cli -- proxy-2gpu $SMALL $lay
    done ;;
  resumectl) # the control for resume: a second uninterrupted run against the first (run-to-run spread)
    for tag in ep2 pp2; do
      lay="layout.ep=2"; [ $tag = pp2 ] && lay="layout.ep=1 layout.pp=2 layout.pp_layers=[1,3]"
      rm -rf runs/resume-$tag-again
      two -m muse_stack.cli run proxy-2gpu $SMALL $lay --steps 6 --out runs/resume-$tag-again --no-progress
      $MS compare runs/resume-$tag-full runs/resume-$tag-again --json --no-plot > "$OUT/resume-$tag-control.json"
      keep resume-$tag-again runs/resume-$tag-again
    done ;;
  pp2) rm -rf runs/pp2; two -m muse_stack.cli run proxy-2gpu layout.ep=1 layout.pp=2 'layout.pp_layers=[1,3]' \
          --out runs/pp2 --no-progress; keep pp2 runs/pp2 ;;
  cp2) rm -rf runs/cp2; two -m muse_stack.cli run proxy-2gpu layout.ep=1 layout.cp=2 layout.cp_comm_type=a2a \
         --out runs/cp2 --no-progress; keep cp2 runs/cp2 ;;
  etp2) rm -rf runs/etp2; two -m muse_stack.cli run proxy-2gpu layout.ep=1 layout.etp=2 --out runs/etp2 --no-progress
        keep etp2 runs/etp2 ;;
  packed) rm -rf runs/packed1; one $MS run proxy-1gpu $PACKED --out runs/packed1 --no-progress; keep packed-1gpu runs/packed1 ;;
  packedcp) rm -rf runs/packedcp; two -m muse_stack.cli run proxy-2gpu $PACKED layout.ep=1 layout.cp=2 \
              layout.cp_comm_type=a2a --out runs/packedcp --no-progress; keep packed-cp2 runs/packedcp ;;
  recompute) # peak memory under each recompute setting (proxy-1gpu, 6 steps), two at a time, one per GPU
    rc() { rm -rf "runs/rc-$1"; CUDA_VISIBLE_DEVICES=$2 MASTER_PORT=$((29517 + $2)) $MS run proxy-1gpu "${@:3}" --steps 6 --out "runs/rc-$1" \
             --no-progress > "$OUT/rc-$1.log" 2>&1; keep "recompute/$1" "runs/rc-$1"; }
    rc none 0 & rc full 1 "recompute.granularity=full" & wait
    rc core-attn 0 "recompute.granularity=selective" "recompute.modules=[core_attn]" &
    rc moe-act 1 "recompute.granularity=selective" "recompute.modules=[moe_act]" & wait
    rc moe 0 "recompute.granularity=selective" "recompute.modules=[moe]" &
    rc moe-act-core 1 "recompute.granularity=selective" "recompute.modules=[core_attn,moe_act]" & wait ;;
  *) echo "unknown step $what" ;;
  esac
done

"""Same weights, same tokens: the megatron-core engine against the reference model.

``python -m lab.verify.parity [--tp N --ep N --etp N --pp N --cp N] [--packed] [--towers]
[--train-steps K] [--out FILE]`` (under torchrun for more than one GPU). The reference model is
initialised on the CPU from the seed (as the reference engine does), its HF-named state dict
is loaded into the megatron-core model through the weight mapping, and both compute the mean
token loss of the same batch: the reference in fp32 and in bf16 autocast, the engine in bf16
with fp32 norms, residual stream and softcap. With TP = 1 the logits are compared too
(relative RMS against fp32). ``--packed`` makes the batch one row of three sequences (THD in
the engine, segment masks in the reference). With ``--train-steps K`` both engines then train
K optimizer steps on the same batch with the recipe's AdamW, LR schedule and clipping (the
reference on each rank's GPU alone, over the same global batch), and the per-step losses are
compared. With PP or CP > 1 the loss of the first training step is the forward comparison
(the stages' forward only runs inside the pipeline schedule; CP ranks hold parts of the row).

``--towers`` gives both models transformers' perception towers at toy size (``TINY_TOWERS``:
tiny-cpu-mm's vision tower, an audio tower projecting to the decoder's width) and puts an
image and an audio clip in the row (``MEDIA``): the engine's first stage runs the towers and
places their feature rows by ``media_index``, the reference scatters them as transformers does;
the media placeholders carry no loss. The vision tower's features are compared on their own too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from muse_stack.engines.base import TrainContext
from muse_stack.resolve.recipe import finalize
from muse_stack.recipes.catalogue import load_recipe, parse_recipe

#: a small model with every feature: 2 sliding + 2 full... layers S F S S, a window shorter
#: than the sequence, GQA, latent MoE with top-4 of 16 experts
TINY = dict(vocab_size=4096, first_padding_token_id=None, hidden_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, moe_hidden_size=256,
            num_local_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, sliding_window=128,
            bos_token_id=1, eos_token_id=[2], pad_token_id=0)
SEQ = 512
#: toy towers whose outputs fit TINY's width: tiny-cpu-mm's vision tower and projector, its audio
#: tower projecting to 512
TINY_TOWERS = dict(
    vision_config=dict(patch_size=14, pos_emb_height=8, pos_emb_width=8, num_attention_heads=2, num_hidden_layers=2,
                       hidden_size=32, intermediate_size=64, patch_temporal=2, merge_size=2, rope_theta=10000.0),
    audio_config=dict(patch_sizes=[4, 4], hidden_sizes=[16, 32], depths=[1, 1], num_hidden_layers=2,
                      out_hidden_size=512),
    out_hidden_size=128, projector_hidden_size=64, image_token_id=4093, video_token_id=4094, audio_token_id=4095)
#: where the media sit in the row: an image of 8 x 12 patches (24 merged tokens) from token 16 and
#: an audio clip of 3 tokens from token 300
MEDIA = dict(image_grid=(1, 8, 12), image_at=16, audio_tokens=3, audio_at=300)
#: the packed row: three sequences, each a multiple of 2 x CP for CP <= 2 (THD zigzag chunks)
PACKED_LENGTHS = (200, 180, 132)


class _OneBatch:
    """Data whose stream hands out one batch for ever (a run's data stream, with a position that never moves)."""

    def __init__(self, batch: dict[str, Any]) -> None:
        self.batch = batch

    def batches(self, mbs, seed=None, rank=0, world_size=1, epochs=None) -> "_OneBatch":
        return self

    def __iter__(self) -> "_OneBatch":
        return self

    def __next__(self) -> dict[str, Any]:
        return self.batch

    def position(self) -> dict[str, Any]:
        return {"epoch": 0, "row": 0, "seed": None, "rows": 1}

    def seek(self, position: dict[str, Any]) -> None:
        """Every position is the same one."""


def tiny_recipe(tp: int = 1, ep: int = 1, world: int = 1, *, etp: int = 1, pp: int = 1, cp: int = 1,
                packed: bool = False, towers: bool = False):
    doc = load_recipe("proxy-1gpu").model_dump(mode="json")
    doc["model"]["overrides"] = dict(TINY)
    doc["model"]["towers"] = dict(TINY_TOWERS) if towers else None
    doc["hardware"]["count"] = world
    doc["layout"].update(tp=tp, ep=ep, etp=etp, pp=pp, cp=cp, pp_layers=[1, 3] if pp == 2 else None)
    doc["batch"].update(mbs=1, gbs=world // (tp * pp * cp), seq_length=SEQ, packed=packed or None,
                        pack_alignment=2 * cp if packed and cp > 1 else None)
    return parse_recipe(doc, "parity-tiny")


def make_batch(vocab: int, seq: int, seed: int = 7, packed: bool = False) -> dict[str, Any]:
    """One row of ``seq`` tokens: a single sequence, or the ``PACKED_LENGTHS`` sequences."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, seq), generator=gen)
    lengths = PACKED_LENGTHS if packed else (seq,)
    assert sum(lengths) == seq
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    position = torch.cat([torch.arange(n) for n in lengths])[None]
    mask = torch.ones(1, seq, dtype=torch.float32)
    mask[0, cu[1:] - 1] = 0  # the last token of each sequence predicts nothing
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[mask == 0] = -100
    return {"input_ids": ids, "labels": labels, "loss_mask": mask, "position_ids": position, "segment_ids": segment,
            "cu_seqlens": cu, "cu_seqlens_padded": cu.clone(), "max_seqlen": max(lengths)}


def add_media(batch: dict[str, Any], towers, seed: int = 11) -> dict[str, Any]:
    """``batch`` with an image and an audio clip (``MEDIA``): their placeholders written into the
    row, random pixels and samples, and no loss on any placeholder or on the token before one."""
    gen = torch.Generator().manual_seed(seed)
    t, h, w = MEDIA["image_grid"]
    image_tokens = t * h * w // towers.vision_config.merge_size ** 2
    step = towers.audio_config.samples_per_token
    out = dict(batch)
    ids = batch["input_ids"].clone()
    ids[0, MEDIA["image_at"]:MEDIA["image_at"] + image_tokens] = towers.image_token_id
    ids[0, MEDIA["audio_at"]:MEDIA["audio_at"] + MEDIA["audio_tokens"]] = towers.audio_token_id
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[batch["labels"] == -100] = -100
    media_ids = torch.tensor([towers.image_token_id, towers.audio_token_id])
    labels[torch.isin(labels, media_ids)] = -100  # a placeholder is never a target
    labels[torch.isin(ids, media_ids)] = -100
    out.update(input_ids=ids, labels=labels, loss_mask=(labels != -100).to(torch.float32),
               pixel_values=torch.randn(t * h * w, towers.vision_config.patch_dim, generator=gen),
               image_grid_thw=torch.tensor([[t, h, w]]),
               input_values=torch.randn(1, MEDIA["audio_tokens"] * step, generator=gen))
    return out


#: the expert-bias ladder that pins routing (``pin_routing``): expert e's selection bias is ``PIN_STEP * e``. Sigmoid
#: scores lie in (0, 1), so a step above 1 makes the top-k the k highest-biased experts for every token whatever its
#: scores; the routing weights still come from the unbiased scores, as always
PIN_STEP = 4.0
#: defects for the negative control (``defect``): applied to the engine's weights after loading, never to the reference
DEFECTS = {"vision-projection-x1.5": ("vision_projection.weight", 1.5)}


def run(tp: int = 1, ep: int = 1, seed: int = 1234, train_steps: int = 0, *, etp: int = 1, pp: int = 1, cp: int = 1,
        packed: bool = False, towers: bool = False, pin_routing: bool = False,
        defect: str | None = None) -> dict[str, Any]:
    """The engine against the reference on one batch. ``pin_routing`` fixes every layer's top-k by a bias ladder
    (``PIN_STEP``) in both models, so that bf16 rounding cannot flip an expert choice: at initialisation the scores
    are near-ties and each flip changes a token's MoE output, which later layers amplify (lab.verify.towers_bound measures it). ``defect`` (a ``DEFECTS`` key)
    damages the engine's loaded weights: the negative control of the bounds."""
    from muse_stack.engines.megatron_available import require_megatron

    require_megatron()  # Transformer Engine loads its cuDNN before torch touches any
    from lab.engine import LoadedEngine, eval_logits, eval_loss
    from muse_stack.models.muse_spark import MuseSparkForCausalLM

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    recipe = tiny_recipe(tp, ep, world, etp=etp, pp=pp, cp=cp, packed=packed, towers=towers)
    cfg = recipe.model_config_resolved()
    tower_cfg = recipe.towers_config_resolved()
    batch = make_batch(cfg.vocab_size - 8, SEQ, packed=packed)  # ids below the media placeholders
    if towers:
        batch = add_media(batch, tower_cfg)
    if (pp > 1 or cp > 1) and train_steps < 1:
        raise SystemExit("with PP or CP > 1 the comparison is the first training step: pass --train-steps K >= 1")
    reference = MuseSparkForCausalLM(cfg, seed=seed, towers=tower_cfg)
    if pin_routing:
        pin_expert_choice(reference)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    reference = reference.to(device)
    on = {k: v.to(device) for k, v in batch.items() if torch.is_tensor(v)}
    args = reference_args(on)
    from muse_stack.models.muse_spark.perception import image_features

    with torch.no_grad():
        ref32 = reference(on["input_ids"], **args)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref16 = reference(on["input_ids"], **args)
        ref_image = image_features(reference.model, on["pixel_values"], on["image_grid_thw"]) if towers else None
    del reference
    ctx = TrainContext(recipe=recipe, model=cfg, rank=rank, world_size=world, local_rank=local,
                       resolved=finalize(recipe, gpus=world))
    engine = LoadedEngine(ctx, state)
    if defect is not None:
        suffix, factor = DEFECTS[defect]
        hit = [p for n, p in engine.model.module.named_parameters() if n.endswith(suffix)]
        if len(hit) != 1:
            raise SystemExit(f"defect {defect}: {len(hit)} engine parameters end with {suffix}")
        with torch.no_grad():
            hit[0].mul_(factor)
    forward_only = pp == 1 and cp == 1
    loss, n = eval_loss(engine, batch) if forward_only else (float("nan"), int(batch["loss_mask"].sum()))
    ref_fp32, ref_bf16 = float(ref32.loss), float(ref16.loss)
    logits = {}
    if tp == 1 and forward_only:
        mine = eval_logits(engine, batch)

        def rel(a, b):
            return float((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt())

        logits = {"logits_rel_rms_megatron_vs_fp32": rel(mine, ref32.logits),
                  "logits_rel_rms_reference_bf16_vs_fp32": rel(ref16.logits, ref32.logits)}
    if towers and forward_only:  # the engine's own towers (bf16 weights) on the same pixels
        host = engine.model.module.perception
        with torch.no_grad():
            mine_image = image_features(host, on["pixel_values"], on["image_grid_thw"])
        rel_image = float((mine_image.float() - ref_image.float()).pow(2).mean().sqrt()
                          / ref_image.float().pow(2).mean().sqrt())
        logits["image_features_rel_rms_megatron_vs_fp32"] = rel_image
        logits["tower_parameters"] = sum(p.numel() for p in host.parameters())
    out = {"tp": tp, "ep": ep, "etp": etp, "pp": pp, "cp": cp, "packed": packed, "towers": TINY_TOWERS if towers else None,
           "pin_routing": PIN_STEP if pin_routing else None, "defect": defect,
           "media": MEDIA if towers else None,
           "packed_lengths": list(PACKED_LENGTHS) if packed else None, "world_size": world, "rank": rank,
           "tokens": n, "model": TINY, "seq_length": SEQ, "reference_fp32_loss": ref_fp32,
           "reference_bf16_loss": ref_bf16, "rel_diff_reference_bf16_vs_fp32": abs(ref_bf16 - ref_fp32) / ref_fp32,
           **logits}
    if train_steps:
        out.update(_train(engine, recipe, cfg, batch, train_steps, local, pin_routing))
    if not forward_only:  # the first step's loss is the forward pass of the loaded weights
        loss = out["megatron_step_losses"][0]
        out["megatron_loss_from"] = "first training step (pipeline schedule)"
    out["megatron_loss"] = loss
    out["rel_diff_vs_fp32"] = abs(loss - ref_fp32) / ref_fp32
    return out


def seeded_start(recipe, seq: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """On GPU 0 (megatron-core and TE loaded first): the reference model's weights from ``seed`` for the recipe's model,
    and one row of ``seq`` tokens below the media placeholders (``make_batch``)."""
    from muse_stack.engines.megatron_available import require_megatron

    require_megatron()
    from muse_stack.models.muse_spark import MuseSparkForCausalLM

    torch.cuda.set_device(0)
    cfg = recipe.model_config_resolved()
    state = {k: v.clone() for k, v in MuseSparkForCausalLM(cfg, seed=seed).state_dict().items()}
    return state, make_batch(cfg.vocab_size - 8, seq)


def steps_main(run, argv: list[str] | None) -> int:
    """``--steps K [--out FILE]``: ``run(K)``'s result as JSON on stdout and in FILE."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    text = json.dumps(run(args.steps), indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)
    return 0


def engine_forward_backward(engine, batch: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """The engine's logits and mean token loss on one batch (TP 1, PP 1), then one backward
    with fresh gradient buffers: every trainable parameter's ``main_grad`` holds its gradient."""
    from lab.engine import eval_logits

    logits = eval_logits(engine, batch)
    prepared = engine._prepare(batch)
    engine.model.zero_grad_buffer()
    out = engine.model(prepared["input_ids"], labels=prepared["labels"], loss_mask=prepared["loss_mask"])
    from muse_stack.engines.megatron import supervised_mask

    loss = out.sum() / supervised_mask(prepared).sum()
    loss.backward()
    return logits, float(loss)


def reference_args(batch: dict[str, Any]) -> dict[str, Any]:
    """The reference model's keyword inputs for ``batch`` (positions, segments, labels, loss mask, media)."""
    from muse_stack.models.muse_spark.perception import MEDIA_INPUTS

    return dict(position_ids=batch["position_ids"], segment_ids=batch["segment_ids"], labels=batch["labels"],
                loss_mask=batch["loss_mask"], **{k: batch[k] for k in MEDIA_INPUTS if k in batch})


def pin_expert_choice(model: torch.nn.Module) -> None:
    """Every layer's expert bias set to the ladder ``PIN_STEP * e`` (``pin_routing``)."""
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(PIN_STEP * torch.arange(buf.numel(), dtype=buf.dtype, device=buf.device))


def _train(engine, recipe, cfg, batch, steps: int, local: int, pin_routing: bool = False) -> dict[str, Any]:
    """``steps`` optimizer steps of the engine, of the reference in bf16 autocast and of the reference in fp32, in
    lockstep on the same batch. After each step the three models' logits on the batch (the next step's forward) are
    compared as the loaded weights' are (the engine's and the bf16 reference's relative RMS from the fp32
    reference's), and after the first the parameters' updates (``update_comparison``)."""
    from lab.engine import eval_logits
    from muse_stack.engines.reference import ReferenceEngine
    from muse_stack.run.steps import TrainSteps

    def reference(precision: str):
        rec = recipe.model_copy(update={"precision": precision})
        ctx = TrainContext(recipe=rec, model=cfg, rank=0, world_size=1, local_rank=local,
                           resolved=finalize(rec, gpus=1))
        ref_engine = ReferenceEngine(ctx)
        if pin_routing:
            pin_expert_choice(ref_engine.model)
        return ref_engine, TrainSteps(ref_engine, rec, _OneBatch(batch), steps)

    driven = TrainSteps(engine, recipe, _OneBatch(batch), steps)
    # the reference alone on this GPU: GBS / MBS micro-batches of the same row, as the engine's DP ranks
    ref16_engine, ref16 = reference(recipe.precision)
    ref32_engine, ref32 = reference("fp32")
    for ref_engine in (ref16_engine, ref32_engine):
        start_as_engine(engine, ref_engine.model)
    device = torch.device("cuda", local)
    on = {k: v.to(device) for k, v in batch.items() if torch.is_tensor(v)}
    args = reference_args(on)
    mine, theirs, fp32, after = [], [], [], []
    before = (engine_parameters(engine), reference_parameters(ref16_engine.model),
              reference_parameters(ref32_engine.model))
    first_update: list[dict[str, Any]] = []
    for s in range(1, steps + 1):
        mine.append(driven.step(s))
        theirs.append(ref16.step(s))
        fp32.append(ref32.step(s))
        if s == 1:
            first_update = update_comparison(before, (engine_parameters(engine), reference_parameters(
                ref16_engine.model), reference_parameters(ref32_engine.model)))
            del before
        if s == steps or engine.ctx.world_size > 1:
            continue  # the logits of the weights a later step's forward reads (one rank: TP, PP and CP 1)
        with torch.no_grad():
            z32 = ref32_engine.model(on["input_ids"], **args).logits.float()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                z16 = ref16_engine.model(on["input_ids"], **args).logits.float()
            zme = eval_logits(engine, batch)
        after.append({"after_step": s, **logits_deviation(zme, z16, z32, on["labels"])})
    return {"train_steps": steps,
            "megatron_step_losses": [m.loss for m in mine], "reference_step_losses": [r.loss for r in theirs],
            "reference_fp32_step_losses": [r.loss for r in fp32],
            "megatron_grad_norms": [m.grad_norm for m in mine], "reference_grad_norms": [r.grad_norm for r in theirs],
            "reference_fp32_grad_norms": [r.grad_norm for r in fp32],
            "logits_after_steps": after, "first_update_by_parameter": first_update,
            "max_step_loss_rel_diff": max(abs(m.loss - r.loss) / r.loss for m, r in zip(mine, theirs))}


def engine_parameters_named(engine):
    """Each of the engine's parameters as ``(engine name, its target in the reference's names or None where no
    mapping covers it, the parameter)``."""
    from muse_stack.engines.mcore.weights import local_to_global, mcore_to_hf

    off = engine.load_kwargs
    for name, p in engine.model.module.named_parameters():
        try:
            target = mcore_to_hf(local_to_global(name, off["layer_offset"], off["expert_offset"]))
        except KeyError:
            target = None
        yield name, target, p


def engine_dtypes(engine) -> dict[str, torch.dtype]:
    """The dtype the engine holds each parameter in, under the reference's names (every rank holds each name in
    one dtype: its experts alike)."""
    out: dict[str, torch.dtype] = {}
    for _, target, p in engine_parameters_named(engine):
        if target is not None and out.setdefault(target.hf_name, p.dtype) != p.dtype:
            raise SystemExit(f"the engine holds {target.hf_name} in {out[target.hf_name]} and {p.dtype}")
    return out


def start_as_engine(engine, model: torch.nn.Module) -> None:
    """The reference ``model``'s parameters set where the engine's optimizer starts: each rounded to the dtype the
    engine holds it in (round to nearest even, as the engine's load casts them). megatron-core builds its fp32 main
    parameters from the bf16 parameters (distrib_optimizer.py:445 at 0.19.2; TE's FusedAdam master weights alike),
    so the engine's masters start on the bf16 grid, where the reference's fp32 initialisation is not: at the first
    step, whose Adam update (about the learning rate a weight) is below half a bf16 ulp for most weights of norm
    2^-6 and above, an on-grid master rounds the update away and an off-grid one does not. Both start here, so
    the training steps compare the engines and not two starting points. On one rank the engine's own values are
    checked to be these, bit for bit."""
    dtypes = engine_dtypes(engine)
    params = dict(model.named_parameters())
    missing = sorted(set(dtypes) - set(params))
    if missing:
        raise SystemExit(f"engine parameters with no reference parameter: {missing[:5]}")
    with torch.no_grad():
        for name, dtype in dtypes.items():
            p = params[name]
            p.copy_(p.to(dtype).to(p.dtype))
    if engine.ctx.world_size > 1:
        return
    held, _ = engine_by_reference_name(engine, lambda q: q.detach().float(), {n: tuple(params[n].shape) for n in dtypes})
    off = [n for n, v in held.items()  # a name the engine holds whole (its shape the reference's)
           if v.shape == params[n].shape and not torch.equal(v.to(params[n].device), params[n].detach().float())]
    if off:
        raise SystemExit(f"the engine's loaded parameters are not the reference's rounded to the engine's dtype: {off[:5]}")


def engine_by_reference_name(engine, value_of, shapes: dict[str, tuple] | None = None):
    """``value_of(p)`` for each of the engine's parameters, under the reference's names and in its shapes: each
    expert's tensor set into the stacked one (an expert this rank lacks stays NaN; ``shapes`` gives the stacked
    shape, else the highest expert index seen). Returns the dict and the engine names no mapping covers."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    unmapped: list[str] = []
    for name, target, p in engine_parameters_named(engine):
        if target is None:
            unmapped.append(name)
            continue
        if target.expert is None:
            out[target.hf_name] = value_of(p)
        else:
            experts.setdefault(target.hf_name, {})[target.expert] = value_of(p)
    for hf_name, by_expert in experts.items():
        first = next(iter(by_expert.values()))
        shape = shapes[hf_name] if shapes is not None else (max(by_expert) + 1, *first.shape)
        full = torch.full(shape, float("nan"), device=first.device)
        for expert, value in by_expert.items():
            full[expert] = value
        out[hf_name] = full
    return out, unmapped


def engine_parameters(engine) -> dict[str, torch.Tensor]:
    """The engine's parameters as its forward reads them (megatron-core's model parameters, bf16 under bf16), in
    the reference's names and shapes, as fp32 copies on their device."""
    return engine_by_reference_name(engine, lambda p: p.detach().float().clone())[0]


def reference_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def update_comparison(before: tuple[dict, dict, dict], after: tuple[dict, dict, dict]) -> list[dict[str, Any]]:
    """Per parameter, the first optimizer step's update of the engine and of the bf16 reference against the fp32
    reference's: the norms and the relative RMS of the difference (largest engine difference first). Where the
    engine's first step differs from the reference's by more than rounding, this names the parameters."""
    rows = []
    for name in sorted(set(after[0]) & set(after[1]) & set(after[2])):
        me, r16, r32 = (a[name] - b[name] for a, b in zip(after, before))
        if me.shape != r32.shape:
            continue
        norm32 = float(r32.norm())
        rows.append({"name": name, "engine_update_norm": float(me.norm()), "reference_bf16_update_norm":
                     float(r16.to(me.device).norm()), "reference_fp32_update_norm": norm32,
                     "engine_vs_fp32": float((me - r32.to(me.device)).norm()) / norm32 if norm32 else None,
                     "reference_bf16_vs_fp32": float((r16 - r32).norm()) / norm32 if norm32 else None})
    return sorted(rows, key=lambda r: -(r["engine_vs_fp32"] or 0.0))


def logits_deviation(mine: torch.Tensor, bf16: torch.Tensor, fp32: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """The engine's and the bf16 reference's logits against the fp32 reference's, relative RMS over the loss tokens."""
    keep = labels.reshape(-1) != -100
    v = fp32.shape[-1]
    z32, z16, zme = (t.reshape(-1, v)[keep].double() for t in (fp32, bf16, mine))
    scale = float(z32.pow(2).mean().sqrt())
    return {"logits_rel_rms_megatron_vs_fp32": float((zme - z32).pow(2).mean().sqrt()) / scale,
            "logits_rel_rms_reference_bf16_vs_fp32": float((z16 - z32).pow(2).mean().sqrt()) / scale}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--packed", action="store_true")
    ap.add_argument("--towers", action="store_true", help="both models with toy perception towers; an image and "
                                                           "an audio clip in the row")
    ap.add_argument("--pin-routing", action="store_true", help="every layer's top-k fixed by an expert-bias ladder")
    ap.add_argument("--defect", choices=sorted(DEFECTS), default=None, help="damage the engine's weights (a negative control)")
    ap.add_argument("--train-steps", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = run(args.tp, args.ep, train_steps=args.train_steps, etp=args.etp, pp=args.pp, cp=args.cp,
                 packed=args.packed, towers=args.towers, pin_routing=args.pin_routing, defect=args.defect)
    print(json.dumps(result), flush=True)
    if args.out and result["rank"] == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

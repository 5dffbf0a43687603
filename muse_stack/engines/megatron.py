"""The megatron-core + Transformer Engine engine behind ``muse-stack run`` (recipes with
``engine: megatron``).

One process per GPU (torchrun). The layout of the recipe maps onto megatron-core's
parallel state: TP (with sequence parallelism), PP (uneven first/last stages), CP (a2a by
default), EP / ETP with the alltoall dispatcher, DP with megatron-core's DDP and distributed
optimizer. Each optimizer step runs megatron-core's pipeline schedule
(``get_forward_backward_func``) over the micro-batches the run gives this data-parallel rank
(GBS / (MBS x DP), :mod:`muse_stack.run.steps`), with the loss summed per
token and divided by the global supervised-token count (``calculate_per_token_loss``; the division
is applied to the loss before the backward rather than to every gradient after it), so the loss
and gradients are those of the reference engine. The run sets the LR of every step
(:meth:`MegatronEngine.set_lr`). Checkpoints are megatron-core dist-checkpoints; with
``recipe.peft`` they hold the adapter tensors and their optimizer state only, plus the base's
identity (:mod:`muse_stack.engines.mcore.peft_checkpoint`).
"""

from __future__ import annotations

import os
import socket
from functools import partial
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as tdist

from muse_stack.engines.base import StepStats, TrainContext
from muse_stack.engines.megatron_available import require_megatron
from muse_stack.util.errors import RecipeError

GIB = 2**30


def rendezvous(world_size: int) -> dict[str, str]:
    """``init_process_group``'s ``init_method`` for this process. Under torchrun (or with ``MASTER_PORT`` set)
    the environment's address and port. A single process without them (``muse-stack run`` on one GPU) takes a
    free port of its own and leaves the environment alone, so single-GPU runs side by side on one host, or a
    process that starts another, never meet on one port."""
    if world_size == 1 and "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return {"init_method": f"tcp://127.0.0.1:{s.getsockname()[1]}"}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    return {"init_method": "env://"}


def _init_process_group(ctx: TrainContext) -> None:
    if tdist.is_initialized():
        return
    tdist.init_process_group("nccl", rank=ctx.rank, world_size=ctx.world_size,
                             device_id=torch.device("cuda", ctx.local_rank), **rendezvous(ctx.world_size))


class MegatronEngine:
    name = "megatron"

    def __init__(self, ctx: TrainContext) -> None:
        """Set up in the order megatron-core needs: the process groups and seeds, the model of
        this rank (its weights, adapters and frozen towers), then DDP and the optimizer over what
        trains, then its data-parallel rank and size."""
        from muse_stack.recipes import options
        from muse_stack.util import numerics

        numerics.apply(ctx.recipe)  # deterministic mode: before any kernel runs (idempotent)
        require_megatron()
        self.ctx = ctx
        #: the recipe's engine options as resolved (muse_stack/recipes/options.py), and why each is off (None: on)
        self.options = options.resolve(ctx.recipe)
        self.options_off: dict[str, str | None] = {key: r.why_off(key) for key, r in self.options.items()}
        #: the step's first micro-batch writes (engine_options.first_micro_batch_writes; None: the whole buffer
        #: zeroed), as its install leaves it
        self.first_writes = None
        seed = ctx.recipe.training.seed if ctx.recipe.training.seed is not None else 0
        self._init_parallel(seed)
        model = self._build_model(seed)
        self._attach_adapters(model, seed)
        self._freeze_towers(model)
        self._build_optimizer(model)
        self._init_data()

    def _init_parallel(self, seed: int) -> None:
        """The device, the process group, megatron-core's parallel state for the recipe's layout,
        the seeds, the transformer config and the process groups the model is built with."""
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from muse_stack.engines.mcore.config import transformer_config, virtual_stages

        ctx = self.ctx
        recipe, lay, batch = ctx.recipe, ctx.recipe.layout, ctx.recipe.batch
        torch.cuda.set_device(ctx.local_rank)
        self.device = f"cuda:{ctx.local_rank}"
        _init_process_group(ctx)
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
                virtual_pipeline_model_parallel_size=virtual_stages(recipe), context_parallel_size=lay.cp or 1,
                expert_model_parallel_size=lay.ep or 1, expert_tensor_parallel_size=lay.etp)
        model_parallel_cuda_manual_seed(seed)
        # the CPU generator too: megatron-core draws the router weights on the CPU, and whatever a
        # process did with that generator before (imports, data setup) must not move them. Offset
        # per pipeline stage as megatron's own training loop seeds (seed + 100 x PP rank).
        torch.default_generator.manual_seed(seed + 100 * ps.get_pipeline_model_parallel_rank())  # CPU only
        #: TE's GEMMs rerouted to exact float32 under precision: fp32 (TE computes fp32 in TF32)
        self.fp32_gemms: list[str] = []
        if recipe.precision == "fp32":
            from muse_stack.engines.mcore import fp32_gemm

            self.fp32_gemms = fp32_gemm.install()
        self.config = transformer_config(recipe, ctx.model)
        self.pg = ProcessGroupCollection.use_mpu_process_groups()
        self.seq_length = batch.seq_length

    def _build_model(self, seed: int):
        """This rank's stage of the model on the device (with the perception towers on the first
        stage of an image-text recipe), its weights from the pretrained checkpoint, each rank
        reading only its part; else as initialised from the seed."""
        from megatron.core import parallel_state as ps

        from muse_stack.engines.mcore.load import checkpoint_getter, load_hf_weights
        from muse_stack.engines.mcore.model import build_model

        ctx, recipe = self.ctx, self.ctx.recipe
        #: the perception towers of an image-text recipe (None: a text model)
        self.towers = ctx.resolved.towers
        model = build_model(self.config, ctx.model, self.seq_length, self.pg, towers=self.towers, seed=seed,
                            recompute_towers=recipe.recompute_towers()).cuda()
        self._install_options("model", model)
        ep_rank, ep = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
        self.load_kwargs = dict(layer_offset=model.decoder.layer_offset,
                                expert_offset=ep_rank * (ctx.model.num_local_experts // ep),
                                tp_rank=ps.get_tensor_model_parallel_rank(),
                                tp_size=ps.get_tensor_model_parallel_world_size(),
                                etp_rank=ps.get_expert_tensor_parallel_rank(),
                                etp_size=ps.get_expert_tensor_parallel_world_size())
        if ctx.pretrained_checkpoint:
            load_hf_weights(model, checkpoint_getter(ctx.pretrained_checkpoint), **self.load_kwargs)
        return model

    def _attach_adapters(self, model, seed: int) -> None:
        """With ``recipe.peft``: the adapters on the frozen base, before DDP, so only they reach the
        optimizer; their values are the reference model's initial ones, and the base's identity is
        kept for the checkpoints. Without it: nothing."""
        self.peft = None
        ctx, recipe = self.ctx, self.ctx.recipe
        if recipe.peft is None:
            return
        from megatron.core import parallel_state as ps

        from muse_stack.engines.mcore import peft as mpeft
        from muse_stack.engines.mcore.peft_checkpoint import base_identity
        from muse_stack.models.muse_spark.hf_config import full_config

        lay = recipe.layout
        self.peft = ctx.resolved.peft
        self.adapter_names = mpeft.attach_adapters(
            model, self.peft, ctx.model, tp_size=ps.get_tensor_model_parallel_world_size(),
            tp_group=ps.get_tensor_model_parallel_group(), sequence_parallel=self.config.sequence_parallel,
            ep_size=ps.get_expert_model_parallel_world_size(), etp_size=ps.get_expert_tensor_parallel_world_size())
        first = model.decoder.layer_offset
        source = mpeft.initial_adapters(self.peft, ctx.model, seed, range(first, first + len(model.decoder.layers)))
        mpeft.load_reference_adapters(model, source, layer_offset=first,
                                      expert_offset=self.load_kwargs["expert_offset"],
                                      tp_rank=self.load_kwargs["tp_rank"], tp_size=self.load_kwargs["tp_size"],
                                      magnitudes_required=False)
        if self.peft.scheme == "dora" and not any(k.endswith("lora_magnitude") for k in source):
            mpeft.init_magnitudes(model)
        self.base = base_identity(pretrained_checkpoint=ctx.pretrained_checkpoint, revision=recipe.model.revision,
                                  hf_id=recipe.model.hf_id, hf_config=full_config(ctx.model), init_seed=seed,
                                  layout={"tp": lay.tp, "pp": lay.pp, "ep": lay.ep or 1, "etp": lay.etp})

    def _build_optimizer(self, model) -> None:
        """megatron-core's DDP around the stage and its optimizer over what trains, with the
        recipe's settings (none filled in here), and the hooks of the pipeline schedule."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from muse_stack.engines.mcore.config import ddp_config_kwargs, optimizer_config_kwargs
        from muse_stack.engines.support import require_stated

        recipe = self.ctx.recipe
        require_stated(recipe)  # the values below are the recipe's; none is filled in here
        opt_kwargs = optimizer_config_kwargs(recipe)
        dist_opt = opt_kwargs["use_distributed_optimizer"]
        ddp_config = DistributedDataParallelConfig(**ddp_config_kwargs(recipe))
        self.model = DistributedDataParallel(self.config, ddp_config, model)
        if recipe.optimizer.name == "sgd":
            raise RecipeError("the megatron engine trains with Adam(W)", field="optimizer.name",
                              value=recipe.optimizer.name, fix="use adam, or the reference engine for SGD")
        # min_lr is stated whenever the schedule decays; a constant schedule never reaches it
        self.opt_config = OptimizerConfig(**opt_kwargs, params_dtype=self.config.params_dtype)
        self.optimizer = get_megatron_optimizer(self.opt_config, [self.model])
        if dist_opt:  # fp32 gains next to bf16 weights: see optimizer_order
            from muse_stack.engines.mcore.optimizer_order import align_group_orders

            self.reordered_optimizer_params = align_group_orders(self.optimizer)
        self._install_options("optimizer", self)
        self.config.no_sync_func = self.model.no_sync
        # the loss arrives divided by the global supervised-token count (train_step): no second pass
        self.config.finalize_model_grads_func = partial(_finalize_prescaled, finalize_model_grads)
        self._loss_scale = 1.0
        self.config.grad_scale_func = self.optimizer.scale_loss

    def _install_options(self, stage: str, target: Any) -> None:
        """The engine options with an install function at ``stage`` (muse_stack/recipes/options.py), in the
        table's order, each with its value as resolved: ``model`` (``target`` this rank's model, before DDP)
        or ``optimizer`` (``target`` this engine, once DDP and the optimizer exist). ``options_off`` records
        why each is off (None: on)."""
        import importlib

        from muse_stack.recipes import options

        for row in options.installed_at(stage):
            resolved = self.options.get(row.key)
            if resolved is None:
                continue
            module, function = row.install_function.split(":")
            why = getattr(importlib.import_module(module), function)(target, resolved.value)
            self.options_off[row.key] = why if resolved.value else resolved.why_off(row.key)

    def _init_data(self) -> None:
        """This process's data-parallel rank and size (the share of each global batch the run gives
        it) and how its micro-batches run (CP split, THD)."""
        from megatron.core import parallel_state as ps

        recipe, batch = self.ctx.recipe, self.ctx.recipe.batch
        self.dp_rank = ps.get_data_parallel_rank(with_context_parallel=False)
        self.dp_size = ps.get_data_parallel_world_size(with_context_parallel=False)
        if self.dp_size != self.ctx.resolved.dp:
            raise RuntimeError(f"megatron-core's data-parallel size {self.dp_size} is not the recipe's "
                               f"{self.ctx.resolved.dp}")
        self.cp_size = ps.get_context_parallel_world_size()
        #: packed rows run as THD (one token stream per micro-batch, per-sequence attention)
        self.thd = bool(batch.packed) or recipe.data.builder == "packed"
        self._seq_lens: list[int] | None = None

    def data_parallel(self) -> tuple[int, int]:
        return self.dp_rank, self.dp_size

    def _freeze_towers(self, model) -> None:
        """The towers the recipe freezes (``frozen: [audio_tower]``) get no gradient and no
        optimizer state; under PEFT the adapters alone train (the whole base, towers included,
        is frozen already). Also the FLOPs counter of the towers' share of the MFU."""
        self._tower_flops = None
        if self.towers is None:
            return
        from muse_stack.engines.support import TOWERS
        from muse_stack.models.muse_spark.flops import TowerFlops

        host = getattr(model, "perception", None)
        if host is not None:
            for name in self.ctx.recipe.frozen:
                if name in TOWERS:
                    getattr(host, name).requires_grad_(False)
        frozen = set(self.ctx.recipe.frozen)
        base_frozen = self.peft is not None or "base" in frozen
        self._tower_flops = TowerFlops(self.towers, self.ctx.model.hidden_size,
                                       vision_trains=not base_frozen and "vision_tower" not in frozen,
                                       projector_trains=not base_frozen)

    def tower_flops_per_token(self) -> dict[str, float] | None:
        """The perception towers' model FLOPs per token over the steps this process ran (its own
        micro-batches' images; ``muse_stack.models.muse_spark.flops.TowerFlops``), or None without towers."""
        return self._tower_flops.per_token() if self._tower_flops is not None else None

    # -- data -----------------------------------------------------------------------------
    def _media(self, mb: dict[str, Any], input_ids: torch.Tensor) -> dict[str, Any]:
        """An image-text micro-batch's media inputs on the device and the index placing their
        feature rows (:func:`muse_stack.models.muse_spark.perception.media_index`), made from the whole
        token rows before any split over CP ranks; {} for a text model."""
        if self.towers is None:
            return {}
        from muse_stack.models.muse_spark.perception import MEDIA_INPUTS, feature_rows, media_index

        media = {k: mb[k].to(self.device, non_blocking=True) for k in MEDIA_INPUTS if mb.get(k) is not None}
        index = media_index(input_ids, self.towers, feature_rows(self.towers, **media))
        return {"media": media, "media_index": index}

    def _prepare(self, mb: dict[str, Any]) -> dict[str, Any]:
        rows, width = mb["input_ids"].shape
        if self.thd:
            return self._prepare_packed(mb)
        if len(mb["cu_seqlens"]) - 1 > rows:
            raise RecipeError("these rows hold several sequences each, but the recipe does not declare packing",
                              field="batch.packed", value=self.ctx.recipe.batch.packed,
                              fix="set batch.packed: true so the engine attends within each sequence (THD)")
        out = {k: mb[k].to(self.device, non_blocking=True) for k in ("input_ids", "labels", "loss_mask")}
        media = self._media(mb, out["input_ids"])
        if media:
            out["media_index"] = media["media_index"]
        if self.cp_size > 1:
            from megatron.core.utils import get_batch_on_this_cp_rank

            out = get_batch_on_this_cp_rank(out, is_hybrid_cp=False)
        if media:
            out["media"] = media["media"]
        return out

    def _prepare_packed(self, mb: dict[str, Any]) -> dict[str, Any]:
        """THD (see :mod:`.mcore.packed`); under CP each sequence is split into 2 x CP chunks,
        zigzag, by Transformer Engine's partitioning."""
        from megatron.core.packed_seq_params import PackedSeqParams

        from muse_stack.engines.mcore.packed import STREAM_KEYS, packed_stream

        stream = packed_stream(mb, self.cp_size, self.ctx.recipe.batch.pack_alignment)
        cu = stream["cu_seqlens"].to(self.device)
        out = {k: stream[k].to(self.device, non_blocking=True) for k in STREAM_KEYS}
        media = self._media(mb, out["input_ids"])  # the stream keeps the rows' order: the same index
        if media:
            out["media_index"] = media["media_index"]
        if self.cp_size > 1:
            import transformer_engine_torch as tex
            from megatron.core import parallel_state as ps

            index = tex.thd_get_partitioned_indices(cu, out["input_ids"].shape[1], self.cp_size,
                                                    ps.get_context_parallel_rank())
            out = {k: v.index_select(1, index) for k, v in out.items()}
        max_len = stream["max_seqlen"]
        if media:
            out["media"] = media["media"]
        out["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
            max_seqlen_q=max_len, max_seqlen_kv=max_len)
        return out

    def _forward_step(self, data_iterator, model):
        mb = next(data_iterator)
        output = model(mb["input_ids"], labels=mb["labels"], loss_mask=mb["loss_mask"],
                       packed_seq_params=mb.get("packed_seq_params"), media=mb.get("media"),
                       media_index=mb.get("media_index"))
        if self.first_writes is not None:  # the first micro-batch's forward is done: the later ones add
            self.first_writes.disarm()
        return output, partial(_per_token_loss, supervised_mask(mb), self._loss_scale)

    # -- one optimizer step ---------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        from muse_stack.engines.mcore.config import group_schedule

        for group in self.optimizer.param_groups:
            rate, group["weight_decay"] = group_schedule(group, lr, self.ctx.recipe.optimizer.weight_decay)
            if torch.is_tensor(group["lr"]):  # TE's capturable Adam (performance.optimizer_cuda_graph): the graph
                group["lr"].fill_(rate)  # reads this tensor; in place, as megatron-core's OptimizerParamScheduler
            else:
                group["lr"] = rate

    def train_step(self, raw: list[dict[str, Any]]) -> StepStats:
        """megatron-core's pipeline schedule over this rank's micro-batches of the step, then the
        optimizer step."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        recipe = self.ctx.recipe
        width = raw[0]["input_ids"].shape[1]
        if self._tower_flops is not None:
            self._tower_flops.add(raw)
        if self._seq_lens is None:  # the sequences' lengths, for the attention FLOPs (as the reference engine)
            cu = raw[0]["cu_seqlens"].tolist()
            self._seq_lens = [b - a for a, b in zip(cu, cu[1:])] or [width]
        micro = [self._prepare(mb) for mb in raw]
        self._loss_scale = self._inverse_supervised_tokens(micro)
        if self.first_writes is not None:
            self.first_writes.zero_grad_buffer()  # all but what the first micro-batch writes
        else:
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        # THD micro-batches cross pipeline stages as [MBS x N, 1, H]
        seq, mbs = (width * recipe.batch.mbs, 1) if self.thd else (width, recipe.batch.mbs)
        try:
            losses = get_forward_backward_func()(
                forward_step_func=self._forward_step, data_iterator=iter(micro), model=[self.model],
                num_microbatches=len(micro), seq_length=seq, micro_batch_size=mbs, forward_only=False)
        finally:
            if self.first_writes is not None:
                self.first_writes.disarm()
        _, grad_norm, _ = self.optimizer.step()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for item in losses:
            totals += item["lm loss"].to(torch.float64)
        # every TP rank of the last stage holds the same sums: the ratio is unaffected
        tdist.all_reduce(totals)
        loss_sum, supervised = totals.tolist()
        tokens = recipe.batch.gbs * width
        dup = self._loss_copies()
        return StepStats(loss=loss_sum / max(supervised, 1.0), grad_norm=float(grad_norm or 0.0),
                         tokens=tokens, supervised_tokens=int(round(supervised / dup)))

    def _inverse_supervised_tokens(self, micro: list[dict[str, Any]]) -> float:
        """1 / the supervised tokens of this step over every DP and CP rank (at least 1): the
        factor megatron-core's ``calculate_per_token_loss`` applies to every gradient after the
        backward, applied to the loss instead (:func:`_per_token_loss`)."""
        from megatron.core import parallel_state as ps

        counts = torch.stack([supervised_mask(mb).sum() for mb in micro])
        total = counts.sum().to(torch.float64)
        tdist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        return 1.0 / max(float(total), 1.0)

    def _loss_copies(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_world_size()

    # -- validation -----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches: Iterable[list[dict[str, Any]]]) -> tuple[float, int]:
        """The loss over the held-out global batches given, each this rank's micro-batches as a step
        is split, run through megatron-core's pipeline schedule with ``forward_only=True`` (as
        Megatron-Bridge's ``evaluate``), the model in eval mode; the loss is the sum over every
        supervised token of every batch and rank divided by their count (Bridge's reduction of
        ``lm loss``)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        recipe = self.ctx.recipe
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        self.model.eval()
        try:
            for raw in batches:
                width = raw[0]["input_ids"].shape[1]
                micro = [self._prepare(mb) for mb in raw]
                seq, mbs = (width * recipe.batch.mbs, 1) if self.thd else (width, recipe.batch.mbs)
                losses = get_forward_backward_func()(
                    forward_step_func=self._forward_step, data_iterator=iter(micro), model=[self.model],
                    num_microbatches=len(micro), seq_length=seq, micro_batch_size=mbs, forward_only=True)
                for item in losses:  # the last pipeline stage's (loss sum, supervised tokens) per micro-batch
                    totals += item["lm loss"].to(torch.float64)
        finally:
            self.model.train()
        # every TP rank of the last stage holds the same sums: the ratio is unaffected
        tdist.all_reduce(totals)
        loss_sum, supervised = totals.tolist()
        return loss_sum / max(supervised, 1.0), int(round(supervised / self._loss_copies()))

    def seq_lens(self) -> list[int]:
        return self._seq_lens or [self.ctx.recipe.batch.seq_length or 1]

    def checkpoint_bytes(self) -> int:
        """One dist-checkpoint of the run: every parameter it holds (the adapters alone on a frozen
        base) in its dtype, and for each trainable one the optimizer's fp32 main copy (none when
        the parameters are fp32 already; an int16 remainder under ``optimizer.param_remainders``)
        and Adam's two fp32 moments. Each tensor counts once:
        a rank's share is divided by the ranks holding the same copy (data parallel, or expert
        data parallel for expert weights), then summed over all ranks (collective)."""
        from megatron.core import parallel_state as ps

        from muse_stack.engines.support import optimizer_state_bytes

        dense = ps.get_data_parallel_world_size(with_context_parallel=True)
        expert = ps.get_expert_data_parallel_world_size()
        tp = ps.get_tensor_model_parallel_world_size()
        state = optimizer_state_bytes(self.ctx.recipe)
        local = 0.0
        for p in self.model.module.parameters():
            if self.peft is not None and not p.requires_grad:
                continue
            copies = dense if getattr(p, "allreduce", True) else expert  # megatron-core marks experts allreduce=False
            if getattr(p, "allreduce", True) and not getattr(p, "tensor_model_parallel", False):
                copies *= tp  # whole on every TP rank (norms, gates, the towers): one copy per TP group
            local += p.numel() * (p.element_size() + (state if p.requires_grad else 0)) / copies
        total = torch.tensor([local], dtype=torch.float64, device=self.device)
        tdist.all_reduce(total)
        return int(round(total.item()))

    def peak_memory_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / GIB

    def describe(self) -> dict[str, Any]:
        from megatron.core import parallel_state as ps

        from muse_stack.engines.mcore import fuse

        local = sum(p.numel() for p in self.model.module.parameters())
        trainable = sum(p.numel() for p in self.model.module.parameters() if p.requires_grad)
        lay = self.ctx.recipe.layout
        return {"engine": self.name, "device": self.device, "local_parameters": local,
                "local_trainable_parameters": trainable,
                "adapters": self.peft.as_dict() if self.peft is not None else None,
                "parallel": {"tp": lay.tp, "pp": lay.pp, "cp": lay.cp or 1, "ep": lay.ep or 1, "etp": lay.etp,
                             "dp": self.dp_size, "sequence_parallel": self.config.sequence_parallel,
                             "pp_rank": ps.get_pipeline_model_parallel_rank(),
                             "first_stage_layers": self.config.num_layers_in_first_pipeline_stage,
                             "last_stage_layers": self.config.num_layers_in_last_pipeline_stage},
                "recompute": self.config.recompute_granularity, "dispatcher": self.config.moe_token_dispatcher_type,
                "distributed_optimizer": self.opt_config.use_distributed_optimizer,
                "optimizer": self._adam_loaded(),
                "optimizer_positions_realigned": getattr(self, "reordered_optimizer_params", 0),
                "perception": self._perception_info(),
                "attention": "TEDotProductAttention" + (" (THD packed)" if self.thd else ""), "experts": "TEGroupedMLP (grouped GEMM)",
                "experts_swiglu": self._swiglu_loaded(),
                "torch_compile_elementwise": fuse.enabled(),
                "levers": self._levers(),
                "fp32_gemms": "torch float32, TF32 off (" + ", ".join(self.fp32_gemms) + ")" if self.fp32_gemms
                else "transformer engine",
                "peak_memory_kind": "max allocated (CUDA)"}

    def _levers(self) -> dict[str, Any]:
        """The recipe's engine options as megatron-core, TE and the engine's modules hold them, read off
        the built config, DDP, optimizer and modules (docs/gpu-engine.md, "Engine options")."""
        from megatron.core.optimizer import clip_grads

        step = self.optimizer.step
        graph = None
        if type(step).__name__ == "OptimizerCudaGraphWrapper":
            graph = (f"captured after {step.cuda_graph_warmup_steps} eager steps" if type(step).cuda_graph is not None
                     else f"eager until step {step.cuda_graph_warmup_steps + 1}")
        from muse_stack.engines.mcore import clip_scale

        on_device = self.options["clip_on_device"].value and clip_grads.multi_tensor_scale_tensor_impl is not None
        scale = ("none on an unclipped step (a Triton kernel that reads the coefficient on the GPU)"
                 if clip_scale.installed() else "every step (TE's multi_tensor_scale_tensor)")
        adam_off, embedding_off = self.options_off["triton_adam"], self.options_off["embedding_into_main_grad"]
        return {"gradient_accumulation_fusion": self.config.gradient_accumulation_fusion,
                "moe_permute_fusion": self.config.moe_permute_fusion,
                "moe_router_fusion": self.config.moe_router_fusion,
                "grad_clip": f"norm and coefficient on the GPU; the scale pass: {scale}" if on_device
                else "norm read on the host (megatron-core's .item() path)",
                "optimizer_cuda_graph": graph,
                "overlap_grad_reduce": self.model.ddp_config.overlap_grad_reduce,
                "expert_counts": self._expert_counts_read(),
                "experts_swiglu": self._swiglu_loaded(),
                "post_expert_norm_backward": self._post_expert_norm_backward(),
                "adam_step": "one Triton launch per parameter group (adam_step.py)" if adam_off is None
                else f"Transformer Engine's multi_tensor_adam ({adam_off})",
                "embedding_grad": "each token's gradient added into the fp32 main gradient (embedding_grad.py)"
                if embedding_off is None else f"a dense bf16 gradient added by megatron-core's DDP ({embedding_off})",
                "grad_buffer_zeroing": self.first_writes.describe() if self.first_writes is not None
                else f"the whole buffer, every step ({self.options_off['first_micro_batch_writes']})",
                "pre_mlp_norm": self._pre_mlp_norm_run()}

    def _expert_counts_read(self) -> str | None:
        """Where the MoE layers' dispatchers read the experts' token counts, asked of the dispatchers."""
        from muse_stack.engines.mcore.dispatch import EarlyCountAllGatherDispatcher

        kinds = set()
        for m in self.model.module.modules():
            d = getattr(m, "token_dispatcher", None)
            if d is None:
                continue
            kinds.add("before the latent GEMM, copied without blocking; the weights permuted with the tokens"
                      if isinstance(d, EarlyCountAllGatherDispatcher) and d.local_only()
                      else f"megatron-core's {type(d).__name__.removeprefix('EarlyCount')}")
        return ", ".join(sorted(kinds)) or None

    def _pre_mlp_norm_run(self) -> str | None:
        """Whether the pre-MLP norm runs in the post-attention residual's chain, asked of the layers."""
        from muse_stack.engines.mcore.layers import MuseSparkLayer

        kinds = {"in the post-attention residual's chain" if m.fused_pre_mlp_norm else "its own chain"
                 for m in self.model.module.modules() if isinstance(m, MuseSparkLayer)}
        return ", ".join(sorted(kinds)) or None

    def _perception_info(self) -> dict[str, Any] | None:
        """The towers as this rank holds them (None: a text model, or not the first stage)."""
        from muse_stack.engines.mcore import towers

        host = getattr(self.model.module, "perception", None)
        if host is None:
            return None
        return {"modules": "transformers' vision tower, audio tower and projector (muse_stack.models.muse_spark.perception), "
                           "whole on every TP rank of the first pipeline stage",
                "parameters": sum(p.numel() for p in host.parameters()),
                "trainable_parameters": sum(p.numel() for p in host.parameters() if p.requires_grad),
                "frozen": sorted(n for n, m in host.named_children() if any(True for _ in m.parameters())
                                 and not any(p.requires_grad for p in m.parameters())),
                "vision_blocks_recomputed": bool(host.vision_tower.recompute),
                "vision_blocks_chains": towers.describe_chains(host.vision_tower),
                "vision_activations": towers.describe_activations(host.vision_tower),
                "vision_attention": towers.describe_attention(host.vision_tower),
                "dtype": str(next(host.parameters()).dtype)}

    def _post_expert_norm_backward(self) -> str | None:
        """How the expert layers' post-expert norm runs its backward, asked of the modules."""
        from muse_stack.engines.mcore.layers import MuseSparkExperts

        kinds = {"one Triton pass (norm_backward.py)" if m.one_pass_norm_backward()
                 else "the compiled chain's (TorchInductor)"
                 for m in self.model.module.modules() if isinstance(m, MuseSparkExperts)}
        return ", ".join(sorted(kinds)) or None

    def _swiglu_loaded(self) -> str | None:
        """Which SwiGLU the expert layers run, asked of the modules themselves."""
        from muse_stack.engines.mcore.layers import MuseSparkExperts

        kinds = {("unweighted (megatron-core's fused SwiGLU; the backward by Transformer Engine's dswiglu)"
                  if m.te_swiglu_backward else "unweighted (megatron-core's fused SwiGLU)") if m._plain_swiglu()
                 else "megatron-core's TEGroupedMLP forward (weighted SwiGLU, given ones)"
                 for m in self.model.module.modules() if isinstance(m, MuseSparkExperts)}
        return ", ".join(sorted(kinds)) or None

    def _adam_loaded(self) -> list[str]:
        """The Adam implementation(s) megatron-core built, read off the objects: class, and where
        the master weights live (TE's FusedAdam under the precision-aware optimizer)."""
        from muse_stack.engines.mcore import adam_step

        out = set()
        for opt in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
            adam = getattr(opt, "optimizer", None)
            if adam is None:
                continue
            name = f"{type(adam).__module__}.{type(adam).__name__}"
            if getattr(adam, "master_weights", False):
                kept = "bf16 weight + int16 remainder" if getattr(adam, "store_param_remainders", False) else "fp32"
                name += f" (holds the master weights: {kept})"
                if adam_step.installed(adam):
                    name += ", stepped by one Triton launch per parameter group (adam_step.py)"
            else:
                name += " (megatron-core keeps the fp32 shards it updates)"
            out.add(name)
        return sorted(out)

    # -- checkpoints (megatron-core dist-checkpointing) -----------------------------------
    def _sharded_state(self, *, is_loading: bool) -> dict[str, Any]:
        """Model and optimizer as sharded state, in megatron-core's torch_dist layout: the
        distributed optimizer's state per gradient bucket (``dp_reshardable``: every rank writes
        and reads its own shard; the DP size may change between save and load)."""
        from megatron.core import parallel_state as ps

        metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                                    "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        if self.opt_config.use_distributed_optimizer:
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
        if self.peft is not None:  # the adapter tensors only: the frozen base is not copied
            state = {"model": self._adapter_sharded_state()}
        else:
            state = {"model": self.model.module.sharded_state_dict(metadata=dict(metadata))}
        state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=dict(metadata))
        return state

    def _adapter_sharded_state(self) -> dict[str, Any]:
        """Each adapter parameter of this rank as a ShardedTensor of its global reference-named
        tensor (:func:`.mcore.peft_checkpoint.placement`); the data are the parameters themselves,
        so the optimizer's sharded state finds them and a load can copy back in place."""
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing import ShardedTensor

        from muse_stack.engines.mcore.peft_checkpoint import is_adapter_param, placement

        kw = self.load_kwargs
        out: dict[str, Any] = {}
        self._adapter_params: dict[str, torch.nn.Parameter] = {}
        for name, param in self.model.module.named_parameters():
            if not is_adapter_param(name):
                continue
            where = placement(name, layer_offset=kw["layer_offset"], expert_offset=kw["expert_offset"],
                              num_experts=self.ctx.model.num_local_experts, per_expert=self.peft.per_expert,
                              tp_rank=kw["tp_rank"], tp_size=kw["tp_size"],
                              ep_rank=ps.get_expert_model_parallel_rank(),
                              dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
                              expert_dp_rank=ps.get_expert_data_parallel_rank())
            # keyed by the local parameter: a rank's local experts are several shards (at their
            # global expert offsets) of one stacked checkpoint tensor, ``where.key``
            out[name] = ShardedTensor.from_rank_offsets(where.key, param, *where.rank_offsets,
                                                        replica_id=where.replica_id,
                                                        prepend_axis_num=where.prepend_axis_num)
            self._adapter_params[name] = param
        return out

    def save(self, directory: Path, step: int) -> None:
        """Every rank writes its shards into ``directory`` (made by the checkpoint manager).

        With ``training.async_checkpoint`` the tensors are staged to host memory here and
        written by a background process (megatron-core's async dist-checkpoint save through
        its ``AsyncCallsQueue``); :meth:`finalize_save` reports when the write is complete."""
        from megatron.core import dist_checkpointing

        state = self._sharded_state(is_loading=False)
        if self.peft is not None and self.ctx.rank == 0:  # what base the adapters sit on, before the shards
            from muse_stack.util import atomic
            from muse_stack.engines.mcore.peft_checkpoint import ADAPTER_BASE, FORMAT

            atomic.write_json(Path(directory) / ADAPTER_BASE, {"format": FORMAT, "peft": self.peft.as_dict(),
                                                               "base": self.base, "tensors": len(state["model"])})
        if not self.ctx.recipe.training.async_checkpoint:
            dist_checkpointing.save(state, str(directory))
            return
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if getattr(self, "_async_queue", None) is None:
            self._async_queue = AsyncCallsQueue()
        request = dist_checkpointing.save(state, str(directory), async_sharded_save=True, async_strategy="mcore")
        self._async_queue.schedule_async_request(request)

    def finalize_save(self, blocking: bool) -> bool:
        """Complete a background save that has finished (every rank calls this at the same
        points); True when no save is in flight."""
        queue = getattr(self, "_async_queue", None)
        if queue is None or queue.get_num_unfinalized_calls() == 0:
            return True
        queue.maybe_finalize_async_calls(blocking=blocking)
        return queue.get_num_unfinalized_calls() == 0

    def load(self, directory: Path) -> None:
        from megatron.core import dist_checkpointing

        # is_loading: the optimizer lays out (empty) Adam state to load into before its first step.
        # No autograd: the fp32 parameters' optimizer shards are views of the parameters themselves,
        # and the load copies into them in place.
        from muse_stack.engines.base import corrupt_checkpoint
        from muse_stack.engines.mcore.peft_checkpoint import check_resume, read_meta

        # adapters / full model, settings and base as this run's, before any tensor is read
        check_resume(Path(directory), read_meta(Path(directory)),
                     settings=self.peft.as_dict() if self.peft is not None else None,
                     ours=getattr(self, "base", None))
        with torch.no_grad():
            try:
                state = dist_checkpointing.load(self._sharded_state(is_loading=True), str(directory))
                if self.peft is not None:  # the adapter parameters, by their checkpoint keys
                    for name, param in self._adapter_params.items():
                        param.copy_(state["model"][name])
                else:
                    self.model.module.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
            except Exception as exc:  # megatron-core's checkpoint errors have no common base class
                raise corrupt_checkpoint(Path(directory), "dist-checkpoint", exc) from exc

    # -- random state ----------------------------------------------------------------------
    def rng_state(self) -> dict[str, Any]:
        """The generators of this engine beside the process's own (which the run captures):
        megatron-core's tensor-parallel RNG tracker, whose forks draw the dropout masks of TP
        regions; saved with them in the checkpoint's ``rng/rank-NNNNN.pt``."""
        return {"mcore_tracker": _tracker_states()}

    def load_rng_state(self, state: dict[str, Any]) -> None:
        """Set the tracker's streams a :meth:`rng_state` took (a state without them: nothing)."""
        from megatron.core import tensor_parallel

        saved = state.get("mcore_tracker")
        if saved:
            tracker = tensor_parallel.random.get_cuda_rng_tracker()
            current = tracker.get_states()
            for name, st in saved.items():
                if isinstance(current.get(name), torch.Generator):
                    current[name].set_state(st)
                else:
                    current[name] = st
            tracker.set_states(current)


def _tracker_states() -> dict[str, Any]:
    """megatron-core's tensor-parallel RNG tracker, by stream: a ByteTensor per stream; a
    CUDA-graph-safe tracker holds torch.Generator objects: their states."""
    from megatron.core import tensor_parallel

    return {name: st.clone() if torch.is_tensor(st) else st.get_state()
            for name, st in tensor_parallel.random.get_cuda_rng_tracker().get_states().items()}


def supervised_mask(mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tokens of a prepared micro-batch that count in the loss: a label, and the loss mask on."""
    from muse_stack.models.muse_spark.loss import IGNORE_INDEX

    return (mb["labels"] != IGNORE_INDEX) & mb["loss_mask"].to(torch.bool)


def _per_token_loss(mask: torch.Tensor, scale: float, output: torch.Tensor):
    """megatron-core loss contract with calculate_per_token_loss: (loss, count, reported). The loss
    that is differentiated is the sum times ``scale`` (1 / the step's global supervised tokens),
    so the gradients come out of the backward already per token; the reported sum is unscaled."""
    loss_sum = output.sum()
    count = mask.sum().to(torch.int)
    return loss_sum * scale, count, {"lm loss": torch.stack([loss_sum.detach().double(), count.double()])}


def _finalize_prescaled(finalize, model, num_tokens=None, **kwargs):
    """megatron-core's ``finalize_model_grads`` (DP reduction, TP/SP and embedding all-reduces)
    without its final ``1 / num_tokens`` pass over the whole fp32 gradient buffer: the loss was
    already divided by that count (:func:`_per_token_loss`), so the gradients are the same and
    one read and write of every gradient per step is saved."""
    return finalize(model, None, **kwargs)

"""The reference engine: the PyTorch Muse Spark model, data parallel over torch.distributed.

It runs on a CPU (gloo) or on GPUs (NCCL, bf16 autocast), one process per device, each a
data-parallel rank. Each optimizer step runs the micro-batches the run gives it (GBS / (MBS x DP)
per rank, :mod:`muse_stack.run.steps`); the loss is averaged over the supervised tokens of the
whole global batch (per-token loss), whatever rank or micro-batch they fall in.
"""

from __future__ import annotations

import os
import resource
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from muse_stack.util import atomic
from muse_stack.engines.base import StepStats, TrainContext
from muse_stack.engines.support import TOWERS
from muse_stack.models.muse_spark.perception import MEDIA_INPUTS

GIB = 2**30


def cpu_threads(world_size: int) -> int:
    """Threads per CPU process: OMP_NUM_THREADS when set, else half the cores shared over the
    processes (oversubscribed small matmuls run many times slower than one thread each)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // (2 * world_size))


def _torch_bytes(obj: Any) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, opt: Any) -> torch.optim.Optimizer:
    """The recipe's optimizer (``recipe.optimizer``, stated) over ``model``'s trainable parameters: SGD, or AdamW
    with weight decay on the parameters of two or more dimensions only."""
    if opt.name == "sgd":
        return torch.optim.SGD(_param_groups(model, opt.weight_decay), lr=opt.lr)
    return torch.optim.AdamW(_param_groups(model, opt.weight_decay), lr=opt.lr, betas=(opt.beta1, opt.beta2),
                             eps=opt.eps)


class ReferenceEngine:
    name = "reference"

    def __init__(self, ctx: TrainContext) -> None:
        from muse_stack.models.muse_spark import MuseSparkForCausalLM, freeze, load_weights_into

        self.ctx = ctx
        recipe = ctx.recipe
        cuda = recipe.hardware.gpu != "cpu"
        if cuda and not torch.cuda.is_available():
            from muse_stack.util.errors import EngineUnavailable

            raise EngineUnavailable("the recipe runs on GPUs but CUDA is not available here",
                                    field="hardware.gpu", value=recipe.hardware.gpu,
                                    fix="run it on a GPU machine, or pick a CPU recipe such as tiny-cpu")
        self.device = f"cuda:{ctx.local_rank}" if cuda else "cpu"
        if cuda:
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(cpu_threads(ctx.world_size))
        seed = recipe.training.seed if recipe.training.seed is not None else 0
        torch.manual_seed(seed)
        # image-text recipes carry the perception towers (model.towers, else the released model's)
        towers = ctx.resolved.towers
        self.model = MuseSparkForCausalLM(ctx.model, seed=seed, towers=towers).to(self.device)
        if ctx.pretrained_checkpoint:
            load_weights_into(self.model, ctx.pretrained_checkpoint)
        self.peft = None
        if recipe.peft is not None:
            # after the base weights load (DoRA's magnitude starts from them), before DDP
            from muse_stack.models.muse_spark.peft import apply_peft
            from muse_stack.models.muse_spark.peft_io import base_identity

            self.peft = ctx.resolved.peft
            self.base = base_identity(self.model, path=ctx.pretrained_checkpoint, revision=recipe.model.revision,
                                      hf_id=recipe.model.hf_id, init_seed=seed)
            apply_peft(self.model, self.peft, seed=seed)
        frozen = [f for f in recipe.frozen if f not in TOWERS and not (self.peft and f == "base")]
        if self.model.towers_config is not None:  # a tower the model has is frozen by its parameters
            frozen += [f"model.{f}" for f in recipe.frozen if f in TOWERS]
        if frozen:
            freeze(self.model, frozen)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda and recipe.precision == "bf16"
                         else nullcontext())
        self.ddp = None
        if ctx.world_size > 1:
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[ctx.local_rank] if cuda else None)
        from muse_stack.engines.support import require_stated

        require_stated(recipe)  # the values below are the recipe's; none is filled in here
        self.optimizer = build_optimizer(self.model, recipe.optimizer)
        self._seq_lens: list[int] | None = None
        #: the perception towers' model FLOPs of the images trained on, and the tokens of those steps
        self._tower_flops = None
        if self.model.towers_config is not None:
            from muse_stack.models.muse_spark.flops import TowerFlops

            trains = {name: any(p.requires_grad for p in getattr(self.model.model, name).parameters())
                      for name in ("vision_tower", "vision_adapter")}
            self._tower_flops = TowerFlops(self.model.towers_config, ctx.model.hidden_size,
                                           vision_trains=trains["vision_tower"],
                                           projector_trains=trains["vision_adapter"])

    def data_parallel(self) -> tuple[int, int]:
        """This process's data-parallel rank and size: every process is one."""
        return self.ctx.rank, self.ctx.world_size

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # -- one optimizer step ---------------------------------------------------------------
    def train_step(self, micro: list[dict[str, Any]]) -> StepStats:
        """Forward and backward over this rank's micro-batches of the step, then the optimizer step."""
        recipe, ctx = self.ctx.recipe, self.ctx
        if self._seq_lens is None:
            first = micro[0]
            cu = first["cu_seqlens"].tolist()
            self._seq_lens = [b - a for a, b in zip(cu, cu[1:])] or [first["input_ids"].shape[1]]
        if self._tower_flops is not None:
            self._tower_flops.add(micro)
        counts = torch.tensor([float(sum(int(m["loss_mask"].sum()) for m in micro)),
                               float(sum(m["input_ids"].numel() for m in micro))], dtype=torch.float64)
        if ctx.world_size > 1:
            counts = counts.to(self.device)
            dist.all_reduce(counts)
            counts = counts.cpu()
        global_supervised, global_tokens = counts.tolist()
        denom = max(global_supervised, 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64)
        module = self.ddp or self.model
        self.optimizer.zero_grad(set_to_none=True)
        for i, mb in enumerate(micro):
            mb = {k: (v.to(self.device) if torch.is_tensor(v) else v) for k, v in mb.items()}
            sync = self.ddp.no_sync() if (self.ddp is not None and i < len(micro) - 1) else nullcontext()
            with sync, self.autocast:
                media = {k: mb[k] for k in MEDIA_INPUTS if k in mb}  # image-text batches: their pixels
                out = module(mb["input_ids"], position_ids=mb["position_ids"], segment_ids=mb["segment_ids"],
                             labels=mb["labels"], loss_mask=mb["loss_mask"], **media)
            n = out.num_tokens.to(torch.float64)
            token_sum = out.loss.to(torch.float64) * n
            # DDP averages gradients over ranks: scale so the result is the global per-token mean
            (token_sum * ctx.world_size / denom).float().backward()
            loss_sum += token_sum.detach().cpu()
        if ctx.world_size > 1:
            t = loss_sum.to(self.device)
            dist.all_reduce(t)
            loss_sum = t.cpu()
        clip = recipe.optimizer.clip_grad
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf"))
        self.optimizer.step()
        return StepStats(loss=float(loss_sum) / denom, grad_norm=float(grad_norm),
                         tokens=int(global_tokens), supervised_tokens=int(global_supervised))

    # -- validation -----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches: Iterable[list[dict[str, Any]]]) -> tuple[float, int]:
        """The loss over the held-out global batches given (this rank's micro-batches of each), as
        a step computes its loss (per supervised token over every micro-batch of every rank) with
        the model in eval mode and no gradient."""
        ctx = self.ctx
        sums = torch.zeros(2, dtype=torch.float64)
        self.model.eval()
        try:
            for mb in (mb for micro in batches for mb in micro):
                mb = {k: (v.to(self.device) if torch.is_tensor(v) else v) for k, v in mb.items()}
                with self.autocast:
                    media = {k: mb[k] for k in MEDIA_INPUTS if k in mb}
                    out = self.model(mb["input_ids"], position_ids=mb["position_ids"], segment_ids=mb["segment_ids"],
                                     labels=mb["labels"], loss_mask=mb["loss_mask"], **media)
                n = out.num_tokens.to(torch.float64).cpu()
                sums += torch.stack([out.loss.to(torch.float64).cpu() * n, n])
        finally:
            self.model.train()
        if ctx.world_size > 1:
            t = sums.to(self.device)
            dist.all_reduce(t)
            sums = t.cpu()
        loss_sum, supervised = sums.tolist()
        return loss_sum / max(supervised, 1.0), int(supervised)

    def tower_flops_per_token(self) -> dict[str, float] | None:
        """The perception towers' model FLOPs per token over the steps this process ran (its own
        micro-batches' images; ``muse_stack.models.muse_spark.flops.TowerFlops``), or None without towers."""
        return self._tower_flops.per_token() if self._tower_flops is not None else None

    def seq_lens(self) -> list[int]:
        return self._seq_lens or [self.ctx.recipe.batch.seq_length or 1]

    def peak_memory_gib(self) -> float | None:
        if self.device.startswith("cuda"):
            return torch.cuda.max_memory_allocated(self.device) / GIB
        rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss_kib * (1 if sys.platform != "darwin" else 1 / 1024) / 2**20

    def describe(self) -> dict[str, Any]:
        n_params = sum(p.numel() for p in self.model.parameters())
        n_train = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return {"engine": self.name, "device": self.device, "parameters": n_params, "trainable_parameters": n_train,
                "peft": self.peft.as_dict() if self.peft is not None else None, "torch_threads": torch.get_num_threads(),
                "peak_memory_kind": "max allocated (CUDA)" if self.device.startswith("cuda")
                else "peak resident set of the process (host)"}

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, directory: Path, step: int) -> None:
        """Model weights as an HF-style checkpoint (with adapters: only the adapter tensors and the
        base's identity) plus the optimizer state in ``optimizer.pt`` (rank 0 writes: every rank
        holds the same)."""
        from muse_stack.models.muse_spark import save_checkpoint

        if self.ctx.rank != 0:
            return
        if self.peft is not None:  # the adapters and the base's identity; the frozen base is not copied
            from muse_stack.models.muse_spark.peft_io import save_adapters

            save_adapters(self.model, directory, self.base, self.peft)
        else:
            save_checkpoint(self.model, directory)
        atomic.write_bytes(directory / "optimizer.pt", _torch_bytes({"optimizer": self.optimizer.state_dict()}))

    def checkpoint_bytes(self) -> int:
        """The saved weights (the adapters alone on a frozen base) and, for each trainable one,
        AdamW's two moments in its dtype (SGD keeps none); rank 0 writes everything."""
        moments = 0 if self.ctx.recipe.optimizer.name == "sgd" else 2
        total = 0
        for p in self.model.parameters():
            if self.peft is not None and not p.requires_grad:
                continue  # the frozen base is named, not copied
            total += p.numel() * p.element_size() * (1 + (moments if p.requires_grad else 0))
        return total

    def load(self, directory: Path) -> None:
        """Read the weights (or the adapters) and the optimizer state a :meth:`save` wrote."""
        from muse_stack.models.muse_spark import load_weights_into

        from muse_stack.engines.base import corrupt_checkpoint

        if self.peft is not None:
            from muse_stack.models.muse_spark.peft_io import load_adapters

            load_adapters(self.model, directory)  # refuses adapters trained on another base
        else:
            load_weights_into(self.model, directory)
        try:  # weights_only: a checkpoint is data, never code to unpickle
            state = torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=True)
            self.optimizer.load_state_dict(state["optimizer"])
        except (OSError, EOFError, RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise corrupt_checkpoint(directory, "optimizer state (optimizer.pt)", exc) from exc
        except Exception as exc:  # pickle.UnpicklingError and the zip reader's own errors
            raise corrupt_checkpoint(directory, "optimizer state (optimizer.pt)", exc) from exc

"""LoRA and DoRA on the megatron-core Muse Spark layers: tensor-parallel shards, grouped
per-expert adapters under EP, and the latent projections.

The mapping and sharding math below (the pure functions) is tested on the CPU against the
reference adapters (``tests/unit/test_mcore_peft_mapping.py``): every TP, EP and PP split,
recombined, gives the reference adapter's output, gradients and names. The module transform
(:func:`attach_adapters`) needs megatron-core + TE; its parity with the reference engine at
TP 1 is ``python -m lab.verify.peft_parity`` on a GPU (``benchmarks/results/parity/peft-parity-*.json``).
The engine starts from the reference's own initial adapters (:func:`initial_adapters`).

How each target is split (checkpoint name -> megatron-core module, as :mod:`.weights`):

============================  ==========================  ==========================================
target                        module                      adapter on one rank
============================  ==========================  ==========================================
self_attn.{q,k,v,gate}_proj   linear_{q,k,v,gate}         column: A [r, in] whole, B [out/TP, r]
self_attn.o_proj              linear_proj                 row: A [r, in/TP], B [out, r] whole
mlp.pre/post_expert_proj      fc1/fc2_latent_proj         duplicated: A and B whole on every TP rank
mlp.experts.gate_up_proj      experts.linear_fc1 (group)  column over ETP (gate and up halves apart)
mlp.experts.down_proj         experts.linear_fc2 (group)  row over ETP
============================  ==========================  ==========================================

The column case all-gathers the sequence-parallel input before A (its backward reduce-scatters,
as the base linear's); the row case reduce-scatters ``A x`` (a partial sum over TP) into the
sequence-parallel layout before B. The factor kept whole on every TP rank sees only its rank's
part of the tokens or outputs, so it carries megatron-core's ``sequence_parallel`` attribute and
its gradient is all-reduced over TP by ``finalize_model_grads``. Each EP rank holds the adapters
of its E / EP experts (global expert ``ep_rank x E / EP + i`` is local ``i``); they are marked
``allreduce = False`` so megatron-core's DDP reduces them over the expert-data-parallel group,
as the expert weights. DoRA's row norm of a row-parallel weight sums the squared row parts over
TP. Adapter names are the base module's name plus ``.adapter.lora_A`` (``lora_A{e}`` for the
experts' local expert e), so the base weights keep their checkpoint mapping.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from muse_stack.engines.mcore.weights import LM
from muse_stack.models.muse_spark.peft_config import DUPLICATED, EXPERT_TARGETS, ROW_PARALLEL, PeftSettings

#: checkpoint target -> megatron-core module suffix inside ``decoder.layers.{l}.``
MCORE_MODULES: dict[str, str] = {
    "self_attn.q_proj": "self_attention.linear_q",
    "self_attn.k_proj": "self_attention.linear_k",
    "self_attn.v_proj": "self_attention.linear_v",
    "self_attn.gate_proj": "self_attention.linear_gate",
    "self_attn.o_proj": "self_attention.linear_proj",
    "mlp.pre_expert_proj": "mlp.fc1_latent_proj",
    "mlp.post_expert_proj": "mlp.fc2_latent_proj",
    "mlp.experts.gate_up_proj": "mlp.experts.linear_fc1",
    "mlp.experts.down_proj": "mlp.experts.linear_fc2",
}
_MCORE_ADAPTER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.adapter\.(lora_A|lora_B|lora_magnitude)(\d*)$")


def parallel_mode(target: str) -> str:
    """'column', 'row' or 'duplicated': how the target's base weight splits over TP (ETP)."""
    if target in DUPLICATED:
        return "duplicated"
    return "row" if target in ROW_PARALLEL else "column"


# ---- names ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdapterTensor:
    """Where one megatron-core adapter tensor lives in the reference model's adapter state dict."""

    hf_name: str  #: the reference model's key
    expert: int | None  #: index into the stacked [E, ...] adapter tensor (global expert)
    factor: str  #: lora_A, lora_B or lora_magnitude
    target: str


def mcore_to_reference(name: str, *, layer_offset: int = 0, expert_offset: int = 0) -> AdapterTensor:
    """The reference adapter tensor of a megatron-core adapter name of one pipeline stage and EP
    rank (``layer_offset``: the stage's first global layer; ``expert_offset``: ep_rank x E / EP)."""
    match = _MCORE_ADAPTER.match(name)
    if match is None:
        raise KeyError(f"not a Muse Spark megatron-core adapter tensor: {name}")
    layer, module, factor, local = int(match.group(1)) + layer_offset, match.group(2), match.group(3), match.group(4)
    target = next((t for t, m in MCORE_MODULES.items() if m == module), None)
    if target is None:
        raise KeyError(f"not a Muse Spark megatron-core adapter tensor: {name}")
    prefix = f"{LM}layers.{layer}."
    if target in EXPERT_TARGETS:
        if not local:
            raise KeyError(f"an expert adapter names its local expert: {name}")
        attr = target.rsplit(".", 1)[1]
        return AdapterTensor(f"{prefix}mlp.experts.adapters.{attr}.{factor}", int(local) + expert_offset, factor,
                             target)
    if local:
        raise KeyError(f"only expert adapters carry an expert index: {name}")
    return AdapterTensor(f"{prefix}{target}.adapter.{factor}", None, factor, target)


def reference_to_mcore(hf_name: str, *, num_experts: int, layer_offset: int = 0, expert_offset: int = 0,
                       local_experts: int | None = None) -> list[str]:
    """The megatron-core adapter names (of the stage / EP rank given by the offsets) that hold a
    reference adapter tensor: one per local expert for the stacked expert adapters."""
    match = re.match(rf"^{re.escape(LM)}layers\.(\d+)\.(.+)$", hf_name)
    if match is None:
        raise KeyError(f"not a reference adapter tensor: {hf_name}")
    layer, rest = int(match.group(1)) - layer_offset, match.group(2)
    expert = re.match(r"^mlp\.experts\.adapters\.(gate_up_proj|down_proj)\.(lora_A|lora_B)$", rest)
    if expert is not None:
        module = MCORE_MODULES[f"mlp.experts.{expert.group(1)}"]
        count = local_experts if local_experts is not None else num_experts
        return [f"decoder.layers.{layer}.{module}.adapter.{expert.group(2)}{i}" for i in range(count)]
    dense = re.match(r"^(.+)\.adapter\.(lora_A|lora_B|lora_magnitude)$", rest)
    if dense is None or dense.group(1) not in MCORE_MODULES:
        raise KeyError(f"not a reference adapter tensor: {hf_name}")
    return [f"decoder.layers.{layer}.{MCORE_MODULES[dense.group(1)]}.adapter.{dense.group(2)}"]


# ---- shards ---------------------------------------------------------------------------------
def _split(t: torch.Tensor, dim: int, rank: int, size: int, glu: bool) -> torch.Tensor:
    if size == 1:
        return t
    if glu:  # [gate; up] rows: each half splits over the ranks, as the base fc1 weight
        gate, up = t.chunk(2, dim=dim)
        return torch.cat([gate.chunk(size, dim=dim)[rank], up.chunk(size, dim=dim)[rank]], dim=dim)
    if t.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not split over {size} ranks")
    return t.chunk(size, dim=dim)[rank]


def shard_factor(tensor: torch.Tensor, target: str, factor: str, rank: int, size: int) -> torch.Tensor:
    """This TP (ETP for experts) rank's part of one expert's or projection's adapter factor:
    A [r, in], B [out, r] or the DoRA magnitude [out]."""
    mode = parallel_mode(target)
    glu = target == "mlp.experts.gate_up_proj"
    if mode == "duplicated":
        return tensor
    if factor == "lora_A":
        return _split(tensor, 1, rank, size, False) if mode == "row" else tensor
    # B and the magnitude follow the base weight's output rows
    return _split(tensor, 0, rank, size, glu) if mode == "column" else tensor


def replicated_over_tp(target: str, factor: str) -> bool:
    """A factor that is whole on every TP rank while its inputs or outputs are split: its
    gradient is a partial sum per rank (``sequence_parallel`` attribute, all-reduced over TP)."""
    mode = parallel_mode(target)
    return mode == "duplicated" or (mode == "column" and factor == "lora_A") or \
        (mode == "row" and factor in ("lora_B", "lora_magnitude"))


# ---- the transform (megatron-core + TE; GPU) ----------------------------------------------
class _AdaptedLinear:
    """Mixed into a TE linear's class: its output plus the adapter's (``(out, bias)`` tuples)."""

    def forward(self, x, *args, **kwargs):  # noqa: D401 - TE's signature
        out, bias = super().forward(x, *args, **kwargs)
        return out + self.adapter(x, out, self).to(out.dtype), bias

    def set_activation_dtype(self, inp: torch.Tensor) -> None:
        """TE checks that every parameter under the module has the input's dtype, the adapter's
        included; those never enter TE's GEMM (DoRA's magnitude stays float32 beside bf16
        weights), so the check runs with the adapter detached: TE's own parameters only."""
        adapter = self._modules.pop("adapter")
        try:
            super().set_activation_dtype(inp)
        finally:
            self._modules["adapter"] = adapter


class _AdaptedGroupedLinear:
    """Mixed into a TE grouped linear: per-local-expert adapters on the token groups ``m_splits``."""

    def forward(self, x, m_splits, *args, **kwargs):
        out, bias = super().forward(x, m_splits, *args, **kwargs)
        splits = m_splits.tolist() if torch.is_tensor(m_splits) else list(m_splits)
        parts = [self.adapter.expert(e, chunk) for e, chunk in enumerate(torch.split(x, splits, dim=0))]
        return out + torch.cat(parts, dim=0).to(out.dtype), bias


class ParallelLoRA(torch.nn.Module):
    """LoRA (and DoRA's magnitude) on one TP-split linear; see the module doc for the comms."""

    def __init__(self, target: str, fan_in: int, fan_out: int, settings: PeftSettings, tp_size: int, tp_group,
                 sequence_parallel: bool, *, dtype, device) -> None:
        super().__init__()
        self.target, self.mode = target, parallel_mode(target)
        self.scaling, self.tp_size, self.tp_group, self.sp = settings.scaling, tp_size, tp_group, sequence_parallel
        r = settings.rank
        split = tp_size if self.mode != "duplicated" else 1  # the latent projections are whole on every rank
        self.split = split
        self.lora_A = torch.nn.Parameter(torch.empty(r, fan_in // split if self.mode == "row" else fan_in,
                                                     dtype=dtype, device=device))
        self.lora_B = torch.nn.Parameter(torch.zeros(fan_out // split if self.mode == "column" else fan_out, r,
                                                     dtype=dtype, device=device))
        self.lora_magnitude = torch.nn.Parameter(torch.ones(self.lora_B.shape[0], dtype=torch.float32,
                                                            device=device)) if settings.scheme == "dora" else None
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout else torch.nn.Identity()
        for name, p in self.named_parameters():
            # whole on every TP rank, but fed by this rank's tokens or outputs only: all-reduce over TP
            setattr(p, "sequence_parallel", sequence_parallel and tp_size > 1 and replicated_over_tp(target, name))

    def _update(self, x: torch.Tensor) -> torch.Tensor:
        if self.split > 1 and self.sp and self.mode == "column":
            from megatron.core import tensor_parallel as tpl

            x = tpl.gather_from_sequence_parallel_region(x, group=self.tp_group)
        h = torch.nn.functional.linear(x, self.lora_A.to(x.dtype))
        if self.split > 1 and self.mode == "row":
            from megatron.core import tensor_parallel as tpl

            h = tpl.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group) if self.sp \
                else tpl.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return torch.nn.functional.linear(h, self.lora_B.to(h.dtype)) * self.scaling

    def row_norm(self, weight: torch.Tensor) -> torch.Tensor:
        wide = torch.float64 if weight.dtype == torch.float64 else torch.float32  # fp32, or float64 in tests
        adapted = weight.to(wide) + self.scaling * (self.lora_B.to(wide) @ self.lora_A.to(wide))
        squares = (adapted * adapted).sum(dim=1)
        if self.mode == "row" and self.split > 1:
            from torch.distributed.nn.functional import all_reduce

            squares = all_reduce(squares, group=self.tp_group)
        return squares.sqrt()

    def forward(self, x: torch.Tensor, out: torch.Tensor, linear) -> torch.Tensor:
        dropped = self.dropout(x)
        update = self._update(dropped)
        if self.lora_magnitude is None:
            return update
        scale = self.lora_magnitude / self.row_norm(linear.weight)
        # with dropout, W drop(x) through the base linear's own forward (the class under the mixin)
        base = out if dropped is x else type(linear).__mro__[2].forward(linear, dropped)[0]
        return (scale - 1) * base + scale * update


class GroupedLoRA(torch.nn.Module):
    """One adapter per local expert (``lora_A{e}`` [r, in], ``lora_B{e}`` [out, r]), or one shared."""

    def __init__(self, target: str, local_experts: int, fan_in: int, fan_out: int, settings: PeftSettings,
                 etp_size: int, *, dtype, device) -> None:
        super().__init__()
        if etp_size > 1:
            raise ValueError("expert adapters under expert tensor parallelism are not supported: set layout.etp=1")
        self.per_expert, self.scaling = settings.per_expert, settings.scaling
        n = local_experts if settings.per_expert else 1
        for e in range(n):
            a = torch.nn.Parameter(torch.empty(settings.rank, fan_in, dtype=dtype, device=device))
            b = torch.nn.Parameter(torch.zeros(fan_out, settings.rank, dtype=dtype, device=device))
            for p in (a, b):
                p.allreduce = False  # megatron-core DDP: reduce over the expert-data-parallel group
            self.register_parameter(f"lora_A{e}", a)
            self.register_parameter(f"lora_B{e}", b)
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout else torch.nn.Identity()

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        i = e if self.per_expert else 0
        a, b = getattr(self, f"lora_A{i}"), getattr(self, f"lora_B{i}")
        h = torch.nn.functional.linear(self.dropout(x), a.to(x.dtype))
        return torch.nn.functional.linear(h, b.to(h.dtype)) * self.scaling


def _adapt(module: torch.nn.Module, mixin: type, adapter: torch.nn.Module) -> None:
    """Give ``module`` the adapter and the mixin's forward, keeping its parameter names."""
    module.adapter = adapter
    module.__class__ = type(f"Adapted{type(module).__name__}", (mixin, type(module)), {})


def attach_adapters(model: torch.nn.Module, settings: PeftSettings, muse, *, tp_size: int, tp_group,
                    sequence_parallel: bool, ep_size: int, etp_size: int) -> list[str]:
    """Freeze the stage ``model`` (a MuseSparkMCore) and attach the adapters to its layers;
    returns the adapter parameter names, the only ones the optimizer gets. Call it after the
    base weights load and before megatron-core's DDP wraps the model. Adapter values come from
    the reference model's adapters through :func:`mcore_to_reference` / :func:`shard_factor`
    (``load_reference_adapters``), so both engines start from the same adapters."""
    from muse_stack.models.muse_spark.peft_config import target_shape

    for p in model.parameters():
        p.requires_grad_(False)
    local_experts = muse.num_local_experts // ep_size
    for layer in model.decoder.layers:
        for target in settings.targets:
            module = layer.get_submodule(MCORE_MODULES[target])
            fan_in, fan_out = target_shape(target, muse)
            device = next(module.parameters()).device
            dtype = next(module.parameters()).dtype
            if target in EXPERT_TARGETS:
                _adapt(module, _AdaptedGroupedLinear,
                       GroupedLoRA(target, local_experts, fan_in, fan_out, settings, etp_size, dtype=dtype,
                                   device=device))
            else:
                _adapt(module, _AdaptedLinear,
                       ParallelLoRA(target, fan_in, fan_out, settings, tp_size, tp_group, sequence_parallel,
                                    dtype=dtype, device=device))
    return [n for n, p in model.named_parameters() if p.requires_grad]


def initial_adapters(settings: PeftSettings, muse, seed: int, layers: range) -> dict[str, torch.Tensor]:
    """The reference model's initial adapter tensors (:func:`muse_stack.models.muse_spark.peft.apply_peft`:
    A Xavier-normal seeded per tensor name on the CPU, B zero) of the global ``layers``, by the
    reference names, in fp32. DoRA's magnitude is not here: it is the base weight's row norms,
    taken from the loaded weights on each rank."""
    from muse_stack.models.muse_spark.peft import _xavier_normal_
    from muse_stack.models.muse_spark.peft_config import target_shape

    out: dict[str, torch.Tensor] = {}
    r = settings.rank
    for layer in layers:
        prefix = f"{LM}layers.{layer}."
        for target in settings.targets:
            fan_in, fan_out = target_shape(target, muse)
            if target in EXPERT_TARGETS:
                n = muse.num_local_experts if settings.per_expert else 1
                key = f"{prefix}mlp.experts.adapters.{target.rsplit('.', 1)[1]}."
                a = torch.empty(n, r, fan_in)
                _xavier_normal_(a, key + "lora_A", seed, fan_in, r)
                out[key + "lora_A"], out[key + "lora_B"] = a, torch.zeros(n, fan_out, r)
                continue
            key = f"{prefix}{target}.adapter."
            a = torch.empty(r, fan_in)
            _xavier_normal_(a, key + "lora_A", seed, fan_in, r)
            out[key + "lora_A"], out[key + "lora_B"] = a, torch.zeros(fan_out, r)
    return out


@torch.no_grad()
def init_magnitudes(model: torch.nn.Module) -> int:
    """DoRA: each magnitude from its base weight's row norms (B = 0, so ``||W + s B A|| = ||W||``;
    a row-parallel weight's rows are summed over TP); returns the magnitudes set."""
    count = 0
    for module in model.modules():
        adapter = getattr(module, "adapter", None)
        if isinstance(adapter, ParallelLoRA) and adapter.lora_magnitude is not None:
            adapter.lora_magnitude.copy_(adapter.row_norm(module.weight))
            count += 1
    return count


@torch.no_grad()
def load_reference_adapters(model: torch.nn.Module, reference: dict[str, torch.Tensor], *, layer_offset: int,
                            expert_offset: int, tp_rank: int, tp_size: int, magnitudes_required: bool = True) -> int:
    """Copy the reference model's adapter tensors (:func:`muse_stack.models.muse_spark.peft.adapter_state_dict`)
    into this stage / rank's adapters; returns the tensors copied. Every adapter tensor of the
    stage must find its source."""
    copied = 0
    for name, param in model.named_parameters():
        if ".adapter." not in name:
            continue
        where = mcore_to_reference(name, layer_offset=layer_offset, expert_offset=expert_offset)
        if where.factor == "lora_magnitude" and where.hf_name not in reference and not magnitudes_required:
            continue  # set from the base weights (init_magnitudes)
        full = reference[where.hf_name]
        if where.expert is not None:
            full = full[where.expert if full.shape[0] > 1 else 0]
        part = shard_factor(full, where.target, where.factor, tp_rank, tp_size) if where.expert is None else full
        param.copy_(part)
        copied += 1
    return copied

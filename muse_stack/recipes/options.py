"""Engine options: one table, one row per option of a training engine.

Each row of :data:`ROWS` holds, in one place:

* ``key``: the recipe field ``engine_options.<key>`` (the schema's section is made from this table) and
  its description, which says whether it changes numerics;
* ``engines``: the engines that read it (set for another engine, the recipe is refused);
* ``default``: what an unset value means: ``on`` (on wherever its blocker allows) or ``off``;
* ``blocker``: where it cannot apply and why (a stated ``true`` there is refused, naming the reason);
* ``prices``: what the step-time model prices (:mod:`muse_stack.plan.cost` reads it from here), or
  why it prices nothing;
* ``install``: how the engine installs it: the megatron-core config field it sets, and/or
  ``install_<key>(target, on)`` in the module beside its kernel, called at a stage of the build;
* ``attribution``: the flags ``benchmarks/scripts/engine_steps.py`` offers to measure it, each the
  override it sets.

Everything that reads an option goes through this table: the recipe's engine check
(:mod:`muse_stack.recipes.engines`), the megatron engine's config (:mod:`muse_stack.engines.mcore.config`)
and installs (:mod:`muse_stack.engines.megatron`), the planner (:func:`muse_stack.plan.cost.step_kernels`),
``muse-stack show --options``, the Bridge key table (:mod:`muse_stack.recipes.bridge`) and
``engine_steps.py``.

**Resolution.** A stated ``false`` is off; a stated ``true`` is on, and :func:`check` refuses it where the
blocker names a reason; unset is the row's default, ``on`` only where the blocker allows. Blockers read
the recipe and the resolved values of the rows above their own, so the table's order is the order of
resolution (and of installation within a stage).

**The sections before.** The options were once two sections, ``fusions`` and ``performance``. A recipe or
an override that names them still loads: each value moves to its ``engine_options`` key, with a
FutureWarning naming the new key (:func:`migrate`, :func:`migrate_path`).

This module imports neither torch nor megatron-core: the install functions are named, and the engine
imports them when it builds.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from muse_stack.util.errors import RecipeError

#: a :class:`muse_stack.recipes.schema.Recipe`, whose ``engine_options`` section the schema makes from this table
#: (so this module does not import the schema)
Recipe = Any

#: the recipe section
SECTION = "engine_options"
#: the sections the options were in before (each row's ``formerly``)
LEGACY_SECTIONS = ("fusions", "performance")
#: megatron-core's config objects an option may set a field of, with the section of Megatron-Bridge's
#: ConfigContainer that holds each (the model provider's TransformerConfig fields are under ``model``)
CONFIGS = {"transformer": "model", "ddp": "ddp", "optimizer": "optimizer"}


class Block(NamedTuple):
    """Why an option cannot apply to a recipe, and (``remedy``) what else the recipe could change so that it
    can, besides dropping the option."""

    reason: str
    remedy: str | None = None


@dataclass(frozen=True)
class Priced:
    """The step-time model prices the option: ``where`` names the term and how. A ``kernel`` option picks
    the value of that :class:`~muse_stack.plan.cost.StepKernels` field: ``on`` or ``off``."""

    where: str
    kernel: str | None = None
    on: str | None = None
    off: str | None = None


@dataclass(frozen=True)
class Unpriced:
    """The step-time model prices nothing for the option, for ``why``."""

    why: str


@dataclass(frozen=True)
class Install:
    """How the engine installs an option: ``config``, the megatron-core config (a key of :data:`CONFIGS`) and
    field it sets; and/or ``install_<key>(target, on)`` in ``module``, called at ``stage``: ``model`` (the
    target is the built model of this rank, before DDP wraps it) or ``optimizer`` (the target is the engine,
    once DDP and the optimizer exist). The function sets the option as resolved (``on`` true or false) and
    returns why it is off though asked on (None: as asked)."""

    config: tuple[str, str] | None = None
    module: str | None = None
    stage: Literal["model", "optimizer"] | None = None


@dataclass(frozen=True)
class Attribution:
    """A flag of ``benchmarks/scripts/engine_steps.py`` (``--<label>``; the run's file is named after it) that
    measures the option by setting it to ``value``; ``what`` is the flag's help."""

    label: str
    value: bool
    what: str

    @property
    def flag(self) -> str:
        return f"--{self.label}"


Resolved = Mapping[str, "Resolution"]
Blocker = Callable[["Recipe", Resolved], Block | None]


@dataclass(frozen=True)
class EngineOption:
    """One row of the table: the option ``engine_options.<key>`` (see the module's text for each field)."""

    key: str
    description: str
    default: Literal["on", "off"]
    blocker: Blocker
    prices: Priced | Unpriced
    install: Install
    attribution: tuple[Attribution, ...]
    engines: tuple[str, ...] = ("megatron",)
    #: the section that held it before ``engine_options`` (None: it was never in one)
    formerly: str | None = None

    @property
    def field(self) -> str:
        return f"{SECTION}.{self.key}"

    def override(self, value: bool) -> str:
        return f"{self.field}={str(value).lower()}"

    @property
    def install_function(self) -> str | None:
        """``module:function`` of its install function (None: a config field only)."""
        return f"{self.install.module}:install_{self.key}" if self.install.module else None


@dataclass(frozen=True)
class Resolution:
    """An option's value for a recipe and where it came from."""

    value: bool
    stated: bool | None  #: the recipe's value (None: unset)
    block: Block | None  #: why it cannot apply here (None: it can)
    default: str
    conditional: bool  #: its row has a blocker (it may not apply everywhere)

    @property
    def source(self) -> str:
        """Where the value came from: stated, or the row's default (and why it does not apply here)."""
        if self.stated is not None and not (self.stated and self.block):
            return "stated"
        if self.stated:
            return f"stated true, but it cannot apply: {self.block.reason}"
        if self.default == "off":
            return "unset: off"
        if not self.conditional:
            return "unset: on"
        if self.block is not None:
            return f"unset: on where it applies, and here it cannot: {self.block.reason}"
        return "unset: on where it applies"

    def why_off(self, key: str) -> str | None:
        """Why the option is off (None: on)."""
        if self.value:
            return None
        if self.stated is False:
            return f"{SECTION}.{key}: false"
        return self.block.reason if self.block is not None else f"{SECTION}.{key} unset: off"


def _on(done: Resolved, key: str) -> bool:
    found = done.get(key)
    return found is not None and found.value


def _nothing(recipe: Recipe, done: Resolved) -> Block | None:
    """Applies wherever its engine runs."""
    return None


# ---- blockers (each reads the recipe and the options resolved above it) ---------------------------
def _multi_kernel_blocker(recipe: Recipe, done: Resolved) -> Block | None:
    if not _on(done, "compile_elementwise"):
        return Block("no elementwise chain is compiled", "set engine_options.compile_elementwise=true")
    return None


def _towers_blocker(recipe: Recipe, done: Resolved) -> Block | None:
    if recipe.model.towers is None and recipe.data.kind != "multimodal":
        return Block("the recipe has no perception towers (a text recipe: no model.towers, data.kind is not "
                     "multimodal)")
    return None


def _towers_bf16_blocker(recipe: Recipe, done: Resolved) -> Block | None:
    towers = _towers_blocker(recipe, done)
    if towers is not None:
        return towers
    if recipe.precision == "fp32":
        return Block("precision: fp32 keeps the weights, and so the towers' GEMMs, in fp32: the activations "
                     "already are in the weights' dtype", "state precision: bf16")
    return None


def _router_blocker(recipe: Recipe, done: Resolved) -> Block | None:
    if recipe.numerics.deterministic:
        return Block("numerics.deterministic is verified bitwise with megatron-core's unfused routing; TE's fused "
                     "router kernel is not", "drop numerics.deterministic")
    return None


def _unweighted_swiglu_blocker(recipe: Recipe, done: Resolved) -> Block | None:
    rc = recipe.recompute
    if rc.granularity == "selective" and "moe_act" in (rc.modules or []):
        return Block("selective recompute of moe_act runs megatron-core's own expert forward (it recomputes the "
                     "activation)", "drop moe_act from recompute.modules")
    return None


def _te_swiglu_backward_blocker(recipe: Recipe, done: Resolved) -> Block | None:
    if not _on(done, "unweighted_swiglu"):
        return Block("it is the backward of the unweighted SwiGLU (engine_options.unweighted_swiglu), which does not "
                     "run here")
    return None


def _early_counts_blocker(recipe: Recipe, done: Resolved) -> Block | None:
    lay = recipe.layout
    if (lay.dispatcher or "alltoall") != "allgather":
        return Block("it is the allgather dispatcher's; this recipe dispatches with "
                     f"{lay.dispatcher or 'alltoall'}", "set layout.dispatcher=allgather")
    if lay.tp > 1 or (lay.ep or 1) > 1:
        return Block("tokens move between ranks (layout.tp or layout.ep above 1): the routing map is gathered "
                     "first, and megatron-core's dispatcher runs unchanged")
    return None


def _clip_skip_blocker(recipe: Recipe, done: Resolved) -> Block | None:
    if not _on(done, "clip_on_device"):
        return Block("megatron-core's host clip path (engine_options.clip_on_device=false) scales only the "
                     "clipped steps already", "drop engine_options.clip_on_device=false")
    return None


def _graph_blocker(recipe: Recipe, done: Resolved) -> Block | None:
    if not _on(done, "clip_on_device"):
        return Block("a captured optimizer step cannot read the gradient norm on the host",
                     "drop engine_options.clip_on_device=false (the clip stays on the GPU)")
    if recipe.optimizer.precision_aware and recipe.optimizer.param_remainders:
        # TE optimizers/fused_adam.py: "Capturable mode doesn't support storing param remainders"
        return Block("TE's capturable FusedAdam does not keep the master weights as int16 remainders",
                     "set optimizer.param_remainders=false (a fp32 master)")
    return None


def _triton_adam_blocker(recipe: Recipe, done: Resolved) -> Block | None:
    """The Triton step is TE's FusedAdam's with fp32 master weights, stepped eagerly
    (``muse_stack/engines/mcore/adam_step.py``)."""
    opt = recipe.optimizer
    if not opt.precision_aware:
        return Block("it steps TE's FusedAdam, which holds the master weights only under optimizer.precision_aware",
                     "set optimizer.precision_aware=true")
    if opt.param_remainders:
        return Block("it keeps fp32 master weights, not optimizer.param_remainders",
                     "set optimizer.param_remainders=false")
    if _on(done, "optimizer_cuda_graph"):
        return Block("engine_options.optimizer_cuda_graph captures TE's capturable step instead")
    return None


def _embedding_blocker(recipe: Recipe, done: Resolved) -> Block | None:
    """The engine's lookup adds into main_grad where the table is whole on the rank and trains
    (``muse_stack/engines/mcore/embedding_grad.py``)."""
    if recipe.peft is not None:
        return Block("the embedding is frozen under peft")
    if recipe.layout.tp > 1:
        return Block("the table is split over layout.tp: megatron-core masks the other ranks' ids around its lookup")
    return None


def first_writes_blocker(gradient_accumulation_fusion: bool, recompute_granularity: str | None,
                         recompute_modules: list[str] | None) -> str | None:
    """Why the step's first micro-batch cannot write the main gradients under these settings (None: it can):
    the recipe's blocker below and the engine's own check on its built config
    (:func:`muse_stack.engines.mcore.first_write.why_not`) ask the same."""
    if not gradient_accumulation_fusion:
        return "gradient accumulation fusion is off: TE returns the gradients and DDP adds them"
    if recompute_granularity == "full":
        return "full recompute runs the layers' forward again in the backward"
    if recompute_granularity == "selective" and "moe" in (recompute_modules or []):
        return "selective recompute of the MoE layer runs its GEMMs' forward again in the backward"
    return None


def _first_writes_blocker(recipe: Recipe, done: Resolved) -> Block | None:
    fused = _on(done, "gradient_accumulation")
    why = first_writes_blocker(fused, recipe.recompute.granularity, recipe.recompute.modules)
    if why is None:
        return None
    return Block(why, "drop the recompute of whole layers or of the MoE layer" if fused
                 else "drop engine_options.gradient_accumulation=false")


def _towers_candidate(key: str, description: str, blocker: Blocker, prices: Priced | Unpriced, label: str,
                      what: str) -> EngineOption:
    """A candidate of the perception towers: off unless stated, installed on the model by
    muse_stack/engines/mcore/towers.py, measured by ``engine_steps.py --<label>``."""
    return EngineOption(key=key, default="off", description=description, blocker=blocker, prices=prices,
                        install=Install(module="muse_stack.engines.mcore.towers", stage="model"),
                        attribution=(Attribution(label, True, f"a candidate, not shipped: {what}"),))


#: the planner's reason for the options whose time is in its fitted constants
_FITTED = ("as the engine ships it, its time is inside the fitted efficiencies, passes and host times of "
           "TimeCalibration (fitted to runs that ran it)")

ROWS: tuple[EngineOption, ...] = (
    EngineOption(
        key="compile_elementwise", formerly="fusions", default="off",
        description="fuse the norm / gate / residual / softcap chains with torch.compile "
                    "(muse_stack/engines/mcore/fuse.py). Unset: off. The same fp32 chains compiled: the last bits "
                    "may differ",
        blocker=_nothing,
        prices=Priced("the elementwise term: TimeCalibration.elementwise_passes_compiled instead of "
                      "elementwise_passes, the compiled norm backward's bandwidth, and the memory plan's "
                      "activation factor"),
        install=Install(module="muse_stack.engines.mcore.fuse", stage="model"),
        attribution=(Attribution("eager-elementwise", False, "the elementwise chains run eagerly"),)),
    EngineOption(
        key="compile_multi_kernel", default="off",
        description="the compiled chains with TorchInductor's multi-kernel (persistent row reductions up to 16,384 "
                    "columns, benchmarked against looped ones at the first call): a candidate, measured and not "
                    "shipped (benchmarks/results/te-swiglu-backward-and-first-microbatch-writes/). Unset: off. "
                    "Another reduction kernel: the last bits may differ",
        blocker=_multi_kernel_blocker,
        prices=Unpriced("a candidate the engine does not ship: no run of the fit ran it"),
        install=Install(module="muse_stack.engines.mcore.fuse", stage="model"),
        attribution=(Attribution("inductor-multi-kernel", True,
                                 "a candidate, not shipped: the compiled elementwise chains with TorchInductor's "
                                 "multi-kernel (persistent row reductions up to 16,384 columns, benchmarked against "
                                 "looped ones)"),)),
    _towers_candidate(
        "compile_towers",
        "the vision tower's blocks through their chained forward, each chain compiled with torch.compile "
        "(muse_stack/engines/mcore/towers.py): each pre-norm with its casts to the GEMM dtype, RoPE on q and k, the "
        "exact GELU between the MLP's GEMMs and each residual add, one kernel each; v and the GEMM outputs stay in "
        "the GEMM dtype. A candidate, not yet measured on a GPU: unset, off. The same fp32 chains compiled: the last "
        "bits may differ",
        _towers_blocker,
        Unpriced("a candidate the engine does not ship: the towers' elementwise traffic is counted from their blocks "
                 "as written (muse_stack/plan/tower_traffic.json)"),
        "compiled-towers", "the vision tower's elementwise chains compiled"),
    _towers_candidate(
        "towers_bf16_activations",
        "the vision tower's activations in the weights' dtype (bf16) between its GEMMs, as transformers runs the "
        "tower in bf16 (muse_stack/engines/mcore/towers.py): no cast around any GEMM, and the norms, GELU, residual "
        "adds and attention gathers read and write bf16; LayerNorm and GELU compute in fp32 inside their kernels, "
        "RoPE in fp32 as transformers does. A candidate, not yet measured on a GPU: unset, off. Changes numerics: "
        "the residual stream is rounded to bf16 at every add (tests/unit/test_towers_bf16_activations.py holds it "
        "to transformers' own bf16 tower)",
        _towers_bf16_blocker,
        Priced("the towers' term: their memory traffic counted with bf16 activations "
               "(muse_stack/plan/tower_traffic.json), and the memory plan's kept vision activations at 2 bytes"),
        "bf16-towers", "the vision tower's activations in bf16"),
    _towers_candidate(
        "towers_varlen_attention",
        "each vision layer's attention in one variable-length call over its frames or windows (PyTorch's "
        "varlen_attn), the blocks running on the patches in window order as transformers orders them "
        "(muse_stack/engines/mcore/towers.py): no gather or scatter per layer, one kernel per layer instead of one "
        "per group size. A candidate, not yet measured on a GPU: unset, off; off where this torch has no "
        "varlen_attn (the fingerprint says why). The same function; another attention kernel and another order of "
        "the weight gradients' sums: the last bits may differ",
        _towers_blocker,
        Unpriced("a candidate the engine does not ship: the towers' traffic is counted with their grouped "
                 "attention's gathers and scatters (muse_stack/plan/tower_traffic.json)"),
        "varlen-towers", "the vision tower's attention in one variable-length call a layer"),
    EngineOption(
        key="gradient_accumulation", formerly="fusions", default="on",
        description="megatron-core's gradient_accumulation_fusion: TE's weight-gradient GEMMs (the experts' grouped "
                    "GEMMs among them) accumulate in fp32 straight into main_grad. Unset: on. false changes "
                    "numerics: each micro-batch's weight gradient is written in bf16 and then added to main_grad by "
                    "megatron-core's DDP",
        blocker=_nothing, prices=Unpriced(_FITTED),
        install=Install(config=("transformer", "gradient_accumulation_fusion")),
        attribution=(Attribution("no-wgrad-accumulation-fusion", False,
                                 "TE's weight gradients written in bf16 and added by DDP"),)),
    EngineOption(
        key="permute", formerly="fusions", default="on",
        description="megatron-core's moe_permute_fusion (TE's fused token permute and unpermute around the "
                    "experts). Unset: on. false: megatron-core's torch permutation, whose unpermute sums each "
                    "token's expert outputs in another order (may change bf16 rounding)",
        blocker=_nothing, prices=Unpriced(_FITTED),
        install=Install(config=("transformer", "moe_permute_fusion")),
        attribution=(Attribution("no-permute-fusion", False, "megatron-core's torch token permutation"),)),
    EngineOption(
        key="router", formerly="fusions", default="off",
        description="megatron-core's moe_router_fusion (TE's fused sigmoid, expert bias, top-k and normalisation in "
                    "one kernel). Unset: off. true computes the same fp32 routing in another order: may change the "
                    "last bits of the routing weights (not with numerics.deterministic)",
        blocker=_router_blocker,
        prices=Unpriced("the model prices the routing the engine ships (unfused); the fused kernel's time is not "
                        "modelled"),
        install=Install(config=("transformer", "moe_router_fusion")),
        attribution=(Attribution("router-fusion", True, "TE's fused router kernel"),)),
    EngineOption(
        key="unweighted_swiglu", default="on",
        description="the experts' SwiGLU between the two grouped GEMMs without the routing weight (it comes after "
                    "the post-expert norm): megatron-core's unweighted fused SwiGLU. false: its weighted one given "
                    "ones, which also reduces a gradient for those ones that nothing reads "
                    "(muse_stack/engines/mcore/layers.py). Unset: on where it applies. The same function (the weights "
                    "are ones); the weighted kernels' backward may round the last bit otherwise",
        blocker=_unweighted_swiglu_blocker, prices=Unpriced(_FITTED),
        install=Install(module="muse_stack.engines.mcore.layers", stage="model"),
        attribution=(Attribution("weighted-swiglu", False,
                                 "the experts' SwiGLU as the engine ran it before: megatron-core's weighted one, "
                                 "given ones"),)),
    EngineOption(
        key="te_swiglu_backward", default="on",
        description="that SwiGLU's backward by Transformer Engine's dswiglu kernel (the forward is megatron-core's "
                    "compiled one either way; layers.SwiGLUTEBackward). false: megatron-core's compiled backward. "
                    "Unset: on where the unweighted SwiGLU runs. Both compute in fp32 and round once; another kernel "
                    "may round the last bit otherwise",
        blocker=_te_swiglu_backward_blocker, prices=Unpriced(_FITTED),
        install=Install(module="muse_stack.engines.mcore.layers", stage="model"),
        attribution=(Attribution("mcore-swiglu", False,
                                 "the experts' SwiGLU backward as megatron-core's compiled one instead of TE's "
                                 "dswiglu"),)),
    EngineOption(
        key="one_pass_norm_backward", default="on",
        description="the post-expert norm's backward as one Triton pass over its input "
                    "(muse_stack/engines/mcore/norm_backward.py) instead of the compiled chain's own (TorchInductor's "
                    "row pass and a column sum that reads the input again). Unset: on (with Triton). The same "
                    "function in fp32, summed in another order: the last bits may differ",
        blocker=_nothing,
        prices=Priced("the post-expert norm's backward at its kernel's measured bandwidth "
                      "(TimeCalibration.norm_backward_bandwidth_one_pass or _compiled)",
                      kernel="post_expert_norm_backward", on="one_pass", off="compiled"),
        install=Install(module="muse_stack.engines.mcore.layers", stage="model"),
        attribution=(
            Attribution("compiled-norm-backward", False,
                        "the post-expert norm's backward as the compiled chain's (TorchInductor) instead of one "
                        "Triton pass (muse_stack/engines/mcore/norm_backward.py)"),
            Attribution("fused-norm-backward", True,
                        "the post-expert norm's backward as one Triton pass, as shipped since "
                        "benchmarks/results/embedgrad/ (the runs in normbwd/, adam/ and embedgrad/ name it)"))),
    EngineOption(
        key="early_expert_counts", default="on",
        description="the allgather dispatcher copies the experts' token counts to the host before the latent GEMM, "
                    "without blocking, and permutes the routing weights with the tokens instead of masked_select "
                    "(muse_stack/engines/mcore/dispatch.py). Unset: on where it applies (the allgather dispatcher at "
                    "layout.tp 1 and layout.ep 1, where the dispatch moves no tokens). The same numbers: every step "
                    "is a copy of one element",
        blocker=_early_counts_blocker, prices=Unpriced(_FITTED),
        install=Install(module="muse_stack.engines.mcore.dispatch", stage="model"),
        attribution=(Attribution("late-counts", False,
                                 "the experts' token counts as megatron-core's allgather dispatcher reads them: "
                                 ".cpu() after the latent GEMM, then masked_select"),)),
    EngineOption(
        key="fused_pre_mlp_norm", default="on",
        description="the post-attention residual and the pre-MLP norm as one chain, whose backward sums the "
                    "stream's two gradients (chains.post_attention_residual_and_norm); false: two chains, the norm "
                    "through its module. Unset: on. The same operations; compiled code may sum in another order "
                    "(the last bits)",
        blocker=_nothing, prices=Unpriced(_FITTED),
        install=Install(module="muse_stack.engines.mcore.layers", stage="model"),
        attribution=(Attribution("separate-pre-mlp-norm", False,
                                 "the pre-MLP norm as its own chain after the post-attention residual's"),)),
    EngineOption(
        key="overlap_grad_reduce", formerly="performance", default="off",
        description="megatron-core DDP's overlap_grad_reduce: each gradient bucket is reduced while the backward "
                    "continues, instead of all at once after it. Unset: off. The same reduction of the same buckets "
                    "(no numerics change intended)",
        blocker=_nothing,
        prices=Priced("the DP gradient reduce: hidden under the last micro-batch's backward but for its last "
                      "bucket"),
        install=Install(config=("ddp", "overlap_grad_reduce")),
        attribution=(Attribution("overlap-grad-reduce", True, "DDP's gradient reduce overlapped with the "
                                                              "backward"),)),
    EngineOption(
        key="clip_on_device", formerly="performance", default="on",
        description="the gradient clip without a host sync: megatron-core keeps the norm and the clip coefficient on "
                    "the GPU and scales the gradients by it there (see engine_options.clip_skip_unclipped). Unset: "
                    "on. false: megatron-core's host path, which reads the norm on the host and scales only when it "
                    "exceeds optimizer.clip_grad (the coefficient in double instead of fp32: a clipped step may "
                    "differ in the last bits)",
        blocker=_nothing, prices=Unpriced(_FITTED),
        install=Install(module="muse_stack.engines.mcore.clip_scale", stage="optimizer"),
        attribution=(Attribution("clip-host-sync", False, "megatron-core's host clip path (.item())"),)),
    EngineOption(
        key="clip_skip_unclipped", default="on",
        description="the clip's scale as a Triton kernel that reads the coefficient on the GPU and makes no pass "
                    "when it is exactly 1, as on every step whose norm is below optimizer.clip_grad, in the place of "
                    "TE's multi_tensor_scale_tensor every step (muse_stack/engines/mcore/clip_scale.py). Unset: on "
                    "where it applies (engine_options.clip_on_device). The same numbers (a product with 1 is exact; "
                    "a NaN gradient stays the NaN it was)",
        blocker=_clip_skip_blocker, prices=Unpriced(_FITTED),
        install=Install(module="muse_stack.engines.mcore.clip_scale", stage="optimizer"),
        attribution=(Attribution("te-clip-scale", False,
                                 "the clip's scale as megatron-core runs it: TE's multi_tensor_scale_tensor every "
                                 "step"),)),
    EngineOption(
        key="optimizer_cuda_graph", formerly="performance", default="off",
        description="capture the optimizer step (norm, clip, Adam, the parameter copy) in a CUDA graph and replay it "
                    "(megatron-core's optimizer_cuda_graph and OptimizerCudaGraphWrapper, after "
                    "cuda_graph_warmup_steps eager steps). Unset: off. TE's capturable Adam keeps the learning rate "
                    "and step count on the GPU: may change the last bits of the update. Needs "
                    "engine_options.clip_on_device and a fp32 master (not optimizer.param_remainders)",
        blocker=_graph_blocker,
        prices=Unpriced("the graph's own time is not modelled; its capturable step is priced as TE's Adam update "
                        "(engine_options.triton_adam cannot apply under it)"),
        install=Install(config=("optimizer", "optimizer_cuda_graph"), module="muse_stack.engines.mcore.optimizer_graph",
                        stage="optimizer"),
        attribution=(Attribution("optimizer-cuda-graph", True, "the optimizer step captured in a CUDA graph"),)),
    EngineOption(
        key="triton_adam", formerly="performance", default="on",
        description="Transformer Engine's FusedAdam (optimizer.precision_aware, fp32 master weights) steps through "
                    "one persistent Triton launch per parameter group instead of TE's multi_tensor_adam launches "
                    "(muse_stack/engines/mcore/adam_step.py). Unset: on where it applies (not with "
                    "optimizer.param_remainders or engine_options.optimizer_cuda_graph). TE's arithmetic in the same "
                    "order; where nvcc contracted a multiply-add otherwise, the update may differ in the last bit "
                    "of fp32",
        blocker=_triton_adam_blocker,
        prices=Priced("the Adam update's bytes at its kernel's measured share of the HBM bandwidth "
                      "(TimeCalibration.adam_bandwidth_triton or _te)", kernel="adam", on="triton", off="te"),
        install=Install(module="muse_stack.engines.mcore.adam_step", stage="optimizer"),
        attribution=(Attribution("te-adam", False,
                                 "the Adam step as TE's FusedAdam runs it: multi_tensor_adam launches instead of one "
                                 "Triton launch per parameter group (muse_stack/engines/mcore/adam_step.py)"),)),
    EngineOption(
        key="embedding_into_main_grad", formerly="performance", default="on",
        description="The word embedding's backward adds each token's gradient, in fp32, into the table's main "
                    "gradient instead of building a dense bf16 gradient of the whole table for megatron-core's DDP "
                    "to add (muse_stack/engines/mcore/embedding_grad.py). Unset: on where it applies (layout.tp 1, "
                    "the embedding trains). A row's sum over a micro-batch is no longer rounded to bf16 before it "
                    "is added: the embedding's gradient may differ by that rounding",
        blocker=_embedding_blocker,
        prices=Priced("the word embedding's gradient on the first stage at the HBM bandwidth (none where the table "
                      "is frozen)", kernel="embedding_grad", on="main_grad", off="dense"),
        install=Install(module="muse_stack.engines.mcore.embedding_grad", stage="optimizer"),
        attribution=(Attribution("dense-embedding-grad", False,
                                 "the word embedding's backward as megatron-core's: a dense bf16 gradient of the "
                                 "table, added into main_grad by DDP (muse_stack/engines/mcore/embedding_grad.py)"),)),
    EngineOption(
        key="first_micro_batch_writes", formerly="performance", default="on",
        description="the step's first micro-batch has Transformer Engine's weight-gradient GEMMs write the decoder "
                    "weights' main gradients (TE's overwrite_main_grad) instead of adding them to zeros, and the "
                    "step zeroes only the rest of megatron-core's grad buffers (muse_stack/engines/mcore/"
                    "first_write.py). Unset: on where it applies (gradient accumulation fusion, no recompute). The "
                    "same gradients; cuBLAS may pick another kernel for a written output than for an added one, so "
                    "the first micro-batch's weight gradients may differ in the last bits",
        blocker=_first_writes_blocker, prices=Unpriced(_FITTED),
        install=Install(module="muse_stack.engines.mcore.first_write", stage="optimizer"),
        attribution=(Attribution("zero-whole-grad-buffer", False,
                                 "the grad buffer zeroed whole every step (megatron-core's zero_grad_buffer)"),)),
)

#: the rows by key
BY_KEY: dict[str, EngineOption] = {row.key: row for row in ROWS}


def row(key: str) -> EngineOption:
    try:
        return BY_KEY[key]
    except KeyError:
        raise RecipeError("not an engine option", field=f"{SECTION}.{key}", value=key,
                          fix=f"use one of {', '.join(BY_KEY)} (muse_stack/recipes/options.py)") from None


def stated(recipe: Recipe, key: str) -> bool | None:
    return getattr(recipe.engine_options, key)


def resolve(recipe: Recipe) -> dict[str, Resolution]:
    """The options of the recipe's engine, in table order, each as resolved (see the module's text); an
    option of another engine is absent (it does not apply)."""
    done: dict[str, Resolution] = {}
    for r in ROWS:
        if recipe.engine not in r.engines:
            continue
        given = stated(recipe, r.key)
        block = r.blocker(recipe, done)
        value = bool(given) if given is not None else (r.default == "on" and block is None)
        done[r.key] = Resolution(value=value and block is None, stated=given, block=block, default=r.default,
                                 conditional=r.blocker is not _nothing)
    return done


def is_on(resolved: Resolved, key: str) -> bool:
    """Whether ``key`` is on (an option that does not apply to the engine is off)."""
    return _on(resolved, row(key).key)


def why_not(recipe: Recipe, key: str) -> str | None:
    """Why ``key`` cannot apply to ``recipe`` (None: it can)."""
    block = resolve(recipe)[row(key).key].block
    return block.reason if block is not None else None


def check(recipe: Recipe) -> None:
    """Refuse an option stated ``true`` where its blocker says it cannot apply, naming the option, the
    reason and the fix."""
    for key, r in resolve(recipe).items():
        if r.stated and r.block is not None:
            opt = BY_KEY[key]
            fix = f"drop {opt.field}" + (f", or {r.block.remedy}" if r.block.remedy else "")
            if opt.default == "on":
                fix += " (unset, it applies where it can)"
            raise RecipeError(f"{opt.field} cannot apply: {r.block.reason}", field=opt.field, value=True, fix=fix)


def config_fields(resolved: Resolved, config: str) -> dict[str, bool]:
    """The megatron-core ``config`` fields (``transformer``, ``ddp`` or ``optimizer``) the options set."""
    return {r.install.config[1]: _on(resolved, r.key) for r in ROWS
            if r.install.config is not None and r.install.config[0] == config and r.key in resolved}


def installed_at(stage: str) -> tuple[EngineOption, ...]:
    """The options with an install function at ``stage``, in table order."""
    return tuple(r for r in ROWS if r.install.module is not None and r.install.stage == stage)


def bridge_keys() -> dict[str, str]:
    """Megatron-Bridge ConfigContainer key -> recipe field, for each option that is a megatron-core config
    field (``model.moe_permute_fusion`` -> ``engine_options.permute``)."""
    return {f"{CONFIGS[r.install.config[0]]}.{r.install.config[1]}": r.field for r in ROWS
            if r.install.config is not None}


def attribution_flags() -> dict[str, tuple[EngineOption, Attribution]]:
    """Each ``engine_steps.py`` flag (``--label``) with its option and attribution."""
    return {a.flag: (r, a) for r in ROWS for a in r.attribution}


def kernels(recipe: Recipe, resolved: Resolved | None = None) -> dict[str, str]:
    """The :class:`~muse_stack.plan.cost.StepKernels` fields the options choose: each priced kernel's ``on``
    or ``off`` value as resolved for ``recipe``."""
    resolved = resolve(recipe) if resolved is None else resolved
    return {r.prices.kernel: r.prices.on if _on(resolved, r.key) else r.prices.off for r in ROWS
            if isinstance(r.prices, Priced) and r.prices.kernel is not None}


# ---- the sections before engine_options ------------------------------------------------------------
def _moved(section: str, key: str, path: str) -> EngineOption:
    r = BY_KEY.get(key)
    if r is None or r.formerly != section:
        raise RecipeError(f"{section}.{key} is not an engine option", field=path, value=key,
                          fix=f"the {section} section's keys are now under {SECTION} (muse_stack/recipes/options.py: "
                              f"{', '.join(r.key for r in ROWS if r.formerly == section)})")
    return r


#: the deprecation warnings given in this process (each once)
_WARNED: dict = {}


def _warn(old: str, new: str) -> None:
    warnings.warn_explicit(f"{old} is deprecated: the engine options are one section now; write {new} "
                           "(muse-stack show RECIPE prints the recipe in the new form)", FutureWarning,
                           filename="muse-stack", lineno=0, module=__name__, registry=_WARNED)


def migrate_path(path: list[str]) -> list[str]:
    """An override's path: ``fusions.X`` or ``performance.X`` becomes ``engine_options.X`` (with a warning)."""
    if len(path) >= 2 and path[0] in LEGACY_SECTIONS:
        r = _moved(path[0], path[1], ".".join(path))
        new = [SECTION, r.key, *path[2:]]
        _warn(".".join(path), ".".join(new))
        return new
    return path


def migrate(data: dict[str, Any], *, warn: bool = True) -> dict[str, Any]:
    """A raw recipe with its ``fusions`` and ``performance`` sections (and notes under them) moved into
    ``engine_options`` (with a warning naming each, unless ``warn`` is off: a recipe recorded in a run
    directory, read as a record); a value stated in both places must agree."""
    if not any(s in data for s in LEGACY_SECTIONS):
        return data
    out = dict(data)
    options = out.get(SECTION)
    options = dict(options) if isinstance(options, dict) else {} if options is None else options
    if not isinstance(options, dict):
        return data  # the schema names the error
    for section in LEGACY_SECTIONS:
        if section not in out:
            continue
        old = out.pop(section)
        if old is None:
            continue
        if not isinstance(old, dict):
            raise RecipeError(f"{section} must be a mapping of engine options", field=section, value=old,
                              fix=f"write the options under {SECTION}")
        for key, value in old.items():
            r = _moved(section, str(key), f"{section}.{key}")
            if value is None:
                continue
            if options.get(r.key) is not None and options[r.key] != value:
                raise RecipeError(f"{section}.{key} and {r.field} disagree", field=r.field, value=options[r.key],
                                  fix=f"state it once, as {r.field} ({section} is the section it was in before)")
            options[r.key] = value
            if warn:
                _warn(f"{section}.{key}", r.field)
    out[SECTION] = options
    notes = out.get("notes")
    if isinstance(notes, dict):
        out["notes"] = {_note_path(k): v for k, v in notes.items()}
    return out


def _note_path(path: Any) -> Any:
    parts = str(path).split(".")
    if len(parts) >= 2 and parts[0] in LEGACY_SECTIONS and parts[1] in BY_KEY:
        return ".".join([SECTION, *parts[1:]])
    return path

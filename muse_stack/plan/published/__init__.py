"""Published training runs the step-time model is checked on: their sources, layouts and figures.

``bridge-moe.yaml`` beside this module holds Megatron-Bridge's published MoE pre-training runs (the models'
shapes from their public configs, each run's system, layout and tokens/s/GPU as the page prints them), the
settings each run used according to Megatron-Bridge's source (``run_settings``: corrected layout fields, selective
recompute, the cross-entropy implementation, dispatcher, CUDA graphs, A2A overlap, each with its citation) and the validation protocol declared
with them: which rows may fit a constant, and which constants. :func:`load` validates the file and the
protocol's rules (at most a third of the rows fit; no fit row shares its model and system with a validation
row; every row has its run settings, each cited at a commit the file names), so a file that breaks them is
refused with the field named. :meth:`Published.run` is a row as it ran: what the planner prices.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Generic, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from muse_stack.util.errors import InputError

FILE = Path(__file__).with_name("bridge-moe.yaml")
Precision = Literal["bf16", "fp8-cs", "fp8-mx"]
#: the modules a selective recompute can name (megatron-core's recompute_modules that these runs use)
Recompute = Literal["moe_act", "layernorm", "mla_up_proj", "mlp"]
#: the token dispatcher: megatron-core's alltoall, or the flex dispatcher with its HybridEP or DeepEP backend
Dispatcher = Literal["alltoall", "hybridep", "deepep"]
#: TransformerEngine CUDA-graph scopes (cuda_graph_scope) the runs capture
GraphScope = Literal["attn", "moe_router", "moe_preprocess"]
#: the loss over the logits: TransformerEngine's fused parallel_cross_entropy (megatron-core's
#: cross_entropy_loss_fusion with cross_entropy_fusion_impl "te"), or a cross-entropy that does not write its
#: gradient into the logits in place; muse_stack.plan.scale prices the logits' memory by it (LOGITS_BYTES)
CrossEntropy = Literal["te-fused", "unfused"]
#: one citation: a commit (abbreviated to the nine characters ``settings_sources`` names it by), a path in that
#: commit's repository and its lines; several joined by "; "
CITE = r"[0-9a-f]{9} [\w./-]+:\d+(-\d+)?(,\d+(-\d+)?)*"
CITATION = rf"^{CITE}(; {CITE})*$"
T = TypeVar("T")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MoeShape(_Strict):
    """A MoE decoder's shapes as the step-time model needs them (the fields of its config.json).

    ``attention``: ``gqa`` (q/k/v/o projections, ``num_key_value_heads`` key-value heads of ``head_dim``) or
    ``mla`` (multi-head latent attention: a query latent of ``q_lora_rank``, a key-value latent of
    ``kv_lora_rank`` plus a shared RoPE key of ``qk_rope_head_dim``, heads of ``qk_head_dim +
    qk_rope_head_dim`` query-key and ``v_head_dim`` value dimensions). ``sliding_window`` with
    ``sliding_every`` k: every k-th layer, from the first, attends to the last ``sliding_window`` keys (GPT-OSS
    alternates). ``dense_layers``: leading layers whose MLP is a dense SwiGLU of ``dense_ffn_hidden_size``
    (DeepSeek-V3's first three); the others route to ``experts_per_token`` of ``num_experts`` SwiGLU experts
    of ``moe_ffn_hidden_size``, beside a shared expert of ``shared_ffn_hidden_size`` (0: none).
    ``mtp_layers``: multi-token-prediction layers the model has (a run says whether it trains them)."""

    source: str = Field(min_length=1)
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    attention: Literal["gqa", "mla"]
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)
    q_lora_rank: int | None = Field(None, gt=0)
    kv_lora_rank: int | None = Field(None, gt=0)
    qk_head_dim: int | None = Field(None, gt=0)
    qk_rope_head_dim: int | None = Field(None, gt=0)
    v_head_dim: int | None = Field(None, gt=0)
    sliding_window: int | None = Field(None, gt=0)
    sliding_every: int = Field(1, gt=0)
    attention_sinks: bool = False
    dense_layers: int = Field(0, ge=0)
    dense_ffn_hidden_size: int = Field(0, ge=0)
    num_experts: int = Field(gt=0)
    experts_per_token: int = Field(gt=0)
    moe_ffn_hidden_size: int = Field(gt=0)
    shared_ffn_hidden_size: int = Field(0, ge=0)
    vocab_size: int = Field(gt=0)
    mtp_layers: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _fields_of_kind(self) -> "MoeShape":
        need = (("num_key_value_heads", "head_dim") if self.attention == "gqa" else
                ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_rope_head_dim", "v_head_dim"))
        missing = [n for n in need if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{self.attention} attention states {', '.join(missing)}")
        if self.attention == "gqa" and self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.experts_per_token > self.num_experts:
            raise ValueError("experts_per_token exceeds num_experts")
        if self.dense_layers and not self.dense_ffn_hidden_size:
            raise ValueError("dense_layers needs dense_ffn_hidden_size")
        if self.dense_layers >= self.num_layers:
            raise ValueError("dense_layers must leave at least one MoE layer")
        return self

    # ---- per-layer shapes ---------------------------------------------------------------
    @property
    def q_width(self) -> int:
        """Query width (heads x query-key dimension)."""
        if self.attention == "gqa":
            return self.num_attention_heads * self.head_dim
        return self.num_attention_heads * (self.qk_head_dim + self.qk_rope_head_dim)

    @property
    def kv_width(self) -> int:
        """Key width of one token as attention reads it (GQA: the key-value heads; MLA: every head's key)."""
        if self.attention == "gqa":
            return self.num_key_value_heads * self.head_dim
        return self.q_width

    @property
    def v_width(self) -> int:
        if self.attention == "gqa":
            return self.num_key_value_heads * self.head_dim
        return self.num_attention_heads * self.v_head_dim

    @property
    def core_out_width(self) -> int:
        """Attention output width (heads x value dimension): the output projection's input."""
        if self.attention == "gqa":
            return self.num_attention_heads * self.head_dim
        return self.num_attention_heads * self.v_head_dim

    def attention_gemms(self) -> list[tuple[int, int, bool]]:
        """The attention block's projections as (input width, output width, split over TP)."""
        h = self.hidden_size
        if self.attention == "gqa":
            return [(h, self.q_width + 2 * self.kv_width, True), (self.core_out_width, h, True)]
        heads = self.num_attention_heads
        return [(h, self.q_lora_rank, False), (self.q_lora_rank, self.q_width, True),
                (h, self.kv_lora_rank + self.qk_rope_head_dim, False),
                (self.kv_lora_rank, heads * (self.qk_head_dim + self.v_head_dim), True),
                (self.core_out_width, h, True)]

    def attention_dims(self) -> tuple[int, int]:
        """(query-key, value) dimensions summed over the heads: the core's FLOPs per query and key are
        ``2 x (qk + v)``."""
        return self.q_width, self.core_out_width

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and layer % self.sliding_every == 0

    def is_moe(self, layer: int) -> bool:
        return layer >= self.dense_layers

    # ---- parameters ---------------------------------------------------------------------
    @property
    def attention_params(self) -> int:
        return sum(k * n for k, n, _ in self.attention_gemms())

    @property
    def expert_params(self) -> int:
        """One routed SwiGLU expert."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    def dense_params(self, layer: int) -> int:
        """Weights of a layer every token uses: attention, and the dense MLP or the router and shared expert."""
        h = self.hidden_size
        mlp = (h * self.num_experts + 3 * h * self.shared_ffn_hidden_size) if self.is_moe(layer) \
            else 3 * h * self.dense_ffn_hidden_size
        return self.attention_params + mlp

    def layer_expert_params(self, layer: int) -> int:
        return self.num_experts * self.expert_params if self.is_moe(layer) else 0

    def total_params(self) -> int:
        layers = range(self.num_layers)
        return (sum(self.dense_params(i) + self.layer_expert_params(i) for i in layers)
                + 2 * self.vocab_size * self.hidden_size)

    def active_params(self) -> int:
        """Weights one token's GEMMs use, embedding excluded (the output layer included)."""
        layers = range(self.num_layers)
        return (sum(self.dense_params(i) + (self.experts_per_token * self.expert_params if self.is_moe(i) else 0)
                    for i in layers) + self.vocab_size * self.hidden_size)

    def mean_keys(self, layer: int, seq: int) -> float:
        if self.is_sliding(layer):
            w = self.sliding_window
            return (w * (w + 1) / 2 + (seq - w) * w) / seq if seq > w else (seq + 1) / 2
        return (seq + 1) / 2

    def training_flops_per_token(self, seq: int, mtp: bool = False) -> float:
        """Model FLOPs of one trained token: 3 x the forward (2 per weight of each GEMM it uses, and the
        causal attention core), MTP's layer and its output GEMM when the run trains them."""
        qk, v = self.attention_dims()
        core = sum(2 * (qk + v) * self.mean_keys(i, seq) for i in range(self.num_layers))
        fwd = 2 * self.active_params() + core
        if mtp and self.mtp_layers:
            last = self.num_layers - 1
            fwd += self.mtp_layers * (2 * (self.dense_params(last) + self.experts_per_token * self.expert_params
                                           + 2 * self.hidden_size ** 2 + self.vocab_size * self.hidden_size)
                                      + 2 * (qk + v) * self.mean_keys(last, seq))
        return 3 * fwd


class Source(_Strict):
    page: str
    archive: str
    commit: str = Field(pattern=r"^[0-9a-f]{40}$")
    container: str
    section: str
    etp_source: str


class Fitted(_Strict):
    name: str
    what: str


class Goal(_Strict):
    median_abs_error: float = Field(gt=0)
    max_abs_error: float = Field(gt=0)
    validation_generations: list[str]


class Amendment(_Strict):
    """A change to the protocol after it was declared: when, whether errors had been seen, what changed."""

    date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")
    after_errors_seen: bool
    change: str = Field(min_length=1)
    refitted: list[str] = []  #: the fitted constants refitted (names of ``fitted``)
    result_before: str | None = None  #: the result folder that keeps what was found before the change


class Protocol(_Strict):
    declared: str
    fit_rows: list[str]
    fitted: list[Fitted]
    amendments: list[Amendment] = []
    goal: Goal

    @model_validator(mode="after")
    def _refitted_are_fitted(self) -> "Protocol":
        names = {f.name for f in self.fitted}
        for i, a in enumerate(self.amendments):
            unknown = [n for n in a.refitted if n not in names]
            if unknown:
                raise ValueError(f"amendments.{i}.refitted: {unknown[0]} is not a fitted constant")
        return self


class System(_Strict):
    machine: str  #: a row of muse_stack/machine/machines.yaml
    inter: str  #: a fabric of muse_stack/machine/machines.yaml: the system's scale-out network
    per_node: int = Field(gt=0)
    note: str


class _Layout(_Strict):
    """A run's GPUs, precision, batch and parallel layout."""

    gpus: int = Field(gt=0)
    precision: Precision
    gbs: int = Field(gt=0)
    mbs: int = Field(gt=0)
    seq: int = Field(gt=0)
    tp: int = Field(gt=0)
    pp: int = Field(gt=0)
    cp: int = Field(gt=0)
    vp: int = Field(gt=0)
    ep: int = Field(gt=0)
    etp: int = Field(1, gt=0)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def microbatches(self) -> int:
        """Micro-batches of a step, as megatron-core runs them: GBS / (MBS x DP)."""
        return self.gbs // (self.mbs * self.dp)

    @model_validator(mode="after")
    def _layout(self):
        if self.gpus % (self.tp * self.pp * self.cp):
            raise ValueError(f"{self.gpus} GPUs are not a multiple of TP x PP x CP")
        if (self.gpus // self.pp) % (self.ep * self.etp):
            raise ValueError("EP x ETP must divide the GPUs of a pipeline stage")
        if self.gbs % (self.mbs * self.dp):
            raise ValueError("GBS must be a multiple of MBS x DP")
        return self


class Row(_Layout):
    """One published run as the page prints it: its layout and its tokens/s/GPU."""

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    model: str
    label: str  #: the page's model column
    mtp: bool = False  #: the run trains the model's MTP layers ("w/ MTP")
    system: str
    ga: int = Field(gt=0)  #: the page's GA column (the run's is GBS / (MBS x DP): run_settings.ga where they differ)
    published_tokens_per_s_per_gpu: float = Field(gt=0)
    published_tflops: float = Field(gt=0)


class Cited(_Strict, Generic[T]):
    """One setting of a run and where the source states it."""

    value: T
    source: str = Field(pattern=CITATION)  #: "<commit> <path>:<lines>[; ...]", the commit named in settings_sources


class RunSettings(_Strict):
    """What a run used where the page prints another value or none, each setting with its citation.

    ``ep``, ``mbs``, ``vp``, ``ga``, ``mtp``: the run's where they differ from (or confirm) the page's columns;
    ``recompute``: the selective recompute modules that act; ``overlap_param_gather``: where the preset turns it
    off (on otherwise); ``cross_entropy``: the loss's implementation, which sets the logits' memory;
    ``dispatcher``, ``cuda_graphs``, ``a2a_overlap``: stated, not priced."""

    ep: Cited[int] | None = None
    mbs: Cited[int] | None = None
    vp: Cited[int] | None = None
    ga: Cited[int] | None = None
    mtp: Cited[bool] | None = None
    recompute: Cited[list[Recompute]]
    overlap_param_gather: Cited[bool] | None = None
    cross_entropy: Cited[CrossEntropy]
    dispatcher: Cited[Dispatcher]
    cuda_graphs: Cited[list[GraphScope]]
    a2a_overlap: Cited[bool]
    note: str = ""

    @model_validator(mode="after")
    def _positive(self) -> "RunSettings":
        for name in ("ep", "mbs", "vp", "ga"):
            setting = getattr(self, name)
            if setting is not None and setting.value <= 0:
                raise ValueError(f"{name}: {setting.value} must be positive")
        return self


#: the layout fields a run's settings may correct
CORRECTABLE = ("ep", "mbs", "vp", "mtp")


class Run(_Layout):
    """A published run as it ran: the page's columns with its run settings applied. What the planner prices."""

    id: str
    model: str
    system: str
    mtp: bool
    recompute: list[Recompute]
    overlap_param_gather: bool = True
    cross_entropy: CrossEntropy
    dispatcher: Dispatcher
    cuda_graphs: list[GraphScope]
    a2a_overlap: bool


class SettingsSource(_Strict):
    repo: str = Field(pattern=r"^[\w.-]+/[\w.-]+$")
    commit: str = Field(pattern=r"^[0-9a-f]{40}$")
    what: str = Field(min_length=1)


class Published(_Strict):
    source: Source
    protocol: Protocol
    systems: dict[str, System]
    models: dict[str, MoeShape]
    rows: list[Row]
    settings_sources: dict[str, SettingsSource]
    run_settings: dict[str, RunSettings]

    @model_validator(mode="after")
    def _protocol(self) -> "Published":
        ids = [r.id for r in self.rows]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"rows: id {dupes[0]} appears twice")
        for r in self.rows:
            if r.model not in self.models:
                raise ValueError(f"rows.{r.id}.model: {r.model} is not in models")
            if r.system not in self.systems:
                raise ValueError(f"rows.{r.id}.system: {r.system} is not in systems")
        unknown = sorted(set(self.protocol.fit_rows) - set(ids))
        if unknown:
            raise ValueError(f"protocol.fit_rows: {unknown[0]} is no row")
        fit = set(self.protocol.fit_rows)
        if 3 * len(fit) > len(self.rows):
            raise ValueError(f"protocol.fit_rows: {len(fit)} of {len(self.rows)} rows fit; at most a third may")
        fit_pairs = {(r.model, r.system) for r in self.rows if r.id in fit}
        for r in self.rows:
            if r.id not in fit and (r.model, r.system) in fit_pairs:
                raise ValueError(f"protocol.fit_rows: validation row {r.id} has the model and system of a fit row")
        self._check_run_settings(ids)
        return self

    def _check_run_settings(self, ids: list[str]) -> None:
        for key in self.settings_sources:
            if not re.fullmatch(r"[0-9a-f]{9}", key) or not self.settings_sources[key].commit.startswith(key):
                raise ValueError(f"settings_sources.{key}: name a source by its commit's first nine characters")
        missing = [i for i in ids if i not in self.run_settings]
        if missing:
            raise ValueError(f"run_settings.{missing[0]}: every row states its run settings, with their sources")
        unknown = sorted(set(self.run_settings) - set(ids))
        if unknown:
            raise ValueError(f"run_settings.{unknown[0]}: no row has this id")
        for r in self.rows:
            settings = self.run_settings[r.id]
            for name in RunSettings.model_fields:
                setting = getattr(settings, name)
                if not isinstance(setting, Cited):
                    continue
                for part in setting.source.split("; "):
                    commit = part.split(" ", 1)[0]
                    if commit not in self.settings_sources:
                        raise ValueError(f"run_settings.{r.id}.{name}.source: commit {commit} is not in "
                                         "settings_sources")
            try:
                run = self.run(r.id)
            except ValidationError as e:
                raise ValueError(f"run_settings.{r.id}: the run's layout does not split: {e.errors()[0]['msg']}") \
                    from None
            ga = settings.ga.value if settings.ga else r.ga
            if ga != run.microbatches:
                where = "run_settings" if settings.ga else "rows"
                raise ValueError(
                    f"{where}.{r.id}.ga: {ga} is not GBS / (MBS x DP) = {r.gbs} / ({run.mbs} x {run.dp}) of the run; "
                    "state the run's in run_settings with its source")

    def role(self, row_id: str) -> Literal["fit", "validation"]:
        return "fit" if row_id in self.protocol.fit_rows else "validation"

    def row(self, row_id: str) -> Row:
        """The row as the page prints it."""
        for r in self.rows:
            if r.id == row_id:
                return r
        raise InputError(f"no published run {row_id!r}", field="ROW", value=row_id,
                         fix=f"give one of {', '.join(r.id for r in self.rows)} ({FILE.name})")

    def run(self, row_id: str) -> Run:
        """The row as it ran: the page's columns, corrected where its run settings say otherwise."""
        r = self.row(row_id)
        s = self.run_settings[row_id]
        fields = {k: getattr(r, k) for k in _Layout.model_fields} | {"id": r.id, "model": r.model,
                                                                     "system": r.system, "mtp": r.mtp}
        fields |= {k: getattr(s, k).value for k in CORRECTABLE if getattr(s, k) is not None}
        if s.overlap_param_gather is not None:
            fields["overlap_param_gather"] = s.overlap_param_gather.value
        return Run(**fields, recompute=s.recompute.value, cross_entropy=s.cross_entropy.value,
                   dispatcher=s.dispatcher.value, cuda_graphs=s.cuda_graphs.value, a2a_overlap=s.a2a_overlap.value)

    def corrections(self, row_id: str) -> dict[str, dict]:
        """The layout fields where the run differs from the page's columns: field -> page, run, source."""
        r, s = self.row(row_id), self.run_settings[row_id]
        out = {}
        for k in (*CORRECTABLE, "ga"):
            setting = getattr(s, k)
            if setting is not None and setting.value != getattr(r, k):
                out[k] = {"page": getattr(r, k), "run": setting.value, "source": setting.source}
        return out


def parse(text: str, where: str = str(FILE)) -> Published:
    """The published runs of ``text`` (a YAML document of :class:`Published`), validated."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InputError(f"{where} is not readable YAML ({e})", field=where, value=None,
                         fix="restore it from the repository") from None
    try:
        return Published.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "(the whole file)"
        raise InputError(f"{where}: {field}: {err['msg']}", field=field, value=err.get("input"),
                         fix="correct the entry against the published page it cites") from None


@cache
def load() -> Published:
    """``bridge-moe.yaml``, validated (once per process)."""
    return parse(FILE.read_text(encoding="utf-8"))

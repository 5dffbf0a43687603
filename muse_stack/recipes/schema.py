"""The recipe format: pydantic models for the declarative YAML files under ``recipes/``.

A value the source document does not state is ``null`` with an entry in ``notes`` (keyed by
its dotted path) saying so; nothing is invented. Here each value is checked, and what one recipe
says of itself (no secrets, ``min_lr`` within ``lr``, steps or epochs); what an engine can run
(layouts that do not divide, batches that do not split, sizes left unstated, settings of another
engine, FP8 on a GPU without it) is checked once by :mod:`muse_stack.resolve.recipe`, so a
recipe can be read and shown even when its engine would refuse it.
"""

from __future__ import annotations

import datetime
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from muse_stack.models.muse_spark.config import ModelConfig
from muse_stack.machine.table import machine_names
from muse_stack.util.credentials import ENV_REFERENCE, findings, is_secret_key

#: recipe and run names: they become folder names (runs/, the data cache), Slurm job names and
#: Kubernetes label values, so only letters, digits, '.', '_' and '-' (starting and ending with a
#: letter or digit, at most 63 characters: a Kubernetes label value)
NAME_PATTERN = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")
NAME_RULE = "1-63 letters, digits, '.', '_' or '-', starting and ending with a letter or digit"
#: an environment variable name as a shell and Kubernetes accept it
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: a reference to the launching environment, resolved when the job runs and never written: ${env:NAME}
#: (ENV_REFERENCE, from muse_stack.util.credentials)

# size bounds: generous beyond any real run, so a mistyped size fails here instead of in a loop
MAX_GPUS = 1 << 20
MAX_PARALLEL = 1 << 20
MAX_TOKENS = 1 << 24  # sequence, pack and alignment lengths
MAX_BATCH = 1 << 30
MAX_STEPS = 1 << 31


def check_name(value: str, field: str = "name") -> str:
    """``value`` if it is a safe recipe or run name; else ValueError naming the rule."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise ValueError(f"{field} must be {NAME_RULE}")
    return value


def _env_secret_name(name: str) -> bool:
    """An ``env`` name is secret by the rule for environment variable names (a secret word anywhere)."""
    return is_secret_key(name, env=True)


def _value_at(model: Any, path: str) -> Any:
    """The value at a dotted path of a model (None where the path leads nowhere)."""
    node = model
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if node is None:
            return None
    return node


def _no_control(value: str) -> bool:
    return all(c.isprintable() or c == " " for c in value)

#: the machines of the machine table (muse_stack/machine/machines.yaml), in its order
GpuType = Literal[machine_names()]  # type: ignore[valid-type]
Engine = Literal["reference", "megatron"]


#: a path the recipe needs and only the user can supply (e.g. the released checkpoint's local copy)
REQUIRED_PATH = "required"


class _Strict(BaseModel):
    # floats are finite: an .inf or .nan learning rate, price or size is refused here
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ModelSpec(_Strict):
    hf_id: str | None = Field(None, description="Hugging Face repository id of the checkpoint")
    revision: str | None = Field(None, description="commit of the Hugging Face repository")
    config_path: str | None = Field(None, description="a local config.json (or its directory) to take shapes from")
    pretrained_checkpoint: str | None = Field(
        None, description=f"HF-style directory to load weights from; {REQUIRED_PATH!r}: the run starts from a "
                          "checkpoint the user supplies (the recipe's note says which), and refuses to start without it")
    overrides: dict[str, Any] = Field(default_factory=dict, description="ModelConfig fields that differ (proxies)")
    towers: dict[str, Any] | None = Field(
        None, description="the perception towers, as transformers' top-level media keys (vision_config, audio_config, "
                          "image/video/audio_token_id, out_hidden_size, projector_hidden_size: "
                          "muse_stack/models/muse_spark/tower_config.py), where they differ from the released model's; an image-text "
                          "recipe without it has the released towers")

    @field_validator("towers")
    @classmethod
    def _check_towers(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            _towers_of(value)
        return value

    @field_validator("overrides")
    @classmethod
    def _check_overrides(cls, value: dict[str, Any]) -> dict[str, Any]:
        from pydantic import ValidationError

        from muse_stack.util.errors import RecipeError

        unknown = sorted(str(k) for k in value if k not in ModelConfig.model_fields)
        if unknown:
            raise RecipeError("not a ModelConfig field", field=f"model.overrides.{unknown[0]}", value=value[unknown[0]],
                              fix="use the field names of muse_stack/models/muse_spark/config.py (the checkpoint's config.json keys)")
        try:
            ModelConfig().with_overrides(**value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            msg = first["msg"].removeprefix("Value error, ")
            raise RecipeError(f"the overrides do not give a valid model: {msg}",
                              field=f"model.overrides.{where}" if where else "model.overrides",
                              value=first.get("input") if where else None, fix="correct the override") from None
        return value

    def resolve(self) -> ModelConfig:
        from pydantic import ValidationError

        from muse_stack.util.errors import RecipeError

        base = ModelConfig.from_hf_config(self.config_path) if self.config_path else ModelConfig()
        try:
            return base.with_overrides(**self.overrides) if self.overrides else base
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise RecipeError(f"the model overrides do not give a valid model: {first['msg']}",
                              field=f"model.overrides.{where}" if where else "model.overrides",
                              value=first.get("input"), fix="correct the override") from None


def _towers_of(value: dict[str, Any]):
    """``model.towers`` as a TowersConfig; a wrong field is a RecipeError naming it."""
    from pydantic import ValidationError

    from muse_stack.util.errors import RecipeError
    from muse_stack.models.muse_spark.tower_config import TowersConfig

    try:
        return TowersConfig.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise RecipeError(f"the towers are not valid: {first['msg'].removeprefix('Value error, ')}",
                          field=f"model.towers.{where}" if where else "model.towers", value=first.get("input"),
                          fix="use the fields of muse_stack/models/muse_spark/tower_config.py (transformers' vision_config and "
                              "audio_config keys)") from None
    except RecipeError as exc:
        raise RecipeError(exc.message, field=f"model.towers.{exc.field}", value=exc.value, rule=exc.rule,
                          fix=exc.fix) from None


class Hardware(_Strict):
    gpu: GpuType
    count: int = Field(gt=0, le=MAX_GPUS, description="GPUs (or CPU processes for gpu: cpu)")
    per_node: int = Field(gt=0, le=1024)
    instance: str | None = None
    memory_gib: float | None = Field(None, gt=0, description="memory per GPU; default from the GPU table")
    price_per_gpu_hour: float | None = Field(None, ge=0, description="USD per GPU-hour")
    nominal_memory_gb: float | None = Field(None, gt=0, description="memory as the vendor names it (GB)")

    @property
    def nodes(self) -> int:
        return -(-self.count // self.per_node)


class Recompute(_Strict):
    granularity: Literal["none", "selective", "full"] | None = None
    method: Literal["uniform", "block"] | None = None
    num_layers: int | None = Field(None, ge=1)
    modules: list[str] | None = None
    towers: bool | None = Field(
        None, description="recompute each vision tower block in the backward, keeping only the blocks' inputs "
                          "(memory, not numerics: the recomputed forward is the same); unset: with granularity full")


def _engine_options_model() -> type[BaseModel]:
    """The ``engine_options`` section: one field per row of the engine option table
    (:data:`muse_stack.recipes.options.ROWS`), each ``true``, ``false`` or unset, described by its row."""
    from pydantic import create_model

    from muse_stack.recipes.options import ROWS

    fields: dict[str, Any] = {row.key: (bool | None, Field(None, description=row.description)) for row in ROWS}
    return create_model("EngineOptions", __base__=_Strict, __doc__=(
        "Options of the training engines, one row each of muse_stack/recipes/options.py (docs/gpu-engine.md, "
        "\"Engine options\"). Unset keeps what the engine ships; each description says whether turning it "
        "changes numerics."), **fields)


EngineOptions = _engine_options_model()


class Numerics(_Strict):
    deterministic: bool = Field(False, description="two runs of the recipe on the same stack and GPU type repeat bit "
                                                   "for bit (deterministic kernels; slower): muse_stack/util/numerics.py")


#: Transformer Engine's FP8 scaling recipes (megatron-core's ``fp8_recipe``) and the GPU
#: architectures that run them: per-tensor (current or delayed) and block scaling from Hopper on,
#: MXFP8 (a shared exponent per 32 values) on Blackwell only
FP8_RECIPE_ARCHS: dict[str, tuple[str, ...]] = {
    "tensorwise": ("sm90", "sm100"), "delayed": ("sm90", "sm100"), "blockwise": ("sm90", "sm100"),
    "mxfp8": ("sm100",),
}


class Fp8(_Strict):
    """``precision: fp8``: the GEMMs of the decoder layers run in FP8 through Transformer Engine
    (weights, master weights, the embedding, the output layer and everything between the GEMMs
    stay as under bf16). Both settings change training, so both are stated."""

    recipe: Literal["tensorwise", "delayed", "blockwise", "mxfp8"] | None = Field(
        None, description="TE's scaling recipe: tensorwise (per-tensor current scaling; sm90's choice), delayed "
                          "(per-tensor, from an amax history), blockwise (1x128 / 128x128 blocks), mxfp8 (sm100)")
    format: Literal["hybrid", "e4m3"] | None = Field(
        None, description="hybrid: E4M3 forward, E5M2 gradients; e4m3: E4M3 throughout")


class Offload(_Strict):
    optimizer: bool | None = None
    activations: bool | None = None


class Layout(_Strict):
    tp: int = Field(1, ge=1, le=MAX_PARALLEL)
    pp: int = Field(1, ge=1, le=MAX_PARALLEL)
    vpp: int | None = Field(None, ge=1, le=MAX_PARALLEL)
    cp: int | None = Field(1, ge=1, le=MAX_PARALLEL, description="None when the source does not state it")
    cp_comm_type: Literal["p2p", "a2a", "allgather", "a2a+p2p"] | None = None
    ep: int | None = Field(1, ge=1, le=MAX_PARALLEL, description="None when the source does not state it")
    etp: int = Field(1, ge=1, le=MAX_PARALLEL)
    dp: int | None = Field(None, ge=1, le=MAX_GPUS, description="as the source states it; checked against the world size")
    sequence_parallel: bool | None = None
    pp_layers: list[int] | None = Field(None, max_length=MAX_PARALLEL, description="decoder layers per pipeline stage, first to last")
    first_stage_layers: int | None = Field(None, ge=0)
    last_stage_layers: int | None = Field(None, ge=0)
    dispatcher: Literal["alltoall", "allgather", "flex"] | None = None
    distributed_optimizer: bool | None = None
    attention_backend: str | None = None
    label: str | None = None
    summary: str | None = None
    highlights: str | None = None


class Batch(_Strict):
    mbs: int | None = Field(None, ge=1, le=MAX_BATCH, description="micro-batch size (sequences)")
    gbs: int | None = Field(None, ge=1, le=MAX_BATCH, description="global batch size (sequences)")
    seq_length: int | None = Field(None, ge=1, le=MAX_TOKENS)
    packed: bool | None = None
    pack_alignment: int | None = Field(None, ge=1, le=MAX_TOKENS, description="pad each packed sequence to a multiple of this")
    max_tokens_per_gpu: int | None = Field(None, ge=1)
    qkv_format: Literal["sbhd", "bshd", "thd"] | None = None


class Optimizer(_Strict):
    name: Literal["adam", "adamw", "sgd"] | None = "adam"
    lr: float | None = Field(None, gt=0, le=1e3, description="peak learning rate (finite, positive)")
    min_lr: float | None = Field(None, ge=0, le=1e3)
    warmup_steps: int | None = Field(None, ge=0, le=MAX_STEPS)
    warmup_fraction: float | None = Field(None, ge=0, le=1)
    decay_style: Literal["cosine", "linear", "constant", "wsd"] | None = None
    weight_decay: float | None = Field(None, ge=0)
    beta1: float | None = Field(None, ge=0, lt=1)
    beta2: float | None = Field(None, ge=0, lt=1)
    eps: float | None = Field(None, gt=0)
    clip_grad: float | None = Field(None, ge=0)
    precision_aware: bool | None = Field(
        None, description="megatron engine: TE's FusedAdam holds the master weights and writes the bf16 weights in "
                          "its own update kernel (megatron-core's use_precision_aware_optimizer; needs the "
                          "distributed optimizer). Unset: off, megatron-core keeps fp32 master shards and copies them "
                          "to the weights after the update")
    param_remainders: bool | None = Field(
        None, description="with precision_aware under bf16: each fp32 master weight is the bf16 weight plus an int16 "
                          "remainder (exactly the same fp32 value, 2 bytes per parameter instead of 4; the bf16 weight "
                          "rounds ties away from zero); false: a separate fp32 master. Stated whenever precision_aware "
                          "is on")


class GarbageCollection(_Strict):
    """Python's garbage collector during training (Megatron-Bridge's ``train.manual_gc``,
    ``manual_gc_interval`` and ``manual_gc_eval``). Manual: after setup the heap is collected and
    frozen and the automatic collector is off, so no collection lands inside a step; the run
    collects after every ``interval``-th step and after each checkpoint save (``eval``), at the
    same steps on every rank. The default is what Bridge's performance recipes set (manual, every
    100 steps): a collection inside a step was the one stall of the H200 slice runs."""

    manual: bool = Field(True, description="turn the automatic collector off and collect at chosen steps")
    interval: int = Field(100, ge=0, le=MAX_STEPS, description="with manual: collect after every N-th step "
                                                                 "(0: never between steps)")
    eval: bool = Field(True, description="with manual: collect after each checkpoint save (and evaluation)")

    def due(self, step: int) -> bool:
        """Whether a manual collection is due after ``step`` (every ``interval``-th step)."""
        return self.manual and bool(self.interval) and step % self.interval == 0


class Training(_Strict):
    steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    epochs: float | None = Field(None, gt=0, le=1e6)
    seed: int | None = None
    data_seed: int | None = None
    log_interval: int = Field(1, ge=1)
    measure_warmup_steps: int | None = Field(None, ge=0, le=MAX_STEPS, description="steps skipped before the measurement window")
    checkpoint_interval: int | None = Field(None, ge=1, le=MAX_STEPS, description="steps between checkpoints (unset: "
                                                                                  "only the final one and one on interrupt)")
    keep_checkpoints: int | None = Field(None, ge=1, le=MAX_STEPS, description="newest complete checkpoints kept (unset: all)")
    final_checkpoint: bool = Field(True, description="write a checkpoint when the run completes (false: a throughput "
                                                     "measurement that keeps no weights; interrupts still save)")
    async_checkpoint: bool = Field(False, description="megatron engine: write dist-checkpoints in the background "
                                                      "(megatron-core async save), completed at step boundaries")
    gc: GarbageCollection = Field(default_factory=GarbageCollection,
                                  description="Python's garbage collector: manual collection at chosen steps")


class Validation(_Strict):
    """Validation loss on a held-out split of the recipe's data (Megatron-Bridge's
    ``ValidationConfig``: ``validation.eval_interval``, ``validation.eval_iters``). The split holds
    ``eval_iters`` x ``batch.gbs`` rows of the build, drawn once by a fixed seed
    (:mod:`muse_stack.data.split`); training takes the others. Every ``eval_interval`` steps and at
    the end of the run the model's loss over those ``eval_iters`` global batches (the same ones
    each time) is recorded as ``val_loss``. A recipe without this section has no validation and
    trains on all its rows; with it, an unstated value is filled from Bridge 0.6.2's common recipe
    for the recipe's kind (``fill_policy``, recorded under ``filled``)."""

    eval_interval: int | None = Field(None, ge=1, le=MAX_STEPS, description="steps between validation losses "
                                                                             "(Bridge: validation.eval_interval)")
    eval_iters: int | None = Field(None, ge=1, le=MAX_STEPS, description="global batches per validation loss; "
                                                                         "the held-out split is eval_iters x "
                                                                         "batch.gbs rows (Bridge: "
                                                                         "validation.eval_iters)")


class Data(_Strict):
    kind: Literal["synthetic", "sft", "pretrain", "multimodal"] = "sft"
    dataset: str | None = Field(None, description="Hugging Face dataset id")
    revision: str | None = None
    split: str | None = Field(None, description="split with slice, e.g. train[:100000]")
    subset: str | None = Field(None, description="files or subset of the dataset used")
    files: list[str] | None = Field(None, description="local parquet/jsonl files with the dataset's schema")
    builder: Literal["synthetic", "fixed", "packed"] | None = None
    packed_size: int | None = Field(None, ge=1, le=MAX_TOKENS)
    packs: int | None = Field(None, ge=1, description="packed sequences or rows the recipe trains on, as recorded")
    rows: int | None = Field(None, ge=1)
    rows_sha256: str | None = None
    build_name: str | None = Field(None, description="the data cache folder's label (a safe name)")
    seed: int | None = None
    loss_mask: str | None = None
    tokenizer: str | None = Field(None, description="directory with tokenizer.json and chat_template.jinja")
    template_kwargs: dict[str, Any] = Field(default_factory=dict)
    license: str | None = None
    details: dict[str, Any] = Field(default_factory=dict, description="further recorded facts of the data build")

    @field_validator("details")
    @classmethod
    def _messages_key(cls, value: dict[str, Any]) -> dict[str, Any]:
        key = value.get("messages_key")
        if key is not None and (not isinstance(key, str) or not key or "$" in key):
            # the data builder reads this field of each row by this name: a reference would be looked up as a name
            raise ValueError("details.messages_key names the rows' messages field literally (a ${env:NAME} "
                             "reference is resolved only in env and data.template_kwargs): give e.g. "
                             "data.details.messages_key=conversations")
        return value


class Peft(_Strict):
    """Adapters on a frozen base. Targets are checkpoint (HF) module names inside a decoder layer
    (``self_attn.q_proj``, ``mlp.experts.gate_up_proj``, ...); :mod:`muse_stack.models.muse_spark.peft_config`
    checks them against the model. A null rank, alpha, dropout or per_expert is filled from
    :data:`muse_stack.models.muse_spark.peft_config.DEFAULTS` (Megatron-Bridge's LoRA/DoRA defaults), and
    ``muse-stack plan`` shows each filled value."""

    scheme: Literal["lora", "dora"]
    rank: int | None = Field(None, ge=1, le=1 << 16, description="adapter rank r")
    alpha: float | None = Field(None, gt=0, le=1 << 20, description="scaling numerator: the update is alpha / r x B A")
    dropout: float | None = Field(None, ge=0, lt=1, description="dropout on the adapter's input")
    targets: list[str] | None = Field(None, max_length=64, description="module names inside a decoder layer")
    per_expert: bool | None = Field(None, description="expert targets: one adapter per routed expert (else one shared)")


class Wandb(_Strict):
    """Weights & Biases, an optional extra (``pip install muse-stack[wandb]``). The API key is never
    a recipe field: it is read from WANDB_API_KEY (or ``wandb login``) when the run starts, and
    without it the run logs offline under the run directory (``wandb sync`` uploads it later)."""
    project: str = Field(description="W&B project")
    entity: str | None = Field(None, description="W&B team or user")
    name: str | None = Field(None, description="run name (default: the run directory's name)")
    group: str | None = None
    tags: list[str] = Field(default_factory=list)
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="default: online when WANDB_API_KEY is set, else offline")


class Logging(_Strict):
    tensorboard: bool = Field(True, description="TensorBoard event files under RUN_DIR/tensorboard")
    wandb: Wandb | None = Field(None, description="also log to Weights & Biases")


class RecordedStack(_Strict):
    framework: str | None = None
    megatron_lm: str | None = None
    transformer_engine: str | None = None
    pytorch: str | None = None
    cuda: str | None = None
    nccl: str | None = None
    cudnn: str | None = None
    flash_attn: str | None = None
    deepep: str | None = None
    python: str | None = None
    network: str | None = None
    source: str | None = None


class RecordedResult(_Strict):
    tokens_per_s_per_gpu: float | None = None
    usd_per_million_tokens: float | None = None
    step_time_cv_percent: float | None = None
    mfu: float | None = None
    mfu_note: str | None = None
    active_params: dict[str, Any] | None = None
    measured: datetime.date | None = None
    steps_per_run: int | None = None
    window: list[int] | None = None
    window_tokens: int | None = None
    runs: int | None = None
    profiler: bool | None = None
    gpu_hours: float | None = None
    gpu_hours_note: str | None = None
    peak_memory_gib: float | None = None
    memory_note: str | None = None


class Provenance(_Strict):
    source: str = Field(description="document the facts come from")
    function: str | None = Field(None, description="Megatron-Bridge function name or record path")
    summary: str | None = None
    url: str | None = None


class FilledValue(_Strict):
    """A value the recipe left unstated, filled by its ``fill_policy``."""

    value: Any
    source: str = Field(description="where the value comes from: package, version, module and function")


class Recipe(_Strict):
    name: str = Field(description="short alias, e.g. sft-192")
    aliases: list[str] = Field(default_factory=list, description="other names, e.g. the Bridge function name")
    task: Literal["pretrain", "sft", "peft", "benchmark"]
    description: str = ""
    engine: Engine = "megatron"
    model: ModelSpec = Field(default_factory=ModelSpec)
    hardware: Hardware
    layout: Layout = Field(default_factory=Layout)
    batch: Batch = Field(default_factory=Batch)
    recompute: Recompute = Field(default_factory=Recompute)
    offload: Offload = Field(default_factory=Offload)
    engine_options: EngineOptions = Field(default_factory=EngineOptions,
                                          description="options of the engine (muse_stack/recipes/options.py)")
    numerics: Numerics = Field(default_factory=Numerics)
    precision: Literal["bf16", "fp32", "fp8"] | None = "bf16"
    fp8: Fp8 | None = Field(None, description="the FP8 scaling recipe and format, with precision: fp8 only")
    optimizer: Optimizer = Field(default_factory=Optimizer)
    training: Training = Field(default_factory=Training)
    data: Data = Field(default_factory=Data)
    validation: Validation | None = Field(None, description="validation loss on a held-out split (absent: none, "
                                                           "every row trains)")
    logging: Logging = Field(default_factory=Logging)
    frozen: list[str] = Field(default_factory=list, description="modules that do not train")
    peft: Peft | None = None
    env: dict[str, str] = Field(default_factory=dict)
    stack: RecordedStack | None = None
    result: RecordedResult | None = None
    correctness: dict[str, Any] | None = None
    run_command: str | None = None
    author: dict[str, Any] | None = None
    status: str | None = None
    provenance: Provenance
    notes: dict[str, str] = Field(default_factory=dict, description="dotted path -> why a value is null or how it was derived")
    fill_policy: Literal["megatron-bridge-0.6.2", "none"] = Field(
        "megatron-bridge-0.6.2", description="where unstated optimizer values come from: Megatron-Bridge 0.6.2's "
                                              "common recipe for the recipe's kind (muse_stack/recipes/fill.py), or none")
    filled: dict[str, FilledValue] = Field(default_factory=dict, description="dotted path -> each value the fill "
                                                                               "policy filled, with its source")

    @model_validator(mode="before")
    @classmethod
    def _engine_options_section(cls, data: Any) -> Any:
        """The sections the engine options were in before (``fusions``, ``performance``) moved into
        ``engine_options``, each with a warning naming its new key."""
        from muse_stack.recipes.options import migrate

        return migrate(data) if isinstance(data, dict) else data

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        return check_name(value)

    @field_validator("aliases")
    @classmethod
    def _check_aliases(cls, value: list[str]) -> list[str]:
        for alias in value:
            if not alias or not all(c.isprintable() for c in alias) or len(alias) > 200:
                raise ValueError("an alias must be 1-200 printable characters")
        return value

    @field_validator("env")
    @classmethod
    def _check_env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if not ENV_NAME.fullmatch(key):
                raise ValueError(f"env name {key[:60]!r} is not a variable name: letters, digits and '_', "
                                 "not starting with a digit")
            if not _no_control(val):
                raise ValueError(f"env {key}: the value holds a control character (newline, tab, NUL, ...)")
        return value

    @model_validator(mode="after")
    def _check(self) -> "Recipe":
        # every key and string of the recipe, whatever it is called: a literal under a secret-named key,
        # or a value shaped like a credential (muse_stack.util.credentials)
        doc = self.model_dump(mode="json", exclude={"env"})
        found = findings(self.env, "env", secret_name=_env_secret_name) + findings(doc)
        if found:
            from muse_stack.util.credentials import FIX
            from muse_stack.util.errors import RecipeError

            where, why = found[0]
            raise RecipeError(
                f"{why}; recipes, run directories and launch files are shared, so secrets never go in them",
                field=where, value="<redacted>",
                rule="literal values of secret-named keys (token, key, secret, password, pass, pwd, auth, bearer, "
                     "pat, ...) and credential-shaped values under any key (URL user:password@, ?token=, Bearer, "
                     "ghp_/hf_/sk-/AWS keys, JWTs, high-entropy strings) are refused"
                     + (f"; also at {', '.join(p for p, _ in found[1:4])}" if len(found) > 1 else ""),
                fix=FIX)
        if self.data.build_name is not None and not NAME_PATTERN.fullmatch(self.data.build_name):
            from muse_stack.util.errors import RecipeError

            raise RecipeError("the data cache folder's label must be a safe name", field="data.build_name",
                              value=self.data.build_name, rule=NAME_RULE, fix="use e.g. tulu3-4k")
        # a filled value an override has since replaced is no longer filled
        stale = [p for p, f in self.filled.items() if _value_at(self, p) != f.value]
        for path in stale:
            del self.filled[path]
        if self.optimizer.lr is not None and self.optimizer.min_lr is not None and \
                self.optimizer.min_lr > self.optimizer.lr and "optimizer.min_lr" in self.filled:
            from muse_stack.util.errors import RecipeError

            raise RecipeError(f"the filled optimizer.min_lr ({self.optimizer.min_lr:g}, "
                              f"{self.filled['optimizer.min_lr'].source}) exceeds the stated optimizer.lr "
                              f"({self.optimizer.lr:g})", field="optimizer.min_lr", value=self.optimizer.min_lr,
                              fix="state optimizer.min_lr too (e.g. a tenth of optimizer.lr)")
        if self.optimizer.lr is not None and self.optimizer.min_lr is not None and \
                self.optimizer.min_lr > self.optimizer.lr:
            raise ValueError(f"optimizer.min_lr ({self.optimizer.min_lr}) exceeds optimizer.lr ({self.optimizer.lr})")
        if self.training.steps is None and self.training.epochs is None:
            raise ValueError("training needs steps or epochs (or both)")
        return self

    def model_config_resolved(self) -> ModelConfig:
        return self.model.resolve()

    def recompute_towers(self) -> bool:
        """Whether the vision tower's blocks are recomputed in the backward: ``recompute.towers``,
        else on exactly when the decoder recomputes whole layers (``granularity: full``)."""
        if self.recompute.towers is not None:
            return self.recompute.towers
        return self.recompute.granularity == "full"

    def towers_config_resolved(self, model: ModelConfig | None = None):
        """The perception towers the recipe's model carries (a TowersConfig): ``model.towers``, else the
        released model's for image-text data; None for a text recipe without ``model.towers``.
        ``model``: the recipe's model configuration, where the caller has it."""
        if self.model.towers is None and self.data.kind != "multimodal":
            return None
        from muse_stack.util.errors import RecipeError

        towers = _towers_of(self.model.towers or {})
        try:
            towers.check_text_hidden_size((model or self.model_config_resolved()).hidden_size)
        except RecipeError as exc:
            raise RecipeError(exc.message, field=f"model.towers.{exc.field}", value=exc.value, fix=exc.fix) from None
        return towers

    @property
    def all_names(self) -> list[str]:
        return [self.name, *self.aliases]

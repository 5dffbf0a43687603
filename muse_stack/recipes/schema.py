"""The recipe format: pydantic models for the declarative YAML files under ``recipes/``.

A value the source document does not state is ``null`` with an entry in ``notes`` (keyed by
its dotted path) saying so; nothing is invented. Rules that span fields (layouts that do not
divide, batches that do not fit) are checked by :mod:`muse_stack.plan.rules`, not here, so a
recipe can be read and shown even when its layout is wrong.
"""

from __future__ import annotations

import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from muse_stack.model_config import ModelConfig

GpuType = Literal["GB200", "B200", "H200", "H100", "cpu"]
Engine = Literal["reference", "megatron"]


#: a path the recipe needs and only the user can supply (e.g. the released checkpoint's local copy)
REQUIRED_PATH = "required"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Strict):
    hf_id: str | None = Field(None, description="Hugging Face repository id of the checkpoint")
    revision: str | None = Field(None, description="commit of the Hugging Face repository")
    config_path: str | None = Field(None, description="a local config.json (or its directory) to take shapes from")
    pretrained_checkpoint: str | None = Field(
        None, description=f"HF-style directory to load weights from; {REQUIRED_PATH!r}: the run starts from a "
                          "checkpoint the user supplies (the recipe's note says which), and refuses to start without it")
    overrides: dict[str, Any] = Field(default_factory=dict, description="ModelConfig fields that differ (proxies)")

    def resolve(self) -> ModelConfig:
        base = ModelConfig.from_hf_config(self.config_path) if self.config_path else ModelConfig()
        return base.with_overrides(**self.overrides) if self.overrides else base


class Hardware(_Strict):
    gpu: GpuType
    count: int = Field(gt=0, description="GPUs (or CPU processes for gpu: cpu)")
    per_node: int = Field(gt=0)
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


class Fusions(_Strict):
    compile_elementwise: bool | None = Field(
        None, description="megatron engine: fuse the norm / gate / residual / softcap chains with torch.compile")


class Offload(_Strict):
    optimizer: bool | None = None
    activations: bool | None = None


class Layout(_Strict):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    vpp: int | None = Field(None, ge=1)
    cp: int | None = Field(1, ge=1, description="None when the source does not state it")
    cp_comm_type: Literal["p2p", "a2a", "allgather", "a2a+p2p"] | None = None
    ep: int | None = Field(1, ge=1, description="None when the source does not state it")
    etp: int = Field(1, ge=1)
    dp: int | None = Field(None, ge=1, description="as the source states it; checked against the world size")
    sequence_parallel: bool | None = None
    pp_layers: list[int] | None = Field(None, description="decoder layers per pipeline stage, first to last")
    first_stage_layers: int | None = Field(None, ge=0)
    last_stage_layers: int | None = Field(None, ge=0)
    dispatcher: Literal["alltoall", "allgather", "flex"] | None = None
    distributed_optimizer: bool | None = None
    attention_backend: str | None = None
    label: str | None = None
    summary: str | None = None
    highlights: str | None = None


class Batch(_Strict):
    mbs: int | None = Field(None, ge=1, description="micro-batch size (sequences)")
    gbs: int | None = Field(None, ge=1, description="global batch size (sequences)")
    seq_length: int | None = Field(None, ge=1)
    packed: bool | None = None
    pack_alignment: int | None = Field(None, ge=1, description="pad each packed sequence to a multiple of this")
    max_tokens_per_gpu: int | None = Field(None, ge=1)
    qkv_format: Literal["sbhd", "bshd", "thd"] | None = None


class Optimizer(_Strict):
    name: Literal["adam", "adamw", "sgd"] | None = "adam"
    lr: float | None = Field(None, gt=0)
    min_lr: float | None = Field(None, ge=0)
    warmup_steps: int | None = Field(None, ge=0)
    warmup_fraction: float | None = Field(None, ge=0, le=1)
    decay_style: Literal["cosine", "linear", "constant", "wsd"] | None = None
    weight_decay: float | None = Field(None, ge=0)
    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None
    clip_grad: float | None = Field(None, ge=0)


class Training(_Strict):
    steps: int | None = Field(None, ge=1)
    epochs: float | None = Field(None, gt=0)
    seed: int | None = None
    data_seed: int | None = None
    log_interval: int = Field(1, ge=1)
    measure_warmup_steps: int | None = Field(None, ge=0, description="steps skipped before the measurement window")
    checkpoint_interval: int | None = Field(None, ge=1, description="steps between checkpoints (unset: only the "
                                                                    "final one and one on interrupt)")
    keep_checkpoints: int | None = Field(None, ge=1, description="newest complete checkpoints kept (unset: all)")
    async_checkpoint: bool = Field(False, description="megatron engine: write dist-checkpoints in the background "
                                                      "(megatron-core async save), completed at step boundaries")


class Data(_Strict):
    kind: Literal["synthetic", "sft", "pretrain", "multimodal"] = "sft"
    dataset: str | None = Field(None, description="Hugging Face dataset id")
    revision: str | None = None
    split: str | None = Field(None, description="split with slice, e.g. train[:100000]")
    subset: str | None = Field(None, description="files or subset of the dataset used")
    files: list[str] | None = Field(None, description="local parquet/jsonl files with the dataset's schema")
    builder: Literal["synthetic", "fixed", "packed"] | None = None
    packed_size: int | None = Field(None, ge=1)
    packs: int | None = Field(None, ge=1, description="packed sequences or rows the recipe trains on, as recorded")
    rows: int | None = Field(None, ge=1)
    rows_sha256: str | None = None
    build_name: str | None = None
    seed: int | None = None
    loss_mask: str | None = None
    tokenizer: str | None = Field(None, description="directory with tokenizer.json and chat_template.jinja")
    template_kwargs: dict[str, Any] = Field(default_factory=dict)
    license: str | None = None
    details: dict[str, Any] = Field(default_factory=dict, description="further recorded facts of the data build")


class Peft(_Strict):
    scheme: Literal["lora", "dora"]
    rank: int = Field(ge=1)
    alpha: float = Field(gt=0)
    targets: list[str]
    per_expert: bool = False


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
    fusions: Fusions = Field(default_factory=Fusions)
    precision: Literal["bf16", "fp32", "fp8"] | None = "bf16"
    optimizer: Optimizer = Field(default_factory=Optimizer)
    training: Training = Field(default_factory=Training)
    data: Data = Field(default_factory=Data)
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

    @model_validator(mode="after")
    def _check(self) -> "Recipe":
        if self.training.steps is None and self.training.epochs is None:
            raise ValueError("training needs steps or epochs (or both)")
        if self.fusions.compile_elementwise and self.engine != "megatron":
            raise ValueError("fusions.compile_elementwise applies to the megatron engine only: "
                             "set engine: megatron or drop fusions.compile_elementwise")
        return self

    def model_config_resolved(self) -> ModelConfig:
        return self.model.resolve()

    @property
    def all_names(self) -> list[str]:
        return [self.name, *self.aliases]

"""Megatron-Bridge ``ConfigContainer`` keys as aliases of recipe fields.

A Bridge user writes overrides in Bridge's own dotted names (``train.global_batch_size=64``,
``model.tensor_model_parallel_size=8``, ``optimizer.lr=3e-5``). :data:`BRIDGE_KEYS` is the one
table that maps each Bridge key with a recipe equivalent to its recipe field; it is used to
translate overrides and printed by ``muse-stack show RECIPE --bridge``. A key under one of
Bridge's sections that is neither a recipe field nor in the table is refused, naming the nearest
field, instead of being written into the recipe where the schema would call it unknown.
"""

from __future__ import annotations

import difflib
from typing import Any

from muse_stack.recipes.options import bridge_keys, migrate_path
from muse_stack.util.errors import RecipeError

#: Bridge ConfigContainer key -> recipe field (dotted). Names as in megatron.bridge.training.config
#: (TrainingConfig, SchedulerConfig, RNGConfig, LoggerConfig, CheckpointConfig, the dataset configs),
#: megatron.core's OptimizerConfig and DistributedDataParallelConfig, and the GPT model provider's
#: TransformerConfig / ModelParallelConfig fields, plus Bridge's LoRA config.
BRIDGE_KEYS: dict[str, str] = {
    # model parallelism (ModelParallelConfig on the model provider)
    "model.tensor_model_parallel_size": "layout.tp",
    "model.pipeline_model_parallel_size": "layout.pp",
    "model.virtual_pipeline_model_parallel_size": "layout.vpp",
    "model.context_parallel_size": "layout.cp",
    "model.cp_comm_type": "layout.cp_comm_type",
    "model.expert_model_parallel_size": "layout.ep",
    "model.expert_tensor_parallel_size": "layout.etp",
    "model.sequence_parallel": "layout.sequence_parallel",
    "model.num_layers_in_first_pipeline_stage": "layout.first_stage_layers",
    "model.num_layers_in_last_pipeline_stage": "layout.last_stage_layers",
    "model.moe_token_dispatcher_type": "layout.dispatcher",
    "model.attention_backend": "layout.attention_backend",
    "model.seq_length": "batch.seq_length",
    # model shapes (TransformerConfig) -> the ModelConfig overrides, in the checkpoint's config.json names
    "model.num_layers": "model.overrides.num_hidden_layers",
    "model.hidden_size": "model.overrides.hidden_size",
    "model.num_attention_heads": "model.overrides.num_attention_heads",
    "model.num_query_groups": "model.overrides.num_key_value_heads",
    "model.kv_channels": "model.overrides.head_dim",
    "model.num_moe_experts": "model.overrides.num_local_experts",
    "model.moe_router_topk": "model.overrides.num_experts_per_tok",
    "model.moe_ffn_hidden_size": "model.overrides.moe_intermediate_size",
    "model.moe_router_topk_scaling_factor": "model.overrides.routed_scaling_factor",
    "model.rotary_base": "model.overrides.rope_theta",
    "model.layernorm_epsilon": "model.overrides.rms_norm_eps",
    "model.vocab_size": "model.overrides.vocab_size",
    "model.share_embeddings_and_output_weights": "model.overrides.tie_word_embeddings",
    "model.add_qkv_bias": "model.overrides.attention_bias",
    # activation recompute (TransformerConfig)
    "model.recompute_granularity": "recompute.granularity",
    "model.recompute_method": "recompute.method",
    "model.recompute_num_layers": "recompute.num_layers",
    "model.recompute_modules": "recompute.modules",
    # TrainingConfig
    "train.micro_batch_size": "batch.mbs",
    "train.global_batch_size": "batch.gbs",
    "train.train_iters": "training.steps",
    "train.manual_gc": "training.gc.manual",
    "train.manual_gc_interval": "training.gc.interval",
    "train.manual_gc_eval": "training.gc.eval",
    # ValidationConfig (and TrainingConfig's deprecated copies of its keys)
    "validation.eval_interval": "validation.eval_interval",
    "validation.eval_iters": "validation.eval_iters",
    "train.eval_interval": "validation.eval_interval",
    "train.eval_iters": "validation.eval_iters",
    # OptimizerConfig (megatron.core); the first four have the same name in both
    "optimizer.lr": "optimizer.lr",
    "optimizer.min_lr": "optimizer.min_lr",
    "optimizer.weight_decay": "optimizer.weight_decay",
    "optimizer.clip_grad": "optimizer.clip_grad",
    "optimizer.optimizer": "optimizer.name",
    "optimizer.adam_beta1": "optimizer.beta1",
    "optimizer.adam_beta2": "optimizer.beta2",
    "optimizer.adam_eps": "optimizer.eps",
    "optimizer.use_distributed_optimizer": "layout.distributed_optimizer",
    "optimizer.use_precision_aware_optimizer": "optimizer.precision_aware",
    "optimizer.store_param_remainders": "optimizer.param_remainders",
    # SchedulerConfig
    "scheduler.lr_warmup_iters": "optimizer.warmup_steps",
    "scheduler.lr_warmup_fraction": "optimizer.warmup_fraction",
    "scheduler.lr_decay_style": "optimizer.decay_style",
    # DistributedDataParallelConfig
    "ddp.use_distributed_optimizer": "layout.distributed_optimizer",
    # RNGConfig, LoggerConfig, CheckpointConfig
    "rng.seed": "training.seed",
    "logger.log_interval": "training.log_interval",
    "checkpoint.save_interval": "training.checkpoint_interval",
    "checkpoint.pretrained_checkpoint": "model.pretrained_checkpoint",
    # dataset configs (GPTDatasetConfig / FinetuningDatasetConfig)
    "dataset.seq_length": "batch.seq_length",
    "dataset.seed": "data.seed",
    "dataset.random_seed": "data.seed",
    "dataset.packed_sequence_specs.packed_sequence_size": "data.packed_size",
    # LoRA
    "peft.dim": "peft.rank",
    "peft.alpha": "peft.alpha",
    "peft.target_modules": "peft.targets",
    # the engine options that are megatron-core config fields (TransformerConfig on the model provider,
    # OptimizerConfig, DistributedDataParallelConfig): muse_stack/recipes/options.py
    **bridge_keys(),
}

#: ConfigContainer sections that are not recipe sections: any key under them is a Bridge key
BRIDGE_ONLY_SECTIONS = frozenset({"train", "scheduler", "ddp", "rng", "logger", "checkpoint", "dataset",
                                  "dist", "mixed_precision", "comm_overlap", "profiling", "tokenizer", "ft",
                                  "straggler", "nvrx_straggler", "inprocess_restart"})
#: sections both formats have; their Bridge-only keys are recognised by the schema not knowing them
SHARED_SECTIONS = frozenset({"model", "optimizer", "peft", "validation"})


def _recipe_fields() -> list[str]:
    """Every dotted field of the recipe schema: section.field, and where a section's field is a
    model both it and its fields (training.gc, training.gc.interval)."""
    from pydantic import BaseModel

    from muse_stack.recipes.schema import Recipe

    def leaves(model: type[BaseModel], prefix: str) -> list[str]:
        out: list[str] = []
        for name, info in model.model_fields.items():
            ann = info.annotation
            sub = next((a for a in getattr(ann, "__args__", (ann,))
                        if isinstance(a, type) and issubclass(a, BaseModel)), None)
            if sub is None:
                out.append(f"{prefix}{name}")
            else:  # a model nested in a section is a field itself (given whole) and has fields of its own
                out.extend([f"{prefix}{name}"] * bool(prefix) + leaves(sub, f"{prefix}{name}."))
        return out

    return leaves(Recipe, "")


def _is_recipe_path(path: list[str]) -> bool:
    """A recipe field, or a key under one of the free-form mappings (model.overrides.X, env.X)."""
    dotted = ".".join(path)
    return any(dotted == f or dotted.startswith(f + ".") for f in _recipe_fields())


def translate(path: list[str]) -> list[str]:
    """The recipe path for an override key: a recipe field is kept, a Bridge key in the table is
    translated, and a Bridge key without a recipe equivalent is refused naming the nearest field."""
    path = migrate_path(path)  # the sections the engine options were in before (fusions, performance)
    dotted = ".".join(path)
    if dotted in BRIDGE_KEYS:
        return BRIDGE_KEYS[dotted].split(".")
    head = path[0]
    if head in BRIDGE_ONLY_SECTIONS or (head in SHARED_SECTIONS and len(path) > 1 and not _is_recipe_path(path)):
        candidates = list(BRIDGE_KEYS) + _recipe_fields()
        close = difflib.get_close_matches(dotted, candidates, n=1, cutoff=0.5)
        if not close:  # match on the last name alone (train.foo_batch_size -> batch.gbs via global_batch_size)
            leaf = difflib.get_close_matches(path[-1], [c.split(".")[-1] for c in candidates], n=1, cutoff=0.5)
            close = [c for c in candidates if leaf and c.split(".")[-1] == leaf[0]][:1]
        if close:
            target = BRIDGE_KEYS.get(close[0], close[0])
            nearest = f"the nearest field is {target}" + (f" (Bridge: {close[0]})" if close[0] in BRIDGE_KEYS else "")
        else:
            nearest = "no recipe field is near it"
        raise RecipeError("a Megatron-Bridge key with no recipe equivalent", field="override", value=dotted,
                          rule="Bridge keys are accepted when the recipe has the same setting "
                               "(`muse-stack show RECIPE --bridge` lists them)",
                          fix=f"{nearest}; write that instead")
    return path


def bridge_rows(recipe: Any) -> list[tuple[str, str, Any]]:
    """(Bridge key, recipe field, the recipe's value) for every row of the table; a model shape is
    the resolved model's value (the checkpoint's config with the recipe's overrides), an engine option
    the value its engine resolves (stated, or its default where it applies)."""
    from muse_stack.recipes.options import SECTION, resolve

    data = recipe.model_dump(mode="json")
    model = recipe.model_config_resolved().model_dump(mode="json")
    options = resolve(recipe)
    rows = []
    for key, field in BRIDGE_KEYS.items():
        if field.startswith("model.overrides."):
            rows.append((key, field, model.get(field.removeprefix("model.overrides."))))
            continue
        if field.startswith(f"{SECTION}."):  # as the engine resolves it (None: not an option of this engine)
            found = options.get(field.removeprefix(f"{SECTION}."))
            rows.append((key, field, found.value if found is not None else None))
            continue
        node: Any = data
        for part in field.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        rows.append((key, field, node))
    return rows

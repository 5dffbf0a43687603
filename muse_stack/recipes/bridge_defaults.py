"""Data: the optimizer and learning-rate schedule Megatron-Bridge 0.6.2's common recipe helpers
state, read from the released wheel (no Bridge code is copied here, only the values).

Source: ``megatron_bridge-0.6.2-py3-none-any.whl`` from PyPI (``pip download --no-deps
--python-version 3.12 --only-binary=:all: megatron-bridge==0.6.2``), module
``megatron/bridge/recipes/common.py``. Each helper calls
``megatron.bridge.recipes.utils.optimizer_utils.distributed_fused_adam_with_cosine_annealing``
with the arguments listed under ``arguments``; the values below are what that call returns
(the helper's own defaults for every argument not passed).

Weight decay: the helper builds ``OptimizerConfig(weight_decay=0.1)`` and
``SchedulerConfig(start_weight_decay=0.033, end_weight_decay=0.033,
weight_decay_incr_style="constant")``; Bridge's ``_get_scheduler`` (training/optim.py) hands the
scheduler's values to megatron-core's ``OptimizerParamScheduler``, which sets every parameter
group's weight decay to ``end_wd`` at each step when the style is constant, so a Bridge run
trains with 0.033, the value filled here.

Warm-up: ``lr_warmup_iters``, in optimizer steps. Bridge's ``ConfigContainer.validate`` caps the
warm-up below the decay length (``train_iters`` when ``lr_decay_iters`` is None); the fill
caps it at ``training.steps`` the same way (:mod:`muse_stack.recipes.fill`).

Validation: each common function builds ``ValidationConfig(eval_interval=..., eval_iters=...)``
(``_pretrain_common``, ``_sft_common``, ``_peft_common``) or sets ``cfg.validation.eval_interval``
and ``cfg.validation.eval_iters`` (``_sft_common_vlm``, ``_peft_common_vlm``); the values are in
:data:`VALIDATION`. They are filled only into a recipe that states a ``validation`` section: the
held-out split they size changes the rows a recipe trains on, so a recipe without the section
keeps its recorded data.
"""

from __future__ import annotations

#: the policy's name, as recipes and run directories record it (``fill_policy``)
POLICY = "megatron-bridge-0.6.2"

WHEEL = {
    "distribution": "megatron-bridge",
    "version": "0.6.2",
    "file": "megatron_bridge-0.6.2-py3-none-any.whl",
    "sha256": "bcb7274ab9327167c345aa24b96b95790ce5090df1945d883bdc41065d5649e2",
    "module": "megatron.bridge.recipes.common",
    "helper": "megatron.bridge.recipes.utils.optimizer_utils.distributed_fused_adam_with_cosine_annealing",
}

#: the helper's defaults for the arguments no common recipe passes (its signature in the wheel)
HELPER_DEFAULTS = {
    "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8, "weight_decay": 0.1, "clip_grad": 1.0,
    "start_weight_decay": 0.033, "end_weight_decay": 0.033, "weight_decay_incr_style": "constant",
    "lr_decay_style": "cosine",
}

#: per recipe kind: the common function, the arguments it passes to the helper, and the recipe
#: fields (``optimizer.*``) that call gives
KINDS: dict[str, dict] = {
    "pretrain": {
        "function": "_pretrain_common",
        "arguments": {"lr_warmup_iters": 500, "lr_decay_iters": None, "max_lr": 3e-4, "min_lr": 3e-5},
        "values": {"name": "adam", "lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 500, "decay_style": "cosine",
                   "weight_decay": 0.033, "clip_grad": 1.0, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8},
    },
    "sft": {
        "function": "_sft_common",
        "arguments": {"lr_warmup_iters": 50, "lr_decay_iters": None, "max_lr": 5e-6, "min_lr": 0.0,
                      "adam_beta2": 0.98},
        "values": {"name": "adam", "lr": 5e-6, "min_lr": 0.0, "warmup_steps": 50, "decay_style": "cosine",
                   "weight_decay": 0.033, "clip_grad": 1.0, "beta1": 0.9, "beta2": 0.98, "eps": 1e-8},
    },
    "peft": {
        "function": "_peft_common",
        "arguments": {"lr_warmup_iters": 50, "lr_decay_iters": None, "max_lr": 1e-4, "min_lr": 0.0,
                      "adam_beta2": 0.98},
        "values": {"name": "adam", "lr": 1e-4, "min_lr": 0.0, "warmup_steps": 50, "decay_style": "cosine",
                   "weight_decay": 0.033, "clip_grad": 1.0, "beta1": 0.9, "beta2": 0.98, "eps": 1e-8},
    },
    "sft_vlm": {
        "function": "_sft_common_vlm",
        "arguments": {"lr_warmup_iters": 500, "lr_decay_iters": None, "max_lr": 3e-4, "min_lr": 3e-5},
        "values": {"name": "adam", "lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 500, "decay_style": "cosine",
                   "weight_decay": 0.033, "clip_grad": 1.0, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8},
    },
    "peft_vlm": {
        "function": "_peft_common_vlm",
        "arguments": {"lr_warmup_iters": 500, "lr_decay_iters": None, "max_lr": 1e-4, "min_lr": 1e-5},
        "values": {"name": "adam", "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 500, "decay_style": "cosine",
                   "weight_decay": 0.033, "clip_grad": 1.0, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8},
    },
}


#: per recipe kind: the ``ValidationConfig`` values of the same common function (recipe fields
#: ``validation.*``, Bridge's own names)
VALIDATION: dict[str, dict[str, int]] = {
    "pretrain": {"eval_interval": 500, "eval_iters": 32},
    "sft": {"eval_interval": 100, "eval_iters": 32},
    "peft": {"eval_interval": 100, "eval_iters": 32},
    "sft_vlm": {"eval_interval": 500, "eval_iters": 32},
    "peft_vlm": {"eval_interval": 500, "eval_iters": 32},
}

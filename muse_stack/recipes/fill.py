"""The named fill policy: optimizer values a recipe leaves unstated come from Megatron-Bridge
0.6.2's own common recipe for the recipe's kind (:mod:`muse_stack.recipes.bridge_defaults`).

Applied to the raw recipe after overrides and before validation, so an override (or a value the
recipe states) always wins. Every value filled is recorded in the resolved recipe under
``filled`` (dotted path -> value and source), which ``muse-stack show`` and ``plan`` print and
the fingerprint's recipe hash covers. ``fill_policy: none`` fills nothing, and a recipe whose
kind Bridge has no common recipe for (``task: benchmark``) gets nothing filled: the engines
refuse what stays unstated, naming it.

Validation values (``validation.eval_interval``, ``validation.eval_iters``) are filled the same
way, from the same common function, but only into a recipe that states a ``validation`` section
(``validation: {}`` or an override under it): the held-out split changes the rows the recipe
trains on, so a recipe without the section keeps its recorded data (Bridge's recipes always
validate; ours do when asked).
"""

from __future__ import annotations

import copy
from typing import Any

from muse_stack.recipes.bridge_defaults import KINDS, POLICY, VALIDATION, WHEEL

NONE = "none"
POLICIES = (POLICY, NONE)


def kind_of(task: Any, data_kind: Any) -> str | None:
    """Bridge's recipe kind for a recipe's task and data: pretrain, sft, peft, or the image-text
    variants sft_vlm / peft_vlm (Bridge has no pre-training common recipe for image-text, so a
    multimodal pretrain takes _pretrain_common)."""
    if task not in ("pretrain", "sft", "peft"):
        return None
    if data_kind == "multimodal" and task in ("sft", "peft"):
        return f"{task}_vlm"
    return str(task)


def source(kind: str) -> str:
    return (f"Megatron-Bridge {WHEEL['version']} {WHEEL['module']}.{KINDS[kind]['function']} "
            f"(wheel sha256 {WHEEL['sha256'][:12]})")


def apply(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with each unstated optimizer value filled and recorded under ``filled``."""
    if not isinstance(data, dict):
        return data
    policy = data.get("fill_policy", POLICY)
    if policy != POLICY:
        return data
    data_section = data.get("data") if isinstance(data.get("data"), dict) else {}
    kind = kind_of(data.get("task"), data_section.get("kind", "sft"))
    if kind is None:
        return data
    opt = data.get("optimizer", {})
    if opt is None:
        opt = {}
    if not isinstance(opt, dict):
        return data  # the schema names the error
    out = copy.deepcopy(data)
    opt = dict(opt)
    filled = dict(out.get("filled") or {}) if isinstance(out.get("filled") or {}, dict) else {}
    src = source(kind)
    values = KINDS[kind]["values"]
    training = data.get("training") if isinstance(data.get("training"), dict) else {}
    steps = training.get("steps")
    for field, value in values.items():
        if opt.get(field) is not None:
            continue
        if field == "warmup_steps" and opt.get("warmup_fraction") is not None:
            continue  # the recipe states its warm-up as a fraction
        note = src
        if field == "warmup_steps" and isinstance(steps, int) and not isinstance(steps, bool) and 0 < steps <= value:
            # Bridge's ConfigContainer.validate caps the warm-up below the decay length (train_iters)
            value = max(steps - 1, 0)
            note = f"{src}; capped below training.steps={steps} as Bridge caps lr_warmup_steps"
        opt[field] = value
        filled[f"optimizer.{field}"] = {"value": value, "source": note}
    if filled:
        out["optimizer"] = opt
    validation = data.get("validation")
    if isinstance(validation, dict):  # stated: fill what it leaves unstated (None: no validation)
        validation = dict(validation)
        for field, value in VALIDATION[kind].items():
            if validation.get(field) is None:
                validation[field] = value
                filled[f"validation.{field}"] = {"value": value, "source": src}
        out["validation"] = validation
    if filled:
        out["filled"] = filled
    return out

"""OpenRecipes records: read a published record into a recipe, write a recipe and its results back.

An OpenRecipes record (schema_version 1) has the fields schema_version, model, gpu, author,
status, stack, workload, layout, result, correctness, env, patches, run and notes. The B200
record in the seed documents is the example of the format. Facts that the record states only
in its ``run`` command (optimizer, distributed optimizer, attention backend) are read from
that command's flags, so nothing is typed in twice.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from muse_stack.util.errors import InputError, RecipeError
from muse_stack.recipes.catalogue import parse_recipe
from muse_stack.recipes.schema import REQUIRED_PATH, Recipe

SCHEMA_VERSION = 1
RECORD_FIELDS = ("schema_version", "model", "gpu", "author", "status", "stack", "workload", "layout", "result",
                 "correctness", "env", "patches", "run", "notes")
_HF_MODEL_URL = re.compile(r"huggingface\.co/([^/\s]+/[^/\s?#]+)")
#: the recipe fields a record has no place for, or holds only in part, carried as overrides of the
#: ``muse-stack run`` command a record of a muse-stack run names in its ``run`` field: with them, a run's
#: record imports to the recipe the run resolved (every field but its name, description, provenance,
#: notes and recorded results), so it trains the same rows with the same seeds and settings
CARRIED = ("engine", "task", "model.config_path", "model.pretrained_checkpoint", "model.overrides", "model.towers",
           "layout", "batch", "recompute", "offload", "engine_options", "numerics", "fp8", "optimizer", "training",
           "data", "validation", "logging", "frozen", "peft", "fill_policy", "filled")
_PEAK_MEMORY = re.compile(r"peaked at ([0-9.]+) GiB used per GPU of ([0-9.]+) GiB")


def extract_record(text: str, source: str = "record") -> dict[str, Any]:
    """The record in a YAML file, or the YAML part of a document that holds one (from ``schema_version:``)."""
    from muse_stack.util.safeio import load_yaml

    try:
        whole = load_yaml(text, source=source, field="record", error=InputError)
    except InputError:
        whole = None
    if isinstance(whole, dict) and "schema_version" in whole:
        check_record(whole, source)
        return whole
    match = re.search(r"^(#[^\n]*\n)*schema_version:", text, flags=re.MULTILINE)
    if not match:
        raise InputError(f"{source} holds no OpenRecipes record", field="schema_version", value=None,
                         fix="give a file whose YAML part starts with 'schema_version: 1'")
    record = load_yaml(text[match.start():], source=f"{source} (the record part)", field="record", error=InputError)
    check_record(record, source)
    return record


def check_record(record: Any, source: str = "record") -> None:
    if not isinstance(record, dict):
        raise InputError(f"{source}: a record must be a mapping", field="record", value=type(record).__name__,
                         fix="write the record as YAML key: value pairs")
    missing = [key for key in ("schema_version", "model", "gpu", "layout", "workload") if key not in record]
    if missing:
        raise InputError(f"{source}: the record lacks {', '.join(missing)}", field=missing[0], value=None,
                         fix="add the field (see the OpenRecipes format in docs/recipes.md)")
    if record["schema_version"] != SCHEMA_VERSION:
        raise InputError(f"{source}: unsupported record schema", field="schema_version",
                         value=record["schema_version"], fix=f"convert the record to schema_version {SCHEMA_VERSION}")


def run_flags(command: str | None) -> dict[str, Any]:
    """``--flag value`` pairs of the training command in a record's ``run`` (bare flags map to True)."""
    if not command:
        return {}
    tokens = shlex.split(command.replace("\\\n", " "), comments=True)
    flags: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--"):
            key = tok[2:].replace("-", "_")
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            if nxt is not None and not nxt.startswith("--"):
                flags[key] = yaml.safe_load(nxt) if not nxt.startswith("$") and not nxt.startswith('"') else nxt
                i += 2
                continue
            flags[key] = True
        i += 1
    return flags


def muse_stack_overrides(command: str | None) -> list[str] | None:
    """The ``key=value`` overrides of a record's run command when it is ``muse-stack run NAME ...``
    (a record of a muse-stack run), else None."""
    if not command:
        return None
    try:
        tokens = shlex.split(command)
    except ValueError:
        return None
    if tokens[:2] != ["muse-stack", "run"]:
        return None
    return [t for t in tokens[3:] if "=" in t and not t.startswith("-")]


def run_command(recipe: Recipe) -> str:
    """The ``muse-stack run`` command of a recipe, with the fields of :data:`CARRIED` as overrides,
    every word quoted (:func:`muse_stack.util.quoting.word`)."""
    from muse_stack.util.quoting import word

    def text(value: Any) -> str:  # YAML, as an override's value is read (1e-08 would read as a string)
        out = yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()
        return out[:-3].strip() if out.endswith("\n...") else out

    doc = recipe.model_dump(mode="json", exclude_none=False)
    words = ["muse-stack", "run", word(recipe.name)]
    for path in CARRIED:
        node: Any = doc
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and node != {}:  # a section whole: it replaces what the record's fields filled
            words.append(word(f"{path}={text(node)}"))
    return " ".join(words)


def _hf_model(result: dict[str, Any]) -> tuple[str | None, str | None]:
    params = (result or {}).get("active_params") or {}
    match = _HF_MODEL_URL.search(str(params.get("source") or ""))
    return (match.group(1) if match else None), params.get("revision")


def record_to_recipe(record: dict[str, Any], name: str, source: str, aliases: list[str] | None = None) -> Recipe:
    """The recipe a record describes; every value comes from the record."""
    check_record(record, source)
    gpu, layout, workload = record["gpu"], record["layout"], record["workload"]
    dataset = dict(workload.get("dataset") or {})
    build = dict(dataset.pop("build", None) or {})
    result = dict(record.get("result") or {})
    flags = run_flags(record.get("run"))
    hf_id, revision = _hf_model(result)
    notes: dict[str, str] = {}

    peak = _PEAK_MEMORY.search(record.get("notes") or "")
    if peak:
        result["peak_memory_gib"] = float(peak.group(1))
        result["memory_note"] = f"from the record's notes: peaked at {peak.group(1)} GiB of {peak.group(2)} GiB"
    memory_gib = float(peak.group(2)) if peak else None
    if memory_gib:
        notes["hardware.memory_gib"] = "usable memory per GPU as the record's notes state it"

    start = None
    if flags.get("hf_checkpoint"):  # the run starts from the released weights: a path only the user has
        start = REQUIRED_PATH
        notes["model.pretrained_checkpoint"] = (
            f"the record's run starts from the released checkpoint (--hf-checkpoint {flags['hf_checkpoint']} in its "
            f"run command); give a local copy of {hf_id or 'the model'} at the recipe's revision")

    price = None
    if result.get("usd_per_million_tokens") and result.get("tokens_per_s_per_gpu"):
        price = round(result["usd_per_million_tokens"] * result["tokens_per_s_per_gpu"] * 3600 / 1e6, 2)
        notes["hardware.price_per_gpu_hour"] = "derived: $ per 1M tokens x tokens/s per GPU x 3600 / 1e6"

    template_kwargs: dict[str, Any] = {}
    for part in str(build.pop("template_kwargs", "") or "").split(","):
        if part.strip():
            key, _, value = part.strip().partition(" ")
            template_kwargs[key] = value
    split = layout.get("layer_split") or {}
    recompute = layout.get("recompute") or {}
    steps = result.get("steps_per_run") or flags.get("num_rollout")
    window = result.get("window")
    carried = muse_stack_overrides(record.get("run"))
    optimizer_flags = ("optimizer", "lr", "min_lr", "lr_warmup_fraction", "lr_decay_style", "weight_decay",
                       "adam_beta1", "adam_beta2")
    if window and steps:
        notes["training.measure_warmup_steps"] = f"the record's window starts at step {window[0]} of {steps}"
    if layout.get("offload") is None:
        says = "no offload" in str(layout.get("summary") or "")
        notes["offload"] = "the record's layout.offload is null" + (" and its summary says no offload" if says else "")
    if any(k in flags for k in optimizer_flags) or any(o.partition("=")[0].split(".")[0] == "optimizer"
                                                       for o in carried or []):
        notes["optimizer"] = "read from the record's run command"
    data = {
        "kind": "sft",
        "dataset": dataset.pop("source", None),
        "revision": dataset.pop("revision", None),
        "builder": "fixed",
        "rows": build.pop("rows", None),
        "rows_sha256": dataset.pop("rows_sha256", None),
        "build_name": build.pop("name", None),
        "seed": build.pop("seed", None),
        "loss_mask": build.pop("loss_mask", None),
        "template_kwargs": template_kwargs,
        "license": dataset.pop("license", None),
        "details": {"dataset_name": dataset.pop("name", None), "rows_description": workload.get("rows"), **build,
                    **dataset},
    }
    recipe = {
        "name": name,
        "aliases": aliases or [],
        "task": "sft" if flags.get("loss_type") == "sft_loss" else "pretrain",
        "description": f"{layout.get('label')} on {gpu['count']} {gpu['type']}: the OpenRecipes record of "
                       f"{(record.get('author') or {}).get('name', 'its author')}.",
        "engine": "megatron",
        "model": {"hf_id": hf_id, "revision": revision, "pretrained_checkpoint": start},
        "hardware": {
            "gpu": gpu["type"],
            "count": gpu["count"],
            "per_node": gpu["per_node"],
            "instance": gpu.get("instance"),
            "memory_gib": memory_gib,
            "price_per_gpu_hour": price,
            "nominal_memory_gb": gpu.get("memory_gb"),
        },
        "layout": {
            "tp": layout["tp"], "pp": layout["pp"], "vpp": layout.get("vpp"), "cp": layout.get("cp", 1),
            "cp_comm_type": None, "ep": layout["ep"], "etp": layout.get("etp", 1), "dp": layout.get("dp"),
            "sequence_parallel": layout.get("sequence_parallel"),
            "first_stage_layers": split.get("first"), "last_stage_layers": split.get("last"),
            "dispatcher": layout.get("dispatcher"),
            "distributed_optimizer": bool(flags.get("use_distributed_optimizer")),
            "attention_backend": flags.get("attention_backend"),
            "label": layout.get("label"), "summary": layout.get("summary"), "highlights": layout.get("highlights"),
        },
        "batch": {
            "mbs": layout.get("rows_per_microbatch"),
            "gbs": workload.get("global_batch"),
            "seq_length": workload.get("row_tokens"),
            "packed": False,
            "max_tokens_per_gpu": layout.get("max_tokens_per_gpu"),
            "qkv_format": flags.get("qkv_format"),
        },
        "recompute": {"granularity": recompute.get("granularity"), "method": recompute.get("method"),
                      "num_layers": recompute.get("num_layers")},
        "offload": {"optimizer": bool(layout.get("offload")), "activations": bool(layout.get("offload"))},
        "precision": workload.get("precision"),
        "optimizer": {
            "name": flags.get("optimizer"), "lr": flags.get("lr"), "min_lr": flags.get("min_lr"),
            "warmup_fraction": flags.get("lr_warmup_fraction"), "decay_style": flags.get("lr_decay_style"),
            "weight_decay": flags.get("weight_decay"), "beta1": flags.get("adam_beta1"),
            "beta2": flags.get("adam_beta2"),
        },
        "training": {"steps": steps, "measure_warmup_steps": window[0] if window else None},
        "data": data,
        "env": {k: str(v) for k, v in (record.get("env") or {}).items()},
        "stack": record.get("stack"),
        "result": {k: v for k, v in result.items()},
        "correctness": record.get("correctness"),
        "run_command": record.get("run"),
        "author": record.get("author"),
        "status": record.get("status"),
        "provenance": {"source": source, "function": aliases[0] if aliases else None,
                       "summary": (record.get("notes") or "").strip() or None,
                       "url": (record.get("author") or {}).get("url")},
        "notes": {
            **notes,
            **({"layout.cp_comm_type": "CP 1: no context parallelism"} if layout.get("cp", 1) == 1 else {}),
        },
    }
    if carried:  # a record of a muse-stack run: what its fields cannot say, from its own command
        from muse_stack.recipes.overrides import apply_overrides

        recipe = apply_overrides(recipe, carried)
        if isinstance(recipe.get("data"), dict) and recipe["data"].get("rows_sha256") is None:
            # the rows the run trained on, as its fingerprint recorded them: the import pins them
            recipe["data"]["rows_sha256"] = data["rows_sha256"]
    from muse_stack.recipes import fill

    return parse_recipe(fill.apply(recipe), source)  # resolved as the catalogue loads it: unstated values filled


def read_record_file(path: str | Path) -> dict[str, Any]:
    from muse_stack.util.safeio import read_text

    path = Path(path)
    text = read_text(path, field="record", what="OpenRecipes record", fix="give the path of an OpenRecipes record (YAML)")
    return extract_record(text, str(path))


def recipe_to_record(recipe: Recipe, results: dict[str, Any] | None = None,
                     stack: dict[str, Any] | None = None, rows_sha256: str | None = None) -> dict[str, Any]:
    """An OpenRecipes record of a recipe; ``results`` (a run's results.json) replaces the recorded result
    and ``stack`` (from a fingerprint) the recorded stack."""
    hw, lay, batch, data = recipe.hardware, recipe.layout, recipe.batch, recipe.data
    details = dict(data.details)
    build = {
        "name": data.build_name,
        **{k: details.pop(k) for k in ("tokenizer",) if k in details},
        "loss_mask": data.loss_mask,
        "rows": data.rows,
        "row_tokens": batch.seq_length,
        **{k: details.pop(k) for k in ("padding_tokens",) if k in details},
        "seed": data.seed,
        **{k: details.pop(k) for k in ("packing",) if k in details},
        "template_kwargs": ", ".join(f"{k} {v}" for k, v in data.template_kwargs.items()) or None,
    }
    dataset_name = details.pop("dataset_name", None)
    rows_description = details.pop("rows_description", None)
    build.update(details)
    result = recipe.result.model_dump(exclude={"peak_memory_gib", "memory_note"}) if recipe.result else {}
    if results:
        result.update({
            "tokens_per_s_per_gpu": results.get("tokens_per_s_per_gpu"),
            "usd_per_million_tokens": results.get("usd_per_million_tokens"),
            "step_time_cv_percent": results.get("step_time_cv_percent"),
            "mfu": results.get("mfu_6n"),
            "mfu_note": "6 x N_active x tokens/s / peak",
            "active_params": {"count": results.get("active_params")},
            "measured": results.get("finished_at", "")[:10] or None,
            "steps_per_run": results.get("steps_completed"),
            "window": results.get("window"),
            "gpu_hours": results.get("gpu_hours"),
        })
    record: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "model": recipe.model.hf_id.split("/")[-1] if recipe.model.hf_id
        else f"{recipe.name} (a reduced Muse Spark configuration)",
        "gpu": {"type": hw.gpu, "memory_gb": hw.nominal_memory_gb, "count": hw.count, "per_node": hw.per_node,
                "instance": hw.instance},
        "author": recipe.author,
        "status": recipe.status,
        "stack": stack if stack is not None else (recipe.stack.model_dump() if recipe.stack else None),
        "workload": {
            "row_tokens": batch.seq_length, "rows": rows_description, "global_batch": batch.gbs,
            "precision": recipe.precision,
            "dataset": {"name": dataset_name, "source": data.dataset, "revision": data.revision,
                        "license": data.license, "rows_sha256": rows_sha256 or data.rows_sha256, "build": build},
        },
        "layout": {
            "label": lay.label, "summary": lay.summary, "highlights": lay.highlights,
            "tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "cp": lay.cp, "ep": lay.ep, "etp": lay.etp, "dp": lay.dp,
            "sequence_parallel": lay.sequence_parallel,
            "layer_split": {"first": lay.first_stage_layers, "last": lay.last_stage_layers},
            "max_tokens_per_gpu": batch.max_tokens_per_gpu, "rows_per_microbatch": batch.mbs,
            "recompute": recipe.recompute.model_dump(exclude={"modules", "towers"}),
            "offload": None if not (recipe.offload.optimizer or recipe.offload.activations)
            else recipe.offload.model_dump(),
            "dispatcher": lay.dispatcher,
        },
        "result": result,
        "correctness": recipe.correctness,
        "env": dict(recipe.env),
        "patches": [],
        "run": recipe.run_command if recipe.run_command else run_command(recipe),
        "notes": recipe.provenance.summary,
    }
    return record


def record_yaml(record: dict[str, Any]) -> str:
    return yaml.safe_dump(record, sort_keys=False, width=120, allow_unicode=True)


def import_record(path: str | Path, name: str) -> Recipe:
    from muse_stack.util.safeio import read_text

    record = read_record_file(path)
    rel = None
    head = read_text(path, field="record", what="OpenRecipes record")
    match = re.search(r"^#\s*(recipes/\S+\.yaml)", head, flags=re.MULTILINE)
    if match:
        rel = match.group(1)
    if not name:
        raise RecipeError("a recipe name is needed", field="name", value=name, fix="pass --name e.g. attune-b200")
    return record_to_recipe(record, name=name, source=Path(path).name, aliases=[rel] if rel else [])

"""What an export adds to the decoder's weights so that transformers loads it as the model.

transformers' ``MuseSparkForConditionalGeneration`` always builds both perception towers, so a
checkpoint it loads with nothing missing carries them:

* a run whose model has towers (its step folder holds tower tensors, on either engine) exports
  those, with the run's tower configs (:func:`towers_from_tensors`);
* else a run from a checkpoint that has towers (the released model) exports those towers
  unchanged, with their configs (:func:`towers_from_checkpoint`);
* a text-only run from a seed gets the smallest consistent towers
  (:func:`muse_stack.models.muse_spark.hf_config.placeholder_perception`), initialised from the run's seed and
  untrained; the model card says so (:func:`placeholder_towers`).

Beside them: the tokenizer files the run trained with, and a model card (``README.md``) naming
the recipe, the run, its fingerprint, the steps, the final loss and how to load it. (The export's
``generation_config.json``, from the ids of the run's tokenizer, is
:func:`muse_stack.publish.hf.generation_config`.)
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from muse_stack.models.muse_spark.hf_config import perception_of, placeholder_perception
from muse_stack.models.muse_spark.config import ModelConfig

#: files of a tokenizer directory that an export copies (what AutoTokenizer reads)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "added_tokens.json")


@dataclass
class Towers:
    """The perception part of an export: its config keys and its tensors by HF name."""

    config: dict[str, Any]
    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    get: Callable[[str], torch.Tensor]
    placeholder: bool
    source: str
    notes: list[str] = field(default_factory=list)


def placeholder_towers(model: ModelConfig, seed: int) -> Towers:
    """The smallest towers consistent with ``model``, initialised from ``seed`` (normal with the
    model's ``initializer_range``; norms at their identity), in the reference model's modules."""
    from muse_stack.models.muse_spark.perception import MuseSparkPerception
    from muse_stack.models.muse_spark.tower_config import TowersConfig

    config = placeholder_perception(model)
    towers = MuseSparkPerception(TowersConfig.from_hf(config), text_hidden_size=model.hidden_size,
                                 text_rms_norm_eps=model.rms_norm_eps)
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in towers.state_dict().items():
        if tensor.dim() == 1 and "norm" in name:
            value = tensor.detach().clone()  # a norm's own identity initialisation
        elif name.endswith(".bias"):
            value = torch.zeros_like(tensor)
        else:
            value = torch.empty(tensor.shape).normal_(0.0, model.initializer_range, generator=generator)
        state[f"model.{name}"] = value.contiguous()
    return Towers(config, list(state), {k: tuple(v.shape) for k, v in state.items()},
                  {k: v.dtype for k, v in state.items()}, state.__getitem__, placeholder=True,
                  source=f"placeholder, seed {seed}",
                  notes=["This run trained the text decoder only. transformers builds both perception towers from "
                         "any config, so this checkpoint carries the smallest consistent towers, initialised from "
                         f"seed {seed} and untrained: image, video and audio inputs give meaningless features."])


def towers_from_tensors(specs: list, get: Callable[[str], torch.Tensor], perception: dict[str, Any], *,
                        source: str) -> Towers | None:
    """The towers among a step folder's tensors by HF name (``specs``: TensorSpec, ``get`` reads
    one), with ``perception`` as their config keys (the run's towers: ``TowersConfig.to_hf()``);
    None when none of the tensors is a tower's (a text run)."""
    from muse_stack.models.muse_spark.checkpoint import is_text_tensor

    names = [s.name for s in specs if not is_text_tensor(s.name)]
    if not names:
        return None
    by_name = {s.name: s for s in specs}
    return Towers(perception, names, {n: tuple(by_name[n].shape) for n in names},
                  {n: by_name[n].dtype for n in names}, get, placeholder=False, source=source)


def towers_of_step(folder: Path, specs: list, get: Callable[[str], torch.Tensor], run_towers) -> Towers | None:
    """The towers a run saved with one step (either engine), or None for a text run: the tower
    tensors among ``specs``, configured by the step folder's ``config.json`` where it has one (the
    reference engine writes it), else by the run's own towers (``run_towers``, a TowersConfig)."""
    from muse_stack.util.errors import InputError
    from muse_stack.models.muse_spark.checkpoint import CONFIG_NAME

    config_file = Path(folder) / CONFIG_NAME
    perception = perception_of(json.loads(config_file.read_text())) if config_file.is_file() else None
    if perception is None and run_towers is not None:
        perception = run_towers.to_hf()
    found = towers_from_tensors(specs, get, perception or {}, source=str(folder))
    if found is not None and perception is None:
        raise InputError("the checkpoint holds tower tensors, but neither its config.json nor the run's recipe "
                         "states the towers", field="checkpoint", value=str(folder),
                         fix="export with the recipe the run trained with (its model.towers)")
    return found


def towers_from_checkpoint(directory: str | Path) -> Towers | None:
    """The towers of an HF checkpoint or of a reference-engine step folder (config keys and
    tensors), or None when it has none (no tower configs in config.json, or no tower tensors)."""
    from safetensors import safe_open

    from muse_stack.models.muse_spark.checkpoint import CONFIG_NAME, _weight_files, is_text_tensor, safetensors_dtype

    path = Path(directory)
    config = json.loads((path / CONFIG_NAME).read_text())
    perception = perception_of(config)
    if perception is None:
        return None
    where: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for file, names in _weight_files(path).items():
        with safe_open(str(path / file), framework="pt") as handle:
            for name in names:
                if is_text_tensor(name):
                    continue
                piece = handle.get_slice(name)
                where[name], shapes[name], dtypes[name] = file, tuple(piece.get_shape()), safetensors_dtype(piece.get_dtype())
    if not where:
        return None

    def get(name: str) -> torch.Tensor:
        with safe_open(str(path / where[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    return Towers(perception, list(where), shapes, dtypes, get, placeholder=False, source=str(path))


def copy_tokenizer(tokenizer_dir: Path | None, out: Path) -> list[str]:
    """Copy the run's tokenizer files into ``out``; returns the names copied."""
    if tokenizer_dir is None or not tokenizer_dir.is_dir():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        source = tokenizer_dir / name
        if source.is_file():
            shutil.copyfile(source, out / name)
            copied.append(name)
    return copied


def file_sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def final_loss(run_dir: Path, step: int) -> float | None:
    """The loss metrics.jsonl records at ``step`` (the exported checkpoint's)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    loss = None
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("step") == step and isinstance(row.get("loss"), (int, float)):
            loss = float(row["loss"])
    return loss


LOAD_SNIPPET = """\
from transformers import AutoTokenizer, MuseSparkForConditionalGeneration

model = MuseSparkForConditionalGeneration.from_pretrained("{path}")
tokenizer = AutoTokenizer.from_pretrained("{path}")
prompt = tokenizer.apply_chat_template([{{"role": "user", "content": "Hello"}}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)
print(tokenizer.decode(model.generate(**prompt, max_new_tokens=8)[0]))
"""


def model_card(*, recipe: str, run_dir: Path, step: int, loss: float | None, fingerprint_sha256: str | None,
               towers: Towers, tokenizer_files: list[str], out_name: str) -> str:
    lines = [
        f"# {recipe}: muse-stack run {run_dir.name}, step {step}",
        "",
        "Muse Spark in transformers' `muse_spark` layout (`MuseSparkForConditionalGeneration`), exported by "
        "`muse-stack export`.",
        "",
        "| | |",
        "|---|---|",
        f"| recipe | `{recipe}` |",
        f"| run | `{run_dir.name}` |",
        f"| stack fingerprint (sha256 of the run's fingerprint.json) | `{fingerprint_sha256 or 'not recorded'}` |",
        f"| steps | {step} |",
        f"| final loss (metrics.jsonl at step {step}) | {'not recorded' if loss is None else f'{loss:.6g}'} |",
        f"| perception towers | {'placeholder (untrained)' if towers.placeholder else 'from ' + towers.source} |",
        f"| tokenizer | {', '.join(tokenizer_files) if tokenizer_files else 'not exported (not found)'} |",
        "",
        "## Load it",
        "",
        "```python",
        LOAD_SNIPPET.format(path=out_name).rstrip(),
        "```",
        "",
    ]
    for note in towers.notes:
        lines += [note, ""]
    return "\n".join(lines)

"""One spec per training engine: how to build it, what it refuses, whether this machine can run it,
and how its checkpoints read as tensors under transformers' names (for export and merge).

Everything that differs between the engines is here or in the module a spec names; the rest of
muse-stack asks :func:`engine_spec` instead of testing the engine's name. What a recipe may ask of
an engine, as data (the traits the resolve step and the planner read), is
:mod:`muse_stack.recipes.engines`; the whole check of a recipe against its engine is
:meth:`muse_stack.resolve.recipe.ResolvedRecipe.validate`, which calls the spec's ``check``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from muse_stack.engines.support import TOWERS, check_precision_aware
from muse_stack.util.errors import InputError, RecipeError
from muse_stack.recipes.engines import EngineTraits, traits


@dataclass(frozen=True)
class EngineSpec:
    traits: EngineTraits
    load: Callable[[], type]  #: the engine class (imports the engine's stack)
    missing: Callable[[], str | None]  #: why this machine's software cannot run it (None: it can)
    #: what it would not train as written, naming the field (of a muse_stack.resolve.recipe.ResolvedRecipe)
    check: Callable[[Any], None]
    hf_tensors: Callable[[Path], tuple[list, Callable]]  #: a step folder's model tensors by HF name
    adapter_meta: Callable[[Path], dict | None]  #: adapter settings and base identity (None: full model)
    adapter_tensors: Callable[[Path], dict]  #: a step folder's adapter tensors by reference name
    #: the base an adapter run sat on can be rebuilt (model None: before building it) and is the one
    #: the adapters were trained on (model given)
    check_base: Callable[[Any, str | None, dict, Path], None]

    @property
    def name(self) -> str:
        return self.traits.name


# ---- reference engine ---------------------------------------------------------------------
def _load_reference() -> type:
    from muse_stack.engines.reference import ReferenceEngine

    return ReferenceEngine


def _check_reference(resolved) -> None:
    recipe = resolved.recipe
    lay = recipe.layout
    split = {k: v for k, v in (("tp", lay.tp), ("pp", lay.pp), ("cp", lay.cp or 1), ("ep", lay.ep or 1),
                               ("etp", lay.etp), ("vpp", lay.vpp or 1)) if v > 1}
    if split:
        name = next(iter(split))
        raise RecipeError("the reference engine is data-parallel only: every process holds the whole model",
                          field=f"layout.{name}", value=split[name],
                          fix=f"set layout.{name}=1 (the processes become data-parallel replicas), "
                              "or use engine: megatron")
    if recipe.training.async_checkpoint:
        raise RecipeError("the reference engine saves checkpoints synchronously", field="training.async_checkpoint",
                          value=True, fix="set training.async_checkpoint=false, or use engine: megatron")
    if recipe.recompute.granularity not in (None, "none"):
        raise RecipeError("the reference engine keeps every activation; it does not recompute",
                          field="recompute.granularity", value=recipe.recompute.granularity,
                          fix="unset recompute.granularity, or use engine: megatron")


def _reference_adapter_meta(folder: Path) -> dict | None:
    from muse_stack.models.muse_spark.peft_io import ADAPTER_META, read_adapter_meta

    return read_adapter_meta(folder) if (folder / ADAPTER_META).exists() else None


def _reference_adapter_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    from muse_stack.models.muse_spark.peft_io import ADAPTER_FILE

    return load_file(str(folder / ADAPTER_FILE))


def _reference_check_base(model, path: str | None, base_id: dict, folder: Path) -> None:
    if model is None:  # a seed base rebuilds on any machine
        return
    from muse_stack.models.muse_spark.peft_io import base_difference

    why = base_difference(model, base_id)
    if why is not None:
        raise InputError(f"the base model rebuilt here is not the one the adapters were trained on: {why}",
                         field="--merge", value=path or f"seed {base_id.get('init_seed')}",
                         fix=("restore the checkpoint the run started from at that path" if path else
                              "export with the torch version the run used")
                             + ", or use --adapters-only (the adapters alone, for the base they name)")


def _reference_hf_tensors(folder: Path):
    from muse_stack.models.muse_spark.checkpoint import hf_tensor_source

    return hf_tensor_source(folder)


# ---- megatron engine ----------------------------------------------------------------------
def _load_megatron() -> type:
    from muse_stack.engines.megatron_available import require_megatron

    require_megatron()
    from muse_stack.engines.megatron import MegatronEngine

    return MegatronEngine


def _megatron_missing() -> str | None:
    from muse_stack.engines.megatron_available import missing

    return missing()


def _check_megatron(resolved) -> None:
    from muse_stack.engines.mcore.config import transformer_config_kwargs

    recipe = resolved.recipe
    transformer_config_kwargs(recipe, resolved.model)
    check_precision_aware(recipe)
    if recipe.optimizer.name == "sgd":
        raise RecipeError("the megatron engine trains with Adam(W)", field="optimizer.name",
                          value=recipe.optimizer.name, fix="use adam, or the reference engine for SGD")
    settings = resolved.peft
    if settings is not None:
        if settings.expert_targets and recipe.layout.etp > 1:
            raise RecipeError("the megatron engine's expert adapters are whole on every expert-tensor-parallel "
                              "rank; it does not split them over ETP", field="layout.etp", value=recipe.layout.etp,
                              fix="set layout.etp=1 (and raise layout.ep), or drop "
                                  + ", ".join(settings.expert_targets) + " from peft.targets")
    # with adapters the whole base is frozen (frozen: [base]); the engine freezes nothing else
    frozen = [f for f in recipe.frozen if f not in TOWERS and not (recipe.peft is not None and f == "base")]
    if frozen:
        raise RecipeError("the megatron engine trains every decoder parameter; it does not freeze modules",
                          field="frozen", value=frozen,
                          fix="drop them from frozen, or use engine: reference, which freezes by parameter name")


def _megatron_hf_tensors(folder: Path):
    from muse_stack.engines.mcore.weights import dist_hf_source

    return dist_hf_source(folder)


def _megatron_adapter_meta(folder: Path) -> dict | None:
    from muse_stack.engines.mcore.peft_checkpoint import read_meta

    return read_meta(folder)


def _megatron_adapter_tensors(folder: Path) -> dict:
    from muse_stack.engines.mcore.peft_checkpoint import dist_adapter_tensors

    return dist_adapter_tensors(folder)


def _megatron_check_base(model, path: str | None, base_id: dict, folder: Path) -> None:
    if not path:
        raise InputError("--merge needs the base weights, but this run's megatron base was initialised from seed "
                         f"{base_id.get('init_seed')} on the GPU and its weights are not on disk",
                         field="--merge", value=str(folder),
                         fix="use --adapters-only, or train with model.pretrained_checkpoint set to an HF checkpoint")
    if model is None:
        return
    from muse_stack.engines.mcore.peft_checkpoint import safetensors_headers_sha256

    ours = safetensors_headers_sha256(path)
    if ours != base_id.get("headers_sha256"):
        raise InputError(f"the base checkpoint {path} is not the one the adapters were trained on "
                         f"(headers sha256 {ours[:12]}, saved {str(base_id.get('headers_sha256'))[:12]})",
                         field="--merge", value=path, fix="restore that checkpoint, or use --adapters-only")


ENGINES: dict[str, EngineSpec] = {
    "reference": EngineSpec(traits("reference"), load=_load_reference, missing=lambda: None,
                            check=_check_reference, hf_tensors=_reference_hf_tensors,
                            adapter_meta=_reference_adapter_meta, adapter_tensors=_reference_adapter_tensors,
                            check_base=_reference_check_base),
    "megatron": EngineSpec(traits("megatron"), load=_load_megatron, missing=_megatron_missing,
                           check=_check_megatron, hf_tensors=_megatron_hf_tensors,
                           adapter_meta=_megatron_adapter_meta, adapter_tensors=_megatron_adapter_tensors,
                           check_base=_megatron_check_base),
}


def engine_spec(name: str) -> EngineSpec:
    """The spec of a recipe's ``engine``."""
    traits(name)  # an unknown name is refused there, naming the field
    return ENGINES[name]

"""What a run reads or needs besides the machine, checked before anything is written (by ``run``,
and by ``launch`` before it writes a job). Whether the machine can run the recipe at all is
:mod:`muse_stack.run.availability`."""

from __future__ import annotations

from pathlib import Path

from muse_stack.util.errors import InputError
from muse_stack.recipes.schema import REQUIRED_PATH, Recipe
from muse_stack.run.tensorboard import check_available


def check_inputs(recipe: Recipe, *, start: bool = True) -> None:
    """The loggers the recipe asks for can start, and the checkpoint it starts from (``start``) is
    a Hugging Face-style directory with a config and weights that loading would not refuse
    (:func:`muse_stack.models.muse_spark.checkpoint.check_readable`)."""
    check_available(recipe)
    if not start:  # a resumed run takes its weights from its own checkpoint
        return
    start = recipe.model.pretrained_checkpoint
    if not start or start == REQUIRED_PATH:
        return
    path = Path(start)
    fix = "pass --pretrained-checkpoint DIR: a local directory holding config.json and model*.safetensors"
    if not path.is_dir():
        raise InputError("the checkpoint to start from is not a directory", field="--pretrained-checkpoint",
                         value=start, fix=fix)
    if not (path / "config.json").is_file():
        raise InputError("the checkpoint to start from has no config.json", field="--pretrained-checkpoint",
                         value=start, fix=fix)
    if not ((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()):
        raise InputError("the checkpoint to start from has no weights (neither model.safetensors nor "
                         "model.safetensors.index.json)", field="--pretrained-checkpoint", value=start, fix=fix)
    from muse_stack.models.muse_spark.checkpoint import check_readable

    check_readable(path)  # what loading it would refuse, from config.json and the headers

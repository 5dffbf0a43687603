"""Can this machine run the recipe at all? Checked first, before the process count and the layout,
so the first error a user sees names the real problem (no CUDA, no megatron-core) and its fix,
instead of a process-count mismatch whose suggested fix leads to a layout error."""

from __future__ import annotations

from muse_stack.engines.spec import engine_spec
from muse_stack.errors import EngineUnavailable
from muse_stack.recipes.schema import Recipe


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_runnable_here(recipe: Recipe, name: str) -> None:
    """Raise :class:`EngineUnavailable` when the recipe's engine or device cannot run on this machine."""
    hw = recipe.hardware
    spec = engine_spec(recipe.engine)
    if hw.gpu == "cpu" and spec.traits.runs_on_cpu:
        return
    needs = (f"{name} needs {hw.count} {hw.gpu} GPU{'s' if hw.count != 1 else ''} "
             f"({hw.nodes} node{'s' if hw.nodes != 1 else ''} of {hw.per_node})")
    target = hw.gpu.lower()
    start = (f"`muse-stack launch {name} --slurm` (or `--k8s`) starts it on {hw.nodes} nodes" if hw.nodes > 1 else
             f"`docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 "
             f"-v $PWD/runs:/workspace/runs muse-stack:{target} run {name}` starts it")
    fix = (f"use a GPU image (`make image gpu={target}`): {start}; on this machine the CPU reference engine "
           "runs `muse-stack run tiny-cpu`")
    reason = spec.missing()
    if reason:
        raise EngineUnavailable(f"{needs} and {spec.traits.summary}: {reason}", field="engine",
                                value=recipe.engine, fix=fix)
    if hw.gpu != "cpu" and _cuda_devices() == 0:
        raise EngineUnavailable(f"{needs}; this machine has no CUDA device", field="hardware.gpu", value=hw.gpu,
                                fix=fix)


def check_inputs(recipe: Recipe, *, start: bool = True) -> None:
    """What the run reads or needs besides the machine, checked before anything is written (and by
    ``launch`` before it writes a job): the loggers the recipe asks for can start, and the
    checkpoint it starts from (``start``) is a Hugging Face-style directory with a config and weights."""
    from muse_stack.errors import InputError
    from muse_stack.recipes.schema import REQUIRED_PATH
    from muse_stack.run.tensorboard import check_available

    check_available(recipe)
    if not start:  # a resumed run takes its weights from its own checkpoint
        return
    start = recipe.model.pretrained_checkpoint
    if not start or start == REQUIRED_PATH:
        return
    from pathlib import Path

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

"""Can this machine run the recipe at all? Checked first, before the process count and the layout,
so the first error a user sees names the real problem (no CUDA, no megatron-core) and its fix,
instead of a process-count mismatch whose suggested fix leads to a layout error."""

from __future__ import annotations

from muse_stack.engines.spec import engine_spec
from muse_stack.util.errors import EngineUnavailable
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
    from muse_stack.machine.table import table

    machine = table().machines.get(hw.gpu)
    target = machine.lock if machine is not None else None  # the image the machine table builds for this GPU
    start = (f"`muse-stack launch {name} --slurm` (or `--k8s`) starts it on {hw.nodes} nodes" if hw.nodes > 1 else
             f"`docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 "
             f"-v $PWD/runs:/workspace/runs muse-stack:{target} run {name}` starts it")
    image = (f"use a GPU image (`make image gpu={target}`): {start}" if target else
             f"run it on a machine with {hw.gpu} GPUs, megatron-core and Transformer Engine (no image of this "
             f"project is built for {hw.gpu}: the locks are in containers/locks/, one per machine of muse_stack/machine/machines.yaml)")
    fix = f"{image}; on this machine the CPU reference engine runs `muse-stack run tiny-cpu`"
    reason = spec.missing()
    if reason:
        raise EngineUnavailable(f"{needs} and {spec.traits.summary}: {reason}", field="engine",
                                value=recipe.engine, fix=fix)
    if hw.gpu != "cpu" and _cuda_devices() == 0:
        raise EngineUnavailable(f"{needs}; this machine has no CUDA device", field="hardware.gpu", value=hw.gpu,
                                fix=fix)


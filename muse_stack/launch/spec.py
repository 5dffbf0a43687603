"""What a launcher renders: the recipe validated by the planner, nodes and processes per node,
the image, the environment and the run directory every node shares."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from muse_stack.errors import InputError, LayoutError, UsageError
from muse_stack.launch.targets import EFA_LIBRARY_PATH, Target, target_for
from muse_stack.recipes.schema import Recipe

RDZV_PORT = 29500
STOP_SIGNAL_SECONDS = 120  # SIGTERM this long before the time limit: time to finish a step and save

# container paths of the shared volumes
DATA_MOUNT = "/data"
CHECKPOINT_MOUNT = "/checkpoints"
RUNS_MOUNT = "/runs"
CONTAINER_ENV: dict[str, str] = {
    "MUSE_STACK_CACHE": f"{DATA_MOUNT}/muse-stack-cache",
    "HF_HOME": f"{CHECKPOINT_MOUNT}/huggingface",
    "HF_DATASETS_CACHE": f"{DATA_MOUNT}/huggingface/datasets",
    "KERNEL_CACHE": f"{DATA_MOUNT}/kernel-cache",
}


@dataclass
class LaunchSpec:
    recipe: Recipe
    name: str  # the recipe as the user named it (catalogue name or file)
    run_overrides: list[str]  # key=value overrides the run command inside the job receives
    steps: int | None
    target: Target
    nodes: int
    per_node: int  # processes per node: one per GPU, or CPU processes
    image: str | None
    network: str  # where the network settings come from, for the rendered comment
    env: dict[str, str] = field(default_factory=dict)  # the target's network settings, then the recipe's
    job_name: str = ""
    library_path: str | None = None  # prepended to LD_LIBRARY_PATH inside the container (EFA libraries)
    run_name: str | None = None  # fixed run directory name (re-submitting it continues an interrupted run)

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    def run_command_args(self) -> list[str]:
        args = [self.name, *self.run_overrides]
        if self.steps is not None:
            args += ["--steps", str(self.steps)]
        return args


def dns_name(text: str, limit: int = 40) -> str:
    """A DNS-1123 label (Kubernetes names, Slurm job names) from a recipe name."""
    s = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return s[:limit].rstrip("-") or "run"


def _layout(recipe: Recipe, target: Target, nodes: int | None, gpus: int | None) -> tuple[int, int]:
    hw = recipe.hardware
    per_node = hw.per_node
    if target.gpus_per_node is not None and per_node != target.gpus_per_node:
        raise LayoutError(f"a {hw.gpu} node has {target.gpus_per_node} GPUs", field="hardware.per_node",
                          value=per_node, rule=f"{target.instance}: {target.gpus_per_node} GPUs per node",
                          fix=f"set hardware.per_node={target.gpus_per_node}")
    count = gpus if gpus is not None else hw.count
    if nodes is not None:
        if gpus is None:
            count = nodes * per_node
        elif target.gpus_per_node is None:
            if gpus % nodes:
                raise LayoutError("the processes do not split evenly over the nodes", field="--gpus", value=gpus,
                                  rule=f"--gpus divisible by --nodes {nodes}", fix="give a multiple of --nodes")
            per_node = gpus // nodes
        elif gpus != nodes * per_node:
            raise LayoutError(f"{nodes} nodes of {per_node} {hw.gpu} GPUs are {nodes * per_node} GPUs", field="--gpus",
                              value=gpus, rule="GPUs = nodes x GPUs per node",
                              fix=f"give --gpus {nodes * per_node}, or only one of --gpus and --nodes")
    if count % per_node:
        raise LayoutError("the GPUs do not fill whole nodes", field="hardware.count", value=count,
                          rule=f"a multiple of {per_node} per node",
                          fix=f"use {(-(-count // per_node)) * per_node} GPUs ({-(-count // per_node)} nodes)")
    return count, per_node


def resolve(name: str, overrides: list[str] | None = None, *, nodes: int | None = None, gpus: int | None = None,
            steps: int | None = None, image: str | None = None, run_name: str | None = None,
            nccl_debug: str | None = None) -> LaunchSpec:
    """Resolve and validate a recipe for launching; raises (the planner's error) before anything is written.
    ``nccl_debug`` sets NCCL_DEBUG over the target's WARN and the recipe's env (INFO and TRACE also
    set NCCL_DEBUG_SUBSYS=INIT,NET: the plugin and network lines without every collective)."""
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.run.pipeline import prepare

    overrides = list(overrides or [])
    from muse_stack.recipes.schema import MAX_GPUS

    if nodes is not None and not 1 <= nodes <= MAX_GPUS:
        raise UsageError("the node count is out of range", field="--nodes", value=nodes, rule=f"1 to {MAX_GPUS:,}",
                         fix="give --nodes 1 or more")
    if gpus is not None and not 1 <= gpus <= MAX_GPUS:
        raise UsageError("the GPU count is out of range", field="--gpus", value=gpus, rule=f"1 to {MAX_GPUS:,}",
                         fix="give --gpus 1 or more")
    from muse_stack.launch import quoting

    quoting.check(image, quoting.IMAGE, "--image", "an image reference: letters, digits and . _ / : @ # + = -",
                  "give e.g. registry.example.com/muse-stack:gb200-0.1.0@sha256:<digest> or /fsx/images/x.sqsh")
    from muse_stack.safeio import URL_CREDENTIALS

    if image is not None and URL_CREDENTIALS.search(image):
        raise UsageError("the image reference holds credentials; launch files are shared", field="--image",
                         value="<redacted>", fix="log in to the registry instead (enroot credentials, docker login, "
                                               "an image pull secret)")
    from muse_stack.launch.targets import NCCL_DEBUG_LEVELS

    if nccl_debug is not None and nccl_debug.upper() not in NCCL_DEBUG_LEVELS:
        raise UsageError("not an NCCL_DEBUG level", field="--nccl-debug", value=nccl_debug,
                         fix=f"use one of {', '.join(NCCL_DEBUG_LEVELS)}")
    first = load_recipe(name, overrides)
    target = target_for(first.hardware.gpu)
    count, per_node = _layout(first, target, nodes, gpus)
    run_overrides = list(overrides)
    if count != first.hardware.count:
        run_overrides.append(f"hardware.count={count}")
    if per_node != first.hardware.per_node:
        run_overrides.append(f"hardware.per_node={per_node}")
    recipe = prepare(name, run_overrides, steps, None)  # the planner: a broken layout raises here
    image_ref, network, env = _image_and_network(target, image)
    library_path = EFA_LIBRARY_PATH if env else None
    env.update(recipe.env)
    if nccl_debug is not None:
        env["NCCL_DEBUG"] = nccl_debug.upper()
        if env["NCCL_DEBUG"] in ("INFO", "TRACE"):
            env.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    if run_name is not None and dns_name(run_name, 63) != run_name:
        raise InputError("the run name must be lower-case letters, digits and dashes", field="--run-name",
                         value=run_name, fix=f"use {dns_name(run_name, 63)!r}")
    return LaunchSpec(recipe=recipe, name=name, run_overrides=run_overrides, steps=steps, target=target,
                      nodes=count // per_node, per_node=per_node, image=image_ref, network=network, env=env,
                      job_name=f"muse-{dns_name(recipe.name)}", library_path=library_path, run_name=run_name)


def _image_and_network(target: Target, image: str | None) -> tuple[str | None, str, dict[str, str]]:
    """The image (the lock's tag unless given) and the network settings the lock supports."""
    if not target.container:
        return None, "none (CPU processes over gloo)", {}
    from muse_stack.stack import image_tag, load
    from muse_stack.stack.lock import value

    loaded = load(target.lock)
    efa = value(loaded.lock.components.efa)
    ref = image or image_tag(loaded)
    if efa is None:
        return ref, f"containers/locks/{target.lock}.toml installs no EFA: NCCL over sockets", {}
    network = (f"EFA {efa.installer_version} (aws-ofi-nccl {efa.aws_ofi_nccl}, libfabric {efa.libfabric}) "
               f"from containers/locks/{target.lock}.toml; {target.instance}, {target.efa_devices} EFA interfaces, "
               f"{target.note}")
    return ref, network, dict(target.env)

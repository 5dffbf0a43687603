"""What a launcher renders: the recipe validated by the planner and by every check `run` makes
that needs no GPU, nodes and processes per node, the image, the fabric's environment, and the
run directory every node shares."""

from __future__ import annotations

import datetime
import hashlib
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from muse_stack.util.errors import InputError, LayoutError, RecipeError, UsageError
from muse_stack.launch.image import Image
from muse_stack.launch.targets import FABRIC_ENV, Target, fabric_for, target_for
from muse_stack.recipes.schema import Recipe

RDZV_PORT = 29500
STOP_SIGNAL_SECONDS = 120  # SIGTERM this long before the time limit: time to finish a step and save
#: the first torch whose torchrun takes ``--shutdown-timeout`` (torch/distributed/run.py of the 2.12.0 wheel has it,
#: 2.11.0's has not: its workers get a fixed 30 s between SIGTERM and SIGKILL, and the option fails its parser)
TORCHRUN_GRACE_SINCE = (2, 12)

# container paths of the shared volumes
DATA_MOUNT = "/data"
CHECKPOINT_MOUNT = "/checkpoints"
RUNS_MOUNT = "/runs"
PRETRAINED_MOUNT = "/pretrained"  # the --pretrained-checkpoint folder, read-only (Slurm)
RECIPES_FOLDER = ".recipes"  # under the runs folder: recipe files given by path, as launched
CONTAINER_ENV: dict[str, str] = {
    "MUSE_STACK_CACHE": f"{DATA_MOUNT}/muse-stack-cache",
    "HF_HOME": f"{CHECKPOINT_MOUNT}/huggingface",
    "HF_DATASETS_CACHE": f"{DATA_MOUNT}/huggingface/datasets",
    "KERNEL_CACHE": f"{DATA_MOUNT}/kernel-cache",
}
#: what a host folder mounted by pyxis may not hold: --container-mounts is SRC:DST[:FLAGS],...
MOUNT_SEPARATORS = (",", ":")


@dataclass
class LaunchSpec:
    recipe: Recipe
    name: str  # the recipe as the user named it (catalogue name or file)
    run_overrides: list[str]  # key=value overrides the run command inside the job receives
    steps: int | None
    target: Target
    nodes: int
    per_node: int  # processes per node: one per GPU, or CPU processes
    image: Image | None  # None: CPU processes, or the target's own image imported to a squashfs
    network: str  # where the network settings come from, for the rendered comment
    run_name: str  # the run directory's name: fixed in the job file, so a requeue continues it
    env: dict[str, str] = field(default_factory=dict)  # the fabric's and target's settings, then the recipe's
    job_name: str = ""
    library_path: str | None = None  # prepended to LD_LIBRARY_PATH inside the container (EFA libraries)
    fabric: str | None = None
    cpus_per_task: int = 1  # Slurm: CPUs of the one task per node that runs every GPU worker
    default_image: str | None = None  # the lock's tag, when no --image was given
    recipe_text: str | None = None  # a recipe given as a file: its text, carried into the job
    pretrained: str | None = None  # --pretrained-checkpoint as given (a host path on Slurm)
    #: seconds ahead of the time limit the warning signal comes, and torchrun's grace for its workers
    #: (muse_stack/plan/save.py: one step plus twice the planned save, at least STOP_SIGNAL_SECONDS)
    signal_s: int = STOP_SIGNAL_SECONDS
    save_note: str | None = None  # the planned save, for the job file's comment
    #: training.checkpoint_interval filled by the launcher: {"value", "source"}, or None
    filled_interval: dict | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def recipe_file_name(self) -> str | None:
        """The file name a recipe given by path gets in the job (its content's hash in it)."""
        if self.recipe_text is None:
            return None
        return f"{self.run_name}-{hashlib.sha256(self.recipe_text.encode()).hexdigest()[:12]}.yaml"

    def torchrun_options(self, nnodes: str, rdzv_endpoint: str, rdzv_id: str) -> list[str]:
        """torchrun's options on every node of the job, the values as the caller writes them (shell text in a
        job script). ``--shutdown-timeout`` is the grace torchrun gives its workers between passing them SIGTERM
        and SIGKILLing them (its own default is 30 s; the option exists from :data:`TORCHRUN_GRACE_SINCE`): the
        warning signal's lead, so the save the signal starts finishes (muse_stack/plan/save.py)."""
        return [f"--nnodes={nnodes}", f"--nproc-per-node={self.per_node}", f"--shutdown-timeout={self.signal_s}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]

    def node_command(self, nnodes: str, rdzv_endpoint: str, rdzv_id: str, out: str, recipe_path: str | None = None,
                     pretrained: str | None = None, python: str = "python") -> list[str]:
        """One node's command, word by word: torchrun starting `muse-stack run` on every process of the node.
        Every start of the job (the first, a requeue, a pod's restart) runs it: ``--resume auto`` continues the
        run directory's latest checkpoint, or starts the run."""
        return [python, "-m", "torch.distributed.run", *self.torchrun_options(nnodes, rdzv_endpoint, rdzv_id),
                "--module", "muse_stack.cli", "run", *self.run_command_args(recipe_path, pretrained),
                "--out", out, "--resume", "auto", "--no-progress"]

    def run_command_args(self, recipe_path: str | None = None, pretrained: str | None = None) -> list[str]:
        """`muse-stack run` arguments: the recipe (``recipe_path`` where the job carries a file),
        overrides, steps and the starting checkpoint (``pretrained``: its path inside the job)."""
        args = [recipe_path or self.name, *self.run_overrides]
        if self.steps is not None:
            args += ["--steps", str(self.steps)]
        if pretrained:
            args += ["--pretrained-checkpoint", pretrained]
        return args


def dns_name(text: str, limit: int = 40) -> str:
    """A DNS-1123 label (Kubernetes names, Slurm job names) from a recipe name."""
    s = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return s[:limit].rstrip("-") or "run"


def default_run_name(recipe_name: str, now: datetime.datetime | None = None) -> str:
    """A run name unique to this launch: the recipe, the UTC time and 4 random hex digits, at most
    63 characters. Written into the job file, so every requeue and resubmit of it continues one run."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    tail = f"-{now:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"
    return dns_name(recipe_name, 63 - len(tail)) + tail


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


def check_mount_path(value: str | None, field: str) -> str | None:
    """A host folder pyxis mounts: printable, and without the separators of --container-mounts
    (a comma would add a mount of its own: ``/etc:/host-etc,...``)."""
    from muse_stack.util import quoting

    quoting.check_path(value, field)
    if value is not None and any(c in value for c in MOUNT_SEPARATORS):
        raise UsageError("the folder's path holds a ',' or ':', which pyxis's --container-mounts reads as the start "
                         "of another mount or of mount flags", field=field, value=value,
                         rule="--container-mounts is SRC:DST[:FLAGS] joined by ','",
                         fix="give a path without ',' and ':' (a symbolic link to the folder works)")
    return value


def resolve(name: str, overrides: list[str] | None = None, *, nodes: int | None = None, gpus: int | None = None,
            steps: int | None = None, image: str | None = None, run_name: str | None = None,
            nccl_debug: str | None = None, fabric: str | None = None, cpus_per_gpu: int | None = None,
            pretrained_checkpoint: str | None = None, kubernetes: bool = False) -> LaunchSpec:
    """Resolve and validate a recipe for launching; raises (the planner's error, or the check `run`
    would fail) before anything is written. ``nccl_debug`` sets NCCL_DEBUG over the fabric's WARN and
    the recipe's env (INFO and TRACE also set NCCL_DEBUG_SUBSYS=INIT,NET: the plugin and network
    lines without every collective)."""
    from muse_stack.launch import image as image_mod
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.run.pipeline import prepare

    overrides = list(overrides or [])
    from muse_stack.recipes.schema import MAX_GPUS, NAME_PATTERN, NAME_RULE

    if nodes is not None and not 1 <= nodes <= MAX_GPUS:
        raise UsageError("the node count is out of range", field="--nodes", value=nodes, rule=f"1 to {MAX_GPUS:,}",
                         fix="give --nodes 1 or more")
    if gpus is not None and not 1 <= gpus <= MAX_GPUS:
        raise UsageError("the GPU count is out of range", field="--gpus", value=gpus, rule=f"1 to {MAX_GPUS:,}",
                         fix="give --gpus 1 or more")
    if cpus_per_gpu is not None and not 1 <= cpus_per_gpu <= 4096:
        raise UsageError("the CPU count per GPU is out of range", field="--cpus-per-gpu", value=cpus_per_gpu,
                         rule="1 to 4096", fix="give the node's cores divided by its GPUs")
    parsed = image_mod.parse(image) if image is not None else None
    from muse_stack.launch.targets import NCCL_DEBUG_LEVELS

    if nccl_debug is not None and nccl_debug.upper() not in NCCL_DEBUG_LEVELS:
        raise UsageError("not an NCCL_DEBUG level", field="--nccl-debug", value=nccl_debug,
                         fix=f"use one of {', '.join(NCCL_DEBUG_LEVELS)}")
    if run_name is not None and (not NAME_PATTERN.fullmatch(run_name) or dns_name(run_name, 63) != run_name):
        raise InputError("the run name must be lower-case letters, digits and dashes", field="--run-name",
                         value=run_name, rule=f"a DNS label: {NAME_RULE}, lower case, no '.' or '_'",
                         fix=f"use {dns_name(run_name, 63)!r}")
    first = load_recipe(name, overrides)
    target = target_for(first.hardware.gpu)
    net = fabric_for(target, fabric)
    if parsed is not None:
        _check_image_machine(parsed, target)
    count, per_node = _layout(first, target, nodes, gpus)
    run_overrides = list(overrides)
    if count != first.hardware.count:
        run_overrides.append(f"hardware.count={count}")
    if per_node != first.hardware.per_node:
        run_overrides.append(f"hardware.per_node={per_node}")
    recipe = prepare(name, run_overrides, steps, None).recipe  # the planner and the engine's checks: raise here
    signal_s, save_note = _save_arrangement(recipe)
    filled = recipe.filled.get("training.checkpoint_interval")  # the run fills the same value from the same plan
    filled_interval = filled.model_dump() if filled is not None else None
    pretrained = _check_start(recipe, pretrained_checkpoint, target, kubernetes)
    _check_loggers(recipe, target)
    if target.container:
        from muse_stack.stack import load

        check_torchrun_grace(load(target.lock).lock.components.torch.version, target.lock)
    if kubernetes and parsed is None and target.container:
        from muse_stack.stack import image_tag, load

        raise UsageError("a Kubernetes cluster pulls its image from a registry, and the default image is a local tag "
                         "(a cluster would look for it on Docker Hub, under library/)", field="--image", value=None,
                         fix=f"push the image (`make image gpu={target.lock}` builds {image_tag(load(target.lock))}) "
                             "to your registry and pass --image REGISTRY/muse-stack@sha256:DIGEST")
    network, env, library_path = _network(target, net)
    env.update(recipe.env)
    if nccl_debug is not None:
        env["NCCL_DEBUG"] = nccl_debug.upper()
        if env["NCCL_DEBUG"] in ("INFO", "TRACE"):
            env.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    default_image = None
    if target.container and parsed is None:
        from muse_stack.stack import image_tag, load

        default_image = image_tag(load(target.lock))
    per_gpu = cpus_per_gpu or target.cpus_per_gpu
    cpus_per_task = per_gpu * per_node if target.container and per_gpu else 1
    recipe_text = None
    path = Path(name)
    if path.is_file():  # a recipe file: its text travels in the job, where the host path does not exist
        from muse_stack.util.safeio import read_text

        recipe_text = read_text(path, field="recipe", what="recipe YAML file")
    return LaunchSpec(recipe=recipe, name=name, run_overrides=run_overrides, steps=steps, target=target,
                      nodes=count // per_node, per_node=per_node, image=parsed, network=network,
                      run_name=run_name or default_run_name(recipe.name), env=env,
                      job_name=f"muse-{dns_name(recipe.name)}", library_path=library_path, fabric=net,
                      cpus_per_task=cpus_per_task, default_image=default_image, recipe_text=recipe_text,
                      pretrained=pretrained, signal_s=signal_s, save_note=save_note,
                      filled_interval=filled_interval)


def _save_arrangement(recipe: Recipe) -> tuple[int, str | None]:
    """The warning signal's lead (and torchrun's grace) from the planned save (muse_stack/plan/save.py)."""
    from muse_stack.plan.planner import make_plan
    from muse_stack.plan.save import signal_seconds

    plan, _ = make_plan(recipe)
    if plan.save is None:
        return STOP_SIGNAL_SECONDS, None
    return signal_seconds(plan.save.seconds, plan.time.step_s if plan.time is not None else None), plan.save.describe()


def check_torchrun_grace(torch_version: str, lock: str) -> None:
    """The image's torchrun takes ``--shutdown-timeout``, the grace every node's command passes it
    (:meth:`LaunchSpec.torchrun_options`): an older torch fails on every node at start-up, after the allocation."""
    parts = re.match(r"(\d+)\.(\d+)", torch_version)
    if parts is not None and (int(parts[1]), int(parts[2])) >= TORCHRUN_GRACE_SINCE:
        return
    from muse_stack.stack import LockError

    since = ".".join(map(str, TORCHRUN_GRACE_SINCE))
    raise LockError(f"the {lock} image's torch {torch_version} has a torchrun without --shutdown-timeout, which "
                    "the job passes it so the save a stop signal starts is not killed after torchrun's own 30 s",
                    field="components.torch.version", value=torch_version, rule=f"torch {since} or later",
                    fix=f"pin torch {since} or later in containers/locks/{lock}.toml and rebuild the image")


def _check_image_machine(image: Image, target: Target) -> None:
    """An image whose name says which lock built it (``muse-stack:gb200-0.1.0``) runs only on a
    machine of that lock's platform and CUDA arch (the machine table's rows): an amd64 sm90 image
    on arm64 sm100 nodes fails after the allocation, at the first exec or kernel. An image whose
    name says nothing (a digest alone, another name) is taken as given."""
    from muse_stack.launch.image import lock_of
    from muse_stack.machine.table import table

    t = table()
    machines = t.locks()
    lock = lock_of(image, machines)
    if lock is None or lock == target.lock:
        return
    built, runs = t.machine(machines[lock]), t.machine(target.gpu)

    def what(m) -> str:
        return f"{m.platform}, {m.gpu.arch if m.gpu is not None else 'no GPU'}"

    if built.platform == runs.platform and (built.gpu and built.gpu.arch) == (runs.gpu and runs.gpu.arch):
        return
    from muse_stack.stack import image_tag, load

    raise UsageError(f"the image is built from the {lock} lock, for {machines[lock]} nodes ({what(built)}); the recipe "
                     f"runs on {target.gpu} nodes ({what(runs)})", field="--image", value=image.record(),
                     rule="an image runs on nodes of its lock's platform and CUDA arch (machine table: platform, "
                          "gpu.arch)",
                     fix=f"pass the {target.gpu} image (`make image gpu={target.lock}` builds "
                         f"{image_tag(load(target.lock))}), or launch a recipe for {machines[lock]}")


def _check_start(recipe: Recipe, pretrained: str | None, target: Target, kubernetes: bool) -> str | None:
    """The checkpoint the run starts from, checked as `run` checks it (where the launching host can
    see it): a recipe that requires one refuses a launch without --pretrained-checkpoint."""
    from muse_stack.recipes.schema import REQUIRED_PATH

    stated = recipe.model.pretrained_checkpoint
    if pretrained is None and stated == REQUIRED_PATH:
        note = recipe.notes.get("model.pretrained_checkpoint", "")
        raise RecipeError(f"this recipe starts from a checkpoint you supply{': ' + note if note else ''}",
                          field="model.pretrained_checkpoint", value=REQUIRED_PATH,
                          fix="pass --pretrained-checkpoint DIR (Slurm: a folder on the nodes' shared storage, "
                              f"mounted read-only; Kubernetes: a folder under {CHECKPOINT_MOUNT}/ in the volume claim)")
    if pretrained is None:
        return None
    from muse_stack.util import quoting
    from muse_stack.util.safeio import refuse_secrets

    refuse_secrets(str(pretrained), field="--pretrained-checkpoint", error=UsageError, what="the path")
    quoting.check_path(pretrained, "--pretrained-checkpoint")
    if kubernetes:
        if not (pretrained.startswith(f"{CHECKPOINT_MOUNT}/") or pretrained.startswith(f"{DATA_MOUNT}/")) \
                or ".." in Path(pretrained).parts:
            raise InputError("on Kubernetes the checkpoint is read from the volume claim", field="--pretrained-checkpoint",
                             value=pretrained, rule=f"a path under {CHECKPOINT_MOUNT}/ (the claim's checkpoints/) "
                                                    f"or {DATA_MOUNT}/ (its data/)",
                             fix=f"copy the checkpoint into the claim and give e.g. {CHECKPOINT_MOUNT}/muse-spark-open")
        return pretrained
    host = str(Path(pretrained).absolute())
    if target.container:
        check_mount_path(host, "--pretrained-checkpoint")
    from muse_stack.run.inputs import check_inputs

    start = recipe.model_copy(update={"model": recipe.model.model_copy(update={"pretrained_checkpoint": host}),
                                      "logging": recipe.logging.model_copy(update={"wandb": None})})
    check_inputs(start)  # a Hugging Face-style folder with a config and weights, as `run` checks it
    return host


def _check_loggers(recipe: Recipe, target: Target) -> None:
    """logging.wandb: the job's Python has wandb (the image's wheel set, or this Python for CPU jobs)."""
    wandb = recipe.logging.wandb
    if wandb is None or wandb.mode == "disabled":
        return
    if not target.container:
        from muse_stack.run.tensorboard import check_available

        check_available(recipe)
        return
    from muse_stack.stack import locks_dir

    lock = locks_dir() / f"pylock.{target.lock}.toml"
    import tomllib

    try:
        packages = {p.get("name", "").lower() for p in tomllib.loads(lock.read_text()).get("packages", [])}
    except (OSError, ValueError) as exc:
        raise InputError(f"the image's wheel set cannot be read: {exc}", field="logging.wandb", value=str(lock),
                         fix="restore containers/locks/ from the repository") from exc
    if "wandb" not in packages:
        raise RecipeError(f"logging.wandb is set but the {target.gpu} image's wheel set ({lock.name}) has no wandb",
                          field="logging.wandb", value=wandb.project,
                          fix="remove logging.wandb (or logging.wandb.mode=disabled), or use an image whose wheel set "
                              "has wandb")


def _network(target: Target, fabric: str | None) -> tuple[str, dict[str, str], str | None]:
    """Where the network settings come from, the environment and the library path for a fabric."""
    if not target.container:
        return "none (CPU processes over gloo)", {}, None
    env = {**FABRIC_ENV[fabric], **target.env}
    if fabric == "ib":
        return (f"InfiniBand through NCCL's IB transport (--fabric ib); {target.gpu} nodes"
                + (f", {target.note}" if target.imex else "")), env, None
    from muse_stack.stack import load
    from muse_stack.stack.lock import value

    loaded = load(target.lock)
    efa = value(loaded.lock.components.efa)
    if efa is None:
        raise UsageError(f"containers/locks/{target.lock}.toml installs no EFA", field="--fabric", value="efa",
                         fix="use --fabric ib, or a lock that installs EFA")
    network = (f"EFA {efa.installer_version} (aws-ofi-nccl {efa.aws_ofi_nccl}, libfabric {efa.libfabric}) "
               f"from containers/locks/{target.lock}.toml; {target.instance}, {target.efa_devices} EFA interfaces, "
               f"{target.note} (--fabric efa)")
    # the image's LD_LIBRARY_PATH already lists the EFA plugin and libfabric after the set's cuDNN and
    # NCCL (Dockerfile); nothing is put ahead of the set
    return network, env, None

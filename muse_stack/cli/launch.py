"""`muse-stack launch NAME --slurm | --k8s`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from muse_stack.cli.complete import recipe_names

console = Console(stderr=True)


def launch_cmd(
    name: str = typer.Argument(..., help="recipe name, alias or YAML file", autocompletion=recipe_names),
    overrides: Optional[list[str]] = typer.Argument(None, help="key.path=value overrides"),
    slurm: bool = typer.Option(False, "--slurm", help="render an sbatch script"),
    k8s: bool = typer.Option(False, "--k8s", help="render Kubernetes manifests (Kubeflow PyTorchJob)"),
    image: Optional[str] = typer.Option(None, "--image", help="container image: REGISTRY/NAME:TAG[@sha256:DIGEST], "
                                        "REGISTRY#NAME:TAG (enroot) or a .sqsh file (default on Slurm: the target's "
                                        "image imported to a squashfs under --images-dir; Kubernetes needs one)"),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="nodes (default: the recipe's GPUs / GPUs per node)"),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs (or CPU processes) in all"),
    steps: Optional[int] = typer.Option(None, "--steps", help="optimizer steps (overrides the recipe)"),
    run_name: Optional[str] = typer.Option(None, "--run-name",
                                           help="run directory name (default: the recipe, the time and a random "
                                                "suffix, fixed in the job file); every attempt under one name "
                                                "continues that run from its latest checkpoint"),
    pretrained_checkpoint: Optional[str] = typer.Option(
        None, "--pretrained-checkpoint", help="HF-style checkpoint folder to start from (Slurm: on shared storage, "
                                              "checked here and mounted read-only; Kubernetes: a path under "
                                              "/checkpoints/ in the volume claim)"),
    fabric: Optional[str] = typer.Option(None, "--fabric", help="network between nodes: efa (AWS) or ib "
                                         "(InfiniBand; default: the target's, efa for the AWS instances)"),
    cpus_per_gpu: Optional[int] = typer.Option(None, "--cpus-per-gpu", help="the node's CPU cores per GPU "
                                               "(default: the target instance's); Slurm's --cpus-per-task is this "
                                               "x GPUs per node"),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", help="shared host folder for run directories"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="shared host folder for data caches (Slurm)"),
    checkpoint_dir: Optional[str] = typer.Option(None, "--checkpoint-dir",
                                                 help="shared host folder for checkpoints (Slurm)"),
    images_dir: Optional[str] = typer.Option(None, "--images-dir", help="shared host folder holding the default "
                                             "image's squashfs (Slurm; default: images/ under the submit folder)"),
    time_limit: Optional[str] = typer.Option(None, "--time", help="Slurm time limit, e.g. 04:00:00 (required "
                                             "with --submit; without it the partition's default applies)"),
    nccl_debug: Optional[str] = typer.Option(None, "--nccl-debug", help="NCCL_DEBUG level (default WARN): "
                                             "VERSION, WARN, INFO or TRACE"),
    partition: Optional[str] = typer.Option(None, "--partition", help="Slurm partition"),
    account: Optional[str] = typer.Option(None, "--account", help="Slurm account"),
    namespace: Optional[str] = typer.Option(None, "--namespace", help="Kubernetes namespace"),
    queue: str = typer.Option("muse-stack", "--queue", help="Kueue LocalQueue that admits the job (gang: all "
                              "pods or none)"),
    claim: str = typer.Option("muse-stack-shared", "--volume-claim",
                              help="Kubernetes ReadWriteMany claim holding data/, checkpoints/, runs/"),
    env_secret: str = typer.Option("muse-stack-env", "--env-secret",
                                   help="Kubernetes secret holding the values of the recipe's ${env:NAME} references"),
    submit: bool = typer.Option(False, "--submit", help="submit the script with sbatch and print the job id"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="write to this file (default: stdout)"),
) -> None:
    """Render (and submit) a multi-node launch of a recipe, validated by the planner first."""
    from muse_stack.util import atomic
    from muse_stack.util.errors import InputError
    from muse_stack.launch import k8s as k8s_mod
    from muse_stack.launch import slurm as slurm_mod
    from muse_stack.launch.spec import resolve

    if slurm == k8s:
        raise InputError("choose one launcher", field="--slurm/--k8s", value=None,
                         fix="pass --slurm or --k8s")
    if submit and not slurm:
        raise InputError("--submit submits Slurm jobs", field="--submit", value=True,
                         fix="use --slurm --submit, or apply the manifests with kubectl")
    if output is not None and output.exists():
        raise InputError("the output file exists; launch never overwrites a file", field="--output",
                         value=str(output), fix="choose a new file name or remove the old one")
    if submit and not time_limit:
        from muse_stack.util.errors import UsageError as _UsageError

        raise _UsageError("a submitted job needs a time limit", field="--time", value=None,
                         rule="without one the job runs under the partition's default limit, which may be "
                              "minutes or unlimited",
                         fix="pass --time, e.g. --time 04:00:00 or --time 1-00:00:00")
    from muse_stack.util.errors import UsageError
    from muse_stack.util.safeio import refuse_rewrite, refuse_secrets

    # each value goes into the launch file as given, or is refused here, before anything is written
    for flag, value in (("--runs-dir", runs_dir), ("--data-dir", data_dir), ("--checkpoint-dir", checkpoint_dir),
                        ("--images-dir", images_dir), ("--partition", partition), ("--account", account),
                        ("--time", time_limit), ("--image", image), ("--run-name", run_name),
                        ("--namespace", namespace), ("--queue", queue), ("--volume-claim", claim),
                        ("--env-secret", env_secret), ("--output", output)):
        if value is not None:
            refuse_secrets(str(value), field=flag, error=UsageError, what="the value")
    spec = resolve(name, overrides or [], nodes=nodes, gpus=gpus, steps=steps, image=image, run_name=run_name,
                   nccl_debug=nccl_debug, fabric=fabric, cpus_per_gpu=cpus_per_gpu,
                   pretrained_checkpoint=pretrained_checkpoint, kubernetes=k8s)
    if spec.filled_interval is not None:  # on stderr: stdout may be the script
        console.print(f"filled: training.checkpoint_interval = {spec.filled_interval['value']} "
                      f"({spec.filled_interval['source']})", highlight=False)
    if slurm:
        text = slurm_mod.render(spec, runs_dir=runs_dir, data_dir=data_dir, checkpoint_dir=checkpoint_dir,
                                python=sys.executable, time_limit=time_limit, partition=partition,
                                account=account, images_dir=images_dir)
    else:
        text = k8s_mod.render(spec, namespace=namespace, claim=claim, secret=env_secret, queue=queue)
    # the file is written as rendered: where the last guard of written text would change it, the launch is refused
    text = refuse_rewrite(text, field="--slurm" if slurm else "--k8s",
                          what="the sbatch script" if slurm else "the manifests")
    if k8s and spec.image is not None and not spec.image.digest:  # on stderr: stdout may be the manifests
        console.print(f"note: {k8s_mod.TAG_NOTE}", highlight=False)
    if output is not None:
        atomic.write_text(output, text, field="--output")
        if output.suffix in ("", ".sh", ".sbatch"):
            output.chmod(0o755)
        console.print(f"wrote {output}: {spec.nodes} node{'s' if spec.nodes > 1 else ''} x {spec.per_node} "
                      f"{'GPUs' if spec.target.container else 'processes'}, run {spec.run_name}")
    elif not submit:
        typer.echo(text, nl=False)
    if submit:
        job = slurm_mod.submit(text)
        typer.echo(job)
        runs = runs_dir or str(Path.cwd() / "runs")
        console.print(f"submitted job {job}; run directory {runs}/{spec.run_name}")


def register(app: typer.Typer) -> None:
    app.command("launch")(launch_cmd)

"""Slurm batch scripts: one srun task per node running torchrun in the image (pyxis), or for CPU
recipes one srun task per process without containers, so it runs on a plain Slurm."""

from __future__ import annotations

import subprocess
from pathlib import Path

import jinja2

from muse_stack.errors import InputError
from muse_stack.launch import quoting
from muse_stack.launch.spec import (CHECKPOINT_MOUNT, CONTAINER_ENV, DATA_MOUNT, RDZV_PORT, RUNS_MOUNT,
                                    STOP_SIGNAL_SECONDS, LaunchSpec)

_TEMPLATE = r"""#!/bin/bash
# muse-stack launch {{ s.recipe.name | comment }} --slurm: {{ s.nodes }} node{{ 's' if s.nodes > 1 }} x {{ s.per_node }} {{ unit }} = {{ s.world_size }} {{ unit_total }}
# {{ s.recipe.description | comment }}
# Network: {{ s.network | comment }}
# Submit with `sbatch THIS_FILE`. Host folders (shared by every node): MUSE_STACK_RUNS, MUSE_STACK_DATA{% if s.target.container %}, MUSE_STACK_CHECKPOINTS{% endif %}.
#SBATCH --job-name={{ s.job_name }}
#SBATCH --nodes={{ s.nodes }}
#SBATCH --ntasks-per-node={{ tasks_per_node }}
{% if s.target.container %}
#SBATCH --gpus-per-node={{ s.per_node }}
#SBATCH --exclusive
{% else %}
#SBATCH --cpus-per-task=1
{% endif %}
#SBATCH --signal=B:TERM@{{ signal_s }}
#SBATCH --output=%x-%j.out
{% if not time_given %}
# no --time given: the job runs under the partition's default time limit (`sinfo -o "%P %l"` lists it);
# the run saves a checkpoint and stops {{ signal_s }} s before that limit. Pass --time to set it.
{% endif %}
{% for opt in extra_sbatch %}
#SBATCH {{ opt }}
{% endfor %}
set -eo pipefail

# every value below is one shell word, quoted when rendered; the MUSE_STACK_* variables override them
RUNS_DIR={{ runs_dir }}; RUNS_DIR="${MUSE_STACK_RUNS:-$RUNS_DIR}"
RUN_NAME={{ run_name }}; RUN_NAME="${MUSE_STACK_RUN_NAME:-$RUN_NAME}"
{% if s.target.container %}
DATA_DIR={{ data_dir }}; DATA_DIR="${MUSE_STACK_DATA:-$DATA_DIR}"
CHECKPOINT_DIR={{ checkpoint_dir }}; CHECKPOINT_DIR="${MUSE_STACK_CHECKPOINTS:-$CHECKPOINT_DIR}"
mkdir -p "$RUNS_DIR" "$DATA_DIR" "$CHECKPOINT_DIR"
{% else %}
mkdir -p "$RUNS_DIR"
{% endif %}

# rendezvous on the first node of the allocation
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
{% if s.target.container %}
RDZV_PORT="${MUSE_STACK_RDZV_PORT:-{{ rdzv_port }}}"
{% else %}
export MASTER_ADDR="$HEAD_NODE"
export MASTER_PORT="${MUSE_STACK_RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
{% endif %}

{% if s.target.container %}
# paths inside the image
{% for k, v in container_env.items() %}
export {{ k }}={{ v | q }}
{% endfor %}
{% if digest %}
export MUSE_STACK_IMAGE_DIGEST={{ digest | q }}
{% endif %}
{% endif %}
{% if s.env %}
# network settings of the target, then the recipe's environment
{% for k, v in s.env.items() %}
export {{ k }}={{ v | envq }}
{% endfor %}
{% endif %}

# an interrupted run of this directory continues from its checkpoint; otherwise a new run starts
if grep -qs '"status": *"interrupted"' "$RUNS_DIR/$RUN_NAME/results.json"; then
  RUN_ARGS=(--resume "{{ run_root }}/$RUN_NAME")
else
  RUN_ARGS=({{ run_args }} --out "{{ run_root }}/$RUN_NAME")
fi
echo "run directory: $RUNS_DIR/$RUN_NAME"

{% if s.target.container %}
srun --kill-on-bad-exit=1 --ntasks-per-node=1 \
  --container-image={{ s.image | q }} \
  --container-mounts="$DATA_DIR:{{ data_mount }},$CHECKPOINT_DIR:{{ checkpoint_mount }},$RUNS_DIR:{{ runs_mount }}" \
  --no-container-mount-home \
{% if s.library_path %}
  muse-stack-entrypoint /bin/sh -c 'export LD_LIBRARY_PATH="{{ s.library_path }}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; exec python -m torch.distributed.run "$@"' torchrun \
{% else %}
  muse-stack-entrypoint python -m torch.distributed.run \
{% endif %}
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={{ s.per_node }} \
    --rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \
    --module muse_stack.cli run "${RUN_ARGS[@]}" --no-progress &
{% else %}
PYTHON={{ python | q }}; PYTHON="${MUSE_STACK_PYTHON:-$PYTHON}"
srun --kill-on-bad-exit=1 --ntasks-per-node={{ s.per_node }} \
  "$PYTHON" -m muse_stack.cli run "${RUN_ARGS[@]}" --no-progress &
{% endif %}
SRUN_PID=$!

# preemption or the time limit: Slurm sends TERM to this script {{ signal_s }} s ahead; srun passes it to
# every process, which finish the step, save a checkpoint and leave the run interrupted
trap 'echo "SIGTERM: stopping the run at the next step"; kill -TERM "$SRUN_PID" 2>/dev/null' TERM
set +e
wait "$SRUN_PID"
rc=$?
while kill -0 "$SRUN_PID" 2>/dev/null; do
  wait "$SRUN_PID"
  rc=$?
done
exit $rc
"""


def _env() -> jinja2.Environment:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    env.filters["q"] = quoting.word  # one literal shell word
    env.filters["envq"] = quoting.env_word  # one shell word; $NAME, ${NAME}, ${env:NAME} expand
    env.filters["comment"] = quoting.comment
    return env


def render(spec: LaunchSpec, *, runs_dir: str | None = None, data_dir: str | None = None,
           checkpoint_dir: str | None = None, python: str = "python3", time_limit: str | None = None,
           partition: str | None = None, account: str | None = None) -> str:
    """The sbatch script. Folder defaults resolve at job time under the submit directory."""
    container = spec.target.container
    rule = "letters, digits and . _ : , + - (Slurm reads #SBATCH lines itself; they cannot be quoted)"
    quoting.check(time_limit, quoting.SLURM_VALUE, "--time", rule, "give e.g. --time 04:00:00 or 1-00:00:00")
    quoting.check(partition, quoting.SLURM_VALUE, "--partition", rule, "give the partition's name, e.g. gpu")
    quoting.check(account, quoting.SLURM_VALUE, "--account", rule, "give the account's name")
    for field, value in (("--runs-dir", runs_dir), ("--data-dir", data_dir), ("--checkpoint-dir", checkpoint_dir),
                         ("python", python)):
        quoting.check_path(value, field)
    for key in spec.env:
        quoting.env_name(key, f"env.{key}")
    extra = [f"--time={time_limit}" if time_limit else None, f"--partition={partition}" if partition else None,
             f"--account={account}" if account else None]
    image = spec.image or ""
    digest = image.split("@", 1)[1] if "@" in image else None
    return _env().from_string(_TEMPLATE).render(
        s=spec,
        unit="GPUs" if container else "processes",
        unit_total="GPUs" if container else "processes",
        tasks_per_node=1 if container else spec.per_node,
        signal_s=STOP_SIGNAL_SECONDS,
        extra_sbatch=[e for e in extra if e],
        time_given=bool(time_limit),
        runs_dir=quoting.word(runs_dir) if runs_dir else '"$SLURM_SUBMIT_DIR"/runs',
        data_dir=quoting.word(data_dir) if data_dir else '"$SLURM_SUBMIT_DIR"/data',
        checkpoint_dir=quoting.word(checkpoint_dir) if checkpoint_dir else '"$SLURM_SUBMIT_DIR"/checkpoints',
        run_name=quoting.word(spec.run_name) if spec.run_name else quoting.word(spec.recipe.name) + '-"$SLURM_JOB_ID"',
        rdzv_port=RDZV_PORT,
        container_env=CONTAINER_ENV,
        digest=digest if digest and quoting.DIGEST.fullmatch(digest) else None,
        run_root=RUNS_MOUNT if container else "$RUNS_DIR",
        run_args=" ".join(quoting.word(a) for a in spec.run_command_args()),
        data_mount=DATA_MOUNT, checkpoint_mount=CHECKPOINT_MOUNT, runs_mount=RUNS_MOUNT,
        python=python,
    )


def submit(script: str, cwd: str | Path | None = None) -> str:
    """Submit with sbatch; returns the job id."""
    try:
        proc = subprocess.run(["sbatch", "--parsable"], input=script, text=True, capture_output=True, cwd=cwd,
                              timeout=60)
    except FileNotFoundError as exc:
        raise InputError("sbatch is not installed here", field="--submit", value="sbatch",
                         fix="run on a Slurm login node, or write the script with -o and submit it there") from exc
    if proc.returncode != 0:
        raise InputError(f"sbatch failed: {proc.stderr.strip() or proc.stdout.strip()}", field="--submit",
                         value=proc.returncode, fix="check the Slurm message above (partition, account, limits)")
    return proc.stdout.strip().split(";", 1)[0]

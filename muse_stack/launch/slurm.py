"""Slurm batch scripts: one srun task per node running torchrun in the image (pyxis), or for CPU
recipes one srun task per process without containers, so it runs on a plain Slurm."""

from __future__ import annotations

import subprocess
from pathlib import Path

import jinja2

from muse_stack.util.errors import InputError
from muse_stack.util import quoting
from muse_stack.launch.spec import (CHECKPOINT_MOUNT, CONTAINER_ENV, DATA_MOUNT, PRETRAINED_MOUNT, RDZV_PORT,
                                    RECIPES_FOLDER, RUNS_MOUNT, LaunchSpec, check_mount_path)

_TEMPLATE = r"""#!/bin/bash
# muse-stack launch {{ s.recipe.name | comment }} --slurm: {{ s.nodes }} node{{ 's' if s.nodes > 1 }} x {{ s.per_node }} {{ unit }} = {{ s.world_size }} {{ unit_total }}
# {{ s.recipe.description | comment }}
# Network: {{ s.network | comment }}
# Submit with `sbatch THIS_FILE`. Host folders (shared by every node): MUSE_STACK_RUNS, MUSE_STACK_DATA{% if s.target.container %}, MUSE_STACK_CHECKPOINTS{% endif %}.
# Every attempt (the first, a requeue, a resubmit of this file) runs `muse-stack run ... --resume auto`
# into the same run directory: it continues from the latest checkpoint there, or starts the run.
#SBATCH --job-name={{ s.job_name }}
#SBATCH --nodes={{ s.nodes }}
#SBATCH --ntasks-per-node={{ tasks_per_node }}
{% if s.target.container %}
#SBATCH --gpus-per-node={{ s.per_node }}
#SBATCH --cpus-per-task={{ s.cpus_per_task }}
#SBATCH --exclusive
{% else %}
#SBATCH --cpus-per-task=1
{% endif %}
#SBATCH --signal=B:TERM@{{ signal_s }}
{% if s.save_note %}
# the warning comes {{ signal_s }} s ahead: one step and twice the planned save ({{ s.save_note | comment }})
{% endif %}
{% if s.filled_interval %}
# training.checkpoint_interval={{ s.filled_interval.value }}: {{ s.filled_interval.source | comment }}
{% endif %}
#SBATCH --requeue
#SBATCH --open-mode=append
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
{% if pretrained %}
PRETRAINED_DIR={{ pretrained }}  # --pretrained-checkpoint, mounted read-only at {{ pretrained_mount }}
{% endif %}
# pyxis reads --container-mounts as SRC:DST[:FLAGS] joined by ','
for dir in "$RUNS_DIR" "$DATA_DIR" "$CHECKPOINT_DIR"{% if pretrained %} "$PRETRAINED_DIR"{% endif %}; do
  case "$dir" in *,*|*:*) echo "error: the folder $dir holds a ',' or ':', which --container-mounts cannot carry" >&2; exit 2;; esac
done
mkdir -p "$RUNS_DIR" "$DATA_DIR" "$CHECKPOINT_DIR"
{% else %}
mkdir -p "$RUNS_DIR"
{% endif %}
case "$RUN_NAME" in ""|*/*|.*) echo "error: MUSE_STACK_RUN_NAME must be a folder name" >&2; exit 2;; esac
{% if s.recipe_text is not none %}

# the recipe file as launched ({{ s.name | comment }}), where every node and the container see it
mkdir -p "$RUNS_DIR/{{ recipes_folder }}"
printf '%s' {{ s.recipe_text | q }} > "$RUNS_DIR/{{ recipes_folder }}/{{ s.recipe_file_name }}.$$"
mv -f "$RUNS_DIR/{{ recipes_folder }}/{{ s.recipe_file_name }}.$$" "$RUNS_DIR/{{ recipes_folder }}/{{ s.recipe_file_name }}"
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
{% if s.image %}
# the image as pyxis/enroot reads it{{ " (pinned by digest)" if s.image.digest else "" }}
IMAGE={{ s.image.enroot() | q }}
{% else %}
# the target's image, imported once to a squashfs on shared storage (never pulled from Docker Hub)
IMAGES_DIR={{ images_dir }}; IMAGES_DIR="${MUSE_STACK_IMAGES:-$IMAGES_DIR}"
IMAGE="$IMAGES_DIR"/{{ squashfs | q }}
if [ ! -f "$IMAGE" ]; then
  echo "error: no image at $IMAGE: import it once on a host that has {{ s.default_image | comment }}:" >&2
  echo "  enroot import -o \"$IMAGE\" dockerd://{{ s.default_image | comment }}   (or podman://...)" >&2
  echo "or pass muse-stack launch an --image pinned by digest (REGISTRY/NAME@sha256:DIGEST)" >&2
  exit 2
fi
{% endif %}

# paths inside the image
{% for k, v in container_env.items() %}
export {{ k }}={{ v | q }}
{% endfor %}
export MUSE_STACK_IMAGE={{ image_record | q }}
{% if digest %}
export MUSE_STACK_IMAGE_DIGEST={{ digest | q }}
{% endif %}
{% endif %}
{% if s.env %}
# network settings of the fabric and target, then the recipe's environment
{% for k, v in s.env.items() %}
export {{ k }}={{ v | envq }}
{% endfor %}
{% endif %}

RUN_ARGS=({{ run_args }} --out "{{ run_root }}/$RUN_NAME" --resume auto)
echo "run directory: $RUNS_DIR/$RUN_NAME (attempt ${SLURM_RESTART_COUNT:-0} of job $SLURM_JOB_ID)"

{% if s.target.container %}
srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task={{ s.cpus_per_task }} \
  --container-image="$IMAGE" \
  --container-mounts="$DATA_DIR:{{ data_mount }},$CHECKPOINT_DIR:{{ checkpoint_mount }},$RUNS_DIR:{{ runs_mount }}{% if pretrained %},$PRETRAINED_DIR:{{ pretrained_mount }}:ro{% endif %}" \
  --no-container-mount-home \
{% if s.library_path %}
  muse-stack-entrypoint /bin/sh -c 'export LD_LIBRARY_PATH="{{ s.library_path }}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; exec python -m torch.distributed.run "$@"' torchrun \
{% else %}
  muse-stack-entrypoint python -m torch.distributed.run \
{% endif %}
    {{ torchrun_options[:3] | join(" ") }} \
    {{ torchrun_options[3:] | join(" ") }} \
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
           partition: str | None = None, account: str | None = None, images_dir: str | None = None) -> str:
    """The sbatch script. Folder defaults resolve at job time under the submit directory."""
    container = spec.target.container
    rule = "letters, digits and . _ : , + - (Slurm reads #SBATCH lines itself; they cannot be quoted)"
    quoting.check(time_limit, quoting.SLURM_VALUE, "--time", rule, "give e.g. --time 04:00:00 or 1-00:00:00")
    quoting.check(partition, quoting.SLURM_VALUE, "--partition", rule, "give the partition's name, e.g. gpu")
    quoting.check(account, quoting.SLURM_VALUE, "--account", rule, "give the account's name")
    for field, value in (("--runs-dir", runs_dir), ("--data-dir", data_dir), ("--checkpoint-dir", checkpoint_dir)):
        if container:
            check_mount_path(value, field)
        else:
            quoting.check_path(value, field)
    quoting.check_path(images_dir, "--images-dir")
    quoting.check_path(python, "python")
    for key in spec.env:
        quoting.env_name(key, f"env.{key}")
    extra = [f"--time={time_limit}" if time_limit else None, f"--partition={partition}" if partition else None,
             f"--account={account}" if account else None]
    image = spec.image
    root = RUNS_MOUNT if container else "$RUNS_DIR"
    recipe_path = f"{root}/{RECIPES_FOLDER}/{spec.recipe_file_name}" if spec.recipe_text is not None else None
    pretrained = spec.pretrained
    if container and pretrained:
        check_mount_path(pretrained, "--pretrained-checkpoint")
    squashfs = spec.default_image.replace(":", "-").replace("/", "-") + ".sqsh" if spec.default_image else None
    args = spec.run_command_args(recipe_path, PRETRAINED_MOUNT if container and pretrained else pretrained)
    # the recipe file's path holds $RUNS_DIR on CPU jobs: it stays one word and expands
    run_args = " ".join(('"' + a + '"') if a == recipe_path else quoting.word(a) for a in args)
    return _env().from_string(_TEMPLATE).render(
        s=spec,
        unit="GPUs" if container else "processes",
        unit_total="GPUs" if container else "processes",
        tasks_per_node=1 if container else spec.per_node,
        signal_s=spec.signal_s,
        torchrun_options=spec.torchrun_options('"$SLURM_JOB_NUM_NODES"', '"$HEAD_NODE:$RDZV_PORT"',
                                               '"$SLURM_JOB_ID"'),
        extra_sbatch=[e for e in extra if e],
        time_given=bool(time_limit),
        runs_dir=quoting.word(runs_dir) if runs_dir else '"$SLURM_SUBMIT_DIR"/runs',
        data_dir=quoting.word(data_dir) if data_dir else '"$SLURM_SUBMIT_DIR"/data',
        checkpoint_dir=quoting.word(checkpoint_dir) if checkpoint_dir else '"$SLURM_SUBMIT_DIR"/checkpoints',
        images_dir=quoting.word(images_dir) if images_dir else '"$SLURM_SUBMIT_DIR"/images',
        squashfs=squashfs,
        run_name=quoting.word(spec.run_name),
        rdzv_port=RDZV_PORT,
        container_env=CONTAINER_ENV,
        image_record=image.record() if image else f"{spec.default_image} (squashfs imported from the local image)",
        digest=image.digest if image else None,
        run_root=root,
        run_args=run_args,
        recipes_folder=RECIPES_FOLDER,
        pretrained=quoting.word(pretrained) if container and pretrained else None,
        pretrained_mount=PRETRAINED_MOUNT,
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

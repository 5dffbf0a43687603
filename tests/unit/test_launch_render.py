"""Rendered sbatch scripts and Kubernetes manifests: golden files compared byte for byte, and
structural checks. Regenerate the golden files with `UPDATE_GOLDEN=1 pytest tests/unit/test_launch_render.py`
(then review the diff)."""

from __future__ import annotations

import os
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from muse_stack.util import quoting
from muse_stack.launch import k8s
from muse_stack.launch.spec import TORCHRUN_GRACE_SINCE, resolve
from muse_stack.plan.planner import make_plan
from muse_stack.plan.save import INTERVAL_POLICY, SIGNAL_MARGIN, default_interval, signal_seconds
from muse_stack.recipes.catalogue import load_recipe

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
IMAGES = {"sft-192": "registry.example.com/muse-stack:gb200-0.1.0",
          "attune-b200": "registry.example.com/muse-stack@sha256:" + "ab" * 32}
CASES = [("sft-192", "GB200", 48, 4, 4), ("attune-b200", "B200", 16, 8, 8)]
# no optimizer values: what the recipes leave unstated comes from their fill policy (test_recipes_fill.py)
STATED = {"sft-192": [], "attune-b200": []}
#: attune-b200 starts from a checkpoint the user supplies (Kubernetes: a path in the volume claim)
START = {"sft-192": [], "attune-b200": ["--pretrained-checkpoint", "/checkpoints/muse-spark-open"]}
RUN_NAME = "golden-run"


def _render(cli, tmp_path, recipe: str, kind: str) -> str:
    out = tmp_path / f"{recipe}.{kind}"
    start = START[recipe] if kind == "k8s" else []
    if recipe == "attune-b200" and kind == "slurm":
        ckpt = tmp_path / "muse-spark-open"
        ckpt.mkdir(exist_ok=True)
        (ckpt / "config.json").write_text("{}")
        save_file({"lm_head.weight": torch.zeros(2)}, str(ckpt / "model.safetensors"))  # readable, as `run` needs
        start = ["--pretrained-checkpoint", str(ckpt)]
    rc, _, err = cli("launch", recipe, *STATED[recipe], f"--{kind}", "--image", IMAGES[recipe], "--run-name", RUN_NAME,
                     *start, "-o", out)
    assert rc == 0, err
    text = out.read_text()
    return text.replace(str(tmp_path), "/shared") if kind == "slurm" else text


@pytest.mark.parametrize("recipe,kind", [(r, k) for r, *_ in CASES for k in ("slurm", "k8s")])
def test_golden(cli, tmp_path, recipe, kind):
    text = _render(cli, tmp_path, recipe, kind)
    golden = GOLDEN / f"launch-{recipe}.{'sbatch' if kind == 'slurm' else 'k8s.yaml'}"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.is_file(), f"{golden} is missing; run with UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"{golden.name} differs; if intended, regenerate with UPDATE_GOLDEN=1"


@pytest.mark.parametrize("recipe,gpu,nodes,per_node,efa", CASES)
def test_sbatch_structure(cli, tmp_path, recipe, gpu, nodes, per_node, efa):
    text = _render(cli, tmp_path, recipe, "slurm")
    directives = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")]
    assert f"--nodes={nodes}" in directives and "--ntasks-per-node=1" in directives
    assert f"--gpus-per-node={per_node}" in directives
    # the warning's lead is torchrun's grace too, and covers a step and the planned save with its margin
    plan, _ = make_plan(load_recipe(recipe))
    lead = signal_seconds(plan.save.seconds, plan.time.step_s)
    assert lead >= plan.time.step_s + SIGNAL_MARGIN * plan.save.seconds > 30  # torchrun's own grace: 30 s
    assert f"--signal=B:TERM@{lead}" in directives and f"--shutdown-timeout={lead} " in text
    # several nodes and no interval stated: the fill policy's interval, recorded with its source
    interval = default_interval(plan.save.seconds, plan.time.step_s)
    assert f"# training.checkpoint_interval={interval}: fill policy {INTERVAL_POLICY}:" in text
    enroot = IMAGES[recipe].replace("registry.example.com/", "registry.example.com#").replace("@sha256:", ":sha256:")
    assert f"--nproc-per-node={per_node}" in text and f"\nIMAGE={quoting.word(enroot)}\n" in text
    assert '--container-image="$IMAGE"' in text and f"--cpus-per-task={per_node * (36 if gpu == 'GB200' else 24)}" in text
    assert '--rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:$RDZV_PORT"' in text
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert "$DATA_DIR:/data,$CHECKPOINT_DIR:/checkpoints,$RUNS_DIR:/runs" in text
    assert "export NCCL_NET_PLUGIN=ofi" in text and "export FI_PROVIDER=efa" in text
    assert ("export NCCL_MNNVL_ENABLE=1" in text) == (gpu == "GB200")
    assert "trap 'echo" in text and 'kill -TERM "$SRUN_PID"' in text


@pytest.mark.parametrize("recipe,gpu,nodes,per_node,efa", CASES)
def test_k8s_structure(cli, tmp_path, recipe, gpu, nodes, per_node, efa):
    docs = list(yaml.safe_load_all(_render(cli, tmp_path, recipe, "k8s")))
    svc, job = docs[0], docs[-1]
    assert svc["kind"] == "Service" and svc["spec"]["clusterIP"] == "None"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == nodes
    assert job["spec"]["nprocPerNode"] == str(per_node)
    head = replicas["Master"]["template"]
    assert svc["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    assert not svc["spec"]["selector"].items() <= replicas["Worker"]["template"]["metadata"]["labels"].items()
    for spec in replicas.values():
        c = spec["template"]["spec"]["containers"][0]
        assert c["image"] == IMAGES[recipe]
        assert c["resources"]["limits"] == {"nvidia.com/gpu": str(per_node), "vpc.amazonaws.com/efa": str(efa)}
        assert f"--rdzv-endpoint={svc['metadata']['name']}:29500" in c["command"][2]
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["FI_PROVIDER"] == "efa" and env["NCCL_NET_PLUGIN"] == "ofi"
    if recipe == "attune-b200":
        assert env["TRITON_CACHE_DIR"] == "$(KERNEL_CACHE)/triton"
        assert env["MUSE_STACK_IMAGE_DIGEST"] == "sha256:" + "ab" * 32


def test_a_lock_whose_torchrun_lacks_the_grace_is_refused(cli, tmp_path, monkeypatch):
    """Every node's torchrun gets --shutdown-timeout; torch before 2.12 has no such option and the job would fail on
    every node after the allocation: launch refuses the lock, naming its torch pin."""
    locks = tmp_path / "locks"
    shutil.copytree(ROOT / "containers" / "locks", locks)
    lock = locks / "gb200.toml"
    pinned = tomllib.loads(lock.read_text())["components"]["torch"]["version"]
    assert tuple(int(x) for x in pinned.split(".")[:2]) >= TORCHRUN_GRACE_SINCE  # the committed lock passes
    lock.write_text(lock.read_text().replace(f'version = "{pinned}"', 'version = "2.11.0"', 1))
    monkeypatch.setenv("MUSE_STACK_LOCKS", str(locks))
    out = tmp_path / "job.sbatch"
    rc, _, err = cli("launch", "sft-192", "--slurm", "--image", IMAGES["sft-192"], "-o", out)
    assert rc != 0 and not out.exists()
    assert "components.torch.version" in err and "2.11.0" in err and "--shutdown-timeout" in err, err


def test_validation_rejects_unknown_fields_and_wrong_types():
    docs = k8s.manifests(resolve("attune-b200", STATED["attune-b200"], image="img:1", kubernetes=True,
                                 pretrained_checkpoint="/checkpoints/x"))
    k8s.validate(docs)
    from muse_stack.util.errors import InputError

    bad = yaml.safe_load(yaml.safe_dump(docs[1]))
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(InputError, match="containers\\[0\\].resource"):
        k8s.validate([docs[0], bad])
    bad = yaml.safe_load(yaml.safe_dump(docs[1]))
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = {"count": 15}
    with pytest.raises(InputError):
        k8s.validate([bad])
    bad = yaml.safe_load(yaml.safe_dump(docs[0]))
    del bad["spec"]["ports"][0]["port"]  # required by the Service API
    with pytest.raises(InputError, match="port"):
        k8s.validate([bad])


def test_default_image_is_the_lock_tag_imported_to_a_squashfs(tmp_path):
    from muse_stack.launch import slurm
    from muse_stack.stack import image_tag, load

    spec = resolve("sft-192")
    assert spec.image is None and spec.default_image == image_tag(load("gb200"))
    text = slurm.render(spec)
    squashfs = image_tag(load("gb200")).replace(":", "-") + ".sqsh"
    assert f'IMAGE="$IMAGES_DIR"/{squashfs}\n' in text and '--container-image="$IMAGE"' in text
    assert f"dockerd://{image_tag(load('gb200'))}" in text  # how to import it, never a registry pull


def test_broken_layout_writes_nothing(cli, tmp_path):
    out = tmp_path / "x.sbatch"
    rc, _, err = cli("launch", "sft-192", "--slurm", "--nodes", "10", "-o", out)
    assert rc == 2 and "hardware.count = 40" in err and "divide" in err
    assert not out.exists()
    rc, _, err = cli("launch", "attune-b200", "--slurm", "hardware.per_node=4", "-o", out)
    assert rc == 2 and "B200 node has 8 GPUs" in err and not out.exists()


def test_node_override_rescales_the_recipe(cli, tmp_path):
    spec = resolve("attune-b200", ["layout.dp=8", *STATED["attune-b200"]], nodes=32, kubernetes=True,
                   pretrained_checkpoint="/checkpoints/x", image="img:1")
    assert spec.nodes == 32 and spec.world_size == 256 and "hardware.count=256" in spec.run_overrides


def test_cpu_recipe_runs_without_containers(cli, tmp_path):
    spec = resolve("tiny-cpu", gpus=4, nodes=2)
    assert (spec.nodes, spec.per_node) == (2, 2)
    from muse_stack.launch import slurm

    text = slurm.render(spec, python="/usr/bin/python3")
    assert "#SBATCH --nodes=2\n" in text and "#SBATCH --ntasks-per-node=2\n" in text
    assert "container" not in text and "torch.distributed.run" not in text
    assert 'export MASTER_ADDR="$HEAD_NODE"' in text
    rc, _, err = cli("launch", "tiny-cpu", "--k8s")
    assert rc == 3 and "CPU recipes run on Slurm" in err


def test_sbatch_states_the_default_time_and_submit_requires_time(cli, tmp_path):
    text = _render(cli, tmp_path, "sft-192", "slurm")
    assert "#SBATCH --time" not in text
    assert "no --time given: the job runs under the partition's default time limit" in text
    out = tmp_path / "timed.sbatch"
    rc, _, err = cli("launch", "sft-192", *STATED["sft-192"], "--slurm", "--image", IMAGES["sft-192"],
                     "--time", "04:00:00", "-o", out)
    assert rc == 0, err
    timed = out.read_text()
    assert "#SBATCH --time=04:00:00\n" in timed and "no --time given" not in timed
    rc, _, err = cli("launch", "sft-192", *STATED["sft-192"], "--slurm", "--submit", "--image", IMAGES["sft-192"])
    assert rc == 2 and "--time" in err and "04:00:00" in err


def test_nccl_debug_is_warn_unless_asked(cli, tmp_path):
    text = _render(cli, tmp_path, "sft-192", "slurm")
    assert "export NCCL_DEBUG=WARN\n" in text and "NCCL_DEBUG_SUBSYS" not in text
    out = tmp_path / "info.sbatch"
    rc, _, err = cli("launch", "sft-192", *STATED["sft-192"], "--slurm", "--image", IMAGES["sft-192"],
                     "--nccl-debug", "info", "-o", out)
    assert rc == 0, err
    info = out.read_text()
    assert "export NCCL_DEBUG=INFO\n" in info and "export NCCL_DEBUG_SUBSYS=INIT,NET\n" in info
    # the recipe's env asks too
    out = tmp_path / "env.sbatch"
    rc, _, err = cli("launch", "sft-192", *STATED["sft-192"], "env.NCCL_DEBUG=TRACE", "--slurm",
                     "--image", IMAGES["sft-192"], "-o", out)
    assert rc == 0, err
    assert "export NCCL_DEBUG=TRACE\n" in out.read_text()
    rc, _, err = cli("launch", "sft-192", *STATED["sft-192"], "--slurm", "--nccl-debug", "LOUD")
    assert rc == 2 and "--nccl-debug" in err

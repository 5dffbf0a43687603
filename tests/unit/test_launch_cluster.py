"""Launch files as a cluster reads them: enroot/pyxis image references, no credentials and no extra
mounts from user input, recipe files that reach the container, the checks `run` would make
before a job is written, the resume-if-checkpoint mode on every attempt, fabrics, CPUs per task,
Kubernetes gang scheduling, GPU placement, IMEX and name limits, and the CLI's -h and completion."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from muse_stack.util.errors import MuseStackError, UsageError
from muse_stack.util import quoting
from muse_stack.launch import k8s, slurm
from muse_stack.launch.image import parse
from muse_stack.launch.spec import default_run_name, resolve

ROOT = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash")
IMG = "registry.example.com/muse-stack:h200-0.1.0"
IMG_B200 = IMG.replace("h200", "b200")  # attune-b200 runs on B200 nodes: their image


@pytest.mark.parametrize("given, enroot, oci", [
    ("registry.example.com/muse-stack:gb200-0.1.0", "registry.example.com#muse-stack:gb200-0.1.0",
     "registry.example.com/muse-stack:gb200-0.1.0"),
    ("registry.example.com:5000/team/muse-stack:1", "registry.example.com:5000#team/muse-stack:1",
     "registry.example.com:5000/team/muse-stack:1"),
    ("nvcr.io#nvidia/pytorch:25.01-py3", "nvcr.io#nvidia/pytorch:25.01-py3", "nvcr.io/nvidia/pytorch:25.01-py3"),
    ("docker://nvcr.io#nvidia/pytorch:25.01-py3", "nvcr.io#nvidia/pytorch:25.01-py3", "nvcr.io/nvidia/pytorch:25.01-py3"),
    # Docker Hub: enroot's default registry, the library/ namespace stated
    ("ubuntu:24.04", "library/ubuntu:24.04", "docker.io/library/ubuntu:24.04"),
    ("docker.io/nvidia/cuda:12.8.0-base-ubuntu24.04", "nvidia/cuda:12.8.0-base-ubuntu24.04",
     "docker.io/nvidia/cuda:12.8.0-base-ubuntu24.04"),
    # a digest: the manifest reference in enroot's grammar, immutable on every enroot release
    ("registry.example.com/muse-stack:gb200@sha256:" + "ab" * 32,
     "registry.example.com#muse-stack:sha256:" + "ab" * 32, "registry.example.com/muse-stack:gb200@sha256:" + "ab" * 32),
])
def test_image_references_are_written_as_enroot_and_kubernetes_read_them(given, enroot, oci):
    ref = parse(given)
    assert ref.enroot() == enroot and ref.oci() == oci
    assert ref.pinned == ("@sha256:" in given)


def test_a_squashfs_is_a_pinned_image_for_pyxis_only(tmp_path):
    ref = parse("/fsx/images/muse-stack-gb200.sqsh")
    assert ref.enroot() == "/fsx/images/muse-stack-gb200.sqsh" and ref.pinned
    with pytest.raises(UsageError) as exc:
        ref.oci()
    assert exc.value.field == "--image"


@pytest.mark.parametrize("bad", ["muse-stack", "Registry.example.com/Muse:1", "dockerd://muse-stack:gb200",
                                 "x.sqsh@sha256:" + "ab" * 32, "img:tag with space"])
def test_what_is_not_an_image_reference_is_refused_naming_the_flag(bad):
    with pytest.raises(UsageError) as exc:
        parse(bad)
    assert exc.value.field == "--image" and exc.value.fix


@pytest.mark.parametrize("image", ["user:hunter2pw@registry.example.com/muse-stack:1",
                                   "docker://user:hunter2pw@registry.example.com#muse-stack:1",
                                   "user@registry.example.com#muse-stack:1"])
def test_credentials_in_an_image_reference_are_refused_and_never_written(cli, tmp_path, image):
    for kind in ("--slurm", "--k8s"):
        out = tmp_path / f"job{kind}"
        rc, stdout, err = cli("launch", "proxy-8gpu", kind, "--image", image, "-o", out)
        assert rc == 2 and "--image" in err and "hunter2pw" not in err + stdout and not out.exists()


@pytest.mark.parametrize("flag", ["--data-dir", "--runs-dir", "--checkpoint-dir"])
def test_a_comma_or_colon_in_a_mounted_folder_adds_no_mount(cli, tmp_path, flag):
    out = tmp_path / "job.sbatch"
    for value in ("/etc:/host-etc", "/shared/data,/etc:/host-etc"):
        rc, _, err = cli("launch", "proxy-8gpu", "--slurm", "--image", IMG, flag, value, "-o", out)
        assert rc == 2 and flag in err and "--container-mounts" in err and not out.exists()


def _stubs(tmp_path: Path) -> Path:
    d = tmp_path / "stubs"
    d.mkdir()
    (d / "srun").write_text('#!/bin/sh\nprintf \'%s\\0\' "$@" > "$STUB_OUT/srun.args"\n')
    (d / "scontrol").write_text("#!/bin/sh\necho node-1\n")
    for f in d.iterdir():
        f.chmod(0o755)
    return d


def _run(text: str, work: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    work.mkdir(exist_ok=True)
    (work / "job.sbatch").write_text(text)
    out = work / "out"
    out.mkdir(exist_ok=True)
    job_env = {"PATH": f"{_stubs(work)}:{os.environ['PATH']}", "STUB_OUT": str(out), "SLURM_JOB_ID": "7",
               "SLURM_JOB_NODELIST": "node-1", "SLURM_JOB_NUM_NODES": "1", "SLURM_SUBMIT_DIR": str(work), **env}
    proc = subprocess.run([BASH, str(work / "job.sbatch")], cwd=work, env=job_env, capture_output=True, text=True,
                          timeout=60)
    args = (out / "srun.args").read_bytes().decode().split("\0")[:-1] if (out / "srun.args").exists() else []
    return proc, args


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_a_folder_set_at_job_time_with_a_comma_stops_the_job_before_srun(tmp_path):
    text = slurm.render(resolve("proxy-8gpu", image=IMG))
    proc, args = _run(text, tmp_path / "w", MUSE_STACK_DATA=str(tmp_path / "d,/etc:/host-etc"))
    assert proc.returncode == 2 and "--container-mounts" in proc.stderr and args == []


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_a_recipe_file_reaches_the_container(cli, tmp_path):
    src = (ROOT / "recipes" / "proxy-8gpu.yaml").read_text().replace("name: proxy-8gpu", "name: my-proxy", 1)
    recipe = tmp_path / "host-only" / "my-proxy.yaml"
    recipe.parent.mkdir()
    recipe.write_text(src + "# a comment with 'quotes', $(touch CANARY) and `backticks`\n")
    spec = resolve(str(recipe), image=IMG, run_name="r1")
    text = slurm.render(spec, runs_dir=str(tmp_path / "runs"))
    assert str(recipe) not in text.replace(f"# the recipe file as launched ({recipe})", "")
    proc, args = _run(text, tmp_path / "w")
    assert proc.returncode == 0, proc.stderr
    carried = tmp_path / "runs" / ".recipes" / spec.recipe_file_name
    assert carried.read_text() == recipe.read_text()  # byte for byte, nothing ran
    assert not list((tmp_path / "w").glob("CANARY")) and f"/runs/.recipes/{spec.recipe_file_name}" in args
    assert f"{tmp_path / 'runs'}:/runs" in next(a for a in args if a.startswith("--container-mounts="))
    # Kubernetes: a ConfigMap mounted where the command reads it
    docs = list(yaml.safe_load_all(k8s.render(resolve(str(recipe), image=IMG, run_name="r1", kubernetes=True))))
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert config["data"]["recipe.yaml"] == recipe.read_text()
    pod = docs[-1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["volumes"][-1]["configMap"]["name"] == config["metadata"]["name"]
    assert f"run {k8s.RECIPE_MOUNT}/recipe.yaml " in pod["containers"][0]["command"][2]


def test_launch_checks_the_starting_checkpoint_before_writing(cli, tmp_path):
    out = tmp_path / "job.sbatch"
    rc, _, err = cli("launch", "attune-b200", "--slurm", "--image", IMG_B200, "-o", out)
    assert rc == 2 and "model.pretrained_checkpoint" in err and "--pretrained-checkpoint" in err and not out.exists()
    rc, _, err = cli("launch", "attune-b200", "--slurm", "--image", IMG_B200, "--pretrained-checkpoint",
                     tmp_path / "missing", "-o", out)
    assert rc == 3 and "--pretrained-checkpoint" in err and not out.exists()
    ckpt = tmp_path / "muse-spark-open"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    rc, _, err = cli("launch", "attune-b200", "--slurm", "--image", IMG_B200, "--pretrained-checkpoint", ckpt, "-o", out)
    assert rc == 3 and "weights" in err and not out.exists()
    (ckpt / "model.safetensors").write_bytes(b"")  # unreadable: `run` would refuse it, so launch does
    rc, _, err = cli("launch", "attune-b200", "--slurm", "--image", IMG_B200, "--pretrained-checkpoint", ckpt, "-o", out)
    assert rc == 3 and "model.safetensors" in err and not out.exists()
    save_file({"lm_head.weight": torch.zeros(2)}, str(ckpt / "model.safetensors"))
    rc, _, err = cli("launch", "attune-b200", "--slurm", "--image", IMG_B200, "--pretrained-checkpoint", ckpt, "-o", out)
    assert rc == 0, err
    text = out.read_text()
    assert f"PRETRAINED_DIR={ckpt}" in text and "$PRETRAINED_DIR:/pretrained:ro" in text
    assert "--pretrained-checkpoint /pretrained" in text
    # Kubernetes reads it from the volume claim
    rc, _, err = cli("launch", "attune-b200", "--k8s", "--image", IMG_B200, "--pretrained-checkpoint", "/home/me/ckpt")
    assert rc == 3 and "--pretrained-checkpoint" in err


def test_launch_checks_wandb_is_in_the_image(monkeypatch, tmp_path):
    import muse_stack.stack as stack

    locks = tmp_path / "locks"
    locks.mkdir()
    monkeypatch.setattr(stack, "locks_dir", lambda: locks)
    wandb = ["logging.wandb.project=muse"]
    (locks / "pylock.h200.toml").write_text('lock-version = "1.0"\n[[packages]]\nname = "torch"\n')
    with pytest.raises(MuseStackError) as exc:
        resolve("proxy-8gpu", wandb, image=IMG)
    assert exc.value.field == "logging.wandb" and "pylock.h200.toml" in exc.value.message
    (locks / "pylock.h200.toml").write_text('lock-version = "1.0"\n[[packages]]\nname = "wandb"\n')
    assert resolve("proxy-8gpu", wandb, image=IMG).recipe.logging.wandb.project == "muse"


def test_every_attempt_runs_the_resume_if_checkpoint_mode(tmp_path):
    text = slurm.render(resolve("sft-192", run_name="r1"))
    assert "#SBATCH --requeue\n" in text and "#SBATCH --open-mode=append\n" in text
    assert 'RUN_ARGS=(sft-192 --out "/runs/$RUN_NAME" --resume auto)' in text
    assert "results.json" not in text  # no guess from how the last attempt ended
    docs = list(yaml.safe_load_all(k8s.render(resolve("sft-192", image=IMG.replace("h200", "gb200"),
                                                      kubernetes=True))))
    for replica in docs[-1]["spec"]["pytorchReplicaSpecs"].values():
        command = replica["template"]["spec"]["containers"][0]["command"][2]
        assert command.endswith('run sft-192 --out "$MUSE_STACK_RUN_DIR" --resume auto --no-progress')
        assert replica["restartPolicy"] == "OnFailure"


def test_run_names_are_unique_per_launch_and_fixed_in_the_job_file():
    a, b = resolve("tiny-cpu"), resolve("tiny-cpu")
    assert a.run_name != b.run_name and a.run_name.startswith("tiny-cpu-")
    assert f"RUN_NAME={a.run_name};" in slurm.render(a)  # a requeue re-runs this file: the same run
    long = default_run_name("x" * 80)
    assert len(long) <= 63 and quoting.DNS_LABEL.fullmatch(long)


def test_fabrics_set_their_own_nccl_settings():
    efa = resolve("sft-192")
    assert efa.fabric == "efa" and efa.env["NCCL_NET_PLUGIN"] == "ofi" and efa.env["FI_PROVIDER"] == "efa"
    # the image lists the EFA folders after the set's NCCL and cuDNN; the job puts nothing ahead of them
    assert efa.library_path is None and efa.env["NCCL_MNNVL_ENABLE"] == "1"
    ib = resolve("sft-192", fabric="ib", image=IMG.replace("h200", "gb200"), kubernetes=True)
    assert ib.env["NCCL_NET"] == "IB" and "FI_PROVIDER" not in ib.env and "NCCL_NET_PLUGIN" not in ib.env
    assert ib.library_path is None and ib.env["NCCL_MNNVL_ENABLE"] == "1"  # NVLink domain whatever the fabric
    text = slurm.render(resolve("sft-192", fabric="ib"))
    assert "export NCCL_NET=IB\n" in text and "ofi" not in text and "/opt/amazon" not in text
    pod = k8s.manifests(ib)[-1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert "vpc.amazonaws.com/efa" not in pod["containers"][0]["resources"]["limits"]
    assert pod["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    for bad, field in ((("sft-192",), {"fabric": "roce"}), (("tiny-cpu",), {"fabric": "ib"})):
        with pytest.raises(UsageError) as exc:
            resolve(*bad, **field)
        assert exc.value.field == "--fabric"


def test_the_one_task_per_node_gets_the_nodes_cpus():
    assert resolve("sft-192").cpus_per_task == 4 * (144 // 4)  # p6e-gb200.36xlarge: 144 vCPUs, 4 GPUs
    assert resolve("proxy-8gpu", image=IMG).cpus_per_task == 8 * (192 // 8)
    spec = resolve("sft-192", cpus_per_gpu=16)
    text = slurm.render(spec)
    assert spec.cpus_per_task == 64 and "#SBATCH --cpus-per-task=64\n" in text and "srun" in text
    assert "--ntasks-per-node=1 --cpus-per-task=64" in text


def test_kubernetes_gang_scheduling_gpu_placement_and_imex():
    docs = k8s.manifests(resolve("sft-192", image=IMG.replace("h200", "gb200"), kubernetes=True, run_name="r1"))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Service", "ComputeDomain", "PyTorchJob"]
    domain, job = docs[1], docs[2]
    assert job["metadata"]["labels"][k8s.KUEUE_LABEL] == "muse-stack"
    assert domain["spec"]["numNodes"] == 48
    channel = domain["spec"]["channel"]["resourceClaimTemplate"]["name"]
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-GB200"}
        assert pod["resourceClaims"] == [{"name": "imex-channel", "resourceClaimTemplateName": channel}]
        assert pod["containers"][0]["resources"]["claims"] == [{"name": "imex-channel"}]
    k8s.validate(docs)
    b200 = k8s.manifests(resolve("proxy-8gpu", image=IMG, kubernetes=True))
    assert [d["kind"] for d in b200] == ["Service", "PyTorchJob"]
    assert "resourceClaims" not in b200[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]


def test_a_63_character_run_name_gives_valid_kubernetes_names():
    run = "r" + "0123456789" * 6 + "ab"
    assert len(run) == 63
    spec = resolve("sft-192", image=IMG.replace("h200", "gb200"), kubernetes=True, run_name=run)
    docs = k8s.manifests(spec)
    names = [d["metadata"]["name"] for d in docs] + [docs[1]["spec"]["channel"]["resourceClaimTemplate"]["name"]]
    # pods and their services, named by the training operator: NAME-worker-<index>
    names += [f"{docs[-1]['metadata']['name']}-worker-{spec.nodes - 2}", f"{docs[-1]['metadata']['name']}-master-0"]
    dns1035 = __import__("re").compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
    assert all(dns1035.fullmatch(n) for n in names), names
    assert docs[0]["metadata"]["labels"][k8s.RUN_LABEL] == run  # the run keeps its full name
    env = {e["name"]: e.get("value") for e in
           docs[-1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MUSE_STACK_RUN_DIR"] == f"/runs/{run}"


def test_kubernetes_needs_a_registry_image(cli, tmp_path):
    out = tmp_path / "job.yaml"
    rc, _, err = cli("launch", "sft-192", "--k8s", "-o", out)
    assert rc == 2 and "--image" in err and "Docker Hub" in err and not out.exists()


def test_job_files_record_the_image_reference():
    digest = "sha256:" + "cd" * 32
    text = slurm.render(resolve("proxy-8gpu", image=f"registry.example.com/muse-stack@{digest}"))
    assert f"export MUSE_STACK_IMAGE=registry.example.com/muse-stack@{digest}\n" in text
    assert f"export MUSE_STACK_IMAGE_DIGEST={digest}\n" in text
    from muse_stack.fingerprint.identity import collect

    os.environ["MUSE_STACK_IMAGE"] = f"registry.example.com/muse-stack@{digest}"
    try:
        assert collect()["image_reference"] == f"registry.example.com/muse-stack@{digest}"
    finally:
        del os.environ["MUSE_STACK_IMAGE"]


def test_the_headline_launch_needs_no_extra_values(cli, tmp_path):
    out = tmp_path / "sft-192.sbatch"
    rc, _, err = cli("launch", "sft-192", "--slurm", "--time", "48:00:00", "-o", out)
    assert rc == 0, err
    assert "optimizer." not in out.read_text()


@pytest.mark.parametrize("args", [["-h"], ["launch", "-h"], ["show", "-h"], ["record", "import", "-h"],
                                  ["run", "-h"]])
def test_h_is_help_everywhere(cli, args):
    rc, out, _ = cli(*args)
    assert rc == 0 and "Usage" in out and "--help" in out


def test_shell_completion_is_offered(cli):
    rc, out, _ = cli("--help")
    assert rc == 0 and "--install-completion" in out and "--show-completion" in out


def test_a_written_sbatch_keeps_slurms_signal_directive(cli, tmp_path):
    """`B:TERM@120` is Slurm's syntax, not user:password@host: the last-guard redaction of written
    text leaves it, so the job is warned 120 s before its limit."""
    out = tmp_path / "job.sbatch"
    rc, _, err = cli("launch", "tiny-cpu", "--slurm", "-o", out)
    assert rc == 0, err
    assert "#SBATCH --signal=B:TERM@120\n" in out.read_text()


def test_a_credential_in_the_checkpoint_path_is_refused_and_never_written(cli, tmp_path):
    out = tmp_path / "job.sbatch"
    for path in ("https://user:hunter2pw@host.example.com/ckpt", "s3:/user:hunter2pw@bucket/ckpt"):
        rc, stdout, err = cli("launch", "attune-b200", "--slurm", "--image", IMG_B200, "--pretrained-checkpoint", path,
                              "-o", out)
        assert rc == 2 and "--pretrained-checkpoint" in err and "hunter2pw" not in stdout + err
        assert "user:password" in err  # named as a credential, not as a path pyxis cannot mount
        assert not out.exists()


def test_the_docker_run_line_a_cpu_machine_suggests_carries_ngcs_flags(cli, monkeypatch):
    import muse_stack.engines.megatron_available as megatron_available
    import muse_stack.run.availability as availability

    monkeypatch.setattr(megatron_available, "missing", lambda: "CUDA is not available on this machine")
    monkeypatch.setattr(availability, "_cuda_devices", lambda: 0)
    rc, _, err = cli("run", "proxy-1gpu")
    assert rc == 2 and "--ipc=host --ulimit memlock=-1 --ulimit stack=67108864" in " ".join(err.split())
    for doc in ("README.md", "docs/images.md"):
        lines = [line for line in (ROOT / doc).read_text().splitlines() if line.startswith("docker run")]
        assert lines and all("--ipc=host --ulimit memlock=-1 --ulimit stack=67108864" in line for line in lines), doc


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_a_recipe_file_reaches_a_cpu_job_too(tmp_path):
    src = (ROOT / "recipes" / "tiny-cpu.yaml").read_text().replace("name: tiny-cpu", "name: my-tiny", 1)
    recipe = tmp_path / "my tiny.yaml"  # a space: the path is one word wherever it goes
    recipe.write_text(src)
    spec = resolve(str(recipe), run_name="r2")
    proc, args = _run(slurm.render(spec, runs_dir=str(tmp_path / "shared runs"), python="python3"), tmp_path / "w")
    assert proc.returncode == 0, proc.stderr
    carried = tmp_path / "shared runs" / ".recipes" / spec.recipe_file_name
    assert carried.read_text() == src and str(carried) in args and str(recipe) not in args
    with pytest.raises(UsageError) as exc:
        k8s.manifests(resolve("proxy-8gpu"))  # no image: never a local tag in a manifest
    assert exc.value.field == "--image"


# ---- images on Kubernetes: a tag is pulled at every start; an image for other nodes is refused -------------

def _container(spec) -> dict:
    return k8s.manifests(spec)[-1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]


def test_a_digest_is_kept_and_a_tag_is_pulled_at_every_pod_start(cli, tmp_path):
    digest = "sha256:" + "cd" * 32
    pinned = _container(resolve("sft-192", image=f"registry.example.com/muse-stack@{digest}", kubernetes=True))
    assert pinned["imagePullPolicy"] == "IfNotPresent"  # a digest names one image for good
    tagged = resolve("sft-192", image="registry.example.com/muse-stack:gb200-0.1.0", kubernetes=True)
    assert _container(tagged)["imagePullPolicy"] == "Always"  # a tag can move: no node keeps a stale copy
    # the launch says why, in the manifests and on stderr (stdout may be the manifests)
    out = tmp_path / "job.yaml"
    rc, _, err = cli("launch", "sft-192", "--k8s", "--image", "registry.example.com/muse-stack:gb200-0.1.0", "-o", out)
    assert rc == 0, err
    assert "a tag can move" in " ".join(err.split()) and "@sha256:DIGEST" in err
    assert "# Image: the image is given by tag, and a tag can move" in out.read_text()
    rc, _, err = cli("launch", "sft-192", "--k8s", "--image", f"registry.example.com/muse-stack@{digest}",
                     "-o", tmp_path / "pinned.yaml")
    assert rc == 0 and "tag can move" not in err and "tag can move" not in (tmp_path / "pinned.yaml").read_text()


@pytest.mark.parametrize("launcher", ["--k8s", "--slurm"])
@pytest.mark.parametrize("recipe, image, built, runs", [
    # the finding: an amd64 sm90 image for arm64 sm100 nodes
    ("sft-192", "registry.example.com/muse-stack:h200-0.1.0", "H200 nodes (linux/amd64, sm90)",
     "GB200 nodes (linux/arm64, sm100)"),
    ("sft-192", "registry.example.com/muse-stack:b200-0.1.0-0123456789ab", "B200 nodes (linux/amd64, sm100)",
     "GB200 nodes (linux/arm64, sm100)"),
    ("attune-b200", "registry.example.com/muse-stack:h200@sha256:" + "ab" * 32, "H200 nodes (linux/amd64, sm90)",
     "B200 nodes (linux/amd64, sm100)"),
    ("proxy-8gpu", "registry.example.com/team/muse-stack-gb200:1", "GB200 nodes (linux/arm64, sm100)",
     "H200 nodes (linux/amd64, sm90)"),
    ("proxy-8gpu", "registry.example.com/muse-stack:cpu", "cpu nodes (linux/amd64, no GPU)",
     "H200 nodes (linux/amd64, sm90)"),
])
def test_an_image_built_for_other_nodes_is_refused(cli, tmp_path, launcher, recipe, image, built, runs):
    out = tmp_path / "job"
    rc, _, err = cli("launch", recipe, launcher, "--image", image, "-o", out)
    err = " ".join(err.split())
    assert rc == 2 and not out.exists()
    assert "--image" in err and built in err and runs in err, err
    target = {"sft-192": "gb200", "attune-b200": "b200", "proxy-8gpu": "h200"}[recipe]
    assert f"make image gpu={target}" in err  # the fix: the recipe's own image


def test_a_squashfs_named_for_other_nodes_is_refused_on_slurm():
    with pytest.raises(UsageError) as exc:
        resolve("sft-192", image="/shared/images/muse-stack-h200-0.1.0-0123456789ab.sqsh")
    assert exc.value.field == "--image" and "H200" in str(exc.value) and "GB200" in str(exc.value)
    assert resolve("sft-192", image="/shared/images/muse-stack-gb200.sqsh").image.squashfs


@pytest.mark.parametrize("image", [
    "registry.example.com/muse-stack:gb200-0.1.0",  # its own target
    "registry.example.com/muse-stack@sha256:" + "ab" * 32,  # a digest alone says no target
    "registry.example.com/team/trainer:h200",  # another name: its tag is not read
    "registry.example.com/muse-stack:1",  # a tag that names no lock
    "registry.example.com/muse-stack:gb2000-1",  # a lock's name only as a whole '-' part
])
def test_an_image_whose_name_says_no_other_target_is_accepted(image):
    spec = resolve("sft-192", image=image, kubernetes=True)
    assert _container(spec)["image"] == parse(image).oci()


def test_the_lock_an_image_name_reads():
    from muse_stack.launch.image import lock_of

    locks = ["gb200", "b200", "h200", "cpu", "gb200-nvl"]
    assert lock_of(parse("r.io/muse-stack:gb200-0.1.0-0123456789ab"), locks) == "gb200"
    assert lock_of(parse("r.io/muse-stack:gb200-nvl-0.1.0"), locks) == "gb200-nvl"  # the longest that fits
    assert lock_of(parse("r.io/muse-stack:b200"), locks) == "b200"
    assert lock_of(parse("muse-stack-h200:0.1.0"), locks) == "h200"
    assert lock_of(parse("/img/muse-stack-cpu.sqsh"), locks) == "cpu"
    for other in ("r.io/muse-stack:0.1.0", "r.io/other:gb200", "/img/gb200.sqsh", "r.io/muse-stackx:gb200",
                  "r.io/muse-stack@sha256:" + "ab" * 32):
        assert lock_of(parse(other), locks) is None, other

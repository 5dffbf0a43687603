"""Values on their way into launch files: every generated sbatch script parses (`bash -n`), runs
with stub srun/scontrol without executing any injected text, and exports exactly the values the
recipe gave; every Kubernetes manifest parses to exactly the two expected documents. Each
generated value is either refused with the project's error or carried through quoted."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muse_stack.util.errors import MuseStackError, UsageError
from muse_stack.util import quoting
from muse_stack.launch import k8s, slurm
from muse_stack.launch.spec import resolve

BASH = shutil.which("bash")
CANARY = "CANARY"  # every injection below would create this file in the script's working directory

INJECTIONS = [f"$(touch {CANARY})", f"`touch {CANARY}`", f'"; touch {CANARY}; "', f"'; touch {CANARY}; '",
              f"\ntouch {CANARY}\n", f"\r\ntouch {CANARY}", f"$(touch${{IFS}}{CANARY})", "${IFS}", "\\", "\\\\\"",
              "}", "${", "$", "#", "!", "*", "~", ";", "&", "|", "<", ">", "${env:MS_SRC}", "$MS_SRC", "${MS_SRC}",
              f"$((1)){CANARY}", "\t", "\x00", " -o x "]
fragment = st.one_of(st.sampled_from(INJECTIONS), st.text(max_size=6))
hostile = st.lists(fragment, min_size=0, max_size=4).map("".join)
env_key = st.from_regex(r"MS_T_[A-Z0-9_]{0,6}", fullmatch=True)

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


@pytest.fixture(scope="module")
def cpu_spec():
    return resolve("tiny-cpu")


@pytest.fixture(scope="module")
def gpu_spec():
    return resolve("proxy-8gpu", image="registry.example.com/muse-stack:h200-0.1.0")


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("stubs")
    (d / "srun").write_text('#!/bin/sh\nenv -0 > "$STUB_OUT/env"\nprintf \'%s\\0\' "$@" > "$STUB_OUT/srun.args"\n')
    (d / "scontrol").write_text("#!/bin/sh\necho node-1\n")
    for f in d.iterdir():
        f.chmod(0o755)
    return d


def _expected(value: str, env: dict[str, str]) -> str:
    """What bash gives a value: its references expanded from the job's environment, the rest literal."""
    shell = {"IFS": " \t\n"}  # set by bash itself

    def sub(m):
        name = m.group("env") or m.group("braced") or m.group("plain")
        return env.get(name, shell.get(name, ""))

    return quoting.REFERENCE.sub(sub, value)


def _run_script(text: str, work: Path, stubs: Path) -> tuple[dict[str, str], list[str], dict[str, str]]:
    """Check the syntax, then run the script with stub srun and scontrol: the environment srun saw,
    its arguments, and the job's starting environment."""
    script = work / "job.sbatch"
    script.write_bytes(text.encode())
    syntax = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    out = work / "out"
    out.mkdir()
    job_env = {"PATH": f"{stubs}:{os.environ['PATH']}", "HOME": str(work / "home"), "STUB_OUT": str(out),
               "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node-1", "SLURM_JOB_NUM_NODES": "1",
               "SLURM_SUBMIT_DIR": str(work), "MS_SRC": "from-the-environment"}
    proc = subprocess.run([BASH, str(script)], cwd=work, env=job_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not any(p.name == CANARY for p in work.rglob("*")), "injected text ran"
    # read as bytes: text mode would turn a value's \r\n into \n
    env = dict(item.split("=", 1) for item in (out / "env").read_bytes().decode().split("\0") if "=" in item)
    return env, (out / "srun.args").read_bytes().decode().split("\0")[:-1], job_env


def _render_or_refuse(spec, **kw):
    try:
        return slurm.render(spec, **kw)
    except UsageError as exc:  # a clear refusal naming the field
        assert exc.field and exc.fix
        return None


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
@FAST
@given(key=env_key, value=hostile, name=hostile, description=hostile, run_name=hostile, override=hostile,
       runs_dir=hostile, python=hostile, partition=st.one_of(st.none(), hostile), account=st.one_of(st.none(), hostile),
       time_limit=st.one_of(st.none(), hostile))
def test_cpu_sbatch_runs_nothing_injected(cpu_spec, stubs, tmp_path_factory, key, value, name, description, run_name,
                                          override, runs_dir, python, partition, account, time_limit):
    recipe = cpu_spec.recipe.model_copy(update={"name": name, "description": description})  # unvalidated on purpose
    spec = dataclasses.replace(cpu_spec, recipe=recipe, env={key: value},
                               run_name=quoting.DNS_LABEL.fullmatch(run_name) and run_name or "r",
                               run_overrides=[f"env.X={override}"])
    text = _render_or_refuse(spec, runs_dir="rel/" + runs_dir, python=python or "python3", partition=partition,
                             account=account, time_limit=time_limit)
    if text is None:
        return
    work = tmp_path_factory.mktemp("job")
    # the stub srun records the environment and the arguments it was given, and runs nothing
    env, args, job_env = _run_script(text, work, stubs)
    assert env[key] == _expected(value, job_env)
    assert f"env.X={override}" in args
    assert [line for line in text.splitlines() if line.startswith("#SBATCH")] == \
        [line for line in text.splitlines() if line.startswith("#SBATCH ")]


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
@FAST
@given(key=env_key, value=hostile, image=hostile, data_dir=hostile, checkpoint_dir=hostile)
def test_gpu_sbatch_runs_nothing_injected(gpu_spec, stubs, tmp_path_factory, key, value, image, data_dir,
                                          checkpoint_dir):
    from muse_stack.launch.image import parse

    try:
        ref = parse(image or "img:1")
    except UsageError as exc:  # refused naming --image, never written
        assert exc.field == "--image" and exc.fix
        return
    spec = dataclasses.replace(gpu_spec, env={**gpu_spec.env, key: value}, image=ref)
    text = _render_or_refuse(spec, runs_dir="runs", data_dir="rel/" + data_dir,
                             checkpoint_dir="rel/" + checkpoint_dir)
    if text is None:
        return
    work = tmp_path_factory.mktemp("job")
    env, args, job_env = _run_script(text, work, stubs)
    assert env[key] == _expected(value, job_env)
    assert f"--container-image={ref.enroot()}" in args
    mounts = next(a for a in args if a.startswith("--container-mounts=")).split("=", 1)[1].split(",")
    assert [m.split(":")[1] for m in mounts] == ["/data", "/checkpoints", "/runs"]  # no mount added


@FAST
@given(key=env_key, value=hostile, name=hostile, run_name=hostile, override=hostile,
       namespace=st.one_of(st.none(), hostile), claim=hostile)
def test_manifest_is_exactly_two_documents(gpu_spec, key, value, name, run_name, override, namespace, claim):
    recipe = gpu_spec.recipe.model_copy(update={"name": name})
    spec = dataclasses.replace(gpu_spec, recipe=recipe, env={key: value}, run_overrides=[f"env.X={override}"],
                               run_name=quoting.DNS_LABEL.fullmatch(run_name) and run_name or "r")
    try:
        text = k8s.render(spec, namespace=namespace, claim=claim or "c")
    except MuseStackError as exc:
        assert exc.field and exc.fix
        return
    docs = list(yaml.safe_load_all(text))
    assert [(d["apiVersion"], d["kind"]) for d in docs] == [("v1", "Service"), ("kubeflow.org/v1", "PyTorchJob")]
    head = text.split("\napiVersion:", 1)[0]
    assert all(line.startswith("#") for line in head.splitlines())
    container = docs[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    by_name = {e["name"]: e for e in container["env"]}
    ref = quoting.REFERENCE.fullmatch(value)
    if ref and ref.group("env"):
        assert by_name[key]["valueFrom"]["secretKeyRef"]["key"] == ref.group("env")
    else:
        assert by_name[key]["value"] == k8s._k8s_value(value)
    assert docs[1]["metadata"]["labels"]["muse-stack.dev/recipe"] == name


def test_cli_refuses_unsafe_values_and_writes_nothing(cli, tmp_path):
    out = tmp_path / "job.sbatch"
    for args, field in [(["--partition", "gpu\ntouch x"], "--partition"), (["--account", "a;b"], "--account"),
                        (["--time", "$(id)"], "--time"), (["--image", "img\nx"], "--image"),
                        (["--runs-dir", "a\nb"], "--runs-dir"),
                        (["--image", "docker://user:pw1234567@registry.example.com#img:1"], "--image")]:
        rc, _, err = cli("launch", "tiny-cpu", "--slurm", *args, "-o", out)
        assert rc == 2 and field in err and "fix:" in err and not out.exists(), err
    rc, _, err = cli("launch", "proxy-8gpu", "--k8s", "--image", "img:1", "--namespace", "a\nkind: Pod", "-o", out)
    assert rc == 2 and "--namespace" in err and not out.exists()
    bad = tmp_path / "evil.yaml"
    src = (Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml").read_text()
    bad.write_text(src.replace("name: tiny-cpu", 'name: "x\\nkind: Pod"'))
    rc, _, err = cli("launch", str(bad), "--slurm", "-o", out)
    assert rc == 2 and "name" in err and not out.exists()


def test_env_reference_is_resolved_at_run_time_and_never_written(cli, tmp_path):
    rc, text, err = cli("launch", "tiny-cpu", "--slurm", "env.WANDB_API_KEY=${env:WANDB_API_KEY}")
    assert rc == 0, err
    assert 'export WANDB_API_KEY="${WANDB_API_KEY}"' in text
    rc, _, err = cli("launch", "tiny-cpu", "--slurm", "env.WANDB_API_KEY=abc123secret")
    assert rc == 2 and "abc123secret" not in err and "${env:WANDB_API_KEY}" in err
    spec = resolve("proxy-8gpu", ["env.WANDB_API_KEY=${env:WANDB_API_KEY}"], image="img:1")
    docs = list(yaml.safe_load_all(k8s.render(spec)))
    env = docs[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": k8s.ENV_SECRET, "key": "WANDB_API_KEY"}}} \
        in env

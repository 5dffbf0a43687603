"""`muse-stack launch tiny-cpu --slurm --submit` on a real one-node Slurm (slurmctld, slurmd and
munge from Debian's packages on localhost): two tasks train one run directory together.

Skips, saying why, where Slurm cannot run (not root, no package manager, daemons that do not start).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from debian_packages import apt_get

ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol")
#: seconds a job credential lives, and so how long a requeued job waits before it may start again
#: (slurm.conf: AuthInfo cred_expire; default 120, least 5): Slurm's own test suite sets 30 for a
#: quicker requeue, ample for a launch on localhost
CRED_EXPIRE = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _install() -> str | None:
    """Install slurm-wlm and munge when missing; returns why not, or None."""
    if all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS):
        return None
    if os.geteuid() != 0:
        return "Slurm is not installed and installing it needs root"
    if not shutil.which("apt-get"):
        return "Slurm is not installed and there is no apt-get"
    for args in (["update", "-qq"], ["install", "-y", "-qq", "slurm-wlm", "munge"]):
        proc = apt_get(*args)
        if proc.returncode != 0:
            return f"`apt-get {' '.join(args)}` failed: {proc.stderr.strip()[-300:]}"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _wait(pred, seconds: float, step: float = 0.25) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(step)
    return False


@pytest.fixture(scope="session")
def slurm_cluster():
    """A one-node Slurm on localhost with private state under /tmp; stopped afterwards."""
    why = _install()
    if why:
        pytest.skip(why)
    state = Path(tempfile.mkdtemp(prefix="muse-slurm-", dir="/tmp"))
    procs: list[subprocess.Popen] = []
    host = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    mem_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.9)
    for d in ("ctld", "spool", "munge"):
        (state / d).mkdir()
    os.chmod(state / "munge", 0o700)
    key = state / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    sock = state / "munge" / "munge.socket"
    conf = state / "slurm.conf"
    conf.write_text(f"""ClusterName=musetest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock},cred_expire={CRED_EXPIRE}
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={state / 'ctld'}
SlurmdSpoolDir={state / 'spool'}
SlurmctldPidFile={state / 'slurmctld.pid'}
SlurmdPidFile={state / 'slurmd.pid'}
SlurmctldLogFile={state / 'slurmctld.log'}
SlurmdLogFile={state / 'slurmd.log'}
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=10
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    try:
        munged = subprocess.run([_which("munged"), "--force", f"--socket={sock}", f"--key-file={key}",
                                 f"--pid-file={state / 'munge' / 'munged.pid'}",
                                 f"--log-file={state / 'munge' / 'munged.log'}",
                                 f"--seed-file={state / 'munge' / 'munged.seed'}"],
                                capture_output=True, text=True, timeout=30)
        if munged.returncode != 0:
            pytest.skip(f"munged does not start here: {munged.stderr.strip()}")
        for daemon in ("slurmctld", "slurmd"):
            procs.append(subprocess.Popen([_which(daemon), "-D", "-f", str(conf)], env=env,
                                          stdout=subprocess.DEVNULL, stderr=open(state / f"{daemon}.err", "w")))
        ok = _wait(lambda: "State=IDLE" in subprocess.run([_which("scontrol"), "show", "node", host], env=env,
                                                          capture_output=True, text=True).stdout, 30)
        if not ok:
            logs = "".join((state / f).read_text()[-600:] for f in ("slurmctld.log", "slurmd.log", "slurmd.err")
                           if (state / f).exists())
            pytest.skip(f"slurmd did not come up idle within 30 s: {logs}")
        yield {"env": env, "state": state, "host": host}
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        pid_file = state / "munge" / "munged.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), 15)
            except (ProcessLookupError, ValueError):
                pass
        shutil.rmtree(state, ignore_errors=True)


def _job_state(env: dict, job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    for field in out.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return "UNKNOWN"


def test_slurm_submit_two_tasks_one_run_directory(slurm_cluster, tmp_path):
    env = {**slurm_cluster["env"], "PYTHONUNBUFFERED": "1"}
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "muse_stack.cli", "launch", "tiny-cpu", "--slurm", "--submit", "--gpus", "2",
           "--nodes", "1", "--steps", "6", "--time", "00:10:00", "--runs-dir", str(runs), "--run-name", "tiny-slurm",
           "-o", str(tmp_path / "tiny.sbatch"), "training.measure_warmup_steps=2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().splitlines()[-1]
    assert job.isdigit(), proc.stdout
    script = (tmp_path / "tiny.sbatch").read_text()
    assert "#SBATCH --nodes=1\n" in script and "#SBATCH --ntasks-per-node=2\n" in script
    assert "--container-image" not in script

    finished = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
    assert _wait(lambda: _job_state(env, job) in finished, 100, 0.5), f"job {job}: {_job_state(env, job)}"
    out_file = tmp_path / f"muse-tiny-cpu-{job}.out"
    log = out_file.read_text() if out_file.exists() else "(no job output)"
    assert _job_state(env, job) == "COMPLETED", log

    run = runs / "tiny-slurm"
    assert f"run directory: {run}" in log
    assert sorted(p.name for p in (run / "fingerprints").iterdir()) == ["rank-0.json", "rank-1.json"]
    fp = json.loads((run / "fingerprint.json").read_text())
    assert fp["ranks"]["count"] == 2 and fp["ranks"]["agree"] is True, fp["ranks"]
    ranks = [json.loads((run / "fingerprints" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["run_inputs"] == ranks[1]["run_inputs"]
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "completed" and results["world_size"] == 2 and results["steps_completed"] == 6
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["tokens"] > 0 and r["loss"] > 0 for r in rows)


def test_sigkill_then_requeue_or_resubmit_completes_the_run_with_every_step_once(slurm_cluster, tmp_path):
    """The job is SIGKILLed mid-run (batch shell and every process, as a node crash or an OOM kill
    leaves it) and requeued; the requeued attempt is SIGKILLed too, and a new `launch` under the same
    --run-name is submitted: each attempt runs `run --resume auto` into the one run directory and
    continues from its latest checkpoint, and metrics.jsonl ends with every step exactly once."""
    env = {**slurm_cluster["env"], "PYTHONUNBUFFERED": "1"}
    runs = tmp_path / "runs"
    steps = 60
    name = "requeue-run"

    def launch(script: Path) -> str:
        cmd = [sys.executable, "-m", "muse_stack.cli", "launch", "tiny-cpu", "--slurm", "--submit", "--gpus", "1",
               "--nodes", "1", "--steps", str(steps), "--time", "00:20:00", "--runs-dir", str(runs), "--run-name",
               name, "-o", str(script), "training.checkpoint_interval=4", "training.measure_warmup_steps=2"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        text = script.read_text()
        assert "#SBATCH --requeue\n" in text and "--resume auto" in text
        return proc.stdout.strip().splitlines()[-1]

    run = runs / name
    metrics = run / "metrics.jsonl"
    finished = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}

    def steps_done() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    def kill_after(job: str, at_least: int) -> None:
        # mid-run, after a checkpoint: the latest complete one is behind the last logged step
        assert _wait(lambda: steps_done() >= at_least and (run / "checkpoints" / "latest").exists(), 240, 0.1), \
            f"job {job}: {_job_state(env, job)}, {steps_done()} steps"
        subprocess.run(["scancel", "--full", "--signal=KILL", job], env=env, check=True, timeout=30)
        assert _wait(lambda: _job_state(env, job) in finished, 60, 0.25), _job_state(env, job)
        assert steps_done() < steps, "the run finished before the kill"

    job = launch(tmp_path / "first.sbatch")
    kill_after(job, 10)
    requeue = subprocess.run(["scontrol", "requeue", job], env=env, capture_output=True, text=True, timeout=30)
    assert requeue.returncode == 0, requeue.stderr
    kill_after(job, 30)
    log = (tmp_path / f"muse-tiny-cpu-{job}.out").read_text()
    assert "(attempt 0 of job" in log and "(attempt 1 of job" in log  # one log, both attempts
    assert log.split("(attempt 1 of job")[1].count("resumed at step ") == 1  # the requeue says it went on

    again = launch(tmp_path / "again.sbatch")  # a manual resubmit under the same run name
    assert again != job
    assert _wait(lambda: _job_state(env, again) in finished, 300, 0.5)
    assert _job_state(env, again) == "COMPLETED", (tmp_path / f"muse-tiny-cpu-{again}.out").read_text()
    assert "resumed at step " in (tmp_path / f"muse-tiny-cpu-{again}.out").read_text()
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "completed" and results["steps_completed"] == steps
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # every step once: none lost, none repeated


def test_plain_srun_one_task_per_process_trains_one_run(slurm_cluster, tmp_path):
    """docs/images.md's example without torchrun: `srun -N 1 --ntasks-per-node=2 muse-stack run`
    takes rank, world and rendezvous from Slurm's environment. The first step stops after 3 steps
    (a checkpoint, as on preemption), the same command again resumes: one run directory, world size
    2 in the fingerprint and the results, every step once, and the job's stdout says where it went
    on, once (rank 0)."""
    env = {**slurm_cluster["env"], "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    exe = Path(sys.executable).parent / "muse-stack"
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "muse_stack.cli"]
    runs = tmp_path / "runs"
    out = runs / "tiny-srun"
    args = ["run", "tiny-cpu", "--out", str(out), "--resume", "auto", "--steps", "6", "--no-progress",
            "training.measure_warmup_steps=2", "training.checkpoint_interval=3"]

    def srun(*extra: str) -> str:
        proc = subprocess.run(["srun", "-N", "1", "--ntasks-per-node=2", "--time=10",
                               *cli, *args, *extra], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == (1 if extra else 0), proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    first = srun("--stop-after", "3")
    assert "resumed at step" not in first
    assert json.loads((out / "results.json").read_text())["status"] == "interrupted"
    second = srun()
    assert second.count("resumed at step 3") == 1, second  # rank 0's line only
    assert [p.name for p in runs.iterdir()] == ["tiny-srun"]  # one run directory, no task's own
    fp = json.loads((out / "fingerprint.json").read_text())
    assert fp["ranks"]["count"] == 2 and fp["ranks"]["agree"] is True, fp["ranks"]
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "completed" and results["world_size"] == 2 and results["steps_completed"] == 6
    assert results["resumed_at_step"] == 3
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))  # every step once

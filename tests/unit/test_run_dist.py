"""Rank, world and rendezvous from the launcher's environment: torchrun's variables, else a
multi-task srun step's (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, the step's node list,
a port of the job and step ids); and Slurm's compact node list, expanded as `scontrol show
hostnames` does."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from hypothesis import given, settings, strategies as st

from muse_stack.run import dist
from muse_stack.run.dist import DistEnv, from_environment, hostnames, slurm_port
from muse_stack.util.errors import UsageError

#: one task of `srun -N 2 --ntasks-per-node=2` (the variables srun sets that are read here)
STEP = {"SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NODELIST": "gpu[07-08]"}


def test_torchrun_wins_over_slurm():
    env = from_environment({**STEP, "WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "5"})
    assert env == DistEnv(5, 8, 5, "torchrun")


def test_an_srun_task_takes_rank_world_and_rendezvous_from_slurm(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # scontrol is not found: the node list is parsed here
    env = from_environment(STEP)
    assert env == DistEnv(3, 4, 1, "slurm", "gpu07", slurm_port(4711, 0))


def test_every_task_of_a_step_agrees_on_the_rendezvous(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    envs = [from_environment({**STEP, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 2)}) for r in range(4)]
    assert [e.rank for e in envs] == [0, 1, 2, 3]
    assert {(e.master_addr, e.master_port, e.world_size) for e in envs} == {("gpu07", slurm_port(4711, 0), 4)}


def test_master_addr_and_port_set_by_hand_win(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    env = from_environment({**STEP, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29600"})
    assert (env.master_addr, env.master_port, env.launcher) == ("10.0.0.9", 29600, "slurm")


def test_a_batch_script_shell_and_a_one_task_step_are_one_process():
    # sbatch -n 2: the script's shell has SLURM_NTASKS=2 and SLURM_PROCID=0 but no step id
    batch = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")} | {"SLURM_PROCID": "0"}
    assert from_environment(batch) == DistEnv()
    assert from_environment({**STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) \
        == DistEnv()
    assert from_environment({}) == DistEnv()


def test_the_step_node_list_comes_before_the_job_one(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    env = from_environment({**STEP, "SLURM_STEP_NODELIST": "gpu[08]", "SLURM_JOB_NODELIST": "gpu[07-08]"})
    assert env.master_addr == "gpu08"
    env = from_environment({k: v for k, v in STEP.items() if k != "SLURM_STEP_NODELIST"})
    assert env.master_addr == "gpu07"


@pytest.mark.parametrize("change, field", [
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID"),
    ({"SLURM_PROCID": ""}, "SLURM_PROCID"),
    ({"SLURM_JOB_ID": ""}, "SLURM_JOB_ID"),
    ({"SLURM_STEP_NODELIST": "gpu[07-", "SLURM_JOB_NODELIST": ""}, "SLURM_STEP_NODELIST"),
    ({"SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": ""}, "SLURM_STEP_NODELIST"),
    ({"SLURM_LOCALID": "one"}, "SLURM_LOCALID"),
])
def test_a_broken_step_environment_is_refused_naming_the_variable(monkeypatch, change, field):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(UsageError) as err:
        from_environment({**STEP, **change})
    assert err.value.field == field and err.value.fix


def test_the_port_is_in_range_and_differs_for_neighbouring_jobs_and_steps():
    ports = {slurm_port(job, 0) for job in range(1_000_000, 1_000_000 + dist.PORT_SPAN)}
    assert len(ports) == dist.PORT_SPAN and min(ports) == dist.PORT_BASE
    assert max(ports) == dist.PORT_BASE + dist.PORT_SPAN - 1 < 32768  # below Linux's ephemeral ports
    assert len({slurm_port(77, step) for step in range(31)}) == 31


def test_init_exports_the_rendezvous_of_an_srun_task(monkeypatch):
    calls = {}

    class FakeDist:
        @staticmethod
        def is_available():
            return True

        @staticmethod
        def is_initialized():
            return False

        @staticmethod
        def init_process_group(**kw):
            calls.update(kw)

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        # set, then deleted: monkeypatch records each as absent, so what init exports is removed afterwards (a
        # WORLD_SIZE left in this process would make a later in-process run wait for a second rank)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(dist, "_dist", lambda: FakeDist)
    dist.init(DistEnv(1, 2, 1, "slurm", "gpu07", 23456), cuda=False)
    import os

    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], os.environ["RANK"]) == ("gpu07", "23456", "1")
    assert calls == {"backend": "gloo", "rank": 1, "world_size": 2}


# -- the compact node list -----------------------------------------------------------------

@pytest.mark.parametrize("nodelist, hosts", [
    ("vm", ["vm"]),
    ("node[01-03,7],x[8-10]", ["node01", "node02", "node03", "node7", "x8", "x9", "x10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("n[07-11]", ["n07", "n08", "n09", "n10", "n11"]),
    ("n[1-03]", ["n1", "n2", "n3"]),
    ("a,b,,c", ["a", "b", "c"]),
    ("n[2-3],n1", ["n2", "n3", "n1"]),
])
def test_known_node_lists(nodelist, hosts):
    assert list(hostnames(nodelist)) == hosts


@pytest.mark.parametrize("nodelist", ["n[1-2", "n1]", "n[3-1]", "n[a-b]", "n[[1]]", "n[]", "n[1-]"])
def test_malformed_node_lists_raise(nodelist):
    with pytest.raises(ValueError):
        next(hostnames(nodelist))


def test_the_first_host_of_a_huge_range_is_given_without_expanding_it():
    assert next(hostnames("n[0-999999999999]")) == "n0"


PREFIX = st.text("abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=6)
RANGE = st.tuples(st.integers(0, 120), st.integers(0, 15), st.integers(1, 4)).map(
    lambda t: (t[0], t[0] + t[1], t[2]))  # (low, high, digits of the low bound as written)


def _written(lo: int, hi: int, width: int) -> str:
    low = f"{lo:0{width}d}"
    return low if lo == hi else f"{low}-{hi}"


def _numbers(ranges) -> list[str]:
    return [f"{n:0{w}d}" for lo, hi, w in ranges for n in range(lo, hi + 1)]


NAME = st.tuples(PREFIX, st.lists(RANGE, min_size=1, max_size=3),
                 st.one_of(st.none(), st.tuples(PREFIX, st.lists(RANGE, min_size=1, max_size=2))))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(PREFIX.map(lambda p: (p, None, None)), NAME), min_size=1, max_size=4))
def test_the_parser_expands_what_it_is_built_from(entries):
    """Each entry is a plain name, or prefix[ranges] with an optional second dimension
    prefix2[ranges2]; the expansion is the entries in order, each the product of its brackets,
    every number with the zero padding of its range's low bound."""
    written, expected = [], []
    for prefix, ranges, second in entries:
        if ranges is None:
            written.append(prefix)
            expected.append(prefix)
            continue
        text = f"{prefix}[{','.join(_written(*r) for r in ranges)}]"
        firsts = [prefix + n for n in _numbers(ranges)]
        if second is None:
            expected += firsts
        else:
            p2, r2 = second
            text += f"{p2}[{','.join(_written(*r) for r in r2)}]"
            expected += [f + p2 + n for f in firsts for n in _numbers(r2)]
        written.append(text)
    assert list(hostnames(",".join(written))) == expected


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory):
    """`scontrol show hostnames` with a minimal slurm.conf (it reads no controller for this)."""
    exe = shutil.which("scontrol")
    if exe is None:
        pytest.skip("scontrol is not installed")
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=hosts\nSlurmctldHost=localhost\n")

    def expand(nodelist: str) -> list[str]:
        proc = subprocess.run([exe, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30,
                              env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0 and "Invalid" not in proc.stdout, proc.stdout + proc.stderr
        return proc.stdout.split()

    try:
        expand("vm")
    except AssertionError as exc:
        pytest.skip(f"scontrol does not run here: {exc}")
    return expand


@settings(max_examples=25, deadline=None)
@given(st.lists(NAME, min_size=1, max_size=3))
def test_the_parser_agrees_with_scontrol(scontrol, entries):
    text = ",".join(f"{p}[{','.join(_written(*r) for r in rs)}]"
                    + (f"{s[0]}[{','.join(_written(*r) for r in s[1])}]" if s else "") for p, rs, s in entries)
    assert list(hostnames(text)) == scontrol(text)


def test_the_head_node_is_scontrol_s_first_host_where_it_runs(scontrol, tmp_path, monkeypatch):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=hosts\nSlurmctldHost=localhost\n")
    environ = {"SLURM_STEP_NODELIST": "gpu[12-13,2]", "SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"}
    assert dist.head_node(environ) == scontrol("gpu[12-13,2]")[0] == "gpu12"

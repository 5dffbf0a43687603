"""The machine table (muse_stack/machine/machines.yaml) is the only enumeration of the machines: the
stack locks, the launch targets, the planner's GPUs and a recipe's `hardware.gpu` values all come
from it, each launched machine is priced on the fabric it is launched on, a broken table is refused
naming the field, and a changed row (a copy named by MUSE_STACK_MACHINES) changes both `plan` and
`launch`. CPU only."""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from muse_stack.launch import slurm
from muse_stack.launch.spec import resolve
from muse_stack.launch.targets import FABRIC_ENV, FABRICS, target_for, targets
from muse_stack.machine import table as machine_table
from muse_stack.machine.hardware import gpu_spec, gpus
from muse_stack.machine.table import DEFAULT_PATH, ENV, Transport, load, machine_names, table
from muse_stack.plan.planner import make_plan
from muse_stack.recipes.catalogue import load_recipe
from muse_stack.recipes.schema import GpuType, Hardware
from muse_stack.stack.lock import LockError, locks_dir
from muse_stack.stack.lock import load as load_lock
from muse_stack.util.errors import InputError, LayoutError

ROOT = Path(__file__).resolve().parents[2]


def _rows() -> dict:
    return yaml.safe_load(DEFAULT_PATH.read_text())


def _write(tmp_path: Path, data: dict, name: str = "machines.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ---- the one enumeration -------------------------------------------------------------------

def test_every_lock_has_a_row_and_every_row_lock_a_file():
    files = sorted(p.stem for p in locks_dir().glob("*.toml") if not p.stem.startswith("pylock."))
    assert files == sorted(table().locks())
    for lock, machine in table().locks().items():
        loaded = load_lock(lock)  # checked against its row: platform and arch
        assert loaded.lock.platform == table().machine(machine).platform
        assert (locks_dir() / f"pylock.{lock}.toml").exists()


def test_launch_targets_are_the_rows_with_a_launch_section():
    rows = table().machines
    assert list(targets()) == [n for n, m in rows.items() if m.launch is not None]
    for name, target in targets().items():
        m = rows[name]
        assert (target.gpu, target.lock, target.gpus_per_node) == (name, m.lock, m.gpus_per_node)
        # the fabric the launcher sets up by default is the one the planner prices
        spec = gpu_spec(name)
        assert target.fabric == (spec.inter.transport if spec is not None else None)
    planned_only = [n for n, m in rows.items() if m.launch is None]
    for name in planned_only:
        with pytest.raises(LayoutError) as exc:
            target_for(name)
        assert exc.value.field == "hardware.gpu"


def test_planner_gpus_and_recipe_values_are_the_rows():
    assert typing.get_args(GpuType) == machine_names() == tuple(_rows()["machines"])
    assert list(gpus()) == [n for n, m in table().machines.items() if m.gpu is not None]
    for name in machine_names():
        assert Hardware(gpu=name, count=1, per_node=1).gpu == name
    with pytest.raises(ValidationError):
        Hardware(gpu="Z100", count=1, per_node=1)


def test_every_transport_a_fabric_names_has_its_nccl_settings():
    assert set(FABRIC_ENV) == set(FABRICS) == set(typing.get_args(Transport))
    assert {f.transport for f in table().fabrics.values() if f.transport} <= set(FABRICS)


# ---- the table's rules ---------------------------------------------------------------------

@pytest.mark.parametrize("edit, field", [
    # a fabric whose line rate is not the GPU's datasheet figure
    (lambda d: d["machines"]["H200"]["fabrics"].__setitem__("inter", "efa-p6e-gb200") or
     d["machines"]["H200"]["gpu"].__setitem__("scaleout_gbps", 25.0), "machines.H200.fabrics.inter"),
    (lambda d: d["machines"]["B200"]["fabrics"].__setitem__("inter", "ib-dr"), "machines.B200.fabrics.inter"),
    (lambda d: d["machines"]["B200"]["fabrics"].__setitem__("inter", "nvlink5"), "machines.B200.fabrics.inter"),
    # the launcher's EFA interfaces must be the fabric's NICs
    (lambda d: d["machines"]["H200"]["launch"].__setitem__("efa_devices", 8), "machines.H200.launch.efa_devices"),
    (lambda d: d["machines"]["H100"].__setitem__("launch", {"note": "x"}), "machines.H100"),
    (lambda d: d["machines"]["GB200"]["gpu"].__setitem__("arch", "blackwell"), "machines.GB200.gpu.arch"),
    (lambda d: d["machines"]["cpu"].__setitem__("lock", "b200"), "machines.cpu.lock"),
])
def test_a_broken_table_is_refused_naming_the_field(tmp_path, edit, field):
    data = _rows()
    edit(data)
    with pytest.raises(InputError) as exc:
        load(_write(tmp_path, data))
    assert exc.value.field == field, exc.value


def test_a_lock_must_build_for_its_machine(tmp_path):
    text = (locks_dir() / "gb200.toml").read_text()
    wrong = tmp_path / "gb200.toml"
    wrong.write_text(text.replace('platform = "linux/arm64"', 'platform = "linux/amd64"'))
    with pytest.raises(LockError) as exc:
        load_lock(wrong)
    assert exc.value.field == "platform" and "linux/arm64" in exc.value.fix
    wrong.write_text(text.replace('cuda_archs = ["10.0"]', 'cuda_archs = ["9.0"]', 1))
    with pytest.raises(LockError) as exc:
        load_lock(wrong)
    assert exc.value.field == "components.transformer_engine.cuda_archs" and '"10.0"' in exc.value.fix


# ---- one row, both consumers ---------------------------------------------------------------

def test_a_changed_row_changes_both_plan_and_launch(tmp_path, monkeypatch):
    """GB200 on InfiniBand instead of EFA, in a copy of the table: the planner prices the PP
    send/receive of sft-192 (PP 6 over 48 trays, beyond the 72-GPU domain) at InfiniBand's figures
    and the launcher sets up NCCL's IB transport, without a flag."""
    shipped, _ = make_plan(load_recipe("sft-192"), strict=False)
    assert "export NCCL_NET_PLUGIN=ofi" in slurm.render(resolve("sft-192"))
    data = _rows()
    data["machines"]["GB200"]["fabrics"]["inter"] = "ib-ndr"
    monkeypatch.setenv(ENV, str(_write(tmp_path, data)))
    ib = table().fabric("ib-ndr")
    assert target_for("GB200").fabric == "ib" and gpu_spec("GB200").inter == ib

    plan, _ = make_plan(load_recipe("sft-192"), strict=False)
    p2p = {c.term: c for c in plan.time.communication}["pp_p2p"]
    assert [f.name for f in p2p.fabrics] == [ib.name]
    # two sends per micro-batch and stage (activations, gradients) of the fp32 pipeline tensor
    per_send = ib.latency_s + p2p.bytes_per_collective / (ib.gbps * 1e9 * plan.time.calibration.link_efficiency)
    # the same few float64 products in another order: rounding ~1e-15; 1e-12 still fails on any wrong
    # figure (EFA's 50 GB/s against InfiniBand's 48 is 4%)
    assert plan.time.terms_s["pp_p2p"] == pytest.approx(2 * plan.time.microbatches * per_send, rel=1e-12)
    assert plan.time.terms_s["pp_p2p"] != shipped.time.terms_s["pp_p2p"]

    text = slurm.render(resolve("sft-192"))
    assert "export NCCL_NET=IB\n" in text and "NCCL_NET_PLUGIN" not in text
    monkeypatch.delenv(ENV)
    assert target_for("GB200").fabric == "efa"


def _pod_env(spec) -> dict[str, str]:
    from muse_stack.launch import k8s

    pod = k8s.manifests(spec)[-1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    return {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}


def test_only_a_machine_whose_fabric_is_efa_asks_nccl_for_the_efa_plugin(tmp_path, monkeypatch):
    """The images do not load aws-ofi-nccl by themselves (on an InfiniBand host it slows NCCL down):
    the launcher asks for it, on Slurm and on Kubernetes, exactly where the machine's fabric is EFA."""
    image = "registry.example.com/muse-stack:gb200-0.1.0"
    assert _pod_env(resolve("sft-192", image=image, kubernetes=True))["NCCL_NET_PLUGIN"] == "ofi"
    assert "export NCCL_NET_PLUGIN=ofi\n" in slurm.render(resolve("sft-192"))
    data = _rows()
    data["machines"]["GB200"]["fabrics"]["inter"] = "ib-ndr"
    monkeypatch.setenv(ENV, str(_write(tmp_path, data)))
    env = _pod_env(resolve("sft-192", image=image, kubernetes=True))
    assert "NCCL_NET_PLUGIN" not in env and env["NCCL_NET"] == "IB"
    assert "NCCL_NET_PLUGIN" not in slurm.render(resolve("sft-192"))


def test_a_missing_or_broken_table_is_an_input_error_of_the_cli(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "none.yaml"))
    with pytest.raises(InputError) as exc:
        machine_table.table()
    assert exc.value.field == ENV and exc.value.exit_code == 3
    # the table is read as the command areas load: the CLI reports it as an error, not a traceback
    data = _rows()
    data["machines"]["B200"]["gpu"]["nvlink_gbps"] = 450.0
    env = {**os.environ, ENV: str(_write(tmp_path, data)), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", "import sys; from muse_stack.cli import main; sys.exit(main())",
                          "plan", "attune-b200"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 3 and "machines.B200.fabrics.intra" in out.stderr and "Traceback" not in out.stderr

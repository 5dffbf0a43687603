"""The first error of `muse-stack run` on a machine that cannot run the recipe names the engine
and the device it needs, with the fix, before any process-count or layout message."""

from __future__ import annotations

import pytest

import muse_stack.engines.megatron_available as megatron_available
import muse_stack.run.availability as availability
from muse_stack.cli import main

OPT = ["optimizer.lr=1e-5", "optimizer.min_lr=1e-6", "optimizer.decay_style=cosine", "optimizer.warmup_steps=5",
       "optimizer.weight_decay=0.1", "optimizer.clip_grad=1.0", "optimizer.beta1=0.9", "optimizer.beta2=0.95",
       "optimizer.eps=1e-8"]


@pytest.fixture
def no_gpu(monkeypatch):
    # this machine as a CPU-only one, whatever it really has
    monkeypatch.setattr(megatron_available, "missing", lambda: "CUDA is not available on this machine")
    monkeypatch.setattr(availability, "_cuda_devices", lambda: 0)


@pytest.mark.parametrize("extra", [[], ["--gpus", "1"], ["--gpus", "8"]])
def test_gpu_recipe_on_a_cpu_machine_names_engine_and_devices(no_gpu, capsys, tmp_path, monkeypatch, extra):
    monkeypatch.chdir(tmp_path)
    rc = main(["run", "sft-192", *OPT, *extra])
    err = capsys.readouterr().err
    assert rc == 2
    assert "192 GB200 GPUs" in err and "megatron-core engine" in err and "CUDA" in err
    assert "muse-stack launch sft-192 --slurm" in err and "make image gpu=gb200" in err
    assert "processes launched" not in err and "divide" not in err  # not the process count, not the layout
    assert not (tmp_path / "runs").exists()  # nothing written


def test_one_node_gpu_recipe_points_at_docker_run(no_gpu, capsys):
    rc = main(["run", "proxy-1gpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "docker run --gpus all" in err and "muse-stack:" in err and "CUDA" in err


def test_reference_engine_on_gpu_hardware_without_cuda_names_the_device(no_gpu, capsys):
    rc = main(["run", "tiny-cpu", "hardware.gpu=H200", "hardware.per_node=8"])
    err = capsys.readouterr().err
    assert rc == 2 and "no CUDA device" in err and "H200" in err


def test_cpu_reference_recipe_passes_the_check(no_gpu):
    from muse_stack.recipes.catalogue import load_recipe

    availability.check_runnable_here(load_recipe("tiny-cpu"), "tiny-cpu")  # no error

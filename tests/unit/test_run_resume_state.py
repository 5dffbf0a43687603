"""What a checkpoint must carry and what a resume must find: every random generator and the data
position, the pretrained base of an adapter run, no staging left by a killed save, and a full
disk reported as the checkpoint error it is."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from muse_stack.run import checkpoints
from muse_stack.run.pipeline import run

QUICK = ["training.measure_warmup_steps=1", "batch.gbs=2"]  # two rows a step: quick
#: adapters with dropout on every dense projection and the experts: a resume that draws other
#: dropout masks than the uninterrupted run gives other losses from its first step on
DROPOUT = ["peft.scheme=lora", "peft.rank=4", "peft.alpha=8", "peft.dropout=0.25", "peft.per_expert=false",
           "peft.targets=[self_attn.q_proj,self_attn.v_proj,mlp.experts.gate_up_proj]"]


@pytest.fixture
def one_thread_env(monkeypatch, one_thread):
    """One thread: every reduction order fixed, so two runs agree bit for bit on this machine."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def metric_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def same_training(a: Path, b: Path) -> None:
    """Loss and gradient norm of every step equal as floats (bitwise: no tolerance)."""
    ra, rb = metric_rows(a), metric_rows(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    assert [(r["loss"], r["grad_norm"]) for r in ra] == [(r["loss"], r["grad_norm"]) for r in rb]


# ---- 2. randomness and data position -----------------------------------------------------------
@pytest.mark.slow
def test_resume_with_adapter_dropout_is_bitwise_the_uninterrupted_run(tmp_path, one_thread_env):
    """With dropout the masks of every step after the resume come from the restored generators;
    anything the run does between loading and training (it measures the CPU's peak with random
    matrices) must not move them."""
    common = dict(steps=6, progress=False, overrides=[*QUICK, *DROPOUT, "training.checkpoint_interval=null"])
    full = run("tiny-cpu", out=tmp_path / "full", **common)
    part = run("tiny-cpu", out=tmp_path / "part", stop_after=3, **common)
    assert part.status == "interrupted" and part.results["checkpoint"]["step"] == 3
    done = run(resume=part.path, progress=False)
    assert done.status == "completed" and done.results["resumed_at_step"] == 3
    same_training(done.path, full.path)


def _steps(tmp_path: Path, overrides: list[str]):
    """The reference engine and the run's steps around it (LR, data, random state), as the trainer
    builds them."""
    from muse_stack.data import build_for_recipe
    from muse_stack.engines.base import TrainContext
    from muse_stack.resolve.recipe import finalize
    from muse_stack.engines.reference import ReferenceEngine
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.run.steps import TrainSteps

    recipe = load_recipe("tiny-cpu", [*QUICK, *overrides])
    data = build_for_recipe(recipe, progress=False)
    resolved = finalize(recipe)
    engine = ReferenceEngine(TrainContext(recipe=recipe, model=resolved.model, resolved=resolved))
    return TrainSteps(engine, recipe, data, 10)


def _manager(run_dir: Path, steps) -> checkpoints.CheckpointManager:
    return checkpoints.CheckpointManager(run_dir, steps.engine, interval=None, keep=None, states=steps.states())


def _save(steps, run_dir: Path, step: int) -> Path:
    """A checkpoint of the engine and the run's state at ``step``, as the trainer saves it."""
    _manager(run_dir, steps).save(step, {})
    return checkpoints.latest(run_dir).path


def _load(steps, run_dir: Path) -> int:
    return _manager(run_dir, steps).load(steps.total_steps)


def _draws() -> tuple:
    return random.random(), float(np.random.random()), float(torch.rand(()))


def test_generators_continue_across_a_resume(tmp_path, one_thread_env):
    """Whatever a step draws from (Python's random, NumPy's global generator, torch's) continues
    after a resume as it would have without one, set again just before the first resumed step."""
    steps = _steps(tmp_path, [])
    steps.step(1)
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    _save(steps, tmp_path / "run", 1)
    steps.step(2)
    expected = _draws()  # what the uninterrupted process draws after step 2
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    again = _steps(tmp_path, [])
    assert _load(again, tmp_path / "run") == 1
    _draws()  # whatever the process draws between loading and its first step does not count
    again.step(2)
    assert _draws() == expected


def test_resume_positions_the_data_without_producing_the_batches_before_it(tmp_path, monkeypatch, one_thread_env):
    """The checkpoint holds where the data stands; a resume starts there instead of producing (and
    throwing away) step x micro-batches batches, and the next batch is the uninterrupted run's."""
    from muse_stack.data import batches

    steps = _steps(tmp_path, ["batch.gbs=4"])  # two micro-batches a step
    for step in (1, 2, 3):
        steps.step(step)
    folder = _save(steps, tmp_path / "run", 3)
    expected = steps.data.next_step()[0]["input_ids"]
    again = _steps(tmp_path, ["batch.gbs=4"])
    made = []
    real = batches.collate
    monkeypatch.setattr(batches, "collate", lambda rows, index: made.append(1) or real(rows, index))
    assert _load(again, tmp_path / "run") == 3
    assert made == []  # nothing replayed
    assert torch.equal(again.data.next_step()[0]["input_ids"], expected)
    state = torch.load(checkpoints.rank_file(folder, 0), weights_only=True)
    assert state["data"]["row"] == 3 * 4 and state["data"]["epoch"] == 0


def test_a_data_position_of_other_rows_is_refused(tmp_path, one_thread_env):
    from muse_stack.util.errors import InputError

    steps = _steps(tmp_path, [])
    steps.step(1)
    stream = steps.data.stream
    with pytest.raises(InputError, match="data position") as err:
        stream.seek({**stream.position(), "rows": stream.rows.num_rows + 1})
    assert err.value.field == "training.data_seed"


def test_the_stream_position_crosses_epochs_and_data_parallel_sizes(tmp_path):
    """A position is the rows consumed in an epoch's order by all ranks together, so a stream of
    another data-parallel size continues at the same rows; past an epoch's last whole step the
    next epoch starts."""
    from muse_stack.data.batches import BatchStream
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.data import build_for_recipe

    rows = build_for_recipe(load_recipe("tiny-cpu", QUICK), progress=False).rows()
    one = BatchStream(rows, 2, seed=5, epochs=None)
    steps = one.steps
    for _ in range(steps + 1):
        next(one)
    assert one.position() == {"epoch": 1, "row": 2, "seed": 5, "rows": rows.num_rows}
    following = next(one)["input_ids"]
    two = [BatchStream(rows, 1, seed=5, rank=r, world_size=2, epochs=None) for r in (0, 1)]
    for s in two:
        s.seek(one.position() | {"row": 2})
    assert torch.equal(torch.cat([next(s)["input_ids"] for s in two]), following)


# ---- 1. an adapter run from a pretrained base resumes --------------------------------------------
@pytest.mark.slow
def test_an_adapter_run_from_a_pretrained_checkpoint_resumes_on_the_same_base(tmp_path, one_thread_env):
    base = run("tiny-cpu", out=tmp_path / "base", steps=2, progress=False, overrides=QUICK)
    start = str(checkpoints.latest(base.path).path)
    common = dict(steps=5, progress=False, overrides=[*QUICK, *DROPOUT], pretrained_checkpoint=start)
    full = run("tiny-cpu", out=tmp_path / "full", **common)
    part = run("tiny-cpu", out=tmp_path / "part", stop_after=2, **common)
    done = run(resume=part.path, progress=False)
    assert done.status == "completed"
    same_training(done.path, full.path)


@pytest.mark.slow
def test_an_adapter_resume_refuses_a_base_that_changed(tmp_path, one_thread_env):
    """The base is rebuilt from the checkpoint the run recorded and checked against the hash of
    its tensors taken at the start: other weights at that path are refused, naming the field."""
    from muse_stack.util.errors import InputError

    base = run("tiny-cpu", out=tmp_path / "base", steps=3, progress=False, overrides=QUICK)
    start = tmp_path / "start"
    shutil.copytree(checkpoints.step_folders(base.path)[-1].path, start)
    part = run("tiny-cpu", out=tmp_path / "part", steps=5, stop_after=2, progress=False,
               overrides=[*QUICK, *DROPOUT], pretrained_checkpoint=str(start))
    other = run("tiny-cpu", out=tmp_path / "other", steps=1, progress=False, overrides=QUICK)
    shutil.rmtree(start)
    shutil.copytree(checkpoints.latest(other.path).path, start)  # other weights at the recorded path
    with pytest.raises(InputError, match="another base model") as err:
        run(resume=part.path, progress=False)
    assert err.value.field == "adapters.base"


# ---- 3. staging left by a killed save ------------------------------------------------------------
def test_staging_left_by_a_killed_save_is_removed_at_resume_and_never_read(tmp_path, one_thread_env):
    part = run("tiny-cpu", out=tmp_path / "part", steps=4, stop_after=2, progress=False, overrides=QUICK)
    root = part.path / "checkpoints"
    # what a SIGKILL inside save_checkpoint / the pointer write leaves: a staged copy of the
    # weights beside step-N.partial, the folder it was replacing, and a staged pointer
    staged = root / ".step-00000003.partial.k2j3h4.tmp"
    shutil.copytree(root / "step-00000002", staged)
    (root / ".step-00000003.partial.old-1a2b3c4d").mkdir()
    (root / ".latest.x8y9.tmp").write_text('{"step": 3, "folder": "step-00000003"}\n')
    assert [c.step for c in checkpoints.step_folders(part.path)] == [2]  # never taken for a step folder
    assert checkpoints.latest(part.path).step == 2
    done = run(resume=part.path, progress=False)
    assert done.status == "completed"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []


def test_a_save_removes_staging_a_killed_save_left(tmp_path):
    class Engine:
        def save(self, directory, step):
            (Path(directory) / "w").write_text("x")

    manager = checkpoints.CheckpointManager(tmp_path / "run", Engine(), interval=1, keep=2)
    manager.root.mkdir(parents=True)
    (manager.root / ".step-00000001.partial.abc.tmp").mkdir()
    (manager.root / "notes.txt").write_text("mine")  # not a staging entry: kept
    manager.save(1, {})
    assert sorted(p.name for p in manager.root.iterdir()) == ["latest", "notes.txt", "step-00000001"]


# ---- 4. a full disk ------------------------------------------------------------------------------
def _disk_full(monkeypatch, after_save: bool) -> None:
    """From the first checkpoint save on (or from step 2's metrics line), every write fails with
    ENOSPC, as on a file system that filled up."""
    from muse_stack.util import atomic
    from muse_stack.models.muse_spark import checkpoint

    full = {"on": False}

    def enospc(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_bytes, real_line, real_save = atomic.write_bytes, atomic.append_line, checkpoint.save_file

    def write_bytes(*a, **k):
        return enospc() if full["on"] else real_bytes(*a, **k)

    def append_line(path, line):
        if not after_save and json.loads(line).get("step") == 2:
            full["on"] = True
        return enospc() if full["on"] else real_line(path, line)

    def save_file(*a, **k):
        full["on"] = True
        return enospc()

    monkeypatch.setattr(atomic, "write_bytes", write_bytes)
    monkeypatch.setattr(atomic, "append_line", append_line)
    if after_save:
        monkeypatch.setattr(checkpoint, "save_file", save_file)


@pytest.mark.parametrize("when", ["checkpoint", "metrics"])
def test_a_full_disk_mid_run_is_the_checkpoint_error_naming_the_free_space(tmp_path, cli, monkeypatch, when,
                                                                          one_thread_env):
    """The results and plots written after the failure fail too on a full disk; that must not
    turn the designed error into an internal one (exit 70)."""
    _disk_full(monkeypatch, after_save=when == "checkpoint")
    rc, out, err = cli("run", "tiny-cpu", "--steps", "4", "--out", tmp_path / "r", "--no-progress", *QUICK,
                       "training.checkpoint_interval=1")
    said = " ".join((out + err).split())
    assert rc == checkpoints.CheckpointError.exit_code, said
    assert "internal error" not in said
    assert "No space left on device" in said and " free on " in said
    assert f"muse-stack run --resume {tmp_path / 'r'}" in said


# ---- the per-rank state files of the megatron engine (its helpers run on the CPU) ------------------
def test_a_ranks_state_file_round_trips_and_a_damaged_one_is_a_clear_error(tmp_path):
    from muse_stack.run import rng
    from muse_stack.util.errors import InputError

    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    saved = {"rng": rng.capture_rng("cpu", extra={"mcore_tracker": {"model-parallel-rng": torch.get_rng_state()}}),
             "data": {"epoch": 0, "row": 16, "seed": 1, "rows": 100}}
    checkpoints.save_rank_state(tmp_path, 1, saved)
    expected = _draws()
    assert checkpoints.load_rank_state(tmp_path, 0) is None  # a rank the folder has no file for
    back = checkpoints.load_rank_state(tmp_path, 1)
    assert back["data"] == saved["data"] and torch.equal(back["rng"]["mcore_tracker"]["model-parallel-rng"],
                                                         saved["rng"]["mcore_tracker"]["model-parallel-rng"])
    rng.restore_rng(back["rng"], "cpu")
    assert _draws() == expected
    checkpoints.rank_file(tmp_path, 2).write_bytes(b"not a torch file")
    with pytest.raises(InputError, match=r"random state and data position \(rng/rank-00002\.pt\)") as err:
        checkpoints.load_rank_state(tmp_path, 2)
    assert err.value.field == "--resume"


def _as_written_before(folder: Path, legacy: dict) -> None:
    """The run's state moved into the reference engine's optimizer.pt, where checkpoints kept it
    before each rank wrote its own file."""
    state = torch.load(folder / "optimizer.pt", weights_only=True)
    torch.save({"optimizer": state["optimizer"], **legacy}, folder / "optimizer.pt")
    shutil.rmtree(folder / checkpoints.RANK_DIR)


def test_a_checkpoint_written_before_still_resumes(tmp_path, one_thread_env):
    """optimizer.pt of earlier checkpoints holds torch's CPU state alone and no data position: the
    resume sets that state and skips the micro-batches the finished steps consumed, as before."""
    steps = _steps(tmp_path, ["batch.gbs=4"])
    for step in (1, 2):
        steps.step(step)
    folder = _save(steps, tmp_path / "run", 2)
    saved = checkpoints.load_rank_state(folder, 0)
    _as_written_before(folder, {"rng": saved["rng"]["torch_cpu"]})
    expected = steps.data.next_step()[0]["input_ids"]
    again = _steps(tmp_path, ["batch.gbs=4"])
    assert _load(again, tmp_path / "run") == 2
    assert torch.equal(again.data.next_step()[0]["input_ids"], expected)
    assert torch.equal(torch.get_rng_state(), saved["rng"]["torch_cpu"])


def test_a_checkpoint_with_its_state_in_optimizer_pt_resumes_bitwise(tmp_path, one_thread_env):
    """Checkpoints of the reference engine written before ``rng/`` held every rank's random state
    (a list) and the data position in optimizer.pt: a run resumed from one draws the same dropout
    masks and rows as the uninterrupted run."""
    common = dict(steps=6, progress=False, overrides=[*QUICK, *DROPOUT, "training.checkpoint_interval=null"])
    full = run("tiny-cpu", out=tmp_path / "full", **common)
    part = run("tiny-cpu", out=tmp_path / "part", stop_after=3, **common)
    folder = checkpoints.latest(part.path).path
    saved = checkpoints.load_rank_state(folder, 0)
    _as_written_before(folder, {"rng": [saved["rng"]], "data": saved["data"]})
    done = run(resume=part.path, progress=False)
    assert done.status == "completed" and done.results["resumed_at_step"] == 3
    same_training(done.path, full.path)


def test_a_rank_the_checkpoint_has_no_file_for_takes_rank_0s_data_position(tmp_path, caplog, one_thread_env):
    """A run continued on more processes: a rank the checkpoint has no state file for keeps its
    seeded generators and continues the data where rank 0's file says it stands (not where
    skipping the finished steps would put it, as for a checkpoint that holds no position)."""
    steps = _steps(tmp_path, ["batch.gbs=4"])
    for step in (1, 2):
        steps.step(step)
    folder = _save(steps, tmp_path / "run", 2)
    steps.step(3)
    saved = checkpoints.load_rank_state(folder, 0)
    checkpoints.save_rank_state(folder, 0, {**saved, "data": steps.data.state_dict()})  # a position after step 3
    expected = steps.data.next_step()[0]["input_ids"]
    again = _steps(tmp_path, ["batch.gbs=4"])
    manager = checkpoints.CheckpointManager(tmp_path / "run", again.engine, interval=None, keep=None, rank=1,
                                            states=again.states())
    with caplog.at_level("WARNING", logger="muse_stack.run"):
        assert manager.load(again.total_steps) == 2
    assert "rank 1 has no saved random state" in caplog.text
    assert again.rng._pending is None
    assert torch.equal(again.data.next_step()[0]["input_ids"], expected)


def test_a_position_between_micro_steps_continues_at_the_next_one(tmp_path, caplog):
    """After a change of the micro-batch (--allow-change) the saved rows may fall inside a new
    micro-step: the stream starts at the next one and says which rows it leaves out."""
    from muse_stack.data import build_for_recipe
    from muse_stack.data.batches import BatchStream

    rows = build_for_recipe(load_recipe_quick(), progress=False).rows()
    stream = BatchStream(rows, 2, seed=5, epochs=None)
    with caplog.at_level("WARNING", logger="muse_stack.run"):
        stream.seek({"epoch": 0, "row": 3, "seed": 5, "rows": rows.num_rows})
    assert stream.position()["row"] == 4 and "rows 3-3" in caplog.text


def load_recipe_quick():
    from muse_stack.recipes.catalogue import load_recipe

    return load_recipe("tiny-cpu", QUICK)


@pytest.mark.slow
def test_an_adapter_resume_names_a_missing_base_and_takes_its_new_place(tmp_path, cli, one_thread_env):
    base = run("tiny-cpu", out=tmp_path / "base", steps=2, progress=False, overrides=QUICK)
    start = tmp_path / "start"
    shutil.copytree(checkpoints.latest(base.path).path, start)
    part = run("tiny-cpu", out=tmp_path / "part", steps=4, stop_after=2, progress=False,
               overrides=[*QUICK, *DROPOUT], pretrained_checkpoint=str(start))
    start.rename(tmp_path / "moved")
    rc, _, err = cli("run", "--resume", part.path, "--no-progress")
    said = " ".join(err.split())
    assert rc == 3 and "model.pretrained_checkpoint" in said and "hold only the adapters" in said, said
    rc, _, err = cli("run", "--resume", part.path, "--no-progress", "--pretrained-checkpoint", tmp_path / "moved",
                     "--allow-change")
    assert rc == 0, err


# ---- the next step's batches made ahead ------------------------------------------------------------
def _train_data(prefetch: bool, gbs: int = 4):
    from muse_stack.data import build_for_recipe
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.run.steps import TrainData

    recipe = load_recipe("tiny-cpu", [*QUICK, f"batch.gbs={gbs}"])
    data = build_for_recipe(recipe, progress=False)
    return TrainData(data, recipe, rank=0, world_size=1, micro_batches=gbs // recipe.batch.mbs, prefetch=prefetch)


def _ids(step: list[dict]) -> list[torch.Tensor]:
    return [mb["input_ids"] for mb in step]


def test_batches_made_ahead_are_the_streams_and_the_position_is_of_those_handed_out():
    """Made ahead in a thread or on demand, the steps' micro-batches are the same, in the same order, across an
    epoch's end; the position a checkpoint records is where the handed-out ones end (not the ones made ahead), and
    a seek to it continues with the same batches; close leaves the stream there."""
    ahead, plain = _train_data(True), _train_data(False)
    steps = ahead.stream.steps // ahead.micro_batches + 2  # past the first epoch's end
    for _ in range(steps):
        assert all(torch.equal(a, b) for a, b in zip(_ids(ahead.next_step()), _ids(plain.next_step()), strict=True))
        assert ahead.state_dict() == plain.state_dict() == plain.stream.position()
    position = ahead.state_dict()
    expected = _ids(plain.next_step())
    other = _train_data(True)
    other.next_step()  # a step handed out and the next one made ahead, then a resume elsewhere
    other.load_state_dict(position)
    assert all(torch.equal(a, b) for a, b in zip(_ids(other.next_step()), expected, strict=True))
    ahead.close()
    assert ahead.stream.position() == position
    assert all(torch.equal(a, b) for a, b in zip(_ids(ahead.next_step()), expected, strict=True))


def test_an_error_making_a_step_ahead_is_raised_at_that_step(monkeypatch):
    """A batch that cannot be made (a corrupt image, say) fails the step it belongs to, as it would unprefetched;
    the step before it is handed out whole."""
    from muse_stack.data import batches

    data = _train_data(True)
    real, calls = batches.collate, []

    def failing(rows, index):
        calls.append(1)
        if len(calls) > data.micro_batches:  # the second step's batches
            raise ValueError("image 0 of the batch is corrupt")
        return real(rows, index)

    monkeypatch.setattr(batches, "collate", failing)
    assert len(data.next_step()) == data.micro_batches
    with pytest.raises(ValueError, match="corrupt"):
        data.next_step()

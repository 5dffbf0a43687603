"""The first micro-batch's main-gradient writes (muse_stack.engines.mcore.first_write) on the CPU,
with stand-ins for megatron-core's DDP and grad buffers: which ranges the step zeroes, the flags TE
reads, and the two guards. The GPU comparison with megatron-core's zeroing is
tests/gpu/test_first_write_gpu.py."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, strategies as st

from muse_stack.engines.mcore import first_write as fw
from muse_stack.util.errors import RecipeError
from muse_stack.recipes.catalogue import load_recipe


class _Buffer:
    """megatron-core's _ParamAndGradBuffer as the writes use it: one flat grad_data, each param's
    (start, end, bucket) in it, and main_grad a view."""

    def __init__(self, params, gap=3):
        self.param_index_map, at = {}, gap
        for p in params:
            self.param_index_map[p] = (at, at + p.numel(), 0)
            at += p.numel() + gap  # padding between params, as the buckets' alignment leaves
        self.grad_data = torch.zeros(at)
        self.extra_main_grads = []
        for p, (a, b, _) in self.param_index_map.items():
            p.main_grad = self.grad_data[a:b].view_as(p)
        self.resets = 0

    def reset(self):
        self.resets += 1
        self.grad_data.zero_()


class _DDP:
    def __init__(self, buffers):
        self.buffers, self.expert_parallel_buffers, self.zeroed = buffers, [], 0

    def zero_grad_buffer(self):  # megatron-core's: every buffer's reset
        self.zeroed += 1
        for b in self.buffers:
            b.reset()


def _setup():
    written = torch.nn.Linear(4, 3, bias=False)
    other = torch.nn.Linear(2, 2, bias=False)
    gain = torch.nn.Parameter(torch.ones(5))
    buffer = _Buffer([written.weight, gain, other.weight])
    ddp = _DDP([buffer])
    return fw.FirstMicroBatchWrites(ddp, [written, other]), ddp, buffer, written, other, gain


def test_the_step_zeroes_all_but_the_written_weights():
    writes, ddp, buffer, written, other, gain = _setup()
    buffer.grad_data.fill_(7.0)
    writes.zero_grad_buffer()
    assert ddp.zeroed == 1 and buffer.resets == 0  # megatron-core's zero_grad_buffer ran, with the partial reset
    assert (written.weight.main_grad == 7).all() and (other.weight.main_grad == 7).all()
    assert (gain.main_grad == 0).all()
    assert buffer.grad_data.sum() == 7 * (12 + 4)  # the padding is zeroed too
    assert writes.armed and getattr(written.weight, fw.FLAG) and getattr(other.weight, fw.FLAG)
    # afterwards the buffer's own reset is megatron-core's again: a plain zero_grad_buffer zeroes everything
    ddp.zero_grad_buffer()
    assert buffer.resets == 1 and buffer.grad_data.abs().sum() == 0


def test_disarm_clears_the_flags_and_zeroes_a_module_that_did_not_run():
    writes, ddp, buffer, written, other, gain = _setup()
    buffer.grad_data.fill_(7.0)
    writes.zero_grad_buffer()
    written(torch.ones(1, 4))  # `other` does not run in the first micro-batch
    writes.disarm()
    assert not writes.armed and not getattr(written.weight, fw.FLAG) and not getattr(other.weight, fw.FLAG)
    assert (written.weight.main_grad == 7).all()  # its GEMM writes it in the backward
    assert (other.weight.main_grad == 0).all()  # nothing will write it: the later micro-batches add to zeros
    writes.disarm()  # a second disarm (the step's finally) changes nothing
    assert (written.weight.main_grad == 7).all()


def test_a_module_run_twice_in_the_first_micro_batch_stops_the_step():
    writes, *_ , written, other, gain = _setup()
    writes.zero_grad_buffer()
    written(torch.ones(1, 4))
    with pytest.raises(RuntimeError, match="ran twice in the step's first micro-batch.*first_micro_batch_writes"):
        written(torch.ones(1, 4))
    writes.disarm()
    written(torch.ones(1, 4))  # later micro-batches may run it as often as they like
    written(torch.ones(1, 4))


def test_unrouted_experts_get_zero_gradients_only_under_the_writes():
    fc1 = [torch.nn.Parameter(torch.ones(2, 2)) for _ in range(3)]
    fc2 = [torch.nn.Parameter(torch.ones(2, 2)) for _ in range(3)]
    for p in fc1 + fc2:
        p.main_grad = torch.full((2, 2), 5.0)
    fw.zero_unrouted(fc1, fc2, [4, 0, 2])  # not armed: nothing
    assert all((p.main_grad == 5).all() for p in fc1 + fc2)
    for p in fc1:
        setattr(p, fw.FLAG, True)
    fw.zero_unrouted(fc1, fc2, [4, 0, 2])
    assert [bool((p.main_grad == 0).all()) for p in fc1] == [False, True, False]
    assert [bool((p.main_grad == 0).all()) for p in fc2] == [False, True, False]
    # TE's single grouped weight: the experts' gradients in one [experts, ...] main_grad
    one = torch.nn.Parameter(torch.ones(3, 2, 2))
    one.main_grad = torch.full((3, 2, 2), 5.0)
    setattr(one, fw.FLAG, True)
    two = torch.nn.Parameter(torch.ones(3, 2, 2))
    two.main_grad = torch.full((3, 2, 2), 5.0)
    fw.zero_unrouted([one], [two], [0, 1, 1])
    assert one.main_grad[0].abs().sum() == 0 and (one.main_grad[1:] == 5).all()
    assert two.main_grad[0].abs().sum() == 0 and (two.main_grad[1:] == 5).all()


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 10)), max_size=8), st.integers(0, 80))
def test_complement_covers_exactly_what_is_not_kept(spans, extra):
    kept = sorted((a, a + n) for a, n in spans)
    size = max([b for _, b in kept], default=0) + extra
    out = fw.complement(kept, size)
    covered = torch.zeros(size, dtype=torch.int32)
    for a, b in out:
        assert a < b
        covered[a:b] += 1
    inside = torch.zeros(size, dtype=torch.bool)
    for a, b in kept:
        inside[a:b] = True
    assert (covered <= 1).all() and torch.equal(covered.bool(), ~inside)
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(out, out[1:]))  # adjacent ranges merged


def _cfg(**kw):
    base = dict(gradient_accumulation_fusion=True, recompute_granularity=None, recompute_modules=None,
                cuda_graph_impl="none")
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kw,reason", [
    ({}, None),
    ({"recompute_granularity": "selective", "recompute_modules": ["core_attn", "moe_act"]}, None),
    ({"gradient_accumulation_fusion": False}, "gradient accumulation fusion is off"),
    ({"recompute_granularity": "full"}, "full recompute"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, "selective recompute of the MoE layer"),
    ({"cuda_graph_impl": "transformer_engine"}, "CUDA graphs"),
])
def test_where_the_writes_apply(kw, reason):
    got = fw.why_not(_cfg(**kw), SimpleNamespace(use_megatron_fsdp=False))
    assert got is None if reason is None else reason in got


@pytest.mark.parametrize("overrides", [
    ["engine_options.first_micro_batch_writes=true", "recompute.granularity=full"],
    ["engine_options.first_micro_batch_writes=true", "engine_options.gradient_accumulation=false"],
])
def test_asking_for_the_writes_where_they_cannot_run_is_refused(overrides):
    from muse_stack.recipes.options import check

    with pytest.raises(RecipeError) as err:
        check(load_recipe("slice-1gpu", overrides))
    assert err.value.field == "engine_options.first_micro_batch_writes"
    check(load_recipe("slice-1gpu", overrides[1:]))  # unset: it just does not apply

"""The GPU layers' elementwise fusion switch (torch.compile), exercised on CPU with a counting backend."""

import pytest
import torch

from muse_stack.engines.mcore import fuse
from muse_stack.util.errors import RecipeError
from muse_stack.recipes.catalogue import load_recipe
from muse_stack.resolve.recipe import resolve


class CountingBackend:
    """A torch.compile backend that runs the captured graph as is and counts compilations."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


@fuse.elementwise
def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)).to(x.dtype)


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    fuse.configure(False, inductor_options={})
    torch._dynamo.reset()


def _expected(x, w):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)).to(x.dtype)


def test_off_runs_eagerly_and_compiles_nothing():
    backend = CountingBackend()
    fuse.configure(False, backend=backend)
    x, w = torch.randn(5, 8), torch.randn(8)
    assert torch.equal(chain(x, w), _expected(x, w))
    assert backend.graphs == 0 and not fuse.enabled()


def test_on_compiles_once_per_shape_family_not_once_per_token_count():
    """Under EP > 1 every rank gets a different token count each step: one static graph, then
    one with the token dimension symbolic, and no more."""
    backend = CountingBackend()
    fuse.configure(True, backend=backend)
    w = torch.randn(8)
    for tokens in (64, 64, 37, 90, 11, 250, 64):
        x = torch.randn(tokens, 8)
        torch.testing.assert_close(chain(x, w), _expected(x, w))
    assert fuse.enabled()
    assert backend.graphs == 2


def test_reconfiguring_rebuilds_the_compiled_chain():
    first, second = CountingBackend(), CountingBackend()
    x, w = torch.randn(4, 8), torch.randn(8)
    fuse.configure(True, backend=first)
    chain(x, w)
    torch._dynamo.reset()
    fuse.configure(True, backend=second)
    chain(x, w)
    assert (first.graphs, second.graphs) == (1, 1)


def test_recipe_switch_is_for_the_megatron_engine_only():
    assert load_recipe("slice-1gpu", ["engine_options.compile_elementwise=true"]).engine_options.compile_elementwise
    with pytest.raises(RecipeError, match="engine_options.compile_elementwise"):
        resolve(load_recipe("tiny-cpu", ["engine_options.compile_elementwise=true"]))


class OptionsBackend:
    """A torch.compile backend that keeps the options each graph was compiled with."""

    def __init__(self) -> None:
        self.options: list = []

    def __call__(self, gm, example_inputs, options=None):
        self.options.append(options)
        return gm.forward


def test_the_options_install_the_compiled_chains_and_inductors_multi_kernel():
    """engine_options.compile_elementwise and compile_multi_kernel as the engine installs them: the chains
    compiled, with TorchInductor's multi-kernel as the compile's option (none when off)."""
    x, w = torch.randn(4, 8), torch.randn(8)
    backend = OptionsBackend()
    fuse.configure(False, backend=backend)
    fuse.install_compile_elementwise(None, True)
    fuse.configure(True, backend=backend)  # the install chose TorchInductor: this test's backend instead
    fuse.install_compile_multi_kernel(None, True)
    torch.testing.assert_close(chain(x, w), _expected(x, w))
    torch._dynamo.reset()
    fuse.install_compile_multi_kernel(None, False)
    chain(x, w)
    assert backend.options == [fuse.MULTI_KERNEL, None]
    fuse.install_compile_elementwise(None, False)
    assert not fuse.enabled()


class RecordingBackend:
    """A torch.compile backend that runs the captured graph as is and keeps the names of the
    functions each graph calls."""

    def __init__(self) -> None:
        self.graphs: list[set[str]] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append({getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                            if n.op == "call_function"})
        return gm.forward


@fuse.elementwise
def inner(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(g) * x + torch.sigmoid(-g)


@fuse.elementwise
def outer(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return inner(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * x, g)


def test_a_chain_called_inside_another_is_still_compiled_when_called_directly():
    """The post-attention residual calls the gated residual, which the layer also calls on its
    own. Traced inside the caller first, the inner chain must still compile for its direct calls:
    one graph for the caller (the inner chain inlined, no recompilation) and one for the inner
    chain alone; none of its direct calls may run eagerly."""
    backend = RecordingBackend()
    fuse.configure(True, backend=backend)
    x, g = torch.randn(6, 8), torch.randn(8)
    for _ in range(3):
        normed = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * x
        torch.testing.assert_close(outer(x, g), torch.sigmoid(g) * normed + torch.sigmoid(-g))
        torch.testing.assert_close(inner(x, g), torch.sigmoid(g) * x + torch.sigmoid(-g))
    assert len(backend.graphs) == 2
    caller, alone = backend.graphs
    assert "rsqrt" in caller and "sigmoid" in caller
    assert "sigmoid" in alone and "rsqrt" not in alone

"""The word embedding's lookup that adds its gradient into main_grad (muse_stack.engines.mcore.embedding_grad) on
the CPU, within the bound derived in tests/helpers/embedding_grad_checks.py; where it applies; the recipe check of
engine_options.embedding_into_main_grad."""

from types import SimpleNamespace

import pytest
import torch
from embedding_grad_checks import check_add_rows, check_dense_without_main_grad, check_lookup

from muse_stack.engines.mcore import embedding_grad
from muse_stack.engines.mcore.chains import hold_padding_row
from muse_stack.util.errors import RecipeError
from muse_stack.recipes.catalogue import load_recipe


@pytest.mark.parametrize("pad_row", [5, None])
def test_the_rows_are_the_tokens_sums(pad_row):
    check_add_rows("cpu", pad_row)


@pytest.mark.parametrize("pad_row", [5, None])
def test_the_lookup_adds_into_main_grad(pad_row):
    check_lookup("cpu", pad_row)


def test_without_main_grad_the_gradient_is_dense():
    check_dense_without_main_grad("cpu")


class _Group:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


class _Words(torch.nn.Module):
    """What install reads of megatron-core's VocabParallelEmbedding."""

    def __init__(self, tp: int = 1, gtp: int = 1) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 4).bfloat16())
        self.tp_group, self.gtp_remat_size = _Group(tp), gtp

    def forward(self, ids):
        return torch.nn.functional.embedding(ids, self.weight)


def test_install_takes_over_the_padding_row():
    words = _Words()
    hook = hold_padding_row(words.weight, 2, 0, 8)
    assert hook is not None and words.weight._backward_hooks
    assert embedding_grad.install(words, hook, 2) is None and embedding_grad.installed(words)
    assert not words.weight._backward_hooks  # the hook would copy the dummy gradient
    words.weight.main_grad = torch.zeros(8, 4)
    ids = torch.tensor([[2, 3, 2, 7]])
    words(ids).float().sum().backward()
    assert torch.equal(words.weight.main_grad.sum(1), torch.tensor([0, 0, 0, 4.0, 0, 0, 0, 4.0]))


@pytest.mark.parametrize("words, why", [
    (_Words(tp=2), "split over TP"),
    (_Words(gtp=2), "GTP"),
    (_Words().requires_grad_(False), "frozen"),
])
def test_where_the_dense_lookup_stays(words, why):
    assert why in embedding_grad.install(words, None, None)
    assert not embedding_grad.installed(words)


def _engine(words: torch.nn.Module, pre_process: bool = True):
    """What the option's install reads of the engine: its DDP's module (the model of this rank)."""
    module = SimpleNamespace(pre_process=pre_process, embedding=SimpleNamespace(word_embeddings=words),
                             padding_hook=None, pad_row=None)
    return SimpleNamespace(model=SimpleNamespace(module=module))


def test_the_option_keeps_the_dense_lookup_when_off():
    """engine_options.embedding_into_main_grad as the engine installs it: off leaves megatron-core's lookup,
    on installs ours; a stage without the embedding has none to change."""
    words = _Words()
    assert embedding_grad.install_embedding_into_main_grad(_engine(words), False) is None
    assert not embedding_grad.installed(words)
    assert "first pipeline stage" in embedding_grad.install_embedding_into_main_grad(_engine(words, False), True)
    assert not embedding_grad.installed(words)
    assert embedding_grad.install_embedding_into_main_grad(_engine(words), True) is None
    assert embedding_grad.installed(words)


@pytest.mark.parametrize("recipe, overrides, why", [
    ("slice-1gpu", ["layout.tp=2"], "layout.tp"),
    ("lora-64", [], "frozen under peft"),
])
def test_the_recipe_refuses_it_where_it_cannot_run(recipe, overrides, why):
    from muse_stack.recipes.options import check, why_not

    assert why in why_not(load_recipe(recipe, overrides), "embedding_into_main_grad")
    with pytest.raises(RecipeError) as err:
        check(load_recipe(recipe, [*overrides, "engine_options.embedding_into_main_grad=true"]))
    assert err.value.field == "engine_options.embedding_into_main_grad" and why in str(err.value)


def test_the_shipped_slice_adds_into_main_grad():
    from muse_stack.recipes.options import check, why_not

    recipe = load_recipe("slice-1gpu", ["engine_options.embedding_into_main_grad=true"])
    assert why_not(recipe, "embedding_into_main_grad") is None
    check(recipe)


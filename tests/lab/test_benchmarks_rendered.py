"""Every figure a README or doc states about a benchmark result is rendered from the result files
(benchmarks/scripts/render.py, figures.py): the committed docs equal what the data renders, so a figure has one
owner, its data file, and a doc that restates it differently fails here. The renderer itself refuses a slot it
cannot fill and a figure it cannot place."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _render():
    spec = importlib.util.spec_from_file_location("render", ROOT / "benchmarks" / "scripts" / "render.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


render = _render()


@pytest.mark.parametrize("doc", sorted(render.figures.DOCS))
def test_the_committed_doc_is_what_its_data_renders(doc):
    committed, rendered = render.rendered(doc)
    assert committed == rendered, f"{doc} differs from its data: python benchmarks/scripts/render.py {doc}"


def test_the_rendered_docs_hold_their_figures():
    """Each rendered doc places figures (a doc with no slot renders nothing and checks nothing)."""
    for doc in render.figures.DOCS:
        text = (ROOT / doc).read_text()
        assert render.MD_SLOT.search(text) or render.YAML_SLOT.search(text), doc


def test_a_changed_figure_is_caught_and_rewritten(tmp_path):
    text = "a | <!--fig:tps-->30,677<!--/fig--> tokens/s, <!--fig:tps-->30,677<!--/fig--> again\n"
    assert render.render_text(text, {"tps": "30,677"}, "doc") == text
    stale = text.replace("30,677<", "30,000<", 1)
    assert render.render_text(stale, {"tps": "30,677"}, "doc") == text


def test_a_slot_without_a_figure_and_a_figure_without_a_slot_are_errors():
    with pytest.raises(render.RenderError, match="slot 'mfu' has no figure"):
        render.render_text("<!--fig:mfu-->4.97%<!--/fig-->", {}, "doc")
    with pytest.raises(render.RenderError, match="figures tps are made but placed nowhere"):
        render.render_text("no slots", {"tps": "1"}, "doc")


def test_a_table_keeps_the_docs_words_and_takes_the_datas_figures():
    fill = render.figures.table(
        lambda cells: cells[0].strip("`"),
        {1: lambda k: {"a": "1,000", "b": "2,000"}[k], 2: lambda k: render.figures.Whole(f"{k}!")},
    )
    doc = "| run | tokens/s | note |\n|---|---:|---|\n| `a` | **9** (best) | x |\n| `b` | 8 | y |"
    assert (
        fill(doc) == "| run | tokens/s | note |\n|---|---:|---|\n| `a` | **1,000** (best) | a! |\n| `b` | 2,000 | b! |"
    )


def test_a_yaml_block_is_rendered_between_its_comment_lines():
    text = "results:\n# fig:results\n  - old\n# /fig\nrest: 1\n"
    assert (
        render.render_text(text, {"results": "  - new\n"}, "index.yaml", yaml_doc=True)
        == "results:\n# fig:results\n  - new\n# /fig\nrest: 1\n"
    )


def test_the_command_line_checks_and_exits_nonzero_on_a_difference(tmp_path, monkeypatch, capsys):
    assert render.main(["--check"]) == 0
    doc = "benchmarks/results/engine-options-each-alone/README.md"
    copy = tmp_path / "repo"
    (copy / Path(doc).parent).mkdir(parents=True)
    text = (ROOT / doc).read_text()
    (copy / doc).write_text(text.replace("<!--fig:base-->48,443<!--/fig-->", "<!--fig:base-->48,000<!--/fig-->"))
    monkeypatch.setattr(render, "REPO", copy)
    assert render.main(["--check", doc]) == 1
    diff = capsys.readouterr().out
    assert "48,000" in diff and "48,443" in diff  # the diff shows the committed figure and the data's
    assert render.main([doc]) == 0 and (copy / doc).read_text() == text

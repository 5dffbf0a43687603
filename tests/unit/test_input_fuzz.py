"""Generated bad input through every subcommand: the answer is success or the project's own error
(exit 1, 2 or 3 with a message naming a field and a fix), never a traceback, an internal error or
a hang. Examples are bounded so the whole file runs in well under a minute on two cores; no
wall-clock time is asserted (hypothesis deadline=None)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muse_stack.cli import main

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "recipes" / "tiny-cpu.yaml").read_text())

KEYS = ["name", "task", "engine", "hardware.count", "hardware.per_node", "hardware.gpu", "layout.tp", "layout.pp",
        "layout.cp", "layout.ep", "layout.etp", "layout.dp", "layout.pp_layers", "layout.sequence_parallel",
        "batch.mbs", "batch.gbs", "batch.seq_length", "batch.packed", "batch.pack_alignment", "optimizer.lr",
        "optimizer.min_lr", "optimizer.beta1", "optimizer.eps", "optimizer.warmup_steps", "optimizer.name",
        "training.steps", "training.epochs", "data.files", "data.builder", "data.tokenizer", "data.template_kwargs",
        "data.build_name", "env", "model.overrides", "model.overrides.hidden_size", "model.overrides.head_dim",
        "model.overrides.num_local_experts", "model.overrides.num_hidden_layers", "model.overrides.layer_types",
        "model.config_path", "frozen", "peft", "notes", "aliases", "provenance"]
HUGE = ["1000000000000", "-1", "0", ".inf", "-.inf", ".nan", "1e308", "9" * 40, "2.5", "true", "null", "~"]
VALUES = st.one_of(
    st.sampled_from(HUGE),
    st.sampled_from(['"../../x"', '"a\\nb"', "[1, 2]", "{a: 1}", "[]", "{}", '"$(touch x)"', "&a [*a]", "[&b x, *b]",
                     "'", "[", "{", "!!python/object:os.system ls", "\"\\u0000\"", "-", ": :", "*undefined"]),
    st.text(max_size=12),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
KEY = st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS), st.sampled_from(KEYS), st.text(max_size=15),
                st.lists(st.sampled_from(["layout", "", "tp", "x", "..", "model", "overrides", "0"]), max_size=4)
                .map(".".join))
OVERRIDE = st.one_of(st.builds(lambda k, v: f"{k}={v}", KEY, VALUES), st.builds(lambda k, v: f"{k}={v}", KEY, VALUES),
                     st.text(max_size=20))

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


def own_answer(capsys, argv: list[str]) -> None:
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc in (0, 1, 2, 3), (argv, rc, err[-2000:])
    assert "Traceback" not in err and "internal error" not in err, (argv, err[-2000:])
    if rc in (2, 3) and err.startswith("error:"):
        assert "fix:" in err, (argv, err)


@FAST
@given(overrides=st.lists(OVERRIDE, max_size=3), command=st.sampled_from(["plan", "plan", "show", "launch", "data-show"]))
def test_dotted_overrides(capsys, overrides, command):
    argv = {"show": ["show", "tiny-cpu"], "plan": ["plan", "tiny-cpu"], "data-show": ["data", "show", "tiny-cpu"],
            "launch": ["launch", "tiny-cpu", "--slurm"]}[command]
    own_answer(capsys, [*argv, "--", *overrides] if command != "launch" else [*argv, "--", *overrides])


def _document(draw_changes: dict) -> dict:
    doc = json.loads(json.dumps(BASE))
    for path, value in draw_changes.items():
        node = doc
        parts = path.split(".")
        for part in parts[:-1]:
            nxt = node.get(part) if isinstance(node, dict) else None
            if not isinstance(nxt, dict):
                nxt = {}
                node[part] = nxt
            node = nxt
        node[parts[-1]] = value
    return doc


LEAF = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=10))
TREE = st.recursive(LEAF, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                    max_leaves=8)


@FAST
@given(changes=st.dictionaries(st.sampled_from(KEYS), TREE, max_size=4),
       command=st.sampled_from(["show", "plan", "launch"]), raw=st.one_of(st.none(), st.text(max_size=200)))
def test_recipe_documents(capsys, tmp_path_factory, changes, command, raw):
    path = tmp_path_factory.mktemp("fuzz") / "recipe.yaml"
    if raw is not None:  # arbitrary text as the recipe file
        path.write_text(raw)
    else:
        path.write_text(yaml.safe_dump(_document(changes), allow_unicode=True))
    argv = {"show": ["show", path], "plan": ["plan", path], "launch": ["launch", path, "--slurm"]}[command]
    own_answer(capsys, argv)


@FAST
@given(content=st.one_of(st.binary(max_size=200).map(lambda b: b.decode("latin-1")), st.text(max_size=200),
                         TREE.map(json.dumps), TREE.map(lambda t: json.dumps({"schema_version": 1, "gpu": t}))),
       command=st.sampled_from(["diff", "audit", "record-import", "compare"]))
def test_input_files(capsys, tmp_path_factory, content, command):
    d = tmp_path_factory.mktemp("files")
    f = d / "input.json"
    f.write_bytes(content.encode("latin-1", errors="replace") if command == "record-import" else content.encode())
    good = ROOT / "tests" / "fixtures" / "fingerprints" / "cpu-debian12-torch2.13.json"
    if command == "compare":
        run = d / "run"
        run.mkdir()
        (run / "metrics.jsonl").write_text(content)
        (run / "recipe.yaml").write_text(content)
        argv = ["compare", run, run, "--no-plot"]
    else:
        argv = {"diff": ["diff", good, f], "audit": ["audit", f, "--recipe", "tiny-cpu"],
                "record-import": ["record", "import", f, "--name", "x"]}[command]
    own_answer(capsys, argv)

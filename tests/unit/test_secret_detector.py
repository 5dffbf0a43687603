"""The secret detector on its labelled set (tests/unit/data/secret_labels.yaml): every labelled
secret is refused and every labelled non-secret passes, except exactly the items the set lists as
accepted, each with its reason; and the committed rates (benchmarks/results/secret-detector-rates)
are what the detector does now."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from lab.secret_labels import expand, labelled, measure, refused

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def labels():
    items, accepted = labelled()
    return items, accepted, measure(items)


def test_every_labelled_secret_is_refused_but_the_accepted_misses(labels):
    items, accepted, rates = labels
    by_id = {i.id: i for i in items}
    unexpected = sorted(set(rates["missed"]) - set(accepted["misses"]))
    assert unexpected == [], [(i, by_id[i].kind) for i in unexpected]
    assert sorted(set(accepted["misses"]) - set(rates["missed"])) == [], "an accepted miss is caught now: drop it"


def test_every_labelled_non_secret_passes_but_the_accepted_false_refusals(labels):
    items, accepted, rates = labels
    by_id = {i.id: i for i in items}
    unexpected = sorted(set(rates["falsely_refused"]) - set(accepted["false_refusals"]))
    assert unexpected == [], [(i, by_id[i].kind, by_id[i].key, by_id[i].value[:80]) for i in unexpected]
    assert sorted(set(accepted["false_refusals"]) - set(rates["falsely_refused"])) == [], \
        "an accepted false refusal passes now: drop it"


def test_the_set_holds_both_labels_from_both_origins_and_every_accepted_item_has_a_reason(labels):
    items, accepted, rates = labels
    for origin in ("generated", "hand-written"):
        got = rates["by_origin"][origin]
        assert got["secrets"] > 0 and got["not_secrets"] > 0, origin
    for group in accepted.values():
        assert all(isinstance(why, str) and len(why) > 20 for why in group.values())
    # the legitimate values are in the set, and pass
    values = {i.value for i in items if not i.secret}
    for legit in ("/shared/sk-experiments-december-2026", "ssh://git@github.com/meta/muse-stack.git",
                  "/tmp/slurm-12345/tmp.AbC123xyz", "01ARZ3NDEKTSV4RRFFQ69G5FAV"):
        assert legit in values
    keys = {i.key for i in items if not i.secret}
    assert {"messages_key", "NCCL_IB_PKEY", "GOOGLE_APPLICATION_CREDENTIALS", "HF_TOKEN_PATH", "bos_token",
            "eos_token"} <= keys


def test_the_committed_rates_are_what_the_detector_does_now():
    spec = importlib.util.spec_from_file_location("secret_detector_rates",
                                                  ROOT / "benchmarks/scripts/secret_detector_rates.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--check"]) == 0, "run python benchmarks/scripts/secret_detector_rates.py"


def test_templates_draw_the_same_strings_everywhere_and_refuse_unknown_fields():
    a = expand("ghp_{alnum:36} {pick:x|y} {int:1-9} {{literal}}", random.Random("s"))
    assert a == expand("ghp_{alnum:36} {pick:x|y} {int:1-9} {{literal}}", random.Random("s"))
    assert a.startswith("ghp_") and a.endswith("{literal}") and len(a.split()[0]) == 40
    with pytest.raises(ValueError, match="unknown template field"):
        expand("{base99:4}", random.Random(0))


def test_a_key_item_is_judged_by_its_name_and_value_together(labels):
    items, _, _ = labels
    item = next(i for i in items if i.kind == "password-recipe-key")
    assert refused(item)
    from dataclasses import replace

    assert not refused(replace(item, key="note"))  # 12 random letters and digits alone are not refused

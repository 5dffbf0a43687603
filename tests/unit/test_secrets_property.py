"""The secrets property, over generated names and values: a secret never reaches a file or a
stream, whatever it is called.

- Given literally (under any name, in an override, a flag, a URL; well-formed or malformed YAML),
  a credential-shaped value is refused before anything is written, and no output shows it.
- Given by reference (``${env:NAME}`` under generated names in ``env``, ``data.template_kwargs``
  and ``notes``, with the values in the environment, one of them also in an allow-listed NCCL_
  variable), a tiny-cpu run, its export and its Slurm launch file (and proxy-8gpu's Kubernetes
  manifest: Kubernetes launches take GPU recipes) write none of
  the values: every file under the run directory (checkpoints, TensorBoard), the data cache, the
  export, the sbatch script and the manifest is searched, and so are stdout and stderr.

Hypothesis runs derandomized (the same examples on every machine); the run-export-launch property
takes few examples (each trains for seconds), the validation path many.
"""

from __future__ import annotations

import base64
import json
import os
import random
import string
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from muse_stack.util.errors import INTERNAL_ERROR

B62 = string.ascii_letters + string.digits
IMAGE = "registry.example.com/muse-stack@sha256:" + "ab" * 32
URL_SAFE = B62 + "-_"


def _b64(rng: random.Random, n: int) -> str:
    return base64.urlsafe_b64encode(bytes(rng.randrange(256) for _ in range(n))).decode().rstrip("=")


def _pw(rng: random.Random) -> str:
    """A password: random letters and digits with a digit in it (not shaped like a token by itself)."""
    return "".join(rng.choices(B62, k=rng.randint(10, 20))) + str(rng.randrange(10))


def _secret(kind: str, seed: int) -> tuple[str, str]:
    """(the text given, the secret in it that must not appear anywhere)."""
    rng = random.Random(seed)
    host = rng.choice(["example.com", "hub.example.org", "10.0.0.7:8443", "s3.eu-west-1.amazonaws.com"])
    if kind == "url-userinfo":
        pw = _pw(rng)
        return f"{rng.choice(['https://', 'https:/', 's3://', 'git+ssh://'])}user{rng.randrange(99)}:{pw}@{host}/m", pw
    if kind == "bare-userinfo":
        pw = _pw(rng)
        return f"deploy:{pw}@{host}/muse/img", pw
    if kind == "query":
        pw = _pw(rng)
        name = rng.choice(["token", "access_token", "api_key", "sig", "X-Amz-Signature", "password", "auth"])
        return f"https://{host}/data.parquet?rev=main&{name}={pw}", pw
    if kind == "bearer":
        pw = _pw(rng)
        return f"Bearer {pw}", pw
    token = {
        "github": lambda: "ghp_" + "".join(rng.choices(B62, k=36)),
        "github-pat": lambda: "github_pat_" + "".join(rng.choices(B62, k=22)) + "_" + "".join(rng.choices(B62, k=59)),
        "huggingface": lambda: "hf_" + "".join(rng.choices(string.ascii_letters, k=34)),
        "openai": lambda: "sk-proj-" + "".join(rng.choices(URL_SAFE, k=48)),
        "aws": lambda: "AKIA" + "".join(rng.choices(string.ascii_uppercase + string.digits, k=16)),
        "jwt": lambda: "eyJ" + _b64(rng, 18) + ".eyJ" + _b64(rng, 30) + "." + _b64(rng, 32),
        "high-entropy": lambda: "".join(rng.choices(B62, k=40)),
    }[kind]()
    return token, token


KINDS = ["url-userinfo", "bare-userinfo", "query", "bearer", "github", "github-pat", "huggingface", "openai", "aws",
         "jwt", "high-entropy"]
secrets = st.tuples(st.sampled_from(KINDS), st.integers(0, 2**32 - 1)).map(lambda t: _secret(*t))
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
PLACES = ["env.{n}", "data.details.{n}", "data.template_kwargs.{n}", "notes.{n}", "correctness.{n}", "author.{n}",
          "description", "data.dataset", "provenance.url", "data.files", "--pretrained-checkpoint", "--out", "--hf"]
FORMS = ["{v}", "[{v}]", "[{v}", "{{{v}", '"{v}', "!!binary {v}", "{{k: {v}}}"]


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _leaks(root: Path, streams: str, needles: list[str]) -> list[str]:
    found = [f"stdout/stderr holds {n[:6]}..." for n in needles if n in streams]
    for path in _files(root):
        data = path.read_bytes()
        found += [f"{path.relative_to(root)} holds {n[:6]}..." for n in needles if n.encode() in data]
    return found


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=names, secret=secrets, place=st.sampled_from(PLACES), form=st.sampled_from(FORMS))
def test_a_literal_secret_is_refused_and_never_shown(cli, name, secret, place, form):
    given_text, needle = secret
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if place == "--pretrained-checkpoint":
            commands = [["run", "tiny-cpu", "--steps", "1", "--pretrained-checkpoint", given_text, "--out", tmp / "r"]]
        elif place == "--out":  # a path is printed and written: a credential-shaped one is refused too
            commands = [["run", "tiny-cpu", "--steps", "1", "--out", tmp / given_text]]
        elif place == "--hf":
            commands = [["export", tmp / "no-run", "--hf", tmp / given_text]]
        else:
            override = f"{place.format(n=name)}={form.format(v=given_text)}"
            commands = [["show", "tiny-cpu", override], ["run", "tiny-cpu", override, "--out", tmp / "r"],
                        ["launch", "tiny-cpu", "--slurm", override, "-o", tmp / "job.sbatch"]]
        for args in commands:
            rc, out, err = cli(*args)
            assert rc not in (0, INTERNAL_ERROR), (args[0], rc, err)
            assert needle not in out + err, (args[0], err)
            assert "Traceback" not in err
        assert _files(tmp) == [] and not (tmp / "r").exists()


@settings(max_examples=2, deadline=None, derandomize=True, phases=[Phase.generate],  # no shrinking: each runs
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@pytest.mark.slow
@given(pairs=st.lists(st.tuples(names, secrets), min_size=3, max_size=3))
def test_secrets_by_reference_reach_no_file_a_run_an_export_or_a_launch_writes(cli, pairs, one_thread):
    values = [v for _, (v, _needle) in pairs] + [needle for _, (_v, needle) in pairs]
    before = dict(os.environ)
    streams = ""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        try:
            os.environ["MUSE_STACK_CACHE"] = str(tmp / "cache")
            refs = []
            for i, (name, (value, _)) in enumerate(pairs):
                os.environ[f"MS_SECRET_{i}"] = value
                os.environ[f"NCCL_MS_SECRET_{i}"] = value  # allow-listed by the fingerprint, recorded by name only
                ref = f"${{env:MS_SECRET_{i}}}"
                refs += [f"env.{name}={ref}", f"data.template_kwargs.x_{name}={ref}", f"notes.{name}={ref}"]
                # the same secret given literally is refused, and leaves nothing
                rc, out, err = cli("run", "tiny-cpu", f"env.{name}={value}", "--out", tmp / "literal")
                streams += out + err
                assert rc == 2 and not (tmp / "literal").exists(), err
            run = tmp / "run"
            steps = [("run", "tiny-cpu", "--steps", "2", "training.checkpoint_interval=1", *refs, "--out", run,
                      "--no-progress"),
                     ("export", run, "--hf", tmp / "hf"),
                     ("launch", "tiny-cpu", "--slurm", *refs, "-o", tmp / "job.sbatch"),
                     # Kubernetes launches take GPU recipes: the smallest multi-GPU one
                     ("launch", "proxy-8gpu", "--k8s", "--image", IMAGE, *refs, "-o", tmp / "job.yaml")]
            for args in steps:
                rc, out, err = cli(*args)
                streams += out + err
                assert rc == 0, (args[0], err)
        finally:
            os.environ.clear()
            os.environ.update(before)
        written = {p.relative_to(tmp).parts[0] for p in _files(tmp)}
        assert {"run", "cache", "hf", "job.sbatch", "job.yaml"} <= written, written
        assert any(p.parts[1] == "checkpoints" for p in (q.relative_to(tmp) for q in _files(tmp / "run")))
        assert any("tfevents" in p.name for p in _files(run / "tensorboard"))
        assert "MS_SECRET_0" in (tmp / "job.sbatch").read_text()  # the reference is what is written
        assert "NCCL_MS_SECRET_0" in json.loads((run / "fingerprint.json").read_text())["environment"]["secrets_set"]
        assert _leaks(tmp, streams, values) == []

"""Shell completion: recipe and lock names complete, and a TAB (one start of the command line)
imports neither torch nor the models: the completion path reads only the names' files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _complete(line: str) -> list[str]:
    """What bash completion offers for ``line`` (the words typed; a trailing space starts a new one)."""
    words = line.split()
    cword = len(words) if line.endswith(" ") else len(words) - 1
    env = {**os.environ, "_MUSE_STACK_COMPLETE": "complete_bash", "COMP_WORDS": line, "COMP_CWORD": str(cword),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    script = Path(sys.executable).parent / "muse-stack"  # the shell completes the installed script's name
    if not script.is_file():
        pytest.skip("the muse-stack script is not installed beside this Python")
    done = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.parametrize("line,expected", [
    ("muse-stack run tiny", {"tiny-cpu", "tiny-cpu-mm"}),
    ("muse-stack plan lora-", {"lora-16-mm", "lora-64"}),
    ("muse-stack launch muse_spark_open_peft_16gpu_gb200", {"muse_spark_open_peft_16gpu_gb200_bf16_multimodal_config"}),
    ("muse-stack stack show ", {"b200", "cpu", "gb200", "h200"}),
    ("muse-stack audit runs/x --lock c", {"cpu"}),
    ("muse-stack audit runs/x --recipe tiny-cpu-", {"tiny-cpu-mm"}),
])
def test_recipe_and_lock_names_complete(line, expected):
    assert set(_complete(line)) == expected


def test_the_command_line_loads_without_torch_or_the_models():
    code = ("import sys, muse_stack.cli; heavy = sorted(m for m in ('torch', 'muse_stack.models.muse_spark.decoder'"
            ", 'muse_stack.models.muse_spark.checkpoint') if m in sys.modules); print(heavy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

"""The benchmarks' figures in docs, generated from the data: the one writer of every figure a README or a doc
states about a result folder, and of benchmarks/index.yaml's list of result folders.

A doc marks what is generated; the doc owns its words, the data its figures:
  Markdown  ``<!--fig:NAME-->30,677<!--/fig-->`` inline, or around a block (a table, a list) on lines of their own
  YAML      a line ``# fig:NAME``, the generated lines, a line ``# /fig``
``figures.py`` says, for each doc, how each NAME is made from the result files: a string (the slot's whole text),
or a function of the slot's committed text (a table whose rows and words the doc owns and whose figure cells the
data owns). A slot the doc has and figures.py lacks, or a figure figures.py makes and the doc does not place, is
an error: a figure is never dropped silently.

    python benchmarks/scripts/render.py            # rewrite every generated part of every doc
    python benchmarks/scripts/render.py --check    # exit 1 with a diff where a committed doc differs (CPU, ~2 s)
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import figures  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MD_SLOT = re.compile(r"<!--fig:([\w.-]+)-->(.*?)<!--/fig-->", re.S)
YAML_SLOT = re.compile(r"^# fig:([\w.-]+)\n(.*?)^# /fig$", re.S | re.M)
Figure = str | Callable[[str], str]


class RenderError(Exception):
    """A doc and its figures disagree on which slots exist."""


def render_text(text: str, made: dict[str, Figure], where: str, yaml_doc: bool = False) -> str:
    """``text`` with every slot's content replaced by its figure. Each slot must have a figure and each figure a
    slot (a name may fill several slots)."""
    pattern = YAML_SLOT if yaml_doc else MD_SLOT
    seen: set[str] = set()

    def fill(m: re.Match) -> str:
        name, old = m.group(1), m.group(2)
        if name not in made:
            raise RenderError(f"{where}: slot {name!r} has no figure in benchmarks/scripts/figures.py")
        seen.add(name)
        fig = made[name]
        new = fig(old) if callable(fig) else fig
        if yaml_doc:
            new = new if new.endswith("\n") or not new else new + "\n"
            return f"# fig:{name}\n{new}# /fig"
        return f"<!--fig:{name}-->{new}<!--/fig-->"

    out = pattern.sub(fill, text)
    unplaced = sorted(set(made) - seen)
    if unplaced:
        raise RenderError(
            f"{where}: figures {', '.join(unplaced)} are made but placed nowhere: mark them in the doc "
            "or drop them from figures.py"
        )
    return out


def rendered(path: str) -> tuple[str, str]:
    """(committed text, rendered text) of one doc, ``path`` relative to the repository."""
    file = REPO / path
    if not file.is_file():
        raise RenderError(f"{path}: figures.py renders it, but there is no such file")
    text = file.read_text()
    return text, render_text(text, figures.DOCS[path](), path, yaml_doc=file.suffix in (".yaml", ".yml"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 where a committed doc differs")
    ap.add_argument("docs", nargs="*", help="only these docs (paths relative to the repository)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.docs) - set(figures.DOCS))
    if unknown:
        ap.error(f"no figures for {', '.join(unknown)}; rendered docs: {', '.join(sorted(figures.DOCS))}")
    stale = []
    try:
        for path in args.docs or sorted(figures.DOCS):
            old, new = rendered(path)
            if old == new:
                continue
            if args.check:
                stale.append(path)
                sys.stdout.writelines(
                    difflib.unified_diff(
                        old.splitlines(True),
                        new.splitlines(True),
                        f"{path} (committed)",
                        f"{path} (from the data)",
                        n=1,
                    )
                )
            else:
                (REPO / path).write_text(new)
                print(f"rendered {path}")
    except RenderError as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 2
    if stale:
        print(
            f"render.py: {len(stale)} doc(s) differ from their data: python benchmarks/scripts/render.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

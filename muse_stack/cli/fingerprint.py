"""CLI: fingerprint (this machine's stack, captured)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from muse_stack.fingerprint.absent import is_absent
from muse_stack.fingerprint.tree import leaves


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str, allow_nan=True)


def render_fingerprint_summary(doc: dict[str, Any], console: Console, written: str | None = None) -> None:
    """Per section, the fields read and those absent, with the first absence's reason."""
    table = Table(title="stack fingerprint" + (f" → {written}" if written else ""), show_lines=False)
    table.add_column("section")
    table.add_column("fields read", justify="right")
    table.add_column("absent", justify="right")
    table.add_column("first absent reason")
    for section, value in doc.items():
        if section in ("schema_version", "kind", "capture"):
            continue
        items = list(leaves(value, (section,)))
        gone = [(p, v) for p, v in items if is_absent(v)]
        reason = f"{'.'.join(gone[0][0][1:]) or section}: {gone[0][1]['absent']}" if gone else ""
        table.add_row(section, str(len(items) - len(gone)), str(len(gone)), Text(reason, style="yellow"))
    console.print(table)
    cap = doc.get("capture", {})
    console.print(f"schema_version {doc.get('schema_version')}, captured {cap.get('captured_at')} in {cap.get('seconds')} s")


def fingerprint_cmd(
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the JSON here (atomically) instead of stdout."),
    recipe_sha256: Optional[str] = typer.Option(None, "--recipe-sha256", help="sha256 of the resolved recipe."),
    rows_sha256: Optional[str] = typer.Option(None, "--rows-sha256", help="sha256 of the data rows."),
) -> None:
    """Capture the stack fingerprint of this machine and Python environment."""
    import re

    from muse_stack.util import atomic
    from muse_stack.util.errors import UsageError
    from muse_stack.fingerprint.capture import capture

    for flag, digest in (("--recipe-sha256", recipe_sha256), ("--rows-sha256", rows_sha256)):
        if digest is not None and not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise UsageError("not a sha256 digest", field=flag, value=digest,
                             fix="give 64 lower-case hex digits, as `sha256sum` prints them")
    doc = capture(recipe_sha256=recipe_sha256, rows_sha256=rows_sha256)
    if output is None:
        typer.echo(_dump(doc))
        return
    atomic.write_json(output, doc, field="--output")
    render_fingerprint_summary(doc, Console(), written=str(output))


def register(app: typer.Typer) -> None:
    app.command("fingerprint")(fingerprint_cmd)

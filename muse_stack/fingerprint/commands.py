"""CLI: fingerprint (this machine's stack, captured)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console



def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str, allow_nan=True)


def register(app: typer.Typer) -> None:
    @app.command("fingerprint")
    def fingerprint_cmd(
        output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the JSON here (atomically) instead of stdout."),
        recipe_sha256: Optional[str] = typer.Option(None, "--recipe-sha256", help="sha256 of the resolved recipe."),
        rows_sha256: Optional[str] = typer.Option(None, "--rows-sha256", help="sha256 of the data rows."),
    ) -> None:
        """Capture the stack fingerprint of this machine and Python environment."""
        from muse_stack import atomic
        from muse_stack.fingerprint.capture import capture

        import re

        from muse_stack.errors import UsageError

        for flag, digest in (("--recipe-sha256", recipe_sha256), ("--rows-sha256", rows_sha256)):
            if digest is not None and not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise UsageError("not a sha256 digest", field=flag, value=digest,
                                 fix="give 64 lower-case hex digits, as `sha256sum` prints them")
        doc = capture(recipe_sha256=recipe_sha256, rows_sha256=rows_sha256)
        if output is None:
            typer.echo(_dump(doc))
            return
        atomic.write_json(output, doc, field="--output")
        from muse_stack.compare.report import render_fingerprint_summary

        render_fingerprint_summary(doc, Console(), written=str(output))

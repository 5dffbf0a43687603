"""The `muse-stack` command line: the top layer of the product, which nothing else imports.

Each area's commands are one module of this package (``muse_stack.cli.plan``, ...) with a
``register(app)`` function, listed in ``_AREAS``; this module only assembles them and turns
:class:`MuseStackError` into a clear message and a non-zero exit. ``python -m muse_stack.cli``
runs :func:`main` as the ``muse-stack`` script does.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer
from rich.console import Console
from rich.markup import escape

from muse_stack import __version__
from muse_stack.util.errors import INTERNAL_ERROR, MuseStackError

app = typer.Typer(
    name="muse-stack",
    help="Reproducible training stack for Muse Spark Open: recipes, planner, runner, fingerprints.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command and group
)

# module paths whose register(app) adds commands; one line per area
_AREAS: list[str] = [
    "muse_stack.cli.engines",
    "muse_stack.cli.recipes",
    "muse_stack.cli.plan",
    "muse_stack.cli.run",
    "muse_stack.cli.publish",
    "muse_stack.cli.stack",
    "muse_stack.cli.data",
    "muse_stack.cli.fingerprint",
    "muse_stack.cli.compare",
    "muse_stack.cli.launch",
]

err_console = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"muse-stack {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Reproducible training stack for Muse Spark Open (816B-A42B)."""


#: a failure of the command areas to load (a machine table, named by MUSE_STACK_MACHINES, that is
#: missing or breaks a rule): main reports it as any other error
_LOAD_ERROR: MuseStackError | None = None
try:
    for _mod in _AREAS:
        importlib.import_module(_mod).register(app)
except MuseStackError as _exc:
    _LOAD_ERROR = _exc


def main(argv: list[str] | None = None) -> int:
    try:
        if _LOAD_ERROR is not None:
            raise _LOAD_ERROR
        rc = app(args=argv, standalone_mode=False)
        if isinstance(rc, int):
            return rc
    except MuseStackError as exc:
        err_console.print(f"[bold red]error:[/] {escape(exc.render())}", highlight=False, soft_wrap=True)
        return exc.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        err_console.print("aborted")
        return 130
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # usage errors from the command-line parser; anything else is a defect
        show = getattr(exc, "show", None)
        if callable(show) and hasattr(exc, "exit_code"):
            import io

            from muse_stack.util.credentials import redact_text

            buf = io.StringIO()  # the parser's message may quote what was typed: credentials redacted
            show(file=buf)
            sys.stderr.write(redact_text(buf.getvalue()))
            return int(exc.exit_code)
        if os.environ.get("MUSE_STACK_DEBUG"):
            raise
        from muse_stack.util.safeio import short_repr

        err_console.print(f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(short_repr(str(exc)))}\n"
                          "  this is a defect in muse-stack, not in your input: rerun with MUSE_STACK_DEBUG=1 for "
                          "the traceback and report it", highlight=False, soft_wrap=True)
        return INTERNAL_ERROR
    return 0

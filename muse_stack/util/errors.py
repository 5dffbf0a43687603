"""Errors that name the field, the value, the rule and the fix.

Every user-facing failure in muse-stack raises a subclass of :class:`MuseStackError`;
the CLI prints it and exits with its ``exit_code`` without leaving partial output behind.
An error never shows a credential: its value is shown bounded, and a credential-shaped one as
``'<redacted>'`` (:mod:`muse_stack.util.credentials`).
"""

from __future__ import annotations

from typing import Any

from muse_stack.util.credentials import REDACTED, redact_text, shape, short_repr

# Exit codes of the command line:
#   0  success
#   1  a check ran and said no: the plan does not fit, a run stopped early, runs differ
#   2  the request is wrong: a recipe, override, option or layout breaks a rule (MuseStackError,
#      UsageError for an option's value)
#   3  an input file is missing, unreadable or corrupt (InputError)
#  70  a defect in muse-stack itself (no traceback unless MUSE_STACK_DEBUG=1)
INTERNAL_ERROR = 70


class MuseStackError(Exception):
    """A failure the user can act on."""

    exit_code = 2

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        value: Any = None,
        rule: str | None = None,
        fix: str | None = None,
        exit_code: int | None = None,
    ) -> None:
        self.message = message
        self.field = field
        self.value = value
        self.rule = rule
        self.fix = fix
        if exit_code is not None:
            self.exit_code = exit_code
        super().__init__(self.render())

    def render(self) -> str:
        parts = []
        if self.field is not None:
            parts.append(f"{self.field} = {short_repr(self.value)}: {self.message}")
        else:
            parts.append(self.message)
        if self.rule:
            parts.append(f"  rule: {self.rule}")
        if self.fix:
            parts.append(f"  fix:  {self.fix}")
        return redact_text("\n".join(parts))

    def as_dict(self) -> dict[str, Any]:
        return {
            "error": type(self).__name__,
            "message": redact_text(self.message),
            "field": self.field,
            "value": self.value if isinstance(self.value, (int, float, bool, type(None)))
            else REDACTED if isinstance(self.value, str) and shape(self.value)
            else redact_text(self.value[:2000]) if isinstance(self.value, str) else short_repr(self.value),
            "rule": self.rule and redact_text(self.rule),
            "fix": self.fix and redact_text(self.fix),
        }


class RecipeError(MuseStackError):
    """A recipe file is missing, malformed or names an unknown recipe."""


class LayoutError(MuseStackError):
    """A parallel layout or batch setting breaks a rule of megatron-core."""


class InputError(MuseStackError):
    """A file given on the command line is missing, unreadable or corrupt."""

    exit_code = 3


class UsageError(MuseStackError):
    """A command-line option's value is out of range or unsafe to carry into a launch file."""


class EngineUnavailable(MuseStackError):
    """The recipe needs an engine (e.g. megatron-core on GPUs) that this machine lacks."""

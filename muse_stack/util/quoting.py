"""Values on their way into a generated shell script or manifest: quoted by construction
(``shlex.quote``) or checked against a safe character set, never pasted as text.

An environment value keeps its ``$NAME`` / ``${NAME}`` references (they expand when the job
runs, as a recipe means them) and ``${env:NAME}`` references to the launching environment;
every other character is literal: the text between references goes through ``shlex.quote``,
so ``$(...)``, backquotes, quotes and newlines can never run.
"""

from __future__ import annotations

import re
import shlex

from muse_stack.util.errors import UsageError

#: $NAME, ${NAME} and ${env:NAME}
REFERENCE = re.compile(r"\$\{env:(?P<env>[A-Za-z_][A-Za-z0-9_]*)\}|\$\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)\}"
                       r"|\$(?P<plain>[A-Za-z_][A-Za-z0-9_]*)")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: what a #SBATCH option value may hold (Slurm reads those lines itself, so they cannot be quoted)
SLURM_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:,+-]{0,127}")
#: an image reference: registry/name:tag@sha256:..., an enroot docker://REGISTRY#image, or a .sqsh path
IMAGE = re.compile(r"[A-Za-z0-9/][A-Za-z0-9._/:@#+=-]{0,511}")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
#: Kubernetes names: a DNS-1123 label (namespaces) and subdomain (claims, secrets)
DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?")


def _no_nul(value: str) -> str:
    if "\0" in value:  # no program argument or variable can hold it
        raise UsageError("a value bound for the launch file holds a NUL character", field="launch value",
                         value=value, fix="remove the NUL character")
    return value


def word(value: str) -> str:
    """One shell word that is exactly ``value``."""
    return shlex.quote(_no_nul(str(value)))


def env_word(value: str) -> str:
    """One shell word: ``value`` with its $NAME / ${NAME} / ${env:NAME} references expanding and
    everything else literal."""
    value = _no_nul(str(value))
    parts: list[str] = []
    pos = 0
    for m in REFERENCE.finditer(value):
        if m.start() > pos:
            parts.append(shlex.quote(value[pos:m.start()]))
        parts.append('"${%s}"' % (m.group("env") or m.group("braced") or m.group("plain")))
        pos = m.end()
    if pos < len(value) or not parts:
        parts.append(shlex.quote(value[pos:]))
    return "".join(parts)


def comment(text: str) -> str:
    """Text for a '#' comment line: every control character (newline, CR, ...) becomes a space."""
    return "".join(c if c.isprintable() else " " for c in str(text))


def env_name(name: str, field: str) -> str:
    if not ENV_NAME.fullmatch(name):
        raise UsageError("not an environment variable name", field=field, value=name,
                         rule="letters, digits and '_', not starting with a digit", fix="rename the variable")
    return name


def check(value: str | None, pattern: re.Pattern[str], field: str, rule: str, fix: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise UsageError("the value holds characters a launch file cannot carry safely", field=field, value=value,
                         rule=rule, fix=fix)
    return value


def check_path(value: str | None, field: str) -> str | None:
    """A host path: any characters (it is quoted), but no control characters."""
    if value is not None and not all(c.isprintable() for c in value):
        raise UsageError("the path holds a control character (newline, tab, NUL, ...)", field=field, value=value,
                         fix="give a path of printable characters")
    return value

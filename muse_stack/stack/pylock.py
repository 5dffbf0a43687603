"""Read a PEP 751 wheel set (pylock.<target>.toml) and turn it into pip requirement lines with
hashes. Standard library only: the image build runs this file with the base's python3 before
muse-stack is installed (`python3 pylock.py requirements ...`), and muse-stack imports it.

    python3 pylock.py requirements PYLOCK [--only N ...] [--exclude N ...] [--sdist N ...] [--no-sdists]
    python3 pylock.py names PYLOCK
    python3 pylock.py pins PYLOCK NAME VERSION [NAME VERSION ...]
    python3 pylock.py sdist PYLOCK NAME          (prints the sdist's url and sha256)

`--no-sdists` leaves out the packages the set's `[tool.muse-stack] sdists` names (the image
compiles those itself). `pins` fails unless the set pins each NAME at VERSION (an empty NAME,
a component the lock leaves out, is skipped).

`requirements` prints one `name==version --hash=sha256:...` line per package, with the hashes
of its wheels, or of its sdist for the packages named with --sdist (those are built in the
image). pip then installs with --require-hashes, so a file whose bytes differ from the set is
refused, whatever index serves it.
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path


def canonical(name: str) -> str:
    """PEP 503 normalised name: lower case, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Artifact:
    url: str
    sha256: str
    size: int | None

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    wheels: tuple[Artifact, ...] = ()
    sdist: Artifact | None = None
    marker: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return canonical(self.name)


class PylockError(ValueError):
    pass


def _artifact(raw: dict, where: str) -> Artifact:
    url = raw.get("url") or raw.get("path")
    sha = (raw.get("hashes") or {}).get("sha256")
    if not url or not sha:
        raise PylockError(f"{where}: every file needs a url (or path) and a sha256 hash")
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise PylockError(f"{where}: sha256 {sha!r} is not 64 hex digits")
    return Artifact(url=str(url), sha256=sha, size=raw.get("size"))


def parse(doc: dict, where: str = "pylock") -> dict[str, Package]:
    if str(doc.get("lock-version", "")) != "1.0":
        raise PylockError(f"{where}: lock-version must be 1.0 (PEP 751), found {doc.get('lock-version')!r}")
    out: dict[str, Package] = {}
    for i, raw in enumerate(doc.get("packages", [])):
        name, version = raw.get("name"), raw.get("version")
        if not name or not version:
            raise PylockError(f"{where}: packages[{i}] needs name and version")
        w = f"{where}: {name}"
        wheels = tuple(_artifact(x, w) for x in raw.get("wheels", []))
        sdist = _artifact(raw["sdist"], w) if raw.get("sdist") else None
        if not wheels and sdist is None:
            raise PylockError(f"{w}: no wheel and no sdist")
        pkg = Package(name=name, version=str(version), wheels=wheels, sdist=sdist, marker=raw.get("marker"))
        if pkg.key in out:
            raise PylockError(f"{w}: listed twice")
        out[pkg.key] = pkg
    return out


def load(path: str | Path) -> tuple[dict, dict[str, Package]]:
    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PylockError(f"no wheel set at {p}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PylockError(f"{p}: not valid TOML: {exc}") from None
    return doc, parse(doc, str(p))


def requirement_lines(
    packages: dict[str, Package],
    *,
    only: set[str] | None = None,
    exclude: set[str] = frozenset(),
    sdists: set[str] = frozenset(),
) -> list[str]:
    only = {canonical(n) for n in only} if only else None
    exclude = {canonical(n) for n in exclude}
    sdists = {canonical(n) for n in sdists}
    if only is not None and (missing := only - set(packages)):
        raise PylockError(f"not in the wheel set: {', '.join(sorted(missing))}")
    lines = []
    for key in sorted(packages):
        pkg = packages[key]
        if (only is not None and key not in only) or key in exclude:
            continue
        if key in sdists:
            if pkg.sdist is None:
                raise PylockError(f"{pkg.name} {pkg.version}: the set has no sdist to build")
            hashes = [pkg.sdist.sha256]
        else:
            if not pkg.wheels:
                raise PylockError(
                    f"{pkg.name} {pkg.version}: the set has only an sdist; name it with --sdist to build it"
                )
            hashes = [a.sha256 for a in pkg.wheels]
        lines.append(f"{pkg.name}=={pkg.version} " + " ".join(f"--hash=sha256:{h}" for h in hashes))
    return lines


def check_pins(packages: dict[str, Package], pairs: list[str]) -> list[str]:
    problems = []
    for name, version in zip(pairs[::2], pairs[1::2]):
        if not name:
            continue
        got = packages.get(canonical(name))
        if got is None:
            problems.append(f"{name} is not in the wheel set (the lock pins {version})")
        elif got.version != version and got.version.split("+")[0] != version:
            problems.append(f"{name} is {got.version} in the wheel set, the lock pins {version}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("requirements", "names", "pins", "sdist"):
        sys.stderr.write(__doc__ or "")
        return 2
    cmd, path, rest = argv[0], argv[1], argv[2:]
    if cmd == "sdist":
        try:
            _, packages = load(path)
            pkg = packages.get(canonical(rest[0])) if rest else None
        except PylockError as exc:
            sys.stderr.write(f"pylock: {exc}\n")
            return 3
        if pkg is None or pkg.sdist is None:
            sys.stderr.write(f"pylock: the wheel set has no sdist of {rest[0] if rest else '(no name given)'}\n")
            return 1
        print(pkg.sdist.url, pkg.sdist.sha256)
        return 0
    if cmd == "pins":
        if len(rest) % 2:
            sys.stderr.write("pylock: pins takes NAME VERSION pairs\n")
            return 2
        try:
            _, packages = load(path)
        except PylockError as exc:
            sys.stderr.write(f"pylock: {exc}\n")
            return 3
        problems = check_pins(packages, rest)
        for p in problems:
            sys.stderr.write(f"pylock: {p}\n")
        return 1 if problems else 0
    no_sdists = "--no-sdists" in rest
    rest = [r for r in rest if r != "--no-sdists"]
    opts: dict[str, set[str]] = {"--only": set(), "--exclude": set(), "--sdist": set()}
    i = 0
    while i < len(rest):
        if rest[i] not in opts or i + 1 >= len(rest):
            sys.stderr.write(f"pylock: unexpected argument {rest[i]!r}\n")
            return 2
        opts[rest[i]].add(rest[i + 1])
        i += 2
    try:
        doc, packages = load(path)
        if no_sdists:
            opts["--exclude"] |= set(doc.get("tool", {}).get("muse-stack", {}).get("sdists", []))
        if cmd == "names":
            print("\n".join(f"{p.name}=={p.version}" for p in packages.values()))
            return 0
        lines = requirement_lines(
            packages, only=opts["--only"] or None, exclude=opts["--exclude"], sdists=opts["--sdist"]
        )
    except PylockError as exc:
        sys.stderr.write(f"pylock: {exc}\n")
        return 3
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

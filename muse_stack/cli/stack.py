"""`muse-stack stack show|build-args|check TARGET_OR_PATH`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Column, Table

from muse_stack.cli.complete import lock_names
from muse_stack import __version__
from muse_stack.stack import buildargs as ba
from muse_stack.stack import record
from muse_stack.stack.lock import LoadedLock, LockError, Null, load, pin_fix, unresolved

console = Console()
stack_app = typer.Typer(help="Stack locks: show, derive image build arguments, check.", no_args_is_help=True)

_TARGET = typer.Argument(..., help="A target (gb200, b200, h200, cpu) or the path of a lock file.",
                         autocompletion=lock_names)

_COMPONENT_ROWS = (
    ("torch", "torch"),
    ("transformer_engine", "Transformer Engine"),
    ("cudnn", "cuDNN"),
    ("nccl", "NCCL"),
    ("flash_attn", "flash-attn"),
    ("deepep", "DeepEP"),
    ("megatron_core", "megatron-core"),
    ("efa", "EFA installer"),
    ("muse_stack", "muse-stack"),
)


def _show(loaded: LoadedLock) -> None:
    lock = loaded.lock
    console.print(f"[bold]{lock.name}[/]  {lock.description}", highlight=False)
    console.print(f"lock    {loaded.path}  sha256 {loaded.sha256}", highlight=False)
    console.print(f"kind    {lock.kind}  platform {lock.platform}  ({ba.nix_system(lock.platform)})", highlight=False)
    digest = lock.base.digest.reason if isinstance(lock.base.digest, Null) else lock.base.digest
    console.print(f"base    {lock.base.image}:{lock.base.tag} ({lock.base.source})  digest: {digest}", highlight=False)
    for src in lock.base.digest_sources:
        console.print(f"        source: {src}", highlight=False, markup=False)
    cuda = f"none ({lock.cuda.reason})" if isinstance(lock.cuda, Null) else lock.cuda.version
    console.print(f"cuda    {cuda}", highlight=False)
    console.print(f"python  {lock.python.version} ({lock.python.source})", highlight=False)
    console.print(f"tag     {ba.image_tag(loaded)}", highlight=False)
    # long values (paths, archs, reasons) wrap at any width; nothing is cut with an ellipsis
    t = Table(*(Column(h, overflow="fold") for h in ("component", "version", "package / detail", "CUDA archs")))
    for key, label in _COMPONENT_ROWS:
        comp = getattr(lock.components, key)
        if isinstance(comp, Null):
            t.add_row(label, "-", f"[dim]{comp.reason}[/]", "")
            continue
        if key == "efa":
            sha = comp.installer_sha256.reason if isinstance(comp.installer_sha256, Null) else comp.installer_sha256
            t.add_row(label, comp.installer_version,
                      f"aws-ofi-nccl {comp.aws_ofi_nccl}, libfabric {comp.libfabric}; sha256 {sha} "
                      f"({len(comp.installer_sha256_sources)} source(s))", "")
            continue
        detail = getattr(comp, "package", "") or getattr(comp, "source", "")
        if key == "transformer_engine":
            detail = f"{comp.core_package} + {comp.torch_package} ({comp.build})"
        archs = ";".join(getattr(comp, "cuda_archs", []))
        t.add_row(label, comp.version, detail, archs)
    console.print(t)
    if lock.deviations:
        d = Table(*(Column(h, overflow="fold") for h in ("deviation", "recorded", "locked", "reason")),
                  title="deliberate deviations from the record")
        for dev in lock.deviations:
            d.add_row(dev.field, dev.recorded, dev.locked, dev.reason)
        console.print(d)
    for field, reason in unresolved(lock):
        console.print(f"[yellow]unresolved[/] {field}: {reason}", highlight=False)


def _labels_from_inspect(path: Path) -> dict[str, str]:
    """Labels from `docker image inspect` (Config.Labels) or `podman image inspect` (Labels) output."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LockError(f"cannot read {path}: {exc}", field="--inspect", value=str(path), exit_code=3) from None
    obj = data[0] if isinstance(data, list) and data else data
    labels = obj.get("Labels") or (obj.get("Config") or {}).get("Labels") or {}
    return {str(k): str(v) for k, v in labels.items()}


def _compare(loaded: LoadedLock, found: dict[str, Any], source: str, keys: dict[str, str]) -> list[str]:
    want = {"name": loaded.name, "sha256": loaded.sha256}
    bad = []
    for what, key in keys.items():
        if found.get(key) != want[what]:
            bad.append(f"{source} {key} = {found.get(key)!r}, the lock gives {want[what]!r}")
    return bad


def _against_record(loaded: LoadedLock) -> list[str]:
    """Compare with the stack recorded by the lock's reference recipe, when the catalogue has it."""
    ref = loaded.lock.reference
    if ref is None:
        return []
    try:
        from muse_stack.recipes.catalogue import load_recipe

        stack = load_recipe(ref.recipe).stack
    except Exception as exc:  # the catalogue is another area; a missing recipe is reported, not fatal
        console.print(f"[yellow]record[/] {ref.recipe}: not compared ({type(exc).__name__}: {exc})", highlight=False)
        return []
    if stack is None:
        console.print(f"[yellow]record[/] {ref.recipe}: the recipe records no stack", highlight=False)
        return []
    checks = record.compare(loaded.lock, stack.model_dump() if hasattr(stack, "model_dump") else dict(stack))
    same = sum(x.ok for x in checks)
    declared = [d.field for d in loaded.lock.deviations]
    # deviations (not pins): how many of the declared ones cover at least one compared pin that differs
    covering = len(record.covering_deviations(loaded.lock, checks))
    # the same deviations `stack show` lists: every one the lock declares, whether or not it covers
    # a compared version pin (the base image is not a version pin, and a fork at the same version matches)
    console.print(
        f"record {ref.recipe}: {same} of {len(checks)} pins as recorded; {len(declared)} declared deviation(s)"
        + (f" ({', '.join(declared)}; {covering} of them cover a pin that differs)" if declared else ""),
        highlight=False,
    )
    return record.problems(checks)


@stack_app.command("show")
def show_cmd(
    target: str = _TARGET,
    as_json: bool = typer.Option(False, "--json", help="Print the parsed lock as JSON."),
) -> None:
    """Show a lock: base, CUDA, Python, component pins, deviations, unresolved pins."""
    loaded = load(target)
    if as_json:
        out = {"path": str(loaded.path), "sha256": loaded.sha256, "lock": loaded.lock.model_dump(by_alias=True)}
        typer.echo(json.dumps(out, indent=2))
    else:
        _show(loaded)


@stack_app.command("build-args")
def build_args_cmd(
    target: str = _TARGET,
    as_json: bool = typer.Option(False, "--json", help="Print JSON with the args, tag, Nix system, capabilities."),
) -> None:
    """Print the image build arguments the lock yields, one KEY=VALUE a line."""
    loaded = load(target)
    if as_json:
        typer.echo(json.dumps(ba.summary(loaded), indent=2))
    else:
        for k, v in ba.build_args(loaded).items():
            typer.echo(f"{k}={v}")


@stack_app.command("check")
def check_cmd(
    target: str = _TARGET,
    strict: bool = typer.Option(False, "--strict", help="Fail on unresolved pins (null digests, hashes, commits)."),
    image_info: Path = typer.Option(None, "--image-info", help="An image's /etc/muse-stack/image.json to check."),
    inspect: Path = typer.Option(None, "--inspect", help="`docker|podman image inspect` output to check."),
) -> None:
    """Validate a lock; optionally check an image's identity (image.json, labels) against it."""
    loaded = load(target)
    lock = loaded.lock
    problems: list[str] = []
    if lock.components.muse_stack.version != __version__:
        problems.append(
            f"components.muse_stack.version = {lock.components.muse_stack.version!r} but this "
            f"muse-stack is {__version__!r}"
        )
    if image_info is not None:
        try:
            info = json.loads(Path(image_info).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise LockError(
                f"cannot read {image_info}: {exc}", field="--image-info", value=str(image_info), exit_code=3
            ) from None
        problems += _compare(loaded, info, "image.json", {"name": "lock_name", "sha256": "lock_sha256"})
    if inspect is not None:
        labels = _labels_from_inspect(Path(inspect))
        problems += _compare(
            loaded, labels, "label", {"name": "dev.muse-stack.lock.name", "sha256": "dev.muse-stack.lock.sha256"}
        )
    problems += _against_record(loaded)
    from muse_stack.stack import wheelset

    ws = wheelset.check(loaded)
    if ws.ok:
        console.print(
            f"wheel set {wheelset.set_path(loaded).name}: {len(ws.packages)} packages, every component at the "
            f"lock's version, {len(lock.overrides)} declared override(s)",
            highlight=False,
        )
    problems += [f"wheel set: {p}" for p in ws.problems]
    pending = unresolved(lock)
    for field, reason in pending:
        console.print(f"[yellow]unresolved[/] {field}: {reason}", highlight=False)
    if problems:
        raise LockError(
            f"{loaded.path} does not match: " + "; ".join(problems),
            field="lock",
            value=loaded.name,
            rule="an image and the muse-stack it carries are built from exactly this lock",
            fix="rebuild the image from this lock (make image gpu=<target>) or check the lock it was built from",
            exit_code=1,
        )
    if strict and pending:
        raise LockError(
            f"{len(pending)} unresolved pin(s) in {loaded.path}: " + ", ".join(f for f, _ in pending),
            field=pending[0][0],
            value=None,
            rule="--strict: a release lock pins every digest, checksum and source commit",
            fix=pin_fix(loaded.name, [f for f, _ in pending]),
            exit_code=1,
        )
    console.print(
        f"[green]ok[/] {loaded.name}: {loaded.path} sha256 {loaded.sha256}"
        + (f" ({len(pending)} unresolved)" if pending else ""),
        highlight=False,
    )


@stack_app.command("pins")
def pins_cmd(
    target: str = _TARGET,
    write: bool = typer.Option(False, "--write", help="Write the pins the lock leaves null (with their source)."),
) -> None:
    """On a networked builder: read the base image's index digest and the EFA installer's sha256
    from the registry and the download, compare them with the lock, and (--write) pin the null ones."""
    from muse_stack.stack import pins as pn

    for p in pn.run(target, write=write):
        state = "ok" if p.ok else ("written" if write and p.locked is None else "unpinned")
        console.print(f"{state:9} {p.field} = {p.found}  ({p.how})", highlight=False, markup=False)


@stack_app.command("preflight")
def preflight_cmd(
    target: str = _TARGET,
    engine: str = typer.Option("docker", "--engine", envvar="ENGINE", help="docker (buildx) or podman."),
) -> None:
    """Refuse an image build, before any download, when a pin is unresolved, the wheel set is stale,
    the build tool is missing or the builder cannot produce the lock's platform."""
    from muse_stack.stack import preflight as pf

    loaded = load(target)
    pf.check(loaded, engine)
    console.print(f"[green]ok[/] {loaded.name}: {engine} can build {loaded.lock.platform} from this lock", highlight=False)


@stack_app.command("selfcheck")
def selfcheck_cmd(
    target: str = _TARGET,
    image: bool = typer.Option(
        False, "--image", help="Inside an image: also fail on any package installed outside the wheel set."
    ),
    json_out: Path = typer.Option(None, "--json", help="Write the full report as JSON here."),
) -> None:
    """Check this Python environment against a lock and its wheel set: every package at the set's
    version, and every component importing at the locked version (cuDNN and NCCL as loaded)."""
    from muse_stack.stack import selfcheck as sc

    loaded = load(target)
    report = sc.run(loaded, image=image)
    t = Table("component", "locked", "found", "", title=f"{loaded.name}: components as imported and loaded")
    for i in report["components"]:
        t.add_row(i["what"], i["want"], i["got"], "[green]ok[/]" if i["ok"] else "[red]differs[/]")
    console.print(t)
    rows = report["wheel_set"]
    same = sum(r["ok"] for r in rows[1:])
    console.print(f"wheel set: {same} of {len(rows) - 1} packages installed at the set's version", highlight=False)
    if report["outside_set"]:
        console.print(f"outside the set: {len(report['outside_set'])} distribution(s)", highlight=False)
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n")
    if not report["ok"]:
        raise LockError(
            f"this environment is not what {loaded.path.name} and its wheel set say: " + "; ".join(report["problems"]),
            field="environment",
            value=loaded.name,
            rule="an image holds exactly its lock's wheel set and components",
            fix="rebuild the image from the lock (make image gpu=TARGET); in a checkout, install the wheel set",
            exit_code=1,
        )
    console.print(f"[green]ok[/] {loaded.name}: environment matches the lock and its wheel set", highlight=False)


@stack_app.command("resolve")
def resolve_cmd(
    targets: list[str] = typer.Argument(None, help="Targets or lock paths (default: every lock).",
                                         autocompletion=lock_names),
    check_only: bool = typer.Option(
        False, "--check", help="Drift: resolve the lock's requirements again and compare with the committed set; write nothing."
    ),
    pinned: bool = typer.Option(
        False, "--pinned",
        help="The committed set's promise: resolved from its own pins it gives itself, and the registry serves "
        "every committed file with its hash (no later upload changes the answer); write nothing.",
    ),
) -> None:
    """Resolve each lock into its hash-pinned wheel set (pylock.<target>.toml) with uv."""
    from muse_stack.stack import wheelset
    from muse_stack.stack.lock import locks_dir

    names = targets or sorted(p.stem for p in locks_dir().glob("*.toml") if not p.stem.startswith("pylock."))
    failed = []
    for name in names:
        loaded = load(name)
        with console.status(f"resolving {loaded.name} with uv ..."):
            if pinned:
                diffs = wheelset.verify_pinned(loaded)
            elif check_only:
                diffs = wheelset.resolve_and_compare(loaded)
            else:
                path = wheelset.write(loaded)
        if check_only or pinned:
            if diffs:
                failed.append(loaded.name)
                for d in diffs:
                    console.print(f"[red]{loaded.name}[/] {d}", highlight=False, markup=False)
            else:
                what = "its committed set resolves to itself, every file served as committed" if pinned else \
                    "resolves to the committed set"
                console.print(f"[green]ok[/] {loaded.name}: {what}", highlight=False)
        else:
            n = len(wheelset.check(loaded).packages)
            console.print(f"wrote {path} ({n} packages)", highlight=False)
    if failed:
        names = ", ".join(failed)
        raise LockError(
            f"the committed wheel set no longer holds for: {names}" if pinned else
            f"the committed wheel set differs from a fresh resolution for: {names}",
            field="wheel set",
            value=names,
            rule="a committed set resolves to itself from its own pins and the registry serves its files as hashed"
            if pinned else "a wheel set is what the resolver makes of its lock",
            fix="review the packages above, then `muse-stack stack resolve TARGET` and commit the set" if pinned else
            "review the differences above, then `muse-stack stack resolve TARGET` and commit the set",
            exit_code=1,
        )


def register(app: typer.Typer) -> None:
    app.add_typer(stack_app, name="stack")

"""The labelled set the secret detector is measured on, and the measurement.

The set is ``tests/unit/data/secret_labels.yaml``: real secrets and real non-secrets, each written by
hand or generated from a template in the provider's format with random content (a fixed seed: the
same strings on every machine). An item is a value as a user gives it anywhere (a recipe value, an
override, a launch option, a data field, a path), or a ``key`` and a value (a recipe key, or with
``env: true`` an environment variable's name, which the rule reads by any word in it). The detector
is :func:`muse_stack.util.credentials.findings`, the one rule every check uses: an item is refused
when it finds anything.

    from lab.secret_labels import labelled, measure
    rates = measure(labelled())
"""

from __future__ import annotations

import base64
import json
import random
import string
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from muse_stack.util import credentials

REPO = Path(__file__).resolve().parents[2]
LABELS = REPO / "tests" / "unit" / "data" / "secret_labels.yaml"

#: the alphabets a template draws from: ``{NAME:N}`` is N characters of NAME
ALPHABETS = {
    "alnum": string.ascii_letters + string.digits,
    "lower_alnum": string.ascii_lowercase + string.digits,
    "upper_alnum": string.ascii_uppercase + string.digits,
    "hex": "0123456789abcdef",
    "b64": string.ascii_letters + string.digits + "+/",
    "b64url": string.ascii_letters + string.digits + "-_",
    "digits": string.digits,
    "lower": string.ascii_lowercase,
    "nix32": "0123456789abcdfghijklmnpqrsvwxyz",  # Nix's base-32
    "crockford": "0123456789ABCDEFGHJKMNPQRSTVWXYZ",  # a ULID's
    "crockford_lower": "0123456789abcdefghjkmnpqrstvwxyz",
    "ulid_first": "01234567",  # a ULID's first character (48-bit time)
    "printable": string.ascii_letters + string.digits + "!#%*+-.=?@^_~",
    "tempfile": "abcdefghijklmnopqrstuvwxyz0123456789_",  # Python's tempfile names
}
#: words for names (folders, projects, run names)
WORDS = ("experiments", "december", "sweep", "ablation", "baseline", "finetune", "research", "shared", "team",
         "scratch", "muse", "spark", "tulu", "eval", "longctx", "vision", "audio", "nightly", "release", "data")


@dataclass(frozen=True)
class Item:
    """One labelled case."""

    id: str
    secret: bool
    kind: str
    origin: str  # "generated" or "hand-written"
    value: str
    key: str | None = None
    env: bool = False

    def data(self) -> Any:
        return {self.key: self.value} if self.key is not None else self.value


def _b64(rng: random.Random, nbytes: int, alphabet: str = "url") -> str:
    raw = bytes(rng.randrange(256) for _ in range(nbytes))
    return (base64.urlsafe_b64encode(raw).decode().rstrip("=") if alphabet == "url"
            else base64.b64encode(raw).decode())


def _jwt(rng: random.Random) -> str:
    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj, separators=(",", ":")).encode()).decode().rstrip("=")

    header = part({"alg": rng.choice(["HS256", "RS256", "ES256"]), "typ": "JWT"})
    payload = part({"sub": str(rng.randrange(10**9)), "iat": 1700000000 + rng.randrange(10**7),
                    "scope": rng.choice(["read", "write", "admin"])})
    return f"{header}.{payload}.{_b64(rng, 32)}"


def _pem(rng: random.Random) -> str:
    kind = rng.choice(["PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY", "OPENSSH PRIVATE KEY"])
    body = _b64(rng, 192, alphabet="std")
    lines = "\n".join(body[i:i + 64] for i in range(0, len(body), 64))
    return f"-----BEGIN {kind}-----\n{lines}\n-----END {kind}-----\n"


def _field(name: str, rng: random.Random) -> str:
    """One ``{...}`` of a template."""
    if name == "jwt":
        return _jwt(rng)
    if name == "pem":
        return _pem(rng)
    if name == "pem_json":  # a PEM as a JSON string holds it (a service-account file)
        return _pem(rng).replace("\n", "\\n")
    if name == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if name == "word":
        return rng.choice(WORDS)
    if name.startswith("pick:"):
        return rng.choice(name[5:].split("|"))
    if name.startswith("int:"):
        low, high = (int(x) for x in name[4:].split("-"))
        return str(rng.randint(low, high))
    if name.startswith("b64bytes:"):
        return _b64(rng, int(name[9:]), alphabet="std")
    alphabet, _, n = name.partition(":")
    if alphabet not in ALPHABETS or not n.isdigit():
        raise ValueError(f"unknown template field {{{name}}}: use {{ALPHABET:N}} with one of {sorted(ALPHABETS)}, "
                         "or jwt, pem, pem_json, uuid, word, pick:a|b, int:LOW-HIGH, b64bytes:N")
    return "".join(rng.choices(ALPHABETS[alphabet], k=int(n)))


def expand(template: str, rng: random.Random) -> str:
    """``template`` with each ``{field}`` drawn (``{{`` and ``}}`` are braces)."""
    out, i = [], 0
    while i < len(template):
        if template.startswith("{{", i) or template.startswith("}}", i):
            out.append(template[i])
            i += 2
        elif template[i] == "{":
            end = template.index("}", i)
            out.append(_field(template[i + 1:end], rng))
            i = end + 1
        else:
            out.append(template[i])
            i += 1
    return "".join(out)


def labelled(path: Path = LABELS) -> tuple[list[Item], dict[str, dict[str, str]]]:
    """Every item of the set, and the accepted misses and false refusals (``{"misses": {id: why},
    "false_refusals": {id: why}}``) the file states."""
    doc = yaml.safe_load(path.read_text())
    items: list[Item] = []
    for label in ("secrets", "not_secrets"):
        for group in doc["generated"][label]:
            rng = random.Random(f"{doc['generated']['seed']}:{group['kind']}")
            for i in range(group["count"]):
                items.append(Item(id=f"{group['kind']}#{i}", secret=label == "secrets", kind=group["kind"],
                                  origin="generated", value=expand(group["template"], rng), key=group.get("key"),
                                  env=bool(group.get("env"))))
        for group in doc["hand_written"][label]:
            for i, entry in enumerate(group["values"]):
                entry = entry if isinstance(entry, dict) else {"value": entry}
                items.append(Item(id=f"{group['kind']}/{i}", secret=label == "secrets", kind=group["kind"],
                                  origin="hand-written", value=str(entry["value"]), key=entry.get("key"),
                                  env=bool(entry.get("env"))))
    ids = [item.id for item in items]
    if len(ids) != len(set(ids)):
        raise ValueError(f"{path}: two groups share a kind")
    accepted = {"misses": doc.get("accepted_misses") or {}, "false_refusals": doc.get("accepted_false_refusals") or {}}
    return items, accepted


def refused(item: Item) -> bool:
    """What the detector says of one item: refused (a credential) or passed."""
    name = (lambda n: credentials.is_secret_key(n, env=True)) if item.env else credentials.is_secret_key
    return bool(credentials.findings(item.data(), secret_name=name))


def measure(items: list[Item]) -> dict[str, Any]:
    """The miss rate (secrets passed / secrets) and the false-refusal rate (non-secrets refused /
    non-secrets), in all and by origin and kind, with the ids of every miss and false refusal."""
    verdicts = {item.id: refused(item) for item in items}

    def rates(subset: list[Item]) -> dict[str, Any]:
        secrets = [i for i in subset if i.secret]
        others = [i for i in subset if not i.secret]
        misses = [i.id for i in secrets if not verdicts[i.id]]
        false = [i.id for i in others if verdicts[i.id]]
        return {"secrets": len(secrets), "not_secrets": len(others), "misses": len(misses),
                "false_refusals": len(false),
                "miss_rate": len(misses) / len(secrets) if secrets else None,
                "false_refusal_rate": len(false) / len(others) if others else None,
                "missed": misses, "falsely_refused": false}

    out = rates(items)
    out["by_origin"] = {o: rates([i for i in items if i.origin == o]) for o in ("generated", "hand-written")}
    out["by_kind"] = {k: {key: v for key, v in rates([i for i in items if i.kind == k]).items()
                          if key not in ("missed", "falsely_refused")}
                      for k in sorted({i.kind for i in items})}
    return out

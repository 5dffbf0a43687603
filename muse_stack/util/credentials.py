"""What a credential looks like, so that none reaches a file or a stream whatever it is called.

Secrets enter muse-stack only by reference: ``${env:NAME}`` is resolved from the environment when
the job runs (the chat template, an sbatch ``export``, a Kubernetes ``secretKeyRef``) and only the
reference is ever written. A literal credential in a recipe, an override, a path or a URL is
refused before anything is written (:func:`findings`), naming the field, never echoing the value:

- under a secret-named key (:func:`is_secret_key`, the one rule for secret names: token, key,
  secret, password, pass, pwd, auth, bearer, pat, credential, cookie, session, signature, private,
  ...; for an environment variable's name, such a word anywhere in it), any literal string;
- under any key, a value shaped like a credential (:func:`shape`): a URL's ``user:password@``
  (with ``scheme://``, a path normaliser's ``scheme:/``, or no scheme at all), a secret-named
  query parameter (``?token=``, ``&sig=``, ``X-Amz-Signature=``), an ``Authorization`` scheme
  (``Bearer ...``), the prefixes of known tokens (GitHub ``ghp_``/``github_pat_``, Hugging Face
  ``hf_``, OpenAI ``sk-``, Slack ``xox?-``, GitLab ``glpat-``, Google ``AIza``, npm ``npm_``,
  AWS access key ids), JSON web tokens, PEM private keys, and high-entropy strings (20 or more
  letters and digits mixed as random text mixes them, :func:`looks_random`).

A value of hex digits alone is a hash or a commit as far as its shape tells (``rows_sha256``,
``revision``), so it is refused only under a secret-named key.

As a last guard every file muse-stack writes as text, and every error it prints, passes through
:func:`redact_text`, which replaces the unambiguous shapes (not the entropy test: it would hit
hashes). This module imports nothing from muse-stack, so the errors and the file readers can both
use it.
"""

from __future__ import annotations

import math
import re
import reprlib
from typing import Any, Callable

REDACTED = "<redacted>"
#: a reference to the launching environment, resolved when the job runs and never written
ENV_REFERENCE = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
#: a shell reference kept as it is in a launch file (``$NAME``, ``${NAME}``)
SHELL_REFERENCE = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*|\{[A-Za-z_][A-Za-z0-9_]*\})")
#: what a refusal tells the user to do instead
FIX = ("reference the environment instead, resolved when the job runs and never written: e.g. "
       "env.WANDB_API_KEY=${env:WANDB_API_KEY} or data.template_kwargs.api_key=${env:MY_KEY}; give a URL's "
       "credentials through the environment (HF_TOKEN, ~/.netrc), not in the URL")

#: user[:password]@ after a URL's scheme; one slash too (``https:/u:p@h``, what path normalisation
#: makes of ``https://u:p@h``)
URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*:/{1,3})[^/@\s:]+(:[^/@\s]*)?@")
#: user:password@host without a scheme (an image reference, a registry, an rsync target); an image
#: digest (``name:tag@sha256:...``) is not one, and neither is Slurm's ``--signal=B:TERM@120``: the
#: host has a dot, or a ':', '/' or '#' after it, or is an [IPv6] address
_BARE_USERINFO = re.compile(r"(?<![A-Za-z0-9+.-])(?P<user>[A-Za-z0-9._%+~-]+):(?P<pw>[^\s/@:]+)@"
                            r"(?!sha\d+:)"
                            r"(?=[A-Za-z0-9-]+\.[A-Za-z0-9]|[A-Za-z0-9.-]+[:/#]|\[)")
#: the words of a secret's name: a key word is one of these or, for the long ones, ends in one
_LONG_WORDS = ("TOKEN", "APIKEY", "ACCESSKEY", "SECRETKEY", "PRIVATEKEY", "SSHKEY", "SECRET", "PASSWORD", "PASSWD",
               "PASSPHRASE", "PASSCODE", "CREDENTIAL", "CREDENTIALS", "AUTH", "COOKIE", "PRIVATE", "SIGNATURE",
               "SESSION", "BEARER", "DSN")
_SHORT_WORDS = ("KEY", "PASS", "PWD", "PW", "PAT", "SIG", "JWT", "CRED", "CREDS")
_WORD = re.compile(rf"(?:{'|'.join(_LONG_WORDS)})$", re.I)
#: in a name muse-stack does not define (``is_secret_key(name, env=True)``): a long word or KEY anywhere
_ANYWHERE = re.compile(f"{'|'.join(_LONG_WORDS + ('KEY',))}", re.I)
#: words that name nothing but a secret wherever they stand in a name (``client_secret_id``); the
#: others only as the last word (``pad_token_id`` and ``num_key_value_heads`` are model fields)
_ONLY_SECRET = frozenset({"SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "CREDENTIALS", "BEARER",
                          "APIKEY", "SECRETKEY", "PRIVATEKEY", "ACCESSKEY"})
#: names that hold one of the words but no secret
NOT_SECRET_NAMES = frozenset({"TOKENIZERS_PARALLELISM", "HF_HUB_DISABLE_IMPLICIT_TOKEN"})
_QUERY = re.compile(r"(?P<lead>[?&;#](?P<name>[A-Za-z0-9_.\-\[\]]{1,64})=)(?P<value>[A-Za-z0-9%._~+/$-][^&#\s\"'<>`]*)")
_AUTH_SCHEME = re.compile(r"(?P<lead>\b(?:[Bb]earer|BEARER|Basic|[Tt]oken|Digest)\s+)"
                          r"(?P<value>(?=[A-Za-z0-9._~+/=-]*[0-9])[A-Za-z0-9._~+/=-]{8,})")
_EDGE = r"(?<![A-Za-z0-9])"
#: tokens whose prefix says what they are
KNOWN_TOKENS = re.compile("|".join([
    rf"{_EDGE}(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{{20,}}",
    rf"{_EDGE}github_pat_[A-Za-z0-9_]{{20,}}",
    rf"{_EDGE}hf_[A-Za-z0-9]{{20,}}",
    rf"{_EDGE}sk-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_-]{{16,}}",
    rf"{_EDGE}[rs]k_(?:live|test)_[A-Za-z0-9]{{16,}}",
    rf"{_EDGE}xox[abposr]-[A-Za-z0-9-]{{10,}}",
    rf"{_EDGE}glpat-[A-Za-z0-9_-]{{20,}}",
    rf"{_EDGE}AIza[A-Za-z0-9_-]{{35}}",
    rf"{_EDGE}npm_[A-Za-z0-9]{{36}}",
    rf"{_EDGE}(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{{16}}(?![A-Za-z0-9])",
    rf"{_EDGE}eyJ[A-Za-z0-9_-]{{8,}}\.eyJ[A-Za-z0-9_-]{{8,}}\.[A-Za-z0-9_-]*",
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
]))
_SPLIT = re.compile(r"[/+=_-]+")
_HEX = re.compile(r"[0-9a-fA-F]+")
_KINDS = (re.compile("[a-z]"), re.compile("[A-Z]"), re.compile("[0-9]"))
_WORDLIKE = re.compile(r"[A-Z]?[a-z]{3,}|[A-Z]{2,5}(?![a-z])|[0-9]{2,}")
_ALNUM_TOKEN = re.compile(r"[A-Za-z0-9+/=_-]{20,}")


def is_secret_key(name: str, *, env: bool = False) -> bool:
    """The one rule for a name that holds a secret, whatever names it: a recipe or config key, an
    override's path, a query parameter, an environment variable, a caller's free-form key.

    A name is secret when its last word (split at '_', '-', '.', spaces and case changes) is a
    secret word, or ends in one of the long ones, or any word is one that names nothing but a
    secret (secret, password, credential, bearer, ...): ``api_key``, ``hfToken``, ``DB_PASS``,
    ``GITHUB_PAT``, ``pwd``, ``bearer`` and ``client_secret_id`` are; ``tokenizer``,
    ``row_tokens``, ``path``, ``pad_token_id``, ``num_key_value_heads`` and
    ``TOKENIZERS_PARALLELISM`` are not.

    ``env=True`` is for names muse-stack does not define (environment variables, a caller's
    free-form keys), where no model field can collide: there a long secret word or ``KEY``
    anywhere in the name counts too, inside a longer word included (``HF_TOKEN_PATH``,
    ``MY_AUTH_MODE``, ``SSH_KEYFILE``); a false alarm there costs only a ``${env:NAME}`` reference
    in a recipe, or a value the fingerprint records by name."""
    name = str(name)
    if name.upper() in NOT_SECRET_NAMES:
        return False
    words = [w for w in re.split(r"[_\-.\s]+|(?<=[a-z0-9])(?=[A-Z])", name) if w]
    if not words:
        return False
    last = words[-1]
    if last.upper() in _SHORT_WORDS or bool(_WORD.search(last)) or any(w.upper() in _ONLY_SECRET for w in words):
        return True
    return env and bool(_ANYWHERE.search(name))


def looks_random(token: str) -> bool:
    """A run of 20+ letters, digits and ``+/=_-`` that reads as random text: split at ``/+=_-``
    and with the hex-only parts (hashes, UUIDs) left out, at least 16 letters and digits outside
    the parts that are one word-like run (``tmp``, ``run``, ``12``: a path's folders, so that
    ``/tmp/tmp4go0z3ol/run``, a temporary folder's 11 characters, is not a credential), of at
    least two kinds (lower case, upper case, digits), less than 60% of them in word-like runs
    (a capitalised or lower-case run of 3+ letters, 2-5 capitals, 2+ digits: names such as
    ``MuseSparkOpenForCausalLM``, dates and versions are), and a high spread of characters
    (Shannon entropy of at least 3.5 bits a character); or, a part of 30 letters and digits with an
    entropy of at least 4.4 bits (words and names repeat their letters more: 4.0-4.3)."""
    parts = [p for p in _SPLIT.split(token) if p and not _HEX.fullmatch(p)]
    text = "".join(parts)
    unworded = sum(len(p) for p in parts if not _WORDLIKE.fullmatch(p))
    if unworded < 16 or sum(bool(k.search(text)) for k in _KINDS) < 2:
        return False
    worded = sum(len(m) for p in parts for m in _WORDLIKE.findall(p))
    entropy = _entropy(text)
    return entropy >= 3.5 and (worded / len(text) < 0.6 or any(len(p) >= 30 and _entropy(p) >= 4.4 for p in parts))


def _entropy(text: str) -> float:
    counts: dict[str, int] = {}
    for c in text:
        counts[c] = counts.get(c, 0) + 1
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())


def _reference(value: str) -> bool:
    value = value.strip()
    return bool(ENV_REFERENCE.fullmatch(value) or SHELL_REFERENCE.fullmatch(value))


def _secret_query(m: re.Match[str]) -> bool:
    value = m.group("value")
    return is_secret_key(m.group("name").replace("[", "_").replace("]", "_")) and not \
        _reference(value)


def shape(text: str) -> str | None:
    """What credential ``text`` holds, by its shape whatever its key ("a URL's user:password", ...),
    or None. ``${env:NAME}`` references are not credentials."""
    if not isinstance(text, str) or not text:
        return None
    text = ENV_REFERENCE.sub("", text)
    if URL_CREDENTIALS.search(text):
        return "a URL's user:password@"
    if _BARE_USERINFO.search(text):
        return "user:password@host"
    if any(_secret_query(m) for m in _QUERY.finditer(text)):
        return "a secret query parameter (?token=...)"
    if _AUTH_SCHEME.search(text):
        return "an Authorization value (Bearer ...)"
    if KNOWN_TOKENS.search(text):
        return "an access token or key"
    if any(looks_random(t) for t in _ALNUM_TOKEN.findall(text)):
        return "a high-entropy string"
    return None


def findings(data: Any, path: str = "", *, under_secret: bool = False,
             secret_name: Callable[[str], bool] = is_secret_key) -> list[tuple[str, str]]:
    """``(dotted path, why)`` for every literal credential under ``data``: a string under a
    secret-named key (``secret_name``) that is not a reference (``${env:NAME}``, or ``$NAME`` kept
    for the shell), a credential-shaped string or key anywhere. Sequences are ``path[i]``."""
    out: list[tuple[str, str]] = []
    if isinstance(data, dict):
        for key, value in data.items():
            where = f"{path}.{key}" if path else str(key)
            if shape(str(key)):  # named by where it stands: the key itself is not shown
                out.append((f"{path}.{REDACTED}" if path else REDACTED, f"a key holds {shape(str(key))}"))
                continue
            out.extend(findings(value, where, under_secret=under_secret or secret_name(str(key)),
                                secret_name=secret_name))
    elif isinstance(data, (list, tuple)):
        for i, value in enumerate(data):
            out.extend(findings(value, f"{path}[{i}]", under_secret=under_secret, secret_name=secret_name))
    elif isinstance(data, str):
        why = shape(data)
        if why:
            out.append((path, f"the value holds {why}"))
        elif under_secret and data and not _reference(data):
            out.append((path, "a secret-named key holds a literal value"))
    return out


def redact_text(text: str) -> str:
    """``text`` with every credential of an unambiguous shape replaced by ``<redacted>``: URL
    credentials (keeping ``scheme://<redacted>@host``), secret query values, Authorization values,
    known tokens and private keys. The last guard on every text file and every error."""
    if not text:
        return text
    if ":/" in text:
        text = URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    if "@" in text:
        text = _BARE_USERINFO.sub(f"{REDACTED}@", text)
    if "=" in text:
        text = _QUERY.sub(lambda m: m.group("lead") + REDACTED if _secret_query(m) else m.group(0), text)
    text = _AUTH_SCHEME.sub(lambda m: m.group("lead") + REDACTED, text)
    return KNOWN_TOKENS.sub(REDACTED, text)


_repr = reprlib.Repr()
_repr.maxstring = 120
_repr.maxother = 120
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 8
_repr.maxlevel = 3


def short_repr(value: Any) -> str:
    """repr() bounded in length and depth (error messages never repr an unbounded value), with
    credentials redacted; a credential-shaped string, or one cut short where a credential may
    have been cut, is shown as ``'<redacted>'``."""
    if isinstance(value, str) and shape(value):
        return repr(REDACTED)
    return redact_text(_repr.repr(value))

"""What a credential looks like, so that none reaches a file or a stream whatever it is called.

Secrets enter muse-stack only by reference: ``${env:NAME}`` is resolved from the environment when
the job runs (the chat template, an sbatch ``export``, a Kubernetes ``secretKeyRef``) and only the
reference is ever written. A literal credential in a recipe, an override, a path or a URL is
refused before anything is written (:func:`findings`), naming the field, never echoing the value:

- under a secret-named key (:func:`is_secret_key`, the one rule for secret names: token, key,
  secret, password, pass, pwd, auth, bearer, pat, credential, cookie, session, signature, private,
  ...; for an environment variable's name, such a word anywhere in it), any literal string;
- under any key, a value shaped like a credential (:func:`shape`): a URL's ``user:password@``
  or ``:password@`` (with ``scheme://``, a path normaliser's ``scheme:/``, or no scheme at all), a
  URL's user name that is not a name, a secret-named query parameter (``?token=``, ``&sig=``,
  ``X-Amz-Signature=``), an ``Authorization`` scheme (``Bearer ...``), tokens of a known shape
  (GitHub ``ghp_``/``github_pat_``, Hugging Face ``hf_``, OpenAI ``sk-``, Slack ``xox?-``, GitLab
  ``glpat-``, Google ``AIza``, npm ``npm_``, AWS access key ids, ..., a prefix followed by random
  text, not words), webhook URLs, JSON web tokens, PEM private keys, a secret-named assignment in
  text (``WANDB_API_KEY=...``), and high-entropy strings (20 or more letters and digits mixed as
  random text mixes them, :func:`looks_random`; a path folder by folder).

How often the rule is wrong is measured on a labelled set (tests/unit/data/secret_labels.yaml,
benchmarks/scripts/secret_detector_rates.py).

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

#: [user]:password@ after a URL's scheme, the user name empty too (``redis://:pw@host``); one slash
#: too (``https:/u:p@h``, what path normalisation makes of ``https://u:p@h``). A user name alone
#: (``ssh://git@host/...``) names an account, not a secret; a password that is a reference
#: (``$PW``, ``${PW}``, ``${env:PW}``) is kept as it is
URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*:/{1,3})[^/@\s:]*:"
                             r"(?!\$(?:[A-Za-z_][A-Za-z0-9_]*|\{(?:env:)?[A-Za-z_][A-Za-z0-9_]*\})@)[^/@\s]+@")
#: a user name alone after a URL's scheme: a credential when it is not a name (a token given as the
#: user, ``https://s3cr3t-t0ken-1234@host``); ``ssh://git@host`` and ``https://alice@host`` name accounts
URL_USER = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*:/{1,3})(?P<user>[^/@\s:]+)@")
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
#: the last word of a name that says where a secret is kept, not the secret: ``HF_TOKEN_PATH``,
#: ``SSH_KEY_FILE``, ``AWS_SHARED_CREDENTIALS_FILE``, ``SSH_KEYFILE`` (its value, a path, is still
#: checked by its shape)
LOCATION_WORDS = frozenset({"PATH", "PATHS", "FILE", "FILES", "FILENAME", "KEYFILE", "DIR", "DIRS", "DIRECTORY",
                            "FOLDER", "LOCATION"})
#: names whose value is by convention a path to a secret's file, though their last word is a secret word
LOCATION_NAMES = frozenset({"GOOGLE_APPLICATION_CREDENTIALS"})
#: words that hold a secret word but name something else: an InfiniBand partition key (``NCCL_IB_PKEY``,
#: ``UCX_IB_PKEY``) is a number that picks the fabric's partition
NOT_SECRET_WORDS = frozenset({"PKEY"})
#: ``<role>_token``: a tokenizer's special token (``bos_token``, ``eos_token``: chat-template
#: arguments and tokenizer_config.json fields), text such as ``<s>``, not a credential
SPECIAL_TOKEN_ROLES = frozenset({"BOS", "EOS", "PAD", "UNK", "SEP", "CLS", "MASK", "EOT", "EOM", "IMAGE", "AUDIO",
                                 "VIDEO"})
#: ``<field>_key``: the name of a field of a data row (``messages_key``, which the data builder
#: reads), not a key that opens anything
FIELD_KEY_WORDS = frozenset({"MESSAGES", "MESSAGE", "TEXT", "PROMPT", "PROMPTS", "RESPONSE", "COMPLETION", "IMAGE",
                             "IMAGES", "AUDIO", "VIDEO", "LABEL", "LABELS", "INPUT", "INPUTS", "OUTPUT", "OUTPUTS",
                             "CONTENT", "ROLE", "CONVERSATION", "CONVERSATIONS", "CHOSEN", "REJECTED", "ANSWER",
                             "QUESTION", "CONTEXT", "INSTRUCTION", "SYSTEM", "ID", "SORT", "COLUMN", "FIELD"})
_QUERY = re.compile(r"(?P<lead>[?&;#](?P<name>[A-Za-z0-9_.\-\[\]]{1,64})=)(?P<value>[A-Za-z0-9%._~+/$-][^&#\s\"'<>`]*)")
#: ``NAME=value``, ``NAME: value``, ``"NAME": "value"`` in free text (``WANDB_API_KEY=...`` pasted
#: into a note, ``aws_secret_access_key = ...`` from a credentials file): secret when NAME is a
#: secret name (not a bare short word: ``key:``) and the value is a literal of 8+ characters that is
#: not a plain word, a name or a version
_ASSIGNMENT = re.compile(r"(?<![A-Za-z0-9_.$-])(?P<lead>[\"']?(?P<name>[A-Za-z_][A-Za-z0-9_.-]{0,63})[\"']?\s*[:=](?!=)\s*"
                         r"[\"']?)(?P<value>[A-Za-z0-9+_~!%*@-][A-Za-z0-9+/=_.~!%*@-]{7,})")
#: a version (``google-auth: 2.35.0.post1`` in a package list) is not a secret's value
_VERSION = re.compile(r"[vV]?[0-9]+(?:\.[0-9]+)+(?:[.+-]?[A-Za-z0-9]+)*")
_AUTH_SCHEME = re.compile(r"(?P<lead>\b(?:[Bb]earer|BEARER|Basic|[Tt]oken|Digest)\s+)"
                          r"(?P<value>(?=[A-Za-z0-9._~+/=-]*[0-9])[A-Za-z0-9._~+/=-]{8,})")
_EDGE = r"(?<![A-Za-z0-9])"
#: tokens whose shape says what they are whatever their content
KNOWN_TOKENS = re.compile("|".join([
    rf"{_EDGE}(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{{20,}}",
    rf"{_EDGE}AIza[A-Za-z0-9_-]{{35}}",
    rf"{_EDGE}npm_[A-Za-z0-9]{{36}}",
    rf"{_EDGE}(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{{16}}(?![A-Za-z0-9])",
    rf"{_EDGE}eyJ[A-Za-z0-9_-]{{8,}}\.eyJ[A-Za-z0-9_-]{{8,}}\.[A-Za-z0-9_-]*",
    rf"{_EDGE}SG\.[A-Za-z0-9_-]{{16,}}\.[A-Za-z0-9_-]{{16,}}",  # SendGrid
    rf"{_EDGE}ya29\.[A-Za-z0-9_-]{{20,}}",  # a Google OAuth access token
    rf"{_EDGE}dapi[0-9a-f]{{32}}(?![A-Za-z0-9])",  # Databricks
    rf"{_EDGE}pypi-AgE[A-Za-z0-9_-]{{50,}}",  # a PyPI upload token
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    # a webhook's URL is its credential: whoever has it posts
    r"hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9_/-]{16,}",
    r"discord(?:app)?\.com/api/webhooks/[0-9]+/[A-Za-z0-9_-]{20,}",
]))
#: tokens that start with a provider's prefix (``sk-``, ``hf_``, ``xoxb-``, ...) and go on with
#: random text: a folder called ``sk-experiments-december-2026`` goes on with words, so it is a
#: name, not a key (:func:`_random_body`)
PREFIXED_TOKENS = re.compile("|".join([
    rf"{_EDGE}github_pat_[A-Za-z0-9_]{{20,}}",
    rf"{_EDGE}hf_[A-Za-z0-9]{{20,}}",
    rf"{_EDGE}api_org_[A-Za-z0-9]{{20,}}",
    rf"{_EDGE}sk-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_-]{{16,}}",
    rf"{_EDGE}[rs]k_(?:live|test)_[A-Za-z0-9]{{16,}}",
    rf"{_EDGE}xox[abposre]-[A-Za-z0-9-]{{10,}}",
    rf"{_EDGE}xapp-[0-9]-[A-Za-z0-9-]{{10,}}",
    rf"{_EDGE}glpat-[A-Za-z0-9_-]{{20,}}",
    rf"{_EDGE}GOCSPX-[A-Za-z0-9_-]{{20,}}",
    rf"{_EDGE}dop_v1_[a-f0-9]{{64}}",
    rf"{_EDGE}dckr_pat_[A-Za-z0-9_-]{{20,}}",
    rf"{_EDGE}(?:r8|gsk)_[A-Za-z0-9]{{20,}}",
]))
#: a word of a name (``experiments``, ``December``, ``v2``, ``2026``, ``70b``, ``4k``)
_WORD_PART = re.compile(r"[A-Z]?[a-z]+|[A-Z]+|[0-9]+|[A-Za-z][a-z]*[0-9]{1,4}|[0-9]{1,4}[a-z]{1,2}")
_SPLIT = re.compile(r"[/+=_-]+")
_HEX = re.compile(r"[0-9a-fA-F]+")
_KINDS = (re.compile("[a-z]"), re.compile("[A-Z]"), re.compile("[0-9]"))
_WORDLIKE = re.compile(r"[A-Z]?(?=[a-z]*[aeiouy])[a-z]{2,}|[A-Z]{2,5}(?![a-z])|[0-9]{2,}")
_ALNUM_TOKEN = re.compile(r"[A-Za-z0-9+/=_-]{20,}")
#: identifiers whose randomness is what they are for, read before the entropy test: a Nix store
#: path's hash (32 of Nix's base-32 letters), a ULID (26 of Crockford's base-32, in one case)
_NOT_SECRET_IDS = re.compile(r"(?<=/nix/store/)[0-9a-df-np-sv-z]{32}(?=-)"
                             r"|(?<![A-Za-z0-9])(?:[0-7][0-9A-HJKMNP-TV-Z]{25}|[0-7][0-9a-hjkmnp-tv-z]{25})(?![A-Za-z0-9])")
#: a path where it starts a word (``/shared/...``, ``~/x``, ``./x``) or a URL: its folders are
#: read one by one, as names (a random folder is still a credential)
_PATH = re.compile(r"(?:(?<![^\s=:\"'(,\[{])(?:~|\.{1,2})?/|[A-Za-z][A-Za-z0-9+.-]*:/{1,3})[^\s\"'<>,;)\]}]*")


def is_secret_key(name: str, *, env: bool = False) -> bool:
    """The one rule for a name that holds a secret, whatever names it: a recipe or config key, an
    override's path, a query parameter, an environment variable, a caller's free-form key.

    A name is secret when its last word (split at '_', '-', '.', spaces and case changes) is a
    secret word, or ends in one of the long ones, or any word is one that names nothing but a
    secret (secret, password, credential, bearer, ...): ``api_key``, ``hfToken``, ``DB_PASS``,
    ``GITHUB_PAT``, ``pwd``, ``bearer`` and ``client_secret_id`` are; ``tokenizer``,
    ``row_tokens``, ``path``, ``pad_token_id``, ``num_key_value_heads`` and
    ``TOKENIZERS_PARALLELISM`` are not. Nor is a name that says where a secret is kept or that
    names something else (its value is still checked by its shape): a last word in
    :data:`LOCATION_WORDS` (``HF_TOKEN_PATH``, ``SSH_KEY_FILE``), :data:`LOCATION_NAMES`
    (``GOOGLE_APPLICATION_CREDENTIALS``), a special token (``bos_token``), a row's field
    (``messages_key``), an InfiniBand partition key (``NCCL_IB_PKEY``).

    ``env=True`` is for names muse-stack does not define (environment variables, a caller's
    free-form keys), where no model field can collide: there a long secret word or ``KEY``
    anywhere in the name counts too, inside a longer word included (``MY_AUTH_MODE``,
    ``MONKEY``); a false alarm there costs only a ``${env:NAME}`` reference in a recipe, or a
    value the fingerprint records by name."""
    name = str(name)
    if name.upper() in NOT_SECRET_NAMES or name.upper() in LOCATION_NAMES:
        return False
    words = [w for w in re.split(r"[_\-.\s]+|(?<=[a-z0-9])(?=[A-Z])", name) if w]
    if not words:
        return False
    upper = [w.upper() for w in words]
    last = upper[-1]
    if last in LOCATION_WORDS or (len(upper) > 1 and (
            (last in ("TOKEN", "TOKENS") and upper[-2] in SPECIAL_TOKEN_ROLES)
            or (last == "KEY" and upper[-2] in FIELD_KEY_WORDS))):
        return False
    if last in _SHORT_WORDS or bool(_WORD.search(last)) or any(w in _ONLY_SECRET for w in upper):
        return True
    return env and bool(_ANYWHERE.search("_".join(w for w in upper if w not in NOT_SECRET_WORDS)))


def _random_body(token: str) -> bool:
    """Whether a prefixed token goes on with random text: some word after the prefix (split at
    ``-``, ``_``, ``.``) is not a word of a name."""
    parts = [p for p in re.split(r"[-_.]+", token)[1:] if p]
    return any(not _WORD_PART.fullmatch(p) for p in parts)


def _tokens(text: str) -> list[tuple[int, int]]:
    """The spans of the tokens in ``text`` that say by their shape what they are, overlapping ones
    merged."""
    spans = [m.span() for m in KNOWN_TOKENS.finditer(text)]
    spans += [m.span() for m in PREFIXED_TOKENS.finditer(text) if _random_body(m.group(0))]
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


#: words joined by '_' (``conversations``, ``chat_turns``), or a variable's name (``WANDB_API_KEY``,
#: what a Kubernetes ``secretKeyRef`` names): a name, not a secret's value
_NAME_VALUE = re.compile(r"[A-Za-z]+(?:_[A-Za-z]+)*|[A-Z_][A-Z0-9_]*")


def _literal(value: str) -> bool:
    """A value given as it is: not a reference, a plain word or name, or a version."""
    return not (value.startswith("$") or _NAME_VALUE.fullmatch(value) or _VERSION.fullmatch(value))


def _wordy(text: str) -> bool:
    """Whether every part of ``text`` (split at ``-``, ``_``, ``.``) is a word of a name (``git``,
    ``ci-bot``, ``first.last``, ``user42``)."""
    return all(_WORD_PART.fullmatch(p) for p in re.split(r"[-_.]+", text) if p)


def _secret_assignment(m: re.Match[str]) -> bool:
    """``NAME=value`` in text with a secret NAME and a literal value; a bare short word (``key:``,
    ``sig=``) names too much else in text (a Kubernetes toleration's ``key: nvidia.com/gpu``)."""
    name = m.group("name")
    return name.upper() not in _SHORT_WORDS and is_secret_key(name) and _literal(m.group("value"))


def _random_candidates(text: str) -> list[str]:
    """The runs of 20+ letters and digits that the entropy test reads: a path's or a URL's folders one
    by one, the rest as it stands; a Nix store hash and a ULID left out."""
    text = _NOT_SECRET_IDS.sub(" ", text)
    out: list[str] = []
    for m in _PATH.finditer(text):
        for part in m.group(0).split("/"):
            out += _ALNUM_TOKEN.findall(part)
    out += _ALNUM_TOKEN.findall(_PATH.sub(" ", text))
    return out


def looks_random(token: str) -> bool:
    """A run of 20+ letters, digits and ``+/=_-`` that reads as random text: split at ``/+=_-``
    and with the hex-only parts (hashes, UUIDs) left out, at least 16 letters and digits outside
    the parts that are one word-like run (``tmp``, ``run``, ``12``: a path's folders, so that
    ``/tmp/tmp4go0z3ol/run``, a temporary folder's 11 characters, is not a credential), of at
    least two kinds (lower case, upper case, digits), less than 60% of them in word-like runs
    (a capitalised or lower-case run of 2+ letters with a vowel, 2-5 capitals, 2+ digits: names
    such as ``MuseSparkOpenForCausalLM`` and ``Wav2Vec2PreTrainedModel``, dates and versions are),
    and a high spread of characters (Shannon entropy of at least 3.5 bits a character); or, a part
    or the whole of 30 letters and digits with an entropy of at least 4.4 bits (words and names
    repeat their letters more: 4.0-4.3). A path's folders are read one by one
    (:func:`_random_candidates`)."""
    parts = [p for p in _SPLIT.split(token) if p and not _HEX.fullmatch(p)]
    text = "".join(parts)
    unworded = sum(len(p) for p in parts if not _WORDLIKE.fullmatch(p))
    if unworded < 16 or sum(bool(k.search(text)) for k in _KINDS) < 2:
        return False
    worded = sum(len(m) for p in parts for m in _WORDLIKE.findall(p))
    entropy = _entropy(text)
    return entropy >= 3.5 and (worded / len(text) < 0.6 or any(len(p) >= 30 and _entropy(p) >= 4.4 for p in parts + [text]))


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
    if any(not _wordy(m.group("user")) for m in URL_USER.finditer(text)):
        return "a URL's user name that is not a name (a token given as the user)"
    if _BARE_USERINFO.search(text):
        return "user:password@host"
    if any(_secret_query(m) for m in _QUERY.finditer(text)):
        return "a secret query parameter (?token=...)"
    if _AUTH_SCHEME.search(text):
        return "an Authorization value (Bearer ...)"
    if _tokens(text):
        return "an access token, key or webhook URL"
    if any(_secret_assignment(m) for m in _ASSIGNMENT.finditer(text)):
        return "a secret-named assignment (NAME=value)"
    if any(looks_random(t) for t in _random_candidates(text)):
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
        text = URL_USER.sub(lambda m: m.group(0) if _wordy(m.group("user")) or m.group("user") == REDACTED
                            else f"{m.group('scheme')}{REDACTED}@", text)
    if "@" in text:
        text = _BARE_USERINFO.sub(f"{REDACTED}@", text)
    if "=" in text:
        text = _QUERY.sub(lambda m: m.group("lead") + REDACTED if _secret_query(m) else m.group(0), text)
    text = _AUTH_SCHEME.sub(lambda m: m.group("lead") + REDACTED, text)
    for start, end in reversed(_tokens(text)):
        text = text[:start] + REDACTED + text[end:]
    if "=" in text or ":" in text:
        text = _ASSIGNMENT.sub(lambda m: m.group("lead") + REDACTED if _secret_assignment(m) else m.group(0), text)
    return text


def redact_value(value: Any) -> Any:
    """A copy of ``value`` (a string, or dicts and lists of them) to show: each string shaped like a
    credential (:func:`shape`) is ``<redacted>``, each key has its unambiguous shapes redacted; other
    values are kept. For what muse-stack prints of a document it did not write (``diff`` of a
    fingerprint file)."""
    if isinstance(value, str):
        return REDACTED if shape(value) else value
    if isinstance(value, dict):
        return {redact_text(k) if isinstance(k, str) else k: redact_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_value(v) for v in value]
    return value


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

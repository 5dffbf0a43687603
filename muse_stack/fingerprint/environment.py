"""Environment variables that change numerics or performance, with secrets never recorded.

Only allow-listed names are recorded. Any variable whose name looks like a secret (token,
key, secret, password, credential, ... anywhere in it: the one rule of
:func:`muse_stack.util.credentials.is_secret_key`), or an allow-listed one whose value is shaped like a
credential (:mod:`muse_stack.util.credentials`), is recorded by name only, in ``secrets_set``; and
as a last guard every string in the finished document is scrubbed of the values of such
variables and of credentials embedded in URLs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from muse_stack.util.credentials import REDACTED, is_secret_key, redact_text, shape

ALLOWED_PREFIXES = (
    "NCCL_",
    "NVTE_",
    "CUDA_",
    "TORCH_",
    "TORCHINDUCTOR_",
    "PYTORCH_",
    "FI_",
    "NVIDIA_",
    "CUBLAS_",
    "CUBLASLT_",
    "CUDNN_",
    "MUSE_STACK_",
    "NVSHMEM_",
    "UCX_",
    "OMP_",
    "KMP_",
    "MKL_",
    "TRITON_",
    "TILELANG_",
    "EP_",
    "XLA_",
    "HF_",
    "TRANSFORMERS_",
    "MEGATRON_",
    "NVLS_",
    "GLOO_",
)
ALLOWED_NAMES = frozenset(
    {
        "LD_LIBRARY_PATH",
        "LD_PRELOAD",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONUSERBASE",
        "PYTHONNOUSERSITE",
        "PYTHONSAFEPATH",
        "PYTHONHASHSEED",
        "MALLOC_CONF",
        "GLIBC_TUNABLES",
        "OPAL_PREFIX",
        "TOKENIZERS_PARALLELISM",
    }
)
MIN_SECRET_LEN = 8


def is_allowed(name: str) -> bool:
    return name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)


def collect(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    env = os.environ if env is None else env
    variables = {}
    secrets = []
    for name in sorted(env):
        if is_secret_key(name, env=True):
            secrets.append(name)
        elif is_allowed(name):
            if shape(env[name]):  # a value shaped like a credential, whatever the name: by name only
                secrets.append(name)
            else:
                variables[name] = env[name]
    return {"variables": variables, "secrets_set": secrets}


def secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    """Values of secret-named variables to keep out of the document. A value that is a plain word
    (letters only, e.g. MY_AUTH_MODE=torch) or shorter than MIN_SECRET_LEN is not a credential
    and is not searched for: replacing it would rewrite unrelated text (the word "torch" in every
    framework field) and make identical stacks differ."""
    env = os.environ if env is None else env
    values = {v for k, v in env.items()
              if is_secret_key(k, env=True) and len(v) >= MIN_SECRET_LEN and not v.isalpha()}
    return sorted(values, key=len, reverse=True)


# characters that may continue a token: a secret is matched only where it stands whole
_TOKEN_CHAR = r"[A-Za-z0-9_]"


def scrub_text(text: str, secrets: list[str]) -> str:
    """``text`` with every secret value replaced where it stands as a whole value or token (the
    whole string, or bounded by characters that cannot continue a token: spaces, quotes, '=', ':',
    '@', ...), never inside a longer word; then every credential of a known shape (URL
    credentials, tokens: :func:`muse_stack.util.credentials.redact_text`)."""
    for value in secrets:
        if value in text:
            text = re.sub(rf"(?<!{_TOKEN_CHAR}){re.escape(value)}(?!{_TOKEN_CHAR})", REDACTED, text)
    return redact_text(text)


def redact(obj: Any, secrets: list[str], *, secret_keys: bool = False) -> Any:
    """A copy of ``obj`` with secret values removed from every string.

    With ``secret_keys`` (for free-form mappings such as a caller's ``extra``), a string under
    a secret-looking key is reduced to whether it was set.
    """
    if isinstance(obj, str):
        return scrub_text(obj, secrets)
    if isinstance(obj, Mapping):
        out = {}
        for key, value in obj.items():
            skey = scrub_text(str(key), secrets)
            if secret_keys and isinstance(value, str) and is_secret_key(str(key), env=True):
                out[skey] = {"set": bool(value)}
            else:
                out[skey] = redact(value, secrets, secret_keys=secret_keys)
        return out
    if isinstance(obj, (list, tuple)):
        return [redact(v, secrets, secret_keys=secret_keys) for v in obj]
    return obj

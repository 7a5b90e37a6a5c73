"""Plaintext bearer keys for the Serve endpoint: the environment variable and the secrets file.

Keys are read once, in the process that starts the application, from an environment variable
and/or a secrets file, and only their SHA-256 digests travel on: Ray stores a Serve
application's init arguments in its control store, and plaintext keys have no business there.
These keys are named by where they came from (env-1, env-2, ..., file-1, ...), have no limits
and may read /metrics. Named keys with limits live in `auth.keys_file`, which holds digests
only and is read (and reloaded) by the ingress itself: pipeline.serve.access.keys.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.serve.spec import AuthSpec


class AuthConfigError(ValueError):
    """No usable key source; the message says which variable or file to set."""


@dataclass(frozen=True)
class KeyDigests:
    """SHA-256 hex digests of the accepted keys. Empty with `insecure` means no auth at all."""

    digests: frozenset[str]
    insecure: bool = False
    # (name, digest) in the order the keys were given: env-1, env-2, ..., file-1, ...
    named: tuple[tuple[str, str], ...] = ()

    def accepts(self, authorization: str | None) -> bool:
        """True if the `Authorization` header carries an accepted bearer key."""
        if self.insecure:
            return True
        if not authorization:
            return False
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return False
        presented = digest(key.strip())
        # Compare against every digest so the time taken says nothing about which one matched.
        matched = False
        for known in self.digests:
            matched |= hmac.compare_digest(presented, known)
        return matched


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def read_named_keys(auth: AuthSpec, env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(name, plaintext key) from the environment variable (env-N) and the secrets file
    (file-N); a key given twice keeps its first name."""
    env = dict(os.environ) if env is None else env
    from_env = [k.strip() for k in env.get(auth.api_keys_env, "").split(",") if k.strip()]
    from_file: list[str] = []
    if auth.api_keys_file:
        path = Path(auth.api_keys_file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise AuthConfigError(
                f"auth.api_keys_file {path}: cannot read it ({exc.strerror or exc}); fix the "
                "path or remove the field"
            ) from None
        from_file = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    named: dict[str, str] = {}  # key -> name
    for prefix, keys in (("env", from_env), ("file", from_file)):
        for i, key in enumerate(keys, start=1):
            named.setdefault(key, f"{prefix}-{i}")
    return [(name, key) for key, name in named.items()]


def load_key_digests(
    auth: AuthSpec, *, insecure_no_auth: bool = False, env: dict[str, str] | None = None
) -> KeyDigests:
    """Digests of the configured keys. No key and no explicit opt-out is an error: an endpoint
    that silently accepts everyone is worse than one that does not start. A keys_file counts
    as configured keys (even while it lists none: its keys may be added later)."""
    named = [(name, digest(key)) for name, key in read_named_keys(auth, env)]
    if named or auth.keys_file:
        return KeyDigests(frozenset(d for _, d in named), named=tuple(named))
    if insecure_no_auth:
        return KeyDigests(frozenset(), insecure=True)
    where = f"${auth.api_keys_env}"
    if auth.api_keys_file:
        where += f" or {auth.api_keys_file}"
    raise AuthConfigError(
        f"no API key configured ({where} is empty): export {auth.api_keys_env}=key1,key2, "
        "set auth.keys_file or auth.api_keys_file, or pass --insecure-no-auth for a local "
        "test server"
    )

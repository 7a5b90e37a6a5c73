"""Named API keys: the keys file (digests, limits, allowed models), its reload, key lookup.

The keys file (`auth.keys_file`, YAML or JSON, e.g. a mounted Kubernetes secret) lists named
keys by the SHA-256 digest of the key, never the key itself:

    keys:
      - name: team-a
        sha256: "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8"
        limits: {requests_per_minute: 600, tokens_per_minute: 200000, max_concurrent: 8}
        models: [tiny-llama]      # absent: every served model
        metrics: true             # may read /metrics (every key's usage)
        batch: {max_batches_in_flight: 4, max_lines_per_day: 100000, max_stored_bytes: 10000000000}

Each ingress replica reads the file itself, so no key material travels through Ray's stored
application arguments, and `KeyFileWatcher` re-reads it every `auth.reload_interval_s` in a
daemon thread: an edit (a key added, revoked, its limits changed) takes effect within about
that long, without a restart. A file that does not parse keeps the last good set in force and
logs an error naming the file, entry and field. Messages never quote the file's values, since
a pasted plaintext key would otherwise end up in the logs.

The keys from the environment / plaintext secrets file (pipeline.serve.access.auth) join the file's
under their names env-N and file-N, without limits.

A key's `owner` is what its Batch API files and batches belong to, and must not move when
keys are reordered: a keys-file entry's name (the operator chose it, and a rotated key keeps
it), else the plaintext key's own SHA-256 (env-N and file-N are positions: reordering
TOKENMILL_API_KEYS would hand one key's files to another). With --insecure-no-auth there is
no owner, and the Batch API is refused.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from engines.strict import StrictModel
from pipeline.serve.access.auth import KeyDigests, digest

logger = logging.getLogger(__name__)

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}$"
DIGEST_PATTERN = r"^[0-9a-f]{64}$"
# Names the plaintext keys from the environment and the secrets file get.
RESERVED_PREFIXES = ("env-", "file-")
ANONYMOUS = "anonymous"  # the caller's name with --insecure-no-auth
# Field names that can only be a plaintext key pasted where its digest belongs.
_KEY_LOOKING = frozenset({"key", "api_key", "apikey", "secret", "token", "password", "value"})


class KeyLimits(StrictModel):
    requests_per_minute: int | None = Field(
        None,
        ge=1,
        description="Requests admitted per minute (a token bucket holding a minute's worth, "
        "refilled continuously); null: no limit.",
    )
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="Prompt plus output tokens per minute. A request is charged its prompt "
        "tokens plus its max_tokens when admitted, and refunded what it did not generate when "
        "it ends; null: no limit.",
    )
    max_concurrent: int | None = Field(
        None, ge=1, description="Requests of this key in flight at once; null: no limit."
    )

    @property
    def unlimited(self) -> bool:
        return (
            self.requests_per_minute is None
            and self.tokens_per_minute is None
            and self.max_concurrent is None
        )


class BatchQuota(StrictModel):
    """What a key's owner may keep running and stored through the Batch API
    (docs/batch-api.md, Quotas); every ingress replica counts against the same totals."""

    max_batches_in_flight: int | None = Field(
        None,
        ge=1,
        description="Batches not yet ended (validating, in_progress, finalizing, cancelling) "
        "at once; one more gets 429 batch_limit_exceeded. Batches created while no limit "
        "was set are not counted. null: no limit.",
    )
    max_lines_per_day: int | None = Field(
        None,
        ge=1,
        description="Requests (lines) of the batches created per UTC day (a resume counts the "
        "requests it has left to run); a batch that would pass it gets 429 "
        "lines_per_day_exceeded with Retry-After until the next UTC midnight, a batch larger "
        "than the whole limit 400. null: no limit.",
    )
    max_stored_bytes: int | None = Field(
        None,
        ge=1,
        description="Bytes of uploaded files kept at once (batch output files do not count); "
        "an upload that would pass it gets 429 storage_limit_exceeded, also mid-upload: "
        "delete files to make room. null: no limit.",
    )

    @property
    def unlimited(self) -> bool:
        return (
            self.max_batches_in_flight is None
            and self.max_lines_per_day is None
            and self.max_stored_bytes is None
        )


class KeyEntry(StrictModel):
    name: str = Field(
        pattern=NAME_PATTERN,
        description="The key's name: what /metrics and the usage log call it (bill by it).",
    )
    sha256: str = Field(
        pattern=DIGEST_PATTERN,
        description="Hex SHA-256 of the key (`tokenmill key-digest`); never the key itself.",
    )
    limits: KeyLimits = Field(default_factory=KeyLimits, description="Per-key limits.")
    models: list[str] | None = Field(
        None,
        description="Served model names this key may use; null: all. Others answer 404 "
        "model_not_found, as OpenAI does for a model a key cannot see.",
    )
    metrics: bool = Field(False, description="May read /metrics (which shows every key's usage).")
    batch: BatchQuota = Field(
        default_factory=BatchQuota,
        description="Batch API quotas of this key's owner (batches in flight, lines per day, "
        "bytes stored); absent: none.",
    )

    @field_validator("sha256", mode="before")
    @classmethod
    def _lowercase(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        if value.startswith(RESERVED_PREFIXES) or value == ANONYMOUS:
            raise ValueError(
                f"names starting with {' or '.join(RESERVED_PREFIXES)} (and '{ANONYMOUS}') "
                "are those of the environment's and the plaintext file's keys; choose another"
            )
        return value


class KeyFile(StrictModel):
    keys: list[KeyEntry] = Field(default_factory=list, description="The accepted keys.")

    @model_validator(mode="after")
    def _unique(self) -> KeyFile:
        for attr in ("name", "sha256"):
            seen: dict[str, int] = {}
            for i, entry in enumerate(self.keys):
                value = getattr(entry, attr)
                if value in seen:
                    # Names are not secret; digests are not either, but say only where.
                    what = f"name '{value}'" if attr == "name" else "sha256"
                    raise ValueError(f"keys[{i}] has the same {what} as keys[{seen[value]}]")
                seen[value] = i
        return self


class KeyFileError(ValueError):
    """The keys file cannot be read or is invalid; the message names file, entry and field."""


def parse_key_file(text: str, source: str) -> KeyFile:
    """Validate a keys file's text (YAML, so JSON too). KeyFileError names the file, the entry
    (index and name) and the field; it never quotes a value from the file."""
    try:
        data = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise KeyFileError(f"{source}: not valid YAML or JSON{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise KeyFileError(
            f"{source}: expected a mapping with a 'keys' list at the top level, got "
            f"{type(data).__name__}"
        )
    try:
        return KeyFile.model_validate(data)
    except ValidationError as exc:
        raise KeyFileError(_describe(exc, data, source)) from None


def _describe(exc: ValidationError, data: dict[str, Any], source: str) -> str:
    lines = [f"{source}: invalid keys file ({exc.error_count()} problem(s))"]
    entries = data.get("keys") if isinstance(data.get("keys"), list) else []
    for err in exc.errors():
        loc = list(err["loc"])
        path = "(top level)"
        if loc[:1] == ["keys"] and len(loc) >= 2 and isinstance(loc[1], int):
            index = loc[1]
            entry = entries[index] if index < len(entries) else None
            name = entry.get("name") if isinstance(entry, dict) else None
            label = f" (name '{name}')" if isinstance(name, str) and len(name) <= 64 else ""
            rest = ".".join(str(p) for p in loc[2:])
            path = f"keys[{index}]{label}" + (f".{rest}" if rest else "")
        elif loc:
            path = ".".join(str(p) for p in loc)
        lines.append(f"  - {path}: {_message(err, loc)}")
    return "\n".join(lines)


def _message(err: Any, loc: list[Any]) -> str:
    """Pydantic's message without the input value (it may be a pasted key)."""
    kind, field = err["type"], str(loc[-1]) if loc else ""
    if kind == "extra_forbidden":
        if field.lower() in _KEY_LOOKING:
            return (
                "the keys file holds digests, never keys: remove this field and put the key's "
                "SHA-256 in sha256 (`tokenmill key-digest`)"
            )
        return "unknown field (allowed: name, sha256, limits, models, metrics, batch)"
    if kind == "missing":
        return "required field is missing"
    if field == "sha256" and kind in ("string_pattern_mismatch", "string_type"):
        return "must be the key's SHA-256 as 64 hex digits, quoted (`tokenmill key-digest`)"
    if kind == "value_error":
        return str(err["msg"]).removeprefix("Value error, ")
    return str(err["msg"])


def load_key_file(path: str | Path) -> KeyFile:
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeyFileError(
            f"auth.keys_file {path}: cannot read it ({exc.strerror or exc})"
        ) from None
    return parse_key_file(text, str(path))


# --- the keys a request is checked against ----------------------------------------------------


@dataclass(frozen=True)
class ApiKey:
    """An accepted key, by name: what it may do and how much."""

    name: str
    limits: KeyLimits = field(default_factory=KeyLimits)
    models: frozenset[str] | None = None  # None: every served model
    metrics: bool = False
    # Who its Batch API files and batches belong to (module docstring); None: nobody.
    owner: str | None = None
    batch: BatchQuota = field(default_factory=BatchQuota)

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


def digest_owner(key_digest: str) -> str:
    """The owner of a plaintext key's files and batches: its digest ('/' keeps it apart from
    every keys-file name)."""
    return f"sha256/{key_digest}"


class KeyRing:
    """The accepted keys by digest. A lookup hashes the presented key and looks the digest up:
    timing can only tell an attacker about the digest of a key they already hold, which
    reveals nothing about any other key, so no constant-time scan over all keys is needed."""

    def __init__(self, keys: Mapping[str, ApiKey], insecure: bool = False) -> None:
        self._keys = dict(keys)
        self.insecure = insecure

    @classmethod
    def build(cls, static: KeyDigests, file: KeyFile | None) -> KeyRing:
        """The environment's / plaintext file's keys (unlimited, may read /metrics) plus the
        keys file's entries. A digest in both takes the entry's name, limits and models."""
        keys = {d: ApiKey(name, metrics=True, owner=digest_owner(d)) for name, d in static.named}
        for entry in file.keys if file else ():
            keys[entry.sha256] = ApiKey(
                entry.name,
                entry.limits,
                frozenset(entry.models) if entry.models is not None else None,
                entry.metrics,
                owner=entry.name,
                batch=entry.batch,
            )
        return cls(keys, insecure=static.insecure)

    def identify(self, authorization: str | None) -> ApiKey | None:
        """The key an `Authorization: Bearer <key>` header carries; None if none accepted."""
        if self.insecure:
            return ApiKey(ANONYMOUS, metrics=True)
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self._keys.get(digest(key.strip()))

    @property
    def names(self) -> list[str]:
        return sorted(k.name for k in self._keys.values())

    def __len__(self) -> int:
        return len(self._keys)


# --- reload ------------------------------------------------------------------------------------


class KeyFileWatcher:
    """The current KeyRing, re-read from `path` every `interval_s` by a daemon thread.

    The file is small, so each poll reads it whole and compares a hash of its bytes: a
    Kubernetes secret update (a symlink swap) or an edit within one mtime tick is seen too.
    `ring` is replaced by a single assignment, which readers on the event loop see atomically.
    """

    def __init__(self, static: KeyDigests, path: str | None, interval_s: float = 1.0) -> None:
        self._static = static
        self._path = Path(path).expanduser() if path else None
        self._interval_s = interval_s
        self._content_hash: str | None = None
        self._failed_hash: str | None = None  # content of the last broken edit (logged once)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None
        if self._path is None:
            self.ring = KeyRing.build(static, None)
            return
        # At start-up a bad file is fatal (there is no last good set to keep).
        raw = self._read()
        self.ring = KeyRing.build(static, parse_key_file(raw.decode(), str(self._path)))
        self._content_hash = hashlib.sha256(raw).hexdigest()

    def _read(self) -> bytes:
        assert self._path is not None
        try:
            return self._path.read_bytes()
        except OSError as exc:
            raise KeyFileError(
                f"auth.keys_file {self._path}: cannot read it ({exc.strerror or exc})"
            ) from None

    def poll(self) -> bool:
        """Check the file once; True when a new set of keys took effect. A file that cannot
        be read or parsed keeps the current set and logs an error (once per broken content)."""
        if self._path is None:
            return False
        try:
            raw = self._read()
        except KeyFileError as exc:
            self._failed(str(exc), f"unreadable:{exc}")
            return False
        content_hash = hashlib.sha256(raw).hexdigest()
        if content_hash == self._content_hash:
            return False
        try:
            file = parse_key_file(raw.decode(errors="replace"), str(self._path))
        except KeyFileError as exc:
            self._failed(str(exc), content_hash)
            return False
        old = set(self.ring.names)
        self.ring = KeyRing.build(self._static, file)
        self._content_hash, self._failed_hash, self.last_error = content_hash, None, None
        new = set(self.ring.names)
        logger.info(
            "keys file %s reloaded: %d keys (added: %s; removed: %s)",
            self._path,
            len(self.ring),
            ", ".join(sorted(new - old)) or "none",
            ", ".join(sorted(old - new)) or "none",
        )
        return True

    def _failed(self, message: str, fingerprint: str) -> None:
        self.last_error = message
        if fingerprint != self._failed_hash:
            self._failed_hash = fingerprint
            logger.error("%s; keeping the %d keys loaded before", message, len(self.ring))

    def start(self) -> None:
        if self._path is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="keys-file", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.poll()
            except Exception:  # never let the thread die: the last good set stays in force
                logger.exception("checking the keys file %s failed", self._path)


def entry_snippet(name: str, key_digest: str) -> str:
    """A keys-file entry for `tokenmill key-digest --name`: YAML, digest quoted."""
    return f'  - name: {name}\n    sha256: "{key_digest}"\n'

"""`/v1/files` storage and upload validation (no FastAPI here: batch_api.batch_routes).

Files live under `<batch_api.uri>/files/<owner>/`, `owner` a digest of the uploading key's
owner (pipeline.serve.access.keys: its keys-file name, or the plaintext key's SHA-256), so a key
only ever lists and opens its own:

    file-<id>.jsonl   the uploaded content (input files)
    file-<id>.json    the file object OpenAI returns, plus private fields (`_tokenmill`: the
                      owner's name, a batch input's BatchInputSummary, or the objects an
                      output file is made of)

A batch's output and error files are registered here when it ends; their content is the
concatenation of the batch job's export files (pipeline.batch.driver.openai_output), not a copy.

An upload is written to storage in parts as it arrives (`Upload`: an S3 multipart upload, or a
temp file renamed into place) and checked on the way (`StreamingValidator`), so the ingress
holds a few parts of it, never the file; its file object is written last, so a file is listed
only once its content is complete.

Uploads are checked in one pass over their lines as OpenAI checks a batch input: each line a
JSON object that `parse_batch_request` accepts (custom_id, POST, a supported url, a body this
server can run), with a string body.model, and no custom_id twice. As with OpenAI, a file with
problems is still stored: what the pass found (`BatchInputSummary`, bounded) is kept in the
file object, and a batch made from the file fails during `validating` with those problems and
its own (a line's url not the batch's endpoint, an unknown model) named by line number
(pipeline.serve.batch_api.batches).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.batch.interface.batch_api import SUPPORTED_BATCH_URLS, parse_batch_request
from pipeline.openai.errors import ApiError
from pipeline.spec import StorageSpec
from pipeline.storage import OutputDir, join_uri
from pipeline.storage.prefix import TEMP_SUFFIX

PRIVATE = "_tokenmill"  # the file object's fields a client never sees
MAX_REPORTED_ERRORS = 20  # errors (and line numbers per url or model) a failed batch names
MAX_TRACKED_MODELS = 100  # distinct body.model values kept: more fail the batch anyway
PURPOSES = ("batch",)  # what an upload may be for (batch_output is the server's own)
# An upload goes to S3 in parts of this size (S3's smallest part but the last), so each
# upload in flight holds at most about this much in the ingress.
UPLOAD_PART_BYTES = 5 * 1024 * 1024


def owner_slug(owner: str) -> str:
    """The storage folder of an owner's files and batches: a digest, since owners may hold
    characters some stores dislike."""
    return hashlib.sha256(owner.encode()).hexdigest()[:20]


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


# --- validation --------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputError:
    """One problem of a batch input: an item of a failed batch's `errors.data` (OpenAI's
    shape; `line` is 1-based, None for the file as a whole)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InputError:
        return cls(str(data["code"]), str(data["message"]), data.get("line"), data.get("param"))


@dataclass
class BatchInputSummary:
    """What one pass over an upload found, kept with the file: the checks a batch adds (its
    endpoint, its model) then name lines without reading the file again.

    Everything is bounded: at most MAX_REPORTED_ERRORS errors and line numbers per url or
    model are kept, and at most MAX_TRACKED_MODELS distinct models."""

    lines: int = 0  # requests read (the pass stops past the line limit)
    errors: list[InputError] = field(default_factory=list)  # the first MAX_REPORTED_ERRORS
    num_errors: int = 0  # all of them
    # body.model -> the first lines naming it, in first-seen order.
    models: dict[str, list[int]] = field(default_factory=dict)
    # url -> the first lines using it (supported urls only: others are errors already).
    urls: dict[str, list[int]] = field(default_factory=dict)

    def add_error(self, error: InputError) -> None:
        self.num_errors += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(error)

    def to_json(self) -> dict[str, Any]:
        return {
            "lines": self.lines,
            "errors": [e.to_json() for e in self.errors],
            "num_errors": self.num_errors,
            "models": self.models,
            "urls": self.urls,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BatchInputSummary:
        def lines_of(value: Any) -> dict[str, list[int]]:
            # Files stored before line numbers were kept hold plain lists of names.
            return dict(value) if isinstance(value, dict) else {str(v): [] for v in value or []}

        return cls(
            lines=int(data.get("lines", 0)),
            errors=[InputError.from_json(e) for e in data.get("errors", [])],
            num_errors=int(data.get("num_errors", 0)),
            models=lines_of(data.get("models")),
            urls=lines_of(data.get("urls")),
        )


def _note_line(where: dict[str, list[int]], value: str, number: int) -> None:
    lines = where.setdefault(value, [])
    if len(lines) < MAX_REPORTED_ERRORS:
        lines.append(number)


def validate_batch_input(lines: Iterable[bytes], max_lines: int) -> BatchInputSummary:
    """One pass over an upload's lines (an iterable of bytes lines, e.g. an open binary
    file). Never raises for what the lines hold: as OpenAI does, problems are kept and fail
    the batch made from the file, during `validating`, naming the lines."""
    checker = _LineChecker(max_lines)
    for raw in lines:
        if not checker.check(raw):
            break
    return checker.finish()


class _LineChecker:
    """The checks of one file, a line at a time."""

    def __init__(self, max_lines: int) -> None:
        self.max_lines = max_lines
        self.summary = BatchInputSummary()
        self.first_line_of: dict[str, int] = {}  # custom_id -> its line: the one unbounded map
        self.number = 0

    def check(self, raw: bytes) -> bool:
        """Check the next line; False once past max_lines (the rest is not read)."""
        if self.number >= self.max_lines:
            self.summary.add_error(
                InputError(
                    "too_many_tasks",
                    f"The file has more than {self.max_lines} requests (lines), this server's "
                    "limit for one batch; split it into several files.",
                )
            )
            return False
        self.number += 1
        error = _line_error(raw, self.number, self.first_line_of, self.summary)
        if error is not None:
            self.summary.add_error(error)
        return True

    def too_long(self, max_line_bytes: int) -> bool:
        """The next line is over max_line_bytes: counted, not read."""
        if self.number >= self.max_lines:
            return self.check(b"")
        self.number += 1
        self.summary.add_error(
            InputError(
                "line_too_long",
                f"This line is longer than this server's limit of {max_line_bytes} bytes for "
                "one request.",
                self.number,
            )
        )
        return True

    def finish(self) -> BatchInputSummary:
        if self.number == 0:
            self.summary.add_error(
                InputError(
                    "empty_file", "The file is empty; a batch file holds one request per line."
                )
            )
        self.summary.lines = self.number
        return self.summary


class StreamingValidator:
    """validate_batch_input over bytes fed in any pieces (an upload as it arrives). A line
    is held until it ends, up to max_line_bytes: a longer one is an error and skipped."""

    def __init__(self, max_lines: int, max_line_bytes: int) -> None:
        self._checker = _LineChecker(max_lines)
        self._max_line_bytes = max_line_bytes
        self._partial = bytearray()  # the current line's start
        self._skipping = False  # inside a line found too long
        self._done = False  # past max_lines: the rest is only stored

    def feed(self, data: bytes) -> None:
        start = 0
        while not self._done:
            end = data.find(b"\n", start)
            if end < 0:
                self._hold(data[start:])
                return
            if self._skipping:
                self._skipping = False
            elif self._partial:
                self._partial += data[start : end + 1]
                if len(self._partial) > self._max_line_bytes:
                    self._done = not self._checker.too_long(self._max_line_bytes)
                else:
                    self._done = not self._checker.check(bytes(self._partial))
                self._partial.clear()
            elif end + 1 - start > self._max_line_bytes:
                self._done = not self._checker.too_long(self._max_line_bytes)
            else:
                self._done = not self._checker.check(data[start : end + 1])
            start = end + 1

    def _hold(self, rest: bytes) -> None:
        if self._skipping or not rest:
            return
        if len(self._partial) + len(rest) > self._max_line_bytes:
            self._done = not self._checker.too_long(self._max_line_bytes)
            self._partial.clear()
            self._skipping = True
        else:
            self._partial += rest

    def finish(self) -> BatchInputSummary:
        if not self._done and self._partial:  # a last line without a line break
            self._checker.check(bytes(self._partial))
            self._partial.clear()
        return self._checker.finish()


def _line_error(
    raw: bytes, number: int, first_line_of: dict[str, int], summary: BatchInputSummary
) -> InputError | None:
    def error(code: str, message: str, param: str | None = None) -> InputError:
        return InputError(code, message, number, param)

    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return error("invalid_json_line", f"This line is not UTF-8 text (byte {exc.start}).")
    except json.JSONDecodeError as exc:
        return error(
            "invalid_json_line",
            f"This line is not parseable as valid JSON ({exc.msg} at column {exc.colno}).",
        )
    if not isinstance(obj, dict):
        return error("invalid_json_line", f"Expected a JSON object, got {type(obj).__name__}.")
    url = obj.get("url")
    if url not in SUPPORTED_BATCH_URLS:
        return error(
            "invalid_url",
            f"Unsupported url {url!r}; supported: {', '.join(SUPPORTED_BATCH_URLS)}.",
            "url",
        )
    parsed = parse_batch_request(obj)
    if parsed["custom_id"] is None:
        return error("missing_required_parameter", "Missing custom_id.", "custom_id")
    if parsed["error"]:
        return error("invalid_request", f"Invalid request: {parsed['error']}.", "body")
    custom_id = parsed["custom_id"]
    if custom_id in first_line_of:
        return error(
            "duplicate_custom_id",
            f"The custom_id {custom_id!r} is also on line {first_line_of[custom_id]}; each "
            "request of a batch needs its own.",
            "custom_id",
        )
    first_line_of[custom_id] = number
    model = obj["body"].get("model")
    if not isinstance(model, str) or not model:
        return error(
            "missing_required_parameter", "body.model must be a non-empty string.", "body.model"
        )
    if model in summary.models or len(summary.models) < MAX_TRACKED_MODELS:
        _note_line(summary.models, model, number)
    _note_line(summary.urls, url, number)
    return None


# --- storage -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredFile:
    """A file object as stored: the public fields plus PRIVATE."""

    data: dict[str, Any]

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def private(self) -> dict[str, Any]:
        return self.data.get(PRIVATE, {})

    def public(self) -> dict[str, Any]:
        return {k: v for k, v in self.data.items() if k != PRIVATE}


class FileStore:
    """One key's files (see the module docstring). Blocking: call it off the event loop."""

    def __init__(self, root_uri: str, storage: StorageSpec, owner: str):
        self.owner = owner
        self.dir = OutputDir(join_uri(root_uri, f"files/{owner_slug(owner)}"), storage)

    def create(
        self,
        content: bytes,
        filename: str,
        purpose: str,
        private: dict[str, Any],
    ) -> StoredFile:
        file_id = new_id("file-")
        self.dir.put(f"{file_id}.jsonl", content)  # content first: a listed file has it
        return self._save(file_id, len(content), filename, purpose, private)

    def open_upload(self) -> Upload:
        """A new file's content, written in parts (Upload); its object comes at `commit`."""
        return Upload(self, new_id("file-"))

    def stored_bytes(self) -> int:
        """Bytes of this owner's uploads, from one listing (files still being uploaded, or
        whose object was never written, are not counted)."""
        try:
            entries = self.dir.fs.ls(self.dir.root, detail=True, refresh=True)
        except FileNotFoundError:
            return 0
        sizes = {str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: e.get("size") for e in entries}
        return sum(
            int(size or 0)
            for name, size in sizes.items()
            if name.startswith("file-")
            and name.endswith(".jsonl")
            and name.removesuffix(".jsonl") + ".json" in sizes
        )

    def register(
        self, file_id: str, filename: str, purpose: str, sources: list[str], size: int
    ) -> StoredFile:
        """A file whose content is the concatenation of `sources` (full URIs)."""
        return self._save(file_id, size, filename, purpose, {"sources": sources})

    def _save(
        self, file_id: str, size: int, filename: str, purpose: str, private: dict[str, Any]
    ) -> StoredFile:
        now = time.time()
        stored = StoredFile(
            {
                "id": file_id,
                "object": "file",
                "bytes": size,
                "created_at": int(now),
                "filename": filename,
                "purpose": purpose,
                "status": "processed",
                "status_details": None,
                "expires_at": None,
                PRIVATE: {"owner": self.owner, "created": now, **private},
            }
        )
        self.dir.put(f"{file_id}.json", json.dumps(stored.data).encode())
        return stored

    def get(self, file_id: str) -> StoredFile:
        """The file, or 404 (also for another key's file: it does not exist for this key)."""
        if not file_id.startswith("file-") or "/" in file_id:
            raise _not_found(file_id)
        try:
            return StoredFile(json.loads(self.dir.read(f"{file_id}.json")))
        except FileNotFoundError:
            raise _not_found(file_id) from None

    def list(self) -> list[StoredFile]:
        """This key's files, newest first."""
        found = []
        for name in self.dir.names("file-"):
            if name.endswith(".json"):
                try:
                    found.append(StoredFile(json.loads(self.dir.read(name))))
                except FileNotFoundError:  # deleted since the listing
                    continue
        return sorted(found, key=lambda f: (f.private.get("created", 0), f.id), reverse=True)

    def content_uris(self, stored: StoredFile) -> list[str]:
        sources = stored.private.get("sources")
        return list(sources) if sources is not None else [self.dir.uri_of(f"{stored.id}.jsonl")]

    def iter_content(self, stored: StoredFile, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
        """The content in chunks (an output file: its export files one after the other)."""
        for uri in self.content_uris(stored):
            source = OutputDir(uri.rsplit("/", 1)[0], self.dir.storage)
            with source.fs.open(source.path(uri.rsplit("/", 1)[1]), "rb") as handle:
                while chunk := handle.read(chunk_bytes):
                    yield chunk

    def delete(self, stored: StoredFile) -> None:
        """The file object and its own content (an output file's sources stay with its
        batch's output)."""
        self.dir.delete(f"{stored.id}.json")
        if "sources" not in stored.private:
            self.dir.delete(f"{stored.id}.jsonl")


class Upload:
    """One upload's content on its way to storage (see the module docstring). Blocking: call
    it off the event loop. `commit` makes it a file; `abort` leaves nothing behind."""

    def __init__(self, store: FileStore, file_id: str) -> None:
        self.store = store
        self.file_id = file_id
        self.size = 0
        out = store.dir
        self._name = f"{file_id}.jsonl"
        self._temp: str | None = None
        self._stored = False  # the content is a complete object (commit got that far)
        if out.is_s3:
            # Uncommitted until `commit`: parts go up as they fill, the object appears whole.
            self._handle: Any = out.fs.open(
                out.path(self._name), "wb", block_size=UPLOAD_PART_BYTES, autocommit=False
            )
        else:
            Path(out.root).mkdir(parents=True, exist_ok=True)
            fd, self._temp = tempfile.mkstemp(
                prefix=f".{self._name}.", suffix=TEMP_SUFFIX, dir=out.root
            )
            self._handle = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> None:
        self._handle.write(data)
        self.size += len(data)

    def commit(self, filename: str, purpose: str, private: dict[str, Any]) -> StoredFile:
        if self._temp is None:
            self._handle.close()  # the last part
            self._handle.commit()  # completes the multipart upload
        else:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            os.replace(self._temp, self.store.dir.path(self._name))
            self._temp = None
        self._stored = True  # the content is an object now: abort deletes it
        # The object last: a listed file has its content.
        try:
            return self.store._save(self.file_id, self.size, filename, purpose, private)
        except Exception:
            # Its answer may be what was lost: a file whose object landed is this upload.
            with contextlib.suppress(Exception):
                return self.store.get(self.file_id)
            raise

    def abort(self) -> None:
        """Leave nothing of the upload behind (called on any failure, also after `commit`)."""
        if self._stored:
            with contextlib.suppress(Exception):
                if self.store.dir.exists(f"{self.file_id}.json"):
                    return  # a file after all (its object's answer was lost): it stays
            self.store.dir.delete(self._name)
            return
        if self._temp is None:
            self._handle.discard()  # aborts the multipart upload: no parts are kept
            self._handle.closed = True  # nothing left to flush when it is collected
            return
        self._handle.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._temp)


def _not_found(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", param="file_id", code="not_found")

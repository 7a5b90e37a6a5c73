"""`/v1/files` storage and upload validation (no FastAPI here: pipeline.serve.batch_routes).

Files live under `<batch_api.uri>/files/<owner>/`, `owner` a digest of the uploading key's
name, so a key only ever lists and opens its own:

    file-<id>.jsonl   the uploaded content (input files)
    file-<id>.json    the file object OpenAI returns, plus private fields (`_tokenmill`: the
                      owner's name, line count, models and urls of a batch input, or the
                      objects an output file is made of)

A batch's output and error files are registered here when it ends; their content is the
concatenation of the batch job's export files (pipeline.batch.openai_output), not a copy.

Uploads are validated line by line as OpenAI validates a batch input: each line a JSON object
that `parse_batch_request` accepts (custom_id, POST, a supported url, a body this server can
run), with a string body.model, and no custom_id twice. Problems are reported by line number.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pipeline.batch.read.openai_batch import parse_batch_request
from pipeline.serve.protocol import ApiError
from pipeline.spec import StorageSpec
from pipeline.storage import OutputDir, join_uri

PRIVATE = "_tokenmill"  # the file object's fields a client never sees
MAX_REPORTED_PROBLEMS = 10  # line problems named in one error message
PURPOSES = ("batch",)  # what an upload may be for (batch_output is the server's own)


def owner_slug(key_name: str) -> str:
    """The storage folder of a key's files and batches: a digest, since key names may hold
    characters some stores dislike."""
    return hashlib.sha256(key_name.encode()).hexdigest()[:20]


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


# --- validation --------------------------------------------------------------------------------


@dataclass
class BatchInputSummary:
    """What a valid batch input holds: the batch endpoint and model checks need no re-read."""

    lines: int = 0
    models: list[str] = field(default_factory=list)  # body.model values, first-seen order
    urls: list[str] = field(default_factory=list)  # url values, first-seen order


def validate_batch_input(data: bytes, max_lines: int) -> BatchInputSummary:
    """Check an upload line by line; ApiError 400 naming the lines at fault (the first
    MAX_REPORTED_PROBLEMS of them) when any is."""
    summary = BatchInputSummary()
    problems: list[str] = []
    first_line_of: dict[str, int] = {}
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            400, f"The file is not UTF-8 text (byte {exc.start})", code="invalid_file"
        ) from None
    number = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            problems.append(f"line {number}: empty line")
            continue
        if number > max_lines:
            raise ApiError(
                400,
                f"The file has more than {max_lines} requests (lines), this server's limit for "
                "one batch; split it into several files",
                code="too_many_lines",
            )
        problem = _line_problem(raw, number, first_line_of, summary)
        if problem:
            problems.append(f"line {number}: {problem}")
    if number == 0:
        raise ApiError(
            400, "The file is empty; a batch file holds one request per line", code="invalid_file"
        )
    if problems:
        shown = "; ".join(problems[:MAX_REPORTED_PROBLEMS])
        more = len(problems) - MAX_REPORTED_PROBLEMS
        raise ApiError(
            400,
            f"The file has {len(problems)} invalid line(s): {shown}"
            + (f"; and {more} more" if more > 0 else ""),
            code="invalid_file",
        )
    summary.lines = number
    return summary


def _line_problem(
    raw: str, number: int, first_line_of: dict[str, int], summary: BatchInputSummary
) -> str | None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return f"not valid JSON ({exc.msg} at column {exc.colno})"
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    parsed = parse_batch_request(obj)
    if parsed["error"]:
        return str(parsed["error"])
    custom_id = parsed["custom_id"]
    if custom_id in first_line_of:
        return f"duplicate custom_id {custom_id!r} (first on line {first_line_of[custom_id]})"
    first_line_of[custom_id] = number
    model = obj["body"].get("model")
    if not isinstance(model, str) or not model:
        return "body.model must be a non-empty string"
    for values, value in ((summary.models, model), (summary.urls, obj["url"])):
        if value not in values:
            values.append(value)
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


def _not_found(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", param="file_id", code="not_found")

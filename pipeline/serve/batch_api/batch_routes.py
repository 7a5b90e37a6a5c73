"""HTTP routes of `/v1/files` and `/v1/batches` (OpenAI's shapes), mounted on the ingress.

The routes are plain functions on an APIRouter that pipeline.serve.app includes in its FastAPI
app; the ingress replica hands them its serve file, its key check and its admission with
`install` when it starts (one ingress per replica process). Without `batch_api` in the serve
file they answer 404 like any unknown route. Storage and the Jobs API block, so they run in
threads.

Every call is admitted as a chat request is: an ingress slot and the key's own limits
(requests_per_minute, max_concurrent), 429 beyond them; a body over http.max_body_bytes (an
upload: over batch_api.max_file_bytes) is refused before it is read. An upload also takes one
of batch_api.max_concurrent_uploads slots, and streams through: the multipart body is read as
it arrives (pipeline.serve.batch_api.multipart), its file part checked line by line and written to
storage in parts (pipeline.serve.batch_api.files.Upload), so the ingress holds a few MiB per upload
whatever the file's size. The key's Batch API quotas (pipeline.serve.access.keys.BatchQuota) are
checked here (bytes stored) and by the batch service (batches in flight, lines per day).
"""

# No `from __future__ import annotations`: FastAPI reads the signatures at runtime.
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.openai.errors import ApiError
from pipeline.openai.models import parse_json_body
from pipeline.serve.access.keys import ApiKey
from pipeline.serve.access.limits import Gate
from pipeline.serve.batch_api.batch_quota import UPLOAD_RENEW_S, QuotaLedger
from pipeline.serve.batch_api.batches import BatchService, JobsApi
from pipeline.serve.batch_api.files import (
    PURPOSES,
    FileStore,
    StoredFile,
    StreamingValidator,
    Upload,
)
from pipeline.serve.batch_api.multipart import (
    MultipartError,
    MultipartReader,
    PartData,
    PartEnd,
    PartStart,
)
from pipeline.serve.http.httpio import (
    HeldStreamingResponse,
    body_chunks,
    body_too_large,
    check_declared_length,
    read_body,
)
from pipeline.serve.spec import ServeSpec
from pipeline.submit import connect as connect_jobs
from pipeline.submit import resolve_auth_token

logger = logging.getLogger(__name__)
router = APIRouter()
# Room for the multipart framing around an upload of max_file_bytes.
MULTIPART_OVERHEAD_BYTES = 64 * 1024
# An upload's data goes to its thread (checked, then written) in pieces of about this size.
UPLOAD_PIECE_BYTES = 1024 * 1024
MAX_FIELD_BYTES = 1024  # a form field other than the file (purpose, or one we do not read)
# An upload reserves storage quota ahead of its data in steps of at least this much (or what
# it declared), so a large upload updates the shared count a few times, not per chunk.
RESERVE_STEP_BYTES = 1024 * 1024

# Takes an ingress slot and the key's admission for one call (429 if refused); returns the
# function that gives them back.
Enter = Callable[[ApiKey], Awaitable[Callable[[], None]]]


async def _no_admission(_: ApiKey) -> Callable[[], None]:
    return lambda: None


@dataclass
class _Installed:
    spec: ServeSpec
    authenticate: Callable[[Request], ApiKey]
    enter: Enter
    service: BatchService
    uploads: Gate  # batch_api.max_concurrent_uploads


_installed: _Installed | None = None


def install(
    spec: ServeSpec, authenticate: Callable[[Request], ApiKey], enter: Enter = _no_admission
) -> None:
    """Called by the ingress at start: the routes answer for this serve file."""
    global _installed
    if spec.batch_api is None:
        _installed = None
        return
    service = BatchService(spec, _jobs_client(spec))
    uploads = Gate(spec.batch_api.max_concurrent_uploads)
    _installed = _Installed(spec, authenticate, enter, service, uploads)


def _jobs_client(spec: ServeSpec) -> Callable[[], JobsApi]:
    """A Jobs API client, made when first needed, as `tokenmill submit` makes its own."""

    def connect() -> JobsApi:

        assert spec.batch_api is not None
        token = resolve_auth_token(os.environ)
        return cast(JobsApi, connect_jobs(spec.batch_api.jobs_address, token))

    return connect


@dataclass
class _Caller:
    service: BatchService
    key: ApiKey
    owner: str  # what its files and batches belong to (pipeline.serve.access.keys)
    release: Callable[[], None]  # its ingress slot and key admission


def _installed_or_404() -> _Installed:
    if _installed is None:
        raise StarletteHTTPException(404, "Not Found")
    return _installed


@contextlib.asynccontextmanager
async def _admitted(request: Request, upload: bool = False) -> AsyncIterator[_Caller]:
    """Authenticate, check the declared body size (http.max_body_bytes; an upload checks its
    own), then take an ingress slot and the key's admission for the call; given back at the
    end unless the caller hands `release` on (a streamed response)."""
    installed = _installed_or_404()
    key = installed.authenticate(request)
    if key.owner is None:
        raise ApiError(
            403,
            "The Batch API keeps files and batches per key, and this server accepts callers "
            "without one (--insecure-no-auth): start it with keys (TOKENMILL_API_KEYS, "
            "auth.api_keys_file or auth.keys_file) to use /v1/files and /v1/batches",
            type="permission_error",
            code="permission_denied",
        )
    if not upload:
        limit = installed.spec.http.max_body_bytes
        check_declared_length(request, limit, body_too_large(limit))
    release = await installed.enter(key)
    caller = _Caller(installed.service, key, key.owner, release)
    try:
        yield caller
    finally:
        caller.release()


def _busy(code: str, what: str) -> ApiError:
    return ApiError.busy(code, what, _installed_or_404().spec.http.retry_after_s)


def _too_large(limit: int) -> ApiError:
    # 400, not 413: OpenAI refuses an oversized upload as a bad request.
    return ApiError(
        400,
        f"The file is larger than this server's limit of {limit} bytes; split it",
        param="file",
        code="file_too_large",
    )


@router.post("/v1/files")
async def upload_file(request: Request) -> JSONResponse:
    installed = _installed_or_404()
    limits = installed.service.api
    async with _admitted(request, upload=True) as caller:
        check_declared_length(
            request,
            limits.max_file_bytes + MULTIPART_OVERHEAD_BYTES,
            _too_large(limits.max_file_bytes),
        )
        if not installed.uploads.try_take():
            raise _busy(
                "upload_slots_full",
                f"this server is taking its maximum of {installed.uploads.capacity} uploads",
            )
        try:
            stored = await _UploadReceiver(request, caller).receive()
        finally:
            installed.uploads.give()
        return JSONResponse(stored.public())


class _UploadReceiver:
    """One upload read from the request as it arrives (see the module docstring).

    Bounds: every byte of the body counts against the upload's limit (max_file_bytes plus
    MULTIPART_OVERHEAD_BYTES of framing and fields) however it is framed, each field other
    than the file against MAX_FIELD_BYTES, and a body that pauses for
    http.body_idle_timeout_s is cut (408). With a storage quota, the file's bytes are
    reserved in the key's shared count (batch_quota.QuotaLedger) before they are written, so
    uploads side by side on any replicas never store more than the quota together; the
    reservation is dropped once the file is stored (then its listing counts it) or fails.
    """

    def __init__(self, request: Request, caller: _Caller) -> None:
        self.request = request
        self.caller = caller
        self.limits = caller.service.api
        self.http = caller.service.spec.http
        self.files: FileStore = caller.service.files(caller.owner)
        self.upload: Upload | None = None
        self.validator = StreamingValidator(self.limits.max_file_lines, self.limits.max_line_bytes)
        self.filename: str | None = None
        self.purpose: bytearray | None = None
        self.field_bytes = 0  # bytes of the field being read, when it is not the file
        self.received = 0  # bytes of the file part
        self.pending: list[bytes] = []  # file data not yet handed to the thread
        self.pending_bytes = 0
        # The storage quota's shared count (None: no quota), this upload's reservation in it,
        # what is reserved so far and when it was last renewed.
        self.ledger: QuotaLedger | None = None
        self.reservation = f"upload-{os.urandom(8).hex()}"
        self.reserved = 0
        self.renewed_at = 0.0

    async def receive(self) -> StoredFile:
        key = self.caller.key
        if key.batch.max_stored_bytes is not None:
            self.ledger = self.caller.service.quota_ledger(self.caller.owner, key.batch, key.name)
        try:
            return await self._receive()
        finally:
            if self.reserved:
                # Shielded: a client that went away still leaves no reservation behind.
                await asyncio.shield(asyncio.to_thread(self._release))

    async def _receive(self) -> StoredFile:
        declared = self.request.headers.get("content-length", "")
        at_least = int(declared) - MULTIPART_OVERHEAD_BYTES if declared.isdigit() else 0
        if self.ledger is not None and at_least > 0:
            await self._reserve(at_least, at_least)  # a declared size that cannot fit: refused
        try:
            reader = MultipartReader(self.request.headers.get("content-type", ""))
        except MultipartError as exc:
            raise _bad_upload(str(exc)) from None
        limit = self.limits.max_file_bytes + MULTIPART_OVERHEAD_BYTES
        chunks = body_chunks(
            self.request,
            limit,
            _too_large(self.limits.max_file_bytes),
            self.http.body_idle_timeout_s,
        )
        try:
            current: str | None = None  # the form field being read
            async for chunk in chunks:
                for event in _events(reader, chunk):
                    if isinstance(event, PartStart):
                        current = await self._start(event)
                    elif isinstance(event, PartData):
                        self._data(current, event.data)
                    elif isinstance(event, PartEnd):
                        current = None
                if self.ledger is not None:
                    await self._keep_reserved()
                if self.pending_bytes >= UPLOAD_PIECE_BYTES:
                    await self._flush()
            try:
                reader.close()
            except MultipartError as exc:
                raise _bad_upload(str(exc)) from None
            await self._flush()
            self._check_purpose(final=True)
            if self.upload is None:
                raise ApiError(
                    400, "Missing required parameter: 'file'.", param="file", code="missing"
                )
            # Problems in the lines do not refuse the upload: a batch made from it fails.
            summary = self.validator.finish()
            upload = self.upload
            return await asyncio.to_thread(
                upload.commit,
                self.filename or "upload.jsonl",
                self._purpose_text(),
                summary.to_json(),
            )
        except BaseException:
            if self.upload is not None:
                # Shielded: a client that went away still leaves nothing behind.
                await asyncio.shield(asyncio.to_thread(self.upload.abort))
            raise

    async def _start(self, part: PartStart) -> str | None:
        self.field_bytes = 0
        if part.name == "file":
            if self.upload is not None:
                raise _bad_upload("the body has two 'file' parts; send one file per upload")
            self._check_purpose(final=False)  # a purpose sent first is refused before storing
            self.filename = part.filename
            self.upload = await asyncio.to_thread(self.files.open_upload)
        elif part.name == "purpose":
            self.purpose = bytearray()
        return part.name

    def _data(self, field: str | None, data: bytes) -> None:
        if field == "file":
            self.received += len(data)
            if self.received > self.limits.max_file_bytes:
                raise _too_large(self.limits.max_file_bytes)
            self.pending.append(data)
            self.pending_bytes += len(data)
            return
        # Any other field (the preamble and epilogue too) is bounded, read or not.
        self.field_bytes += len(data)
        if self.field_bytes > MAX_FIELD_BYTES:
            name = f"the {field!r} field" if field else "the data outside the form's fields"
            raise _bad_upload(f"{name} is over {MAX_FIELD_BYTES} bytes")
        if field == "purpose" and self.purpose is not None:
            self.purpose += data

    async def _keep_reserved(self) -> None:
        """Reserve ahead of the file's bytes before they are written (in steps: double what
        arrived, up to RESERVE_STEP_BYTES more), and renew a reservation held long."""
        if self.received > self.reserved:
            await self._reserve(
                self.received, min(2 * self.received, self.received + RESERVE_STEP_BYTES)
            )
        elif self.reserved and time.monotonic() - self.renewed_at > UPLOAD_RENEW_S:
            await self._reserve(self.reserved, self.reserved)

    async def _reserve(self, need: int, want: int) -> None:
        assert self.ledger is not None
        self.reserved = await asyncio.to_thread(
            self.ledger.reserve_bytes, self.reservation, need, want, self.files.stored_bytes
        )
        self.renewed_at = time.monotonic()

    def _release(self) -> None:
        assert self.ledger is not None
        try:
            self.ledger.release_bytes(self.reservation)
        except Exception:  # it runs out by itself (UPLOAD_RESERVATION_TTL_S)
            logger.warning("releasing upload reservation %s failed", self.reservation)

    async def _flush(self) -> None:
        if not self.pending:
            return
        pieces, self.pending, self.pending_bytes = self.pending, [], 0
        assert self.upload is not None
        await asyncio.to_thread(_check_and_write, self.validator, self.upload, pieces)

    def _purpose_text(self) -> str:
        return bytes(self.purpose or b"").decode(errors="replace").strip()

    def _check_purpose(self, final: bool) -> None:
        if self.purpose is None and not final:
            return  # not sent yet: it may follow the file
        purpose = self._purpose_text()
        if purpose not in PURPOSES:
            raise ApiError(
                400,
                f"Invalid purpose {purpose!r}; this server stores files for: {', '.join(PURPOSES)}",
                param="purpose",
                code="invalid_value",
            )


def _events(reader: MultipartReader, chunk: bytes) -> list:
    try:
        return reader.feed(chunk)
    except MultipartError as exc:
        raise _bad_upload(str(exc)) from None


def _check_and_write(validator: StreamingValidator, upload: Upload, pieces: list[bytes]) -> None:
    for data in pieces:
        validator.feed(data)
        upload.write(data)


def _bad_upload(why: str) -> ApiError:
    return ApiError(
        400,
        f"The upload could not be read: {why}. Upload the file as multipart/form-data with "
        "fields 'file' and 'purpose'",
        code="invalid_request",
    )


@router.get("/v1/files")
async def list_files(
    request: Request, purpose: str | None = None, limit: int = 10_000, after: str | None = None
) -> JSONResponse:
    async with _admitted(request) as caller:
        files = await asyncio.to_thread(caller.service.files(caller.owner).list)
    found = [f.public() for f in files if purpose is None or f.data.get("purpose") == purpose]
    if after is not None:
        ids = [f["id"] for f in found]
        found = found[ids.index(after) + 1 :] if after in ids else []
    page = found[: max(limit, 1)]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(found) > len(page),
        }
    )


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> JSONResponse:
    async with _admitted(request) as caller:
        stored = await asyncio.to_thread(caller.service.files(caller.owner).get, file_id)
    return JSONResponse(stored.public())


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    async with _admitted(request) as caller:
        files = caller.service.files(caller.owner)
        stored = await asyncio.to_thread(files.get, file_id)
        # The call holds its slot until the last byte is sent: the response gives it back.
        release, caller.release = caller.release, lambda: None
    # A sync iterator: Starlette reads it in a thread pool, chunk by chunk.
    return HeldStreamingResponse(
        files.iter_content(stored), media_type="application/octet-stream", on_close=release
    )


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> JSONResponse:
    async with _admitted(request) as caller:
        files = caller.service.files(caller.owner)
        stored = await asyncio.to_thread(files.get, file_id)
        await asyncio.to_thread(files.delete, stored)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


# --- /v1/batches -------------------------------------------------------------------------------


@router.post("/v1/batches")
async def create_batch(request: Request) -> JSONResponse:
    async with _admitted(request) as caller:
        http = caller.service.spec.http
        body = parse_json_body(
            await read_body(request, http.max_body_bytes, http.body_idle_timeout_s)
        )
        key = caller.key
        batch = await asyncio.to_thread(
            caller.service.create, caller.owner, key.allows, body, key.batch, key.name
        )
    return JSONResponse(batch)


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> JSONResponse:
    async with _admitted(request) as caller:
        page = await asyncio.to_thread(caller.service.list, caller.owner, limit, after)
    return JSONResponse(page)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> JSONResponse:
    async with _admitted(request) as caller:
        batch = await asyncio.to_thread(caller.service.retrieve, caller.owner, batch_id)
    return JSONResponse(batch)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
    async with _admitted(request) as caller:
        batch = await asyncio.to_thread(caller.service.cancel, caller.owner, batch_id)
    return JSONResponse(batch)

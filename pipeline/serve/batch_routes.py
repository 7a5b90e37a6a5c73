"""HTTP routes of `/v1/files` and `/v1/batches` (OpenAI's shapes), mounted on the ingress.

The routes are plain functions on an APIRouter that pipeline.serve.app includes in its FastAPI
app; the ingress replica hands them its serve file and its key check with `install` when it
starts (one ingress per replica process). Without `batch_api` in the serve file they answer
404 like any unknown route. Storage and the Jobs API block, so they run in threads.
"""

# No `from __future__ import annotations`: FastAPI reads the signatures at runtime.
import asyncio
import email.policy
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from email.parser import BytesParser
from typing import cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.serve.batches import BatchService, JobsApi
from pipeline.serve.files import PURPOSES, validate_batch_input
from pipeline.serve.keys import ApiKey
from pipeline.serve.protocol import ApiError, parse_json_body
from pipeline.serve.spec import ServeSpec

router = APIRouter()
# Room for the multipart framing around an upload of max_file_bytes.
MULTIPART_OVERHEAD_BYTES = 64 * 1024


@dataclass
class _Installed:
    authenticate: Callable[[Request], ApiKey]
    service: BatchService


_installed: _Installed | None = None


def install(spec: ServeSpec, authenticate: Callable[[Request], ApiKey]) -> None:
    """Called by the ingress at start: the routes answer for this serve file."""
    global _installed
    if spec.batch_api is None:
        _installed = None
        return
    _installed = _Installed(authenticate, BatchService(spec, _jobs_client(spec)))


def _jobs_client(spec: ServeSpec) -> Callable[[], JobsApi]:
    """A Jobs API client, made when first needed, as `tokenmill submit` makes its own."""

    def connect() -> JobsApi:
        from pipeline.submit import connect as connect_jobs
        from pipeline.submit import resolve_auth_token

        assert spec.batch_api is not None
        token = resolve_auth_token(os.environ)
        return cast(JobsApi, connect_jobs(spec.batch_api.jobs_address, token))

    return connect


def _caller(request: Request) -> tuple[BatchService, ApiKey, str]:
    """The service, the caller's key and the owner its files and batches belong to."""
    if _installed is None:
        raise StarletteHTTPException(404, "Not Found")
    key = _installed.authenticate(request)
    if key.owner is None:
        raise ApiError(
            403,
            "The Batch API keeps files and batches per key, and this server accepts callers "
            "without one (--insecure-no-auth): start it with keys (TOKENMILL_API_KEYS, "
            "auth.api_keys_file or auth.keys_file) to use /v1/files and /v1/batches",
            type="permission_error",
            code="permission_denied",
        )
    return _installed.service, key, key.owner


# --- multipart ---------------------------------------------------------------------------------


def parse_multipart(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """Form fields of a multipart/form-data body: name -> (filename, bytes)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise ApiError(
            400,
            "Upload the file as multipart/form-data with fields 'file' and 'purpose'",
            code="invalid_request",
        )
    head = b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n"
    message = BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise ApiError(400, "The multipart body could not be read", code="invalid_request")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():  # type: ignore[attr-defined]
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True)
            fields[name] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    return fields


def _too_large(limit: int) -> ApiError:
    # 400, not 413: OpenAI refuses an oversized upload as a bad request.
    return ApiError(
        400,
        f"The file is larger than this server's limit of {limit} bytes; split it",
        param="file",
        code="file_too_large",
    )


async def _read_limited(request: Request, limit: int) -> bytes:
    too_large = _too_large(limit)
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + MULTIPART_OVERHEAD_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit + MULTIPART_OVERHEAD_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


# --- /v1/files ---------------------------------------------------------------------------------


@router.post("/v1/files")
async def upload_file(request: Request) -> JSONResponse:
    service, _, owner = _caller(request)
    limits = service.api
    body = await _read_limited(request, limits.max_file_bytes)
    fields = parse_multipart(request.headers.get("content-type", ""), body)
    purpose = fields.get("purpose", (None, b""))[1].decode(errors="replace").strip()
    if purpose not in PURPOSES:
        raise ApiError(
            400,
            f"Invalid purpose {purpose!r}; this server stores files for: {', '.join(PURPOSES)}",
            param="purpose",
            code="invalid_value",
        )
    if "file" not in fields:
        raise ApiError(400, "Missing required parameter: 'file'.", param="file", code="missing")
    filename, content = fields["file"]
    if len(content) > limits.max_file_bytes:
        raise _too_large(limits.max_file_bytes)
    # Problems in the lines do not refuse the upload: a batch made from it fails instead.
    summary = await asyncio.to_thread(
        validate_batch_input, io.BytesIO(content), limits.max_file_lines
    )
    stored = await asyncio.to_thread(
        service.files(owner).create,
        content,
        filename or "upload.jsonl",
        purpose,
        summary.to_json(),
    )
    return JSONResponse(stored.public())


@router.get("/v1/files")
async def list_files(
    request: Request, purpose: str | None = None, limit: int = 10_000, after: str | None = None
) -> JSONResponse:
    service, _, owner = _caller(request)
    files = await asyncio.to_thread(service.files(owner).list)
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
    service, _, owner = _caller(request)
    stored = await asyncio.to_thread(service.files(owner).get, file_id)
    return JSONResponse(stored.public())


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    service, _, owner = _caller(request)
    files = service.files(owner)
    stored = await asyncio.to_thread(files.get, file_id)
    # A sync iterator: Starlette reads it in a thread pool, chunk by chunk.
    return StreamingResponse(files.iter_content(stored), media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> JSONResponse:
    service, _, owner = _caller(request)
    files = service.files(owner)
    stored = await asyncio.to_thread(files.get, file_id)
    await asyncio.to_thread(files.delete, stored)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


# --- /v1/batches -------------------------------------------------------------------------------


@router.post("/v1/batches")
async def create_batch(request: Request) -> JSONResponse:
    service, key, owner = _caller(request)
    body = parse_json_body(await request.body())
    batch = await asyncio.to_thread(service.create, owner, key.allows, body)
    return JSONResponse(batch)


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> JSONResponse:
    service, _, owner = _caller(request)
    return JSONResponse(await asyncio.to_thread(service.list, owner, limit, after))


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> JSONResponse:
    service, _, owner = _caller(request)
    return JSONResponse(await asyncio.to_thread(service.retrieve, owner, batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
    service, _, owner = _caller(request)
    return JSONResponse(await asyncio.to_thread(service.cancel, owner, batch_id))

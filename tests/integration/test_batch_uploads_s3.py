"""Batch API uploads to s3:// storage (moto's S3 server over HTTP): a file larger than one
part goes up as a multipart upload while it arrives, and an upload that fails midway leaves
neither an object nor an unfinished multipart upload behind."""

from __future__ import annotations

import asyncio
import hashlib
import json

from pipeline.serve.batch_api import batch_routes
from pipeline.serve.batch_api.files import UPLOAD_PART_BYTES
from pipeline.serve.spec import parse_serve_spec
from tests.integration.s3_server import S3Server
from tests.unit.test_batch_api import (
    BOUNDARY,
    KEYS,
    MULTIPART_TAIL,
    FakeJobs,
    _asgi_post,
    _big_lines,
    _chunked,
    _multipart_head,
    _routes_app,
)

CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def _app(s3_server: S3Server, bucket: str):  # type: ignore[no-untyped-def]
    spec = parse_serve_spec(
        {
            "models": [{"name": "tiny", "model": {"path": "/m"}, "batch": {}}],
            "batch_api": {"uri": f"s3://{bucket}/batches", "max_file_bytes": 64 << 20},
            "storage": {"endpoint_url": s3_server.endpoint_url},
        }
    )
    return _routes_app(spec, FakeJobs(), KEYS.get)


def test_a_large_upload_goes_up_in_parts(s3_server: S3Server, bucket: str) -> None:
    size = 3 * UPLOAD_PART_BYTES
    app = _app(s3_server, bucket)
    try:
        body = _chunked(iter([_multipart_head(), *_big_lines(size), MULTIPART_TAIL]))
        status, _, raw = asyncio.run(_asgi_post(app, "/v1/files", "key-a", body, CONTENT_TYPE))
        assert status == 200, raw
        uploaded = json.loads(raw)
        assert uploaded["bytes"] == size
        service = batch_routes._installed.service  # type: ignore[union-attr]
        files = service.files("alpha")
        stored = files.get(uploaded["id"])
        (uri,) = files.content_uris(stored)
        content = s3_server.get(uri)
        assert (
            hashlib.sha256(content).digest() == hashlib.sha256(b"".join(_big_lines(size))).digest()
        )
        # Completed from parts, not one PUT: S3 gives such an object a "-<parts>" ETag.
        head = s3_server.client().head_object(Bucket=bucket, Key=uri.split("/", 3)[3])
        assert head["ETag"].strip('"').endswith("-3"), head["ETag"]
        assert files.stored_bytes() == size
    finally:
        batch_routes._installed = None


def test_a_failed_upload_leaves_nothing(s3_server: S3Server, bucket: str) -> None:
    app = _app(s3_server, bucket)
    try:
        # Two parts' worth of data, then the body ends without its closing boundary.
        lines = _big_lines(2 * UPLOAD_PART_BYTES + 4096)
        body = _chunked(iter([_multipart_head(), *lines]))
        status, _, raw = asyncio.run(_asgi_post(app, "/v1/files", "key-a", body, CONTENT_TYPE))
        assert status == 400 and b"closing boundary" in raw, raw
        client = s3_server.client()
        assert client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
        assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    finally:
        batch_routes._installed = None

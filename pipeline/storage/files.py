"""Filesystems and input listing: one fsspec family (s3fs for s3://, the local filesystem
otherwise).

Everything that touches input files, model directories or output objects gets its filesystem
here, so endpoint, timeouts and the fast-failing retry limits are set in one place.
Credentials come only from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_DEFAULT_REGION, ...); the job file holds the endpoint, never a secret.

Paths returned by `filesystem_for` are the filesystem's own paths: "bucket/key" for S3, an
absolute path for local files. URIs handed back to callers are always full ("s3://bucket/key"
or an absolute local path), so they can be stored in manifests and passed to other processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.spec import JobSpec, SpecError, StorageSpec

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

# Fail fast on a wrong endpoint: a job should not wait minutes before reporting a typo. The
# commit path adds its own, longer retries on top (pipeline.storage.retry).
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 60
MAX_ATTEMPTS = 2
_GLOB_CHARS = frozenset("*?[")
# Files that are bookkeeping, not data: _SUCCESS, _manifest.json, .crc, .DS_Store, ...
_HIDDEN_PREFIXES = ("_", ".")


class StorageError(RuntimeError):
    """An object store or file operation failed; the message names the URI and the endpoint."""


@dataclass(frozen=True)
class InputFile:
    """One input file found by listing: what the reader reads and the fingerprint hashes."""

    uri: str  # full URI: s3://bucket/key or an absolute local path
    size: int  # bytes
    version: str  # S3 ETag, or "mtime:<ns>" for local files: changes when the content does


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def strip_file_scheme(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


def _s3_filesystem(storage: StorageSpec) -> AbstractFileSystem:
    import s3fs

    client_kwargs: dict[str, Any] = {}
    if storage.endpoint_url:
        client_kwargs["endpoint_url"] = storage.endpoint_url
    if storage.region:
        client_kwargs["region_name"] = storage.region
    fs = s3fs.S3FileSystem(
        anon=storage.anonymous,
        client_kwargs=client_kwargs,
        config_kwargs={
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": READ_TIMEOUT_S,
            "retries": {"max_attempts": MAX_ATTEMPTS, "mode": "standard"},
        },
        # Another process (a resumed run, a second writer) may change a prefix at any time;
        # a cached listing would hide its parts.
        use_listings_cache=False,
    )
    # s3fs retries some errors itself on top of botocore (5 by default); keep the total short.
    fs.retries = MAX_ATTEMPTS
    return fs


def filesystem_for(uri: str, storage: StorageSpec) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem for `uri` and the path to use with it."""
    if is_s3(uri):
        return _s3_filesystem(storage), uri[len("s3://") :]
    if "://" in uri and not uri.startswith("file://"):
        raise SpecError(f"unsupported URI scheme in {uri!r}: use s3://, file:// or a local path")
    from fsspec.implementations.local import LocalFileSystem

    path = os.path.abspath(os.path.expanduser(strip_file_scheme(uri)))
    return LocalFileSystem(), path


def _to_uri(fs: AbstractFileSystem, path: str, like: str) -> str:
    return f"s3://{path}" if is_s3(like) else path


def endpoint_of(storage: StorageSpec, uri: str) -> str:
    if not is_s3(uri):
        return "local filesystem"
    return storage.endpoint_url or "the default AWS endpoint"


def version_of(info: dict[str, Any], uri: str) -> str:
    if is_s3(uri):
        etag = info.get("ETag") or info.get("etag") or ""
        return str(etag).strip('"') or f"size:{info.get('size')}"
    mtime = info.get("mtime") or info.get("created") or 0
    return f"mtime:{int(float(mtime) * 1e9)}"


def _is_hidden(path: str) -> bool:
    return path.rstrip("/").rsplit("/", 1)[-1].startswith(_HIDDEN_PREFIXES)


def unreachable_error(uri: str, storage: StorageSpec, exc: BaseException, field: str) -> SpecError:
    return SpecError(
        f"{field}: cannot reach {uri} at {endpoint_of(storage, uri)}: "
        f"{type(exc).__name__}: {exc}. Check storage.endpoint_url, the bucket name and the "
        "AWS_* credentials in the environment."
    )


def expand_uri(uri: str, storage: StorageSpec, field: str = "input.uri") -> list[InputFile]:
    """Files behind one URI: a file, a directory (recursive) or a glob; sorted by URI.

    Raises SpecError naming `field` and the URI when nothing matches or storage is unreachable.
    """
    fs, path = filesystem_for(uri, storage)
    try:
        if _GLOB_CHARS & set(path):
            found = fs.glob(path, detail=True)
        elif fs.isdir(path):
            found = fs.find(path, detail=True)
        elif fs.exists(path):
            found = {path: fs.info(path)}
        else:
            found = {}
    except (FileNotFoundError, PermissionError) as exc:
        if isinstance(exc, PermissionError):
            raise unreachable_error(uri, storage, exc, field) from None
        found = {}
    except SpecError:
        raise
    except Exception as exc:  # botocore / aiohttp errors have no common base worth naming
        raise unreachable_error(uri, storage, exc, field) from None
    files = [
        InputFile(
            uri=_to_uri(fs, p, uri), size=int(info.get("size") or 0), version=version_of(info, uri)
        )
        for p, info in found.items()
        if info.get("type", "file") != "directory" and not _is_hidden(p)
    ]
    if not files:
        where = endpoint_of(storage, uri) if is_s3(uri) or path == uri else f"local path {path}"
        raise SpecError(
            f"{field}: no input file matches {uri!r} (at {where}); "
            "check the path, the glob and that the files were uploaded"
        )
    return sorted(files, key=lambda f: f.uri)


def list_input_files(spec: JobSpec) -> list[InputFile]:
    """Every input file of the job, in the order of `input.uri` entries, each entry sorted.

    A file matched by two entries is read once.
    """
    if spec.input.format == "ray_data":
        # pipeline.batch.stages.read.staging turns the source into Parquet files; listing
        # comes after that.
        raise SpecError(
            "input.format ray_data has no files to list before `tokenmill run` stages the "
            "source (pipeline.batch.stages.read.staging); run the job, or point input.uri at "
            "the staged snapshot (output.uri/_staging/...) with format parquet"
        )
    seen: set[str] = set()
    files: list[InputFile] = []
    for index, uri in enumerate(spec.input.uris):
        field = "input.uri" if isinstance(spec.input.uri, str) else f"input.uri.{index}"
        for item in expand_uri(uri, spec.storage, field=field):
            if item.uri not in seen:
                seen.add(item.uri)
                files.append(item)
    return files


def join_uri(base: str, name: str) -> str:
    """`base/name` without doubled slashes; works for s3:// and local paths."""
    return f"{base.rstrip('/')}/{name.lstrip('/')}"


def exists(uri: str, storage: StorageSpec) -> bool:
    fs, path = filesystem_for(uri, storage)
    try:
        return bool(fs.exists(path))
    except Exception as exc:
        raise StorageError(f"cannot check {uri} at {endpoint_of(storage, uri)}: {exc}") from exc

"""Object storage access: one fsspec family (s3fs for s3://, the local filesystem otherwise).

Everything that touches input files, model directories or output objects goes through here, so
endpoint, timeouts and retries are set in one place. Credentials come only from the
environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, ...); the job file
holds the endpoint, never a secret.

Paths returned by `filesystem_for` are the filesystem's own paths: "bucket/key" for S3, an
absolute path for local files. URIs handed back to callers are always full ("s3://bucket/key"
or an absolute local path), so they can be stored in manifests and passed to other processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.spec import JobSpec, SpecError, StorageSpec

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

# Fail fast on a wrong endpoint: a job should not wait minutes before reporting a typo.
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 60
MAX_ATTEMPTS = 2
_GLOB_CHARS = frozenset("*?[")
# Files that are bookkeeping, not data: _SUCCESS, _manifest.json, .crc, .DS_Store, ...
_HIDDEN_PREFIXES = ("_", ".")
# Written last into a downloaded model directory; its presence means the download completed.
COMPLETE_MARKER = ".tokenmill-complete"


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


def _strip_file_scheme(uri: str) -> str:
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

    path = os.path.abspath(os.path.expanduser(_strip_file_scheme(uri)))
    return LocalFileSystem(), path


def _to_uri(fs: AbstractFileSystem, path: str, like: str) -> str:
    return f"s3://{path}" if is_s3(like) else path


def _endpoint(storage: StorageSpec, uri: str) -> str:
    if not is_s3(uri):
        return "local filesystem"
    return storage.endpoint_url or "the default AWS endpoint"


def _version(info: dict[str, Any], uri: str) -> str:
    if is_s3(uri):
        etag = info.get("ETag") or info.get("etag") or ""
        return str(etag).strip('"') or f"size:{info.get('size')}"
    mtime = info.get("mtime") or info.get("created") or 0
    return f"mtime:{int(float(mtime) * 1e9)}"


def _is_hidden(path: str) -> bool:
    return path.rstrip("/").rsplit("/", 1)[-1].startswith(_HIDDEN_PREFIXES)


def _unreachable(uri: str, storage: StorageSpec, exc: BaseException, field: str) -> SpecError:
    return SpecError(
        f"{field}: cannot reach {uri} at {_endpoint(storage, uri)}: "
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
            raise _unreachable(uri, storage, exc, field) from None
        found = {}
    except SpecError:
        raise
    except Exception as exc:  # botocore / aiohttp errors have no common base worth naming
        raise _unreachable(uri, storage, exc, field) from None
    files = [
        InputFile(
            uri=_to_uri(fs, p, uri), size=int(info.get("size") or 0), version=_version(info, uri)
        )
        for p, info in found.items()
        if info.get("type", "file") != "directory" and not _is_hidden(p)
    ]
    if not files:
        where = _endpoint(storage, uri) if is_s3(uri) or path == uri else f"local path {path}"
        raise SpecError(
            f"{field}: no input file matches {uri!r} (at {where}); "
            "check the path, the glob and that the files were uploaded"
        )
    return sorted(files, key=lambda f: f.uri)


def list_input_files(spec: JobSpec) -> list[InputFile]:
    """Every input file of the job, in the order of `input.uri` entries, each entry sorted.

    A file matched by two entries is read once.
    """
    seen: set[str] = set()
    files: list[InputFile] = []
    for index, uri in enumerate(spec.input.uris):
        field = "input.uri" if isinstance(spec.input.uri, str) else f"input.uri.{index}"
        for item in expand_uri(uri, spec.storage, field=field):
            if item.uri not in seen:
                seen.add(item.uri)
                files.append(item)
    return files


# --- small object helpers (used for Parquet parts, the manifest and _SUCCESS) -----------------


def join_uri(base: str, name: str) -> str:
    """`base/name` without doubled slashes; works for s3:// and local paths."""
    return f"{base.rstrip('/')}/{name.lstrip('/')}"


def read_bytes(uri: str, storage: StorageSpec) -> bytes:
    fs, path = filesystem_for(uri, storage)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise StorageError(f"cannot read {uri} at {_endpoint(storage, uri)}: {exc}") from exc


def exists(uri: str, storage: StorageSpec) -> bool:
    fs, path = filesystem_for(uri, storage)
    try:
        return bool(fs.exists(path))
    except Exception as exc:
        raise StorageError(f"cannot check {uri} at {_endpoint(storage, uri)}: {exc}") from exc


def list_dir(uri: str, storage: StorageSpec) -> list[str]:
    """Full URIs of the files directly under `uri` (not recursive), sorted; [] if absent."""
    fs, path = filesystem_for(uri, storage)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    except Exception as exc:
        raise StorageError(f"cannot list {uri} at {_endpoint(storage, uri)}: {exc}") from exc
    return sorted(
        _to_uri(fs, entry["name"], uri)
        for entry in entries
        if entry.get("type", "file") != "directory"
        and entry["name"].rstrip("/") != path.rstrip("/")
    )


def write_bytes_atomic(uri: str, data: bytes, storage: StorageSpec) -> None:
    """Write `data` so readers see the old content or the new one, never a partial file.

    Local: a temporary file in the same directory, fsync, os.replace. S3: one PUT (objects
    become visible whole).
    """
    fs, path = filesystem_for(uri, storage)
    if is_s3(uri):
        try:
            fs.pipe_file(path, data)
        except Exception as exc:
            raise StorageError(f"cannot write {uri} at {_endpoint(storage, uri)}: {exc}") from exc
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# --- models ----------------------------------------------------------------------------------


def materialize_model(
    path: str,
    cache_dir: str,
    storage: StorageSpec,
    *,
    required_file: str = "config.json",
    field: str = "model.path",
    patterns: tuple[str, ...] | None = None,
) -> Path:
    """A local directory holding the model (or tokenizer) at `path`.

    Local paths are checked and returned as they are. s3:// prefixes are downloaded once per
    node into `cache_dir/<hash of uri and listing>`: a file lock makes concurrent actors on one
    node wait for a single download, and a marker written last tells a complete copy from one
    interrupted halfway. A changed remote listing (new ETags) hashes to a new directory.

    `patterns` (fnmatch globs on the relative path) download only some files, e.g. the
    tokenizer files without the weights; a different selection is a different cache entry.
    """
    if not is_s3(path):
        local = Path(os.path.expanduser(_strip_file_scheme(path)))
        if not (local / required_file).is_file():
            raise SpecError(
                f"{field}: {local} has no {required_file}; point it at a Hugging Face model "
                "directory (or an s3:// prefix holding one)"
            )
        return local

    prefix = path.rstrip("/")
    fs, root = filesystem_for(prefix, storage)
    try:
        listing = fs.find(root, detail=True)
    except Exception as exc:
        raise _unreachable(prefix, storage, exc, field) from None
    files = {
        p[len(root) + 1 :]: info
        for p, info in listing.items()
        if info.get("type", "file") != "directory" and p.startswith(root + "/")
    }
    if patterns is not None:
        files = {
            rel: info
            for rel, info in files.items()
            if rel == required_file or any(fnmatch.fnmatch(rel, pat) for pat in patterns)
        }
    if required_file not in files:
        raise SpecError(
            f"{field}: {prefix} has no {required_file} at {_endpoint(storage, prefix)}; "
            "upload the whole Hugging Face model directory under that prefix"
        )
    digest = hashlib.sha256(f"{prefix}\n{patterns}".encode())
    for rel in sorted(files):
        digest.update(f"\n{rel}\t{files[rel].get('size')}\t{_version(files[rel], prefix)}".encode())
    cache = Path(os.path.expanduser(cache_dir))
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / digest.hexdigest()[:16]
    if (target / COMPLETE_MARKER).is_file():
        return target
    with open(cache / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (target / COMPLETE_MARKER).is_file():  # another process finished while we waited
            return target
        # Leftovers of an interrupted download are not trusted.
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for rel in sorted(files):
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                fs.get_file(f"{root}/{rel}", str(dest))
            except Exception as exc:
                raise StorageError(
                    f"{field}: downloading {prefix}/{rel} from {_endpoint(storage, prefix)} "
                    f"failed: {exc}"
                ) from exc
        (target / COMPLETE_MARKER).write_text(prefix + "\n")
    return target

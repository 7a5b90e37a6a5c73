"""One prefix of an object store (or a local directory) with the operations a commit needs.

    put(name, data)                 atomic: readers see the old object or the new one, never part
    create(name, data)              only if `name` does not exist        (S3: If-None-Match: *)
    replace(name, data, version)    only if `name` is still `version`    (S3: If-Match: <ETag>)
    delete_if(name, version)        only if `name` is still `version`    (S3: If-Match on DELETE)
    read_versioned(name)            data, version and age by the store's own clock

On S3 the conditions are the store's (one request each; a lost race is a 412). On a local
filesystem, create is a hard link of a complete temp file (fails if the name exists);
replace and delete_if run under an flock on a hidden lock file beside the object, comparing
the object's (inode, mtime, size) before an atomic rename or the unlink; that fences
processes on one host or one POSIX-locking filesystem. Not every S3-compatible store honours
If-Match on DELETE (some delete regardless): `supports_conditional_deletes` probes it.

Every operation can be given a RetryPolicy (pipeline.storage.retry): transient failures are
retried, a failed precondition never is. A conditional write whose first attempt landed but
whose answer was lost (a dropped connection, a 503 after the write) is retried, by us or by the
client library, and the retry finds the object changed: a 412 that is no lost race. So after a
failed precondition the object is read back, and if it holds exactly the bytes written, the
write is reported as done. That needs every write's bytes to be its own: the lease and the
manifest carry a fresh write id.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import email.utils
import fcntl
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pipeline.spec import StorageSpec
from pipeline.storage.files import StorageError, endpoint_of, filesystem_for, is_s3
from pipeline.storage.retry import PreconditionFailed, RetryPolicy, with_retries

T = TypeVar("T")

TEMP_SUFFIX = ".tmp"  # local temp files: .<name>.<random>.tmp
# Tries of a local write whose temp file another run removed meanwhile (_local_move).
TEMP_ATTEMPTS = 3
_LOCK_SUFFIX = ".lock"  # local lock files: .<name>.lock


@dataclass(frozen=True)
class Versioned:
    """An object's bytes with the version a conditional replace must name."""

    data: bytes
    version: str  # S3: the ETag; local: "<inode>-<mtime_ns>-<size>"
    age_s: float  # seconds since it was last written, by the store's clock


def _local_version(st: os.stat_result) -> str:
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"


def _http_date(headers: dict[str, str]) -> dt.datetime | None:
    value = headers.get("date") or headers.get("Date")
    return email.utils.parsedate_to_datetime(value) if value else None


class OutputDir:
    """One prefix (an s3:// prefix or a local directory) and the objects directly under it."""

    def __init__(self, uri: str, storage: StorageSpec, retry: RetryPolicy | None = None):
        self.uri = uri.rstrip("/")
        self.storage = storage
        self.retry = retry
        self.fs, root = filesystem_for(self.uri, storage)
        self.root = root.rstrip("/")
        self.is_s3 = is_s3(self.uri)

    def with_retries(self, retry: RetryPolicy | None) -> OutputDir:
        """The same prefix whose operations are retried per `retry` (None: no retries)."""
        return OutputDir(self.uri, self.storage, retry)

    def _do(self, operation: Callable[[], T], what: str) -> T:
        if self.retry is None:
            return operation()
        return with_retries(operation, f"{what} at {self.uri}", self.retry)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def uri_of(self, name: str) -> str:
        return f"{self.uri}/{name}"

    def _bucket_key(self, name: str) -> tuple[str, str]:
        bucket, _, key = self.path(name).partition("/")
        return bucket, key

    def _fail(self, what: str, name: str, exc: Exception) -> StorageError:
        return StorageError(
            f"cannot {what} {self.uri_of(name)} at {endpoint_of(self.storage, self.uri)}: "
            f"{type(exc).__name__}: {exc}"
        )

    # --- listing and plain objects ------------------------------------------------------

    def names(self, prefix: str = "") -> list[str]:
        """Names directly under the prefix (starting with `prefix`), sorted; [] if absent."""

        def ls() -> list[str]:
            try:
                entries = self.fs.ls(self.root, detail=False, refresh=True)
            except FileNotFoundError:
                return []
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in entries)

        return [n for n in self._do(ls, "list") if n.startswith(prefix)]

    def exists(self, name: str) -> bool:
        return bool(self._do(lambda: self.fs.exists(self.path(name)), f"check {name}"))

    def read(self, name: str) -> bytes:
        return bytes(self._do(lambda: self.fs.cat_file(self.path(name)), f"read {name}"))

    def stat(self, name: str) -> tuple[int, str]:
        """(size in bytes, version) of an object, without reading it."""

        def info() -> tuple[int, str]:
            if not self.is_s3:
                st = os.stat(self.path(name))
                return st.st_size, _local_version(st)
            details = self.fs.info(self.path(name), refresh=True)
            return int(details.get("size") or 0), str(details.get("ETag", ""))

        return self._do(info, f"stat {name}")

    def put(self, name: str, data: bytes) -> str:
        """Make `name` hold exactly `data` (atomically); returns the new version."""
        return self._do(lambda: self._put(name, data), f"write {name}")

    def delete(self, name: str) -> None:
        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path(name))

        self._do(rm, f"delete {name}")

    # --- conditional writes ---------------------------------------------------------------

    def read_versioned(self, name: str) -> Versioned | None:
        """`name`'s bytes, version and age; None if it does not exist."""
        return self._do(lambda: self._read_versioned(name), f"read {name}")

    def create(self, name: str, data: bytes) -> str:
        """Write `name` only if it does not exist; returns its version.

        Raises PreconditionFailed if it exists (another writer created it first)."""
        return self._conditional(lambda: self._create(name, data), name, data, "create")

    def replace(self, name: str, data: bytes, version: str) -> str:
        """Overwrite `name` only if its version is still `version`; returns the new version.

        Raises PreconditionFailed if it changed or vanished since `version` was read."""
        return self._conditional(lambda: self._replace(name, data, version), name, data, "replace")

    def _conditional(self, write: Callable[[], str], name: str, data: bytes, what: str) -> str:
        """`write()` (with retries); a failed precondition stands only if the object does not
        hold `data`: else an earlier attempt of this very write landed (module docstring)."""
        try:
            return self._do(write, f"{what} {name}")
        except PreconditionFailed:
            current = self.read_versioned(name)
            if current is not None and current.data == data:
                return current.version
            raise

    def delete_if(self, name: str, version: str) -> bool:
        """Delete `name` only if its version is still `version`; False if it was absent.

        Raises PreconditionFailed if it changed since `version` was read. On a store that
        ignores the condition (`supports_conditional_deletes`) this deletes in any case."""

        def attempt() -> bool:
            try:
                self._delete_if(name, version)
            except FileNotFoundError:
                return False  # gone already (or a retry of a delete that landed)
            return True

        return self._do(attempt, f"delete {name}")

    def supports_conditional_deletes(self) -> bool:
        """Whether the store refuses a delete that names another version (probed with a
        scratch object). Local filesystems always do."""
        if not self.is_s3:
            return True
        probe = f"_probe-{uuid.uuid4().hex}"
        self.create(probe, b"probe")
        try:
            self.delete_if(probe, '"00000000000000000000000000000000"')
        except PreconditionFailed:
            return True
        except StorageError:
            return False  # refused as unknown (e.g. 501 NotImplemented)
        finally:
            self.delete(probe)
        return False

    def supports_conditional_writes(self) -> bool:
        """Whether the store refuses a second create of one name (probed with a scratch
        object that is deleted after). Local filesystems always do."""
        if not self.is_s3:
            return True
        probe = f"_probe-{uuid.uuid4().hex}"
        try:
            self.create(probe, b"probe")
            try:
                self.create(probe, b"probe again")
            except PreconditionFailed:
                return True
            return False
        finally:
            self.delete(probe)

    # --- S3 -------------------------------------------------------------------------------

    def _put(self, name: str, data: bytes) -> str:
        if not self.is_s3:
            return self._local_put(name, data)
        bucket, key = self._bucket_key(name)
        try:
            response = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data)
        except Exception as exc:
            raise self._translate(exc, "write", name) from exc
        return str(response.get("ETag", ""))

    def _read_versioned(self, name: str) -> Versioned | None:
        if not self.is_s3:
            return self._local_read_versioned(name)
        bucket, key = self._bucket_key(name)
        try:
            response = self.fs.call_s3("get_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._translate(exc, "read", name) from exc
        body = response["Body"]
        data = _read_body(self.fs, body)
        now = _http_date(response["ResponseMetadata"].get("HTTPHeaders", {}))
        modified = response.get("LastModified")
        age = (now - modified).total_seconds() if now and modified else 0.0
        return Versioned(data=data, version=str(response.get("ETag", "")), age_s=max(age, 0.0))

    def _create(self, name: str, data: bytes) -> str:
        if not self.is_s3:
            return self._local_create(name, data)
        bucket, key = self._bucket_key(name)
        try:
            response = self.fs.call_s3(
                "put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*"
            )
        except Exception as exc:
            raise self._translate(exc, "create", name) from exc
        return str(response.get("ETag", ""))

    def _replace(self, name: str, data: bytes, version: str) -> str:
        if not self.is_s3:
            return self._local_replace(name, data, version)
        bucket, key = self._bucket_key(name)
        try:
            response = self.fs.call_s3(
                "put_object", Bucket=bucket, Key=key, Body=data, IfMatch=version
            )
        except FileNotFoundError as exc:
            raise PreconditionFailed(f"{self.uri_of(name)} no longer exists") from exc
        except Exception as exc:
            raise self._translate(exc, "replace", name) from exc
        return str(response.get("ETag", ""))

    def _delete_if(self, name: str, version: str) -> None:
        if not self.is_s3:
            return self._local_delete_if(name, version)
        bucket, key = self._bucket_key(name)
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise self._translate(exc, "delete", name) from exc

    def _translate(self, exc: Exception, what: str, name: str) -> Exception:
        """PreconditionFailed for a lost condition; transient errors as they are (they are
        retried); anything else as a StorageError naming the object and the endpoint."""
        # retry imports this module's OutputDir: a top-level import would be a cycle
        from pipeline.storage.retry import _s3_code, is_transient

        if _s3_code(exc) == "PreconditionFailed":
            return PreconditionFailed(f"{self.uri_of(name)} changed (a conditional {what} lost)")
        if is_transient(exc):
            return exc
        return self._fail(what, name, exc)

    # --- local ----------------------------------------------------------------------------

    def _local_target(self, name: str) -> Path:
        target = Path(self.path(name))
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def _local_temp(self, target: Path, data: bytes) -> str:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMP_SUFFIX, dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return tmp

    def _local_move(self, target: Path, data: bytes, move: Callable[[str], None]) -> str:
        """`data` into a temp file beside `target`, then `move(temp)` onto it.

        The run that holds the output's lease removes temp files that dead writers left
        (remove_temp_files), and a live writer's temp can go with them between its write and
        its move: a run contending for the lease is one. Such a write starts again with a new
        temp file instead of failing; any other error stands."""
        for attempt in range(TEMP_ATTEMPTS):
            tmp = self._local_temp(target, data)
            try:
                move(tmp)
                break
            except FileNotFoundError:
                if os.path.exists(tmp) or attempt == TEMP_ATTEMPTS - 1:
                    raise  # not (only) our temp that vanished
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        return _local_version(target.stat())

    def _local_put(self, name: str, data: bytes) -> str:
        target = self._local_target(name)
        return self._local_move(target, data, lambda tmp: os.replace(tmp, target))

    def _local_read_versioned(self, name: str) -> Versioned | None:
        target = Path(self.path(name))
        try:
            with open(target, "rb") as handle:
                st = os.fstat(handle.fileno())
                data = handle.read()
        except FileNotFoundError:
            return None
        return Versioned(data, _local_version(st), max(time.time() - st.st_mtime, 0.0))

    def _local_create(self, name: str, data: bytes) -> str:
        target = self._local_target(name)

        def link(tmp: str) -> None:
            try:
                os.link(tmp, target)  # atomic, and fails if the name exists
            except FileExistsError:
                raise PreconditionFailed(f"{target} already exists") from None

        return self._local_move(target, data, link)

    @contextlib.contextmanager
    def _local_lock(self, target: Path) -> Iterator[None]:
        lock_path = target.parent / f".{target.name}{_LOCK_SUFFIX}"
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            yield

    def _local_replace(self, name: str, data: bytes, version: str) -> str:
        target = self._local_target(name)
        with self._local_lock(target):
            try:
                current = _local_version(target.stat())
            except FileNotFoundError:
                raise PreconditionFailed(f"{target} no longer exists") from None
            if current != version:
                raise PreconditionFailed(f"{target} changed since it was read")
            return self._local_put(name, data)

    def _local_delete_if(self, name: str, version: str) -> None:
        target = Path(self.path(name))
        if not target.parent.exists():
            raise FileNotFoundError(target)
        with self._local_lock(target):  # the lock replace takes: no replace in between
            current = _local_version(target.stat())  # FileNotFoundError: gone already
            if current != version:
                raise PreconditionFailed(f"{target} changed since it was read")
            target.unlink()

    def remove_temp_files(self) -> None:
        """Temp files left by a process that died mid-write (local disks only)."""
        if self.is_s3:
            return
        for name in self.names("."):
            if name.endswith(TEMP_SUFFIX):
                self.delete(name)


def _read_body(fs: object, body: object) -> bytes:
    """Read an aiobotocore streaming body on s3fs's event loop."""
    from fsspec.asyn import sync

    async def read() -> bytes:
        async with body:  # type: ignore[attr-defined]
            return await body.read()  # type: ignore[attr-defined]

    return sync(fs.loop, read)  # type: ignore[attr-defined]

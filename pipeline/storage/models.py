"""Model directories on object storage → one node-local copy, downloaded once per node.

`materialize_model` returns a local directory for a model (or tokenizer) path. Local paths are
checked and returned as they are; Hugging Face Hub sources (hf://ORG/NAME@REVISION) come from
huggingface_hub's cache (pipeline/storage/hub.py). s3:// prefixes are downloaded into
`cache_dir/<hash of uri, selection and listing>`:

- once per node: a file lock makes the second actor on a node wait for the first one's
  download instead of starting its own; a marker written last tells a complete copy from one
  interrupted halfway (which is not trusted and is downloaded again);
- files in parallel (`DOWNLOAD_THREADS` at once: a checkpoint's shards are large and S3 serves
  each connection at a fraction of the node's bandwidth), each to a temp name then renamed;
- with progress: a log line every `PROGRESS_INTERVAL_S` with bytes done, total and rate.

A changed remote listing (new ETags) hashes to a new directory, so a new checkpoint under the
same prefix is never mixed with the old one.
"""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pipeline.spec import SpecError, StorageSpec
from pipeline.storage import hub
from pipeline.storage.files import (
    StorageError,
    endpoint_of,
    filesystem_for,
    is_s3,
    strip_file_scheme,
    unreachable_error,
    version_of,
)
from pipeline.storage.hub import is_hub

logger = logging.getLogger(__name__)

# Written last into a downloaded model directory; its presence means the download completed.
COMPLETE_MARKER = ".tokenmill-complete"
DOWNLOAD_THREADS = 8
PROGRESS_INTERVAL_S = 10.0


class _Progress:
    """Bytes downloaded so far, logged every PROGRESS_INTERVAL_S by whichever thread notices."""

    def __init__(self, what: str, total_bytes: int):
        self.what = what
        self.total = total_bytes
        self.done = 0
        self.started = time.monotonic()
        self._last_log = self.started
        self._lock = threading.Lock()

    def add(self, num_bytes: int) -> None:
        with self._lock:
            self.done += num_bytes
            now = time.monotonic()
            if now - self._last_log < PROGRESS_INTERVAL_S:
                return
            self._last_log = now
        rate = self.done / max(now - self.started, 1e-9)
        logger.info(
            "downloading %s: %.1f of %.1f MB (%.0f%%) at %.1f MB/s",
            self.what,
            self.done / 1e6,
            self.total / 1e6,
            100.0 * self.done / max(self.total, 1),
            rate / 1e6,
        )


def _local_model(path: str, required_file: str, field: str) -> Path:
    local = Path(os.path.expanduser(strip_file_scheme(path)))
    if not (local / required_file).is_file():
        raise SpecError(
            f"{field}: {local} has no {required_file}; point it at a Hugging Face model "
            "directory (or an s3:// prefix holding one)"
        )
    return local


def _remote_listing(
    prefix: str, storage: StorageSpec, field: str, patterns: tuple[str, ...] | None, required: str
) -> tuple[Any, str, dict[str, dict[str, Any]]]:
    """(filesystem, root path, {relative name: info}) of the files to download."""
    fs, root = filesystem_for(prefix, storage)
    try:
        listing = fs.find(root, detail=True)
    except Exception as exc:
        raise unreachable_error(prefix, storage, exc, field) from None
    files = {
        p[len(root) + 1 :]: info
        for p, info in listing.items()
        if info.get("type", "file") != "directory" and p.startswith(root + "/")
    }
    if patterns is not None:
        files = {
            rel: info
            for rel, info in files.items()
            if rel == required or any(fnmatch.fnmatch(rel, pat) for pat in patterns)
        }
    if required not in files:
        raise SpecError(
            f"{field}: {prefix} has no {required} at {endpoint_of(storage, prefix)}; "
            "upload the whole Hugging Face model directory under that prefix"
        )
    return fs, root, files


def _destinations(
    files: dict[str, dict[str, Any]], target: Path, prefix: str, field: str
) -> dict[str, Path]:
    """{relative name: local path} for every file, each checked to land inside `target`.

    Object keys are names, not paths: a key holding `..` segments, or an empty segment that
    turns the rest into an absolute path ("models/x//etc/y"), would write outside the cache if
    joined as it is. Such a listing is refused whole, before anything is downloaded."""
    root = target.resolve()
    destinations = {}
    for rel in files:
        dest = (target / rel).resolve()
        if not dest.is_relative_to(root) or dest == root:
            raise SpecError(
                f"{field}: the object {prefix}/{rel} would be written outside the model's "
                f"download directory ({root}): its name climbs out with '..' or turns "
                "absolute at an empty segment ('//'); rename or delete that object"
            )
        destinations[rel] = dest
    return destinations


def _download_all(
    fs: Any, root: str, files: dict[str, Path], sizes: dict[str, int], prefix: str, field: str
) -> None:
    """Download every `files` name (relative to `root`) to its local path."""
    progress = _Progress(prefix, sum(sizes.values()))
    storage_hint = f"{prefix} ({field})"

    def fetch(rel: str) -> None:
        dest = files[rel]
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(f".{dest.name}.partial")
        try:
            fs.get_file(f"{root}/{rel}", str(partial))
        except Exception as exc:
            raise StorageError(f"{field}: downloading {prefix}/{rel} failed: {exc}") from exc
        partial.rename(dest)
        progress.add(sizes[rel])

    started = time.monotonic()
    # Largest first: the long downloads start at once instead of queueing behind small files.
    order = sorted(files, key=lambda rel: -sizes[rel])
    with ThreadPoolExecutor(DOWNLOAD_THREADS, thread_name_prefix="model-download") as pool:
        for future in [pool.submit(fetch, rel) for rel in order]:
            future.result()  # the first failure raises; the pool finishes what is running
    logger.info(
        "downloaded %s: %d files, %.1f MB in %.1fs",
        storage_hint,
        len(files),
        progress.total / 1e6,
        time.monotonic() - started,
    )


def materialize_model(
    path: str,
    cache_dir: str,
    storage: StorageSpec,
    *,
    required_file: str = "config.json",
    field: str = "model.path",
    patterns: tuple[str, ...] | None = None,
) -> Path:
    """A local directory holding the model (or tokenizer) at `path` (see the module docstring).

    `patterns` (fnmatch globs on the relative path) download only some files, e.g. the
    tokenizer files without the weights; a different selection is a different cache entry.
    """
    if is_hub(path):
        return hub.snapshot(path, cache_dir, field, required_file, patterns)
    if not is_s3(path):
        return _local_model(path, required_file, field)
    prefix = path.rstrip("/")
    fs, root, files = _remote_listing(prefix, storage, field, patterns, required_file)
    digest = hashlib.sha256(f"{prefix}\n{patterns}".encode())
    for rel in sorted(files):
        digest.update(
            f"\n{rel}\t{files[rel].get('size')}\t{version_of(files[rel], prefix)}".encode()
        )
    cache = Path(os.path.expanduser(cache_dir))
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / digest.hexdigest()[:16]
    destinations = _destinations(files, target, prefix, field)
    if (target / COMPLETE_MARKER).is_file():
        return target
    with open(cache / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (target / COMPLETE_MARKER).is_file():  # another process finished while we waited
            return target
        # Leftovers of an interrupted download are not trusted.
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        sizes = {rel: int(info.get("size") or 0) for rel, info in files.items()}
        _download_all(fs, root, destinations, sizes, prefix, field)
        (target / COMPLETE_MARKER).write_text(prefix + "\n")
    return target

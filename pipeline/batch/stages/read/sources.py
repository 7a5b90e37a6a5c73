"""Ray Data sources as a job's input (`input.format: ray_data`): which reader, and which version.

A job names a reader on `ray.data` (`input.reader` with `input.reader_args`) or a function
returning a Dataset (`input.dataset: "module:function"`). The run stages it once as Parquet
(pipeline.batch.stages.read.staging); this module says what that snapshot is a snapshot *of*:

- `check_source`: the reader exists and takes those arguments (spec validation, no I/O);
- `source_fingerprint`: reader name, canonical arguments (secret-looking values masked, so a
  rotated key keeps the snapshot) and, where the source has one, its version:
    read_iceberg   the table's snapshot id (`snapshot_id` if given, else the current one)
    read_delta     the table version (`version` if given, else the latest)
    file readers   the listing of `paths` (read_lance: `uri`): uri, size, ETag / mtime
    anything else  none: a function or a database query is fingerprinted by name + arguments
- `open_dataset`: the Dataset to stage, with the fingerprinted version pinned where the reader
  can be told (Iceberg `snapshot_id`, Delta `version`), so what is staged is what was
  fingerprinted even if the table moves on meanwhile.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pipeline.batch.commit.fingerprint import canonical_hash
from pipeline.spec import InputSpec, SpecError, StorageSpec
from pipeline.spec.redact import redact_reader_args
from pipeline.storage import expand_uri, filesystem_for

if TYPE_CHECKING:
    from ray.data import Dataset
from pipeline.spec.sources import (
    resolve_reader,
)

# The argument naming a file reader's files (read_lance's dataset directory is `uri`).
_PATH_ARGS = ("paths", "uri")


def resolve_dataset_function(ref: str) -> Callable[..., Any]:
    """The function `input.dataset` names; SpecError naming the field if it cannot be found."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(
            f"input.dataset: cannot import {module_name!r} ({exc}); it must be importable on "
            "the driver (installed, or on PYTHONPATH / the job's working_dir)"
        ) from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise SpecError(f"input.dataset: {module_name} has no function {attr!r}")
    return function  # type: ignore[no-any-return]


# --- the fingerprint ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceVersion:
    """What version of the source a snapshot holds, where the source has versions."""

    kind: str  # "iceberg_snapshot" | "delta_version" | "listing" | "none"
    value: Any  # the snapshot id, the table version, the listing [{uri, size, version}], None
    pin: dict[str, Any]  # reader arguments that make the read take exactly this version

    def describe(self) -> str:
        if self.kind == "listing":
            return f"{len(self.value)} file(s)"
        if self.kind == "none":
            return "no version"
        return f"{self.kind.replace('_', ' ')} {self.value}"


@dataclass(frozen=True)
class SourceFingerprint:
    """A ray_data source as the snapshot under `_staging/input-<key>` was taken from it."""

    source: str  # "read_iceberg", ... or "dataset:module:function"
    args: dict[str, Any]  # input.reader_args, secret-looking values masked
    version: SourceVersion
    value: str  # sha256 of the three above

    @property
    def key(self) -> str:
        """The snapshot's directory name under `_staging/`."""
        return f"input-{self.value[:16]}"

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "args": self.args,
            "version": asdict(self.version),
            "value": self.value,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SourceFingerprint:
        return cls(
            source=str(data["source"]),
            args=dict(data.get("args") or {}),
            version=SourceVersion(**data["version"]),
            value=str(data["value"]),
        )

    def describe_change(self, before: SourceFingerprint | None) -> str:
        """What differs from the source an earlier snapshot was taken from, naming the field."""
        if before is None:
            return "the snapshot it was generated from is gone (deleted from _staging/)"
        if before.source != self.source:
            return f"input.reader / input.dataset changed ({before.source} -> {self.source})"
        if before.args != self.args:
            return f"input.reader_args of {self.source} changed"
        if before.version.kind == "listing" and self.version.kind == "listing":
            return (
                f"the files {self.source} reads changed (input.reader_args paths: "
                f"{before.version.describe()} then, {self.version.describe()} now, sizes or "
                "versions differ)"
            )
        return (
            f"the source of {self.source} changed ({before.version.describe()} when the rows "
            f"were generated, {self.version.describe()} now)"
        )


def source_fingerprint(inp: InputSpec, storage: StorageSpec) -> SourceFingerprint:
    """The fingerprint of the source `inp` names, with its version read now."""

    args = redact_reader_args(dict(inp.reader_args))
    if inp.dataset is not None:
        source, version = f"dataset:{inp.dataset}", SourceVersion("none", None, {})
    else:
        assert inp.reader is not None
        source, version = inp.reader, _version(inp.reader, inp.reader_args, storage)
    value = canonical_hash({"source": source, "args": args, "version": asdict(version)})
    return SourceFingerprint(source, args, version, value)


def _version(reader: str, args: dict[str, Any], storage: StorageSpec) -> SourceVersion:
    if reader == "read_iceberg":
        return _iceberg_version(args)
    if reader == "read_delta":
        return _delta_version(args)
    paths = next((args[name] for name in _PATH_ARGS if name in args), None)
    if paths is not None:
        return SourceVersion("listing", _listing(paths, storage), {})
    return SourceVersion("none", None, {})


def _iceberg_version(args: dict[str, Any]) -> SourceVersion:
    if args.get("snapshot_id") is not None:
        return SourceVersion("iceberg_snapshot", int(args["snapshot_id"]), {})
    from pyiceberg.catalog import load_catalog

    # As ray.data.read_iceberg opens it: catalog_kwargs' "name", the rest as properties.
    properties = dict(args.get("catalog_kwargs") or {})
    name = properties.pop("name", "default")
    table_id = args.get("table_identifier")
    try:
        table = load_catalog(name, **properties).load_table(table_id)
    except Exception as exc:
        raise SpecError(
            f"input.reader_args: cannot load Iceberg table {table_id!r} from catalog {name!r} "
            f"(catalog_kwargs): {type(exc).__name__}: {exc}"
        ) from None
    current = table.current_snapshot()
    snapshot_id = current.snapshot_id if current is not None else None
    # An empty table has no snapshot: nothing to pin, and nothing to read.
    pin = {"snapshot_id": snapshot_id} if snapshot_id is not None else {}
    return SourceVersion("iceberg_snapshot", snapshot_id, pin)


def _delta_version(args: dict[str, Any]) -> SourceVersion:
    if args.get("version") is not None:
        return SourceVersion("delta_version", int(args["version"]), {})
    from deltalake import DeltaTable

    path = args.get("path")
    try:
        version = int(DeltaTable(path, storage_options=args.get("storage_options")).version())
    except Exception as exc:
        raise SpecError(
            f"input.reader_args: cannot open Delta table {path!r} (path, storage_options): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return SourceVersion("delta_version", version, {"version": version})


def _listing(paths: str | list[str], storage: StorageSpec) -> list[dict[str, Any]]:

    entries = [paths] if isinstance(paths, str) else list(paths)
    files = []
    for uri in entries:
        for item in expand_uri(str(uri), storage, field="input.reader_args.paths"):
            files.append({"uri": item.uri, "size": item.size, "version": item.version})
    return sorted(files, key=lambda f: f["uri"])


# --- the Dataset -------------------------------------------------------------------------------


def open_dataset(inp: InputSpec, source: SourceFingerprint, storage: StorageSpec) -> Dataset:
    """The Dataset to stage: the reader called with its arguments and the version pinned, or
    the `input.dataset` function's result. Needs Ray."""
    import ray.data

    if inp.dataset is not None:
        result = resolve_dataset_function(inp.dataset)(**inp.reader_args)
        if not isinstance(result, ray.data.Dataset):
            raise SpecError(
                f"input.dataset: {inp.dataset} returned {type(result).__name__}, not a "
                "ray.data.Dataset"
            )
        return result
    assert inp.reader is not None
    reader = resolve_reader(inp.reader)
    kwargs = {**inp.reader_args, **source.version.pin}
    if _reads_s3_files(reader, kwargs):
        # The job's endpoint and timeouts (storage section), as its own inputs get them.

        name = next(n for n in _PATH_ARGS if n in kwargs)
        paths = [kwargs[name]] if isinstance(kwargs[name], str) else list(kwargs[name])
        fs = filesystem_for(paths[0], storage)[0]
        kwargs["filesystem"] = arrow_filesystem(fs)
        # That filesystem takes its own paths (bucket/key), not URIs.
        kwargs[name] = [filesystem_for(p, storage)[1] for p in paths]
    return reader(**kwargs)  # type: ignore[no-any-return]


def _reads_s3_files(reader: Callable[..., Any], kwargs: dict[str, Any]) -> bool:
    if "filesystem" in kwargs or "filesystem" not in inspect.signature(reader).parameters:
        return False
    if kwargs.get("lines"):
        return False  # read_json(lines=True) takes no filesystem: Ray's own S3 client reads
    paths = next((kwargs[n] for n in _PATH_ARGS if n in kwargs), None)
    entries = [paths] if isinstance(paths, str) else list(paths or [])
    return bool(entries) and all(str(p).startswith("s3://") for p in entries)


def arrow_filesystem(fs: object) -> Any:
    """A pyarrow filesystem over one of ours (pipeline.storage.filesystem_for): Ray Data reads
    and writes through pyarrow."""
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    return PyFileSystem(FSSpecHandler(fs))

"""Quantized artifacts: cache key, build-or-reuse, publication to a local path or s3://.

An artifact is a directory (local or an object-storage prefix) holding the ModelOpt export, the
tokenizer, `quality_report.json`, and `tokenmill_artifact.json` — the marker, written last. A
directory with the marker is complete; one without is unusable (an interrupted build, or a
failed quality gate, which publishes only its report).

The cache key hashes everything the artifact depends on: the source model (config and weight
files), the format and KV cache format, the calibration texts and settings, and the versions of
ModelOpt, torch and transformers. A build whose key matches the marker at its destination
returns at once, without loading the model or calibrating.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from engines.quantize.build import quantize_checkpoint, read_architecture
from engines.quantize.calibration import load_texts
from engines.quantize.config import QuantizationSpec, QuantizeError

log = logging.getLogger(__name__)

MARKER = "tokenmill_artifact.json"
REPORT = "quality_report.json"
_FINGERPRINT_FILES = ("config.json",)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".index.json")
_TOOLS = ("nvidia-modelopt", "torch", "transformers")


class QualityGateFailed(QuantizeError):
    """The quantized model drifted past the thresholds; nothing usable was published."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class ArtifactResult:
    uri: str  # where the artifact lives (local path or s3:// prefix)
    key: str  # cache key (sha256 hex)
    reused: bool  # True: an existing complete artifact was returned, nothing was built
    report: dict[str, Any]  # quality_report.json contents
    calibration_batches: int  # forward passes of calibration run by this call (0 if reused)


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 over config.json and every weight file (names and contents)."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    files = sorted(
        p
        for p in model_dir.iterdir()
        if p.is_file() and (p.name in _FINGERPRINT_FILES or p.name.endswith(_WEIGHT_SUFFIXES))
    )
    if not any(p.name.endswith(_WEIGHT_SUFFIXES) for p in files):
        raise QuantizeError(f"{model_dir}: no weight files (*.safetensors / *.bin) to quantize")
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def tool_versions() -> dict[str, str]:
    versions = {}
    for name in _TOOLS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "missing"
    return versions


def cache_inputs(model_fp: str, spec: QuantizationSpec, calibration_sha256: str) -> dict[str, Any]:
    """Everything the artifact's bytes depend on (the quality thresholds do not)."""
    return {
        "model_fingerprint": model_fp,
        "format": spec.format,
        "kv_cache": spec.kv_cache,
        "calibration_sha256": calibration_sha256,
        "calibration": spec.calibration.model_dump(exclude={"source"}),
        "versions": tool_versions(),
    }


def cache_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _fs_and_path(uri: str, fs: Any) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    uri = os.path.expanduser(uri)
    if fs is None:
        return url_to_fs(uri)
    return fs, fs._strip_protocol(uri)


def read_marker(uri: str, fs: Any = None) -> dict[str, Any] | None:
    """The marker of the artifact at `uri`, or None when there is no complete artifact."""
    fs, path = _fs_and_path(uri, fs)
    try:
        return json.loads(fs.cat_file(f"{path.rstrip('/')}/{MARKER}"))
    except FileNotFoundError:
        return None


def build_or_reuse(
    model_dir: str | Path,
    out_uri: str,
    spec: QuantizationSpec,
    *,
    fs: Any = None,
    calibration_fs: Any = None,
    overwrite: bool = False,
) -> ArtifactResult:
    """Return the artifact for (model, spec) at `out_uri`, building it first if needed.

    `fs` / `calibration_fs`: fsspec filesystems for `out_uri` and the calibration source (the
    caller's configured S3 clients); None infers one from the URI. `overwrite`: replace a
    complete artifact built from other inputs (otherwise an error, so one is never silently
    swapped for another).
    Raises QualityGateFailed (after publishing only the report) when the gate fails and
    `spec.allow_quality_failure` is off.
    """

    model_dir = Path(model_dir)
    read_architecture(model_dir)  # unsupported models fail before any hashing
    texts = load_texts(spec.calibration, spec.quality, fs=calibration_fs)
    inputs = cache_inputs(model_fingerprint(model_dir), spec, texts.sha256)
    key = cache_key(inputs)
    fs, path = _fs_and_path(out_uri, fs)
    with _build_lock(fs, path):
        marker = read_marker(out_uri, fs)
        if marker is not None and marker.get("key") == key:
            log.info("reusing quantized artifact %s (key %s): no calibration", out_uri, key[:12])
            report = json.loads(fs.cat_file(f"{path.rstrip('/')}/{REPORT}"))
            return ArtifactResult(out_uri, key, True, report, 0)
        if marker is not None and not overwrite:
            raise QuantizeError(
                f"{out_uri} holds an artifact built from other inputs (key "
                f"{marker.get('key', '?')[:12]}, this build {key[:12]}); choose another "
                "output location or pass --overwrite"
            )
        _check_replaceable(fs, path, out_uri)
        return _build_and_publish(model_dir, out_uri, fs, path, spec, texts, inputs, key)


def build_in_cache(
    model_dir: str | Path,
    cache_uri: str,
    model_name: str,
    spec: QuantizationSpec,
    *,
    fs: Any = None,
    calibration_fs: Any = None,
) -> ArtifactResult:
    """`build_or_reuse` under `cache_uri/<model>-<format>-<key>`, one folder per distinct input.

    Jobs use this: the same (model, quantization) on any node maps to the same folder.
    """

    model_dir = Path(model_dir)
    read_architecture(model_dir)
    texts = load_texts(spec.calibration, spec.quality, fs=calibration_fs)
    key = cache_key(cache_inputs(model_fingerprint(model_dir), spec, texts.sha256))
    uri = f"{cache_uri.rstrip('/')}/{model_name}-{spec.label}-{key[:16]}"
    return build_or_reuse(model_dir, uri, spec, fs=fs, calibration_fs=calibration_fs)


def _build_and_publish(
    model_dir: Path,
    out_uri: str,
    fs: Any,
    path: str,
    spec: QuantizationSpec,
    texts: Any,
    inputs: dict[str, Any],
    key: str,
) -> ArtifactResult:

    with tempfile.TemporaryDirectory(prefix="tokenmill-quantize-") as tmp:
        export_dir = Path(tmp) / "export"
        started = time.monotonic()
        outcome = quantize_checkpoint(model_dir, export_dir, spec, texts)
        report = outcome.report
        report.quality_failure_allowed = not report.passed and spec.allow_quality_failure
        document = {
            "cache_key": key,
            "cache_inputs": inputs,
            "calibration_source": texts.source,
            "num_calibration_texts": len(texts.calibration),
            "device": outcome.device,
            "seconds": {**outcome.seconds, "total": time.monotonic() - started},
            **report.to_dict(),
        }
        (export_dir / REPORT).write_text(json.dumps(document, indent=2))
        log.info("%s: %s", spec.label, report.summary())
        # Whatever was at the destination before (an older or interrupted build) goes first,
        # so no stale file survives next to the new ones.
        _clear(fs, path)
        if not report.passed and not spec.allow_quality_failure:
            fs.makedirs(path, exist_ok=True)
            fs.put_file(str(export_dir / REPORT), f"{path.rstrip('/')}/{REPORT}")
            raise QualityGateFailed(
                f"{report.summary()}\n  " + "\n  ".join(report.failures) + f"\nonly {REPORT} "
                f"was written to {out_uri}; fix the calibration data or the thresholds, or "
                "pass --allow-quality-failure to publish anyway",
                document,
            )
        fs.makedirs(path, exist_ok=True)
        for file in sorted(export_dir.iterdir()):
            fs.put_file(str(file), f"{path.rstrip('/')}/{file.name}")
        marker = {
            "key": key,
            "format": spec.format,
            "kv_cache": spec.kv_cache,
            "quality_passed": report.passed,
            "quality_failure_allowed": report.quality_failure_allowed,
            "created_unix": time.time(),
        }
        # Written last: its presence means every other file is in place.
        fs.pipe_file(f"{path.rstrip('/')}/{MARKER}", json.dumps(marker, indent=2).encode())
    return ArtifactResult(out_uri, key, False, document, outcome.calibration_batches)


def _check_replaceable(fs: Any, path: str, out_uri: str) -> None:
    """The destination is replaced by the build: refuse anything but an artifact's leftovers."""
    try:
        names = {entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)}
    except FileNotFoundError:
        return
    if names and not names & {MARKER, REPORT}:
        raise QuantizeError(
            f"{out_uri} is not empty and holds no quantized artifact; point the output at a "
            "new or empty location"
        )


def _clear(fs: Any, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        for entry in fs.ls(path, detail=False):
            fs.rm(entry, recursive=True)


@contextlib.contextmanager
def _build_lock(fs: Any, path: str):
    """One build per local destination at a time (engine actors on one node start together).

    Object storage has no locks: two nodes may build the same artifact concurrently; the
    content is the same and the marker is written last, so the result is still complete.
    """
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" not in protocols:
        yield
        return
    lock_path = Path(path).parent / f".{Path(path).name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield

"""Calibration and held-out texts: read, sample, split, hash.

The held-out texts the quality gate compares on are never calibration texts: both come from
one seeded shuffle of the source, calibration from the front, held-out from the back.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

from engines.quantize.config import CalibrationSpec, QualitySpec, QuantizeError

_WORDS = (
    "the a an one every some batch token model engine prompt answer question request row job "
    "cluster node actor storage bucket object file part manifest cost price hour second minute "
    "fast slow large small quiet busy early late new old exact cheap dear bright dark warm cold "
    "river mountain city garden window letter story number colour music market harbour bridge "
    "runs reads writes counts sends waits builds checks keeps finds opens closes moves learns "
    "and or but so because while when where if then after before over under into from with "
    "is was are were has had will would can could should may might must does did "
    "red green blue yellow seven twelve hundred thousand million north south east west "
    "what why how who which please tell me explain write summarize list describe compare"
).split()


def sample_text(num_sentences: int = 2000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English sentences: tokenizer training and calibration text."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(num_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        punct = rng.choice(".?!.,;:")
        number = f" {rng.randint(0, 10_000)}" if rng.random() < 0.2 else ""
        sentences.append(" ".join(words).capitalize() + number + punct)
    return sentences


@dataclass(frozen=True)
class CalibrationTexts:
    calibration: list[str]  # texts run through the model to collect amax statistics
    held_out: list[str]  # texts the quality gate compares the models on
    source: str  # where they came from ("builtin" or the URI)

    @property
    def sha256(self) -> str:
        """Hash of the calibration texts (part of the artifact cache key)."""
        digest = hashlib.sha256()
        for text in self.calibration:
            digest.update(text.encode())
            digest.update(b"\0")
        return digest.hexdigest()


def load_texts(
    calibration: CalibrationSpec,
    quality: QualitySpec,
    fs: Any = None,
) -> CalibrationTexts:
    """Draw `num_samples` calibration texts and `quality.num_prompts` held-out texts.

    `fs`: the fsspec filesystem to read `calibration.source` with (the caller's configured S3
    client); None infers one from the URI.
    """
    wanted = calibration.num_samples + quality.num_prompts
    if calibration.source is None:
        # Built-in text is already pseudo-random; a fixed seed keeps the cache key stable.
        pool = sample_text(max(wanted, 2000), seed=calibration.seed)
        source = "builtin"
    else:
        pool = _read_column(calibration.source, calibration.column, fs)
        source = calibration.source
        random.Random(calibration.seed).shuffle(pool)
    pool = [t for t in pool if t.strip()]
    if len(pool) < quality.num_prompts + 1:
        raise QuantizeError(
            f"calibration.source {source}: {len(pool)} non-empty texts in column "
            f"{calibration.column!r}; need at least {quality.num_prompts + 1} "
            f"(quality.num_prompts held out + calibration)"
        )
    held_out = pool[-quality.num_prompts :]
    calib = pool[: min(calibration.num_samples, len(pool) - quality.num_prompts)]
    return CalibrationTexts(calibration=calib, held_out=held_out, source=source)


def _read_column(uri: str, column: str, fs: Any) -> list[str]:
    from fsspec.core import url_to_fs

    if fs is None:
        fs, path = url_to_fs(uri)
    else:
        path = fs._strip_protocol(uri)
    lowered = uri.lower()
    try:
        with fs.open(path, "rb") as f:
            if lowered.endswith(".parquet"):
                import pyarrow.parquet as pq

                table = pq.read_table(f)
                if column not in table.column_names:
                    raise QuantizeError(
                        f"calibration.source {uri}: no column {column!r} (columns: "
                        f"{', '.join(table.column_names)}); set calibration.column"
                    )
                values = table.column(column).to_pylist()
            elif lowered.endswith((".jsonl", ".json")):
                values = []
                for number, line in enumerate(f.read().decode().splitlines(), start=1):
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    if column not in row:
                        raise QuantizeError(
                            f"calibration.source {uri} line {number}: no key {column!r}; "
                            f"set calibration.column"
                        )
                    values.append(row[column])
            else:
                raise QuantizeError(
                    f"calibration.source {uri}: unknown file type; use a .parquet or .jsonl file"
                )
    except FileNotFoundError:
        raise QuantizeError(f"calibration.source {uri}: file not found") from None
    return [_as_text(v) for v in values if v is not None]


def _as_text(value: Any) -> str:
    # A chat ({role, content} list) calibrates on its contents joined; anything else as is.
    if isinstance(value, list):
        parts = (str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in value)
        return "\n".join(parts)
    return str(value)

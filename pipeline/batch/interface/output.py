"""Reading a batch job's committed output: its manifest, part records and row stats
(pipeline.data.read_output, the report, the Batch API)."""

from pipeline.batch.commit.manifest import Manifest, read_manifest
from pipeline.batch.commit.parts import MANIFEST_NAME, SUCCESS_NAME, PartRecord
from pipeline.batch.commit.stats import Histogram, RowStats, SpecCounts, error_kind

__all__ = [
    "MANIFEST_NAME",
    "SUCCESS_NAME",
    "Histogram",
    "Manifest",
    "PartRecord",
    "RowStats",
    "SpecCounts",
    "error_kind",
    "read_manifest",
]

"""The `output` section: where the results go and how they are written and committed."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engines.strict import StrictModel


class OutputSpec(StrictModel):
    uri: str = Field(
        min_length=1, description="Output directory: local path, file:// or s3:// prefix."
    )
    format: Literal["parquet", "openai_batch"] = Field(
        "parquet",
        description="parquet: the Parquet parts only. openai_batch: besides them, per "
        "committed part `part-<n>.parquet`, OpenAI Batch API output lines "
        "(`openai-output-<n>.jsonl`: custom_id, response with a chat.completion / "
        "text_completion body and usage) and error lines (`openai-errors-<n>.jsonl`: "
        "custom_id, error), derived from the committed part and written before `_SUCCESS` (a "
        "stopped run writes them for what it committed). Needs input.format openai_batch with "
        "`url` in input.passthrough_columns (it picks the response object per request). See "
        "docs/batch-api.md.",
    )
    rows_per_file: int = Field(10_000, ge=1, description="Rows per Parquet part at most.")
    include_token_ids: bool = Field(
        False, description="Also write completion_token_ids (list<int32>) per row."
    )
    report: bool = Field(True, description="Write report.md and plots beside the output.")
    flush_interval_s: float = Field(
        60.0,
        gt=0,
        description="An engine actor writes the finished rows of a shard as a part at least "
        "this often (and when rows_per_file are finished), so a crash loses little work.",
    )
    commit_interval_s: float = Field(
        10.0,
        gt=0,
        description="How often the driver records newly written parts in _manifest.json.",
    )
    lease_timeout_s: float = Field(
        120.0,
        ge=5,
        description="A run holds a lease on its output prefix (_lease.json) and renews it every "
        "third of this; another run takes the lease over only after this long without renewal. "
        "A renewal the store keeps refusing is retried for a sixth of this, then the run stops.",
    )

"""The `input` section: where the prompts are and how to read them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from engines.strict import StrictModel
from pipeline.spec.sources import check_source


class InputSpec(StrictModel):
    uri: str | list[str] | None = Field(
        None,
        description="Input file(s): local paths, file://, or s3:// URIs; globs (`*`, `**`) and "
        "directories are expanded (names starting with `_` or `.` are skipped). A list reads "
        "several sources as one dataset. Local paths must exist on every node that reads: use "
        "s3:// on multi-node clusters. Required, except with format ray_data (the reader's "
        "arguments name the source there).",
    )
    format: Literal["parquet", "jsonl", "openai_batch", "ray_data"] = Field(
        "parquet",
        description="parquet | jsonl (one JSON object per line) | openai_batch (OpenAI Batch "
        "API JSONL: custom_id, method, url, body) | ray_data (any Ray Data source, named by "
        "input.reader or input.dataset: the run first stages it once as Parquet under "
        "output.uri's `_staging/`, then reads that snapshot as format parquet; see "
        "docs/python-api.md).",
    )
    reader: str | None = Field(
        None,
        description="format ray_data: the `ray.data` reader to call, by name (read_iceberg, "
        "read_delta, read_lance, read_csv, read_json, read_parquet, read_mongo, ...), with "
        "input.reader_args as its keyword arguments. Readers that take Python objects (read_sql's "
        "connection_factory) go through input.dataset. Set this or input.dataset.",
    )
    reader_args: dict[str, Any] = Field(
        default_factory=dict,
        description="format ray_data: keyword arguments of input.reader (e.g. read_iceberg: "
        "{table_identifier: db.prompts, catalog_kwargs: {name: main, type: sql, ...}}; "
        "read_csv: {paths: s3://bucket/prompts/}) or of the input.dataset function. Part of "
        "the snapshot's fingerprint, except credentials, which are never written or hashed: "
        "in a settings map (catalog_kwargs, storage_options, any *_options / *_kwargs / "
        "*_config) only the keys that locate the data (endpoint, region, uri, name, type, "
        "warehouse, account and container names, ...) are kept, elsewhere values under "
        "credential-like keys (token, key, secret, password, sas, signature, ...) are masked, "
        "and URIs lose user:password@ and signatures (pipeline/spec/redact.py). An s3:// "
        "`paths` of a file reader is read with the storage section's endpoint.",
    )
    dataset: str | None = Field(
        None,
        description="format ray_data: 'module:function' returning a ray.data.Dataset, called "
        "with input.reader_args as keyword arguments on the driver. Its snapshot is "
        "fingerprinted by the name and the arguments only (a function has no version), so a "
        "rerun reuses it: to read the source anew, use a new output.uri (or delete "
        "output.uri's _staging/ and rerun with --fresh). Set this or input.reader.",
    )
    id_column: str | None = Field(
        None,
        description="Column holding a unique, stable row id. Null: derived from (file, row "
        "index), stable as long as the input files do not change. openai_batch uses custom_id.",
    )
    prompt_column: str | None = Field(
        None,
        description="Column with the prompt text (plain string). Set this or messages_column "
        "(or neither, when prompt.template builds the prompt from other columns).",
    )
    messages_column: str | None = Field(
        None,
        description="Column with a chat as a list of {role, content} (or its JSON string). "
        "Set this or prompt_column.",
    )
    image_columns: list[str] = Field(
        default_factory=list,
        description="Columns holding each row's images (image bytes, or a URL / URI string: "
        "data:, s3://, a local path, or http(s) from prompt.images.http_hosts), for a "
        "vision-language model. The row's user message shows them in this order before its "
        "text (the prompt column or prompt.template); a null cell shows no image. For chats, "
        "put image_url parts in the messages instead.",
    )
    adapter_column: str | None = Field(
        None,
        description="Column naming each row's LoRA adapter (one of model.adapters); a null or "
        "empty cell runs the row on the model itself, an unknown name makes it an error row. "
        "openai_batch ignores it: a line's body.model names its adapter there.",
    )
    passthrough_columns: list[str] = Field(
        default_factory=list,
        description="Input columns copied unchanged into the output rows (e.g. a user id). "
        "For openai_batch: top-level keys of each line. Names the pipeline writes itself "
        "(id, text, error, ...) are not allowed.",
    )
    passthrough_types: dict[
        str, Literal["string", "json", "int64", "float64", "bool", "timestamp", "date"]
    ] = Field(
        default_factory=dict,
        description="Output type per passthrough column (string, json, int64, float64, bool, "
        "timestamp, date). Unset: the Parquet files' own type, or for JSONL the type of the "
        "values in the first lines (mixed values or objects: json text). The types are fixed "
        "before the first row is generated; a later cell that does not fit is that row's error.",
    )
    limit: int | None = Field(
        None, ge=1, description="Read at most this many rows (in input order); null reads all."
    )
    shard_rows: int | None = Field(
        None,
        ge=1,
        description="Parquet: rows per shard, the unit of work and of commit (whole row groups; "
        "a larger row group is a shard of its own). Null: about 256 shards per job, 64 to "
        "20,000 rows each.",
    )
    shard_bytes: int | None = Field(
        None,
        ge=1024,
        description="JSONL / openai_batch: bytes per shard (a byte range of a file; compressed "
        "files are one shard). Null: about 256 shards per job, 64 to 20,000 lines each.",
    )

    @model_validator(mode="after")
    def _one_prompt_source(self) -> InputSpec:
        if self.format == "openai_batch":
            if self.prompt_column or self.messages_column:
                raise ValueError(
                    "input.format openai_batch takes prompts from body.messages / body.prompt; "
                    "remove input.prompt_column and input.messages_column"
                )
            return self
        if self.prompt_column and self.messages_column:
            raise ValueError(
                "set only one of input.prompt_column or input.messages_column "
                f"(format {self.format})"
            )
        return self

    @model_validator(mode="after")
    def _source_fields_fit_the_format(self) -> InputSpec:
        if self.format == "ray_data":
            if self.uri is not None:
                raise ValueError(
                    "input.uri does not apply to input.format ray_data: the reader's arguments "
                    "name the source (e.g. input.reader_args.paths); remove input.uri"
                )
            check_source(self.reader, self.reader_args, self.dataset)
            return self
        set_fields = [
            name
            for name, value in (
                ("reader", self.reader),
                ("reader_args", self.reader_args),
                ("dataset", self.dataset),
            )
            if value
        ]
        if set_fields:
            raise ValueError(
                f"input.{set_fields[0]} applies to input.format ray_data only; set "
                f"input.format: ray_data, or remove input.{set_fields[0]} (format {self.format})"
            )
        if self.uri is None:
            raise ValueError(f"input.uri is required for input.format {self.format}")
        return self

    @model_validator(mode="after")
    def _typed_columns_are_passed_through(self) -> InputSpec:
        unknown = sorted(set(self.passthrough_types) - set(self.passthrough_columns))
        if unknown:
            raise ValueError(
                f"input.passthrough_types names {unknown}, which are not in "
                "input.passthrough_columns; add them there or remove their types"
            )
        return self

    @field_validator("uri")
    @classmethod
    def _non_empty_uris(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is None:
            return value
        uris = [value] if isinstance(value, str) else value
        if not uris or any(not u.strip() for u in uris):
            raise ValueError("give at least one non-empty path or URI")
        return value

    @property
    def uris(self) -> list[str]:
        """The input.uri entries ([] for format ray_data before it is staged)."""
        if self.uri is None:
            return []
        return [self.uri] if isinstance(self.uri, str) else list(self.uri)

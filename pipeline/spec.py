"""JobSpec: the one YAML file that describes a batch job.

Strict on purpose (`extra="forbid"` everywhere): a misspelled key in a nightly job must fail
before any actor starts, with the field path, not be silently ignored. Every field carries a
description; docs/job-spec.md is generated from them (`python -m pipeline.docgen`).

Loading a file goes: read text → `{{ date }}` templating → YAML → `${ENV_VAR}` substitution in
the parsed values → `--set a.b=c` overrides → validation. See `load_job_spec` and `load_yaml`.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engines.api import PROCESSING_FIELDS
from engines.quantize.config import QuantizationSpec


class SpecError(ValueError):
    """A job file that cannot run; the message names the file, the field path and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# --- input -----------------------------------------------------------------------------------


class InputSpec(_Strict):
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
        "the snapshot's fingerprint, except values under secret-looking keys (masked). An "
        "s3:// `paths` of a file reader is read with the storage section's endpoint.",
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
            from pipeline.data.sources import check_source

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


# --- prompt ----------------------------------------------------------------------------------


class PromptSpec(_Strict):
    template: str | None = Field(
        None,
        description="Jinja2 template applied to each row to build the user prompt, e.g. "
        "'Summarize: {{ text }}'. Row columns are the variables; `prompt` is the prompt "
        "column's value. Null uses the prompt column as is.",
    )
    system_prompt: str | None = Field(
        None,
        description="System message prepended to every chat (when chat_template is on) unless "
        "the chat already starts with one.",
    )
    chat_template: bool = Field(
        True,
        description="Apply the model tokenizer's chat template (with the generation prompt). "
        "Off: the prompt text is tokenized as is (messages are rejected).",
    )
    reasoning: Literal["none", "think", "harmony"] = Field(
        "none",
        description="How the model writes its reasoning before its answer: none | think "
        "(Qwen3, QwQ, DeepSeek-R1: a <think>...</think> block, which the chat template may "
        "open) | harmony (GPT-OSS: analysis and final channels). Set, output rows get "
        "`reasoning` (null when a row's output has none) and `reasoning_tokens` columns and "
        "`text` holds the answer alone; Serve answers carry `reasoning_content` and "
        "usage.completion_tokens_details.reasoning_tokens. Reasoning tokens are output tokens "
        "(counts and cost unchanged). The model's tokenizer must have the format's tokens "
        "(checked before the job starts).",
    )
    enable_thinking: bool | None = Field(
        None,
        description="Passed to the chat template as `enable_thinking` (Qwen3's switch: false "
        "asks for the answer without reasoning). Null: not passed (the template's default).",
    )
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None,
        description="Passed to the chat template as `reasoning_effort` (GPT-OSS's `Reasoning: "
        "low|medium|high`). Null: not passed. A row may set its own through "
        "sampling.overrides.reasoning_effort.",
    )

    @field_validator("template")
    @classmethod
    def _template_parses(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.strip():
            raise ValueError("prompt.template is empty; remove it or write a template")
        import jinja2

        try:
            jinja2.Environment().parse(value)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"prompt.template line {exc.lineno}: {exc.message}") from None
        return value

    def template_kwargs(self, reasoning_effort: str | None = None) -> dict[str, Any] | None:
        """Extra chat template variables (enable_thinking, reasoning_effort; a row's own
        effort over the job's); None when there are none."""
        kwargs: dict[str, Any] = {}
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        effort = reasoning_effort or self.reasoning_effort
        if effort is not None:
            kwargs["reasoning_effort"] = effort
        return kwargs or None

    def template_variables(self) -> list[str]:
        """Names the template reads (row columns, plus `prompt`), sorted; [] without one."""
        if self.template is None:
            return []
        import jinja2
        from jinja2 import meta

        return sorted(meta.find_undeclared_variables(jinja2.Environment().parse(self.template)))


# --- model and engine ------------------------------------------------------------------------


class ModelSpec(_Strict):
    path: str = Field(
        description="Hugging Face model directory: a local path or an s3:// prefix (downloaded "
        "once per node into cache_dir)."
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer directory if not the model's own (local path or s3://)."
    )
    cache_dir: str = Field(
        "~/.cache/tokenmill/models",
        description="Node-local directory where s3:// models are downloaded and reused.",
    )
    name: str | None = Field(
        None,
        description="Name reported in output rows and manifests; default: the path's last part.",
    )
    quantization: QuantizationSpec | None = Field(
        None,
        description="Run a low-precision copy of the model: {format: fp8 | nvfp4, kv_cache, "
        "calibration, quality, cache_uri}. The artifact is reused from cache_uri when one was "
        "built from the same inputs, else built there first (see docs/quantization.md). Null: "
        "load the model as it is.",
    )

    @property
    def display_name(self) -> str:
        return self.name or self.path.rstrip("/").rsplit("/", 1)[-1]


class SpeculativeSpec(_Strict):
    method: Literal["ngram", "draft", "eagle3", "mtp"] = Field(
        description="ngram (prompt lookup: propose the tokens that followed the last match of "
        "the request's own recent tokens in its prompt + output; no second model) | draft (a "
        "small model with the same tokenizer proposes) | eagle3 (an EAGLE-3 head proposes) | "
        "mtp (the checkpoint's multi-token-prediction layers). Engine kinds: reference ngram, "
        "draft; vllm ngram, draft; trtllm ngram, draft, eagle3, mtp. See "
        "docs/speculative-decoding.md."
    )
    num_tokens: int | None = Field(
        None,
        ge=1,
        le=32,
        description="Tokens proposed per request per step; the target model scores them all "
        "(plus one) in one forward pass. Null: 4 (mtp: num_layers).",
    )
    prompt_lookup_min: int | None = Field(
        None,
        ge=1,
        description="ngram: shortest match (in tokens) of the request's last tokens that may "
        "propose. Null: 2 (trtllm matches down to 1 and needs null or 1).",
    )
    prompt_lookup_max: int | None = Field(
        None,
        ge=1,
        description="ngram: longest match tried first (longer matches propose more reliably). "
        "Null: 4 (trtllm: max_matching_ngram_size).",
    )
    model: str | None = Field(
        None,
        description="draft: the draft model directory (same tokenizer as the model); eagle3: the "
        "EAGLE-3 head checkpoint directory. Local paths on every node.",
    )
    num_layers: int | None = Field(
        None,
        ge=1,
        description="mtp: MTP layers used (trtllm num_nextn_predict_layers; each proposes "
        "one token). Null: num_tokens.",
    )
    disable_above_batch_size: int | None = Field(
        None,
        ge=0,
        description="Speculate only in engine steps with at most this many running requests: "
        "verification costs compute, which a large batch no longer has spare. Null: the engine "
        "kind's default (reference 8, measured on CPU, see docs/speculative-decoding.md; trtllm "
        "always on). Not available on vllm 0.32.",
    )


class EngineSpec(_Strict):
    kind: Literal["reference", "trtllm", "vllm", "synthetic"] = Field(
        "reference",
        description="reference (PyTorch, runs anywhere incl. CPU) | trtllm (TensorRT-LLM, GPU) | "
        "vllm (vLLM's async engine; CPU or CUDA build installed separately) | synthetic (a test "
        "and capacity tool, no model: random token ids at a set rate, to drive the pipeline at "
        "GPU speed on CPUs; its settings go in `extra`: tokens_per_s, ttft_ms, ttft_jitter, "
        "step_interval_ms, output_tokens, stop_fraction, error_fraction, seed, script "
        "(max_batch_size and max_model_len apply as for the other kinds; see docs/engine.md). "
        "See docs/engines.md.",
    )
    max_batch_size: int | None = Field(
        None,
        ge=1,
        description="Most requests in one engine step. Null: the engine kind's default "
        "(reference 64; trtllm 2048, TensorRT-LLM's own default and the range its published "
        "benchmarks run; vllm: vLLM's own; synthetic 256). See docs/engines.md.",
    )
    max_num_tokens: int | None = Field(
        None,
        ge=16,
        description="Token budget of one engine step (prefill chunks + decodes). Null: the "
        "engine kind's default (reference 2048; trtllm 8192, as its published benchmarks; "
        "vllm: vLLM's own).",
    )
    kv_cache_tokens: int | None = Field(
        None,
        ge=16,
        description="KV cache size in tokens. Null: sized from kv_cache_memory_fraction "
        "(GPU) or kv_cache_memory_gb (CPU).",
    )
    kv_cache_memory_gb: float | None = Field(
        None, gt=0, description="KV cache size as memory (GiB); used when kv_cache_tokens is null."
    )
    kv_cache_memory_fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description="trtllm, vllm on GPU: fraction of GPU memory for the KV cache "
        "(free_gpu_memory_fraction / gpu_memory_utilization).",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto", description="auto (model dtype) | fp8 (trtllm with an FP8-KV checkpoint, vllm)."
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse KV of shared prompt prefixes (full blocks only)."
    )
    enable_chunked_prefill: bool = Field(
        True, description="Split long prompts across steps so decodes are not stalled."
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV cache block.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype. auto: float32 on CPU, bfloat16 on GPU."
    )
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N (reference engine).")
    max_model_len: int | None = Field(
        None, ge=16, description="Cap on prompt + output tokens; null: the model's context."
    )
    profile_dir: str | None = Field(
        None,
        description="reference engine: record engine steps with torch.profiler and write a "
        "Chrome / Perfetto trace (JSON) to this local directory on each node, one named range "
        "per step phase (schedule, build_inputs, forward, sample, detokenize, deliver; NVTX "
        "ranges too on CUDA). Null: no profiling and no overhead. See docs/engine.md.",
    )
    profile_steps: int = Field(
        20, ge=1, description="reference engine with profile_dir: engine steps to record."
    )
    scheduler_policy: Literal["guaranteed_no_evict", "max_utilization"] = Field(
        "guaranteed_no_evict", description="trtllm capacity scheduler policy."
    )
    speculative: SpeculativeSpec | None = Field(
        None,
        description="Speculative decoding: {method: ngram | draft | eagle3 | mtp, num_tokens, "
        "...}. Greedy output is unchanged token for token; sampled output keeps the model's "
        "distribution. Null: off. See docs/speculative-decoding.md.",
    )
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Engine-specific options passed through verbatim."
    )
    expected_tokens_per_s: float | None = Field(
        None,
        gt=0,
        description="Output tokens per second one actor is expected to generate; `tokenmill "
        "plan` uses it for the time and cost estimate (or --tokens-per-s / --measure). Not "
        "passed to the engine.",
    )

    @model_validator(mode="after")
    def _synthetic_settings(self) -> EngineSpec:
        """engine.kind synthetic: its settings (in `extra`) are checked now, not at load."""
        if self.kind == "synthetic":
            from engines.synthetic.settings import SyntheticSettings

            shared = {"max_batch_size": self.max_batch_size, "max_model_len": self.max_model_len}
            given = {k: v for k, v in shared.items() if v is not None} | self.extra
            try:
                SyntheticSettings.of(given)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"engine.extra: {exc}") from None
        return self

    @model_validator(mode="after")
    def _speculative_runs_on_kind(self) -> EngineSpec:
        from engines.speculative import problems

        if self.speculative is not None:
            found = problems(self.kind, self.speculative.model_dump())
            if self.kind == "trtllm" and self.extra.get("backend", "pytorch") != "pytorch":
                found.append("trtllm speculates on its pytorch backend only (engine.extra.backend)")
            if found:
                raise ValueError("engine.speculative: " + "; ".join(found))
        return self


# --- sampling --------------------------------------------------------------------------------


class SamplingSpec(_Strict):
    max_tokens: int = Field(256, ge=1, description="Tokens to generate at most per row.")
    temperature: float = Field(0.0, ge=0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass; 1 disables.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens; 0 disables.")
    seed: int | None = Field(
        None,
        description="Base seed; each row samples with hash(seed, row id), so reruns are "
        "reproducible whatever the batching.",
    )
    stop: list[str] = Field(default_factory=list, description="Stop strings (cut from the text).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    ignore_eos: bool = Field(False, description="Generate past end-of-sequence (benchmarks).")
    response_format: dict[str, Any] | None = Field(
        None,
        description="Constrain every row's text while it is generated: "
        "{type: json_schema, schema: {...}} (or OpenAI's {type: json_schema, json_schema: "
        "{name, schema}}), {type: json_object}, {type: regex, regex: ...} or {type: choice, "
        "choices: [...]}. Output rows get `parsed`: whether the text is whole and valid. "
        "Null: free text.",
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="Per output token, its logprob and this many most likely alternatives "
        "(0: the chosen token's only), from the model's own distribution (before temperature "
        "and masks), in a nested `logprobs` output column. Null: none.",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="Scoring: for every prompt token after the first, its logprob given the "
        "tokens before it and this many most likely alternatives, in a nested "
        "`prompt_logprobs` output column (its first entry null). Such rows compute their "
        "whole prompt (the prefix cache keeps no logits). Null: none.",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2,
        le=2,
        description="OpenAI's: subtract this x the times a token was already generated from "
        "its logit (generated tokens only, not the prompt). 0 disables.",
    )
    presence_penalty: float = Field(
        0.0,
        ge=-2,
        le=2,
        description="OpenAI's: subtract this from the logit of every token already generated. "
        "0 disables.",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0,
        description="Hugging Face's / vLLM's: a token seen in the prompt or the output has its "
        "logit divided by this when positive, multiplied when negative (> 1 discourages "
        "repeats). 1 disables.",
    )
    min_p: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Drop tokens whose probability (after temperature) is below min_p x the "
        "most likely token's, before top_k / top_p. 0 disables.",
    )
    min_tokens: int = Field(
        0,
        ge=0,
        description="EOS and stop_token_ids cannot end a row (and stop strings do not match) "
        "before this many output tokens.",
    )
    logit_bias: dict[int, float] = Field(
        default_factory=dict,
        description="Token id -> bias in [-100, 100] added to its logit (OpenAI's logit_bias); "
        "-100 all but bans a token, 100 all but forces it.",
    )
    bad_words: list[str] = Field(
        default_factory=list,
        description="Words the output must not contain: each is tokenized as given and with a "
        "leading space, and its last token is banned wherever the output ends with the tokens "
        "before it (vLLM's rule).",
    )
    n: int = Field(
        1,
        ge=1,
        le=128,
        description="Samples per row (OpenAI's n), each with its own seed stream (the row's "
        "seed + i). The prompt is computed once and its KV shared by the samples (reference "
        "engine). With n > 1 possible, the output gets a `samples` list column (index, text, "
        "finish_reason, completion_tokens, parsed, logprobs, completion_token_ids per sample); "
        "the row's text, finish_reason, parsed and logprobs are sample 0's, and its "
        "completion_tokens, gpu_seconds and cost cover all samples. A row is an error row "
        "when any sample fails.",
    )
    overrides: dict[str, str] = Field(
        default_factory=dict,
        description="Per-row overrides: sampling field -> input column, e.g. "
        "{max_tokens: max_tokens_col}. A null cell keeps the default. response_format's "
        "column holds a format as JSON text or an object (a row may carry its own schema); "
        "stop (a string or a list), stop_token_ids, logit_bias ({token id: bias}) and "
        "bad_words columns hold lists / objects, or them as JSON text; reasoning_effort "
        "(low | medium | high) replaces prompt.reasoning_effort for the row. Fields: "
        "max_tokens, "
        "temperature, top_p, top_k, seed, response_format, logprobs, n, stop, stop_token_ids, "
        "frequency_penalty, presence_penalty, repetition_penalty, min_p, min_tokens, "
        "logit_bias, bad_words, reasoning_effort.",
    )

    @functools.cached_property
    def response_format_json(self) -> str:
        """`response_format` as JSON text, made once per spec: every row of a job reads it
        (the prompt stage's format cache is keyed by it), and a schema is not small."""
        return json.dumps(self.response_format, sort_keys=True)

    @field_validator("response_format")
    @classmethod
    def _readable_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        from pipeline.openai.response_format import parse_response_format

        # FormatError is a ValueError: pydantic reports it under sampling.response_format.
        parse_response_format(value, "sampling.response_format")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float]) -> dict[int, float]:
        bad = {t: b for t, b in value.items() if t < 0 or not -100 <= b <= 100}
        if bad:
            raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100]: {bad}")
        return value

    @field_validator("bad_words")
    @classmethod
    def _words(cls, value: list[str]) -> list[str]:
        if any(not w.strip() for w in value):
            raise ValueError("bad_words must be non-blank strings")
        return value

    @field_validator("overrides")
    @classmethod
    def _known_override_fields(cls, value: dict[str, str]) -> dict[str, str]:
        allowed = {
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "response_format",
            "logprobs",
            "n",
            "reasoning_effort",
            # The parameters Serve and openai_batch lines share (pipeline.openai.params).
            "stop",
            "stop_token_ids",
            *PROCESSING_FIELDS,
        }
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ValueError(
                f"unknown sampling.overrides field(s) {unknown}; allowed: {sorted(allowed)}"
            )
        return value


# --- resources -------------------------------------------------------------------------------


class ResourcesSpec(_Strict):
    num_actors: int | None = Field(
        1, ge=1, description="Fixed number of engine actors. Null with min/max_actors: autoscale."
    )
    min_actors: int | None = Field(None, ge=1, description="Autoscaling lower bound.")
    max_actors: int | None = Field(None, ge=1, description="Autoscaling upper bound.")
    devices_per_actor: float = Field(
        0,
        ge=0,
        description="GPUs per engine actor (0 on CPU-only clusters). Above 1 it must be a whole "
        "number: the actor then gets a Ray placement group of that many one-GPU bundles (see "
        "`placement`), and the engine's parallel sizes in engine.extra must multiply to it "
        "(docs/engine.md, multi-device engines).",
    )
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field(
        "pack",
        description="With devices_per_actor > 1: how one actor's GPU bundles are placed. pack: "
        "on as few nodes as possible (one node when it has the GPUs; tensor and expert "
        "parallel need that); strict_pack: one node or not at all; spread: over as many nodes "
        "as possible; strict_spread: every GPU on a different node (pipeline parallel across "
        "nodes).",
    )
    placement_timeout_s: float = Field(
        600.0,
        gt=0,
        description="With devices_per_actor > 1: how long the driver waits for the engine "
        "actors' placement groups (the fixed pool, or min_actors) before failing with what was "
        "asked and what the cluster has; long enough for an autoscaler to add nodes.",
    )
    cpus_per_actor: float = Field(
        0.5,
        gt=0,
        description="CPUs reserved per engine actor; fractional on small machines so read and "
        "write tasks still get a CPU.",
    )
    batch_size: int = Field(
        256,
        ge=1,
        description="Rows an engine actor takes from its shard at a time: asked of the budget "
        "together and submitted to the engine together.",
    )
    max_in_flight: int = Field(
        128,
        ge=1,
        description="Requests one actor keeps in its engine at once, across the shards it "
        "works on, so the engine never starves.",
    )
    actor_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each engine actor asks for, e.g. {engine_slot: 1} to "
        "place one actor per node that offers that resource.",
    )
    prompt_actors: int | None = Field(
        None,
        ge=1,
        description="Tokenizer actors feeding the engine actors (chat template + tokenization, "
        "1/4 CPU each). A fixed pool, started before any row is generated, so none starts "
        "mid-run and takes CPU from the engines. Null: one per four engine actors (at least "
        "one); raise it when long prompts make tokenizing the slower stage.",
    )
    max_restarts: int = Field(3, ge=0, description="Restarts of a crashed engine actor.")
    max_task_retries: int = Field(
        3,
        ge=0,
        description="Times one shard is tried again after its work failed (an unreadable "
        "input, a write failing past storage.retry_s) or a prompt actor died tokenizing it. "
        "Past this, a shard that kills prompt actors becomes error rows naming the cause; "
        "other failures fail the job. A shard whose engine actor died is handed out again "
        "with its committed rows kept (the actor restarts up to max_restarts).",
    )
    tail_split: bool = Field(
        True,
        description="At the end of a job, when no shard is left to hand out and an engine "
        "actor has nothing to do, split the running shard with the most rows left: the rows "
        "its actor has not yet taken go to the idle one, so the night does not end waiting for "
        "one actor. Every row is still generated and committed once; the manifest lists each "
        "split (events: tail_split). false: each shard runs on one actor to its end.",
    )

    @property
    def peak_actors(self) -> int:
        """Most engine actors the job runs at once: the fixed pool, or the autoscaling maximum."""
        return self.num_actors or self.max_actors or 1

    @model_validator(mode="after")
    def _pool_size(self) -> ResourcesSpec:
        if self.num_actors is None and (self.min_actors is None or self.max_actors is None):
            raise ValueError("resources: set num_actors, or both min_actors and max_actors")
        if self.min_actors and self.max_actors and self.min_actors > self.max_actors:
            raise ValueError("resources.min_actors must be <= resources.max_actors")
        if self.devices_per_actor > 1 and not float(self.devices_per_actor).is_integer():
            raise ValueError(
                f"resources.devices_per_actor {self.devices_per_actor:g}: above 1 it must be a "
                "whole number of GPUs (one placement-group bundle per GPU)"
            )
        return self

    @property
    def multi_device(self) -> bool:
        """Whether each engine actor spans several GPUs (and gets its own placement group)."""
        return self.devices_per_actor > 1


# --- output, storage, limits, cost -----------------------------------------------------------


class OutputSpec(_Strict):
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


class StorageSpec(_Strict):
    endpoint_url: str | None = Field(
        None,
        description="S3 endpoint, e.g. https://storage.eu-north1.nebius.cloud. Credentials come "
        "only from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...).",
    )
    region: str | None = Field(None, description="S3 region (e.g. eu-north1).")
    anonymous: bool = Field(False, description="Access public buckets without credentials.")
    retry_s: float = Field(
        600.0,
        ge=0,
        description="While a job runs, how long a failing write of a part, the manifest or the "
        "lease is retried (exponential backoff with jitter) before the job fails. Pre-flight "
        "checks fail fast instead.",
    )


class LimitsSpec(_Strict):
    max_error_fraction: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Error rows above this fraction of all rows make the run exit 3 (partial).",
    )
    stop_at: float | None = Field(
        None,
        description="Unix time (seconds) at which a run stops taking rows, commits what has "
        "finished and ends incomplete (exit 1; a rerun resumes), as on SIGTERM: a deadline "
        "such as a Batch API completion window. Null: none.",
    )


class PricePerMillion(_Strict):
    input: float = Field(0.0, ge=0, description="USD per 1M uncached input tokens.")
    cached_input: float | None = Field(
        None, ge=0, description="USD per 1M cached input tokens; null: the input price."
    )
    output: float = Field(0.0, ge=0, description="USD per 1M output tokens.")


class CostSpec(_Strict):
    device_hour_usd: float = Field(
        0.0,
        ge=0,
        description="Price of one device-hour: a GPU-hour for GPU actors, a CPU-actor-hour "
        "for CPU actors (e.g. 3.50 for a Nebius H200).",
    )
    price_per_million: PricePerMillion | None = Field(
        None, description="List prices of a token-priced API, for comparison (list_price_usd)."
    )
    batch_discount: float = Field(
        0.0, ge=0, lt=1, description="Discount on list prices for batch APIs (0.5 = half price)."
    )
    prefill_weight: float = Field(
        1.0, ge=0, description="Weight of a prefill token when sharing a step's time."
    )
    decode_weight: float = Field(
        1.0, ge=0, description="Weight of a decode token when sharing a step's time."
    )
    budget_usd: float | None = Field(
        None,
        gt=0,
        description="Stop admitting rows once spend plus the projected cost of rows in flight "
        "would pass this; a rerun with a higher budget resumes.",
    )

    @model_validator(mode="after")
    def _weights(self) -> CostSpec:
        if self.prefill_weight == 0 and self.decode_weight == 0:
            raise ValueError("cost.prefill_weight and cost.decode_weight cannot both be 0")
        return self


# --- the job ---------------------------------------------------------------------------------


def reserved_columns() -> frozenset[str]:
    """Column names the pipeline writes itself (pipeline.batch.schema.RESERVED_COLUMNS)."""
    # The list is the output schema's; that module imports this one, so it is imported here,
    # when a spec is validated, not when this module loads.
    from pipeline.batch.schema import RESERVED_COLUMNS

    return RESERVED_COLUMNS


class EmbedSpec(_Strict):
    pooling: Literal["last", "mean"] | None = Field(
        None,
        description="task embed: how the prompt's final hidden states become one vector: "
        "last (the last prompt token's) or mean (over the prompt's tokens). Null: the model's "
        "own (its sentence-transformers modules.json where it has one, else last).",
    )
    normalize: bool | None = Field(
        None,
        description="task embed: L2-normalise each embedding. Null: the model's own (its "
        "sentence-transformers Normalize module where it has modules.json, else true).",
    )


# Sampling settings that shape generated text and mean nothing for an embedding.
_GENERATION_ONLY = ("response_format", "logprobs", "prompt_logprobs")


class JobSpec(_Strict):
    name: str = Field(
        description="Job name: letters, digits, '-', '_' and '.'; used in submission ids.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
    )
    date: str | None = Field(
        None,
        description="Run date (YYYY-MM-DD) substituted for {{ date }} anywhere in the file "
        "(and in --set values). Precedence: --date, --set date=..., this field, today (UTC).",
        pattern=r"^\d{4}-\d{2}-\d{2}$",
    )
    input: InputSpec = Field(description="Where the prompts are and how to read them.")
    prompt: PromptSpec = Field(default_factory=PromptSpec, description="How rows become prompts.")
    task: Literal["generate", "embed"] = Field(
        "generate",
        description="generate: complete every prompt (text, finish_reason, token counts). "
        "embed: compute every prompt's embedding instead (prefill only, engine.kind "
        "reference): rows get an `embedding` column (list<float32>), `text` is empty, "
        "finish_reason is stop (or error), completion_tokens 0; sampling is not used.",
    )
    embed: EmbedSpec = Field(
        default_factory=EmbedSpec, description="Pooling and normalisation of task embed."
    )
    model: ModelSpec = Field(description="The model to generate with.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine and its settings.")
    sampling: SamplingSpec = Field(
        default_factory=SamplingSpec, description="Sampling defaults and per-row overrides."
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="Actor pool and batching."
    )
    output: OutputSpec = Field(description="Where the results go.")
    storage: StorageSpec = Field(
        default_factory=StorageSpec, description="Object storage endpoint (no credentials)."
    )
    limits: LimitsSpec = Field(default_factory=LimitsSpec, description="Failure thresholds.")
    cost: CostSpec = Field(default_factory=CostSpec, description="Prices, budget, cost split.")

    @model_validator(mode="after")
    def _engine_devices(self) -> JobSpec:
        """The engine's parallel sizes (engine.extra) must span exactly the GPUs each actor
        reserves: more would wait for GPUs never given, fewer would pay for idle ones."""
        from engines.api import EngineError
        from engines.parallel import DEVICE_FACTORS, engine_devices

        try:
            needed = engine_devices(self.engine.kind, self.engine.extra)
        except EngineError as exc:
            raise ValueError(str(exc)) from exc
        reserved = self.resources.devices_per_actor
        factors = DEVICE_FACTORS.get(self.engine.kind, ())
        if not factors or (needed == 1 and reserved <= 1):
            return self  # one device (or a fraction, or none): nothing spans several
        if needed != reserved:
            sizes = " x ".join(f"{name} {self.engine.extra.get(name) or 1}" for name in factors)
            raise ValueError(
                f"engine.extra parallel sizes ({sizes} = {needed} device(s)) must equal "
                f"resources.devices_per_actor ({reserved:g}); change one of them"
            )
        return self

    @model_validator(mode="after")
    def _embed_task(self) -> JobSpec:
        """task embed: an engine that embeds, and no generation-only setting that would be
        silently ignored."""
        if self.task != "embed":
            return self
        if self.engine.kind != "reference":
            raise ValueError(
                f"task embed: engine.kind {self.engine.kind} does not compute embeddings "
                "(vLLM embeds only in its pooling runner, a separate engine that cannot "
                "generate; the TensorRT-LLM adapter has no pooling); use engine.kind reference"
            )
        sampling = self.sampling
        asked = [name for name in _GENERATION_ONLY if getattr(sampling, name) is not None]
        if sampling.n != 1 or "n" in sampling.overrides:
            asked.append("n")
        if self.engine.speculative is not None:
            asked.append("engine.speculative")
        if self.prompt.reasoning != "none":
            asked.append("prompt.reasoning")
        if self.output.include_token_ids:
            asked.append("output.include_token_ids")
        if asked:
            raise ValueError(
                f"task embed computes no output tokens, so {', '.join(asked)} cannot apply; "
                "remove them or use task generate"
            )
        return self

    @property
    def embed_params(self) -> Any:
        """engines.api.EmbedParams for task embed; None for task generate."""
        if self.task != "embed":
            return None
        from engines.api import EmbedParams

        return EmbedParams(pooling=self.embed.pooling, normalize=self.embed.normalize)

    @model_validator(mode="after")
    def _prompt_source(self) -> JobSpec:
        inp, prompt = self.input, self.prompt
        clashes = sorted(set(inp.passthrough_columns) & reserved_columns())
        if clashes:
            raise ValueError(
                f"input.passthrough_columns: {clashes} are written by the pipeline itself; "
                "rename those input columns"
            )
        sampling = self.sampling
        if (
            self.engine.kind == "trtllm"
            and self.engine.extra.get("backend", "pytorch") != "pytorch"
            and (sampling.logprobs is not None or "logprobs" in sampling.overrides)
        ):
            raise ValueError(
                "sampling.logprobs: engine.kind trtllm returns logprobs on its pytorch backend "
                "only (engine.extra.backend); use backend pytorch, or engine.kind reference or "
                "vllm"
            )
        if self.engine.kind == "trtllm" and sampling.prompt_logprobs is not None:
            raise ValueError(
                "sampling.prompt_logprobs: engine.kind trtllm does not return the prompt "
                "tokens' own logprobs; use engine.kind reference or vllm"
            )
        if self.engine.kind == "synthetic" and sampling.response_format is not None:
            # Every row would be a row error: say so before the job starts.
            raise ValueError(
                "sampling.response_format: engine.kind synthetic generates random tokens and "
                "cannot constrain them; remove response_format or use another engine kind"
            )
        if self.output.format == "openai_batch" and (
            inp.format != "openai_batch" or "url" not in inp.passthrough_columns
        ):
            raise ValueError(
                "output.format openai_batch answers OpenAI Batch API requests: it needs "
                "input.format openai_batch and `url` in input.passthrough_columns (the url "
                "says whether a request gets a chat.completion or a text_completion)"
            )
        if inp.format == "openai_batch":
            if prompt.template is not None:
                raise ValueError(
                    "prompt.template does not apply to input.format openai_batch (the request "
                    "body holds the prompt); remove prompt.template"
                )
            return self
        if inp.messages_column and prompt.template is not None:
            raise ValueError(
                "prompt.template builds a text prompt, but input.messages_column gives whole "
                "chats; remove one of them"
            )
        if inp.messages_column and not prompt.chat_template:
            raise ValueError(
                "input.messages_column needs prompt.chat_template: true (chats are rendered "
                "with the tokenizer's chat template)"
            )
        if not (inp.prompt_column or inp.messages_column or prompt.template):
            raise ValueError(
                "no prompt source: set input.prompt_column, input.messages_column, or "
                "prompt.template (built from row columns)"
            )
        variables = prompt.template_variables()
        bad = sorted(set(variables) & reserved_columns() - {"prompt"})
        if bad:
            raise ValueError(
                f"prompt.template uses {bad}, which are pipeline column names; only input "
                "columns and `prompt` can be template variables"
            )
        if "prompt" in variables and not inp.prompt_column:
            raise ValueError("prompt.template uses {{ prompt }} but input.prompt_column is not set")
        return self

    def template_columns(self) -> list[str]:
        """Input columns the prompt template reads (besides the prompt column), sorted."""
        return [v for v in self.prompt.template_variables() if v != "prompt"]


# --- loading ---------------------------------------------------------------------------------

_ENV_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_DATE_TAG = re.compile(r"\{\{\s*date\s*\}\}")


def today_utc() -> str:
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def render_date(text: str, date: str | None = None, source: str = "job file") -> str:
    """`{{ date }}` in the text becomes the run date (default today, UTC).

    Done on the text, before parsing, because `key: {{ date }}` is not valid YAML until then;
    a checked YYYY-MM-DD cannot change the file's shape (an environment value can, which is why
    `${VAR}` goes into parsed values instead: see `load_yaml`)."""
    run_date = date or today_utc()
    try:
        dt.date.fromisoformat(run_date)
    except ValueError:
        raise SpecError(f"{source}: date {run_date!r} is not YYYY-MM-DD") from None
    return _DATE_TAG.sub(run_date, text)


class _EnvLoader(yaml.SafeLoader):
    """PyYAML's safe loader that keeps how YAML typed each scalar: `implicit[id(node)]` holds
    the (plain, quoted) flags of a scalar whose tag was inferred; a scalar with a tag written in
    the file (`!!str`) has none. A substituted value is typed again from them, as if it had
    been written there."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.implicit: dict[int, tuple[bool, bool]] = {}

    def compose_scalar_node(self, anchor: str | None) -> yaml.ScalarNode:
        event = self.peek_event()
        node = super().compose_scalar_node(anchor)
        if event.tag in (None, "!"):
            self.implicit[id(node)] = event.implicit
        return node


class _Parsed:
    """A file's YAML node tree, each `${...}` in it standing as a plain word until substituted.

    The words exist because `${...}` is not valid everywhere a value may be written: in
    `model: {path: ${MODEL}}` its braces would end the flow mapping. Each reference becomes
    `<marker><n>_`, a word that is a plain scalar (or part of one) wherever the reference stood,
    and is replaced in the parsed values by what the reference gives."""

    def __init__(self, text: str, source: str) -> None:
        # Per reference: the `${...}` text, the variable's name, its default (None: none).
        self.references: list[tuple[str, str, str | None]] = []
        self._marker = f"tokenmill{os.urandom(6).hex()}ref"
        self._word = re.compile(rf"{self._marker}(\d+)_")

        def stand_in(match: re.Match[str]) -> str:
            self.references.append((match.group(0), match.group(1), match.group(2)))
            return f"{self._marker}{len(self.references) - 1}_"

        text = _ENV_VAR.sub(stand_in, text)
        self._lines = text.splitlines()
        try:
            self.loader = _EnvLoader(text)  # the reader refuses control characters here
            self.root: yaml.Node | None = self.loader.get_single_node()
        except yaml.YAMLError as exc:
            raise self._error(exc, source) from None
        self.loader.dispose()  # the parser's state; the tree and the constructor stay

    def _as_written(self, text: str) -> str:
        return self._word.sub(lambda m: self.references[int(m.group(1))][0], text)

    def _error(self, exc: yaml.YAMLError, source: str) -> SpecError:
        """The YAML error with the line as the file wrote it (PyYAML quotes the text it read,
        cut to a window that can end inside a stand-in)."""
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None)
        if mark is None or not problem or not 0 <= mark.line < len(self._lines):
            return SpecError(f"{source}: not valid YAML: {self._as_written(str(exc))}")
        line = self._lines[mark.line]
        column = len(self._as_written(line[: mark.column]))
        what = ": ".join(str(t) for t in (getattr(exc, "context", None), problem) if t)
        return SpecError(
            f"{source}: not valid YAML at line {mark.line + 1}, column {column + 1}: {what}\n"
            f"  {self._as_written(line)}\n  {' ' * column}^"
        )

    def names(self) -> list[str]:
        """Variable names the file's keys and values use (comments are gone), sorted."""
        found: set[str] = set()
        stack = [self.root]
        while stack:
            node = stack.pop()
            if isinstance(node, yaml.MappingNode):
                stack += [n for pair in node.value for n in pair]
            elif isinstance(node, yaml.SequenceNode):
                stack += node.value
            elif isinstance(node, yaml.ScalarNode):
                found.update(self.references[int(n)][1] for n in self._word.findall(node.value))
        return sorted(found)

    def substitute(self, env: dict[str, str], source: str) -> Any:
        """The file's data, each reference replaced by its variable (or default)."""
        if self.root is None:
            return None
        self._substitute(self.root, env, source, "", set())
        try:
            return self.loader.construct_document(self.root)
        except yaml.YAMLError as exc:  # e.g. a tag the safe loader does not know
            raise self._error(exc, source) from None

    def _substitute(
        self, node: yaml.Node, env: dict[str, str], source: str, path: str, done: set[int]
    ) -> None:
        if id(node) in done:  # an alias: substituted where its anchor stands
            return
        done.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                self._substitute(key, env, source, path, done)
                name = str(key.value) if isinstance(key, yaml.ScalarNode) else "?"
                self._substitute(value, env, source, f"{path}.{name}" if path else name, done)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._substitute(item, env, source, f"{path}[{i}]", done)
        elif isinstance(node, yaml.ScalarNode) and self._marker in node.value:

            def value_of(match: re.Match[str]) -> str:
                _, name, default = self.references[int(match.group(1))]
                if name in env:
                    return env[name]
                if default is not None:
                    return default
                raise SpecError(
                    f"{source}: {path or '(top level)'}: environment variable ${{{name}}} is "
                    f"not set (export it, or write ${{{name}:-default}})"
                )

            node.value = self._word.sub(value_of, node.value)
            if id(node) in self.loader.implicit:
                implicit = self.loader.implicit[id(node)]
                node.tag = self.loader.resolve(yaml.ScalarNode, node.value, implicit)


def load_yaml(
    text: str,
    *,
    source: str,
    date: str | None = None,
    env: dict[str, str] | None = None,
) -> Any:
    """A job, serve or quantize file's data: `{{ date }}` in the text (`render_date`), then
    YAML, then `${VAR}` / `${VAR:-default}` from `env` (default os.environ) in the parsed values.

    Substituting into parsed values keeps a variable one value whatever it holds (`: `, quotes,
    `#`, brackets, newlines), and leaves comments alone. Types: a substituted value is typed as
    YAML types that text written in the same place. Unquoted (`num_actors: ${N}`) it gets
    YAML's scalar types (N=4 is the integer 4, `true` a boolean, an empty value null), never a
    list or a mapping; quoted (`"${N}"`) or a block scalar, it is text, which the schema then
    converts where the field is a number or a boolean (the specs validate in pydantic's lax
    mode). So a value the schema takes as text and YAML would not (`no`, `1.10`) is quoted."""
    env = dict(os.environ) if env is None else env
    return _Parsed(render_date(text, date, source), source).substitute(env, source)


def env_references(text: str) -> list[str]:
    """The `${VAR}` names a file's values use (what it needs from the environment), sorted;
    none for a file that is not valid YAML."""
    try:
        return _Parsed(render_date(text), "").names()
    except SpecError:
        return []


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides; values are parsed as YAML scalars (`3`, `true`, `[1,2]`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set {item!r}: expected key.path=value")
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SpecError(f"--set {item!r}: {part!r} is not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise SpecError(f"--set {item!r}: value is not valid YAML: {exc}") from None
    return data


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line per problem: `field.path: what is wrong (got <value>)`.

    Pydantic's messages already list allowed values for Literal fields ("Input should be
    'reference', 'trtllm' or 'vllm'"); the value given is appended so the user sees both.
    """
    lines = [f"{source}: invalid job spec ({exc.error_count()} problem(s))"]
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        kind = err["type"]
        msg = err["msg"]
        if kind == "extra_forbidden":
            msg = "unknown field (check the spelling; see docs/job-spec.md)"
        elif kind == "missing":
            msg = "required field is missing"
        elif kind == "value_error":
            # Our own validators: the message already names the fields involved.
            msg = msg.removeprefix("Value error, ")
        elif not isinstance(err.get("input"), dict):
            msg = f"{msg} (got {_short(err.get('input'))})"
        lines.append(f"  - {path}: {msg}")
    return "\n".join(lines)


def parse_job_spec(data: Any, source: str = "job spec") -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, source)) from None


def load_job_spec(
    path: str | Path,
    overrides: list[str] | None = None,
    date: str | None = None,
    env: dict[str, str] | None = None,
) -> JobSpec:
    """Read, render and validate a job file. Raises SpecError with the file and field path."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"cannot read job file {path}: {exc.strerror or exc}") from None
    # The run date feeds `{{ date }}`, so it is settled before rendering. Precedence:
    # --date, then --set date=..., then a top-level `date:` in the file, then today (UTC).
    overrides = list(overrides or [])
    if date is None:
        for item in overrides:
            key, _, value = item.partition("=")
            if key.strip() == "date" and value.strip():
                date = value.strip().strip("'\"")
    if date is None:
        match = re.search(r"^date:\s*['\"]?(\d{4}-\d{2}-\d{2})", text, re.MULTILINE)
        date = match.group(1) if match else None
    run_date = date or today_utc()
    data = load_yaml(text, source=str(path), date=run_date, env=env)
    if data is None:
        raise SpecError(
            f"{path}: the job file is empty; a job needs at least name, input, model and output "
            "(see docs/job-spec.md or jobs/demo.yaml)"
        )
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping at the top level")
    file_date = data.get("date")
    if file_date is not None and not isinstance(file_date, dt.date):
        try:
            dt.date.fromisoformat(str(file_date))
        except ValueError:
            raise SpecError(f"{path}: date: {file_date!r} is not YYYY-MM-DD") from None
    # `{{ date }}` in a --set value (e.g. an output prefix) gets the same run date.
    rest = [_DATE_TAG.sub(run_date, o) for o in overrides if o.partition("=")[0].strip() != "date"]
    data = apply_overrides(data, rest)
    data["date"] = run_date
    return parse_job_spec(data, source=str(path))

"""Rows → prompt token ids and per-row sampling: the second stage of a job.

`PromptStage` (run by `PromptWorker` actors, one shard at a time) takes the columns
`pipeline.batch.stages.read` produces and adds, per row (names are the constants below):

- `prompt_token_ids` (list<int32>): the rendered prompt's tokens; empty on error rows.
- `prompt_tokens` (int32): len(prompt_token_ids).
- `max_tokens` (int32), `temperature` (float64), `top_p` (float64), `top_k` (int32): the
  `sampling` defaults, replaced per row by a non-null value in the `sampling.overrides` column
  (openai_batch: the request body's values).
- `seed` (int64, null): a per-row override as given; else, when `sampling.seed` is set,
  `derive_seed(sampling.seed, id)` so a row samples the same whatever its batch; else null.
- `logprobs` (int32, null): alternatives per output token to report (override, else
  `sampling.logprobs`); null: no logprobs.
- `num_samples` (int32): samples to draw for the row (`sampling.n`, or its override).
- `response_format` (string, null): the row's format as canonical JSON text (the override
  column's, else `sampling.response_format`); null: free text. A format that cannot be read
  makes the row an error row naming the column.
- `reasoning_effort` (string, null): the row's override (low | medium | high), else
  `prompt.reasoning_effort`; passed to the chat template with `prompt.enable_thinking`.
- `tool_plan` (string, null): rows with tools (their own, else `prompt.tools`): how calls
  are made and read (pipeline.batch.stages.tools); the tools go to the chat template, and a
  required or named tool_choice sets `response_format` to the calls' schema.
- `error` (string, null): set when the row cannot be generated: invalid messages, an empty
  prompt, a template error, an invalid override value, or prompt_tokens + max_tokens above the
  context length, or an id that repeats an earlier row of the shard. Rows that arrive with
  `error` pass through untouched (empty token ids, default sampling values).

Every other column (`id`, `prompt`, `messages`, passthrough, ...) is kept as it is.

Chats (`messages`) always go through the tokenizer's chat template. Text prompts do when
`prompt.chat_template` is on, except openai_batch `/v1/completions` prompts, which are raw
continuations as in the OpenAI API (no chat template, no system prompt).

Chat rendering and the tokenizer are the OpenAI layer's (pipeline.openai.chat: chat
validation, chat template, raw completions), shared with Serve so a request is tokenized
exactly like a batch row. This module adds what is a job's own: `prompt.template` over a row's
columns (`render_user_text`), a row's prompt and template variables (`render_row`), and the
stage, which renders a batch's prompts together (`render_rows`: chat templates and tokenizer
calls over many rows), with the same result per row as `render_row`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engines import faults
from pipeline.batch.columns import ERROR, ID, IMAGES, MESSAGES, PROMPT
from pipeline.batch.commit.parts import read_part, read_part_record
from pipeline.batch.stages.heap import settle_after_load
from pipeline.batch.stages.images import images_cells, images_type, may_have_images
from pipeline.batch.stages.read import override_columns, read_shard
from pipeline.batch.units import PreparedInfo, RowRanges, RowSelection, WorkUnit
from pipeline.media.prompt import PromptImages
from pipeline.openai import params
from pipeline.openai.chat import (
    RAW_COMPLETION,
    PromptError,
    apply_chat_template,
    chat_messages,
    load_tokenizer,
    prompt_chat,
    render_prompt,
)
from pipeline.openai.sampling import check
from pipeline.spec import JobSpec, ModelSpec, PromptSpec, StorageSpec
from pipeline.spec.response_format import FormatError, parse_response_format, to_json
from pipeline.storage import OutputDir, materialize_model

if TYPE_CHECKING:
    import pyarrow as pa
from pipeline.batch.columns import (
    FREE_TEXT,
    LOGPROBS,
    MAX_TOKENS,
    PROMPT_TOKEN_IDS,
    PROMPT_TOKENS,
    REASONING_EFFORT,
    RESPONSE_FORMAT,
    SAMPLES,
    SEED,
    TEMPERATURE,
    TOO_LONG,
    TOOL_PLAN,
    TOP_K,
    TOP_P,
)
from pipeline.batch.stages.tools import row_tools, template_tools

# Tokenizing is light: a fraction of a CPU per tokenizer actor leaves room for the engines.
PROMPT_STAGE_CPUS = 0.25


# --- model facts -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def model_context_length(model: ModelSpec, storage: StorageSpec) -> int | None:
    """max_position_embeddings from the model's config.json (None when it does not say)."""

    local = materialize_model(
        model.path, model.cache_dir, storage, patterns=("config.json",), field="model.path"
    )
    config = json.loads((local / "config.json").read_text())
    # Multimodal checkpoints keep the language model's limits in text_config.
    for section in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            if isinstance(section.get(key), int):
                return section[key]
    return None


def context_length(spec: JobSpec) -> int | None:
    """Prompt + output tokens a row may use: engine.max_model_len, else the model's own."""
    if spec.engine.max_model_len is not None:
        return spec.engine.max_model_len
    return model_context_length(spec.model, spec.storage)


# --- rows to prompts (pure) --------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _compiled_template(template: str) -> Any:
    from jinja2 import StrictUndefined
    from jinja2.sandbox import SandboxedEnvironment

    # StrictUndefined: a misspelled column is an error, not an empty string in the prompt.
    return SandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True).from_string(
        template
    )


def render_user_text(row: Mapping[str, Any], prompt_spec: PromptSpec) -> str:
    """The user prompt text of a row: `prompt.template` over its columns, or its `prompt`."""
    if prompt_spec.template is not None:
        try:
            text = _compiled_template(prompt_spec.template).render(**row)
        except Exception as exc:  # jinja2 raises many kinds; all mean "fix the template/row"
            raise PromptError(f"prompt.template: {type(exc).__name__}: {exc}") from None
    else:
        text = row.get(PROMPT)
    if not isinstance(text, str) or not text.strip():
        raise PromptError("empty prompt" + (" after the template" if prompt_spec.template else ""))
    return text


def _row_prompt(row: Mapping[str, Any], spec: JobSpec) -> dict[str, Any]:
    """render_prompt's arguments for one row: its prompt spec, its text or its messages, and
    the chat template's extra variables (the row's `reasoning_effort` cell over the job's)."""
    kwargs = spec.prompt.template_kwargs(row.get(REASONING_EFFORT))
    tools = template_tools(row)
    if tools is not None:  # the row's tools (its TOOL_PLAN cell), rendered by the template
        kwargs = {**(kwargs or {}), "tools": tools}
    if row.get(MESSAGES) is not None:
        return {"prompt_spec": spec.prompt, "messages": row[MESSAGES], "template_kwargs": kwargs}
    if spec.input.format == "openai_batch":
        return {"prompt_spec": RAW_COMPLETION, "text": render_user_text(row, RAW_COMPLETION)}
    images = [(c, row.get(c)) for c in spec.input.image_columns if row.get(c) is not None]
    if images:  # the row's image columns, shown before its text in one user turn
        parts = [
            {"type": "image_url", "image_url": {"url": cell}, "where": f"column {column!r}"}
            for column, cell in images
        ]
        parts.append({"type": "text", "text": render_user_text(row, spec.prompt)})
        messages = [{"role": "user", "content": parts}]
        return {"prompt_spec": spec.prompt, "messages": messages, "template_kwargs": kwargs}
    return {
        "prompt_spec": spec.prompt,
        "text": render_user_text(row, spec.prompt),
        "template_kwargs": kwargs,
    }


def render_row(row: Mapping[str, Any], spec: JobSpec, tokenizer: Any) -> list[int]:
    """Token ids for one dataset row (columns as produced by pipeline.batch.stages.read)."""
    return render_prompt(tokenizer, **_row_prompt(row, spec))


# Chats rendered by one chat template call. A template that fails on one chat fails the call;
# that chunk is then rendered chat by chat, so only the bad chat becomes an error row.
TEMPLATE_CHUNK = 256


def render_rows(
    rows: Sequence[Mapping[str, Any]], spec: JobSpec, tokenizer: Any
) -> list[list[int] | PromptError]:
    """render_row over many rows: per row the same token ids, or the PromptError render_row
    raises, from fewer calls. The chat template runs over chunks of chats, and the tokenizer
    once per kind of text (chat template output, raw text with special tokens): the fast
    tokenizer encodes a batch in one call into Rust, where `encode` per row spent about as
    much in transformers' Python around each row as in the encoding itself.
    """
    out: list[list[int] | PromptError | None] = [None] * len(rows)
    # Chats by their template variables (rows of a job mostly share them): one template call
    # renders chats of the same variables only.
    groups: dict[str, tuple[dict[str, Any] | None, list[tuple[int, list[dict]]]]] = {}
    # (row index, text, add_special_tokens): the template already wrote any BOS it wants.
    texts: list[tuple[int, str, bool]] = []
    for i, row in enumerate(rows):
        try:
            args = _row_prompt(row, spec)
            chat = prompt_chat(
                tokenizer, args["prompt_spec"], args.get("text"), args.get("messages")
            )
        except PromptError as exc:
            out[i] = exc
            continue
        if chat is None:
            texts.append((i, args["text"], True))
        else:
            kwargs = args.get("template_kwargs")
            key = json.dumps(kwargs, sort_keys=True)
            groups.setdefault(key, (kwargs, []))[1].append((i, chat))
    for kwargs, chats in groups.values():
        for start in range(0, len(chats), TEMPLATE_CHUNK):
            chunk = chats[start : start + TEMPLATE_CHUNK]
            try:
                rendered = apply_chat_template(tokenizer, [chat for _, chat in chunk], kwargs)
            except PromptError:
                for i, chat in chunk:
                    try:
                        texts.append((i, apply_chat_template(tokenizer, chat, kwargs), False))
                    except PromptError as exc:
                        out[i] = exc
                continue
            texts += [(i, text, False) for (i, _), text in zip(chunk, rendered, strict=True)]
    for i, ids in _encode(tokenizer, texts):
        out[i] = ids
    return out  # type: ignore[return-value]  # every row is set by now


def _encode(tokenizer: Any, texts: list[tuple[int, str, bool]]) -> list[tuple[int, list[int]]]:
    """(row index, token ids) for each (row index, text, add_special_tokens), the ids as
    `tokenizer.encode` gives them: transformers' encode is this same call on a batch of one."""
    out: list[tuple[int, list[int]]] = []
    try:
        for add_special_tokens in (False, True):
            group = [(i, text) for i, text, special in texts if special == add_special_tokens]
            if group:
                encoded = tokenizer(
                    [t for _, t in group],
                    add_special_tokens=add_special_tokens,
                    # Only the ids are used: no per-row mask or type id lists.
                    return_attention_mask=False,
                    return_token_type_ids=False,
                )
                out += [
                    (i, list(ids)) for (i, _), ids in zip(group, encoded["input_ids"], strict=True)
                ]
    except Exception:
        # Encoding one row by one, in row order, fails (or not) just as render_row would.
        return [
            (i, list(tokenizer.encode(text, add_special_tokens=special)))
            for i, text, special in sorted(texts, key=lambda t: t[0])
        ]
    return out


# --- per-row sampling --------------------------------------------------------------------------


def derive_seed(base_seed: int, row_id: str) -> int:
    """A row's seed from the job seed and its id: independent of batching, fits in int64."""
    digest = hashlib.sha256(f"{base_seed}:{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


@functools.lru_cache(maxsize=256)
def _format_cell(text: str, where: str) -> tuple[str | None, str | None]:
    """(canonical JSON text or FREE_TEXT, None) or (None, what is wrong), from JSON text."""

    try:
        fmt = parse_response_format(text, where)
    except FormatError as exc:
        return None, str(exc)
    return (to_json(fmt) if fmt is not None else FREE_TEXT), None


def resolve_sampling(
    row: Mapping[str, Any], spec: JobSpec, overrides: Mapping[str, str]
) -> tuple[dict[str, Any], str | None]:
    """The row's sampling values (defaults + overrides) and an error naming a bad override."""
    base = spec.sampling
    values: dict[str, Any] = {
        MAX_TOKENS: base.max_tokens,
        TEMPERATURE: base.temperature,
        TOP_P: base.top_p,
        TOP_K: base.top_k,
        SEED: None,
        RESPONSE_FORMAT: None,
        LOGPROBS: base.logprobs,
        SAMPLES: base.n,
        REASONING_EFFORT: spec.prompt.reasoning_effort,
    }
    if base.parsed_format is not None:  # parsed when the job was read
        values[RESPONSE_FORMAT] = base.format_text
    seed_overridden = False
    for field, column in overrides.items():
        value = row.get(column)
        if field in params.BATCH_SAMPLING:  # read into the row's BODY_SAMPLING by the reader
            continue
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if field == RESPONSE_FORMAT:
            if not isinstance(value, str):  # a Parquet struct column, or a reader's object
                value = json.dumps(value)
            values[RESPONSE_FORMAT], problem = _format_cell(
                value, f"column {column!r} (sampling.overrides.response_format)"
            )
            if problem:
                return values, problem
            continue
        if field == REASONING_EFFORT:
            if value not in ("low", "medium", "high"):
                return values, (
                    f"column {column!r} (sampling.overrides.reasoning_effort): {value!r} must be "
                    "low, medium or high"
                )
            values[REASONING_EFFORT] = value
            continue
        problem = check(field, value)
        if problem:
            return values, f"column {column!r} (sampling.overrides.{field}): {value!r} {problem}"
        values[SAMPLES if field == "n" else field] = value
        seed_overridden |= field == SEED
    if not seed_overridden and base.seed is not None:
        values[SEED] = derive_seed(base.seed, str(row.get(ID)))
    return values, None


# --- the Ray Data stage ------------------------------------------------------------------------


class PromptStage:
    """Renders read rows into prompts: loads the tokenizer once; each call maps a table of read
    rows to the same rows with the stage columns added (see the module docstring)."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.tokenizer = load_tokenizer(spec.model, spec.storage)
        self.max_len = context_length(spec)
        self.overrides = override_columns(spec)
        # Rows with tools: the template's markers choose the tool parser (prompt.tool_parser
        # unset). A tokenizer may hold several named templates; any of them will do to look.
        template = getattr(self.tokenizer, "chat_template", None)
        self.chat_template = json.dumps(template) if isinstance(template, dict) else template
        # Rows with images: the model's image processor, loaded on the first such row.
        self._images: PromptImages | None = None

    def process_row(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """Stage columns and `error` for one row (a dict of the read columns)."""
        out = self._sampling(row)
        if out[ERROR] is not None:
            return out
        try:
            row = {**row, REASONING_EFFORT: out[REASONING_EFFORT], TOOL_PLAN: out[TOOL_PLAN]}
            token_ids: list[int] | PromptError = render_row(row, self.spec, self.tokenizer)
        except PromptError as exc:
            token_ids = exc
        return self._with_prompt(out, self._with_images(row, token_ids, out))

    def process_rows(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """process_row over many rows, with the same result per row; the prompts of the rows
        that get that far are rendered together (render_rows)."""
        outs = [self._sampling(row) for row in rows]
        pending = [i for i, out in enumerate(outs) if out[ERROR] is None]
        # The row's effort and tools (its own or the job's) are stage values, not read columns.
        rendered = render_rows(
            [
                {
                    **rows[i],
                    REASONING_EFFORT: outs[i][REASONING_EFFORT],
                    TOOL_PLAN: outs[i][TOOL_PLAN],
                }
                for i in pending
            ],
            self.spec,
            self.tokenizer,
        )
        for i, token_ids in zip(pending, rendered, strict=True):
            token_ids = self._with_images(rows[i], token_ids, outs[i])
            outs[i] = self._with_prompt(outs[i], token_ids)
        return outs

    def images(self) -> PromptImages:
        """The job's image reader (the model's config and processor files only: the same
        files the tokenizer came from), made on the first row with images."""
        if self._images is None:
            spec = self.spec
            self._images = PromptImages.for_model(
                spec.model,
                spec.prompt.images,
                spec.storage,
                read_s3=True,
                engine_kind=spec.engine.kind,
            )
        return self._images

    def _with_images(
        self, row: Mapping[str, Any], token_ids: list[int] | PromptError, out: dict[str, Any]
    ) -> list[int] | PromptError:
        """For a row with images: its images processed into `out` (IMAGES) and its prompt with
        their placeholders expanded; a bad image (or images to a text model) is the row's
        error, over whatever the template made of the parts."""
        if not may_have_images(row, self.spec):
            return token_ids
        try:
            args = _row_prompt(row, self.spec)
            if args.get("messages") is None:
                return token_ids
            chat = chat_messages(args["messages"], args["prompt_spec"].system_prompt)
            images = self.images().inputs(chat)
            if not images or isinstance(token_ids, PromptError):
                return token_ids
            expanded = self.images().expand(token_ids, images)
        except PromptError as exc:
            return exc
        out[IMAGES] = images_cells(images)
        return expanded

    def _sampling(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """A row's stage columns before its prompt: sampling values, no tokens, and `error`:
        the row's own, or a bad override's. Rows with an error here are not rendered."""
        sampling, problem = resolve_sampling(row, self.spec, self.overrides)
        out: dict[str, Any] = {
            PROMPT_TOKEN_IDS: [],
            PROMPT_TOKENS: 0,
            **sampling,
            TOOL_PLAN: None,
            IMAGES: [],
        }
        out[ERROR] = row.get(ERROR)
        if out[ERROR] is None and problem:
            out[ERROR] = problem
        if out[ERROR] is None and self.spec.task != "embed":
            out[ERROR] = self._tools(row, out)
        return out

    def _tools(self, row: Mapping[str, Any], out: dict[str, Any]) -> str | None:
        """The row's tools into `out` (TOOL_PLAN, and the calls' format when the choice forces
        a call); what is wrong with them, else None."""
        if row.get(MESSAGES) is None and self.spec.input.format == "openai_batch":
            return None  # a /v1/completions line: a raw continuation, never offered tools
        tools, problem = row_tools(row, self.spec, self.overrides, self.chat_template)
        if problem or tools is None:
            return problem
        if not self.spec.prompt.chat_template:
            return "tools need a chat template: set prompt.chat_template: true"
        if out[SAMPLES] > 1:
            return "tools with n > 1 are not supported in batch jobs yet; send n: 1"
        fmt = tools.response_format()
        if fmt is not None:
            if out[RESPONSE_FORMAT] not in (None, FREE_TEXT):
                return (
                    "response_format cannot be combined with tool_choice required or a named "
                    "function (the output is the calls)"
                )
            out[RESPONSE_FORMAT], problem = _format_cell(json.dumps(fmt), "tool_choice")
            if problem:
                return problem
        out[TOOL_PLAN] = tools.cell()
        return None

    def _with_prompt(
        self, out: dict[str, Any], token_ids: list[int] | PromptError
    ) -> dict[str, Any]:
        """`out` with the rendered prompt, or with the error when it fails or does not fit."""
        out = self._checked_prompt(out, token_ids)
        if out[ERROR] is not None:
            out[IMAGES] = []  # an error row carries no pixels to the engine actors
        return out

    def _checked_prompt(
        self, out: dict[str, Any], token_ids: list[int] | PromptError
    ) -> dict[str, Any]:
        if isinstance(token_ids, PromptError):
            out[ERROR] = str(token_ids)
            return out
        if self.spec.task == "embed":  # no output token follows an embedded prompt
            if self.max_len is not None and len(token_ids) > self.max_len:
                out[ERROR] = (
                    f"{TOO_LONG}: prompt has {len(token_ids)} tokens > context length "
                    f"{self.max_len} (max_model_len); shorten the prompt"
                )
                return out
            out[PROMPT_TOKEN_IDS] = token_ids
            out[PROMPT_TOKENS] = len(token_ids)
            return out
        total = len(token_ids) + out[MAX_TOKENS]
        if self.max_len is not None and total > self.max_len:
            out[ERROR] = (
                f"{TOO_LONG}: prompt has {len(token_ids)} tokens + max_tokens "
                f"{out[MAX_TOKENS]} = {total} > context length {self.max_len}; "
                "shorten the prompt or lower max_tokens"
            )
            return out
        out[PROMPT_TOKEN_IDS] = token_ids
        out[PROMPT_TOKENS] = len(token_ids)
        return out

    def __call__(self, batch: pa.Table) -> pa.Table:
        import pyarrow as pa

        image_cells = images_type()
        results = self.process_rows(batch.to_pylist())
        columns = {
            PROMPT_TOKEN_IDS: pa.array(
                [r[PROMPT_TOKEN_IDS] for r in results], type=pa.list_(pa.int32())
            ),
            PROMPT_TOKENS: pa.array([r[PROMPT_TOKENS] for r in results], type=pa.int32()),
            MAX_TOKENS: pa.array([r[MAX_TOKENS] for r in results], type=pa.int32()),
            TEMPERATURE: pa.array([r[TEMPERATURE] for r in results], type=pa.float64()),
            TOP_P: pa.array([r[TOP_P] for r in results], type=pa.float64()),
            TOP_K: pa.array([r[TOP_K] for r in results], type=pa.int32()),
            SEED: pa.array([r[SEED] for r in results], type=pa.int64()),
            RESPONSE_FORMAT: pa.array([r[RESPONSE_FORMAT] for r in results], type=pa.string()),
            LOGPROBS: pa.array([r[LOGPROBS] for r in results], type=pa.int32()),
            SAMPLES: pa.array([r[SAMPLES] for r in results], type=pa.int32()),
            REASONING_EFFORT: pa.array([r[REASONING_EFFORT] for r in results], type=pa.string()),
            TOOL_PLAN: pa.array([r[TOOL_PLAN] for r in results], type=pa.string()),
            IMAGES: pa.array([r[IMAGES] for r in results], type=image_cells),
            ERROR: pa.array([r[ERROR] for r in results], type=pa.string()),
        }
        for name, array in columns.items():
            if name in batch.column_names:
                batch = batch.set_column(batch.column_names.index(name), name, array)
            else:
                batch = batch.append_column(name, array)
        return batch


def prompt_pool_size(spec: JobSpec) -> int:
    """Tokenizer actors for a job: `resources.prompt_actors`, else one per four engine actors.

    One actor tokenizes thousands of short prompts a second, far more than an engine generates;
    more are for many engines with long prompts.
    """
    res = spec.resources
    if res.prompt_actors is not None:
        return res.prompt_actors
    return max(1, math.ceil(res.peak_actors / 4))


def mark_duplicate_ids(table: pa.Table, where: str) -> pa.Table:
    """Rows whose id repeats an earlier row of the same table become error rows (the first
    occurrence stays): an id must name one row, or reruns and joins on it break."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ids = table.column(ID)
    if pc.count_distinct(ids).as_py() == table.num_rows:
        return table
    seen: set[str] = set()
    errors = table.column(ERROR).to_pylist()
    for i, row_id in enumerate(ids.to_pylist()):
        if row_id in seen and errors[i] is None:
            errors[i] = (
                f"duplicate id {row_id!r}: an earlier row of {where} has the same id; every row "
                "needs a unique id (fix the input, or set input.id_column to null to derive ids)"
            )
        seen.add(row_id)
    return table.set_column(table.column_names.index(ERROR), ERROR, pa.array(errors, pa.string()))


class PromptWorker:
    """Ray actor of the prompt stage: reads one shard's rows and renders their prompts.

    `prepare(unit)` returns (PreparedInfo, rows): the rows go to an engine actor through the
    object store, the info (counts only) to the driver. Call it with `num_returns=2`.
    """

    def __init__(self, arguments: tuple[JobSpec, list[pa.Field]]) -> None:
        self.spec, self.passthrough = arguments  # (job spec, passthrough fields)
        self.stage = PromptStage(self.spec)

        settle_after_load()  # see pipeline.batch.stages.heap

    def ready(self) -> bool:
        return True

    def prepare(self, unit: WorkUnit) -> tuple[PreparedInfo, pa.Table]:

        selection = unit.selection
        if unit.replace_parts:
            selection = RowSelection(only=self._error_rows(unit))
        shard_rows = read_shard(self.spec, unit.shard, selection, self.passthrough)
        read_errors = shard_rows.table.num_rows - shard_rows.table.column(ERROR).null_count
        table = mark_duplicate_ids(shard_rows.table, unit.shard.describe())
        if unit.failed is not None:  # the stage would kill this actor: no row is tokenized
            table = _all_errors(table, unit.failed)
        else:
            _test_exit_hook(table)
        table = self.stage(table)
        info = PreparedInfo(
            shard=unit.shard.index,
            num_rows=shard_rows.num_rows,
            num_selected=table.num_rows,
            num_read_errors=int(read_errors),
        )
        return info, table

    def _error_rows(self, unit: WorkUnit) -> RowRanges:
        """Shard rows whose committed row is an error, in the parts `unit` replaces."""
        import pyarrow.compute as pc

        out = OutputDir(self.spec.output.uri, self.spec.storage)
        rows: list[int] = []
        for name in unit.replace_parts:
            record = read_part_record(out, name)
            if record is None:
                raise RuntimeError(f"{out.uri}/{name} has no tokenmill record in its footer")
            reasons = read_part(out, name, columns=["finish_reason"]).column("finish_reason")
            is_error = pc.fill_null(pc.equal(reasons, "error"), False).to_pylist()
            rows += [row for row, bad in zip(record.rows, is_error, strict=True) if bad]
        return RowRanges.from_indexes(rows)


def _all_errors(table: pa.Table, message: str) -> pa.Table:
    """Every row an error row: `message`, or the row's own error (a bad line, a duplicate id)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    errors = pc.fill_null(table.column(ERROR), message)
    return table.set_column(table.column_names.index(ERROR), ERROR, errors.cast(pa.string()))


def _test_exit_hook(table: pa.Table) -> None:
    """Tests only (engines.faults): exit, as a crashing tokenizer would, on a shard holding
    a prompt with the marker text."""
    marker = faults.prompt_exit_marker()
    if marker is None or PROMPT not in table.column_names:
        return
    if any(marker in str(p) for p in table.column(PROMPT).to_pylist()):
        faults.exit_prompt_actor()

"""`output.format: openai_batch`: OpenAI Batch API output and error lines from committed parts.

Per committed part `part-<n>.parquet` (pipeline.batch.commit.parts) the export writes

    openai-output-<n>.jsonl   one line per ok row:    {id, custom_id, response: {status_code,
                              request_id, body: <chat.completion | text_completion>}, error: null}
    openai-errors-<n>.jsonl   one line per error row: {id, custom_id, response: null,
                              error: {code, message}}

(not `part-*`: a reader globbing the prefix's parts must keep finding Parquet only).

An empty file is not written: a part has an output file when it holds an ok row and an error
file when it holds an error row (its record's `rows` and `errors` say which). The lines are a
pure function of the part's rows and the job's fingerprint (ids are digests, `created` is the
row's finish time), so an export of the same committed parts writes the same bytes whoever
runs it, the job before `_SUCCESS` or the Batch API after a job that was killed before it got
there. Files of parts that are no longer committed (replaced by `--retry-errors`) are deleted,
by a run only after its manifest no longer lists those parts, and never those of a part
written by a newer run (pipeline.batch.commit.committer says why).

The response body is built by pipeline.openai.responses' `choices_body`, so a batch answer
has exactly the shape (and usage, with cached tokens and cost) of the Serve endpoint's; a
request with n > 1 gets its n choices from the row's `samples`. A `/v1/responses` line's body
is that chat answer as a Response (pipeline.openai.responses_api), as Serve's route writes it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pipeline.batch.columns import ADAPTER  # jobs with model.adapters: a line's adapter
from pipeline.batch.commit.parts import PART_RE, PartName, PartRecord, read_part
from pipeline.openai.embeddings import embeddings_body
from pipeline.openai.responses import Choice, ResponseIds, Usage, choices_body
from pipeline.openai.responses_api import response_body
from pipeline.storage import OutputDir

OUTPUT_PREFIX = "openai-output-"
ERRORS_PREFIX = "openai-errors-"
EXPORT_SUFFIX = ".jsonl"
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
RESPONSES_URL = "/v1/responses"
EMBEDDING = "embedding"  # task embed jobs: the row's embedding (the body of an embeddings line)
# Columns of a part the lines are made from (`url` is a passthrough column: see JobSpec).
COLUMNS = (
    "id",
    "url",
    "text",
    "finish_reason",
    "error",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "gpu_seconds",
    "cost_usd",
    "list_price_usd",
    "model",
    "actor_id",
    "finished_at",
)
SAMPLES = "samples"  # n > 1 rows: every choice (parts of older jobs may lack the column)
# Jobs with prompt.reasoning: the chat message's reasoning_content and usage's reasoning_tokens.
REASONING = ("reasoning", "reasoning_tokens")
# Rows with tools: JSON text of the calls the answer made (parts of older jobs lack the column).
TOOL_CALLS = "tool_calls"


def export_names(part_name: str) -> tuple[str, str]:
    """(output file, error file) names of a part."""
    stem = part_name.removeprefix("part-").removesuffix(".parquet")
    return OUTPUT_PREFIX + stem + EXPORT_SUFFIX, ERRORS_PREFIX + stem + EXPORT_SUFFIX


def part_of_export(name: str) -> str | None:
    """The part an export file belongs to, or None when `name` is not an export file."""
    for prefix in (OUTPUT_PREFIX, ERRORS_PREFIX):
        if name.startswith(prefix) and name.endswith(EXPORT_SUFFIX):
            part = "part-" + name.removeprefix(prefix).removesuffix(EXPORT_SUFFIX) + ".parquet"
            return part if PART_RE.match(part) else None
    return None


def expected_exports(rows: int, errors: int, part_name: str) -> list[str]:
    """The export files a part with `rows` rows, `errors` of them error rows, has."""
    output, error = export_names(part_name)
    return [n for n, count in ((output, rows - errors), (error, errors)) if count > 0]


@dataclass(frozen=True)
class LineContext:
    """What the lines of one job share."""

    job_key: str  # the job fingerprint's value: ids of two jobs never collide
    list_prices: bool  # cost.price_per_million is set (else usage has no list_price_usd)


def _digest(ctx: LineContext, part_name: str, index: int) -> str:
    text = f"{ctx.job_key}\0{part_name}\0{index}"
    return hashlib.sha256(text.encode()).hexdigest()


def _created(value: Any) -> int:
    if isinstance(value, dt.datetime):
        return int(value.timestamp())
    return 0


def error_code(row: dict[str, Any]) -> str:
    """OpenAI-style code of an error row. Rows never sent to an engine (actor_id null) failed
    on the request itself (a bad line, an unsupported parameter, a prompt too long); the
    rest failed while generating."""
    message = row.get("error") or ""
    if message.startswith("duplicate id") or "duplicate id" in message[:200]:
        return "duplicate_custom_id"
    if row.get("actor_id") is None:
        return "invalid_request"
    return "server_error"


def output_line(row: dict[str, Any], ctx: LineContext, part_name: str, index: int) -> dict:
    """The output-file line of an ok row (index: its position in the part)."""
    digest = _digest(ctx, part_name, index)
    if row.get("url") == EMBEDDINGS_URL:
        prompt_tokens = int(row.get("prompt_tokens") or 0)
        vector = [float(x) for x in row.get(EMBEDDING) or []]
        body = embeddings_body(row.get("model") or "", [vector], "float", prompt_tokens)
        return {
            "id": f"batch_req_{digest[:32]}",
            "custom_id": row.get("id"),
            "response": {"status_code": 200, "request_id": digest[32:], "body": body},
            "error": None,
        }
    endpoint = "chat" if row.get("url") in (CHAT_URL, RESPONSES_URL) else "completions"
    # The body names what the line asked for, as OpenAI's does: its adapter, else the model.
    model = row.get(ADAPTER) or row.get("model") or ""
    ids = dataclasses.replace(
        ResponseIds.new(endpoint, digest[32:], model),
        created=_created(row.get("finished_at")),
    )
    usage = Usage(
        prompt_tokens=int(row.get("prompt_tokens") or 0),
        completion_tokens=int(row.get("completion_tokens") or 0),
        cached_tokens=int(row.get("cached_prompt_tokens") or 0),
        gpu_seconds=float(row.get("gpu_seconds") or 0.0),
        cost_usd=float(row.get("cost_usd") or 0.0),
        list_price_usd=float(row.get("list_price_usd") or 0.0) if ctx.list_prices else None,
        reasoning_tokens=int(row.get("reasoning_tokens") or 0),
    )
    samples = row.get(SAMPLES)
    if samples:
        choices = [
            Choice(
                s.get("text") or "", s.get("finish_reason") or "stop", reasoning=s.get("reasoning")
            )
            for s in samples
        ]
    else:
        calls = row.get(TOOL_CALLS)
        choices = [
            Choice(
                row.get("text") or "",
                row.get("finish_reason") or "stop",
                reasoning=row.get("reasoning"),
                tool_calls=tuple(json.loads(calls)) if calls else (),
            )
        ]
    body = choices_body(ids, choices, usage)
    if row.get("url") == RESPONSES_URL:
        # The same answer as a Response. The line's request is not kept with its row, so the
        # fields a Response echoes from its request (instructions, tools, ...) are left out.
        body = response_body(body, {})
    return {
        "id": f"batch_req_{digest[:32]}",
        "custom_id": row.get("id"),
        "response": {"status_code": 200, "request_id": digest[32:], "body": body},
        "error": None,
    }


def error_line(row: dict[str, Any], ctx: LineContext, part_name: str, index: int) -> dict:
    """The error-file line of an error row."""
    digest = _digest(ctx, part_name, index)
    return {
        "id": f"batch_req_{digest[:32]}",
        "custom_id": row.get("id"),
        "response": None,
        "error": {"code": error_code(row), "message": row.get("error") or "unknown error"},
    }


def part_lines(
    rows: Iterable[dict[str, Any]], ctx: LineContext, part_name: str
) -> tuple[bytes, bytes]:
    """(output file, error file) bytes of a part's rows, in the part's row order."""
    ok: list[str] = []
    failed: list[str] = []
    for index, row in enumerate(rows):
        if row.get("finish_reason") == "error":  # what RowSums counts as an error row
            failed.append(_dumps(error_line(row, ctx, part_name, index)))
        else:
            ok.append(_dumps(output_line(row, ctx, part_name, index)))
    return _join(ok), _join(failed)


def _dumps(line: dict) -> str:
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False)


def _join(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


def export_part(out: OutputDir, part_name: str, ctx: LineContext) -> list[str]:
    """Write a committed part's export files; returns their names."""
    optional = (SAMPLES, *REASONING, EMBEDDING, ADAPTER, TOOL_CALLS)
    table = read_part(out, part_name, columns=list(COLUMNS), optional=optional)
    output, errors = part_lines(table.to_pylist(), ctx, part_name)
    output_name, errors_name = export_names(part_name)
    written = []
    # The error file first: a reader that finds the output file finds both.
    for name, data in ((errors_name, errors), (output_name, output)):
        if data:
            out.put(name, data)
            written.append(name)
    return written


def export_committed(out: OutputDir, records: Iterable[PartRecord], ctx: LineContext) -> int:
    """Bring the export files in line with the committed parts: write those missing, delete
    those of parts no longer committed (`prune_exports`). Returns the number of parts
    exported now."""
    records = list(records)
    exported = write_exports(out, records, ctx)
    prune_exports(out, records, max((r.run for r in records), default=0))
    return exported


def write_exports(out: OutputDir, records: Iterable[PartRecord], ctx: LineContext) -> int:
    """Write the export files of the committed parts that lack them; returns how many parts
    were exported now."""
    present = _present(out)
    exported = 0
    for record in records:
        names = expected_exports(record.sums.rows, record.sums.errors, record.name)
        # Written whole (one atomic put each) and deterministic: present means done.
        if not set(names) <= present:
            export_part(out, record.name, ctx)
            exported += 1
    return exported


def prune_exports(out: OutputDir, records: Iterable[PartRecord], newest_run: int) -> list[str]:
    """Delete the export files of parts that are not committed (replaced ones, mostly), except
    those of parts written by a run numbered above `newest_run`: a run that took the output
    over may have committed those. Returns the names deleted."""
    wanted = {
        name
        for record in records
        for name in expected_exports(record.sums.rows, record.sums.errors, record.name)
    }
    stale = []
    for name in sorted(_present(out) - wanted):
        part = PartName.parse(part_of_export(name) or "")
        if part is not None and part.run <= newest_run:
            out.delete(name)
            stale.append(name)
    return stale


def _present(out: OutputDir) -> set[str]:
    return {n for n in out.names("openai-") if part_of_export(n) is not None}

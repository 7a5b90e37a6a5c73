"""Tool calls in batch rows: a row's tools read into a plan (prompt stage), and the calls read
out of its answer (engine actor), with the same rules as Serve's chat (pipeline.openai.tools).

A row's tools are its own (an openai_batch line's body, or the `sampling.overrides.tools`
column) or the job's `prompt.tools`; `tool_choice` likewise. The prompt stage renders them
into the chat template, constrains the output of `required` and named choices to valid calls
(the row's response_format becomes the calls' JSON schema), and hands the plan on as the
row's TOOL_PLAN cell. The engine actor reads the answer with it: a constrained answer is the
calls; an `auto` one goes through the model's tool parser, and text that holds no call that
parses stays the answer. Call ids are derived from the row id, so a rerun writes the same ids.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.batch.columns import MESSAGES, TOOL_PLAN
from pipeline.openai.tools import (
    PARSERS,
    ToolCall,
    ToolError,
    ToolPlan,
    answer_calls,
    call_schema,
    choose_parser,
    read_tools,
)
from pipeline.spec import JobSpec, SpecError

FINISH_TOOL_CALLS = "tool_calls"  # a row's finish_reason when its answer made calls


@dataclass(frozen=True)
class RowTools:
    """A row's plan and the parser its answers are read with."""

    plan: ToolPlan
    parser: str  # a name in PARSERS

    def cell(self) -> str:
        """The TOOL_PLAN cell: JSON text the engine actor reads back with `from_cell`."""
        plan = self.plan
        return json.dumps(
            {
                "tools": list(plan.tools),
                "mode": plan.mode,
                "forced": plan.forced,
                "parallel": plan.parallel,
                "parser": self.parser,
            },
        )  # keys in their order: the template renders the tools as the request gave them

    @classmethod
    def from_cell(cls, text: str) -> RowTools:
        value = json.loads(text)
        plan = ToolPlan(
            tuple(value["tools"]), value["mode"], value.get("forced"), value["parallel"]
        )
        return cls(plan, value["parser"])

    def response_format(self) -> dict[str, Any] | None:
        """The structured output that makes a required or named answer valid calls."""
        return call_schema(self.plan) if self.plan.constrained else None


def _cell_value(value: Any) -> Any:
    """A tools or tool_choice cell: JSON text read, a plain word (auto, required) kept."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _messages(row: Mapping[str, Any]) -> list[Any]:
    raw = row.get(MESSAGES)
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return []  # the prompt stage names a broken chat itself
    return raw if isinstance(raw, list) else []


@functools.lru_cache(maxsize=256)
def _read_plan(tools_text: str, choice_text: str, parallel: bool | None) -> ToolPlan | None:
    """read_tools of one set of tools and choice (as JSON text). A job's rows mostly share
    theirs: each distinct set has its schemas checked once, not once per row."""
    return read_tools(json.loads(tools_text), json.loads(choice_text), parallel)


def row_tools(
    row: Mapping[str, Any],
    spec: JobSpec,
    overrides: Mapping[str, str],
    chat_template: str | None,
) -> tuple[RowTools | None, str | None]:
    """(the row's tools, None) or (None, what is wrong naming the column or field)."""
    tools_column = overrides.get("tools")
    choice_column = overrides.get("tool_choice")
    parallel_column = overrides.get("parallel_tool_calls")
    tools, tools_from = spec.prompt.tools, "prompt.tools"
    if tools_column is not None and row.get(tools_column) is not None:
        tools, tools_from = _cell_value(row[tools_column]), f"column {tools_column!r}"
    choice, choice_from = spec.prompt.tool_choice, "prompt.tool_choice"
    if choice_column is not None and row.get(choice_column) is not None:
        choice, choice_from = _cell_value(row[choice_column]), f"column {choice_column!r}"
    parallel = spec.prompt.parallel_tool_calls
    if parallel_column is not None and row.get(parallel_column) is not None:
        parallel = bool(row[parallel_column])
    if tools is None:
        return None, None  # a choice without tools (the job's, for rows that bring theirs)
    try:
        plan = _read_plan(json.dumps(tools), json.dumps(choice), parallel)
        read_tools(None, None, None, _messages(row))  # the row's own tool turns
    except ToolError as exc:
        where = choice_from if exc.param.startswith("tool_choice") else tools_from
        if exc.param.startswith("messages"):
            where = "messages"
        return None, f"{where}: {exc}"
    if plan is None or plan.mode == "none":
        return None, None
    parser = choose_parser(chat_template, spec.prompt.tool_parser).name
    if parser == "harmony" and spec.prompt.reasoning != "harmony" and not plan.constrained:
        # GPT-OSS's calls are special-token messages only the harmony split reads.
        return None, (
            "the chat template writes harmony tool calls (GPT-OSS): set prompt.reasoning: "
            "harmony so they can be read"
        )
    return RowTools(plan, parser), None


def template_tools(row: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The tools a row's chat template renders (from its TOOL_PLAN cell); None: none."""
    cell = row.get(TOOL_PLAN)
    if not cell:
        return None
    return RowTools.from_cell(cell).plan.template_tools


def _call_id(row_id: str, index: int) -> str:
    digest = hashlib.sha256(f"{row_id}\0{index}".encode()).hexdigest()
    return "call_" + digest[:24]


def read_calls(
    cell: str, row_id: str, text: str, split_calls: Sequence[tuple[str, str]] = ()
) -> tuple[str, str | None]:
    """(the answer's content, JSON text of its calls or None) for a row's answer
    (`split_calls`: the calls the harmony split read from the token ids)."""
    tools = RowTools.from_cell(cell)
    content, found = answer_calls(tools.plan, PARSERS[tools.parser], text, split_calls)
    if not found:
        # harmony calls that did not parse are content (answer_calls), never dropped
        return (content or "") if split_calls else text, None
    calls = [ToolCall(c.name, c.arguments, _call_id(row_id, k)) for k, c in enumerate(found)]
    return content or "", json.dumps([c.body() for c in calls], ensure_ascii=False)


def check_job_tools(spec: JobSpec) -> None:
    """A job's own tools (prompt.tools, tool_choice, parallel_tool_calls) can be used: checked
    before any row is read, so a bad schema stops the job, not every row. SpecError naming the
    field."""
    prompt = spec.prompt
    if prompt.tools is None and prompt.tool_choice is None:
        return
    if spec.task == "embed":
        raise SpecError("prompt.tools: an embed job generates no text; remove the tools")
    if prompt.tools is None:
        # A choice for rows that bring their own tools; each row's is checked with its tools.
        if "tools" not in spec.sampling.overrides and spec.input.format != "openai_batch":
            raise SpecError(
                "prompt.tool_choice: no row has tools to choose from; set prompt.tools or "
                "sampling.overrides.tools"
            )
        return
    try:
        plan = read_tools(prompt.tools, prompt.tool_choice, prompt.parallel_tool_calls)
    except ToolError as exc:
        raise SpecError(f"prompt.{exc.param}: {exc}") from None
    if plan is not None and plan.constrained and spec.sampling.response_format is not None:
        raise SpecError(
            "prompt.tool_choice: required or a named function makes the output the calls; "
            "it cannot be combined with sampling.response_format (remove one)"
        )
    if plan is not None and not prompt.chat_template:  # the template renders the tools
        raise SpecError("prompt.tools: tools need a chat template; set prompt.chat_template")

"""A streamed answer of a request with tools, one choice: content is sent as it comes until a
call may be starting (the parser says where), the call itself is held back and sent whole at the
end as OpenAI streams calls (a delta with the id and name, then one with the arguments, by
index). A constrained answer (tool_choice required or named) is all calls: nothing is sent
before the end."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.openai.tools.constrain import calls_from_constrained
from pipeline.openai.tools.parsers import HarmonyToolParser, ToolParser
from pipeline.openai.tools.request import ToolCall, ToolPlan


def answer_calls(
    plan: ToolPlan,
    parser: ToolParser,
    text: str,
    split_calls: Sequence[tuple[str, str]] = (),
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer: a constrained one read as calls, else parsed (or,
    for a parser whose calls the reasoning split found, `split_calls`: Split.calls)."""
    if plan.mode == "none":
        return text, []
    if plan.constrained:
        calls = calls_from_constrained(plan, text)
        return (None, calls) if calls else (text, [])
    if isinstance(parser, HarmonyToolParser):
        content, calls = parser.split_calls(text, split_calls)
    else:
        content, calls = parser.parse(text)
    if calls and not plan.parallel:
        calls = calls[:1]  # parallel_tool_calls false: the first call only
    return content, calls


@dataclass
class ToolStream:
    plan: ToolPlan
    parser: ToolParser
    text: str = ""
    sent: int = 0  # characters of `text` already sent as content
    held: bool = field(default=False, init=False)

    def feed(self, delta: str) -> str:
        """The content to send now for this text delta."""
        self.text += delta
        if self.plan.mode == "none":
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        if self.plan.constrained:
            return ""
        safe = self.parser.safe_prefix(self.text)
        if safe <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : safe], safe
        return out

    def close(self, split_calls: Sequence[tuple[str, str]] = ()) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, calls) once the answer is whole (`split_calls`: the calls
        the reasoning split found, for the harmony parser)."""
        content, calls = answer_calls(self.plan, self.parser, self.text, split_calls)
        if not calls and not split_calls:
            return self.text[self.sent :], []
        content = content or ""
        already = self.text[: self.sent]
        rest = content[len(already) :] if content.startswith(already) else ""
        return rest, calls

"""Reasoning output: a reasoning model's output split into its reasoning and its answer.

Engine-independent: it reads the output's token ids and text as every engine kind returns
them, so batch rows and Serve responses split the same way whatever generated them.

Formats (`prompt.reasoning` of a job, `reasoning` of a served model):

- `think` (Qwen3, QwQ, DeepSeek-R1): the reasoning is a `<think>...</think>` block at the
  start of the output. The chat template may open the block in the prompt (the prompt's last
  `<think>` is not closed): the output is then reasoning from its first token. A block still
  open when the output ends (max_tokens) is all reasoning, with an empty answer. An output that
  does not start with `<think>` (whitespace aside), in a prompt that left no block open, has no
  reasoning (null) and is all answer. Whitespace around the reasoning and before the answer is
  dropped. The split is made on the text: the markers are tokens that decode to themselves
  (checked when the parser is built), and the text is what the engine returned (stop strings
  already cut).
- `harmony` (GPT-OSS): the output is messages `<|channel|>NAME<|message|>...<|end|>`, each
  after `<|start|>assistant`, the last ending in `<|return|>` (or `<|call|>`). Messages of the
  `analysis` channel are the reasoning, those of `final` the answer. A message addressed to a
  function (`to=functions.NAME` in its header, on the `commentary` channel) is a tool call:
  its content is the call's arguments, kept as the split's `calls` (the `harmony` tool parser
  returns them: pipeline.openai.tools); other `commentary` messages (preambles, calls to
  built-in tools) are in neither. The markers are
  special tokens, absent from the decoded text, so this format reads token ids and decodes
  each message's content itself. The `openai-harmony` package is not used: it downloads its
  vocabulary when first loaded, and nothing may be downloaded at run time.

Reasoning tokens are counted on the token ids as vLLM's reasoning parsers count them
(`count_reasoning_tokens`): the tokens of the reasoning content only. The markers (`<think>`,
`</think>`, harmony's message headers) are neither reasoning nor answer. All of them are output
tokens still: completion tokens and cost do not change.

Streaming (`ReasoningStream`) gives the same result as the whole split for any cut of the
output into deltas: text that may be the start of a marker, or whitespace that may turn out to
be the end of the reasoning, is held back until the next delta decides it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from engines.detokenize import IncrementalDetokenizer
from pipeline.openai.markers import marker_prefix_len

ReasoningFormat = Literal["none", "think", "harmony"]
REASONING_FORMATS: tuple[str, ...] = ("none", "think", "harmony")
REASONING_EFFORTS: tuple[str, ...] = ("low", "medium", "high")

THINK_START = "<think>"
THINK_END = "</think>"
# harmony's structural tokens (GPT-OSS's o200k_harmony vocabulary).
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_END, H_RETURN, H_CALL, H_CONSTRAIN = "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"
HARMONY_MARKERS = (H_START, H_CHANNEL, H_MESSAGE, H_END, H_RETURN, H_CALL, H_CONSTRAIN)
ANALYSIS, FINAL = "analysis", "final"
FUNCTIONS = "functions."  # the namespace of a request's function tools in harmony
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class ReasoningError(ValueError):
    """A reasoning format that does not fit the model's tokenizer; the message says why."""


@dataclass(frozen=True)
class Split:
    """One output, split."""

    reasoning: str | None  # the reasoning; None: the output has no reasoning part
    text: str  # the answer
    reasoning_tokens: int  # output tokens of the reasoning (markers not counted)
    # harmony: the messages addressed to functions, as (name, arguments text), in order
    calls: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Delta:
    """What one streamed piece of output adds to each part ("" for nothing)."""

    reasoning: str = ""
    text: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.text)


class ReasoningStream(Protocol):
    """One output, split as it streams."""

    def feed(self, token_ids: Sequence[int], text: str) -> Delta:
        """The next piece: its new token ids and the text they added."""
        ...

    def close(self) -> Delta:
        """The output ended: what was held back."""
        ...

    def result(self, output_ids: Sequence[int]) -> Split:
        """The whole split (after close), its token count from all of the output's ids."""
        ...


class ReasoningParser(Protocol):
    """A format bound to one tokenizer: built once, used for every output."""

    def stream(self, prompt_ids: Sequence[int]) -> ReasoningStream: ...


def split_output(
    parser: ReasoningParser, prompt_ids: Sequence[int], output_ids: Sequence[int], text: str
) -> Split:
    """A whole output, split: the stream fed everything at once, so both agree by design."""
    stream = parser.stream(prompt_ids)
    stream.feed(output_ids, text)
    stream.close()
    return stream.result(output_ids)


def make_parser(fmt: str, tokenizer: Any) -> ReasoningParser | None:
    """The parser of `fmt` for `tokenizer` (None for "none"); ReasoningError when the
    tokenizer lacks the format's tokens."""
    if fmt == "none":
        return None
    if fmt == "think":
        return ThinkParser.from_tokenizer(tokenizer)
    if fmt == "harmony":
        return HarmonyParser.from_tokenizer(tokenizer)
    raise ReasoningError(f"unknown reasoning format {fmt!r}; choose one of {REASONING_FORMATS}")


def _single_token(tokenizer: Any, marker: str, fmt: str) -> int:
    """The id of the one token that is `marker`, or ReasoningError naming what is wrong."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    if len(ids) != 1:
        raise ReasoningError(
            f"reasoning format {fmt} needs {marker!r} as one token, but the model's tokenizer "
            f"splits it into {len(ids)}; this model does not write {fmt} reasoning (set "
            "reasoning to none, or pick the format the model was trained with)"
        )
    return int(ids[0])


# --- think -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThinkParser:
    """`<think>...</think>` reasoning (see the module docstring)."""

    start_id: int
    end_id: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ThinkParser:
        start = _single_token(tokenizer, THINK_START, "think")
        end = _single_token(tokenizer, THINK_END, "think")
        for marker, token in ((THINK_START, start), (THINK_END, end)):
            # Engines decode with special tokens skipped: a special marker leaves no trace in
            # the text, and the text is where this format finds the block.
            if tokenizer.decode([token], skip_special_tokens=True) != marker:
                raise ReasoningError(
                    f"reasoning format think: the tokenizer marks {marker!r} as a special token, "
                    "so decoded text drops it and the reasoning cannot be told from the answer"
                )
        return cls(start, end)

    def opens_in_prompt(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt leaves a block open (the template wrote `<think>`)."""
        for token in reversed(prompt_ids):
            if token == self.end_id:
                return False
            if token == self.start_id:
                return True
        return False

    def stream(self, prompt_ids: Sequence[int]) -> ThinkStream:
        return ThinkStream(self, self.opens_in_prompt(prompt_ids))

    def count(self, opened_in_prompt: bool, output_ids: Sequence[int], has_block: bool) -> int:
        """Tokens strictly inside the block: after its `<think>` (or from the output's first
        token when the prompt opened it) up to its `</think>` (or the output's end)."""
        if not has_block:
            return 0
        ids = list(output_ids)
        begin = 0
        if not opened_in_prompt and self.start_id in ids:
            begin = ids.index(self.start_id) + 1
        try:
            end = ids.index(self.end_id, begin)
        except ValueError:
            end = len(ids)
        return max(0, end - begin)


class ThinkStream:
    """The think split over text deltas; a small state machine:

    opening: before anything but whitespace (is the output a block?) → reasoning → answer.
    """

    def __init__(self, parser: ThinkParser, opened_in_prompt: bool) -> None:
        self._parser = parser
        self._opened_in_prompt = opened_in_prompt
        self._state: Literal["opening", "reasoning", "answer"] = (
            "reasoning" if opened_in_prompt else "opening"
        )
        self._has_block = opened_in_prompt
        self._lead = True  # the current part has shown no non-whitespace yet (it is dropped)
        self._held = ""  # text not yet given to a part
        self._reasoning: list[str] = []
        self._text: list[str] = []

    def feed(self, token_ids: Sequence[int], text: str) -> Delta:
        del token_ids  # the text says it all (markers decode to themselves)
        self._held += text
        reasoning, answer = [], []
        while True:
            if self._state == "opening":
                rest = self._held.lstrip()
                if rest.startswith(THINK_START):
                    self._held = rest[len(THINK_START) :]
                    self._state, self._has_block, self._lead = "reasoning", True, True
                    continue
                if not rest or THINK_START.startswith(rest):
                    break  # only whitespace, or the start of "<think>": not decided yet
                self._state, self._lead = "answer", False  # no block: the text as it is
                continue
            if self._state == "reasoning":
                if self._lead:
                    self._held = self._held.lstrip()
                    if not self._held:
                        break
                    self._lead = False
                at = self._held.find(THINK_END)
                if at >= 0:
                    reasoning.append(self._held[:at].rstrip())
                    self._held = self._held[at + len(THINK_END) :]
                    self._state, self._lead = "answer", True
                    continue
                # Keep back what may be the start of "</think>" and the whitespace before it.
                safe = len(self._held) - marker_prefix_len(self._held, THINK_END)
                out = self._held[:safe].rstrip()
                reasoning.append(out)
                self._held = self._held[len(out) :]
                break
            # answer
            if self._lead:
                self._held = self._held.lstrip()
                if not self._held:
                    break
                self._lead = False
            answer.append(self._held)
            self._held = ""
            break
        return self._emit("".join(reasoning), "".join(answer))

    def close(self) -> Delta:
        held, self._held = self._held, ""
        if self._state == "opening":
            return self._emit("", held)  # whitespace or a cut "<think": all answer
        if self._state == "reasoning":
            # An unfinished block is all reasoning; what was held is its end (less whitespace).
            return self._emit(held.rstrip(), "")
        return self._emit("", "" if self._lead else held)

    def _emit(self, reasoning: str, text: str) -> Delta:
        if reasoning:
            self._reasoning.append(reasoning)
        if text:
            self._text.append(text)
        return Delta(reasoning, text)

    def result(self, output_ids: Sequence[int]) -> Split:
        count = self._parser.count(self._opened_in_prompt, output_ids, self._has_block)
        reasoning = "".join(self._reasoning) if self._has_block else None
        return Split(reasoning, "".join(self._text), count)


# --- harmony -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HarmonyParser:
    """GPT-OSS harmony messages (see the module docstring)."""

    tokenizer: Any
    ids: dict[str, int]  # marker -> token id

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> HarmonyParser:
        ids = {marker: _single_token(tokenizer, marker, "harmony") for marker in HARMONY_MARKERS}
        return cls(tokenizer, ids)

    def stream(self, prompt_ids: Sequence[int]) -> HarmonyStream:
        stream = HarmonyStream(self)
        # The prompt ends inside the assistant's first header (`<|start|>assistant`), or in a
        # body the template opened: read its last message's start silently.
        start = self.ids[H_START]
        tail = list(prompt_ids)
        if start in tail:
            tail = tail[len(tail) - 1 - tail[::-1].index(start) :]
            stream.prime(tail)
        return stream

    def channel(self, header: Sequence[int]) -> tuple[str, str | None]:
        """(the channel a message header names, final without one; the function it is
        addressed to, None when it is no call). The recipient may stand before the channel
        (`assistant to=functions.f<|channel|>commentary json`) or after it
        (`<|channel|>commentary to=functions.f <|constrain|>json`): GPT-OSS writes both."""
        text = self.tokenizer.decode(list(header), skip_special_tokens=False)
        found = _RECIPIENT.search(text)
        function = None
        if found is not None and found.group(1).startswith(FUNCTIONS):
            function = found.group(1).removeprefix(FUNCTIONS)
        if H_CHANNEL not in text:
            return FINAL, function
        after = text.rsplit(H_CHANNEL, 1)[1].split("<|", 1)[0].split()
        return (after[0] if after else FINAL), function


class HarmonyStream:
    """The harmony split over token ids: a header (up to `<|message|>`), then a body (up to
    `<|end|>`, `<|return|>` or `<|call|>`), again and again."""

    def __init__(self, parser: HarmonyParser) -> None:

        self._parser = parser
        self._detokenizer_cls = IncrementalDetokenizer
        ids = parser.ids
        self._message = ids[H_MESSAGE]
        self._ends = {ids[H_END], ids[H_RETURN], ids[H_CALL]}
        self._start = ids[H_START]
        self._header: list[int] = []
        self._channel: str | None = None  # in a body: its channel
        self._function: str | None = None  # in a call's body: the function it calls
        self._calls: list[tuple[str, str]] = []
        self._detok: Any = None  # the body's incremental detokenizer
        self._sent = 0  # characters of the body's text already given out
        self._priming = False
        self._bodies = 0  # bodies opened by the output
        self._raw: list[int] = []  # the output's ids (the fallback when it has no messages)
        self._reasoning: list[str] | None = None  # None until an analysis message opens
        self._text: list[str] = []
        self.reasoning_tokens = 0

    def prime(self, prompt_tail: Sequence[int]) -> None:
        self._priming = True
        self.feed(prompt_tail, "")
        self._priming = False

    def feed(self, token_ids: Sequence[int], text: str) -> Delta:
        del text  # the markers are special tokens: the engine's text lost them
        reasoning, answer = [], []
        for token in token_ids:
            if not self._priming:
                self._raw.append(token)
            if self._channel is None:
                if token == self._message:
                    self._open(*self._parser.channel(self._header))
                elif token == self._start:
                    self._header = []
                else:
                    self._header.append(token)
                continue
            if token in self._ends or token == self._start:
                self._end_call(token)
                self._channel, self._detok, self._header = None, None, []
                continue
            if self._priming:
                continue  # content the template wrote is the prompt's, not the output's
            if self._channel == ANALYSIS and self._function is None:
                self.reasoning_tokens += 1
            self._detok.add(token)
            new = self._detok.text[self._sent :]
            self._sent = len(self._detok.text)
            if self._function is not None:
                continue  # a call's arguments: read whole when its body ends
            if self._channel == ANALYSIS:
                reasoning.append(new)
            elif self._channel == FINAL:
                answer.append(new)
        return self._emit("".join(reasoning), "".join(answer))

    def _end_call(self, token: int | None) -> None:
        """A body ends: a call's is kept. One the output cut short (no end token after it)
        is kept only when its arguments are whole JSON; else its text is the answer's, so a
        cut call is never lost and never returned broken."""
        if self._function is None or self._priming:
            return
        arguments = self._detok.text.strip()
        if token is None:
            try:
                json.loads(arguments)
            except json.JSONDecodeError:
                self._emit("", arguments)
                self._function = None
                return
        self._calls.append((self._function, arguments))
        self._function = None

    def _open(self, channel: str, function: str | None = None) -> None:
        self._channel = channel
        self._function = function
        self._detok = self._detokenizer_cls(self._parser.tokenizer, [], ())
        self._sent = 0
        if not self._priming:
            self._bodies += 1
        if channel == ANALYSIS and self._reasoning is None:
            self._reasoning = []

    def close(self) -> Delta:
        if self._bodies == 0 and self._raw:
            # No message at all: not harmony output; all of it is the answer.
            text = self._parser.tokenizer.decode(self._raw, skip_special_tokens=True)
            return self._emit("", text)
        if self._channel is not None and self._function is not None:
            before = len(self._text)
            self._end_call(None)  # a call the output cut short
            return Delta("", "".join(self._text[before:]))
        return Delta()

    def _emit(self, reasoning: str, text: str) -> Delta:
        if reasoning:
            if self._reasoning is None:
                self._reasoning = []
            self._reasoning.append(reasoning)
        if text:
            self._text.append(text)
        return Delta(reasoning, text)

    def result(self, output_ids: Sequence[int]) -> Split:
        del output_ids  # counted while reading them
        reasoning = None if self._reasoning is None else "".join(self._reasoning)
        return Split(reasoning, "".join(self._text), self.reasoning_tokens, tuple(self._calls))

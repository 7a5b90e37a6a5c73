"""Incremental detokenization with stop strings.

Text grows by decoding a small window of recent ids twice (with and without the newest
tokens) and keeping the difference, so the cost per token stays constant and multi-byte
characters split across tokens never show up half-done (a trailing U+FFFD waits for more,
and is left out if the output ends there, as vLLM's detokenizer does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the output so spacing comes out right


# A finished output's text stops before a trailing incomplete character; walking back further
# than this many tokens means the output ends in a run of invalid bytes: cut them all at once.
_MAX_WALK_BACK = 8


def final_text(tokenizer: Any, output_ids: Sequence[int]) -> str:
    """The text of a finished output, as IncrementalDetokenizer would have built it: decoded
    whole, without the tokens of a character the output stopped in the middle of."""
    text = tokenizer.decode(output_ids, skip_special_tokens=True)
    end = len(output_ids)
    while text.endswith("\ufffd") and end > 0:
        if len(output_ids) - end >= _MAX_WALK_BACK:
            return text.rstrip("\ufffd")
        end -= 1
        text = tokenizer.decode(output_ids[:end], skip_special_tokens=True)
    return text


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # output text so far (cut before a matched stop string)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int, search: bool = True) -> str | None:
        """Take one output token; return the stop string it completed, if any (none when
        `search` is False: the output is still shorter than min_tokens)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        before = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if not self.stop or not search:
            return None
        search_from = max(0, before - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def stable_text_len(self) -> int:
        """Length of text that no future stop-string match can cut (safe to stream)."""
        return max(0, len(self.text) - max(0, self._max_stop - 1))

"""Engine logprobs → OpenAI's `logprobs` objects, for chat and completions, whole or streamed.

Chat (`choices[].logprobs`): {"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}], "refusal": null}. Completions: {"tokens",
"token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}. A token's text is its own
decoding, so a token that is part of a multi-byte character shows U+FFFD, as in vLLM.

The engines report one entry per output token id, a final stop or EOS token included (it is
counted). That token is not part of the text, so it is left out here too, as OpenAI and vLLM
leave it out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engines.api import GenerationResult, TokenLogprob

TokenText = Callable[[int], str]


def ends_on_stop_token(result: GenerationResult | None) -> bool:
    """Whether the request's last output token is a stop or EOS token (not in the text)."""
    return (
        result is not None
        and result.finish_reason == "stop"
        and not isinstance(result.stop_reason, str)
        and len(result.output_token_ids) > 0
    )


class LogprobsBody:
    """OpenAI logprobs objects for one response's tokens, chunk after chunk (completions'
    text_offset runs on across chunks)."""

    def __init__(self, endpoint: str, token_text: TokenText) -> None:
        self._chat = endpoint == "chat"
        self._token_text = token_text
        self._offset = 0

    def body(
        self,
        entries: Sequence[TokenLogprob],
        result: GenerationResult | None = None,
    ) -> dict[str, Any]:
        """The object for `entries`; pass the result with the last ones (a final stop token
        is then left out)."""
        if ends_on_stop_token(result) and entries:
            entries = entries[:-1]
        if self._chat:
            return chat_logprobs(entries, self._token_text)
        body = completion_logprobs(entries, self._token_text, self._offset)
        self._offset += sum(len(t) for t in body["tokens"])
        return body

    def prompt_body(
        self, prompt_ids: Sequence[int], entries: Sequence[TokenLogprob | None] | None
    ) -> dict[str, Any]:
        """Completions with echo: the prompt's tokens, each with its logprob given the tokens
        before it (the first has none: nothing predicts it; null top_logprobs there too, as
        in OpenAI's and vLLM's answers). Call before the completion's own bodies."""
        tokens, values, tops, offsets = [], [], [], []
        for i, token in enumerate(prompt_ids):
            lp = entries[i] if entries is not None and i < len(entries) else None
            tokens.append(self._token_text(token))
            offsets.append(self._offset)
            self._offset += len(tokens[-1])
            values.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else {self._token_text(t): v for t, v in lp.top})
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def join_completion_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two completions logprobs objects of consecutive tokens as one."""
    return {key: first[key] + second[key] for key in first}


def _entry(token_text: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    content = []
    for lp in entries:
        item = _entry(token_text, lp.token_id, lp.logprob)
        item["top_logprobs"] = [_entry(token_text, t, v) for t, v in lp.top]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: Sequence[TokenLogprob], token_text: TokenText, offset: int = 0
) -> dict[str, Any]:
    """`offset`: characters of text before these tokens (earlier chunks of a stream)."""
    tokens, offsets = [], []
    for lp in entries:
        tokens.append(token_text(lp.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in entries],
        "top_logprobs": [{token_text(t): v for t, v in lp.top} for lp in entries],
        "text_offset": offsets,
    }

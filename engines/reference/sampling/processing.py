"""Logits processing before temperature, for all of a step's rows at once: bad words, logit
bias, min_tokens, then the repetition, frequency and presence penalties.

The order and the formulas are vLLM's (its sampler applies the same edits to the raw logits,
then temperature, then min_p, top-k and top-p, which live in sampler.py here):
- bad words: a word's last token gets -inf when the output ends with the word's other tokens
  (the output only, not the prompt: vLLM matches against generated tokens);
- logit bias: added to the logit, as OpenAI's logit_bias;
- min_tokens: EOS and stop_token_ids get -inf while the output is shorter than min_tokens;
- repetition penalty (Hugging Face's): a token present in the prompt or the output has its
  logit divided by the penalty when positive, multiplied when not;
- frequency and presence penalties (OpenAI's): logit -= frequency x (times generated)
  + presence x (generated at all), counting generated tokens only.

Rows of requests that use none of this are never touched, and a step none of whose requests
uses it costs one dict lookup (`apply` returns at once).

State: a request with a penalty holds a slot in two [slots, V] buffers, the counts of the
tokens it generated (float32, so the penalty is one multiply-add) and a mask of the tokens
its prompt holds. Counts grow incrementally: each step adds the output tokens appended since
the request was last processed, so no step re-reads a request's history (and forks,
preemption and recomputation, which keep a request's output, need nothing special).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engines.api import SamplingParams


@dataclass
class _RowState:
    """What one request's rows need beyond its params."""

    params: SamplingParams
    stop_ids: tuple[int, ...]  # masked until min_tokens outputs: EOS ids and stop_token_ids
    bad_words: tuple[tuple[int, ...], ...]  # token ids of each banned word (all variants)
    slot: int | None = None  # row of the penalty buffers; None without penalties
    num_counted: int = 0  # output tokens already added to the slot's counts


class LogitsProcessing:
    """Per-request state and the batched edit of a step's logits (engine thread only)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._states: dict[str, _RowState] = {}
        self._counts: torch.Tensor | None = None  # [slots, V] float32 generated-token counts
        self._in_prompt: torch.Tensor | None = None  # [slots, V] bool, token is in the prompt
        self._free_slots: list[int] = []

    def admit(
        self,
        request_id: str,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        eos_token_ids: Sequence[int],
        bad_words: Sequence[Sequence[int]] = (),
    ) -> None:
        """Start tracking a request that uses logits processing (uses_logits_processing)."""
        state = _RowState(
            params,
            stop_ids=tuple(dict.fromkeys([*eos_token_ids, *params.stop_token_ids])),
            bad_words=tuple(tuple(w) for w in bad_words),
        )
        if params.uses_penalties:
            state.slot = self._take_slot()
            self._counts[state.slot].zero_()
            mask = self._in_prompt[state.slot]
            mask.zero_()
            mask[torch.tensor(list(prompt_token_ids), device=self.device)] = True
        self._states[request_id] = state

    def free(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None and state.slot is not None:
            self._free_slots.append(state.slot)

    @torch.inference_mode()  # the runner's logits are inference tensors
    def apply(self, logits: torch.Tensor, rows: Sequence[int], lives: Sequence[Any]) -> None:
        """Edit `logits` ([S, V]) in place: row rows[i] belongs to lives[i] (anything with
        `.request.request_id` and `.sched`, the scheduler's request: token_ids and
        num_prompt_tokens). Requests not admitted here are left alone."""
        if not self._states:
            return
        picked = []  # (row, state, its output: a view, no copy of the history)
        for row, live in zip(rows, lives, strict=True):
            state = self._states.get(live.request.request_id)
            if state is not None:
                sched = live.sched
                picked.append((row, state, _Output(sched.token_ids, sched.num_prompt_tokens)))
        if not picked:
            return
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for row, state, output in picked:
            for word in state.bad_words:
                prefix = word[:-1]
                if len(prefix) <= len(output) and output.ends_with(prefix):
                    banned_rows.append(row)
                    banned_ids.append(word[-1])
            for token, bias in state.params.logit_bias:
                bias_rows.append(row)
                bias_ids.append(token)
                bias_values.append(bias)
            if len(output) < state.params.min_tokens:
                banned_rows += [row] * len(state.stop_ids)
                banned_ids += state.stop_ids
        device = logits.device
        if bias_rows:
            # Bad words first, as vLLM: -inf stays -inf whatever the bias.
            logits.index_put_(
                (_ids(bias_rows, device), _ids(bias_ids, device)),
                torch.tensor(bias_values, dtype=logits.dtype, device=device),
                accumulate=True,
            )
        if banned_rows:
            logits[_ids(banned_rows, device), _ids(banned_ids, device)] = -torch.inf
        penalized = [entry for entry in picked if entry[1].slot is not None]
        if penalized:
            self._penalize(logits, penalized)

    def _penalize(self, logits: torch.Tensor, picked: list[tuple[int, _RowState, Any]]) -> None:
        device = logits.device
        new_slots: list[int] = []
        new_ids: list[int] = []
        for _, state, output in picked:
            fresh = output.tail(state.num_counted)
            new_slots += [state.slot] * len(fresh)
            new_ids += fresh
            state.num_counted = len(output)
        if new_ids:
            self._counts.index_put_(
                (_ids(new_slots, device), _ids(new_ids, device)),
                torch.ones(len(new_ids), device=device),
                accumulate=True,
            )
        rows = _ids([row for row, _, _ in picked], device)
        slots = _ids([state.slot for _, state, _ in picked], device)
        counts = self._counts[slots]  # [P, V]
        values = logits[rows].float()  # [P, V]

        def column(name: str) -> torch.Tensor:  # [P, 1] one parameter per row
            return torch.tensor(
                [getattr(state.params, name) for _, state, _ in picked], device=device
            )[:, None]

        repetition = column("repetition_penalty")
        seen = (counts > 0) | self._in_prompt[slots]
        values = torch.where(
            seen, torch.where(values > 0, values / repetition, values * repetition), values
        )
        values -= column("frequency_penalty") * counts
        values -= column("presence_penalty") * (counts > 0)
        logits[rows] = values.to(logits.dtype)

    def _take_slot(self) -> int:
        if not self._free_slots:
            old = 0 if self._counts is None else self._counts.shape[0]
            size = max(8, 2 * old)
            counts = torch.zeros(size, self.vocab_size, device=self.device)
            in_prompt = torch.zeros(size, self.vocab_size, dtype=torch.bool, device=self.device)
            if self._counts is not None:
                counts[:old] = self._counts
                in_prompt[:old] = self._in_prompt
            self._counts, self._in_prompt = counts, in_prompt
            self._free_slots = list(range(size - 1, old - 1, -1))
        return self._free_slots.pop()


@dataclass(frozen=True)
class _Output:
    """A request's output tokens inside its token list, read without copying the history."""

    token_ids: list[int]  # prompt + output
    num_prompt: int

    def __len__(self) -> int:
        return len(self.token_ids) - self.num_prompt

    def ends_with(self, tokens: tuple[int, ...]) -> bool:
        """Whether the output's last len(tokens) tokens are `tokens` (len(tokens) <= len)."""
        start = len(self.token_ids) - len(tokens)
        return all(self.token_ids[start + i] == t for i, t in enumerate(tokens))

    def tail(self, start: int) -> list[int]:
        """Output tokens from index `start` on."""
        return self.token_ids[self.num_prompt + start :]


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)

"""The reference engine's step loop: everything that runs on the engine thread.

A step is: (propose) → schedule → run the model → sample (or verify proposals) → append the
StepRecord → update requests → deliver. With `speculative` set, decoding requests get n-gram
proposals, or a draft model's (engines/reference/speculative/draft.py: k draft forwards for
all of them before the schedule), that the same forward pass verifies
(engines/reference/speculative/verify.py). The draft's forwards fall inside the step's
[start, end), shared like the rest of it. The record is appended before any result of that
step is delivered, so when a caller sees a request finish, every step it took part in is
already recorded (cost relies on this).

The loop owns every piece of mutable engine state (scheduler, block manager, runner, the
requests' `Live` state); callers reach it only through the Mailbox
(engines/reference/runtime/mailbox.py) and the sinks their results arrive on.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from engines.api import (
    EngineDeadError,
    EngineStats,
    FinishReason,
    StepRecord,
    StreamDelta,
)
from engines.detokenize import IncrementalDetokenizer, final_text
from engines.reference.model.config import ModelConfig
from engines.reference.model.pooling import pool
from engines.reference.runtime.groups import SampleGroups
from engines.reference.runtime.kv_cache import BlockManager
from engines.reference.runtime.live import Embedding, Live, SamplingRows, result_of
from engines.reference.runtime.mailbox import Mailbox
from engines.reference.runtime.profiling import NoProfiler
from engines.reference.runtime.runner import ChunkInput, ModelRunner
from engines.reference.runtime.scheduler import Scheduler
from engines.reference.sampling.grammar import accept, is_complete
from engines.reference.sampling.logprobs import (
    RawLogprobs,
    prompt_rows,
    raw_logprobs,
    record_logprobs,
    take_prompt_logprobs,
)
from engines.reference.sampling.processing import LogitsProcessing
from engines.reference.sampling.sampler import make_generator, sample
from engines.reference.speculative.draft import DraftRequest
from engines.reference.speculative.verify import NgramIndex, verify
from engines.requests import bad_words_token_ids
from engines.sinks import Outbox
from engines.speculative import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from engines.reference.runtime.scheduler import SchedulerOutput

    # n > 1: a group leader's logits row [1, V] for its waiting samples, and its raw logprobs
    # row when it wants logprobs.
    _ForkRows = tuple[torch.Tensor, torch.Tensor | None]

_log = logging.getLogger(__name__)


class StepLoop:
    """The engine thread's side of a ReferenceEngine (see the module docstring). Built by the
    engine once its model is loaded; `run()` is the thread's body."""

    def __init__(
        self,
        *,
        mailbox: Mailbox,
        config: ModelConfig,
        tokenizer: Any,
        scheduler: Scheduler,
        block_manager: BlockManager,
        runner: ModelRunner,
        drafter: Any,
        speculative: SpeculativeConfig | None,
        spec_limit: int,
        processing: LogitsProcessing,
        default_generator: Any,
        device: Any,
        embed_defaults: Any,
        profiler: NoProfiler,
        max_num_tokens: int,
        step_delay_s: float,
    ) -> None:
        self.mailbox = mailbox
        self.config = config
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.runner = runner
        self.drafter = drafter  # method draft: the draft model and its KV pool; else None
        self.speculative = speculative
        self.spec_limit = spec_limit  # no speculation with more running requests than this
        self.processing = processing
        self.default_generator = default_generator  # for rows without a seed
        self.device = device
        self.embed_defaults = embed_defaults
        self.profiler = profiler
        self.max_num_tokens = max_num_tokens  # an embed batch's prompt tokens at most
        self.step_delay_s = step_delay_s  # 0 outside tests
        # engines.reference.sampling.grammar.Grammars, made by the caller's first
        # response_format (compiled on its thread); None before.
        self.grammars: Any = None
        self.outbox = Outbox()  # this thread only
        self.live: dict[str, Live] = {}
        self.records: list[StepRecord] = []
        self.records_lock = threading.Lock()
        self.num_finished = 0
        self.num_steps = 0
        self.spec_proposed = 0  # speculative tokens verified since load
        self.spec_accepted = 0
        # n > 1: which sample of a group computes the prompt, which wait to fork it.
        self.groups = SampleGroups()

    def stats(self) -> EngineStats:
        """The engine's load (read from the callers' thread)."""
        scheduler, bm, mailbox = self.scheduler, self.block_manager, self.mailbox
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting)
            + len(mailbox.inbox)
            + len(mailbox.embeds)
            + self.groups.num_waiting,
            num_finished=self.num_finished,
            num_preemptions=scheduler.num_preemptions,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            num_steps=self.num_steps,
            spec_proposed_tokens=self.spec_proposed,
            spec_accepted_tokens=self.spec_accepted,
        )

    def drain_records(self) -> list[StepRecord]:
        with self.records_lock:
            records, self.records = self.records, []
        return records

    def run(self) -> None:
        """The step loop, until the engine stops (requests in flight finish "cancelled") or it
        crashes (they get EngineDeadError with the cause)."""
        try:
            while True:
                work = self.mailbox.take(bool(self.live), self.max_num_tokens)
                if work is None:
                    break
                inbox, aborts, embeds = work
                for live in inbox:
                    self._admit(live)
                for request_id in aborts:
                    self._finish(request_id, "cancelled")
                if embeds:
                    # Between generation steps, one bounded forward: generation waits one
                    # embed batch at most, and its KV pool is never touched.
                    self._embed_step(embeds)
                self.mailbox.embedding = []
                stepped = bool(self.live)
                if stepped:
                    with self.profiler.step():
                        self._step()
                self.outbox.flush()
                if stepped and self.step_delay_s:
                    time.sleep(self.step_delay_s)
        except BaseException as exc:  # the loop must never die silently: callers get the cause
            _log.exception("reference engine step loop crashed")
            self._die(f"step loop crashed: {type(exc).__name__}: {exc}")
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            # On the thread that recorded the steps; a run shorter than profile_steps still
            # leaves its trace.
            self.profiler.close()
        self._cancel_all()

    def _embed_step(self, batch: list[Embedding]) -> None:
        """Embed a batch of prompts in one dense forward; record it as a prefill-only step."""

        start = time.monotonic()
        prompts = [e.request.prompt_token_ids for e in batch]
        resolved = [self.embed_defaults.resolve(e.request.embed) for e in batch]
        hidden = self.runner.embed_hidden(prompts)  # [T, hidden]
        vectors = pool(
            hidden, [len(p) for p in prompts], [r[0] for r in resolved], [r[1] for r in resolved]
        ).tolist()
        end = time.monotonic()
        record = StepRecord(
            start=start,
            end=end,
            prefill_tokens={e.request.request_id: len(e.request.prompt_token_ids) for e in batch},
            decode_tokens={},
        )
        with self.records_lock:
            self.records.append(record)
        self.num_steps += 1
        self.mailbox.finished([e.request.request_id for e in batch])
        for e, vector in zip(batch, vectors, strict=True):
            e.metrics.first_scheduled_time = start
            e.metrics.finish_time = end
            result = result_of(e.request, [], "", "stop", e.metrics)
            result.embedding = vector
            self.num_finished += 1
            self.outbox.put(e.sink, StreamDelta([], "", True, result) if e.is_stream else result)

    def _admit(self, live: Live) -> None:

        sampling = live.request.sampling
        if self.tokenizer is not None and (live.is_stream or sampling.stop):
            live.detok = IncrementalDetokenizer(
                self.tokenizer, live.request.prompt_token_ids, sampling.stop
            )
        live.generator = make_generator(sampling.seed, self.device)
        if live.grammar is not None:
            live.matcher = self.grammars.matcher(live.grammar)
        if sampling.logprobs is not None:
            live.logprobs = []
        if sampling.prompt_logprobs is not None:
            live.prompt_logprobs = [None]
            live.sched.use_prefix_cache = False
        live.stop_ids = frozenset(sampling.stop_token_ids)
        if sampling.uses_logits_processing:
            # Tokenized here, on the thread that detokenizes: a fast tokenizer's encode resets
            # its truncation settings, which must not race a decode on another thread.
            bad_words = bad_words_token_ids(self.tokenizer, sampling.bad_words)
            self.processing.admit(
                live.request.request_id,
                sampling,
                live.request.prompt_token_ids,
                self.config.eos_token_ids,
                bad_words,
            )
        spec = self.speculative
        # Constrained rows would need their grammar matcher advanced through the proposals and
        # rolled back on rejection; logprob rows would need every emitted position's
        # alternatives; rows with logits processing or min_p would need each proposal's
        # position processed with the counts and output of the positions before it. All
        # decode one token a step instead (correct, just not faster).
        may_speculate = not (sampling.uses_logits_processing or sampling.min_p)
        if spec is not None and live.matcher is None and live.logprobs is None and may_speculate:
            if spec.method == "draft":
                live.is_drafting = True
            else:
                live.ngram = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.live[live.request.request_id] = live
        if self.groups.admit(live):
            return  # computes nothing until its group's leader has the prompt; then forks
        self.scheduler.add_request(live.sched)

    def _fork(
        self, leader: Live, waiters: list[Live], row: Any, raw_row: Any, end: float
    ) -> list[tuple[Live, int]]:
        """n > 1: the leader just sampled its first token from `row` (its logits after any
        format mask; `raw_row` the unmasked log-softmax when logprobs are wanted). Each sample
        waiting on it draws its own first token from the same row, with its own generator, and
        starts running on a fork of the leader's prompt KV: the prompt is computed once for
        the whole group. Samples that do not fit now (batch or KV pool full) queue as
        ordinary requests; prefix caching still spares them the prompt's full blocks.
        Returns the forked samples and their first tokens."""

        forked: list[Live] = []
        for member in waiters:
            if self.scheduler.can_fork(leader.sched):
                forked.append(member)
            else:
                self.scheduler.add_request(member.sched)
        if not forked:
            return []
        tokens = sample(
            row.expand(len(forked), -1),
            [m.request.sampling for m in forked],
            [m.generator for m in forked],
            self.default_generator,
        )
        if raw_row is not None:
            record_logprobs(raw_row.expand(len(forked), -1), forked, tokens)
        copies = []
        for member, token in zip(forked, tokens, strict=True):
            copy = self.scheduler.fork(leader.sched, member.sched)
            if copy is not None:
                copies.append(copy)
            member.sched.append_token(token)
            if leader.prompt_logprobs is not None:
                member.prompt_logprobs = list(leader.prompt_logprobs)
            member.metrics.first_scheduled_time = leader.metrics.first_scheduled_time
            member.metrics.first_token_time = end
        self.runner.copy_blocks(copies)
        for member in forked:
            self.block_manager.cache_full_blocks(
                member.request.request_id, member.sched.hash_ids, member.sched.num_computed_tokens
            )
        return list(zip(forked, tokens, strict=True))

    def _propose(self) -> None:
        """Give each decoding request that may speculate its proposal for this step (n-gram,
        or the draft model's for all of them at once), unless the batch is too large for
        speculation to pay."""
        spec = self.speculative
        running = self.scheduler.running
        if spec is None or len(running) > self.spec_limit:
            return
        drafting = []
        for req in running:
            live = self.live.get(req.request_id)
            if live is None or not (live.ngram or live.is_drafting) or not req.is_decoding:
                continue
            # The model's own next token comes on top: never propose past max_tokens.
            room = req.max_tokens - (req.num_tokens - req.num_prompt_tokens) - 1
            if room > 0 and live.ngram is not None:
                req.spec_token_ids = live.ngram.propose(req.token_ids, min(spec.num_tokens, room))
            elif room > 0:
                drafting.append(live)
        if drafting:
            wanted = []
            for live in drafting:
                req = live.sched
                live.draft_probs, req.spec_token_ids = None, []
                room = req.max_tokens - (req.num_tokens - req.num_prompt_tokens) - 1
                wanted.append(
                    DraftRequest(
                        req.request_id,
                        req.token_ids,
                        min(spec.num_tokens, room),
                        live.request.sampling,
                        live.generator,
                    )
                )
            proposals = self.drafter.propose(
                wanted, self.scheduler.config.max_num_tokens, self.default_generator
            )
            for request_id, proposal in proposals.items():
                live = self.live[request_id]
                live.sched.spec_token_ids = proposal.tokens
                live.draft_probs = proposal.probs

    def _step(self) -> None:
        """One step: schedule → run the model → sample (or verify proposals) → record the step
        → deliver. The StepRecord is appended before any result of the step is delivered (the
        module doc says why)."""
        phase = self.profiler.phase  # named ranges in a profile; no-ops otherwise
        start = time.monotonic()
        with phase("schedule"):
            output = self._schedule()
        if not output.chunks:
            # Cannot happen with admission checks in place; fail loudly rather than spin.
            head = self.scheduler.waiting[0].request_id
            self._finish(head, "error", error="the request could not be scheduled")
            return
        logits = self._run_model(output, start)
        rows = SamplingRows.of(output.chunks, self.live)
        with phase("sample"):
            emitted, fork_rows = self._sample(logits, rows)
        # Stop checks, streaming and results; detokenization has ranges of its own inside.
        with phase("deliver"):
            end = time.monotonic()
            self._record_step(output, rows, emitted, start, end)
            self._deliver(output, rows, emitted, fork_rows, end)

    def _schedule(self) -> SchedulerOutput:
        """This step's chunks, after giving speculating requests their proposals."""
        self._propose()
        output = self.scheduler.schedule()
        if self.drafter is not None:
            for request_id in output.preempted:  # recomputed from scratch when readmitted
                self.drafter.free(request_id)
        return output

    def _run_model(self, output: SchedulerOutput, start: float) -> torch.Tensor:
        """The step's forward pass: logits [S, V], `chunk.num_logits` rows per chunk in order.
        Prompt logprobs asked for are recorded from the rows after those, which are cut off."""
        with self.profiler.phase("build_inputs"):
            inputs = self._chunk_inputs(output, start)
        # build_inputs (tensors) and forward ranges of their own inside
        logits = self.runner.execute(inputs)  # [S + P, V]
        num_rows = sum(c.num_logits for c in output.chunks)
        return take_prompt_logprobs(logits, num_rows, inputs, self.live)

    def _chunk_inputs(self, output: SchedulerOutput, start: float) -> list[ChunkInput]:
        """What the runner needs about each scheduled chunk (and the requests' first
        scheduled time)."""

        inputs = []
        adapters = self.scheduler.adapters
        for chunk in output.chunks:
            live = self.live[chunk.request_id]
            if live.metrics.first_scheduled_time is None:
                live.metrics.first_scheduled_time = start
            inputs.append(
                ChunkInput(
                    chunk,
                    live.sched.token_ids,
                    self.block_manager.block_ids(chunk.request_id),
                    *prompt_rows(live, chunk),
                    adapter_slot=-1 if adapters is None else adapters.slot(chunk.request_id),
                    media=live.sched.media,
                )
            )
        return inputs

    def _sample(
        self, logits: torch.Tensor, rows: SamplingRows
    ) -> tuple[list[list[int]], dict[int, _ForkRows]]:
        """Each sampling chunk's emitted tokens, and the rows group leaders hand to the
        samples waiting on them (by position in `rows`). Edits `logits` in place."""
        # The model's own distribution: taken before the mask and the processing edit the
        # logits in place.
        raw = raw_logprobs(logits, rows.first_rows, rows.lives)
        # Disallowed tokens get -inf for every constrained row at once, before sampling.
        if self.grammars is not None:  # made by the first response_format: none before
            self.grammars.mask_constrained(logits, rows.first_rows, rows.lives)
        # Penalties, logit bias, min_tokens and bad words (rows that use them never carry
        # proposals); temperature, min_p, top-k and top-p follow in the sampler.
        self.processing.apply(logits, rows.first_rows, rows.lives)
        emitted = self._verify_or_sample(logits, rows)
        if raw is not None:
            raw.record(rows.lives, emitted)
        return emitted, self._fork_rows(logits, raw, rows)

    def _verify_or_sample(self, logits: torch.Tensor, rows: SamplingRows) -> list[list[int]]:
        """Each sampling chunk's emitted tokens: its accepted proposals and the model's own
        next token when the step carries proposals, else its one sampled token."""

        lives = rows.lives
        params = [lv.request.sampling for lv in lives]
        generators = [lv.generator for lv in lives]
        if rows.speculating:
            verified = verify(
                logits,
                [c.spec_token_ids for c in rows.chunks],
                params,
                generators,
                self.default_generator,
                [lv.draft_probs for lv in lives],
            )
            emitted = [v.tokens for v in verified]
        else:
            tokens = sample(logits, params, generators, self.default_generator)
            emitted = [[t] for t in tokens]
        for lv in lives:  # verified, or dropped by the scheduler: q is spent either way
            lv.draft_probs = None
        return emitted

    def _fork_rows(
        self, logits: torch.Tensor, raw: RawLogprobs | None, rows: SamplingRows
    ) -> dict[int, _ForkRows]:
        """n > 1: group leaders whose first token this is hand their logits row to the
        samples waiting on them (after the mask: they share the leader's format state), with
        the raw logprobs row when they want logprobs."""
        return {
            i: (
                logits[rows.first_rows[i]].unsqueeze(0),
                None if raw is None else raw.row(i),
            )
            for i, lv in enumerate(rows.lives)
            if self.groups.has_waiters(lv)
        }

    def _record_step(
        self,
        output: SchedulerOutput,
        rows: SamplingRows,
        emitted: list[list[int]],
        start: float,
        end: float,
    ) -> None:
        """Append the step's StepRecord (before any of its results is delivered)."""
        load = self.runner.expert_load()
        record = StepRecord(
            start=start,
            end=end,
            prefill_tokens={
                c.request_id: c.num_prefill_tokens for c in output.chunks if c.num_prefill_tokens
            },
            # A verification step computed 1 + k positions for the row: all are its cost.
            decode_tokens={c.request_id: c.num_logits for c in rows.chunks},
            spec_proposed_tokens={
                c.request_id: len(c.spec_token_ids) for c in rows.chunks if c.spec_token_ids
            },
            spec_accepted_tokens={
                c.request_id: len(tokens) - 1
                for c, tokens in zip(rows.chunks, emitted, strict=True)
                if c.spec_token_ids
            },
            expert_tokens_max=None if load is None else load.max_tokens,
            expert_tokens_mean=None if load is None else load.mean_tokens,
        )
        with self.records_lock:
            self.records.append(record)
        self.num_steps += 1
        if load is not None:  # a track of its own in a profile's trace
            self.profiler.counter(
                "expert_load", {"max_tokens": load.max_tokens, "mean_tokens": load.mean_tokens}
            )

    def _deliver(
        self,
        output: SchedulerOutput,
        rows: SamplingRows,
        emitted: list[list[int]],
        fork_rows: dict[int, _ForkRows],
        end: float,
    ) -> None:
        """Append the emitted tokens to their requests, fork the samples waiting on group
        leaders, then check each request's stop conditions and stream or finish it."""
        sampled = {c.request_id: t for c, t in zip(rows.chunks, emitted, strict=True)}
        self.scheduler.update_from_output(output, sampled)
        # Forks first: a leader that finishes on its first token frees its blocks.
        forked = self._fork_groups(rows.lives, fork_rows, end)
        for chunk, live, tokens in zip(rows.chunks, rows.lives, emitted, strict=True):
            if live.metrics.first_token_time is None:
                live.metrics.first_token_time = end
            if chunk.spec_token_ids:
                live.spec_proposed += len(chunk.spec_token_ids)
                live.spec_accepted += len(tokens) - 1
                live.spec_verifications += 1
                self.spec_proposed += len(chunk.spec_token_ids)
                self.spec_accepted += len(tokens) - 1
            self._after_tokens(live, tokens)
        for member, token in forked:
            if member.request.request_id in self.live:
                self._after_tokens(member, [token])

    def _fork_groups(
        self, lives: list[Live], fork_rows: dict[int, _ForkRows], end: float
    ) -> list[tuple[Live, int]]:
        """Fork the samples waiting on each leader in `lives` (which just sampled its first
        token); returns the forked samples and their first tokens."""
        forked: list[tuple[Live, int]] = []
        for i, live in enumerate(lives):
            # A group whose leader is past its prompt takes no more waiters.
            waiters = self.groups.first_token(live)
            if waiters:
                forked += self._fork(live, waiters, *fork_rows[i], end)
        return forked

    def _after_tokens(self, live: Live, tokens: list[int]) -> None:
        """Check the stop conditions for each new token in order (already appended to the
        request); the first that stops finishes the request and the tokens after it are
        dropped. Otherwise stream what is new."""
        num_before = live.sched.num_tokens - live.sched.num_prompt_tokens - len(tokens)
        for i, token in enumerate(tokens):
            num_output = num_before + i + 1  # outputs up to and including this token
            outcome = self._stop_outcome(live, token, num_output)
            if outcome is not None:
                live.sched.drop_last_tokens(len(tokens) - 1 - i)
                self._finish(live.request.request_id, **outcome)
                return
        if live.is_stream:
            new_tokens = live.sched.output_token_ids[live.sent_tokens :]
            stable = live.detok.stable_text_len() if live.detok else 0
            text = live.detok.text[live.sent_chars : stable] if live.detok else ""
            logprobs = None
            if live.logprobs is not None:
                logprobs = live.logprobs[live.sent_tokens : live.sent_tokens + len(new_tokens)]
            first = live.sent_tokens == 0
            live.sent_tokens += len(new_tokens)
            live.sent_chars = max(live.sent_chars, stable)
            self.outbox.put(
                live.sink,
                StreamDelta(
                    list(new_tokens),
                    text,
                    logprobs=logprobs,
                    prompt_logprobs=live.prompt_logprobs if first else None,
                ),
            )

    def _stop_outcome(self, live: Live, token: int, num_output: int) -> dict[str, Any] | None:
        """How `token` (the request's num_output-th output) ends the request, as _finish's
        keyword arguments; None when the request goes on."""
        sampling = live.request.sampling
        if live.matcher is not None:
            if not accept(live.matcher, token):
                return {"reason": "error", "error": f"token {token} breaks the response_format"}
            if is_complete(live.matcher):
                # The text is whole: the grammar accepted its end (an EOS token), which ends
                # the request even with ignore_eos, since nothing may follow.
                return {"reason": "stop", "stop_reason": None, "stop_token": True}
        # Like a stop string, a stop or EOS token ends the text without appearing in it (its
        # id stays in output_token_ids and is counted), as in vLLM and OpenAI's servers.
        if token in live.stop_ids:
            return {"reason": "stop", "stop_reason": token}
        if not sampling.ignore_eos and token in self.config.eos_token_ids:
            return {"reason": "stop", "stop_reason": None, "stop_token": True}
        stop_string = None
        if live.detok is not None:
            with self.profiler.phase("detokenize"):
                # Like EOS, stop strings cannot end the output before min_tokens (vLLM's rule).
                stop_string = live.detok.add(token, search=num_output > sampling.min_tokens)
        if stop_string is not None:
            return {"reason": "stop", "stop_reason": stop_string}
        if num_output >= live.sched.max_tokens:
            return {"reason": "length"}
        return None

    def _finish(
        self,
        request_id: str,
        reason: FinishReason,
        error: str | None = None,
        stop_reason: str | int | None = None,
        stop_token: bool = False,
    ) -> None:
        live = self.live.pop(request_id, None)
        if live is None:
            return  # already finished (an abort racing a normal finish)
        for waiter in self.groups.leave(live):
            # It led a group and left before its first token: the others run on their own.
            if waiter.request.request_id in self.live:
                self.scheduler.add_request(waiter.sched)
        sched = self.scheduler.finish_request(request_id)
        self.processing.free(request_id)
        if self.drafter is not None:
            self.drafter.free(request_id)
        output_ids = list(sched.output_token_ids) if sched is not None else []
        if live.detok is not None:
            # Complete characters only: the bytes of a character the output stopped in the
            # middle of stay out of the text (their ids are in output_token_ids).
            text = live.detok.text
        elif self.tokenizer is not None and output_ids:
            stopped_by_token = stop_token or isinstance(stop_reason, int)
            with self.profiler.phase("detokenize"):
                text = final_text(
                    self.tokenizer, output_ids[:-1] if stopped_by_token else output_ids
                )
        else:
            text = ""
        live.metrics.finish_time = time.monotonic()
        result = result_of(
            live.request,
            output_ids,
            text,
            reason,
            live.metrics,
            error=error,
            stop_reason=stop_reason,
            cached=(sched.num_cached_tokens or 0) if sched else 0,
            preemptions=sched.num_preemptions if sched else 0,
            logprobs=None if live.logprobs is None else live.logprobs[: len(output_ids)],
            prompt_logprobs=live.prompt_logprobs,
            spec_proposed=live.spec_proposed,
            spec_accepted=live.spec_accepted,
            spec_verifications=live.spec_verifications,
        )
        self.num_finished += 1
        self.mailbox.finished([request_id])
        if live.is_stream:
            rest = None if result.logprobs is None else result.logprobs[live.sent_tokens :]
            delta = StreamDelta(
                output_ids[live.sent_tokens :], text[live.sent_chars :], True, result, rest
            )
            self.outbox.put(live.sink, delta)
        else:
            self.outbox.put(live.sink, result)

    def _cancel_all(self) -> None:
        inbox, embeds = self.mailbox.left()
        for e in embeds:
            e.metrics.finish_time = time.monotonic()
            result = result_of(e.request, [], "", "cancelled", e.metrics)
            self.outbox.put(e.sink, StreamDelta([], "", True, result) if e.is_stream else result)
        for live in inbox:
            self.live[live.request.request_id] = live
            self.scheduler.add_request(live.sched)
        for request_id in list(self.live):
            self._finish(request_id, "cancelled")
        self.outbox.flush()

    def _die(self, reason: str) -> None:
        inbox, embeds = self.mailbox.die(reason)
        error = EngineDeadError(f"the reference engine stopped: {reason}")
        # After what the crashed step delivered, in the same batch.
        for live in list(self.live.values()) + list(inbox) + list(embeds):
            self.outbox.put(live.sink, error)
        self.outbox.flush()
        self.live.clear()

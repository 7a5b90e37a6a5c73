"""The synthetic engine: the engine contract without a model, at a configured speed.

A test and capacity tool. It generates random token ids (valid in the model's vocabulary) at
`tokens_per_s`, after a simulated time to first token, so the rest of the pipeline (prompt
actors, the engine actor's own work, the driver, output writing) can be driven at GPU speeds
on CPUs, and measured. It imports no torch and no Ray; the model directory gives only its
config (vocabulary, context, EOS ids) and tokenizer (for the text).

How it runs: a step loop, an asyncio task on the loop of the first caller (engine actors and
Serve replicas call from one loop). Each step admits queued requests up to max_batch_size,
gives every running request past its time to first token one token, and lasts at least
max(step_interval_ms, tokens in the step / tokens_per_s); tokens are delivered when the step
ends, as a real engine's are. Steps are recorded (StepRecord) like the reference engine's:
a request's first token step counts its prompt as prefill, later ones one decode token.

Departures from a real engine, by design: the text means nothing; logprobs are made up (well
formed: the chosen token is the most likely); response_format, and the logits processing
parameters (penalties, min_p, min_tokens, logit_bias, bad_words), are refused as row errors; there
is no KV cache, so nothing is ever cached or preempted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.api import (
    FORMAT_ERROR_PREFIX,
    EngineDeadError,
    EngineError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    RequestMetrics,
    StepRecord,
    StreamDelta,
    TokenLogprob,
)
from engines.detokenize import IncrementalDetokenizer, final_text
from engines.requests import admit, context_length, eos_token_ids, error_result, read_config
from engines.synthetic.plan import (
    RequestPlan,
    TokenTable,
    logprobs_for,
    plan_request,
    prompt_logprobs_for,
)
from engines.synthetic.settings import SETTINGS, SyntheticSettings

__all__ = ["SETTINGS", "SyntheticEngine"]

LIMITATIONS = (
    "engine.kind synthetic is a test and capacity tool: it generates random token ids at a "
    "configured rate, so its text means nothing",
    "engine.kind synthetic refuses response_format, penalties, min_p, min_tokens, logit_bias "
    "and bad_words (row errors), makes up logprobs and has no prefix cache "
    "(cached_prompt_tokens is always 0)",
)
FORMAT_REFUSAL = (
    f"{FORMAT_ERROR_PREFIX} is not supported by engine.kind synthetic: it generates random "
    "token ids and cannot constrain the text"
)


PROCESSING_REFUSAL = (
    "penalties, min_p, min_tokens, logit_bias and bad_words are not supported by engine.kind "
    "synthetic: it generates random token ids, not from logits"
)


@dataclass
class _Live:
    """A request in the engine, owned by the step loop."""

    request: GenerationRequest
    plan: RequestPlan
    metrics: RequestMetrics
    done: asyncio.Future[GenerationResult]
    detokenizer: IncrementalDetokenizer | None  # streams and stop strings; else text at the end
    changed: asyncio.Event | None = None  # set when a stream has something new
    ready_at: float = 0.0  # its first token may come in a step starting from then
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class SyntheticEngine:
    """engines.api.Engine that simulates generation; see the module docstring."""

    def __init__(self, model: str, **settings: Any) -> None:
        started = time.monotonic()
        self.settings = SyntheticSettings.of(settings)
        model_dir = Path(model)
        config = read_config(model_dir)
        vocab_size = int(config.get("vocab_size") or 0)
        if vocab_size < 1:
            raise EngineError(f"{model_dir / 'config.json'} has no vocab_size")
        self._vocab_size = vocab_size
        self._max_model_len = self.settings.max_model_len or context_length(config)
        eos = eos_token_ids(config, model_dir)
        self._eos = eos[0] if eos else None
        self._tokenizer = _load_tokenizer(model_dir)
        self._table = _token_table(self._tokenizer, vocab_size, set(eos))
        self._script = self._script_ids(self.settings.script)
        self._waiting: dict[str, _Live] = {}  # dicts keep arrival order and find by id
        self._running: dict[str, _Live] = {}
        self._records: list[StepRecord] = []
        self._num_steps = 0
        self._num_finished = 0
        self._closed = False
        self._dead: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self.info = EngineInfo(
            kind="synthetic",
            model=model,
            max_model_len=self._max_model_len,
            device="cpu",
            num_devices=1,
            dtype="none",
            has_step_records=True,
            eos_token_ids=eos,
            load_seconds=time.monotonic() - started,
            limitations=LIMITATIONS,
        )

    def _script_ids(self, script: str | None) -> list[int] | None:
        """settings.script as token ids (None without a script)."""
        if script is None:
            return None
        if self._tokenizer is None:
            raise EngineError("engine.extra.script needs the model's tokenizer.json to encode it")
        ids = self._tokenizer.encode(script, add_special_tokens=False).ids
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise EngineError(f"engine.extra.script encodes to ids outside the vocabulary: {bad}")
        return list(ids)

    # --- requests ---------------------------------------------------------------------------

    def _submit(self, request: GenerationRequest, streaming: bool) -> _Live | GenerationResult:
        """Queue `request`, or its error result when it cannot run."""
        if self._dead is not None:
            raise EngineDeadError(f"the synthetic engine has stopped: {self._dead}")
        if self._closed:
            raise EngineDeadError("the synthetic engine is shut down; load a new engine")
        arrival = time.monotonic()
        admission = admit(request, vocab_size=self._vocab_size, max_model_len=self._max_model_len)
        if not admission.ok:
            return error_result(request, admission.error or "", arrival)
        rid = request.request_id
        if rid in self._waiting or rid in self._running:
            return error_result(request, f"request_id {rid!r} is already in flight", arrival)
        if request.sampling.response_format is not None:
            return error_result(request, FORMAT_REFUSAL, arrival)
        if request.sampling.uses_logits_processing or request.sampling.min_p:
            return error_result(request, PROCESSING_REFUSAL, arrival)
        loop = self._start_loop()
        stop = request.sampling.stop
        live = _Live(
            request=request,
            plan=plan_request(
                request,
                admission.max_tokens,
                self.settings,
                None if self._script is None else len(self._script) + (self._eos is not None),
            ),
            metrics=RequestMetrics(arrival_time=arrival),
            done=loop.create_future(),
            detokenizer=(
                IncrementalDetokenizer(self._tokenizer, [], stop)
                if self._tokenizer is not None and (streaming or stop)
                else None
            ),
            changed=asyncio.Event() if streaming else None,
            logprobs=[] if request.sampling.logprobs is not None else None,
        )
        self._waiting[rid] = live
        assert self._wake is not None
        self._wake.set()
        return live

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        live = self._submit(request, streaming=False)
        if isinstance(live, GenerationResult):
            return live
        try:
            return await asyncio.shield(live.done)
        except asyncio.CancelledError:
            self.abort(request.request_id)  # the caller is gone: free its slot
            raise

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        live = self._submit(request, streaming=True)
        if isinstance(live, GenerationResult):
            yield StreamDelta(token_ids=[], text="", finished=True, result=live)
            return
        assert live.changed is not None
        sent_ids = sent_text = 0
        prompt_logprobs = self._prompt_logprobs(request)
        try:
            while True:
                if not live.done.done():
                    await live.changed.wait()
                    live.changed.clear()
                finished = live.done.done()
                # A stop string could still cut text not yet final: hold that back.
                text = self._text_so_far(live)
                stable = len(text) if finished else self._stable_len(live, text)
                ids = live.token_ids[sent_ids:]
                if ids or stable > sent_text:
                    yield StreamDelta(
                        token_ids=ids,
                        text=text[sent_text:stable],
                        logprobs=None if live.logprobs is None else live.logprobs[sent_ids:],
                        prompt_logprobs=prompt_logprobs,
                    )
                    prompt_logprobs = None
                    # What was sent, not what there is now: tokens the step loop added while
                    # this delta waited for its consumer go out with the next one.
                    sent_ids, sent_text = sent_ids + len(ids), max(sent_text, stable)
                if finished:
                    yield StreamDelta(
                        token_ids=[], text="", finished=True, result=live.done.result()
                    )
                    return
        finally:
            if not live.done.done():
                self.abort(request.request_id)  # closed early: the client is gone

    def abort(self, request_id: str) -> None:
        live = self._waiting.pop(request_id, None) or self._running.pop(request_id, None)
        if live is not None:
            self._finish(live, "cancelled")

    def drain_step_records(self) -> list[StepRecord]:
        records, self._records = self._records, []
        return records

    def stats(self) -> EngineStats:
        """The engine's load; raises EngineDeadError once its step loop has ended on its own
        (died, or cancelled from outside), not only once a request trips over it."""
        if self._dead is not None:
            raise EngineDeadError(f"the synthetic engine has stopped: {self._dead}")
        if not self._closed and self._task is not None and self._task.done():
            raise EngineDeadError("the synthetic engine's step loop has ended")
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_finished=self._num_finished,
            num_preemptions=0,
            kv_blocks_total=0,
            kv_blocks_used=0,
            num_steps=self._num_steps,
        )

    def shutdown(self) -> None:
        """Stop the step loop; requests in flight finish "cancelled", later ones raise
        EngineDeadError. Idempotent, and callable from any thread."""
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._cancel_all()
        else:
            loop.call_soon_threadsafe(self._cancel_all)

    # --- step loop --------------------------------------------------------------------------

    def _start_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="synthetic-engine")
        elif self._loop is not loop:
            raise EngineError("the synthetic engine runs on the event loop that first used it")
        return loop

    async def _run(self) -> None:
        assert self._wake is not None
        interval = self.settings.step_interval_ms / 1000.0
        try:
            while not self._closed:
                if not self._waiting and not self._running:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                start = time.monotonic()
                self._schedule(start)
                ready = [live for live in self._running.values() if live.ready_at <= start]
                if not ready:  # every running request is still in its time to first token
                    first = min(live.ready_at for live in self._running.values())
                    await self._sleep_or_wake(first - start)
                    continue
                duration = max(interval, len(ready) / self.settings.tokens_per_s)
                await asyncio.sleep(max(0.0, start + duration - time.monotonic()))
                self._step(start, ready)
        except asyncio.CancelledError:
            if not self._closed:  # cancelled from outside, not by shutdown
                self._die("its step loop was cancelled")
            raise
        except Exception as exc:  # the loop itself failed: no request can be served any more
            self._die(f"{type(exc).__name__}: {exc}")

    async def _sleep_or_wake(self, seconds: float) -> None:
        """Sleep up to `seconds`, waking early for new requests (they may be ready sooner)."""
        assert self._wake is not None
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), max(0.0, seconds))

    def _schedule(self, now: float) -> None:
        free = self.settings.max_batch_size - len(self._running)
        while free > 0 and self._waiting:
            rid, live = next(iter(self._waiting.items()))
            del self._waiting[rid]
            live.metrics.first_scheduled_time = now
            live.ready_at = now + live.plan.ttft_s
            self._running[rid] = live
            free -= 1

    def _step(self, start: float, ready: list[_Live]) -> None:
        """Give each request of `ready` still running its next token; record the step."""
        prefill: dict[str, int] = {}
        decode: dict[str, int] = {}
        now = time.monotonic()
        for live in ready:
            rid = live.request.request_id
            if self._running.get(rid) is not live:
                continue  # aborted while the step ran
            if not live.token_ids:
                prefill[rid] = len(live.request.prompt_token_ids)
                live.metrics.first_token_time = now
            else:
                decode[rid] = 1
            if live.plan.ending == "error":
                del self._running[rid]
                self._fail(live)
                continue
            self._advance(live)
        if prefill or decode:
            self._records.append(StepRecord(start, now, prefill, decode))
            self._num_steps += 1

    def _advance(self, live: _Live) -> None:
        """Append one token to `live`; finish it when that ends it."""
        plan, sampling = live.plan, live.request.sampling
        last = len(live.token_ids) + 1 == plan.num_tokens
        if last and plan.ending == "stop" and self._eos is not None:
            token = self._eos
        elif self._script is not None:
            token = self._script[len(live.token_ids) % len(self._script)]  # ignore_eos: again
        else:
            token = self._table.draw(plan.rng)
        live.token_ids.append(token)
        if live.logprobs is not None:
            live.logprobs.append(logprobs_for(token, sampling.logprobs or 0, self._table))
        stop_string = live.detokenizer.add(token) if live.detokenizer is not None else None
        rid = live.request.request_id
        if stop_string is not None:
            del self._running[rid]
            self._finish(live, "stop", stop_string)
        elif token in sampling.stop_token_ids:
            del self._running[rid]
            self._finish(live, "stop", token)
        elif last:
            del self._running[rid]
            self._finish(live, "length" if plan.ending == "length" else "stop")
        elif live.changed is not None:
            live.changed.set()

    # --- finishing --------------------------------------------------------------------------

    def _finish(
        self, live: _Live, reason: str, stop_reason: str | int | None = None
    ) -> GenerationResult:
        request = live.request
        live.metrics.finish_time = time.monotonic()
        result = GenerationResult(
            request_id=request.request_id,
            output_token_ids=live.token_ids,
            text=self._text_so_far(live),
            finish_reason=reason,  # type: ignore[arg-type]
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=len(live.token_ids),
            stop_reason=stop_reason,
            metrics=live.metrics,
            logprobs=live.logprobs,
            prompt_logprobs=self._prompt_logprobs(request),
        )
        self._resolve(live, result)
        return result

    def _fail(self, live: _Live) -> None:
        rate = self.settings.error_fraction
        message = (
            f"synthetic row error: the synthetic engine fails this fraction of rows on purpose "
            f"(error_fraction {rate})"
        )
        live.metrics.finish_time = time.monotonic()
        result = GenerationResult.without_output(live.request, "error", message, live.metrics)
        self._resolve(live, result)

    def _resolve(self, live: _Live, result: GenerationResult) -> None:
        if not live.done.done():
            live.done.set_result(result)
            self._num_finished += 1
        if live.changed is not None:
            live.changed.set()

    def _cancel_all(self) -> None:
        for rid in list(self._waiting) + list(self._running):
            self.abort(rid)
        if self._task is not None:
            self._task.cancel()

    def _die(self, why: str) -> None:
        self._dead = why
        for live in list(self._waiting.values()) + list(self._running.values()):
            if not live.done.done():
                live.done.set_exception(EngineDeadError(f"the synthetic engine has stopped: {why}"))
            if live.changed is not None:
                live.changed.set()
        self._waiting.clear()
        self._running.clear()

    # --- text -------------------------------------------------------------------------------

    def _text_so_far(self, live: _Live) -> str:
        if live.detokenizer is not None:
            return live.detokenizer.text
        if self._tokenizer is None or not live.token_ids:
            return ""
        return final_text(self._tokenizer, live.token_ids)  # once, when the request finishes

    @staticmethod
    def _stable_len(live: _Live, text: str) -> int:
        if live.detokenizer is None:
            return len(text)
        return min(len(text), live.detokenizer.stable_text_len())

    def _prompt_logprobs(self, request: GenerationRequest) -> list[TokenLogprob | None] | None:
        k = request.sampling.prompt_logprobs
        if k is None:
            return None
        return prompt_logprobs_for(request.prompt_token_ids, k, self._table)


def _load_tokenizer(model_dir: Path) -> Any:
    """The model's fast tokenizer (the `tokenizers` library only: no transformers, no torch),
    or None when the directory has no tokenizer.json (text stays empty)."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own exception type for a bad file
        raise EngineError(f"{path}: cannot load the tokenizer ({exc})") from exc


def _token_table(tokenizer: Any, vocab_size: int, eos: set[int]) -> TokenTable:
    """Ids the synthetic model may emit: in the vocabulary, not EOS (ends are planned) and,
    with a tokenizer, decoding to whole characters on their own."""
    if tokenizer is None:
        return TokenTable([i for i in range(vocab_size) if i not in eos])
    ids = []
    for i in range(min(vocab_size, tokenizer.get_vocab_size())):
        if i in eos:
            continue
        text = tokenizer.decode([i], skip_special_tokens=True)
        if text.strip() and "\ufffd" not in text:
            ids.append(i)
    return TokenTable(ids)

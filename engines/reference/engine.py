"""ReferenceEngine: the `engines.api.Engine` contract over the reference PyTorch model.

Threads: callers live on an asyncio loop; the step loop runs on its own thread, which also
loads the model (one OpenMP pool per process: see _engine_thread), and owns every piece of
mutable engine state (scheduler, block manager, runner). The two sides meet in an
inbox (new requests and aborts, under a condition variable) and in per-request sinks that the
step loop resolves with `loop.call_soon_threadsafe`.

A step is: (propose) → schedule → run the model → sample (or verify proposals) → append the
StepRecord → update requests → deliver. With `speculative` set, decoding requests get n-gram
proposals, or a draft model's (engines/reference/speculative/draft.py: k draft forwards for all of them
before the schedule), that the same forward pass verifies (engines/reference/speculative/verify.py).
The draft's forwards fall inside the step's [start, end), shared like the rest of it. The record
is appended before any result of that step is delivered, so when a caller sees a request
finish, every step it took part in is already recorded (cost relies on this).

Shutdown: the step loop stops, requests still in flight finish with finish_reason "cancelled"
(they are results, not exceptions); requests submitted afterwards raise EngineDeadError. If
the step loop itself crashes, in-flight requests raise EngineDeadError with the cause.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines import faults
from engines.adapter import declared_settings
from engines.api import (
    EngineDeadError,
    EngineError,
    EngineInfo,
    EngineStats,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RequestMetrics,
    StepRecord,
    StreamDelta,
    TokenLogprob,
)
from engines.detokenize import IncrementalDetokenizer, final_text
from engines.reference.model.config import ModelConfig, load_model_config
from engines.reference.model.linear import fallback_note
from engines.reference.model.pooling import embed_defaults, pool
from engines.reference.model.weights import load_model
from engines.reference.runtime.groups import SampleGroups
from engines.reference.runtime.kv_cache import BlockManager
from engines.reference.runtime.profiling import NO_PROFILER, NoProfiler, StepProfiler
from engines.reference.runtime.resources import (
    load_tokenizer,
    pool_blocks,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
)
from engines.reference.runtime.runner import ChunkInput, ModelRunner, kv_bytes_per_token
from engines.reference.runtime.scheduler import Request, Scheduler, SchedulerConfig
from engines.reference.sampling.grammar import GrammarError, Grammars, accept, is_complete
from engines.reference.sampling.grammar import limitations as grammar_limitations
from engines.reference.sampling.logprobs import (
    RawLogprobs,
    prompt_rows,
    raw_logprobs,
    record_logprobs,
    take_prompt_logprobs,
)
from engines.reference.sampling.processing import LogitsProcessing
from engines.reference.sampling.sampler import make_generator, sample
from engines.reference.speculative.draft import Drafter, DraftRequest, draft_pool_blocks
from engines.reference.speculative.verify import NgramIndex, verify
from engines.requests import admit, bad_words_token_ids, embed_error
from engines.sinks import Outbox, Sink, await_result, deliver, stream_items
from engines.speculative import resolve

if TYPE_CHECKING:
    import torch

    from engines.reference.runtime.runner import ChunkInput
    from engines.reference.runtime.scheduler import ScheduledChunk, SchedulerOutput

    # n > 1: a group leader's logits row [1, V] for its waiting samples, and its raw logprobs
    # row when it wants logprobs.
    _ForkRows = tuple[torch.Tensor, torch.Tensor | None]

_log = logging.getLogger(__name__)

# Speculation is off in steps with more running requests than this, unless the job says
# otherwise. Measured on 2 CPU cores (tests/benchmarks/bench_speculative.py, numbers in
# docs/speculative-decoding.md): up to 8 requests speculation won 1.25-1.5x on the copy-heavy
# workload and still 1.1-1.2x at 16-64, where acceptance is ~0.65 by construction. With
# output that copies less the k extra positions per request are waste where the step is
# already compute-bound (`--size small`, which hardly repeats, lost ~20% at 64, measured
# before verification chunks attended in decode groups).
DEFAULT_DISABLE_ABOVE_BATCH_SIZE = 8


@dataclass
class _Live:
    """Step-loop state of one admitted request."""

    request: GenerationRequest
    sched: Any  # scheduler.Request
    sink: Sink
    metrics: RequestMetrics
    is_stream: bool
    detok: Any = None  # IncrementalDetokenizer when text is needed as it grows
    generator: Any = None  # torch.Generator for seeded sampling
    grammar: Any = None  # compiled grammar of the request's response_format
    matcher: Any = None  # its xgrammar matcher, advanced token by token
    logprobs: list[TokenLogprob] | None = None  # one per output token, when requested
    # One per prompt token computed so far (None first), when prompt logprobs are requested.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    sent_tokens: int = 0  # output tokens already streamed
    sent_chars: int = 0  # text characters already streamed
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    ngram: Any = None  # speculative.NgramIndex when the request may speculate
    is_drafting: bool = False  # may speculate with draft-model proposals (method draft)
    draft_probs: Any = None  # torch.Tensor [k, V]: q of its pending draft proposals
    spec_proposed: int = 0  # proposed tokens verified so far
    spec_accepted: int = 0  # of them, accepted
    spec_verifications: int = 0  # steps that verified proposals for it


@dataclass(slots=True)
class _SamplingRows:
    """A step's sampling chunks in logits-row order, their requests, and the row where each
    chunk's logits start (1 + k rows for a chunk carrying k proposals, else one)."""

    chunks: list[ScheduledChunk]
    lives: list[_Live]
    first_rows: list[int]
    speculating: bool  # some chunk carries proposals: the step verifies them

    @classmethod
    def of(cls, chunks: list[ScheduledChunk], live: dict[str, _Live]) -> _SamplingRows:
        sampling = [c for c in chunks if c.is_sampling]
        first_rows: list[int] = []
        next_row = 0
        for c in sampling:
            first_rows.append(next_row)
            next_row += c.num_logits
        speculating = any(c.spec_token_ids for c in sampling)
        return cls(sampling, [live[c.request_id] for c in sampling], first_rows, speculating)


@dataclass
class _Embedding:
    """An embed request waiting for its dense forward (never enters the scheduler)."""

    request: GenerationRequest
    sink: Sink
    metrics: RequestMetrics
    is_stream: bool


def take_embed_batch(queue: deque[Any], max_num_tokens: int) -> list[Any]:
    """Embed requests for one forward, first come first: as many as fit `max_num_tokens`
    prompt tokens together, and always at least one (a longer prompt runs alone)."""
    batch: list[Any] = []
    num_tokens = 0
    while queue:
        n = len(queue[0].request.prompt_token_ids)
        if batch and num_tokens + n > max_num_tokens:
            break
        batch.append(queue.popleft())
        num_tokens += n
    return batch


class ReferenceEngine:
    """PyTorch engine with a paged KV cache, prefix caching, chunked prefill and in-flight
    batching (docs/engine.md has the details).

    Args:
        model: local Hugging Face directory (config.json, safetensors, tokenizer).
        max_num_tokens: tokens computed per step, all requests together.
        max_batch_size: requests holding KV blocks at once.
        kv_cache_tokens: KV pool size in tokens; wins over kv_cache_memory_gb.
        kv_cache_memory_gb: KV pool size in GiB. Neither: max_batch_size x
            min(max_model_len, 2048) tokens, at most 1 GiB on CPU / half the free GPU memory.
        block_size: tokens per KV block (allocation and prefix-reuse unit).
        enable_prefix_caching: reuse KV of full blocks whose whole prefix matches.
        enable_chunked_prefill: let prompts span steps; off refuses prompts > max_num_tokens.
        dtype: auto | float32 | bfloat16 | float16 (auto: float32 on CPU, bf16 on CUDA).
        device: auto | cpu | cuda | cuda:N.
        max_model_len: prompt + output tokens per request (default: the model's).
        num_threads: torch threads for the step loop (default: all cores).
        profile_dir: write a torch.profiler trace (Chrome / Perfetto JSON) of the first
            `profile_steps` steps here, one named range per phase; None: no profiling.
        profile_steps: steps the trace records.
        speculative: engine.speculative as a dict ({method: ngram, num_tokens,
            prompt_lookup_min, prompt_lookup_max, disable_above_batch_size} or {method:
            draft, model: <draft model dir>, num_tokens, disable_above_batch_size}); None:
            off. A draft model must share the model's tokenizer and vocab size; it is loaded
            with the same dtype and device, and gets its own KV pool (the model's pool's
            tokens plus room for proposals). Requests with response_format or logprobs never
            speculate (see docs/speculative-decoding.md).
    """

    def __init__(
        self,
        model: str,
        *,
        max_num_tokens: int = 2048,
        max_batch_size: int = 64,
        kv_cache_tokens: int | None = None,
        kv_cache_memory_gb: float | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        num_threads: int | None = None,
        profile_dir: str | None = None,
        profile_steps: int = 20,
        speculative: Any = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise TypeError(
                f"ReferenceEngine got unknown setting(s) {', '.join(sorted(unknown))}; "
                f"accepted: {', '.join(SETTINGS)}"
            )
        started = time.monotonic()
        for name, value in (
            ("max_num_tokens", max_num_tokens),
            ("max_batch_size", max_batch_size),
            ("block_size", block_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise EngineError(f"{name} must be an integer >= 1, got {value!r}")

        self._speculative = resolve("reference", speculative)
        self._spec_limit = DEFAULT_DISABLE_ABOVE_BATCH_SIZE
        if self._speculative is not None and self._speculative.disable_above_batch_size is not None:
            self._spec_limit = self._speculative.disable_above_batch_size
        self._num_threads = num_threads or os.cpu_count() or 1
        self._profiler: NoProfiler = NO_PROFILER  # replaced by _load when profiling
        self.drafter: Any = None  # method draft: set by _load
        self._grammars: Any = None  # engines.reference.sampling.grammar.Grammars, on first use
        self._grammars_lock = threading.Lock()
        self._processing: Any = None  # processing.LogitsProcessing, made by _load
        self._test_step_delay_s = faults.step_delay_s()  # 0 outside tests
        self._cv = threading.Condition()
        self._inbox: deque[_Live] = deque()
        self._outbox = Outbox()  # step-loop thread only
        self._embeds: deque[_Embedding] = deque()  # embed requests (under _cv)
        self._embedding: list[_Embedding] = []  # the embed batch being run (step loop)
        self._max_num_tokens = max_num_tokens
        self._aborts: deque[str] = deque()
        self._live: dict[str, _Live] = {}  # step-loop owned
        self._in_flight: set[str] = set()  # ids submitted and not yet finished (under _cv)
        self._records: list[StepRecord] = []
        self._records_lock = threading.Lock()
        self._stopping = False
        self._dead: str | None = None  # why the engine stopped
        self._num_finished = 0
        self._num_steps = 0
        self._spec_proposed = 0  # speculative tokens verified since load
        self._spec_accepted = 0
        # n > 1: which sample of a group computes the prompt, which wait to fork it.
        self._groups = SampleGroups()

        # The model is loaded on the engine thread, which then runs the step loop: see
        # _engine_thread. A load error is raised here, in the caller's thread.
        loaded: Future[None] = Future()
        load = functools.partial(
            self._load,
            Path(model),
            max_num_tokens=max_num_tokens,
            max_batch_size=max_batch_size,
            kv_cache_tokens=kv_cache_tokens,
            kv_cache_memory_gb=kv_cache_memory_gb,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            profile_dir=profile_dir,
            profile_steps=profile_steps,
        )
        self._thread = threading.Thread(
            target=self._engine_thread, args=(load, loaded), name="reference-engine", daemon=True
        )
        self._thread.start()
        loaded.result()
        self.info = EngineInfo(
            kind="reference",
            model=str(model),
            max_model_len=self.max_model_len,
            device=str(self._torch_device),
            num_devices=1,
            dtype=str(self._torch_dtype).removeprefix("torch."),
            has_step_records=True,
            eos_token_ids=self.config.eos_token_ids,
            load_seconds=time.monotonic() - started,
            limitations=self.limitations + grammar_limitations(),
            embedding_size=self.config.hidden_size,
        )

    def _load(
        self,
        model_dir: Path,
        *,
        max_num_tokens: int,
        max_batch_size: int,
        kv_cache_tokens: int | None,
        kv_cache_memory_gb: float | None,
        block_size: int,
        enable_prefix_caching: bool,
        enable_chunked_prefill: bool,
        dtype: str,
        device: str,
        max_model_len: int | None,
        profile_dir: str | None,
        profile_steps: int,
    ) -> None:
        """Model, tokenizer, KV pool, scheduler, runner, profiler and drafter (on the engine
        thread)."""
        import torch

        self._torch_device = resolve_device(device)
        self._torch_dtype = getattr(torch, resolve_dtype(dtype, self._torch_device))
        self.config: ModelConfig = load_model_config(model_dir)
        self.max_model_len = resolve_max_model_len(self.config, max_model_len)
        self.model = load_model(model_dir, self.config, self._torch_dtype, self._torch_device)
        # Where this CPU's oneDNN refuses the dtype, nn.Linear ran instead (draft model too).
        note = fallback_note(self._torch_device, self._torch_dtype)
        self.limitations: tuple[str, ...] = (note,) if note else ()
        self.tokenizer = load_tokenizer(model_dir)

        self._embed_defaults = embed_defaults(model_dir)

        bytes_per_token = kv_bytes_per_token(self.config, self._torch_dtype)
        num_blocks = pool_blocks(
            kv_cache_tokens,
            kv_cache_memory_gb,
            block_size,
            bytes_per_token,
            max_batch_size,
            self.max_model_len,
            self._torch_device,
        )
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_tokens, max_batch_size, enable_chunked_prefill),
            self.block_manager,
        )
        self.runner = ModelRunner(
            self.model,
            self.config,
            num_blocks,
            block_size,
            self.max_model_len,
            self._torch_dtype,
            self._torch_device,
        )
        if profile_dir is not None:
            try:
                self._profiler = StepProfiler(profile_dir, profile_steps, self._torch_device)
            except (ValueError, OSError) as exc:
                raise EngineError(f"profile_dir={profile_dir!r}: {exc}") from exc
        self.runner.profiler = self._profiler
        # Method draft: the draft model with its own KV pool (engines/reference/speculative/draft.py).
        if self._speculative is not None and self._speculative.method == "draft":
            k = self._speculative.num_tokens
            self.drafter = Drafter(
                self._speculative.model,
                str(model_dir),
                self.config,
                self.tokenizer,
                num_blocks=draft_pool_blocks(
                    num_blocks, block_size, k, min(max_batch_size, self._spec_limit)
                ),
                block_size=block_size,
                enable_prefix_caching=enable_prefix_caching,
                max_len=self.max_model_len + k,
                dtype=self._torch_dtype,
                device=self._torch_device,
            )

        self._processing = LogitsProcessing(self.config.vocab_size, self._torch_device)
        self._default_generator = torch.Generator(device=self._torch_device)
        self._default_generator.manual_seed(int.from_bytes(os.urandom(4), "little"))

    # ---- caller side (asyncio) ---------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await await_result(
            lambda sink: self._submit(request, sink, is_stream=False),
            lambda: self.abort(request.request_id),
        )

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        return stream_items(
            lambda sink: self._submit(request, sink, is_stream=True),
            lambda: self.abort(request.request_id),
        )

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def drain_step_records(self) -> list[StepRecord]:
        with self._records_lock:
            records, self._records = self._records, []
        return records

    def stats(self) -> EngineStats:
        """The engine's load; raises EngineDeadError once the step loop has died (its last
        figures would read as a live engine to whoever checks health with them)."""
        if self._dead is not None:
            raise EngineDeadError(f"the reference engine has stopped: {self._dead}")
        if not self._thread.is_alive() and not self._stopping:
            raise EngineDeadError("the reference engine's step loop is gone")
        scheduler, bm = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting)
            + len(self._inbox)
            + len(self._embeds)
            + self._groups.num_waiting,
            num_finished=self._num_finished,
            num_preemptions=scheduler.num_preemptions,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            num_steps=self._num_steps,
            spec_proposed_tokens=self._spec_proposed,
            spec_accepted_tokens=self._spec_accepted,
        )

    @property
    def profile_trace(self) -> Path | None:
        """The trace file of `profile_dir` once written (after profile_steps steps, or at
        shutdown if the engine stopped before); None when not profiling."""
        return self._profiler.trace_path

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        # Drop the big tensors so the memory goes back even if the engine object lingers.
        self.runner.kv_caches = []
        self.runner.model = None
        self.model = None
        if self.drafter is not None:
            self.drafter.close()

    def _submit(self, request: GenerationRequest, sink: Sink, is_stream: bool) -> None:

        metrics = RequestMetrics(arrival_time=time.monotonic())
        if request.embed is not None:
            self._submit_embed(request, sink, is_stream, metrics)
            return
        error, max_tokens = self._check(request)
        grammar = None
        if error is None and request.sampling.response_format is not None:
            # Compiled on the caller's thread: a bad format is this row's error at once, and
            # the step loop never waits on a compile.
            grammar, error = self._compile(request.sampling.response_format)
        with self._cv:
            if not self._accept(request, sink, is_stream, metrics, error):
                return
            live = _Live(
                request=request,
                sched=Request(request.request_id, list(request.prompt_token_ids), max_tokens),
                sink=sink,
                metrics=metrics,
                is_stream=is_stream,
                grammar=grammar,
            )
            self._inbox.append(live)
            self._cv.notify()

    def _submit_embed(
        self, request: GenerationRequest, sink: Sink, is_stream: bool, metrics: RequestMetrics
    ) -> None:
        """Queue an embed request for the step loop, or answer its row error now."""
        error = embed_error(request, self.config.vocab_size, self.max_model_len)
        with self._cv:
            if self._accept(request, sink, is_stream, metrics, error):
                self._embeds.append(_Embedding(request, sink, metrics, is_stream))
                self._cv.notify()

    def _accept(
        self,
        request: GenerationRequest,
        sink: Sink,
        is_stream: bool,
        metrics: RequestMetrics,
        error: str | None,
    ) -> bool:
        """Under the lock: refuse if the engine stopped (EngineDeadError); answer a row error
        (the request's own, or a request id already in flight) at once; else mark the id in
        flight and return True for the caller to queue it."""
        if self._stopping or self._dead is not None:
            raise EngineDeadError(
                f"the reference engine has stopped ({self._dead or 'shut down'}); "
                "load a new engine to serve more requests"
            )
        if error is None and request.request_id in self._in_flight:
            error = f"request_id {request.request_id!r} is already in flight"
        if error is not None:
            metrics.finish_time = metrics.arrival_time
            result = _result(request, [], "", "error", metrics, error=error)
            deliver([(sink, StreamDelta([], "", True, result) if is_stream else result)])
            return False
        self._in_flight.add(request.request_id)
        return True

    def _check(self, request: GenerationRequest) -> tuple[str | None, int]:
        """A per-request problem (as an error text) and the request's allowed output tokens."""
        admission = admit(
            request, vocab_size=self.config.vocab_size, max_model_len=self.max_model_len
        )
        if not admission.ok:
            return admission.error, 0
        if request.sampling.stop and self.tokenizer is None:
            return "stop strings need a tokenizer, and the model directory has none", 0
        if request.sampling.bad_words and self.tokenizer is None:
            return "bad_words need a tokenizer, and the model directory has none", 0
        max_tokens = admission.max_tokens
        return self.scheduler.admission_error(len(request.prompt_token_ids), max_tokens), max_tokens

    def _compile(self, fmt: Any) -> tuple[Any, str | None]:
        """(compiled grammar, None) or (None, why the format cannot be used)."""

        if self.tokenizer is None:
            return None, "response_format needs a tokenizer, and the model directory has none"
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(
                    self.tokenizer, self.config.vocab_size, self.config.eos_token_ids
                )
        try:
            return self._grammars.compile(fmt), None
        except GrammarError as exc:
            return None, str(exc)

    # ---- step loop (engine thread) -------------------------------------------------------
    def _engine_thread(self, load: Callable[[], None], loaded: Future[None]) -> None:
        """Load, then run the step loop, on this one thread.

        Why one thread for both: every thread that runs an OpenMP parallel region keeps a pool
        of OpenMP threads, and once a process's pools hold more threads than it has cores,
        libgomp stops spinning at its barriers and sleeps on a futex at each one. The step loop
        would then pay a sleep and a wake-up at every GEMM and kernel, 40+ times a step: its
        decode linears ran 20-40% slower on a loop thread when the model had been loaded on
        another. Loaded here, the process has one pool. (A caller thread that runs parallel
        torch ops of its own brings the slowdown back; nothing here can prevent that.)"""
        import torch

        torch.set_num_threads(self._num_threads)
        try:
            load()
        except BaseException as exc:  # the constructor raises it
            loaded.set_exception(exc)
            return
        loaded.set_result(None)
        self._run()

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (
                        self._stopping or self._inbox or self._aborts or self._live or self._embeds
                    ):
                        self._cv.wait()
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, deque()
                    aborts, self._aborts = self._aborts, deque()
                    embeds = take_embed_batch(self._embeds, self._max_num_tokens)
                    # Held where _die finds it: a crash mid-batch fails these callers too.
                    self._embedding = embeds
                for live in inbox:
                    self._admit(live)
                for request_id in aborts:
                    self._finish(request_id, "cancelled")
                if embeds:
                    # Between generation steps, one bounded forward: generation waits one
                    # embed batch at most, and its KV pool is never touched.
                    self._embed_step(embeds)
                self._embedding = []
                stepped = bool(self._live)
                if stepped:
                    with self._profiler.step():
                        self._step()
                self._outbox.flush()
                if stepped and self._test_step_delay_s:
                    time.sleep(self._test_step_delay_s)
        except BaseException as exc:  # the loop must never die silently: callers get the cause
            _log.exception("reference engine step loop crashed")
            self._die(f"step loop crashed: {type(exc).__name__}: {exc}")
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            # On the thread that recorded the steps; a run shorter than profile_steps still
            # leaves its trace.
            self._profiler.close()
        self._cancel_all()

    def _embed_step(self, batch: list[_Embedding]) -> None:
        """Embed a batch of prompts in one dense forward; record it as a prefill-only step."""

        start = time.monotonic()
        prompts = [e.request.prompt_token_ids for e in batch]
        resolved = [self._embed_defaults.resolve(e.request.embed) for e in batch]
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
        with self._records_lock:
            self._records.append(record)
        self._num_steps += 1
        with self._cv:
            for e in batch:
                self._in_flight.discard(e.request.request_id)
        for e, vector in zip(batch, vectors, strict=True):
            e.metrics.first_scheduled_time = start
            e.metrics.finish_time = end
            result = _result(e.request, [], "", "stop", e.metrics)
            result.embedding = vector
            self._num_finished += 1
            self._outbox.put(e.sink, StreamDelta([], "", True, result) if e.is_stream else result)

    def _admit(self, live: _Live) -> None:

        sampling = live.request.sampling
        if self.tokenizer is not None and (live.is_stream or sampling.stop):
            live.detok = IncrementalDetokenizer(
                self.tokenizer, live.request.prompt_token_ids, sampling.stop
            )
        live.generator = make_generator(sampling.seed, self._torch_device)
        if live.grammar is not None:
            live.matcher = self._grammars.matcher(live.grammar)
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
            self._processing.admit(
                live.request.request_id,
                sampling,
                live.request.prompt_token_ids,
                self.config.eos_token_ids,
                bad_words,
            )
        spec = self._speculative
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
        self._live[live.request.request_id] = live
        if self._groups.admit(live):
            return  # computes nothing until its group's leader has the prompt; then forks
        self.scheduler.add_request(live.sched)

    def _fork(
        self, leader: _Live, waiters: list[_Live], row: Any, raw_row: Any, end: float
    ) -> list[tuple[_Live, int]]:
        """n > 1: the leader just sampled its first token from `row` (its logits after any
        format mask; `raw_row` the unmasked log-softmax when logprobs are wanted). Each sample
        waiting on it draws its own first token from the same row, with its own generator, and
        starts running on a fork of the leader's prompt KV: the prompt is computed once for
        the whole group. Samples that do not fit now (batch or KV pool full) queue as
        ordinary requests; prefix caching still spares them the prompt's full blocks.
        Returns the forked samples and their first tokens."""

        forked: list[_Live] = []
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
            self._default_generator,
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
                member.request.request_id, member.sched.token_ids, member.sched.num_computed_tokens
            )
        return list(zip(forked, tokens, strict=True))

    def _propose(self) -> None:
        """Give each decoding request that may speculate its proposal for this step (n-gram,
        or the draft model's for all of them at once), unless the batch is too large for
        speculation to pay."""
        spec = self._speculative
        running = self.scheduler.running
        if spec is None or len(running) > self._spec_limit:
            return
        drafting = []
        for req in running:
            live = self._live.get(req.request_id)
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
                wanted, self.scheduler.config.max_num_tokens, self._default_generator
            )
            for request_id, proposal in proposals.items():
                live = self._live[request_id]
                live.sched.spec_token_ids = proposal.tokens
                live.draft_probs = proposal.probs

    def _step(self) -> None:
        """One step: schedule → run the model → sample (or verify proposals) → record the step
        → deliver. The StepRecord is appended before any result of the step is delivered (the
        module doc says why)."""
        phase = self._profiler.phase  # named ranges in a profile; no-ops otherwise
        start = time.monotonic()
        with phase("schedule"):
            output = self._schedule()
        if not output.chunks:
            # Cannot happen with admission checks in place; fail loudly rather than spin.
            head = self.scheduler.waiting[0].request_id
            self._finish(head, "error", error="the request could not be scheduled")
            return
        logits = self._run_model(output, start)
        rows = _SamplingRows.of(output.chunks, self._live)
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
        with self._profiler.phase("build_inputs"):
            inputs = self._chunk_inputs(output, start)
        # build_inputs (tensors) and forward ranges of their own inside
        logits = self.runner.execute(inputs)  # [S + P, V]
        num_rows = sum(c.num_logits for c in output.chunks)
        return take_prompt_logprobs(logits, num_rows, inputs, self._live)

    def _chunk_inputs(self, output: SchedulerOutput, start: float) -> list[ChunkInput]:
        """What the runner needs about each scheduled chunk (and the requests' first
        scheduled time)."""

        inputs = []
        for chunk in output.chunks:
            live = self._live[chunk.request_id]
            if live.metrics.first_scheduled_time is None:
                live.metrics.first_scheduled_time = start
            inputs.append(
                ChunkInput(
                    chunk,
                    live.sched.token_ids,
                    self.block_manager.block_ids(chunk.request_id),
                    *prompt_rows(live, chunk),
                )
            )
        return inputs

    def _sample(
        self, logits: torch.Tensor, rows: _SamplingRows
    ) -> tuple[list[list[int]], dict[int, _ForkRows]]:
        """Each sampling chunk's emitted tokens, and the rows group leaders hand to the
        samples waiting on them (by position in `rows`). Edits `logits` in place."""
        # The model's own distribution: taken before the mask and the processing edit the
        # logits in place.
        raw = raw_logprobs(logits, rows.first_rows, rows.lives)
        # Disallowed tokens get -inf for every constrained row at once, before sampling.
        if self._grammars is not None:  # made by the first response_format: none before
            self._grammars.mask_constrained(logits, rows.first_rows, rows.lives)
        # Penalties, logit bias, min_tokens and bad words (rows that use them never carry
        # proposals); temperature, min_p, top-k and top-p follow in the sampler.
        self._processing.apply(logits, rows.first_rows, rows.lives)
        emitted = self._verify_or_sample(logits, rows)
        if raw is not None:
            raw.record(rows.lives, emitted)
        return emitted, self._fork_rows(logits, raw, rows)

    def _verify_or_sample(self, logits: torch.Tensor, rows: _SamplingRows) -> list[list[int]]:
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
                self._default_generator,
                [lv.draft_probs for lv in lives],
            )
            emitted = [v.tokens for v in verified]
        else:
            tokens = sample(logits, params, generators, self._default_generator)
            emitted = [[t] for t in tokens]
        for lv in lives:  # verified, or dropped by the scheduler: q is spent either way
            lv.draft_probs = None
        return emitted

    def _fork_rows(
        self, logits: torch.Tensor, raw: RawLogprobs | None, rows: _SamplingRows
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
            if self._groups.has_waiters(lv)
        }

    def _record_step(
        self,
        output: SchedulerOutput,
        rows: _SamplingRows,
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
        with self._records_lock:
            self._records.append(record)
        self._num_steps += 1
        if load is not None:  # a track of its own in a profile's trace
            self._profiler.counter(
                "expert_load", {"max_tokens": load.max_tokens, "mean_tokens": load.mean_tokens}
            )

    def _deliver(
        self,
        output: SchedulerOutput,
        rows: _SamplingRows,
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
                self._spec_proposed += len(chunk.spec_token_ids)
                self._spec_accepted += len(tokens) - 1
            self._after_tokens(live, tokens)
        for member, token in forked:
            if member.request.request_id in self._live:
                self._after_tokens(member, [token])

    def _fork_groups(
        self, lives: list[_Live], fork_rows: dict[int, _ForkRows], end: float
    ) -> list[tuple[_Live, int]]:
        """Fork the samples waiting on each leader in `lives` (which just sampled its first
        token); returns the forked samples and their first tokens."""
        forked: list[tuple[_Live, int]] = []
        for i, live in enumerate(lives):
            # A group whose leader is past its prompt takes no more waiters.
            waiters = self._groups.first_token(live)
            if waiters:
                forked += self._fork(live, waiters, *fork_rows[i], end)
        return forked

    def _after_tokens(self, live: _Live, tokens: list[int]) -> None:
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
            self._outbox.put(
                live.sink,
                StreamDelta(
                    list(new_tokens),
                    text,
                    logprobs=logprobs,
                    prompt_logprobs=live.prompt_logprobs if first else None,
                ),
            )

    def _stop_outcome(self, live: _Live, token: int, num_output: int) -> dict[str, Any] | None:
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
            with self._profiler.phase("detokenize"):
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
        live = self._live.pop(request_id, None)
        if live is None:
            return  # already finished (an abort racing a normal finish)
        for waiter in self._groups.leave(live):
            # It led a group and left before its first token: the others run on their own.
            if waiter.request.request_id in self._live:
                self.scheduler.add_request(waiter.sched)
        sched = self.scheduler.finish_request(request_id)
        self._processing.free(request_id)
        if self.drafter is not None:
            self.drafter.free(request_id)
        output_ids = list(sched.output_token_ids) if sched is not None else []
        if live.detok is not None:
            # Complete characters only: the bytes of a character the output stopped in the
            # middle of stay out of the text (their ids are in output_token_ids).
            text = live.detok.text
        elif self.tokenizer is not None and output_ids:
            stopped_by_token = stop_token or isinstance(stop_reason, int)
            with self._profiler.phase("detokenize"):
                text = final_text(
                    self.tokenizer, output_ids[:-1] if stopped_by_token else output_ids
                )
        else:
            text = ""
        live.metrics.finish_time = time.monotonic()
        result = _result(
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
        self._num_finished += 1
        with self._cv:
            self._in_flight.discard(request_id)
        if live.is_stream:
            rest = None if result.logprobs is None else result.logprobs[live.sent_tokens :]
            delta = StreamDelta(
                output_ids[live.sent_tokens :], text[live.sent_chars :], True, result, rest
            )
            self._outbox.put(live.sink, delta)
        else:
            self._outbox.put(live.sink, result)

    def _cancel_all(self) -> None:
        with self._cv:
            inbox, self._inbox = self._inbox, deque()
            embeds, self._embeds = self._embeds, deque()
        for e in embeds:
            e.metrics.finish_time = time.monotonic()
            result = _result(e.request, [], "", "cancelled", e.metrics)
            self._outbox.put(e.sink, StreamDelta([], "", True, result) if e.is_stream else result)
        for live in inbox:
            self._live[live.request.request_id] = live
            self.scheduler.add_request(live.sched)
        for request_id in list(self._live):
            self._finish(request_id, "cancelled")
        self._outbox.flush()

    def _die(self, reason: str) -> None:
        with self._cv:
            self._dead = reason
            inbox, self._inbox = self._inbox, deque()
            embeds, self._embeds = self._embeds, deque()
            embeds.extend(self._embedding)  # the batch the crash interrupted
            self._embedding = []
            self._in_flight.clear()
        error = EngineDeadError(f"the reference engine stopped: {reason}")
        # After what the crashed step delivered, in the same batch.
        for live in list(self._live.values()) + list(inbox) + list(embeds):
            self._outbox.put(live.sink, error)
        self._outbox.flush()
        self._live.clear()


# The settings this kind takes: the constructor's keyword parameters.
SETTINGS = declared_settings(ReferenceEngine.__init__)


def _result(
    request: GenerationRequest,
    output_ids: list[int],
    text: str,
    reason: FinishReason,
    metrics: RequestMetrics,
    *,
    error: str | None = None,
    stop_reason: str | int | None = None,
    cached: int = 0,
    preemptions: int = 0,
    logprobs: list[TokenLogprob] | None = None,
    prompt_logprobs: list[TokenLogprob | None] | None = None,
    spec_proposed: int = 0,
    spec_accepted: int = 0,
    spec_verifications: int = 0,
) -> GenerationResult:
    return GenerationResult(
        request_id=request.request_id,
        output_token_ids=output_ids,
        text=text,
        finish_reason=reason,
        prompt_tokens=len(request.prompt_token_ids),
        completion_tokens=len(output_ids),
        cached_prompt_tokens=cached,
        error=error,
        stop_reason=stop_reason,
        num_preemptions=preemptions,
        metrics=metrics,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        spec_proposed_tokens=spec_proposed,
        spec_accepted_tokens=spec_accepted,
        spec_verifications=spec_verifications,
    )

"""ReferenceEngine: the `engines.api.Engine` contract over the reference PyTorch model.

Threads: callers live on an asyncio loop; the step loop (engines.reference.step_loop.py)
runs on its own thread, which also loads the model (one OpenMP pool per process: see
_engine_thread), and owns every piece of mutable engine state (scheduler, block manager,
runner). The two sides meet in a Mailbox (new requests and aborts, under a condition variable:
engines/reference/runtime/mailbox.py) and in per-request sinks that the step loop resolves with
`loop.call_soon_threadsafe`. This class is the callers' side: settings, loading, admission
checks and grammar compiles (on the caller's thread, so a bad request is its own error at
once), and the contract's methods.

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
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines import faults
from engines.adapter import declared_settings
from engines.api import (
    EngineDeadError,
    EngineError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    RequestMetrics,
    StepRecord,
    StreamDelta,
)
from engines.lora.vendor import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS
from engines.reference.adapters import adapter_for, attach_adapters
from engines.reference.model.config import ModelConfig, load_model_config
from engines.reference.model.linear import fallback_note
from engines.reference.model.pooling import embed_defaults
from engines.reference.model.weights import load_model
from engines.reference.runtime.kv_cache import BlockManager
from engines.reference.runtime.live import Embedding, Live
from engines.reference.runtime.mailbox import Mailbox
from engines.reference.runtime.media import MediaError, read_media
from engines.reference.runtime.profiling import NO_PROFILER, NoProfiler, StepProfiler
from engines.reference.runtime.resources import (
    load_tokenizer,
    pool_blocks,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
)
from engines.reference.runtime.runner import ModelRunner, kv_bytes_per_token
from engines.reference.runtime.scheduler import Request, Scheduler, SchedulerConfig
from engines.reference.sampling.grammar import GrammarError, Grammars
from engines.reference.sampling.grammar import limitations as grammar_limitations
from engines.reference.sampling.processing import LogitsProcessing
from engines.reference.speculative.draft import Drafter, draft_pool_blocks
from engines.reference.step_loop import StepLoop
from engines.requests import admit, embed_error
from engines.settings import default
from engines.sinks import Sink, await_result, stream_items
from engines.speculative import resolve

if TYPE_CHECKING:
    import torch

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
        lora_adapters: LoRA adapters by name -> local PEFT folder; a request picks one by
            name (GenerationRequest.adapter). Read and checked on first use. None: none.
        max_loras: adapters usable in one step (the model's LoRA slots).
        max_lora_rank: the highest adapter rank accepted (slots are sized for it).
        max_cpu_loras: adapters kept read in memory (default: max(max_loras, 8)).
        lora_prefix: {uri, cache_dir, endpoint_url, region, anonymous}: adapters not in
            lora_adapters are looked up as uri/NAME on first use (engines/lora/prefix.py).
    """

    def __init__(
        self,
        model: str,
        *,
        max_num_tokens: int = default("reference", "max_num_tokens"),
        max_batch_size: int = default("reference", "max_batch_size"),
        kv_cache_tokens: int | None = None,
        kv_cache_memory_gb: float | None = None,
        block_size: int = default("reference", "block_size"),
        enable_prefix_caching: bool = default("reference", "enable_prefix_caching"),
        enable_chunked_prefill: bool = default("reference", "enable_chunked_prefill"),
        dtype: str = default("reference", "dtype"),
        device: str = default("reference", "device"),
        max_model_len: int | None = None,
        num_threads: int | None = None,
        profile_dir: str | None = None,
        profile_steps: int = 20,
        speculative: Any = None,
        lora_adapters: dict[str, str] | None = None,
        max_loras: int = DEFAULT_MAX_LORAS,
        max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
        max_cpu_loras: int | None = None,
        lora_prefix: dict[str, Any] | None = None,
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
            ("max_loras", max_loras),
            ("max_lora_rank", max_lora_rank),
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
        self._grammars_lock = threading.Lock()  # the first response_format makes them
        self._mailbox = Mailbox()
        self._loop: StepLoop | None = None  # made by _load, run by the engine thread
        self._max_num_tokens = max_num_tokens
        self._step_delay_s = faults.step_delay_s()  # 0 outside tests

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
            lora=(lora_adapters or {}, max_loras, max_lora_rank, max_cpu_loras, lora_prefix),
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
        lora: tuple[dict[str, str], int, int, int | None, dict[str, Any] | None],
    ) -> None:
        """Model, tokenizer, KV pool, scheduler, runner, profiler, drafter and LoRA slots (on
        the engine thread)."""
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
        self.adapters, slots, lora_state = attach_adapters(self.model, self.config, *lora)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_tokens, max_batch_size, enable_chunked_prefill),
            self.block_manager,
            slots,
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
        self.runner.lora = lora_state
        # Method draft: the draft model with its own KV pool (speculative/draft.py).
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

        default_generator = torch.Generator(device=self._torch_device)
        default_generator.manual_seed(int.from_bytes(os.urandom(4), "little"))
        self._loop = StepLoop(
            mailbox=self._mailbox,
            config=self.config,
            tokenizer=self.tokenizer,
            scheduler=self.scheduler,
            block_manager=self.block_manager,
            runner=self.runner,
            drafter=self.drafter,
            speculative=self._speculative,
            spec_limit=self._spec_limit,
            processing=LogitsProcessing(self.config.vocab_size, self._torch_device),
            default_generator=default_generator,
            device=self._torch_device,
            embed_defaults=embed_defaults(model_dir),
            profiler=self._profiler,
            max_num_tokens=max_num_tokens,
            step_delay_s=self._step_delay_s,
        )

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
        self._mailbox.abort(request_id)

    def drain_step_records(self) -> list[StepRecord]:
        assert self._loop is not None
        return self._loop.drain_records()

    def stats(self) -> EngineStats:
        """The engine's load; raises EngineDeadError once the step loop has died (its last
        figures would read as a live engine to whoever checks health with them)."""
        mailbox = self._mailbox
        if mailbox.dead is not None:
            raise EngineDeadError(f"the reference engine has stopped: {mailbox.dead}")
        if not self._thread.is_alive() and not mailbox.stopping:
            raise EngineDeadError("the reference engine's step loop is gone")
        assert self._loop is not None
        return self._loop.stats()

    @property
    def profile_trace(self) -> Path | None:
        """The trace file of `profile_dir` once written (after profile_steps steps, or at
        shutdown if the engine stopped before); None when not profiling."""
        return self._profiler.trace_path

    def shutdown(self) -> None:
        self._mailbox.stop()
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
        adapter = None
        if error is None and request.adapter is not None:
            adapter, error = adapter_for(self.adapters, request.adapter)
        media = None
        # A vision model's placeholder without pixels would run as a word: refused as well.
        placeholder = self.config.image_token_id
        if error is None and (
            request.images or (placeholder is not None and placeholder in request.prompt_token_ids)
        ):
            try:
                media = read_media(request.prompt_token_ids, request.images, self.config)
            except MediaError as exc:
                error = str(exc)
        grammar = None
        if error is None and request.sampling.response_format is not None:
            # Compiled on the caller's thread: a bad format is this row's error at once, and
            # the step loop never waits on a compile.
            grammar, error = self._compile(request.sampling.response_format)
        live = Live(
            request=request,
            sched=Request(
                request.request_id,
                list(request.prompt_token_ids),
                max_tokens,
                adapter=adapter,
                media=media,
            ),
            sink=sink,
            metrics=metrics,
            is_stream=is_stream,
            grammar=grammar,
        )
        self._mailbox.put(live, error)

    def _submit_embed(
        self, request: GenerationRequest, sink: Sink, is_stream: bool, metrics: RequestMetrics
    ) -> None:
        """Queue an embed request for the step loop, or answer its row error now."""
        error = embed_error(request, self.config.vocab_size, self.max_model_len)
        if error is None and request.adapter is not None:
            error = "LoRA adapters apply to generation; embed with the base model (no adapter)"
        if error is None and request.images:
            error = "embeddings take text only; send the input without images"
        self._mailbox.put_embed(Embedding(request, sink, metrics, is_stream), error)

    def _check(self, request: GenerationRequest) -> tuple[str | None, int]:
        """A per-request problem (as an error text) and the request's allowed output tokens."""
        admission = admit(
            request,
            vocab_size=self.config.vocab_size,
            max_model_len=self.max_model_len,
            takes_adapters=True,
            takes_images=self.config.vision is not None,
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
        assert self._loop is not None
        with self._grammars_lock:
            if self._loop.grammars is None:
                self._loop.grammars = Grammars(
                    self.tokenizer, self.config.vocab_size, self.config.eos_token_ids
                )
        try:
            return self._loop.grammars.compile(fmt), None
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
        assert self._loop is not None
        self._loop.run()


# The settings this kind takes: the constructor's keyword parameters.
SETTINGS = declared_settings(ReferenceEngine.__init__)

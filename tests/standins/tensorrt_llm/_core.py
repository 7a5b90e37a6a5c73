"""The shared body of the stand-in `LLM` classes: argument checks, a toy model, results.

The toy model is deterministic and cheap: greedy output token i of a prompt is
(sum(prompt) + 7 * i) % 50 + 10, so tests can predict every token; a sampled token adds a
random offset of 1..4 to that (which can wrap far down the toy distribution), or with top_k
is one of the top_k most likely. It runs on the asyncio loop of the caller (the real executor
runs in worker processes: requests reach it pickled, as they would), producing one token per
loop turn so that concurrent requests interleave, abort lands mid-generation and streaming
has steps.

The toy tokenizer writes token t as "<t>"; the checkpoint's EOS ids are its special tokens.

What it copies from TensorRT-LLM 1.2 (see the notes at each place):
- stop checks in the PyTorch sampler's order: end_id, then length, then stop words;
- token_ids: a matched stop word (stop_token_ids entry or tokenized stop string) is removed
  unless include_stop_str_in_output; the end_id token is kept by the PyTorch backend and left
  out by the TensorRT backend's C++ decoder;
- text: a stop string found in the detokenized text cuts it (before the string, or after it
  with include_stop_str_in_output) and finishes the request with that stop_reason;
- greedy or not: the PyTorch rule of SamplingParams, or the C++ sampler's (top_k 0 and top_p 0,
  the runtime defaults for None, decode greedily);
- seeds: the TensorRT backend seeds each request from SamplingParams.seed; the PyTorch
  backend draws every request from one generator seeded 42 (per-request seeds ignored);
- perf-metric time points never reached are timedelta(0), not None;
- a failure of one request inside the executor is raised as RequestError from awaiting or
  iterating it;
- guided decoding: with guided_decoding_backend "xgrammar" on the LLM, a request's
  GuidedDecodingParams constrain its tokens (xgrammar over the checkpoint's own tokenizer, which
  then also detokenizes that request: the toy "<t>" vocabulary spells no JSON). The toy model
  keeps its token when the grammar allows it, else takes the next allowed id, and ends (end_id)
  as soon as the grammar may. "llguidance" is refused on the TensorRT backend, any other name
  on both. A guide sent to an LLM built without a guided decoding backend is ignored here (the
  worst case: the adapter must set the backend);
- logits processors: SamplingParams.logits_processor (a list on the PyTorch backend only) is
  called on a toy logits row peaking at the toy token, with the request's tokens so far; the
  processed row's argmax is the token (the penalty fields themselves are accepted and, as in
  1.2's default sampler, not applied);
- logprobs: SamplingParams.logprobs k (0 and None: none) gives one {token id: Logprob(logprob,
  rank)} per output token, the top k by rank, from a toy distribution that peaks at the greedy
  toy token (log-softmax of -0.7 * |t - greedy|, before any guide or sampling offset); as 1.2's
  TorchSampler, the PyTorch backend leaves the sampled token out when it is not among them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import json
import math
import os
import pickle
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The arguments each backend's LLM takes: the adapter's own table (engines/trtllm_args.py),
# read from the 1.2 line's llm_args.py.
from engines.trtllm_args import (
    COMMON_ARGS,
    PARALLEL_ARGS,
    PYTORCH_ONLY_ARGS,
    TENSORRT_ONLY_ARGS,
)
from tensorrt_llm._multimodal import ToyVisionInput
from tensorrt_llm.executor.result import Logprob
from tensorrt_llm.executor.utils import RequestError
from tensorrt_llm.llmapi import DecodingBaseConfig, KvCacheConfig, SchedulerConfig

__all__ = ["COMMON_ARGS", "PARALLEL_ARGS", "PYTORCH_ONLY_ARGS", "TENSORRT_ONLY_ARGS"]


_ZERO = dt.timedelta(0)


def _td(seconds: float) -> dt.timedelta:
    # The real metrics are steady_clock time points exposed as timedeltas since its epoch;
    # on Linux that is CLOCK_MONOTONIC, the clock behind time.monotonic().
    return dt.timedelta(seconds=seconds)


@dataclass
class TimingMetrics:
    # Unset time points are a zero duration in the real bindings (a default time point).
    arrival_time: dt.timedelta = _ZERO
    first_scheduled_time: dt.timedelta = _ZERO
    first_token_time: dt.timedelta = _ZERO
    last_token_time: dt.timedelta = _ZERO


@dataclass
class KvCacheMetrics:
    num_total_allocated_blocks: int = 0
    num_new_allocated_blocks: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    kv_cache_hit_rate: float = 0.0


@dataclass
class SpeculativeDecodingMetrics:
    acceptance_rate: float = 0.0
    total_accepted_draft_tokens: int = 0
    total_draft_tokens: int = 0


@dataclass
class RequestPerfMetrics:
    timing_metrics: TimingMetrics
    kv_cache_metrics: KvCacheMetrics = field(default_factory=KvCacheMetrics)
    speculative_decoding: SpeculativeDecodingMetrics = field(
        default_factory=SpeculativeDecodingMetrics
    )
    first_iter: int | None = None
    last_iter: int | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "timeout" | "cancelled"
    stop_reason: int | str | None = None
    request_perf_metrics: RequestPerfMetrics | None = None

    @property
    def length(self) -> int:
        return len(self.token_ids)


class FinishReason(enum.Enum):
    """tensorrt_llm.bindings.executor.FinishReason (the values the stand-in produces)."""

    END_ID = "end_id"
    STOP_WORDS = "stop_words"
    LENGTH = "length"
    CANCELLED = "cancelled"


def toy_token(prompt: list[int], i: int) -> int:
    return (sum(prompt) + 7 * i) % 50 + 10


def toy_text(token_ids: list[int], special: frozenset[int] = frozenset()) -> str:
    return "".join(f"<{t}>" for t in token_ids if t not in special)


class ToyTokenizer:
    """`llm.tokenizer`: "<t>" per token; the checkpoint's EOS ids are special tokens."""

    def __init__(self, model_dir: str) -> None:
        ids: list[int] = []
        for name in ("config.json", "generation_config.json"):
            path = Path(model_dir) / name
            value = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
            ids += value if isinstance(value, list) else [] if value is None else [value]
        self.eos_token_id = ids[0] if ids else None
        self.special_ids = frozenset(ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # Only "<t>" sequences tokenize; other text has no token form in the toy vocabulary,
        # so such stop strings are found in the detokenized text only.
        if re.fullmatch(r"(<\d+>)+", text) is None:
            return []
        return [int(t) for t in re.findall(r"<(\d+)>", text)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return toy_text(ids, self.special_ids if skip_special_tokens else frozenset())


class RequestOutput:
    """What generate_async returns: await it for the final output, or `async for` it when
    streaming=True; `abort()` cancels."""

    def __init__(
        self,
        llm: Any,
        request_id: int,
        prompt_token_ids: list[int],
        params,
        streaming,
        lora=None,
        toy_key: list[int] | None = None,
    ):
        self._llm = llm
        self.lora_request = lora
        self.request_id = request_id
        self.prompt = None
        self.prompt_token_ids = prompt_token_ids
        # What the toy model reads: the prompt, plus one value per image for multimodal ones.
        self._key = prompt_token_ids if toy_key is None else toy_key
        self.outputs = [CompletionOutput(index=0)]
        self.finished = False
        self.cached_tokens = 0
        self._params = params
        self._streaming = streaming
        self._aborted = False
        self._error: RequestError | None = None
        self._fail_after = llm._take_injected_failure()
        self._rng = llm._rng_for(params)
        self._matcher = llm._matcher_for(params)
        self._timing = TimingMetrics(arrival_time=_td(time.monotonic()))
        self._updates: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def abort(self) -> None:
        self._aborted = True

    async def _run(self) -> None:
        await asyncio.sleep(0)
        try:
            if self._aborted:  # cancelled while queued: never scheduled
                reason = FinishReason.CANCELLED
            else:
                self._timing.first_scheduled_time = _td(time.monotonic())
                self.cached_tokens = self._llm._reuse_prefix(self._key)
                reason = await self._generate()
            self._finish(reason)
        except (RequestError, RuntimeError) as exc:  # one request failed, or the executor died
            self._error = exc
        self.finished = True
        self._llm._finished(self)
        self._updates.put_nowait(True)

    async def _generate(self) -> FinishReason:
        p, out = self._params, self.outputs[0]
        ids: list[int] = []
        while True:
            await asyncio.sleep(self._llm.step_seconds)
            if self._llm.executor_error is not None:
                raise self._llm.executor_error
            if self._aborted:
                return FinishReason.CANCELLED
            if self._fail_after is not None and len(ids) >= self._fail_after[1]:
                raise RequestError(self._fail_after[0])
            adapter = 0 if self.lora_request is None else self.lora_request.lora_int_id
            token = self._llm._next_token(self._key, len(ids), p, self._rng, adapter)
            if p.logits_processor is not None:
                token = self._llm._processed_token(self, ids, token)
            if self._matcher is not None:
                token = self._llm._guide.constrain(self._matcher, token, p.end_id)
            if p.logprobs:
                greedy = toy_token(self._key, len(ids))
                out.logprobs.append(self._llm._toy_logprobs(greedy, token, p.logprobs))
            ids.append(token)
            now = _td(time.monotonic())
            if self._timing.first_token_time == _ZERO:
                self._timing.first_token_time = now
            self._timing.last_token_time = now
            out.token_ids = list(ids)
            reason = self._llm._stop_check(ids, p)
            if reason is not None:
                return reason
            if self._streaming:
                self._detokenize(final=False)
                if out.finish_reason == "stop":
                    # A stop string showed up in the streamed text: the real result aborts
                    # the request there (_finish keeps the text-level stop).
                    return FinishReason.STOP_WORDS
                self._updates.put_nowait(False)

    def _finish(self, reason: FinishReason) -> None:
        """GenerationResultBase._handle_sequence, then the detokenizer's stop-string cut."""
        p, out = self._params, self.outputs[0]
        if out.finish_reason == "stop":  # already finished by a stop string in the text
            pass
        elif reason is FinishReason.END_ID:
            out.finish_reason = "stop"
            if self._llm.backend == "tensorrt":
                # The C++ decoder does not count or return the end_id token.
                out.token_ids = out.token_ids[:-1]
        elif reason is FinishReason.STOP_WORDS:
            out.finish_reason = "stop"
            for stop_reason, words in p._get_stop_reasons_and_words():
                if words and out.token_ids[-len(words) :] == words:
                    out.stop_reason = stop_reason
                    if not p.include_stop_str_in_output:
                        out.token_ids = out.token_ids[: -len(words)]
                    break
        elif reason is FinishReason.LENGTH:
            out.finish_reason = "length"
        else:
            out.finish_reason = "cancelled"
        self._detokenize(final=True)
        self._attach_metrics()

    def _detokenize(self, final: bool) -> None:
        p, out = self._params, self.outputs[0]
        if not p.detokenize:
            return
        tokenizer = self._llm._guide.tokenizer if self._matcher is not None else self._llm.tokenizer
        out.text = tokenizer.decode(out.token_ids, skip_special_tokens=p.skip_special_tokens)
        if final and out.finish_reason not in ("stop", "length"):
            return
        for stop_reason, _ in p._get_stop_reasons_and_words():
            if isinstance(stop_reason, str) and stop_reason in out.text:
                at = out.text.find(stop_reason)
                keep = len(stop_reason) if p.include_stop_str_in_output else 0
                out.text = out.text[: at + keep]
                out.finish_reason, out.stop_reason = "stop", stop_reason
                break

    def _attach_metrics(self) -> None:
        p, out = self._params, self.outputs[0]
        if p.return_perf_metrics and self._llm.args["return_perf_metrics"]:
            spec = SpeculativeDecodingMetrics()
            config = self._llm.args["speculative_config"]
            if config is not None:
                # Toy figures (there is no real drafter here): one draft of max_draft_len per
                # generated token after the first, half of each accepted.
                steps = max(len(out.token_ids) - 1, 0)
                drafted = steps * config.max_draft_len
                accepted = drafted // 2
                spec = SpeculativeDecodingMetrics(
                    accepted / drafted if drafted else 0.0, accepted, drafted
                )
            out.request_perf_metrics = RequestPerfMetrics(
                timing_metrics=self._timing,
                first_iter=0,
                last_iter=len(out.token_ids),
                speculative_decoding=spec,
            )

    def __await__(self):
        return self._result().__await__()

    async def _result(self) -> RequestOutput:
        await self._task
        if self._error is not None:
            raise self._error
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
            if done and self._error is not None:
                raise self._error
            yield self
            if done:
                return


class LlmCore:
    """Argument handling and request bookkeeping common to both stand-in LLM classes."""

    #: every LLM constructed in this process, newest last (tests read the recorded args)
    instances: list[LlmCore] = []
    #: seconds per generated token (0: one event-loop turn); tests that need requests to stay
    #: in flight for a while raise it (in a child process: TOKENMILL_STANDIN_STEP_S)
    step_seconds: float = float(os.environ.get("TOKENMILL_STANDIN_STEP_S", "0"))
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
        if self.args["orchestrator_type"] not in (None, "rpc", "ray"):
            raise ValueError("orchestrator_type must be one of None, 'rpc', 'ray'")
        kv = self.args["kv_cache_config"] or KvCacheConfig()
        if not isinstance(kv, KvCacheConfig):
            raise ValueError("kv_cache_config must be a KvCacheConfig")
        sched = self.args["scheduler_config"] or SchedulerConfig()
        if not isinstance(sched, SchedulerConfig):
            raise ValueError("scheduler_config must be a SchedulerConfig")
        self.kv_cache_config = kv
        from tensorrt_llm.lora_helper import LoraConfig

        lora = self.args["lora_config"]
        if lora is not None and not isinstance(lora, LoraConfig):
            raise ValueError("lora_config must be a LoraConfig")
        guide_backend = self.args["guided_decoding_backend"]
        if guide_backend not in (None, "xgrammar", "llguidance") or (
            guide_backend == "llguidance" and self.backend == "tensorrt"
        ):
            raise ValueError(f"Unsupported guided decoding backend {guide_backend}")
        self._guide: _Guide | None = None
        config = json.loads((Path(model) / "config.json").read_text())
        # A multimodal checkpoint's language model is its text_config (as AutoConfig reads it).
        self._vocab_size = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
        self._log_norm: dict[int, float] = {}
        spec = self.args["speculative_config"]
        if spec is not None:
            if not isinstance(spec, DecodingBaseConfig):
                raise ValueError("speculative_config must be a DecodingBaseConfig")
            if not spec.supports_backend(self.backend):
                raise ValueError(
                    f"{type(spec).__name__} is not supported by the {self.backend} backend"
                )
        self.is_shutdown = False
        self.shutdown_calls = 0
        self.submitted: list[tuple[list[int], Any, bool]] = []
        self.lora_requests: list[Any] = []  # each submitted request's lora_request (or None)
        self.live: dict[int, RequestOutput] = {}
        self.tokenizer = ToyTokenizer(model)
        self.model_dir = model
        self.vision_input: ToyVisionInput | None = None  # made on the first multimodal input
        self.multimodal_inputs: list[dict[str, Any]] = []  # each multimodal request's inputs
        self._seen_prompts: list[list[int]] = []
        self._next_id = 0
        self._injected: list[tuple[str, int]] = []
        self.executor_error: RuntimeError | None = None
        # The PyTorch sampler draws every request from one generator with a fixed seed.
        self._shared_rng = random.Random(42)
        LlmCore.instances.append(self)

    # --- test hooks ---------------------------------------------------------------------------

    def inject_request_error(self, message: str, after_tokens: int = 0) -> None:
        """Make the next submitted request fail inside the executor after `after_tokens` tokens
        (as an error response for that one request does: RequestError, the LLM stays up)."""
        self._injected.append((message, after_tokens))

    def kill_executor(self) -> None:
        """The executor process dies: as the real LLM does on a background error, it shuts
        down; requests in flight and every later one raise (not RequestError)."""
        self.executor_error = RuntimeError("the executor process died (injected)")
        self.is_shutdown = True

    def _take_injected_failure(self) -> tuple[str, int] | None:
        return self._injected.pop(0) if self._injected else None

    # --- the toy model ------------------------------------------------------------------------

    def _is_greedy(self, p: Any) -> bool:
        spec = self.args["speculative_config"]
        if spec is not None and spec.samples_greedily:
            return True  # a one-model speculative path without allow_advanced_sampling
        if self.backend == "pytorch":
            return p.params_imply_greedy_decoding(
                temperature=p.temperature, top_p=p.top_p, top_k=p.top_k
            )
        # C++ samplers: None takes the runtime default (top_k 0, top_p 0), and top_k 0 with
        # top_p 0 is turned into top_k 1.
        top_k = p.top_k or 0
        top_p = 0.0 if p.top_p is None else p.top_p
        return top_k == 1 or (top_k == 0 and top_p == 0.0)

    def _rng_for(self, p: Any) -> random.Random:
        if self.backend == "pytorch":
            return self._shared_rng  # SamplingParams.seed is not read
        return random.Random(0 if p.seed is None else p.seed)  # C++ default seed is 0

    def _next_token(
        self, prompt: list[int], i: int, p: Any, rng: random.Random, adapter: int = 0
    ) -> int:
        """The greedy toy token; sampled with top_k > 1, one of the top_k most likely (as a
        sampler keeps them); sampled without, 1..4 steps along the toy sequence, which can
        land far down the toy distribution (its tail). A LoRA adapter (its lora_int_id)
        shifts the toy sequence by 13 per id, so each adapter answers differently."""
        greedy = (sum(prompt) + 7 * i + 13 * adapter) % 50 + 10
        if self._is_greedy(p):
            return greedy
        top_k = p.top_k or 0
        if top_k > 1:
            return self._by_rank(greedy)[rng.randint(1, min(top_k, self._vocab_size) - 1)]
        return (sum(prompt) + 7 * i + rng.randint(1, 4)) % 50 + 10

    def _by_rank(self, greedy: int) -> list[int]:
        """The vocabulary from the most to the least likely under the toy distribution."""
        return sorted(range(self._vocab_size), key=lambda t: (abs(t - greedy), t))

    def _processed_token(self, out: RequestOutput, ids: list[int], token: int) -> int:
        """The PyTorch backend's logits post-processors: each is called in place on this
        request's logits row ([1, V] here) with its tokens so far (prompt + output, beam 0),
        before sampling. The toy logits peak at the toy token (-0.7 * |t - token|); the
        processed row's argmax is the token taken."""
        import torch

        processors = out._params.logits_processor
        if isinstance(processors, list) and self.backend != "pytorch":
            raise ValueError("a list of logits processors needs the PyTorch backend")
        logits = -0.7 * (torch.arange(self._vocab_size, dtype=torch.float32) - token).abs()
        logits = logits[None, :]
        tokens = [[*out.prompt_token_ids, *ids]]
        for processor in processors if isinstance(processors, list) else [processors]:
            processor(out.request_id, logits, tokens, None, None)
        return int(logits[0].argmax())

    def _matcher_for(self, p: Any) -> Any:
        """A grammar matcher for a guided request; None for free text (or no backend)."""
        if p.guided_decoding is None or self.args["guided_decoding_backend"] is None:
            return None
        if self._guide is None:
            self._guide = _Guide(self.args["model"], self._vocab_size, self.tokenizer.special_ids)
        return self._guide.matcher(p.guided_decoding)

    def _toy_logprobs(self, greedy: int, chosen: int, k: int) -> dict[int, Logprob]:
        """One position's {token id: Logprob}: the top k by rank, as 1.2's TorchSampler returns
        them (the top k of log_softmax, the sampled token only when it is among them); the
        TensorRT backend's also holds the chosen token."""
        vocab = self._vocab_size
        norm = self._log_norm.get(greedy)
        if norm is None:
            norm = math.log(sum(math.exp(-0.7 * abs(t - greedy)) for t in range(vocab)))
            self._log_norm[greedy] = norm
        by_rank = self._by_rank(greedy)
        entry = {
            t: Logprob(-0.7 * abs(t - greedy) - norm, rank=r + 1) for r, t in enumerate(by_rank[:k])
        }
        if chosen not in entry and self.backend == "tensorrt":
            entry[chosen] = Logprob(-0.7 * abs(chosen - greedy) - norm, by_rank.index(chosen) + 1)
        return entry

    def _stop_check(self, ids: list[int], p: Any) -> FinishReason | None:
        """TorchSampler._handle_stop_criteria's order: end_id, length, stop words."""
        if not p.ignore_eos and ids[-1] == p.end_id:
            return FinishReason.END_ID
        if len(ids) >= p.max_tokens:
            return FinishReason.LENGTH
        for _, words in p._get_stop_reasons_and_words():
            if words and ids[-len(words) :] == words:
                return FinishReason.STOP_WORDS
        return None

    def generate_async(
        self, inputs, sampling_params=None, streaming: bool = False, lora_request=None, **kwargs
    ):
        from tensorrt_llm import SamplingParams
        from tensorrt_llm.executor import LoRARequest

        if self.is_shutdown:
            raise self.executor_error or RuntimeError("LLM is shutting down")
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        if lora_request is not None:
            # The worker's LoRA manager: an LLM built without lora_config has none.
            if self.args.get("lora_config") is None:
                raise ValueError("a lora_request needs an LLM built with lora_config")
            if not isinstance(lora_request, LoRARequest):
                raise TypeError("lora_request must be a LoRARequest")
        params = sampling_params or SamplingParams()
        if params.end_id is None:
            # LLM._prepare_sampling_params: end_id from the tokenizer, stop strings tokenized.
            params._setup(self.tokenizer)
        prompt, toy_key = self._prompt_of(inputs)
        if not self.args["enable_chunked_prefill"] and len(prompt) > self.args["max_num_tokens"]:
            raise ValueError(
                f"The sum of prompt length ({len(prompt)}) should not exceed max_num_tokens "
                f"({self.args['max_num_tokens']})"
            )
        # The request crosses to the executor's worker processes pickled (executor/ipc.py):
        # what runs there, a logits processor included, is a copy, and must pickle and import.
        params = pickle.loads(pickle.dumps(params))
        max_seq_len = self.args["max_seq_len"]
        if max_seq_len is not None and len(prompt) + params.max_tokens > max_seq_len:
            if self.backend == "tensorrt":  # the TensorRT backend checks the sum
                raise ValueError(f"prompt + max_tokens exceeds max_seq_len ({max_seq_len})")
            # The PyTorch backend's worker lowers max_tokens to what the sequence has room for
            # (_deduce_max_tokens, with a warning), and refuses a prompt that leaves none.
            room = max_seq_len - len(prompt)
            if room <= 0:
                raise ValueError(f"the prompt ({len(prompt)} tokens) fills max_seq_len")
            params.max_tokens = room
        self.submitted.append((prompt, params, streaming))
        self.lora_requests.append(lora_request)
        self._next_id += 1
        out = RequestOutput(self, self._next_id, prompt, params, streaming, lora_request, toy_key)
        self.live[out.request_id] = out
        return out

    def _prompt_of(self, inputs: Any) -> tuple[list[int], list[int]]:
        """(the prompt's token ids as the model runs them, the toy model's key): a token list,
        or a TokensPrompt dict, whose multi_modal_data the multimodal input processor expands
        (_multimodal.py)."""
        if not isinstance(inputs, dict):
            prompt = list(inputs)
            return prompt, prompt
        unknown = set(inputs) - {"prompt_token_ids", "multi_modal_data"}
        if unknown:
            raise TypeError(f"the stand-in's TokensPrompt takes no {sorted(unknown)}")
        prompt = list(inputs["prompt_token_ids"])
        media = inputs.get("multi_modal_data")
        if not media:
            return prompt, prompt
        if self.vision_input is None:
            self.vision_input = ToyVisionInput(self.model_dir)
        self.multimodal_inputs.append(inputs)
        return self.vision_input.expand(prompt, media)

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
        """As 1.2's LLM.shutdown: every request in flight is aborted (each ends with
        finish_reason "cancelled"), then the executor's workers are waited for."""
        self.shutdown_calls += 1
        self.is_shutdown = True
        for out in list(self.live.values()):
            out.abort()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class _Guide:
    """xgrammar over the checkpoint's own tokenizer: compiled guides and per-request matchers."""

    def __init__(self, model_dir: str, vocab_size: int, stop_ids: frozenset[int]) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self._xgr = xgr
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_ids
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def matcher(self, guide: Any) -> Any:
        c = self._compiler
        if guide.json_object:
            compiled = c.compile_builtin_json_grammar()
        elif guide.json is not None:
            schema = guide.json if isinstance(guide.json, str) else json.dumps(guide.json)
            compiled = c.compile_json_schema(schema, any_whitespace=False)
        elif guide.regex is not None:
            compiled = c.compile_regex(guide.regex)
        elif guide.grammar is not None:
            compiled = c.compile_grammar(guide.grammar)
        else:
            raise RequestError("structural_tag guides are not modelled by the stand-in")
        return self._xgr.GrammarMatcher(compiled)

    def constrain(self, matcher: Any, token: int, end_id: int | None) -> int:
        """The toy model's token under the grammar: end as soon as allowed, else the token
        itself when allowed, else the next allowed id (wrapping)."""
        import numpy as np

        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: self.vocab_size])
        stops = [t for t in ([end_id] if end_id is not None else []) + self.stop_ids if bits[t]]
        if stops:
            choice = stops[0]
        elif token < self.vocab_size and bits[token]:
            choice = token
        else:
            later = allowed[allowed >= token]
            choice = int(later[0] if len(later) else allowed[0])
        if not matcher.accept_token(choice):
            raise RequestError(f"the grammar refused token {choice}")
        return choice

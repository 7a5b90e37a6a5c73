"""The engine contract: request, sampling, result, metrics and step-record types.

Every engine (the reference PyTorch engine, the TensorRT-LLM adapter) speaks these types, and
nothing above `engines/` (the batch pipeline, the Serve app, the cost module) sees anything
else. The types are plain dataclasses so they pickle cheaply across Ray and import no torch.

Times are `time.monotonic()` seconds of the process that runs the engine. They are only
compared with each other (and with the actor's own monotonic clock), never with wall time.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "error", "cancelled"]


class EngineError(RuntimeError):
    """The engine itself failed (bad model directory, dead step loop); not one request's fault."""


class EngineDeadError(EngineError):
    """The step loop has stopped; no further request can be served by this engine."""


ResponseFormatKind = Literal["json_schema", "json_object", "regex", "choice"]
# Alternatives per output token a request may ask for (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log probability and the most likely alternatives at its position
    (highest first; may include the chosen token itself)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# Row errors caused by a request's response_format start with this (Serve answers them 400).
FORMAT_ERROR_PREFIX = "response_format"


@dataclass(frozen=True)
class ResponseFormat:
    """A constraint on the output text, enforced token by token while sampling.

    - json_schema: the text is JSON valid under `schema` (JSON text, so the params hash);
    - json_object: the text is any JSON object;
    - regex: the text matches `regex` in full;
    - choice: the text is exactly one of `choices`.
    """

    kind: ResponseFormatKind
    schema: str | None = None  # json_schema: the schema as JSON text
    regex: str | None = None
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        import json

        object.__setattr__(self, "choices", tuple(self.choices))
        kinds = ("json_schema", "json_object", "regex", "choice")
        if self.kind not in kinds:
            raise ValueError(f"response_format.type must be one of {', '.join(kinds)}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.schema) if isinstance(self.schema, str) else None
            except json.JSONDecodeError as exc:
                raise ValueError(f"response_format.schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("response_format json_schema needs a schema: a JSON object")
        if self.kind == "regex" and not (isinstance(self.regex, str) and self.regex):
            raise ValueError("response_format regex needs a non-empty regex")
        if self.kind == "choice" and (
            not self.choices or any(not isinstance(c, str) or not c for c in self.choices)
        ):
            raise ValueError("response_format choice needs a list of non-empty strings")

    @classmethod
    def json(cls, schema: dict | None = None) -> ResponseFormat:
        """json_schema for `schema`, or json_object without one."""
        import json

        if schema is None:
            return cls("json_object")
        return cls("json_schema", schema=json.dumps(schema, sort_keys=True))


# Temperatures below this are greedy: dividing logits by ~0 overflows to inf / nan, and the
# distribution is an argmax long before (vLLM uses the same 1e-5).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Invalid values raise ValueError naming the field."""

    max_tokens: int = 16  # tokens to generate at most (>= 1)
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included) means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 disables
    top_k: int = 0  # keep the k most likely tokens; 0 disables
    seed: int | None = None  # same seed → same tokens, whatever else is in the batch
    stop: tuple[str, ...] = ()  # stop strings; the match is cut from the text
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the request (kept in ids)
    ignore_eos: bool = False  # keep generating past the model's end-of-sequence token
    # Constrain the text (JSON schema, JSON object, regex, choice); None: free text.
    response_format: ResponseFormat | None = None
    # Log probabilities of the output tokens: None off; k (0..MAX_LOGPROBS) returns each
    # chosen token's logprob and the k most likely alternatives, from the model's own
    # distribution (before temperature, top-k/top-p and response_format masks, as vLLM's
    # default and OpenAI report them).
    logprobs: int | None = None
    # Log probabilities of the prompt's own tokens (scoring, OpenAI's echo): None off; k
    # (0..MAX_LOGPROBS) returns, for every prompt token after the first, its logprob given the
    # tokens before it and the k most likely alternatives there. The whole prompt is then
    # computed, never taken from the prefix cache, whose blocks hold no logits.
    prompt_logprobs: int | None = None
    # Logits processing (vLLM's semantics and order: docs/sampling.md). The neutral values
    # below cost nothing per step; `uses_logits_processing` says whether a request needs any.
    # OpenAI's: subtract penalty x (times the token was generated) / (1 if it was at all).
    frequency_penalty: float = 0.0  # in [-2, 2]; counts generated tokens only
    presence_penalty: float = 0.0  # in [-2, 2]; generated tokens only
    # Hugging Face's / vLLM's: a token seen in the prompt or the output has its logit divided
    # by this when positive, multiplied when negative. > 0; 1 disables.
    repetition_penalty: float = 1.0
    # Drop tokens whose probability (after temperature) is below min_p x the top token's.
    min_p: float = 0.0  # in [0, 1]; 0 disables
    # EOS and stop_token_ids cannot be generated (and stop strings do not match) before this
    # many output tokens.
    min_tokens: int = 0
    # Token id -> bias in [-100, 100] added to its logit (OpenAI's logit_bias); given as a
    # dict or pairs, kept as sorted (id, bias) pairs so the params stay hashable.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Words the output must not contain: each is tokenized (as is and with a leading space,
    # as vLLM does), and a word's last token is banned wherever the output ends with the
    # tokens before it.
    bad_words: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Normalize lists (from YAML / JSON) to tuples so the params stay hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        problems = _bias_problems(self)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            problems.append(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            problems.append(f"seed must be an integer or null, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be integers >= 0, got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_LOGPROBS
            ):
                problems.append(
                    f"{name} must be null or an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        problems += _processing_problems(self)
        if problems:
            raise ValueError("invalid sampling params: " + "; ".join(problems))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def uses_logits_processing(self) -> bool:
        """Whether any logits processing before temperature is asked for (penalties, bias,
        min_tokens, bad words); False for the neutral values, whose rows skip it."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.logit_bias
            or self.bad_words
        )

    @property
    def uses_penalties(self) -> bool:
        """Whether the frequency, presence or repetition penalty is set."""
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
        )


# The logits-processing fields of SamplingParams (and min_p): one list for the engines' messages
# and the job spec's per-row overrides.
PROCESSING_FIELDS = (
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "bad_words",
)

# OpenAI's limits for these parameters.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0


def _bias_problems(params: SamplingParams) -> list[str]:
    """Normalize logit_bias to sorted (id, bias) pairs; what is wrong with it."""
    raw = params.logit_bias
    try:
        pairs = list(raw.items()) if isinstance(raw, dict) else [tuple(p) for p in raw]
    except TypeError:
        return [f"logit_bias must map token ids to numbers, got {raw!r}"]
    problems = []
    seen: dict[int, float] = {}
    for pair in pairs:
        token, bias = pair if len(pair) == 2 else (None, None)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            problems.append(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        elif not _finite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            problems.append(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {bias!r} for token {token}"
            )
        else:
            seen[token] = float(bias)
    object.__setattr__(params, "logit_bias", tuple(sorted(seen.items())))
    return problems


def _processing_problems(params: SamplingParams) -> list[str]:
    problems = []
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(params, name)
        if not _finite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            problems.append(f"{name} must be in [-2, 2], got {value!r}")
    if not _finite(params.repetition_penalty) or params.repetition_penalty <= 0:
        problems.append(
            f"repetition_penalty must be a number > 0 (1 disables), got "
            f"{params.repetition_penalty!r}"
        )
    if not _finite(params.min_p) or not 0 <= params.min_p <= 1:
        problems.append(f"min_p must be in [0, 1], got {params.min_p!r}")
    min_tokens = params.min_tokens
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        problems.append(f"min_tokens must be an integer >= 0, got {min_tokens!r}")
    elif isinstance(params.max_tokens, int) and min_tokens > params.max_tokens:
        problems.append(
            f"min_tokens ({min_tokens}) must not exceed max_tokens ({params.max_tokens})"
        )
    if any(not isinstance(w, str) or not w.strip() for w in params.bad_words):
        problems.append(f"bad_words must be non-blank strings, got {params.bad_words!r}")
    return problems


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# Samples one prompt may ask for at once (OpenAI's `n`; vLLM and OpenAI cap it at 128 too).
MAX_SAMPLES = 128


@dataclass(frozen=True)
class SampleOf:
    """Marks a request as sample `index` of `count` drawn from one prompt (OpenAI's `n`).

    The samples of a group are separate requests with the same prompt and sampling (seeds
    differ), made by `engines.samples.fan_out`. An engine may compute the prompt once for the
    whole group (the reference engine forks the first member's KV after its prefill); one
    that ignores the mark still serves every sample correctly, just without the sharing.
    """

    group_id: str
    index: int  # 0 .. count - 1
    count: int


Pooling = Literal["last", "mean"]
POOLINGS: tuple[str, ...] = ("last", "mean")


@dataclass(frozen=True)
class EmbedParams:
    """Asks for the prompt's embedding instead of a completion (prefill only, no output token).

    The embedding is the final hidden state after the model's final norm, pooled over the
    prompt and optionally L2-normalised, as float32. None takes the model's default: its
    sentence-transformers config (`modules.json` / `1_Pooling/config.json`) where the
    checkpoint has one, otherwise last-token pooling with normalisation (vLLM's default for
    decoder-only models).
    """

    pooling: Pooling | None = None  # "last": the last prompt token's state; "mean": the mean
    normalize: bool | None = None  # divide by the L2 norm

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ValueError(
                f"embed pooling must be one of {', '.join(POOLINGS)} (or null for the model's "
                f"default), got {self.pooling!r}"
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"embed normalize must be true, false or null, got {self.normalize!r}")


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt as the model's own processor made it (in the prompt stage, on CPU
    workers): the reference engine only runs the encoder. The prompt holds the image's
    placeholder tokens already expanded, one per image token, in the order of `images`.

    Engines that run the model's processor themselves (TensorRT-LLM) take `source`, the image
    file, instead of the pixels; the prompt stage fills the one the engine kind reads."""

    # float32 [patches, channels x frames x patch x patch], row-major bytes of a numpy array,
    # so the type stays torch-free and pickles compactly across Ray and process pipes. Empty
    # when the engine reads `source` (a 1-megapixel photo's pixels are ~24 MB, its JPEG ~100x less).
    pixel_values: bytes
    grid_thw: tuple[int, int, int]  # patch grid (frames, rows, columns) of the processed image
    # Digest of the image's pixels: equal images share prefix-cache blocks, different never.
    content_hash: str
    # The image file as it was read (PNG, JPEG, ...; already decoded once within the limits of
    # prompt.images), for engines that process it themselves; empty for the reference engine.
    source: bytes = b""

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete (or, with `embed` set, to embed). The engine batches many of
    these itself."""

    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    sample_of: SampleOf | None = None  # one of n samples of the same prompt; None: alone
    # Set: embed the prompt (sampling is ignored; the result carries `embedding`, no tokens,
    # finish_reason "stop"). An engine that cannot embed answers a row error saying so.
    embed: EmbedParams | None = None
    # The LoRA adapter to generate with, by the name the engine knows it by; None: the base
    # model. An adapter the engine does not know (or cannot use) is this request's error.
    adapter: str | None = None
    # The prompt's images, in placeholder order; empty for text. An engine or model that
    # cannot take images answers this request's error saying so.
    images: tuple[ImageInput, ...] = ()


@dataclass
class RequestMetrics:
    """Monotonic timestamps of one request's life in the engine (None: never reached)."""

    arrival_time: float  # the request entered the engine
    first_scheduled_time: float | None = None  # first step that computed any of its tokens
    first_token_time: float | None = None  # its first output token was sampled
    finish_time: float | None = None  # it left the engine (finished, failed or cancelled)

    @property
    def queue_s(self) -> float | None:
        return _delta(self.arrival_time, self.first_scheduled_time)

    @property
    def ttft_s(self) -> float | None:
        return _delta(self.arrival_time, self.first_token_time)

    @property
    def decode_s(self) -> float | None:
        return _delta(self.first_token_time, self.finish_time)

    @property
    def latency_s(self) -> float | None:
        return _delta(self.arrival_time, self.finish_time)


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


@dataclass
class GenerationResult:
    """What came of one request. Per-request problems are results, not exceptions."""

    request_id: str
    output_token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    error: str | None = None  # set iff finish_reason == "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    num_preemptions: int = 0  # times the request was evicted and recomputed
    metrics: RequestMetrics | None = None
    # One per output token id (in order) when sampling.logprobs was set; else None.
    logprobs: list[TokenLogprob] | None = None
    # One per prompt token when sampling.prompt_logprobs was set (None for the first token,
    # which nothing predicts); else None.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Speculative decoding: tokens proposed for this request and verified by the model, and
    # how many of them it accepted (0 and 0 without speculation, or where the engine does
    # not report them per request).
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Steps that verified proposals for it (accepted / this: mean accepted per verification).
    spec_verifications: int = 0
    # The pooled prompt embedding (float32 values) when the request set `embed`; else None.
    embedding: list[float] | None = None

    @property
    def ok(self) -> bool:
        return self.finish_reason != "error"

    @classmethod
    def without_output(
        cls,
        request: GenerationRequest,
        finish_reason: FinishReason,
        error: str | None = None,
        metrics: RequestMetrics | None = None,
    ) -> GenerationResult:
        """The result of a request that produced no token: refused, failed or cancelled."""
        return cls(
            request_id=request.request_id,
            output_token_ids=[],
            text="",
            finish_reason=finish_reason,
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=0,
            error=error,
            metrics=metrics,
        )


@dataclass(frozen=True)
class StreamDelta:
    """One increment of a streamed request: new token ids and the text they completed.

    The last delta of a stream has `finished=True` and carries the full result.
    """

    token_ids: list[int]
    text: str
    finished: bool = False
    result: GenerationResult | None = None
    logprobs: list[TokenLogprob] | None = None  # for token_ids, when requested
    # On a request's first delta when sampling.prompt_logprobs was set (see GenerationResult).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class StepRecord:
    """One engine step: its duration and the tokens each request processed in it.

    The cost module shares [start, end) among the requests in proportion to their (weighted)
    tokens, so the record must list every request the step computed for.
    """

    start: float  # monotonic seconds
    end: float
    prefill_tokens: dict[str, int]  # request_id -> prompt tokens computed in this step
    # request_id -> positions computed for its output in this step: 1 for a plain decode,
    # 1 + k when it verified k speculative proposals (all of them its cost, accepted or not).
    decode_tokens: dict[str, int]
    # Speculative decoding, for the requests that verified proposals in this step:
    # request_id -> tokens proposed, and of them accepted.
    spec_proposed_tokens: dict[str, int] = field(default_factory=dict)
    spec_accepted_tokens: dict[str, int] = field(default_factory=dict)
    # Mixture-of-Experts models: tokens per expert in this step, the busiest expert of any
    # layer and the mean (tokens x experts per token / experts); None for dense models.
    expert_tokens_max: int | None = None
    expert_tokens_mean: float | None = None

    @property
    def request_ids(self) -> set[str]:
        return set(self.prefill_tokens) | set(self.decode_tokens)


@dataclass(frozen=True)
class EngineInfo:
    """Static facts about a loaded engine, for manifests, cost and the Serve /v1/models."""

    kind: str  # "reference" | "trtllm" | "vllm"
    model: str  # model path or name as given
    max_model_len: int  # prompt + output tokens the model accepts
    device: str  # "cpu", "cuda:0", ...
    num_devices: int  # devices this engine holds (cost: devices x lifetime)
    dtype: str  # compute dtype
    has_step_records: bool  # True: step-based cost split; False: interval-based
    eos_token_ids: tuple[int, ...] = ()
    load_seconds: float = 0.0  # time spent loading weights and warming up
    # Known ways this engine departs from the request contract (e.g. seeds not honoured) or
    # from its usual path on this machine (e.g. a slower fallback the CPU forces), one sentence
    # each; surfaced in the run's manifest and logs so a user learns them up front.
    limitations: tuple[str, ...] = ()
    # Values in one embedding (the model's hidden size) where the engine embeds; else None.
    embedding_size: int | None = None


@dataclass(frozen=True)
class EngineStats:
    """A point-in-time view of the engine's load, for metrics and tests."""

    num_running: int  # requests holding KV blocks
    num_waiting: int  # requests queued, not yet scheduled (includes preempted ones)
    num_finished: int  # requests finished since load
    num_preemptions: int  # evictions since load
    kv_blocks_total: int
    kv_blocks_used: int
    num_steps: int
    # Speculative decoding since load: tokens proposed and verified, and of them accepted.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0


@runtime_checkable
class Engine(Protocol):
    """What every engine offers. All methods may be called from one asyncio loop; the engine
    runs its own step loop (a thread or an executor) and batches concurrent requests itself."""

    info: EngineInfo

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Run one request to completion. Never raises for a per-request problem (too long a
        prompt, ...): that is a result with finish_reason "error". Raises EngineDeadError once
        the engine has stopped."""
        ...

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        """Like generate, yielding deltas as tokens are produced. Closing the iterator early
        (client gone) cancels the request and frees its KV blocks."""
        ...

    def abort(self, request_id: str) -> None:
        """Cancel a request; its generate() returns finish_reason "cancelled"."""
        ...

    def drain_step_records(self) -> list[StepRecord]:
        """Step records since the last call (empty for engines without step records)."""
        ...

    def stats(self) -> EngineStats: ...

    def shutdown(self) -> None:
        """Stop the step loop and release memory. Idempotent."""
        ...

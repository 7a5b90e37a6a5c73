"""Pure parts of the Serve endpoint: serve spec, API keys, OpenAI parsing, caps, cost split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.api import EngineInfo
from pipeline.openai.errors import ApiError
from pipeline.openai.models import (
    MAX_NAMED_FIELDS,
    WARNING_HEADER,
    ignored_warning,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
    strict_mode,
)
from pipeline.openai.responses import (
    ResponseIds,
    Usage,
    chunk_body,
    completion_body,
    usage_chunk_body,
)
from pipeline.openai.sse import sse
from pipeline.serve.access.auth import AuthConfigError, load_key_digests
from pipeline.serve.protocol.requests import capped_max_tokens, parse_request, to_engine_request
from pipeline.serve.replicas.cost import EqualShareMeter
from pipeline.serve.spec import (
    AuthSpec,
    ServedModelSpec,
    engine_deployment_options,
    load_serve_spec,
    parse_serve_spec,
)
from pipeline.spec import SpecError

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "hi"}]


# --- serve spec ------------------------------------------------------------------------------


def test_example_serve_file_is_valid() -> None:
    spec = load_serve_spec(REPO / "jobs" / "serve.yaml")
    assert spec.models[0].name == "tiny-llama"
    assert spec.auth.api_keys_env == "TOKENMILL_API_KEYS"


def test_spec_rejects_duplicates_bad_bounds_and_row_templates() -> None:
    model = {"name": "m", "model": {"path": "/x"}}
    with pytest.raises(SpecError, match="duplicate name"):
        parse_serve_spec({"models": [model, model]})
    with pytest.raises(SpecError, match="min_replicas must be <= "):
        parse_serve_spec({"models": [{**model, "replicas": {"min_replicas": 3}}]})
    with pytest.raises(SpecError, match="template"):
        parse_serve_spec({"models": [{**model, "prompt": {"template": "{{ x }}"}}]})


def test_adapters_share_one_namespace_with_the_models_and_route_to_theirs() -> None:
    base = {"name": "base", "model": {"path": "/x", "adapters": {"ft-a": "/a", "ft-b": "/b"}}}
    other = {"name": "other", "model": {"path": "/y", "adapters": {"ft-c": "/c"}}}
    spec = parse_serve_spec({"models": [base, other]})
    assert spec.served_names() == ["base", "other", "ft-a", "ft-b", "ft-c"]
    assert [(m.name, a) for m, a in [spec.route("base"), spec.route("ft-b"), spec.route("ft-c")]]
    assert spec.route("ft-b")[0].name == "base" and spec.route("ft-b")[1] == "ft-b"
    assert spec.route("other")[1] is None and spec.route("ft-c")[0].name == "other"
    assert spec.route("nope") is None
    # An adapter named like a model, or like another model's adapter: refused, naming both.
    clash = {"name": "other", "model": {"path": "/y", "adapters": {"base": "/c"}}}
    with pytest.raises(SpecError, match=r"models\[other\].model.adapters.base.*model 'base'"):
        parse_serve_spec({"models": [base, clash]})
    twice = {"name": "other", "model": {"path": "/y", "adapters": {"ft-a": "/c"}}}
    with pytest.raises(SpecError, match=r"adapters.ft-a.*an adapter of 'base'"):
        parse_serve_spec({"models": [base, twice]})


def test_names_not_listed_route_to_the_one_model_with_an_adapter_prefix() -> None:
    from engines.api import GenerationResult
    from pipeline.serve.gateway import result_error

    base = {"name": "base", "model": {"path": "/x", "adapters": {"ft-a": "/a"}}}
    lib = {"name": "lib", "model": {"path": "/y", "adapter_prefix": "s3://b/adapters"}}
    spec = parse_serve_spec({"models": [base, lib]})
    assert spec.route("ft-a")[0].name == "base"  # listed: its own model
    found = spec.route("ft-new")
    assert found is not None and (found[0].name, found[1]) == ("lib", "ft-new")
    assert spec.served_names() == ["base", "lib", "ft-a"]  # only what is listed is listed
    with pytest.raises(SpecError, match="adapter_prefix on more than one model"):
        parse_serve_spec({"models": [{**base, "model": {**lib["model"]}}, lib]})
    # The engine's "no such adapter" is OpenAI's 404 for a model it does not have.
    missing = GenerationResult(
        "r", [], "", "error", 3, 0, error="unknown adapter 'ft-new': no adapter_config.json"
    )
    error = result_error("lib", missing)
    assert error is not None and (error.status, error.code, error.param) == (
        404,
        "model_not_found",
        "model",
    )
    broken = GenerationResult("r", [], "", "error", 3, 0, error="engine died")
    assert result_error("lib", broken).status == 500  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "data",
    [
        {"token": "x"},
        {"auth": {"secret": "x"}},
        {"http": {"Password": "x"}},
        {"storage": {"aws_secret_access_key": "x"}},
        {"note": "sk-abcdefghijkl"},
    ],
)
def test_spec_rejects_anything_key_looking(data: dict) -> None:
    base = {"models": [{"name": "m", "model": {"path": "/x"}}]}
    with pytest.raises(SpecError, match="never go in the serve file"):
        parse_serve_spec({**base, **data})


def test_token_counts_are_not_mistaken_for_secrets() -> None:
    spec = parse_serve_spec(
        {
            "models": [
                {
                    "name": "m",
                    "model": {"path": "/x"},
                    "engine": {"max_num_tokens": 64, "kv_cache_tokens": 128},
                    "limits": {"max_tokens": 10, "default_max_tokens": 5},
                }
            ]
        }
    )
    assert spec.models[0].limits.max_tokens == 10


# --- keys ------------------------------------------------------------------------------------


def test_keys_from_env_and_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# rotated 2026-01\nfile-key\n\n")
    auth = AuthSpec(api_keys_file=str(keys_file))
    digests = load_key_digests(auth, env={"TOKENMILL_API_KEYS": "a, b"})
    assert len(digests.digests) == 3
    assert all(k not in repr(digests) for k in ("file-key", "'a'"))  # only digests are kept
    assert digests.accepts("Bearer a") and digests.accepts("bearer file-key")
    for header in (None, "", "Bearer", "Bearer c", "Basic a", "a"):
        assert not digests.accepts(header)


def test_no_keys_is_an_error_unless_insecure() -> None:
    with pytest.raises(AuthConfigError, match="TOKENMILL_API_KEYS"):
        load_key_digests(AuthSpec(), env={})
    open_door = load_key_digests(AuthSpec(), insecure_no_auth=True, env={})
    assert open_door.insecure and open_door.accepts(None)


# --- request parsing -------------------------------------------------------------------------


def test_supported_parameters_map_through() -> None:
    request = parse_chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "seed": 3,
            "stop": "END",
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "u1",
            "top_k": 4,
            "ignore_eos": True,
            # Unsupported parameters at their neutral values pass.
            "n": 1,
            "logprobs": False,
            "presence_penalty": 0,
            "response_format": {"type": "text"},
        }
    )
    assert request.requested_max_tokens == 7
    assert request.messages[1].text == "ab"
    assert request.stop_list == ("END",)
    assert request.include_usage


@pytest.mark.parametrize(
    ("changes", "param", "code"),
    [
        ({"n": 0}, "n", "invalid_value"),
        ({"n": 129}, "n", "invalid_value"),
        ({"best_of": 3}, "best_of", "unsupported_parameter"),
        # Tools are read (pipeline.openai.tools): a malformed one is named where it is wrong.
        ({"tools": [{"type": "function"}]}, "tools[0].function", "invalid_value"),
        ({"tool_choice": "auto"}, "tool_choice", "invalid_value"),  # auto with no tools
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"logprobs": "yes"}, "logprobs", "invalid_value"),
        ({"top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"response_format": "json"}, "response_format", "invalid_value"),
        ({"frequency_penalty": "0.5"}, "frequency_penalty", "invalid_value"),
        ({"n": True}, "n", "invalid_value"),
        ({"temperature": "0.5"}, "temperature", "invalid_value"),
        ({"temperature": 3}, "temperature", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        # vLLM extras: length_penalty is known but not implemented; the others are checked.
        ({"length_penalty": 0.5}, "length_penalty", "unsupported_parameter"),
        ({"logit_bias": {"a": 1}}, "logit_bias", "invalid_value"),
        ({"bad_words": [1]}, "bad_words", "invalid_value"),
        ({"guided_json": {"type": "object"}}, "guided_json", "unsupported_parameter"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0", "invalid_value"),
        ({"stop_token_ids": "2"}, "stop_token_ids", "invalid_value"),
        ({"top_k": -2}, "top_k", "invalid_value"),
        ({"top_k": 1.5}, "top_k", "invalid_value"),
        ({"ignore_eos": "yes"}, "ignore_eos", "invalid_value"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "invalid_value"),
        (
            {"chat_template_kwargs": {"tokenize": True}},
            "chat_template_kwargs.tokenize",
            "invalid_value",
        ),
        # Harmless bookkeeping fields are accepted with any value, but typed.
        ({"store": "yes"}, "store", "invalid_value"),
        ({"metadata": {"a": 1}}, "metadata.a", "invalid_value"),
        ({"messages": None}, "messages", "invalid_value"),
    ],
)
def test_bad_chat_parameters_are_named(changes: dict, param: str, code: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat_request({"model": "m", "messages": MESSAGES, **changes})
    assert info.value.status == 400
    assert info.value.param == param and info.value.code == code


def test_completion_prompts() -> None:
    assert parse_completion_request({"model": "m", "prompt": "x"}).prompt == "x"
    assert parse_completion_request({"model": "m", "prompt": [1, 2]}).prompt == [1, 2]
    assert parse_completion_request({"model": "m", "prompt": ["x"]}).prompt == ["x"]
    for prompt in (["a", "b"], [[1], [2]], []):
        with pytest.raises(ApiError) as info:
            parse_completion_request({"model": "m", "prompt": prompt})
        assert info.value.param == "prompt"


@pytest.mark.parametrize("raw", [b"{", b"[]", b'"x"', b"\xff\xfe"])
def test_body_must_be_a_json_object(raw: bytes) -> None:
    with pytest.raises(ApiError) as info:
        parse_json_body(raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"


# --- caps ------------------------------------------------------------------------------------


def _served(**limits) -> ServedModelSpec:
    return ServedModelSpec.model_validate(
        {"name": "m", "model": {"path": "/x"}, "limits": {"max_tokens": 100, **limits}}
    )


def _info(max_model_len: int) -> EngineInfo:
    return EngineInfo("reference", "/x", max_model_len, "cpu", 1, "float32", True)


def test_max_tokens_caps_and_defaults() -> None:
    served, info = _served(default_max_tokens=50), _info(120)
    assert capped_max_tokens(served, info, 10, None, 50, "messages").value == 50
    assert capped_max_tokens(served, info, 100, None, 50, "messages").value == 20  # room
    exact = capped_max_tokens(served, info, 10, 100, 50, "messages")
    assert exact.value == 100 and exact.warning is None
    for num_prompt in (120, 200):  # the prompt alone fills the context: nothing to clamp
        with pytest.raises(ApiError) as err:
            capped_max_tokens(served, info, num_prompt, None, 50, "messages")
        assert err.value.status == 400 and err.value.param == "messages"
        assert err.value.code == "context_length_exceeded"
    with pytest.raises(ApiError, match="at most 8 prompt tokens"):
        capped_max_tokens(
            _served(default_max_tokens=5, max_prompt_tokens=8), info, 9, None, 5, "prompt"
        )


def test_max_tokens_over_the_cap_or_the_context_is_clamped_with_a_warning() -> None:
    served, info = _served(default_max_tokens=50), _info(120)
    over_cap = capped_max_tokens(served, info, 10, 5000, 50, "messages")
    assert over_cap.value == 100
    assert over_cap.warning == "max_tokens 5000 clamped to 100 (model 'm' allows at most 100)"
    over_room = capped_max_tokens(served, info, 30, 100, 50, "prompt", param="max_tokens")
    assert over_room.value == 90
    assert (
        over_room.warning is not None and "leaves 90 of the 120-token context" in over_room.warning
    )
    over_both = capped_max_tokens(served, info, 110, 5000, 50, "messages", "max_completion_tokens")
    assert over_both.value == 10
    assert over_both.warning == (  # only the bound that set the value is named
        "max_completion_tokens 5000 clamped to 10 "
        "(the 110-token messages leaves 10 of the 120-token context)"
    )
    tie = capped_max_tokens(served, info, 20, 5000, 50, "messages")
    assert tie.value == 100 and tie.warning is not None
    assert "at most 100 and the 20-token messages leaves 100" in tie.warning


# --- tolerance: unknown fields, strict mode, extras -------------------------------------------


def test_unknown_fields_are_ignored_and_named() -> None:
    request = parse_chat_request(
        {
            "model": "m",
            "messages": MESSAGES,
            "verbosity": "low",  # a newer OpenAI field
            "skip_special_tokens": True,  # a vLLM extra this server does not know
            "stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False},
        }
    )
    assert request.ignored_fields == (
        "verbosity",
        "skip_special_tokens",
        "stream_options.include_obfuscation",
    )
    assert request.include_usage
    completion = parse_completion_request({"model": "m", "prompt": "x", "chat_template_kwargs": {}})
    assert completion.ignored_fields == ("chat_template_kwargs",)  # chat-only extension
    assert parse_chat_request({"model": "m", "messages": MESSAGES}).ignored_fields == ()


def test_strict_mode_refuses_unknown_fields_by_name() -> None:
    body = {"model": "m", "messages": MESSAGES, "foo": 1, "bar": 2}
    with pytest.raises(ApiError) as info:
        parse_chat_request(body, strict=True)
    assert info.value.status == 400 and info.value.code == "unknown_parameter"
    assert info.value.param == "foo" and "foo, bar" in info.value.message
    with pytest.raises(ApiError, match=r"stream_options\.x"):
        parse_completion_request(
            {"model": "m", "prompt": "x", "stream_options": {"x": 1}}, strict=True
        )
    # Known-but-unsupported values are refused in either mode.
    with pytest.raises(ApiError, match="'best_of'"):
        parse_completion_request({"model": "m", "prompt": "x", "best_of": 2})
    assert parse_chat_request({"model": "m", "messages": MESSAGES, "n": 4}).n == 4


def test_strict_mode_header_overrides_the_serve_file() -> None:
    assert strict_mode(None, False) is False and strict_mode("", True) is True
    assert strict_mode("1", False) is True and strict_mode(" TRUE ", False) is True
    assert strict_mode("0", True) is False and strict_mode("no", True) is False
    with pytest.raises(ApiError) as info:
        strict_mode("maybe", False)
    assert info.value.status == 400 and "x-tokenmill-strict" in info.value.message
    spec = parse_serve_spec({"models": [{"name": "m", "model": {"path": "/x"}}]})
    assert spec.http.strict_fields is False
    strict = parse_serve_spec(
        {"models": [{"name": "m", "model": {"path": "/x"}}], "http": {"strict_fields": True}}
    )
    assert strict.http.strict_fields is True


def test_warning_names_are_header_safe_and_bounded() -> None:
    names = tuple(f"f{i}\r\nSet-Cookie: x" for i in range(MAX_NAMED_FIELDS + 3))
    warning = ignored_warning(names)
    assert warning.isascii() and "\n" not in warning and "\r" not in warning
    assert warning.startswith("ignored unknown fields: f0?") and warning.endswith(" and 3 more")


def test_harmless_fields_are_accepted_with_any_value() -> None:
    request = parse_chat_request(
        {
            "model": "m",
            "messages": MESSAGES,
            "n": 1,
            "logprobs": False,
            "parallel_tool_calls": True,
            "store": True,
            "metadata": {"team": "search"},
            "user": "u1",
            "service_tier": "flex",
            "safety_identifier": "s",
            "prompt_cache_key": "k",
            "min_p": 0,
            "repetition_penalty": 1.0,
            "add_generation_prompt": True,
        }
    )
    assert request.ignored_fields == ()


class _FakeTokenizer:
    """PromptTokenizer's interface: one token per character, template kwargs recorded."""

    has_chat_template = True
    vocab_size = 1000
    reasoning = None  # no prompt.reasoning: answers are not split

    def __init__(self) -> None:
        self.template_kwargs: dict | None = None

    def chat_ids(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        self.template_kwargs = template_kwargs
        return [ord(c) for m in messages for c in m["content"]]

    def completion_ids(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_extras_reach_sampling_params_and_warnings_reach_the_header() -> None:
    served, info, tokenizer = _served(default_max_tokens=50), _info(120), _FakeTokenizer()
    body = {
        "model": "m",
        "messages": MESSAGES,
        "max_tokens": 5000,
        "top_k": 7,
        "stop_token_ids": [5, 9],
        "ignore_eos": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "foo": 1,
    }
    prepared = to_engine_request(parse_request(body, "chat"), "chat", served, tokenizer, info)
    sampling = prepared.engine_request.sampling
    assert (sampling.top_k, sampling.stop_token_ids, sampling.ignore_eos) == (7, (5, 9), True)
    assert sampling.max_tokens == 100
    assert tokenizer.template_kwargs == {"enable_thinking": False}
    assert prepared.headers == {
        WARNING_HEADER: "ignored unknown fields: foo; "
        "max_tokens 5000 clamped to 100 (model 'm' allows at most 100)"
    }
    plain = {"model": "m", "prompt": "hello", "top_k": -1, "ignore_eos": None}
    prepared = to_engine_request(
        parse_request(plain, "completions"), "completions", served, tokenizer, info
    )
    sampling = prepared.engine_request.sampling
    assert (sampling.top_k, sampling.ignore_eos, sampling.stop_token_ids) == (0, False, ())
    assert sampling.max_tokens == 16 and prepared.headers == {}


# --- response bodies -------------------------------------------------------------------------


def _usage() -> Usage:
    return Usage(10, 5, 4, gpu_seconds=0.5, cost_usd=1e-4, list_price_usd=2e-6)


def test_usage_and_whole_bodies() -> None:
    usage = _usage().body()
    assert usage["total_tokens"] == 15 and usage["prompt_tokens_details"] == {"cached_tokens": 4}
    assert usage["cost_usd"] == 1e-4 and usage["list_price_usd"] == 2e-6
    no_prices = Usage(1, 1, 0, 0.1, 0.0, None).body()
    assert "list_price_usd" not in no_prices

    chat = completion_body(ResponseIds.new("chat", "r1", "m"), "hey", "stop", _usage())
    assert chat["id"] == "chatcmpl-r1" and chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hey", "refusal": None}
    text = completion_body(ResponseIds.new("completions", "r2", "m"), "hey", "length", _usage())
    assert text["id"] == "cmpl-r2" and text["object"] == "text_completion"
    assert text["choices"][0]["text"] == "hey" and text["choices"][0]["finish_reason"] == "length"


def test_stream_chunks() -> None:
    ids = ResponseIds.new("chat", "r", "m")
    opener = chunk_body(ids, role=True, include_usage=True)
    assert opener["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert opener["usage"] is None
    delta = chunk_body(ids, text="ab")
    assert delta["choices"][0]["delta"] == {"content": "ab"} and "usage" not in delta
    finish = chunk_body(ids, finish_reason="stop")
    assert finish["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    last = usage_chunk_body(ids, _usage())
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    framed = sse(delta)
    assert framed.startswith(b"data: {") and framed.endswith(b"\n\n")
    assert json.loads(framed[6:]) == delta


# --- cost split ------------------------------------------------------------------------------


def test_equal_share_meter_splits_busy_time_exactly() -> None:
    meter = EqualShareMeter(devices=2)
    meter.enter("a", 0.0)
    meter.enter("b", 1.0)  # a alone for 1 s
    a = meter.leave("a", 3.0)  # a and b share 2 s
    meter.enter("c", 5.0)  # b alone 3..5
    b = meter.leave("b", 6.0)  # b and c share 1 s
    c = meter.leave("c", 7.0)  # c alone 1 s
    assert a == pytest.approx(2 * (1 + 1))
    assert b == pytest.approx(2 * (1 + 2 + 0.5))
    assert c == pytest.approx(2 * (0.5 + 1))
    assert a + b + c == pytest.approx(2 * 7.0)  # every busy second, on both devices
    assert meter.leave("unknown", 8.0) == 0.0


# --- deployment options ----------------------------------------------------------------------


def test_replica_settings_become_serve_options() -> None:
    fixed = ServedModelSpec.model_validate(
        {
            "name": "m",
            "model": {"path": "/x"},
            "replicas": {"min_replicas": 2, "max_replicas": 2, "max_queued_requests": 5},
        }
    )
    options = engine_deployment_options(fixed)
    assert options["num_replicas"] == 2 and "autoscaling_config" not in options
    assert options["max_queued_requests"] == 5 and options["name"] == "engine-m"

    scaled = ServedModelSpec.model_validate(
        {
            "name": "m",
            "model": {"path": "/x"},
            "replicas": {
                "min_replicas": 1,
                "max_replicas": 4,
                "target_ongoing_requests": 8,
                "devices_per_replica": 1,
            },
        }
    )
    options = engine_deployment_options(scaled)
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 8,
    }
    assert options["ray_actor_options"]["num_gpus"] == 1

"""Pure parts of the Serve endpoint: serve spec, API keys, OpenAI parsing, caps, cost split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.api import EngineInfo
from pipeline.serve.auth import AuthConfigError, load_key_digests
from pipeline.serve.cost import EqualShareMeter
from pipeline.serve.protocol import (
    ApiError,
    ResponseIds,
    Usage,
    chunk_body,
    completion_body,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
    sse,
    usage_chunk_body,
)
from pipeline.serve.requests import capped_max_tokens
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
        ({"n": 2}, "n", "unsupported_parameter"),
        ({"best_of": 3}, "best_of", "unsupported_parameter"),
        ({"tools": [{"type": "function"}]}, "tools", "unsupported_parameter"),
        ({"tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"logprobs": True}, "logprobs", "unsupported_parameter"),
        ({"top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
        ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "unsupported_parameter"),
        ({"n": True}, "n", "unsupported_parameter"),
        ({"temperature": "0.5"}, "temperature", "invalid_value"),
        ({"temperature": 3}, "temperature", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"bogus": 1}, "bogus", "unknown_parameter"),
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
    assert capped_max_tokens(served, info, 10, None, 50, "messages") == 50
    assert capped_max_tokens(served, info, 100, None, 50, "messages") == 20  # clipped to room
    assert capped_max_tokens(served, info, 10, 100, 50, "messages") == 100
    cases = [
        (10, 101, "max_tokens"),  # over the server's cap
        (30, 100, "max_tokens"),  # prompt + max_tokens over the context
        (120, None, "messages"),  # the prompt alone fills the context
    ]
    for num_prompt, requested, param in cases:
        with pytest.raises(ApiError) as err:
            capped_max_tokens(served, info, num_prompt, requested, 50, "messages")
        assert err.value.status == 400 and err.value.param == param
    with pytest.raises(ApiError, match="at most 8 prompt tokens"):
        capped_max_tokens(
            _served(default_max_tokens=5, max_prompt_tokens=8), info, 9, None, 5, "prompt"
        )


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

"""`tokenmill serve` tolerance: unknown fields, strict mode, max_tokens clamps, vLLM extras and
a served model whose name holds a slash, through the official OpenAI client.

The model named `org/tiny-7b` (the name is the point: `/v1/models/{model}` must take
slashes) is `tiny` renamed, on the shared server (tests/e2e/serve_fixtures.py). Greedy and
seeded outputs are checked against the reference engine run in this process on the same token
ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

import httpx
import openai
import pydantic
import pytest

from tests.e2e.serve_fixtures import (
    API_KEY,
    MAX_MODEL_LEN,
    MAX_TOKENS_CAP,
    SLASHED_MODEL,
    ServerProcess,
    chat_ids,
    local_engine,
    run_engine,
    slashed_model,
)

pytestmark = pytest.mark.timeout(600)

MODEL = SLASHED_MODEL
WARNING = "x-tokenmill-warning"
STRICT = {"x-tokenmill-strict": "1"}
CHAT = [{"role": "user", "content": "Tell me about the river and the bridge."}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(serve_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(serve_model_dir))


@pytest.fixture(scope="module")
def engine(serve_model_dir: Path):
    """The reference engine with the served model's settings, run in this process."""
    with local_engine(serve_model_dir, slashed_model(serve_model_dir)) as eng:
        yield eng


# --- model names with a slash ----------------------------------------------------------------


def test_model_named_with_a_slash_is_listed_retrieved_and_served(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    assert MODEL in [m.id for m in client.models.list()]
    assert client.models.retrieve(MODEL).id == MODEL  # the client sends org%2Ftiny-7b
    headers = {"Authorization": f"Bearer {API_KEY}"}
    raw = httpx.get(f"{server.api_url}/models/{MODEL}", headers=headers, timeout=30)
    assert raw.status_code == 200 and raw.json()["id"] == MODEL
    missing = httpx.get(f"{server.api_url}/models/org/nope", headers=headers, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert reply.model == MODEL and reply.usage.completion_tokens >= 1


# --- unknown fields --------------------------------------------------------------------------


def test_unknown_fields_are_ignored_and_named_in_the_header(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=3,
        temperature=0,
        extra_body={"future_field": {"a": 1}, "skip_special_tokens": True},
    )
    assert raw.status_code == 200
    assert raw.headers[WARNING] == "ignored unknown fields: future_field, skip_special_tokens"
    assert raw.parse().usage.completion_tokens >= 1
    # Without anything to report, no header.
    clean = client.completions.with_raw_response.create(
        model=MODEL, prompt="the river", max_tokens=2
    )
    assert clean.status_code == 200 and WARNING not in clean.headers


def test_streamed_response_carries_the_warning_header(client: openai.OpenAI) -> None:
    with client.completions.with_streaming_response.create(
        model=MODEL,
        prompt="the river",
        max_tokens=3,
        stream=True,
        extra_body={"chat_template_kwargs": {"x": 1}},  # chat-only: unknown on completions
    ) as response:
        assert response.status_code == 200
        assert response.headers[WARNING] == "ignored unknown fields: chat_template_kwargs"
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"


def test_strict_mode_refuses_unknown_fields(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=2,
            extra_body={"future_field": 1},
            extra_headers=STRICT,
        )
    assert info.value.code == "unknown_parameter" and info.value.param == "future_field"
    assert "future_field" in info.value.message
    # Known semantics the server cannot honour are a 400 in either mode.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_body={"length_penalty": 0.5}
        )
    assert info.value.code == "unsupported_parameter" and info.value.param == "length_penalty"
    # ... and at their neutral values they pass, strict or not.
    ok = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=2,
        n=1,
        logprobs=False,
        store=False,
        metadata={"team": "search"},
        user="u1",
        extra_body={"length_penalty": 1, "min_p": 0, "parallel_tool_calls": False},
        extra_headers=STRICT,
    )
    assert ok.status_code == 200 and WARNING not in ok.headers


# --- max_tokens clamps -----------------------------------------------------------------------


def test_max_tokens_over_the_cap_is_clamped(client: openai.OpenAI, engine, tokenizer) -> None:
    # Stop on the first greedy token, so a 2000-token allowance finishes at once.
    ids = chat_ids(tokenizer, CHAT)
    first = run_engine(engine, ids, max_tokens=1).output_token_ids[0]
    asked = MAX_TOKENS_CAP + 3000
    for name in ("max_tokens", "max_completion_tokens"):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=CHAT,
            temperature=0,
            extra_body={name: asked, "stop_token_ids": [first]},
        )
        assert raw.status_code == 200
        assert raw.headers[WARNING] == (
            f"{name} {asked} clamped to {MAX_TOKENS_CAP} (model '{MODEL}' allows at most "
            f"{MAX_TOKENS_CAP})"
        )
        reply = raw.parse()
        assert reply.usage.completion_tokens == 1
        assert reply.choices[0].finish_reason == "stop"


def test_max_tokens_past_the_context_is_clamped_to_what_fits(
    client: openai.OpenAI, tokenizer
) -> None:
    room = 4
    prompt = [(7 * i) % (len(tokenizer) - 10) + 5 for i in range(MAX_MODEL_LEN - room)]
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=100, extra_body={"ignore_eos": True}
    )
    assert raw.status_code == 200
    assert raw.headers[WARNING] == (
        f"max_tokens 100 clamped to {room} (the {len(prompt)}-token prompt leaves {room} of "
        f"the {MAX_MODEL_LEN}-token context)"
    )
    reply = raw.parse()
    assert reply.usage.completion_tokens == room and reply.choices[0].finish_reason == "length"


# --- vLLM extras -----------------------------------------------------------------------------


def test_vllm_extras_reach_the_engine(client: openai.OpenAI, engine, tokenizer) -> None:
    ids = chat_ids(tokenizer, CHAT)
    sampled = {"temperature": 0.9, "top_k": 3, "seed": 11, "ignore_eos": True}
    expected = run_engine(engine, ids, max_tokens=12, **sampled)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=0.9,
        seed=11,
        extra_body={"top_k": 3, "ignore_eos": True},
    )
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.completion_tokens == 12  # ignore_eos: all of them, EOS or not

    # stop_token_ids: the third greedy token ends the reply (kept in the count).
    greedy = run_engine(engine, ids, max_tokens=8, ignore_eos=True)
    stop_id = greedy.output_token_ids[2]
    expected = run_engine(engine, ids, max_tokens=8, stop_token_ids=(stop_id,))
    reply = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id], "top_k": -1},
    )
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.completion_tokens == len(expected.output_token_ids) <= 3
    assert reply.choices[0].finish_reason == "stop"


def test_chat_template_kwargs_are_passed_and_checked(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    # The tiny model's template has no such variable: same prompt, same greedy reply.
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert WARNING not in raw.headers
    reply = raw.parse()
    assert reply.choices[0].message.content == plain.choices[0].message.content
    assert reply.usage.prompt_tokens == plain.usage.prompt_tokens
    for bad, param in (
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=CHAT, extra_body=bad)
        assert info.value.param == param


# --- structured output ---------------------------------------------------------------------------


class Pet(pydantic.BaseModel):
    """What openai-python's .parse() turns into a strict json_schema response_format."""

    kind: Literal["cat", "dog"]
    age: Annotated[int, pydantic.Field(ge=0, le=30)]
    # Bounded: a random model would otherwise write one string until max_tokens.
    name: Annotated[str, pydantic.Field(max_length=8)]


def test_parse_with_a_pydantic_model_returns_a_valid_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=CHAT, response_format=Pet, max_tokens=120, temperature=0
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    pet = choice.message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")


def test_json_object_streams_valid_json_and_choice_via_extension(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0.8,
        seed=3,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    if finish == ["stop"]:
        assert isinstance(json.loads(text), dict)
    labels = ["left", "right", "up"]
    answer = client.completions.create(
        model=MODEL,
        prompt="Which way?",
        max_tokens=8,
        extra_body={"response_format": {"type": "choice", "choices": labels}},
    )
    assert answer.choices[0].text in labels


def test_bad_response_formats_are_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, response_format={"type": "xml"}, max_tokens=4
        )
    assert info.value.body["param"] == "response_format"
    # A regex the grammar engine cannot compile is found in the engine: still a 400.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=4,
            extra_body={"response_format": {"type": "regex", "regex": "a(b"}},
        )
    assert info.value.body["param"] == "response_format"
    assert "parenthesis" in info.value.body["message"]


# --- logprobs --------------------------------------------------------------------------------


def test_chat_logprobs_match_the_engine_and_stream_alike(
    client: openai.OpenAI, engine, tokenizer
) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = reply.choices[0]
    content = choice.logprobs.content
    visible = reply.usage.completion_tokens - (choice.finish_reason == "stop")
    assert len(content) == visible
    assert "".join(c.token for c in content) == choice.message.content
    expected = run_engine(engine, chat_ids(tokenizer, CHAT), 8, logprobs=3).logprobs
    for got, want in zip(content, expected, strict=False):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(
            [v for _, v in want.top], abs=1e-4
        )
        assert got.bytes == list(got.token.encode())
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [
        item
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for item in chunk.choices[0].logprobs.content
    ]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [
        (c.token, round(c.logprob, 4)) for c in content
    ]


def test_completion_logprobs_and_their_checks(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL,
        prompt="the river",
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=21)


def test_n_choices_with_a_format_in_one_hop(client: openai.OpenAI) -> None:
    """n > 1 through the one-hop shape (engine in the ingress): every choice keeps the
    format, streamed or not, and streamed choices end with their own finish chunk."""
    labels = ["left", "right", "up"]
    choice_format = {"response_format": {"type": "choice", "choices": labels}}
    answer = client.completions.create(
        model=MODEL, prompt="Which way?", max_tokens=8, n=4, seed=1, extra_body=choice_format
    )
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert all(c.text in labels and c.finish_reason == "stop" for c in answer.choices)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        n=2,
        temperature=0,
        stream=True,
    )
    texts, finished = {0: "", 1: ""}, set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and texts[0] == texts[1]

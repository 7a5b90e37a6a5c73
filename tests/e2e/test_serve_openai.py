"""`tokenmill serve` end to end: the official OpenAI client and raw HTTP against a real server.

One server per module (see serve_fixtures.py). Greedy outputs are checked against the
reference engine run directly in this process on the same model and the same chat-templated
token ids; usage against the tokenizer's own counts.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.serve_fixtures import (
    API_KEY,
    DEVICE_HOUR_USD,
    MAX_BODY_BYTES,
    MAX_TOKENS_CAP,
    OTHER_KEY,
    PRICES,
    ServerProcess,
    chat_ids,
    local_engine,
    run_engine,
    serve_config,
)

# Fixtures shared with the other serve test modules.

pytestmark = pytest.mark.timeout(600)

CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Tell me about the river and the bridge."},
]
PROMPT = "Please explain why the cluster reads every file"
READY_WITHIN_S = 30  # a hang guard: the view is refreshed every second or so


# --- helpers ---------------------------------------------------------------------------------


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
    with local_engine(serve_model_dir, serve_config(serve_model_dir)["models"][0]) as eng:
        yield eng


def scrape(server: ServerProcess) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    text = httpx.get(server.base_url + "/metrics", timeout=60).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def strict() -> dict[str, str]:
    return {**auth(), "x-tokenmill-strict": "1"}


def check_usage_cost(usage, expect_prompt: int, expect_completion: int) -> None:
    assert usage.prompt_tokens == expect_prompt
    assert usage.completion_tokens == expect_completion
    assert usage.total_tokens == expect_prompt + expect_completion
    cached = usage.prompt_tokens_details.cached_tokens
    assert 0 <= cached <= expect_prompt
    extra = usage.model_extra
    assert extra["gpu_seconds"] > 0
    assert extra["cost_usd"] == pytest.approx(extra["gpu_seconds"] * DEVICE_HOUR_USD / 3600)
    expected_list = (
        (expect_prompt - cached) * PRICES["input"]
        + cached * PRICES["cached_input"]
        + expect_completion * PRICES["output"]
    ) / 1e6
    assert extra["list_price_usd"] == pytest.approx(expected_list)


# --- happy paths -----------------------------------------------------------------------------


def test_models_and_health(server: ServerProcess, client: openai.OpenAI) -> None:
    # The served models, and tiny's LoRA adapters (tests/e2e/test_serve_lora.py).
    assert sorted(m.id for m in client.models.list()) == [
        "harmony",
        "harmony-tools",
        "narrow",
        "org/tiny-7b",
        "scripted",
        "think",
        "tiny",
        "tiny-all",
        "tiny-qv",
        "vision",
    ]
    assert client.models.retrieve("tiny").id == "tiny"
    health = httpx.get(server.base_url + "/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    # Eight models on engine deployments of their own (not one hop): /ready counts them and
    # names none. Its view is refreshed in the background, within seconds of the start.
    deadline = time.monotonic() + READY_WITHIN_S
    while (ready := httpx.get(server.base_url + "/ready", timeout=30)).status_code != 200:
        assert time.monotonic() < deadline, f"/ready {ready.status_code} for {READY_WITHIN_S} s"
        time.sleep(0.2)
    assert ready.json()["status"] == "ready"
    assert (ready.json()["models"], ready.json()["models_serving"]) == (8, 8)
    assert "tiny" not in ready.text and "narrow" not in ready.text and "scripted" not in ready.text
    # Either configured key works.
    other = openai.OpenAI(base_url=server.api_url, api_key=OTHER_KEY, max_retries=0)
    assert len(other.models.list().data) == 10


def test_chat_greedy_equals_engine(client: openai.OpenAI, engine, tokenizer) -> None:
    ids = chat_ids(tokenizer, CHAT)
    expected = run_engine(engine, ids, max_tokens=24)
    response = client.chat.completions.create(
        model="tiny", messages=CHAT, temperature=0, max_tokens=24
    )
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    check_usage_cost(response.usage, len(ids), expected.completion_tokens)


def test_chat_stream_equals_engine(client: openai.OpenAI, engine, tokenizer) -> None:
    ids = chat_ids(tokenizer, CHAT)
    expected = run_engine(engine, ids, max_tokens=20)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            temperature=0,
            max_completion_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    *content, finish, usage_chunk = chunks
    assert "".join(c.choices[0].delta.content or "" for c in content) == expected.text
    assert finish.choices[0].finish_reason in ("stop", "length")
    assert usage_chunk.choices == [] and all(c.usage is None for c in chunks[:-1])
    check_usage_cost(usage_chunk.usage, len(ids), expected.completion_tokens)


def test_completions_greedy_and_stream_equal_engine(
    client: openai.OpenAI, engine, tokenizer
) -> None:
    ids = list(tokenizer(PROMPT)["input_ids"])
    expected = run_engine(engine, ids, max_tokens=16)
    # No max_tokens: OpenAI's completions default of 16 applies.
    response = client.completions.create(model="tiny", prompt=PROMPT, temperature=0)
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert response.choices[0].text == expected.text
    check_usage_cost(response.usage, len(ids), expected.completion_tokens)

    stream = client.completions.create(
        model="tiny", prompt=PROMPT, temperature=0, max_tokens=16, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # Token-id prompts reach the engine unchanged.
    by_ids = client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=16)
    assert by_ids.choices[0].text == expected.text


def test_sampling_parameters_reach_the_engine(client: openai.OpenAI, engine, tokenizer) -> None:
    ids = chat_ids(tokenizer, CHAT)
    # Seeded sampling: the same seed gives the same tokens, whatever else is in the batch.
    sampled = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 7}
    expected = run_engine(engine, ids, max_tokens=12, **sampled)
    response = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=12,
        temperature=0.9,
        top_p=0.9,
        seed=7,
        extra_body={"top_k": 50},
    )
    assert response.choices[0].message.content == expected.text
    # A stop string taken from the greedy text ends the completion before it.
    greedy = run_engine(engine, ids, max_tokens=24).text
    stop = next(
        greedy[i : i + 3] for i in range(len(greedy) // 2, len(greedy)) if greedy[i : i + 3].strip()
    )
    expected = run_engine(engine, ids, max_tokens=24, stop=(stop,))
    response = client.chat.completions.create(
        model="tiny", messages=CHAT, temperature=0, max_tokens=24, stop=[stop]
    )
    assert response.choices[0].message.content == expected.text
    assert stop not in expected.text and response.choices[0].finish_reason == "stop"


def test_n_choices_are_seeded_samples_with_one_prompt_in_usage(
    client: openai.OpenAI, engine, tokenizer
) -> None:
    """n = 3: choice i is the engine's sample with seed + i; usage counts the prompt once and
    every choice's tokens; streamed choices carry their index and add up to the same texts."""
    ids = chat_ids(tokenizer, CHAT)
    sampled = {"temperature": 1.0, "ignore_eos": True}
    expected = [run_engine(engine, ids, max_tokens=10, seed=40 + i, **sampled) for i in range(3)]
    assert len({r.text for r in expected}) > 1, "seeds should give different samples"
    response = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=10,
        n=3,
        seed=40,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.message.content for c in response.choices] == [r.text for r in expected]
    assert all(c.finish_reason == "length" for c in response.choices)
    check_usage_cost(response.usage, len(ids), 30)

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=10,
            n=3,
            seed=40,
            temperature=1.0,
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {0: "", 1: "", 2: ""}
    roles, finishes = set(), {}
    for chunk in chunks[:-1]:
        choice = chunk.choices[0]
        texts[choice.index] += choice.delta.content or ""
        if choice.delta.role:
            roles.add(choice.index)
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert roles == {0, 1, 2} and finishes == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [r.text for r in expected]
    check_usage_cost(chunks[-1].usage, len(ids), 30)

    # Completions too: n choices of a text prompt.
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, n=2, temperature=0
    )
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.choices[0].text == completion.choices[1].text  # greedy: the same answer


def test_echo_scores_the_prompt(client: openai.OpenAI, engine, tokenizer) -> None:
    """Completions with echo and logprobs (lm-eval's loglikelihood request): the text opens
    with the prompt and the logprobs cover every prompt token (the first has none), equal to
    the engine's own prompt logprobs; streamed, the prompt comes first."""
    ids = list(tokenizer(PROMPT)["input_ids"])
    expected = run_engine(engine, ids, max_tokens=1, prompt_logprobs=2, logprobs=2)
    response = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2, echo=True
    )
    choice = response.choices[0]
    assert choice.text == PROMPT + expected.text
    lp = choice.logprobs
    completion = 0 if expected.finish_reason == "stop" else 1  # a final EOS is not listed
    assert len(lp.tokens) == len(ids) + completion
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [x.logprob for x in expected.prompt_logprobs[1:]]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-4)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    check_usage_cost(response.usage, len(ids), expected.completion_tokens)

    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text == PROMPT
    plain = run_engine(engine, ids, max_tokens=3)
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + plain.text
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=2, extra_body={"echo": True}
        )


def test_repeated_prefix_reports_cached_tokens(client: openai.OpenAI, tokenizer) -> None:
    # A long shared system message: its full KV blocks are reused the second time.
    chat = [
        {"role": "system", "content": "You answer about rivers and bridges. " * 12},
        {"role": "user", "content": "Which bridge is the oldest?"},
    ]
    usages = [
        client.chat.completions.create(
            model="tiny", messages=chat, temperature=0, max_tokens=2
        ).usage
        for _ in range(2)
    ]
    prompt_tokens = len(chat_ids(tokenizer, chat))
    for usage in usages:
        check_usage_cost(usage, prompt_tokens, usage.completion_tokens)
    assert usages[1].prompt_tokens_details.cached_tokens >= prompt_tokens // 2


def test_raw_stream_is_openai_sse(server: ServerProcess) -> None:
    body = {"model": "tiny", "messages": CHAT, "temperature": 0, "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", server.api_url + "/chat/completions", json=body, headers=auth(), timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert "usage" not in last  # only with stream_options.include_usage


# --- errors ----------------------------------------------------------------------------------

GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def with_(**changes) -> dict:
    return {**GOOD, **changes}


ERROR_CASES = [
    # (id, headers, body (dict → JSON, bytes → raw), status, param, code)
    ("no-key", {}, GOOD, 401, None, "invalid_api_key"),
    ("wrong-key", auth("nope"), GOOD, 401, None, "invalid_api_key"),
    ("bad-json", auth(), b'{"model": "tiny", "messages": [', 400, None, "invalid_json"),
    ("json-array", auth(), b"[1, 2]", 400, None, "invalid_json"),
    ("wrong-type", auth(), with_(temperature="hot"), 400, "temperature", "invalid_value"),
    ("bad-role", auth(), with_(messages=[{"role": "robot", "content": "x"}]), 400, None, None),
    ("missing", auth(), {"model": "tiny"}, 400, "messages", "missing_required_parameter"),
    ("unknown-model", auth(), with_(model="gpt-9"), 404, "model", "model_not_found"),
    ("n=0", auth(), with_(n=0), 400, "n", "invalid_value"),
    ("best_of=2", auth(), with_(best_of=2), 400, "best_of", "unsupported_parameter"),
    # Tools are read (docs/tools.md): a malformed one is named where it is wrong.
    (
        "tools",
        auth(),
        with_(tools=[{"type": "function"}]),
        400,
        "tools[0].function",
        "invalid_value",
    ),
    ("top_logprobs", auth(), with_(top_logprobs=2), 400, "top_logprobs", "invalid_value"),
    (
        "penalty",
        auth(),
        with_(presence_penalty=2.5),
        400,
        "presence_penalty",
        "invalid_value",
    ),
    # Unknown fields are only refused in strict mode (the tolerant path: test_serve_tolerance).
    ("unknown-strict", strict(), with_(foo=1), 400, "foo", "unknown_parameter"),
    (
        "length_penalty",
        auth(),
        with_(length_penalty=0.2),
        400,
        "length_penalty",
        "unsupported_parameter",
    ),
    (
        "long-prompt",
        auth(),
        with_(messages=[{"role": "user", "content": "river bridge " * 2000}]),
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("oversize", auth(), b"x" * (MAX_BODY_BYTES + 1), 413, None, "request_too_large"),
]


@pytest.mark.parametrize(
    ("headers", "body", "status", "param", "code"),
    [case[1:] for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
def test_bad_requests_get_openai_errors(
    server: ServerProcess, headers, body, status, param, code
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        server.api_url + "/chat/completions",
        content=content,
        headers={"Content-Type": "application/json", **headers},
        timeout=60,
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def test_errors_through_openai_client_then_server_still_serves(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.api_url, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="'n'"):
        client.chat.completions.create(model="tiny", messages=GOOD["messages"], n=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    missing = httpx.get(server.api_url + "/nothing-here", headers=auth(), timeout=30)
    assert missing.status_code == 404 and "error" in missing.json()
    ok = client.chat.completions.create(model="tiny", messages=GOOD["messages"], max_tokens=3)
    assert ok.usage.completion_tokens >= 1
    errors = scrape(server)
    assert metric(errors, "tokenmill_serve_errors_total", kind="invalid_api_key") >= 1
    assert metric(errors, "tokenmill_serve_errors_total", kind="unsupported_parameter") >= 1


# --- load limits and cancellation -------------------------------------------------------------


def test_full_queue_answers_429_with_retry_after(server: ServerProcess) -> None:
    # `narrow` has one engine slot and one queue place: of 6 concurrent long requests (~2 s each)
    # four find both taken; two would need the others to be spread over seconds.
    body = {"model": "narrow", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers=auth(), timeout=120) as http:
            return await asyncio.gather(
                *(http.post(server.api_url + "/completions", json=body) for _ in range(6))
            )

    responses = asyncio.run(fire())
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) >= 1 and statuses.count(429) >= 2, statuses
    assert set(statuses) <= {200, 429}
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "2"
            assert r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["usage"]["completion_tokens"] == 400
    # Once the burst is over the same model serves again.
    again = httpx.post(
        server.api_url + "/completions", json={**body, "max_tokens": 2}, headers=auth(), timeout=60
    )
    assert again.status_code == 200


ENGINE_GAUGES = (
    "tokenmill_engine_steps",
    "tokenmill_engine_requests_running",
    "tokenmill_engine_requests_waiting",
    "tokenmill_engine_spec_proposed_tokens",
)


def wait_engine_idle(server: ServerProcess, model: str, timeout: float = 60) -> dict:
    """A scrape in which `model` has no request anywhere. The engine gauges must be present:
    a scrape whose stats call to the replica timed out lacks them, and reading a missing
    gauge as 0 would count every step since start-up as this test's."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        labels = (("model", model),)
        present = all((name, labels) in samples for name in ENGINE_GAUGES)
        idle = (
            present
            and metric(samples, "tokenmill_serve_requests_in_flight", model=model) == 0
            and metric(samples, "tokenmill_engine_requests_running", model=model) == 0
            and metric(samples, "tokenmill_engine_requests_waiting", model=model) == 0
        )
        if idle:
            return samples
        busy = {
            name: metric(samples, name, model=model) if present else "missing"
            for name in (
                "tokenmill_serve_requests_in_flight",
                "tokenmill_engine_requests_running",
                "tokenmill_engine_requests_waiting",
            )
        }
        assert time.monotonic() < deadline, f"engine of {model} still busy after {timeout}s: {busy}"
        time.sleep(0.2)


def seconds_per_token(server: ServerProcess, tokens: int = 200) -> float:
    """Wall seconds per generated token of one greedy request on `tiny`, measured now."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True}
    started = time.monotonic()
    response = httpx.post(server.api_url + "/completions", json=body, headers=auth(), timeout=120)
    assert response.status_code == 200
    return (time.monotonic() - started) / tokens


def test_client_disconnect_mid_stream_frees_the_engine(server: ServerProcess) -> None:
    before = wait_engine_idle(server, "tiny")
    steps_before = metric(before, "tokenmill_engine_steps", model="tiny")
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS_CAP,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", server.api_url + "/completions", json=body, headers=auth(), timeout=60
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [ln for ln, _ in zip(lines, range(6), strict=False) if ln.startswith("data: ")]
        assert received
    # Leaving the block closed the connection mid-stream.
    after = wait_engine_idle(server, "tiny")
    steps = metric(after, "tokenmill_engine_steps", model="tiny")
    time.sleep(1.0)
    assert metric(scrape(server), "tokenmill_engine_steps", model="tiny") == steps  # idle
    # The request was cut short: it alone would have taken one engine step per token.
    assert 0 < steps - steps_before < MAX_TOKENS_CAP / 2
    assert metric(after, "tokenmill_serve_errors_total", kind="client_disconnected") >= 1


def test_client_disconnect_while_waiting_for_whole_response(server: ServerProcess) -> None:
    check_whole_response_disconnect_cancels(server)


def check_whole_response_disconnect_cancels(server: ServerProcess) -> None:
    # The client gives up after a quarter of the time the whole reply takes on this machine
    # (measured, so a fast machine gets a short timeout and a slow one a long one). If the
    # server cancels the request when the client goes away, the engine stops near a quarter
    # of the reply; if it does not, it decodes all MAX_TOKENS_CAP tokens.
    per_token = seconds_per_token(server)
    client_timeout = max(0.2, per_token * MAX_TOKENS_CAP / 4)
    before = wait_engine_idle(server, "tiny")
    steps_before = metric(before, "tokenmill_engine_steps", model="tiny")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS_CAP, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.api_url + "/completions", json=body, headers=auth(), timeout=client_timeout
        )
    # Long enough for the whole reply on a machine twice as busy as when measured, so that a
    # request the server failed to cancel shows as `ran` below, not as a timeout here.
    after = wait_engine_idle(server, "tiny", timeout=max(60.0, 2 * per_token * MAX_TOKENS_CAP))
    ran = metric(after, "tokenmill_engine_steps", model="tiny") - steps_before
    # One step per token for a lone request. Cancelled, it stops near a quarter of the reply;
    # the margin (to 90%) covers Serve noticing the closed connection on a loaded machine.
    assert 0 < ran < MAX_TOKENS_CAP * 0.9, (ran, per_token, client_timeout)


def test_metrics_count_tokens_and_latency(server: ServerProcess, client: openai.OpenAI) -> None:
    before = scrape(server)
    response = client.chat.completions.create(
        model="tiny", messages=CHAT, temperature=0, max_tokens=5
    )
    after = scrape(server)

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    usage = response.usage
    assert grew("tokenmill_serve_prompt_tokens_total", model="tiny") == usage.prompt_tokens
    assert grew("tokenmill_serve_completion_tokens_total", model="tiny") == usage.completion_tokens
    assert grew("tokenmill_serve_requests_total", model="tiny", endpoint="chat", status="200") == 1
    assert grew("tokenmill_serve_latency_seconds_count", model="tiny", endpoint="chat") == 1
    assert grew("tokenmill_serve_ttft_seconds_count", model="tiny") == 1
    assert grew("tokenmill_serve_cost_usd_total", model="tiny") == pytest.approx(
        response.usage.model_extra["cost_usd"]
    )


def test_fault_injection_route_is_off_without_test_hooks(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    # This server runs without TOKENMILL_TEST_HOOKS: the route is an unknown route.
    response = httpx.post(
        server.base_url + "/debug/break-engine/tiny", params={"mode": "crash"}, headers=auth()
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    reply = client.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert reply.parse().usage.completion_tokens == 2
    assert reply.headers["x-tokenmill-replica"]


@pytest.mark.ends_shared_server  # run after every other test of the shared server
def test_sigterm_stops_the_server_cleanly(server: ServerProcess) -> None:
    # Last in the module: stops the shared server.
    assert server.stop(timeout=90) == 0, "".join(server.lines[-30:])
    with pytest.raises(httpx.TransportError):
        httpx.get(server.base_url + "/health", timeout=5)

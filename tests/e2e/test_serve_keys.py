"""Named keys, per-key limits and usage, and bounded overload against a real `tokenmill serve`,
through the official OpenAI client where a client would use it.

One server for the module (each start costs seconds on a small machine): one model with
small queues, a keys file it reloads every 0.2 s, a usage log flushed every 0.2 s, and tight
ingress bounds, so overload is reached with a few dozen requests.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.serve_fixtures import API_KEY, ServerProcess, serve_config, start_server

pytestmark = pytest.mark.timeout(600)

CHAT = [{"role": "user", "content": "Tell me about the river and the bridge."}]
MAX_ONGOING, MAX_QUEUED, MAX_CONCURRENT = 2, 4, 8
RELOAD_S = 0.2
# name -> (key, entry fields besides name and sha256)
KEYS: dict[str, tuple[str, dict]] = {
    "alpha": ("key-alpha", {"metrics": True}),
    "beta": ("key-beta", {"limits": {"requests_per_minute": 3}}),
    "gamma": ("key-gamma", {"limits": {"tokens_per_minute": 300}}),
    "restricted": ("key-restricted", {"models": ["elsewhere"]}),
    "doomed": ("key-doomed", {}),
}


def entries(names: list[str]) -> list[dict]:
    return [
        {"name": n, "sha256": hashlib.sha256(KEYS[n][0].encode()).hexdigest(), **KEYS[n][1]}
        for n in names
    ]


def replace_file(path: Path, text: str) -> None:
    """Swap the file in one rename, as a secret update does: never a half-written file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-keys")


@pytest.fixture(scope="module")
def server(serve_model_dir: Path, workdir: Path) -> Iterator[ServerProcess]:
    keys_file = workdir / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"keys": entries(list(KEYS))}))
    config = serve_config(serve_model_dir)
    tiny = config["models"][0]
    tiny["replicas"] = {
        "cpus_per_replica": 0.25,
        "max_ongoing_requests": MAX_ONGOING,
        "max_queued_requests": MAX_QUEUED,
    }
    config["models"] = [tiny]  # one engine: the test's machine has two cores
    config["name"] = "tokenmill-keys"
    config["http"] = {
        **config["http"],
        "metrics_without_key": False,
        "max_concurrent_requests": MAX_CONCURRENT,
        "max_tokenizing_requests": 4,
    }
    config["auth"] = {"keys_file": str(keys_file), "reload_interval_s": RELOAD_S}
    config["usage_log"] = {"uri": str(workdir / "usage.jsonl"), "flush_interval_s": 0.2}
    path = workdir / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = start_server(path, {"TOKENMILL_API_KEYS": API_KEY}, [])
    yield proc
    proc.stop()
    (workdir / "server.log").write_text("".join(proc.lines))
    # Keys never appear in what the server printed, nor in any log of its Ray session (the
    # replicas' logs, where the broken keys-file edit was reported).
    logs = ["".join(proc.lines)] + [p.read_text(errors="replace") for p in ray_logs(proc)]
    for key in [API_KEY, *(k for k, _ in KEYS.values())]:
        assert not [text for text in logs if key in text], "a key is in the logs"
    if len(logs) > 1:
        assert any("keeping the" in text for text in logs), "broken edit not logged"


def ray_logs(proc: ServerProcess) -> list[Path]:
    """The log files of the local Ray the server started (session_<date>_<its pid>)."""
    root = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray"
    return [
        p
        for session in root.glob(f"session_*_{proc.process.pid}")
        for p in (session / "logs").rglob("*")
        if p.is_file() and p.suffix in (".log", ".out", ".err")
    ]


def client(server: ServerProcess, name: str) -> openai.OpenAI:
    key = API_KEY if name == "env" else KEYS[name][0]
    return openai.OpenAI(base_url=server.api_url, api_key=key, max_retries=0, timeout=120)


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY if name == 'env' else KEYS[name][0]}"}


def scrape(server: ServerProcess, name: str = "alpha") -> dict[tuple[str, tuple], float]:
    response = httpx.get(server.base_url + "/metrics", headers=auth(name), timeout=60)
    assert response.status_code == 200, response.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def chat(c: openai.OpenAI, max_tokens: int = 4):
    return c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=max_tokens)


def usage_records(workdir: Path, ids: set[str], timeout: float = 10) -> list[dict]:
    """The usage log's records of these request ids, once all of them are written."""
    path = workdir / "usage.jsonl"
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        found = [r for r in map(json.loads, lines) if r["request_id"] in ids]
        if len(found) == len(ids):
            return found
        assert time.monotonic() < deadline, f"{len(found)} of {len(ids)} records written"
        time.sleep(0.1)


# --- limits --------------------------------------------------------------------------------------


def test_a_key_over_its_limit_gets_429_while_another_keeps_getting_200(
    server: ServerProcess,
) -> None:
    beta, alpha = client(server, "beta"), client(server, "alpha")
    for _ in range(3):
        assert chat(beta).choices
        assert chat(alpha).choices
    with pytest.raises(openai.RateLimitError) as err:
        chat(beta)
    assert err.value.status_code == 429
    assert err.value.body["code"] == "rate_limit_exceeded" and err.value.body["type"] == "requests"
    assert "beta" in err.value.body["message"] and "key-beta" not in err.value.body["message"]
    # Its own budget: 3 a minute refill one per 20 s.
    assert 1 <= int(err.value.response.headers["retry-after"]) <= 20
    for _ in range(3):
        assert chat(alpha).choices  # the other key is untouched

    # tokens_per_minute: charged prompt + max_tokens up front.
    # tokens_per_minute (300, 5 a second): each request is charged prompt + max_tokens.
    gamma = client(server, "gamma")
    long_reply = {"max_tokens": 200, "extra_body": {"ignore_eos": True}}
    started = time.monotonic()
    first = gamma.chat.completions.create(model="tiny", messages=CHAT, **long_reply)
    took = time.monotonic() - started
    assert first.usage.completion_tokens == 200
    with pytest.raises(openai.RateLimitError) as err:
        gamma.chat.completions.create(model="tiny", messages=CHAT, **long_reply)
    assert err.value.body["type"] == "tokens" and err.value.body["code"] == "rate_limit_exceeded"
    # Retry-After: the time gamma's bucket needs to hold the second request's charge, less
    # what refilled while the first ran.
    charge = first.usage.total_tokens
    missing_s = (charge - (300 - charge)) / 5
    retry = int(err.value.response.headers["retry-after"])
    assert missing_s - took - 1 <= retry <= missing_s + 1, (retry, missing_s, took)
    assert chat(alpha).choices


def test_usage_per_key_in_metrics_and_log_equals_the_responses(
    server: ServerProcess, workdir: Path
) -> None:
    before = scrape(server)
    responses = {"alpha": [], "env": []}
    for name in responses:
        c = client(server, name)
        responses[name].append(chat(c, max_tokens=6))
        responses[name].append(c.completions.create(model="tiny", prompt="The river", max_tokens=5))
        stream = c.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[-1].usage is not None
        responses[name].append(chunks[-1])
    after = scrape(server)
    records = usage_records(workdir, {r.id for rs in responses.values() for r in rs})

    for name, replies in responses.items():
        key = "env-1" if name == "env" else name
        usage = [r.usage for r in replies]
        expected = {
            "prompt_tokens": sum(u.prompt_tokens for u in usage),
            "cached_prompt_tokens": sum(u.prompt_tokens_details.cached_tokens for u in usage),
            "completion_tokens": sum(u.completion_tokens for u in usage),
            "cost_usd": sum(u.model_extra["cost_usd"] for u in usage),
        }
        for field, value in expected.items():
            metric_name = f"tokenmill_serve_key_{field}_total"
            grew = metric(after, metric_name, key=key, model="tiny") - metric(
                before, metric_name, key=key, model="tiny"
            )
            assert grew == pytest.approx(value), (key, field)
        ok = ("tokenmill_serve_key_requests_total", {"key": key, "model": "tiny", "status": "200"})
        assert metric(after, ok[0], **ok[1]) - metric(before, ok[0], **ok[1]) == 3

        mine = [r for r in records if r["key"] == key]
        assert len(mine) == 3 and {r["status"] for r in mine} == {200}
        assert {r["endpoint"] for r in mine} == {"chat", "completions"}
        assert sum(r["prompt_tokens"] for r in mine) == expected["prompt_tokens"]
        assert sum(r["cached_tokens"] for r in mine) == expected["cached_prompt_tokens"]
        assert sum(r["completion_tokens"] for r in mine) == expected["completion_tokens"]
        assert sum(r["cost_usd"] for r in mine) == pytest.approx(expected["cost_usd"])
        assert sum(r["list_price_usd"] for r in mine) == pytest.approx(
            sum(u.model_extra["list_price_usd"] for u in usage)
        )


def test_metrics_need_a_key_allowed_to_read_them(server: ServerProcess) -> None:
    assert httpx.get(server.base_url + "/metrics", timeout=30).status_code == 401
    denied = httpx.get(server.base_url + "/metrics", headers=auth("beta"), timeout=30)
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "permission_denied"
    assert scrape(server, "env")  # keys from the environment are the operator's


def test_a_disallowed_model_and_a_hopeless_prompt_are_refused(
    server: ServerProcess, workdir: Path
) -> None:
    restricted = client(server, "restricted")
    with pytest.raises(openai.NotFoundError) as err:
        chat(restricted)
    assert err.value.body["code"] == "model_not_found"
    assert "may not use it" in err.value.body["message"]
    assert restricted.models.list().data == []
    assert [m.id for m in client(server, "alpha").models.list().data] == ["tiny"]

    # Over (context - 1) x bytes-per-token bytes: refused from its length alone.
    prompt = "river " * 7000  # 42,000 bytes
    with pytest.raises(openai.BadRequestError) as err:
        client(server, "alpha").completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert err.value.body["code"] == "context_length_exceeded"
    assert "at least" in err.value.body["message"]


def test_a_removed_key_is_refused_within_seconds_and_a_broken_edit_changes_nothing(
    server: ServerProcess, workdir: Path
) -> None:
    keys_file = workdir / "keys.yaml"
    doomed, alpha = client(server, "doomed"), client(server, "alpha")
    assert chat(doomed).choices

    replace_file(keys_file, "keys:\n  - name: alpha\n    sha256: [unclosed\n")
    time.sleep(RELOAD_S * 5)
    assert chat(doomed).choices and chat(alpha).choices  # the last good set stays

    replace_file(keys_file, yaml.safe_dump({"keys": entries(["alpha", "beta", "gamma"])}))
    removed_at = time.monotonic()
    while True:
        try:
            chat(doomed, max_tokens=1)
        except openai.AuthenticationError as exc:
            assert exc.body["code"] == "invalid_api_key"
            break
        assert time.monotonic() - removed_at < 5, "removed key still accepted after 5 s"
        time.sleep(0.05)
    print(f"removed key refused after {time.monotonic() - removed_at:.2f}s")
    assert chat(alpha).choices
    assert chat(client(server, "env")).choices


# --- overload ------------------------------------------------------------------------------------


def test_ten_times_the_queue_gets_only_200s_and_429s_and_frees_every_slot(
    server: ServerProcess,
) -> None:
    slots = MAX_ONGOING + MAX_QUEUED
    burst = 10 * slots
    body = {"model": "tiny", "prompt": "The river", "max_tokens": 24, "ignore_eos": True}

    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
        payload = {**body, "stream": i % 3 == 0}
        async with http.stream("POST", server.api_url + "/completions", json=payload) as r:
            text = (await r.aread()).decode()
            if r.status_code == 200:
                code = None
            elif text.startswith("Request dropped due to backpressure"):
                # Serve's proxy, before the ingress: its queue of unassigned requests is full.
                code = "proxy_queue_full"
                assert r.headers["retry-after"] == "2"
            else:
                code = r.json()["error"]["code"]
                assert r.headers["retry-after"] == "2"
            if r.status_code == 200 and payload["stream"]:
                assert text.rstrip().endswith("data: [DONE]"), text[-200:]
            return r.status_code, code

    async def fire() -> list[tuple[int, str | None]]:
        limits = httpx.Limits(max_connections=burst)
        async with httpx.AsyncClient(headers=auth("alpha"), timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(burst)))

    results = asyncio.run(fire())
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429}, results
    assert statuses.count(200) >= 1 and statuses.count(429) >= 1, results
    codes = {c for s, c in results if s == 429}
    assert codes <= {"ingress_full", "queue_full", "tokenizer_busy", "proxy_queue_full"}, codes
    print(f"{burst} requests: {statuses.count(200)} answered, 429s: {sorted(codes)}")

    # Every slot is free again: the ingress's, the tokenizer queue's, the key's, the engine's.
    deadline = time.monotonic() + 30
    while True:
        samples = scrape(server)
        held = {
            "ingress": metric(samples, "tokenmill_serve_ingress_requests_in_flight"),
            "tokenizing": metric(samples, "tokenmill_serve_tokenizing_requests"),
            "alpha": metric(samples, "tokenmill_serve_key_requests_in_flight", key="alpha"),
            "dispatched": metric(samples, "tokenmill_serve_requests_in_flight", model="tiny"),
            "running": metric(samples, "tokenmill_engine_requests_running", model="tiny"),
            "waiting": metric(samples, "tokenmill_engine_requests_waiting", model="tiny"),
        }
        # The scrape itself holds no request slot (it is not a generation request).
        if not any(held.values()):
            break
        assert time.monotonic() < deadline, held
        time.sleep(0.2)
    assert chat(client(server, "alpha")).choices  # and it serves as before

"""`POST /v1/embeddings` end to end: the official OpenAI client against a real `tokenmill serve`
(Ray Serve over HTTP). Embeddings equal the reference engine's own, run in this process on the
same token ids; base64 decodes to the float answer; usage counts the prompt tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.serve_fixtures import API_KEY, ServerProcess, local_engine, serve_config

pytestmark = pytest.mark.timeout(600)

TEXTS = ["The river runs under the bridge.", "Every file is read once", "hello"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(serve_model_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """text -> (its token ids as the server tokenizes it, the engine's embedding of them)."""
    from transformers import AutoTokenizer

    from engines.api import EmbedParams, GenerationRequest
    from pipeline.openai.chat import RAW_COMPLETION, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(str(serve_model_dir))
    out = {}
    with local_engine(serve_model_dir, serve_config(serve_model_dir)["models"][0]) as engine:
        for text in TEXTS:
            ids = render_prompt(tokenizer, RAW_COMPLETION, text=text)
            result = asyncio.run(engine.generate(GenerationRequest(ids, embed=EmbedParams())))
            out[text] = (ids, result.embedding)
    return out


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


def test_single_string(client: openai.OpenAI, expected) -> None:
    response = client.embeddings.create(model="tiny", input=TEXTS[0])
    ids, vector = expected[TEXTS[0]]
    assert response.object == "list" and response.model == "tiny"
    assert len(response.data) == 1 and response.data[0].index == 0
    assert _close(response.data[0].embedding, vector)
    assert response.usage.prompt_tokens == len(ids) == response.usage.total_tokens
    norm = sum(x * x for x in response.data[0].embedding) ** 0.5
    assert abs(norm - 1) < 1e-5  # last token, L2-normalised by default


def test_list_of_strings_in_order(client: openai.OpenAI, expected) -> None:
    response = client.embeddings.create(model="tiny", input=TEXTS)
    assert [d.index for d in response.data] == [0, 1, 2]
    for item, text in zip(response.data, TEXTS, strict=True):
        assert _close(item.embedding, expected[text][1])
    assert response.usage.prompt_tokens == sum(len(expected[t][0]) for t in TEXTS)


def test_base64_decodes_to_float(client: openai.OpenAI, expected) -> None:
    from pipeline.openai.embeddings import decode_base64

    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    # Asked for explicitly, base64 comes back as the string (the client decodes only the
    # base64 it chose itself, when no format is given).
    b64 = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="base64")
    for f, b in zip(floats.data, b64.data, strict=True):
        assert isinstance(b.embedding, str)
        assert decode_base64(b.embedding) == pytest.approx(f.embedding, abs=1e-7)
    # No format: the client asks for base64 and decodes it to floats itself.
    default = client.embeddings.create(model="tiny", input=TEXTS[1])
    assert list(default.data[0].embedding) == pytest.approx(floats.data[1].embedding, abs=1e-7)


def test_token_ids_and_dimensions(client: openai.OpenAI, expected) -> None:
    ids, vector = expected[TEXTS[2]]
    one = client.embeddings.create(model="tiny", input=ids)
    assert _close(one.data[0].embedding, vector)
    many = client.embeddings.create(model="tiny", input=[ids, ids[:1]])
    assert len(many.data) == 2 and _close(many.data[0].embedding, vector)
    size = len(vector)
    same = client.embeddings.create(model="tiny", input="hello", dimensions=size)
    assert len(same.data[0].embedding) == size
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="tiny", input="hello", dimensions=size - 1)
    assert err.value.body["param"] == "dimensions"


def test_refusals(server: ServerProcess) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = server.api_url + "/embeddings"
    for body, param in [
        ({"model": "tiny", "input": []}, "input"),
        ({"model": "tiny", "input": ""}, "input"),
        ({"model": "tiny", "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": "tiny", "input": [[1] * 10_000]}, "input"),
        ({"model": "nope", "input": "x"}, "model"),
    ]:
        response = httpx.post(url, json=body, headers=headers, timeout=60)
        assert response.status_code in (400, 404), (body, response.text)
        assert response.json()["error"]["param"] == param, response.text
    assert httpx.post(url, json={"model": "tiny", "input": "x"}, timeout=60).status_code == 401

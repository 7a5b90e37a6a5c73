"""The shared sampling parameters do what they say through both OpenAI entry points, on the
reference engine: a Serve request (parsed and prepared as the app does) and an openai_batch
line (a real job: local Ray, S3 over HTTP). logit_bias forces a token, min_tokens holds off a
favoured EOS, a row's own stop ends it, an invalid value is named."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.batch.driver.run import run_job
from tests.integration.s3_server import S3Server
from tests.integration.test_pipeline import make_spec, read_output

pytestmark = pytest.mark.timeout(300)


def _tokens(model_dir: Path) -> tuple[Any, int, int]:
    """The tokenizer, a one-token word to force, and EOS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    forced = next(
        ids[0]
        for word in (" river", " the", " and", " a")
        if len(ids := tokenizer.encode(word, add_special_tokens=False)) == 1
    )
    return tokenizer, forced, tokenizer.eos_token_id


# body extras -> what the output must show (checked by _check)
def _cases(forced: int, eos: int, word: str) -> dict[str, dict[str, Any]]:
    return {
        "bias": {"logit_bias": {str(forced): 100}},
        "min-tokens": {"logit_bias": {str(eos): 100}, "min_tokens": 4},
        "stop": {"logit_bias": {str(forced): 100}, "stop": [word.strip()]},
        "bad": {"presence_penalty": 3},
    }


def _check(name: str, text: str, finish: str, completion_tokens: int, error: Any, word: str):
    if name == "bias":
        assert text == word * 6 and finish == "length"
    elif name == "min-tokens":
        assert completion_tokens == 5 and finish == "stop"  # 4 tokens, then EOS
    elif name == "stop":
        assert text.strip() == "" and finish == "stop" and completion_tokens == 1
    else:
        assert error is not None and "presence_penalty" in error


def test_serve_requests_apply_the_parameters(tiny_model_dir: Path) -> None:
    from engines.api import EngineInfo
    from engines.reference.engine import ReferenceEngine
    from pipeline.openai.errors import ApiError
    from pipeline.serve.protocol.requests import parse_request, to_engine_request
    from pipeline.serve.spec import ServedModelSpec

    tokenizer, forced, eos = _tokens(tiny_model_dir)
    word = tokenizer.decode([forced])
    served = ServedModelSpec.model_validate(
        {
            "name": "tiny",
            "model": {"path": str(tiny_model_dir)},
            "limits": {"max_tokens": 64, "default_max_tokens": 16},
        }
    )

    class Tokens:  # what to_engine_request asks of the app's tokenizer
        has_chat_template = False
        vocab_size = len(tokenizer)

        def completion_ids(self, text: str) -> list[int]:
            return tokenizer.encode(text)

    engine = ReferenceEngine(str(tiny_model_dir), num_threads=1)
    try:
        info: EngineInfo = engine.info
        for name, extra in _cases(forced, eos, word).items():
            body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 6, "temperature": 0}
            try:
                prepared = to_engine_request(
                    parse_request({**body, **extra}, "completions"),
                    "completions",
                    served,
                    Tokens(),
                    info,
                )
            except ApiError as exc:
                _check(name, "", "error", 0, str(exc), word)
                continue
            result = asyncio.run(engine.generate(prepared.engine_request))
            _check(name, result.text, result.finish_reason, result.completion_tokens, None, word)
    finally:
        engine.shutdown()


def test_batch_lines_apply_the_parameters(
    ray_local: Any, s3_server: S3Server, tiny_model_dir: Path
) -> None:
    tokenizer, forced, eos = _tokens(tiny_model_dir)
    word = tokenizer.decode([forced])
    cases = _cases(forced, eos, word)
    bucket = s3_server.make_bucket()
    lines = [
        {
            "custom_id": name,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "Once upon", "max_tokens": 6, **extra},
        }
        for name, extra in cases.items()
    ]
    s3_server.put(f"s3://{bucket}/in.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    spec = make_spec(
        "openai-params",
        {"uri": f"s3://{bucket}/in.jsonl", "format": "openai_batch"},
        f"s3://{bucket}/out/",
        s3_server,
        tiny_model_dir,
        limits={"max_error_fraction": 0.5},
    )
    result = run_job(spec)
    assert result.status == "complete", result.message
    table, _ = read_output(s3_server, spec.output.uri)
    rows = {r["id"]: r for r in table.to_pylist()}
    assert set(rows) == set(cases)
    for name, row in rows.items():
        _check(
            name, row["text"], row["finish_reason"], row["completion_tokens"], row["error"], word
        )

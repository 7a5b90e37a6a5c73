"""OpenAI logprobs objects from engine logprobs: shapes, stop tokens left out, offsets."""

from __future__ import annotations

from engines.api import GenerationResult, TokenLogprob
from pipeline.serve.protocol.logprobs import LogprobsBody

TEXTS = {1: "Hel", 2: "lo", 3: " w", 9: "<eos>"}
ENTRIES = [
    TokenLogprob(1, -0.1, ((1, -0.1), (2, -2.5))),
    TokenLogprob(2, -0.3, ((2, -0.3), (3, -1.5))),
    TokenLogprob(9, -0.01, ((9, -0.01), (1, -5.0))),
]


def _result(stop_reason) -> GenerationResult:
    return GenerationResult("r", [1, 2, 9], "Hello", "stop", 3, 3, stop_reason=stop_reason)


def test_chat_shape_and_the_eos_is_left_out() -> None:
    body = LogprobsBody("chat", TEXTS.__getitem__).body(ENTRIES, _result(None))
    assert body["refusal"] is None
    assert [c["token"] for c in body["content"]] == ["Hel", "lo"]
    first = body["content"][0]
    assert first == {
        "token": "Hel",
        "logprob": -0.1,
        "bytes": list(b"Hel"),
        "top_logprobs": [
            {"token": "Hel", "logprob": -0.1, "bytes": list(b"Hel")},
            {"token": "lo", "logprob": -2.5, "bytes": list(b"lo")},
        ],
    }


def test_a_stop_string_keeps_every_token_and_offsets_run_across_chunks() -> None:
    formatter = LogprobsBody("completions", TEXTS.__getitem__)
    first = formatter.body(ENTRIES[:2])
    assert first["tokens"] == ["Hel", "lo"] and first["text_offset"] == [0, 3]
    assert first["top_logprobs"][1] == {"lo": -0.3, " w": -1.5}
    last = formatter.body(ENTRIES[2:], _result("STOP"))  # stopped by a string: token kept
    assert last["tokens"] == ["<eos>"] and last["text_offset"] == [5]


def test_echoed_prompt_logprobs_come_first_with_running_offsets() -> None:
    from engines.api import TokenLogprob
    from pipeline.serve.protocol.logprobs import LogprobsBody, join_completion_logprobs

    builder = LogprobsBody("completions", lambda t: f"<{t}>")
    prompt = [5, 6, 7]
    entries = [None, TokenLogprob(6, -1.0, ((6, -1.0),)), TokenLogprob(7, -2.0, ((1, -0.5),))]
    head = builder.prompt_body(prompt, entries)
    tail = builder.body([TokenLogprob(9, -0.1, ((9, -0.1),))])
    body = join_completion_logprobs(head, tail)
    assert body["tokens"] == ["<5>", "<6>", "<7>", "<9>"]
    assert body["token_logprobs"] == [None, -1.0, -2.0, -0.1]
    assert body["top_logprobs"] == [None, {"<6>": -1.0}, {"<1>": -0.5}, {"<9>": -0.1}]
    assert body["text_offset"] == [0, 3, 6, 9]
    # An engine that sent no prompt logprobs still gets the tokens, without values.
    bare = LogprobsBody("completions", str).prompt_body([1, 2], None)
    assert bare["token_logprobs"] == [None, None] and bare["tokens"] == ["1", "2"]

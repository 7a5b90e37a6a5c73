"""The reasoning split (pipeline.openai.reasoning): whole and streamed, on the tiny model's
think and harmony tokenizers, with known token sequences."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from pipeline.openai.reasoning import (
    Delta,
    ReasoningError,
    Split,
    make_parser,
    split_output,
)


@pytest.fixture(scope="module")
def think_tok() -> Any:
    from engines.dev.tiny import train_tokenizer

    return train_tokenizer(1024, 0, "think")


@pytest.fixture(scope="module")
def harmony_tok() -> Any:
    from engines.dev.tiny import train_tokenizer

    return train_tokenizer(1024, 0, "harmony")


@pytest.fixture(scope="module")
def plain_tok() -> Any:
    from engines.dev.tiny import train_tokenizer

    return train_tokenizer(1024, 0)


def ids(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def prompt(tok: Any, **kwargs: Any) -> list[int]:
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Why is the river cold?"}],
        add_generation_prompt=True,
        tokenize=False,
        **kwargs,
    )
    return ids(tok, rendered)


def streamed(parser: Any, prompt_ids: list[int], pieces: list[tuple[list[int], str]]) -> Split:
    """The split from feeding `pieces` one by one; also checks the deltas add up to it."""
    stream = parser.stream(prompt_ids)
    deltas = [stream.feed(i, t) for i, t in pieces] + [stream.close()]
    out = stream.result([t for i, _ in pieces for t in i])
    assert "".join(d.reasoning for d in deltas) == (out.reasoning or "")
    assert "".join(d.text for d in deltas) == out.text
    return out


# --- think ------------------------------------------------------------------------------------


THINK_CASES = [
    # (output text, prompt opened the block?, reasoning, answer)
    (
        "<think>\nthe river runs north\n</think>\n\nIt is cold.",
        False,
        "the river runs north",
        "It is cold.",
    ),
    ("the river runs north\n</think>\n\nIt is cold.", True, "the river runs north", "It is cold."),
    ("the river runs north and", True, "the river runs north and", ""),  # cut at max_tokens
    ("<think>the river runs </th", False, "the river runs </th", ""),  # cut inside the marker
    ("It is cold.", False, None, "It is cold."),  # no block
    ("  It is <think> cold.</think> x", False, None, "  It is <think> cold.</think> x"),
    ("<think>\n\n</think>\n\nIt is cold.", False, "", "It is cold."),  # an empty block
    ("<think>a \n b</think>", False, "a \n b", ""),  # the model stopped after the block
    ("<thi", False, None, "<thi"),  # ended while it could still have been a block
    ("   ", False, None, "   "),
]


@pytest.mark.parametrize(("text", "opened", "reasoning", "answer"), THINK_CASES)
def test_think_whole_and_every_two_and_three_way_cut(
    think_tok: Any, text: str, opened: bool, reasoning: str | None, answer: str
) -> None:
    parser = make_parser("think", think_tok)
    prompt_ids = prompt(think_tok) if opened else prompt(think_tok, enable_thinking=False)
    output_ids = ids(think_tok, text)
    whole = split_output(parser, prompt_ids, output_ids, text)
    assert (whole.reasoning, whole.text) == (reasoning, answer)
    # The text alone decides the split: every cut of it into deltas gives the same.
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        pieces = [(output_ids, text[:i]), ([], text[i:j]), ([], text[j:])]
        assert streamed(parser, prompt_ids, pieces) == whole, (i, j)


def test_think_random_cuts_into_many_deltas(think_tok: Any) -> None:
    parser = make_parser("think", think_tok)
    text = "<think>\n  step one;\n step </ two </think>\n\n  The answer </think> is 7.\n"
    output_ids = ids(think_tok, text)
    whole = split_output(parser, [], output_ids, text)
    assert whole.reasoning == "step one;\n step </ two"
    assert whole.text == "The answer </think> is 7.\n"
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
        bounds = [0, *cuts, len(text)]
        pieces = [([], text[a:b]) for a, b in itertools.pairwise(bounds)]
        pieces[0] = (output_ids, pieces[0][1])
        assert streamed(parser, [], pieces) == whole


def test_think_token_counts_leave_the_markers_out(think_tok: Any) -> None:
    parser = make_parser("think", think_tok)
    reasoning_ids = ids(think_tok, "\nthe river runs north\n")
    answer_ids = ids(think_tok, "\n\nIt is cold.")
    start, end = ids(think_tok, "<think>"), ids(think_tok, "</think>")
    assert len(start) == len(end) == 1
    eos = [think_tok.eos_token_id]

    def count(prompt_ids: list[int], out: list[int]) -> int:
        return split_output(
            parser, prompt_ids, out, think_tok.decode(out, skip_special_tokens=True)
        ).reasoning_tokens

    # Output opens the block; the prompt does not.
    closed_prompt = prompt(think_tok, enable_thinking=False)
    assert count(closed_prompt, start + reasoning_ids + end + answer_ids + eos) == len(
        reasoning_ids
    )
    # The template opened it: reasoning from the first output token.
    open_prompt = prompt(think_tok)
    assert count(open_prompt, reasoning_ids + end + answer_ids + eos) == len(reasoning_ids)
    # Unfinished at max_tokens: all of it.
    assert count(open_prompt, reasoning_ids) == len(reasoning_ids)
    # No block: none.
    assert count(closed_prompt, answer_ids + eos) == 0


def test_think_needs_its_tokens(plain_tok: Any) -> None:
    with pytest.raises(ReasoningError, match="'<think>' as one token"):
        make_parser("think", plain_tok)
    assert make_parser("none", plain_tok) is None
    with pytest.raises(ReasoningError, match="unknown reasoning format"):
        make_parser("thinking", plain_tok)


# --- harmony ----------------------------------------------------------------------------------

HARMONY_OUTPUT = (
    "<|channel|>analysis<|message|>The river runs north, so the water is cold.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking the map.<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|> Yes.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is cold because it comes from the "
    "mountain.<|return|>"
)


def test_harmony_whole_and_every_cut_of_the_ids(harmony_tok: Any) -> None:
    parser = make_parser("harmony", harmony_tok)
    prompt_ids = prompt(harmony_tok, reasoning_effort="high")
    output_ids = ids(harmony_tok, HARMONY_OUTPUT)
    text = harmony_tok.decode(output_ids, skip_special_tokens=True)  # what engines return
    whole = split_output(parser, prompt_ids, output_ids, text)
    assert whole.reasoning == "The river runs north, so the water is cold. Yes."
    assert whole.text == "It is cold because it comes from the mountain."
    content = ids(harmony_tok, "The river runs north, so the water is cold.") + ids(
        harmony_tok, " Yes."
    )
    assert whole.reasoning_tokens == len(content)
    for i, j in itertools.combinations_with_replacement(range(len(output_ids) + 1), 2):
        pieces = [(output_ids[:i], ""), (output_ids[i:j], ""), (output_ids[j:], "")]
        assert streamed(parser, prompt_ids, pieces) == whole, (i, j)


def test_harmony_unfinished_analysis_and_no_analysis(harmony_tok: Any) -> None:
    parser = make_parser("harmony", harmony_tok)
    prompt_ids = prompt(harmony_tok)
    cut = ids(harmony_tok, "<|channel|>analysis<|message|>The river runs")
    out = split_output(parser, prompt_ids, cut, "")
    assert out == Split("The river runs", "", len(ids(harmony_tok, "The river runs")))
    final_only = ids(harmony_tok, "<|channel|>final<|message|>Cold.<|return|>")
    assert split_output(parser, prompt_ids, final_only, "") == Split(None, "Cold.", 0)
    # Not harmony at all: the whole output is the answer.
    plain = ids(harmony_tok, "Cold water.")
    assert split_output(parser, prompt_ids, plain, "") == Split(None, "Cold water.", 0)


# GPT-OSS's calls: messages to functions.NAME, the recipient before or after the channel.
HARMONY_CALLS = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Looking it up.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    '{"city": "Paris"}<|call|>'
    "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
    '<|message|>{"city": "Rome"}<|call|>'
)


def test_harmony_calls_whole_and_streamed_in_any_pieces(harmony_tok: Any) -> None:
    parser = make_parser("harmony", harmony_tok)
    prompt_ids = prompt(harmony_tok)
    output_ids = ids(harmony_tok, HARMONY_CALLS)
    whole = split_output(parser, prompt_ids, output_ids, "")
    assert whole.calls == (("get_weather", '{"city": "Paris"}'), ("get_time", '{"city": "Rome"}'))
    # The calls' arguments are neither reasoning nor answer, and not reasoning tokens.
    assert (whole.reasoning, whole.text) == ("Need the weather.", "")
    assert whole.reasoning_tokens == len(ids(harmony_tok, "Need the weather."))
    # Every cut in two, and 300 random cuts in three (every pair would take seconds).
    rng = random.Random(7)
    n = len(output_ids)
    cuts = [(i, i) for i in range(n + 1)]
    cuts += [tuple(sorted((rng.randint(0, n), rng.randint(0, n)))) for _ in range(300)]
    for i, j in cuts:
        pieces = [(output_ids[:i], ""), (output_ids[i:j], ""), (output_ids[j:], "")]
        assert streamed(parser, prompt_ids, pieces) == whole, (i, j)


def test_a_harmony_call_cut_short_is_kept_only_when_whole(harmony_tok: Any) -> None:
    parser = make_parser("harmony", harmony_tok)
    prompt_ids = prompt(harmony_tok)
    head = "<|channel|>commentary to=functions.get_weather json<|message|>"
    whole_json = split_output(parser, prompt_ids, ids(harmony_tok, head + '{"city": "Oslo"}'), "")
    assert whole_json.calls == (("get_weather", '{"city": "Oslo"}'),) and whole_json.text == ""
    # Arguments cut mid-way (max_tokens): not a call, and not lost: the answer's text.
    cut = split_output(parser, prompt_ids, ids(harmony_tok, head + '{"city": "Os'), "")
    assert cut.calls == () and cut.text == '{"city": "Os'


def test_harmony_needs_its_tokens(think_tok: Any) -> None:
    with pytest.raises(ReasoningError, match="harmony needs"):
        make_parser("harmony", think_tok)


def test_delta_truthiness() -> None:
    assert not Delta()
    assert Delta(reasoning="x") and Delta(text="y")


# --- job config -------------------------------------------------------------------------------


def _job(**prompt: Any) -> Any:
    from pipeline.spec import parse_job_spec

    return parse_job_spec(
        {
            "name": "r",
            "input": {"uri": "/in.jsonl", "format": "jsonl", "prompt_column": "q"},
            "model": {"path": "/m"},
            "output": {"uri": "/out"},
            "prompt": prompt,
            "sampling": {"overrides": {"reasoning_effort": "effort"}},
        }
    )


def test_rows_render_with_their_own_effort(think_tok: Any) -> None:
    from pipeline.batch.columns import REASONING_EFFORT
    from pipeline.batch.stages.prompts import render_row, render_rows

    spec = _job(reasoning="think", reasoning_effort="low", enable_thinking=False)
    rows = [
        {"prompt": f"Why is river {i} cold?", REASONING_EFFORT: effort}
        for i, effort in enumerate(["high", None, "medium", None, "high"])
    ]
    together = render_rows(rows, spec, think_tok)
    assert together == [render_row(row, spec, think_tok) for row in rows]
    texts = [think_tok.decode(ids) for ids in together]
    assert "Reasoning: high" in texts[0] and "Reasoning: low" in texts[1]
    assert all(t.endswith("<think>\n\n</think>\n\n") for t in texts)  # enable_thinking false


def test_fingerprint_changes_only_when_reasoning_is_set() -> None:
    from pipeline.batch.commit.fingerprint import _prompt_part, job_fingerprint

    plain, think = _job(), _job(reasoning="think")
    # A job without the reasoning fields fingerprints as before they existed.
    assert set(_prompt_part(plain)) == {"template", "system_prompt", "chat_template"}
    assert _prompt_part(think)["reasoning"] == "think"
    a = job_fingerprint(plain, [], model_info={})
    b = job_fingerprint(think, [], model_info={})
    assert a.value != b.value

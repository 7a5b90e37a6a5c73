"""Incremental detokenization and stop strings, against the tokenizer's own full decode."""

from __future__ import annotations

import pytest

from engines.detokenize import IncrementalDetokenizer
from engines.dev.tiny import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(512)


def test_incremental_text_equals_full_decode(tokenizer) -> None:
    text = "Every bucket reads the manifest, then the cluster waits 4096 seconds. Ünïcödé ✓"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=())
    for token in ids:
        assert detok.add(token) is None
    assert detok.text == tokenizer.decode(ids)


def test_a_character_cut_in_the_middle_stays_out_of_the_text(tokenizer) -> None:
    ids = tokenizer.encode("bridge ✓")
    partial = next(n for n in range(len(ids), 0, -1) if "\ufffd" in tokenizer.decode(ids[:n]))
    detok = IncrementalDetokenizer(tokenizer, [], stop=())
    for token in ids[:partial]:
        detok.add(token)
    assert "\ufffd" not in detok.text
    assert tokenizer.decode(ids[:partial]).startswith(detok.text)


def test_stop_string_cuts_text_before_the_match(tokenizer) -> None:
    ids = tokenizer.encode("the river runs under the bridge and the city sleeps")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("bridge", "never"))
    matched = None
    used = 0
    for token in ids:
        used += 1
        matched = detok.add(token)
        if matched:
            break
    assert matched == "bridge"
    assert detok.text == "the river runs under the "
    assert used < len(ids)


def test_stop_string_spanning_tokens_and_earliest_match_wins(tokenizer) -> None:
    ids = tokenizer.encode("seven twelve hundred")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("hundred", "en tw"))
    matched = next(m for m in (detok.add(t) for t in ids) if m is not None)
    assert matched == "en tw"  # completed by " t" + "welve", before "hundred" appears
    assert detok.text == "sev"


def test_stable_text_holds_back_a_possible_stop_prefix(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], stop=("abcd",))
    for token in tokenizer.encode("xyz ab"):
        detok.add(token)
    assert detok.stable_text_len() == len(detok.text) - 3

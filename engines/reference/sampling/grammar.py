"""Structured output for the reference engine: grammars from response formats, token masks.

xgrammar (the grammar engine vLLM, SGLang and TensorRT-LLM use) does the work: it compiles a
JSON schema, a regex or an EBNF grammar against the tokenizer's vocabulary once, and a
per-request matcher then gives, for each step, the set of tokens that keep the text inside the
grammar as a bitmask. Per step the engine fills the masks of all constrained rows in one call
and sets every disallowed logit to -inf before sampling, so greedy and sampled rows alike only
ever pick allowed tokens.

Compiled grammars are cached by response format (most jobs use one schema for every row), so
compiling costs once per schema and engine, not once per row. A matcher holds the request's
position in its grammar; the engine's preemption recomputes KV but keeps the output tokens, so
the matcher never needs rolling back.

When the grammar is complete the matcher allows only the model's EOS tokens, so a constrained
request ends with finish_reason "stop" as soon as its text is whole. A request that hits
max_tokens first ends with "length" and its text is cut short: the batch output's `parsed`
flag says which rows are whole.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from engines.api import EngineError, ResponseFormat

# Distinct response formats kept compiled per engine; a job with a schema per row cycles.
CACHE_SIZE = 256

# xgrammar's C++ errors start with a timestamp, a source location and a check expression.
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """A response format xgrammar cannot compile; the message says what is wrong."""


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise EngineError(
            f"structured output (response_format) needs xgrammar, which is not installed "
            f"({exc}); pip install 'xgrammar>=0.1.25,<0.3'"
        ) from exc
    return xgrammar


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose only sentences are `choices`. JSON string quoting is the EBNF
    string syntax xgrammar reads (backslash escapes), so any text is quoted safely."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar's rules for the characters of a JSON string let through what JSON text cannot
# hold: its rule for length-bounded strings passes raw control characters (U+0000 to U+001F),
# which strict parsers (Python's json, most others) reject, and both rules pass the surrogate
# code points U+D800 to U+DFFF, whose UTF-8 bytes are invalid and decode to U+FFFD (breaking
# maxLength as well). Both rules get the class JSON allows.
_STRING_CHAR_RULES = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n\uD800-\uDFFF]"
# xgrammar 0.1.x (TensorRT-LLM 1.2's pin) clamps a negated class's code points above 127, so
# the surrogate range there would refuse every non-ASCII character: it gets the control
# characters out only, and a surrogate stays possible (rare; it decodes to U+FFFD).
_JSON_STRING_CHAR_0_1 = r"[^\0-\x1f\"\\\r\n]"


XGRAMMAR_0_1_LIMITATION = (
    "structured output on xgrammar 0.1.x: a JSON string can hold a surrogate code point, "
    "which decodes to U+FFFD and breaks maxLength; such a row fails its schema check "
    "(parsed: false). xgrammar >= 0.2 keeps them out."
)


def limitations() -> tuple[str, ...]:
    """What the installed xgrammar cannot guarantee (EngineInfo.limitations), read from its
    metadata so that an engine without structured output never imports it."""
    from importlib import metadata

    from packaging.version import Version

    try:
        version = Version(metadata.version("xgrammar"))
    except metadata.PackageNotFoundError:
        return ()
    return (XGRAMMAR_0_1_LIMITATION,) if version < Version("0.2") else ()


def json_strings_without_controls(ebnf: str, surrogates_excludable: bool = True) -> str:
    """`ebnf` (a JSON schema's grammar) with only characters JSON text allows in strings
    (`surrogates_excludable`: False for xgrammar 0.1.x, see _JSON_STRING_CHAR_0_1)."""
    char = _JSON_STRING_CHAR if surrogates_excludable else _JSON_STRING_CHAR_0_1
    for rule in _STRING_CHAR_RULES:
        ebnf = ebnf.replace(rule, char)
    return ebnf


class Grammars:
    """Compiled grammars for one tokenizer and vocabulary, and per-request matchers."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        threads: int = 1,
    ) -> None:
        xgr = _import_xgrammar()
        self._xgr = xgr
        self.vocab_size = vocab_size
        # The model's vocabulary can be larger than the tokenizer's (padded embeddings): those
        # ids decode to nothing and are always masked.
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        # xgrammar 0.2 fills all rows' masks in one call spread over its threads; 0.1.x
        # (TensorRT-LLM 1.2's pin) fills one matcher at a time.
        batch = getattr(xgr, "BatchGrammarMatcher", None)
        self._batch = batch(max_threads=threads) if batch is not None else None
        self._modern = batch is not None  # 0.2 or later: see _JSON_STRING_CHAR_0_1
        self._cache: OrderedDict[ResponseFormat, Any] = OrderedDict()
        self._lock = threading.Lock()  # compile runs on callers' threads, the cache is shared

    def compile(self, fmt: ResponseFormat) -> Any:
        """The compiled grammar of `fmt`; GrammarError when xgrammar cannot compile it."""
        with self._lock:
            compiled = self._cache.get(fmt)
            if compiled is not None:
                self._cache.move_to_end(fmt)
                return compiled
        try:
            compiled = self._compile(fmt)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GrammarError(
                f"response_format {fmt.kind} cannot be compiled: {_NOISE.sub('', first)}"
            ) from None
        with self._lock:
            self._cache[fmt] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, fmt: ResponseFormat) -> Any:
        if fmt.kind in ("json_schema", "json_object"):
            schema = fmt.schema if fmt.kind == "json_schema" else '{"type": "object"}'
            # any_whitespace=False: one space after ":" and ",", no other whitespace, as
            # OpenAI's structured outputs give; a random or weak model would otherwise spend
            # its budget on whitespace.
            grammar = self._xgr.Grammar.from_json_schema(schema, any_whitespace=False)
            ebnf = json_strings_without_controls(str(grammar), self._modern)
            return self._compiler.compile_grammar(ebnf)
        if fmt.kind == "regex":
            return self._compiler.compile_regex(fmt.regex)
        return self._compiler.compile_grammar(choice_grammar(fmt.choices))

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher at the start of `compiled`'s grammar (one per request)."""
        return self._xgr.GrammarMatcher(compiled)

    def mask(self, logits: Any, rows: Sequence[int], matchers: Sequence[Any]) -> None:
        """Set the logits of tokens each matcher forbids to -inf, in place.

        `logits` is [S, V] (any device); `rows[i]` is the row `matchers[i]` constrains.
        One fill for all rows (xgrammar 0.2 spreads it over its threads), one apply."""
        if not rows:
            return
        xgr = self._xgr
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        if self._batch is not None:
            self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask, list(rows))
        else:
            for matcher, row in zip(matchers, rows, strict=True):
                matcher.fill_next_token_bitmask(bitmask, row)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=list(rows)
        )

    def mask_constrained(self, logits: Any, rows: Sequence[int], lives: Sequence[Any]) -> None:
        """`mask` for the requests in `lives` (the engine's per-request state) that have a
        matcher (`.matcher`, None when unconstrained); rows[i] is lives[i]'s row. Rows with a
        grammar never carry proposals: one row each."""
        constrained = [i for i, live in enumerate(lives) if live.matcher is not None]
        if constrained:
            matchers = [lives[i].matcher for i in constrained]
            self.mask(logits, [rows[i] for i in constrained], matchers)


def accept(matcher: Any, token: int) -> bool:
    """Advance `matcher` by `token`; False when the grammar does not allow it (cannot happen
    for a token sampled from masked logits, but a caller bug must not pass silently)."""
    return bool(matcher.accept_token(token))


def is_complete(matcher: Any) -> bool:
    """True once the grammar has accepted a stop token: the text is whole."""
    return bool(matcher.is_terminated())

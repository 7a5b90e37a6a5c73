"""How an engine's output becomes a chat or completions answer, whole or streamed: the
reasoning split of a reasoning model's chat answers and the logprobs bodies."""

from __future__ import annotations

from engines.api import GenerationResult
from pipeline.openai.reasoning import ReasoningParser, Split, split_output
from pipeline.serve.gateway import Gateway
from pipeline.serve.protocol.logprobs import LogprobsBody
from pipeline.serve.protocol.requests import Prepared


def reasoning_parser(gw: Gateway, prepared: Prepared) -> ReasoningParser | None:
    """The model's reasoning parser, for requests whose answers are split (chat)."""
    if not prepared.split_reasoning:
        return None
    return gw.tokenizers[prepared.served.name].reasoning


def split(
    gw: Gateway, prepared: Prepared, prompt_ids: list[int], result: GenerationResult
) -> Split | None:
    parser = reasoning_parser(gw, prepared)
    if parser is None:
        return None
    return split_output(parser, prompt_ids, result.output_token_ids, result.text)


def logprobs_builder(gw: Gateway, prepared: Prepared) -> LogprobsBody:
    return LogprobsBody(prepared.ids.endpoint, gw.tokenizers[prepared.served.name].token_text)

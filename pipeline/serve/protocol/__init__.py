"""From a parsed OpenAI request to an engine request, and from an engine result back.

tokens (prompt token ids through pipeline.openai.chat, counted in the ingress), requests (caps,
OpenAI's defaults, the engine request; a result's `usage` and cost) and logprobs (engine
logprobs → OpenAI's `logprobs` objects). Pure functions the ingress calls, testable without Ray;
the wire format itself is pipeline.openai.
"""

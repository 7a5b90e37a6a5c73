"""Sampling: the sampler, grammars (structured output), logits processors and logprobs."""

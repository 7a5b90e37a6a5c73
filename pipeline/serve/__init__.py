"""The Serve product: an OpenAI-compatible HTTP endpoint over the same engines as the batch jobs.

spec (the serve file) → auth and keys (plaintext keys' digests; the reloaded keys file of named
keys) → app (FastAPI ingress: limits, protocol checks, prompts, tokens) → replica (one engine
per Serve replica) → cost, metrics and usage (per key, and the usage log); run starts it all on
Ray.
"""

"""The Serve product: an OpenAI-compatible HTTP endpoint over the same engines as the batch jobs.

spec (the serve file) → auth (bearer keys) → app (FastAPI ingress: protocol checks, prompts,
tokens) → replica (one engine per Serve replica) → cost and metrics; run starts it all on Ray.
"""

"""The Serve product: an OpenAI-compatible HTTP endpoint over the same engines as the batch jobs.

spec (the serve file) → access (plaintext keys' digests; the reloaded keys file of named keys;
per-key limits, shared by the ingress replicas) → app (FastAPI ingress: limits, protocol checks,
prompts, tokens; protocol/ turns requests into engine requests, http/ holds the HTTP plumbing)
→ replicas (one engine per Serve replica, their health, routing and board) → metrics and usage
(per key, and the usage log); batch_api/ adds /v1/files and /v1/batches; run starts it all on
Ray.

At this level: app (the ingress deployment, app assembly), run (`tokenmill serve`), spec (the
serve file), metrics (Prometheus) and usage (per-key usage and its log).
"""

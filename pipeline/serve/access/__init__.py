"""Who may call the Serve endpoint and how much: API keys and their limits.

auth (plaintext keys from the environment or a secrets file, only their digests travel on),
keys (the keys file of named keys: limits, allowed models, Batch API quotas; its reload and key
lookup), limits (one ingress replica's per-key budgets and its own slots), and the limits held
over several ingress replicas: limit_ledger (the authoritative budgets), limit_coordinator (the
named actor holding the ledger) and shared_limits (a replica's admission from its lease).
"""

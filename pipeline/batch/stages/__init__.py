"""The batch stages, in the order a row meets them: read, prompts, generate, rows, schema (and
the actor-side helpers they share: heap, devices, tools)."""

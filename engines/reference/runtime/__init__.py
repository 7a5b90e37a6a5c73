"""The engine's runtime: scheduler, KV cache, model runner, resources, profiling, sample groups."""

"""The reference PyTorch engine: paged KV cache, in-flight batching, CPU or CUDA."""

"""The model: architectures, weights, MoE, quantized linears and the CPU kernels they run on."""

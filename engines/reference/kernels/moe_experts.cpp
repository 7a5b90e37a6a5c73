// A Mixture-of-Experts layer's active experts run side by side on the intra-op threads (CPU).
//
// The grouped expert path (engines/reference/moe.py) runs one SwiGLU MLP per active expert over
// that expert's rows. When each expert has few rows (decode), one expert's GEMMs do not spread
// over threads: they stream the expert's weights, as fast on one thread as on two. So here the
// experts are shared out instead: one share per thread, each thread running its experts' GEMMs
// single-threaded (oneDNN and ATen run a call made inside a parallel region on the calling
// thread), with no thread of our own (a second OpenMP pool would make every pool stop spinning
// at its barriers; see ReferenceEngine._serve). Each expert's arithmetic is the same calls as
// the one-after-another path, so the outputs are the same (to the last bits only where oneDNN
// would split a GEMM's reduction over threads).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

namespace {

// y = x W^T through oneDNN with W in its packed layout (linear.OneDnnLinear), no bias.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(c10::IValue());  // no bias
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tokenmill::silu_mul", "")
                             .typed<at::Tensor(const at::Tensor&)>();
  return op.call(gate_up);
}

// outputs[first:first+count] = down(silu_mul(gate_up(grouped[first:first+count]))) * weight
// for every listed expert; share s is entries share_starts[s] .. share_starts[s + 1] - 1.
void moe_experts(const at::Tensor& grouped, at::Tensor& outputs, const at::Tensor& pair_weights,
                 at::IntArrayRef firsts, at::IntArrayRef counts, at::IntArrayRef share_starts,
                 at::TensorList gate_up, at::TensorList down) {
  const int64_t entries = static_cast<int64_t>(firsts.size());
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == entries &&
                  static_cast<int64_t>(gate_up.size()) == entries &&
                  static_cast<int64_t>(down.size()) == entries,
              "moe_experts: one first row, count, gate_up and down weight per entry");
  TORCH_CHECK(share_starts.size() >= 2 && share_starts.front() == 0 &&
                  share_starts.back() == entries,
              "moe_experts: share_starts must run from 0 to the number of entries");
  TORCH_CHECK(grouped.is_contiguous() && outputs.is_contiguous() && grouped.dim() == 2 &&
                  outputs.sizes() == grouped.sizes(),
              "moe_experts: grouped and outputs are contiguous [rows, hidden]");
  const int64_t shares = static_cast<int64_t>(share_starts.size()) - 1;
  // The caller's inference mode and dispatch state, which OpenMP workers do not inherit.
  const at::ThreadLocalState caller;
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(caller);
    for (int64_t s = begin; s < end; ++s) {
      for (int64_t i = share_starts[s]; i < share_starts[s + 1]; ++i) {
        const auto x = grouped.narrow(0, firsts[i], counts[i]);
        const auto y = packed_linear(silu_mul(packed_linear(x, gate_up[i])), down[i]);
        outputs.narrow(0, firsts[i], counts[i])
            .copy_(y.mul_(pair_weights.narrow(0, firsts[i], counts[i])));
      }
    }
  });
}

}  // namespace

// Registered for every backend (not CPU only): the packed weights are oneDNN tensors, whose
// own dispatch key would otherwise pick the kernel; the op itself only runs on CPU.
TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def(
      "moe_experts(Tensor grouped, Tensor(a!) outputs, Tensor pair_weights, int[] firsts, "
      "int[] counts, int[] share_starts, Tensor[] gate_up, Tensor[] down) -> ()",
      &moe_experts);
}

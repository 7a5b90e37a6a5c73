// e^x in plain arithmetic the compiler vectorises, for the CPU kernels' inner loops: std::exp
// is a scalar libm call per element and was most of the attention kernel's time.
// x = (n + f) / log2 e with n an integer and |f| <= 1/2: 2^n from the exponent bits, 2^f from
// its Taylor series to degree 7 (relative error below 1e-8, under fp32's rounding). x is
// clamped to [-87, 88]: below, the result is ~0 (as e^x is in fp32); above, e^x overflows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tokenmill {

// e^f for |f| <= ln 2 / 2, the Taylor series to degree 7; T is float or a GCC vector of
// floats (the attention kernel's lane-wise softmax), the same arithmetic lane by lane.
template <typename T>
inline T exp_reduced(T f) {
  T p = f * (1.f / 5040.f) + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  return p * f + 1.f;
}

inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float t = x * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float p = exp_reduced((t - n) * 0.693147180559945309f);  // 2^(t - n) = e^f
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace tokenmill

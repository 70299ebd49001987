// One head row through RMSNorm and RoPE on the CPU: the arithmetic both CPU kernels share.
#pragma once

#include <cmath>
#include <cstdint>

namespace vllm_dflash {

// Weight rounding: vLLM's drafter applies k_norm's weight after a rounded rms_norm on the
// context path (kSeparate) and inside rms_norm on the block path (kFused).
enum class WeightRounding { kSeparate, kFused };

// Normalises `in` (dim elements, stride in_s) with weight `w` (stride w_s), rotates the
// first `rot` dims by the cos/sin row `cs` ([cos | sin], rot / 2 each), and writes `out`
// (stride out_s). Reads all of `in` before writing, so in == out is allowed. fp32 math;
// `buf` holds dim floats.
template <typename T, WeightRounding R>
inline void norm_rope_row(const T* in, int64_t in_s, T* out, int64_t out_s, const T* w,
                          int64_t w_s, int64_t dim, float eps, const T* cs, int64_t rot,
                          bool is_neox, float* buf) {
  float ss = 0.f;
  for (int64_t d = 0; d < dim; ++d) {
    const float x = static_cast<float>(in[d * in_s]);
    ss += x * x;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
  for (int64_t d = 0; d < dim; ++d) {
    const float x = static_cast<float>(in[d * in_s]) * inv;
    const float wd = static_cast<float>(w[d * w_s]);
    buf[d] = R == WeightRounding::kSeparate
                 ? static_cast<float>(static_cast<T>(static_cast<float>(static_cast<T>(x)) * wd))
                 : x * wd;
  }
  const int64_t half = rot / 2;
  for (int64_t j = 0; j < half; ++j) {
    const int64_t a = is_neox ? j : 2 * j, b = is_neox ? j + half : 2 * j + 1;
    const float c = static_cast<float>(cs[j]), s = static_cast<float>(cs[half + j]);
    out[a * out_s] = static_cast<T>(buf[a] * c - buf[b] * s);
    out[b * out_s] = static_cast<T>(buf[b] * c + buf[a] * s);
  }
  for (int64_t d = rot; d < dim; ++d) out[d * out_s] = static_cast<T>(buf[d]);
}

}  // namespace vllm_dflash

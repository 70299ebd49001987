// CUDA kernel of vllm_dflash::qk_norm_rope: one thread block per (token, q or k head) row,
// normalised and rotated in place; value heads are not touched.
#include "common.cuh"
#include "launchers.cuh"

namespace vllm_dflash {
namespace {

template <typename T>
__global__ void qk_norm_rope_kernel(const QkNormRopeParams p) {
  extern __shared__ float y[];  // [dim]
  const int64_t heads = p.heads + p.kv_heads;
  const int64_t i = blockIdx.x / heads, h = blockIdx.x % heads;
  const bool is_q = h < p.heads;
  T* row = static_cast<T*>(p.qkv) + i * p.s_n + h * p.dim * p.s_d;
  const T* w = static_cast<const T*>(is_q ? p.q_weight : p.k_weight);
  const T* cs = static_cast<const T*>(p.cos_sin) + p.positions[i * p.pos_stride] * p.rot;
  norm_rope_row<T>(row, p.s_d, row, p.s_d, w, is_q ? p.qw_s : p.kw_s, p.dim, p.eps, cs, p.rot,
                   p.is_neox, /*separate_weight=*/false, y);
}

template <typename T>
cudaError_t launch(const QkNormRopeParams& p, cudaStream_t stream) {
  const int64_t rows = p.tokens * (p.heads + p.kv_heads);
  if (rows == 0) return cudaSuccess;
  const size_t shared = static_cast<size_t>(p.dim) * sizeof(float);
  qk_norm_rope_kernel<T><<<static_cast<unsigned>(rows), kThreads, shared, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_qk_norm_rope(const QkNormRopeParams& p, DType dtype, cudaStream_t stream) {
  return dispatch_dtype(
      dtype, [&](auto t) { return launch<typename decltype(t)::type>(p, stream); });
}

}  // namespace vllm_dflash

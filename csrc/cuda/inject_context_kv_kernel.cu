// CUDA kernel of vllm_dflash::inject_context_kv: one thread block per (token, layer, kv head)
// row; the key row goes through norm_rope_row into the key cache, the value row is copied.
#include "common.cuh"
#include "launchers.cuh"

namespace vllm_dflash {
namespace {

template <typename T>
__global__ void inject_context_kv_kernel(const InjectContextKvParams p) {
  extern __shared__ float y[];  // [dim]
  const int64_t row = blockIdx.x;
  const int64_t i = row / (p.layers * p.heads);
  const int64_t l = (row / p.heads) % p.layers;
  const int64_t h = row % p.heads;
  const int64_t s = p.slots[i * p.slot_stride];
  if (s < 0) return;  // padding: the whole block leaves together, before any barrier
  const int64_t blk = s / p.block_size, off = s % p.block_size;
  const T* k = static_cast<const T*>(p.kv) + i * p.s_n + l * p.s_l + h * p.s_h;
  const T* v = k + p.s_kv;
  const CacheStrides& K = p.key[l];
  T* kd = static_cast<T*>(K.data) + blk * K.block + off * K.offset + h * K.head;
  const T* cs = static_cast<const T*>(p.cos_sin) + p.positions[i * p.pos_stride] * p.rot;
  norm_rope_row<T>(k, p.s_d, kd, K.dim, static_cast<const T*>(p.weight) + l * p.w_l, p.w_d,
                   p.dim, p.eps, cs, p.rot, p.is_neox, /*separate_weight=*/true, y);
  const CacheStrides& V = p.value[l];
  T* vd = static_cast<T*>(V.data) + blk * V.block + off * V.offset + h * V.head;
  for (int64_t d = threadIdx.x; d < p.dim; d += blockDim.x) vd[d * V.dim] = v[d * p.s_d];
}

template <typename T>
cudaError_t launch(const InjectContextKvParams& p, cudaStream_t stream) {
  const int64_t rows = p.tokens * p.layers * p.heads;
  if (rows == 0) return cudaSuccess;
  const size_t shared = static_cast<size_t>(p.dim) * sizeof(float);
  inject_context_kv_kernel<T><<<static_cast<unsigned>(rows), kThreads, shared, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_inject_context_kv(const InjectContextKvParams& p, DType dtype,
                                     cudaStream_t stream) {
  return dispatch_dtype(
      dtype, [&](auto t) { return launch<typename decltype(t)::type>(p, stream); });
}

}  // namespace vllm_dflash

// Device helpers shared by the CUDA kernels: dtype conversions and one head row through
// RMSNorm and RoPE by a whole thread block (same arithmetic as csrc/cpu/norm_rope.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "launchers.cuh"

namespace vllm_dflash {

template <typename T>
struct Tag {
  using type = T;
};

// Runs launch(Tag<T>{}) with the element type T of `dtype`: the one place the launchers map
// the tensor dtype to a kernel instantiation.
template <typename Launch>
cudaError_t dispatch_dtype(DType dtype, Launch&& launch) {
  switch (dtype) {
    case DType::kFloat32:
      return launch(Tag<float>{});
    case DType::kFloat16:
      return launch(Tag<__half>{});
    case DType::kBFloat16:
      return launch(Tag<__nv_bfloat16>{});
  }
  return cudaErrorInvalidValue;
}

constexpr int kThreads = 128;  // per block; a power of two for the reduction

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}
template <>
__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  return static_cast<T>(x);
}
template <>
__device__ __forceinline__ __half from_float(float x) {
  return __float2half(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float x) {
  return __float2bfloat16(x);
}

// Called by every thread of a kThreads block. `y` is shared memory of dim floats. Reads
// all of `in` before the barrier and writes `out` after it, so in == out is allowed.
// separate_weight: round to T after the norm and after the weight (rms_norm(x) * w, the
// context path), else one rounding at the end (rms_norm(x, w), the block path).
template <typename T>
__device__ void norm_rope_row(const T* in, int64_t in_s, T* out, int64_t out_s, const T* w,
                              int64_t w_s, int64_t dim, float eps, const T* cs, int64_t rot,
                              bool is_neox, bool separate_weight, float* y) {
  __shared__ float partial[kThreads];
  float ss = 0.f;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    const float x = to_float(in[d * in_s]);
    ss += x * x;
  }
  partial[threadIdx.x] = ss;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  const float inv = rsqrtf(partial[0] / static_cast<float>(dim) + eps);
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    const float x = to_float(in[d * in_s]) * inv;
    const float wd = to_float(w[d * w_s]);
    y[d] = separate_weight ? to_float(from_float<T>(to_float(from_float<T>(x)) * wd)) : x * wd;
  }
  __syncthreads();
  const int64_t half = rot / 2;
  for (int64_t j = threadIdx.x; j < half; j += blockDim.x) {
    const int64_t a = is_neox ? j : 2 * j, b = is_neox ? j + half : 2 * j + 1;
    const float c = to_float(cs[j]), s = to_float(cs[half + j]);
    out[a * out_s] = from_float<T>(y[a] * c - y[b] * s);
    out[b * out_s] = from_float<T>(y[b] * c + y[a] * s);
  }
  for (int64_t d = rot + threadIdx.x; d < dim; d += blockDim.x) out[d * out_s] = from_float<T>(y[d]);
}

}  // namespace vllm_dflash

// Launcher interfaces of the CUDA kernels. Plain C++ types only, so the kernel files compile
// with nvcc alone (no torch headers); torch_bindings_cuda.cpp fills these from tensors.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace vllm_dflash {

constexpr int kMaxLayers = 16;  // per launch; kernel parameters must stay under 4 KiB

struct CacheStrides {
  void* data;
  int64_t block, offset, head, dim;  // in elements
};

struct InjectContextKvParams {
  const void* kv;  // [tokens, layers, 2, heads, dim]
  int64_t s_n, s_l, s_kv, s_h, s_d;
  const void* weight;  // [layers, dim]
  int64_t w_l, w_d;
  const void* cos_sin;  // [positions, rot], contiguous
  const int64_t* positions;
  int64_t pos_stride;
  const int64_t* slots;
  int64_t slot_stride;
  int64_t tokens, layers, heads, dim, rot, block_size;
  float eps;
  bool is_neox;
  CacheStrides key[kMaxLayers];
  CacheStrides value[kMaxLayers];
};

struct QkNormRopeParams {
  void* qkv;  // [tokens, (heads + 2 * kv_heads) * dim], in place
  int64_t s_n, s_d;
  const void* q_weight;
  const void* k_weight;
  int64_t qw_s, kw_s;
  const void* cos_sin;  // [positions, rot], contiguous
  const int64_t* positions;
  int64_t pos_stride;
  int64_t tokens, heads, kv_heads, dim, rot;
  float eps;
  bool is_neox;
};

enum class DType { kFloat32, kFloat16, kBFloat16 };

cudaError_t launch_inject_context_kv(const InjectContextKvParams& p, DType dtype,
                                     cudaStream_t stream);
cudaError_t launch_qk_norm_rope(const QkNormRopeParams& p, DType dtype, cudaStream_t stream);

}  // namespace vllm_dflash

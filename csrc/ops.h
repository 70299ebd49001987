// vllm-dflash custom ops: declarations shared by the schema registration and the kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace vllm_dflash {

// Context K/V injection for every drafter layer in one call (see torch_bindings.cpp for the
// schema and the meaning of each argument).
void inject_context_kv_cpu(const at::Tensor& kv, const at::Tensor& k_norm_weight, double eps,
                           const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                           bool is_neox, const at::Tensor& slots,
                           at::TensorList key_caches, at::TensorList value_caches);

// Shape and dtype checks shared by the CPU and CUDA entry points.
void check_inject_context_kv_args(const at::Tensor& kv, const at::Tensor& k_norm_weight,
                                  const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                                  const at::Tensor& slots, at::TensorList key_caches,
                                  at::TensorList value_caches);

// The drafter block's q_norm / k_norm and RoPE, in place on the fused qkv rows.
void qk_norm_rope_cpu(const at::Tensor& qkv, const at::Tensor& q_weight,
                      const at::Tensor& k_weight, double eps, const at::Tensor& positions,
                      const at::Tensor& cos_sin_cache, bool is_neox, int64_t num_heads,
                      int64_t num_kv_heads);

void check_qk_norm_rope_args(const at::Tensor& qkv, const at::Tensor& q_weight,
                             const at::Tensor& k_weight, const at::Tensor& positions,
                             const at::Tensor& cos_sin_cache, int64_t num_heads,
                             int64_t num_kv_heads);

}  // namespace vllm_dflash

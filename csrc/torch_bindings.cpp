// Registers the vllm_dflash operator library with torch.library. Importing the extension
// module (vllm_dflash._C) runs these static registrations; the Python side then calls
// torch.ops.vllm_dflash.<op>. Kernels register per device in cpu/ and cuda/.
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

namespace vllm_dflash {

void check_inject_context_kv_args(const at::Tensor& kv, const at::Tensor& k_norm_weight,
                                  const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                                  const at::Tensor& slots, at::TensorList key_caches,
                                  at::TensorList value_caches) {
  TORCH_CHECK(kv.dim() == 5 && kv.size(2) == 2,
              "inject_context_kv: kv must be [tokens, layers, 2, kv_heads, head_dim], got ",
              kv.sizes());
  const int64_t n = kv.size(0), layers = kv.size(1), heads = kv.size(3), dim = kv.size(4);
  TORCH_CHECK(dim <= 1024, "inject_context_kv: head_dim ", dim, " > 1024");
  TORCH_CHECK(k_norm_weight.dim() == 2 && k_norm_weight.size(0) == layers &&
                  k_norm_weight.size(1) == dim && k_norm_weight.scalar_type() == kv.scalar_type(),
              "inject_context_kv: k_norm_weight must be [layers, head_dim] in kv's dtype");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == n &&
                  positions.scalar_type() == at::kLong,
              "inject_context_kv: positions must be int64 [tokens]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == n && slots.scalar_type() == at::kLong,
              "inject_context_kv: slots must be int64 [tokens]");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) % 2 == 0 &&
                  cos_sin_cache.size(1) <= dim && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.scalar_type() == kv.scalar_type(),
              "inject_context_kv: cos_sin_cache must be contiguous [positions, rotary_dim] in "
              "kv's dtype, rotary_dim even and <= head_dim");
  TORCH_CHECK(static_cast<int64_t>(key_caches.size()) == layers &&
                  static_cast<int64_t>(value_caches.size()) == layers,
              "inject_context_kv: one key and one value cache per layer");
  for (const auto& caches : {key_caches, value_caches}) {
    for (const auto& c : caches) {
      TORCH_CHECK(c.dim() == 4 && c.size(2) == heads && c.size(3) == dim &&
                      c.size(1) == key_caches[0].size(1) &&
                      c.scalar_type() == kv.scalar_type() && c.device() == kv.device(),
                  "inject_context_kv: caches must be [blocks, block_size, kv_heads, head_dim] "
                  "views in kv's dtype and device, got ",
                  c.sizes());
    }
  }
}

void check_qk_norm_rope_args(const at::Tensor& qkv, const at::Tensor& q_weight,
                             const at::Tensor& k_weight, const at::Tensor& positions,
                             const at::Tensor& cos_sin_cache, int64_t num_heads,
                             int64_t num_kv_heads) {
  const int64_t dim = q_weight.size(0);
  TORCH_CHECK(q_weight.dim() == 1 && k_weight.dim() == 1 && k_weight.size(0) == dim &&
                  q_weight.scalar_type() == qkv.scalar_type() &&
                  k_weight.scalar_type() == qkv.scalar_type(),
              "qk_norm_rope: q_weight and k_weight must be [head_dim] in qkv's dtype");
  TORCH_CHECK(dim <= 1024, "qk_norm_rope: head_dim ", dim, " > 1024");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0, "qk_norm_rope: head counts must be > 0");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * dim,
              "qk_norm_rope: qkv must be [tokens, (num_heads + 2 * num_kv_heads) * head_dim], "
              "got ",
              qkv.sizes());
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == qkv.size(0) &&
                  positions.scalar_type() == at::kLong,
              "qk_norm_rope: positions must be int64 [tokens]");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) % 2 == 0 &&
                  cos_sin_cache.size(1) <= dim && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.scalar_type() == qkv.scalar_type(),
              "qk_norm_rope: cos_sin_cache must be contiguous [positions, rotary_dim] in "
              "qkv's dtype, rotary_dim even and <= head_dim");
}

}  // namespace vllm_dflash

TORCH_LIBRARY(vllm_dflash, m) {
  // For each token n and layer l: k = rms_norm(kv[n, l, 0]) * k_norm_weight[l] per head,
  // rotated by RoPE at positions[n] (cos_sin_cache rows: [cos | sin] of rotary_dim / 2
  // each; neox = rotate halves, else interleaved pairs; dims past rotary_dim unchanged),
  // then k -> key_caches[l] and v = kv[n, l, 1] -> value_caches[l] at block slots[n] /
  // block_size, offset slots[n] % block_size. Caches are [blocks, block_size, kv_heads,
  // head_dim] views with any strides, so one op serves every paged layout that is a strided
  // view. Slots < 0 (padding) are skipped.
  m.def(
      "inject_context_kv(Tensor kv, Tensor k_norm_weight, float eps, Tensor positions, "
      "Tensor cos_sin_cache, bool is_neox, Tensor slots, Tensor(a!)[] key_caches, "
      "Tensor(b!)[] value_caches) -> ()");
  // In place on qkv [tokens, (num_heads + 2 * num_kv_heads) * head_dim]: every query head
  // becomes rope(rms_norm(q, q_weight)), every key head rope(rms_norm(k, k_weight)), at
  // positions[token]; the value heads are left alone.
  m.def(
      "qk_norm_rope(Tensor(a!) qkv, Tensor q_weight, Tensor k_weight, float eps, "
      "Tensor positions, Tensor cos_sin_cache, bool is_neox, int num_heads, "
      "int num_kv_heads) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_dflash, CPU, m) {
  m.impl("inject_context_kv", &vllm_dflash::inject_context_kv_cpu);
  m.impl("qk_norm_rope", &vllm_dflash::qk_norm_rope_cpu);
}

// `import vllm_dflash._C` loads this library (and with it the registrations above).
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "vllm-dflash custom ops", -1,
                               nullptr};
  return PyModule_Create(&module);
}

// CPU kernel of vllm_dflash::qk_norm_rope: the drafter block's q_norm, k_norm and RoPE on
// every query and key head of the fused qkv projection, in place. The PyTorch path is two
// rms_norm calls (each several ATen ops on CPU) and a RoPE op per layer, plus the copies
// between them.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "../ops.h"
#include "norm_rope.h"

namespace vllm_dflash {
namespace {

template <typename T>
void run(const at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
         float eps, const at::Tensor& positions, const at::Tensor& cos_sin, bool is_neox,
         int64_t num_heads, int64_t num_kv_heads) {
  const int64_t n = qkv.size(0), dim = q_weight.size(0), rot = cos_sin.size(1);
  const int64_t heads = num_heads + num_kv_heads;  // v is not touched
  const int64_t s_n = qkv.stride(0), s_d = qkv.stride(1);
  T* data = qkv.data_ptr<T>();
  const T* qw = q_weight.data_ptr<T>();
  const T* kw = k_weight.data_ptr<T>();
  const int64_t qw_s = q_weight.stride(0), kw_s = k_weight.stride(0);
  const T* cs = cos_sin.data_ptr<T>();
  const auto pos = positions.accessor<int64_t, 1>();
  at::parallel_for(0, n * heads, 64, [&](int64_t begin, int64_t end) {
    float y[1024];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r / heads, h = r % heads;
      T* row = data + i * s_n + h * dim * s_d;
      const bool is_q = h < num_heads;
      norm_rope_row<T, WeightRounding::kFused>(row, s_d, row, s_d, is_q ? qw : kw,
                                               is_q ? qw_s : kw_s, dim, eps,
                                               cs + pos[i] * rot, rot, is_neox, y);
    }
  });
}

}  // namespace

void qk_norm_rope_cpu(const at::Tensor& qkv, const at::Tensor& q_weight,
                      const at::Tensor& k_weight, double eps, const at::Tensor& positions,
                      const at::Tensor& cos_sin_cache, bool is_neox, int64_t num_heads,
                      int64_t num_kv_heads) {
  check_qk_norm_rope_args(qkv, q_weight, k_weight, positions, cos_sin_cache, num_heads,
                          num_kv_heads);
  if (qkv.size(0) == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, qkv.scalar_type(),
                                  "qk_norm_rope_cpu", [&] {
                                    run<scalar_t>(qkv, q_weight, k_weight,
                                                  static_cast<float>(eps), positions,
                                                  cos_sin_cache, is_neox, num_heads,
                                                  num_kv_heads);
                                  });
}

}  // namespace vllm_dflash

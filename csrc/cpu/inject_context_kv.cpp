// CPU kernel of vllm_dflash::inject_context_kv. The PyTorch path it replaces runs ~6 ATen
// ops plus one cache-write op per drafter layer, each a dispatch and a pass over memory;
// here every (token, layer, kv head) row is normalised, rotated and written in one pass.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../ops.h"
#include "norm_rope.h"

namespace vllm_dflash {
namespace {

struct CacheView {
  void* data;
  int64_t block, offset, head, dim;  // strides in elements
};

std::vector<CacheView> views(at::TensorList caches) {
  std::vector<CacheView> out;
  out.reserve(caches.size());
  for (const auto& c : caches) {
    out.push_back({c.data_ptr(), c.stride(0), c.stride(1), c.stride(2), c.stride(3)});
  }
  return out;
}

template <typename T>
void run(const at::Tensor& kv, const at::Tensor& weight, float eps, const at::Tensor& positions,
         const at::Tensor& cos_sin, bool is_neox, const at::Tensor& slots,
         const std::vector<CacheView>& kc, const std::vector<CacheView>& vc, int64_t block_size) {
  const int64_t n = kv.size(0), layers = kv.size(1), heads = kv.size(3), dim = kv.size(4);
  const int64_t rot = cos_sin.size(1);
  const int64_t s_n = kv.stride(0), s_l = kv.stride(1), s_kv = kv.stride(2), s_h = kv.stride(3),
                s_d = kv.stride(4);
  const T* src = kv.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  const int64_t w_l = weight.stride(0), w_d = weight.stride(1);
  const T* cs = cos_sin.data_ptr<T>();
  const auto pos = positions.accessor<int64_t, 1>();
  const auto slot = slots.accessor<int64_t, 1>();
  const int64_t rows = n * layers * heads;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    float y[1024];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i = r / (layers * heads), l = (r / heads) % layers, h = r % heads;
      const int64_t s = slot[i];
      if (s < 0) continue;
      const int64_t blk = s / block_size, off = s % block_size;
      const T* k = src + i * s_n + l * s_l + h * s_h;
      const T* v = k + s_kv;
      const CacheView& K = kc[l];
      T* kd = static_cast<T*>(K.data) + blk * K.block + off * K.offset + h * K.head;
      norm_rope_row<T, WeightRounding::kSeparate>(k, s_d, kd, K.dim, w + l * w_l, w_d, dim, eps,
                                                  cs + pos[i] * rot, rot, is_neox, y);
      const CacheView& V = vc[l];
      T* vd = static_cast<T*>(V.data) + blk * V.block + off * V.offset + h * V.head;
      for (int64_t d = 0; d < dim; ++d) vd[d * V.dim] = v[d * s_d];
    }
  });
}

}  // namespace

void inject_context_kv_cpu(const at::Tensor& kv, const at::Tensor& k_norm_weight, double eps,
                           const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                           bool is_neox, const at::Tensor& slots,
                           at::TensorList key_caches, at::TensorList value_caches) {
  check_inject_context_kv_args(kv, k_norm_weight, positions, cos_sin_cache, slots, key_caches,
                               value_caches);
  if (kv.size(0) == 0) return;
  const auto kc = views(key_caches), vc = views(value_caches);
  const int64_t block_size = key_caches[0].size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, kv.scalar_type(), "inject_context_kv_cpu", [&] {
        run<scalar_t>(kv, k_norm_weight, static_cast<float>(eps), positions, cos_sin_cache,
                      is_neox, slots, kc, vc, block_size);
      });
}

}  // namespace vllm_dflash

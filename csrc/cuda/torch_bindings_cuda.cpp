// Torch bindings of the CUDA kernels: argument checks (shared with the CPU kernels), launch
// parameters from tensors, launch on the current stream (so CUDA graphs capture them).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../ops.h"
#include "launchers.cuh"

namespace vllm_dflash {
namespace {

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "vllm_dflash: unsupported dtype ", t.scalar_type());
  }
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": ", cudaGetErrorString(err));
}

void inject_context_kv_cuda(const at::Tensor& kv, const at::Tensor& k_norm_weight, double eps,
                            const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                            bool is_neox, const at::Tensor& slots, at::TensorList key_caches,
                            at::TensorList value_caches) {
  check_inject_context_kv_args(kv, k_norm_weight, positions, cos_sin_cache, slots, key_caches,
                               value_caches);
  TORCH_CHECK(kv.size(1) <= kMaxLayers, "inject_context_kv: at most ", kMaxLayers,
              " layers per call on CUDA, got ", kv.size(1));
  const c10::cuda::CUDAGuard guard(kv.device());
  InjectContextKvParams p{};
  p.kv = kv.data_ptr();
  p.s_n = kv.stride(0);
  p.s_l = kv.stride(1);
  p.s_kv = kv.stride(2);
  p.s_h = kv.stride(3);
  p.s_d = kv.stride(4);
  p.weight = k_norm_weight.data_ptr();
  p.w_l = k_norm_weight.stride(0);
  p.w_d = k_norm_weight.stride(1);
  p.cos_sin = cos_sin_cache.data_ptr();
  p.positions = positions.data_ptr<int64_t>();
  p.pos_stride = positions.stride(0);
  p.slots = slots.data_ptr<int64_t>();
  p.slot_stride = slots.stride(0);
  p.tokens = kv.size(0);
  p.layers = kv.size(1);
  p.heads = kv.size(3);
  p.dim = kv.size(4);
  p.rot = cos_sin_cache.size(1);
  p.block_size = key_caches[0].size(1);
  p.eps = static_cast<float>(eps);
  p.is_neox = is_neox;
  for (int64_t l = 0; l < p.layers; ++l) {
    for (auto [dst, src] : {std::pair{&p.key[l], &key_caches[l]}, {&p.value[l], &value_caches[l]}}) {
      *dst = {src->data_ptr(), src->stride(0), src->stride(1), src->stride(2), src->stride(3)};
    }
  }
  check_launch(launch_inject_context_kv(p, dtype_of(kv), c10::cuda::getCurrentCUDAStream()),
               "inject_context_kv");
}

void qk_norm_rope_cuda(const at::Tensor& qkv, const at::Tensor& q_weight,
                       const at::Tensor& k_weight, double eps, const at::Tensor& positions,
                       const at::Tensor& cos_sin_cache, bool is_neox, int64_t num_heads,
                       int64_t num_kv_heads) {
  check_qk_norm_rope_args(qkv, q_weight, k_weight, positions, cos_sin_cache, num_heads,
                          num_kv_heads);
  const c10::cuda::CUDAGuard guard(qkv.device());
  QkNormRopeParams p{};
  p.qkv = qkv.data_ptr();
  p.s_n = qkv.stride(0);
  p.s_d = qkv.stride(1);
  p.q_weight = q_weight.data_ptr();
  p.k_weight = k_weight.data_ptr();
  p.qw_s = q_weight.stride(0);
  p.kw_s = k_weight.stride(0);
  p.cos_sin = cos_sin_cache.data_ptr();
  p.positions = positions.data_ptr<int64_t>();
  p.pos_stride = positions.stride(0);
  p.tokens = qkv.size(0);
  p.heads = num_heads;
  p.kv_heads = num_kv_heads;
  p.dim = q_weight.size(0);
  p.rot = cos_sin_cache.size(1);
  p.eps = static_cast<float>(eps);
  p.is_neox = is_neox;
  check_launch(launch_qk_norm_rope(p, dtype_of(qkv), c10::cuda::getCurrentCUDAStream()),
               "qk_norm_rope");
}

}  // namespace
}  // namespace vllm_dflash

TORCH_LIBRARY_IMPL(vllm_dflash, CUDA, m) {
  m.impl("inject_context_kv", &vllm_dflash::inject_context_kv_cuda);
  m.impl("qk_norm_rope", &vllm_dflash::qk_norm_rope_cuda);
}

// Shared by the CUDA handlers of the ffi backend (cuda_rwkv7.cu, cuda_rwkv6.cu, cuda_rwkv4.cu,
// cuda_rwkv7_chunk.cu): dtype/head-size dispatch, the CUDA shape checks and launching; the
// kernels' device helpers are in cuda_device.cuh. Each op family compiles on its own, so a
// multi-core build compiles them side by side.
#pragma once

#include <cuda_runtime.h>

#include "checks.h"
#include "cuda_device.cuh"
#include "handlers.h"

namespace rwkv_ffi {

template <typename Body> ffi::Error dispatch_cuda(ffi::DataType dtype, Body&& body) {
  switch (dtype) {
    case ffi::DataType::F32: return body(float{});
    case ffi::DataType::BF16: return body(__nv_bfloat16{});
    case ffi::DataType::F16: return body(__half{});
    default: return ffi::Error::InvalidArgument("inputs must be float32, bfloat16 or float16");
  }
}

template <typename Body> ffi::Error dispatch_head_size(int64_t K, Body&& body) {
  switch (K) {
    case 64: return body(std::integral_constant<int, 64>{});
    case 128: return body(std::integral_constant<int, 128>{});
    default: return ffi::Error::InvalidArgument("the CUDA kernels support K in {64, 128}");
  }
}

// body(T{}, std::integral_constant<int, K>{}) for the inputs' element type T and head size K.
template <typename Body> ffi::Error dispatch_type_and_head_size(ffi::DataType dtype, int64_t K,
                                                                Body&& body) {
  return dispatch_cuda(dtype, [&](auto t) {
    return dispatch_head_size(K, [&](auto k) { return body(t, k); });
  });
}

// The CUDA kernels run one thread per value column: V must be whole warps, at most 1024.
inline void check_cuda(Checks& c, const SeqShape& s) {
  if (!c.ok()) return;
  c.require(s.K == 64 || s.K == 128,
            "the CUDA kernels support K in {64, 128}, got K=" + std::to_string(s.K));
  c.require(s.V % 32 == 0 && s.V >= 32 && s.V <= 1024,
            "the CUDA kernels need V a multiple of 32 up to 1024, got V=" + std::to_string(s.V));
}

template <typename Kernel, typename Args>
ffi::Error launch(Kernel kernel, dim3 grid, int threads, size_t shared, cudaStream_t stream,
                  const Args& args) {
  if (grid.x == 0 || grid.y == 0) return ffi::Error::Success();
  if (shared > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared);
    if (e != cudaSuccess) return ffi::Error::Internal(std::string("rwkv_jax CUDA: ") + cudaGetErrorString(e));
  }
  kernel<<<grid, threads, shared, stream>>>(args);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(std::string("rwkv_jax CUDA: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace rwkv_ffi

#define RWKV_JAX_STREAM ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()

// Shared by the CUDA kernels of the ffi backend (cuda_rwkv7.cu, cuda_rwkv6.cu, cuda_rwkv4.cu):
// element conversions, sequence ranges, warp reductions, dtype/head-size dispatch and launching.
// Each op family compiles on its own, so a multi-core build compiles them side by side.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "checks.h"
#include "handlers.h"

namespace rwkv_ffi {

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

__host__ __device__ __forceinline__ int64_t lmin(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t lmax(int64_t a, int64_t b) { return a > b ? a : b; }

// Token range of sequence n of the grid's gridDim.y sequences. cu_seqlens are not checked on the
// host here (that would need a device-to-host copy); the ops layer never passes invalid ones, and
// for any others the ranges are clamped into [0, total], the first starts at 0, the last ends at
// total and no range ends before it starts. Valid offsets are unchanged; invalid ones give
// overlapping ranges (garbage) but never an access outside the buffers or an unwritten output.
struct Range {
  int64_t start, end;
};
__device__ __forceinline__ Range sequence(const int* cu, int64_t n, int64_t length, int64_t total) {
  if (!cu) return {n * length, (n + 1) * length};
  const int64_t s = n == 0 ? 0 : lmin(lmax(cu[n], 0), total);
  return {s, n == gridDim.y - 1 ? total : lmin(lmax(cu[n + 1], s), total)};
}

// Step rows: a state index outside the pool (the ops layer's sentinel for an invalid row) gets
// NaN outputs (column j of tokens [seq.start, seq.end)) and leaves the pool untouched.
template <typename T>
__device__ __forceinline__ bool outside_pool(const int* rows, int64_t n, int64_t pool_rows,
                                             Range seq, T* o, int64_t H, int64_t hd, int V, int j) {
  const int64_t row = rows[n];
  if (row >= 0 && row < pool_rows) return false;
  const T nan = from_f<T>(__int_as_float(0x7fc00000));
  for (int64_t t = seq.start; t < seq.end; ++t) o[(t * H + hd) * V + j] = nan;
  return true;
}

// Sums x[0..K) over the 32 lanes of a warp; afterwards lane l holds the sums of elements
// [l * K/32, (l + 1) * K/32) in x[0..K/32).
template <int K>
__device__ __forceinline__ void warp_transpose_reduce(float (&x)[K], int lane) {
#pragma unroll
  for (int level = 0; level < 5; ++level) {
    const int offset = 16 >> level, half = K >> (level + 1);
    const bool upper = lane & offset;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float keep = upper ? x[i + half] : x[i];
      const float send = upper ? x[i] : x[i + half];
      x[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
    }
  }
}

// Stores a warp's K partial sums (after warp_transpose_reduce) into red[warp][K].
template <int K>
__device__ __forceinline__ void store_warp_sums(const float (&x)[K], float* red, int j) {
  const int lane = j & 31, warp = j >> 5;
#pragma unroll
  for (int i = 0; i < K / 32; ++i) red[warp * K + lane * (K / 32) + i] = x[i];
}

__device__ __forceinline__ float sum_warps(const float* red, int warps, int K, int i) {
  float s = 0.f;
  for (int w = 0; w < warps; ++w) s += red[w * K + i];
  return s;
}

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

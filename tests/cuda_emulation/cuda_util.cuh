// A host stand-in for what ffi/cuda_rwkv7_chunk.cuh takes from CUDA and ffi/cuda_util.cuh, so that
// the kernels' own source runs on the CPU (tests/test_cuda_emulation.py): one block at a time, a
// std::thread per CUDA thread, std::barrier for __syncthreads, shared memory a global array,
// bfloat16 rounded to nearest even as on the GPU.
#pragma once
#define RWKV_JAX_CUDA_EMULATION
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <algorithm>
#include "common.h"
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __align__(x)
#define __shared__
struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 gridDim;
inline std::barrier<>* emu_block_barrier;
inline std::barrier<>* emu_warp_barrier[32];
inline std::atomic<int> emu_and;
inline float emu_shfl[1024];
inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
inline int __syncthreads_and(int pred) {
  __syncthreads();
  if (threadIdx.x == 0) emu_and = 1;
  __syncthreads();
  if (!pred) emu_and = 0;
  __syncthreads();
  int r = emu_and;
  __syncthreads();
  return r;
}
inline float __shfl_xor_sync(unsigned, float v, int off) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  emu_shfl[threadIdx.x] = v;
  emu_warp_barrier[warp]->arrive_and_wait();
  float r = emu_shfl[warp * 32 + (lane ^ off)];
  emu_warp_barrier[warp]->arrive_and_wait();
  return r;
}
struct __nv_bfloat16 { uint16_t bits; };
using __half = _Float16;
inline float __bfloat162float(__nv_bfloat16 x) { uint32_t u = uint32_t(x.bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16(float x) {
  uint32_t u; std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u); return {uint16_t(u >> 16)};
}
inline float to_float_emu(float x) { return x; }
inline float to_float_emu(__nv_bfloat16 x) { return __bfloat162float(x); }
namespace rwkv_ffi {
template <typename T> inline float to_f(T x);
template <> inline float to_f<float>(float x) { return x; }
template <> inline float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> inline float to_f<__half>(__half x) { return float(x); }
template <typename T> inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
template <> inline __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> inline __half from_f<__half>(float x) { return __half(x); }
inline int64_t lmin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t lmax(int64_t a, int64_t b) { return a > b ? a : b; }
struct Range { int64_t start, end; };
inline Range sequence(const int* cu, int64_t n, int64_t length, int64_t total) {
  if (!cu) return {n * length, (n + 1) * length};
  const int64_t s = n == 0 ? 0 : lmin(lmax(cu[n], 0), total);
  return {s, n == gridDim.y - 1 ? total : lmin(lmax(cu[n + 1], s), total)};
}
}

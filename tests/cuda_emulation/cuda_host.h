// A host stand-in for what the CUDA kernels take from CUDA itself, so that their own source
// (ffi/cuda_rwkv7_chunk*.cuh, ffi/cuda_rwkv7.cuh, ffi/cuda_rwkv6.cuh and their device helpers in
// ffi/cuda_device.cuh) runs on the CPU (tests/test_cuda_emulation.py): one block at a time, a
// std::thread per CUDA thread, std::barrier for __syncthreads and for the warp shuffles, shared
// memory a global array, bfloat16 rounded to nearest even as on the GPU.
#pragma once
#define RWKV_JAX_CUDA_EMULATION
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <algorithm>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
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
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp_barrier[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  emu_shfl[threadIdx.x] = v;
  emu_warp_barrier[warp]->arrive_and_wait();
  float r = emu_shfl[warp * 32 + (lane ^ off)];
  emu_warp_barrier[warp]->arrive_and_wait();
  return r;
}
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
struct __nv_bfloat16 { uint16_t bits; };
using __half = _Float16;
inline float __bfloat162float(__nv_bfloat16 x) { uint32_t u = uint32_t(x.bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16(float x) {
  uint32_t u; std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u); return {uint16_t(u >> 16)};
}
inline float __half2float(__half x) { return float(x); }
inline __half __float2half(float x) { return __half(x); }

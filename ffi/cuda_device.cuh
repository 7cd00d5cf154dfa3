// Device-side helpers shared by the CUDA kernels of the ffi backend: element conversions, sequence
// ranges, warp reductions and the sequence kernels' block set-up. Free of the CUDA runtime, so that
// tests/cuda_emulation compiles it for the host (its stand-in defines RWKV_JAX_CUDA_EMULATION and
// provides the CUDA types and intrinsics) and runs the kernels' own source on the CPU.
#pragma once

#ifndef RWKV_JAX_CUDA_EMULATION
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "common.h"

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

// The sequence kernels' shared set-up (cuda_rwkv7.cuh, cuda_rwkv6.cuh): one block per (head hd,
// sequence n), one thread per value column j, which holds column j of the K x V state in
// registers; kChunk tokens at a time staged in shared memory.

// What every forward kernel takes besides its inputs (an op's arguments derive from it).
struct ForwardArgs {
  const int* cu;       // [N + 1] or null (then sequence n is tokens [n T, (n + 1) T))
  const int* rows;     // step: state row of each sequence, or null (row n)
  int64_t pool_rows;   // step: slots in the pool
  const float* h_in;   // [rows, H, K, V]
  float* h_out;        // may alias h_in (step)
  float* ckpt;         // [slots, H, K, V] or null
  void* o;
  int64_t H, V, length, total;
  float scale;
};

// A forward block: its head hd, sequence n, value column j (the thread's), the sequence's tokens
// and its state row (the step's pool row, else n); `skip` for a step row outside the pool, whose
// outputs are then NaN (outside_pool).
struct ForwardBlock {
  int64_t hd, n;
  int j;
  Range seq;
  int64_t row;
  bool skip;
};
template <typename T>
__device__ __forceinline__ ForwardBlock forward_block(const ForwardArgs& p) {
  const int64_t hd = blockIdx.x, n = blockIdx.y;
  const int j = threadIdx.x;
  const Range seq = sequence(p.cu, n, p.length, p.total);
  if (p.rows && outside_pool(p.rows, n, p.pool_rows, seq, (T*)p.o, p.H, hd, (int)p.V, j))
    return {hd, n, j, seq, n, true};
  return {hd, n, j, seq, p.rows ? p.rows[n] : n, false};
}

// What every backward kernel takes besides its inputs, cotangents and gradients.
struct BackwardArgs {
  const int* cu;
  const float *dh_final, *ckpt;
  float* dh0;
  int64_t H, V, total;
  float scale;
};

// A backward block: its head hd, sequence n, value column j (the thread's), j's lane in its warp,
// the block's warps and the sequence's tokens.
struct BackwardBlock {
  int64_t hd, n;
  int j, lane, warps;
  Range seq;
};
__device__ __forceinline__ BackwardBlock backward_block(const BackwardArgs& p) {
  const int64_t n = blockIdx.y;
  const int j = threadIdx.x;
  return {blockIdx.x, n, j, j & 31, (int)p.V / 32, sequence(p.cu, n, 0, p.total)};
}

// Column j of the state of head hd at entry `row` of a [rows, H, K, V] float32 buffer.
template <int K>
__device__ __forceinline__ void load_column(float (&s)[K], const float* states, int64_t row,
                                            int64_t H, int64_t hd, int V, int j) {
#pragma unroll
  for (int i = 0; i < K; ++i) s[i] = states[((row * H + hd) * K + i) * V + j];
}

template <int K>
__device__ __forceinline__ void store_column(const float (&s)[K], float* states, int64_t row,
                                             int64_t H, int64_t hd, int V, int j) {
#pragma unroll
  for (int i = 0; i < K; ++i) states[((row * H + hd) * K + i) * V + j] = s[i];
}

// The forward's checkpoint of sequence n's chunk starting at token c0 (if checkpoints are kept):
// the state before the chunk.
template <int K>
__device__ __forceinline__ void save_checkpoint(float* ckpt, int64_t n, Range seq, int64_t c0,
                                                const float (&s)[K], int64_t H, int64_t hd, int V,
                                                int j) {
  if (!ckpt) return;
  store_column(s, ckpt, first_slot(n, seq.start) + (c0 - seq.start) / kChunk, H, hd, V, j);
}

// The backward's view of sequence n's chunk c (chunks run last to first): its first token, its
// length and its checkpoint (the [K, V] state before it).
struct Chunk {
  int64_t c0;
  int len;
  const float* ckpt;
};
__device__ __forceinline__ int64_t chunk_count(Range seq) {
  return (seq.end - seq.start + kChunk - 1) / kChunk;
}
__device__ __forceinline__ Chunk backward_chunk(const float* ckpt, int64_t n, Range seq, int64_t c,
                                                int64_t H, int64_t hd, int K, int V) {
  const int64_t c0 = seq.start + c * kChunk;
  return {c0, (int)lmin(kChunk, seq.end - c0),
          ckpt + ((first_slot(n, seq.start) + c) * H + hd) * K * V};
}

// Stages the K-wide inputs of tokens [c0, c0 + len) of head hd in shared memory, token t at
// x = sm + t * stride: x[0, K) = scale * r, x[K, 2K) = e^w, x[2K, 3K) = k, then K values of each
// array of `more` in turn (RWKV-7's a and b). The block's V threads share the work.
template <int K, typename T, typename... More>
__device__ __forceinline__ void stage_keys(float* sm, int stride, int64_t c0, int len, int64_t H,
                                           int64_t hd, int V, int j, float scale, const T* r,
                                           const T* w, const T* k, const More*... more) {
  for (int idx = j; idx < len * K; idx += V) {
    const int t = idx / K, i = idx % K;
    const int64_t src = ((c0 + t) * H + hd) * K + i;
    float* x = sm + t * stride;
    x[i] = to_f(r[src]) * scale;
    x[K + i] = expf(to_f(w[src]));
    x[2 * K + i] = to_f(k[src]);
    int at = 3 * K + i;
    ((x[at] = to_f(more[src]), at += K), ...);
  }
}

// Stages the V-wide inputs of tokens [c0, c0 + len) of head hd in shared memory after their
// K-wide ones (stage_keys): token t's V values of each array in turn from x = sm + t * stride +
// offset (v, and the backward's do). The block's V threads share the work.
template <typename... Arrays>
__device__ __forceinline__ void stage_values(float* sm, int stride, int offset, int64_t c0,
                                             int len, int64_t H, int64_t hd, int V, int j,
                                             const Arrays*... arrays) {
  for (int idx = j; idx < len * V; idx += V) {
    const int t = idx / V, jj = idx % V;
    const int64_t src = ((c0 + t) * H + hd) * V + jj;
    float* x = sm + t * stride + offset;
    int at = jj;
    ((x[at] = to_f(arrays[src]), at += V), ...);
  }
}

}  // namespace rwkv_ffi

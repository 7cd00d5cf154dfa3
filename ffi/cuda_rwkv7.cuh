// CUDA kernels of RWKV-7 (training forward/backward, inference step), with the same operands as
// the CPU handlers of cpu_rwkv7.cc (see there for the math).
//
// One block per (head, sequence), one thread per value column j; thread j keeps column j of the
// K x V state (K floats) in registers. The inputs of kChunk steps are staged in shared memory at
// a time. Sums over j (the key-side gradients) are block reductions: a warp transpose-reduce
// (each lane ends with K/32 of the K sums) and a pass over the warps. The backward recomputes the
// state before each step from the chunk's checkpoint (exact, no division by the decay), walking
// dL/dh back with the exact reverse recurrence.
//
// The kernels are a header of their own so that tests/cuda_emulation can compile the same source
// for the host and run it there; cuda_rwkv7.cu holds the FFI handlers and launches.
#pragma once

#include "cuda_device.cuh"

namespace rwkv_ffi {
namespace {

struct Rwkv7Args : ForwardArgs {
  const void *r, *w, *k, *v, *a, *b;
};

// One step of the recurrence on a thread's state column h, from the staged step x and its
// value v_j: h = h * e^w + b (a . h) + k v_j.
template <int K>
__device__ __forceinline__ void advance(float (&h)[K], const float* x, float vj) {
  float sa = 0.f;
#pragma unroll
  for (int i = 0; i < K; ++i) sa += x[3 * K + i] * h[i];
#pragma unroll
  for (int i = 0; i < K; ++i) h[i] = h[i] * x[K + i] + x[4 * K + i] * sa + x[2 * K + i] * vj;
}

// Shared-memory layout of one staged step: rs, ew, k, a, b (K each), then v (V).
template <int K> size_t rwkv7_forward_shared_bytes(int64_t V) {
  return sizeof(float) * kChunk * (5 * K + V);
}
template <int K, typename T>
__global__ void rwkv7_forward_kernel(Rwkv7Args p) {
  const auto [hd, n, j, seq, row, skip] = forward_block<T>(p);
  if (skip) return;
  const int V = p.V;
  extern __shared__ float sm[];
  const int stride = 5 * K + V;
  float s[K];
  load_column(s, p.h_in, row, p.H, hd, V, j);
  const T *r = (const T*)p.r, *w = (const T*)p.w, *k = (const T*)p.k, *v = (const T*)p.v;
  const T *a = (const T*)p.a, *b = (const T*)p.b;
  for (int64_t c0 = seq.start; c0 < seq.end; c0 += kChunk) {
    const int len = (int)lmin(kChunk, seq.end - c0);
    save_checkpoint(p.ckpt, n, seq, c0, s, p.H, hd, V, j);
    __syncthreads();
    stage_keys<K>(sm, stride, c0, len, p.H, hd, V, j, p.scale, r, w, k, a, b);
    stage_values(sm, stride, 5 * K, c0, len, p.H, hd, V, j, v);
    __syncthreads();
    for (int t = 0; t < len; ++t) {
      const float* x = sm + t * stride;
      advance<K>(s, x, x[5 * K + j]);
      float out = 0.f;
#pragma unroll
      for (int i = 0; i < K; ++i) out += x[i] * s[i];
      ((T*)p.o)[((c0 + t) * p.H + hd) * V + j] = from_f<T>(out);
    }
  }
  store_column(s, p.h_out, row, p.H, hd, V, j);
}

struct Rwkv7BackArgs : BackwardArgs {
  const void *r, *w, *k, *v, *a, *b, *d_o;
  void *dr, *dw, *dk, *dv, *da, *db;
};

// Shared memory: staged steps (rs, ew, k, a, b: K each; v, do: V each), then 5 x warps x K sums.
template <int K> size_t rwkv7_backward_shared_bytes(int64_t V) {
  return sizeof(float) * (kChunk * (5 * K + 2 * V) + 5 * (V / 32) * K);
}
template <int K, typename T>
__global__ void rwkv7_backward_kernel(Rwkv7BackArgs p) {
  const auto [hd, n, j, lane, warps, seq] = backward_block(p);
  const int V = p.V;
  extern __shared__ float sm[];
  const int stride = 5 * K + 2 * V;
  float* red = sm + kChunk * stride;
  float G[K];
  load_column(G, p.dh_final, n, p.H, hd, V, j);
  const T *r = (const T*)p.r, *w = (const T*)p.w, *k = (const T*)p.k, *v = (const T*)p.v;
  const T *a = (const T*)p.a, *b = (const T*)p.b, *d_o = (const T*)p.d_o;
  T* outs[5] = {(T*)p.dk, (T*)p.db, (T*)p.dw, (T*)p.da, (T*)p.dr};
  for (int64_t c = chunk_count(seq) - 1; c >= 0; --c) {
    const auto [c0, len, ck] = backward_chunk(p.ckpt, n, seq, c, p.H, hd, K, V);
    __syncthreads();
    stage_keys<K>(sm, stride, c0, len, p.H, hd, V, j, p.scale, r, w, k, a, b);
    stage_values(sm, stride, 5 * K, c0, len, p.H, hd, V, j, v, d_o);
    __syncthreads();
    for (int t = len - 1; t >= 0; --t) {
      // h_{t-1}: the checkpoint advanced by the t earlier steps of the chunk.
      float h[K];
#pragma unroll
      for (int i = 0; i < K; ++i) h[i] = ck[i * V + j];
      for (int u = 0; u < t; ++u) advance<K>(h, sm + u * stride, sm[u * stride + 5 * K + j]);
      const float* x = sm + t * stride;
      const float vj = x[5 * K + j], dj = x[5 * K + V + j];
      float sa = 0.f, dsa = 0.f, dv = 0.f;
#pragma unroll
      for (int i = 0; i < K; ++i) sa += x[3 * K + i] * h[i];
#pragma unroll
      for (int i = 0; i < K; ++i) {
        G[i] += x[i] * dj;  // the read of o_t
        dsa += x[4 * K + i] * G[i];
        dv += x[2 * K + i] * G[i];
      }
      const int64_t tok = c0 + t;
      ((T*)p.dv)[(tok * p.H + hd) * V + j] = from_f<T>(dv);
      float part[K];
#pragma unroll
      for (int q = 0; q < 5; ++q) {
#pragma unroll
        for (int i = 0; i < K; ++i) {
          const float ew = x[K + i];
          part[i] = q == 0 ? G[i] * vj
                  : q == 1 ? G[i] * sa
                  : q == 2 ? G[i] * h[i]
                  : q == 3 ? h[i] * dsa
                           : (ew * h[i] + x[4 * K + i] * sa + x[2 * K + i] * vj) * dj;
        }
        warp_transpose_reduce<K>(part, lane);
        store_warp_sums<K>(part, red + q * warps * K, j);
      }
#pragma unroll
      for (int i = 0; i < K; ++i) G[i] = x[K + i] * G[i] + x[3 * K + i] * dsa;
      __syncthreads();
      for (int idx = j; idx < 5 * K; idx += V) {
        const int q = idx / K, i = idx % K;
        float s = sum_warps(red + q * warps * K, warps, K, i);
        if (q == 2) s *= x[K + i];
        if (q == 4) s *= p.scale;
        outs[q][(tok * p.H + hd) * K + i] = from_f<T>(s);
      }
      __syncthreads();
    }
  }
  store_column(G, p.dh0, n, p.H, hd, V, j);
}

}  // namespace
}  // namespace rwkv_ffi

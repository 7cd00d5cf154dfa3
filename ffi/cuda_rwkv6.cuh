// CUDA kernels of RWKV-6 (training forward/backward, inference step), with the same operands as
// the CPU handlers of cpu_rwkv6.cc (see there for the math). Same layout as cuda_rwkv7.cuh: one
// block per (head, sequence), one thread per value column holding its state column in registers,
// kChunk steps staged in shared memory, block reductions for the key-side gradients.
//
// The kernels are a header of their own so that tests/cuda_emulation can compile the same source
// for the host and run it there; cuda_rwkv6.cu holds the FFI handlers and launches.
#pragma once

#include "cuda_device.cuh"

namespace rwkv_ffi {
namespace {

struct Rwkv6Args : ForwardArgs {
  const void *r, *k, *v, *w;
  const float* u;  // [H, K]
};

// Shared memory: staged steps (rs, ew, k: K each, then v: V), then u (K).
template <int K> size_t rwkv6_forward_shared_bytes(int64_t V) {
  return sizeof(float) * (kChunk * (3 * K + V) + K);
}
template <int K, typename T>
__global__ void rwkv6_forward_kernel(Rwkv6Args p) {
  const auto [hd, n, j, seq, row, skip] = forward_block<T>(p);
  if (skip) return;
  const int V = p.V;
  extern __shared__ float sm[];
  const int stride = 3 * K + V;
  float* uk = sm + kChunk * stride;
  for (int i = j; i < K; i += V) uk[i] = p.u[hd * K + i];
  float s[K];
  load_column(s, p.h_in, row, p.H, hd, V, j);
  const T *r = (const T*)p.r, *w = (const T*)p.w, *k = (const T*)p.k, *v = (const T*)p.v;
  for (int64_t c0 = seq.start; c0 < seq.end; c0 += kChunk) {
    const int len = (int)lmin(kChunk, seq.end - c0);
    save_checkpoint(p.ckpt, n, seq, c0, s, p.H, hd, V, j);
    __syncthreads();
    stage_keys<K>(sm, stride, c0, len, p.H, hd, V, j, p.scale, r, w, k);
    stage_values(sm, stride, 3 * K, c0, len, p.H, hd, V, j, v);
    __syncthreads();
    for (int t = 0; t < len; ++t) {
      const float* x = sm + t * stride;
      const float vj = x[3 * K + j];
      float out = 0.f;
#pragma unroll
      for (int i = 0; i < K; ++i) {
        const float kv = x[2 * K + i] * vj;
        out += x[i] * (s[i] + uk[i] * kv);
        s[i] = s[i] * x[K + i] + kv;
      }
      ((T*)p.o)[((c0 + t) * p.H + hd) * V + j] = from_f<T>(out);
    }
  }
  store_column(s, p.h_out, row, p.H, hd, V, j);
}

struct Rwkv6BackArgs : BackwardArgs {
  const void *r, *k, *v, *w, *d_o;
  const float* u;
  void *dr, *dk, *dv, *dw;
  float* du;  // [N, H, K]
};

// Shared memory: staged steps (rs, ew, k: K each; v, do: V each; v.do: 1), u and du (K each),
// then 3 x warps x K sums.
template <int K> size_t rwkv6_backward_shared_bytes(int64_t V) {
  return sizeof(float) * (kChunk * (3 * K + 2 * V + 1) + 2 * K + 3 * (V / 32) * K);
}
template <int K, typename T>
__global__ void rwkv6_backward_kernel(Rwkv6BackArgs p) {
  const auto [hd, n, j, lane, warps, seq] = backward_block(p);
  const int V = p.V;
  extern __shared__ float sm[];
  const int stride = 3 * K + 2 * V + 1;
  float* uk = sm + kChunk * stride;
  float* du = uk + K;
  float* red = du + K;
  for (int i = j; i < K; i += V) {
    uk[i] = p.u[hd * K + i];
    du[i] = 0.f;
  }
  float G[K];
  load_column(G, p.dh_final, n, p.H, hd, V, j);
  const T *r = (const T*)p.r, *w = (const T*)p.w, *k = (const T*)p.k, *v = (const T*)p.v;
  const T* d_o = (const T*)p.d_o;
  T* outs[3] = {(T*)p.dr, (T*)p.dk, (T*)p.dw};
  for (int64_t c = chunk_count(seq) - 1; c >= 0; --c) {
    const auto [c0, len, ck] = backward_chunk(p.ckpt, n, seq, c, p.H, hd, K, V);
    __syncthreads();
    stage_keys<K>(sm, stride, c0, len, p.H, hd, V, j, p.scale, r, w, k);
    stage_values(sm, stride, 3 * K, c0, len, p.H, hd, V, j, v, d_o);
    __syncthreads();
    for (int t = j; t < len; t += V) {  // v_t . do_t, one step per thread
      const float* x = sm + t * stride;
      float s = 0.f;
      for (int jj = 0; jj < V; ++jj) s += x[3 * K + jj] * x[3 * K + V + jj];
      sm[t * stride + 3 * K + 2 * V] = s;
    }
    __syncthreads();
    for (int t = len - 1; t >= 0; --t) {
      float h[K];
#pragma unroll
      for (int i = 0; i < K; ++i) h[i] = ck[i * V + j];
      for (int u = 0; u < t; ++u) {
        const float* x = sm + u * stride;
        const float vj = x[3 * K + j];
#pragma unroll
        for (int i = 0; i < K; ++i) h[i] = h[i] * x[K + i] + x[2 * K + i] * vj;
      }
      const float* x = sm + t * stride;
      const float vj = x[3 * K + j], dj = x[3 * K + V + j], v_do = x[3 * K + 2 * V];
      float dv = 0.f, bonus = 0.f;
#pragma unroll
      for (int i = 0; i < K; ++i) {
        dv += x[2 * K + i] * G[i];
        bonus += x[i] * uk[i] * x[2 * K + i];
      }
      const int64_t tok = c0 + t;
      ((T*)p.dv)[(tok * p.H + hd) * V + j] = from_f<T>(dv + bonus * dj);
      float part[K];
#pragma unroll
      for (int q = 0; q < 3; ++q) {
#pragma unroll
        for (int i = 0; i < K; ++i) part[i] = q == 0 ? h[i] * dj : q == 1 ? G[i] * vj : G[i] * h[i];
        warp_transpose_reduce<K>(part, lane);
        store_warp_sums<K>(part, red + q * warps * K, j);
      }
#pragma unroll
      for (int i = 0; i < K; ++i) G[i] = x[K + i] * G[i] + x[i] * dj;
      __syncthreads();
      for (int idx = j; idx < 3 * K; idx += V) {
        const int q = idx / K, i = idx % K;
        const float s = sum_warps(red + q * warps * K, warps, K, i);
        const float rs = x[i], ki = x[2 * K + i];
        float g;
        if (q == 0) {
          g = p.scale * (s + uk[i] * ki * v_do);
          du[i] += rs * ki * v_do;  // idx -> thread mapping is fixed: one writer per i
        } else if (q == 1) {
          g = s + rs * uk[i] * v_do;
        } else {
          g = x[K + i] * s;
        }
        outs[q][(tok * p.H + hd) * K + i] = from_f<T>(g);
      }
      __syncthreads();
    }
  }
  store_column(G, p.dh0, n, p.H, hd, V, j);
  for (int i = j; i < K; i += V) p.du[(n * p.H + hd) * K + i] = du[i];
}

}  // namespace
}  // namespace rwkv_ffi

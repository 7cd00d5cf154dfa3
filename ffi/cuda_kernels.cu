// CUDA kernels of the ffi backend: RWKV-7 and RWKV-6 (training forward/backward, inference step)
// and RWKV-4, with the same operands as the CPU handlers (see cpu_rwkv*.cc for the math).
//
// RWKV-7/6: one block per (head, sequence), one thread per value column j; thread j keeps column j
// of the K x V state (K floats) in registers. The inputs of kChunk steps are staged in shared
// memory at a time. Sums over j (the key-side gradients) are block reductions: a warp
// transpose-reduce (each lane ends with K/32 of the K sums) and a pass over the warps.
// The backward recomputes the state before each step from the chunk's checkpoint (exact, no
// division by the decay), walking dL/dh back with the exact reverse recurrence.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "checks.h"
#include "handlers.h"
#include "rwkv4_math.h"

namespace rwkv_ffi {
namespace {

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

// Token range of sequence n, clamped to [0, total] (cu_seqlens are not checked on the host here:
// that would need a device-to-host copy; clamping keeps every access in bounds).
struct Range {
  int64_t start, end;
};
__device__ __forceinline__ Range sequence(const int* cu, int64_t n, int64_t length, int64_t total) {
  if (!cu) return {n * length, (n + 1) * length};
  const int64_t s = lmin(lmax(cu[n], 0), total);
  return {s, lmin(lmax(cu[n + 1], s), total)};
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

// --------------------------------------------------------------------------------------------
// RWKV-7

struct Rwkv7Args {
  const void *r, *w, *k, *v, *a, *b;
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

// Shared-memory layout of one staged step: rs, ew, k, a, b (K each), then v (V).
template <int K, typename T>
__global__ void rwkv7_forward_kernel(Rwkv7Args p) {
  const int64_t hd = blockIdx.x, n = blockIdx.y;
  const int j = threadIdx.x, V = p.V;
  const Range seq = sequence(p.cu, n, p.length, p.total);
  int64_t row = n;
  if (p.rows) {
    row = p.rows[n];
    if (row < 0 || row >= p.pool_rows) return;
  }
  extern __shared__ float sm[];
  const int stride = 5 * K + V;
  float s[K];
#pragma unroll
  for (int i = 0; i < K; ++i) s[i] = p.h_in[((row * p.H + hd) * K + i) * V + j];
  const T *r = (const T*)p.r, *w = (const T*)p.w, *k = (const T*)p.k, *v = (const T*)p.v;
  const T *a = (const T*)p.a, *b = (const T*)p.b;
  for (int64_t c0 = seq.start; c0 < seq.end; c0 += kChunk) {
    const int len = (int)lmin(kChunk, seq.end - c0);
    if (p.ckpt) {
      const int64_t slot = first_slot(n, seq.start) + (c0 - seq.start) / kChunk;
#pragma unroll
      for (int i = 0; i < K; ++i) p.ckpt[((slot * p.H + hd) * K + i) * V + j] = s[i];
    }
    __syncthreads();
    for (int idx = j; idx < len * K; idx += V) {
      const int t = idx / K, i = idx % K;
      const int64_t src = ((c0 + t) * p.H + hd) * K + i;
      float* x = sm + t * stride;
      x[i] = to_f(r[src]) * p.scale;
      x[K + i] = expf(to_f(w[src]));
      x[2 * K + i] = to_f(k[src]);
      x[3 * K + i] = to_f(a[src]);
      x[4 * K + i] = to_f(b[src]);
    }
    for (int idx = j; idx < len * V; idx += V) {
      const int t = idx / V, jj = idx % V;
      sm[t * stride + 5 * K + jj] = to_f(v[((c0 + t) * p.H + hd) * V + jj]);
    }
    __syncthreads();
    for (int t = 0; t < len; ++t) {
      const float* x = sm + t * stride;
      float sa = 0.f;
#pragma unroll
      for (int i = 0; i < K; ++i) sa += x[3 * K + i] * s[i];
      const float vj = x[5 * K + j];
      float out = 0.f;
#pragma unroll
      for (int i = 0; i < K; ++i) {
        s[i] = s[i] * x[K + i] + x[4 * K + i] * sa + x[2 * K + i] * vj;
        out += x[i] * s[i];
      }
      ((T*)p.o)[((c0 + t) * p.H + hd) * V + j] = from_f<T>(out);
    }
  }
#pragma unroll
  for (int i = 0; i < K; ++i) p.h_out[((row * p.H + hd) * K + i) * V + j] = s[i];
}

struct Rwkv7BackArgs {
  const void *r, *w, *k, *v, *a, *b, *d_o;
  const int* cu;
  const float *dh_final, *ckpt;
  void *dr, *dw, *dk, *dv, *da, *db;
  float* dh0;
  int64_t H, V, total;
  float scale;
};

// Shared memory: staged steps (rs, ew, k, a, b: K each; v, do: V each), then 5 x warps x K sums.
template <int K, typename T>
__global__ void rwkv7_backward_kernel(Rwkv7BackArgs p) {
  const int64_t hd = blockIdx.x, n = blockIdx.y;
  const int j = threadIdx.x, V = p.V, warps = V / 32, lane = j & 31;
  const Range seq = sequence(p.cu, n, 0, p.total);
  extern __shared__ float sm[];
  const int stride = 5 * K + 2 * V;
  float* red = sm + kChunk * stride;
  const int64_t base = (n * p.H + hd) * K;
  float G[K];
#pragma unroll
  for (int i = 0; i < K; ++i) G[i] = p.dh_final[(base + i) * V + j];
  const T *r = (const T*)p.r, *w = (const T*)p.w, *k = (const T*)p.k, *v = (const T*)p.v;
  const T *a = (const T*)p.a, *b = (const T*)p.b, *d_o = (const T*)p.d_o;
  T* outs[5] = {(T*)p.dk, (T*)p.db, (T*)p.dw, (T*)p.da, (T*)p.dr};
  const int64_t n_chunks = (seq.end - seq.start + kChunk - 1) / kChunk;
  for (int64_t c = n_chunks - 1; c >= 0; --c) {
    const int64_t c0 = seq.start + c * kChunk;
    const int len = (int)lmin(kChunk, seq.end - c0);
    const float* ck = p.ckpt + ((first_slot(n, seq.start) + c) * p.H + hd) * K * V;
    __syncthreads();
    for (int idx = j; idx < len * K; idx += V) {
      const int t = idx / K, i = idx % K;
      const int64_t src = ((c0 + t) * p.H + hd) * K + i;
      float* x = sm + t * stride;
      x[i] = to_f(r[src]) * p.scale;
      x[K + i] = expf(to_f(w[src]));
      x[2 * K + i] = to_f(k[src]);
      x[3 * K + i] = to_f(a[src]);
      x[4 * K + i] = to_f(b[src]);
    }
    for (int idx = j; idx < len * V; idx += V) {
      const int t = idx / V, jj = idx % V;
      const int64_t src = ((c0 + t) * p.H + hd) * V + jj;
      sm[t * stride + 5 * K + jj] = to_f(v[src]);
      sm[t * stride + 5 * K + V + jj] = to_f(d_o[src]);
    }
    __syncthreads();
    for (int t = len - 1; t >= 0; --t) {
      // h_{t-1}: the checkpoint advanced by the t earlier steps of the chunk.
      float h[K];
#pragma unroll
      for (int i = 0; i < K; ++i) h[i] = ck[i * V + j];
      for (int u = 0; u < t; ++u) {
        const float* x = sm + u * stride;
        float sa = 0.f;
#pragma unroll
        for (int i = 0; i < K; ++i) sa += x[3 * K + i] * h[i];
        const float vj = x[5 * K + j];
#pragma unroll
        for (int i = 0; i < K; ++i) h[i] = h[i] * x[K + i] + x[4 * K + i] * sa + x[2 * K + i] * vj;
      }
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
#pragma unroll
  for (int i = 0; i < K; ++i) p.dh0[(base + i) * V + j] = G[i];
}

// --------------------------------------------------------------------------------------------
// RWKV-6

struct Rwkv6Args {
  const void *r, *k, *v, *w;
  const float* u;  // [H, K]
  const int* cu;
  const int* rows;
  int64_t pool_rows;
  const float* h_in;
  float* h_out;
  float* ckpt;
  void* o;
  int64_t H, V, length, total;
  float scale;
};

// Staged step: rs, ew, k (K each), then v (V).
template <int K, typename T>
__global__ void rwkv6_forward_kernel(Rwkv6Args p) {
  const int64_t hd = blockIdx.x, n = blockIdx.y;
  const int j = threadIdx.x, V = p.V;
  const Range seq = sequence(p.cu, n, p.length, p.total);
  int64_t row = n;
  if (p.rows) {
    row = p.rows[n];
    if (row < 0 || row >= p.pool_rows) return;
  }
  extern __shared__ float sm[];
  const int stride = 3 * K + V;
  float* uk = sm + kChunk * stride;
  for (int i = j; i < K; i += V) uk[i] = p.u[hd * K + i];
  float s[K];
#pragma unroll
  for (int i = 0; i < K; ++i) s[i] = p.h_in[((row * p.H + hd) * K + i) * V + j];
  const T *r = (const T*)p.r, *w = (const T*)p.w, *k = (const T*)p.k, *v = (const T*)p.v;
  for (int64_t c0 = seq.start; c0 < seq.end; c0 += kChunk) {
    const int len = (int)lmin(kChunk, seq.end - c0);
    if (p.ckpt) {
      const int64_t slot = first_slot(n, seq.start) + (c0 - seq.start) / kChunk;
#pragma unroll
      for (int i = 0; i < K; ++i) p.ckpt[((slot * p.H + hd) * K + i) * V + j] = s[i];
    }
    __syncthreads();
    for (int idx = j; idx < len * K; idx += V) {
      const int t = idx / K, i = idx % K;
      const int64_t src = ((c0 + t) * p.H + hd) * K + i;
      float* x = sm + t * stride;
      x[i] = to_f(r[src]) * p.scale;
      x[K + i] = expf(to_f(w[src]));
      x[2 * K + i] = to_f(k[src]);
    }
    for (int idx = j; idx < len * V; idx += V) {
      const int t = idx / V, jj = idx % V;
      sm[t * stride + 3 * K + jj] = to_f(v[((c0 + t) * p.H + hd) * V + jj]);
    }
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
#pragma unroll
  for (int i = 0; i < K; ++i) p.h_out[((row * p.H + hd) * K + i) * V + j] = s[i];
}

struct Rwkv6BackArgs {
  const void *r, *k, *v, *w, *d_o;
  const float* u;
  const int* cu;
  const float *dh_final, *ckpt;
  void *dr, *dk, *dv, *dw;
  float *du, *dh0;  // du: [N, H, K]
  int64_t H, V, total;
  float scale;
};

// Shared memory: staged steps (rs, ew, k: K each; v, do: V each; v.do: 1), u and du (K each),
// then 3 x warps x K sums.
template <int K, typename T>
__global__ void rwkv6_backward_kernel(Rwkv6BackArgs p) {
  const int64_t hd = blockIdx.x, n = blockIdx.y;
  const int j = threadIdx.x, V = p.V, warps = V / 32, lane = j & 31;
  const Range seq = sequence(p.cu, n, 0, p.total);
  extern __shared__ float sm[];
  const int stride = 3 * K + 2 * V + 1;
  float* uk = sm + kChunk * stride;
  float* du = uk + K;
  float* red = du + K;
  for (int i = j; i < K; i += V) {
    uk[i] = p.u[hd * K + i];
    du[i] = 0.f;
  }
  const int64_t base = (n * p.H + hd) * K;
  float G[K];
#pragma unroll
  for (int i = 0; i < K; ++i) G[i] = p.dh_final[(base + i) * V + j];
  const T *r = (const T*)p.r, *w = (const T*)p.w, *k = (const T*)p.k, *v = (const T*)p.v;
  const T* d_o = (const T*)p.d_o;
  T* outs[3] = {(T*)p.dr, (T*)p.dk, (T*)p.dw};
  const int64_t n_chunks = (seq.end - seq.start + kChunk - 1) / kChunk;
  for (int64_t c = n_chunks - 1; c >= 0; --c) {
    const int64_t c0 = seq.start + c * kChunk;
    const int len = (int)lmin(kChunk, seq.end - c0);
    const float* ck = p.ckpt + ((first_slot(n, seq.start) + c) * p.H + hd) * K * V;
    __syncthreads();
    for (int idx = j; idx < len * K; idx += V) {
      const int t = idx / K, i = idx % K;
      const int64_t src = ((c0 + t) * p.H + hd) * K + i;
      float* x = sm + t * stride;
      x[i] = to_f(r[src]) * p.scale;
      x[K + i] = expf(to_f(w[src]));
      x[2 * K + i] = to_f(k[src]);
    }
    for (int idx = j; idx < len * V; idx += V) {
      const int t = idx / V, jj = idx % V;
      const int64_t src = ((c0 + t) * p.H + hd) * V + jj;
      sm[t * stride + 3 * K + jj] = to_f(v[src]);
      sm[t * stride + 3 * K + V + jj] = to_f(d_o[src]);
    }
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
#pragma unroll
  for (int i = 0; i < K; ++i) p.dh0[(base + i) * V + j] = G[i];
  for (int i = j; i < K; i += V) p.du[base + i] = du[i];
}

// --------------------------------------------------------------------------------------------
// RWKV-4: one thread per (batch row, channel).

template <typename T>
__global__ void rwkv4_forward_kernel(const float* w, const float* u, const T* k, const T* v,
                                     const Wkv4State* s0, T* y, Wkv4State* s_final,
                                     Wkv4State* ckpt, int64_t B, int64_t T_, int64_t C) {
  const int64_t id = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (id >= B * C) return;
  const int64_t b = id / C, c = id % C, chunks = (T_ + kChunk - 1) / kChunk;
  Wkv4State st = s0[id];
  const float wc = w[c], uc = u[c];
  for (int64_t t = 0; t < T_; ++t) {
    if (t % kChunk == 0) ckpt[(b * chunks + t / kChunk) * C + c] = st;
    const int64_t i = (b * T_ + t) * C + c;
    y[i] = from_f<T>(wkv4_step(st, wc, uc, to_f(k[i]), to_f(v[i])));
  }
  s_final[id] = st;
}

template <typename T>
__global__ void rwkv4_backward_kernel(const float* w, const float* u, const T* k, const T* v,
                                      const T* dy, const Wkv4State* ds_final,
                                      const Wkv4State* ckpt, float* dw, float* du, T* dk, T* dv,
                                      Wkv4State* ds0, int64_t B, int64_t T_, int64_t C) {
  const int64_t id = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (id >= B * C) return;
  const int64_t b = id / C, c = id % C, chunks = (T_ + kChunk - 1) / kChunk;
  const float wc = w[c], uc = u[c];
  float gw = 0.f, gu = 0.f;
  Wkv4State g = ds_final[id];
  Wkv4State states[kChunk];
  for (int64_t chunk = chunks - 1; chunk >= 0; --chunk) {
    const int64_t t0 = chunk * kChunk;
    const int len = (int)lmin(kChunk, T_ - t0);
    Wkv4State st = ckpt[(b * chunks + chunk) * C + c];
#pragma unroll
    for (int t = 0; t < kChunk; ++t) {
      states[t] = st;
      if (t < len) {
        const int64_t i = (b * T_ + t0 + t) * C + c;
        wkv4_step(st, wc, uc, to_f(k[i]), to_f(v[i]));
      }
    }
#pragma unroll
    for (int t = kChunk - 1; t >= 0; --t) {
      if (t < len) {
        const int64_t i = (b * T_ + t0 + t) * C + c;
        float gk, gv;
        wkv4_step_back(states[t], wc, uc, to_f(k[i]), to_f(v[i]), to_f(dy[i]), g, gw, gu, gk, gv);
        dk[i] = from_f<T>(gk);
        dv[i] = from_f<T>(gv);
      }
    }
  }
  ds0[id] = g;
  dw[id] = gw;
  du[id] = gu;
}

// --------------------------------------------------------------------------------------------
// Launching

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
void check_cuda(Checks& c, const SeqShape& s) {
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

ffi::Error rwkv7_forward(cudaStream_t stream, Buffers ins, const SeqShape& s, const int* cu,
                         const int* rows, int64_t pool_rows, const float* h_in, float* h_out,
                         float* ckpt, void* o, int64_t n_seq, float scale) {
  Rwkv7Args p{ins[0].untyped_data(), ins[1].untyped_data(), ins[2].untyped_data(),
              ins[3].untyped_data(), ins[4].untyped_data(), ins[5].untyped_data(),
              cu, rows, pool_rows, h_in, h_out, ckpt, o, s.H, s.V, s.T, s.B * s.T, scale};
  return dispatch_cuda(ins[0].element_type(), [&](auto t) {
    using T = decltype(t);
    return dispatch_head_size(s.K, [&](auto kc) {
      constexpr int K = decltype(kc)::value;
      const size_t shared = sizeof(float) * kChunk * (5 * K + s.V);
      return launch(rwkv7_forward_kernel<K, T>, dim3(s.H, n_seq), s.V, shared, stream, p);
    });
  });
}

ffi::Error rwkv6_forward(cudaStream_t stream, Buffers ins, const float* u, const SeqShape& s,
                         const int* cu, const int* rows, int64_t pool_rows, const float* h_in,
                         float* h_out, float* ckpt, void* o, int64_t n_seq, float scale) {
  Rwkv6Args p{ins[0].untyped_data(), ins[1].untyped_data(), ins[2].untyped_data(),
              ins[3].untyped_data(), u, cu, rows, pool_rows, h_in, h_out, ckpt, o,
              s.H, s.V, s.T, s.B * s.T, scale};
  return dispatch_cuda(ins[0].element_type(), [&](auto t) {
    using T = decltype(t);
    return dispatch_head_size(s.K, [&](auto kc) {
      constexpr int K = decltype(kc)::value;
      const size_t shared = sizeof(float) * (kChunk * (3 * K + s.V) + K);
      return launch(rwkv6_forward_kernel<K, T>, dim3(s.H, n_seq), s.V, shared, stream, p);
    });
  });
}

}  // namespace

ffi::Error Rwkv7ForwardCuda(cudaStream_t stream, ffi::AnyBuffer r, ffi::AnyBuffer w,
                            ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer a,
                            ffi::AnyBuffer b, ffi::AnyBuffer h0, ffi::Buffer<ffi::S32> cu,
                            float scale, ffi::Result<ffi::AnyBuffer> o,
                            ffi::Result<ffi::AnyBuffer> h_final, ffi::Result<ffi::AnyBuffer> ckpt) {
  const ffi::AnyBuffer ins[6] = {r, w, k, v, a, b};
  SeqShape s;
  Checks c = check_rwkv7(ins, s);
  if (c.ok()) check_forward(c, h0, cu, *o, *h_final, *ckpt, r.element_type(), s);
  check_cuda(c, s);
  if (!c.ok()) return c.error("rwkv7 forward");
  return rwkv7_forward(stream, ins, s, cu.typed_data(), nullptr, 0, h0.typed_data<float>(),
                       h_final->typed_data<float>(), checkpoint_data(*ckpt),
                       o->untyped_data(), s.N, scale);
}

ffi::Error Rwkv7BackwardCuda(cudaStream_t stream, ffi::AnyBuffer r, ffi::AnyBuffer w,
                             ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer a,
                             ffi::AnyBuffer b, ffi::AnyBuffer d_o, ffi::AnyBuffer dh_final,
                             ffi::AnyBuffer ckpt, ffi::Buffer<ffi::S32> cu, float scale,
                             ffi::Result<ffi::AnyBuffer> dr, ffi::Result<ffi::AnyBuffer> dw,
                             ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                             ffi::Result<ffi::AnyBuffer> da, ffi::Result<ffi::AnyBuffer> db,
                             ffi::Result<ffi::AnyBuffer> dh0) {
  const ffi::AnyBuffer ins[6] = {r, w, k, v, a, b};
  const ffi::AnyBuffer grads[6] = {*dr, *dw, *dk, *dv, *da, *db};
  SeqShape s;
  Checks c = check_rwkv7(ins, s);
  if (c.ok()) check_backward(c, d_o, dh_final, ckpt, cu, grads, 6, 3, *dh0, r.element_type(), s);
  check_cuda(c, s);
  if (!c.ok()) return c.error("rwkv7 backward");
  Rwkv7BackArgs p{r.untyped_data(), w.untyped_data(), k.untyped_data(), v.untyped_data(),
                  a.untyped_data(), b.untyped_data(), d_o.untyped_data(), cu.typed_data(),
                  dh_final.typed_data<float>(), ckpt.typed_data<float>(), dr->untyped_data(),
                  dw->untyped_data(), dk->untyped_data(), dv->untyped_data(), da->untyped_data(),
                  db->untyped_data(), dh0->typed_data<float>(), s.H, s.V, s.B * s.T, scale};
  return dispatch_cuda(r.element_type(), [&](auto t) {
    using T = decltype(t);
    return dispatch_head_size(s.K, [&](auto kc) {
      constexpr int K = decltype(kc)::value;
      const size_t shared = sizeof(float) * (kChunk * (5 * K + 2 * s.V) + 5 * (s.V / 32) * K);
      return launch(rwkv7_backward_kernel<K, T>, dim3(s.H, s.N), s.V, shared, stream, p);
    });
  });
}

ffi::Error Rwkv7StepCuda(cudaStream_t stream, ffi::AnyBuffer r, ffi::AnyBuffer w,
                         ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer a, ffi::AnyBuffer b,
                         ffi::AnyBuffer pool_in, ffi::Buffer<ffi::S32> rows, float scale,
                         ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> pool) {
  const ffi::AnyBuffer ins[6] = {r, w, k, v, a, b};
  SeqShape s;
  Checks c = check_rwkv7(ins, s);
  if (c.ok()) check_step(c, pool_in, rows, *o, *pool, r.element_type(), s);
  check_cuda(c, s);
  if (!c.ok()) return c.error("rwkv7_step");
  // Rows outside the pool are skipped on the device (checking them here would need a copy).
  return rwkv7_forward(stream, ins, s, nullptr, rows.typed_data(), s.N,
                       pool->typed_data<float>(), pool->typed_data<float>(), nullptr,
                       o->untyped_data(), s.B, scale);
}

ffi::Error Rwkv6ForwardCuda(cudaStream_t stream, ffi::AnyBuffer r, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer w, ffi::AnyBuffer u,
                            ffi::AnyBuffer h0, ffi::Buffer<ffi::S32> cu, float scale,
                            ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> h_final,
                            ffi::Result<ffi::AnyBuffer> ckpt) {
  const ffi::AnyBuffer ins[4] = {r, k, v, w};
  SeqShape s;
  Checks c = check_rwkv6(ins, u, s);
  if (c.ok()) check_forward(c, h0, cu, *o, *h_final, *ckpt, r.element_type(), s);
  check_cuda(c, s);
  if (!c.ok()) return c.error("rwkv6 forward");
  return rwkv6_forward(stream, ins, u.typed_data<float>(), s, cu.typed_data(), nullptr, 0,
                       h0.typed_data<float>(), h_final->typed_data<float>(),
                       checkpoint_data(*ckpt), o->untyped_data(), s.N, scale);
}

ffi::Error Rwkv6BackwardCuda(cudaStream_t stream, ffi::AnyBuffer r, ffi::AnyBuffer k,
                             ffi::AnyBuffer v, ffi::AnyBuffer w, ffi::AnyBuffer u,
                             ffi::AnyBuffer d_o, ffi::AnyBuffer dh_final, ffi::AnyBuffer ckpt,
                             ffi::Buffer<ffi::S32> cu, float scale, ffi::Result<ffi::AnyBuffer> dr,
                             ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                             ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> du,
                             ffi::Result<ffi::AnyBuffer> dh0) {
  const ffi::AnyBuffer ins[4] = {r, k, v, w};
  const ffi::AnyBuffer grads[4] = {*dr, *dk, *dv, *dw};
  SeqShape s;
  Checks c = check_rwkv6(ins, u, s);
  if (c.ok()) check_backward(c, d_o, dh_final, ckpt, cu, grads, 4, 2, *dh0, r.element_type(), s);
  if (c.ok()) check_f32(c, "du", *du, {s.N, s.H, s.K});
  check_cuda(c, s);
  if (!c.ok()) return c.error("rwkv6 backward");
  Rwkv6BackArgs p{r.untyped_data(), k.untyped_data(), v.untyped_data(), w.untyped_data(),
                  d_o.untyped_data(), u.typed_data<float>(), cu.typed_data(),
                  dh_final.typed_data<float>(), ckpt.typed_data<float>(), dr->untyped_data(),
                  dk->untyped_data(), dv->untyped_data(), dw->untyped_data(),
                  du->typed_data<float>(), dh0->typed_data<float>(), s.H, s.V, s.B * s.T, scale};
  return dispatch_cuda(r.element_type(), [&](auto t) {
    using T = decltype(t);
    return dispatch_head_size(s.K, [&](auto kc) {
      constexpr int K = decltype(kc)::value;
      const size_t shared =
          sizeof(float) * (kChunk * (3 * K + 2 * s.V + 1) + 2 * K + 3 * (s.V / 32) * K);
      return launch(rwkv6_backward_kernel<K, T>, dim3(s.H, s.N), s.V, shared, stream, p);
    });
  });
}

ffi::Error Rwkv6StepCuda(cudaStream_t stream, ffi::AnyBuffer r, ffi::AnyBuffer k,
                         ffi::AnyBuffer v, ffi::AnyBuffer w, ffi::AnyBuffer u,
                         ffi::AnyBuffer pool_in, ffi::Buffer<ffi::S32> rows, float scale,
                         ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> pool) {
  const ffi::AnyBuffer ins[4] = {r, k, v, w};
  SeqShape s;
  Checks c = check_rwkv6(ins, u, s);
  if (c.ok()) check_step(c, pool_in, rows, *o, *pool, r.element_type(), s);
  check_cuda(c, s);
  if (!c.ok()) return c.error("rwkv6_step");
  return rwkv6_forward(stream, ins, u.typed_data<float>(), s, nullptr, rows.typed_data(), s.N,
                       pool->typed_data<float>(), pool->typed_data<float>(), nullptr,
                       o->untyped_data(), s.B, scale);
}

ffi::Error Rwkv4ForwardCuda(cudaStream_t stream, ffi::AnyBuffer w, ffi::AnyBuffer u,
                            ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer s0,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> s_final,
                            ffi::Result<ffi::AnyBuffer> ckpt) {
  Rwkv4Shape s;
  Checks c = check_rwkv4(w, u, k, v, s);
  if (c.ok()) check_rwkv4_forward(c, s0, *y, *s_final, *ckpt, k.element_type(), s);
  if (!c.ok()) return c.error("rwkv4 forward");
  const int threads = 128;
  const dim3 grid((unsigned)((s.B * s.C + threads - 1) / threads));
  return dispatch_cuda(k.element_type(), [&](auto t) -> ffi::Error {
    using T = decltype(t);
    if (grid.x == 0) return ffi::Error::Success();
    rwkv4_forward_kernel<T><<<grid, threads, 0, stream>>>(
        w.typed_data<float>(), u.typed_data<float>(), (const T*)k.untyped_data(),
        (const T*)v.untyped_data(), (const Wkv4State*)s0.untyped_data(), (T*)y->untyped_data(),
        (Wkv4State*)s_final->untyped_data(), (Wkv4State*)ckpt->untyped_data(), s.B, s.T, s.C);
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? ffi::Error::Success()
                            : ffi::Error::Internal(std::string("rwkv_jax CUDA: ") + cudaGetErrorString(e));
  });
}

ffi::Error Rwkv4BackwardCuda(cudaStream_t stream, ffi::AnyBuffer w, ffi::AnyBuffer u,
                             ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer dy,
                             ffi::AnyBuffer ds_final, ffi::AnyBuffer ckpt,
                             ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> du,
                             ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                             ffi::Result<ffi::AnyBuffer> ds0) {
  Rwkv4Shape s;
  Checks c = check_rwkv4(w, u, k, v, s);
  if (c.ok())
    check_rwkv4_backward(c, dy, ds_final, ckpt, *dw, *du, *dk, *dv, *ds0, k.element_type(), s);
  if (!c.ok()) return c.error("rwkv4 backward");
  const int threads = 128;
  const dim3 grid((unsigned)((s.B * s.C + threads - 1) / threads));
  return dispatch_cuda(k.element_type(), [&](auto t) -> ffi::Error {
    using T = decltype(t);
    if (grid.x == 0) return ffi::Error::Success();
    rwkv4_backward_kernel<T><<<grid, threads, 0, stream>>>(
        w.typed_data<float>(), u.typed_data<float>(), (const T*)k.untyped_data(),
        (const T*)v.untyped_data(), (const T*)dy.untyped_data(),
        (const Wkv4State*)ds_final.untyped_data(), (const Wkv4State*)ckpt.untyped_data(),
        dw->typed_data<float>(), du->typed_data<float>(), (T*)dk->untyped_data(),
        (T*)dv->untyped_data(), (Wkv4State*)ds0->untyped_data(), s.B, s.T, s.C);
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? ffi::Error::Success()
                            : ffi::Error::Internal(std::string("rwkv_jax CUDA: ") + cudaGetErrorString(e));
  });
}

}  // namespace rwkv_ffi

using namespace rwkv_ffi;

#define RWKV_JAX_STREAM ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7ForwardCuda, Rwkv7ForwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV7_FWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7BackwardCuda, Rwkv7BackwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV7_BWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7StepCuda, Rwkv7StepCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV7_STEP_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv6ForwardCuda, Rwkv6ForwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV6_FWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv6BackwardCuda, Rwkv6BackwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV6_BWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv6StepCuda, Rwkv6StepCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV6_STEP_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv4ForwardCuda, Rwkv4ForwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV4_FWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv4BackwardCuda, Rwkv4BackwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV4_BWD_OPS);

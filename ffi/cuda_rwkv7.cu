// CUDA kernels of RWKV-7 (training forward/backward, inference step), with the same operands as
// the CPU handlers of cpu_rwkv7.cc (see there for the math).
//
// One block per (head, sequence), one thread per value column j; thread j keeps column j of the
// K x V state (K floats) in registers. The inputs of kChunk steps are staged in shared memory at
// a time. Sums over j (the key-side gradients) are block reductions: a warp transpose-reduce
// (each lane ends with K/32 of the K sums) and a pass over the warps. The backward recomputes the
// state before each step from the chunk's checkpoint (exact, no division by the decay), walking
// dL/dh back with the exact reverse recurrence.
#include "cuda_util.cuh"

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
    for (int idx = j; idx < len * V; idx += V) {
      const int t = idx / V, jj = idx % V;
      sm[t * stride + 5 * K + jj] = to_f(v[((c0 + t) * p.H + hd) * V + jj]);
    }
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

ffi::Error rwkv7_forward(cudaStream_t stream, Buffers ins, const SeqShape& s, const int* cu,
                         const int* rows, int64_t pool_rows, const float* h_in, float* h_out,
                         float* ckpt, void* o, int64_t n_seq, float scale) {
  Rwkv7Args p{{cu, rows, pool_rows, h_in, h_out, ckpt, o, s.H, s.V, s.T, s.B * s.T, scale},
              ins[0].untyped_data(), ins[1].untyped_data(), ins[2].untyped_data(),
              ins[3].untyped_data(), ins[4].untyped_data(), ins[5].untyped_data()};
  return dispatch_type_and_head_size(ins[0].element_type(), s.K, [&](auto t, auto kc) {
    using T = decltype(t);
    constexpr int K = decltype(kc)::value;
    const size_t shared = sizeof(float) * kChunk * (5 * K + s.V);
    return launch(rwkv7_forward_kernel<K, T>, dim3(s.H, n_seq), s.V, shared, stream, p);
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
  Rwkv7BackArgs p{{cu.typed_data(), dh_final.typed_data<float>(), ckpt.typed_data<float>(),
                   dh0->typed_data<float>(), s.H, s.V, s.B * s.T, scale},
                  r.untyped_data(), w.untyped_data(), k.untyped_data(), v.untyped_data(),
                  a.untyped_data(), b.untyped_data(), d_o.untyped_data(), dr->untyped_data(),
                  dw->untyped_data(), dk->untyped_data(), dv->untyped_data(), da->untyped_data(),
                  db->untyped_data()};
  return dispatch_type_and_head_size(r.element_type(), s.K, [&](auto t, auto kc) {
    using T = decltype(t);
    constexpr int K = decltype(kc)::value;
    const size_t shared = sizeof(float) * (kChunk * (5 * K + 2 * s.V) + 5 * (s.V / 32) * K);
    return launch(rwkv7_backward_kernel<K, T>, dim3(s.H, s.N), s.V, shared, stream, p);
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

}  // namespace rwkv_ffi

using namespace rwkv_ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7ForwardCuda, Rwkv7ForwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV7_FWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7BackwardCuda, Rwkv7BackwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV7_BWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7StepCuda, Rwkv7StepCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV7_STEP_OPS,
                              {ffi::Traits::kCmdBufferCompatible});

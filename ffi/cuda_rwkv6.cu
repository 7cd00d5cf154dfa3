// CUDA kernels of RWKV-6 (training forward/backward, inference step), with the same operands as
// the CPU handlers of cpu_rwkv6.cc (see there for the math). Same layout as cuda_rwkv7.cu: one
// block per (head, sequence), one thread per value column holding its state column in registers,
// kChunk steps staged in shared memory, block reductions for the key-side gradients.
#include "cuda_util.cuh"

namespace rwkv_ffi {
namespace {

struct Rwkv6Args : ForwardArgs {
  const void *r, *k, *v, *w;
  const float* u;  // [H, K]
};

// Staged step: rs, ew, k (K each), then v (V).
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
  store_column(G, p.dh0, n, p.H, hd, V, j);
  for (int i = j; i < K; i += V) p.du[(n * p.H + hd) * K + i] = du[i];
}

ffi::Error rwkv6_forward(cudaStream_t stream, Buffers ins, const float* u, const SeqShape& s,
                         const int* cu, const int* rows, int64_t pool_rows, const float* h_in,
                         float* h_out, float* ckpt, void* o, int64_t n_seq, float scale) {
  Rwkv6Args p{{cu, rows, pool_rows, h_in, h_out, ckpt, o, s.H, s.V, s.T, s.B * s.T, scale},
              ins[0].untyped_data(), ins[1].untyped_data(), ins[2].untyped_data(),
              ins[3].untyped_data(), u};
  return dispatch_type_and_head_size(ins[0].element_type(), s.K, [&](auto t, auto kc) {
    using T = decltype(t);
    constexpr int K = decltype(kc)::value;
    const size_t shared = sizeof(float) * (kChunk * (3 * K + s.V) + K);
    return launch(rwkv6_forward_kernel<K, T>, dim3(s.H, n_seq), s.V, shared, stream, p);
  });
}

}  // namespace

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
  Rwkv6BackArgs p{{cu.typed_data(), dh_final.typed_data<float>(), ckpt.typed_data<float>(),
                   dh0->typed_data<float>(), s.H, s.V, s.B * s.T, scale},
                  r.untyped_data(), k.untyped_data(), v.untyped_data(), w.untyped_data(),
                  d_o.untyped_data(), u.typed_data<float>(), dr->untyped_data(),
                  dk->untyped_data(), dv->untyped_data(), dw->untyped_data(),
                  du->typed_data<float>()};
  return dispatch_type_and_head_size(r.element_type(), s.K, [&](auto t, auto kc) {
    using T = decltype(t);
    constexpr int K = decltype(kc)::value;
    const size_t shared =
        sizeof(float) * (kChunk * (3 * K + 2 * s.V + 1) + 2 * K + 3 * (s.V / 32) * K);
    return launch(rwkv6_backward_kernel<K, T>, dim3(s.H, s.N), s.V, shared, stream, p);
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

}  // namespace rwkv_ffi

using namespace rwkv_ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv6ForwardCuda, Rwkv6ForwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV6_FWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv6BackwardCuda, Rwkv6BackwardCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV6_BWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv6StepCuda, Rwkv6StepCuda,
                              RWKV_JAX_STREAM RWKV_JAX_RWKV6_STEP_OPS,
                              {ffi::Traits::kCmdBufferCompatible});

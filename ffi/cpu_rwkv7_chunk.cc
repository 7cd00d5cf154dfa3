// RWKV-7 training in chunks of kChunk tokens on the CPU: the twin of the chunked CUDA kernels
// (cuda_rwkv7_chunk.cu), the same arithmetic in float32 (rwkv7_chunk_math.h), so that CI tests
// it. One task per (sequence, head) walks its chunks with the float32 state; the forward saves
// the state at every chunk's start (the checkpoint slots of common.h; bfloat16 for 16-bit inputs,
// as the CUDA kernels save it), the backward walks the chunks in reverse from those states,
// computing every gradient of a chunk from its saved state and the state gradient at its end.
#include "checks.h"
#include "cpu_util.h"
#include "handlers.h"
#include "rwkv7_chunk_math.h"

namespace rwkv_ffi {
namespace {

constexpr int64_t C = kChunk;

// The type of the checkpoints (checks.h's chunk_checkpoint_dtype): bfloat16 for 16-bit inputs.
template <typename T> using Saved = std::conditional_t<std::is_same_v<T, float>, float, bf16>;

// sx = sum_kk row x F and sy = sum_kk row y F: two entries of the in-chunk matrices (row q or a;
// x, y: k and b of the column's token; F its factors).
inline void factored_dots(const float* row, const float* x, const float* y, const float* F,
                          int64_t K, float& sx, float& sy) {
  float dx = 0.f, dy = 0.f;
#pragma omp simd reduction(+ : dx, dy)
  for (int64_t kk = 0; kk < K; ++kk) {
    dx += row[kk] * x[kk] * F[kk];
    dy += row[kk] * y[kk] * F[kk];
  }
  sx = dx;
  sy = dy;
}

// The gradients of factored_dots from those of sx and sy (dx, dy), added into g_row, g_x, g_y.
inline void factored_dots_backward(float dx, float dy, const float* row, const float* x,
                                   const float* y, const float* F, int64_t K, float* g_row,
                                   float* g_x, float* g_y) {
#pragma omp simd
  for (int64_t kk = 0; kk < K; ++kk) {
    g_row[kk] += (dx * x[kk] + dy * y[kk]) * F[kk];
    g_x[kk] += dx * row[kk] * F[kk];
    g_y[kk] += dy * row[kk] * F[kk];
  }
}

// One chunk of one head: its inputs (padded to C rows), decays, factors and in-chunk matrices.
struct Chunk {
  int64_t K, V;
  std::vector<float> q, w, k, a, b, v;  // [C, K] (v: [C, V]); q = scale * r
  std::vector<float> gi, ge, to_end;    // [C, K]: inclusive, exclusive sums, g - gi from the end
  std::vector<float> e_gi, e_ge, e_end;  // their exponentials
  std::vector<float> F;                 // [C, C, K]: F(t, i) = e^(gi_t - gi_i), i <= t
  std::vector<float> Aqk, Aqb, Aak, Aab, Tm;  // [C, C]; Tm = (I - A_ab)^-1
  bool tame = true;

  Chunk(int64_t K_, int64_t V_)
      : K(K_), V(V_), q(C * K_), w(C * K_), k(C * K_), a(C * K_), b(C * K_), v(C * V_),
        gi(C * K_), ge(C * K_), to_end(C * K_), e_gi(C * K_), e_ge(C * K_), e_end(C * K_),
        F(C * C * K_), Aqk(C * C), Aqb(C * C),
        Aak(C * C), Aab(C * C), Tm(C * C) {}

  float* f(int64_t t, int64_t i) { return F.data() + (t * C + i) * K; }
  const float* f(int64_t t, int64_t i) const { return F.data() + (t * C + i) * K; }
  float g(int64_t kk) const { return gi[(C - 1) * K + kk]; }

  // Tokens [c0, c1) of head hd; rows past c1 are zero with log decay 0.
  template <typename T>
  void load_tokens(const T* const in[6], int64_t c0, int64_t c1, int64_t hd, int64_t H,
                   float scale) {
    std::fill(q.begin(), q.end(), 0.f);
    std::fill(w.begin(), w.end(), 0.f);
    std::fill(k.begin(), k.end(), 0.f);
    std::fill(a.begin(), a.end(), 0.f);
    std::fill(b.begin(), b.end(), 0.f);
    std::fill(v.begin(), v.end(), 0.f);
    for (int64_t t = 0; t < c1 - c0; ++t) {
      const int64_t ok = ((c0 + t) * H + hd) * K, ov = ((c0 + t) * H + hd) * V;
      load(in[0] + ok, q.data() + t * K, K);
      load(in[1] + ok, w.data() + t * K, K);
      load(in[2] + ok, k.data() + t * K, K);
      load(in[3] + ov, v.data() + t * V, V);
      load(in[4] + ok, a.data() + t * K, K);
      load(in[5] + ok, b.data() + t * K, K);
    }
    for (int64_t i = 0; i < C * K; ++i) {
      q[i] *= scale;
      w[i] = floored(w[i]);
    }
    prepare();
  }

  // Decay sums, the factors and the in-chunk matrices.
  void prepare() {
    for (int64_t kk = 0; kk < K; ++kk) {
      float run = 0.f, back = 0.f;
      for (int64_t t = 0; t < C; ++t) {
        ge[t * K + kk] = run;
        run += w[t * K + kk];
        gi[t * K + kk] = run;
      }
      for (int64_t t = C - 1; t >= 0; --t) {
        to_end[t * K + kk] = back;
        back += w[t * K + kk];
      }
    }
    for (int64_t x = 0; x < C * K; ++x) {
      e_gi[x] = vexp(gi[x]);
      e_ge[x] = vexp(ge[x]);
      e_end[x] = vexp(to_end[x]);
    }
    tame = true;
    for (int64_t kk = 0; kk < K; ++kk) tame = tame && g(kk) >= -kTameSum;
    if (tame) {
      // Referenced to the middle: F = e^(gi_t - m) e^(m - gi_i).
      std::vector<float> row(C * K), col(C * K);
      for (int64_t t = 0; t < C; ++t)
        for (int64_t kk = 0; kk < K; ++kk) {
          const float m = gi[kMiddle * K + kk];
          row[t * K + kk] = vexp(gi[t * K + kk] - m);
          col[t * K + kk] = vexp(m - gi[t * K + kk]);
        }
      for (int64_t t = 0; t < C; ++t)
        for (int64_t i = 0; i <= t; ++i)
          for (int64_t kk = 0; kk < K; ++kk) f(t, i)[kk] = row[t * K + kk] * col[i * K + kk];
    } else {
      // Each factor from its own sum of log decays.
      std::vector<float> sum(K);
      for (int64_t i = 0; i < C; ++i) {
        std::fill(sum.begin(), sum.end(), 0.f);
        std::fill(f(i, i), f(i, i) + K, 1.f);
        for (int64_t t = i + 1; t < C; ++t) {
          float* F_ti = f(t, i);
          for (int64_t kk = 0; kk < K; ++kk) {
            sum[kk] += w[t * K + kk];
            F_ti[kk] = vexp(sum[kk]);
          }
        }
      }
    }
    std::fill(Aqk.begin(), Aqk.end(), 0.f);
    std::fill(Aqb.begin(), Aqb.end(), 0.f);
    std::fill(Aak.begin(), Aak.end(), 0.f);
    std::fill(Aab.begin(), Aab.end(), 0.f);
    for (int64_t t = 0; t < C; ++t)
      for (int64_t i = 0; i <= t; ++i) {
        const float *ki = &k[i * K], *bi = &b[i * K];
        factored_dots(&q[t * K], ki, bi, f(t, i), K, Aqk[t * C + i], Aqb[t * C + i]);
        if (i < t)  // E(t, i) = e^(ge_t - gi_i) = F(t - 1, i)
          factored_dots(&a[t * K], ki, bi, f(t - 1, i), K, Aak[t * C + i], Aab[t * C + i]);
      }
    // (I - A_ab)^-1 by forward substitution: unit lower triangular.
    std::fill(Tm.begin(), Tm.end(), 0.f);
    for (int64_t t = 0; t < C; ++t) {
      Tm[t * C + t] = 1.f;
      for (int64_t i = 0; i < t; ++i) {
        float s = 0.f;
        for (int64_t j = i; j < t; ++j) s += Aab[t * C + j] * Tm[j * C + i];
        Tm[t * C + i] = s;
      }
    }
  }

  // U = (I - A_ab)^-1 (a~ H + A_ak V)  [C, V]
  void values_u(const float* Hs, float* U) const {
    std::vector<float> X(C * V, 0.f);
    for (int64_t t = 0; t < C; ++t) {
      float* x = &X[t * V];
      for (int64_t kk = 0; kk < K; ++kk) axpy(x, a[t * K + kk] * e_ge[t * K + kk], Hs + kk * V, V);
      for (int64_t i = 0; i < t; ++i) axpy(x, Aak[t * C + i], &v[i * V], V);
    }
    std::fill(U, U + C * V, 0.f);
    for (int64_t t = 0; t < C; ++t)
      for (int64_t i = 0; i <= t; ++i) axpy(U + t * V, Tm[t * C + i], &X[i * V], V);
  }
};

// The forward of one chunk: o rows (C x V, padded) and the state H updated in place.
void forward_chunk(const Chunk& c, float* Hs, float* O, float* U) {
  const int64_t K = c.K, V = c.V;
  c.values_u(Hs, U);
  std::fill(O, O + C * V, 0.f);
  for (int64_t t = 0; t < C; ++t) {
    float* o = O + t * V;
    for (int64_t kk = 0; kk < K; ++kk)
      axpy(o, c.q[t * K + kk] * c.e_gi[t * K + kk], Hs + kk * V, V);
    for (int64_t i = 0; i <= t; ++i) {
      axpy(o, c.Aqk[t * C + i], &c.v[i * V], V);
      axpy(o, c.Aqb[t * C + i], U + i * V, V);
    }
  }
  for (int64_t kk = 0; kk < K; ++kk) {
    float* h = Hs + kk * V;
    const float eg = c.e_gi[(C - 1) * K + kk];
    for (int64_t j = 0; j < V; ++j) h[j] *= eg;
    for (int64_t t = 0; t < C; ++t) {
      const float f = c.e_end[t * K + kk];
      axpy(h, c.k[t * K + kk] * f, &c.v[t * V], V);
      axpy(h, c.b[t * K + kk] * f, U + t * V, V);
    }
  }
}

template <typename T>
ffi::Error forward(const ffi::AnyBuffer* ins, ffi::AnyBuffer h0, ffi::Buffer<ffi::S32> cu,
                   float scale, ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> h_final,
                   ffi::Result<ffi::AnyBuffer> ckpt) {
  auto dims = ins[0].dimensions();
  const int64_t B = dims[0], T_ = dims[1], H = dims[2], K = dims[3], V = ins[3].dimensions()[3];
  const int64_t N = cu.dimensions()[0] - 1, kv = K * V;
  const T* in[6];
  for (int i = 0; i < 6; ++i) in[i] = ptr<T>(ins[i]);
  const int32_t* seg = cu.typed_data();
  Saved<T>* cp = checkpoint_data<Saved<T>>(*ckpt);
  T* op = ptr<T>(*o);
  parallel_for(N * H, (B * T_ / N) * kv * 8, [&](int64_t task) {
    const int64_t n = task / H, hd = task % H, start = seg[n], end = seg[n + 1];
    float* Hs = h_final->typed_data<float>() + (n * H + hd) * kv;
    std::memcpy(Hs, h0.typed_data<float>() + (n * H + hd) * kv, sizeof(float) * kv);
    Saved<T>* slots = cp ? cp + (first_slot(n, start) * H + hd) * kv : nullptr;
    Chunk c(K, V);
    std::vector<float> O(C * V), U(C * V);
    for (int64_t c0 = start, ci = 0; c0 < end; c0 += C, ++ci) {
      const int64_t c1 = std::min(c0 + C, end);
      if (slots) store(Hs, slots + ci * H * kv, kv);
      c.load_tokens<T>(in, c0, c1, hd, H, scale);
      forward_chunk(c, Hs, O.data(), U.data());
      for (int64_t t = 0; t < c1 - c0; ++t) store(&O[t * V], op + ((c0 + t) * H + hd) * V, V);
    }
  });
  return ffi::Error::Success();
}

// The gradients of one chunk's inputs from its start state Hs, dO (C x V, padded with zeros) and
// G = dL/dH' on entry; G becomes dL/dH of the chunk's start. Writes the per-token gradients into
// g_* ([C, K], g_v [C, V]); dr is scale * dq.
void backward_chunk(const Chunk& c, const float* Hs, const float* dO, float* G, float* g_q,
                    float* g_w, float* g_k, float* g_v, float* g_a, float* g_b) {
  const int64_t K = c.K, V = c.V;
  std::vector<float> U(C * V), dU(C * V, 0.f), dX(C * V, 0.f);
  c.values_u(Hs, U.data());
  // dU = A_qb^T dO + b^ dH'
  for (int64_t i = 0; i < C; ++i) {
    float* du = &dU[i * V];
    for (int64_t t = i; t < C; ++t) axpy(du, c.Aqb[t * C + i], dO + t * V, V);
    for (int64_t kk = 0; kk < K; ++kk)
      axpy(du, c.b[i * K + kk] * c.e_end[i * K + kk], G + kk * V, V);
  }
  // dX = Tm^T dU
  for (int64_t i = 0; i < C; ++i)
    for (int64_t t = i; t < C; ++t) axpy(&dX[i * V], c.Tm[t * C + i], &dU[t * V], V);
  // dV = A_qk^T dO + A_ak^T dX + k^ dH'
  std::fill(g_v, g_v + C * V, 0.f);
  for (int64_t i = 0; i < C; ++i) {
    float* dv = g_v + i * V;
    for (int64_t t = i; t < C; ++t) {
      axpy(dv, c.Aqk[t * C + i], dO + t * V, V);
      if (t > i) axpy(dv, c.Aak[t * C + i], &dX[t * V], V);
    }
    for (int64_t kk = 0; kk < K; ++kk)
      axpy(dv, c.k[i * K + kk] * c.e_end[i * K + kk], G + kk * V, V);
  }
  // dA matrices.
  std::vector<float> dAqk(C * C, 0.f), dAqb(C * C, 0.f), dAak(C * C, 0.f), dAab(C * C, 0.f);
  for (int64_t t = 0; t < C; ++t)
    for (int64_t i = 0; i <= t; ++i) {
      dAqk[t * C + i] = dot(dO + t * V, &c.v[i * V], V);
      dAqb[t * C + i] = dot(dO + t * V, &U[i * V], V);
      if (i < t) {
        dAak[t * C + i] = dot(&dX[t * V], &c.v[i * V], V);
        dAab[t * C + i] = dot(&dX[t * V], &U[i * V], V);
      }
    }
  // Against the state: dq~ = dO H^T, da~ = dX H^T, dk^ = V dH'^T, db^ = U dH'^T.
  std::vector<float> dgi(C * K), dge(C * K), dg(K, 0.f);
  for (int64_t kk = 0; kk < K; ++kk) {
    const float* h = Hs + kk * V;
    const float* gk = G + kk * V;
    dg[kk] = c.e_gi[(C - 1) * K + kk] * dot(h, gk, V);
    for (int64_t t = 0; t < C; ++t) {
      const int64_t x = t * K + kk;
      const float eq = c.e_gi[x], ea = c.e_ge[x], ek = c.e_end[x];
      g_q[x] = dot(dO + t * V, h, V) * eq;
      g_a[x] = dot(&dX[t * V], h, V) * ea;
      const float dkh = dot(&c.v[t * V], gk, V) * ek, dbh = dot(&U[t * V], gk, V) * ek;
      g_k[x] = dkh;
      g_b[x] = dbh;
      dg[kk] += c.k[x] * dkh + c.b[x] * dbh;
    }
  }
  // Through the in-chunk factors.
  for (int64_t t = 0; t < C; ++t)
    for (int64_t i = 0; i <= t; ++i) {
      const float *ki = &c.k[i * K], *bi = &c.b[i * K];
      factored_dots_backward(dAqk[t * C + i], dAqb[t * C + i], &c.q[t * K], ki, bi, c.f(t, i), K,
                             &g_q[t * K], &g_k[i * K], &g_b[i * K]);
      if (i < t)
        factored_dots_backward(dAak[t * C + i], dAab[t * C + i], &c.a[t * K], ki, bi,
                               c.f(t - 1, i), K, &g_a[t * K], &g_k[i * K], &g_b[i * K]);
    }
  // dw_s = sum_{t >= s} (dgi_t + dge_t) - dge_s + dg; 0 where the log decay was raised.
  for (int64_t x = 0; x < C * K; ++x) {
    dgi[x] = c.q[x] * g_q[x] - c.k[x] * g_k[x] - c.b[x] * g_b[x];
    dge[x] = c.a[x] * g_a[x];
  }
  for (int64_t kk = 0; kk < K; ++kk) {
    float run = 0.f;
    for (int64_t t = C - 1; t >= 0; --t) {
      const int64_t x = t * K + kk;
      run += dgi[x] + dge[x];
      g_w[x] = run - dge[x] + dg[kk];
    }
  }
  // dH = e^g dH' + q~^T dO + a~^T dX
  for (int64_t kk = 0; kk < K; ++kk) {
    float* gk = G + kk * V;
    const float eg = c.e_gi[(C - 1) * K + kk];
    for (int64_t j = 0; j < V; ++j) gk[j] *= eg;
    for (int64_t t = 0; t < C; ++t) {
      axpy(gk, c.q[t * K + kk] * c.e_gi[t * K + kk], dO + t * V, V);
      axpy(gk, c.a[t * K + kk] * c.e_ge[t * K + kk], &dX[t * V], V);
    }
  }
}

template <typename T>
ffi::Error backward(const ffi::AnyBuffer* ins, ffi::AnyBuffer d_o, ffi::AnyBuffer dh_final,
                    ffi::AnyBuffer ckpt, ffi::Buffer<ffi::S32> cu, float scale,
                    ffi::Result<ffi::AnyBuffer>* grads, ffi::Result<ffi::AnyBuffer> dh0) {
  auto dims = ins[0].dimensions();
  const int64_t B = dims[0], T_ = dims[1], H = dims[2], K = dims[3], V = ins[3].dimensions()[3];
  const int64_t N = cu.dimensions()[0] - 1, kv = K * V;
  const T* in[6];
  T* gr[6];
  for (int i = 0; i < 6; ++i) {
    in[i] = ptr<T>(ins[i]);
    gr[i] = ptr<T>(*grads[i]);
  }
  const T* dop = ptr<T>(d_o);
  const int32_t* seg = cu.typed_data();
  parallel_for(N * H, (B * T_ / N) * kv * 20, [&](int64_t task) {
    const int64_t n = task / H, hd = task % H, start = seg[n], end = seg[n + 1];
    float* G = dh0->typed_data<float>() + (n * H + hd) * kv;
    std::memcpy(G, dh_final.typed_data<float>() + (n * H + hd) * kv, sizeof(float) * kv);
    const Saved<T>* slots = ptr<Saved<T>>(ckpt) + (first_slot(n, start) * H + hd) * kv;
    Chunk c(K, V);
    std::vector<float> Hs(kv), dO(C * V), gq(C * K), gw(C * K), gk(C * K), gv(C * V),
        ga(C * K), gb(C * K);
    const int64_t n_chunks = (end - start + C - 1) / C;
    for (int64_t ci = n_chunks - 1; ci >= 0; --ci) {
      const int64_t c0 = start + ci * C, c1 = std::min(c0 + C, end);
      c.load_tokens<T>(in, c0, c1, hd, H, scale);
      std::fill(dO.begin(), dO.end(), 0.f);
      for (int64_t t = 0; t < c1 - c0; ++t) load(dop + ((c0 + t) * H + hd) * V, &dO[t * V], V);
      load(slots + ci * H * kv, Hs.data(), kv);
      backward_chunk(c, Hs.data(), dO.data(), G, gq.data(), gw.data(), gk.data(),
                     gv.data(), ga.data(), gb.data());
      for (int64_t t = 0; t < c1 - c0; ++t) {
        const int64_t ok = ((c0 + t) * H + hd) * K;
        for (int64_t kk = 0; kk < K; ++kk) {
          gq[t * K + kk] *= scale;
          // The gradient of a raised log decay is 0 (NaN stays NaN).
          if (to_float(in[1][ok + kk]) < kFloor) gw[t * K + kk] = 0.f;
        }
        store(&gq[t * K], gr[0] + ok, K);
        store(&gw[t * K], gr[1] + ok, K);
        store(&gk[t * K], gr[2] + ok, K);
        store(&gv[t * V], gr[3] + ((c0 + t) * H + hd) * V, V);
        store(&ga[t * K], gr[4] + ok, K);
        store(&gb[t * K], gr[5] + ok, K);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

ffi::Error Rwkv7ChunkForwardCpu(ffi::AnyBuffer r, ffi::AnyBuffer w, ffi::AnyBuffer k,
                                ffi::AnyBuffer v, ffi::AnyBuffer a, ffi::AnyBuffer b,
                                ffi::AnyBuffer h0, ffi::Buffer<ffi::S32> cu, float scale,
                                ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> h_final,
                                ffi::Result<ffi::AnyBuffer> ckpt) {
  const ffi::AnyBuffer ins[6] = {r, w, k, v, a, b};
  SeqShape s;
  Checks c = check_rwkv7_forward(ins, h0, cu, *o, *h_final, *ckpt, s, /*chunked=*/true);
  check_cpu(c, s, cu);
  if (!c.ok()) return c.error("rwkv7 chunked forward");
  return dispatch_float(r.element_type(), "rwkv7 chunked forward", [&]<typename T>() {
    return forward<T>(ins, h0, cu, scale, o, h_final, ckpt);
  });
}

ffi::Error Rwkv7ChunkBackwardCpu(ffi::AnyBuffer r, ffi::AnyBuffer w, ffi::AnyBuffer k,
                                 ffi::AnyBuffer v, ffi::AnyBuffer a, ffi::AnyBuffer b,
                                 ffi::AnyBuffer d_o, ffi::AnyBuffer dh_final, ffi::AnyBuffer ckpt,
                                 ffi::Buffer<ffi::S32> cu, float scale,
                                 ffi::Result<ffi::AnyBuffer> dr, ffi::Result<ffi::AnyBuffer> dw,
                                 ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                                 ffi::Result<ffi::AnyBuffer> da, ffi::Result<ffi::AnyBuffer> db,
                                 ffi::Result<ffi::AnyBuffer> dh0) {
  const ffi::AnyBuffer ins[6] = {r, w, k, v, a, b};
  ffi::Result<ffi::AnyBuffer> grads[6] = {dr, dw, dk, dv, da, db};
  const ffi::AnyBuffer grad_bufs[6] = {*dr, *dw, *dk, *dv, *da, *db};
  SeqShape s;
  Checks c = check_rwkv7_backward(ins, d_o, dh_final, ckpt, cu, grad_bufs, *dh0, s, /*chunked=*/true);
  check_cpu(c, s, cu);
  if (!c.ok()) return c.error("rwkv7 chunked backward");
  return dispatch_float(r.element_type(), "rwkv7 chunked backward", [&]<typename T>() {
    return backward<T>(ins, d_o, dh_final, ckpt, cu, scale, grads, dh0);
  });
}

}  // namespace rwkv_ffi

using namespace rwkv_ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7ChunkForwardCpu, Rwkv7ChunkForwardCpu,
                              ffi::Ffi::Bind() RWKV_JAX_RWKV7_FWD_OPS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RwkvJaxRwkv7ChunkBackwardCpu, Rwkv7ChunkBackwardCpu,
                              ffi::Ffi::Bind() RWKV_JAX_RWKV7_BWD_OPS);

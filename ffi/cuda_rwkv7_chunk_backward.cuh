// The chunked RWKV-7 backward kernel (see cuda_rwkv7_chunk.cu and cuda_rwkv7_chunk.cuh).
#pragma once

#include "cuda_rwkv7_chunk.cuh"

namespace rwkv_ffi {
namespace {

// After a warp stores its tile of a [C, C] matrix gradient: the entries above the diagonal (and
// on it, STRICT) set to 0, as the key-side products read whole tiles.
struct LowerOnly {
  float* m;
  bool strict;
  __device__ void tile(int, int) const {
    __syncwarp();
    for (int e = threadIdx.x % 32; e < C * C; e += 32)
      if (e % C > e / C || (strict && e % C == e / C)) m[e] = 0.f;
  }
  __device__ void element(int, int, float) const {}
};

// Four consecutive entries of a row as float32.
__device__ __forceinline__ Floats4 load4(const float* x) {
  return *reinterpret_cast<const Floats4*>(x);
}
__device__ __forceinline__ Floats4 load4(const __nv_bfloat16* x) {
  struct alignas(8) Four {
    __nv_bfloat16 x[4];
  };
  const Four v = *reinterpret_cast<const Four*>(x);
  return Floats4{{to_f(v.x[0]), to_f(v.x[1]), to_f(v.x[2]), to_f(v.x[3])}};
}

// dg = e^g rowsum(H * dH') and dH' *= e^g in place (dH = e^g dH' + ... at the chunk's end): four
// columns per lane, each warp's rows loaded in batches before any is used (G may be in global
// memory, where each load waits hundreds of cycles). H is the saved state as the products read it.
template <int D, typename Op>
__device__ void row_sums_and_scale(const Op* H, int ldH, float* G, int ldG, const float* eg,
                                   float* dg) {
  constexpr int kLanes = D / 4;                        // lanes per row
  constexpr int kRows = 32 / kLanes;                   // rows per warp step
  constexpr int kSteps = D / (kWarps<D> * kRows);      // steps per warp
  constexpr int kBatch = kSteps < 4 ? kSteps : 4;
  static_assert(kSteps % kBatch == 0, "whole batches");
  const int lane = threadIdx.x % 32, x = (lane % kLanes) * 4;
  const int first = (threadIdx.x / 32) * kRows + lane / kLanes;
#pragma unroll 1
  for (int s0 = 0; s0 < kSteps; s0 += kBatch) {
    Floats4 h[kBatch], g[kBatch];
#pragma unroll
    for (int s = 0; s < kBatch; ++s) {
      const int row = first + (s0 + s) * kWarps<D> * kRows;
      h[s] = load4(H + row * ldH + x);
      g[s] = load4(G + row * ldG + x);
    }
#pragma unroll
    for (int s = 0; s < kBatch; ++s) {
      const int row = first + (s0 + s) * kWarps<D> * kRows;
      const float e = eg[row];
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        sum += h[s].x[c] * g[s].x[c];
        g[s].x[c] *= e;
      }
      *reinterpret_cast<Floats4*>(G + row * ldG + x) = g[s];
#pragma unroll
      for (int off = kLanes / 2; off; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (lane % kLanes == 0) dg[row] = e * sum;
    }
  }
}

template <int D, typename T>
__global__ void __launch_bounds__(kThreads<D>) rwkv7_chunk_backward_kernel(ChunkArgs p) {
  using Blk = Block<D, T, true>;
  using Lay = typename Blk::Lay;
  using Op = typename Blk::Op;
  constexpr int L = Blk::L;
  extern __shared__ __align__(128) char sm[];
  Blk blk(sm, p.scale);
  const int64_t hd = blockIdx.x, n = blockIdx.y;
  const Range seq = sequence(p.cu, n, 0, p.total);
  const int64_t base = (n * p.H + hd) * D * D;
  // The state gradient G (dL/dH' of the chunk being processed): on chip, or in its dh0 slot.
  float* G;
  int ldG;
  if constexpr (Lay::kGradientOnChip) {
    G = reinterpret_cast<float*>(blk.states() + (Lay::kCopies ? 2 * Lay::state_op : 0));
    ldG = L;
  } else {
    G = p.h_out + base;
    ldG = D;
  }
  Op *H_op_copy = reinterpret_cast<Op*>(blk.states()),
     *G_op_copy = reinterpret_cast<Op*>(blk.states() + Lay::state_op);
  float *u = blk.f(0), *dx = blk.f(5);
  float *s0 = blk.f(1), *s1 = blk.f(2), *s2 = blk.f(3), *s3 = blk.f(4);
  Op *qt = blk.op(0), *at = blk.op(1), *kh = blk.op(2), *bh = blk.op(3), *ub = blk.op(4),
     *dxb = blk.op(5), *vb = blk.v_op(), *dob = blk.do_op();
  T *gr = static_cast<T*>(p.dr), *gw = static_cast<T*>(p.dw), *gk = static_cast<T*>(p.dk),
    *gv = static_cast<T*>(p.dv), *ga = static_cast<T*>(p.da), *gb = static_cast<T*>(p.db);
  const int j = threadIdx.x, warp = threadIdx.x / 32;
  // The column-wise steps: kParts threads per column, each over kRows rows.
  constexpr int kParts = kThreads<D> / D, kRows = C / kParts;
  static_assert(2 * kParts <= C, "dg_parts and dw_parts in the dX tile");
  const int column = j % D, part = j / D;
  // The cumulative log decays (operands()); the parts' sums of dg and of dw's terms in rows of
  // the dX tile (free from the column-wise steps on).
  const float* gi = blk.gi();
  float *dg_parts = blk.f(5), *dw_parts = blk.f(5) + kParts * L;

  for (int idx = j; idx < D * D; idx += kThreads<D>) {
    const float g = p.h_in[base + idx];
    G[(idx / D) * ldG + idx % D] = g;
    if constexpr (Lay::kCopies) G_op_copy[(idx / D) * L + idx % D] = from_f<Op>(g);
  }
  const int64_t n_chunks = (seq.end - seq.start + C - 1) / C;
  Prefetch<D, T, 7> next;
  if (n_chunks > 0) {
    const int64_t last = seq.start + (n_chunks - 1) * C;
    next.load(p, last, (int)(seq.end - last), hd);
  }
  for (int64_t ci = n_chunks - 1; ci >= 0; --ci) {
    const int64_t c0 = seq.start + ci * C;
    const int len = (int)lmin(C, seq.end - c0);
    const Op* Hs = checkpoint_slot<Op, D>(p, n, seq.start, ci, hd);
    const Op *H_op, *G_op;
    int ldH, ldG_op;
    __syncthreads();
    blk.store(next);
    if (ci > 0) next.load(p, c0 - C, C, hd);
    // The checkpoint (already an operand) loaded now and copied on chip at the end of
    // operands(), which hides the loads' latency.
    constexpr int kPerVec = 16 / sizeof(Op);
    constexpr int kSavedVecs = Lay::kCopies ? D * D / kPerVec / kThreads<D> : 1;
    Vec16 saved[kSavedVecs];
    if constexpr (Lay::kCopies) {
#pragma unroll
      for (int n = 0; n < kSavedVecs; ++n)
        saved[n] = *reinterpret_cast<const Vec16*>(Hs + (j + n * kThreads<D>) * kPerVec);
      H_op = H_op_copy;
      G_op = G_op_copy;
      ldH = L;
      ldG_op = L;
    } else {
      H_op = Hs;
      G_op = G;
      ldH = D;
      ldG_op = ldG;
    }
    __syncthreads();
    blk.operands([&] {
      if constexpr (Lay::kCopies) {
#pragma unroll
        for (int n = 0; n < kSavedVecs; ++n) {
          const int idx = (j + n * kThreads<D>) * kPerVec;
          *reinterpret_cast<Vec16*>(H_op_copy + (idx / D) * L + idx % D) = saved[n];
        }
      }
    });
    const bool tame = *blk.tame_flag();
    if constexpr (Lay::kTensor) {
      // The in-chunk matrices and the inverse beside the products with the states, a~H (into
      // u) and b^ dH' (into dx; the factored tiles s0..s3 are being read): a tame chunk's
      // matrices take a warp each (warps 0..3, the inverse on warp 3 once A_ab is done), any
      // other chunk's every thread first.
      const auto state_products = [&](Warps by) {
        for_tiles<2 * C, D>(by, [&](int m0, int n0) {
          Tile<Op> acc;
          acc.zero();
          if (m0 == 0) acc.template add<D, false, false>(at, L, H_op, ldH, 0, n0);
          else acc.template add<D, false, false>(bh, L, G_op, ldG_op, 0, n0);
          acc.store((m0 == 0 ? u : dx) + n0, L);
        });
      };
      if (tame) {
        if (warp < 4) {
          blk.tame_matrix(warp);
          if (warp == 3) blk.inverse();
        } else {
          state_products(Warps{4, kWarps<D> - 4});
        }
      } else {
        blk.in_chunk_matrices();
        __syncthreads();
        if (warp == 0) blk.inverse();
        else state_products(Warps{1, kWarps<D> - 1});
      }
      __syncthreads();
      // Column tile by column tile on one warp each, in place: X = a~H + A_ak V, then
      // U = (I - A_ab)^-1 X (and ub); dU = b^ dH' + A_qb^T dO, then dX = (I - A_ab)^-T dU (and
      // dxb).
      for_tiles<2 * C, D>(kAllWarps<D>, [&](int m0, int n0) {
        const bool rows_u = m0 == 0;
        float* x = (rows_u ? u : dx) + n0;
        Tile<Op> sum;
        sum.load(x, L);
        if (rows_u) {
          sum.template add<C, false, false>(blk.hi(1), C, vb, L, 0, n0);
          sum.template add<C, false, false>(blk.lo(1), C, vb, L, 0, n0);
        } else {
          sum.template add<C, true, false>(blk.hi(2), C, dob, L, 0, n0);
          sum.template add<C, true, false>(blk.lo(2), C, dob, L, 0, n0);
        }
        sum.store(x, L);
        __syncwarp();
        Tile<float> acc;
        acc.zero();
        if (rows_u) acc.template add<C, false, false>(blk.mat(4), C, u, L, 0, n0);
        else acc.template add<C, true, false>(blk.mat(4), C, dx, L, 0, n0);
        acc.store(x, L);
        copy_tile(x, L, (rows_u ? ub : dxb) + n0, L);
      });
    } else {
      blk.in_chunk_matrices();
      __syncthreads();
      if (warp == 0) {
        blk.inverse();
      } else {  // a~H, k^ dH', b^ dH' on the other warps
        constexpr Warps others{1, kWarps<D> - 1};
        gemm<C, D, D, false, false, false>(at, L, H_op, ldH, s0, L, others);
        gemm<C, D, D, false, false, false>(kh, L, G_op, ldG_op, s1, L, others);
        gemm<C, D, D, false, false, false>(bh, L, G_op, ldG_op, s2, L, others);
      }
      __syncthreads();
      // X = a~H + A_ak V; dU = A_qb^T dO + b^ dH' (in place of b^ dH'); one element per thread.
      blk.values_x(s0);
      for (int idx = j; idx < C * D; idx += kThreads<D>) {
        const int i = idx / D, column = idx % D;
        float s = s2[i * L + column];
        for (int t = i; t < C; ++t) s += blk.Aqb(t, i) * to_f(blk.in(6)[t * L + column]);
        s2[i * L + column] = s;
      }
      __syncthreads();
      // U = (I - A_ab)^-1 X, dX = (I - A_ab)^-T dU.
      blk.values_u(s0);
      for (int idx = j; idx < C * D; idx += kThreads<D>) {
        const int i = idx / D, column = idx % D;
        float s = 0.f;
        for (int t = i; t < C; ++t) s += blk.Tm(t, i) * s2[t * L + column];
        dx[i * L + column] = s;
        dxb[i * L + column] = from_f<Op>(s);
      }
    }
    __syncthreads();
    // dV = A_qk^T dO + A_ak^T dX + k^ dH', and the gradients of the in-chunk matrices:
    // dA_qk = dO V^T, dA_qb = dO U^T, dA_ak = dX V^T, dA_ab = dX U^T (lower parts).
    if constexpr (Lay::kTensor) {
      if (warp < 4) {
        float* dA = blk.mat(5 + warp);  // rows dO (warps 0, 1) or dX, against V or U
        mma_tiles<C, C, D, false, true, false, false>(warp < 2 ? dob : dxb, L, warp % 2 ? ub : vb,
                                                      L, nullptr, nullptr, dA, C, Warps{warp, 1},
                                                      LowerOnly{dA, warp >= 2});
      } else {
        // dV's bfloat16 products (k^ dH' among them), then its TF32 one.
        for_tiles<C, D>(Warps{4, kWarps<D> - 4}, [&](int, int n0) {
          Tile<Op> in_bf16;
          in_bf16.zero();
          in_bf16.template add<D, false, false>(kh, L, G_op, ldG_op, 0, n0);
          in_bf16.template add<C, true, false>(blk.hi(0), C, dob, L, 0, n0);
          in_bf16.template add<C, true, false>(blk.lo(0), C, dob, L, 0, n0);
          in_bf16.store(s1 + n0, L);
          __syncwarp();
          Tile<float> in_tf32;
          in_tf32.load(s1 + n0, L);
          in_tf32.template add<C, true, false>(blk.mat(2), C, dx, L, 0, n0);
          in_tf32.store(s1 + n0, L);
          store_tile_rows<D>(s1, n0, len, gv, c0, p.H, hd);
        });
      }
    } else {
      for (int idx = j; idx < len * D; idx += kThreads<D>) {
        const int i = idx / D, column = idx % D;
        float s = s1[i * L + column];
        for (int t = i; t < C; ++t) {
          s += blk.Aqk(t, i) * to_f(blk.in(6)[t * L + column]);
          if (t > i) s += blk.Aak(t, i) * dx[t * L + column];
        }
        gv[((c0 + i) * p.H + hd) * D + column] = from_f<T>(s);
      }
      // Each pair (t, i) by two threads: rows dO (dA_qk, dA_qb), rows dX (dA_ak, dA_ab).
      for (int idx = j; idx < 2 * kPairs; idx += kThreads<D>) {
        int t, i;
        pair(idx % kPairs, t, i);
        const bool rows_x = idx >= kPairs;
        float sv = 0.f, su = 0.f;
        for (int x = 0; x < D; ++x) {
          const float rx = rows_x ? dx[t * L + x] : to_f(blk.in(6)[t * L + x]);
          sv += rx * blk.v_(i, x);
          su += rx * u[i * L + x];
        }
        if (rows_x) {
          blk.dAak(t, i) = sv;
          blk.dAab(t, i) = su;
        } else {
          blk.dAqk(t, i) = sv;
          blk.dAqb(t, i) = su;
        }
      }
    }
    __syncthreads();
    // Against the state: dq~ = dO H^T, da~ = dX H^T, dk^ = V dH'^T, db^ = U dH'^T.
    gemm<C, D, D, false, true, false>(dob, L, H_op, ldH, s0, L, kAllWarps<D>);
    gemm<C, D, D, false, true, false>(dxb, L, H_op, ldH, s1, L, kAllWarps<D>);
    gemm<C, D, D, false, true, false>(vb, L, G_op, ldG_op, s2, L, kAllWarps<D>);
    gemm<C, D, D, false, true, false>(ub, L, G_op, ldG_op, s3, L, kAllWarps<D>);
    // Float32 inputs read dH' itself above (no operand copy): done before it is scaled.
    if constexpr (!Lay::kCopies) __syncthreads();
    row_sums_and_scale<D>(H_op, ldH, G, ldG, blk.eg(), blk.dg());
    __syncthreads();
    // The terms against the state through their factors (dq~ e^gi, da~ e^ge, dk^ e^(g - gi),
    // db^ e^(g - gi) in place in s0..s3), each thread over rows part, part + kParts, ..., and
    // its share of dg (sum over t of k dk^ + b db^) into dg_parts.
    {
      float dg_part = 0.f;
#pragma unroll
      for (int t = part; t < C; t += kParts) {
        const int e = t * L + column;
        const float g_t = gi[e], ge = t ? gi[e - L] : 0.f;
        // g - gi_t: precise as a difference in a tame chunk; else summed from the chunk's end.
        float to_end = 0.f;
        if (tame) to_end = gi[(C - 1) * L + column] - g_t;
        else for (int s = C - 1; s > t; --s) to_end += blk.w_(s, column);
        const float back = expf(to_end);
        s0[e] *= expf(g_t);
        s1[e] *= expf(ge);
        const float dk_h = s2[e] * back, db_h = s3[e] * back;
        s2[e] = dk_h;
        s3[e] = db_h;
        dg_part += blk.k_(t, column) * dk_h + blk.b_(t, column) * db_h;
      }
      dg_parts[part * L + column] = dg_part;
    }
    __syncthreads();
    // The key-side gradients through the in-chunk factors.
    bool factored = false;  // whether s2, s3 still lack their factor e^(m - gi) (tame products)
    if constexpr (Lay::kTensor) {
      if (tame) {
        factored = true;
        // With the factored tiles (F = e^(gi_t - m) e^(m - gi_i)): dq += e^(gi_t - m)
        // (dA_qk k_f + dA_qb b_f), da += e^(ge_t - m) (dA_ak k_f + dA_ab b_f), then dk, db +=
        // e^(m - gi_i) (dA_qk^T q_f + dA_ak^T a_f, dA_qb^T q_f + dA_ab^T a_f): each sum taken
        // in the frame of its factor (divided out first, multiplied back after).
        float* k_f = u;  // U is spent
        float* b_f = blk.spent_kb();
        for (int idx = j; idx < C * D; idx += kThreads<D>) {
          const int t = idx / D, x = idx % D, e = t * L + x;
          const float m = gi[kMiddle * L + x], g_t = gi[e], ge = t ? gi[e - L] : 0.f;
          const float col = expf(m - g_t);
          k_f[e] = blk.k_(t, x) * col;
          b_f[e] = blk.b_(t, x) * col;
          s0[e] *= col;
          s1[e] *= expf(m - ge);
        }
        __syncthreads();
        mma_tiles<C, D, C, false, false, true, true>(blk.mat(5), C, k_f, L, blk.mat(6), b_f, s0, L,
                                               Warps{0, kWarps<D> / 2}, NoEpilogue{});
        mma_tiles<C, D, C, false, false, true, true>(blk.mat(7), C, k_f, L, blk.mat(8), b_f, s1, L,
                                               Warps{kWarps<D> / 2, kWarps<D> / 2}, NoEpilogue{});
        __syncthreads();
        float *q_f = k_f, *a_f = b_f;
        for (int idx = j; idx < C * D; idx += kThreads<D>) {
          const int t = idx / D, x = idx % D, e = t * L + x;
          const float m = gi[kMiddle * L + x], g_t = gi[e], ge = t ? gi[e - L] : 0.f;
          const float row = expf(g_t - m), row_e = expf(ge - m);
          s0[e] *= row;
          s1[e] *= row_e;
          q_f[e] = blk.q_(t, x) * row;
          a_f[e] = blk.a_(t, x) * row_e;
          s2[e] *= row;
          s3[e] *= row;
        }
        __syncthreads();
        mma_tiles<C, D, C, true, false, true, true>(blk.mat(5), C, q_f, L, blk.mat(7), a_f, s2, L,
                                              Warps{0, kWarps<D> / 2}, NoEpilogue{});
        mma_tiles<C, D, C, true, false, true, true>(blk.mat(6), C, q_f, L, blk.mat(8), a_f, s3, L,
                                              Warps{kWarps<D> / 2, kWarps<D> / 2}, NoEpilogue{});
        __syncthreads();
      }
    }
    if (!factored) {
      // kParts threads per column share its pairs (t, i) by i; then the parts' sums of dq
      // and da, one part after another (the same order every run).
      const float m = gi[kMiddle * L + column];
      float row[C], g_q[C], g_a[C];
#pragma unroll
      for (int t = 0; t < C; ++t) {
        row[t] = expf(gi[t * L + column] - m);
        g_q[t] = 0.f;
        g_a[t] = 0.f;
      }
#pragma unroll 1
      for (int i = part; i < C; i += kParts) {
        const float ki = blk.k_(i, column), bi = blk.b_(i, column);
        const float col = expf(m - gi[i * L + column]);
        float F = 1.f, E = 0.f, sum = 0.f, dki = 0.f, dbi = 0.f;
#pragma unroll
        for (int t = 0; t < C; ++t) {
          if (t < i) continue;
          if (t > i) {
            E = F;  // E(t, i) = F(t - 1, i)
            sum += blk.w_(t, column);
            F = tame ? row[t] * col : expf(sum);
          } else if (tame) {
            F = row[t] * col;
          }
          const float q_t = blk.q_(t, column), qk = blk.dAqk(t, i), qb = blk.dAqb(t, i);
          g_q[t] += (qk * ki + qb * bi) * F;
          dki += qk * q_t * F;
          dbi += qb * q_t * F;
          if (t > i) {
            const float a_t = blk.a_(t, column), ak = blk.dAak(t, i), ab = blk.dAab(t, i);
            g_a[t] += (ak * ki + ab * bi) * E;
            dki += ak * a_t * E;
            dbi += ab * a_t * E;
          }
        }
        s2[i * L + column] += dki;  // each i belongs to one thread of the column
        s3[i * L + column] += dbi;
      }
      for (int q = 0; q < kParts; ++q) {
        if (part == q) {
#pragma unroll
          for (int t = 0; t < C; ++t) {
            s0[t * L + column] += g_q[t];
            s1[t * L + column] += g_a[t];
          }
        }
        __syncthreads();
      }
    }
    // The gradients of r, k, a, b, and dw_s = sum_{t >= s} (dgi_t + dge_t) - dge_s + dg (0 where
    // the log decay was raised): each thread over kRows consecutive rows of a column; first the
    // row terms (into s0 and s1, whose values they replace) and their sum (into dw_parts), then,
    // once every part's sum is there, dw.
    const int t0 = part * kRows;
    {
      const float m = gi[kMiddle * L + column];
      float sum = 0.f;
#pragma unroll
      for (int r = kRows - 1; r >= 0; --r) {
        const int t = t0 + r, e = t * L + column;
        const float back = factored ? expf(m - gi[e]) : 1.f;
        const float g_q = s0[e], g_a = s1[e], g_k = s2[e] * back, g_b = s3[e] * back;
        const float dge = blk.a_(t, column) * g_a;
        const float term =
            blk.q_(t, column) * g_q - blk.k_(t, column) * g_k - blk.b_(t, column) * g_b + dge;
        s0[e] = term;
        s1[e] = dge;
        sum += term;
        if (t < len) {
          const int64_t out = ((c0 + t) * p.H + hd) * D + column;
          gr[out] = from_f<T>(g_q * p.scale);
          gk[out] = from_f<T>(g_k);
          ga[out] = from_f<T>(g_a);
          gb[out] = from_f<T>(g_b);
        }
      }
      dw_parts[part * L + column] = sum;
    }
    // dH = e^g dH' + q~^T dO + a~^T dX (dH' scaled above). With tensor cores each warp's tile
    // also goes to a staging tile of its own (in U's and k^ b^'s places, spent) for its operand
    // copy, which then never reads G back (in global memory at K = 128).
    if constexpr (Lay::kTensor) {
      constexpr int kHalf = kWarps<D> / 2;
      static_assert(kHalf * 256 <= C * L, "a staging tile per warp");
      float* stage = warp < kHalf ? u + warp * 256 : blk.spent_kb() + (warp - kHalf) * 256;
      for_tiles<D, D>(kAllWarps<D>, [&](int m0, int n0) {
        Tile<Op> acc;
        acc.load(G + m0 * ldG + n0, ldG);
        acc.template add<C, true, false>(qt, L, dob, L, m0, n0);
        acc.template add<C, true, false>(at, L, dxb, L, m0, n0);
        acc.store(G + m0 * ldG + n0, ldG);
        acc.store(stage, 16);
        copy_tile(stage, 16, G_op_copy + m0 * L + n0, L);
        __syncwarp();
      });
    } else {
      gemm<D, D, C, true, false, true, true>(qt, L, dob, L, G, ldG, kAllWarps<D>, at, dxb);
    }
    __syncthreads();
    {
      float dg = blk.dg()[column], acc = 0.f;
      for (int q = 0; q < kParts; ++q) dg += dg_parts[q * L + column];
      for (int q = kParts - 1; q > part; --q) acc += dw_parts[q * L + column];
#pragma unroll
      for (int r = kRows - 1; r >= 0; --r) {
        const int t = t0 + r, e = t * L + column;
        acc += s0[e];
        if (t < len) {
          const float w_raw = to_f(blk.in(1)[e]);
          gw[((c0 + t) * p.H + hd) * D + column] = from_f<T>(w_raw < kFloor ? 0.f : acc - s1[e] + dg);
        }
      }
    }
  }
  __syncthreads();
  if constexpr (Lay::kGradientOnChip)
    for (int idx = j; idx < D * D; idx += kThreads<D>) p.h_out[base + idx] = G[(idx / D) * ldG + idx % D];
}

}  // namespace
}  // namespace rwkv_ffi

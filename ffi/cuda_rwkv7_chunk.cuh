// The chunked RWKV-7 CUDA kernels (see cuda_rwkv7_chunk.cu): a header of its own so that
// tests/cuda_emulation can compile the same source for the host and run it there.
#pragma once

#include <mma.h>

#include <algorithm>

#include "cuda_device.cuh"
#include "rwkv7_chunk_math.h"

namespace rwkv_ffi {
namespace {

constexpr int C = kChunk;
constexpr int kThreads = 256;
constexpr int kPairs = C * (C + 1) / 2;  // (t, i) with i <= t

// Whether the backward's state gradient stays in shared memory (else in its dh0 slot).
template <int D> constexpr bool gradient_on_chip() { return D <= 64; }

// Row strides (elements) of the [C, D] tiles and of an on-chip [D, D] state: padded by 8 so that
// wmma tiles stay 32-byte aligned and rows fall on different banks.
template <int D> constexpr int ld() { return D + 8; }

// The tensor-core operand type: bfloat16 for 16-bit inputs, float for float32 inputs.
template <typename T> struct OperandOf { using type = __nv_bfloat16; };
template <> struct OperandOf<float> { using type = float; };

template <typename Op> __device__ __forceinline__ Op to_op(float x);
template <> __device__ __forceinline__ float to_op<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 to_op<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// C (+)= A B, A [M, KD] (A_COL: element (m, k) at A[k * lda + m], else A[m * lda + k]),
// B [KD, N] (B_COL: element (k, n) at B[n * ldb + k], else B[k * ldb + n]), C [M, N] float32
// row-major. The whole block calls it; bfloat16 operands on tensor cores, one 16 x 16 tile of
// C per warp at a time.
template <int M, int N, int KD, bool A_COL, bool B_COL, bool ACC>
__device__ void gemm(const __nv_bfloat16* A, int lda, const __nv_bfloat16* B, int ldb, float* Cm,
                     int ldc) {
  using namespace nvcuda;
  using ALayout = typename std::conditional<A_COL, wmma::col_major, wmma::row_major>::type;
  using BLayout = typename std::conditional<B_COL, wmma::col_major, wmma::row_major>::type;
  const int warp = threadIdx.x / 32;
  for (int tile = warp; tile < (M / 16) * (N / 16); tile += kThreads / 32) {
    const int m0 = (tile / (N / 16)) * 16, n0 = (tile % (N / 16)) * 16;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    if (ACC)
      wmma::load_matrix_sync(acc, Cm + m0 * ldc + n0, ldc, wmma::mem_row_major);
    else
      wmma::fill_fragment(acc, 0.f);
#pragma unroll
    for (int k0 = 0; k0 < KD; k0 += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, ALayout> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, BLayout> fb;
      wmma::load_matrix_sync(fa, A_COL ? A + k0 * lda + m0 : A + m0 * lda + k0, lda);
      wmma::load_matrix_sync(fb, B_COL ? B + n0 * ldb + k0 : B + k0 * ldb + n0, ldb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(Cm + m0 * ldc + n0, acc, ldc, wmma::mem_row_major);
  }
}

template <int M, int N, int KD, bool A_COL, bool B_COL, bool ACC>
__device__ void gemm(const float* A, int lda, const float* B, int ldb, float* Cm, int ldc) {
  for (int idx = threadIdx.x; idx < M * N; idx += kThreads) {
    const int m = idx / N, n = idx % N;
    float acc = ACC ? Cm[m * ldc + n] : 0.f;
#pragma unroll 8
    for (int k = 0; k < KD; ++k)
      acc += (A_COL ? A[k * lda + m] : A[m * lda + k]) * (B_COL ? B[n * ldb + k] : B[k * ldb + n]);
    Cm[m * ldc + n] = acc;
  }
}

// Pair p of the lower triangle (row-major order): t, i with i <= t.
__device__ __forceinline__ void pair(int p, int& t, int& i) {
  t = 0;
  while (p > t) {
    p -= t + 1;
    ++t;
  }
  i = p;
}

// Shared memory of one block, in 128-byte aligned pieces: the input tiles (type T, [C, ld]),
// the operand tiles (Op), the float32 tiles, the states and the small arrays.
template <int D, typename T, bool BACKWARD> struct Layout {
  using Op = typename OperandOf<T>::type;
  static constexpr bool kCopies = !std::is_same<Op, float>::value;  // operand copies of states
  static constexpr bool kGradientOnChip = gradient_on_chip<D>();
  static constexpr size_t align(size_t x) { return (x + 127) / 128 * 128; }
  static constexpr size_t tile_in = align(sizeof(T) * C * ld<D>());
  static constexpr size_t tile_op = align(sizeof(Op) * C * ld<D>());
  static constexpr size_t tile_f = align(sizeof(float) * C * ld<D>());
  static constexpr size_t state_f = align(sizeof(float) * D * ld<D>());
  static constexpr size_t state_op = align(sizeof(Op) * D * ld<D>());
  static constexpr size_t small = align(sizeof(float) * (9 * C * C + 2 * D) + 16);
  // Inputs r, w, k, v, a, b (+ dO). Operands q~, a~, k^, b^, U, V (+ dX, dO). Float32: U and
  // four scratch tiles (+ dX).
  static constexpr int n_in = BACKWARD ? 7 : 6;
  static constexpr int n_op = BACKWARD ? 8 : 6;
  static constexpr int n_f = BACKWARD ? 6 : 5;
  // Forward: the state and its operand copy. Backward: the saved state's operand copy, the
  // state gradient's (when copies) and the state gradient itself when it stays on chip.
  static constexpr size_t states =
      BACKWARD ? (kCopies ? 2 * state_op : 0) + (kGradientOnChip ? state_f : 0)
               : state_f + (kCopies ? state_op : 0);
  static constexpr size_t bytes = n_in * tile_in + n_op * tile_op + n_f * tile_f + states + small;
};

struct ChunkArgs {
  const void *r, *w, *k, *v, *a, *b, *d_o;
  const int* cu;
  const float* h_in;   // forward: initial state; backward: d(final state)
  float* h_out;        // forward: final state; backward: d(initial state)
  float* ckpt;         // [slots, H, D, D]; the forward's may be null (no backward follows)
  void* o;             // forward: o
  void *dr, *dw, *dk, *dv, *da, *db;
  int64_t H, total;
  float scale;
};

// One chunk's tiles over the block's shared memory and the steps both kernels share.
template <int D, typename T, bool BACKWARD> struct Block {
  using Lay = Layout<D, T, BACKWARD>;
  using Op = typename OperandOf<T>::type;
  static constexpr int L = ld<D>();
  char* sm;  // the pieces at Layout's offsets: the compiler folds each address
  float scale;

  __device__ Block(char* sm_, float scale_) : sm(sm_), scale(scale_) {}

  // r, w, k, v, a, b (, dO): [C, L], rows past the chunk 0.
  __device__ T* in(int q) const { return reinterpret_cast<T*>(sm + q * Lay::tile_in); }
  // q~, a~, k^, b^, U, V (, dX, dO).
  __device__ Op* op(int q) const {
    return reinterpret_cast<Op*>(sm + Lay::n_in * Lay::tile_in + q * Lay::tile_op);
  }
  // U, scratch 0..3 (, dX).
  __device__ float* f(int q) const {
    return reinterpret_cast<float*>(sm + Lay::n_in * Lay::tile_in + Lay::n_op * Lay::tile_op +
                                    q * Lay::tile_f);
  }
  // A_qk, A_qb, A_ak, A_ab, (I - A_ab)^-1, dA_qk, dA_qb, dA_ak, dA_ab: [C, C].
  __device__ float* mat(int q) const {
    return reinterpret_cast<float*>(sm + Lay::n_in * Lay::tile_in + Lay::n_op * Lay::tile_op +
                                    Lay::n_f * Lay::tile_f) + q * C * C;
  }
  __device__ float* eg() const { return mat(9); }      // e^g [D]
  __device__ float* dg() const { return mat(9) + D; }  // [D]
  __device__ int* tame_flag() const { return reinterpret_cast<int*>(mat(9) + 2 * D); }
  __device__ char* states() const {
    return sm + Lay::n_in * Lay::tile_in + Lay::n_op * Lay::tile_op + Lay::n_f * Lay::tile_f +
           Lay::small;
  }
  __device__ float& Aqk(int t, int i) const { return mat(0)[t * C + i]; }
  __device__ float& Aqb(int t, int i) const { return mat(1)[t * C + i]; }
  __device__ float& Aak(int t, int i) const { return mat(2)[t * C + i]; }
  __device__ float& Aab(int t, int i) const { return mat(3)[t * C + i]; }
  __device__ float& Tm(int t, int i) const { return mat(4)[t * C + i]; }
  __device__ float& dAqk(int t, int i) const { return mat(5)[t * C + i]; }
  __device__ float& dAqb(int t, int i) const { return mat(6)[t * C + i]; }
  __device__ float& dAak(int t, int i) const { return mat(7)[t * C + i]; }
  __device__ float& dAab(int t, int i) const { return mat(8)[t * C + i]; }

  __device__ float q_(int t, int j) const { return to_f(in(0)[t * L + j]) * scale; }
  __device__ float w_(int t, int j) const { return floored(to_f(in(1)[t * L + j])); }
  __device__ float k_(int t, int j) const { return to_f(in(2)[t * L + j]); }
  __device__ float v_(int t, int j) const { return to_f(in(3)[t * L + j]); }
  __device__ float a_(int t, int j) const { return to_f(in(4)[t * L + j]); }
  __device__ float b_(int t, int j) const { return to_f(in(5)[t * L + j]); }

  // The inputs of tokens [c0, c0 + len) of head hd (and dO in the backward).
  __device__ void load(const ChunkArgs& p, int64_t c0, int len, int64_t hd) const {
    const void* const srcs[7] = {p.r, p.w, p.k, p.v, p.a, p.b, p.d_o};
#pragma unroll
    for (int q = 0; q < Lay::n_in; ++q) {
      const T* src = static_cast<const T*>(srcs[q]);
      for (int idx = threadIdx.x; idx < C * D; idx += kThreads) {
        const int t = idx / D, j = idx % D;
        in(q)[t * L + j] = t < len ? src[((c0 + t) * p.H + hd) * D + j] : from_f<T>(0.f);
      }
    }
  }

  // The decays, the operand tiles q~, a~, k^, b^, V, e^g, the in-chunk matrices and
  // (I - A_ab)^-1. Uses the four scratch tiles. Ends synchronised.
  __device__ void prepare() {
    const int j = threadIdx.x;
    // The cumulative log decays gi of each column (into the U tile, free until values_u) and
    // e^g. Tame: every column's total >= -kTameSum (a NaN total makes the chunk exact).
    float* gi = f(0);
    bool tame_col = true;
    if (j < D) {
      float run = 0.f;
      for (int t = 0; t < C; ++t) {
        run += w_(t, j);
        gi[t * L + j] = run;
      }
      eg()[j] = expf(run);
      tame_col = run >= -kTameSum;
    }
    const bool tame = __syncthreads_and(tame_col);
    if (j == 0) *tame_flag() = tame;
    // The operands q~, a~, k^, b^, V and, on the tame path, the factored tiles referenced to
    // the middle (F = e^(gi_t - m) e^(m - gi_i), E(t, i) = F(t - 1, i)); one element per thread.
    float *qm = f(1), *am = f(2), *km = f(3), *bm = f(4);
    for (int idx = j; idx < C * D; idx += kThreads) {
      const int t = idx / D, x = idx % D, e = t * L + x;
      const float g_t = gi[e], ge = t ? gi[e - L] : 0.f;
      float to_end = 0.f;  // e^(g - gi_t) from its own sum, from the chunk's end
      for (int s = C - 1; s > t; --s) to_end += w_(s, x);
      const float f_end = expf(to_end);
      op(0)[e] = to_op<Op>(q_(t, x) * expf(g_t));
      op(1)[e] = to_op<Op>(a_(t, x) * expf(ge));
      op(2)[e] = to_op<Op>(k_(t, x) * f_end);
      op(3)[e] = to_op<Op>(b_(t, x) * f_end);
      op(5)[e] = to_op<Op>(v_(t, x));
      if (tame) {
        const float m = gi[kMiddle * L + x], col = expf(m - g_t);
        qm[e] = q_(t, x) * expf(g_t - m);
        am[e] = a_(t, x) * expf(ge - m);
        km[e] = k_(t, x) * col;
        bm[e] = b_(t, x) * col;
      }
    }
    __syncthreads();
    // Each pair (t, i) by two threads: the rows q (A_qk, A_qb) and the rows a (A_ak, A_ab).
    for (int idx = j; idx < 2 * kPairs; idx += kThreads) {
      int t, i;
      pair(idx % kPairs, t, i);
      const bool rows_a = idx >= kPairs;
      const float* rm = rows_a ? am : qm;
      float sk = 0.f, sb = 0.f;
      if (tame) {
        for (int x = 0; x < D; ++x) {
          const float rx = rm[t * L + x];
          sk += rx * km[i * L + x];
          sb += rx * bm[i * L + x];
        }
      } else {  // each factor from its own sum: F = e^(w_{i+1} + ... + w_t), E = F(t - 1, i)
        for (int x = 0; x < D; ++x) {
          float e_sum = 0.f;
          for (int s = i + 1; s < t; ++s) e_sum += w_(s, x);
          const float F = rows_a ? expf(e_sum) : t > i ? expf(e_sum + w_(t, x)) : 1.f;
          const float rx = rows_a ? a_(t, x) : q_(t, x);
          sk += rx * k_(i, x) * F;
          sb += rx * b_(i, x) * F;
        }
      }
      if (rows_a) {
        Aak(t, i) = sk;  // read only below the diagonal
        Aab(t, i) = sb;
      } else {
        Aqk(t, i) = sk;
        Aqb(t, i) = sb;
      }
    }
    __syncthreads();
    // (I - A_ab)^-1 by forward substitution, one column per thread.
    if (j < C) {
      Tm(j, j) = 1.f;
      for (int t = j + 1; t < C; ++t) {
        float s = 0.f;
        for (int x = j; x < t; ++x) s += Aab(t, x) * Tm(x, j);
        Tm(t, j) = s;
      }
    }
    __syncthreads();
  }

  // U = (I - A_ab)^-1 (a~H + A_ak V) from a~H in `x` [C, L] (overwritten with X): into f(0)
  // and op(4). One element (t, j) per thread at a time. Ends synchronised.
  __device__ void values_u(float* x) {
    for (int idx = threadIdx.x; idx < C * D; idx += kThreads) {
      const int t = idx / D, j = idx % D;
      float s = x[t * L + j];
      for (int i = 0; i < t; ++i) s += Aak(t, i) * v_(i, j);
      x[t * L + j] = s;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < C * D; idx += kThreads) {
      const int t = idx / D, j = idx % D;
      float s = 0.f;
      for (int i = 0; i <= t; ++i) s += Tm(t, i) * x[i * L + j];
      f(0)[t * L + j] = s;
      op(4)[t * L + j] = to_op<Op>(s);
    }
    __syncthreads();
  }
};

template <int D, typename T>
__global__ void __launch_bounds__(kThreads) rwkv7_chunk_forward_kernel(ChunkArgs p) {
  using Blk = Block<D, T, false>;
  using Lay = typename Blk::Lay;
  using Op = typename Blk::Op;
  constexpr int L = Blk::L;
  extern __shared__ __align__(128) char sm[];
  Blk blk(sm, p.scale);
  float* S = reinterpret_cast<float*>(blk.states());  // the state [D, L]
  Op* S_op;                                         // the state as an operand
  if constexpr (Lay::kCopies) S_op = reinterpret_cast<Op*>(blk.states() + Lay::state_f);
  else S_op = S;
  float *u = blk.f(0), *qh = blk.f(1), *ah = blk.f(2);

  const int64_t hd = blockIdx.x, n = blockIdx.y;
  const Range seq = sequence(p.cu, n, 0, p.total);
  const int64_t base = (n * p.H + hd) * D * D;
  for (int idx = threadIdx.x; idx < D * D; idx += kThreads) {
    const float h = p.h_in[base + idx];
    S[(idx / D) * L + idx % D] = h;
    if constexpr (Lay::kCopies) S_op[(idx / D) * L + idx % D] = to_op<Op>(h);
  }
  for (int64_t c0 = seq.start, ci = 0; c0 < seq.end; c0 += C, ++ci) {
    const int len = (int)lmin(C, seq.end - c0);
    __syncthreads();
    if (p.ckpt) {
      float* slot = p.ckpt + ((first_slot(n, seq.start) + ci) * p.H + hd) * D * D;
      for (int idx = threadIdx.x; idx < D * D; idx += kThreads) slot[idx] = S[(idx / D) * L + idx % D];
    }
    blk.load(p, c0, len, hd);
    __syncthreads();
    blk.prepare();
    gemm<C, D, D, false, false, false>(blk.op(0), L, S_op, L, qh, L);  // q~H
    gemm<C, D, D, false, false, false>(blk.op(1), L, S_op, L, ah, L);  // a~H
    __syncthreads();
    blk.values_u(ah);
    // O = q~H + A_qk V + A_qb U
    T* o = static_cast<T*>(p.o);
    for (int idx = threadIdx.x; idx < len * D; idx += kThreads) {
      const int t = idx / D, j = idx % D;
      float s = qh[t * L + j];
      for (int i = 0; i <= t; ++i) s += blk.Aqk(t, i) * blk.v_(i, j) + blk.Aqb(t, i) * u[i * L + j];
      o[((c0 + t) * p.H + hd) * D + j] = from_f<T>(s);
    }
    // H' = e^g H + k^^T V + b^^T U
    for (int idx = threadIdx.x; idx < D * D; idx += kThreads) S[(idx / D) * L + idx % D] *= blk.eg()[idx / D];
    __syncthreads();
    gemm<D, D, C, true, false, true>(blk.op(2), L, blk.op(5), L, S, L);
    __syncthreads();
    gemm<D, D, C, true, false, true>(blk.op(3), L, blk.op(4), L, S, L);
    __syncthreads();
    if constexpr (Lay::kCopies)
      for (int idx = threadIdx.x; idx < D * D; idx += kThreads)
        S_op[(idx / D) * L + idx % D] = to_op<Op>(S[(idx / D) * L + idx % D]);
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < D * D; idx += kThreads) p.h_out[base + idx] = S[(idx / D) * L + idx % D];
}

template <int D, typename T>
__global__ void __launch_bounds__(kThreads) rwkv7_chunk_backward_kernel(ChunkArgs p) {
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
     *vb = blk.op(5), *dxb = blk.op(6), *dob = blk.op(7);
  T *gr = static_cast<T*>(p.dr), *gw = static_cast<T*>(p.dw), *gk = static_cast<T*>(p.dk),
    *gv = static_cast<T*>(p.dv), *ga = static_cast<T*>(p.da), *gb = static_cast<T*>(p.db);

  for (int idx = threadIdx.x; idx < D * D; idx += kThreads)
    G[(idx / D) * ldG + idx % D] = p.h_in[base + idx];
  const int64_t n_chunks = (seq.end - seq.start + C - 1) / C;
  for (int64_t ci = n_chunks - 1; ci >= 0; --ci) {
    const int64_t c0 = seq.start + ci * C;
    const int len = (int)lmin(C, seq.end - c0);
    const float* Hs = p.ckpt + ((first_slot(n, seq.start) + ci) * p.H + hd) * D * D;
    const Op *H_op, *G_op;
    int ldH, ldG_op;
    __syncthreads();
    if constexpr (Lay::kCopies) {
      for (int idx = threadIdx.x; idx < D * D; idx += kThreads) {
        const int i = idx / D, j = idx % D;
        H_op_copy[i * L + j] = to_op<Op>(Hs[idx]);
        G_op_copy[i * L + j] = to_op<Op>(G[i * ldG + j]);
      }
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
    blk.load(p, c0, len, hd);
    __syncthreads();
    blk.prepare();
    const bool tame = *blk.tame_flag();
    for (int idx = threadIdx.x; idx < C * D; idx += kThreads)
      dob[(idx / D) * L + idx % D] = to_op<Op>(to_f(blk.in(6)[(idx / D) * L + idx % D]));
    gemm<C, D, D, false, false, false>(at, L, H_op, ldH, s0, L);  // a~H
    __syncthreads();
    blk.values_u(s0);
    gemm<C, D, D, false, false, false>(kh, L, G_op, ldG_op, s1, L);  // k^ dH'
    gemm<C, D, D, false, false, false>(bh, L, G_op, ldG_op, s2, L);  // b^ dH'
    __syncthreads();
    const int j = threadIdx.x;
    // dU = A_qb^T dO + b^ dH' (in place of b^ dH'), dX = (I - A_ab)^-T dU,
    // dV = A_qk^T dO + A_ak^T dX + k^ dH'; one element (i, column) per thread at a time.
    for (int idx = j; idx < C * D; idx += kThreads) {
      const int i = idx / D, column = idx % D;
      float s = s2[i * L + column];
      for (int t = i; t < C; ++t) s += blk.Aqb(t, i) * to_f(blk.in(6)[t * L + column]);
      s2[i * L + column] = s;
    }
    __syncthreads();
    for (int idx = j; idx < C * D; idx += kThreads) {
      const int i = idx / D, column = idx % D;
      float s = 0.f;
      for (int t = i; t < C; ++t) s += blk.Tm(t, i) * s2[t * L + column];
      dx[i * L + column] = s;
      dxb[i * L + column] = to_op<Op>(s);
    }
    __syncthreads();
    for (int idx = j; idx < len * D; idx += kThreads) {
      const int i = idx / D, column = idx % D;
      float s = s1[i * L + column];
      for (int t = i; t < C; ++t) {
        s += blk.Aqk(t, i) * to_f(blk.in(6)[t * L + column]);
        if (t > i) s += blk.Aak(t, i) * dx[t * L + column];
      }
      gv[((c0 + i) * p.H + hd) * D + column] = from_f<T>(s);
    }
    __syncthreads();
    // The gradients of the in-chunk matrices, each pair (t, i) by two threads: rows dO
    // (dA_qk, dA_qb) and rows dX (dA_ak, dA_ab).
    for (int idx = j; idx < 2 * kPairs; idx += kThreads) {
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
    // Against the state: dq~ = dO H^T, da~ = dX H^T, dk^ = V dH'^T, db^ = U dH'^T.
    gemm<C, D, D, false, true, false>(dob, L, H_op, ldH, s0, L);
    gemm<C, D, D, false, true, false>(dxb, L, H_op, ldH, s1, L);
    gemm<C, D, D, false, true, false>(vb, L, G_op, ldG_op, s2, L);
    gemm<C, D, D, false, true, false>(ub, L, G_op, ldG_op, s3, L);
    // e^g rowsum(H * dH'): a warp per row.
    for (int row = threadIdx.x / 32; row < D; row += kThreads / 32) {
      float s = 0.f;
      for (int x = threadIdx.x % 32; x < D; x += 32) s += Hs[row * D + x] * G[row * ldG + x];
#pragma unroll
      for (int off = 16; off; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (threadIdx.x % 32 == 0) blk.dg()[row] = blk.eg()[row] * s;
    }
    __syncthreads();
    // The key-side gradients through the factors, column by column: first each column's
    // terms against the state (dq~ e^gi, da~ e^ge, dk^ e^(g - gi), db^ e^(g - gi) in place in
    // s0..s3; gi into the dX tile, free now; dg), then kParts threads per column share its
    // pairs (t, i) by i, then one thread per column sums dw and stores.
    constexpr int kParts = kThreads / D;
    if (j < D) {
      float run = 0.f;
#pragma unroll
      for (int t = 0; t < C; ++t) {
        s1[t * L + j] *= expf(run);
        run += blk.w_(t, j);
        s0[t * L + j] *= expf(run);
        dx[t * L + j] = run;
      }
      float dg = blk.dg()[j], back = 0.f;
#pragma unroll
      for (int t = C - 1; t >= 0; --t) {
        const float e = expf(back);
        const float dk_h = s2[t * L + j] * e, db_h = s3[t * L + j] * e;
        s2[t * L + j] = dk_h;
        s3[t * L + j] = db_h;
        dg += blk.k_(t, j) * dk_h + blk.b_(t, j) * db_h;
        back += blk.w_(t, j);
      }
      blk.dg()[j] = dg;
    }
    __syncthreads();
    {
      const int column = j % D, part = j / D;
      const float m = dx[kMiddle * L + column];
      float row[C], g_q[C], g_a[C];
#pragma unroll
      for (int t = 0; t < C; ++t) {
        row[t] = expf(dx[t * L + column] - m);
        g_q[t] = 0.f;
        g_a[t] = 0.f;
      }
#pragma unroll 1
      for (int i = part; i < C; i += kParts) {
        const float ki = blk.k_(i, column), bi = blk.b_(i, column);
        const float col = expf(m - dx[i * L + column]);
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
      // The parts' sums of dq and da, one part after another (the same order every run).
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
    if (j < D) {
      // dw_s = sum_{t >= s} (dgi_t + dge_t) - dge_s + dg; 0 where the log decay was raised.
      const float dg = blk.dg()[j];
      float acc = 0.f;
#pragma unroll
      for (int t = C - 1; t >= 0; --t) {
        const float g_q = s0[t * L + j], g_a = s1[t * L + j];
        const float g_k = s2[t * L + j], g_b = s3[t * L + j];
        const float dgi = blk.q_(t, j) * g_q - blk.k_(t, j) * g_k - blk.b_(t, j) * g_b;
        const float dge = blk.a_(t, j) * g_a;
        acc += dgi + dge;
        if (t < len) {
          const int64_t out = ((c0 + t) * p.H + hd) * D + j;
          const float w_raw = to_f(blk.in(1)[t * L + j]);
          gw[out] = from_f<T>(w_raw < kFloor ? 0.f : acc - dge + dg);
          gr[out] = from_f<T>(g_q * p.scale);
          gk[out] = from_f<T>(g_k);
          ga[out] = from_f<T>(g_a);
          gb[out] = from_f<T>(g_b);
        }
      }
    }
    // dH = e^g dH' + q~^T dO + a~^T dX
    for (int idx = threadIdx.x; idx < D * D; idx += kThreads) G[(idx / D) * ldG + idx % D] *= blk.eg()[idx / D];
    __syncthreads();
    gemm<D, D, C, true, false, true>(qt, L, dob, L, G, ldG);
    __syncthreads();
    gemm<D, D, C, true, false, true>(at, L, dxb, L, G, ldG);
  }
  __syncthreads();
  if constexpr (Lay::kGradientOnChip)
    for (int idx = threadIdx.x; idx < D * D; idx += kThreads) p.h_out[base + idx] = G[(idx / D) * ldG + idx % D];
}

}  // namespace
}  // namespace rwkv_ffi

// What the chunked RWKV-7 CUDA kernels share (see cuda_rwkv7_chunk.cu): the block's shared-memory
// layout, the prefetch of a chunk's inputs, the steps both kernels take on a chunk (Block) and
// the tile epilogues. The kernels are in cuda_rwkv7_chunk_forward.cuh and
// cuda_rwkv7_chunk_backward.cuh; headers, so that tests/cuda_emulation can compile the same
// source for the host and run it there.
#pragma once

#include <algorithm>

#include "cuda_mma.cuh"
#include "rwkv7_chunk_math.h"

namespace rwkv_ffi {
namespace {

constexpr int C = kChunk;
// Threads per block: 256, and 512 at K = 128, where shared memory holds one block per
// multiprocessor and more warps hide more latency.
template <int D> constexpr int kThreads = D >= 128 ? 512 : 256;
template <int D> constexpr int kWarps = kThreads<D> / 32;
constexpr int kPairs = C * (C + 1) / 2;  // (t, i) with i <= t

// Whether the backward's state gradient stays in shared memory (else in its dh0 slot).
template <int D> constexpr bool gradient_on_chip() { return D <= 64; }

// Row strides (elements) of the [C, D] tiles and of an on-chip [D, D] state: padded by 8 so that
// wmma tiles stay 32-byte aligned and rows fall on different banks.
template <int D> __host__ __device__ constexpr int ld() { return D + 8; }

// The tensor-core operand type: bfloat16 for 16-bit inputs, float for float32 inputs.
template <typename T> struct OperandOf { using type = __nv_bfloat16; };
template <> struct OperandOf<float> { using type = float; };

template <int D> constexpr Warps kAllWarps{0, kWarps<D>};

// The products with the state: tensor cores for bfloat16 operands, CUDA cores for float32 ones.
template <int M, int N, int KD, bool A_COL, bool B_COL, bool ACC, bool TWO = false,
          typename Op, typename After = NoEpilogue>
__device__ void gemm(const Op* A, int lda, const Op* B, int ldb, float* Cm, int ldc,
                     Warps by, const Same<Op>* A2 = nullptr,
                     const Same<Op>* B2 = nullptr, const After& after = {}) {
  if constexpr (std::is_same<Op, float>::value)
    fma_elements<M, N, KD, A_COL, B_COL, ACC, TWO>(A, lda, B, ldb, A2, B2, Cm, ldc, by, after);
  else
    mma_tiles<M, N, KD, A_COL, B_COL, ACC, TWO>(A, lda, B, ldb, A2, B2, Cm, ldc, by, after);
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
  // Tensor cores for every product of 16-bit inputs (float32 ones keep CUDA cores).
  static constexpr bool kTensor = kCopies;
  // bfloat16 inputs are their own operand tiles (V, dO).
  static constexpr bool kInputsAreOperands = std::is_same<T, Op>::value;
  static constexpr bool kGradientOnChip = gradient_on_chip<D>();
  static constexpr size_t align(size_t x) { return (x + 127) / 128 * 128; }
  static constexpr size_t tile_in = align(sizeof(T) * C * ld<D>());
  static constexpr size_t tile_op = align(sizeof(Op) * C * ld<D>());
  static constexpr size_t tile_f = align(sizeof(float) * C * ld<D>());
  static constexpr size_t state_f = align(sizeof(float) * D * ld<D>());
  static constexpr size_t state_op = align(sizeof(Op) * D * ld<D>());
  // The [C, C] matrices (the backward's four gradients too), e^g, dg and the tame flag; then
  // the bfloat16 halves of A_qk, A_ak (and the backward's A_qb).
  static constexpr int n_mat = BACKWARD ? 9 : 5;
  static constexpr int n_split = kTensor ? (BACKWARD ? 3 : 2) : 0;
  static constexpr size_t small_f = align(sizeof(float) * (n_mat * C * C + 2 * D) + 16);
  static constexpr size_t small = small_f + n_split * 2 * C * C * sizeof(__nv_bfloat16);
  // Inputs r, w, k, v, a, b (+ dO). Operands q~, a~, k^, b^, U (+ dX), then V (+ dO) unless
  // the inputs serve. Float32: U and four scratch tiles (+ dX and the cumulative log decays).
  static constexpr int n_in = BACKWARD ? 7 : 6;
  static constexpr int n_op_own = BACKWARD ? 6 : 5;
  static constexpr int n_op = n_op_own + (kInputsAreOperands ? 0 : BACKWARD ? 2 : 1);
  static constexpr int n_f = BACKWARD ? 7 : 5;
  // Forward: the state and its operand copy. Backward: the saved state's operand copy, the
  // state gradient's (when copies) and the state gradient itself when it stays on chip.
  static constexpr size_t states =
      BACKWARD ? (kCopies ? 2 * state_op : 0) + (kGradientOnChip ? state_f : 0)
               : state_f + (kCopies ? state_op : 0);
  static constexpr size_t bytes = n_in * tile_in + n_op * tile_op + n_f * tile_f + states + small;
  // The factored tiles of the backward's key-side step borrow k^ and b^ (free by then) as one
  // float32 tile.
  static_assert(!kTensor || 2 * tile_op == tile_f, "k^ and b^ make one float32 tile");
};

struct ChunkArgs {
  const void *r, *w, *k, *v, *a, *b, *d_o;
  const int* cu;
  const float* h_in;   // forward: initial state; backward: d(final state)
  float* h_out;        // forward: final state; backward: d(initial state)
  // [slots, H, D, D] of the operand type (checkpoint_slot); the forward's may be null (no
  // backward follows).
  void* ckpt;
  void* o;             // forward: o
  void *dr, *dw, *dk, *dv, *da, *db;
  int64_t H, total;
  float scale;
};

// Sixteen bytes (one vector load or store).
struct alignas(16) Vec16 {
  uint32_t x[4];
};
struct alignas(16) Floats4 {
  float x[4];
};

// The next chunk's inputs, loaded into registers while this chunk computes: each thread holds
// kCount vectors of 16 bytes (of N_IN [C, D] tiles in order).
template <int D, typename T, int N_IN> struct Prefetch {
  static constexpr int kPer = 16 / sizeof(T);
  static constexpr int kVecs = C * D / kPer;  // per tile
  static constexpr int kCount = (N_IN * kVecs + kThreads<D> - 1) / kThreads<D>;
  Vec16 v[kCount];

  __device__ static const T* source(const ChunkArgs& p, int q) {
    const void* s = q == 0 ? p.r : q == 1 ? p.w : q == 2 ? p.k : q == 3 ? p.v
                  : q == 4 ? p.a : q == 5 ? p.b : p.d_o;
    return static_cast<const T*>(s);
  }
  // Tokens [c0, c0 + len) of head hd; rows past len are zeros.
  __device__ void load(const ChunkArgs& p, int64_t c0, int len, int64_t hd) {
#pragma unroll
    for (int n = 0; n < kCount; ++n) {
      const int g = threadIdx.x + n * kThreads<D>, q = g / kVecs, e = (g % kVecs) * kPer;
      const int t = e / D, j = e % D;
      if (g < N_IN * kVecs && t < len)
        v[n] = *reinterpret_cast<const Vec16*>(source(p, q) + ((c0 + t) * p.H + hd) * D + j);
      else
        v[n] = Vec16{{0u, 0u, 0u, 0u}};
    }
  }
  template <typename Tile> __device__ void store(Tile tile) const {
#pragma unroll
    for (int n = 0; n < kCount; ++n) {
      const int g = threadIdx.x + n * kThreads<D>, q = g / kVecs, e = (g % kVecs) * kPer;
      if (g < N_IN * kVecs)
        *reinterpret_cast<Vec16*>(tile(q) + (e / D) * ld<D>() + e % D) = v[n];
    }
  }
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
  // q~, a~, k^, b^, U (, dX).
  __device__ Op* op(int q) const {
    return reinterpret_cast<Op*>(sm + Lay::n_in * Lay::tile_in + q * Lay::tile_op);
  }
  // V and dO as operands.
  __device__ Op* v_op() const {
    if constexpr (Lay::kInputsAreOperands) return in(3);
    else return op(Lay::n_op_own);
  }
  __device__ Op* do_op() const {
    if constexpr (Lay::kInputsAreOperands) return in(6);
    else return op(Lay::n_op_own + 1);
  }
  // k^ and b^ as one float32 tile (the backward's key-side step, once both are spent).
  __device__ float* spent_kb() const { return reinterpret_cast<float*>(op(2)); }
  // U, scratch 0..3 (, dX, gi).
  __device__ float* f(int q) const {
    return reinterpret_cast<float*>(sm + Lay::n_in * Lay::tile_in + Lay::n_op * Lay::tile_op +
                                    q * Lay::tile_f);
  }
  // A_qk, A_qb, A_ak, A_ab, (I - A_ab)^-1, dA_qk, dA_qb, dA_ak, dA_ab: [C, C].
  __device__ float* mat(int q) const {
    return reinterpret_cast<float*>(sm + Lay::n_in * Lay::tile_in + Lay::n_op * Lay::tile_op +
                                    Lay::n_f * Lay::tile_f) + q * C * C;
  }
  __device__ float* eg() const { return mat(Lay::n_mat); }      // e^g [D]
  __device__ float* dg() const { return mat(Lay::n_mat) + D; }  // [D]
  __device__ int* tame_flag() const { return reinterpret_cast<int*>(mat(Lay::n_mat) + 2 * D); }
  __device__ char* states() const {
    return sm + Lay::n_in * Lay::tile_in + Lay::n_op * Lay::tile_op + Lay::n_f * Lay::tile_f +
           Lay::small;
  }
  // The bfloat16 halves (hi + lo: 16 bits of mantissa together) of A_qk (0), A_ak (1), A_qb (2).
  __device__ __nv_bfloat16* hi(int q) const {
    return reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<char*>(mat(0)) + Lay::small_f) +
           2 * q * C * C;
  }
  __device__ __nv_bfloat16* lo(int q) const { return hi(q) + C * C; }
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

  // Prefetched inputs into their tiles.
  template <typename P> __device__ void store(const P& next) const {
    next.store([this](int q) { return in(q); });
  }

  // The cumulative log decays gi of each column: the forward's in the U tile (free until
  // values_u), the backward's in a tile of their own, read until the chunk's end.
  __device__ float* gi() const { return BACKWARD ? f(6) : f(0); }

  // The decays, the operand tiles q~, a~, k^, b^ (and V, dO unless the inputs serve), e^g and,
  // for a tame chunk, its factored tiles q, a, k, b (f(1..4)); then the caller's `extra` stores.
  // Ends synchronised.
  template <typename Extra> __device__ void operands(const Extra& extra) {
    const int j = threadIdx.x;
    // gi and e^g. Tame: every column's total >= -kTameSum (a NaN total makes the chunk exact).
    float* gi = this->gi();
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
    // The operands and, on the tame path, the factored tiles referenced to the middle
    // (F = e^(gi_t - m) e^(m - gi_i), E(t, i) = F(t - 1, i)); one element per thread.
    float *qm = f(1), *am = f(2), *km = f(3), *bm = f(4);
    for (int idx = j; idx < C * D; idx += kThreads<D>) {
      const int t = idx / D, x = idx % D, e = t * L + x;
      const float g_t = gi[e], ge = t ? gi[e - L] : 0.f;
      // g - gi_t: a difference within kTameSum in a tame chunk (precise); else summed from the
      // chunk's end, so that no large sums cancel.
      float to_end = 0.f;
      if (tame) to_end = gi[(C - 1) * L + x] - g_t;
      else for (int s = C - 1; s > t; --s) to_end += w_(s, x);
      const float f_end = expf(to_end);
      op(0)[e] = from_f<Op>(q_(t, x) * expf(g_t));
      op(1)[e] = from_f<Op>(a_(t, x) * expf(ge));
      op(2)[e] = from_f<Op>(k_(t, x) * f_end);
      op(3)[e] = from_f<Op>(b_(t, x) * f_end);
      if constexpr (!Lay::kInputsAreOperands) {
        v_op()[e] = from_f<Op>(v_(t, x));
        if constexpr (BACKWARD) do_op()[e] = from_f<Op>(to_f(in(6)[e]));
      }
      if (tame) {
        const float m = gi[kMiddle * L + x], col = expf(m - g_t);
        qm[e] = q_(t, x) * expf(g_t - m);
        am[e] = a_(t, x) * expf(ge - m);
        km[e] = k_(t, x) * col;
        bm[e] = b_(t, x) * col;
      }
    }
    extra();
    __syncthreads();
  }

  // Entry e of in-chunk matrix q (A_qk, A_qb, A_ak, A_ab) made ready for tensor cores: 0 past
  // its triangle (i <= t; i < t for A_ak) and the bfloat16 halves written. A_ab is read by the
  // inverse alone, below the diagonal.
  __device__ void finish_entry(int q, int e) const {
    if (q == 3) return;
    const int t = e / C, i = e % C, half = q == 0 ? 0 : q == 2 ? 1 : BACKWARD ? 2 : -1;
    const float v = (q == 2 ? i < t : i <= t) ? mat(q)[e] : 0.f;
    mat(q)[e] = v;
    if (half >= 0) {
      const __nv_bfloat16 h = __float2bfloat16(v);
      hi(half)[e] = h;
      const float rest = v - __bfloat162float(h);  // NaN where v is infinite: then 0
      lo(half)[e] = __float2bfloat16(rest == rest ? rest : 0.f);
    }
  }

  // A tame chunk's in-chunk matrix q (A_qk, A_qb, A_ak, A_ab) on the calling warp (q's own), a
  // product of its factored tiles on TF32 tensor cores, each entry then finished. Not
  // synchronised.
  __device__ void tame_matrix(int q) const {
    const float* rows = f(q < 2 ? 1 : 2);       // q or a
    const float* cols = f(q % 2 == 0 ? 3 : 4);  // k or b
    mma_tiles<C, C, D, false, true, false, false>(rows, L, cols, L, nullptr, nullptr, mat(q), C,
                                                  Warps{q, 1}, Finished{this, q});
  }

  // A_qk, A_qb (i <= t), A_ak, A_ab (i < t). A tame chunk's on tensor cores (tame_matrix, warps
  // 0..3); any other chunk's factors each from its own sum. With tensor cores, every entry is
  // then finished (finish_entry). Not synchronised.
  __device__ void in_chunk_matrices() {
    const bool tame = *tame_flag();
    if constexpr (Lay::kTensor) {
      if (tame) {
        const int warp = threadIdx.x / 32;
        if (warp < 4) tame_matrix(warp);
        return;
      }
    }
    float *qm = f(1), *am = f(2), *km = f(3), *bm = f(4);
    // Each pair (t, i) by two threads: the rows q (A_qk, A_qb) and the rows a (A_ak, A_ab).
    for (int idx = threadIdx.x; idx < 2 * kPairs; idx += kThreads<D>) {
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
        Aak(t, i) = sk;
        Aab(t, i) = sb;
      } else {
        Aqk(t, i) = sk;
        Aqb(t, i) = sb;
      }
    }
    if constexpr (Lay::kTensor) {
      __syncthreads();
      for (int idx = threadIdx.x; idx < 4 * C * C; idx += kThreads<D>)
        finish_entry(idx / (C * C), idx % (C * C));
    }
  }

  // After a warp stores its tile of in-chunk matrix q: finish_entry on each entry.
  struct Finished {
    const Block* blk;
    int q;
    __device__ void tile(int, int) const {
      __syncwarp();
      for (int e = threadIdx.x % 32; e < C * C; e += 32) blk->finish_entry(q, e);
    }
  };

  // (I - A_ab)^-1 by forward substitution on the calling warp: lane j < C keeps column j in
  // registers. Not synchronised.
  __device__ void inverse() const {
    const int j = threadIdx.x % 32;
    if (j >= C) return;
    float col[C];
#pragma unroll
    for (int t = 0; t < C; ++t) {
      float s = t == j ? 1.f : 0.f;
#pragma unroll
      for (int x = 0; x < t; ++x) s += Aab(t, x) * col[x];
      col[t] = t < j ? 0.f : s;  // 0 above the diagonal even where a row holds NaN or inf
      Tm(t, j) = col[t];
    }
  }

  // X = a~H + A_ak V in place of a~H in `x` [C, L] (float32 inputs; 16-bit ones take tensor
  // cores in the kernels). Not synchronised.
  __device__ void values_x(float* x) const {
    for (int idx = threadIdx.x; idx < C * D; idx += kThreads<D>) {
      const int t = idx / D, j = idx % D;
      float s = x[t * L + j];
      for (int i = 0; i < t; ++i) s += Aak(t, i) * v_(i, j);
      x[t * L + j] = s;
    }
  }

  // U = (I - A_ab)^-1 X into f(0) and op(4) (float32 inputs, as values_x). Not synchronised.
  __device__ void values_u(const float* x) const {
    for (int idx = threadIdx.x; idx < C * D; idx += kThreads<D>) {
      const int t = idx / D, j = idx % D;
      float s = 0.f;
      for (int i = 0; i <= t; ++i) s += Tm(t, i) * x[i * L + j];
      f(0)[t * L + j] = s;
      op(4)[t * L + j] = from_f<Op>(s);
    }
  }
};

// A lane's eight entries of a warp's [16, 16] tile: row lane / 2, columns (lane % 2) * 8 on, moved
// 16 bytes at a time.
struct TileRow {
  Floats4 x[2];
  __device__ static int row() { return threadIdx.x % 32 / 2; }
  __device__ static int col() { return threadIdx.x % 2 * 8; }
  __device__ float& operator[](int e) { return x[e / 4].x[e % 4]; }
  __device__ float operator[](int e) const { return x[e / 4].x[e % 4]; }
  __device__ void load(const float* tile, int ld) {
    const float* p = tile + row() * ld + col();
    x[0] = *reinterpret_cast<const Floats4*>(p);
    x[1] = *reinterpret_cast<const Floats4*>(p + 4);
  }
  __device__ void store(float* tile, int ld) const {
    float* p = tile + row() * ld + col();
    *reinterpret_cast<Floats4*>(p) = x[0];
    *reinterpret_cast<Floats4*>(p + 4) = x[1];
  }
  // As 16-bit operands.
  template <typename Op> __device__ void store_op(Op* tile, int ld) const {
    static_assert(sizeof(Op) == 2, "16-bit operands");
    Vec16 v;
    Op* e = reinterpret_cast<Op*>(&v);
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = from_f<Op>((*this)[k]);
    *reinterpret_cast<Vec16*>(tile + row() * ld + col()) = v;
  }
};

// A warp's [16, 16] float32 tile at src (row stride lds) as 16-bit operands at dst (row stride
// ldd).
template <typename Op>
__device__ void copy_tile(const float* src, int lds, Op* dst, int ldd) {
  __syncwarp();
  TileRow t;
  t.load(src, lds);
  t.store_op(dst, ldd);
}

// Rows t < len of a warp's [16, 16] tile (columns n0..) of a float32 [C, L] tile, to tokens
// [c0, c0 + len) of head hd of out [tokens, H, D] (16-bit: two lanes per row, 16 bytes each).
template <int D, typename T>
__device__ void store_tile_rows(const float* tile, int n0, int len, T* out, int64_t c0,
                                int64_t H, int64_t hd) {
  static_assert(sizeof(T) == 2, "16-bit outputs");
  __syncwarp();
  const int t = TileRow::row(), col = n0 + TileRow::col();
  if (t < len) {
    Vec16 v;
    T* e = reinterpret_cast<T*>(&v);
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = from_f<T>(tile[t * ld<D>() + col + k]);
    *reinterpret_cast<Vec16*>(out + ((c0 + t) * H + hd) * D + col) = v;
  }
}

// Chunk ci's slot of the state saved at each chunk's start, in the operand type: bfloat16 for
// 16-bit inputs (the backward reads it as its products' operand and in dg's row sums), float32
// for float32 inputs.
template <typename Op, int D>
__device__ Op* checkpoint_slot(const ChunkArgs& p, int64_t n, int64_t seq_start, int64_t ci,
                               int64_t hd) {
  return static_cast<Op*>(p.ckpt) + ((first_slot(n, seq_start) + ci) * p.H + hd) * D * D;
}

// Once an element of a float32 state [D, ld] is final (float32 inputs): its float32 checkpoint
// slot [D, D] (if any).
template <int D> struct Checkpoint {
  float* slot;
  __device__ void element(int m, int n, float h) const {
    if (slot) slot[m * D + n] = h;
  }
};

}  // namespace
}  // namespace rwkv_ffi

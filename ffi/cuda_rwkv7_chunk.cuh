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
constexpr int kWarps = kThreads / 32;
constexpr int kPairs = C * (C + 1) / 2;  // (t, i) with i <= t

// Whether the backward's state gradient stays in shared memory (else in its dh0 slot).
template <int D> constexpr bool gradient_on_chip() { return D <= 64; }

// Row strides (elements) of the [C, D] tiles and of an on-chip [D, D] state: padded by 8 so that
// wmma tiles stay 32-byte aligned and rows fall on different banks.
template <int D> __host__ __device__ constexpr int ld() { return D + 8; }

// The tensor-core operand type: bfloat16 for 16-bit inputs, float for float32 inputs.
template <typename T> struct OperandOf { using type = __nv_bfloat16; };
template <> struct OperandOf<float> { using type = float; };

template <typename Op> __device__ __forceinline__ Op to_op(float x);
template <> __device__ __forceinline__ float to_op<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 to_op<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// Which warps share a product: warps [first, first + count) of the block.
struct Warps {
  int first, count;
};
constexpr Warps kAllWarps{0, kWarps};

// T where a template argument is not to be deduced from (a null pointer, say).
template <typename T> struct SameAs { using type = T; };
template <typename T> using Same = typename SameAs<T>::type;

// wmma operand loads from shared memory. nvcc emits the generic-address form of wmma.load for
// the A and B operands even from a shared array (a load that waits like a global one); these
// name the shared state space. The host emulation has only the generic ones.
#ifdef RWKV_JAX_CUDA_EMULATION
template <typename Frag, typename P>
__device__ __forceinline__ void load_shared(Frag& f, const P* p, unsigned ld) {
  nvcuda::wmma::load_matrix_sync(f, p, ld);
}
#else
#define RWKV_SHARED_LOAD(USE, LAYOUT, K, TYPE, PTX)                                            \
  __device__ __forceinline__ void load_shared(                                               \
      nvcuda::wmma::fragment<nvcuda::wmma::USE, 16, 16, K, TYPE, nvcuda::wmma::LAYOUT>& f,   \
      const void* p, unsigned ld) {                                                          \
    uint32_t* r = reinterpret_cast<uint32_t*>(&f.x[0]);                                      \
    asm volatile(PTX " {%0, %1, %2, %3}, [%4], %5;"                                          \
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                            \
                 : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(ld)                       \
                 : "memory");                                                                \
  }
RWKV_SHARED_LOAD(matrix_a, row_major, 16, __nv_bfloat16, "wmma.load.a.sync.aligned.row.m16n16k16.shared.bf16")
RWKV_SHARED_LOAD(matrix_a, col_major, 16, __nv_bfloat16, "wmma.load.a.sync.aligned.col.m16n16k16.shared.bf16")
RWKV_SHARED_LOAD(matrix_b, row_major, 16, __nv_bfloat16, "wmma.load.b.sync.aligned.row.m16n16k16.shared.bf16")
RWKV_SHARED_LOAD(matrix_b, col_major, 16, __nv_bfloat16, "wmma.load.b.sync.aligned.col.m16n16k16.shared.bf16")
RWKV_SHARED_LOAD(matrix_a, row_major, 8, nvcuda::wmma::precision::tf32, "wmma.load.a.sync.aligned.row.m16n16k8.shared.tf32")
RWKV_SHARED_LOAD(matrix_a, col_major, 8, nvcuda::wmma::precision::tf32, "wmma.load.a.sync.aligned.col.m16n16k8.shared.tf32")
RWKV_SHARED_LOAD(matrix_b, row_major, 8, nvcuda::wmma::precision::tf32, "wmma.load.b.sync.aligned.row.m16n16k8.shared.tf32")
RWKV_SHARED_LOAD(matrix_b, col_major, 8, nvcuda::wmma::precision::tf32, "wmma.load.b.sync.aligned.col.m16n16k8.shared.tf32")
#undef RWKV_SHARED_LOAD
#endif

// Runs body(m0, n0) for each 16 x 16 tile of an [M, N] result, one tile per warp of `by` at a
// time (each tile the warp's alone).
template <int M, int N, typename Body> __device__ void for_tiles(Warps by, const Body& body) {
  const int warp = threadIdx.x / 32 - by.first;
  if (warp < 0 || warp >= by.count) return;
  for (int tile = warp; tile < (M / 16) * (N / 16); tile += by.count)
    body((tile / (N / 16)) * 16, (tile % (N / 16)) * 16);
}

// One warp's 16 x 16 tile of float32 sums of products on tensor cores: bfloat16 operands
// (Elem = __nv_bfloat16, steps of 16), or TF32 ones read from float32 tiles (Elem = float, steps
// of 8). Operands live in shared memory.
template <typename Elem> struct Tile {
  static constexpr bool kTf32 = std::is_same<Elem, float>::value;
  static constexpr int KS = kTf32 ? 8 : 16;
  using Frag = typename std::conditional<kTf32, nvcuda::wmma::precision::tf32, Elem>::type;
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, KS, float> acc;

  __device__ void zero() { nvcuda::wmma::fill_fragment(acc, 0.f); }
  __device__ void load(const float* c, int ldc) {
    nvcuda::wmma::load_matrix_sync(acc, c, ldc, nvcuda::wmma::mem_row_major);
  }
  __device__ void store(float* c, int ldc) const {
    nvcuda::wmma::store_matrix_sync(c, acc, ldc, nvcuda::wmma::mem_row_major);
  }
  // += rows [m0, m0 + 16) of A [M, KD] times columns [n0, n0 + 16) of B [KD, N]; A_COL: A's
  // element (m, k) at A[k * lda + m], else A[m * lda + k]; B_COL: B's (k, n) at B[n * ldb + k],
  // else B[k * ldb + n].
  template <int KD, bool A_COL, bool B_COL>
  __device__ void add(const Elem* A, int lda, const Elem* B, int ldb, int m0, int n0) {
    using namespace nvcuda;
    using ALayout = typename std::conditional<A_COL, wmma::col_major, wmma::row_major>::type;
    using BLayout = typename std::conditional<B_COL, wmma::col_major, wmma::row_major>::type;
#pragma unroll
    for (int k0 = 0; k0 < KD; k0 += KS) {
      wmma::fragment<wmma::matrix_a, 16, 16, KS, Frag, ALayout> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, KS, Frag, BLayout> fb;
      load_shared(fa, A_COL ? A + k0 * lda + m0 : A + m0 * lda + k0, lda);
      load_shared(fb, B_COL ? B + n0 * ldb + k0 : B + k0 * ldb + n0, ldb);
      if constexpr (kTf32) {
        for (int e = 0; e < fa.num_elements; ++e) fa.x[e] = wmma::__float_to_tf32(fa.x[e]);
        for (int e = 0; e < fb.num_elements; ++e) fb.x[e] = wmma::__float_to_tf32(fb.x[e]);
      }
      wmma::mma_sync(acc, fa, fb, acc);
    }
  }
};

// C (+)= A B (+ A2 B2 when TWO), C [M, N] float32 row-major, on tensor cores (Tile), one tile
// per warp of `by` at a time; after.tile(m0, n0) once the warp has stored it.
template <int M, int N, int KD, bool A_COL, bool B_COL, bool ACC, bool TWO, typename Elem,
          typename After>
__device__ void mma_tiles(const Elem* A, int lda, const Elem* B, int ldb, const Same<Elem>* A2,
                          const Same<Elem>* B2, float* Cm, int ldc, Warps by, const After& after) {
  for_tiles<M, N>(by, [&](int m0, int n0) {
    Tile<Elem> t;
    if (ACC) t.load(Cm + m0 * ldc + n0, ldc);
    else t.zero();
    t.template add<KD, A_COL, B_COL>(A, lda, B, ldb, m0, n0);
    if (TWO) t.template add<KD, A_COL, B_COL>(A2, lda, B2, ldb, m0, n0);
    t.store(Cm + m0 * ldc + n0, ldc);
    after.tile(m0, n0);
  });
}

// The same product in float32 on CUDA cores (float32 inputs: their contract), one element of C
// per thread of `by` at a time, after.element(m, n, value) once it is stored.
template <int M, int N, int KD, bool A_COL, bool B_COL, bool ACC, bool TWO, typename After>
__device__ void fma_elements(const float* A, int lda, const float* B, int ldb, const float* A2,
                             const float* B2, float* Cm, int ldc, Warps by, const After& after) {
  const int me = threadIdx.x - by.first * 32;
  if (me < 0 || me >= by.count * 32) return;
  for (int idx = me; idx < M * N; idx += by.count * 32) {
    const int m = idx / N, n = idx % N;
    float acc = ACC ? Cm[m * ldc + n] : 0.f;
    for (int term = 0; term < (TWO ? 2 : 1); ++term) {
      const float *a = term ? A2 : A, *b = term ? B2 : B;
#pragma unroll 8
      for (int k = 0; k < KD; ++k)
        acc += (A_COL ? a[k * lda + m] : a[m * lda + k]) * (B_COL ? b[n * ldb + k] : b[k * ldb + n]);
    }
    Cm[m * ldc + n] = acc;
    after.element(m, n, acc);
  }
}

struct NoEpilogue {
  __device__ void tile(int, int) const {}
  __device__ void element(int, int, float) const {}
};

// The products with the state: tensor cores for bfloat16 operands, CUDA cores for float32 ones.
template <int M, int N, int KD, bool A_COL, bool B_COL, bool ACC, bool TWO = false,
          typename Op, typename After = NoEpilogue>
__device__ void gemm(const Op* A, int lda, const Op* B, int ldb, float* Cm, int ldc,
                     Warps by = kAllWarps, const Same<Op>* A2 = nullptr, const Same<Op>* B2 = nullptr,
                     const After& after = {}) {
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
  // the inputs serve. Float32: U and four scratch tiles (+ dX).
  static constexpr int n_in = BACKWARD ? 7 : 6;
  static constexpr int n_op_own = BACKWARD ? 6 : 5;
  static constexpr int n_op = n_op_own + (kInputsAreOperands ? 0 : BACKWARD ? 2 : 1);
  static constexpr int n_f = BACKWARD ? 6 : 5;
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
  float* ckpt;         // [slots, H, D, D]; the forward's may be null (no backward follows)
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
  static constexpr int kCount = (N_IN * kVecs + kThreads - 1) / kThreads;
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
      const int g = threadIdx.x + n * kThreads, q = g / kVecs, e = (g % kVecs) * kPer;
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
      const int g = threadIdx.x + n * kThreads, q = g / kVecs, e = (g % kVecs) * kPer;
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

  // The decays, the operand tiles q~, a~, k^, b^ (and V, dO unless the inputs serve), e^g and,
  // for a tame chunk, its factored tiles q, a, k, b (f(1..4)). Ends synchronised.
  __device__ void operands() {
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
    // The operands and, on the tame path, the factored tiles referenced to the middle
    // (F = e^(gi_t - m) e^(m - gi_i), E(t, i) = F(t - 1, i)); one element per thread.
    float *qm = f(1), *am = f(2), *km = f(3), *bm = f(4);
    for (int idx = j; idx < C * D; idx += kThreads) {
      const int t = idx / D, x = idx % D, e = t * L + x;
      const float g_t = gi[e], ge = t ? gi[e - L] : 0.f;
      // g - gi_t: a difference within kTameSum in a tame chunk (precise); else summed from the
      // chunk's end, so that no large sums cancel.
      float to_end = 0.f;
      if (tame) to_end = gi[(C - 1) * L + x] - g_t;
      else for (int s = C - 1; s > t; --s) to_end += w_(s, x);
      const float f_end = expf(to_end);
      op(0)[e] = to_op<Op>(q_(t, x) * expf(g_t));
      op(1)[e] = to_op<Op>(a_(t, x) * expf(ge));
      op(2)[e] = to_op<Op>(k_(t, x) * f_end);
      op(3)[e] = to_op<Op>(b_(t, x) * f_end);
      if constexpr (!Lay::kInputsAreOperands) {
        v_op()[e] = to_op<Op>(v_(t, x));
        if constexpr (BACKWARD) do_op()[e] = to_op<Op>(to_f(in(6)[e]));
      }
      if (tame) {
        const float m = gi[kMiddle * L + x], col = expf(m - g_t);
        qm[e] = q_(t, x) * expf(g_t - m);
        am[e] = a_(t, x) * expf(ge - m);
        km[e] = k_(t, x) * col;
        bm[e] = b_(t, x) * col;
      }
    }
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

  // A_qk, A_qb (i <= t), A_ak, A_ab (i < t). A tame chunk's are products of its factored tiles
  // (TF32 tensor cores, warps 0..3); any other chunk's factors each from its own sum. With
  // tensor cores, every entry is then finished (finish_entry). Not synchronised.
  __device__ void in_chunk_matrices() {
    const bool tame = *tame_flag();
    if constexpr (Lay::kTensor) {
      if (tame) {
        const int warp = threadIdx.x / 32;
        if (warp < 4) {
          const float* rows = f(warp < 2 ? 1 : 2);         // q or a
          const float* cols = f(warp % 2 == 0 ? 3 : 4);    // k or b
          mma_tiles<C, C, D, false, true, false, false>(rows, L, cols, L, nullptr, nullptr,
                                                        mat(warp), C, Warps{warp, 1},
                                                        Finished{this, warp});
        }
        return;
      }
    }
    float *qm = f(1), *am = f(2), *km = f(3), *bm = f(4);
    // Each pair (t, i) by two threads: the rows q (A_qk, A_qb) and the rows a (A_ak, A_ab).
    for (int idx = threadIdx.x; idx < 2 * kPairs; idx += kThreads) {
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
      for (int idx = threadIdx.x; idx < 4 * C * C; idx += kThreads) finish_entry(idx / (C * C), idx % (C * C));
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
      col[t] = t < j ? 0.f : s;  // a select: no 0 * (an entry above the diagonal)
      Tm(t, j) = col[t];
    }
  }

  // X = a~H + A_ak V in place of a~H in `x` [C, L]. Not synchronised.
  __device__ void values_x(float* x) const {
    for (int idx = threadIdx.x; idx < C * D; idx += kThreads) {
      const int t = idx / D, j = idx % D;
      float s = x[t * L + j];
      for (int i = 0; i < t; ++i) s += Aak(t, i) * v_(i, j);
      x[t * L + j] = s;
    }
  }

  // U = (I - A_ab)^-1 X into f(0) and op(4). Not synchronised.
  __device__ void values_u(const float* x) const {
    for (int idx = threadIdx.x; idx < C * D; idx += kThreads) {
      const int t = idx / D, j = idx % D;
      float s = 0.f;
      for (int i = 0; i <= t; ++i) s += Tm(t, i) * x[i * L + j];
      f(0)[t * L + j] = s;
      op(4)[t * L + j] = to_op<Op>(s);
    }
  }
};

// A warp's [16, 16] tile (columns n0..) of a float32 [C, L] tile, as operands into `dst`.
template <int D, typename Op> __device__ void copy_tile(const float* src, Op* dst, int n0) {
  __syncwarp();
  for (int e = threadIdx.x % 32; e < 256; e += 32) {
    const int at = (e / 16) * ld<D>() + n0 + e % 16;
    dst[at] = to_op<Op>(src[at]);
  }
}

// Rows t < len of a warp's [16, 16] tile (columns n0..) of a float32 [C, L] tile, to tokens
// [c0, c0 + len) of head hd of out [tokens, H, D] (16-bit: two lanes per row, 16 bytes each).
template <int D, typename T>
__device__ void store_tile_rows(const float* tile, int n0, int len, T* out, int64_t c0,
                                int64_t H, int64_t hd) {
  static_assert(sizeof(T) == 2, "16-bit outputs");
  __syncwarp();
  const int lane = threadIdx.x % 32, t = lane / 2, col = n0 + (lane % 2) * 8;
  if (t < len) {
    Vec16 v;
    T* e = reinterpret_cast<T*>(&v);
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = from_f<T>(tile[t * ld<D>() + col + k]);
    *reinterpret_cast<Vec16*>(out + ((c0 + t) * H + hd) * D + col) = v;
  }
}

// Once a tile (or element) of a float32 state [D, ld] is final: its operand copy (if any) and
// its float32 checkpoint slot [D, D] (if any).
template <int D, typename Op> struct StateCopies {
  const float* state;
  int ld_state;
  Op* copy;
  float* slot;
  __device__ void element(int m, int n, float h) const {
    if (copy) copy[m * ld<D>() + n] = to_op<Op>(h);
    if (slot) slot[m * D + n] = h;
  }
  __device__ void tile(int m0, int n0) const {
    __syncwarp();
    for (int e = threadIdx.x % 32; e < 256; e += 32) {
      const int m = m0 + e / 16, n = n0 + e % 16;
      element(m, n, state[m * ld_state + n]);
    }
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
  float *u = blk.f(0), *qh = blk.f(1), *x = blk.f(2);

  const int64_t hd = blockIdx.x, n = blockIdx.y;
  const Range seq = sequence(p.cu, n, 0, p.total);
  const int64_t base = (n * p.H + hd) * D * D;
  const int64_t n_chunks = (seq.end - seq.start + C - 1) / C;
  auto slot_of = [&](int64_t ci) {
    return p.ckpt + ((first_slot(n, seq.start) + ci) * p.H + hd) * D * D;
  };
  for (int idx = threadIdx.x; idx < D * D; idx += kThreads) {
    const float h = p.h_in[base + idx];
    S[(idx / D) * L + idx % D] = h;
    if constexpr (Lay::kCopies) S_op[(idx / D) * L + idx % D] = to_op<Op>(h);
    if (p.ckpt && n_chunks > 0) slot_of(0)[idx] = h;
  }
  Prefetch<D, T, 6> next;
  if (n_chunks > 0) next.load(p, seq.start, (int)lmin(C, seq.end - seq.start), hd);
  for (int64_t ci = 0; ci < n_chunks; ++ci) {
    const int64_t c0 = seq.start + ci * C;
    const int len = (int)lmin(C, seq.end - c0);
    __syncthreads();
    blk.store(next);
    if (ci + 1 < n_chunks) next.load(p, c0 + C, (int)lmin(C, seq.end - c0 - C), hd);
    __syncthreads();
    blk.operands();
    blk.in_chunk_matrices();
    __syncthreads();
    T* o = static_cast<T*>(p.o);
    if (threadIdx.x < 32) {
      blk.inverse();
    } else if constexpr (Lay::kTensor) {
      // q~H + A_qk V into qh and X = a~H + A_ak V into x: [2C, D] tiles on the other warps.
      for_tiles<2 * C, D>(Warps{1, kWarps - 1}, [&](int m0, int n0) {
        const int which = m0 / C;  // 0: the rows q, 1: the rows a
        Tile<Op> acc;
        acc.zero();
        acc.template add<D, false, false>(blk.op(which), L, S_op, L, 0, n0);
        acc.template add<C, false, false>(blk.hi(which), C, blk.v_op(), L, 0, n0);
        acc.template add<C, false, false>(blk.lo(which), C, blk.v_op(), L, 0, n0);
        acc.store((which ? x : qh) + n0, L);
      });
    } else {  // q~H, a~H on the other warps
      gemm<C, D, D, false, false, false>(blk.op(0), L, S_op, L, qh, L, Warps{1, kWarps - 1});
      gemm<C, D, D, false, false, false>(blk.op(1), L, S_op, L, x, L, Warps{1, kWarps - 1});
    }
    __syncthreads();
    // U = (I - A_ab)^-1 X into u and its operand copy.
    if constexpr (Lay::kTensor) {
      for_tiles<C, D>(kAllWarps, [&](int, int n0) {
        Tile<float> acc;
        acc.zero();
        acc.template add<C, false, false>(blk.mat(4), C, x, L, 0, n0);
        acc.store(u + n0, L);
        copy_tile<D>(u, blk.op(4), n0);
      });
    } else {
      blk.values_x(x);
      __syncthreads();
      blk.values_u(x);
    }
    __syncthreads();
    // O = q~H + A_qk V + A_qb U; H *= e^g
    if constexpr (Lay::kTensor) {
      for_tiles<C, D>(kAllWarps, [&](int, int n0) {
        Tile<float> acc;
        acc.load(qh + n0, L);
        acc.template add<C, false, false>(blk.mat(1), C, u, L, 0, n0);
        acc.store(qh + n0, L);
        store_tile_rows<D>(qh, n0, len, o, c0, p.H, hd);
      });
    } else {
      for (int idx = threadIdx.x; idx < len * D; idx += kThreads) {
        const int t = idx / D, j = idx % D;
        float s = qh[t * L + j];
        for (int i = 0; i <= t; ++i) s += blk.Aqk(t, i) * blk.v_(i, j) + blk.Aqb(t, i) * u[i * L + j];
        o[((c0 + t) * p.H + hd) * D + j] = from_f<T>(s);
      }
    }
    for (int idx = threadIdx.x; idx < D * D; idx += kThreads) S[(idx / D) * L + idx % D] *= blk.eg()[idx / D];
    __syncthreads();
    // H' = e^g H + k^^T V + b^^T U, and its operand copy and checkpoint as each tile is done.
    float* slot = p.ckpt && ci + 1 < n_chunks ? slot_of(ci + 1) : nullptr;
    gemm<D, D, C, true, false, true, true>(blk.op(2), L, blk.v_op(), L, S, L, kAllWarps, blk.op(3),
                                     blk.op(4), StateCopies<D, Op>{S, L, Lay::kCopies ? S_op : nullptr, slot});
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < D * D; idx += kThreads) p.h_out[base + idx] = S[(idx / D) * L + idx % D];
}

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
     *dxb = blk.op(5), *vb = blk.v_op(), *dob = blk.do_op();
  T *gr = static_cast<T*>(p.dr), *gw = static_cast<T*>(p.dw), *gk = static_cast<T*>(p.dk),
    *gv = static_cast<T*>(p.dv), *ga = static_cast<T*>(p.da), *gb = static_cast<T*>(p.db);
  const int j = threadIdx.x, warp = threadIdx.x / 32;

  for (int idx = j; idx < D * D; idx += kThreads) {
    const float g = p.h_in[base + idx];
    G[(idx / D) * ldG + idx % D] = g;
    if constexpr (Lay::kCopies) G_op_copy[(idx / D) * L + idx % D] = to_op<Op>(g);
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
    const float* Hs = p.ckpt + ((first_slot(n, seq.start) + ci) * p.H + hd) * D * D;
    const Op *H_op, *G_op;
    int ldH, ldG_op;
    __syncthreads();
    blk.store(next);
    if (ci > 0) next.load(p, c0 - C, C, hd);
    if constexpr (Lay::kCopies) {
      for (int idx = j * 4; idx < D * D; idx += kThreads * 4) {
        const Floats4 h = *reinterpret_cast<const Floats4*>(Hs + idx);
        Op* row = H_op_copy + (idx / D) * L + idx % D;
#pragma unroll
        for (int e = 0; e < 4; ++e) row[e] = to_op<Op>(h.x[e]);
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
    __syncthreads();
    blk.operands();
    const bool tame = *blk.tame_flag();
    blk.in_chunk_matrices();
    __syncthreads();
    if (warp == 0) {
      blk.inverse();
    } else if constexpr (Lay::kTensor) {
      // X = a~H + A_ak V (s0), k^ dH' (s1), dU = b^ dH' + A_qb^T dO (s2): [3C, D] tiles.
      for_tiles<3 * C, D>(Warps{1, kWarps - 1}, [&](int m0, int n0) {
        const int which = m0 / C;
        Tile<Op> acc;
        acc.zero();
        if (which == 0) {
          acc.template add<D, false, false>(at, L, H_op, ldH, 0, n0);
          acc.template add<C, false, false>(blk.hi(1), C, vb, L, 0, n0);
          acc.template add<C, false, false>(blk.lo(1), C, vb, L, 0, n0);
        } else {
          acc.template add<D, false, false>(which == 1 ? kh : bh, L, G_op, ldG_op, 0, n0);
          if (which == 2) {
            acc.template add<C, true, false>(blk.hi(2), C, dob, L, 0, n0);
            acc.template add<C, true, false>(blk.lo(2), C, dob, L, 0, n0);
          }
        }
        acc.store((which == 0 ? s0 : which == 1 ? s1 : s2) + n0, L);
      });
    } else {  // a~H, k^ dH', b^ dH' on the other warps
      constexpr Warps others{1, kWarps - 1};
      gemm<C, D, D, false, false, false>(at, L, H_op, ldH, s0, L, others);
      gemm<C, D, D, false, false, false>(kh, L, G_op, ldG_op, s1, L, others);
      gemm<C, D, D, false, false, false>(bh, L, G_op, ldG_op, s2, L, others);
    }
    __syncthreads();
    if constexpr (Lay::kTensor) {
      // U = (I - A_ab)^-1 X into u and ub, dX = (I - A_ab)^-T dU into dx and dxb (TF32).
      for_tiles<2 * C, D>(kAllWarps, [&](int m0, int n0) {
        Tile<float> acc;
        acc.zero();
        if (m0 == 0) {
          acc.template add<C, false, false>(blk.mat(4), C, s0, L, 0, n0);
          acc.store(u + n0, L);
          copy_tile<D>(u, ub, n0);
        } else {
          acc.template add<C, true, false>(blk.mat(4), C, s2, L, 0, n0);
          acc.store(dx + n0, L);
          copy_tile<D>(dx, dxb, n0);
        }
      });
    } else {
      // X = a~H + A_ak V; dU = A_qb^T dO + b^ dH' (in place of b^ dH'); one element per thread.
      blk.values_x(s0);
      for (int idx = j; idx < C * D; idx += kThreads) {
        const int i = idx / D, column = idx % D;
        float s = s2[i * L + column];
        for (int t = i; t < C; ++t) s += blk.Aqb(t, i) * to_f(blk.in(6)[t * L + column]);
        s2[i * L + column] = s;
      }
      __syncthreads();
      // U = (I - A_ab)^-1 X, dX = (I - A_ab)^-T dU.
      blk.values_u(s0);
      for (int idx = j; idx < C * D; idx += kThreads) {
        const int i = idx / D, column = idx % D;
        float s = 0.f;
        for (int t = i; t < C; ++t) s += blk.Tm(t, i) * s2[t * L + column];
        dx[i * L + column] = s;
        dxb[i * L + column] = to_op<Op>(s);
      }
    }
    __syncthreads();
    // dV = A_qk^T dO + A_ak^T dX + k^ dH', and the gradients of the in-chunk matrices:
    // dA_qk = dO V^T, dA_qb = dO U^T, dA_ak = dX V^T, dA_ab = dX U^T (lower parts).
    if constexpr (Lay::kTensor) {
      if (warp < 4) {
        mma_tiles<C, C, D, false, true, false, false>(warp < 2 ? dob : dxb, L, warp % 2 ? ub : vb, L,
                                                      nullptr, nullptr, blk.mat(5 + warp), C,
                                                      Warps{warp, 1}, LowerOnly{blk.mat(5 + warp), warp >= 2});
      } else {
        for_tiles<C, D>(Warps{4, kWarps - 4}, [&](int, int n0) {
          Tile<Op> in_bf16;
          in_bf16.load(s1 + n0, L);
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
      for (int idx = j; idx < len * D; idx += kThreads) {
        const int i = idx / D, column = idx % D;
        float s = s1[i * L + column];
        for (int t = i; t < C; ++t) {
          s += blk.Aqk(t, i) * to_f(blk.in(6)[t * L + column]);
          if (t > i) s += blk.Aak(t, i) * dx[t * L + column];
        }
        gv[((c0 + i) * p.H + hd) * D + column] = from_f<T>(s);
      }
      // Each pair (t, i) by two threads: rows dO (dA_qk, dA_qb), rows dX (dA_ak, dA_ab).
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
    }
    __syncthreads();
    // Against the state: dq~ = dO H^T, da~ = dX H^T, dk^ = V dH'^T, db^ = U dH'^T.
    gemm<C, D, D, false, true, false>(dob, L, H_op, ldH, s0, L);
    gemm<C, D, D, false, true, false>(dxb, L, H_op, ldH, s1, L);
    gemm<C, D, D, false, true, false>(vb, L, G_op, ldG_op, s2, L);
    gemm<C, D, D, false, true, false>(ub, L, G_op, ldG_op, s3, L);
    // e^g rowsum(H * dH'): a warp per row.
    for (int row = warp; row < D; row += kWarps) {
      float s = 0.f;
      for (int x = j % 32; x < D; x += 32) s += Hs[row * D + x] * G[row * ldG + x];
#pragma unroll
      for (int off = 16; off; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (j % 32 == 0) blk.dg()[row] = blk.eg()[row] * s;
    }
    __syncthreads();
    // The terms against the state through their factors, column by column (dq~ e^gi,
    // da~ e^ge, dk^ e^(g - gi), db^ e^(g - gi) in place in s0..s3; gi into the dX tile, free
    // now; dg); meanwhile dH' *= e^g on every thread (dH = e^g dH' + ... below).
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
    for (int idx = j; idx < D * D; idx += kThreads) G[(idx / D) * ldG + idx % D] *= blk.eg()[idx / D];
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
        for (int idx = j; idx < C * D; idx += kThreads) {
          const int t = idx / D, x = idx % D, e = t * L + x;
          const float m = dx[kMiddle * L + x], gi = dx[e], ge = t ? dx[e - L] : 0.f;
          const float col = expf(m - gi);
          k_f[e] = blk.k_(t, x) * col;
          b_f[e] = blk.b_(t, x) * col;
          s0[e] *= col;
          s1[e] *= expf(m - ge);
        }
        __syncthreads();
        mma_tiles<C, D, C, false, false, true, true>(blk.mat(5), C, k_f, L, blk.mat(6), b_f, s0, L,
                                               Warps{0, kWarps / 2}, NoEpilogue{});
        mma_tiles<C, D, C, false, false, true, true>(blk.mat(7), C, k_f, L, blk.mat(8), b_f, s1, L,
                                               Warps{kWarps / 2, kWarps / 2}, NoEpilogue{});
        __syncthreads();
        float *q_f = k_f, *a_f = b_f;
        for (int idx = j; idx < C * D; idx += kThreads) {
          const int t = idx / D, x = idx % D, e = t * L + x;
          const float m = dx[kMiddle * L + x], gi = dx[e], ge = t ? dx[e - L] : 0.f;
          const float row = expf(gi - m), row_e = expf(ge - m);
          s0[e] *= row;
          s1[e] *= row_e;
          q_f[e] = blk.q_(t, x) * row;
          a_f[e] = blk.a_(t, x) * row_e;
          s2[e] *= row;
          s3[e] *= row;
        }
        __syncthreads();
        mma_tiles<C, D, C, true, false, true, true>(blk.mat(5), C, q_f, L, blk.mat(7), a_f, s2, L,
                                              Warps{0, kWarps / 2}, NoEpilogue{});
        mma_tiles<C, D, C, true, false, true, true>(blk.mat(6), C, q_f, L, blk.mat(8), a_f, s3, L,
                                              Warps{kWarps / 2, kWarps / 2}, NoEpilogue{});
        __syncthreads();
      }
    }
    if (!factored) {
      // kParts threads per column share its pairs (t, i) by i; then the parts' sums of dq
      // and da, one part after another (the same order every run).
      constexpr int kParts = kThreads / D;
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
      const float dg = blk.dg()[j], m = dx[kMiddle * L + j];
      float acc = 0.f;
#pragma unroll
      for (int t = C - 1; t >= 0; --t) {
        const float back = factored ? expf(m - dx[t * L + j]) : 1.f;
        const float g_q = s0[t * L + j], g_a = s1[t * L + j];
        const float g_k = s2[t * L + j] * back, g_b = s3[t * L + j] * back;
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
    // dH = e^g dH' + q~^T dO + a~^T dX, and its operand copy as each tile is done.
    gemm<D, D, C, true, false, true, true>(qt, L, dob, L, G, ldG, kAllWarps, at, dxb,
                                     StateCopies<D, Op>{G, ldG, Lay::kCopies ? G_op_copy : nullptr,
                                                        nullptr});
  }
  __syncthreads();
  if constexpr (Lay::kGradientOnChip)
    for (int idx = j; idx < D * D; idx += kThreads) p.h_out[base + idx] = G[(idx / D) * ldG + idx % D];
}

}  // namespace
}  // namespace rwkv_ffi

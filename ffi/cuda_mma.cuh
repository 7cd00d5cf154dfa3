// Products on tensor cores for the chunked kernels (cuda_rwkv7_chunk*.cuh): a warp's 16 x 16 tile
// of float32 sums over bfloat16 or TF32 operands in shared memory, the loop that hands tiles to
// warps, and the same products in float32 on CUDA cores. A header of its own so that
// tests/cuda_emulation can compile it for the host (with its stand-in for nvcuda::wmma).
#pragma once

#include <mma.h>

#include <type_traits>

#include "cuda_device.cuh"

namespace rwkv_ffi {
namespace {

// Which warps share a product: warps [first, first + count) of the block.
struct Warps {
  int first, count;
};

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

}  // namespace
}  // namespace rwkv_ffi

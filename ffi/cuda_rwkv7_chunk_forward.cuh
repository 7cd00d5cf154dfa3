// The chunked RWKV-7 forward kernel (see cuda_rwkv7_chunk.cu and cuda_rwkv7_chunk.cuh).
#pragma once

#include "cuda_rwkv7_chunk.cuh"

namespace rwkv_ffi {
namespace {

template <int D, typename T>
__global__ void __launch_bounds__(kThreads<D>, 1) rwkv7_chunk_forward_kernel(ChunkArgs p) {
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
  auto slot_of = [&](int64_t ci) { return checkpoint_slot<Op, D>(p, n, seq.start, ci, hd); };
  for (int idx = threadIdx.x; idx < D * D; idx += kThreads<D>) {
    const float h = p.h_in[base + idx];
    S[(idx / D) * L + idx % D] = h;
    if constexpr (Lay::kCopies) S_op[(idx / D) * L + idx % D] = from_f<Op>(h);
    if (p.ckpt && n_chunks > 0) slot_of(0)[idx] = from_f<Op>(h);
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
    blk.operands([] {});
    blk.in_chunk_matrices();
    __syncthreads();
    T* o = static_cast<T*>(p.o);
    if (threadIdx.x < 32) {
      blk.inverse();
    } else if constexpr (Lay::kTensor) {
      // q~H + A_qk V into qh and X = a~H + A_ak V into x: [2C, D] tiles on the other warps.
      for_tiles<2 * C, D>(Warps{1, kWarps<D> - 1}, [&](int m0, int n0) {
        const int which = m0 / C;  // 0: the rows q, 1: the rows a
        Tile<Op> acc;
        acc.zero();
        acc.template add<D, false, false>(blk.op(which), L, S_op, L, 0, n0);
        acc.template add<C, false, false>(blk.hi(which), C, blk.v_op(), L, 0, n0);
        acc.template add<C, false, false>(blk.lo(which), C, blk.v_op(), L, 0, n0);
        acc.store((which ? x : qh) + n0, L);
      });
    } else {  // q~H, a~H on the other warps
      gemm<C, D, D, false, false, false>(blk.op(0), L, S_op, L, qh, L, Warps{1, kWarps<D> - 1});
      gemm<C, D, D, false, false, false>(blk.op(1), L, S_op, L, x, L, Warps{1, kWarps<D> - 1});
    }
    __syncthreads();
    // U = (I - A_ab)^-1 X into u and its operand copy.
    if constexpr (Lay::kTensor) {
      for_tiles<C, D>(kAllWarps<D>, [&](int, int n0) {
        Tile<float> acc;
        acc.zero();
        acc.template add<C, false, false>(blk.mat(4), C, x, L, 0, n0);
        acc.store(u + n0, L);
        copy_tile(u + n0, L, blk.op(4) + n0, L);
      });
    } else {
      blk.values_x(x);
      __syncthreads();
      blk.values_u(x);
    }
    __syncthreads();
    // O = q~H + A_qk V + A_qb U
    if constexpr (Lay::kTensor) {
      for_tiles<C, D>(kAllWarps<D>, [&](int, int n0) {
        Tile<float> acc;
        acc.load(qh + n0, L);
        acc.template add<C, false, false>(blk.mat(1), C, u, L, 0, n0);
        acc.store(qh + n0, L);
        store_tile_rows<D>(qh, n0, len, o, c0, p.H, hd);
      });
    } else {
      for (int idx = threadIdx.x; idx < len * D; idx += kThreads<D>) {
        const int t = idx / D, j = idx % D;
        float s = qh[t * L + j];
        for (int i = 0; i <= t; ++i) s += blk.Aqk(t, i) * blk.v_(i, j) + blk.Aqb(t, i) * u[i * L + j];
        o[((c0 + t) * p.H + hd) * D + j] = from_f<T>(s);
      }
    }
    // H' = e^g H + k^^T V + b^^T U, and its operand copy and checkpoint as each tile is done.
    Op* slot = p.ckpt && ci + 1 < n_chunks ? slot_of(ci + 1) : nullptr;
    if constexpr (Lay::kTensor) {
      // Each warp's products staged in f(3..4) (the factored tiles, spent), then each lane's
      // entries of the state scaled, summed and written with their copies: no pass of its own.
      static_assert(kWarps<D> * 256 <= 2 * C * L, "a staging tile per warp");
      float* stage = blk.f(3) + threadIdx.x / 32 * 256;
      for_tiles<D, D>(kAllWarps<D>, [&](int m0, int n0) {
        TileRow h, sum;
        h.load(S + m0 * L + n0, L);
        Tile<Op> acc;
        acc.zero();
        acc.template add<C, true, false>(blk.op(2), L, blk.v_op(), L, m0, n0);
        acc.template add<C, true, false>(blk.op(3), L, blk.op(4), L, m0, n0);
        acc.store(stage, 16);
        __syncwarp();
        sum.load(stage, 16);
        const float e = blk.eg()[m0 + TileRow::row()];
#pragma unroll
        for (int k = 0; k < 8; ++k) h[k] = e * h[k] + sum[k];
        __syncwarp();  // the stage is free for the warp's next tile
        h.store(S + m0 * L + n0, L);
        h.store_op(S_op + m0 * L + n0, L);
        if (slot) h.store_op(slot + m0 * D + n0, D);
      });
    } else {
      for (int idx = threadIdx.x; idx < D * D; idx += kThreads<D>) S[(idx / D) * L + idx % D] *= blk.eg()[idx / D];
      __syncthreads();
      gemm<D, D, C, true, false, true, true>(blk.op(2), L, blk.v_op(), L, S, L, kAllWarps<D>,
                                             blk.op(3), blk.op(4), Checkpoint<D>{slot});
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < D * D; idx += kThreads<D>) p.h_out[base + idx] = S[(idx / D) * L + idx % D];
}

}  // namespace
}  // namespace rwkv_ffi

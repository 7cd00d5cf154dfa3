// RWKV-7 in chunks of kChunk (16) tokens, the WY form (docs/RWKV7-CHUNK64.md, at C = 16): the
// arithmetic the CPU twin (cpu_rwkv7_chunk.cc) and the CUDA kernels (cuda_rwkv7_chunk.cu) share.
//
// Per chunk and head, with the state H [K, V] at its start and rows t = 0..C-1 (a ragged last
// chunk is padded with tokens whose inputs are 0 and log decay 0: they change nothing):
//   gi_t = w_0 + ... + w_t (inclusive), ge_t = gi_{t-1} (exclusive), g = gi_{C-1},
//   q~ = q e^gi, a~ = a e^ge, k^ = k e^(g - gi), b^ = b e^(g - gi)     (each factor <= 1)
//   A_qk[t,i] = sum_k q_tk k_ik F_k(t,i)  (i <= t), A_qb likewise with b,  F = e^(gi_t - gi_i)
//   A_ak[t,i] = sum_k a_tk k_ik E_k(t,i)  (i < t),  A_ab likewise with b,  E = e^(ge_t - gi_i)
//   U = (I - A_ab)^-1 (a~ H + A_ak V)          (u_t = h_{t-1}^T a_t)
//   O = q~ H + A_qk V + A_qb U
//   H' = e^g * H + k^^T V + b^^T U
// Backward, from dO and dH' (the gradient of the chunk's end state):
//   dU = A_qb^T dO + b^ dH',  dX = (I - A_ab)^-T dU
//   dH = e^g * dH' + q~^T dO + a~^T dX                       (the reverse recurrence)
//   dV = A_qk^T dO + A_ak^T dX + k^ dH'
//   dA_qk = tril(dO V^T), dA_qb = tril(dO U^T), dA_ak = strict(dX V^T), dA_ab = strict(dX U^T)
//   dq~ = dO H^T, da~ = dX H^T, dk^ = V dH'^T, db^ = U dH'^T, then through the factors; and
//   dgi = q dq - k dk - b db, dge = a da, dg = e^g rowsum(H * dH') + sum_t (k^ dk^ + b^ db^),
//   dw_s = sum_{t >= s} (dgi_t + dge_t) - dge_s + dg.
//
// The in-chunk factors F, E are exact for every log decay: log decays are raised to kFloor on
// load (e^kFloor is 0 in float32, so no product changes; a raised element's gradient is 0), and
//  - a tame chunk (every column's total g_k >= -kTameSum) references its factors to the chunk's
//    middle, m = gi_{C/2-1}: F = e^(gi_t - m) e^(m - gi_i), each within e^(+-kTameSum), so the
//    A matrices are products of whole [C, K] tiles (tensor cores on the GPU);
//  - any other chunk forms each factor from its own sum, F = e^(w_{i+1} + ... + w_t): every
//    factor <= 1 and no difference of two large cumulative sums (-1e9, -inf, w = 0 all exact).
// The factors against the state, e^gi, e^ge and e^(g - gi), are sums of same-signed log decays
// (the last summed from the chunk's end), so they are exact on both paths.
#pragma once

#include "common.h"

namespace rwkv_ffi {

// Log decays below kFloor are raised to it (e^-128 is 0 in float32).
constexpr float kFloor = -128.f;
// A chunk is tame when every column's log decays sum to at least -kTameSum.
constexpr float kTameSum = 16.f;
// The middle row whose cumulative log decay references a tame chunk's factors.
constexpr int kMiddle = kChunk / 2 - 1;

// The log decay as used: raised to kFloor (NaN stays NaN).
RWKV_HD float floored(float w) { return w < kFloor ? kFloor : w; }

}  // namespace rwkv_ffi

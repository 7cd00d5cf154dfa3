"""Chunked kernels of gated linear attention and RWKV-6: one family, one set of kernels.

Per head, with the float32 state h [K, V], q = scale * q (RWKV-6: r), a per-key log gate
a_t (GLA: gk + g + g_gamma, summed by the caller; RWKV-6: w) and a per-value log gate b_t
(GLA's gv):

    h_t = (e^{a_t} e^{b_t}^T) * h_{t-1} + k_t v_t^T
    GLA:     o_t = h_t^T q_t                                  (read after the update)
    RWKV-6:  o_t = (h_{t-1} + diag(u) k_t v_t^T)^T q_t         (read before, bonus u)

A chunk of C tokens starting from the state H, with the in-chunk cumulative log gates
A_t = a_1 + ... + a_t, B_t likewise, the read decay R_t = A_t (GLA) or A_t - a_t (RWKV-6)
and the pairwise scores

    S[t,i] = sum_k q_t k_i e^{R_t - A_i}   (i <= t; RWKV-6: i < t, and S[t,t] = q_t . (u k_t))

is (the value gate enters each column v on its own):

    o_t = e^{B_t} (H^T (q_t e^{R_t})) + sum_i S[t,i] v_i e^{B_t - B_i}
    H'  = (e^{A_C} e^{B_C}^T) * H + (k e^{A_C - A})^T (v e^{B_C - B})

Two builds of the in-chunk pair factors e^{R_t - A_i}, chosen per call on the device by the
backend (each its own compiled kernels, TAME constexpr):
- tame (a call whose chunks' log gates all sum to >= -GLA_TAME_SUM: model gates): every factor
  referenced to the chunk's middle row m, e^{R_t - A_m} on the row operand and e^{A_m - A_i} on
  the column operand of ONE tensor-core product per K block; each lies within
  e^(+-GLA_TAME_SUM), and each kept pair's term is still its own factor <= 1 times q_t k_i.
- exact (any gates in [-inf, 0]): level by level as RWKV-7's A matrices (common.level_factors):
  at level s, rows t of each odd segment of s steps meet columns i of the even segment before
  it, with the factor split at the boundary b between them, e^{R_t - A_b} e^{A_b - A_i}, each
  <= 1 (levels s = C/2, ..., 1 cover every pair i < t once; the diagonal has the factor e^0).
The value gate's pair factors are always built level by level. The other factors are decays to
the chunk's end or from its start (<= 1). Log gates are raised to FLOOR on load (their exp is 0
in float32 either way; it keeps the sums finite and precise), and the gradient of a floored
gate is 0.

Every kernel takes chunks of C tokens (the backend's GLA_SPAN), the states saved at the start
of each chunk (slot ``state_index[n] + c`` of sequence n's chunk c, processing order) being the
interface between them. The forward: a sequential state pass per (sequence, head, K block,
V block) (H' above: one product per chunk, every factor <= 1; the final state as ht), then the
outputs per (chunk, head, V block), all chunks at once, from the chunk's saved state and its
scores (formed in the output kernel on the tame path; from the exact scores kernel before it
otherwise). The backward: a lean sequential reverse pass of the state gradient, one product
per chunk (dH_prev = (e^{A_C} e^{B_C}^T) * dH + (q e^R)^T (dO e^B), saved at every chunk's
end in the chunk's slot), parallel over blocks of K and of V; then two kernels parallel over
(chunk, head, block): the K-side gradients (dq, dk, da, du) of a block of keys, summing over V
in blocks, and the V-side ones (dv, db) of a block of values, summing over K in blocks. Their
loops over the levels are not unrolled (``level_factors_at``), so that one level's tiles are
live at a time. The sequential passes loop over chunks with ``for``, which Triton pipelines
(the launch's num_stages): the next chunks' loads are in flight during the current chunk's
product.

Gate gradients: a log gate multiplies a factor x = y e^z, so dz = x dx; summed over the chunk's
factors that gives dR = q dq, dA = -k dk and the per-token gradient is their reverse cumulative
sum (exclusive for R under RWKV-6), in float32. Terms that would cancel exactly are kept out of
those sums (strong gates leave the gradient far smaller than the rounding of the cancelling
terms): the pairs whose factor is e^0 whatever the gates (GLA: i = t; RWKV-6: i = t - 1), and
the decays to the chunk's end, summed forwards (A_end - A_i = a_{i+1} + ... + a_C) instead of
as A_end minus a reverse sum.

REVERSE runs each sequence from its last token to its first (GLA's ``reverse``): chunk c's
position j is row ``end - 1 - (c * C + j)``. Sequences are rows [cu[n], cu[n+1]) of the
flattened inputs, clamped to [0, ROWS) in the kernel, and saved-state slots are masked to
[0, SLOTS), so no value of ``cu`` makes a kernel read or write out of bounds.

Modules, by phase: ``state`` (the two sequential passes: the forward's state pass and the
backward's state-gradient pass), ``scores`` (the exact path's in-chunk scores), ``output`` (the
outputs), ``gradients`` (the K-side and V-side gradient kernels); their helpers in ``tiles``
(where a program's chunk, tiles and state block lie) and ``gates`` (log gates and the factors
built from them), and those shared with RWKV-7 in ``triton_kernels/common.py``. The backend
(``rwkv_jax/backends/triton/gla.py``) launches the kernels imported below.
"""

from .gradients import gla_key_gradient_kernel, gla_value_gradient_kernel
from .output import gla_output_kernel
from .scores import gla_scores_kernel
from .state import gla_state_gradient_kernel, gla_state_kernel

__all__ = ["gla_key_gradient_kernel", "gla_output_kernel", "gla_scores_kernel",
           "gla_state_gradient_kernel", "gla_state_kernel", "gla_value_gradient_kernel"]

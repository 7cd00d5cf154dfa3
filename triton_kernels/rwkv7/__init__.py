"""RWKV-7 (generalized delta rule) chunked forward and backward kernels.

Per head, with the float32 state h [K, V] and q = scale * r:

    h_t = diag(exp w_t) h_{t-1} + b_t (a_t^T h_{t-1}) + k_t v_t^T,   o_t = h_t^T q_t

A chunk of C tokens starting from the state H is, with the in-chunk cumulative log decays
gi_t = w_1 + ... + w_t (inclusive), ge_t = gi_t - w_t (exclusive), g = gi_C, and the
decayed rows  a~ = a e^ge,  q~ = q e^gi,  k^ = k e^(g - gi),  b^ = b e^(g - gi):

    A_ab[t,i] = sum_k a_t e^(ge_t - gi_i) b_i  (i < t),  A_ak likewise with k_i  (i < t)
    A_qb[t,i] = sum_k q_t e^(gi_t - gi_i) b_i  (i <= t), A_qk likewise with k_i  (i <= t)
    U  = (I - A_ab)^-1 (A_ak V + a~ H)           # u_t = h_{t-1}^T a_t, rows of U
    O  = q~ H + A_qk V + A_qb U
    H' = e^g H + k^T V + b^T U

Every exponent is a difference of cumulative log decays inside one chunk, and every factor
is at most 1 whatever the decays, so nothing overflows and underflow is harmless: log decays
are raised to FLOOR (-128, where e^w is 0 in float32; the gradient of a raised element is 0)
on load, the factors against the state are e^gi, e^ge, e^(g - gi) <= 1, and the A matrices are
built level by level (``_level``): at level S the chunk is cut into segments of S steps and
rows t of each odd segment meet columns i of the even segment just before it, with the factor
split at the boundary b between them, e^(G_t - gi_b) * e^(gi_b - gi_i), each <= 1. Levels
S = C/2, C/4, ..., 1 cover every pair i < t once; the diagonal (i = t) has no factor.

Every kernel that builds A matrices has a tame and an exact path, compiled apart on the
constexpr TAME (one compiled path per kernel keeps the tame one's registers those of a kernel
without the other). The tame one is for calls whose every log decay is >= -1 (the caller
decides on the device, for the whole call; model-range decays always are), so that a 64-token
chunk's log decays sum to at least -64 in every column: one product per A matrix, its factors
referenced to the chunk's middle and so within e^(+-32) (``chunks._middle``). The exact one
splits each factor at block or level boundaries, exact for every decay.

The kernels take chunks of C = 64 tokens in the WY form (docs/DESIGN.md): the forward is three
kernels,
  1. ``rwkv7_wy_kernel`` (``in_chunk``; parallel, two programs per chunk and head): the
     in-chunk matrices, T = (I - A_ab)^-1, W = T a~ [C, K] and U0 = T A_ak V [C, V] per token,
     A_qk, A_qb, A_ak and T per chunk ([chunk slots, HEADS, 4, C, C]; the last two for the
     backward); and the decayed rows q~ = q e^gi, k^ = k e^(g - gi), b^ = b e^(g - gi) per
     token and e^g per chunk, which every later kernel but the K side reads instead of the
     decays (no cumulative sums or exponentials in the sequential passes, and 16-bit operands
     for 16-bit inputs);
  2. ``rwkv7_wy_state_kernel`` (``state``; sequential, a program per sequence, head and V
     block): U = W H + U0 and H' = e^g H + k^T V + b^T U (no [C, C] matrix), saving H at
     every chunk's start and U for the kernels after it; or, when the call is not
     differentiated, writing each chunk's outputs O = q~ H + A_qk V + A_qb U itself (nothing
     for a backward goes to memory, and kernel 3 does not run);
  3. ``rwkv7_wy_output_kernel`` (``outputs``; parallel, a program per chunk, head and V
     block): O from the chunk's saved H and U;
and the backward three more:
  4. ``rwkv7_wy_state_gradient_kernel`` (``v_side``; sequential, reverse): dH' per chunk, dU,
     dh0;
  5. ``rwkv7_wy_value_gradient_kernel`` (``v_side``; parallel, per chunk, head and V block):
     dX, dV;
  6. ``rwkv7_wy_matrix_gradient_kernel`` then ``rwkv7_wy_key_gradient_kernel`` (``k_side``;
     parallel, per chunk and head, then per chunk, head and block of keys over all of V
     inside): the in-chunk matrices' gradients, then dr, dw, dk, da, db.
Sequences are rows [cu[n], cu[n+1]) of the flattened [rows, HEADS, *] inputs (a plain batch:
cu = arange(B + 1) * T); ``chunk_index[n]`` is sequence n's first chunk slot and
``chunk_sequence[s]`` the sequence of slot s (-1 past the last chunk: such slots read and write
nothing). ``chunks`` holds what the modules share: chunk slots, a sequential pass's program,
the in-chunk decays and the buffers' layout. ``chunk16`` is the 16-token forward, which a call
that is not differentiated takes at many sequence-heads (the backend's KernelConfig).

Tiles are addressed as a scalar row base plus offsets within a chunk that are the same for
every chunk (computed once per program), and masks are row masks unless K or V needs padding,
which keeps registers free and loads and stores vectorised.
"""

# The kernels the backend launches (rwkv_jax/backends/triton: ``launch.kernels("rwkv7")``).
from .chunk16 import rwkv7_forward_kernel, rwkv7_in_chunk_kernel, rwkv7_tame_in_chunk_kernel
from .in_chunk import rwkv7_wy_kernel
from .k_side import rwkv7_wy_key_gradient_kernel, rwkv7_wy_matrix_gradient_kernel
from .outputs import rwkv7_wy_output_kernel
from .state import rwkv7_wy_state_kernel
from .v_side import rwkv7_wy_state_gradient_kernel, rwkv7_wy_value_gradient_kernel

__all__ = ["rwkv7_forward_kernel", "rwkv7_in_chunk_kernel", "rwkv7_tame_in_chunk_kernel",
           "rwkv7_wy_kernel", "rwkv7_wy_key_gradient_kernel",
           "rwkv7_wy_matrix_gradient_kernel", "rwkv7_wy_output_kernel",
           "rwkv7_wy_state_gradient_kernel", "rwkv7_wy_state_kernel",
           "rwkv7_wy_value_gradient_kernel"]

"""Phase 3 of the 64-token kernels, when the backward needs the forward's residuals: the outputs
of every chunk at once from the states the state pass saved (``rwkv7_wy_output_kernel``)."""

import triton
import triton.language as tl

from ..common import (dot, stored)
from .chunks import (_state, _wy_load, _wy_chunk_program, WY_A_QK, WY_A_QB)


@triton.jit
def _wy_outputs(o, v, u, matrices_ptr, slot, used, head, o_ptr, v_base, v_tile, v_in,
                HEADS: tl.constexpr, C: tl.constexpr, PRECISION: tl.constexpr):
    """O = o + A_qk V + A_qb U stored in o's rows (o: q~ H), one [C, C] matrix live at a time."""
    o = dot(_wy_load(matrices_ptr, slot, used, head, WY_A_QK, HEADS, C, False), v, o, PRECISION)
    o = dot(_wy_load(matrices_ptr, slot, used, head, WY_A_QB, HEADS, C, False), u, o, PRECISION)
    tl.store(o_ptr + v_base + v_tile, o.to(o_ptr.dtype.element_ty), mask=v_in)


@triton.jit
def rwkv7_wy_output_kernel(
    qd_ptr, v_ptr, u_ptr, states_ptr, matrices_ptr, cu_ptr, chunk_index_ptr,
    chunk_sequence_ptr,                                                          # inputs
    o_ptr,                                                                       # output
    HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    TOTAL_ROWS: tl.constexpr, SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid (chunk slots * V blocks of BV, HEADS): O = q~ H + A_qk V + A_qb U, all chunks at
    once, from the chunk's H saved by the state pass (in the same chunk slot) and its q~, A_qk
    and A_qb (``rwkv7_wy_kernel``). o [rows, HEADS, V] in its dtype. Each product takes its
    tiles as stored (``dot``)."""
    (slot, head, used, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, k_base, k_in, v_base,
     v_in) = _wy_chunk_program(cu_ptr, chunk_index_ptr, chunk_sequence_ptr, HEADS, K, V, BK, BV,
                               C, TOTAL_ROWS, SEQUENCES, CHUNK_SLOTS)
    h = tl.load(_state(states_ptr, slot, head, HEADS, K, V, BK, v_cols),
                mask=(tl.trans(k_cols_in) & v_cols_in) & used, other=0.0)
    _wy_outputs(dot(stored(qd_ptr + k_base, k_tile, k_in), h, None, PRECISION),
                stored(v_ptr + v_base, v_tile, v_in), stored(u_ptr + v_base, v_tile, v_in),
                matrices_ptr, slot, used, head, o_ptr, v_base, v_tile, v_in, HEADS, C, PRECISION)

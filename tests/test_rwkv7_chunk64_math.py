"""The math of the 64-token-chunk RWKV-7 kernels (docs/DESIGN.md, "RWKV-7 at 64-token
chunks"), in float64 numpy, against the reference: the WY form of the forward, the blockwise
in-chunk inverse and the backward's formulas, chunk by chunk. Small chunks of four blocks stand
for 64 tokens in blocks of 16; the formulas do not depend on the sizes (the kernels' own float32
exactness is the shared suite's business)."""

import numpy as np
import pytest

import reference

CHUNK, BLOCK = 16, 4
FLOOR = -128.0  # log decays are raised to it on load, as in the kernels (dw 0 there)


def _pair_decays(w):
    """e^(gi_t - gi_i) and e^(ge_t - gi_i) for every pair i <= t (else 0), [C, C, K]: sums of
    the log decays between, so that -inf and -1e9 give exact zeros."""
    chunk = w.shape[0]
    inclusive = np.zeros((chunk, chunk, w.shape[1]))
    exclusive = np.zeros_like(inclusive)
    for t in range(chunk):
        for i in range(t + 1):
            inclusive[t, i] = np.exp(w[i + 1:t + 1].sum(0))
            if i < t:
                exclusive[t, i] = np.exp(w[i + 1:t].sum(0))
    return inclusive, exclusive


def _blockwise_inverse(lower):
    """(I - lower)^-1 for a strictly lower [C, C] matrix, from the inverses of its BLOCK x BLOCK
    diagonal blocks: T[J,I] = T[J,J] sum_{I <= M < J} lower[J,M] T[M,I]."""
    blocks = lower.shape[0] // BLOCK
    part = lambda x, j, i: x[j * BLOCK:(j + 1) * BLOCK, i * BLOCK:(i + 1) * BLOCK]
    inverse = np.zeros_like(lower)
    for j in range(blocks):
        part(inverse, j, j)[:] = np.linalg.inv(np.eye(BLOCK) - part(lower, j, j))
        for i in range(j):
            part(inverse, j, i)[:] = part(inverse, j, j) @ sum(
                part(lower, j, m) @ part(inverse, m, i) for m in range(i, j))
    return inverse


def _chunk(q, w, k, a, b):
    """One chunk's factored tiles and in-chunk matrices (the plan's notation); every exponent
    a sum of log decays."""
    gi = np.cumsum(w, 0)
    ge = np.concatenate([np.zeros_like(w[:1]), gi[:-1]])
    to_end = np.exp(np.cumsum(w[::-1], 0)[::-1] - w)  # e^(g - gi): the decays after t
    inclusive, exclusive = _pair_decays(w)
    pairs = lambda x, y, decay: np.einsum("tk,ik,tik->ti", x, y, decay)
    strict = np.tril(np.ones((len(w), len(w))), -1)
    A_qk, A_qb = pairs(q, k, inclusive), pairs(q, b, inclusive)
    A_ak, A_ab = pairs(a, k, exclusive) * strict, pairs(a, b, exclusive) * strict
    return dict(q_=q * np.exp(gi), a_=a * np.exp(ge), k_=k * to_end, b_=b * to_end,
                e_gi=np.exp(gi), e_ge=np.exp(ge), to_end=to_end, decay=np.exp(gi[-1]),
                inclusive=inclusive, exclusive=exclusive,
                A_qk=A_qk, A_qb=A_qb, A_ak=A_ak, T=_blockwise_inverse(A_ab))


def _forward(x, h0, chunk=CHUNK):
    """Outputs, final state, and each chunk's start state, U and matrices (x padded to whole
    chunks of ``chunk`` rows)."""
    h, outputs, saved = h0, [], []
    for start in range(0, len(x["w"]), chunk):
        q, w, k, v, a, b = (x[n][start:start + chunk] for n in "qwkvab")
        m = _chunk(q, w, k, a, b)
        W, U0 = m["T"] @ m["a_"], m["T"] @ m["A_ak"] @ v
        u = W @ h + U0
        outputs.append(m["q_"] @ h + m["A_qk"] @ v + m["A_qb"] @ u)
        saved.append((h, u, W, m))
        h = m["decay"][:, None] * h + m["k_"].T @ v + m["b_"].T @ u
    return np.concatenate(outputs), h, saved


def _backward(x, saved, d_out, d_state, chunk=CHUNK):
    """The plan's backward, chunk by chunk from the last, carrying dH'. Also returns, under
    "chunks", each chunk's dH' (its end state's gradient), dU and dX, in chunk order."""
    grads = {n: np.zeros_like(x[n]) for n in "qwkvab"}
    grads["chunks"] = [None] * len(saved)
    dh = d_state
    for index in reversed(range(len(saved))):
        h, u, W, m = saved[index]
        rows = slice(index * chunk, (index + 1) * chunk)
        q, w, k, v, a, b = (x[n][rows] for n in "qwkvab")
        do = d_out[rows]
        du = m["A_qb"].T @ do + m["b_"] @ dh
        dx = m["T"].T @ du
        grads["chunks"][index] = (dh, du, dx)
        grads["v"][rows] = m["A_qk"].T @ do + m["A_ak"].T @ dx + m["k_"] @ dh
        strict = np.tril(np.ones((len(w), len(w))), -1)
        dA_qk, dA_qb = np.tril(do @ v.T), np.tril(do @ u.T)
        dA_ak, dA_ab = strict * (dx @ v.T), strict * (dx @ u.T)
        dk_, db_ = v @ dh.T, u @ dh.T
        dg = m["decay"] * (h * dh).sum(1) + (m["k_"] * dk_ + m["b_"] * db_).sum(0)
        through = lambda dA, y, decay: np.einsum("ti,ik,tik->tk", dA, y, decay)
        back = lambda dA, y, decay: np.einsum("ti,tk,tik->ik", dA, y, decay)
        inc, exc = m["inclusive"], m["exclusive"]
        dq = m["e_gi"] * (do @ h.T) + through(dA_qk, k, inc) + through(dA_qb, b, inc)
        da = m["e_ge"] * (dx @ h.T) + through(dA_ak, k, exc) + through(dA_ab, b, exc)
        dk = m["to_end"] * dk_ + back(dA_qk, q, inc) + back(dA_ak, a, exc)
        db = m["to_end"] * db_ + back(dA_qb, q, inc) + back(dA_ab, a, exc)
        dgi, dge = q * dq - k * dk - b * db, a * da
        dw = np.cumsum((dgi + dge)[::-1], 0)[::-1] - dge + dg
        grads["w"][rows] = np.where(x["floored"][rows], 0.0, dw)
        for name, value in zip("qkab", (dq, dk, da, db)):
            grads[name][rows] = value
        dh = m["decay"][:, None] * dh + m["q_"].T @ do + W.T @ du
    grads["initial_state"] = dh
    return grads


@pytest.mark.parametrize("decay", ["model", "strong", "zero", "-1e9 and -inf tokens"])
def test_plan_matches_the_reference(decay):
    rng = np.random.default_rng(3)
    steps, key, value, scale = 2 * CHUNK + 5, 8, 6, 0.5
    hard = decay == "-1e9 and -inf tokens"
    inputs = reference.random_inputs("rwkv7", rng, batch=1, steps=steps, heads=1, key=key,
                                     value=value, decay="model" if hard else decay)
    if hard:
        inputs["w"][0, 3, 0, :4] = -1e9
        inputs["w"][0, CHUNK + 1, 0, 2:] = -np.inf
    d_out = rng.standard_normal((1, steps, 1, value))
    d_state = rng.standard_normal((1, 1, key, value))
    out, state = reference.forward("rwkv7", inputs, scale=scale)
    expected = reference.gradients("rwkv7", inputs, d_out, d_state, scale=scale)

    # One head, padded to whole chunks with inert tokens (no decay, zero everything else).
    padded = -steps % CHUNK
    x = {n: np.pad(inputs[n][0, :, 0], ((0, padded), (0, 0))) for n in "rwkvab"}
    x["q"] = scale * x.pop("r")
    x["floored"] = x["w"] < FLOOR
    x["w"] = np.maximum(x["w"], FLOOR)
    h0 = inputs["initial_state"][0, 0]
    ours_out, ours_state, saved = _forward(x, h0)
    np.testing.assert_allclose(ours_out[:steps], out[0, :, 0], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(ours_state, state[0, 0], rtol=1e-9, atol=1e-9)

    grads = _backward(x, saved, np.pad(d_out[0, :, 0], ((0, padded), (0, 0))), d_state[0, 0])
    grads["r"] = scale * grads.pop("q")
    for name in "rwkvab":
        np.testing.assert_allclose(grads[name][:steps], expected[name][0, :, 0], rtol=1e-8,
                                   atol=1e-9, err_msg=name)
    np.testing.assert_allclose(grads["initial_state"], expected["initial_state"][0, 0],
                               rtol=1e-8, atol=1e-9)


def test_blockwise_inverse():
    lower = np.tril(np.random.default_rng(0).standard_normal((CHUNK, CHUNK)) * 0.3, -1)
    np.testing.assert_allclose(_blockwise_inverse(lower),
                               np.linalg.inv(np.eye(CHUNK) - lower), rtol=1e-10, atol=1e-12)

"""The float64 reference checks itself: its hand-derived (and complex-step) gradients against
central finite differences, and its recurrences against independent formulations of the math."""

import numpy as np
import pytest

import reference

SMALL = dict(batch=2, steps=4, heads=2, key=3, value=2)

# (op, random_inputs options, reference options)
CASES = {
    "rwkv7": ("rwkv7", {}, {"scale": 0.7}),
    "rwkv7_strong": ("rwkv7", dict(decay="strong"), {}),
    "rwkv7_packed": ("rwkv7", dict(batch=1, steps=5, state_rows=3),
                     dict(cu_seqlens=np.array([0, 2, 2, 5]))),
    "rwkv6": ("rwkv6", {}, {"scale": 0.7}),
    "rwkv6_packed": ("rwkv6", dict(batch=1, steps=5, state_rows=3),
                     dict(cu_seqlens=np.array([0, 3, 3, 5]))),
    "gla_all_gates": ("gated_linear_attention", dict(gates=("g", "g_gamma", "gk", "gv")), {}),
    "gla_g_only": ("gated_linear_attention", dict(gates=("g",)), {"scale": 1.3}),
    "gla_reverse_packed": ("gated_linear_attention",
                           dict(batch=1, steps=5, state_rows=3, gates=("g", "g_gamma", "gk", "gv")),
                           dict(cu_seqlens=np.array([0, 1, 1, 5]), reverse=True)),
    "rwkv4": ("rwkv4", {}, {}),
    "rwkv4_default_state": ("rwkv4", dict(initial_state=False), {}),
    "rwkv7_step": ("rwkv7_step", dict(state_rows=5), dict(state_indices=np.array([3, 1]))),
    "rwkv6_step": ("rwkv6_step", dict(state_rows=4), dict(state_indices=np.array([2, 0]))),
}


def _loss(op, inputs, d_out, d_state, opts):
    out, state = reference.forward(op, inputs, **opts)
    return (out * d_out).sum() + (state * d_state).sum()


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_match_finite_differences(case):
    op, input_options, opts = CASES[case]
    rng = np.random.default_rng(7)
    inputs = reference.random_inputs(op, rng, **{**SMALL, **input_options})
    out, state = reference.forward(op, inputs, **opts)
    d_out, d_state = rng.standard_normal(out.shape), rng.standard_normal(state.shape)
    grads = reference.gradients(op, inputs, d_out, d_state, **opts)
    assert set(grads) == set(inputs)
    eps = 1e-6
    for name, x in inputs.items():
        numeric = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            plus, minus = x.copy(), x.copy()
            plus[index] += eps
            minus[index] -= eps
            numeric[index] = (_loss(op, {**inputs, name: plus}, d_out, d_state, opts)
                              - _loss(op, {**inputs, name: minus}, d_out, d_state, opts)) / (2 * eps)
        assert grads[name].shape == x.shape, name
        error = np.linalg.norm(grads[name] - numeric) / np.linalg.norm(numeric)
        assert error < 1e-7, f"{case}: d/d{name} relative error {error:.2e}"


def test_rwkv7_matches_official_row_layout():
    """S = S diag(exp w) + (S a) b^T + v k^T, y = S r with S = h^T (DESIGN.md)."""
    rng = np.random.default_rng(1)
    x = reference.random_inputs("rwkv7", rng, **SMALL)
    o, h = reference.forward("rwkv7", x)
    for n in range(SMALL["batch"]):
        for head in range(SMALL["heads"]):
            s = x["initial_state"][n, head].T.copy()
            for t in range(SMALL["steps"]):
                r, w, k, v, a, b = (x[name][n, t, head] for name in "rwkvab")
                s = s @ np.diag(np.exp(w)) + np.outer(s @ a, b) + np.outer(v, k)
                np.testing.assert_allclose(o[n, t, head], s @ r, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(h[n, head], s.T, rtol=1e-12, atol=1e-12)


def test_rwkv4_max_trick_matches_plain_sums():
    """Without the max trick: y_t = (A + e^{u+k_t} v_t) / (B + e^{u+k_t}) where A, B are the
    decayed sums sum_i e^{(t-1-i) w + k_i} (v_i, 1) from the default empty state."""
    rng = np.random.default_rng(2)
    x = reference.random_inputs("rwkv4", rng, **SMALL, initial_state=False)
    y, state = reference.forward("rwkv4", x)
    w, u, k, v = x["w"], x["u"], x["k"], x["v"]
    numerator = np.zeros(k[:, 0].shape)
    denominator = np.zeros(k[:, 0].shape)
    for t in range(SMALL["steps"]):
        bonus = np.exp(u + k[:, t])
        np.testing.assert_allclose(y[:, t], (numerator + bonus * v[:, t]) / (denominator + bonus),
                                   rtol=1e-12)
        numerator = np.exp(w) * numerator + np.exp(k[:, t]) * v[:, t]
        denominator = np.exp(w) * denominator + np.exp(k[:, t])
    aa, bb, pp = state[..., 0], state[..., 1], state[..., 2]
    np.testing.assert_allclose(aa * np.exp(pp), numerator, rtol=1e-12)
    np.testing.assert_allclose(bb * np.exp(pp), denominator, rtol=1e-12)


def test_packed_segments_run_alone_and_reverse_runs_backwards():
    """Packing equals separate runs; reverse GLA equals forward GLA on time-flipped inputs."""
    rng = np.random.default_rng(3)
    gates = ("g", "gk", "gv")
    x = reference.random_inputs("gated_linear_attention", rng, batch=1, steps=6, heads=2, key=3,
                                value=2, gates=gates, state_rows=2)
    o, h = reference.forward("gated_linear_attention", x, cu_seqlens=np.array([0, 4, 6]),
                             reverse=True)
    for row, (start, end) in enumerate([(0, 4), (4, 6)]):
        flipped = {n: x[n][:, start:end][:, ::-1] for n in ("q", "k", "v") + gates}
        flipped["initial_state"] = x["initial_state"][row:row + 1]
        o_alone, h_alone = reference.forward("gated_linear_attention", flipped)
        np.testing.assert_allclose(o[:, start:end], o_alone[:, ::-1], rtol=1e-12)
        np.testing.assert_allclose(h[row:row + 1], h_alone, rtol=1e-12)

"""The sequence ops (RWKV-7, RWKV-6, gated linear attention, RWKV-4) on every rwkv_jax backend
beside the peers, on the same inputs: forward and forward+backward times, peak memory, and the
error of each against float64.

    python benchmarks/ops.py --quick --backends native,chunked --peers none   # a CPU smoke run
    python benchmarks/ops.py --ops rwkv7 --shapes 8,4096,64,64 8,4096,32,128 --json ops.jsonl
    python benchmarks/ops.py --ops rwkv7,gla --shapes 1,32768,64,64 --packed 16   # cu_seqlens

Inputs are ``rwkv_jax._bench.make_case``'s (the models' distributions, a random initial state;
gated linear attention with its key gate ``gk`` only, the gate fla's ``chunk_gla`` takes).
"fwd+bwd" is the forward plus the gradients of every input and of the initial state for random
cotangents of the output and the final state. The error column compares one slice of each
call's outputs and gradients (batch 0, the first ``--error-heads`` heads; RWKV-4: the first
``--error-heads`` x K channels) with the native backend run in float64 on that slice's inputs
(gradients of per-head parameters such as RWKV-6's ``u`` sum over the whole batch, so the slice
does not check them). Backend "default" is the op without ``backend=``: the row names the
backend it resolved to.

Peers: ``fla`` (flash-linear-attention: ``chunk_rwkv7`` in its fastest configuration where the
decays allow it, ``chunk_rwkv6``, ``chunk_gla``; it has no RWKV-4). A peer or backend that
cannot run here is a row saying why.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch (the peers) shares the GPU

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runner  # noqa: E402

import rwkv_jax  # noqa: E402
from rwkv_jax import backends  # noqa: E402
from rwkv_jax._bench import (DTYPES, FLA_RWKV7_FASTEST, FLA_RWKV7_LOWER_BOUND,  # noqa: E402
                             bind, make_case, random_cotangents, vjp_function)

OPS = {"rwkv7": "rwkv7", "rwkv6": "rwkv6", "gla": "gated_linear_attention", "rwkv4": "rwkv4"}
PEERS = ("fla",)
BACKENDS = ("default",) + backends.names()
GPU_SHAPES = ((8, 4096, 64, 64), (8, 4096, 32, 128))
CPU_SHAPES = ((1, 1024, 4, 64),)
QUICK_SHAPE = (2, 64, 2, 16)
PASSES = ("fwd", "fwd+bwd")
GLA_UNUSED_GATES = ("g", "gv", "g_gamma")  # fla's chunk_gla takes the key gate only
PARAMETERS = ("u", "g_gamma")  # per-head or per-channel: no batch axis


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=runner.names_of(tuple(OPS)), default=list(OPS),
                        help=f"comma-separated: {', '.join(OPS)} (default all)")
    parser.add_argument("--backends", type=runner.names_of(BACKENDS), default=list(BACKENDS),
                        help=f"comma-separated rwkv_jax backends: {', '.join(BACKENDS)} "
                             f"(default all; one that cannot run here is reported as absent)")
    parser.add_argument("--shapes", type=_shape, nargs="+",
                        help="B,T,H,K each (RWKV-4: C = H*K channels); default "
                             f"{' '.join(','.join(map(str, s)) for s in GPU_SHAPES)} on a GPU, "
                             f"{' '.join(','.join(map(str, s)) for s in CPU_SHAPES)} on a CPU")
    parser.add_argument("--packed", type=int, default=0, metavar="N",
                        help="N sequences of random lengths packed in each shape's T tokens "
                             "(cu_seqlens; B must be 1; not RWKV-4)")
    parser.add_argument("--dtype", choices=tuple(DTYPES),
                        help="the inputs' dtype (default bfloat16 on a GPU, float32 on a CPU)")
    parser.add_argument("--passes", type=runner.names_of(PASSES), default=list(PASSES),
                        help="comma-separated: fwd, fwd+bwd (default both)")
    parser.add_argument("--error-heads", type=int, default=2,
                        help="heads in the float64 error slice (0: no error column)")
    parser.add_argument("--quick", action="store_true",
                        help=f"shape {','.join(map(str, QUICK_SHAPE))} and 3 timed calls: a smoke run")
    runner.add_common_arguments(parser, peers=PEERS)
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes = args.shapes or [QUICK_SHAPE]
        args.repeats, args.warmup = min(args.repeats, 3), 1
    gpu = jax.default_backend() == "gpu"
    args.shapes = args.shapes or list(GPU_SHAPES if gpu else CPU_SHAPES)
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    if args.packed < 0:
        parser.error(f"--packed must be 0 (none) or more, got {args.packed}")
    if args.packed and ("rwkv4" in args.ops or any(s[0] != 1 or s[1] < args.packed
                                                    for s in args.shapes)):
        parser.error("--packed needs shapes of B=1 and T >= N, and no rwkv4 (it takes no "
                     "cu_seqlens)")
    if args.error_heads < 0:
        parser.error(f"--error-heads must be 0 or more, got {args.error_heads}")
    return args


def _shape(text: str) -> tuple:
    parts = text.replace("x", ",").split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is four positive integers B,T,H,K, got {text!r}")
    return tuple(int(p) for p in parts)


# ---------------------------------------------------------------------------------------------
# Inputs and the float64 slice

def make_inputs(op: str, shape: tuple, dtype_name: str, packed: int = 0):
    """The case (float32 numpy arrays; GLA with its key gate only; with ``packed``, that many
    sequences of random lengths in the T tokens, each with its initial state), the arrays
    rounded to ``dtype_name`` (the state stays float32) and cotangents typed as the outputs."""
    case = make_case(op, *shape)
    if op == "gated_linear_attention":
        case.arrays = {n: x for n, x in case.arrays.items() if n not in GLA_UNUSED_GATES}
    if packed:
        rng = np.random.default_rng(1)
        steps = shape[1]
        cuts = np.sort(rng.choice(np.arange(1, steps), packed - 1, replace=False))
        case.options["cu_seqlens"] = np.concatenate([[0], cuts, [steps]]).astype(np.int32)
        state = case.arrays["initial_state"]
        case.arrays["initial_state"] = (0.5 * rng.standard_normal(
            (packed,) + state.shape[1:])).astype(np.float32)
    arrays = case.as_dtype(DTYPES[dtype_name])
    native = bind(functools.partial(getattr(rwkv_jax, op), backend="native"), tuple(arrays),
                  case.options)
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays.values())
    cotangents = random_cotangents(native, shapes)
    return case, arrays, cotangents


@dataclasses.dataclass(frozen=True)
class ErrorSlice:
    """Batch 0 and the first ``width`` heads (RWKV-4: channels) of a call's arrays; states keep
    every sequence's where the sequences are packed in batch 0."""
    width: int
    packed: bool

    @classmethod
    def of(cls, op: str, shape: tuple, heads: int, packed: bool) -> "ErrorSlice":
        _, _, total_heads, head_size = shape
        return cls(min(total_heads, heads) * (head_size if op == "rwkv4" else 1), packed)

    def take(self, name: str, x):
        """The slice of array ``name`` (an input, its gradient, the output ``o`` or the final
        ``state``) as float64 numpy."""
        if name in ("initial_state", "state"):
            part = x[:, :self.width] if self.packed else x[:1, :self.width]
        elif name in PARAMETERS or x.ndim == 1:
            part = x[:self.width]
        else:
            part = x[:1, :, :self.width]
        return np.asarray(part).astype(np.float64)


def float64_reference(case, arrays: dict, cotangents, view: ErrorSlice):
    """The native backend in float64 (on the CPU) on the slice of the rounded inputs:
    ``(out, state), gradients`` of the sliced inputs."""
    names = tuple(arrays)
    forward = bind(functools.partial(getattr(rwkv_jax, case.op), backend="native"), names,
                   case.options)
    out_cot, state_cot = cotangents
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        xs = tuple(jnp.asarray(view.take(n, x)) for n, x in arrays.items())
        cots = jnp.asarray(view.take("o", out_cot)), jnp.asarray(view.take("state", state_cot))
        (out, state), grads = jax.jit(vjp_function(forward))(xs, cots)
        return ((np.asarray(out), np.asarray(state)),
                {n: np.asarray(g) for n, g in zip(names, grads)})


def slice_errors(out, state, grads: dict, reference, view: ErrorSlice) -> dict:
    """Errors of one call's slice against the float64 reference: output, final state and the
    worst gradient of the per-token inputs and the initial state (``None`` gradients: a
    forward only)."""
    (ref_out, ref_state), ref_grads = reference
    errors = dict(out=runner.relative_error(view.take("o", out), ref_out),
                  state=runner.relative_error(view.take("state", state), ref_state))
    if grads is not None:
        per_input = {n: runner.relative_error(view.take(n, g), ref_grads[n])
                     for n, g in grads.items() if n not in PARAMETERS and np.ndim(g) > 1}
        worst = max(per_input, key=per_input.get)
        errors.update(worst_grad=per_input[worst], worst_input=worst)
    return errors


# ---------------------------------------------------------------------------------------------
# Contenders

def run_ours(op, backend, arrays, cotangents, case, args, reference, view):
    """Rows of one rwkv_jax backend ("default": the op's own choice)."""
    name = None if backend == "default" else backend
    batch, _, heads, head_size = case.shape
    sequences = len(case.options["cu_seqlens"]) - 1 if "cu_seqlens" in case.options else batch
    shape_class = dict(sequence_heads=sequences * heads, key=head_size, value=head_size,
                       dtype=DTYPES[args.dtype])
    resolved = backends.resolve(op, name, DTYPES[args.dtype], shape_class)[0]
    names = tuple(arrays)
    forward = bind(functools.partial(getattr(rwkv_jax, op), backend=name), names, case.options)
    xs = tuple(jax.device_put(x) for x in arrays.values())
    cots = jax.device_put(cotangents)
    errors = None
    if reference is not None:
        (out, state), grads = jax.jit(vjp_function(forward))(xs, cots)
        errors = slice_errors(out, state, dict(zip(names, grads)), reference, view)
        del out, state, grads
    timed = {}
    if "fwd" in args.passes:
        timed["fwd"] = runner.time_jax(forward, xs, args)
    if "fwd+bwd" in args.passes:
        timed["fwd+bwd"] = runner.time_jax(vjp_function(forward), (xs, cots), args)
    label = backend if backend != "default" else f"default ({resolved})"
    return label, dict(backend=resolved), timed, errors


def run_fla(op, arrays, cotangents, case, args, reference, view):
    """Rows of fla's kernel for ``op`` on the same (rounded) inputs and cotangents."""
    import importlib

    import torch
    functions = {"rwkv7": ("fla.ops.rwkv7", "chunk_rwkv7", tuple("rwkvab")),
                 "rwkv6": ("fla.ops.rwkv6", "chunk_rwkv6", tuple("rkvwu")),
                 "gated_linear_attention": ("fla.ops.gla", "chunk_gla", ("q", "k", "v", "gk"))}
    module, function, names = functions[op]
    fla_op = getattr(importlib.import_module(module), function)
    dtype = getattr(torch, args.dtype)
    to_torch = lambda x, to: torch.from_numpy(np.asarray(x).astype(np.float32)).cuda().to(to)
    leaves = {n: to_torch(x, torch.float32 if n == "initial_state" else dtype).requires_grad_(True)
              for n, x in arrays.items()}
    d_out = to_torch(cotangents[0], dtype)
    d_state = to_torch(cotangents[1], torch.float32)
    options = dict(scale=case.options.get("scale", 1.0), output_final_state=True,
                   initial_state=leaves["initial_state"])
    if "cu_seqlens" in case.options:
        options["cu_seqlens"] = torch.tensor(case.options["cu_seqlens"], device="cuda").long()
    configuration = "defaults"
    if op == "rwkv7" and float(arrays["w"].min()) >= FLA_RWKV7_LOWER_BOUND:
        options.update(FLA_RWKV7_FASTEST)
        configuration = "fastest: " + ", ".join(f"{k}={v}" for k, v in FLA_RWKV7_FASTEST.items())

    def forward():
        return fla_op(*(leaves[n] for n in names), **options)

    def forward_backward():
        out, state = forward()
        torch.autograd.backward((out, state), (d_out, d_state))

    def clear():
        for t in leaves.values():
            t.grad = None

    errors = None
    if reference is not None:
        clear()
        out, state = forward()
        torch.autograd.backward((out, state), (d_out, d_state))
        to_numpy = lambda t: t.detach().float().cpu().numpy()
        grads = {n: to_numpy(leaves[n].grad) for n in (*names, "initial_state")}
        errors = slice_errors(to_numpy(out), to_numpy(state), grads, reference, view)
    held = [*leaves.values(), d_out, d_state]
    timed = {}
    if "fwd" in args.passes:
        with torch.no_grad():
            timed["fwd"] = runner.time_torch(forward, args, held=held)
    if "fwd+bwd" in args.passes:
        timed["fwd+bwd"] = runner.time_torch(forward_backward, args, before=clear, held=held)
    return f"fla {function}", dict(configuration=configuration), timed, errors


def describe(row) -> str:
    head = (f"{row['op']:22s} {'x'.join(map(str, row['shape'])):14s} {row['dtype']:8s} "
            f"{row['name']:24s} {row['pass']:8s}")
    if "absent" in row or "error" in row:
        return f"{head} {'absent' if 'absent' in row else 'FAILED'}: {row.get('absent') or row['error']}"
    errors = row.get("errors") or {}
    text = "".join(f" {k} {errors[k]:.1e}" for k in ("out", "state", "worst_grad") if k in errors)
    return (f"{head} {row['median_ms']:10.3f} ms  peak {runner.size_text(row['peak_bytes']):>10s}"
            f"{'  err' + text if text else ''}")


def main(argv=None):
    args = parse_args(argv)
    rows = runner.Rows("ops", args.json)
    where = backends.platform()
    for op in (OPS[o] for o in args.ops):
        for shape in args.shapes:
            common = dict(op=op, shape=list(shape), dtype=args.dtype, packed=args.packed,
                          tokens=shape[0] * shape[1])
            case, arrays, cotangents = make_inputs(op, shape, args.dtype, args.packed)
            view = ErrorSlice.of(op, shape, args.error_heads, bool(args.packed))
            reference = (float64_reference(case, arrays, cotangents, view)
                         if args.error_heads else None)
            contenders = []
            for backend in args.backends:
                absent = None
                if backend != "default":
                    absent = backends.unavailable_reason(backend, where) or (
                        None if backends.implements(backend, op)
                        else f"backend {backend} does not implement {op}")
                contenders.append((backend, absent, functools.partial(run_ours, op, backend)))
            for peer in args.peers:
                absent = runner.peer_absent(peer) or (
                    "fla has no RWKV-4 kernel" if op == "rwkv4" else None)
                contenders.append((peer, absent, functools.partial(run_fla, op)))
            for name, absent, run in contenders:
                if absent is not None:
                    for pass_name in args.passes:
                        row = dict(common, name=name, **{"pass": pass_name}, absent=absent)
                        rows.add(row, describe(row))
                    continue
                try:
                    label, extra, timed, errors = run(arrays, cotangents, case, args, reference,
                                                      view)
                except Exception as err:  # one failing contender must not hide the others
                    for pass_name in args.passes:
                        row = dict(common, name=name, **{"pass": pass_name},
                                   error=runner.error_text(err))
                        rows.add(row, describe(row))
                    continue
                for pass_name, timing in timed.items():
                    row_errors = errors
                    if errors is not None and pass_name == "fwd":
                        row_errors = {k: errors[k] for k in ("out", "state")}
                    row = dict(common, name=label, **{"pass": pass_name}, **extra, **timing,
                               tokens_per_s=common["tokens"] / (timing["median_ms"] / 1e3),
                               errors=row_errors)
                    rows.add(row, describe(row))
    return rows.rows


if __name__ == "__main__":
    main()

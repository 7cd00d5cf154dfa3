"""Official RWKV-7 and RWKV-6 checkpoints <-> :class:`rwkv_jax.nn.RWKV7LM`, :class:`RWKV6LM`.

An official checkpoint is a flat dict with the names of BlinkDL's RWKV-LM (``emb.weight``,
``blocks.{i}.att.w1``, ``blocks.{i}.ffn.key.weight``, ``head.weight``, ...): per-channel
parameters are ``[1, 1, C]``, linear weights ``[out, in]``. :func:`load_rwkv7` reads one (a
``.pth`` as torch.save writes it, read without torch; ``.safetensors``; ``.npz``; or a dict of
arrays), infers the model sizes from the shapes, checks every name and shape, and returns the
model;
:func:`rwkv7_state_dict` gives a model's weights in the official format and :func:`save_rwkv7`
writes them to a file.

RWKV-6 ("Finch") checkpoints go the same way through :func:`load_rwkv6`,
:func:`rwkv6_state_dict` and :func:`save_rwkv6` (names ``blocks.{i}.att.time_maa_x``, ...).
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
import re
import types
import warnings
import zipfile
import zlib
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .._files import write_atomically
from .._pth import open_pth, write_pth
from .rwkv6 import RWKV6ChannelMix, RWKV6Config, RWKV6LM, RWKV6TimeMix
from .rwkv7 import RWKV7Config, RWKV7LM

# The official trainer creates v0/v1/v2 in every layer, but layer 0 never uses them (its value
# is the one carried to later layers): accepted and dropped.
_UNUSED_IN_LAYER0 = ("v0", "v1", "v2")


def read_checkpoint(path) -> dict[str, np.ndarray]:
    """The arrays of a ``.pth``/``.pt``, ``.safetensors`` or ``.npz`` file."""
    with _open_checkpoint(path) as checkpoint:
        return {name: checkpoint.read(name) for name in checkpoint.names}


class _Checkpoint:
    """A checkpoint's names, and each array's shape and values read only when asked for: a file
    from an untrusted source is checked by its names and shapes before any array is read."""

    def __init__(self, names, shape, read):
        self.names = dict.fromkeys(names)   # in file order, with fast membership
        self.shape = shape   # name -> tuple, without reading the values where the format allows
        self.read = read     # name -> numpy array (16-bit floats widened, see _to_numpy)


@contextlib.contextmanager
def _open_checkpoint(source):
    if isinstance(source, Mapping):
        yield _Checkpoint(source, lambda name: tuple(np.shape(source[name])),
                          lambda name: _to_numpy(source[name]))
        return
    if not isinstance(source, (str, bytes, os.PathLike)):
        raise TypeError(f"source must be a checkpoint path or a dict of arrays, got "
                        f"{type(source).__name__}")
    path = os.fsdecode(source)
    suffix = os.path.splitext(path)[1].lower()
    if suffix in (".pth", ".pt"):
        pth = open_pth(path)   # no torch: rwkv_jax/_pth.py
        yield _Checkpoint(pth.tensors, lambda name: pth.tensors[name].shape,
                          lambda name: _to_numpy(pth.read(name)))
    elif suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open
        with _damage_named(path, SafetensorError), safe_open(path, framework="flax") as data:
            # As JAX arrays: bfloat16 works.
            yield _Checkpoint(data.keys(), lambda name: tuple(data.get_slice(name).get_shape()),
                              lambda name: _to_numpy(data.get_tensor(name)))
    elif suffix == ".npz":
        with _open_npz(path) as checkpoint:
            yield checkpoint
    else:
        raise ValueError(f"checkpoint path must end in .pth, .pt, .safetensors or .npz, "
                         f"got {path!r}")


@contextlib.contextmanager
def _damage_named(path, *errors):
    """The reader's own ``errors`` (a truncated file, a bad checksum) as a ValueError that names
    ``path``, as every other unreadable file gives."""
    try:
        yield
    except errors as err:
        raise ValueError(f"{path} cannot be read (a damaged or truncated file?): "
                         f"{type(err).__name__}: {err}") from err


@contextlib.contextmanager
def _open_npz(path):
    """An ``.npz`` read member by member from its zip directory: a member is decompressed only
    when its array is read, and its shape comes from its ``.npy`` header alone."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as err:
        raise ValueError(f"{path} is not an .npz file (a zip archive of .npy arrays): "
                         f"{err}") from err
    with archive:
        # np.savez names each array NAME.npy; other members are listed as they are (and so are
        # unknown names).
        members = {(info.filename[:-4] if info.filename.endswith(".npy") else info.filename):
                   info for info in archive.infolist()}

        def header(member):
            version = np.lib.format.read_magic(member)
            if version == (1, 0):
                return np.lib.format.read_array_header_1_0(member)
            if version == (2, 0):
                return np.lib.format.read_array_header_2_0(member)
            return None

        damaged = functools.partial(_damage_named, path, zipfile.BadZipFile, zlib.error,
                                    EOFError)

        def shape(name):
            with damaged(), archive.open(members[name]) as member:
                found = header(member)
            return tuple(found[0]) if found else read(name).shape

        def read(name):
            if not members[name].filename.endswith(".npy"):
                raise ValueError(f"{path}: member {members[name].filename!r} is not a .npy array")
            with damaged(), archive.open(members[name]) as member:
                return _to_numpy(np.lib.format.read_array(member, allow_pickle=False))

        yield _Checkpoint(members, shape, read)


def _to_numpy(x):
    """A numpy array; 16-bit floats (bfloat16 in released models) widened to float32. A jax
    array split across processes is all-gathered first: a collective, so every process calls."""
    if hasattr(x, "detach"):  # a torch tensor: numpy cannot take bfloat16 from torch
        x = x.detach().cpu()
        return (x.float() if x.is_floating_point() and x.element_size() < 4 else x).numpy()
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    x = np.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4:
        return x.astype(np.float32)
    return x


def _lm_layout(cfg, layer_layout) -> dict[str, tuple[tuple, tuple, str]]:
    """Official name -> (path in the model, official shape with named sizes, kind) of a whole
    language model: the embedding, the output, each block's norms and its layers
    (``layer_layout(cfg, i)``, paths from the block). ``kind``: "linear" (the model's kernel
    is the transpose), "channel" ([1, 1, C] stored as [C]) or "same"."""
    c, v = ("C", cfg.n_embd), ("vocab", cfg.vocab_size)
    layout = {"emb.weight": (("emb", "embedding"), (v, c), "same"),
              "ln_out.weight": (("ln_out", "scale"), (c,), "same"),
              "ln_out.bias": (("ln_out", "bias"), (c,), "same"),
              "head.weight": (("head", "kernel"), (v, c), "linear")}
    for i in range(cfg.n_layer):
        block = ("blocks", i)
        for norm in (["ln0"] if i == 0 else []) + ["ln1", "ln2"]:
            layout[f"blocks.{i}.{norm}.weight"] = (block + (norm, "scale"), (c,), "same")
            layout[f"blocks.{i}.{norm}.bias"] = (block + (norm, "bias"), (c,), "same")
        for name, (path, named_shape, kind) in layer_layout(cfg, i).items():
            layout[name] = (block + path, named_shape, kind)
    return layout


def _layout(cfg: RWKV7Config) -> dict[str, tuple[tuple, tuple, str]]:
    """The official layout of an RWKV-7 model (see :func:`_lm_layout`)."""
    return _lm_layout(cfg, _rwkv7_layout)


def _rwkv7_layout(cfg: RWKV7Config, i: int):
    c, f = ("C", cfg.n_embd), ("F", cfg.dim_ffn)
    h, n = ("H", cfg.n_head), ("N", cfg.head_size)
    one = ("1", 1)
    widths = dict(w=("D_decay", cfg.decay_lora), a=("D_a", cfg.a_lora),
                  v=("D_v", cfg.v_lora), g=("D_gate", cfg.gate_lora))
    layout = {}
    channels = ["x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "k_k", "k_a"]
    loras = ["w", "a", "g"] + (["v"] if i > 0 else [])
    channels += ["v0"] if i > 0 else []
    for name in channels:
        layout[f"blocks.{i}.att.{name}"] = (("att", name), (one, one, c), "channel")
    for name in loras:
        layout[f"blocks.{i}.att.{name}1"] = (("att", name + "1"), (c, widths[name]), "same")
        layout[f"blocks.{i}.att.{name}2"] = (("att", name + "2"), (widths[name], c), "same")
    layout[f"blocks.{i}.att.r_k"] = (("att", "r_k"), (h, n), "same")
    for name in ("receptance", "key", "value", "output"):
        layout[f"blocks.{i}.att.{name}.weight"] = (("att", name, "kernel"), (c, c), "linear")
    layout[f"blocks.{i}.att.ln_x.weight"] = (("att", "ln_x", "scale"), (c,), "same")
    layout[f"blocks.{i}.att.ln_x.bias"] = (("att", "ln_x", "bias"), (c,), "same")
    layout[f"blocks.{i}.ffn.x_k"] = (("ffn", "x_k"), (one, one, c), "channel")
    layout[f"blocks.{i}.ffn.key.weight"] = (("ffn", "key", "kernel"), (f, c), "linear")
    layout[f"blocks.{i}.ffn.value.weight"] = (("ffn", "value", "kernel"), (c, f), "linear")
    return layout


def _shape_text(named):
    return "[" + ", ".join(name if name == "1" else f"{name}={size}" for name, size in named) + "]"


def _dim(checkpoint: _Checkpoint, name, axis, what):
    if name not in checkpoint.names:
        raise ValueError(f"the checkpoint has no {name!r}, needed to infer {what}")
    shape = checkpoint.shape(name)
    if len(shape) <= abs(axis):
        raise ValueError(f"{name} must have at least {abs(axis) + 1} dims (to infer {what}), "
                         f"got shape {shape}")
    return int(shape[axis])


def _short(name: str, limit: int = 80) -> str:
    return name if len(name) <= limit else name[:limit - 3] + "..."


def _layer_count(names) -> int:
    """``max(i) + 1`` over the names ``blocks.{i}.*``, each ``i`` checked against what the
    checkpoint can hold (every layer below it needs names too, so ``i < len(names)``) before
    any set of layers is built."""
    found = [(name, m.group(1)) for name in names if (m := re.match(r"blocks\.(\d+)\.", name))]
    if not found:
        raise ValueError("the checkpoint has no blocks.{i}.* parameters: not an RWKV model")
    for name, index in found:
        if len(index) > len(str(len(names))) or int(index) >= len(names):
            raise ValueError(f"the checkpoint's name {_short(name)!r} gives a layer index beyond "
                             f"what its {len(names)} names can hold (at most {len(names)} layers)")
    layers = {int(index) for _, index in found}
    n_layer = max(layers) + 1
    missing = sorted(set(range(n_layer)) - layers)
    if missing:
        raise ValueError(f"the checkpoint has blocks up to {n_layer - 1} but none of blocks "
                         f"{missing}")
    return n_layer


def rwkv7_config(params) -> RWKV7Config:
    """The model sizes of an official RWKV-7 checkpoint (a dict of arrays or a file), inferred
    from its names and shapes."""
    with _open_checkpoint(params) as checkpoint:
        return _rwkv7_config(checkpoint)


def _rwkv7_config(checkpoint: _Checkpoint) -> RWKV7Config:
    n_layer = _layer_count(checkpoint.names)
    _check_version(checkpoint, 7)
    value_layer = 1 if n_layer > 1 else 0
    dim = functools.partial(_dim, checkpoint)
    return RWKV7Config(
        vocab_size=dim("emb.weight", 0, "the vocabulary size"),
        n_embd=dim("emb.weight", 1, "n_embd"),
        n_layer=n_layer,
        head_size=dim("blocks.0.att.r_k", 1, "the head size ([H, N])"),
        dim_ffn=dim("blocks.0.ffn.key.weight", 0, "the channel-mix width"),
        decay_lora=dim("blocks.0.att.w1", 1, "the decay LoRA width"),
        a_lora=dim("blocks.0.att.a1", 1, "the in-context-rate LoRA width"),
        v_lora=(dim(f"blocks.{value_layer}.att.v1", 1, "the value-residual LoRA width")
                if n_layer > 1 or "blocks.0.att.v1" in checkpoint.names else None),
        gate_lora=dim("blocks.0.att.g1", 1, "the gate LoRA width"))


def _variable(model, path):
    node = model
    for step in path:
        node = node[step] if isinstance(step, int) else getattr(node, step)
    return node


def _fill(root, layout, checkpoint: _Checkpoint, what, tolerated=(),
          param_dtype=jnp.float32):
    """Check the names, then the shapes of ``checkpoint`` against ``layout`` (before reading
    any array), and set every parameter of ``root`` from it."""
    unknown = sorted(set(checkpoint.names) - set(layout) - set(tolerated))
    missing = sorted(set(layout) - set(checkpoint.names))
    if unknown or missing:
        raise ValueError(f"checkpoint names do not match {what}: unknown "
                         f"{[_short(name) for name in unknown[:20]]}"
                         f"{f' and {len(unknown) - 20} more' if len(unknown) > 20 else ''}, "
                         f"missing {missing}")
    flat_shapes = {}
    for name, (path, named_shape, kind) in layout.items():
        official = tuple(size for _, size in named_shape)
        flat_shapes[name] = official[2:] if kind == "channel" else official
        if checkpoint.shape(name) not in (official, flat_shapes[name]):
            raise ValueError(f"{name} must have shape {official} {_shape_text(named_shape)} for "
                             f"{what}, got {checkpoint.shape(name)}")
    non_finite = []
    for name, (path, named_shape, kind) in layout.items():
        value = checkpoint.read(name)
        if not np.issubdtype(value.dtype, np.floating):
            raise TypeError(f"{name} must be floating point, got dtype {value.dtype}")
        if not np.isfinite(value).all():
            non_finite.append(name)
        value = value.reshape(flat_shapes[name])
        _variable(root, path).set_value(jnp.asarray(value.T if kind == "linear" else value,
                                                    param_dtype))
    if non_finite:
        # Loaded as they are (NaN in, NaN out), but said: such a model gives NaN or inf.
        warnings.warn(f"the checkpoint for {what} holds NaN or inf in {len(non_finite)} "
                      f"tensors: {non_finite[:20]}{' ...' if len(non_finite) > 20 else ''}",
                      RuntimeWarning, stacklevel=3)


def load_rwkv7(source, *, dtype=jnp.float32, param_dtype=jnp.float32) -> RWKV7LM:
    """An :class:`RWKV7LM` holding the weights of an official RWKV-7 checkpoint.

    ``source``: a path (``.pth``/``.pt``, read without torch; ``.safetensors``, ``.npz``) or a
    mapping from official names to arrays. Every expected name must be present with its official
    shape (per-channel ``[1, 1, C]`` parameters may also come flat as ``[C]``); unknown names
    are errors, except ``blocks.0.att.v0/v1/v2``, which layer 0 does not use.
    """
    with _open_checkpoint(source) as checkpoint:
        cfg = _rwkv7_config(checkpoint)
        # Build the model abstractly (no random init), then fill in every parameter.
        model = nnx.eval_shape(lambda: RWKV7LM(cfg, dtype=dtype, param_dtype=param_dtype,
                                               rngs=nnx.Rngs(0)))
        tolerated = [f"blocks.0.att.{name}" for name in _UNUSED_IN_LAYER0]
        _fill(model, _layout(cfg), checkpoint, f"an RWKV-7 model with {cfg}", tolerated,
              param_dtype)
    return model


def rwkv7_state_dict(model: RWKV7LM) -> dict[str, np.ndarray]:
    """The model's weights under the official names and shapes: float32 numpy arrays that are
    C-contiguous and writable (their own memory), so any writer (``safetensors``, ``np.savez``,
    ``torch.from_numpy``) stores them as the official layout. Parameters split across processes
    are gathered, so with those every process must call it (each gets the whole dict)."""
    return _state_dict(model, _layout(model.config))


def _state_dict(model, layout) -> dict[str, np.ndarray]:
    out = {}
    for name, (path, named_shape, kind) in layout.items():
        value = _to_numpy(_variable(model, path).get_value()).astype(np.float32, copy=False)
        value = value.T if kind == "linear" else value
        # A transpose is a Fortran-ordered view: writers that take the buffer as it lies in
        # memory would store the matrix transposed. Copy into C order.
        out[name] = np.array(value.reshape(tuple(size for _, size in named_shape)), order="C")
    return out


def save_rwkv7(model: RWKV7LM, path) -> None:
    """Write ``model`` as an official RWKV-7 checkpoint (float32) that :func:`load_rwkv7` and
    the official code read: ``.safetensors``, ``.npz``, or ``.pth``/``.pt`` (torch's zip
    layout, written without torch).

    With several processes (``jax.distributed``) every process calls it: parameters split across
    processes are gathered, process 0 alone writes ``path``, and every process returns once the
    file is written (or raises if process 0 could not write it)."""
    _save(model, path, RWKV7LM, rwkv7_state_dict)


def _save(model, path, model_type, state_dict) -> None:
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a str, bytes or os.PathLike file name, got "
                        f"{type(path).__name__} {path!r}")
    path = os.fsdecode(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".pth", ".pt", ".safetensors", ".npz"):
        raise ValueError(f"path must end in .pth, .pt, .safetensors or .npz, got {path!r}")
    if not isinstance(model, model_type):
        raise TypeError(f"model must be an {model_type.__name__}, got {type(model).__name__}")
    params = state_dict(model)
    if jax.process_count() == 1:
        _write_checkpoint(params, path, suffix)
        return
    from jax.experimental import multihost_utils
    error = None
    if jax.process_index() == 0:
        try:
            _write_checkpoint(params, path, suffix)
        except Exception as err:  # the others learn of it below instead of waiting for ever
            error = err
    written = bool(multihost_utils.broadcast_one_to_all(np.bool_(error is None)))
    if error is not None:
        raise error
    if not written:
        raise RuntimeError(f"process 0 could not write {path}; its exception says why")


def _write_checkpoint(params, path, suffix):
    if suffix == ".safetensors":
        from safetensors.numpy import save
        write = lambda f: f.write(save(params))
    elif suffix == ".npz":
        write = lambda f: np.savez(f, **params)  # a file object: a name would get ".npz" added
    else:
        write = lambda f: write_pth(f, params)
    write_atomically(path, write)


def _rwkv6_layout(cfg: RWKV6Config, layer_id: int):
    c, f = ("C", cfg.n_embd), ("F", cfg.dim_ffn)
    h, n, one = ("H", cfg.n_head), ("N", cfg.head_size), ("1", 1)
    mix, decay = ("D_mix", cfg.mix_lora), ("D_decay", cfg.decay_lora)
    att, ffn = f"blocks.{layer_id}.att.", f"blocks.{layer_id}.ffn."
    layout = {att + name: (("att", name), (one, one, c), "channel")
              for name in ("time_maa_x", "time_maa_w", "time_maa_k", "time_maa_v", "time_maa_r",
                           "time_maa_g", "time_decay")}
    layout.update({
        att + "time_maa_w1": (("att", "time_maa_w1"), (c, ("5*D_mix", 5 * cfg.mix_lora)), "same"),
        att + "time_maa_w2": (("att", "time_maa_w2"), (("5", 5), mix, c), "same"),
        att + "time_decay_w1": (("att", "time_decay_w1"), (c, decay), "same"),
        att + "time_decay_w2": (("att", "time_decay_w2"), (decay, c), "same"),
        att + "time_faaaa": (("att", "time_faaaa"), (h, n), "same"),
        att + "ln_x.weight": (("att", "ln_x", "scale"), (c,), "same"),
        att + "ln_x.bias": (("att", "ln_x", "bias"), (c,), "same"),
        ffn + "time_maa_k": (("ffn", "time_maa_k"), (one, one, c), "channel"),
        ffn + "time_maa_r": (("ffn", "time_maa_r"), (one, one, c), "channel"),
        ffn + "key.weight": (("ffn", "key", "kernel"), (f, c), "linear"),
        ffn + "receptance.weight": (("ffn", "receptance", "kernel"), (c, c), "linear"),
        ffn + "value.weight": (("ffn", "value", "kernel"), (c, f), "linear"),
    })
    for name in ("receptance", "key", "value", "gate", "output"):
        layout[att + name + ".weight"] = (("att", name, "kernel"), (c, c), "linear")
    return layout


def load_rwkv6_layer(source, layer_id: int, *, dtype=jnp.float32, param_dtype=jnp.float32):
    """``(RWKV6TimeMix, RWKV6ChannelMix)`` holding layer ``layer_id`` (``blocks.{i}.att.*`` and
    ``blocks.{i}.ffn.*``) of an official RWKV-6 ("x060") checkpoint (a path or a dict of
    arrays); the sizes come from the shapes. Other layers' names are ignored."""
    if isinstance(layer_id, (bool, np.bool_)) or not isinstance(layer_id, numbers.Integral):
        raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__} {layer_id!r}")
    if layer_id < 0:
        raise ValueError(f"layer_id must be >= 0, got {layer_id}")
    layer_id = int(layer_id)
    with _open_checkpoint(source) as whole:
        prefixes = (f"blocks.{layer_id}.att.", f"blocks.{layer_id}.ffn.")
        checkpoint = _Checkpoint([name for name in whole.names if name.startswith(prefixes)],
                                 whole.shape, whole.read)
        cfg = RWKV6Config(n_layer=layer_id + 1, **_rwkv6_sizes(checkpoint, layer_id))
        rngs = nnx.Rngs(0)
        layers = types.SimpleNamespace(
            att=RWKV6TimeMix(cfg, layer_id, dtype=dtype, param_dtype=param_dtype, rngs=rngs),
            ffn=RWKV6ChannelMix(cfg, layer_id, dtype=dtype, param_dtype=param_dtype, rngs=rngs))
        _fill(layers, _rwkv6_layout(cfg, layer_id), checkpoint,
              f"RWKV-6 layer {layer_id} with {cfg}", param_dtype=param_dtype)
    return layers.att, layers.ffn


def _rwkv6_sizes(checkpoint: _Checkpoint, layer_id: int) -> dict:
    """The layer sizes of an RWKV-6 checkpoint, from the shapes of layer ``layer_id``."""
    att, ffn = f"blocks.{layer_id}.att.", f"blocks.{layer_id}.ffn."
    dim = functools.partial(_dim, checkpoint)
    n_embd = dim(att + "time_maa_x", -1, "n_embd")
    n_head = dim(att + "time_faaaa", 0, "the number of heads ([H, N])")
    head_size = dim(att + "time_faaaa", 1, "the head size ([H, N])")
    if n_head * head_size != n_embd:
        raise ValueError(f"{att}time_faaaa must be [H, N] with H * N = n_embd = {n_embd}, got "
                         f"{checkpoint.shape(att + 'time_faaaa')}")
    return dict(n_embd=n_embd, head_size=head_size,
                dim_ffn=dim(ffn + "key.weight", 0, "the channel-mix width"),
                mix_lora=dim(att + "time_maa_w2", 1, "the token-shift LoRA width"),
                decay_lora=dim(att + "time_decay_w1", 1, "the decay LoRA width"))


def _rwkv6_lm_layout(cfg: RWKV6Config):
    """The official layout of an RWKV-6 model (see :func:`_lm_layout`)."""
    return _lm_layout(cfg, _rwkv6_layout)


def rwkv6_config(params) -> RWKV6Config:
    """The model sizes of an official RWKV-6 checkpoint (a dict of arrays or a file), inferred
    from its names and shapes."""
    with _open_checkpoint(params) as checkpoint:
        return _rwkv6_config(checkpoint)


def _rwkv6_config(checkpoint: _Checkpoint) -> RWKV6Config:
    n_layer = _layer_count(checkpoint.names)
    _check_version(checkpoint, 6)
    return RWKV6Config(vocab_size=_dim(checkpoint, "emb.weight", 0, "the vocabulary size"),
                       n_layer=n_layer, **_rwkv6_sizes(checkpoint, 0))


def _check_version(checkpoint: _Checkpoint, version: int):
    """A clear error for a checkpoint of another RWKV version, told by a name only it has."""
    marks = {"RWKV-7": ("blocks.0.att.r_k", "load it with load_rwkv7"),
             "RWKV-6": ("blocks.0.att.time_maa_x", "load it with load_rwkv6"),
             "RWKV-5 (or older)": ("blocks.0.att.time_mix_k", "those are not supported")}
    found = [kind for kind, (name, _) in marks.items() if name in checkpoint.names]
    if found and f"RWKV-{version}" not in found:
        name, use = marks[found[0]]
        raise ValueError(f"this is an {found[0]} checkpoint (it has {name!r}), not "
                         f"RWKV-{version}: {use}")


def load_rwkv6(source, *, dtype=jnp.float32, param_dtype=jnp.float32) -> RWKV6LM:
    """An :class:`RWKV6LM` holding the weights of an official RWKV-6 ("Finch", "x060")
    checkpoint.

    ``source`` as in :func:`load_rwkv7`. Every expected name must be present with its official
    shape (per-channel ``[1, 1, C]`` parameters may also come flat as ``[C]``), unknown names
    are errors; the names and shapes are checked before any array is read.
    """
    with _open_checkpoint(source) as checkpoint:
        cfg = _rwkv6_config(checkpoint)
        model = nnx.eval_shape(lambda: RWKV6LM(cfg, dtype=dtype, param_dtype=param_dtype,
                                               rngs=nnx.Rngs(0)))
        _fill(model, _rwkv6_lm_layout(cfg), checkpoint, f"an RWKV-6 model with {cfg}",
              param_dtype=param_dtype)
    return model


def rwkv6_state_dict(model: RWKV6LM) -> dict[str, np.ndarray]:
    """The model's weights under the official RWKV-6 names and shapes (as
    :func:`rwkv7_state_dict`)."""
    return _state_dict(model, _rwkv6_lm_layout(model.config))


def save_rwkv6(model: RWKV6LM, path) -> None:
    """Write ``model`` as an official RWKV-6 checkpoint (float32), as :func:`save_rwkv7`."""
    _save(model, path, RWKV6LM, rwkv6_state_dict)

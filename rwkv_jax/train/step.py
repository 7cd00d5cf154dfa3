"""The training step: one jitted function from (train state, a step's tokens) to the next state.

An RWKV7LM in ``compute_dtype`` with parameters in ``param_dtype`` (float32 master weights, or
bfloat16) and a float32 optimizer state: the gradient of each micro-batch accumulates in float32
inside the step (``lax.scan`` over the micro-batches), then one AdamW update, whose moments and
arithmetic are float32 whatever the parameters' dtype (the update is rounded to it once, at the
end). The loss is :func:`rwkv_jax.nn.chunked_cross_entropy` on ``model.hidden``'s output (never
the full float32 logits), with RWKV-LM's L2-wrap gradient as an option. The train state is
donated: its buffers are reused for the next one.

With documents (``TrainConfig.documents``) a batch also brings ``resets`` (True where a document
begins: the model restarts its state there, rows kept) and loss ``weights`` (0 for a target
predicted across a reset); the step's loss and gradient are then the token-weighted mean over
all its micro-batches, ``sum(weights * ce) / sum(weights)``, not a mean of their means.

Weight decay as RWKV-LM's ``configure_optimizers`` puts it: on every parameter that is a 2-D
``.weight`` there, that is the embedding, the head and the block's projection matrices
(``kernel``/``embedding`` here); not on the norms, the token-shift mixes, decays, biases, the
LoRA matrices ``w1, w2, a1, ...`` or ``r_k``. ``w0`` learns at ``w0_lr_scale`` times the rate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ..nn import RWKV7LM, chunked_cross_entropy
from ..nn.common import embed
from . import mesh as meshes
from .config import DTYPES

DECAYED = ("kernel", "embedding")
# The primitives through which the backends launch their kernels. "save_wkv" keeps what they
# return (the wkv outputs and the residuals their backward reads: naming the outputs alone would
# run the forward kernel again for the residuals) and recomputes the rest of the block. The
# backends written in jax.numpy (native, chunked) launch none: there it recomputes as "block".
KERNEL_PRIMITIVES = ("ffi_call", "triton_kernel_call", "pallas_call", "pure_callback")


def _name(path) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))


def decay_mask(params):
    """True for the parameters that weight decay applies to (see the module's docstring)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: _name(path) in DECAYED and len(x.shape) == 2, params)


def schedule(config) -> optax.Schedule:
    """Linear warm-up to ``learning_rate`` over ``warmup_steps``, then cosine down to
    ``final_lr_fraction`` of it at ``steps`` (or constant)."""
    peak = config.learning_rate
    if config.schedule == "constant":
        return optax.join_schedules([optax.linear_schedule(0.0, peak, config.warmup_steps),
                                     optax.constant_schedule(peak)], [config.warmup_steps])
    return optax.warmup_cosine_decay_schedule(
        0.0, peak, config.warmup_steps, max(config.steps, config.warmup_steps + 1),
        end_value=peak * config.final_lr_fraction)


def optimizer(config, params) -> optax.GradientTransformation:
    """Clipping, AdamW with RWKV-LM's decay mask and ``w0``'s learning-rate scale."""
    parts = [optax.clip_by_global_norm(config.clip)] if config.clip else []
    parts.append(optax.adamw(schedule(config), config.beta1, config.beta2, config.eps,
                             weight_decay=config.weight_decay, mask=decay_mask(params)))
    if config.w0_lr_scale != 1:
        w0 = jax.tree_util.tree_map_with_path(lambda path, _: _name(path) == "w0", params)
        parts.append(optax.masked(optax.scale(config.w0_lr_scale), w0))
    return optax.chain(*parts)


def _float32(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def _norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def _weight(weights):
    """What a micro-batch's mean loss counts for in its step: its total weight, or 1 without
    weights (every micro-batch has as many tokens)."""
    return 1.0 if weights is None else jnp.sum(weights, dtype=jnp.float32)


def _weighted_mean(total, count):
    """``total / count``, 0 where nothing counted (every target of the step masked out)."""
    return total / jnp.where(count > 0, count, 1)


class _OptionalDocuments:
    """A jitted ``fn(first, inputs, targets, resets, weights)`` that may be called (and
    lowered) without the last two, which are then None: a batch without documents."""

    def __init__(self, jitted):
        self.jitted = jitted

    def __call__(self, first, inputs, targets, resets=None, weights=None):
        return self.jitted(first, inputs, targets, resets, weights)

    def lower(self, first, inputs, targets, resets=None, weights=None):
        return self.jitted.lower(first, inputs, targets, resets, weights)


def _kernel_outputs(primitive, *args, **params) -> bool:
    return primitive.name in KERNEL_PRIMITIVES


def _remat(fn, policy: str):
    if policy == "block":
        return jax.checkpoint(fn)
    if policy == "save_wkv":
        return jax.checkpoint(fn, policy=_kernel_outputs)
    return fn


class TrainStep:
    """The model, optimizer and jitted functions of ``config`` on ``mesh``.

    The train state is a dict: ``step`` (int32), ``params`` (the model's parameters as a nested
    dict, :func:`flax.nnx.to_pure_dict`'s layout) and ``opt_state``, every array placed by
    :mod:`rwkv_jax.train.mesh`. Batches are ``(inputs, targets)``, int32 ``[accumulation,
    micro_batch, seq_len]`` global arrays (:func:`rwkv_jax.train.mesh.global_batch`), with
    documents also ``resets`` (bool) and ``weights`` (float32) of that shape, laid out alike.

    ``init()`` the first state (the parameters drawn from ``config.seed``, each made where it
    lives: a model too big for one device never is on one); ``step(state, inputs, targets[,
    resets, weights])`` the next state and the step's metrics (loss, gradient norm, learning
    rate); ``eval_loss(params, inputs, targets[, resets, weights])`` the mean loss of a batch;
    ``model(params)`` an RWKV7LM holding ``params``.
    """

    def __init__(self, config, mesh):
        self.config, self.mesh = config, mesh
        self.model_config = config.model_config()
        dtype, param_dtype = DTYPES[config.compute_dtype], DTYPES[config.param_dtype]
        self._new_model = lambda: RWKV7LM(self.model_config, dtype=dtype,
                                          param_dtype=param_dtype, rngs=nnx.Rngs(config.seed))
        abstract = nnx.eval_shape(self._new_model)
        self.graphdef, abstract_state = nnx.split(abstract)
        self._state_tree = jax.tree.structure(abstract_state)
        abstract_params = nnx.to_pure_dict(abstract_state)
        self.parameters = sum(x.size for x in jax.tree.leaves(abstract_params))
        self.optimizer = optimizer(config, abstract_params)
        abstract_opt = jax.eval_shape(lambda p: self.optimizer.init(_float32(p)),
                                      abstract_params)
        self.param_shardings = meshes.tree_shardings(mesh, abstract_params, config.fsdp)
        self.state_shardings = dict(
            step=meshes.replicated(mesh), params=self.param_shardings,
            opt_state=meshes.tree_shardings(mesh, abstract_opt, config.fsdp))
        self.abstract_state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            dict(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
                 opt_state=abstract_opt), self.state_shardings)
        self.wkv_op = meshes.wkv_op(mesh, config.backend)
        tokens = meshes.batch_sharding(mesh)
        whole = meshes.replicated(mesh)
        batch = (tokens,) * 4   # inputs, targets, resets, weights: laid out alike
        self.step = _OptionalDocuments(jax.jit(
            self._step, in_shardings=(self.state_shardings, *batch),
            out_shardings=(self.state_shardings, whole), donate_argnums=0))
        self.eval_loss = _OptionalDocuments(jax.jit(
            self._eval_loss, in_shardings=(self.param_shardings, *batch), out_shardings=whole))

    def model(self, params) -> RWKV7LM:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._state_tree,
                                                           jax.tree.leaves(params)))

    def init(self):
        """The first train state, laid out in ``state_shardings``.

        Drawn by one program on the host's CPU, then placed shard by shard: compiled for a GPU,
        the whole initialisation in one program (every layer's draws and the orthogonal LoRA
        factors' QR decompositions) takes far longer to compile than the step itself. The draws
        are the same on every backend and process (threefry), so each process places its own
        shards of one state."""
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            state = jax.jit(self._init)()
        return jax.tree.map(
            lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i, x=np.asarray(x): x[i]),
            state, self.state_shardings)

    def _init(self):
        params = nnx.to_pure_dict(nnx.state(self._new_model()))
        return dict(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=self.optimizer.init(_float32(params)))

    def hidden(self, params, tokens, resets=None):
        """``ln_out`` of the last block's output ``[B, T, C]`` and the head's kernel: the
        model's sequence mode (``resets``: documents restarting in the rows, see
        :class:`rwkv_jax.nn.RWKV7LM`) with each block rematerialised as ``config.remat`` says
        and its parameters gathered where it runs (FSDP)."""
        lm = self.model(params)
        x = embed(meshes.gathered(self.mesh, lm.emb.embedding[...]), tokens,
                  lm.emb.dtype or lm.emb.param_dtype)
        v_first = None
        for block in lm.blocks:
            block_graph, block_state = nnx.split(block)

            def run_block(state, x, v_first, resets, block_graph=block_graph):
                block = nnx.merge(block_graph, meshes.gathered(self.mesh, state))
                return block(x, v_first, wkv_op=self.wkv_op, resets=resets)[:2]

            x, v_first = _remat(run_block, self.config.remat)(block_state, x, v_first, resets)
        return lm.ln_out(x), meshes.gathered(self.mesh, lm.head.kernel[...])

    def loss(self, params, inputs, targets, l2wrap=0.0, *, resets=None, weights=None):
        """The mean cross-entropy of one micro-batch, weighted by ``weights`` when given
        (``l2wrap``, ``weights``: see chunked_cross_entropy; ``resets``: see :meth:`hidden`)."""
        h, kernel = self.hidden(params, inputs, resets)
        chunk = min(self.config.vocab_chunk, self.config.vocab_size)
        return chunked_cross_entropy(h, kernel, targets, vocab_chunk=chunk, l2wrap=l2wrap,
                                     weights=weights)

    def _eval_loss(self, params, inputs, targets, resets, weights):
        def micro_batch(batch):
            x, y, r, w = batch
            return self.loss(params, x, y, resets=r, weights=w), _weight(w)

        losses, counts = jax.lax.map(micro_batch, (inputs, targets, resets, weights))
        return _weighted_mean(jnp.sum(losses * counts), jnp.sum(counts))

    def _step(self, state, inputs, targets, resets, weights):
        params = state["params"]
        # A micro-batch's mean loss times its weight: its sum (and the gradient's), to divide by
        # the step's total weight; the weight is the batch's, a constant to the parameters.
        grad_fn = jax.value_and_grad(lambda p, x, y, r, w: self.loss(
            p, x, y, self.config.l2wrap, resets=r, weights=w) * _weight(w))
        grad_shardings = self.param_shardings

        def micro_batch(carry, batch):
            total, loss_sum, count = carry
            weighted_loss, grads = grad_fn(params, *batch)
            grads = jax.lax.with_sharding_constraint(_float32(grads), grad_shardings)
            return (jax.tree.map(jnp.add, total, grads), loss_sum + weighted_loss,
                    count + _weight(batch[3])), None

        zeros = jax.lax.with_sharding_constraint(
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), grad_shardings)
        scalar = jnp.zeros((), jnp.float32)
        (total, loss_sum, count), _ = jax.lax.scan(micro_batch, (zeros, scalar, scalar),
                                                   (inputs, targets, resets, weights))
        grads = jax.tree.map(lambda g: _weighted_mean(g, count), total)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], _float32(params))
        metrics = dict(loss=_weighted_mean(loss_sum, count), grad_norm=_norm(grads),
                       learning_rate=schedule(self.config)(state["step"]))
        new_state = dict(step=state["step"] + 1, params=optax.apply_updates(params, updates),
                         opt_state=opt_state)
        return new_state, metrics

"""``rwkv-jax train``: the command line of :func:`rwkv_jax.train.train`, one flag per field of
:class:`rwkv_jax.train.TrainConfig` (``--seq-len`` for ``seq_len``, ...)."""

from __future__ import annotations

import argparse
import dataclasses

from ..train.config import MODEL_SIZES, REMAT_POLICIES, TrainConfig

# What each field of TrainConfig does, for its flag's --help (docs/cli.md says the same).
FIELD_HELP = {
    "train_data": "the training token file: .npy, binidx (X, X.bin or X.idx) or a flat file "
                  "of ids (then --token-dtype)",
    "eval_data": "a held-out token file for the eval loss",
    "token_dtype": "the id dtype of flat token files (uint16, uint32, ...)",
    "documents": "restart the model's state at every document of the (binidx) corpora and "
                 "leave out of the loss each document's first token",
    "vocab_size": "vocabulary size",
    "n_layer": "number of blocks",
    "n_embd": "model width, a multiple of --head-size",
    "head_size": "channels per head",
    "seq_len": "tokens per row",
    "micro_batch": "rows per micro-batch, over every process",
    "accumulation": "micro-batches accumulated per optimizer step",
    "steps": "optimizer steps of the schedule",
    "learning_rate": "peak learning rate",
    "warmup_steps": "steps of linear warm-up",
    "schedule": "cosine or constant after the warm-up",
    "final_lr_fraction": "the cosine schedule's last learning rate, as a fraction of the peak",
    "weight_decay": "AdamW's weight decay, on the embedding, the head and the projection "
                    "matrices only",
    "beta1": "AdamW's beta1",
    "beta2": "AdamW's beta2",
    "eps": "AdamW's epsilon",
    "clip": "clip gradients to this global norm (0: no clipping)",
    "w0_lr_scale": "factor on the learning rate of the decay bias w0",
    "l2wrap": "coefficient of RWKV-LM's L2-wrap term (0: off)",
    "param_dtype": "master weights' dtype: float32 or bfloat16",
    "compute_dtype": "the dtype the model computes in: float32 or bfloat16",
    "remat": "recompute in the backward: " + ", ".join(REMAT_POLICIES),
    "vocab_chunk": "vocabulary entries per chunk of the cross-entropy",
    "backend": "the rwkv7 backend of the blocks (None: the op's default here)",
    "data": "devices on the mesh's data axis (-1: every device left)",
    "seq": "devices on the mesh's sequence axis",
    "fsdp": "shard parameters and optimizer state over the data axis",
    "checkpoint_dir": "where checkpoints go; a run whose directory holds one continues from it",
    "checkpoint_every": "steps between checkpoints (and one at the end)",
    "checkpoint_keep": "how many of the latest checkpoints are kept",
    "eval_every": "steps between eval losses (and one at the end)",
    "eval_batches": "micro-batches of --eval-data the eval loss is computed on (the same "
                    "ones each time)",
    "log_path": "append a JSON line per logged step (and per eval loss) to this file",
    "log_every": "steps between log records (and the run's first and last step)",
    "seed": "seed of the parameters and of the sampling of training windows",
}


def register(commands) -> None:
    """Add the ``train`` command to an argparse ``add_subparsers`` object."""
    parser = commands.add_parser(
        "train", help="train an RWKV-7 language model on a token file",
        description="Train an RWKV-7 language model on a token file (rwkv_jax.train). A run "
        "whose --checkpoint-dir holds a checkpoint continues from the latest one.")
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default=None,
                        help="a model shape (its sizes; --n-layer etc. override them)")
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        text = f"{FIELD_HELP[field.name]} (default {default})"
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=text)
        else:
            parser.add_argument(flag, type=str if default is None else type(default),
                                default=None, help=text)
    parser.add_argument("--until", type=int, default=None,
                        help="stop after this step (the schedule still spans --steps)")
    parser.add_argument("--plot", metavar="OUT.png", default=None,
                        help="write the loss curves to this image (needs matplotlib)")
    parser.add_argument("--export", metavar="OUT.pth", default=None,
                        help="write the final model as an official checkpoint (.pth needs "
                             "torch; .safetensors, .npz)")
    parser.add_argument("--cpu-devices", type=int, default=0,
                        help="simulate this many CPU devices (tests, smoke runs)")
    parser.add_argument("--distributed", action="store_true",
                        help="one of several processes: call jax.distributed.initialize "
                             "(coordinator, process count and id from the environment)")
    parser.set_defaults(handler=run)


def config_from(args) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``rwkv-jax train`` arguments: --model's shape, then
    every flag given."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
             if getattr(args, f.name) is not None}
    if args.model is not None:
        return TrainConfig.for_model(args.model, **given)
    return TrainConfig(**given)


def run(args) -> int:
    import jax
    if args.cpu_devices:   # before anything asks JAX for its devices
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if args.distributed:
        jax.distributed.initialize()
    from ..train.loop import train
    records = train(config_from(args), until=args.until, plot=args.plot, export=args.export)
    last = next((r for r in reversed(records) if "loss" in r), None)
    if last is not None and jax.process_index() == 0:
        held_out = next((r["eval_loss"] for r in reversed(records) if "eval_loss" in r), None)
        print(f"step {last['step']}: loss {last['loss']:.4f}"
              + ("" if held_out is None else f", eval loss {held_out:.4f}"))
    return 0

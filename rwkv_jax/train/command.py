"""``rwkv-jax train``: the command line of :func:`rwkv_jax.train.train`, one flag per field of
:class:`rwkv_jax.train.TrainConfig` (``--seq-len`` for ``seq_len``, ...)."""

from __future__ import annotations

import argparse
import dataclasses

from .config import MODEL_SIZES, TrainConfig


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
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=f"(default {default})")
        else:
            parser.add_argument(flag, type=str if default is None else type(default),
                                default=None, help=f"(default {default})")
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
    from .loop import train
    records = train(config_from(args), until=args.until, plot=args.plot, export=args.export)
    last = next((r for r in reversed(records) if "loss" in r), None)
    if last is not None and jax.process_index() == 0:
        held_out = next((r["eval_loss"] for r in reversed(records) if "eval_loss" in r), None)
        print(f"step {last['step']}: loss {last['loss']:.4f}"
              + ("" if held_out is None else f", eval loss {held_out:.4f}"))
    return 0

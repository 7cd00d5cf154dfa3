"""The baseline the kernels must beat (BENCHMARKS.md): rwkv7 forward and forward+backward time
and peak memory of one backend (default: native, the lax.scan reference).

    python benchmarks/native_baseline.py                 # CPU: B=1,T=1024,H=4,K=64 float32
                                                          # GPU: B=8,T=1024,H=32,K=64 bfloat16
    python benchmarks/native_baseline.py --backend chunked

Prints a markdown table row. Peak memory is XLA's compiled memory analysis of each call
(arguments + outputs + temporaries); on a GPU the device allocator's peak over this process
(it ran nothing else) is printed too.
"""

import argparse
import os

import jax

from rwkv_jax import backends
from rwkv_jax._bench import PRESETS, device_peak_bytes, make_case
from rwkv_jax.cli.bench import bench_case

SETTINGS = {"cpu": (PRESETS["medium"], "float32"), "gpu": (PRESETS["large"], "bfloat16")}


def device_name() -> str:
    device = jax.devices()[0]
    if device.platform != "cpu":
        return device.device_kind
    model = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return f"CPU {model} ({os.cpu_count()} cores)".replace(" ()", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="native")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--max-seconds", type=float, default=60.0)
    args = parser.parse_args()

    platform = backends.platform()
    (batch, length, heads, head_size), dtype = SETTINGS.get(platform, SETTINGS["gpu"])
    case = make_case("rwkv7", batch, length, heads, head_size)
    fwd, fwd_bwd = bench_case(case, args.backend, dtype, repeats=args.repeats, warmup=2,
                              max_seconds=args.max_seconds)
    for result in (fwd, fwd_bwd):
        if "error" in result:
            raise SystemExit(f"{result['pass']}: {result['error']}")
    process_peak = device_peak_bytes()
    mb = lambda n: "-" if n is None else f"{n / 2**20:,.0f}"
    ms = lambda r: f"{r['median_ms']:.2f} / {r['min_ms']:.2f}"
    print("| device | backend | B,T,H,K | dtype | fwd ms (median / min) | fwd+bwd ms (median / min) "
          "| fwd tokens/s | fwd+bwd tokens/s | peak fwd MB | peak fwd+bwd MB | device peak MB "
          "| repeats |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {device_name()} | {args.backend} | {batch},{length},{heads},{head_size} | {dtype} "
          f"| {ms(fwd)} | {ms(fwd_bwd)} | {fwd['tokens_per_s']:,.0f} "
          f"| {fwd_bwd['tokens_per_s']:,.0f} | {mb(fwd['peak_bytes'])} | {mb(fwd_bwd['peak_bytes'])} "
          f"| {mb(process_peak)} | {fwd['repeats']}/{fwd_bwd['repeats']} |")


if __name__ == "__main__":
    main()

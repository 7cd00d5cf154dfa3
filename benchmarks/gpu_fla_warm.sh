#!/bin/bash
# Warms fla's Triton cache for the benchmark shapes, one job at a time (autotuning times kernels:
# jobs side by side would disturb each other's choices), each job into its own cache, packed to
# $OUT/fla-OP-SIZE.tar.xz (under the 16 MiB a returned file may have; carry them back in
# .gpu-cache/). A job cut by the call's limit still packs what it compiled.
#   bash benchmarks/gpu_fla_warm.sh rwkv6:64 gla:128 ...
set -o pipefail
source benchmarks/gpu_env.sh  # the wheels and the import path, as for every GPU script
trap - EXIT  # (not its one shared cache: each job here has its own)
pack() { tar -cf - -C "$TRITON_CACHE_DIR" . | xz -T0 -6 > "$OUT/fla-${job/:/-}.tar.xz"; }
trap 'pack; exit 143' TERM
for job in "$@"; do
    export TRITON_CACHE_DIR=/tmp/fla_cache/${job/:/-}
    mkdir -p "$TRITON_CACHE_DIR"
    # a carried partial pack of this job goes on from where it was cut
    carried=.gpu-cache/fla-${job/:/-}.tar.xz
    [ -f "$carried" ] && tar -xJf "$carried" -C "$TRITON_CACHE_DIR"
    # (in the background: a trapped TERM interrupts `wait` at once, not after the job)
    python3 benchmarks/gpu_fla_warm.py "$job" 2>&1 | grep -v Warning &
    wait $!
    pack
    echo "$job: $(du -sh "$TRITON_CACHE_DIR" | cut -f1) cache, packed $(du -h "$OUT/fla-${job/:/-}.tar.xz" | cut -f1)"
done

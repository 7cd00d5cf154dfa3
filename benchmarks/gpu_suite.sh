#!/usr/bin/env bash
# The GPU suite in one command, for an H100/H200 machine without internet (Python 3.12, jax 0.11.2
# with CUDA 13, triton 3.6.0, torch 2.11, pytest, nanobind, scikit-build-core, cmake, ninja, nvcc
# preinstalled; jax-triton, fla-core and rwkv carried as wheels in .whl/, see
# BUILD.md says which), set up by benchmarks/gpu_setup.sh.
#
#   OUT=/some/dir bash benchmarks/gpu_suite.sh            # every part below, in order
#   OUT=/some/dir bash benchmarks/gpu_suite.sh ops decode # only some parts (install once first)
#   QUICK=1 OUT=/some/dir bash benchmarks/gpu_suite.sh install ops decode multi-device
#                                                         # the topics at tiny shapes: a smoke run
#
# Parts: install info gpu-tests tests check ops decode multi-device train. The topics ops,
# decode and multi-device append their rows to $OUT/<part>.jsonl, train to $OUT/train.jsonl
# (QUICK) or $OUT/train/ (benchmarks/gpu_train.sh table). Each part writes
# $OUT/<part>.log and a line of $OUT/summary.tsv as soon as it ends (so a run cut short keeps
# what it did); the summary table comes last. Exit status: 0 only if every part that ran
# succeeded.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
SITE=/tmp/site
mkdir -p "$OUT"
export OUT
source benchmarks/gpu_setup.sh
# The package is installed into $SITE (with rwkv_jax.triton_kernels mapped and the extension
# built), ahead of the source tree on PYTHONPATH. PYTHONSAFEPATH keeps `python -m` and
# `python -` from putting the working directory, whose source folder rwkv_jax/ lacks both,
# ahead of it (scripts run with their own folder first, which is harmless, so they run without
# it).
export PYTHONSAFEPATH=1
PY=${PYTHON:-python3}
QUICK=${QUICK:-}

ALL_PARTS=(install info gpu-tests tests check ops decode multi-device train)
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=("${ALL_PARTS[@]}")
for part in "${parts[@]}"; do
  [[ " ${ALL_PARTS[*]} " == *" $part "* ]] || { echo "unknown part '$part'; parts: ${ALL_PARTS[*]}" >&2; exit 2; }
done

install() {
  # Its own build folder (kept between runs, so a rerun rebuilds only what changed).
  "$PY" -m pip install --no-index --no-deps --no-build-isolation --upgrade --target "$SITE" \
    -C build-dir=build/gpu-suite/{wheel_tag} . || return
  # The installed copy, not the source folder, must be what Python finds, triton_kernels included.
  "$PY" - "$SITE" <<'EOF'
import sys, rwkv_jax, rwkv_jax.triton_kernels, jax
site = sys.argv[1]
assert rwkv_jax.__file__.startswith(site), f"rwkv_jax imported from {rwkv_jax.__file__}, not {site}"
assert rwkv_jax.triton_kernels.__file__.startswith(site), rwkv_jax.triton_kernels.__file__
print("rwkv_jax from", rwkv_jax.__file__, "| triton_kernels from", rwkv_jax.triton_kernels.__file__)
print("jax", jax.__version__, "devices", jax.devices())
EOF
}

pytest_ran_tests() {  # pytest exits 5 when it collected no test: that is a failure here
  "$PY" -m pytest -p no:cacheprovider "$@"
  local rc=$?
  [ $rc -eq 5 ] && echo "pytest collected no test (exit 5)"
  return $rc
}

parallel() {  # four pytest workers where pytest-xdist is installed (the tests mostly compile)
  "$PY" -c "import xdist" 2>/dev/null && echo "-n 4"
}

topic() {  # a topic script with its rows in $OUT/<part>.jsonl
  local part=$1 script=$2; shift 2
  env -u PYTHONSAFEPATH "$PY" "benchmarks/$script" --json "$OUT/$part.jsonl" "$@"
}

ops() {
  if [ -n "$QUICK" ]; then
    topic ops ops.py --quick --shapes 2,256,4,64
  else
    topic ops ops.py
  fi
}

decode() {
  if [ -n "$QUICK" ]; then
    topic decode decode.py --sizes 0.1b --new-tokens 16 --concurrent 4 --prompt-tokens 256 \
      --steps-per-call 8 --parts single,concurrent,prefill,profile --top 5
  else
    topic decode decode.py --parts single,concurrent,prefill,breakdown,profile
  fi
}

multi_device() {
  local count
  count=$(nvidia-smi --list-gpus | wc -l)
  [ "$count" -ge 2 ] || { echo "multi-device: one GPU here, nothing to split"; return 0; }
  if [ -n "$QUICK" ]; then
    topic multi-device multi_device.py --devices 2 --shapes 4x512x4x64 --repeats 3
  else
    topic multi-device multi_device.py --devices $(seq 2 2 "$count" | tr '\n' ' ')
  fi
}

train() {  # the train topic: benchmarks/gpu_train.sh, one process per row
  if [ -n "$QUICK" ]; then
    env -u PYTHONSAFEPATH "$PY" benchmarks/train_throughput.py --model 0.1b --batch 1 --seq 512 \
      --steps 2 --json "$OUT/train.jsonl"
  else
    OUT="$OUT/train" bash benchmarks/gpu_train.sh table
  fi
}

run_part() {
  local part=$1 started rc seconds
  started=$(date +%s)
  echo "== $part (log: $OUT/$part.log)"
  case $part in
    install) install ;;
    info) "$PY" -m rwkv_jax info ;;
    gpu-tests) pytest_ran_tests -q -m gpu $(parallel) ;;
    tests) pytest_ran_tests -q ;;
    check) "$PY" -m rwkv_jax check ;;
    ops) ops ;;
    decode) decode ;;
    multi-device) multi_device ;;
    train) train ;;
  esac > "$OUT/$part.log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - started ))
  tail -n 15 "$OUT/$part.log"
  printf '%s\t%s\t%s\t%s\n' "$part" "$([ $rc -eq 0 ] && echo ok || echo "FAILED ($rc)")" "$seconds" \
    "$(grep -v '^\s*$' "$OUT/$part.log" | tail -n 1 | cut -c1-100)" >> "$OUT/summary.tsv"
  return $rc
}

: > "$OUT/summary.tsv"
failed=0
for part in "${parts[@]}"; do
  run_part "$part" || failed=1
  [ "$part" = install ] && [ $failed -ne 0 ] && { echo "install failed: stopping"; break; }
done

echo
echo "== summary ($OUT)"
# Aligned with awk (the GPU image has no `column`).
{ printf 'part\tstatus\tseconds\tlast line\n'; cat "$OUT/summary.tsv"; } | awk -F'\t' '
  { for (i = 1; i <= NF; i++) { cell[NR, i] = $i; if (length($i) > width[i]) width[i] = length($i) }
    if (NF > columns) columns = NF }
  END { for (r = 1; r <= NR; r++) { line = ""
          for (i = 1; i < columns; i++) line = line sprintf("%-" width[i] "s  ", cell[r, i])
          print line cell[r, columns] } }'
exit $failed

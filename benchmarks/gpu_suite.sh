#!/usr/bin/env bash
# The GPU suite in one command, for an H100/H200 machine without internet (Python 3.12, jax 0.11.2
# with CUDA 13, triton 3.6.0, torch 2.11, pytest, nanobind, scikit-build-core, cmake, ninja, nvcc
# preinstalled; jax-triton and fla-core carried as wheels in .whl/, see shared/tools/gpu-wheels.sh).
#
#   OUT=/some/dir bash benchmarks/gpu_suite.sh            # every part below, in order
#   OUT=/some/dir bash benchmarks/gpu_suite.sh bench      # only some parts (install once first)
#
# Parts: install info gpu-tests tests check bench baseline scripts. Each writes $OUT/<part>.log
# and a line of $OUT/summary.tsv as soon as it ends (so a run cut short keeps what it did); the
# summary table comes last. Exit status: 0 only if every part that ran succeeded.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
export OUT
# The package is installed into $SITE (with rwkv_jax.triton_kernels mapped and the extension
# built). PYTHONSAFEPATH keeps `python -m` and `python -` from putting the working directory,
# whose source folder rwkv_jax/ lacks both, ahead of it (scripts run with their own folder
# first, which is harmless, so they run without it).
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1
# Several processes share the GPU (pytest workers): none takes most of its memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}

ALL_PARTS=(install info gpu-tests tests check bench baseline scripts)
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=("${ALL_PARTS[@]}")
for part in "${parts[@]}"; do
  [[ " ${ALL_PARTS[*]} " == *" $part "* ]] || { echo "unknown part '$part'; parts: ${ALL_PARTS[*]}" >&2; exit 2; }
done

install() {
  shopt -s nullglob
  local wheels=(.whl/*.whl)
  if [ ${#wheels[@]} -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" "${wheels[@]}" || return
  fi
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

bench() {
  local plot=()
  "$PY" -c "import matplotlib" 2>/dev/null && plot=(--plot "$OUT/bench.png")
  # The issue's GPU sizes: every op at the baseline size, rwkv7 also at the training-memory size.
  "$PY" -m rwkv_jax bench --dtype bfloat16 --size 8,1024,32,64 --json "$OUT/bench.json" "${plot[@]}" || return
  "$PY" -m rwkv_jax bench --dtype bfloat16 --op rwkv7 --size 8,4096,64,64 --json "$OUT/bench_xl.json"
}

scripts() {
  local status=0 script
  for script in benchmarks/gpu_*.py; do
    [ -e "$script" ] || { echo "no benchmarks/gpu_*.py yet"; return 0; }
    echo "== $script"
    env -u PYTHONSAFEPATH "$PY" "$script" || { echo "FAILED: $script"; status=1; }
  done
  return $status
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
    bench) bench ;;
    baseline) env -u PYTHONSAFEPATH "$PY" benchmarks/native_baseline.py | tee "$OUT/baseline.md" ;;
    scripts) scripts ;;
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

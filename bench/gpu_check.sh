#!/usr/bin/env bash
# `make gpu-check`: on a CUDA machine, in at most ~10 minutes, install what is missing,
# build enginecore, run the CUDA tests (tests/test_cuda.py) and the throughput
# comparison with transformers (bench/gpu_throughput.py), and write everything to
# $OUT if set, else ./gpu-check-results: summary.md, cuda_tests.log/.xml,
# throughput.json/.md, gpu_check.log.
#
# A bare machine is fine: with no torch, `pip install torch` (on a CUDA machine PyPI's
# default wheel is the CUDA build); missing Python packages are installed with pip
# (from .whl/ too, where wheels were carried to a machine without a network).
# PYTHON=... picks the interpreter (default: python3, or .venv/bin/python for the dry run).
#
# Dry run without a GPU: ENGINECORE_GPU_CHECK_ON_CPU=1 make gpu-check runs the same
# steps on the CPU (the CUDA tests on the CPU, a tiny throughput case).
#
# For a CUDA machine without a network whose image has torch, transformers, pytest,
# scikit-build-core and pybind11 but not our other packages: run
# `bash bench/gpu_check.sh --fetch-wheels` where PyPI is reachable; it puts the
# CPython 3.12 manylinux wheels of those packages into .whl/ (git-ignored), which the
# check then installs from with --no-index (carry .whl along).
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [[ ${1:-} == --fetch-wheels ]]; then
  exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    msgspec pyzmq gguf llguidance
fi
RESULTS=${OUT:-$ROOT/gpu-check-results}
mkdir -p "$RESULTS"
LOG=$RESULTS/gpu_check.log
: >"$LOG"
ON_CPU=${ENGINECORE_GPU_CHECK_ON_CPU:-0}
BUDGET_S=${GPU_CHECK_BUDGET_S:-570}
START=$(date +%s)
FAILED=()
declare -A STATUS

say() { echo "[gpu-check $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET_S - ($(date +%s) - START))); }
step() {  # step NAME CMD...: run with the time that is left, record ok/FAILED
  # (STEP_LOG=FILE step ... also keeps that step's output in FILE)
  local name=$1; shift
  local t=$(left)
  if ((t < 20)); then say "$name: skipped, out of time"; STATUS[$name]="skipped (time)"
    FAILED+=("$name"); return 1; fi
  say "$name: $*"
  local t0=$(date +%s)
  timeout "$t" "$@" 2>&1 | tee -a "$LOG" ${STEP_LOG:+"$STEP_LOG"}
  local rc=${PIPESTATUS[0]}
  local dt=$(($(date +%s) - t0))
  if ((rc == 0)); then STATUS[$name]="ok (${dt}s)"; else STATUS[$name]="FAILED rc=$rc (${dt}s)"
    FAILED+=("$name"); fi
  say "$name: ${STATUS[$name]}"
  return $rc
}

# -- the interpreter ---------------------------------------------------------------
if [[ -n ${PYTHON:-} ]]; then PY=$PYTHON
elif [[ $ON_CPU == 1 && -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=$(command -v python3)
fi
say "python: $PY ($($PY -c 'import sys; print(sys.version.split()[0])'))"
$PY -m pip --version >/dev/null 2>&1 || $PY -m ensurepip --upgrade >>"$LOG" 2>&1
PIP=("$PY" -m pip install --no-input --disable-pip-version-check -q)
# A system interpreter that forbids pip (PEP 668) on a throwaway machine: allow it.
if $PY -c 'import sys, sysconfig, os; sys.exit(not (sys.prefix == sys.base_prefix and
    os.path.exists(os.path.join(sysconfig.get_paths()["stdlib"], "EXTERNALLY-MANAGED"))))'; then
  PIP+=(--break-system-packages)
fi
# Carried wheels: install from them alone (without a network pip would spend minutes
# retrying the index).
PIP_DEPS=("${PIP[@]}")
[[ -d .whl ]] && PIP_DEPS+=(--no-index --find-links "$ROOT/.whl")

# -- torch ----------------------------------------------------------------------------
if ! $PY -c 'import torch' 2>/dev/null; then
  if [[ $ON_CPU == 1 ]]; then step torch "${PIP[@]}" torch==2.13.0
  else step torch "${PIP[@]}" torch; fi
fi
if [[ $ON_CPU != 1 ]] && ! $PY -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
  say "torch sees no CUDA device: this is the GPU check (ENGINECORE_GPU_CHECK_ON_CPU=1 for the dry run)"
  FAILED+=("cuda-device"); STATUS[cuda-device]="FAILED: no CUDA device"
fi
$PY - <<'EOF' 2>&1 | tee -a "$LOG" >"$RESULTS/device.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"device {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
EOF

# -- the other packages (only the missing ones) -------------------------------------
missing=()
for pair in msgspec:msgspec zmq:pyzmq safetensors:safetensors tokenizers:tokenizers \
    jinja2:jinja2 gguf:gguf numpy:numpy tqdm:tqdm llguidance:llguidance \
    huggingface_hub:huggingface_hub transformers:transformers pytest:pytest; do
  $PY -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
((${#missing[@]})) && step deps "${PIP_DEPS[@]}" "${missing[@]}"

# -- enginecore itself (the C++ extension builds from source) -----------------------
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if $PY -c 'import scikit_build_core, pybind11' 2>/dev/null; then
  step build "${PIP[@]}" --no-deps --no-build-isolation .
else
  step build "${PIP[@]}" --no-deps .
fi

# -- the CUDA tests, then the throughput comparison --------------------------------
if [[ $ON_CPU == 1 ]]; then
  export ENGINECORE_CUDA_TESTS_ON_CPU=1
  TP_ARGS=(--device cpu --dtype float32 --shape tiny --batches 1,4 --prompt-len 16 --output-len 8)
else
  TP_ARGS=(--device cuda --dtype bfloat16)
fi
STEP_LOG=$RESULTS/cuda_tests.log step cuda-tests "$PY" -m pytest tests/test_cuda.py -m cuda -q \
  -p no:cacheprovider -rs --junitxml="$RESULTS/cuda_tests.xml"
step throughput "$PY" bench/gpu_throughput.py --out "$RESULTS" "${TP_ARGS[@]}"

# -- summary --------------------------------------------------------------------------
{
  echo "# gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  [[ $ON_CPU == 1 ]] && echo "DRY RUN on the CPU (ENGINECORE_GPU_CHECK_ON_CPU=1): no GPU figures." && echo
  echo '```'; cat "$RESULTS/device.txt"; echo '```'; echo
  echo "| step | status |"; echo "|---|---|"
  for k in torch cuda-device deps build cuda-tests throughput; do
    [[ -n ${STATUS[$k]:-} ]] && echo "| $k | ${STATUS[$k]} |"
  done
  echo
  [[ -f $RESULTS/cuda_tests.log ]] && { echo '```'; tail -n 15 "$RESULTS/cuda_tests.log"; echo '```'; echo; }
  [[ -f $RESULTS/throughput.md ]] && cat "$RESULTS/throughput.md"
  echo; echo "total $(($(date +%s) - START)) s"
} >"$RESULTS/summary.md"
cat "$RESULTS/summary.md"
((${#FAILED[@]} == 0)) || { echo "gpu-check FAILED: ${FAILED[*]}"; exit 1; }

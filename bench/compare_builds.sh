#!/usr/bin/env bash
# Same-run comparison of two builds, alternating: bench/compare_builds.sh BEFORE_DIR AFTER_DIR
# (two checkouts, each with its own built .venv: `git worktree add /tmp/prev REV &&
# make -C /tmp/prev install`). Engine step (synthetic, 1/64/256 decodes), block hashing
# (with the SHA-256 limit line), the process engine's E2E, and LLM() on the default model
# at batch 1 and 64 (float32). Run it on an otherwise idle machine; compare within a run.
set -u
before=${1:?usage: bench/compare_builds.sh BEFORE_DIR AFTER_DIR}
after=${2:?usage: bench/compare_builds.sh BEFORE_DIR AFTER_DIR}
lscpu | grep -E "Model name"; grep -o -w -E "avx2|avx512f|amx_tile" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
for round in 1 2; do
  for dir in "$before" "$after"; do
    cd "$dir"
    echo "=== round $round: $dir ($(git rev-parse --short HEAD))"
    .venv/bin/python -m pytest -q -p no:cacheprovider bench/bench_engine_core.py bench/bench_proc.py \
      -s -k "engine_step or test_block_hash or e2e" --benchmark-columns=min,median --benchmark-group-by=group \
      --benchmark-sort=name 2>&1 | grep -E "^test_|^-+ benchmark|passed|failed|block_hash\[" | sed 's/  */ /g'
    BENCH_MODEL_BATCHES=1,64 BENCH_MODEL_DTYPES=float32 .venv/bin/python -m pytest -q -p no:cacheprovider -s bench/bench_model.py -k "llm_default" 2>&1 \
      | grep -E "tok|passed|failed" | grep -v "^$" | tail -8
  done
done

#!/usr/bin/env bash
# One GPU lease's measurements, in one command of at most 7.5 minutes (docs/gpu.md: the fourth and
# fifth leases; since the fifth the run's own decode is fused, CUDA's default):
#   bash scripts/gpu_lease.sh      # from the checkout root on the GPU machine; $OUT collects the logs
# TRL_SECONDS=450 adds 3 rounds beside TRL's GRPOTrainer (about 140 s a round on the H200; with the
# rest, past a 10-minute command: give it a command of its own, as the fifth lease did).
# Carry gpu_kit/ (python -m scripts.gpu_check --prepare SMOLLM2_DIR) and .whl/ (transformers 5.23.0,
# trl 1.16.0, datasets 5.2.0, dill, multiprocess as wheels): the machine has no network.
set -o pipefail
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 3
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== 1. the CUDA-graph and fused decodes against the eager one, on CUDA (tests)"
[ -n "$SKIP_TESTS" ] || timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_sampling.py \
  tests/test_fused_decode.py -k "cuda_graph or plain_decode or cuda_the_fused" 2>&1 | tail -15 \
  | tee "$OUT/tests.log"
echo "== 2. the defaults on a 40 GB card: the plan, the training decode; graphs and fused against eager"
timeout 300 python3 -m scripts.gpu_check --card-gb 40 --skip-compile --out "$OUT/gpu_check_40gb.json" \
  -- --eval-limit 8 2>&1 | tee "$OUT/gpu_check.log"
if [ -n "$TRL_SECONDS" ]; then
  echo "== 3. the step beside TRL's GRPOTrainer, rounds A B (about 150 s a round at this size)"
  timeout "$TRL_SECONDS" python3 -m scripts.bench --vs-trl --config smollm2-1.7b --batch-size 4 \
    --steps 2 --rounds 3 2>&1 | tee "$OUT/vs_trl.log"
fi
date -u

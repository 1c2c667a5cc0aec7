#!/usr/bin/env bash
# The warp-specialized Gluon probe on the H200: a smoke launch of every tile first (a hang stops there),
# then one process per (head dim, causal) pair under timeout. Run from the repository root.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
probe=$(dirname "$0")/ws_gluon_probe.py
OUT=${OUT:-out}
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader | tee -a $OUT/ws_gluon.log
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/ws_gluon.log
timeout 100 python3 $probe smoke 2>&1 | tail -30 | tee -a $OUT/ws_gluon.log
rc=${PIPESTATUS[0]}
echo "smoke rc=$rc" | tee -a $OUT/ws_gluon.log
[ "$rc" = 0 ] || exit 0
for pair in "128 0" "128 1" "64 1" "64 0"; do
  timeout ${PAIR_TIMEOUT:-110} python3 $probe $pair 2>&1 | grep -v Warning | tee -a $OUT/ws_gluon.log
  echo "pair $pair rc=${PIPESTATUS[0]}" | tee -a $OUT/ws_gluon.log
done

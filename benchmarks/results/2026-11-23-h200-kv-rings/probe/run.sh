#!/usr/bin/env bash
# The device runs as issued: the probe (package vs the HEAD package carried in .gpu_carry/base), then the forward's
# GPU tests and the `tl` kernels' (whose calls go through the tuner, which now has the new tile) on the package.
cd "$(dirname "$0")/../../../.."
export PYTHONPATH=$PWD:$PWD/.gpu_carry/base PYTHONUNBUFFERED=1
mkdir -p "$OUT/probe"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/probe/env.txt"
timeout 300 python3 benchmarks/results/2026-11-23-h200-kv-rings/probe/kv_probe.py "$OUT/probe" > "$OUT/probe/probe.log" 2>&1
grep -v '^{' "$OUT/probe/probe.log" | tail -20
timeout 100 python3 -m pytest -q -m gpu -rs tests/test_triton_hopper.py 2>&1 | tail -3 | tee "$OUT/probe/gpu-tests-hopper.log"
timeout 190 python3 -m pytest -q -m gpu -rs tests/test_triton_gpu.py 2>&1 | tail -3 | tee "$OUT/probe/gpu-tests-tl.log"

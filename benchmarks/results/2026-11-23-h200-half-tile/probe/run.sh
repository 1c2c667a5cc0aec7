#!/usr/bin/env bash
# The device run as issued: the probe (package vs the HEAD package carried in .gpu_carry/base), then the forward's GPU
# tests on the package.
cd "$(dirname "$0")/../../../.."
export PYTHONPATH=$PWD:$PWD/.gpu_carry/base PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/env.txt"
timeout 330 python3 benchmarks/results/2026-11-23-h200-half-tile/probe/half_tile_probe.py "$OUT" > "$OUT/probe.log" 2>&1
tail -16 "$OUT/probe.log"
timeout 240 python3 -m pytest -q -m gpu -rs tests/test_triton_hopper.py 2>&1 | tail -25 | tee "$OUT/gpu-tests.log"

# The GPU run of the TMA-store probe: the builds, the forward and launch GPU tests, then the probe. Results under $OUT.
export PYTHONPATH=.
D=benchmarks/results/2026-11-22-h200-item-edges/tma-store
TRITON_INTERPRET=0 python3 -m benchmarks.hopper_build 2>&1 | grep '^{' > $OUT/build.log
timeout 200 python3 -m pytest -q -m gpu -rs tests/test_triton_hopper.py tests/test_launch.py > $OUT/gpu-tests-forward.log 2>&1
tail -4 $OUT/gpu-tests-forward.log
timeout 330 python3 $D/store_probe.py $OUT > $OUT/store.log 2> $OUT/store_stderr.txt
tail -16 $OUT/store_stderr.txt

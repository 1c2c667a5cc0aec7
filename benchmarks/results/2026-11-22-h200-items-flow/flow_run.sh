# the session's GPU call: the forward GPU tests on the tree, then the probe against HEAD's kernel
mkdir -p $OUT
export PYTHONPATH=.
# .gpu_carry/triton_hopper_head.py: HEAD's kernel, made here as flow_probe.py's docstring says
D=benchmarks/results/2026-11-22-h200-items-flow
timeout 240 python3 -m pytest -q -m gpu tests/test_triton_hopper.py 2>&1 | tail -6 | tee $OUT/gpu-tests-forward.log
timeout 300 python3 $D/flow_probe.py $OUT 2>$OUT/flow_stderr.txt > $OUT/flow.log
tail -16 $OUT/flow_stderr.txt

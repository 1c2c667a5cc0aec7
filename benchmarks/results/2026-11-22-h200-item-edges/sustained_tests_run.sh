# The forward at T=1k and 4k under sustained load (time, energy and SM clock per call, ours vs cuDNN), then the GPU
# test files not run with the probe (the Hopper backward's, the `tl` kernels'). Results under $OUT.
export PYTHONPATH=.
for causal in true false; do
  timeout 100 python3 -m benchmarks.sustained --family dense --T 1024,4096 --hs 64,128 --causal $causal --passes fwd \
    --out_dir $OUT/sustained-causal-$causal > $OUT/sustained-causal-$causal.log 2>&1
  tail -12 $OUT/sustained-causal-$causal/dense.md
done
timeout 220 python3 -m pytest -q -m gpu -rs tests/test_triton_hopper_backward.py > $OUT/gpu-tests-hopper-backward.log 2>&1
tail -2 $OUT/gpu-tests-hopper-backward.log
timeout 250 python3 -m pytest -q -m gpu -rs tests/test_triton_gpu.py > $OUT/gpu-tests-tl.log 2>&1
tail -2 $OUT/gpu-tests-tl.log

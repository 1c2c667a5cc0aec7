# the leak test against a copy without the templates (must fail), then GPU tests on the tree
mkdir -p $OUT
PYTHONPATH=.gpu_carry/leaky:. timeout 120 python3 -P -m pytest -q -m gpu tests/test_triton_hopper_backward.py -k keep_no_tensor -p no:cacheprovider 2>&1 | tail -4 > $OUT/leak-test-without-templates.log
cat $OUT/leak-test-without-templates.log
export PYTHONPATH=.
timeout 250 python3 -m pytest -q -m gpu tests/test_triton_hopper_backward.py tests/test_launch.py 2>&1 | tail -4 | tee $OUT/gpu-tests-backward.log
timeout 200 python3 -m pytest -q -m gpu tests --ignore=tests/test_triton_hopper.py --ignore=tests/test_triton_gpu.py --ignore=tests/test_triton_hopper_backward.py --ignore=tests/test_launch.py 2>&1 | tail -4 | tee $OUT/gpu-tests-rest.log

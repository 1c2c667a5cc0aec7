# after the operator fix: the compile tests, the GPT-2 step, the GPT-2 cell through the grid's harness
export PYTHONPATH=. TIKTOKEN_CACHE_DIR=$PWD/.gpu_carry/tiktoken_cache
mkdir -p $OUT
timeout 200 python3 -m pytest -q -m gpu tests/test_triton_gpu.py -k "compile or kept" 2>&1 | tail -3 | tee $OUT/gpu-tests-compile.log
STEP_TIMEOUT=260 bash benchmarks/gpu_session.sh step --rounds 5 --steps 20 > /dev/null 2>&1
(cd out && tar czf $OUT/step.tgz step)
grep -A4 "^| backend" out/step/results.md
BENCH_DIR=gpt2 BENCH_TIMEOUT=150 bash benchmarks/gpu_session.sh bench --backends sdpa-cudnn,triton --seq_lens 1024 --head_dims 64 --causal true --gpt2 --passes fwd,bwd,fwd+bwd > /dev/null 2>&1
grep -A5 "speed-up" out/gpt2/results.md

#!/usr/bin/env bash
# The commands we run on the lent GPU machine (H200), one stage per call:
#   bash benchmarks/gpu_session.sh env|tests|hopper|bench|sparse|tune|train|step|reuse [extra args for that stage]
# Results go under $OUT (the device tool copies it back); without $OUT, under out/gpu/.
# Offline inputs (tiktoken's GPT-2 BPE files, tiny shakespeare) travel in .gpu_carry/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stage=${1:?stage: env|tests|hopper|bench|sparse|tune|train|step|reuse}; shift

log() { tee -a "$OUT/$stage.log"; }

python3 - <<'PY' 2>&1 | log
import datetime, subprocess, torch, triton
print(datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip())
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
PY

case $stage in
env) ;;
tests)  # every GPU-marked test: the kernel's float64 checks in bf16/fp16, determinism, compile
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -m gpu -rs --durations=15 tests "$@" 2>&1 | log ;;
hopper)  # the warp-specialized Hopper forward and backward (§12, §13): what ptxas made of them, then their GPU tests
  TRITON_INTERPRET=0 python3 -m benchmarks.hopper_build 2>&1 | grep '^{' | log
  TRITON_INTERPRET=0 python3 -m benchmarks.hopper_build --backward 2>&1 | grep '^{' | log
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -rs -v tests/test_triton_hopper.py \
    tests/test_triton_hopper_backward.py "$@" 2>&1 | log ;;
bench)  # the kernel benchmark into out/$BENCH_DIR; args go to benchmarks.attention (--backends ...)
  dir=${BENCH_DIR:-bench}
  # .gpu_carry/$dir/results.json from an earlier call lets --resume skip cells already measured
  mkdir -p "out/$dir" && cp -n ".gpu_carry/$dir/results.json" "out/$dir/" 2>/dev/null
  timeout "${BENCH_TIMEOUT:-540}" python3 -m benchmarks.attention --resume --out_dir "out/$dir" "$@" 2>&1 \
    | grep -v "it/s]" | log
  python3 -m benchmarks.attention_report "out/$dir" | log  # a run cut off by the timeout still gets its report
  tar czf "$OUT/$dir.tgz" -C out "$dir"
  tail -40 "out/$dir/results.md" ;;
sparse)  # the sparse-attention benchmark (window, documents, MoBA vs dense and Flex) into out/$BENCH_DIR
  dir=${BENCH_DIR:-sparse}
  mkdir -p "out/$dir" && cp -n ".gpu_carry/$dir/results.json" "out/$dir/" 2>/dev/null
  timeout "${BENCH_TIMEOUT:-540}" python3 -m benchmarks.sparse --resume --out_dir "out/$dir" "$@" 2>&1 \
    | grep -v "it/s]" | log
  python3 -m benchmarks.sparse_report "out/$dir" | log
  tar czf "$OUT/$dir.tgz" -C out "$dir"
  tail -30 "out/$dir/results.md" ;;
tune)  # the dense kernels' tile and feature sweep against cuDNN (benchmarks/tune_kernels.py)
  timeout "${TUNE_TIMEOUT:-420}" python3 -m benchmarks.tune_kernels --jobs 4 --out_dir out/tune "$@" 2>&1 | log
  tar czf "$OUT/tune.tgz" -C out tune ;;
train)  # tiny shakespeare prep, then the training comparison; args go to benchmarks.compare
  export TIKTOKEN_CACHE_DIR=$PWD/.gpu_carry/tiktoken_cache
  python3 -m data.shakespeare --input .gpu_carry/tinyshakespeare.txt 2>&1 | log
  timeout "${TRAIN_TIMEOUT:-540}" python3 -m benchmarks.compare --out_dir out/compare --wandb=false "$@" 2>&1 \
    | grep -v "it/s]" | log
  tar czf "$OUT/compare.tgz" --exclude=ckpt.pt -C out compare
  cat out/compare/comparison.md ;;
step)  # GPT-2 training steps per attention backend, timed side by side in one process; args go to benchmarks.train_step
  export TIKTOKEN_CACHE_DIR=$PWD/.gpu_carry/tiktoken_cache
  [ -d data/shakespeare ] || python3 -m data.shakespeare --input .gpu_carry/tinyshakespeare.txt 2>&1 | log
  timeout "${STEP_TIMEOUT:-420}" python3 -m benchmarks.train_step configs/shakespeare.py --out_dir out/step "$@" 2>&1 | log
  tar czf "$OUT/step.tgz" -C out step ;;
reuse)  # the Llama-style example per backend (same seed and steps), then decoding with vs without the KV cache
  export TIKTOKEN_CACHE_DIR=$PWD/.gpu_carry/tiktoken_cache
  [ -d data/shakespeare ] || python3 -m data.shakespeare --input .gpu_carry/tinyshakespeare.txt 2>&1 | log
  for attn in ${LLAMA_BACKENDS:-sdpa triton}; do
    timeout 240 python3 -m examples.train_llama --attn=$attn --max_steps=300 --batch_size=16 --compile \
      --out_dir=out/llama/$attn 2>&1 | grep -E "^step (0|[0-9]*00)/|error" | log
  done
  python3 -m benchmarks.compare_report out/llama | log
  timeout 150 python3 -m benchmarks.generate --backends sdpa,triton --out_dir out/generate 2>&1 | log
  timeout 200 python3 -m benchmarks.generate --backends sdpa,triton --prompt_len 512 --new_tokens 512 \
    --out_dir out/generate-long 2>&1 | log
  tar czf "$OUT/reuse.tgz" --exclude=ckpt.pt -C out llama generate generate-long ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# The GPU runs behind the README's tables, and the GPU tests: one or more stages per call of a GPU machine.
#   bash benchmarks/gpu_session.sh STAGE [STAGE ...]
# STAGE: env | tests | kernels | memory | same_loss | seeds | step | sparse | decoding | documents | moba | long_context
#        | host | hf_step | tune | startup | versions | scaling | terms | cuda
# Each table's raw files go to out/results/<table>/; with $OUT set (a lent machine's folder that comes back), the
# folder is also packed into $OUT/<table>.tgz, which unpacks into benchmarks/results/<table>/ (the README's source):
#   tar xzf <table>.tgz -C benchmarks/results
# The tiny shakespeare text and the GPT-2 BPE ship in data/assets/: the sessions need no network.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
RESULTS=out/results
mkdir -p "$RESULTS" "${OUT:-out}"
LOG=${OUT:-out}/gpu_session.log
SECONDS_LEFT=${SECONDS_LEFT:-560}  # a stage's time limit; a device call runs at most 600 s

log() { tee -a "$LOG"; }
pack() {  # the table's folder into $OUT/<table>.tgz (checkpoints left out), runs' metrics gzipped as the repository
          # keeps them (benchmarks/compare_report.py reads metrics.jsonl.gz)
  [ -n "${OUT:-}" ] || return 0
  find "$RESULTS/$1" -name metrics.jsonl -exec gzip -9nf {} +
  tar czf "$OUT/$1.tgz" --exclude=ckpt.pt --exclude=wandb -C "$RESULTS" "$1"
}
elapsed() {  # each line of stdin behind the seconds since $1 (when a start-up's time goes)
  python3 -c "import sys, time; [print(f'{time.time() - float(sys.argv[1]):7.1f} {line}', end='', flush=True)
                                  for line in sys.stdin]" "$1"
}
shakespeare() {  # tiny shakespeare as GPT-2 tokens in data/shakespeare/
  [ -d data/shakespeare ] && return
  python3 -m data.shakespeare
}

for stage in "$@"; do
  echo "== $stage $(date -u +%FT%TZ)" | log
  case $stage in
  env)
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader | log
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__)" | log ;;
  tests)  # every GPU-marked test (the kernels against float64 in bf16/fp16, determinism, compile), or those of the
          # files in $TESTS, then the Hopper kernels' sm_90 builds (registers, spills, wgmma), dense and with documents.
          # Compiling kernels, not running them, takes the time: the tests, dealt out one by one (so that no process
          # gets a whole slow file), go to $TEST_SHARDS pytest processes (default 4) at once, spread over the
          # machine's GPUs, each its own log; SIGINT at the limit makes every one print its failures and summary
    ids=${OUT:-out}/tests.ids
    python3 -m pytest -q -m gpu --collect-only -p no:cacheprovider -o addopts="" ${TESTS:-tests} 2>/dev/null | grep '^tests/.*::' \
      > "$ids"
    gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
    shards=${TEST_SHARDS:-4}
    for i in $(seq 0 $((shards - 1))); do
      mapfile -t mine < <(awk -v i="$i" -v n="$shards" '(NR - 1) % n == i' "$ids")  # ids may hold spaces
      [ ${#mine[@]} -gt 0 ] || continue
      CUDA_VISIBLE_DEVICES=$((i % gpus)) timeout -s INT "$SECONDS_LEFT" python3 -m pytest -q -m gpu -rfs \
        -p no:cacheprovider -o addopts="" --durations=5 "${mine[@]}" > "${OUT:-out}/tests.$i.log" 2>&1 &
    done
    wait
    for f in "${OUT:-out}"/tests.*.log; do echo "-- $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$f"; done | log
    # one file back from the machine, not one per shard (a device call returns a limited number of files)
    [ -n "${OUT:-}" ] && tar czf "$OUT/tests.tgz" -C "$OUT" $(cd "$OUT" && ls tests.*.log) && rm -f "$OUT"/tests.*.log "$OUT"/tests.ids
    for build in "" "--backward" "--documents" "--documents --backward"; do
      TRITON_INTERPRET=0 python3 -m benchmarks.hopper_build $build 2>&1 | grep '^{' | log
    done ;;
  kernels)  # forward, backward, forward+backward of our kernels beside cuDNN, FlashAttention-2 and FlexAttention
    timeout "$SECONDS_LEFT" python3 -m benchmarks.attention --resume --backends sdpa-cudnn,sdpa-flash,flex,triton \
      --seq_lens 1024,4096,16384 --out_dir "$RESULTS/kernels" 2>&1 | grep -v "it/s]" | log
    python3 -m benchmarks.attention_report "$RESULTS/kernels" | tail -5 | log
    pack kernels ;;
  memory)  # forward+backward peak memory against T
    timeout "$SECONDS_LEFT" python3 -m benchmarks.attention --batch 1 --head_dims 64 --causal true --no-gpt2 \
      --passes fwd+bwd --backends naive,sdpa-flash,sdpa-cudnn,triton,cuda --rounds 1 --out_dir "$RESULTS/memory" 2>&1 \
      | grep -v "it/s]" | log
    pack memory ;;
  same_loss)  # float32 without TF32: the backends' losses step by step against naive's (into same_loss/fp32)
    shakespeare 2>&1 | log
    timeout "$SECONDS_LEFT" python3 -m benchmarks.compare --backends naive,sdpa,triton --reference naive \
      --out_dir "$RESULTS/same_loss/fp32" --wandb false -- configs/shakespeare.py --dtype=float32 --tf32=false \
      --compile=false --batch_size=8 --max_steps=200 --eval_interval=50 --sample_interval=0 2>&1 \
      | grep -v "it/s]" | tail -20 | log
    pack same_loss ;;
  seeds)  # bf16: three seeds per backend, the backend-to-backend difference against the seed spread (same_loss/bf16)
    shakespeare 2>&1 | log
    timeout "$SECONDS_LEFT" python3 -m benchmarks.compare --backends naive,sdpa,triton,cuda --seeds 1,2,3 \
      --out_dir "$RESULTS/same_loss/bf16" --wandb false -- configs/shakespeare.py --compile=false --max_steps=200 \
      --eval_interval=50 --sample_interval=0 2>&1 | grep -v "it/s]" | tail -30 | log
    pack same_loss ;;
  step)  # the GPT-2 training step per backend, compiled, side by side in one process; triton twice (an A/A pair on
         # one model: the run's noise) and once without the non-finite check (its cost)
    shakespeare 2>&1 | log
    timeout "$SECONDS_LEFT" python3 -m benchmarks.train_step configs/shakespeare.py --rounds 5 --steps 20 \
      --backends "naive,sdpa,triton,cuda,triton-again:attn=triton,triton-unchecked:attn=triton+nonfinite=off" \
      --out_dir "$RESULTS/step" 2>&1 | log
    pack step ;;
  sparse)  # sliding window, packed documents and MoBA against dense causal and FlexAttention
    timeout "$SECONDS_LEFT" python3 -m benchmarks.sparse --resume --out_dir "$RESULTS/sparse" 2>&1 \
      | grep -v "it/s]" | tail -30 | log
    pack sparse ;;
  documents)  # packed documents: per-call ids, a prebuilt mask, varlen, Flex and dense causal side by side
    timeout "$SECONDS_LEFT" python3 -m benchmarks.documents --out_dir "$RESULTS/documents" 2>&1 | log
    pack documents ;;
  moba)  # MoBA (block 512, top-3) against dense causal at T=32k, hs=128: q, k, v contiguous (into moba/<gpu>), and
        # as a model's fused projection leaves them (moba/<gpu>-model)
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9][0-9]*' | head -1 | tr A-Z a-z)
    for layout in contiguous model; do
      folder=${gpu:-gpu}; [ $layout = model ] && folder=${gpu:-gpu}-model
      timeout "$SECONDS_LEFT" python3 -m benchmarks.sparse --families dense,moba --seq_lens 32768 --head_dims 128 \
        --passes fwd,fwd+bwd --no-flex --layout $layout --out_dir "$RESULTS/moba/$folder" 2>&1 | grep -v "it/s]" \
        | tail -12 | log
    done
    pack moba ;;
  long_context)  # GPT-2 124M on packed speeches, 16k tokens a step in rows of T (LONG_CONTEXT_T, default 4096 and 8192):
                 # dense, document-masked and windowed attention, into long_context/T<T>
    shakespeare 2>&1 | log
    for T in ${LONG_CONTEXT_T:-4096 8192}; do
      timeout "$SECONDS_LEFT" python3 -m benchmarks.compare --reference triton --out_dir "$RESULTS/long_context/T$T" \
        --wandb false --variants sdpa:attn=sdpa triton:attn=triton flex-docs:attn=flex,doc_mask=true \
        triton-docs:attn=triton,doc_mask=true triton-window:attn=triton,window=1024 -- configs/shakespeare.py \
        --block_size=$T --batch_size=$((16384 / T)) --compile=false --max_steps=100 --eval_interval=25 --eval_iters=2 \
        --sample_interval=0 2>&1 | grep -v "it/s]" | tail -24 | log
    done
    pack long_context ;;
  decoding)  # generate() with and without the KV cache and its CUDA graph
    timeout "$SECONDS_LEFT" python3 -m benchmarks.generate --backends sdpa,triton --out_dir "$RESULTS/decoding" \
      2>&1 | log
    pack decoding ;;
  host)  # host time per eager call, ours beside cuDNN and FlashAttention-2 (tiny and GPT-2 shapes)
    timeout "$SECONDS_LEFT" python3 -m benchmarks.launch_overhead --out_dir "$RESULTS/host" 2>&1 | log
    pack host ;;
  hf_step)  # a Hugging Face Llama's eager training step, ours against sdpa
    timeout "$SECONDS_LEFT" python3 -m benchmarks.hf_step --out_dir "$RESULTS/hf_step" 2>&1 | log
    pack hf_step ;;
  cuda)  # issue 48: the CUDA kernels (attention/cuda/) beside sdpa's FlashAttention-2 and ours in Triton, forward and
         # forward+backward, hs 64 and 128, T 1k-16k, causal and not; and the first call's build time (into cuda/)
    timeout 300 python3 -m benchmarks.cuda_build --out_dir "$RESULTS/cuda" 2>&1 | log
    timeout "$SECONDS_LEFT" python3 -m benchmarks.attention --resume --backends sdpa-flash,cuda,triton --no-gpt2 \
      --seq_lens 1024,2048,4096,8192,16384 --head_dims 64,128 --passes fwd,fwd+bwd --out_dir "$RESULTS/cuda" 2>&1 \
      | grep -v "it/s]" | log
    python3 -m benchmarks.attention_report "$RESULTS/cuda" | tail -5 | log
    pack cuda ;;
  terms)  # issue 47: what softcap, ALiBi, sinks, dropout and return_lse cost over our plain kernel, and ours against
          # Flex's softcap / ALiBi and sdpa's dropout (B=4 H=16 T=4096 hs=128 bf16, causal and not, fwd and fwd+bwd)
    timeout "$SECONDS_LEFT" python3 -m benchmarks.terms --out_dir "$RESULTS/terms" 2>&1 | log
    python3 -m benchmarks.terms_report "$RESULTS/terms" | log
    pack terms ;;
  tune)  # the tuner's choices for this GPU model, into attention/flash/tuned/ (and $OUT/tuned/), which the repo ships
    timeout "$SECONDS_LEFT" python3 -m benchmarks.tune 2>&1 | tail -3 | log
    [ -n "${OUT:-}" ] && mkdir -p "$OUT/tuned" && cp attention/flash/tuned/*.json "$OUT/tuned/" ;;
  startup)  # train.py to its 5th step, each backend with caches of its own: fresh (Triton's, Inductor's, our tuner's
            # and the native launcher's build, both under NANOFLASH_CACHE_DIR, empty; our shipped choices in place), then
            # again with them warm; each log line behind its second. Two rounds, the second in the other order (a fresh
            # run's time varies from run to run: the pair of rounds shows by how much)
    shakespeare 2>&1 | log
    mkdir -p "$RESULTS/startup"
    rm -f "$RESULTS/startup/results.txt"
    for round in 1 2; do
      order="sdpa triton"; [ $round = 2 ] && order="triton sdpa"
      for backend in $order; do
        caches=$(mktemp -d)
        for run in fresh second; do
          start=$(date +%s.%N)
          TRITON_CACHE_DIR=$caches/triton TORCHINDUCTOR_CACHE_DIR=$caches/inductor NANOFLASH_CACHE_DIR=$caches/nanoflash \
            timeout "$SECONDS_LEFT" python3 train.py configs/shakespeare.py --attn=$backend --max_steps=5 \
            --warmup_steps=2 --wandb=false --out_dir="$caches/out" 2>&1 | elapsed "$start" \
            > "$RESULTS/startup/$backend-$run-$round.log"
          status=${PIPESTATUS[0]}
          seconds=$(python3 -c "print(round($(date +%s.%N) - $start, 1))")
          [ $status = 0 ] || seconds="failed (exit $status, see $backend-$run-$round.log)"
          echo "$backend $run $seconds s (round $round)" | tee -a "$RESULTS/startup/results.txt" | log
        done
      done
    done
    pack startup ;;
  versions)  # the kernel grid and the compiled GPT-2 step in the checkout before the change (.gpu_carry/before/, a
             # `git archive` of it) and in this one, side by side (benchmarks/versions.py)
    shakespeare 2>&1 | log
    cp -r data/shakespeare .gpu_carry/before/data/ 2>/dev/null
    for tree in before after; do
      dir=.; [ $tree = before ] && dir=.gpu_carry/before
      (cd $dir && timeout "$SECONDS_LEFT" python3 -m benchmarks.attention --backends sdpa-cudnn,triton \
        --seq_lens 1024,4096,16384 --out_dir "$OLDPWD/$RESULTS/versions/kernels-$tree" 2>&1 | grep -v "it/s]" | tail -3)
      (cd $dir && timeout "$SECONDS_LEFT" python3 -m benchmarks.train_step configs/shakespeare.py --rounds 5 \
        --steps 20 --profile_steps 0 --backends "sdpa,triton,triton-again:attn=triton" \
        --out_dir "$OLDPWD/$RESULTS/versions/step-$tree" 2>&1 | tail -3)
    done 2>&1 | log
    python3 -m benchmarks.versions kernels $RESULTS/versions/kernels-{before,after}/results.json | tee \
      $RESULTS/versions/kernels.md | log
    python3 -m benchmarks.versions step $RESULTS/versions/step-{before,after}/results.json | tee \
      $RESULTS/versions/step.md | log
    pack versions ;;
  scaling)  # issues 50 and 51, on the machine's N GPUs (or the first $SCALING_GPUS of them): DDP at 1 GPU
            # (accumulating to N's global batch) and at 2..N, FSDP2 beside DDP at N, the 3.9B model under FSDP2 at N,
            # and at N >= 4 a checkpoint of N GPUs resumed at N/2 (benchmarks/scaling.py), into scaling/<gpu>x<N>, or
            # scaling/<gpu>x<all>-<N>gpus for a part of the machine. Past 2 GPUs, FSDP2's figures go beside the 2-GPU
            # plan's: this session's on this machine (SCALING_GPUS=2 first), else a committed <gpu>x2 session's.
            # NVLink multicast stays off (the machines' own setting, kept if this shell lacks it). $SCALING_ARGS: more
            # runner options (--steps, --tiny for a CPU rehearsal with a stand-in nvidia-smi)
    shakespeare 2>&1 | log
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9][0-9]*' | head -1 | tr A-Z a-z)
    all=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
    n=${SCALING_GPUS:-$all}
    folder="${gpu:-gpu}x$all"; [ "$n" -lt "$all" ] && folder="${gpu:-gpu}x$all-${n}gpus"
    against=""
    for two in "$RESULTS/scaling/${gpu:-gpu}x$all-2gpus" "benchmarks/results/scaling/${gpu:-gpu}x2"; do
      [ "$n" -gt 2 ] && [ -z "$against" ] && [ -f "$two/results.json" ] && against="--against $two/results.json"
    done
    NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
      timeout "$SECONDS_LEFT" python3 -m benchmarks.scaling --gpus "$n" --budget_s $((SECONDS_LEFT - 20)) \
      --out_dir "$RESULTS/scaling/$folder" $against ${SCALING_ARGS:-} -- --wandb=false 2>&1 | log
    pack scaling ;;
  *) echo "unknown stage $stage: env|tests|kernels|memory|same_loss|seeds|step|sparse|decoding|documents|moba|long_context|host|hf_step|tune|startup|versions|scaling|terms" >&2
     exit 2 ;;
  esac
done

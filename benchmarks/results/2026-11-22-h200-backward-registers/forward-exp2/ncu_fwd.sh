#!/usr/bin/env bash
# Nsight Compute: the hs=64 forward, our tiles vs cuDNN (ncu_fwd.py); details, raw CSV and hotspots under $OUT/ncu
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT/ncu"; export PYTHONPATH=.
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section LaunchStats --section InstructionStats --section SourceCounters"
profile() {  # name args...
  local name=$1; shift
  timeout 120 ncu --clock-control none --profile-from-start off $SECTIONS --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio \
    -o "$OUT/ncu/$name" -f python3 .gpu_carry/ncu_fwd.py "$@" > "$OUT/ncu/$name.out" 2>&1
  ncu --import "$OUT/ncu/$name.ncu-rep" --page details > "$OUT/ncu/$name.txt" 2>&1
  ncu --import "$OUT/ncu/$name.ncu-rep" --page raw --csv > "$OUT/ncu/$name.raw.csv" 2>&1
  grep -E '^  [A-Za-z_].*\(|Duration' "$OUT/ncu/$name.txt" | tr -s ' ' | cut -c1-160
  k=_attn_fwd_ws; [ "$1" = cudnn ] && k=fprop
  ncu --import "$OUT/ncu/$name.ncu-rep" --page source --csv --print-source sass --kernel-name "regex:$k" > "$OUT/ncu/$name.source.csv" 2>&1
  python3 .gpu_carry/ncu_hotspots.py "$OUT/ncu/$name.source.csv" 45 > "$OUT/ncu/$name.hotspots.txt" 2>&1
  rm -f "$OUT/ncu/$name.source.csv" "$OUT/ncu/$name.ncu-rep"
}
profile f64_4k_cudnn cudnn 4 32 4096 64 0
profile f64_4k_t1283p ours 4 32 4096 64 0 128,3,1
profile f64_4k_t1283 ours 4 32 4096 64 0 128,3,0
profile f64_4k_t1282p ours 4 32 4096 64 0 128,2,1
profile f64_1k_cudnn cudnn 16 32 1024 64 0
profile f64_1k_t1283p ours 16 32 1024 64 0 128,3,1
tar czf "$OUT/ncu.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu"

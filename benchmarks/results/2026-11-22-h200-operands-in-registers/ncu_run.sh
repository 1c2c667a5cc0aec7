#!/usr/bin/env bash
# Nsight Compute on our Hopper kernels and cuDNN's, same shapes (ncu_probe.py); reports and text under $OUT/ncu.
set -uo pipefail
D=$(dirname "$0"); OUT=${OUT:-out}; mkdir -p "$OUT/ncu"
export PYTHONPATH=.
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy --section SourceCounters"
profile() {  # name probe-args...
  local name=$1; shift
  timeout 150 ncu --clock-control none --profile-from-start off $SECTIONS \
    -o "$OUT/ncu/$name" -f python3 "$D/ncu_probe.py" "$@" > "$OUT/ncu/$name.out" 2>&1
  ncu --import "$OUT/ncu/$name.ncu-rep" --page details > "$OUT/ncu/$name.txt" 2>&1
  grep -E '^  [A-Za-z_].*\(|Duration|Issue Slots Busy|Compute \(SM\) Throughput' "$OUT/ncu/$name.txt" | tr -s ' '
  if [ -n "${HOTSPOTS:-}" ]; then  # the kernel whose stalls to place, instruction by instruction
    ncu --import "$OUT/ncu/$name.ncu-rep" --page source --csv --print-source sass --kernel-name "regex:$HOTSPOTS" \
      > "$OUT/ncu/$name.source.csv" 2>&1
    python3 "$D/ncu_hotspots.py" "$OUT/ncu/$name.source.csv" 45 > "$OUT/ncu/$name.hotspots.txt" 2>&1
  fi
}
HOTSPOTS=_attn_fwd_ws profile fwd128_ours ours fwd 4 16 4096 128 0
profile fwd128_cudnn cudnn fwd 4 16 4096 128 0
HOTSPOTS=_attn_bwd_ws profile bwd64_ours ours bwd 4 32 4096 64 0
profile bwd64_cudnn cudnn bwd 4 32 4096 64 0
tar czf "$OUT/ncu.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu"  # the device tool brings back a few files only

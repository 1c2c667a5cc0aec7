#!/usr/bin/env bash
# Nsight Compute: the hs=128 backward, committed vs offset vs cuDNN (ncu_bwd128.py); text and hotspots under $OUT/ncu
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT/ncu"; export PYTHONPATH=.
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section LaunchStats --section InstructionStats --section SourceCounters"
for who in ${NCU_WHO:-committed staging1 cudnn}; do
  timeout 150 ncu --clock-control none --profile-from-start off $SECTIONS --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio \
    -o "$OUT/ncu/$who" -f python3 .gpu_carry/ncu_bwd128.py $who ${NCU_D:-128} > "$OUT/ncu/$who.out" 2>&1
  ncu --import "$OUT/ncu/$who.ncu-rep" --page details > "$OUT/ncu/$who.txt" 2>&1
  ncu --import "$OUT/ncu/$who.ncu-rep" --page raw --csv > "$OUT/ncu/$who.raw.csv" 2>&1
  grep -E '^  [A-Za-z_].*\(|Duration|Issue Slots Busy|Compute \(SM\) Throughput|Registers Per|Grid Size|Block Size|Dynamic Shared' "$OUT/ncu/$who.txt" | tr -s ' ' | cut -c1-200
  k=_attn_bwd_ws; [ $who = cudnn ] && k=bprop
  ncu --import "$OUT/ncu/$who.ncu-rep" --page source --csv --print-source sass --kernel-name "regex:$k" > "$OUT/ncu/$who.source.csv" 2>&1
  python3 .gpu_carry/ncu_hotspots.py "$OUT/ncu/$who.source.csv" 45 > "$OUT/ncu/$who.hotspots.txt" 2>&1
  rm -f "$OUT/ncu/$who.source.csv"
done
tar czf "$OUT/ncu.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu"

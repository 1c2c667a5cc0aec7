#!/usr/bin/env bash
# stall reasons of the backward's main kernel, committed vs item-loop structure (ncu_struct.py)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT/ncu"; export PYTHONPATH=.
for which in old new; do
  timeout 200 ncu --clock-control none --profile-from-start off -k regex:_attn_bwd_ws \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,regex:smsp__pcsamp_warps_issue_stalled_.* \
    -o "$OUT/ncu/$which" -f python3 benchmarks/results/2026-11-22-h200-persistent-backward/ncu_struct.py $which 4 32 4096 64 0 > "$OUT/ncu/$which.out" 2>&1
  ncu --import "$OUT/ncu/$which.ncu-rep" --page details > "$OUT/ncu/$which.txt" 2>&1
  ncu --import "$OUT/ncu/$which.ncu-rep" --page raw --csv > "$OUT/ncu/$which.raw.csv" 2>&1
  ncu --import "$OUT/ncu/$which.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu/$which.source.csv" 2>&1
  python3 benchmarks/results/2026-11-22-h200-operands-in-registers/ncu_hotspots.py "$OUT/ncu/$which.source.csv" 40 > "$OUT/ncu/$which.hotspots.txt" 2>&1
done
python3 - "$OUT/ncu" <<'PY'
import csv, sys, os
d = sys.argv[1]
rows = {}
for w in ("old", "new"):
    r = list(csv.reader(open(os.path.join(d, w + ".raw.csv"))))
    hdr, vals = r[0], r[-1]
    rows[w] = dict(zip(hdr, vals))
keys = [k for k in rows["old"] if ("stalled" in k and "ratio" in k) or k in ("gpu__time_duration.sum", "sm__cycles_elapsed.avg", "smsp__inst_executed.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active")]
for k in keys:
    a, b = rows["old"].get(k, ""), rows["new"].get(k, "")
    try:
        if abs(float(a)) < 1e-3 and abs(float(b)) < 1e-3: continue
    except ValueError:
        pass
    print(f"{k:90s} {a:>14s} {b:>14s}")
PY
tar czf "$OUT/ncu.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu"

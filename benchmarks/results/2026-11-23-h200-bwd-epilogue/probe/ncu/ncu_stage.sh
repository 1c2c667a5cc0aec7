#!/usr/bin/env bash
# Nsight Compute: the hs=64 backward's main kernel, tile (3, no) vs (3, yes); summaries under $OUT/ncu
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT/ncu"; export PYTHONPATH=.
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section LaunchStats --section InstructionStats --section Occupancy --section SourceCounters"
for staged in 0 1; do
  who=staged$staged-${NCU_T:-16384}
  timeout 200 ncu --clock-control none --profile-from-start off --kernel-name regex:_attn_bwd_ws $SECTIONS \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_red.sum,lts__t_sectors_op_red.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    -o "$OUT/ncu/$who" -f python3 .gpu_carry/ncu_stage.py $staged ${NCU_T:-16384} ${NCU_CAUSAL:-0} > "$OUT/ncu/$who.out" 2>&1
  ncu --import "$OUT/ncu/$who.ncu-rep" --page details > "$OUT/ncu/$who.txt" 2>&1
  ncu --import "$OUT/ncu/$who.ncu-rep" --page raw --csv > "$OUT/ncu/$who.raw.csv" 2>&1
  ncu --import "$OUT/ncu/$who.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu/$who.source.csv" 2>&1
  python3 .gpu_carry/ncu_hotspots.py "$OUT/ncu/$who.source.csv" 40 > "$OUT/ncu/$who.hotspots.txt" 2>&1
  rm -f "$OUT/ncu/$who.source.csv" "$OUT/ncu/$who.ncu-rep"
done
python3 - "$OUT/ncu" <<'PY'
import csv, sys, glob
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.raw.csv")):
    r = list(csv.reader(open(f)))
    head, units, vals = r[0], r[1], r[2]
    rows[f.split("/")[-1]] = dict(zip(head, vals))
keys = [k for k in next(iter(rows.values())) if any(s in k for s in ("gpu__time_duration.sum", "stalled", "hit_rate", "op_red", "dram__bytes", "sm__throughput.avg.pct", "issue_active", "inst_executed.sum", "l1tex__t_sector_hit"))]
for k in keys:
    vals = [rows[n].get(k, "") for n in rows]
    try:
        a, b = (float(x.replace(",", "")) for x in vals)
        if a == b == 0: continue
    except Exception: pass
    print(f"{k[:90]:90s} " + "  ".join(f"{v:>14s}" for v in vals))
PY

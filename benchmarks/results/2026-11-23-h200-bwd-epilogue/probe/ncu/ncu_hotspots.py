"""The SASS instructions of one kernel where its warps were sampled stalled most, from Nsight Compute's source page:

    ncu --import r.ncu-rep --page source --csv --print-source sass --kernel-name regex:<k> > r.csv
    python3 ncu_hotspots.py r.csv [top]

Prints each instruction's share of the samples, its address and text, and the columns that look like stall
reasons or shared-memory excess wavefronts where they are non-zero."""
import csv
import sys

lines = open(sys.argv[1]).read().splitlines()
rows = list(csv.DictReader(lines[next(i for i, line in enumerate(lines) if line.startswith('"Address"')):]))
top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
if not rows:
    raise SystemExit("no rows")
columns = list(rows[0])
samples = next(c for c in columns if "Sampling (All" in c)
number = lambda v: float(v.replace(",", "")) if v not in ("", None) else 0.0  # noqa: E731
total = sum(number(r[samples]) for r in rows) or 1.0
print("total samples", total)
extra = [c for c in columns
         if (c.startswith("stall_") and "Not Issued" not in c) or c == "L1 Wavefronts Shared Excessive"]
for r in sorted(rows, key=lambda r: -number(r[samples]))[:top]:
    share = number(r[samples]) / total
    detail = {c: r[c] for c in extra if c != samples and number(r.get(c) or "0") not in (0.0,)}
    print(f"{share:6.1%} {r.get('Address', '')} {r.get('Source', '')[:90]} {detail}")

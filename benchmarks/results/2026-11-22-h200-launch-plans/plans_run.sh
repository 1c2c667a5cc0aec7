# before/after launch plans, alternating processes; then a table
set -x
mkdir -p $OUT/plans
for r in 1 2 3; do
  PYTHONPATH=.gpu_carry/before timeout 200 python3 .gpu_carry/plans_probe.py before $OUT/plans/plans.jsonl > /dev/null 2>>$OUT/plans/err.log
  PYTHONPATH=. timeout 200 python3 .gpu_carry/plans_probe.py after $OUT/plans/plans.jsonl > /dev/null 2>>$OUT/plans/err.log
done
python3 - <<'PY'
import json, os, statistics, collections
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/plans/plans.jsonl")]
g = collections.defaultdict(list)
for r in rows: g[(r["B"], r["H"], r["T"], r["D"], r["causal"], r["pass_"], r["backend"], r["label"])].append(r)
cells = sorted({k[:6] for k in g})
print("cell pass | cudnn host/ms | before host/ms | after host/ms | ratio before -> after (cudnn ms / triton ms, per-run medians)")
for c in cells:
    def med(lbl, be, f): 
        v = [r[f] for r in g.get((*c, be, lbl), [])]; return statistics.median(v) if v else float("nan")
    def ratio(lbl):
        rs = [a["ms"] / b["ms"] for a, b in zip(g[(*c, "sdpa-cudnn", lbl)], g[(*c, "triton", lbl)])]
        return statistics.median(rs) if rs else float("nan")
    print(c, f"| {med('after','sdpa-cudnn','host_us'):.0f}/{med('after','sdpa-cudnn','ms'):.3f} | {med('before','triton','host_us'):.0f}/{med('before','triton','ms'):.3f} | {med('after','triton','host_us'):.0f}/{med('after','triton','ms'):.3f} | {ratio('before'):.2f} -> {ratio('after'):.2f}")
PY
tail -5 $OUT/plans/err.log

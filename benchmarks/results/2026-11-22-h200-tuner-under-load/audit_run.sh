# HEAD's tuner's choices (head_choices.py, HEAD's package in .gpu_carry/before), unless HEAD_CHOICES names a file of
# them from an earlier run; then the audit of the tree's tuner. Results under $OUT.
export PYTHONPATH=.
D=benchmarks/results/2026-11-22-h200-tuner-under-load
if [ -z "$HEAD_CHOICES" ]; then
  HEAD_CHOICES=$OUT/head_choices.json
  PYTHONPATH=.gpu_carry/before:. timeout 200 python3 -P $D/head_choices.py $HEAD_CHOICES > $OUT/head_choices.log 2>&1
  tail -3 $OUT/head_choices.log
fi
timeout 400 python3 $D/tuner_audit.py $OUT $HEAD_CHOICES 2>$OUT/audit_stderr.txt > $OUT/audit.log
tail -30 $OUT/audit_stderr.txt

# the compiled GPT-2 step with the package before the launch plans, then after; sdpa in each as the anchor
export TIKTOKEN_CACHE_DIR=$PWD/.gpu_carry/tiktoken_cache
mkdir -p $OUT
for label in before after; do
  if [ $label = before ]; then pp=.gpu_carry/before:.; else pp=.; fi
  PYTHONPATH=$pp timeout 250 python3 -P -m benchmarks.train_step configs/shakespeare.py --out_dir out/step_$label --rounds 5 --steps 20 > out/step_$label.log 2>&1
  grep "attention package" out/step_$label.log; python3 -P -c "import sys; sys.path[:0]='$pp'.split(':'); import attention; print('$label uses', attention.__file__)"
  echo "== $label"; grep -A4 "^| backend" out/step_$label/results.md
done
cd out && tar czf $OUT/step_ab.tgz step_before step_after step_before.log step_after.log

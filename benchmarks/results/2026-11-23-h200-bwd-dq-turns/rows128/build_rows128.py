"""Build the 128-row backward variant (.gpu_carry/triton_hopper_backward_m128.py) for sm_90 without a GPU, beside
the package's hs=64 tiles: registers, spills, HGMMA and barrier counts, shared memory (benchmarks/hopper_build.py).

    TRITON_INTERPRET=0 PYTHONPATH=$PWD python benchmarks/results/2026-11-23-h200-bwd-dq-turns/rows128/build_rows128.py
"""
import importlib.util
import json
import sys

import triton

from benchmarks import hopper_build

spec = importlib.util.spec_from_file_location("rows128", ".gpu_carry/triton_hopper_backward_m128.py")
rows128 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rows128)
package = hopper_build.triton_hopper_backward
for name, module in (("package", package), ("rows128", rows128)):
    hopper_build.triton_hopper_backward = module
    for tile in module.TILES[64]:
        figures, sass = hopper_build.report(hopper_build.build_backward(64, tile))
        print(json.dumps(dict(triton=triton.__version__, kernel=name, head_dim=64, tile=tile, **figures)), flush=True)
        if len(sys.argv) > 1:
            with open(f"{sys.argv[1]}/{name}_{tile[0]}_{int(tile[1])}.sass", "w") as f:
                f.write(sass)

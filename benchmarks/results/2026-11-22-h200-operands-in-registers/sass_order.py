"""Where ptxas puts the forward's wait for P V (sm_90 build, no GPU needed; Triton 3.6 as on the GPU box):

    TRITON_INTERPRET=0 PYTHONPATH=. python benchmarks/results/2026-11-22-h200-operands-in-registers/sass_order.py \
        [module ...]      # default: attention.triton_hopper; others from .gpu_carry (variants/*.patch)

The loop issues S_j and P_{j-1} V_{j-1}, waits for S_j (`WARPGROUP.DEPBAR.LE gsb0, 0x1`), runs the softmax of tile
j, then waits for P V (`... 0x0`). For the softmax to run under P V, its exp2s (MUFU.EX2) must come between the
two waits in the SASS. Per tile build: the exp2s of the main loop found before and after the wait for P V."""
import importlib
import sys

sys.path.insert(0, ".gpu_carry")
import benchmarks.hopper_build as hopper_build  # noqa: E402

for name in sys.argv[1:] or ["attention.triton_hopper"]:
    module = importlib.import_module(name)
    hopper_build.triton_hopper = module
    for head_dim, tiles in sorted(module.TILES.items()):
        for tile in sorted({t[:2] for t in tiles}):
            _, sass = hopper_build.report(hopper_build.build(head_dim, tile))
            before = after = 0
            state = None  # None: outside the loop's pair of waits; "S": after the wait for S; "PV": after both
            for line in sass.split("\n"):
                if "DEPBAR.LE gsb0, 0x1" in line:
                    state = "S"
                elif "DEPBAR.LE gsb0, 0x0" in line and state == "S":
                    state = "PV"
                elif "HGMMA" in line:
                    state = None
                elif "MUFU.EX2" in line:
                    before += state == "S"
                    after += state == "PV"
            print(f"{name} hs={head_dim} tile={tile}: loop exp2s between the two waits {before}, "
                  f"after the wait for P V {after}", flush=True)

"""Build the warp-specialized Hopper forward (attention/triton_hopper.py, §12) for sm_90 without a GPU, and
print what the compiler made of each tile: registers, spills, wgmma (HGMMA) and barrier instructions in the
SASS, shared memory. For kernel work on a machine without a Hopper GPU; tests/test_triton_hopper.py runs it
in CI, so a Gluon API change in a new Triton, or a change that makes the kernel spill, fails there.

    python -m benchmarks.hopper_build                               # every tile of both head dims
    python -m benchmarks.hopper_build --head_dim 64 --tile 128,3 --sass out.sass

The causal mask and the grid (persistent or not) are arguments of the launch, not of the build.

One JSON line per build. Runs compiled (not under TRITON_INTERPRET): Triton decides when it is imported.
"""
import argparse
import inspect
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from attention import triton_hopper


def build(head_dim: int, tile: tuple[int, int]):
    """The kernel for bf16 inputs, compiled as a launch on an H100/H200 would compile it; tile: (BLOCK_N, STAGES)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    block_n, stages = tile
    layout = lambda rows: gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], gl.bfloat16)  # noqa: E731
    desc = lambda rows: f"tensordesc<bf16[1, 1, {rows}, {head_dim}],{layout(rows)}>"  # noqa: E731
    signature = dict(q_desc=desc(triton_hopper.ROWS.value), k_desc=desc(block_n), v_desc=desc(block_n), O="*bf16",
                     LSE="*fp32", stride_ob="i32", stride_oh="i32", stride_ot="i32", H="i32", GROUP="i32", Tq="i32",
                     Tk="i32", diag="i32", scale="fp32", n_work="i32")
    constants = dict(BLOCK_N=block_n, STAGES=stages)
    signature.update(dict.fromkeys(constants, "constexpr"))
    params = list(inspect.signature(triton_hopper._attn_fwd_ws.fn).parameters)
    source = GluonASTSource(fn=triton_hopper._attn_fwd_ws, signature=signature,
                            constexprs={(params.index(name),): value for name, value in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=triton_hopper.LAUNCH_REGS))


def report(kernel) -> tuple[dict, str]:
    """-> (figures, SASS) of a compiled kernel, read from its cubin with the cuobjdump Triton ships."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        run = lambda flag: subprocess.run([tool, flag, cubin.name], capture_output=True, text=True,  # noqa: E731
                                          check=True).stdout
        usage, sass = run("--dump-resource-usage"), run("-sass")
    number = lambda name: int(re.search(rf"\b{name}:(\d+)", usage).group(1))  # noqa: E731
    ptx = kernel.asm["ptx"]
    return dict(registers=number("REG"), stack_bytes=number("STACK"), local_bytes=number("LOCAL"),
                spill_stores=sass.count("STL"), hgmma=sass.count("HGMMA"), bar_sync=sass.count("BAR.SYNC"),
                setmaxnreg="setmaxnreg" in ptx, tma_4d="cp.async.bulk.tensor.4d" in ptx,
                shared_bytes=kernel.metadata.shared), sass


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head_dim", type=int, choices=sorted(triton_hopper.TILES), default=None, help="default: both")
    p.add_argument("--tile", default=None, help="BLOCK_N,STAGES (default: every one of the head dim's tiles)")
    p.add_argument("--sass", default=None, help="write the (last) build's SASS here")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1" or triton_hopper.gluon is None:
        raise SystemExit("needs Triton >= 3.6 with Gluon, compiled: unset TRITON_INTERPRET")
    for head_dim in [args.head_dim] if args.head_dim else sorted(triton_hopper.TILES):
        # the grid (persistent or not) is the launch's choice: one build per (BLOCK_N, STAGES)
        tiles = ([tuple(int(x) for x in args.tile.split(","))] if args.tile
                 else sorted({tile[:2] for tile in triton_hopper.TILES[head_dim]}))
        for tile in tiles:
            figures, sass = report(build(head_dim, tile))
            print(json.dumps(dict(triton=triton.__version__, head_dim=head_dim, tile=tile, **figures)), flush=True)
            if args.sass:
                with open(args.sass, "w") as f:
                    f.write(sass)


if __name__ == "__main__":
    main()

"""Build the warp-specialized Hopper forward (attention/flash/hopper/gluon_forward.py, §12) or backward
(attention/flash/hopper/gluon_backward.py, §13) for sm_90 without a GPU, and print what the compiler made of each
tile: registers, spills, wgmma (HGMMA), barrier, 16-byte atomic add and 16-byte row copy (cp.async) instructions in
the SASS, the copy engine's reductions and stores in the PTX, shared memory.
For kernel work on a machine without a Hopper GPU; tests/test_triton_hopper*.py run it in CI, so a Gluon API
change in a new Triton, or a change that makes a kernel spill, fails there.

    python -m benchmarks.hopper_build                               # every tile of both head dims
    python -m benchmarks.hopper_build --head_dim 64 --tile 128,3,2 --sass out.sass
    python -m benchmarks.hopper_build --backward                    # the backward, every tile
    python -m benchmarks.hopper_build --terms softcap,alibi,sinks   # with FlashAttention's terms (§15), each alone
    python -m benchmarks.hopper_build --terms alibi --causal        # ALiBi's causal build (its bias folded, §15)

The causal mask and the grid (persistent or not) are arguments of the launch, not of the build, except for ALiBi:
its bias is folded under the causal mask (--causal) and per key tile on full attention in the forward (§15), a build
each.

One JSON line per build. Runs compiled (not under TRITON_INTERPRET): Triton decides when it is imported.
"""
import argparse
import inspect
import json
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget

from attention.flash import device
from attention.flash.hopper import backward as hopper_backward
from attention.flash.hopper import shapes

if device.HAS_GLUON:
    from attention.flash.hopper import gluon_backward, gluon_common, gluon_forward


def _compile(kernel, signature: dict, constants: dict, launch_regs: int):
    """kernel for bf16 inputs, compiled as a launch on an H100/H200 would compile it."""
    from triton.experimental.gluon._runtime import GluonASTSource

    signature.update(dict.fromkeys(constants, "constexpr"))
    params = list(inspect.signature(kernel.fn).parameters)
    # as a launch specializes them for tensors of whole 16-byte rows: pointers and strides divisible by 16, which
    # is what lets the compiler vectorize stores
    aligned = [name for name, kind in signature.items() if (kind.startswith("*") or name.startswith("stride_"))
               and name not in ("SLOPES", "stride_slopes_b", "stride_slopes_h", "SINK_LOGITS", "stride_sinks",
                                "DROP_SEED")]
    source = GluonASTSource(fn=kernel, signature=signature,
                            constexprs={(params.index(name),): value for name, value in constants.items()},
                            attrs={(params.index(name),): [["tt.divisibility", 16]] for name in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=launch_regs))


def _descriptor_type(rows: int, head_dim: int, swizzle: int | None = None) -> str:
    """The type of gluon_common.descriptor(t, rows, swizzle) for a bf16 t: the layout the launches build."""
    layout = gluon_common.shared_layout((1, 1, rows, head_dim), torch.bfloat16, swizzle)
    return f"tensordesc<bf16[1, 1, {rows}, {head_dim}],{layout}>"


# the kernels' last runtime arguments: a gathered problem's key heads and rows per head (gluon_common.key_block)
KEY_SIZES = dict.fromkeys(["KEY_HEADS", "KEY_T"], "i32")


def _gathered_args(documents: str | None, names: list[str]) -> tuple[dict, dict]:
    """-> (signature, constants) of a kernel's ROW_SRC and the source tensors' strides and sizes `names`: a gathered
    problem's (MoBA's, §11) with spans alone, None (a constant) otherwise."""
    sizes = dict.fromkeys(names, "i32")
    return (dict(ROW_SRC="*i32", **sizes), {}) if documents == "spans" else (sizes, dict(ROW_SRC=None))


def _document_args(documents: str | None) -> tuple[dict, dict]:
    """-> (signature, constants) of the kernels' SPANS, IDS, stride_ids: int32 spans and int64 ids (a model's
    document ids) in the document mode ("documents"), int32 spans alone ("spans", MoBA's, §11), None (constants)
    without."""
    if documents == "documents":
        return dict(SPANS="*i32", IDS="*i64", stride_ids="i32"), {}
    if documents == "spans":
        return dict(SPANS="*i32", stride_ids="i32"), dict(IDS=None)
    return dict(stride_ids="i32"), dict(SPANS=None, IDS=None)


TERMS = ("softcap", "alibi", "sinks", "dropout")


def _term_args(terms: tuple[str, ...], backward: bool = False) -> tuple[dict, dict]:
    """-> (signature, constants) of the kernels' §15 arguments: softcap (fp32), SLOPES with its two strides, and the
    forward's SINK_LOGITS with its stride or the backward's SINK_ROWS, for the terms named (of TERMS); None
    (constants) for the others, which is how a call without them builds (dispatch passes None for a term it does not
    have). The strides are not marked 16-divisible: slopes are (H,) or (B, H)."""
    unknown = set(terms) - set(TERMS)
    if unknown:
        raise SystemExit(f"--terms: {sorted(unknown)} not among {TERMS}")
    signature, constants = {}, {}
    if "softcap" in terms:
        signature["softcap"] = "fp32"
    else:
        constants["softcap"] = None
    alibi = dict(SLOPES="*fp32", stride_slopes_b="i32", stride_slopes_h="i32")
    (signature if "alibi" in terms else constants).update(alibi if "alibi" in terms else dict.fromkeys(alibi))
    # the backward reads the sink's share in lse, and adds each row's sum of P dP into SINK_ROWS (terms.sink_grad)
    sinks = dict(SINK_ROWS="*fp32") if backward else dict(SINK_LOGITS="*fp32", stride_sinks="i32")
    (signature if "sinks" in terms else constants).update(sinks if "sinks" in terms else dict.fromkeys(sinks))
    dropout = dict(dropout_p="fp32", DROP_SEED="*i64")  # §16
    (signature if "dropout" in terms else constants).update(dropout if "dropout" in terms else dict.fromkeys(dropout))
    return signature, constants


def build(head_dim: int, tile: tuple[int, int, int, int], documents: str | None = None, terms: tuple[str, ...] = (),
          causal: bool = False):
    """The forward for bf16 inputs; tile: (BLOCK_N, K_STAGES, V_STAGES, CONSUMERS); documents: §14's document mode
    ("documents") or spans alone ("spans", §11), or None; terms: §15's to build in (of TERMS); causal: with ALiBi, the
    causal call's build (ALIBI_CAUSAL: the bias folded), else the full-attention one (ALIBI_FULL: folded per key
    tile); other builds do not depend on it."""
    block_n, k_stages, v_stages, consumers = tile
    launch_regs, consumer_regs = shapes.REGS[consumers]
    doc_signature, doc_constants = _document_args(documents)
    gathered_signature, gathered_constants = _gathered_args(
        documents, ["stride_qb", "stride_qh", "stride_qt", "H_src", "T_src"])
    queries = "*bf16" if documents == "spans" else _descriptor_type(shapes.ROWS.value, head_dim)
    signature = dict(Q=queries, k_desc=_descriptor_type(block_n, head_dim), v_desc=_descriptor_type(block_n, head_dim),
                     o_desc=_descriptor_type(shapes.ROWS.value, head_dim), O="*bf16", LSE="*fp32",
                     stride_ob="i32", stride_oh="i32", stride_ot="i32", H="i32", GROUP="i32", Tq="i32", Tk="i32",
                     diag="i32", scale="fp32", n_work="i32", per_turn="i32", **doc_signature, **gathered_signature)
    term_signature, term_constants = _term_args(terms)
    return _compile(gluon_forward.attn_fwd_ws, {**signature, **term_signature, **KEY_SIZES},
                    dict(BLOCK_N=block_n, K_STAGES=k_stages, V_STAGES=v_stages, CONSUMERS=consumers,
                         CONSUMER_REGS=consumer_regs, ALIBI_CAUSAL=causal and "alibi" in terms,
                         ALIBI_FULL=not causal and "alibi" in terms, **doc_constants,
                         **gathered_constants, **term_constants), launch_regs)


def build_backward(head_dim: int, tile: tuple[int, bool], documents: str | None = None, terms: tuple[str, ...] = (),
                   causal: bool = False):
    """The backward's main kernel for bf16 inputs, with the descriptor layouts hopper_backward.backward passes; tile:
    (STAGES, DKDV_STAGED); documents, terms and causal as `build` takes them. With spans alone (MoBA's, §11) the
    problem is a gathered one, as moba_hopper.backward runs it: rows copied from their sources, dQ added by atomics
    there. KV_SPLIT is 1 (as a launch specializes it) unless the grid of grouped heads is small (§13)."""
    stages, staged = tile
    kv = _descriptor_type(shapes.KEY_BLOCK.value, head_dim, swizzle=head_dim)
    rows = f"tensordesc<fp32[{shapes.QUERY_BLOCK.value}],{gluon_backward.ROW_LAYOUT.value}>"
    dq_block = (shapes.QUERY_BLOCK.value, gluon_backward.dq_cols(head_dim))
    gathered = documents == "spans"
    dq = "*fp32" if gathered else \
        f"tensordesc<fp32{list(dq_block)},{gluon_common.shared_layout(dq_block, torch.float32)}>"
    gathered_signature, gathered_constants = _gathered_args(
        documents, ["stride_qb", "stride_qh", "stride_qt", "stride_dob", "stride_doh", "stride_dot", "H_src", "T_src"])
    queries = "*bf16" if gathered else _descriptor_type(shapes.QUERY_BLOCK.value, head_dim)
    dkdv = _descriptor_type(shapes.KEYS.value, head_dim, swizzle=head_dim) if staged else "*bf16"
    row_values = "*fp32" if gathered else rows
    signature = dict(k_desc=kv, v_desc=kv, Q=queries, DO=queries, LSE=row_values, DELTA=row_values, DK=dkdv, DV=dkdv,
                     **dict.fromkeys(["stride_dkb", "stride_dkh", "stride_dkt", "stride_dvb", "stride_dvh",
                                      "stride_dvt"], "i32"),
                     DQ_ACC=dq, **gathered_signature,
                     **dict.fromkeys(["H_kv", "GROUP", "n_kv_heads", "heads_per_group", "Tq", "Tq_pad", "Tk", "diag"],
                                     "i32"), scale="fp32")
    doc_signature, doc_constants = _document_args(documents)
    term_signature, term_constants = _term_args(terms, backward=True)
    return _compile(gluon_backward.attn_bwd_ws, {**signature, **doc_signature, **term_signature, **KEY_SIZES},
                    dict(STAGES=stages, ROWS_FIRST=hopper_backward.row_values_first(head_dim),
                         ALIBI_CAUSAL=causal and "alibi" in terms, **gathered_constants, **doc_constants,
                         **term_constants, KV_SPLIT=1), shapes.BACKWARD_LAUNCH_REGS)


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
                bulk_reductions=ptx.count("cp.reduce.async.bulk.tensor"),
                vector_atomic_adds=sass.count("REDG.E.ADD.F32x4"), row_copies=sass.count("LDGSTS.E.BYPASS.128"),
                gpu_fences=sass.count("MEMBAR.ALL.GPU"),  # an atomic that orders memory (not sem="relaxed") adds one
                tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)),
                setmaxnreg="setmaxnreg" in ptx, tma_4d="cp.async.bulk.tensor.4d" in ptx,
                shared_bytes=kernel.metadata.shared), sass


def forward_build(tile: tuple[int, int, int, bool, int]) -> tuple[int, int, int, int]:
    """A forward tile of shapes.FORWARD_TILES -> what its build depends on, (BLOCK_N, K_STAGES, V_STAGES, CONSUMERS)."""
    block_n, k_stages, v_stages, _, consumers = tile
    return block_n, k_stages, v_stages, consumers


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backward", action="store_true", help="the backward (§13) instead of the forward")
    p.add_argument("--head_dim", type=int, choices=[64, 128], default=None, help="default: every one with tiles")
    p.add_argument("--tile", default=None,
                   help="forward: BLOCK_N,K_STAGES,V_STAGES,CONSUMERS; backward: STAGES,DKDV_STAGED (0/1) "
                        "(default: every one)")
    p.add_argument("--documents", action="store_const", const="documents", help="the document mode (§14)")
    p.add_argument("--spans", action="store_const", const="spans", dest="documents",
                   help="spans without ids, as MoBA runs the kernels (§11)")
    p.add_argument("--terms", default="", help="§15's terms to build in, comma-separated, of " + ",".join(TERMS)
                   + "; with several, each alone and then all together")
    p.add_argument("--causal", action="store_true",
                   help="ALiBi's build for causal calls, its bias folded (§15); other builds are the same either way")
    p.add_argument("--sass", default=None, help="write the (last) build's SASS here")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1" or not device.HAS_GLUON:
        raise SystemExit("needs Triton >= 3.6 with Gluon, compiled: unset TRITON_INTERPRET")
    table = shapes.BACKWARD_TILES if args.backward else shapes.FORWARD_TILES
    for head_dim in [args.head_dim] if args.head_dim else sorted(table):
        if args.backward:
            tiles = [tuple(int(x) for x in args.tile.split(","))] if args.tile else table[head_dim]
        else:  # one build per forward_build(tile): the grid (persistent or not) is the launch's choice
            listed = shapes.document_tiles(head_dim) if args.documents else table[head_dim]
            tiles = ([tuple(int(x) for x in args.tile.split(","))] if args.tile
                     else sorted({forward_build(tile) for tile in listed}))
        named = tuple(term for term in args.terms.split(",") if term)
        # each term alone, then all of them together
        term_sets = [(term,) for term in named] + ([named] if len(named) > 1 else []) if named else [()]
        if args.backward:  # the sinks' rows not with softcap (dispatch._backward_plan)
            term_sets = list(dict.fromkeys(tuple(t for t in terms if t != "sinks" or "softcap" not in terms)
                                           for terms in term_sets))
        for tile in tiles:
            for terms in term_sets:
                kernel = (build_backward(head_dim, tile, args.documents, terms, args.causal) if args.backward
                          else build(head_dim, tile, args.documents, terms, args.causal))
                figures, sass = report(kernel)
                print(json.dumps(dict(triton=triton.__version__, kernel="backward" if args.backward else "forward",
                                      head_dim=head_dim, tile=tile, documents=args.documents,
                                      **(dict(terms=list(terms)) if named else {}),
                                      **(dict(causal=True) if args.causal else {}), **figures)), flush=True)
                if args.sass:
                    with open(args.sass, "w") as f:
                        f.write(sass)


if __name__ == "__main__":
    main()

"""Build the backward variants of .gpu_carry (nostore, staged) for sm_90 offline, as benchmarks/hopper_build does."""
import importlib.util
import json
import sys

import torch

from attention import triton_hopper
from benchmarks import hopper_build as hb_build


def load(name):
    spec = importlib.util.spec_from_file_location(name, f".gpu_carry/triton_hopper_backward_{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


for name in sys.argv[1:]:
    hb = load(name)
    for head_dim in (64, 128):
        for stages in hb.TILES[head_dim]:
            kv = hb_build._descriptor_type(hb.BLOCK_N.value, head_dim, swizzle=head_dim)
            rows = f"tensordesc<fp32[{hb.BLOCK_M.value}],{hb.ROW_LAYOUT}>"
            dq_block = (hb.BLOCK_M.value, head_dim // 2)
            dq = f"tensordesc<fp32{list(dq_block)},{triton_hopper.shared_layout(dq_block, torch.float32)}>"
            grads = dict(DK="*bf16", DV="*bf16") if name == "nostore" else dict(
                DK=hb_build._descriptor_type(64, head_dim, swizzle=head_dim if name == "vstage" else 128),
                DV=hb_build._descriptor_type(64, head_dim, swizzle=head_dim if name == "vstage" else 128))
            signature = dict(k_desc=kv, v_desc=kv, q_desc=hb_build._descriptor_type(hb.BLOCK_M.value, head_dim),
                             do_desc=hb_build._descriptor_type(hb.BLOCK_M.value, head_dim), lse_desc=rows,
                             delta_desc=rows, **grads,
                             **dict.fromkeys(["stride_dkb", "stride_dkh", "stride_dkt", "stride_dvb", "stride_dvh",
                                              "stride_dvt"], "i32"),
                             dq_desc=dq, **dict.fromkeys(["H_kv", "GROUP", "n_kv_heads", "heads_per_group", "Tq",
                                                          "Tq_pad", "Tk", "diag"], "i32"), scale="fp32")
            kernel = hb_build._compile(hb._attn_bwd_ws, signature, dict(STAGES=stages), hb.LAUNCH_REGS)
            figures, _ = hb_build.report(kernel)
            print(json.dumps(dict(variant=name, head_dim=head_dim, stages=stages, **figures)), flush=True)

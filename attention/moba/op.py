"""MoBA's kernels as PyTorch operators with autograd (as flash/autograd.py is for dense attention): on an sm_90 GPU the
Hopper kernels over the gathered entries (hopper.py), elsewhere the `tl` kernels over the entry lists
(tl_kernels.py), both §11.

    y = moba_triton(q, k, v, selection, block_size, scale)   # selection: attention/moba/reference.py:moba_select
"""
import torch
import triton

from . import hopper, tl_kernels
from ..flash.ops import define_op
from ..flash.dispatch import HOPPER_MODE, empty_bthd
from ..flash.tiles import candidate_tiles


def _moba_fwd_fake(q, k, v, selection, block_size, scale):
    B, H, T, D = q.shape
    lists = [q.new_empty(B * H, n, dtype=torch.int32) for n in (T * selection.shape[-1], -(-T // block_size),
                                                                 -(-T // block_size))]
    return empty_bthd(B, H, T, D, q), q.new_empty(B, H, T, dtype=torch.float32), *lists


moba_fwd = define_op("moba_fwd(Tensor q, Tensor k, Tensor v, Tensor selection, int block_size, float scale) "
                     "-> (Tensor, Tensor, Tensor, Tensor, Tensor)", tl_kernels.forward, _moba_fwd_fake)


def _moba_bwd_fake(do, q, k, v, o, lse, selection, order, first, count, block_size, scale):
    return tuple(empty_bthd(*t.shape, t) for t in (q, k, v))


moba_bwd = define_op("moba_bwd(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor selection, "
                     "Tensor order, Tensor first, Tensor count, int block_size, float scale) -> (Tensor, Tensor, Tensor)",
                     tl_kernels.backward, _moba_bwd_fake)


def _moba_hopper_fwd_fake(q, k, v, selection, block_size, scale):
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], selection.shape[-1]
    n_rows = hopper.layout_rows(B, Hq, Hkv, T, S, block_size)
    return (empty_bthd(B, Hq, T, D, q), q.new_empty(B, Hq, T, dtype=torch.float32),
            q.new_empty(n_rows, dtype=torch.int32), q.new_empty(1, 2, B * Hkv * T, dtype=torch.int32))


moba_hopper_fwd = define_op("moba_hopper_fwd(Tensor q, Tensor k, Tensor v, Tensor selection, int block_size, "
                            "float scale) -> (Tensor, Tensor, Tensor, Tensor)",
                            hopper.forward, _moba_hopper_fwd_fake)


def _moba_hopper_bwd_fake(do, q, k, v, o, lse, src, key_spans, scale):
    return empty_bthd(*q.shape, q), k.new_empty(k.shape), v.new_empty(v.shape)


moba_hopper_bwd = define_op("moba_hopper_bwd(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, "
                            "Tensor src, Tensor key_spans, float scale) "
                            "-> (Tensor, Tensor, Tensor)", hopper.backward, _moba_hopper_bwd_fake)


class MobaFunction(torch.autograd.Function):
    """Autograd for the MoBA kernels (the selection gets no gradient); under torch.compile it calls the
    ops, in eager mode the launchers directly (see flash/autograd.py for why). on_hopper: which kernels."""

    @staticmethod
    def forward(ctx, q, k, v, selection, block_size: int, scale: float, on_hopper: bool):
        if on_hopper:
            fwd = moba_hopper_fwd if torch.compiler.is_compiling() else hopper.forward
            o, lse, *layout = fwd(q, k, v, selection, block_size, scale)
            ctx.args = (scale,)
        else:
            fwd = moba_fwd if torch.compiler.is_compiling() else tl_kernels.forward
            o, lse, *lists = fwd(q, k, v, selection, block_size, scale)
            layout = (selection, *lists)
            ctx.args = (block_size, scale)
        ctx.save_for_backward(q, k, v, o, lse, *layout)
        ctx.on_hopper = on_hopper
        return o

    @staticmethod
    def backward(ctx, do):
        if ctx.on_hopper:
            bwd = moba_hopper_bwd if torch.compiler.is_compiling() else hopper.backward
        else:
            bwd = moba_bwd if torch.compiler.is_compiling() else tl_kernels.backward
        dq, dk, dv = bwd(do, *ctx.saved_tensors, *ctx.args)
        return dq, dk, dv, None, None, None, None


def moba_triton(q, k, v, selection: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """MoBA attention of q (B, Hq, T, D), k, v (B, Hkv, T, D) over selection (B, Hq, T, topk + 1)
    (attention/moba/reference.py:moba_select), on inputs flash.device.check_triton_support passed. block_size must be a
    multiple of the `tl` kernels' tiles (128 on a GPU)."""
    try:
        for kernel in ("fwd", "dq", "dkdv"):
            candidate_tiles(kernel, triton.next_power_of_2(q.shape[-1]), q.dtype.itemsize, block_size)
    except ValueError:
        raise ValueError(f"the triton MoBA kernels walk a block in tiles, and block_size={block_size} is smaller "
                         "than every tile of one of them; use a multiple of 128 (the MoBA paper uses 512)") from None
    on_hopper = HOPPER_MODE != "0" and hopper.runs_on(q)
    return MobaFunction.apply(q, k, v, selection.contiguous(), block_size, scale, on_hopper)

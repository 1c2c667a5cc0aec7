"""How the Hopper backward's consumers add dQ (gluon_backward._key_gradients, §13): dQ = dS K over a query tile,
issued as a wgmma (dq_product), then added into the float32 buffer, by the copy engine from a staging tile
(tma_add), or for a gathered problem by atomics into the rows it names (dq_targets, add_dq_cols). dq_cols says how
many columns a warpgroup adds at once, in the kernel and on the host (backward.py).

Imported only where Gluon exists (device.HAS_GLUON), as gluon_common.
"""
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from .shapes import QUERY_BLOCK


@triton.constexpr_function
def dq_cols(head_dim):
    """The columns of a query tile's dQ a consumer warpgroup adds at once (in the kernel and on the host), and so
    whether the warpgroups take turns (_key_gradients' TURNS): all of them at hs=64, where they do, half at
    hs=128, where each adds half of every tile's."""
    return head_dim if head_dim == 64 else head_dim // 2


@builtin
def tma_add(desc, coord, src, _semantic=None):
    """global[desc's block at coord] += shared memory src, by the copy engine (`cp.reduce.async.bulk.tensor
    .add`): a thread issues it and goes on; tma.store_wait(n) waits until at most n such copies still read their
    source. Triton 3.9 calls it tma.async_atomic_add; 3.6 has the operation but no Gluon name for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)

@gluon.jit
def dq_product(u, ds_smem, k_cols, ds_ready):
    """Issue dQ[:, cols] = dS K[:, cols] (M, C) of query tile u, k_cols being K's (N, C) columns cols, once both
    halves of its dS^T are in buffer u % 2; -> the wgmma's token."""
    COLS: gl.constexpr = k_cols.shape[1]
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, COLS, 16])  # 4 warps along the rows
    mbarrier.wait(ds_ready.index(u % 2), (u // 2) & 1)
    return warpgroup_mma(ds_smem.index(u % 2).permute((1, 0)), k_cols,
                         gl.zeros([QUERY_BLOCK, COLS], gl.float32, dq_layout), use_acc=False, is_async=True)

@triton.constexpr_function
def add_layout(cols):
    """The layout a warpgroup adds a (QUERY_BLOCK, cols) dQ block from by atomics: four adjacent columns per thread,
    so that each warp's add is two whole rows, 16-byte vectors (add_dq_cols)."""
    return gl.BlockedLayout([1, 4], [32 * 4 // cols, cols // 4], [4, 1], [1, 0])

@gluon.jit
def dq_targets(ROW_SRC, bh, start_m, Tq, HEAD_DIM: gl.constexpr, COLS: gl.constexpr):
    """Where each row of query tile start_m of query head bh adds its dQ: the offset of a row of the float32 buffer
    (M,) (negative for none), whose index ROW_SRC (B*Hq*Tq,) holds (§11 "MoBA on the Hopper kernels": MoBA's rows
    add into their queries'). In add_layout, and whole multiples of HEAD_DIM, so that the adds go out four
    columns at a time."""
    rows = start_m + gl.arange(0, QUERY_BLOCK, layout=gl.SliceLayout(1, add_layout(COLS)))  # (M,)
    return gl.load(ROW_SRC + bh.to(gl.int64) * Tq + rows, mask=rows < Tq, other=-1).to(gl.int64) * HEAD_DIM

@gluon.jit
def add_dq_cols(WG: gl.constexpr, u, n, dq, first_col, ds_empty, DQ_ACC, dq_smem, targets, bh, start_m, Tq_pad):
    """Query tile u's dQ[:, first_col:] done, the warpgroup's n-th: free its dS^T buffer, and add dq into the
    float32 buffer. Without targets the copy engine adds it into the rows of query head bh (DQ_ACC a descriptor)
    from a staging tile; a warpgroup has STAGING of them (attn_bwd_ws), used in turn: the n-th is free once at most
    STAGING - 1 reductions still read theirs. With targets (dq_targets) the warpgroup adds it by atomics into
    the rows they name (DQ_ACC a pointer), from add_layout: each warp's add is two whole rows of the block, which
    L2 adds sector by sector as it adds the copy engine's (from dq's own layout a warp's add would touch eight rows
    two columns at a time: twice the instructions, and measured slower)."""
    mbarrier.arrive(ds_empty.index(u % 2), count=1)
    if targets is None:
        STAGING: gl.constexpr = dq_smem.shape[0] // 2
        staging = dq_smem.index(WG * STAGING + n % STAGING)  # (M, C)
        tma.store_wait(STAGING - 1)
        staging.store(dq)
        fence_async_shared()  # the stores, visible to the copy engine
        tma_add(DQ_ACC, [bh * Tq_pad + start_m, first_col], staging)
    else:
        layout: gl.constexpr = add_layout(dq.shape[1])
        cols = first_col + gl.arange(0, dq.shape[1], layout=gl.SliceLayout(0, layout))  # (C,)
        gl.atomic_add(DQ_ACC + targets[:, None] + cols[None, :], gl.convert_layout(dq, layout),
                      mask=(targets >= 0)[:, None], sem="relaxed")

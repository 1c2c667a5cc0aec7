"""Probe: the forward in Gluon (Triton's lower-level language) for Hopper, with what tl cannot say:
async wgmma so the softmax of key tile j runs while the tensor cores do P_{j-1} V_{j-1} (FA3's
intra-warpgroup overlap), TMA loads into a ring of STAGES slots with mbarriers. Contiguous (B, H, T, D)."""
import sys, os, json
import torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor



@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, row0, tile, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    slot = tile % STAGES
    pred = tile < n_tiles
    bar = bars.index(slot)
    mbarrier.expect(bar, 2 * k_desc.block_type.nbytes, pred)
    tma.async_copy_global_to_shared(k_desc, [row0 + tile * BLOCK_N, 0], bar, k_smem.index(slot), pred)
    tma.async_copy_global_to_shared(v_desc, [row0 + tile * BLOCK_N, 0], bar, v_smem.index(slot), pred)


@gluon.jit
def _masked(s, q_abs, start_n, Tk, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    k_pos = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if CAUSAL:
        visible = k_pos[None, :] <= q_abs[:, None]
    else:
        visible = (k_pos < Tk)[None, :] & (q_abs >= 0)[:, None]
    return gl.where(visible, s, float("-inf"))


@gluon.jit
def _gluon_fwd(q_desc, k_desc, v_desc, O, LSE, H, Tq, Tk, scale,
               HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr):
    NUM_WARPS: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    tile_m = gl.program_id(0)
    if CAUSAL:
        tile_m = gl.num_programs(0) - 1 - tile_m
    start_m = tile_m * BLOCK_M
    bh = gl.program_id(1)
    q_row0 = bh * Tq
    kv_row0 = bh * Tk
    if CAUSAL:
        end = gl.minimum(start_m + BLOCK_M + Tk - Tq, Tk)
        mask_from = start_m + Tk - Tq  # key tiles ending past the first row's last key need the mask
    else:
        end = Tk
        mask_from = Tk // BLOCK_N * BLOCK_N
    n_tiles = gl.cdiv(end, BLOCK_N)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_bars.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row0 + start_m, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _issue_kv(k_desc, v_desc, k_smem, v_smem, kv_bars, kv_row0, i, n_tiles, BLOCK_N, STAGES)

    qk_scale = scale * 1.4426950408889634
    q_abs = start_m + gl.arange(0, BLOCK_M, layout=s_rows) + (Tk - Tq)  # (M,) absolute positions
    mbarrier.wait(q_bar, 0)

    # tile 0: S_0 = Q K_0^T, its softmax
    mbarrier.wait(kv_bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                      use_acc=False)
    if BLOCK_N > mask_from:
        s = _masked(s, q_abs, 0, Tk, s_layout, BLOCK_N, CAUSAL)
    m_i = gl.max(s, 1) * qk_scale
    m_ref = gl.where(m_i == float("-inf"), 0.0, m_i)
    p = gl.exp2(s * qk_scale - m_ref[:, None])
    l_i = gl.sum(p, 1)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    for j in range(1, n_tiles):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        # S_j = Q K_j^T and O += P_{j-1} V_{j-1}, both in flight; wait for S_j only
        mbarrier.wait(kv_bars.index(slot), (j // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)),
                              gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_tok])
        # softmax of tile j while P_{j-1} V_{j-1} runs
        if (j + 1) * BLOCK_N > mask_from:
            s = _masked(s, q_abs, j * BLOCK_N, Tk, s_layout, BLOCK_N, CAUSAL)
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - m_ref[:, None])
        alpha = gl.exp2(m_i - m_ref)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = warpgroup_mma_wait(0, deps=[o_tok])
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        # slot prev is free (K_{j-1} and V_{j-1} consumed): load tile j - 1 + STAGES into it
        _issue_kv(k_desc, v_desc, k_smem, v_smem, kv_bars, kv_row0, j - 1 + STAGES, n_tiles, BLOCK_N, STAGES)

    last = (n_tiles - 1) % STAGES
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    acc = warpgroup_mma(p_op, v_smem.index(last), acc)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_bars.index(i))

    l_o = gl.convert_layout(l_i, o_rows)
    seen = l_o > 0
    l_safe = gl.where(seen, l_o, 1.0)
    rows = start_m + gl.arange(0, BLOCK_M, layout=o_rows)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = O + (q_row0 + rows).to(gl.int64)[:, None] * HEAD_DIM + cols[None, :]
    gl.store(o_ptrs, (acc / l_safe[:, None]).to(gl.bfloat16), mask=(rows < Tq)[:, None])
    m_o = gl.convert_layout(m_i, o_rows)
    lse = gl.where(seen, (m_o + gl.log2(l_safe)) * 0.6931471805599453, float("inf"))
    gl.store(LSE + q_row0 + rows, lse, mask=rows < Tq)


def gluon_forward(q, k, v, causal, tile):
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    bm, bn, w, stages = tile
    o = torch.empty_like(q)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    def desc(t, rows):
        flat = t.reshape(-1, D)
        return TensorDescriptor.from_tensor(flat, [rows, D], gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16))
    _gluon_fwd[(triton.cdiv(Tq, bm), B * H)](desc(q, bm), desc(k, bn), desc(v, bn), o, lse, H, Tq, Tk, D ** -0.5,
                                             HEAD_DIM=D, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages,
                                             num_warps=w)
    return o, lse


TILES = {128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2)], 64: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2)]}

if __name__ == "__main__":
    # one (head dim, causal) pair per process, run under timeout: a hung kernel loses only its pair
    from torch.nn.attention import sdpa_kernel, SDPBackend
    import torch.nn.functional as F
    from attention import triton_flash as tf
    D, causal = int(sys.argv[1]), sys.argv[2] == "1"
    log = open(os.path.join(os.environ.get("OUT", "."), f"gluon_probe_{D}_{int(causal)}.jsonl"), "a")
    shapes = [(16384 // T, 2048 // D, T) for T in (1024, 4096, 16384)]
    if D == 64 and causal:
        shapes.insert(0, (16, 12, 1024))  # GPT-2
    for B, H, T in shapes:
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal).float()
        runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                "ours": lambda: tf.forward(q, k, v, causal, D ** -0.5)[0]}
        runs.update({f"gluon{tile}": (lambda tile=tile: gluon_forward(q, k, v, causal, tile)[0]) for tile in TILES[D]})
        for name, f in runs.items():
            print(f"D={D} causal={causal:d} B={B} H={H} T={T} {name} ...", end=" ", flush=True)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                try:
                    err = (f().float() - ref).abs().max().item()
                    ms = triton.testing.do_bench(f, warmup=25, rep=200)
                except Exception as e:
                    err, ms = repr(e)[:120], None
            print(ms, err, flush=True)
            log.write(json.dumps(dict(D=D, causal=causal, B=B, H=H, T=T, name=name, ms=ms, err=err)) + "\n"); log.flush()

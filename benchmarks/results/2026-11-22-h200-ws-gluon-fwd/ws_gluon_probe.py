"""Probe: a warp-specialized forward in Gluon for Hopper, FA3's layout. Per program 128 query rows:
  - a producer warp: Q once, then K_j, V_j by TMA into a ring of STAGES slots; it refills a slot when
    both consumers have arrived on that slot's "empty" mbarrier (no CTA-wide barrier anywhere);
  - two consumer warpgroups of 64 rows each (the default partition and a worker), each running
    S_j = Q K_j^T while P_{j-1} V_{j-1} is in flight (async wgmma), so its softmax runs under its own
    matmuls and the warp scheduler interleaves the two warpgroups.
Contiguous (B, H, T, D) bf16 inputs. Session 8's probe (../2026-11-22-h200-hopper-ws-gluon/gluon_probe.py)
did the same without warp specialization and lost to four CTA-wide barriers per key tile.

    PYTHONPATH=$PWD python3 ws_gluon_probe.py compile        # sm_90 build, no GPU needed (Triton 3.6): registers, spills
    PYTHONPATH=$PWD python3 ws_gluon_probe.py smoke          # on the H200: one small launch per tile against float64
    PYTHONPATH=$PWD python3 ws_gluon_probe.py D CAUSAL        # on the H200: error and time vs cuDNN and ours
"""
import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma M)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, q_row0, kv_row0, n_tiles):
    STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    mbarrier.expect(q_bar.index(0), 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row0, 0], q_bar.index(0), q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row0 + ROWS, 0], q_bar.index(0), q_smem.index(1))
    for j in range(n_tiles):
        slot = j % STAGES
        # a fresh mbarrier counts as having completed the phase before phase 0: the first pass waits on nothing
        mbarrier.wait(kv_empty.index(slot), ((j // STAGES) & 1) ^ 1)
        ready = kv_ready.index(slot)
        mbarrier.expect(ready, 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row0 + j * BLOCK_N, 0], ready, k_smem.index(slot))
        tma.async_copy_global_to_shared(v_desc, [kv_row0 + j * BLOCK_N, 0], ready, v_smem.index(slot))


@gluon.jit
def _masked(s, first_row, start_n, Tk, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """s with -inf where a key is past the sequence or (causal) after the row's position. first_row: the
    absolute position (bottom-right aligned) of this warpgroup's first query."""
    k_pos = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if CAUSAL:
        q_abs = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        visible = k_pos[None, :] <= q_abs[:, None]
    else:
        visible = (k_pos < Tk)[None, :] & (gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout)) >= 0)[:, None]
    return gl.where(visible, s, float("-inf"))


@gluon.jit
def _my_turn(turn, WG: gl.constexpr, k):
    """Ping-pong (FA3): the two warpgroups take turns to issue their matmuls, so one's softmax runs while the
    tensor cores work on the other's. Issue point k of warpgroup WG waits for the other's issue point k - 1
    (warpgroup 0 goes first: a fresh mbarrier passes a wait for parity 1)."""
    if turn.type.shape[0] == 2:
        mbarrier.wait(turn.index(WG), (k & 1) ^ (1 - WG))


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr):
    if turn.type.shape[0] == 2:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _consume(WG: gl.constexpr, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, O, LSE, q_row0, start_m,
             n_tiles, Tq, Tk, scale):
    """Warpgroup WG's 64 rows: the online softmax (§2) over the key tiles, then O and the log-sum-exp."""
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    CAUSAL: gl.constexpr = q_bar.type.shape[0] == 2  # see _ws_fwd
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    first_row = start_m + WG * ROWS + Tk - Tq  # absolute position of this warpgroup's first query
    if CAUSAL:
        n_mine = gl.cdiv(gl.minimum(first_row + ROWS, Tk), BLOCK_N)  # the tiles any of its rows sees
        mask_from = first_row  # tiles ending past this need the causal mask
    else:
        n_mine = n_tiles
        mask_from = Tk // BLOCK_N * BLOCK_N  # a ragged last tile: keys past Tk load as zeros, mask them
    qk_scale = scale * 1.4426950408889634
    q = q_smem.index(WG)
    mbarrier.wait(q_bar.index(0), 0)

    mbarrier.wait(kv_ready.index(0), 0)
    _my_turn(turn, WG, 0)
    s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    _pass_turn(turn, WG)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    if BLOCK_N > mask_from:
        s = _masked(s, first_row, 0, Tk, s_layout, BLOCK_N, CAUSAL)
    m_i = gl.max(s, 1) * qk_scale
    p = gl.exp2(s * qk_scale - gl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
    l_i = gl.sum(p, 1)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

    for j in range(1, n_mine):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(kv_ready.index(slot), (j // STAGES) & 1)
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        _my_turn(turn, WG, j)
        s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                              use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        _pass_turn(turn, WG)
        s = warpgroup_mma_wait(1, deps=[s_tok])  # S_j ready; P_{j-1} V_{j-1} still running
        if (j + 1) * BLOCK_N > mask_from:
            s = _masked(s, first_row, j * BLOCK_N, Tk, s_layout, BLOCK_N, CAUSAL)
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - m_ref[:, None])
        alpha = gl.exp2(m_i - m_ref)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(kv_empty.index(prev), count=1)  # this warpgroup is done with K_{j-1}, V_{j-1}
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    last = (n_mine - 1) % STAGES
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    _my_turn(turn, WG, n_mine)
    o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    _pass_turn(turn, WG)
    acc = warpgroup_mma_wait(0, deps=[o_tok])
    mbarrier.arrive(kv_empty.index(last), count=1)
    for j in range(n_mine, n_tiles):  # tiles only the other warpgroup's rows see: release them unread
        mbarrier.wait(kv_ready.index(j % STAGES), (j // STAGES) & 1)
        mbarrier.arrive(kv_empty.index(j % STAGES), count=1)
        _my_turn(turn, WG, j + 1)  # keep the turn count equal to the other warpgroup's (n_tiles + 1 issue points)
        _pass_turn(turn, WG)

    l_o = gl.convert_layout(l_i, o_rows)
    seen = l_o > 0
    l_safe = gl.where(seen, l_o, 1.0)
    rows = start_m + WG * ROWS + gl.arange(0, ROWS, layout=o_rows)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = O + (q_row0 + WG * ROWS + gl.arange(0, ROWS, layout=o_rows)).to(gl.int64)[:, None] * HEAD_DIM + cols[None, :]
    gl.store(o_ptrs, (acc / l_safe[:, None]).to(gl.bfloat16), mask=(rows < Tq)[:, None])
    m_o = gl.convert_layout(m_i, o_rows)
    lse = gl.where(seen, (m_o + gl.log2(l_safe)) * 0.6931471805599453, float("inf"))
    gl.store(LSE + q_row0 + WG * ROWS + gl.arange(0, ROWS, layout=o_rows), lse, mask=rows < Tq)


@gluon.jit
def _consumer0(q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, O, LSE, q_row0, start_m, n_tiles, Tq, Tk,
               scale):
    _consume(0, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, O, LSE, q_row0, start_m, n_tiles, Tq, Tk,
             scale)


@gluon.jit
def _consumer1(q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, O, LSE, q_row0, start_m, n_tiles, Tq, Tk,
               scale):
    _consume(1, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, O, LSE, q_row0, start_m, n_tiles, Tq, Tk,
             scale)


@gluon.jit
def _ws_fwd(q_desc, k_desc, v_desc, O, LSE, Tq, Tk, scale, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr):
    BLOCK_M: gl.constexpr = 2 * ROWS
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    tile_m = gl.program_id(0)
    if CAUSAL:
        tile_m = gl.num_programs(0) - 1 - tile_m  # longest rows first
    start_m = tile_m * BLOCK_M
    bh = gl.program_id(1)
    q_row0 = bh * Tq + start_m
    kv_row0 = bh * Tk
    if CAUSAL:
        n_tiles = gl.cdiv(gl.minimum(start_m + BLOCK_M + Tk - Tq, Tk), BLOCK_N)
    else:
        n_tiles = gl.cdiv(Tk, BLOCK_N)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    # Triton 3.6 hands warp_specialize's constexpr arguments to the partitions as tensors, so the partitions
    # read their constants from shapes: STAGES and BLOCK_N from the K ring's, CAUSAL from q_bar's length,
    # PINGPONG from turn's
    q_bar = gl.allocate_shared_memory(gl.int64, [2 if CAUSAL else 1, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2 if PINGPONG else 1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    for i in gl.static_range(2 if PINGPONG else 1):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()

    consumer_args = (q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, O, LSE, q_row0, start_m, n_tiles, Tq, Tk,
                     scale)
    gl.warp_specialize([
        (_consumer0, consumer_args),
        (_consumer1, consumer_args),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, q_row0, kv_row0,
                     n_tiles)),
    ], [4, 1], [CONSUMER_REGS, 24])


def _desc(t, rows):
    flat = t.reshape(-1, t.shape[-1])
    return TensorDescriptor.from_tensor(flat, [rows, t.shape[-1]],
                                        gl.NVMMASharedLayout.get_default_for([rows, t.shape[-1]], gl.bfloat16))


def ws_forward(q, k, v, causal, tile):
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    block_n, stages, regs, maxnreg, pingpong = tile
    o = torch.empty_like(q)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    _ws_fwd[(triton.cdiv(Tq, 128), B * H)](_desc(q, 64), _desc(k, block_n), _desc(v, block_n), o, lse, Tq, Tk,
                                           D ** -0.5, CAUSAL=causal, BLOCK_N=block_n, STAGES=stages,
                                           CONSUMER_REGS=regs, PINGPONG=pingpong, num_warps=4, maxnreg=maxnreg)
    return o, lse


# (BLOCK_N, STAGES, consumer worker's registers, maxnreg, ping-pong): 12 warps in all (4 + 4 + the producer's
# warpgroup). The first run (first/) timed the first three of each list without ping-pong.
TILES = {128: [(64, 3, 240, 168, False), (64, 3, 240, 168, True), (64, 4, 240, 168, True), (128, 2, 240, 168, True)],
         64: [(128, 3, 240, 168, False), (128, 3, 240, 168, True), (64, 4, 240, 168, True), (128, 2, 240, 168, True)]}


def compile_sm90(D, causal, tile):
    import inspect
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    block_n, stages, regs, maxnreg, pingpong = tile
    params = list(inspect.signature(_ws_fwd.fn).parameters)
    desc = lambda rows: "tensordesc<bf16[%d, %d],%s>" % (rows, D, gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16))
    sig = dict(q_desc=desc(64), k_desc=desc(block_n), v_desc=desc(block_n), O="*bf16", LSE="*fp32", Tq="i32", Tk="i32",
               scale="fp32")
    consts = dict(CAUSAL=causal, BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=regs, PINGPONG=pingpong)
    sig.update({c: "constexpr" for c in consts})
    src = GluonASTSource(fn=_ws_fwd, signature=sig, constexprs={(params.index(a),): b for a, b in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))


def measure(D, causal, log):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    from attention import triton_flash as tf
    shapes = [(16384 // T, 2048 // D, T) for T in (1024, 4096, 16384)]
    if D == 64 and causal:
        shapes.insert(0, (16, 12, 1024))  # GPT-2
    for B, H, T in shapes:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = None
        if B * H * T * T <= 2 ** 31:  # the float64 reference's scores fit in 16 GiB
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal).float()
        runs = {"cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                "ours": lambda: tf.forward(q, k, v, causal, D ** -0.5)[0]}
        runs.update({f"ws{tile}": (lambda tile=tile: ws_forward(q, k, v, causal, tile)[0]) for tile in TILES[D]})
        for name, f in runs.items():
            print(f"D={D} causal={causal:d} B={B} H={H} T={T} {name} ...", end=" ", flush=True)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                try:
                    out = f()
                    torch.cuda.synchronize()
                    err = None if ref is None else (out.float() - ref).abs().max().item()
                    ms = triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")
                except Exception as e:  # a tile that does not build: record why, go on
                    err, ms = repr(e)[:200], None
            print(ms, err, flush=True)
            log.write(json.dumps(dict(D=D, causal=causal, B=B, H=H, T=T, name=name, ms=ms, err=err)) + "\n")
            log.flush()


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile"]:
        import subprocess
        import tempfile

        def usage(kernel):
            """ptxas's resource line and the SASS of a compiled kernel, through Triton's own cuobjdump."""
            cubin = os.path.join(tempfile.mkdtemp(), "k.cubin")
            open(cubin, "wb").write(kernel.asm["cubin"])
            tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
            run = lambda *flags: subprocess.run([tool, *flags, cubin], capture_output=True, text=True).stdout
            return [line.strip() for line in run("--dump-resource-usage").splitlines() if "REG" in line], run("-sass")
        for D in (128, 64):
            for causal in (False, True):
                for tile in TILES[D]:
                    kernel = compile_sm90(D, causal, tile)
                    u, sass = usage(kernel)
                    print(D, causal, tile, u, "STL", sass.count("STL"), "HGMMA", sass.count("HGMMA"),
                          "BAR.SYNC", sass.count("BAR.SYNC"), "smem", kernel.metadata.shared, flush=True)
                    if os.environ.get("SASS"):
                        open(os.environ["SASS"], "w").write(sass)
        sys.exit()
    if sys.argv[1:2] == ["smoke"]:  # one small launch per tile, against float64: does it finish, is it right
        import torch.nn.functional as F
        for D in (128, 64):
            for causal in (False, True):
                torch.manual_seed(0)
                q, k, v = (torch.randn(2, 3, 1000, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal).float()
                for tile in TILES[D]:
                    print(f"smoke D={D} causal={causal:d} {tile} ...", end=" ", flush=True)
                    out = ws_forward(q, k, v, causal, tile)[0]
                    torch.cuda.synchronize()
                    print("max error", (out.float() - ref).abs().max().item(), flush=True)
        sys.exit()
    # one (head dim, causal) pair per process, under `timeout`: a hung kernel loses only its pair
    D, causal = int(sys.argv[1]), sys.argv[2] == "1"
    with open(os.path.join(os.environ.get("OUT", "."), f"ws_gluon_{D}_{int(causal)}.jsonl"), "a") as log:
        measure(D, causal, log)

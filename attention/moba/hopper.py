"""MoBA (reference.py, §11) on the warp-specialized Hopper kernels (§12, §13): every entry, a query and one block it
reads, becomes a row of one cross-attention problem whose rows and keys see each other through spans
(§11 "MoBA on the Hopper kernels", §14 "Documents on the Hopper kernels").

    layout = entry_layout(selection, block_size, Hkv)     # where each entry's row goes, and the spans
    o, lse, src, key_spans = forward(q, k, v, selection, block_size, scale)
    dq, dk, dv = backward(do, q, k, v, o, lse, src, key_spans, scale)

The keys are k and v as they are, one sequence of B*Hkv*T rows that the kernels read where they lie. The rows are the
entries block by block: for each (batch, kv head, key block) a segment, its own entries first (query by query, the
group's heads side by side), then every entry that chose it as a past block, padded to a whole forward tile. The
kernels' producer warps read each row from its query's row of q (and of dO in the backward; gather_rows), so that no
gathered copy of either is made. A row's span is the keys it sees: its block, and for an own entry the block up to the
query. A key's span is the rows that see it: from the own rows of its query on to the segment's end, one interval, so
the backward needs nothing else. The forward leaves an output and lse per row, which a merge by log-sum-exp combines per
query; the backward adds each row's dQ into its query's row of one float32 buffer, and leaves dK, dV whole, the keys'
gradients from all their rows.
"""
import torch
import triton
import triton.language as tl

from ..flash.hopper import backward as hopper_backward
from ..flash.hopper import forward as hopper_forward
from ..flash.hopper.shapes import KEY_BLOCK, HopperBackwardTile, HopperForwardTile
from ..flash.dispatch import empty_bthd
from .tl_kernels import merge_slots

ROW_TILE = 128  # the forward's query tile (two consumers of 64 rows, document_tiles): a segment's start


def layout_rows(B: int, Hq: int, Hkv: int, T: int, S: int, block_size: int) -> int:
    """The rows of the gathered problem: every slot of every query, and each segment's padding, rounded up to a
    tile. The selection lives on the GPU; sizing by this bound, not by the count, keeps the call free of host syncs.
    The rows past the used ones see no key."""
    rows = B * Hq * T * S + B * Hkv * triton.cdiv(T, block_size) * (ROW_TILE - 1)
    return triton.cdiv(rows, ROW_TILE) * ROW_TILE


@triton.jit
def _entry_runs(SELECTION, RUN, T, G, n_blocks, S: tl.constexpr, BLOCK: tl.constexpr):
    """RUN (B*Hkv, T*G*S): per kv head its entries in (query, head of the group, slot) order, each as the run it sorts
    into: 2n for an own entry of block n, 2n + 1 for a past one, 2 * n_blocks for an empty slot. SELECTION
    (B, Hq, T, S), query head h = kv head * G + g."""
    r = tl.program_id(1)
    entry = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # (E,)
    n_entries = T * G * S
    inside = entry < n_entries
    t, g, s = entry // (G * S), entry // S % G, entry % S
    block = tl.load(SELECTION + ((r * G + g).to(tl.int64) * T + t) * S + s, mask=inside, other=-1)
    run = tl.where(block >= 0, 2 * block + (s > 0), 2 * n_blocks)
    tl.store(RUN + r.to(tl.int64) * n_entries + entry, run.to(RUN.dtype.element_ty), mask=inside)


@triton.jit
def _place_entries(SORTED_RUN, ORDER, FIRST, SEGMENT_START, POS, SRC, T, G, n_blocks, S: tl.constexpr,
                   BLOCK: tl.constexpr):
    """For the sorted entries of kv head r: entry p of block n's segment goes to row SEGMENT_START[r, n] + p -
    FIRST[r, n]; POS (B, Hq, T, S) gets its row (-1 for an empty slot), SRC its query, (b * Hq + h) * T + t."""
    r = tl.program_id(1)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # (E,) sorted positions
    n_entries = T * G * S
    inside = p < n_entries
    run = tl.load(SORTED_RUN + r.to(tl.int64) * n_entries + p, mask=inside, other=2 * n_blocks).to(tl.int32)
    entry = tl.load(ORDER + r.to(tl.int64) * n_entries + p, mask=inside, other=0)
    valid = run < 2 * n_blocks
    segment = r * n_blocks + tl.minimum(run // 2, n_blocks - 1)
    row = tl.load(SEGMENT_START + segment) + p - tl.load(FIRST + segment)
    t, g, s = entry // (G * S), entry // S % G, entry % S
    query = (r * G + g).to(tl.int64) * T + t  # (b * Hq + h) * T + t
    tl.store(POS + query * S + s, tl.where(valid, row, -1).to(tl.int32), mask=inside)
    tl.store(SRC + row, query.to(tl.int32), mask=inside & valid)


@triton.jit
def _row_spans(SPANS, TILE_SEGMENT, SEGMENT_START, USED_ROWS, T, G, n_blocks, n_rows, MOBA_BLOCK: tl.constexpr,
               ROWS: tl.constexpr):
    """SPANS (2, n_rows): the keys each row of a ROWS-row tile sees, [first, end) in the B*Hkv*T keys. A tile lies in
    one segment (segments start on a tile), block n of kv head r: its first G * (block length) rows are the own
    entries, query n * MOBA_BLOCK + i // G at row i, which see the block up to themselves; the rest (past entries,
    padding) see the whole block. Rows past the used ones see nothing."""
    tile = tl.program_id(0)
    rows = tile * ROWS + tl.arange(0, ROWS)  # (R,)
    segment = tl.load(TILE_SEGMENT + tile)
    r, n = segment // n_blocks, segment % n_blocks
    first = r * T + n * MOBA_BLOCK
    length = tl.minimum(MOBA_BLOCK, T - n * MOBA_BLOCK)
    i = rows - tl.load(SEGMENT_START + segment)  # (R,) rows into the segment
    end = tl.where(i < G * length, first + i // G + 1, first + length)
    used = rows < tl.load(USED_ROWS)
    tl.store(SPANS + rows, tl.where(used, first, 0))
    tl.store(SPANS + n_rows + rows, tl.where(used, end, 0))


ENTRY_BLOCK = 1024  # entries per _entry_runs / _place_entries program


@torch.no_grad()
def entry_layout(selection: torch.Tensor, block_size: int, Hkv: int) -> tuple[torch.Tensor, ...]:
    """selection (B, Hq, T, S) key blocks per query (moba_select's: slot 0 its own, -1 empty) -> (pos, src, row_spans,
    key_spans), all int32:
    pos (B, Hq, T, S): the row of each entry, -1 for an empty slot;
    src (n_rows,): the query of each row, as (b * Hq + h) * T + t, -1 for padding;
    row_spans (1, 2, n_rows): the keys each row sees, [first, end) in the B*Hkv*T keys ([0, 0) past the used rows);
    key_spans (1, 2, B*Hkv*T): the rows that see each key, [first, end)."""
    B, Hq, T, S = selection.shape
    G, R, n_blocks = Hq // Hkv, B * Hkv, triton.cdiv(T, block_size)
    n_rows, n_entries = layout_rows(B, Hq, Hkv, T, S, block_size), T * G * S
    device = selection.device
    # per kv head a segment per block: its own entries (run 2n), then its past ones (run 2n + 1). The sort is stable,
    # so each run keeps the (query, head of the group) order, and sorts the small run numbers, not entry-unique keys
    # (tl_kernels.entry_lists)
    run = torch.empty(R, n_entries, dtype=torch.int16 if 2 * n_blocks < 2**15 else torch.int32, device=device)
    grid = (triton.cdiv(n_entries, ENTRY_BLOCK), R)
    _entry_runs[grid](selection, run, T, G, n_blocks, S=S, BLOCK=ENTRY_BLOCK)
    sorted_run, order = torch.sort(run, dim=-1, stable=True)
    starts = torch.searchsorted(sorted_run, torch.arange(2 * n_blocks + 1, dtype=run.dtype, device=device)
                                .expand(R, -1).contiguous())  # (R, 2 * n_blocks + 1)
    first, size = starts[:, :-1:2], starts[:, 2::2] - starts[:, :-1:2]  # (R, n_blocks) each segment's entries
    padded = (size + ROW_TILE - 1) // ROW_TILE * ROW_TILE
    ends = padded.flatten().cumsum(0)
    segment_start = ends - padded.flatten()  # (R * n_blocks,)

    pos = torch.empty(B, Hq, T, S, dtype=torch.int32, device=device)
    src = torch.full((n_rows,), -1, dtype=torch.int32, device=device)
    _place_entries[grid](sorted_run, order, first.contiguous(), segment_start, pos, src, T, G, n_blocks, S=S,
                         BLOCK=ENTRY_BLOCK)
    row_spans = torch.empty(1, 2, n_rows, dtype=torch.int32, device=device)
    tile_segment = torch.searchsorted(ends, torch.arange(0, n_rows, ROW_TILE, device=device), right=True)
    _row_spans[(n_rows // ROW_TILE,)](row_spans, tile_segment.clamp(max=R * n_blocks - 1), segment_start, ends[-1:],
                                      T, G, n_blocks, n_rows, MOBA_BLOCK=block_size, ROWS=ROW_TILE)

    # a key's span: the own rows of its query and those after it (row (t', g) sits at (t' - block start) * G + g),
    # then the block's past entries
    keys = torch.arange(T, device=device)
    start = segment_start.view(R, n_blocks)[:, keys // block_size]  # (R, T)
    key_spans = torch.stack([start + keys % block_size * G, start + size[:, keys // block_size]]).int()
    return pos, src, row_spans, key_spans.view(1, 2, R * T)


def flat_rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """(B, Hkv, T, D) tensors -> the one sequence of B*Hkv*T keys the rows' spans index, (1, 1, B*Hkv*T, D) views
    (copies where they are not contiguous)."""
    return [t.contiguous().view(1, 1, -1, t.shape[-1]) for t in tensors]


def key_tensors(k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """k, v (B, Hkv, T, D) as the kernels read a gathered problem's keys: where they lie, a model's layout included
    (§11 "Keys read where they are"), where each head's rows are whole key tiles (KEY_BLOCK, which the forward's
    tiles divide) and the copy engine reads them; else flat_rows' copies."""
    if k.shape[2] % KEY_BLOCK.value == 0 and hopper_forward.tma_can_read(k, v):
        return [k, v]
    return flat_rows(k, v)


def runs_on(q: torch.Tensor) -> bool:
    """Whether MoBA runs on the Hopper kernels: where they run (hopper_forward.runs_on), and not where determinism
    was asked for (the backward adds dQ in any order, §13)."""
    return hopper_forward.runs_on(q) and not torch.are_deterministic_algorithms_enabled()


def copyable_rows(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy where the producers cannot copy its rows in 16-byte pieces (hopper_forward.tma_can_read's
    rule, which tensors from a model's projections pass)."""
    return t if hopper_forward.tma_can_read(t) else t.contiguous()


# §11 the tiles MoBA's rows run fastest with on the Hopper kernels (docs/perf_notes.md section 11): at hs=128 the
# forward's 64-key tile, which has registers to spare for the spans, and the backward's staged dK, dV
MOBA_FORWARD_TILE = {64: HopperForwardTile(128, 3, 3, True, 2), 128: HopperForwardTile(64, 3, 3, True, 2)}
MOBA_BACKWARD_TILE = {64: HopperBackwardTile(2, False), 128: HopperBackwardTile(2, True)}


def forward(q, k, v, selection, block_size: int, scale: float):
    """-> out (B, Hq, T, D), lse (B, Hq, T) float32 of the merged slots, and for the backward the layout's src and
    key_spans (entry_layout)."""
    B, Hq, T, D = q.shape
    pos, src, row_spans, key_spans = entry_layout(selection, block_size, k.shape[1])
    q = copyable_rows(q)
    o_rows = q.new_empty(1, 1, src.shape[0], D)
    lse_rows = torch.empty(1, 1, src.shape[0], dtype=torch.float32, device=q.device)
    # §11 the rows' attention to their blocks (not causal: the own rows' spans end at their query)
    hopper_forward.forward(q, *key_tensors(k, v), o_rows, lse_rows, False, scale, MOBA_FORWARD_TILE[D],
                           (row_spans, None), row_src=src)
    o = empty_bthd(B, Hq, T, D, q)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    merge_slots(o_rows.view(-1, D), lse_rows.view(-1), pos, o, lse)
    return o, lse, src, key_spans


def backward(do, q, k, v, o, lse, src, key_spans, scale: float):
    """-> dq (B, Hq, T, D), dk, dv (B, Hkv, T, D). §5 with each row's P taken against its query's merged lse and
    Delta, so every row's share of the gradients is exact on its own."""
    B, Hq, T, D = q.shape
    q, do = copyable_rows(q), copyable_rows(do)
    dk, dv = (torch.empty(B, k.shape[1], T, D, dtype=k.dtype, device=k.device) for _ in range(2))
    dk_rows, dv_rows = flat_rows(dk, dv)
    # each row adds its dS K into its query's row (src numbers them); programs go key block by key block, so the
    # rows of the head being worked on meet in L2
    dq_acc = torch.zeros(B * Hq * T, D, dtype=torch.float32, device=q.device)
    hopper_backward.backward(do, q, *key_tensors(k, v), o, lse, None, dk_rows, dv_rows, False, scale,
                                    MOBA_BACKWARD_TILE[D], (key_spans, None), gathered=(src, dq_acc))
    dq = empty_bthd(B, Hq, T, D, q)
    hopper_backward.finish_dq(dq_acc, dq, T, scale)
    return dq, dk, dv

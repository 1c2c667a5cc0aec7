"""MoBA (attention/moba.py, §11) on the warp-specialized Hopper kernels (§12, §13): every entry, a query and one
block it reads, becomes a row of one cross-attention problem whose rows and keys see each other through spans
(§11 "MoBA on the Hopper kernels", §14 "Documents on the Hopper kernels").

    layout = entry_layout(selection, block_size, Hkv)     # where each entry's row goes, and the spans
    o, lse, *layout = forward(q, k, v, selection, block_size, scale)
    dq, dk, dv = backward(do, q, k, v, o, lse, *layout, scale)

The keys are k and v as they are, viewed as one sequence of B*Hkv*T rows. The rows are the entries gathered
block by block: for each (batch, kv head, key block) a segment, its own entries first (query by query, the group's
heads side by side), then every entry that chose it as a past block, padded to a whole forward tile. A row's span
is the keys it sees: its block, and for an own entry the block up to the query. A key's span is the rows that see
it: from the own rows of its query on to the segment's end, one interval, so the backward needs nothing else.
The forward leaves an output and lse per row, which a merge by log-sum-exp combines per query; the backward
leaves dQ per row, which the same merge sums, and dK, dV whole, the keys' gradients from all their rows.
"""
import torch
import triton
import triton.language as tl

from . import triton_hopper, triton_hopper_backward
from .triton_dispatch import empty_bthd
from .triton_moba import merge_slots, row_delta

ROW_TILE = 128  # the forward's query tile (two consumers of 64 rows, triton_hopper.document_tiles): segments start on one
GATHER_ROWS = 64  # rows per _gather_entries program


def layout_rows(B: int, Hq: int, Hkv: int, T: int, S: int, block_size: int) -> int:
    """The rows of the gathered problem: every slot of every query, and each segment's padding, rounded up to a
    tile. The selection lives on the GPU; sizing by this bound, not by the count, keeps the call free of host syncs.
    The rows past the used ones see no key."""
    rows = B * Hq * T * S + B * Hkv * triton.cdiv(T, block_size) * (ROW_TILE - 1)
    return triton.cdiv(rows, ROW_TILE) * ROW_TILE


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
    n_rows = layout_rows(B, Hq, Hkv, T, S, block_size)
    device = selection.device
    # per kv head the entries in (query, head of the group, slot) order; block n's own entries sort into run 2n, its
    # past ones into run 2n + 1, empty slots after all of them. The sort is stable, so each run keeps that order, and
    # sorts the small run numbers, not entry-unique keys (triton_moba.entry_lists)
    chosen = selection.view(B, Hkv, G, T, S).transpose(2, 3).reshape(R, T * G * S)
    past = (torch.arange(S, device=device) > 0).repeat(T * G)  # (T*G*S,)
    run = torch.where(chosen >= 0, 2 * chosen + past, 2 * n_blocks)
    sorted_run, order = torch.sort(run.to(torch.int16 if 2 * n_blocks < 2**15 else torch.int32), dim=-1, stable=True)
    starts = torch.searchsorted(sorted_run, torch.arange(2 * n_blocks + 1, dtype=sorted_run.dtype, device=device)
                                .expand(R, -1).contiguous())  # (R, 2 * n_blocks + 1)
    first, size = starts[:, :-1:2], starts[:, 2::2] - starts[:, :-1:2]  # (R, n_blocks) each segment's entries
    padded = (size + ROW_TILE - 1) // ROW_TILE * ROW_TILE
    segment_start = (padded.flatten().cumsum(0) - padded.flatten()).view(R, n_blocks)

    # each sorted entry's row, and what it is: order indexes the (query, head of the group, slot) enumeration
    valid = sorted_run < 2 * n_blocks  # (R, T*G*S)
    block = (sorted_run.long() // 2).clamp(max=n_blocks - 1)
    row = segment_start.gather(1, block) + torch.arange(T * G * S, device=device) - first.gather(1, block)
    t, g, s = order // (G * S), order // S % G, order % S
    head = torch.arange(R, device=device)[:, None] * G + g  # b * Hq + h
    pos = torch.empty(B * Hq * T * S, dtype=torch.int32, device=device)
    pos.scatter_(0, ((head * T + t) * S + s).flatten(), torch.where(valid, row, -1).int().flatten())
    # scatters over the rows send the entries they skip to one extra element, dropped after
    unused = torch.where(valid, row, n_rows).flatten()
    src = torch.full((n_rows + 1,), -1, dtype=torch.int32, device=device)
    src.scatter_(0, unused, (head * T + t).int().flatten())

    # a row's span: its segment's block, cut at the query for an own entry (padding rows see the whole block, so
    # every span in a tile starts at the same key and none ends after the tile's last row's)
    rows = torch.arange(n_rows, device=device)
    segment = torch.searchsorted(segment_start.flatten(), rows, right=True) - 1
    sequence, key_block = segment // n_blocks, segment % n_blocks
    used = rows < segment_start[-1, -1] + padded[-1, -1]
    key_first = torch.where(used, sequence * T + key_block * block_size, 0)
    key_end = torch.where(used, sequence * T + torch.clamp((key_block + 1) * block_size, max=T), 0)
    key_end = torch.cat([key_end, key_end.new_zeros(1)])
    own = torch.where(valid & (s == 0), row, n_rows).flatten()
    key_end.scatter_(0, own, (torch.arange(R, device=device)[:, None] * T + t + 1).flatten())
    row_spans = torch.stack([key_first, key_end[:n_rows]]).int()[None]

    # a key's span: the own rows of its query and those after it (row (t', g) sits at (t' - block start) * G + g),
    # then the block's past entries
    keys = torch.arange(T, device=device)
    start = segment_start[:, keys // block_size]  # (R, T)
    key_spans = torch.stack([start + keys % block_size * G, start + size[:, keys // block_size]]).int()
    return pos.view(B, Hq, T, S), src[:n_rows], row_spans, key_spans.view(1, 2, R * T)


@triton.jit
def _gather_entries(SRC, X, X_ROWS, stride_xb, stride_xh, stride_xt, stride_xd, LSE, DELTA, LSE_ROWS, DELTA_ROWS, H, T,
                    HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """Row r of X_ROWS (n_rows, D) = row SRC[r] of X (B, H, T, D), zeros for padding (SRC -1: finite rows, so P = 0
    there, not NaN); with LSE and DELTA (B*H*T,) also the row's lse (+inf for padding: P = 0, §5) and Delta (0)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (R,)
    src = tl.load(SRC + rows)
    real = src >= 0
    src = tl.where(real, src, 0)
    bh, t = src // T, src % T
    cols = tl.arange(0, HEAD_DIM)  # (D,)
    x = tl.load(X + ((bh // H).to(tl.int64) * stride_xb + (bh % H) * stride_xh + t.to(tl.int64) * stride_xt)[:, None]
                + cols[None, :] * stride_xd, mask=real[:, None], other=0.0)
    tl.store(X_ROWS + rows.to(tl.int64)[:, None] * HEAD_DIM + cols[None, :], x)
    if LSE is not None:
        tl.store(LSE_ROWS + rows, tl.load(LSE + src, mask=real, other=float("inf")))
        tl.store(DELTA_ROWS + rows, tl.load(DELTA + src, mask=real, other=0.0))


def gather_entries(x: torch.Tensor, src: torch.Tensor, lse: torch.Tensor | None = None,
                   delta: torch.Tensor | None = None) -> list[torch.Tensor]:
    """x (B, H, T, D) -> [its rows in the layout's order (1, 1, n_rows, D)], and with lse, delta (B, H, T) float32
    theirs too (1, 1, n_rows) each."""
    n_rows, D = src.shape[0], x.shape[-1]
    x_rows = x.new_empty(1, 1, n_rows, D)
    row_values = [torch.empty(1, 1, n_rows, dtype=torch.float32, device=x.device) for _ in range(2)] if lse is not None \
        else [None, None]
    _gather_entries[(n_rows // GATHER_ROWS,)](src, x, x_rows, *x.stride(), lse, delta, *row_values, x.shape[1], x.shape[2],
                                              HEAD_DIM=D, ROWS=GATHER_ROWS)
    return [x_rows] + ([] if lse is None else row_values)


def key_rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """k, v (B, Hkv, T, D) -> the one sequence of B*Hkv*T keys the rows' spans index, (1, 1, B*Hkv*T, D) views (copies
    where k, v are not contiguous)."""
    return [t.contiguous().view(1, 1, -1, t.shape[-1]) for t in tensors]


def runs_on(q: torch.Tensor) -> bool:
    """Whether MoBA runs on the Hopper kernels: where they run (triton_hopper.runs_on), and not where determinism
    was asked for (the backward adds dQ in any order, §13)."""
    return triton_hopper.runs_on(q) and not torch.are_deterministic_algorithms_enabled()


def forward(q, k, v, selection, block_size: int, scale: float):
    """-> out (B, Hq, T, D), lse (B, Hq, T) float32 of the merged slots, and the layout (pos, src, row_spans,
    key_spans) for the backward."""
    B, Hq, T, D = q.shape
    pos, src, row_spans, key_spans = entry_layout(selection, block_size, k.shape[1])
    (q_rows,) = gather_entries(q, src)
    o_rows = torch.empty_like(q_rows)
    lse_rows = torch.empty(1, 1, src.shape[0], dtype=torch.float32, device=q.device)
    # §11 the rows' attention to their blocks (not causal: the own rows' spans end at their query)
    triton_hopper.forward(q_rows, *key_rows(k, v), o_rows, lse_rows, False, scale,
                          triton_hopper.document_tiles(D)[0], (row_spans, None))
    o = empty_bthd(B, Hq, T, D, q)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    merge_slots(o_rows.view(-1, D), lse_rows.view(-1), pos, o, lse)
    return o, lse, pos, src, row_spans, key_spans


def backward(do, q, k, v, o, lse, pos, src, row_spans, key_spans, scale: float):
    """-> dq (B, Hq, T, D), dk, dv (B, Hkv, T, D). §5 with each row's P taken against its query's merged lse and
    Delta, so every row's share of the gradients is exact on its own."""
    B, Hq, T, D = q.shape
    (q_rows,) = gather_entries(q, src)
    do_rows, lse_rows, delta_rows = gather_entries(do, src, lse, row_delta(o, do))
    dk, dv = (torch.empty(B, k.shape[1], T, D, dtype=k.dtype, device=k.device) for _ in range(2))
    dk_rows, dv_rows = key_rows(dk, dv)
    dq_rows = torch.empty(src.shape[0], D, dtype=torch.float32, device=q.device)
    triton_hopper_backward.backward(do_rows, q_rows, *key_rows(k, v), None, lse_rows, None, dk_rows, dv_rows, False,
                                    scale, triton_hopper_backward.tiles(D, dk_rows, dv_rows)[0], (key_spans, None),
                                    delta=delta_rows, dq_acc=dq_rows)
    dq = empty_bthd(B, Hq, T, D, q)
    merge_slots(dq_rows, None, pos, dq, None, scale)  # the rows' dS K, summed and scaled
    return dq, dk, dv

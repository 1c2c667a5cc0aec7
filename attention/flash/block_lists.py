"""A document mask's block lists in three launches (§10 of docs/flash_attention.md), and its spans in one (§14):
what a training step with --doc_mask builds once for all its layers.

    state, kv_blocks, q_blocks = document_block_lists(rule_state, document_ids, Tq, Tk, block_size)
    spans = document_spans(document_ids)      # (B, 2, T): each position's document [first, end), for the Hopper kernels

block_mask.py builds the same lists with torch operations (BlockMask.from_rules, then _block_lists); that takes
about a hundred small kernels, each a launch of host time, so on the GPU the documents' lists come from here:
  block_id_bounds        a program per (block, batch row): the block's smallest and largest document id
  listed_blocks          a program per (block row, batch row): each block's state, the minimum of the rules' state
                         (causal, window; the same for every batch) and the documents' (from the id bounds), then
                         the row's list: [n_full, n_listed, FULL blocks, PARTIAL blocks, SKIP blocks, tile ids]
  spans_of_runs          a program per batch row: whether its ids are runs, then each position's run by a running
                         maximum forwards (first) and a running minimum backwards (end)
"""
import torch
import triton
import triton.language as tl

# block_mask.py's states, and the int32 extremes; constexpr: a compiled kernel reads no other globals
SKIP, PARTIAL, FULL = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
ID_MIN, ID_MAX = tl.constexpr(-(2 ** 31)), tl.constexpr(2 ** 31 - 1)


@triton.jit
def block_id_bounds(IDS, LO, HI, stride_b, start, n, n_blocks, BLOCK: tl.constexpr):
    """LO, HI (B, n_blocks): the smallest and largest id among positions start + [block * BLOCK, ...) below
    start + n of each batch row (padding past the end takes no part)."""
    block, b = tl.program_id(0), tl.program_id(1)
    pos = block * BLOCK + tl.arange(0, BLOCK)
    real = pos < n
    ids = tl.load(IDS + b.to(tl.int64) * stride_b + start + pos, mask=real, other=0)
    tl.store(LO + b * n_blocks + block, tl.min(tl.where(real, ids, ID_MAX), 0))
    tl.store(HI + b * n_blocks + block, tl.max(tl.where(real, ids, ID_MIN), 0))


@triton.jit
def listed_blocks(RULES, stride_rule_row, stride_rule_col, ROW_LO, ROW_HI, COL_LO, COL_HI, LISTS, STATE, n_rows,
                  n_cols, WRITE_STATE: tl.constexpr, COLS: tl.constexpr):
    """One block row's list for one batch row (block_mask.py, BlockMask.kv_blocks). Rows are query blocks and
    columns key blocks for the forward's lists; the transpose for dK/dV's."""
    row, b = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, COLS)  # (C,)
    real = cols < n_cols
    rule = tl.load(RULES + row * stride_rule_row + cols * stride_rule_col, mask=real, other=SKIP).to(tl.int32)
    row_lo, row_hi = tl.load(ROW_LO + b * n_rows + row), tl.load(ROW_HI + b * n_rows + row)
    col_lo = tl.load(COL_LO + b * n_cols + cols, mask=real, other=0)
    col_hi = tl.load(COL_HI + b * n_cols + cols, mask=real, other=0)
    # the documents' state from the id ranges: none shared -> SKIP, one and the same document -> FULL (exact for
    # packed, non-decreasing ids; a safe superset of PARTIAL blocks otherwise, as block_mask.py's)
    skip = (row_hi < col_lo) | (col_hi < row_lo)
    full = (row_lo == row_hi) & (col_lo == col_hi) & (row_lo == col_lo)
    state = tl.minimum(rule, tl.where(full, FULL, tl.where(skip, SKIP, PARTIAL)))
    state = tl.where(real, state, -1)  # padding columns: no state, no place in the list
    if WRITE_STATE:
        tl.store(STATE + (b * n_rows + row).to(tl.int64) * n_cols + cols, state.to(tl.int8), mask=real)
    is_full, is_partial, is_skip = state == FULL, state == PARTIAL, state == SKIP
    n_full = tl.sum(is_full.to(tl.int32), 0)
    n_listed = n_full + tl.sum(is_partial.to(tl.int32), 0)
    # each block's place: FULL ones first, then PARTIAL, then SKIP, each in ascending order
    place = tl.where(is_full, tl.cumsum(is_full.to(tl.int32), 0) - 1,
                     tl.where(is_partial, n_full + tl.cumsum(is_partial.to(tl.int32), 0) - 1,
                              n_listed + tl.cumsum(is_skip.to(tl.int32), 0) - 1))
    out = LISTS + (b * n_rows + row).to(tl.int64) * (2 + 2 * n_cols)
    tl.store(out, n_full)
    tl.store(out + 1, n_listed)
    tl.store(out + 2 + place, cols, mask=real)
    tl.store(out + 2 + n_cols + place, tl.full([COLS], -1, tl.int32), mask=real)  # no mask function: no tile ids


def document_block_lists(rule_state: torch.Tensor, document_ids: torch.Tensor, Tq: int, Tk: int,
                         block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rule_state (nQ, nK) int8: the causal / window rules' block states; document_ids (B, Tk) integer.
    -> state (B, 1, nQ, nK) int8, kv_blocks (B, 1, nQ, 2 + 2 nK) and q_blocks (B, 1, nK, 2 + 2 nQ) int32."""
    ids = document_ids.to(torch.int32).contiguous()
    B, device = ids.shape[0], ids.device
    nq, nk = rule_state.shape

    def bounds(start: int, n: int, n_blocks: int):
        lo, hi = (torch.empty(B, n_blocks, dtype=torch.int32, device=device) for _ in range(2))
        block_id_bounds[(n_blocks, B)](ids, lo, hi, ids.stride(0), start, n, n_blocks, BLOCK=block_size)
        return lo, hi
    k_lo, k_hi = bounds(0, Tk, nk)
    q_lo, q_hi = (k_lo, k_hi) if Tq == Tk else bounds(Tk - Tq, Tq, nq)  # the queries are the last Tq positions
    state = torch.empty(B, 1, nq, nk, dtype=torch.int8, device=device)
    kv_blocks = torch.empty(B, 1, nq, 2 + 2 * nk, dtype=torch.int32, device=device)
    q_blocks = torch.empty(B, 1, nk, 2 + 2 * nq, dtype=torch.int32, device=device)
    rules = rule_state.contiguous()
    listed_blocks[(nq, B)](rules, rules.stride(0), rules.stride(1), q_lo, q_hi, k_lo, k_hi, kv_blocks, state, nq, nk,
                           WRITE_STATE=True, COLS=triton.next_power_of_2(nk))
    listed_blocks[(nk, B)](rules, rules.stride(1), rules.stride(0), k_lo, k_hi, q_lo, q_hi, q_blocks, state, nk, nq,
                           WRITE_STATE=False, COLS=triton.next_power_of_2(nq))
    return state, kv_blocks, q_blocks


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def spans_of_runs(IDS, SPANS, stride_b, T, BLOCK: tl.constexpr):
    """SPANS (B, 2, T) int32 for one batch row: [0, t] the first position of t's run of equal ids, [1, t] one past its
    last. A row whose ids ever decrease is not certain to hold each document in one run: -1 and T throughout, so the
    kernels compare ids there (§14)."""
    b = tl.program_id(0)
    ids_row = IDS + b.to(tl.int64) * stride_b
    first_row = SPANS + b.to(tl.int64) * 2 * T
    falls = 0
    for start in range(0, T, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        inside = (pos > 0) & (pos < T)
        falls += tl.sum((inside & (tl.load(ids_row + pos, mask=inside) < tl.load(ids_row + pos - 1, mask=inside)))
                        .to(tl.int32), 0)
    runs = falls == 0
    reached = 0  # the first position of the run the last block ended in
    for start in range(0, T, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        inside = (pos > 0) & (pos < T)
        starts = (pos == 0) | (tl.load(ids_row + pos, mask=inside) != tl.load(ids_row + pos - 1, mask=inside))
        first = tl.maximum(tl.associative_scan(tl.where(starts, pos, 0), 0, _maximum), reached)
        reached = tl.max(first, 0)
        tl.store(first_row + pos, tl.where(runs, first, -1), mask=pos < T)
    reached = T  # one past the run the last block (walking backwards) ended in
    for start in range(0, T, BLOCK):
        pos = T - 1 - start - tl.arange(0, BLOCK)  # backwards
        inside = (pos >= 0) & (pos < T - 1)
        ends = (pos == T - 1) | (tl.load(ids_row + pos, mask=inside) != tl.load(ids_row + pos + 1, mask=inside))
        end = tl.minimum(tl.associative_scan(tl.where(ends, pos + 1, T), 0, _minimum), reached)
        reached = tl.min(end, 0)
        tl.store(first_row + T + pos, tl.where(runs, end, T), mask=pos >= 0)


def document_spans(document_ids: torch.Tensor) -> torch.Tensor:
    """document_ids (B, T) integer -> (B, 2, T) int32 spans (spans_of_runs)."""
    B, T = document_ids.shape
    ids = document_ids if document_ids.stride(-1) == 1 else document_ids.contiguous()
    spans = torch.empty(B, 2, T, dtype=torch.int32, device=ids.device)
    spans_of_runs[(B,)](ids, spans, ids.stride(0), T, BLOCK=1024)
    return spans

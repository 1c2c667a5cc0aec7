"""Block masks: which tiles of the (Tq, Tk) score matrix a sparse attention call visits (§10 of
docs/flash_attention.md).

The score matrix is cut into square blocks of block_size x block_size. Each (query block, key block)
pair is in one of three states:
    SKIP     no query of the block sees any key of the other: the kernel never loads it
    PARTIAL  some pairs are visible: the kernel loads the tile and masks it element by element
    FULL     every pair is visible: the kernel loads the tile and applies no mask at all
so the work grows with the number of visible blocks, not with Tq * Tk.

A BlockMask is built once and reused across calls and layers (build it once per batch and pass it to
every layer). Four ways to get one:
    BlockMask.from_mask_fn(fn, B, H, Tq, Tk)     any rule fn(b, h, q_idx, kv_idx) -> bool
    BlockMask.from_layout(layout, Tq, Tk)        a dense boolean (n_q_blocks, n_kv_blocks) layout
    BlockMask.from_rules(Tq, Tk, causal=..., window=..., document_ids=...)   the built-in rules
    mask.restrict(causal=..., window=..., document_ids=...)                  AND of a mask and the rules
The built-in rules (causal, sliding window, documents) are checked inside the kernel on partial
tiles, so they cost no storage. A mask function can be anything, so its partial tiles are evaluated
once here and stored as (block_size, block_size) booleans that the kernel reads.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .masks import dense_mask

SKIP, PARTIAL, FULL = 0, 1, 2
# Elements of the score matrix evaluated at once while building from a mask function (~64 MiB of bools)
EVAL_CHUNK = 1 << 26


def _default_block_size() -> int:
    # The kernel's tiles must divide the block (attention/flash/tl_forward.py walks a block in tiles).
    # On the GPU 64, not FlexAttention's 128: the tiles that suit a sparse call's short rows are 64 wide,
    # and a 64-wide tile of a PARTIAL 128 block can hold no visible pair (half of a block on the diagonal
    # or at a window's or document's edge) yet is loaded and computed; 64 blocks list only tiles that see
    # something, and make FULL (unmasked) tiles of the rest (docs/flash_attention.md §10; its effect:
    # docs/perf_notes.md). The CPU interpreter's tiles are 16..32 rows, and its tests use short sequences,
    # so a smaller block there still exercises skipping, full and partial blocks.
    from .flash.device import INTERPRET

    return 32 if INTERPRET else 64


def _block_bounds(T: int, offset: int, n_blocks: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last absolute position of each block (blocks cut off by T end at T - 1)."""
    first = torch.arange(n_blocks, device=device) * block_size
    last = torch.clamp(first + block_size, max=T) - 1
    return first + offset, last + offset


def _interval_state(lo: torch.Tensor, hi: torch.Tensor, first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """State of blocks whose allowed range [lo, hi] (per query row) vary linearly: for a query block
    with allowed key ranges from [lo.first, hi.first] to [lo.last, hi.last] and a key block [first, last]
    (broadcast shapes), FULL when every row allows the whole block, SKIP when no row allows any key."""
    # lo/hi: (nQ, 2) = (value at the block's first row, value at its last row); both grow by one per
    # row, so a block no row's extreme reaches is reached by no row at all
    full = (first >= lo[..., 1:]) & (last <= hi[..., :1])
    skip = (last < lo[..., :1]) | (first > hi[..., 1:])
    return torch.where(full, FULL, torch.where(skip, SKIP, PARTIAL))


class BlockMask:
    """The block states of a (Tq, Tk) attention mask plus what the kernel needs to mask partial tiles.

    state: (Bm, Hm, n_q_blocks, n_kv_blocks) int8 in {SKIP, PARTIAL, FULL}; Bm is 1 or the batch size,
    Hm 1 or the number of query heads (size 1 = the same for every batch row / head).
    """

    def __init__(self, state: torch.Tensor, Tq: int, Tk: int, block_size: int, *, causal: bool = False,
                 window: tuple[int, int] | None = None, document_ids: torch.Tensor | None = None,
                 mask_fn: Callable | None = None, tile_ids: torch.Tensor | None = None,
                 tile_bits: torch.Tensor | None = None):
        self.state, self.Tq, self.Tk, self.block_size = state, Tq, Tk, block_size
        # the built-in rules, checked element by element on partial tiles
        self.causal, self.window, self.document_ids = causal, window, document_ids
        # a mask function's partial tiles: tile_ids (like state) index tile_bits (n, block, block); -1 = none
        self.mask_fn, self.tile_ids, self.tile_bits = mask_fn, tile_ids, tile_bits
        self._lists: dict[str, torch.Tensor] = {}
        self._restricted: dict[tuple, BlockMask] = {}

    # ---------------------------------------------------------------------------------------------
    # Construction
    # ---------------------------------------------------------------------------------------------
    @classmethod
    def from_rules(cls, Tq: int, Tk: int, *, causal: bool = False, window: tuple[int, int] | None = None,
                   document_ids: torch.Tensor | None = None, block_size: int | None = None,
                   device=None) -> BlockMask:
        """The block mask of causal / sliding-window / document masking (any combination), computed
        from the rules per block without evaluating a single element. Without document ids it depends on the sizes
        and rules alone, so one per (sizes, rules, device) is kept and given again: a model passes the same window
        to every layer."""
        block_size = block_size or _default_block_size()
        _check_block_size(block_size)
        window = None if window in (None, (-1, -1)) else tuple(window)
        if document_ids is not None:
            if lists_by_kernel(document_ids.device):
                return cls._from_document_lists(Tq, Tk, causal, window, document_ids, block_size)
            return cls._from_rules(Tq, Tk, causal, window, document_ids, block_size, document_ids.device)
        if torch.compiler.is_compiling():  # built inside the graph, where nothing is kept
            return cls._from_rules(Tq, Tk, causal, window, None, block_size, device)
        key = (Tq, Tk, causal, window, block_size, torch.device("cpu" if device is None else device))
        if key not in _rule_masks:
            _rule_masks[key] = cls._from_rules(Tq, Tk, causal, window, None, block_size, device)
        return _rule_masks[key]

    @classmethod
    def _from_rules(cls, Tq: int, Tk: int, causal: bool, window, document_ids, block_size: int, device) -> BlockMask:
        nq, nk = -(-Tq // block_size), -(-Tk // block_size)
        q_first, q_last = _block_bounds(Tq, Tk - Tq, nq, block_size, device)  # absolute positions (bottom-right)
        k_first, k_last = _block_bounds(Tk, 0, nk, block_size, device)
        q_rows = torch.stack([q_first, q_last], -1)  # (nQ, 2): each query block's first and last position
        k_first, k_last = k_first[None, :], k_last[None, :]  # (1, nK)
        unbounded = torch.full_like(q_rows, Tk)
        state = torch.full((nq, nk), FULL, dtype=torch.int8, device=device)
        if causal:  # key <= query position
            state = torch.minimum(state, _interval_state(-unbounded, q_rows, k_first, k_last))
        if window is not None:
            left, right = window
            lo = q_rows - left if left >= 0 else -unbounded
            hi = q_rows + right if right >= 0 else unbounded + Tk
            state = torch.minimum(state, _interval_state(lo, hi, k_first, k_last))
        state = _mark_ragged(state, Tq, Tk, block_size)[None, None]  # (1, 1, nQ, nK)
        if document_ids is not None:
            state = torch.minimum(state, _document_state(document_ids, Tq, Tk, block_size))
        return cls(state.to(torch.int8), Tq, Tk, block_size, causal=causal, window=window, document_ids=document_ids)

    @classmethod
    def _from_document_lists(cls, Tq: int, Tk: int, causal: bool, window, document_ids: torch.Tensor,
                             block_size: int) -> BlockMask:
        """from_rules with documents, and its block lists, in three launches (flash/block_lists.py): the rules'
        states (no documents) are the same for every batch, kept by from_rules."""
        from .flash.block_lists import document_block_lists

        rules = cls.from_rules(Tq, Tk, causal=causal, window=window, block_size=block_size, device=document_ids.device)
        state, kv_blocks, q_blocks = document_block_lists(rules.state[0, 0], document_ids, Tq, Tk, block_size)
        mask = cls(state, Tq, Tk, block_size, causal=causal, window=rules.window, document_ids=document_ids)
        mask._lists.update(kv=kv_blocks, q=q_blocks)
        return mask

    @classmethod
    def from_mask_fn(cls, mask_fn: Callable, B: int, H: int, Tq: int, Tk: int, block_size: int | None = None,
                     device=None) -> BlockMask:
        """Evaluate mask_fn(b, h, q_idx, kv_idx) -> bool on every element, once, in chunks of query
        blocks (index tensors broadcast as b (B,1,1,1), h (1,H,1,1), q_idx (1,1,Tq,1), kv_idx (1,1,1,Tk),
        raw 0-based indices). Blocks with every element True are FULL, with none SKIP; the partial
        blocks' elements are kept for the kernel."""
        block_size = block_size or _default_block_size()
        _check_block_size(block_size)
        nq, nk = -(-Tq // block_size), -(-Tk // block_size)
        rows_per_chunk = max(block_size, EVAL_CHUNK // max(1, B * H * nk * block_size) // block_size * block_size)
        states, tiles, ids = [], [], []
        n_tiles = 0
        for row0 in range(0, nq * block_size, rows_per_chunk):
            rows = min(rows_per_chunk, nq * block_size - row0)
            visible = dense_mask(rows, nk * block_size, causal=False, batch=B, heads=H, device=device,
                                 mask_fn=_padded(mask_fn, row0, Tq, Tk, device))  # (Bm, Hm, rows, nK*bs)
            Bm, Hm = visible.shape[:2]
            visible = visible.expand(Bm, Hm, rows, nk * block_size)
            blocks = visible.reshape(Bm, Hm, rows // block_size, block_size, nk, block_size).transpose(3, 4)
            count = blocks.sum((-1, -2))  # (Bm, Hm, nq_chunk, nK) visible elements per block
            state = torch.where(count == block_size ** 2, FULL, torch.where(count == 0, SKIP, PARTIAL))
            partial = state == PARTIAL
            tile_id = torch.full_like(count, -1, dtype=torch.int32)
            n_new = int(partial.sum())
            tile_id[partial] = torch.arange(n_tiles, n_tiles + n_new, dtype=torch.int32, device=count.device)
            tiles.append(blocks[partial])  # (n_new, bs, bs), in the order of the ids just given
            n_tiles += n_new
            states.append(state)
            ids.append(tile_id)
        shape = torch.broadcast_shapes(*(s.shape for s in states))
        state = torch.cat([s.expand(*shape[:2], *s.shape[2:]) for s in states], 2).to(torch.int8)
        tile_ids = torch.cat([t.expand(*shape[:2], *t.shape[2:]) for t in ids], 2).contiguous()
        return cls(state, Tq, Tk, block_size, mask_fn=mask_fn, tile_ids=tile_ids,
                   tile_bits=torch.cat(tiles).to(torch.uint8).contiguous())

    @classmethod
    def from_layout(cls, layout: torch.Tensor, Tq: int, Tk: int, block_size: int | None = None) -> BlockMask:
        """A dense boolean block layout (n_q_blocks, n_kv_blocks), optionally with leading (B|1, H|1)
        dims: True blocks are visited whole, False blocks skipped."""
        block_size = block_size or _default_block_size()
        _check_block_size(block_size)
        nq, nk = -(-Tq // block_size), -(-Tk // block_size)
        if layout.dtype != torch.bool or layout.dim() not in (2, 4) or tuple(layout.shape[-2:]) != (nq, nk):
            raise ValueError(
                f"layout must be a bool tensor of shape ({nq}, {nk}) or (B|1, H|1, {nq}, {nk}) for Tq={Tq}, "
                f"Tk={Tk}, block_size={block_size} (one entry per block), got {layout.dtype} {tuple(layout.shape)}")
        layout = layout.reshape(*(1, 1)[: 4 - layout.dim()], *layout.shape)

        def mask_fn(b, h, q_idx, kv_idx):  # the element-level mask the layout stands for
            return layout[b % layout.shape[0], h % layout.shape[1], q_idx // block_size, kv_idx // block_size]

        state = _mark_ragged(torch.where(layout, FULL, SKIP).to(torch.int8), Tq, Tk, block_size)
        return cls(state, Tq, Tk, block_size, mask_fn=mask_fn)

    def restrict(self, *, causal: bool = False, window: tuple[int, int] | None = None,
                 document_ids: torch.Tensor | None = None) -> BlockMask:
        """self AND the built-in rules. Cached per (causal, window) when there are no document ids, so
        passing the same BlockMask to every layer builds the combination once."""
        window = None if window in (None, (-1, -1)) else tuple(window)
        if ((not causal or self.causal) and window in (None, self.window)
                and (document_ids is None or document_ids is self.document_ids)):
            return self  # nothing new: e.g. a mask built by from_rules(causal=True) passed with causal=True
        key = (causal, window)
        if document_ids is None and key in self._restricted:
            return self._restricted[key]
        if self.window is not None or self.document_ids is not None:
            raise ValueError("this BlockMask already holds window/document rules; build it with all of them at once "
                             "(BlockMask.from_rules) instead of adding more to it per call")
        rules = BlockMask.from_rules(self.Tq, self.Tk, causal=causal, window=window, document_ids=document_ids,
                                     block_size=self.block_size, device=self.state.device)
        combined = BlockMask(torch.minimum(self.state, rules.state), self.Tq, self.Tk, self.block_size,
                             causal=rules.causal or self.causal, window=rules.window, document_ids=rules.document_ids,
                             mask_fn=self.mask_fn, tile_ids=self.tile_ids, tile_bits=self.tile_bits)
        if document_ids is None:
            self._restricted[key] = combined
        return combined

    # ---------------------------------------------------------------------------------------------
    # What the kernel and the reference backends read
    # ---------------------------------------------------------------------------------------------
    def kv_blocks(self) -> torch.Tensor:
        """(Bm, Hm, n_q_blocks, 2 + 2 * n_kv_blocks) int32: per query block [n_full, n_listed, the
        listed key blocks (FULL first, then PARTIAL, each ascending), their tile ids]. Forward and dQ."""
        if "kv" not in self._lists:
            self._lists["kv"] = _block_lists(self.state, self._tile_ids())
        return self._lists["kv"]

    def q_blocks(self) -> torch.Tensor:
        """(Bm, Hm, n_kv_blocks, 2 + 2 * n_q_blocks) int32: the same per key block, listing query
        blocks. dK/dV."""
        if "q" not in self._lists:
            self._lists["q"] = _block_lists(self.state.transpose(-1, -2), self._tile_ids().transpose(-1, -2))
        return self._lists["q"]

    def only_documents(self) -> bool:
        """Whether the mask is documents alone, causal or not, over as many queries as keys: what the Hopper kernels
        keep to themselves from each position's span (§14), without block lists."""
        return (self.document_ids is not None and self.window is None and self.mask_fn is None
                and self.Tq == self.Tk)

    def document_spans(self) -> torch.Tensor:
        """(B, 2, T) int32: each position's document, [first, end) (flash/block_lists.py:spans_of_runs; -1 and T
        throughout a batch row whose ids ever decrease). Built once, for only_documents() masks."""
        if "spans" not in self._lists:
            ids = self.document_ids
            if lists_by_kernel(ids.device):
                from .flash.block_lists import document_spans

                self._lists["spans"] = document_spans(ids)
            else:  # inside torch.compile: Inductor fuses these
                self._lists["spans"] = _spans_of_runs(ids)
        return self._lists["spans"]

    def _tile_ids(self) -> torch.Tensor:
        if self.tile_ids is not None:
            return self.tile_ids
        return torch.full(self.state.shape, -1, dtype=torch.int32, device=self.state.device)

    def dense(self, B: int, H: int, device=None) -> torch.Tensor:
        """The element-level mask, (Bm, Hm, Tq, Tk) bool: what the reference backends apply."""
        return dense_mask(self.Tq, self.Tk, causal=self.causal, window=self.window, document_ids=self.document_ids,
                          mask_fn=self.mask_fn, batch=B, heads=H, device=device or self.state.device)

    def sparsity(self) -> float:
        """Fraction of blocks skipped."""
        return float((self.state == SKIP).float().mean())

    def __repr__(self) -> str:
        rules = [name for name, on in (("causal", self.causal), (f"window={self.window}", self.window),
                                       ("documents", self.document_ids is not None),
                                       ("mask_fn", self.mask_fn is not None)) if on]
        return (f"BlockMask(Tq={self.Tq}, Tk={self.Tk}, block_size={self.block_size}, state={tuple(self.state.shape)}, "
                f"rules=[{', '.join(rules)}], skipped={self.sparsity():.1%})")


# (Tq, Tk, causal, window, block_size, device) -> the BlockMask of the rules alone (from_rules)
_rule_masks: dict[tuple, BlockMask] = {}


def lists_by_kernel(device) -> bool:
    """Whether a document mask's lists come from flash/block_lists.py: on the GPU, and under the CPU interpreter
    (its tests); not inside torch.compile, which fuses the torch build into the graph instead."""
    from .flash.device import INTERPRET

    return (torch.device(device).type == "cuda" or INTERPRET) and not torch.compiler.is_compiling()


def _check_block_size(block_size: int) -> None:
    if not (isinstance(block_size, int) and block_size >= 16 and block_size & (block_size - 1) == 0):
        raise ValueError(f"block_size must be a power of two >= 16 (the kernel walks a block in tiles), got {block_size!r}")


def _mark_ragged(state: torch.Tensor, Tq: int, Tk: int, block_size: int) -> torch.Tensor:
    """Blocks cut off by the end of the queries or keys are never FULL: their padding rows must be masked."""
    state = state.clone()
    if Tq % block_size:
        state[..., -1, :] = state[..., -1, :].clamp(max=PARTIAL)
    if Tk % block_size:
        state[..., :, -1] = state[..., :, -1].clamp(max=PARTIAL)
    return state


def _document_state(document_ids: torch.Tensor, Tq: int, Tk: int, block_size: int) -> torch.Tensor:
    """(B, 1, nQ, nK) states for "same document": from each block's smallest and largest id. Blocks
    whose id ranges do not overlap are SKIP; blocks that are both one and the same document are FULL.
    Exact for sorted (packed) ids, a safe superset of PARTIAL blocks otherwise."""
    B = document_ids.shape[0]
    ids = document_ids.long()
    pad = -(-Tk // block_size) * block_size - Tk
    k_ids = torch.nn.functional.pad(ids, (0, pad), value=-1).view(B, -1, block_size)  # padding never matches
    q_ids = ids[:, Tk - Tq:]
    q_pad = -(-Tq // block_size) * block_size - Tq
    q_ids = torch.nn.functional.pad(q_ids, (0, q_pad), value=-1).view(B, -1, block_size)

    def bounds(blocks):  # ignore the -1 padding when taking the min
        real = blocks >= 0
        big = torch.iinfo(torch.int64).max
        return torch.where(real, blocks, big).amin(-1), blocks.amax(-1)

    (qlo, qhi), (klo, khi) = bounds(q_ids), bounds(k_ids)
    qlo, qhi, klo, khi = qlo[:, :, None], qhi[:, :, None], klo[:, None, :], khi[:, None, :]
    skip = (qhi < klo) | (khi < qlo)
    full = (qlo == qhi) & (klo == khi) & (qlo == klo)
    return torch.where(full, FULL, torch.where(skip, SKIP, PARTIAL)).to(torch.int8)[:, None]


def _spans_of_runs(ids: torch.Tensor) -> torch.Tensor:
    """flash/block_lists.py:spans_of_runs in torch operations: (B, T) ids -> (B, 2, T) int32 spans."""
    T = ids.shape[1]
    pos = torch.arange(T, device=ids.device, dtype=torch.int32)
    changes = ids[:, 1:] != ids[:, :-1]  # (B, T - 1): position t + 1 starts a run
    edge = torch.ones_like(ids[:, :1], dtype=torch.bool)
    first = torch.where(torch.cat([edge, changes], 1), pos, 0).cummax(1).values
    end = torch.where(torch.cat([changes, edge], 1), pos + 1, T).flip(1).cummin(1).values.flip(1)
    runs = (ids[:, 1:] >= ids[:, :-1]).all(1, keepdim=True)
    return torch.stack([torch.where(runs, first, -1), torch.where(runs, end, T)], 1).to(torch.int32)


def _padded(mask_fn: Callable, row0: int, Tq: int, Tk: int, device) -> Callable:
    """mask_fn on rows row0.. of a grid padded to whole blocks: padding rows/columns are False."""
    def fn(b, h, q_idx, kv_idx):
        q_idx = q_idx + row0
        inside = (q_idx < Tq) & (kv_idx < Tk)
        return mask_fn(b, h, q_idx.clamp(max=Tq - 1), kv_idx.clamp(max=Tk - 1)) & inside
    return fn


def _block_lists(state: torch.Tensor, tile_ids: torch.Tensor) -> torch.Tensor:
    """Per row of the (…, R, C) block states: [n_full, n_listed, FULL columns ascending, then PARTIAL
    ones, then padding, then the tile ids in the same order] as int32 (see BlockMask.kv_blocks)."""
    C = state.shape[-1]
    column = torch.arange(C, device=state.device)
    order = ((FULL - state.long()) * C + column).argsort(-1)  # FULL (0) before PARTIAL (1) before SKIP (2)
    n_full = (state == FULL).sum(-1, keepdim=True)
    n_listed = (state != SKIP).sum(-1, keepdim=True)
    return torch.cat([n_full, n_listed, order, tile_ids.long().gather(-1, order)], -1).to(torch.int32).contiguous()

"""§16 attention dropout on the Hopper kernels: the keep mask of a tile of scores drawn in the registers that hold
it, bit for bit the mask of the `tl` kernels (tl_tiles.dropout_keep), so a forward here and a backward there (or
the other way round) drop the same probabilities.

    p = dropout_tile(p, seed, row0, first_row, key0, n_cols, dropout_p)   # p (ROWS, N) in acc_layout(N)
    keep = keep_tile(pt, seed, row0, first_query, first_key, n_cols, dropout_p, True)   # the backward's S^T tile

A thread of a wgmma accumulator holds rows {a, a + 8} of each 16 and columns {c, c + 1} of each 8. Of a patch of
eight scores §16 draws together (rows {a, a + 8} by columns {c, c + 1, c + 8, c + 9}) the forward's thread holds all
eight, so its draws run on a grid of patches laid out so (forward_patches), one draw per eight scores. In the
backward's S^T (keys by queries) a thread holds two keys of each 16, c or c + 1 and 8 on: half of each patch, so it
draws half the patches of its thread pair (backward_patches), one draw per eight scores as in the forward, and the
values of the other half come from the other thread of the pair within the warp.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# A wgmma accumulator (4 warps of 16 rows) puts a row's bits 0-2 in lane bits 2-4, bit 3 in a register, bits 4-5 in
# the warp; a column's bit 0 in a register, bits 1-2 in lane bits 0-1, the rest in registers. A patch grid keeps
# each index bit where the accumulator has it, less the bits inside a patch, but for the one the backward's grid
# moves (backward_patches).


@triton.constexpr_function
def forward_patches(rows, cols):
    """The layout of a (rows / 2, cols / 4) grid of §16's patches in which each thread holds the patches of its own
    scores in acc_layout(cols): patch (i, j) covers rows 16 * (i // 8) + i % 8 + {0, 8} and columns 16 * (j // 4) +
    2 * (j % 4) + {0, 1, 8, 9} (a column index without its bits 0 and 3)."""
    registers = [[0, 1 << bit] for bit in range(2, (cols // 4).bit_length() - 1)]
    lanes = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]
    warps = [[8, 0], [16, 0]]
    return gl.DistributedLinearLayout(registers, lanes, warps, [], [rows // 2, cols // 4])


@triton.constexpr_function
def backward_patches(rows, cols):
    """The layout of a (rows / 4, cols / 2) grid of §16's patches in S^T (keys by queries), each drawn by one thread:
    patch (i, j) covers keys 16 * (i // 4) + 2 * (i % 4) + {0, 1, 8, 9} and queries 16 * (j // 8) + j % 8 + {0, 8}.
    In acc_layout(cols) the keys c and c + 1 of a patch lie in two threads (lane bit 2, the key's bit 0), which both
    need its four words; here those two threads draw different patches, of queries a and a + 1 (lane bit 2 holds the
    query's bit 0 instead), and the scores' values change threads afterwards, within the warp."""
    registers = [[0, 1 << bit] for bit in range(3, (cols // 2).bit_length() - 1)]
    lanes = [[0, 2], [0, 4], [0, 1], [1, 0], [2, 0]]
    warps = [[4, 0], [8, 0]]
    return gl.DistributedLinearLayout(registers, lanes, warps, [], [rows // 4, cols // 2])


@gluon.jit
def philox_seven(seed, counters):
    """Philox-4x32 with seven rounds of the int64 counters (their low and high 32 bits, then two zero words), keyed
    by the int64 seed's halves: tl.randint4x(seed, counters, 7)'s four uint32 words, as §16 uses them."""
    k0 = (seed & 0xFFFFFFFF).to(gl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(gl.uint32)
    c0 = counters.to(gl.uint32)
    c1 = (counters >> 32).to(gl.uint32)
    c2 = c0 * 0
    c3 = c2
    for _ in gl.static_range(7):
        a0, a2 = c0, c2
        c0 = gl.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = gl.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
        c1 = a2 * 0xCD9E8D57
        c3 = a0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@gluon.jit
def keep_tile(like, seed, row0, first_query, first_key, n_cols, dropout_p, TRANSPOSED: gl.constexpr):
    """§16 True where a score is kept, shaped and laid out as `like` (R, C), a wgmma accumulator (acc_layout(C)) of
    scores of queries first_query ... by keys first_key ... (each a multiple of 16), or with TRANSPOSED the keys by
    the queries (the backward's S^T). row0: the queries' counter base (tl_tiles.dropout_first's), n_cols the call's
    key count that the counters step by."""
    R: gl.constexpr = like.shape[0]
    C: gl.constexpr = like.shape[1]
    if TRANSPOSED:  # (R / 4, C / 2): the patches, eight scores each, half of a thread pair's each
        patches: gl.constexpr = backward_patches(R, C)
        i = gl.arange(0, R // 4, layout=gl.SliceLayout(1, patches))
        j = gl.arange(0, C // 2, layout=gl.SliceLayout(0, patches))
        c = first_key + (i // 4) * 16 + (i % 4) * 2  # (R / 4,) the patches' first keys
        a = first_query + (j // 8) * 16 + j % 8  # (C / 2,) and first queries
        counters = (row0 + a.to(gl.int64))[None, :] * n_cols + c[:, None]
        w0, w1, w2, w3 = philox_seven(seed, counters)  # queries a, a + 8 by keys c, c + 8: 00, 01, 10, 11
        # (R / 4, C / 2, key parity, key half, query half)
        values = gl.join(gl.join(gl.join(w0 & 0xFFFF, w0 >> 16), gl.join(w1 & 0xFFFF, w1 >> 16)),
                         gl.join(gl.join(w2 & 0xFFFF, w2 >> 16), gl.join(w3 & 0xFFFF, w3 >> 16)))
        # key = 16 * . + 8 * (key half) + 2 * . + parity, query = 16 * . + 8 * (query half) + .
        values = gl.reshape(values, [R // 16, 4, C // 16, 8, 2, 2, 2])
        values = gl.reshape(gl.permute(values, [0, 5, 1, 4, 2, 6, 3]), [R, C])
    else:  # (R / 2, C / 4): the patches, eight scores each
        patches: gl.constexpr = forward_patches(R, C)
        i = gl.arange(0, R // 2, layout=gl.SliceLayout(1, patches))
        j = gl.arange(0, C // 4, layout=gl.SliceLayout(0, patches))
        a = first_query + (i // 8) * 16 + i % 8  # (R / 2,) the patches' first rows
        c = first_key + (j // 4) * 16 + (j % 4) * 2  # (C / 4,) and first columns
        counters = (row0 + a.to(gl.int64))[:, None] * n_cols + c[None, :]
        w0, w1, w2, w3 = philox_seven(seed, counters)  # rows a, a + 8 by columns c, c + 8: 00, 01, 10, 11
        words = gl.join(gl.join(w0, w1), gl.join(w2, w3))  # (R / 2, C / 4, column half, row half)
        values = gl.join(words & 0xFFFF, words >> 16)  # (..., column parity)
        values = gl.reshape(values, [R // 16, 8, C // 16, 4, 2, 2, 2])
        values = gl.reshape(gl.permute(values, [0, 5, 1, 2, 4, 3, 6]), [R, C])
    keep = values >= (dropout_p * 65536.0).to(gl.uint32)
    return gl.convert_layout(keep, like.type.layout)


@gluon.jit
def dropout_tile(p, seed, row0, first_row, key0, n_cols, dropout_p):
    """§16: p (ROWS, N), probabilities of rows first_row ... and keys key0 ... in acc_layout(N), with the dropped
    ones 0 (keep_tile)."""
    return gl.where(keep_tile(p, seed, row0, first_row, key0, n_cols, dropout_p, False), p, 0.0)

"""Documents on the warp-specialized Hopper kernels (§14 "Documents on the Hopper kernels"): each position's span, in
the CPU interpreter and in torch against a plain loop; which calls get spans; on the GPU (marked gpu) both kernels and
every tile against float64, through attention(document_ids=...), a prebuilt BlockMask and attention_varlen."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, assert_errors_within, assert_matches_fp64, out_and_grads, packed_document_ids, qkv

from attention import BlockMask, attention, attention_varlen
from attention.flash import dispatch
from attention import block_mask, inputs
from attention.flash import autograd
from attention.flash.block_lists import document_spans
from attention.flash import device
from attention.flash.hopper import backward as hopper_backward
from attention.flash.hopper import forward as hopper_forward
from attention.flash.hopper import shapes

needs_gluon = pytest.mark.skipif(not device.HAS_GLUON, reason="this Triton has no Gluon (3.6 or newer)")


def spans_by_loop(ids: torch.Tensor) -> torch.Tensor:
    """The spans' definition, position by position: the run of equal ids holding t; -1 and T for a row whose ids ever
    decrease."""
    B, T = ids.shape
    spans = torch.empty(B, 2, T, dtype=torch.int32)
    for b in range(B):
        row = ids[b].tolist()
        runs = all(x <= y for x, y in zip(row, row[1:]))
        for t in range(T):
            first, end = t, t + 1
            while first > 0 and row[first - 1] == row[t]:
                first -= 1
            while end < T and row[end] == row[t]:
                end += 1
            spans[b, :, t] = torch.tensor([first, end] if runs else [-1, T])
    return spans


def test_spans_by_kernel_and_by_torch_follow_their_definition():
    # uneven documents crossing the kernel's 1024-position blocks, documents of one position, one document, ids of
    # another dtype, and a row whose ids come back after another (not runs)
    gen = torch.Generator().manual_seed(0)
    lengths = [[1, 1, 700, 3, 1, 400], [1100, 6], [1106]]
    ids = packed_document_ids(3, 1106, lengths)
    scattered = torch.randint(0, 4, (1, 1106), generator=gen)
    for case in (ids, ids.to(torch.int32), scattered, torch.cat([ids[:1] * 7, scattered])):
        expected = spans_by_loop(case)
        assert torch.equal(document_spans(case), expected)
        assert torch.equal(block_mask._spans_of_runs(case), expected)


def test_sequence_spans_skip_empty_sequences():
    cu = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)  # lengths 3, 0, 1, 5
    spans = inputs.sequence_spans(cu, 9)
    assert spans.tolist() == [[[0, 0, 0, 3, 4, 4, 4, 4, 4], [3, 3, 3, 4, 9, 9, 9, 9, 9]]]
    assert inputs.sequence_spans(cu, 9) is spans  # kept for the tensor...
    cu[1] = 2
    assert inputs.sequence_spans(cu, 9)[0, 1, 0] == 2  # ...until it changes in place


def test_spans_go_to_the_kernels_for_documents_alone_on_hopper(monkeypatch):
    monkeypatch.setattr(autograd, "is_hopper", lambda device: True)
    ids = packed_document_ids(2, 64, [[10, 54], [64]])
    for causal in (True, False):
        mask = BlockMask.from_rules(64, 64, causal=causal, document_ids=ids)
        assert torch.equal(autograd.kernel_mask_args(mask).spans, spans_by_loop(ids))
    for mask in (BlockMask.from_rules(64, 64, causal=True, window=(8, 0), document_ids=ids),  # the `tl` kernels
                 BlockMask.from_rules(32, 64, causal=True, document_ids=ids),  # fewer queries than keys
                 BlockMask.from_rules(64, 64, causal=True)):  # no documents
        assert autograd.kernel_mask_args(mask).spans is None
    monkeypatch.setattr(autograd, "is_hopper", lambda device: False)
    assert autograd.kernel_mask_args(BlockMask.from_rules(64, 64, causal=True, document_ids=ids)).spans is None


@needs_gluon
@pytest.mark.parametrize("mode", ["--documents", "--spans"])
@pytest.mark.parametrize("backward", [False, True])
def test_document_kernels_build_for_hopper(backward, mode):
    # in a process of its own, as tests/test_triton_hopper.py's builds; the document mode of every tile it runs with,
    # and spans without ids (MoBA's rows, §11)
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "benchmarks.hopper_build", mode,
                          *(["--backward"] if backward else [])], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    builds = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert builds and all(built["documents"] == mode[2:] and built["setmaxnreg"] and built["hgmma"] > 0
                          for built in builds)
    # MoBA's rows are read from their queries' rows by the producers' 16-byte copies; documents load tiles by TMA
    assert all((built["row_copies"] > 0) == (mode == "--spans") for built in builds), builds
    if backward:  # dQ: documents add it by the copy engine, MoBA's rows into their queries by 16-byte atomics
        spans = mode == "--spans"
        assert all((built["bulk_reductions"] == 0) == spans and (built["vector_atomic_adds"] > 0) == spans
                   for built in builds)


# --- on the GPU -------------------------------------------------------------------------------------------------
def uneven_ids(B: int, T: int, seed: int, short: bool = False) -> torch.Tensor:
    """(B, T) packed documents: uneven lengths, some of one position, or with short all of 1-40 positions."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        lengths = []
        while sum(lengths) < T:
            lengths.append(int(torch.randint(1, 41 if short else T // 2, (1,), generator=gen)))
            if not short and len(lengths) % 3 == 1:
                lengths.append(1)
        rows.append(lengths)
    return packed_document_ids(B, T, rows)


CASES = [  # dtype, D, causal, B, Hq, Hkv, T, documents
    (torch.bfloat16, 64, True, 2, 4, 4, 1000, "uneven"),  # ragged last tiles, documents of one position
    (torch.float16, 128, True, 2, 8, 2, 2048, "uneven"),  # GQA
    (torch.bfloat16, 128, False, 1, 4, 1, 777, "uneven"),  # MQA, documents without the causal rule
    (torch.bfloat16, 64, True, 1, 4, 2, 1500, "short"),  # many documents per tile
    (torch.float16, 64, False, 2, 2, 2, 600, "scattered"),  # ids that come back after another: compared by id
    (torch.bfloat16, 128, True, 2, 2, 2, 300, "scattered"),
]


def case_ids(documents: str, B: int, T: int) -> torch.Tensor:
    if documents == "scattered":
        return torch.randint(0, 3, (B, T), generator=torch.Generator().manual_seed(3))
    return uneven_ids(B, T, seed=1, short=documents == "short")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, D, causal, B, Hq, Hkv, T, documents", CASES)
def test_document_ids_on_hopper_kernels_match_fp64(monkeypatch, dtype, D, causal, B, Hq, Hkv, T, documents):
    # NANOFLASH_HOPPER=1: both Hopper kernels take the documents themselves, through the autograd op
    monkeypatch.setattr(dispatch, "HOPPER_MODE", "1")
    taken = []
    monkeypatch.setattr(hopper_forward, "forward", spy(hopper_forward.forward, taken))
    torch.manual_seed(0)
    q, k, v = qkv(B, Hq, Hkv, T, T, D, dtype, device="cuda")
    assert_matches_fp64(q, k, v, causal=causal, document_ids=case_ids(documents, B, T).cuda())
    assert taken and all(documents is not None for documents in taken)


def spy(forward, taken: list):
    """hopper_forward.forward that records each call's documents."""
    def recorded(*args):
        taken.append(args[8] if len(args) > 8 else None)
        return forward(*args)
    return recorded


@pytest.mark.gpu
@pytest.mark.parametrize("D, tile", [(D, tile) for D in shapes.FORWARD_TILES for tile in shapes.document_tiles(D)])
@pytest.mark.parametrize("causal", [True, False])
def test_every_forward_tile_keeps_to_documents(D, tile, causal):
    # 4 x 8 heads of 1000 rows: persistent programs walk pairs of items, whose key ranges start mid-row
    torch.manual_seed(0)
    B, H, T = 4, 8, 1000
    q, k, v = qkv(B, H, 2, T, T, D, torch.bfloat16, device="cuda")
    ids = uneven_ids(B, T, seed=2).cuda()
    mask = BlockMask.from_rules(T, T, causal=causal, document_ids=ids)
    o, lse = dispatch.empty_bthd(B, H, T, D, q), torch.empty(B, H, T, device="cuda")
    hopper_forward.forward(q, k, v, o, lse, causal, D ** -0.5, tile, (mask.document_spans(), ids))
    visible = mask.dense(B, H, "cuda")
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=visible, enable_gqa=True)
    math = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
    assert (o.double() - exact).abs().max() <= 2 * (math.double() - exact).abs().max() + 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("D, tile", [(D, tile) for D, tiles in shapes.BACKWARD_TILES.items() for tile in tiles])
@pytest.mark.parametrize("causal", [True, False])
def test_every_backward_tile_keeps_to_documents(monkeypatch, D, tile, causal):
    monkeypatch.setattr(dispatch, "HOPPER_MODE", "0")  # the forward's lse from the `tl` kernel
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "0")
    torch.manual_seed(0)
    B, Hq, Hkv, T = 2, 4, 2, 1000
    q, k, v = qkv(B, Hq, Hkv, T, T, D, torch.bfloat16, device="cuda")
    do = torch.randn_like(q)
    ids = uneven_ids(B, T, seed=4).cuda()
    mask = BlockMask.from_rules(T, T, causal=causal, document_ids=ids)
    o, lse = dispatch.forward(q, k, v, causal, D ** -0.5, autograd.kernel_mask_args(mask))
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]  # an element the kernel skips stays NaN
    hopper_backward.backward(do, q, k, v, o, lse, *grads, causal, D ** -0.5, tile,
                                    (mask.document_spans(), ids))
    naive = lambda *t: attention(*t, causal, backend="naive", block_mask=mask)  # noqa: E731
    exact = out_and_grads(naive, q.double(), k.double(), v.double(), do.double())[1:]
    math = out_and_grads(naive, q, k, v, do)[1:]
    assert_errors_within(("dq", "dk", "dv"), exact, math, grads)


@pytest.mark.gpu
@pytest.mark.parametrize("D", sorted(shapes.FORWARD_TILES))
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_on_hopper_kernels_matches_fp64(monkeypatch, D, causal):
    # one cu_seqlens for queries and keys: the sequences are documents of one batch entry, with empty, one-row and
    # ragged ones among them
    monkeypatch.setattr(dispatch, "HOPPER_MODE", "1")
    taken = []
    monkeypatch.setattr(hopper_forward, "forward", spy(hopper_forward.forward, taken))
    torch.manual_seed(5)
    lengths = [1, 700, 129, 0, 2000, 63, 1031]
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32).cuda()
    q = torch.randn(sum(lengths), 8, D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(sum(lengths), 2, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))

    def call(backend):
        return lambda q, k, v: attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal,
                                                backend=backend)
    do = torch.randn_like(q)
    exact = out_and_grads(call("naive"), q.double(), k.double(), v.double(), do.double())
    math = out_and_grads(call("naive"), q, k, v, do)
    assert_errors_within(("out", "dq", "dk", "dv"), exact, math, out_and_grads(call("triton"), q, k, v, do))
    assert taken and all(documents is not None for documents in taken)

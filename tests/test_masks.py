"""The dense masks against hand-written cases and a rule-by-rule loop; the naive reference applies them
exactly (float64 masked softmax), rows with no visible key included; bad masks fail clearly."""
import pytest
import torch

from attention.masks import (
    causal_mask,
    dense_mask,
    document_mask,
    mask_fn_mask,
    window_mask,
)
from attention.reference.naive import naive_attention


def rows(mask: torch.Tensor) -> list[str]:
    """A (Tq, Tk) mask as strings, one per query: '1' visible, '.' not. Easy to write by hand."""
    return ["".join("1" if x else "." for x in row) for row in mask.tolist()]


def test_window_on_both_sides():
    assert rows(window_mask(5, 5, (1, 2))) == [
        "111..",
        "1111.",
        ".1111",
        "..111",
        "...11",
    ]


def test_minus_one_leaves_a_side_unbounded():
    assert rows(window_mask(4, 4, (-1, 0))) == rows(causal_mask(4, 4))
    assert rows(window_mask(4, 4, (0, -1))) == ["1111", ".111", "..11", "...1"]
    assert window_mask(4, 4, (-1, -1)).all()


def test_causal_sliding_window():
    assert rows(dense_mask(5, 5, causal=True, window=(2, 3))[0, 0]) == [
        "1....",
        "11...",
        "111..",
        ".111.",
        "..111",
    ]


def test_window_is_bottom_right_aligned_when_fewer_queries_than_keys():
    # 2 queries against 5 keys sit at positions 3 and 4
    assert rows(window_mask(2, 5, (1, 0))) == ["..11.", "...11"]
    assert rows(dense_mask(2, 5, causal=True, window=(1, 5))[0, 0]) == ["..11.", "...11"]


def test_packed_documents_with_causal():
    ids = torch.tensor([[0, 0, 1, 1, 1], [3, 3, 3, 3, 7]])
    visible = dense_mask(5, 5, causal=True, document_ids=ids, batch=2)
    assert visible.shape == (2, 1, 5, 5)
    assert rows(visible[0, 0]) == ["1....", "11...", "..1..", "..11.", "..111"]
    assert rows(visible[1, 0]) == ["1....", "11...", "111..", "1111.", "....1"]


def test_documents_of_the_last_queries_when_fewer_queries_than_keys():
    ids = torch.tensor([[0, 0, 1, 1, 2]])
    # the 3 queries are positions 2, 3, 4: documents 1, 1, 2
    assert rows(document_mask(ids, 3)[0, 0]) == ["..11.", "..11.", "....1"]


def test_mask_fn_gets_broadcasting_indices_and_keeps_only_the_dims_it_uses():
    def every_other_key_per_head(b, h, q_idx, kv_idx):
        return (kv_idx % (h + 1) == 0) & (kv_idx <= q_idx)

    visible = mask_fn_mask(every_other_key_per_head, B=3, H=2, Tq=4, Tk=4)
    assert visible.shape == (1, 2, 4, 4)  # nothing depends on b
    assert rows(visible[0, 0]) == rows(causal_mask(4, 4))
    assert rows(visible[0, 1]) == ["1...", "1...", "1.1.", "1.1."]
    # a rule of the batch row only, and a constant, come back 4-D as well
    assert mask_fn_mask(lambda b, h, q, kv: b > 0, 2, 3, 4, 5).shape == (2, 1, 1, 1)
    assert mask_fn_mask(lambda b, h, q, kv: torch.tensor(True), 2, 3, 4, 5).shape == (1, 1, 1, 1)


def reference_visible(b, h, i, j, Tq, Tk, causal, window, ids, mask_fn) -> bool:
    """The conventions of masks.py written out for one (query, key) pair."""
    pos = i + Tk - Tq
    ok = j <= pos if causal else True
    if window is not None:
        left, right = window
        ok &= (left < 0 or j >= pos - left) and (right < 0 or j <= pos + right)
    if ids is not None:
        ok &= bool(ids[b, pos] == ids[b, j])
    if mask_fn is not None:
        ok &= bool(mask_fn(torch.tensor(b), torch.tensor(h), torch.tensor(i), torch.tensor(j)))
    return ok


@pytest.mark.parametrize("Tq,Tk", [(7, 7), (3, 7)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, (2, 1), (-1, 0)])
@pytest.mark.parametrize("with_docs", [False, True])
def test_dense_mask_is_the_and_of_every_rule(Tq, Tk, causal, window, with_docs):
    B, H = 2, 3
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [5, 4, 4, 4, 4, 4, 9]]) if with_docs else None

    def mask_fn(b, h, q_idx, kv_idx):  # drops one key per (batch row, head)
        return kv_idx != (b + h + q_idx) % Tk

    visible = dense_mask(Tq, Tk, causal=causal, window=window, document_ids=ids, mask_fn=mask_fn, batch=B, heads=H)
    visible = visible.expand(B, H, Tq, Tk)
    expected = torch.tensor([[[[reference_visible(b, h, i, j, Tq, Tk, causal, window, ids, mask_fn)
                                for j in range(Tk)] for i in range(Tq)] for h in range(H)] for b in range(B)])
    assert torch.equal(visible, expected)


def test_dense_mask_keeps_size_one_dims_where_nothing_varies():
    assert dense_mask(4, 6, causal=True, window=(2, 0), batch=5, heads=7).shape == (1, 1, 4, 6)
    assert dense_mask(4, 6, causal=False).all()
    ids = torch.zeros(5, 6, dtype=torch.int64)
    assert dense_mask(4, 6, causal=True, document_ids=ids, batch=5, heads=7).shape == (5, 1, 4, 6)


@pytest.mark.parametrize(
    "window, match",
    [((1, 2, 3), "two ints"), ((-2, 0), "-1 for unbounded"), ((1.0, 0), "two ints"), ((True, 0), "two ints"),
     (1024, r"window=\(1024, 0\)")],
)
def test_bad_window_names_the_fix(window, match):
    with pytest.raises(ValueError, match=match):
        dense_mask(4, 4, causal=True, window=window)


def test_bad_document_ids_name_the_fix():
    with pytest.raises(TypeError, match="integer tensor"):
        dense_mask(4, 4, causal=True, document_ids=torch.zeros(1, 4))
    with pytest.raises(TypeError, match="integer tensor"):
        dense_mask(4, 4, causal=True, document_ids=[[0, 0, 1, 1]])
    with pytest.raises(ValueError, match=r"shape \(2, 4\).*got \(1, 4\)"):
        dense_mask(4, 4, causal=True, document_ids=torch.zeros(1, 4, dtype=torch.int64), batch=2)
    with pytest.raises(ValueError, match=r"shape \(batch, Tk\).*got \(4,\)"):
        document_mask(torch.zeros(4, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="Tq must be <= Tk"):
        dense_mask(5, 4, causal=True, document_ids=torch.zeros(1, 4, dtype=torch.int64))


def test_bad_mask_fn_output_names_the_fix():
    with pytest.raises(TypeError, match="bool tensor, got torch.int64"):
        mask_fn_mask(lambda b, h, q, kv: q - kv, 1, 1, 4, 4)
    with pytest.raises(TypeError, match="bool tensor, got bool"):
        mask_fn_mask(lambda b, h, q, kv: True, 1, 1, 4, 4)
    with pytest.raises(ValueError, match=r"shape \(1, 1, 4, 8\), which does not broadcast to .* \(1, 1, 4, 4\)"):
        mask_fn_mask(lambda b, h, q, kv: torch.cat([q >= kv, q < kv], dim=-1), 1, 1, 4, 4)
    with pytest.raises(ValueError, match="does not broadcast"):
        mask_fn_mask(lambda b, h, q, kv: torch.ones(2, 4, 4, dtype=torch.bool), 1, 1, 4, 4)


# ---------------------------------------------------------------------------------------------
# the naive reference with an explicit mask


def masked_softmax_attention(q, k, v, visible, scale):
    """One query at a time: softmax over its visible keys only, 0 when it has none."""
    B, H, Tq, _ = q.shape
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            kv_head = h // (H // k.shape[1])
            for i in range(Tq):
                keys = visible[b, h, i].nonzero().flatten()
                if len(keys):
                    weights = torch.softmax(k[b, kv_head, keys] @ q[b, h, i] * scale, dim=0)
                    out[b, h, i] = weights @ v[b, kv_head, keys]
    return out


def test_naive_with_visible_matches_a_masked_softmax_and_zeroes_empty_rows():
    torch.manual_seed(0)
    B, Hq, Hkv, Tq, Tk, D = 2, 4, 2, 6, 8, 8
    q = torch.randn(B, Hq, Tq, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, Hkv, Tk, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2, 2]])
    visible = dense_mask(Tq, Tk, causal=True, window=(2, 0), document_ids=ids, batch=B, heads=Hq,
                         mask_fn=lambda b, h, q_idx, kv_idx: (h != 3) | (q_idx != 1))  # head 3, query 1: no keys
    visible = visible.expand(B, Hq, Tq, Tk)
    empty = ~visible.any(-1)
    assert empty[:, 3, 1].all() and empty.sum() == B

    out = naive_attention(q, k, v, causal=True, scale=0.3, visible=visible)
    torch.testing.assert_close(out, masked_softmax_attention(q, k, v, visible, 0.3))
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, 3, 1], torch.zeros_like(q.grad[:, 3, 1]))  # an empty row learns nothing


def test_naive_visible_replaces_the_causal_mask():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    everything = torch.ones(5, 5, dtype=torch.bool)
    torch.testing.assert_close(naive_attention(q, k, v, causal=True, scale=0.5, visible=everything),
                               naive_attention(q, k, v, causal=False, scale=0.5))

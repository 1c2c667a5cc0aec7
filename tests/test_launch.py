"""attention/flash/launch.py: two launches share a key only if Triton would compile them alike, so a kept kernel never
runs on arguments it was not compiled for. dispatch.py's launch plans: likewise one plan per dense call that
launches alike, and later calls run it on their own tensors."""
import types

import torch
from helpers import assert_matches_fp64, assert_qkvpacked_matches_fp64, packed_qkv, qkv, whole_paths

from attention.flash import dispatch
from attention.flash.launch import launch_key


def key(*args, grid=(4, 2), **constants):
    return launch_key("kernel", 0, grid, args, constants)


def descriptor(t, block, shape=None, layout="swizzle-128"):
    # what launch_key reads of a host-side tensor descriptor (Gluon's TensorDescriptor)
    return types.SimpleNamespace(base=t, block_shape=list(block), layout=layout, shape=list(shape or t.shape),
                                 strides=list(t.stride()))


def test_calls_that_differ_only_in_data_and_floats_share_a_key():
    a, b = torch.randn(8, 64), torch.randn(8, 64)
    assert key(a, 64, 0.5, None, True, BLOCK=64) == key(b, 64, 0.25, None, True, BLOCK=64)
    assert key(descriptor(a, (4, 64))) == key(descriptor(b, (4, 64)))


def test_what_triton_specialises_on_separates_keys():
    buf = torch.randn(1024)
    aligned, shifted = buf[:512], buf[1:513]  # the same shape, 4 bytes apart
    assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 != 0
    base = key(aligned, 64, BLOCK=64)
    assert key(shifted, 64, BLOCK=64) != base  # 16-byte alignment
    assert key(aligned.half(), 64, BLOCK=64) != base  # dtype
    assert key(aligned, 65, BLOCK=64) != base  # an integer's value (Triton: == 1, a multiple of 16)
    assert key(aligned, 64, BLOCK=128) != base  # a constexpr
    assert key(aligned, 64, BLOCK=64, num_warps=8) != base  # a launch option
    assert key(aligned, 64, grid=(4, 3), BLOCK=64) != base
    assert key(aligned, 1) != key(aligned, True)  # equal in Python, a constexpr 1 and an i1 to Triton
    t = aligned.view(8, 64)
    desc = key(descriptor(t, (4, 64)))
    assert key(descriptor(t, (8, 64))) != desc  # block shape
    assert key(descriptor(t, (4, 64), layout="swizzle-64")) != desc
    assert key(descriptor(t, (4, 64), shape=(7, 64))) != desc
    assert key(descriptor(shifted.view(8, 64), (4, 64))) != desc


def test_later_calls_run_the_plan_on_their_own_tensors(monkeypatch):
    taken = whole_paths(monkeypatch)
    torch.manual_seed(0)
    q, k, v = qkv(Hq=4, Hkv=2, Tq=37, Tk=45, D=32)
    assert_matches_fp64(q, k, v, causal=True)
    assert taken == ["_forward_plan", "_backward_plan"]
    for _ in range(2):  # fresh values, and the same shapes at other addresses: the plans, right results
        assert_matches_fp64(*qkv(Hq=4, Hkv=2, Tq=37, Tk=45, D=32), causal=True, scale=0.3)
    assert taken == ["_forward_plan", "_backward_plan"]


def test_a_call_that_launches_otherwise_gets_its_own_plan(monkeypatch):
    taken = whole_paths(monkeypatch)
    torch.manual_seed(0)
    q, k, v = qkv(Tq=37, Tk=37, D=32)
    assert_matches_fp64(q, k, v, causal=True)
    assert_matches_fp64(q, k, v, causal=False)  # another mask
    assert_matches_fp64(*(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)))  # other strides
    assert_matches_fp64(*qkv(Tq=38, Tk=38, D=32))  # other sizes
    assert_matches_fp64(*(t.half() for t in (q, k, v)))  # another dtype
    assert taken == ["_forward_plan", "_backward_plan"] * 5
    assert_matches_fp64(q, k, v, causal=True, window=(8, 0))  # sparse: the whole path every time, no plan
    assert_matches_fp64(q, k, v, causal=True, window=(8, 0))
    assert taken[10:] == ["_forward_plan", "_backward_plan"] * 2
    assert len(dispatch._plans) == 10


def test_calls_through_the_operators_run_plans(monkeypatch):
    # torch.compile calls the kernels through torch.ops.nanoflash.*, whose mask arguments arrive flattened
    from attention.flash.autograd import flash_attn_bwd, flash_attn_fwd

    taken = whole_paths(monkeypatch)
    torch.manual_seed(0)
    for _ in range(2):
        q, k, v = qkv(Tq=37, Tk=37, D=32)
        o, lse = flash_attn_fwd(q, k, v, True, 0.2)
        torch.testing.assert_close(o, dispatch.forward(q, k, v, True, 0.2)[0])
        flash_attn_bwd(torch.randn_like(q), q, k, v, o, lse, True, 0.2)
    assert taken == ["_forward_plan", "_backward_plan"]


def plan_key(*tensors, causal=True):
    return dispatch._plan_key("fwd", causal, dispatch.DENSE, None, *tensors)


def test_plan_keys_hold_what_the_launches_depend_on(monkeypatch):
    q, k, _ = qkv(2, 3, 3, 40, 40, 32)
    shifted = torch.empty(q.numel() + 1)[1:].view_as(q).copy_(q)  # the same values 4 bytes off alignment
    base = plan_key(q, k, k)
    assert plan_key(q.clone(), k.clone(), k.clone()) == base  # other values and addresses
    assert plan_key(shifted, k, k) != base  # 16-byte alignment
    assert plan_key(q.transpose(1, 2).contiguous().transpose(1, 2), k, k) != base  # strides
    assert plan_key(q[:, :, :39], k, k) != base  # shape
    assert plan_key(q.half(), k, k) != base
    assert plan_key(q, k, k, causal=False) != base
    window = dispatch.MaskArgs(window=(8, 0))  # a mask of numbers only: in the key
    assert dispatch._plan_key("fwd", True, window, None, q, k, k) not in (None, base)
    cu = torch.tensor([0, 40], dtype=torch.int32)  # varlen: the longest lengths in the key, cu_seqlens as tensors
    varlen = dispatch.Varlen(cu, cu, 40, 40)
    assert dispatch._plan_key("fwd", True, dispatch.DENSE, varlen, q, k, k, cu, cu) not in (None, base)
    assert (dispatch._plan_key("fwd", True, dispatch.DENSE, varlen._replace(max_seqlen_q=39), q, k, k,
                                      cu, cu) != dispatch._plan_key("fwd", True, dispatch.DENSE, varlen,
                                                                           q, k, k, cu, cu))
    blocks = dispatch.MaskArgs(kv_blocks=torch.zeros(1, 1, 1, 4, dtype=torch.int32))  # tensors: no plan
    assert dispatch._plan_key("fwd", True, blocks, None, q, k, k) is None
    monkeypatch.setattr(dispatch, "HOPPER_MODE", "0")  # the settings a test or a user may change
    assert plan_key(q, k, k) != base
    monkeypatch.undo()
    monkeypatch.setattr(dispatch, "TMA_MODE", "1")
    assert plan_key(q, k, k) != base
    monkeypatch.undo()
    torch.use_deterministic_algorithms(True)
    try:
        assert plan_key(q, k, k) != base
    finally:
        torch.use_deterministic_algorithms(False)


def test_plans_write_the_packed_gradient_into_the_callers_tensor(monkeypatch):
    # the packed op's backward writes dq, dk, dv into slices of one tensor it allocates per call: the plan must take
    # them from the call, not keep the first call's
    taken = whole_paths(monkeypatch)
    torch.manual_seed(0)
    for _ in range(2):
        assert_qkvpacked_matches_fp64(packed_qkv(1, 37, 2, 32))
    assert taken == ["_forward_plan", "_backward_plan"]


def test_forgetting_the_plans_makes_the_next_call_take_the_whole_path(monkeypatch):
    # what conftest.py does before every test, and what a change to a setting the plans bind needs
    taken = whole_paths(monkeypatch)
    q, k, v = qkv(Tq=20, Tk=20, D=16)
    first = [dispatch.forward(q, k, v, True, 0.25)[0] for _ in range(2)]
    assert taken == ["_forward_plan"] and len(dispatch._plans) == 1
    dispatch.forget_plans()
    assert dispatch._plans == {}
    assert torch.equal(dispatch.forward(q, k, v, True, 0.25)[0], first[0])
    assert torch.equal(first[0], first[1]) and taken == ["_forward_plan"] * 2


# --- a kept kernel launched again (on the GPU; here with a fake compiled kernel) -----------------------------------
class FakeCompiled:
    def __init__(self):
        self.launched = []

    def __getitem__(self, grid):
        return lambda *args: self.launched.append((grid, args))


def fake_descriptor(t):
    return types.SimpleNamespace(base=t, block_shape=[4, 8], layout="swizzle", shape=list(t.shape),
                                 strides=list(t.stride()))


def test_bound_launch_takes_a_tensor_in_a_descriptors_place():
    from attention.flash.launch import BoundLaunch
    a, b = torch.randn(16, 8), torch.randn(16, 8)
    compiled = FakeCompiled()
    bound = BoundLaunch(compiled, (2, 1, 1), (fake_descriptor(a), a, 7), ("K",))
    assert bound.templates[0].base is None  # the template keeps no tensor alive
    bound(b, b, 7)
    (grid, (desc, tensor, n, constexpr)), = compiled.launched
    assert grid == (2, 1, 1) and desc.base is b and desc.block_shape == [4, 8] and (tensor, n, constexpr) == (b, 7, "K")


def test_a_planned_launch_fills_the_inputs_places_and_keeps_none_of_the_first_calls_tensors():
    import weakref
    from attention.flash.launch import planned
    launched = []
    a, b = torch.randn(4), torch.randn(4)
    first = (fake_descriptor(a), a, 3, b, 0.5, None)
    run = planned(lambda *args: launched.append(args), first, (a, b, 0.5))
    c, d = torch.randn(4), torch.randn(4)
    run(c, d, 0.25)
    (args,) = launched
    assert (args[0], args[1], args[2], args[3], args[4], args[5]) == (c, c, 3, d, 0.25, None)  # the descriptor's place
    dead = weakref.ref(a)
    del first, a
    assert dead() is None  # the plan holds no tensor of the first call
    assert planned(print, (b, b), (b, b)) is None  # aliased inputs: their places cannot be told apart

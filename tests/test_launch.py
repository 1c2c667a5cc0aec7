"""attention/launch.py: two launches share a key only if Triton would compile them alike, so a kept kernel never
runs on arguments it was not compiled for."""
import types

import torch

from attention.launch import launch_key


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

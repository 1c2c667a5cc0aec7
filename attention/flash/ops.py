"""The Triton kernels as PyTorch operators (torch.ops.nanoflash.*), so torch.compile(fullgraph=True)
traces straight through them: each op has a fake (meta) implementation that gives its outputs' shapes
and strides without running it.

Declared with torch.library's low-level API (define, impl, register_fake, register_autograd) rather than
torch.library.custom_op: custom_op wraps every call in Python layers (a wrapper that turns dynamo off and on, a check
that outputs alias no input) which these ops need none of: they always return new tensors, eager calls take the
torch.autograd.Functions of flash/autograd.py instead, and the layers cost host time on every call
(docs/perf_notes.md, "Host time").
"""
import torch

_lib = torch.library.Library("nanoflash", "FRAGMENT")


def define_op(schema: str, impl, fake, backward=None, setup_context=None):
    """schema: "name(Tensor q, ...) -> (Tensor, Tensor)". impl runs the kernels on real tensors (CUDA,
    or CPU under Triton's interpreter); fake returns empty outputs shaped and strided like impl's.
    The dispatcher leaves out trailing arguments equal to their schema defaults, so impl and fake must
    give them the same defaults. backward, setup_context: the op's autograd (torch.library.register_autograd's),
    for an op that torch.compile differentiates. -> the op, torch.ops.nanoflash.<name>."""
    name = schema.split("(", 1)[0]
    if hasattr(torch.ops.nanoflash, name):
        return _defined_by_another_copy(name, schema)
    _lib.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"nanoflash::{name}", fake, lib=_lib)
    if backward is not None:
        torch.library.register_autograd(f"nanoflash::{name}", backward, setup_context=setup_context, lib=_lib)
    return getattr(torch.ops.nanoflash, name)


def _defined_by_another_copy(name: str, schema: str):
    """One process can hold two copies of this package: the checkout's `attention` and an installed `nanoflash`
    (an editable install maps that name onto this same folder). Both define their ops in the one namespace
    nanoflash::, where a second definition is an error; so the copy that comes second reuses the op the first one
    defined, which runs the same code when the schemas agree. Schemas that differ mean two versions of the package."""
    op = getattr(torch.ops.nanoflash, name)
    if str(op.default._schema) != str(torch._C.parse_schema(f"nanoflash::{schema}")):
        raise RuntimeError(f"torch.ops.nanoflash.{name} is already defined, with another signature, by another "
                           "version of this package in this process (the checkout's `attention` beside an installed "
                           "`nanoflash`?); import one of them only, or reinstall from this checkout: pip install .")
    return op

"""What `pip install` puts into site-packages (pyproject.toml): the checkout's attention/ folder, with its Hugging Face
glue, as the package `nanoflash`, which must work without the rest of the checkout (the trainer, data, benchmarks and
examples run from the checkout) and beside the checkout's own `attention` in one process."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from helpers import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def checkout_modules() -> set[str]:
    """The checkout's top-level importable names: its packages and its .py files."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    return packages | {p.stem for p in ROOT.glob("*.py")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel setuptools builds from pyproject.toml, unpacked as pip would into site-packages -> (its folder, the
    wheel's file names). Built from a copy of what the build reads, so the checkout gets no build/ folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, site_packages = tmp / "src", tmp / "dist", tmp / "site-packages"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(ROOT / "attention", src / "attention", ignore=shutil.ignore_patterns("__pycache__"))
    build = "from setuptools import build_meta; print(build_meta.build_wheel(%r))" % str(dist)
    result = subprocess.run([sys.executable, "-c", build], cwd=src, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    with zipfile.ZipFile(dist / result.stdout.split()[-1]) as wheel:
        wheel.extractall(site_packages)
        return site_packages, wheel.namelist()


def test_the_wheel_holds_nanoflash_only(installed):
    _, names = installed
    assert PYPROJECT["project"]["name"] == "nanoflash"
    top_level = {name.split("/")[0] for name in names}
    assert top_level - {"nanoflash"} == {top for top in top_level if top.startswith("nanoflash-")}  # its metadata
    # every module, every shipped tuner choice, the native launcher's and the CUDA backend's sources (built on first
    # use) of attention/, under the installed name, and nothing else
    shipped = {"nanoflash/" + p.relative_to(ROOT / "attention").as_posix() for p in (ROOT / "attention").rglob("*")
               if p.suffix == ".py" or p.parent.name == "tuned" and p.name.endswith(".json.gz")
               or p.parent.name == "cuda" and p.suffix in (".cu", ".cuh", ".cpp", ".h")
               or p.parent.name == "flash" and p.suffix == ".cpp"}
    assert "nanoflash/cuda/flash_forward.cu" in shipped and "nanoflash/flash/native_launch.cpp" in shipped
    assert "nanoflash/integrations/transformers.py" in shipped
    assert any(name.startswith("nanoflash/flash/tuned/") and name.endswith(".json.gz") for name in shipped)
    assert {name for name in names if not name.startswith("nanoflash-")} == shipped


def test_the_installed_package_needs_nothing_else_from_the_checkout(installed):
    folder, _ = installed
    left_out = sorted(checkout_modules())  # `attention` too: the installed package must not import it by that name
    assert {"attention", "train", "model", "data", "training", "benchmarks", "examples"} <= set(left_out)
    script = f"""
import sys
class LeftOut:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {left_out!r}:
            raise ImportError(f"the installed package imports {{name}}, which pip install leaves out")
sys.meta_path.insert(0, LeftOut())
import torch
import nanoflash
assert nanoflash.__file__.startswith({str(folder)!r}), nanoflash.__file__
assert "transformers" not in sys.modules  # nanoflash depends on torch and triton only
from nanoflash import attention
from nanoflash.integrations.transformers import register
assert register("naive") == "nanoattn_naive"
q = torch.randn(1, 2, 8, 16)
assert torch.allclose(attention(q, q, q, causal=True, backend="naive"), attention(q, q, q, causal=True, backend="sdpa"),
                      atol=1e-5)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=folder, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(folder)})
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_checkout_and_the_installed_package_in_one_process(installed):
    """Both copies define the torch.library ops nanoflash::*: the second reuses the first's (ops.py), and each copy's
    Triton path runs through them."""
    folder, _ = installed
    script = """
import torch
import attention, nanoflash
from attention.flash import autograd as checkout_ops
from nanoflash.flash import autograd as installed_ops
from attention.moba import op
from nanoflash.moba import op
assert attention.__file__ != nanoflash.__file__
assert installed_ops.flash_attn_fwd is checkout_ops.flash_attn_fwd is torch.ops.nanoflash.flash_attn_fwd
q, k, v = (torch.randn(1, 2, 16, 16, requires_grad=True) for _ in range(3))
for package in (attention, nanoflash):
    y = package.attention(q, k, v, causal=True, backend="triton")
    dq, = torch.autograd.grad(y.sum(), q)
    y_ref = package.attention(q, k, v, causal=True, backend="naive")
    dq_ref, = torch.autograd.grad(y_ref.sum(), q)
    assert torch.allclose(y, y_ref, atol=1e-5) and torch.allclose(dq, dq_ref, atol=1e-5), package.__name__
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(folder)]), "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]


def test_an_op_of_another_version_is_refused_in_one_line():
    from attention.flash.autograd import flash_attn_fwd
    from attention.flash.ops import define_op

    with pytest.raises(RuntimeError, match="flash_attn_fwd is already defined, with another signature"):
        define_op("flash_attn_fwd(Tensor q) -> Tensor", impl=None, fake=None)
    assert flash_attn_fwd is define_op(str(flash_attn_fwd.default._schema).split("::", 1)[1], impl=None, fake=None)


def test_the_license_is_an_spdx_string():
    assert PYPROJECT["project"]["license"] == "MIT"  # a table is deprecated by setuptools, which warns on each install

"""What `pip install` puts into site-packages (pyproject.toml): the attention module and its Hugging Face glue, which
must work without the rest of the checkout (the trainer, data, benchmarks and examples run from the checkout)."""
import subprocess
import sys

import pytest
from helpers import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def checkout_modules() -> set[str]:
    """The checkout's top-level importable names: its packages and its .py files."""
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    return packages | {p.stem for p in ROOT.glob("*.py")}


def test_the_installed_packages_need_nothing_else_from_the_checkout():
    packages = set(PYPROJECT["tool"]["setuptools"]["packages"])
    installed = {name.split(".")[0] for name in packages}
    assert installed == {"attention", "integrations"}
    # every subpackage of attention/ is listed (setuptools installs the listed ones only), and nothing else
    subpackages = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "attention").rglob("__init__.py")}
    assert packages == subpackages | {"integrations"}
    assert "py-modules" not in PYPROJECT["tool"]["setuptools"]  # no train.py or model.py in site-packages
    left_out = sorted(checkout_modules() - installed)
    assert {"train", "model", "data", "training", "benchmarks", "examples"} <= set(left_out)
    # import what is installed, and use it, with every other name of the checkout refused
    script = f"""
import sys
class LeftOut:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {left_out!r}:
            raise ImportError(f"the installed package imports {{name}}, which pip install leaves out")
sys.meta_path.insert(0, LeftOut())
import torch
from attention import attention
from integrations.transformers import register
q = torch.randn(1, 2, 8, 16)
assert torch.allclose(attention(q, q, q, causal=True, backend="naive"), attention(q, q, q, causal=True, backend="sdpa"),
                      atol=1e-5)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_license_is_an_spdx_string():
    assert PYPROJECT["project"]["license"] == "MIT"  # a table is deprecated by setuptools, which warns on each install

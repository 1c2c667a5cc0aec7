"""Fixtures and hooks only; what test modules share otherwise is in helpers.py."""
import os
import sys

import pytest
import torch

# Without a GPU, Triton kernels run in its numpy interpreter. Triton reads this flag when a
# kernel is defined, so it must be set before anything imports the kernel modules.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def default_tiles(monkeypatch):
    """Each kernel launches its first tile that fits (NANOFLASH_AUTOTUNE=0): timing every candidate
    for every new shape would make the GPU tests take minutes. Modules opt in with usefixtures."""
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "0")


@pytest.fixture(autouse=True)
def no_launch_plans():
    """Each test starts without dispatch.py's launch plans: a test that changes a setting the plans bind (a
    monkeypatched tile list, say) must see its first call take the whole path."""
    dispatch = sys.modules.get("attention.flash.dispatch")
    if dispatch is not None:
        dispatch.forget_plans()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The tiny train.py run's token shards (helpers.tiny_run_shards), made once per test module; modules whose runs
    need other data define their own."""
    from helpers import tiny_run_shards
    return str(tiny_run_shards(tmp_path_factory.mktemp("tokens")))

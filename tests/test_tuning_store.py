"""The tuner's on-disk store of choices (attention/flash/tuning_store.py): CPU only, files under tmp_path."""
import gzip
import json
import subprocess
import sys
import textwrap
import warnings

import pytest

from attention.flash import tuning_store
from attention.flash.tuning_store import FORMAT, TuningStore, gpu_slug

H100 = dict(gpu="NVIDIA H100 80GB HBM3", triton="3.6.0", package="0.1.0")
KEY = "fwd|HEAD_DIM=64|causal=True|Tq=4096|Tk=4096|dtype=bf16"


def open_store(cache_dir, shipped_dir=None, **versions):
    return TuningStore.open(**{**H100, **versions}, cache_dir=cache_dir, shipped_dir=shipped_dir)


def ship(shipped_dir, data: dict):
    """data as the repository ships a GPU model's choices: gzipped JSON."""
    shipped_dir.mkdir(exist_ok=True)
    (shipped_dir / "nvidia-h100-80gb-hbm3.json.gz").write_bytes(gzip.compress(json.dumps(data).encode()))


def shipped_choices(shipped_dir):
    return json.loads(gzip.decompress((shipped_dir / "nvidia-h100-80gb-hbm3.json.gz").read_bytes()))["choices"]


def test_slug_and_default_cache_dir(monkeypatch, tmp_path):
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_slug("NVIDIA H200") == "nvidia-h200"
    monkeypatch.setenv("NANOFLASH_CACHE_DIR", str(tmp_path / "a"))
    assert open_store(None).path == tmp_path / "a" / "tuning" / "nvidia-h100-80gb-hbm3.json"
    monkeypatch.delenv("NANOFLASH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert open_store(None).path == tmp_path / "xdg" / "nanoflash" / "tuning" / "nvidia-h100-80gb-hbm3.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert open_store(None).path == tmp_path / "home" / ".cache" / "nanoflash" / "tuning" / "nvidia-h100-80gb-hbm3.json"


def test_round_trip_across_instances(tmp_path, recwarn):
    first = open_store(tmp_path)
    assert first.get(KEY) is None
    first.put(KEY, [128, 64, 8, 3])
    first.put("bwd|x", None)  # the backward's choice may be None
    assert first.get(KEY) == [128, 64, 8, 3]
    assert open_store(tmp_path).get(KEY) == [128, 64, 8, 3]  # a later process
    data = json.loads(first.path.read_text())
    assert data == {"format": FORMAT, **H100, "choices": {KEY: [128, 64, 8, 3], "bwd|x": None}}
    assert len(recwarn) == 0


def test_shipped_used_and_user_wins(tmp_path, recwarn):
    shipped = tmp_path / "shipped"
    ship(shipped, {"format": FORMAT, **H100, "choices": {KEY: [64, 64, 4, 3], "dq|y": [128, 64, 8, 3]}})
    store = open_store(tmp_path / "cache", shipped)
    assert store.get(KEY) == [64, 64, 4, 3] and store.get("dq|y") == [128, 64, 8, 3]
    store.put(KEY, [128, 64, 8, 3])
    again = open_store(tmp_path / "cache", shipped)
    assert again.get(KEY) == [128, 64, 8, 3] and again.get("dq|y") == [128, 64, 8, 3]
    # The user file holds only the user's choices; the shipped file is never written
    assert json.loads(store.path.read_text())["choices"] == {KEY: [128, 64, 8, 3]}
    assert shipped_choices(shipped)[KEY] == [64, 64, 4, 3]
    # Shipped choices for other versions are skipped, quietly
    assert open_store(tmp_path / "other", shipped, triton="3.5.0").get("dq|y") is None
    assert len(recwarn) == 0


@pytest.mark.parametrize("stale", [dict(triton="3.5.0"), dict(package="0.0.9"), dict(gpu="NVIDIA H200"),
                                   dict(format=1)])
def test_stale_file_ignored_with_one_warning_and_replaced(tmp_path, stale):
    path = open_store(tmp_path).path
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": FORMAT, **H100, **stale, "choices": {KEY: [1, 2, 3, 4]}}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = open_store(tmp_path)
        assert store.get(KEY) is None
        store.put("dq|y", [64, 64, 4, 3])
    assert len(caught) == 1 and str(path) in str(caught[0].message) and "\n" not in str(caught[0].message)
    assert json.loads(path.read_text()) == {"format": FORMAT, **H100, "choices": {"dq|y": [64, 64, 4, 3]}}


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]", '{"format": 2}', b"\xff\xfe".decode("latin-1"),
                                  json.dumps({"format": FORMAT, **H100, "choices": [KEY]}),
                                  json.dumps({"format": "1", **H100, "choices": {}}),
                                  json.dumps({"format": FORMAT, **H100, "triton": 3.6, "choices": {}})])
def test_corrupt_file_ignored_with_one_warning_and_rebuilt(tmp_path, text):
    path = open_store(tmp_path).path
    path.parent.mkdir(parents=True)
    path.write_text(text, encoding="latin-1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = open_store(tmp_path)
        store.put(KEY, [128, 64, 8, 3])
    assert len(caught) == 1 and str(path) in str(caught[0].message) and "rebuilt" in str(caught[0].message)
    assert open_store(tmp_path).get(KEY) == [128, 64, 8, 3]


@pytest.mark.parametrize("damage", [lambda data: data[: len(data) // 2], lambda data: b"not gzip" + data])
def test_corrupt_shipped_file_ignored_with_one_warning(tmp_path, damage):
    shipped = tmp_path / "shipped"
    ship(shipped, {"format": FORMAT, **H100, "choices": {KEY: [64, 64, 4, 3]}})
    path = shipped / "nvidia-h100-80gb-hbm3.json.gz"
    path.write_bytes(damage(path.read_bytes()))  # a truncated gzip stream; bytes that are no gzip at all
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert open_store(tmp_path / "cache", shipped).get(KEY) is None
    assert len(caught) == 1 and str(path) in str(caught[0].message) and "ignored" in str(caught[0].message)


# Each child loads the module from its file (no torch import: fast start-up), waits for the others, then puts its keys
CHILD = textwrap.dedent("""
    import importlib.util, sys, time
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("tuning_store", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cache, go, rank = Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    store = module.TuningStore.open(gpu="NVIDIA H100 80GB HBM3", triton="3.6.0", package="0.1.0", cache_dir=cache)
    while not go.exists():
        time.sleep(0.001)
    for i in range(20):
        store.put(f"fwd|rank={rank}|i={i}", [rank, i])
""")


def test_concurrent_puts_lose_nothing(tmp_path):
    go = tmp_path / "go"
    args = [sys.executable, "-c", CHILD, tuning_store.__file__, str(tmp_path), str(go)]
    children = [subprocess.Popen(args + [str(r)], stderr=subprocess.PIPE, text=True) for r in range(4)]
    go.touch()
    for child in children:
        assert child.wait(timeout=60) == 0, child.stderr.read()
        assert child.stderr.read() == ""
    path = open_store(tmp_path).path
    choices = json.loads(path.read_text())["choices"]
    assert choices == {f"fwd|rank={r}|i={i}": [r, i] for r in range(4) for i in range(20)}
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.with_suffix(".lock").name]  # no temp files


def test_unwritable_dir_warns_once_and_keeps_choices_in_memory(tmp_path):
    (tmp_path / "file").write_text("")  # a cache dir below a file cannot be made, even by root
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = open_store(tmp_path / "file" / "cache")
        store.put(KEY, [128, 64, 8, 3])
        store.put("dq|y", [64, 64, 4, 3])
    assert len(caught) == 1 and "in memory" in str(caught[0].message)
    assert store.get(KEY) == [128, 64, 8, 3] and store.get("dq|y") == [64, 64, 4, 3]


def test_export_is_read_as_shipped(tmp_path, recwarn):
    shipped = tmp_path / "shipped"
    ship(shipped, {"format": FORMAT, **H100, "choices": {"dq|y": [1]}})
    store = open_store(tmp_path / "gpu-session", shipped)
    store.put(KEY, [128, 64, 8, 3])
    out = store.export(tmp_path / "repo" / "tuning")
    assert out == tmp_path / "repo" / "tuning" / "nvidia-h100-80gb-hbm3.json.gz"
    assert out.read_bytes() == store.export(tmp_path / "again").read_bytes()  # the same choices, the same bytes
    fresh = open_store(tmp_path / "user", out.parent)
    assert fresh.get(KEY) == [128, 64, 8, 3] and fresh.get("dq|y") == [1]
    assert not fresh.path.exists()
    assert len(recwarn) == 0

"""The tile tuner (attention/flash/tuner.py, §9): which tiles are candidates, how they are timed, what is kept per
key, and the backward's choice between the `tl` kernels and the Hopper one. Pure Python or interpreter-sized: the
timing itself is faked (do_bench, or the tuner's timed)."""
import gzip
import json
import re
import types

import pytest
import torch
import triton
from helpers import qkv
from triton.runtime.errors import OutOfResources

from attention import attention
from attention.flash import tiles, tuner
from attention.flash.hopper.shapes import HopperBackwardTile, HopperForwardTile
from attention.flash.tuning_store import TuningStore


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The tuner's choices on disk in a folder of the test's own (a fake GPU's), empty at first; store() opens it again
    as a new process would."""
    def open_store():
        return TuningStore.open(gpu="Test GPU", triton="3.x", package="0", cache_dir=tmp_path)
    monkeypatch.setattr(tuner, "choices_store", lambda device: kept[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kept = [open_store()]

    def reopen():
        kept[0] = open_store()
        return kept[0]
    return reopen


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [16, 40, 64, 80, 128, 160, 256])
def test_hopper_tile_pruning(kernel, dtype, head_dim, monkeypatch):
    # pure Python: every head dim and dtype keeps at least one Hopper config that fits on chip
    monkeypatch.setattr(tiles, "INTERPRET", False)  # the GPU's candidate list, not the interpreter's
    block_d = triton.next_power_of_2(head_dim)
    kept = tiles.candidate_tiles(kernel, block_d, dtype.itemsize)
    assert kept
    for tile in kept:
        assert tile in tiles.TL_TILES[kernel][tiles.head_dim_class(block_d)]
        assert tiles.smem_bytes(kernel, tile, block_d, dtype.itemsize) <= tiles.SMEM_BUDGET


def test_tuned_choices_name_the_kernels_a_call_of_those_sizes_ran(monkeypatch):
    # benchmarks/attention.py records them per cell; a key of other sizes, mask or dtype is not reported
    monkeypatch.setattr(tuner, "best_tile", {})  # what earlier tests tuned is not this test's
    monkeypatch.setattr(tuner, "best_backward", {})
    q, k, v = qkv(1, 2, 2, 40, 40, 24, torch.float16, requires_grad=True)
    assert tuner.tuned_choices(24, True, torch.float16, 40, 40) == {}
    attention(q, k, v, causal=True, backend="triton").sum().backward()
    choices = tuner.tuned_choices(24, True, torch.float16, 40, 40)
    assert set(choices) == {"fwd", "dq", "dkdv"}  # no "bwd": the Hopper backward is not a candidate here
    assert choices["fwd"][0] == tiles.INTERPRETER_TILES["fwd"]
    assert tuner.tuned_choices(24, True, torch.float16, 33, 33) == choices  # the same power-of-two bucket
    assert tuner.tuned_choices(24, False, torch.float16, 40, 40) == {}
    assert tuner.tuned_choices(24, True, torch.float32, 40, 40) == {}
    attention(q, k, v, causal=True, window=(16, 0), backend="triton").sum().backward()  # a window: another key
    assert tuner.tuned_choices(24, True, torch.float16, 40, 40) == choices
    # the Hopper backward's choice (only on an H100/H200), whichever its candidate tiles were
    tuner.best_backward[tuner.BackwardKey(24, True, False, torch.float16, 64, 64, ((2, False),))] = (2, False)
    assert tuner.tuned_choices(24, True, torch.float16, 40, 40) == {**choices, "bwd": (2, False)}
    assert "bwd" not in tuner.tuned_choices(24, False, torch.float16, 40, 40)


def test_untuned_launch_takes_the_first_tile_that_fits():
    # NANOFLASH_AUTOTUNE=0: no timing, but a tile the compiler rejects for shared memory is passed over
    tried = []

    def run(tile):
        tried.append(tile)
        if tile == "big":
            raise OutOfResources(300_000, 232_448, "shared memory")
        return f"{tile} launched"

    assert tuner.first_that_fits(["big", "small", "smaller"], run) == ("small", "small launched")
    assert tried == ["big", "small"]


def test_tuner_times_each_candidates_repeat_after_a_warmup_of_its_own_in_rotating_rounds(monkeypatch):
    # the forward's tiles and the backward's choice between the `tl` and Hopper kernels share this timing: each
    # candidate's first run (a compile, the whole launch path) returns its repeat, the launch a plan makes, which is
    # what do_bench times, after all have compiled, each after running alone for WARMUP_MS (the GPU's clock settles
    # to the kernel's draw), the very first for HEAT_MS more (from an idle GPU's clock); in ROUNDS rounds, the order
    # rotating, a candidate's time the median of its rounds. A candidate that does not fit in shared memory is
    # infinitely slow and never timed.
    def too_big():
        raise OutOfResources(300_000, 232_448, "shared memory")

    events = []

    def candidate(name):
        def first_run():
            events.append(("compile", name))
            return lambda: name
        return first_run

    measured = {"a": [2.0, 9.0, 3.0], "b": [5.0, 1.0, 6.0]}  # one slow round each: the median ignores it

    def do_bench(repeat, warmup, rep, return_mode):
        events.append((repeat(), warmup, rep))
        return measured[repeat()].pop(0)

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(tuner, "ROUNDS", 3)
    times = tuner.timed({"a": candidate("a"), "big": too_big, "b": candidate("b")})
    assert times == {"big": float("inf"), "a": 3.0, "b": 5.0}
    warmup, rep = tuner.WARMUP_MS, tuner.REP_MS
    assert events == [("compile", "a"), ("compile", "b"), ("a", warmup + tuner.HEAT_MS, rep), ("b", warmup, rep),
                      ("b", warmup, rep), ("a", warmup, rep), ("a", warmup, rep), ("b", warmup, rep)]
    assert tuner.timed({"big": too_big}) == {"big": float("inf")}  # nothing fits: nothing to time


def test_block_sparse_candidates_are_the_tiles_that_divide_the_mask_block():
    # a block mask's blocks are walked tile by tile: under the interpreter (tiles 32x16, 16x32) 32 works, 16 not
    assert tiles.candidate_tiles("fwd", 32, 4, mask_block=32) == [tiles.INTERPRETER_TILES["fwd"]]
    assert tiles.candidate_tiles("dkdv", 32, 4) == [tiles.INTERPRETER_TILES["dkdv"]]
    with pytest.raises(ValueError, match="a block mask with block_size=16 is smaller than every dq tile"):
        tiles.candidate_tiles("dq", 32, 4, mask_block=16)


def test_tuning_is_off_in_the_interpreter_and_with_autotune_0(monkeypatch):
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "1")
    monkeypatch.setattr(tuner, "INTERPRET", True)
    assert not tuner.tuning_enabled()  # nothing to time in the interpreter
    monkeypatch.setattr(tuner, "INTERPRET", False)
    assert tuner.tuning_enabled()
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "0")
    assert not tuner.tuning_enabled()


def fake_backward_kernels(launched: list):
    """tl_backward and hopper_backward as backward_choice takes them, recording each plan's run."""
    def tl_backward():
        launched.append("tl plan")
        return lambda *call: launched.append(("tl", call))

    def hopper_backward(tile):
        return types.SimpleNamespace(again=lambda *call: launched.append((tile, call)))

    return tl_backward, hopper_backward


def test_backward_choice_times_the_tl_pair_against_each_hopper_tile_once_per_key(monkeypatch, store):
    monkeypatch.setattr(tuner, "INTERPRET", False)  # tuning on, as on a GPU
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "1")
    monkeypatch.setattr(tuner, "best_backward", {})
    monkeypatch.setattr(tuner, "tuning_log", [])
    timings = []

    def timed(first_runs):
        timings.append(list(first_runs))
        for first_run in first_runs.values():
            first_run()()  # its first run, then a repeat as do_bench would launch it
        return {"tl": 0.30, (2, False): 0.20, (3, True): 0.25}

    monkeypatch.setattr(tuner, "timed", timed)
    launched = []
    tl_backward, hopper_backward = fake_backward_kernels(launched)
    tiles = [HopperBackwardTile(2, False), HopperBackwardTile(3, True)]
    choice = tuner.backward_choice(tl_backward, hopper_backward, tiles, 64, True, False, torch.bfloat16, 1000, 1000,
                                   ("do", "q"))
    assert choice == (2, False)  # the fastest
    assert timings == [["tl", (2, False), (3, True)]]  # "tl": the `tl` pair
    assert launched == ["tl plan", ("tl", ("do", "q")), ((2, False), ("do", "q")), ((3, True), ("do", "q"))]
    key = tuner.BackwardKey(64, True, False, torch.bfloat16, 1024, 1024, ((2, False), (3, True)))
    assert tuner.best_backward == {key: (2, False)}
    assert [(entry["kernel"], entry["key"]) for entry in tuner.tuning_log] == [("bwd", key)]
    # sizes in the same power-of-two buckets keep the choice; another causality, other tiles: new keys, timed
    assert tuner.backward_choice(tl_backward, hopper_backward, tiles, 64, True, False, torch.bfloat16, 600, 1024,
                                 ()) == (2, False)
    assert len(timings) == 1
    tuner.backward_choice(tl_backward, hopper_backward, tiles, 64, False, False, torch.bfloat16, 1000, 1000, ())
    tuner.backward_choice(tl_backward, hopper_backward, tiles[:1], 64, True, False, torch.bfloat16, 1000, 1000, ())
    assert len(timings) == 3 and len(tuner.best_backward) == 3
    assert tuner.tuned_choices(64, True, torch.bfloat16, 1000, 1000)["bwd"] == (2, False)
    # a new process reads every choice back from disk and times nothing, the `tl` pair's included
    monkeypatch.setattr(tuner, "best_backward", {})
    store()
    assert tuner.backward_choice(tl_backward, hopper_backward, tiles, 64, True, False, torch.bfloat16, 1000, 1000,
                                 ()) == HopperBackwardTile(2, False)
    assert tuner.backward_choice(tl_backward, hopper_backward, tiles[:1], 64, True, False, torch.bfloat16, 1000, 1000,
                                 ()) in (None, HopperBackwardTile(2, False))
    assert len(timings) == 3


def test_stored_key_is_the_repr_without_names_and_the_shipped_files_use_it():
    key = tuner.TuningKey("fwd", (("HEAD_DIM", 64), ("CAUSAL", True)), ("pointers",), True, torch.bfloat16, 1024, 2048)
    expected = "TuningKey('fwd',(('HEAD_DIM',64),('CAUSAL',True)),('pointers',),True,bfloat16,1024,2048)"
    assert tuner.stored_key(key) == expected
    backward = tuner.BackwardKey(128, True, False, torch.float16, 512, 512, (HopperBackwardTile(2, False),))
    assert tuner.stored_key(backward) == "BackwardKey(128,True,False,float16,512,512,((2,False),))"
    shipped = sorted(tuner.SHIPPED_CHOICES.glob("*.json.gz"))
    assert len(shipped) == 2  # the H100's and the H200's
    for path in shipped:  # a key in another form would never be found
        keys = json.loads(gzip.decompress(path.read_bytes()))["choices"]
        assert keys and not [key for key in keys if re.search(r"\w=|torch\.|Tile\(|, ", key)]


def test_a_stored_choice_the_candidates_no_longer_hold_is_timed_again(monkeypatch, store):
    monkeypatch.setattr(tuner, "INTERPRET", False)
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "1")
    monkeypatch.setattr(tuner, "best_backward", {})
    tiles = [HopperBackwardTile(2, False)]
    key = tuner.BackwardKey(64, True, False, torch.bfloat16, 1024, 1024, tuple(tiles))
    store().put(tuner.stored_key(key), [9, True])  # a tile an older table had
    monkeypatch.setattr(tuner, "timed", lambda first_runs: {"tl": 0.1, tiles[0]: 0.2})
    assert tuner.backward_choice(*fake_backward_kernels([]), tiles, 64, True, False, torch.bfloat16, 1000, 1000,
                                 ()) is None
    assert store().get(tuner.stored_key(key)) == "tl"  # timed, and kept for the next process


def test_backward_choice_without_tuning_keeps_the_tl_kernels(monkeypatch, store):
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "0")
    monkeypatch.setattr(tuner, "INTERPRET", False)
    monkeypatch.setattr(tuner, "best_backward", {})
    monkeypatch.setattr(tuner, "timed", lambda first_runs: pytest.fail("timed with tuning off"))
    launched = []
    choice = tuner.backward_choice(*fake_backward_kernels(launched), [(2, False)], 128, True, False, torch.float16,
                                          300, 300, ())
    assert choice is None and launched == []  # nothing ran: the caller's run is the first


def test_a_kernels_choice_is_kept_on_disk_and_a_new_process_times_nothing(monkeypatch, store):
    monkeypatch.setattr(tuner, "INTERPRET", False)
    monkeypatch.setattr(tiles, "INTERPRET", False)  # the GPU's candidates
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "1")
    monkeypatch.setattr(tuner, "best_tile", {})
    launched, timings = [], []
    monkeypatch.setattr(tuner, "launch", lambda fn, grid, args, **constants: launched.append(
        (constants["BLOCK_M"], constants["BLOCK_N"])) or types.SimpleNamespace(again=lambda *args: None))

    def timed(first_runs):
        timings.append(list(first_runs))
        return {choice: (0.1 if i == 1 else 0.2) for i, choice in enumerate(first_runs)}  # the second is fastest
    monkeypatch.setattr(tuner, "timed", timed)
    constants = dict(HEAD_DIM=64, BLOCK_D=64, CAUSAL=True)
    call = ("dq", "kernel", lambda block_m, block_n: (1, 1), (), constants, 1000, 1000, torch.bfloat16)
    choice, _ = tuner.tuned_launch(*call)
    second = tiles.TL_TILES["dq"][64][1]
    assert choice == (second, None) and len(timings) == 1 and launched == [(second.block_m, second.block_n)]
    monkeypatch.setattr(tuner, "best_tile", {})  # a new process: nothing in memory, the same file on disk
    store()
    monkeypatch.setattr(tuner, "timed", lambda first_runs: pytest.fail("timed a key kept on disk"))
    choice, _ = tuner.tuned_launch(*call)
    assert choice == (second, None) and isinstance(choice[0], tiles.TlTile)


def test_keys_too_small_to_time_take_the_first_candidate_and_the_tl_backward(monkeypatch, store):
    # a head's (Tq, Tk) below TIMED_FROM runs for microseconds: no candidate is timed or compiled beyond the one taken
    monkeypatch.setattr(tuner, "INTERPRET", False)  # tuning on, as on a GPU
    monkeypatch.setattr(tiles, "INTERPRET", False)  # the GPU's candidates
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "1")
    monkeypatch.setattr(tuner, "best_tile", {})
    monkeypatch.setattr(tuner, "best_backward", {})
    monkeypatch.setattr(tuner, "timed", lambda first_runs: pytest.fail("timed a key too small to time"))
    launched = []
    monkeypatch.setattr(tuner, "launch", lambda fn, grid, args, **constants: launched.append(
        (constants["BLOCK_M"], constants["BLOCK_N"])) or types.SimpleNamespace(again=lambda *args: None))
    constants = dict(HEAD_DIM=64, BLOCK_D=64, CAUSAL=True)
    for T in (1, 37, 128):  # buckets up to 128
        choice, _ = tuner.tuned_launch("fwd", "kernel", lambda block_m, block_n: (1, 1), (), constants, T, T,
                                       torch.bfloat16)
        first = tiles.TL_TILES["fwd"][64][0]
        assert choice == (first, None)
    assert launched[0] == (first.block_m, first.block_n)
    tl_backward, hopper_backward = fake_backward_kernels(launched := [])
    assert tuner.backward_choice(tl_backward, hopper_backward, [HopperBackwardTile(2, False)], 64, True, False,
                                 torch.bfloat16, 100, 100, ()) is None  # the `tl` pair
    # nothing kept on disk
    assert launched == [] and store().get(tuner.stored_key(next(iter(tuner.best_backward)))) is None
    # from TIMED_FROM on (bucket 256: T from 129), a key is timed
    monkeypatch.setattr(tuner, "timed", lambda first_runs: {choice: 1.0 for choice in first_runs})
    tuner.backward_choice(tl_backward, hopper_backward, [HopperBackwardTile(2, False)], 64, True, False,
                          torch.bfloat16, 129, 129, ())
    assert len(tuner.best_backward) == 2


def test_a_term_key_takes_its_plain_keys_backward_choice_untimed(monkeypatch, store):
    # §15: a call with softcap, ALiBi or sinks has its own key, so it never reuses a plain call's plan, and is not
    # timed: it takes the plain key's choice (in this process or on disk), else the `tl` pair (tuner.TERM_SWITCHES)
    monkeypatch.setattr(tuner, "INTERPRET", False)
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "1")
    monkeypatch.setattr(tuner, "best_backward", {})
    monkeypatch.setattr(tuner, "timed", lambda first_runs: pytest.fail("a term key was timed"))
    tiles = [HopperBackwardTile(2, False), HopperBackwardTile(3, True)]
    kernels = fake_backward_kernels([])
    plain = tuner.BackwardKey(64, True, False, torch.bfloat16, 1024, 1024, tuple(tiles))
    # no plain choice anywhere: the `tl` pair
    assert tuner.backward_choice(*kernels, tiles, 64, True, False, torch.bfloat16, 1000, 1000, (), ("SOFTCAP",)) is None
    store().put(tuner.stored_key(plain), [3, True])  # the plain key's choice on disk (a shipped one, say)
    assert tuner.backward_choice(*kernels, tiles, 64, True, False, torch.bfloat16, 1000, 1000, (),
                                 ("ALIBI", "SINKS")) == (3, True)
    tuner.best_backward[plain] = HopperBackwardTile(2, False)  # ... or in this process
    assert tuner.backward_choice(*kernels, tiles, 64, True, False, torch.bfloat16, 1000, 1000, (),
                                 ("SOFTCAP", "ALIBI")) == (2, False)
    assert (plain, ("SOFTCAP",)) in tuner.best_backward
    assert store().get(tuner.stored_key(plain)) == [3, True]  # the plain key's choice as it was
    assert tuner.tuned_choices(64, True, torch.bfloat16, 1000, 1000)["bwd"] == (2, False)  # term keys left out


def test_a_term_key_takes_its_plain_keys_forward_choice_untimed(monkeypatch, store):
    # the forward's tuning key holds the term switches among its constants; with the Hopper tiles among the candidates
    # a term key is not timed: the plain key's choice (here the Hopper tile it chose), else the first that fits
    monkeypatch.setattr(tuner, "INTERPRET", False)
    monkeypatch.setattr(tiles, "INTERPRET", False)
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "1")
    monkeypatch.setattr(tuner, "best_tile", {})
    monkeypatch.setattr(tuner, "timed", lambda first_runs: pytest.fail("a term key was timed"))
    launched = []
    monkeypatch.setattr(tuner, "launch", lambda fn, grid, args, **constants: launched.append(
        (constants["BLOCK_M"], constants["BLOCK_N"])) or types.SimpleNamespace(again=lambda *args: None))
    hopper_tile = HopperForwardTile(128, 3, 3, True, 2)
    hopper = ([hopper_tile], lambda tile: launched.append(tile) or types.SimpleNamespace(again=lambda *a: None), ())
    plain = dict(HEAD_DIM=64, BLOCK_D=64, CAUSAL=True)
    with_terms = {**plain, "SOFTCAP": True, "SINKS": True}
    call = ("fwd", "kernel", lambda block_m, block_n: (1, 1), (), with_terms, 1000, 1000, torch.bfloat16)
    choice, _ = tuner.tuned_launch(*call, hopper=hopper)  # no plain choice yet: the first candidate, a `tl` tile
    assert choice == (tiles.TL_TILES["fwd"][64][0], None)
    monkeypatch.setattr(tuner, "best_tile", {})
    plain_key = tuner.TuningKey("fwd", tuple(plain.items()), None, True, torch.bfloat16, 1024, 1024)
    # the plain key's (shipped) choice
    store().put(tuner.stored_key(plain_key), tuner._as_json((hopper_tile, "hopper")))
    choice, _ = tuner.tuned_launch(*call, hopper=hopper)
    assert choice == (hopper_tile, "hopper") and launched[-1] == hopper_tile
    term_key = tuner.TuningKey("fwd", tuple(with_terms.items()), None, True, torch.bfloat16, 1024, 1024)
    assert store().get(tuner.stored_key(term_key)) is None  # nothing kept for the term key

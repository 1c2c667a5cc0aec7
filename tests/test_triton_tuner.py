"""The tile tuner (attention/triton_tuner.py, §9): which tiles are candidates, how they are timed, what is kept per
key, and the backward's choice between the `tl` kernels and the Hopper one. Pure Python or interpreter-sized: the
timing itself is faked (do_bench, or the tuner's timed)."""
import types

import pytest
import torch
import triton
from helpers import qkv
from triton.runtime.errors import OutOfResources

from attention import attention, triton_tuner


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [16, 40, 64, 80, 128, 160, 256])
def test_hopper_tile_pruning(kernel, dtype, head_dim, monkeypatch):
    # pure Python: every head dim and dtype keeps at least one Hopper config that fits on chip
    monkeypatch.setattr(triton_tuner, "INTERPRET", False)  # the GPU's candidate list, not the interpreter's
    block_d = triton.next_power_of_2(head_dim)
    kept = triton_tuner.candidate_tiles(kernel, block_d, dtype.itemsize)
    assert kept
    for tile in kept:
        assert tile in triton_tuner.HOPPER_TILES[kernel][triton_tuner.head_dim_class(block_d)]
        assert triton_tuner.smem_bytes(kernel, tile, block_d, dtype.itemsize) <= triton_tuner.SMEM_BUDGET


def test_tuned_choices_name_the_kernels_a_call_of_those_sizes_ran(monkeypatch):
    # benchmarks/attention.py records them per cell; a key of other sizes, mask or dtype is not reported
    monkeypatch.setattr(triton_tuner, "best_tile", {})  # what earlier tests tuned is not this test's
    monkeypatch.setattr(triton_tuner, "best_backward", {})
    q, k, v = qkv(1, 2, 2, 40, 40, 24, torch.float16, requires_grad=True)
    assert triton_tuner.tuned_choices(24, True, torch.float16, 40, 40) == {}
    attention(q, k, v, causal=True, backend="triton").sum().backward()
    choices = triton_tuner.tuned_choices(24, True, torch.float16, 40, 40)
    assert set(choices) == {"fwd", "dq", "dkdv"}  # no "bwd": the Hopper backward is not a candidate here
    assert choices["fwd"][0] == triton_tuner.INTERPRETER_TILES["fwd"]
    assert triton_tuner.tuned_choices(24, True, torch.float16, 33, 33) == choices  # the same power-of-two bucket
    assert triton_tuner.tuned_choices(24, False, torch.float16, 40, 40) == {}
    assert triton_tuner.tuned_choices(24, True, torch.float32, 40, 40) == {}
    attention(q, k, v, causal=True, window=(16, 0), backend="triton").sum().backward()  # a window: another key
    assert triton_tuner.tuned_choices(24, True, torch.float16, 40, 40) == choices
    # the Hopper backward's choice (only on an H100/H200), whichever its candidate tiles were
    triton_tuner.best_backward[triton_tuner.BackwardKey(24, True, False, torch.float16, 64, 64, ((2, False),))] = (2, False)
    assert triton_tuner.tuned_choices(24, True, torch.float16, 40, 40) == {**choices, "bwd": (2, False)}
    assert "bwd" not in triton_tuner.tuned_choices(24, False, torch.float16, 40, 40)


def test_untuned_launch_takes_the_first_tile_that_fits():
    # NANOFLASH_AUTOTUNE=0: no timing, but a tile the compiler rejects for shared memory is passed over
    tried = []

    def run(tile):
        tried.append(tile)
        if tile == "big":
            raise OutOfResources(300_000, 232_448, "shared memory")
        return f"{tile} launched"

    assert triton_tuner.first_that_fits(["big", "small", "smaller"], run) == ("small", "small launched")
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
    monkeypatch.setattr(triton_tuner, "ROUNDS", 3)
    times = triton_tuner.timed({"a": candidate("a"), "big": too_big, "b": candidate("b")})
    assert times == {"big": float("inf"), "a": 3.0, "b": 5.0}
    warmup, rep = triton_tuner.WARMUP_MS, triton_tuner.REP_MS
    assert events == [("compile", "a"), ("compile", "b"), ("a", warmup + triton_tuner.HEAT_MS, rep), ("b", warmup, rep),
                      ("b", warmup, rep), ("a", warmup, rep), ("a", warmup, rep), ("b", warmup, rep)]
    assert triton_tuner.timed({"big": too_big}) == {"big": float("inf")}  # nothing fits: nothing to time


def test_block_sparse_candidates_are_the_tiles_that_divide_the_mask_block():
    # a block mask's blocks are walked tile by tile: under the interpreter (tiles 32x16, 16x32) 32 works, 16 not
    assert triton_tuner.candidate_tiles("fwd", 32, 4, mask_block=32) == [triton_tuner.INTERPRETER_TILES["fwd"]]
    assert triton_tuner.candidate_tiles("dkdv", 32, 4) == [triton_tuner.INTERPRETER_TILES["dkdv"]]
    with pytest.raises(ValueError, match="a block mask with block_size=16 is smaller than every dq tile"):
        triton_tuner.candidate_tiles("dq", 32, 4, mask_block=16)


def test_tuning_is_off_in_the_interpreter_and_with_autotune_0(monkeypatch):
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "1")
    monkeypatch.setattr(triton_tuner, "INTERPRET", True)
    assert not triton_tuner.tuning_enabled()  # nothing to time in the interpreter
    monkeypatch.setattr(triton_tuner, "INTERPRET", False)
    assert triton_tuner.tuning_enabled()
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "0")
    assert not triton_tuner.tuning_enabled()


def fake_backward_kernels(launched: list):
    """tl_backward and hopper_backward as backward_choice takes them, recording each plan's run."""
    def tl_backward():
        launched.append("tl plan")
        return lambda *call: launched.append(("tl", call))

    def hopper_backward(tile):
        return types.SimpleNamespace(again=lambda *call: launched.append((tile, call)))

    return tl_backward, hopper_backward


def test_backward_choice_times_the_tl_pair_against_each_hopper_tile_once_per_key(monkeypatch):
    monkeypatch.setattr(triton_tuner, "INTERPRET", False)  # tuning on, as on a GPU
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "1")
    monkeypatch.setattr(triton_tuner, "best_backward", {})
    monkeypatch.setattr(triton_tuner, "tuning_log", [])
    timings = []

    def timed(first_runs):
        timings.append(list(first_runs))
        for first_run in first_runs.values():
            first_run()()  # its first run, then a repeat as do_bench would launch it
        return {None: 0.30, (2, False): 0.20, (3, True): 0.25}

    monkeypatch.setattr(triton_tuner, "timed", timed)
    launched = []
    tl_backward, hopper_backward = fake_backward_kernels(launched)
    tiles = [(2, False), (3, True)]
    choice = triton_tuner.backward_choice(tl_backward, hopper_backward, tiles, 64, True, False, torch.bfloat16, 1000, 1000,
                                          ("do", "q"))
    assert choice == (2, False)  # the fastest
    assert timings == [[None, (2, False), (3, True)]]  # None: the `tl` pair
    assert launched == ["tl plan", ("tl", ("do", "q")), ((2, False), ("do", "q")), ((3, True), ("do", "q"))]
    key = triton_tuner.BackwardKey(64, True, False, torch.bfloat16, 1024, 1024, ((2, False), (3, True)))
    assert triton_tuner.best_backward == {key: (2, False)}
    assert [(entry["kernel"], entry["key"]) for entry in triton_tuner.tuning_log] == [("bwd", key)]
    # sizes in the same power-of-two buckets keep the choice; another causality, other tiles: new keys, timed
    assert triton_tuner.backward_choice(tl_backward, hopper_backward, tiles, 64, True, False, torch.bfloat16, 600, 1024,
                                        ()) == (2, False)
    assert len(timings) == 1
    triton_tuner.backward_choice(tl_backward, hopper_backward, tiles, 64, False, False, torch.bfloat16, 1000, 1000, ())
    triton_tuner.backward_choice(tl_backward, hopper_backward, tiles[:1], 64, True, False, torch.bfloat16, 1000, 1000, ())
    assert len(timings) == 3 and len(triton_tuner.best_backward) == 3
    assert triton_tuner.tuned_choices(64, True, torch.bfloat16, 1000, 1000)["bwd"] == (2, False)


def test_backward_choice_without_tuning_keeps_the_tl_kernels(monkeypatch):
    monkeypatch.setenv("NANOFLASH_AUTOTUNE", "0")
    monkeypatch.setattr(triton_tuner, "INTERPRET", False)
    monkeypatch.setattr(triton_tuner, "best_backward", {})
    monkeypatch.setattr(triton_tuner, "timed", lambda first_runs: pytest.fail("timed with tuning off"))
    launched = []
    choice = triton_tuner.backward_choice(*fake_backward_kernels(launched), [(2, False)], 128, True, False, torch.float16,
                                          300, 300, ())
    assert choice is None and launched == []  # nothing ran: the caller's run is the first

"""data/loader.py's TokenLoader and the shard checks it relies on (data/shards.py): batches, shard rollover,
ranks and global batches, exact restore, and the one-line refusals of a missing, damaged or foreign data_dir, index or
shard."""
import json
import os
import re

import numpy as np
import pytest
import torch

from data.loader import TokenLoader
from data.shards import (INDEX, ShardError, check_shard, check_tokens, load_shard, read_index, shard_path, write_index,
                         write_shard)


# --- TokenLoader ---------------------------------------------------------------------------------------

def make_shards(folder, sizes, split="train"):
    """Shard i holds the token ids i*1000, i*1000+1, ...: every token says where it came from. Then the index, as a
    preparation script ends."""
    for i, size in enumerate(sizes):
        write_shard(shard_path(str(folder), split, i), np.arange(i * 1000, i * 1000 + size, dtype=np.uint16))
    write_index(str(folder), "make_shards")
    return str(folder)


def first_tokens(loader, steps):
    return [loader.next_batch()[0][0, 0].item() for _ in range(steps)]


def test_y_is_x_shifted_by_one(tmp_path):
    x, y = TokenLoader(make_shards(tmp_path, [100]), "train", batch_size=3, block_size=5).next_batch()
    assert x.shape == y.shape == (3, 5) and x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"
    assert torch.equal(x.flatten(), torch.arange(15))
    assert torch.equal(y.flatten(), torch.arange(1, 16))


def test_shard_rollover_and_wrap_around(tmp_path):
    # a batch needs 2*4+1 = 9 tokens: shard 0 (20 tokens) gives two, shard 1 (10 tokens) one, then shard 0 again
    loader = TokenLoader(make_shards(tmp_path, [20, 10]), "train", batch_size=2, block_size=4)
    assert first_tokens(loader, 5) == [0, 8, 1000, 0, 8]
    assert loader.state_dict() == {"split": "train", "shard": 1, "position": 0}


def test_two_ranks_split_what_one_rank_with_twice_the_batch_reads(tmp_path):
    data_dir = make_shards(tmp_path, [50, 30, 41])
    ranks = [TokenLoader(data_dir, "train", 2, 4, rank=r, world_size=2) for r in range(2)]
    single = TokenLoader(data_dir, "train", 4, 4)
    for _ in range(12):  # several rollovers and one wrap-around
        (x0, y0), (x1, y1), (x, y) = ranks[0].next_batch(), ranks[1].next_batch(), single.next_batch()
        assert not set(x0.flatten().tolist()) & set(x1.flatten().tolist())
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()


def test_one_global_batch_reads_the_same_tokens_however_it_is_split(tmp_path):
    # 16 tokens a step (plus 1) over shards of 50, 30 and 41: a step's micro-batches never straddle a shard or an
    # epoch, so 1 rank x 4 micro-batches, 2 x 2 and 4 x 1 train on the same tokens in every step, wrap-arounds included
    data_dir = make_shards(tmp_path, [50, 30, 41])

    def steps(world_size, accumulation, n=12):
        ranks = [TokenLoader(data_dir, "train", 1, 4, rank=r, world_size=world_size, accumulation=accumulation)
                 for r in range(world_size)]
        out = []
        for _ in range(n):
            out.append(sorted(x.flatten().tolist() for loader in ranks for x, _ in
                              [loader.next_batch() for _ in range(accumulation)]))
        assert all(loader.state_dict() == ranks[0].state_dict() for loader in ranks)
        return out, ranks[0].state_dict()

    single, state = steps(1, 4)
    assert [step[0][0] for step in single[:7]] == [0, 16, 32, 1000, 2000, 2016, 0]
    assert steps(2, 2) == steps(4, 1) == (single, state)


def test_a_step_larger_than_any_shard_still_reads_batch_by_batch(tmp_path):
    # 8 micro-batches of 9 tokens (72 + 1) never fit in shards of 50 and 30: each shard is done when a batch is not
    loader = TokenLoader(make_shards(tmp_path, [50, 30]), "train", 2, 4, accumulation=8)
    assert first_tokens(loader, 9) == [0, 8, 16, 24, 32, 40, 1000, 1008, 1016]


def test_state_dict_restores_the_exact_next_batches_on_every_rank(tmp_path):
    data_dir = make_shards(tmp_path, [50, 30, 41])
    rank0, rank1 = (TokenLoader(data_dir, "train", 2, 3, rank=r, world_size=2) for r in range(2))
    for _ in range(5):
        rank0.next_batch(), rank1.next_batch()
    state = json.loads(json.dumps(rank0.state_dict()))  # plain data: survives any checkpoint format
    expected = [rank1.next_batch() for _ in range(10)]

    resumed = TokenLoader(data_dir, "train", 2, 3, rank=1, world_size=2)  # restored from rank 0's state
    resumed.load_state_dict(state)
    for (x, y), (ex, ey) in zip((resumed.next_batch() for _ in range(10)), expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_restore_with_a_larger_batch_moves_on_when_too_little_is_left(tmp_path):
    data_dir = make_shards(tmp_path, [30, 30])
    loader = TokenLoader(data_dir, "train", 2, 4)
    loader.load_state_dict({"split": "train", "shard": 0, "position": 16})  # 14 tokens left, a batch needs 9
    assert first_tokens(loader, 1) == [16]
    bigger = TokenLoader(data_dir, "train", 4, 4)  # needs 17: shard 0 is done
    bigger.load_state_dict({"split": "train", "shard": 0, "position": 16})
    assert first_tokens(bigger, 1) == [1000]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"rank": 2, "world_size": 2}, ValueError, r"rank must be an integer in \[0, world_size=2\)"),
    ({"rank": -1}, ValueError, "rank must be"),
    ({"world_size": 0}, ValueError, "world_size must be a positive integer"),
    ({"batch_size": 0}, ValueError, "batch_size must be a positive integer"),
    ({"block_size": 2.5}, ValueError, "block_size must be a positive integer"),
    ({"split": "val"}, FileNotFoundError, r"no val_\*\.npy shards .*python -m data\.shakespeare"),
    ({"batch_size": 10}, ValueError, r"holds 40 tokens.*1 \* 10 \* 4 \+ 1 = 41"),
])
def test_loader_errors(tmp_path, kwargs, error, match):
    data_dir = make_shards(tmp_path, [100, 40])
    args = {"split": "train", "batch_size": 2, "block_size": 4} | kwargs
    with pytest.raises(error, match=match):
        TokenLoader(data_dir, **args)


def test_loader_error_for_missing_data_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist.*python -m data\.shakespeare"):
        TokenLoader(str(tmp_path / "nowhere"), "train", 2, 4)


def test_loader_error_for_a_shard_that_is_not_uint16(tmp_path):
    make_shards(tmp_path, [100])
    np.save(tmp_path / "train_000000.npy", np.arange(50, dtype=np.int32))  # the same number of bytes
    with pytest.raises(ShardError, match="int32 array of shape \\(50,\\), not 1-D uint16 tokens; re-create it with "
                                         "`make_shards`"):
        TokenLoader(str(tmp_path), "train", 2, 4)


@pytest.mark.parametrize("state, match", [
    ({"shard": 0}, "with keys 'split', 'shard' and 'position'"),
    ({"split": "val", "shard": 0, "position": 0}, "split 'val' but this loader reads 'train'"),
    ({"split": "train", "shard": 2, "position": 0}, "points at shard 2 but .* holds 2 train shards"),
    ({"split": "train", "shard": 1, "position": 41}, "position 41 lies outside"),
])
def test_load_state_dict_errors(tmp_path, state, match):
    loader = TokenLoader(make_shards(tmp_path, [100, 40]), "train", 2, 4)
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(state)


# --- the index and the shard checks ------------------------------------------------------------------------------

MADE_BY = "python -m data.prep --out_dir d"


def prepared(folder, vocab: int = 64) -> tuple[str, str]:
    """train_000000.npy, train_000001.npy (100 tokens each, ids 0..vocab-1) and val_000000.npy, then the index.
    -> (data_dir, the path of train_000000.npy)."""
    folder = str(folder)
    for split, i in (("train", 0), ("train", 1), ("val", 0)):
        write_shard(shard_path(folder, split, i), (np.arange(100) % vocab).astype(np.uint16))
    write_index(folder, MADE_BY)
    return folder, shard_path(folder, "train", 0)


def test_index_records_size_length_and_largest_token_of_every_shard(tmp_path):
    data_dir, path = prepared(tmp_path)
    index = read_index(data_dir)
    assert index["made_by"] == MADE_BY
    entry = {"tokens": 100, "bytes": os.path.getsize(path), "max_token": 63}
    assert index["shards"] == {name: entry for name in ("train_000000.npy", "train_000001.npy", "val_000000.npy")}
    assert check_shard(path, index, vocab_size=64) == 100
    check_tokens(path, load_shard(path), index, vocab_size=64)  # nothing to say


def rewrite_header(path, old: bytes, new: bytes) -> None:
    with open(path, "r+b") as f:
        data = f.read()
        assert len(old) == len(new) and old in data[:128]
        f.seek(0)
        f.write(data.replace(old, new, 1))


def truncate(path, size: int) -> None:
    os.truncate(path, size)


def zero_start(path) -> None:
    with open(path, "r+b") as f:
        f.write(bytes(16))


SHARD_DAMAGES = {  # name: (damage(path), what the refusal says)
    "truncated": (lambda p: truncate(p, 318), r"holds 318 bytes, its index says 328: truncated or damaged"),
    "emptied": (lambda p: truncate(p, 0), r"holds 0 bytes, its index says 328"),
    "zeroed_header": (zero_start, r"is not a readable token shard \(ValueError: no \.npy header\)"),
    "garbled_header": (lambda p: rewrite_header(p, b"{'descr'", b"{'de#~,'"), r"is not a readable token shard \("),
    "shorter_header": (lambda p: rewrite_header(p, b"(100,)", b"(99,) "), r"holds 99 tokens, its index says 100"),
    "longer_header": (lambda p: rewrite_header(p, b"(100,)", b"(900,)"), r"is not a readable token shard \("),
    # numpy retries a header that does not parse through Python's tokenizer, which fails on an unclosed bracket
    "unclosed_header": (lambda p: rewrite_header(p, b"(100,)", b"(100,("), r"is not a readable token shard \("),
    "foreign_int32": (lambda p: np.save(p, np.arange(50, dtype=np.int32)),  # the same number of bytes
                      r"holds a int32 array of shape \(50,\), not 1-D uint16"),
}


@pytest.mark.parametrize("damage", SHARD_DAMAGES)
def test_check_shard_refuses_a_damaged_shard_naming_it_and_the_command(tmp_path, damage):
    data_dir, path = prepared(tmp_path)
    damage, match = SHARD_DAMAGES[damage]
    damage(path)
    with pytest.raises(ShardError, match=match) as err:
        check_shard(path, read_index(data_dir), vocab_size=64)
    assert str(err.value).startswith(path) and f"re-create it with `{MADE_BY}`" in str(err.value)
    with pytest.raises(ShardError, match=match):  # the loader checks every shard when it starts
        TokenLoader(data_dir, "train", 2, 4, vocab_size=64)


def test_check_shard_refuses_a_shard_the_index_does_not_know(tmp_path):
    data_dir, _ = prepared(tmp_path)
    extra = shard_path(data_dir, "train", 2)
    write_shard(extra, np.arange(100, dtype=np.uint16))  # after the index was written
    with pytest.raises(ShardError, match=rf"{extra} is not in {INDEX} \(left from another preparation\?\); delete it"):
        check_shard(extra, read_index(data_dir))
    with pytest.raises(ShardError, match="is not in"):
        TokenLoader(data_dir, "train", 2, 4)


def test_loader_refuses_a_data_dir_missing_a_shard_its_index_lists(tmp_path):
    # an interrupted copy of the data, a deleted file: the index says what the preparation wrote, and a loader that
    # reads it must not train on part of the data without a word (nor send a resume to "the data_dir the run started
    # with" when that is the one it has)
    data_dir, _ = prepared(tmp_path)
    missing = shard_path(data_dir, "train", 1)
    os.unlink(missing)
    with pytest.raises(ShardError, match=re.escape(missing)):
        TokenLoader(data_dir, "train", 2, 4)


def test_check_shard_refuses_token_ids_past_the_models_vocabulary(tmp_path):
    data_dir, path = prepared(tmp_path)
    with pytest.raises(ShardError, match=r"train_000000.npy holds token id 63, and the model's vocabulary has 50: "
                                         r"shards of another tokenizer\? Re-create it with"):
        check_shard(path, read_index(data_dir), vocab_size=50)
    with pytest.raises(ShardError, match="the model's vocabulary has 50"):
        TokenLoader(data_dir, "train", 2, 4, vocab_size=50)
    assert TokenLoader(data_dir, "train", 2, 4).shard_sizes == [100, 100]  # no vocab_size: not checked


def test_check_tokens_finds_a_shard_overwritten_after_its_preparation(tmp_path):
    # same size, same header, the index's largest id: only reading the tokens shows it
    data_dir, _ = prepared(tmp_path, vocab=1000)
    later = shard_path(data_dir, "train", 1)
    tokens = np.arange(100, dtype=np.uint16)
    tokens[57] = 700
    write_shard(later, tokens)
    index = read_index(data_dir)
    assert check_shard(later, index, vocab_size=1000) == 100
    with pytest.raises(ShardError, match=r"train_000001.npy holds token id 700 \(its index says at most 99, the "
                                         r"model's vocabulary has 1000\): damaged after its preparation; re-create"):
        check_tokens(later, load_shard(later), index, vocab_size=1000)
    # the loader reads a shard through when it first opens it: here the second, when the first is used up
    loader = TokenLoader(data_dir, "train", 2, 4, vocab_size=1000)
    with pytest.raises(ShardError, match="train_000001.npy holds token id 700"):
        for _ in range(20):
            loader.next_batch()
    # and at once when a state points into it
    with pytest.raises(ShardError, match="train_000001.npy holds token id 700"):
        TokenLoader(data_dir, "train", 2, 4).load_state_dict({"split": "train", "shard": 1, "position": 0})


def test_loader_refuses_a_data_dir_without_an_index(tmp_path):
    make_shards(tmp_path, [100])
    os.unlink(tmp_path / INDEX)  # shards of an unfinished preparation, or of an older version
    with pytest.raises(ShardError, match=rf"{tmp_path} has no {INDEX}, which the preparation script writes when it "
                                         r"finishes; prepare the data \(again\): python -m data.shakespeare"):
        TokenLoader(str(tmp_path), "train", 2, 4)


@pytest.mark.parametrize("text", ["{not json", '{"made_by": "x"}', '{"made_by": "x", "shards": []}', "\xff"])
def test_loader_refuses_a_damaged_index(tmp_path, text):
    make_shards(tmp_path, [100])
    (tmp_path / INDEX).write_bytes(text.encode("latin-1"))
    with pytest.raises(ShardError, match=rf"{INDEX} is damaged .*; prepare the data again"):
        TokenLoader(str(tmp_path), "train", 2, 4)


@pytest.mark.parametrize("content", [b"", b"hello, not a shard", b"\x93NUMPY\x01\x00v\x00{'descr': '<u2'"])
def test_load_shard_refuses_files_that_are_not_npy(tmp_path, content):
    path = tmp_path / "train_000000.npy"
    path.write_bytes(content)
    with pytest.raises(ShardError, match=rf"{path} is not a readable token shard .*; how to fix"):
        load_shard(str(path), "how to fix")

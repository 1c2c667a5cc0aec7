"""data/: tokenizer, shard writer, tiny shakespeare and FineWeb-Edu preparation, TokenLoader. No network: the GPT-2
BPE and the tiny shakespeare text ship with the repository, and FineWeb documents are an in-memory list."""
import bz2
import gzip
import itertools
import json
import os
import re
import sys

import numpy as np
import pytest
import tiktoken
import torch

from data import fineweb, shakespeare
from data.loader import TokenLoader
from data.shards import (INDEX, ShardError, check_shard, check_tokens, find_shards, load_shard, read_index, shard_path,
                         write_index, write_shard)
from data.tokenizer import EOT_TOKEN, encode, get_encoding, to_uint16
from helpers import run_cli

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak. — café ✓\n"


@pytest.fixture(scope="module")
def enc():
    return get_encoding()


# --- tokenizer and shards ---------------------------------------------------------------------------

def test_encode_round_trip(enc):
    tokens = encode(TEXT)
    assert tokens.dtype == np.uint16 and tokens.ndim == 1
    assert enc.decode(tokens.tolist()) == TEXT
    assert enc.eot_token == EOT_TOKEN


def test_special_token_text_is_not_a_document_boundary(enc):
    tokens = encode("a <|endoftext|> b")
    assert EOT_TOKEN not in tokens
    assert enc.decode(tokens.tolist()) == "a <|endoftext|> b"


@pytest.mark.parametrize("bad", [[1, 2**16], [-1, 5]])
def test_to_uint16_rejects_ids_that_do_not_fit(bad):
    with pytest.raises(ValueError, match="uint16"):
        to_uint16(bad)


def test_the_shipped_bpe_is_tiktokens_gpt2(enc):
    try:
        reference = tiktoken.get_encoding("gpt2")  # tiktoken's cache (TIKTOKEN_CACHE_DIR), or a download
    except Exception as err:  # offline without a cache: requests' errors, or others
        pytest.skip(f"tiktoken's own GPT-2 BPE is unavailable: {err}")
    assert enc._mergeable_ranks == reference._mergeable_ranks
    assert enc.encode(TEXT + "<|endoftext|>", allowed_special="all") == reference.encode(TEXT + "<|endoftext|>",
                                                                                          allowed_special="all")


def test_write_shard_round_trip_leaves_no_temp_file(tmp_path):
    tokens = np.arange(100, dtype=np.uint16)
    path = shard_path(str(tmp_path / "d"), "train", 3)
    write_shard(path, tokens)
    assert path.endswith("train_000003.npy")
    assert np.array_equal(np.load(path), tokens)
    assert os.listdir(tmp_path / "d") == ["train_000003.npy"]


def test_interrupted_write_keeps_the_old_shard_and_no_partial_file(tmp_path, monkeypatch):
    path = shard_path(str(tmp_path), "train", 0)
    write_shard(path, np.arange(10, dtype=np.uint16))

    def save_half_then_die(f, tokens):
        f.write(b"\x93NUMPY partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "save", save_half_then_die)
    with pytest.raises(KeyboardInterrupt):
        write_shard(path, np.arange(20, dtype=np.uint16))
    monkeypatch.undo()
    assert np.array_equal(np.load(path), np.arange(10))
    assert os.listdir(tmp_path) == ["train_000000.npy"]


def test_write_shard_rejects_wide_tokens(tmp_path):
    with pytest.raises(TypeError, match="uint16"):
        write_shard(str(tmp_path / "train_000000.npy"), np.arange(5))


# --- tiny shakespeare --------------------------------------------------------------------------------

SPEECHES = [f"Citizen {i}:\n" + "Speak, speak. — café ✓\n" * (i % 4 + 1) + "\n" for i in range(30)]
SPEECHES[5] += "\n"  # a play ends: its two blank lines stay with the speech before them
SPEECHES[7] = SPEECHES[7].replace("Speak", "<|endoftext|>", 1)  # text like any other, not a document boundary
SPEECHES[-1] = SPEECHES[-1][:-1]  # the text ends with the last speech's newline, no blank line
PLAY = "".join(SPEECHES)
REAL_TEXT = shakespeare.TEXT


def prepared_speeches(tmp_path, text):
    """prepare(text) -> (its counts, train tokens, val tokens)."""
    counts = shakespeare.prepare(text, str(tmp_path))
    return counts, np.load(tmp_path / "train_000000.npy"), np.load(tmp_path / "val_000000.npy")


def test_split_speeches_joins_back_into_the_text():
    assert shakespeare.split_speeches(PLAY) == SPEECHES
    assert shakespeare.split_speeches("") == []


def test_shakespeare_puts_eot_before_every_speech_and_decodes_back(enc, tmp_path, capsys):
    text_file = tmp_path / "input.txt"
    text_file.write_text(PLAY, encoding="utf-8")
    out_dir = tmp_path / "shards"
    shakespeare.main(["--input", str(text_file), "--out_dir", str(out_dir)])

    train, val = np.load(out_dir / "train_000000.npy"), np.load(out_dir / "val_000000.npy")
    assert train.dtype == val.dtype == np.uint16
    stream = np.concatenate([train, val])
    starts = np.flatnonzero(stream == EOT_TOKEN)
    assert starts[0] == 0 and len(starts) == len(SPEECHES)
    documents = np.split(stream, starts[1:])
    assert [enc.decode(document[1:].tolist()) for document in documents] == SPEECHES
    assert enc.decode(stream[stream != EOT_TOKEN].tolist()) == PLAY
    assert val[0] == EOT_TOKEN
    n_train_documents = int(np.count_nonzero(train == EOT_TOKEN))
    assert (f"train: {len(train):,} tokens in {n_train_documents:,} speeches, val: {len(val):,} tokens in "
            f"{len(SPEECHES) - n_train_documents:,} speeches -> {out_dir}") in capsys.readouterr().out
    # the index, written last, records each shard and the command that re-creates them
    assert read_index(str(out_dir)) == {
        "made_by": f"python -m data.shakespeare --input {text_file} --out_dir {out_dir}",
        "shards": {f"{split}_000000.npy": {"tokens": len(tokens), "bytes": (out_dir / f"{split}_000000.npy").stat().st_size,
                                           "max_token": EOT_TOKEN} for split, tokens in (("train", train), ("val", val))}}
    assert sorted(os.listdir(out_dir)) == [INDEX, "train_000000.npy", "val_000000.npy"]  # no temporary file left


def test_shakespeare_val_starts_at_the_speech_nearest_90_percent(enc, tmp_path):
    counts, train, val = prepared_speeches(tmp_path, PLAY)
    n_tokens = len(train) + len(val)
    starts = np.flatnonzero(np.concatenate([train, val]) == EOT_TOKEN)
    nearest = min(starts[1:], key=lambda start: abs(start - 0.9 * n_tokens))
    assert len(train) == nearest
    assert counts == {"train": {"tokens": len(train), "documents": int(np.count_nonzero(train == EOT_TOKEN))},
                      "val": {"tokens": len(val), "documents": int(np.count_nonzero(val == EOT_TOKEN))}}
    assert counts["train"]["documents"] + counts["val"]["documents"] == len(SPEECHES)


def test_shakespeare_ten_equal_speeches_split_nine_to_one(enc, tmp_path):
    speech = "All:\nSpeak, speak.\n\n"
    length = 1 + len(encode(speech))
    counts, train, val = prepared_speeches(tmp_path, speech * 10)
    assert counts == {"train": {"tokens": 9 * length, "documents": 9}, "val": {"tokens": length, "documents": 1}}
    assert np.array_equal(val, np.concatenate(([EOT_TOKEN], encode(speech))))


def test_shakespeare_real_text_one_document_per_speech(enc, tmp_path):
    text = shakespeare.read_text(REAL_TEXT)
    assert len(text) > 1_000_000  # the whole play, gunzipped
    counts, train, val = prepared_speeches(tmp_path, text)
    speeches = shakespeare.split_speeches(text)
    assert all(re.match(r"[^\n]+:\n", speech) for speech in speeches)  # each opens with its speaker
    assert counts["train"]["documents"] + counts["val"]["documents"] == len(speeches)
    assert train[0] == val[0] == EOT_TOKEN
    stream = np.concatenate([train, val])
    assert enc.decode(stream[stream != EOT_TOKEN].tolist()) == text


@pytest.mark.parametrize("text", ["", "a", "First Citizen:\nBefore we proceed any further, hear me speak.\n"])
def test_shakespeare_rejects_text_too_short_to_split(enc, tmp_path, text):
    with pytest.raises(ValueError, match="too few to split into train and val; pass a text with speeches"):
        shakespeare.prepare(text, str(tmp_path))


def test_shakespeare_reads_a_compressed_input_as_the_text(tmp_path):
    (tmp_path / "play.txt").write_text(PLAY, encoding="utf-8")
    (tmp_path / "play.txt.gz").write_bytes(gzip.compress(PLAY.encode("utf-8")))
    (tmp_path / "play.txt.bz2").write_bytes(bz2.compress(PLAY.encode("utf-8")))
    for name in ("play.txt", "play.txt.gz", "play.txt.bz2"):
        shakespeare.main(["--input", str(tmp_path / name), "--out_dir", str(tmp_path / name.replace(".", "_"))])
    for split, compressed in itertools.product(("train", "val"), ("play_txt_gz", "play_txt_bz2")):
        assert np.array_equal(np.load(tmp_path / "play_txt" / f"{split}_000000.npy"),
                              np.load(tmp_path / compressed / f"{split}_000000.npy"))


def test_shakespeare_an_unreadable_input_is_one_line(tmp_path):
    result = run_cli("-m", "data.shakespeare", "--input", str(tmp_path / "missing.txt"), "--out_dir", str(tmp_path))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [f"data.shakespeare: error: cannot read --input {tmp_path / 'missing.txt'} "
                                          f"([Errno 2] No such file or directory: '{tmp_path / 'missing.txt'}'); "
                                          "pass a UTF-8 text file (gzip or bzip2 if its name ends in .gz or .bz2)"]
    (tmp_path / "plain.txt.gz").write_text(PLAY)  # named .gz, not gzipped
    result = run_cli("-m", "data.shakespeare", "--input", str(tmp_path / "plain.txt.gz"), "--out_dir", str(tmp_path))
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(f"data.shakespeare: error: cannot read --input {tmp_path / 'plain.txt.gz'} (")


# --- FineWeb-Edu ---------------------------------------------------------------------------------------

DOCUMENTS = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 4 + 1) for i in range(12)]


def expected_stream(documents):
    return np.concatenate([np.concatenate(([EOT_TOKEN], encode(d))) for d in documents]).astype(np.uint16)


def read_all(paths):
    return np.concatenate([np.load(p) for p in paths])


def test_fineweb_shards_eot_before_each_document(enc, tmp_path, capsys):
    paths = fineweb.write_shards(DOCUMENTS, str(tmp_path), shard_tokens=64)
    stream = expected_stream(DOCUMENTS)
    assert paths[0] == shard_path(str(tmp_path), "val", 0)
    assert paths[1:] == find_shards(str(tmp_path), "train")
    assert [len(np.load(p)) for p in paths[:-1]] == [64] * (len(paths) - 1)
    assert 0 < len(np.load(paths[-1])) <= 64
    assert np.array_equal(read_all(paths), stream)
    # every document starts right after an EOT
    starts = np.flatnonzero(stream == EOT_TOKEN)
    assert len(starts) == len(DOCUMENTS) and starts[0] == 0
    assert enc.decode(stream[starts[3] + 1 : starts[4]].tolist()) == DOCUMENTS[3]


def test_fineweb_max_tokens_stops_an_endless_stream(enc, tmp_path, capsys):
    endless = itertools.cycle(DOCUMENTS)
    paths = fineweb.write_shards(endless, str(tmp_path), shard_tokens=50, max_tokens=130)
    assert [len(np.load(p)) for p in paths] == [50, 50, 30]
    assert np.array_equal(read_all(paths), expected_stream(DOCUMENTS * 2)[:130])


def test_fineweb_workers_keep_document_order(enc, tmp_path, capsys):
    one = fineweb.write_shards(DOCUMENTS, str(tmp_path / "one"), shard_tokens=64, workers=1)
    two = fineweb.write_shards(DOCUMENTS, str(tmp_path / "two"), shard_tokens=64, workers=2)
    assert np.array_equal(read_all(one), read_all(two))


def test_fineweb_shards_feed_the_loader(enc, tmp_path, capsys):
    paths = fineweb.write_shards(DOCUMENTS, str(tmp_path), shard_tokens=64, made_by="python -m data.fineweb --x=1")
    index = read_index(str(tmp_path))
    assert index["made_by"] == "python -m data.fineweb --x=1"
    assert sorted(index["shards"]) == sorted(os.path.basename(p) for p in paths)
    assert [check_shard(p, index, vocab_size=50257) for p in paths] == [len(np.load(p)) for p in paths]
    x, y = TokenLoader(str(tmp_path), "val", batch_size=3, block_size=8).next_batch()
    assert torch.equal(x.flatten(), torch.from_numpy(expected_stream(DOCUMENTS)[:24].astype(np.int64)))


@pytest.mark.parametrize("kwargs, match", [
    ({"shard_tokens": 0}, "shard_tokens must be a positive integer"),
    ({"workers": 0}, "workers must be a positive integer"),
    ({"shard_tokens": 100, "max_tokens": 100}, "no train shard"),
])
def test_fineweb_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fineweb.write_shards(DOCUMENTS, str(tmp_path), **kwargs)


def test_fineweb_refuses_to_mix_with_existing_shards(tmp_path):
    write_shard(shard_path(str(tmp_path), "train", 7), np.zeros(4, dtype=np.uint16))
    with pytest.raises(FileExistsError, match="already holds shards"):
        fineweb.write_shards(DOCUMENTS, str(tmp_path), shard_tokens=64)


def test_fineweb_without_datasets_says_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(ImportError, match="pip install datasets"):
        fineweb.stream_documents()


@pytest.mark.parametrize("datasets", ["missing", "offline"])
def test_fineweb_preparation_fails_in_one_line(tmp_path, datasets):
    # a stand-in datasets module: absent, or one whose Hub cannot be reached
    stand_in = ("None" if datasets == "missing" else
                "type('datasets', (), {'load_dataset': staticmethod(lambda *a, **k: (_ for _ in ()).throw("
                "ConnectionError('Name or service not known\\nmore lines')))})")
    script = (f"import sys; sys.modules['datasets'] = {stand_in}; from data import fineweb; "
              f"fineweb.main(['--out_dir', {str(tmp_path)!r}])")
    result = run_cli("-c", script)
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("data.fineweb: error: ")
    assert ("pip install datasets" if datasets == "missing" else "run where the Hub can be reached") in result.stderr


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

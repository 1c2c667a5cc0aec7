"""data/: tokenizer, shard writer, tiny shakespeare and FineWeb-Edu preparation. No network: the GPT-2 BPE and the
tiny shakespeare text ship with the repository, and FineWeb documents are an in-memory list. TokenLoader and the
shard checks are in test_token_loader.py."""
import bz2
import gzip
import itertools
import os
import re
import sys

import numpy as np
import pytest
import tiktoken
import torch

from data import fineweb, shakespeare
from data.loader import TokenLoader
from data.shards import INDEX, check_shard, find_shards, read_index, shard_path, write_shard
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

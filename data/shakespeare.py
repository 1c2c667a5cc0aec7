"""Tiny Shakespeare as GPT-2 tokens, one document per speech: [EOT] speech [EOT] speech ... The first 90% of the
tokens are for training, the rest for validation, cut where a speech starts.

    python -m data.shakespeare                       # the repository's copy of the text -> data/shakespeare/
    python -m data.shakespeare --input other.txt     # another text with speeches separated by blank lines (or .gz, .bz2)

The text (1.1 MB, public domain) ships bzip2-compressed as data/assets/tinyshakespeare.txt.bz2; unpacked, it is byte for byte
char-rnn's https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt, so that
preparing it, and the first `python train.py`, need no network.
"""
import argparse
import bz2
import gzip
import re
import sys
import zlib
from pathlib import Path

import numpy as np

from .shards import shard_path, write_index, write_shard
from .tokenizer import EOT_TOKEN, get_encoding, to_uint16

TEXT = Path(__file__).parent / "assets" / "tinyshakespeare.txt.bz2"  # shipped compressed: a small repository
OPENERS = {".gz": gzip.open, ".bz2": bz2.open}  # a compressed text, by its name's ending
OUT_DIR = "data/shakespeare"  # the trainer's default data_dir: train.py prepares it on first use
TRAIN_FRACTION = 0.9
# speeches are separated by blank lines: a speech starts where a line with text follows one or more blank lines
SPEECH_START = re.compile(r"(?<=\n\n)(?=[^\n])")


def read_text(path) -> str:
    """A UTF-8 text file, decompressed on the way if its name ends in .gz or .bz2."""
    with OPENERS.get(Path(path).suffix, open)(path, "rt", encoding="utf-8") as f:
        return f.read()


def split_speeches(text: str) -> list[str]:
    """The speeches of text, each with the blank line(s) after it, so that they join back into text exactly."""
    return SPEECH_START.split(text) if text else []


def tokenize_speeches(speeches: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """-> (tokens, starts): [EOT] speech [EOT] speech ... as uint16, and the position of each EOT. Each speech is
    encoded on its own, special-token strings as ordinary text, so only the EOTs placed here mark boundaries."""
    documents = [[EOT_TOKEN, *tokens] for tokens in get_encoding().encode_ordinary_batch(speeches)]
    starts = np.cumsum([0] + [len(document) for document in documents], dtype=np.int64)[:-1]
    tokens = to_uint16([token for document in documents for token in document])
    return tokens, starts


def train_val_cut(starts: np.ndarray, n_tokens: int) -> int:
    """The index of the first val document: the one whose start lies nearest TRAIN_FRACTION of the tokens, leaving
    at least one document to each split."""
    if len(starts) < 2:
        raise ValueError(f"the text has {len(starts)} speech(es): too few to split into train and val; "
                         "pass a text with speeches separated by blank lines")
    distances = np.abs(starts[1:] - n_tokens * TRAIN_FRACTION)
    return 1 + int(np.argmin(distances))


def prepare(text: str, out_dir: str, made_by: str = "python -m data.shakespeare") -> dict[str, dict[str, int]]:
    """Tokenize text speech by speech and write train_000000.npy and val_000000.npy, then their index (made_by: the
    command that re-creates them); returns each split's token and document counts."""
    tokens, starts = tokenize_speeches(split_speeches(text))
    first_val = train_val_cut(starts, len(tokens))
    n_train = int(starts[first_val])
    documents = {"train": first_val, "val": len(starts) - first_val}
    counts = {}
    # split by position, not at random: val is then text the model has never seen a neighbour of
    for split, part in (("train", tokens[:n_train]), ("val", tokens[n_train:])):
        write_shard(shard_path(out_dir, split, 0), part)
        counts[split] = {"tokens": len(part), "documents": documents[split]}
    write_index(out_dir, made_by)
    return counts


def summary(counts: dict[str, dict[str, int]], out_dir: str) -> str:
    return ", ".join(f"{split}: {c['tokens']:,} tokens in {c['documents']:,} speeches" for split, c in counts.items()) \
        + f" -> {out_dir}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", metavar="PATH", default=str(TEXT), help="the text (default: the repository's copy)")
    parser.add_argument("--out_dir", default=OUT_DIR, help="where the shards go")
    args = parser.parse_args(argv)

    try:
        text = read_text(args.input)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as err:
        sys.exit(f"data.shakespeare: error: cannot read --input {args.input} ({err}); pass a UTF-8 text file "
                 "(gzip or bzip2 if its name ends in .gz or .bz2)")
    command = " ".join(["python -m data.shakespeare", *(argv if argv is not None else sys.argv[1:])])
    print(summary(prepare(text, args.out_dir, command), args.out_dir))


if __name__ == "__main__":
    main()

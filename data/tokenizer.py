"""GPT-2 BPE through tiktoken, giving the uint16 token arrays that shards store. The BPE ships with the repository
(data/assets/gpt2_encoder.json.xz, OpenAI's encoder.json compressed), so tokenizing never needs the network."""
import functools
import json
import lzma
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenizer pattern (tiktoken >= 0.8)

EOT_TOKEN = 50256  # <|endoftext|>: marks the start of each document in the token stream
UINT16_LIMIT = 2**16
ENCODER_JSON = Path(__file__).parent / "assets" / "gpt2_encoder.json.xz"  # shipped compressed: a small repository


@functools.cache
def get_encoding() -> tiktoken.Encoding:
    """tiktoken's "gpt2" encoding, built from the shipped encoder.json: its token ranks are the BPE's merge order, so
    it needs no vocab.bpe. encoder.json writes each token's bytes as printable characters: a printable byte (not the
    space) as itself, each other byte as chr(256 + its place among those others)."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    byte_of = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    encoder = json.loads(lzma.decompress(ENCODER_JSON.read_bytes()).decode("utf-8"))
    ranks = {bytes(byte_of[c] for c in token): rank for token, rank in encoder.items() if rank != EOT_TOKEN}
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT_TOKEN}, explicit_n_vocab=EOT_TOKEN + 1)


def to_uint16(tokens) -> np.ndarray:
    """Token ids as uint16, which halves shard size next to int32; every GPT-2 id (< 50257) fits."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= UINT16_LIMIT):
        raise ValueError(
            f"token ids must lie in [0, {UINT16_LIMIT - 1}] to be stored as uint16, got ids in "
            f"[{tokens.min()}, {tokens.max()}]; a vocabulary of more than {UINT16_LIMIT} tokens needs wider shards"
        )
    return tokens.astype(np.uint16)


def encode(text: str) -> np.ndarray:
    """Text -> uint16 tokens. Special-token strings inside the text (a literal "<|endoftext|>") are
    encoded as ordinary text, so the data itself can never forge a document boundary."""
    return to_uint16(get_encoding().encode_ordinary(text))

"""GPT-2 (124M to 1.5B) in one file, with the attention backend chosen by one config field.

    model = GPT(GPTConfig.preset("gpt2", attn="triton"))
    logits, loss = model(idx, targets)        # idx, targets: (B, T) token ids
    GPT(GPTConfig(window=256))                # sparse: a 256-token sliding window, any backend with masks
    GPT(GPTConfig(attn="moba"))               # sparse: MoBA, a backend with options of its own (attn_options)

Two things GPT does live in files of their own, as mixins: sampling with a KV cache, model.generate(idx, 100)
(generation.py), and loading OpenAI's weights, GPT.from_pretrained("gpt2") (pretrained.py; module names follow
Hugging Face's GPT-2 so its checkpoints load 1:1).
"""
import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import (BlockMask, attention, attention_qkvpacked, available_backends, backend_options, decode_attention,
                       get_backend, keys_per_query, unpack_qkv)
from generation import GenerationMixin, KVCache
from pretrained import PRESET_ALIASES, PRESETS, PretrainedMixin


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest sequence: the number of learned position embeddings
    vocab_size: int = 50304  # GPT-2's 50257 tokens padded to a multiple of 64: faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    # Dropout on the residual path (embeddings, attention output, MLP output) and, as nanoGPT's, on the attention
    # probabilities in training (attention()'s dropout_p, docs/flash_attention.md §16), on every backend that computes
    # it (naive, compile, sdpa, triton; MoBA's selection gets the residual dropout only)
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as in GPT-2; False is a bit faster
    attn: str = "sdpa"  # attention backend, one of attention.available_backends()
    # Sliding window: each token attends to itself and the `window` tokens before it, through any
    # backend that takes masks (the triton one skips the key blocks outside it). 0 is full causal attention.
    window: int = 0
    # Document masking: packed documents, each starting at a doc_token (GPT-2's <|endoftext|>), attend only within
    # themselves (alone or with the window), through any backend that takes masks
    doc_mask: bool = False
    doc_token: int = 50256
    # the backend's own options (attention.backend_options), its defaults filled in by __post_init__
    attn_options: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; each head gets "
                             "n_embd // n_head channels, so pick n_head among the divisors of n_embd")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not (isinstance(self.window, int) and not isinstance(self.window, bool) and self.window >= 0):
            raise ValueError(f"GPTConfig.window must be an int >= 0 (previous tokens each token sees; 0 = full "
                             f"causal attention), got {self.window!r}")
        if not isinstance(self.attn_options, dict):
            raise ValueError(f"GPTConfig.attn_options must be a dict of the backend's options, got "
                             f"{self.attn_options!r}")
        self.attn_options = backend_options(self.attn, **self.attn_options)  # unknown backend or option: an error
        if (self.window or self.doc_mask) and not get_backend(self.attn).supports_masks:
            rule = f"window={self.window}" if self.window else "doc_mask=True"
            raise ValueError(f"{rule} with attn={self.attn!r}: that backend takes no masks; pick a backend that "
                             f"does ({', '.join(b for b in available_backends() if get_backend(b).supports_masks)})")

    def sparsity(self) -> dict:
        """What the attention computes beyond dense causal attention: {} for none, the window, and for a backend
        that computes a function of its own (attention.Backend.exact False) its name and options. Configs that
        differ only in an exact backend have the same sparsity and compute the same function, up to rounding."""
        rules = {"window": self.window} if self.window else {}
        if self.doc_mask:
            rules["doc_mask"] = True
        if not get_backend(self.attn).exact:
            rules.update(attn=self.attn, **self.attn_options)
        return rules

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """GPT-2 sizes by HF name or parameter count: gpt2|124M, gpt2-medium|350M, gpt2-large|774M, gpt2-xl|1.5B."""
        name = PRESET_ALIASES.get(name, name)
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join([*PRESETS, *PRESET_ALIASES])}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(overrides) - set(valid))
        if unknown:
            hint = " (`dropout` acts on the residual path and on the attention probabilities)"
            raise ValueError(f"unknown GPTConfig field(s) {unknown}; valid fields: {valid}"
                             + (hint if any("dropout" in k for k in unknown) else ""))
        return cls(**{**PRESETS[name], **overrides})


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.backend, self.options = config.attn, config.attn_options
        self.window = config.window
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True  # see GPT._init_weights
        self.resid_dropout = nn.Dropout(config.dropout)
        # attention dropout (§16) where the backend computes it; in training only (forward)
        self.attn_dropout = config.dropout if "dropout_p" in get_backend(config.attn).terms else 0.0

    def forward(self, x, kv_cache: KVCache | None = None, documents: BlockMask | None = None):
        """documents: the step's document mask (GPT.document_mask), which holds the window too."""
        B, T, C = x.size()
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head)  # (B, T, 3, nh, hs)
        window = (self.window, 0) if self.window else None
        if kv_cache is None:
            # packed: the triton backend's backward then returns qkv's gradient as one tensor, where three
            # gradients of q, k, v would cost a concatenation per layer (see attention_qkvpacked)
            y = attention_qkvpacked(qkv, causal=True, backend=self.backend, window=window, block_mask=documents,
                                    dropout_p=self.attn_dropout if self.training else 0.0, **self.options)
        else:
            y = self._attend_cached(qkv, kv_cache, window)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads side by side
        return self.resid_dropout(self.c_proj(y))

    def _attend_cached(self, qkv, kv_cache: KVCache, window) -> torch.Tensor:
        """Attention against the KV cache, on q, k, v as (B, nh, T, hs) views of qkv. Left strided on purpose:
        the Triton kernels read them in place, and a .contiguous() would cost three copies per layer."""
        q, k, v = unpack_qkv(qkv)
        if kv_cache.step_pos is not None:
            # a static decode step (see KVCache): T = 1, the whole buffer, the valid length on the device
            kv_cache.write_step(k, v)
            return decode_attention(q, kv_cache.k, kv_cache.v, kv_cache.step_len, backend=self.backend)
        T = q.shape[2]
        k, v = kv_cache.extend(k, v)  # (B, nh, Tk, hs): the cached positions, then these T
        if self.window:
            # the first of the T queries reads back `window` keys, so older ones would all be
            # masked out; dropping them also keeps Tk, and so the cached BlockMask, the same each step
            k, v = k[:, :, -(T + self.window):], v[:, :, -(T + self.window):]
        # With a cache, Tq = T < Tk: the causal mask is aligned bottom-right, so new query i sits at
        # position Tk - T + i and sees every cached key (within the window) plus the new ones up to itself.
        return attention(q, k, v, causal=True, backend=self.backend, window=window, **self.options)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 was trained with the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN: normalise before each sub-layer, so the residual stream itself is never normalised."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache: KVCache | None = None, documents: BlockMask | None = None):
        x = x + self.attn(self.ln_1(x), kv_cache, documents)
        return x + self.mlp(self.ln_2(x))


class GPT(GenerationMixin, PretrainedMixin, nn.Module):
    config_class = GPTConfig  # what from_pretrained builds

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying: the output projection is the token embedding (saves vocab * n_embd parameters)
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            # Each block adds its two residual projections to the stream, so the stream's variance
            # grows with depth; GPT-2 scales these inits by 1/sqrt(number of additions) to cancel it.
            if getattr(module, "residual_projection", False):
                std /= math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None, kv_caches: list[KVCache] | None = None):
        """idx, targets: (B, T) int64. Returns logits (B, T, vocab) and the mean cross-entropy
        (None without targets); targets equal to -1 are ignored.

        kv_caches: one KVCache per layer (generate() makes them). idx then holds the tokens that
        follow the cached ones, and their k, v are added to the caches.
        With doc_mask, each row's documents start at its doc_tokens; tokens before the first are one more document.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, seq_len) token ids, got shape {tuple(idx.shape)}; "
                             "use idx[None] for a single sequence")
        if kv_caches is not None and not get_backend(self.config.attn).kv_cache:
            raise ValueError(f"attn={self.config.attn!r} attends whole sequences only (as many queries as keys) and "
                             "runs without KV caches; run the full context, as generate() does for it")
        if kv_caches is not None and self.config.doc_mask:
            raise ValueError("a doc_mask model runs without KV caches (each query needs the documents of every key); "
                             "run the full context, as generate() does for it")
        if kv_caches is not None and len(kv_caches) != self.config.n_layer:
            raise ValueError(f"got {len(kv_caches)} KV caches for {self.config.n_layer} layers; pass one per layer")
        B, T = idx.size()
        past = kv_caches[0].length if kv_caches else 0
        if past + T > self.config.block_size:
            length = f"{past} cached + {T} new tokens" if past else f"sequence length {T}"
            raise ValueError(f"{length} exceeds block_size={self.config.block_size}; crop the input to its last "
                             f"{self.config.block_size} tokens (clear() the caches first) or build the model "
                             "with a larger block_size")
        pos = kv_caches[0].positions(T, idx.device) if kv_caches else torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        documents = self.document_mask(idx) if self.config.doc_mask else None  # one per step, for every layer
        for i, block in enumerate(self.transformer.h):
            x = block(x, kv_caches[i] if kv_caches else None, documents)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def document_mask(self, idx: torch.Tensor) -> BlockMask:
        """The causal mask within documents (and the window) of the batch idx (B, T), built on idx's device without
        waiting for it: a document starts at each doc_token."""
        T = idx.size(1)
        document_ids = (idx == self.config.doc_token).cumsum(1, dtype=torch.int32)  # (B, T)
        window = (self.config.window, 0) if self.config.window else None
        return BlockMask.from_rules(T, T, causal=True, window=window, document_ids=document_ids)

    def num_params(self) -> int:
        # parameters() yields the tied wte/lm_head weight once
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> int:
        """Training FLOPs per token, for MFU: 6 per parameter (2 forward, 4 backward) plus the
        attention score and value matmuls, 12 * n_layer * n_head * head_dim * keys, keys being the
        most one query reads (attention.keys_per_query): block_size for causal attention (the causal mask's
        skipped half is counted, as is the convention), window + 1 for a sliding window, a sparse backend's own
        bound. A sparse model is so credited with the work it needs, not with the dense work it skips."""
        cfg = self.config
        keys = keys_per_query(cfg.attn, cfg.block_size, cfg.window, **cfg.attn_options)
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_embd * keys

    def configure_optimizers(self, weight_decay, learning_rate, betas) -> torch.optim.AdamW:
        # Decay matmul weights and embeddings (every 2-D tensor). Biases and LayerNorm gains (1-D)
        # are few and only shift or scale activations: pulling gains towards 0 would not regularise.
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # the fused kernel updates all parameters in a few launches instead of several per tensor, and skips the
        # update on the device when training/step.py's non-finite check says so (found_inf)
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True)

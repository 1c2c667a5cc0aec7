"""GPT-2 (124M to 1.5B) in one file, with the attention backend chosen by one config field.

    model = GPT(GPTConfig.preset("gpt2", attn="triton"))
    logits, loss = model(idx, targets)        # idx, targets: (B, T) token ids
    out = model.eval().generate(idx, 100)     # sampling with a KV cache (see KVCache)
    GPT(GPTConfig(window=256))                # sparse: a 256-token sliding window, any backend with masks
    GPT(GPTConfig(attn="moba"))               # sparse: MoBA, a backend with options of its own (attn_options)

Module names follow Hugging Face's GPT-2 so its checkpoints load 1:1 (see load_hf_state_dict).
"""
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import (BlockMask, attention, attention_qkvpacked, available_backends, backend_options, decode_attention,
                       get_backend, keys_per_query, unpack_qkv)

# every GPT-2 size uses a head size of 64; only the depth and width change
PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}
PRESET_ALIASES = {"124M": "gpt2", "350M": "gpt2-medium", "774M": "gpt2-large", "1.5B": "gpt2-xl"}


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest sequence: the number of learned position embeddings
    vocab_size: int = 50304  # GPT-2's 50257 tokens padded to a multiple of 64: faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    # Dropout on the residual path only (embeddings, attention output, MLP output). Dropout on the
    # attention probabilities is not offered: the flash backends never materialise them.
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
            hint = " (`dropout` acts on the residual path; attention-probability dropout is not supported)"
            raise ValueError(f"unknown GPTConfig field(s) {unknown}; valid fields: {valid}"
                             + (hint if any("dropout" in k for k in unknown) else ""))
        return cls(**{**PRESETS[name], **overrides})


class KVCache:
    """One layer's keys and values during generate(), so each step computes k, v for new tokens only.

    The buffer is (B, nh, max_len, hs), allocated once on the first write, in the dtype the keys come
    in (bf16 under autocast, say), and filled in place: no torch.cat and no reallocation per token.
    Two ways to fill it:

    - extend(k, v) appends T positions at the host-side count `length`; attention then reads the
      filled prefix, a view whose length changes every call. generate() fills the prompt this way.
    - a static decode step, while step_pos is set (generate() sets it, see DecodeStep): write_step()
      puts one token's k, v at the device-side position step_pos, and attention reads the whole
      buffer through decode_attention, keys at or past step_len masked. Every step has the same
      shapes and reads no host int, so it can be captured once in a CUDA graph and replayed.
    """

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0  # positions filled so far
        self.k = self.v = None
        # (1,) int64 device tensors during a static decode step: the new token's position, and the
        # number of valid positions including it (step_pos + 1), kept apart to save an add per layer
        self.step_pos = self.step_len = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, nh, T, hs) of the next T positions; return all of them (B, nh, length, hs)."""
        end = self.length + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} cached + {k.size(2)} new positions > max_len="
                             f"{self.max_len}; clear() it and re-run the context, or make a larger cache")
        if self.k is None:
            # zeros, not empty: the masked decode of the non-Triton backends reads the whole buffer and
            # weights unwritten positions by 0, and 0 * a NaN left in uninitialised memory is NaN
            self.k = k.new_zeros(k.size(0), k.size(1), self.max_len, k.size(3))
            self.v = torch.zeros_like(self.k)
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        # strided views of the buffer, which every backend reads in place
        return self.k[:, :, :end], self.v[:, :, :end]

    def write_step(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one token's k, v (B, nh, 1, hs) at step_pos; the caller advances the positions."""
        self.k.index_copy_(2, self.step_pos, k)
        self.v.index_copy_(2, self.step_pos, v)

    def positions(self, T: int, device) -> torch.Tensor:
        """(T,) absolute positions of the next T tokens: the device-side step_pos in a static step."""
        if self.step_pos is not None:
            return self.step_pos
        return torch.arange(self.length, self.length + T, device=device)

    def clear(self) -> None:
        self.length = 0  # the buffer is kept: the next writes overwrite it
        self.step_pos = self.step_len = None  # and they are extend()s again


class DecodeStep:
    """generate()'s decode loop body: one token per sequence through the model, at the position its
    KV caches (filled by a prefill) have reached. The step reads its inputs from static buffers and
    the position from a device tensor (KVCache.step_pos), so its shapes and addresses never change.

    With cuda_graph the whole step (embedding, every block's cache write and decode attention, the
    head) is captured once into a torch.cuda.CUDAGraph, and each token then costs one replay instead
    of a few hundred kernel launches from Python, which is what bounds decoding at small batch.
    """

    def __init__(self, model: "GPT", caches: list[KVCache], token: torch.Tensor, cuda_graph: bool):
        self.model, self.caches = model, caches
        self.token = token.clone()  # (B, 1) static input buffer: each call copies the next token in
        start = caches[0].length
        self.pos = torch.full((1,), start, dtype=torch.long, device=token.device)
        self.cache_len = self.pos + 1
        for cache in caches:  # every layer reads the same two position tensors
            cache.step_pos, cache.step_len = self.pos, self.cache_len
        self.graph = None
        if cuda_graph:
            # Warm up on a side stream first, as CUDA graph capture requires: Triton compiles its
            # kernels and cuBLAS picks its algorithms there, outside the capture. The warm-up writes
            # this token's k, v, which the first replay rewrites identically; rewind the positions.
            side = torch.cuda.Stream(device=token.device)
            side.wait_stream(torch.cuda.current_stream(token.device))
            with torch.cuda.stream(side):
                self._forward()
            torch.cuda.current_stream(token.device).wait_stream(side)
            self.pos.fill_(start)
            self.cache_len.fill_(start + 1)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._forward()  # (B, vocab) static output, refreshed by every replay

    def _forward(self) -> torch.Tensor:
        logits, _ = self.model(self.token, kv_caches=self.caches)
        # advance on the device, inside the captured step: the next replay decodes one position on
        self.pos.add_(1)
        self.cache_len.add_(1)
        return logits[:, -1, :]

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """token (B, 1) -> logits (B, vocab) for the position after it. With a graph these are its
        static output buffer, valid until the next call: generate() samples from them before that."""
        self.token.copy_(token)
        if self.graph is None:
            logits = self._forward()
        else:
            self.graph.replay()
            logits = self.logits
        for cache in self.caches:  # the host-side count, which generate() and GPT.forward's checks read
            cache.length += 1
        return logits


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

    def forward(self, x, kv_cache: KVCache | None = None, documents: BlockMask | None = None):
        """documents: the step's document mask (GPT.document_mask), which holds the window too."""
        B, T, C = x.size()
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head)  # (B, T, 3, nh, hs)
        window = (self.window, 0) if self.window else None
        if kv_cache is None:
            # packed: the triton backend's backward then returns qkv's gradient as one tensor, where three
            # gradients of q, k, v would cost a concatenation per layer (see attention_qkvpacked)
            y = attention_qkvpacked(qkv, causal=True, backend=self.backend, window=window, block_mask=documents,
                                    **self.options)
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


class GPT(nn.Module):
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

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True,
                 cuda_graph: bool | None = None):
        """Extend idx (B, T) by max_new_tokens sampled tokens; returns (B, T + max_new_tokens).

        temperature=0 means greedy decoding (argmax), the same as top_k=1. Put the model in
        eval() mode first if it has dropout.

        use_cache=True: one forward over the prompt fills a KVCache per layer (the prefill), then
        each step runs the newest token alone through a static-shape DecodeStep: the cache written
        and read in place, the position a device tensor, attention by decode_attention.
        cuda_graph (default: on when idx is on CUDA and use_cache) captures that step once in a
        CUDA graph and replays it per token. use_cache=False re-runs the whole context every step.
        All see the same context: past block_size tokens the learned positions run out, so each
        step re-runs the last block_size tokens from position 0 (the cache is cleared and
        refilled, and no decode step runs again), and from there on the cache saves nothing.

        Sparse models: with a window, the cache is used but each step runs eagerly (the newest
        token through attention() with the window, against the cache's last window keys) and
        without a CUDA graph, since the static decode step has no window. A backend that attends whole
        sequences only (attention.Backend.kv_cache False), and a doc_mask model, always run as use_cache=False.
        """
        if not (isinstance(temperature, (int, float)) and 0 <= temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature!r}")
        if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
            raise ValueError(f"top_k must be a positive int or None (no top-k filtering), got {top_k!r}")
        if not get_backend(self.config.attn).kv_cache or self.config.doc_mask:
            use_cache = False  # it attends a whole sequence at once (or per document): no form for one new query
        static_step = use_cache and not self.config.window  # decode_attention has no window
        if cuda_graph is None:
            cuda_graph = static_step and idx.device.type == "cuda"
        if cuda_graph and not (static_step and idx.device.type == "cuda"):
            raise ValueError(f"cuda_graph=True replays the static decode step on the GPU: it needs use_cache=True and "
                             f"idx on a CUDA device, and a dense model without window (got use_cache={use_cache}, "
                             f"device {idx.device}, window={self.config.window}, attn={self.config.attn!r}); "
                             "leave cuda_graph=None to choose automatically")
        block_size = self.config.block_size
        max_len = min(block_size, idx.size(1) + max_new_tokens)
        caches = [KVCache(max_len) for _ in self.transformer.h] if use_cache else None
        decode_step = None  # built after the prefill, when the caches hold the prompt
        for _ in range(max_new_tokens):
            cached = caches and 0 < caches[0].length < block_size  # the caches hold the tokens before the newest
            if cached and static_step:
                if decode_step is None:
                    decode_step = DecodeStep(self, caches, idx[:, -1:], cuda_graph)
                logits = decode_step(idx[:, -1:])
            elif cached:  # a window model: the newest token through attention() with the window
                logits = self(idx[:, -1:], kv_caches=caches)[0][:, -1, :]
            else:  # no cache, the first step, or a full context: crop, positions past block_size have no embedding
                for cache in caches or []:
                    cache.clear()
                logits = self(idx[:, -block_size:], kv_caches=caches)[0][:, -1, :]  # only the last position predicts
            if temperature == 0:  # logits: (B, vocab)
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth_largest, -math.inf)
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx

    @classmethod
    def from_pretrained(cls, name_or_path: str, attn: str = "sdpa", n_head: int | None = None, **settings) -> "GPT":
        """OpenAI's GPT-2 weights by name (gpt2, gpt2-medium, gpt2-large, gpt2-xl or 124M ... 1.5B,
        through transformers), or a local HF-layout state dict (.safetensors, .bin, .pt). No weight shape reveals
        a local file's n_head: it comes from the config.json beside it (as save_pretrained writes) or from
        n_head=, and without either the load is refused rather than guessed. settings: GPTConfig's window and
        attn_options, to run the dense weights with sparse attention (fine-tuning, say)."""
        name, path = PRESET_ALIASES.get(str(name_or_path), str(name_or_path)), Path(name_or_path)
        if name in PRESETS:
            state_dict, n_head = _download_hf_state_dict(name), PRESETS[name]["n_head"]
        elif path.is_file():
            state_dict = _read_state_dict_file(path)
            n_head = n_head or _n_head_beside(path)
        else:
            raise ValueError(f"{name_or_path!r} is neither a GPT-2 name ({', '.join([*PRESETS, *PRESET_ALIASES])}) "
                             "nor an existing state dict file")
        state_dict = _with_transformer_prefix(state_dict)
        if "transformer.wte.weight" not in state_dict or "transformer.wpe.weight" not in state_dict:
            raise ValueError(f"{name_or_path} holds no GPT-2 token and position embeddings (transformer.wte.weight, "
                             "transformer.wpe.weight); pass a GPT-2 state dict in Hugging Face's layout")
        vocab_size, n_embd = state_dict["transformer.wte.weight"].shape
        n_layer = len({k.split(".")[2] for k in state_dict if k.startswith("transformer.h.")})
        config = GPTConfig(block_size=state_dict["transformer.wpe.weight"].shape[0], vocab_size=vocab_size,
                           n_layer=n_layer, n_head=n_head, n_embd=n_embd, attn=attn, **settings)
        model = cls(config)
        load_hf_state_dict(model, state_dict)
        return model


def _n_head_beside(path: Path) -> int:
    """n_head from the HF config.json beside a weights file; refused without one (a guess from the head size
    would load a 4-head model as 2 heads without a word)."""
    config_file = path.parent / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json beside it, and n_head cannot be read off the weights; put the "
                         "checkpoint's HF config.json beside it or pass n_head= (GPT.from_pretrained(path, n_head=12))")
    try:
        config = json.loads(config_file.read_text())
        n_head = config.get("n_head", config.get("num_attention_heads"))
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise ValueError(f"{config_file} is not a JSON config ({err}); restore it or pass n_head=") from None
    if not isinstance(n_head, int) or n_head < 1:
        raise ValueError(f"{config_file} gives no n_head (got {n_head!r}); fix it or pass n_head=")
    return n_head


# HF's GPT-2 uses Conv1D layers, which store weights as (in, out); nn.Linear stores (out, in)
_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# non-trainable buffers in older HF checkpoints (a causal mask and its fill value): nothing to load
_HF_BUFFERS = (".attn.bias", ".attn.masked_bias")


def _with_transformer_prefix(state_dict: dict) -> dict:
    """GPT2Model checkpoints (as OpenAI's original upload) name keys h.0..., GPT2LMHeadModel's transformer.h.0..."""
    return {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in state_dict.items()}


def load_hf_state_dict(model: GPT, state_dict: dict) -> None:
    """Copy a Hugging Face GPT-2 state dict into model in place (shapes and names must match)."""
    state_dict = {k: v for k, v in _with_transformer_prefix(state_dict).items() if not k.endswith(_HF_BUFFERS)}
    state_dict.pop("lm_head.weight", None)  # tied to wte (save_pretrained often leaves it out)
    ours = model.state_dict()
    expected = set(ours) - {"lm_head.weight"}
    missing, unexpected = expected - set(state_dict), set(state_dict) - expected
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {sorted(missing)[:5]}, unexpected "
                         f"{sorted(unexpected)[:5]}; HF GPT-2 weights need bias=True and the checkpoint's n_layer")
    weights = {key: weight.t() if key.endswith(_CONV1D_WEIGHTS) else weight for key, weight in state_dict.items()}
    for key, weight in weights.items():  # every shape checked before the first copy: no half-loaded model
        if weight.shape != ours[key].shape:
            raise ValueError(f"{key}: checkpoint shape {tuple(weight.shape)} != model shape "
                             f"{tuple(ours[key].shape)}; build the model with the checkpoint's sizes (OpenAI's "
                             "GPT-2 uses vocab_size=50257 and block_size=1024)")
    with torch.no_grad():
        for key, weight in weights.items():
            ours[key].copy_(weight)


def _download_hf_state_dict(name: str) -> dict:
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise ImportError(f"loading {name!r} by name needs transformers: pip install transformers") from None
    try:
        return GPT2LMHeadModel.from_pretrained(name).state_dict()
    except OSError as e:
        raise OSError(f"could not fetch {name!r} from the Hugging Face Hub ({e}); when offline, download it "
                      "elsewhere and pass the path of its model.safetensors or pytorch_model.bin instead") from e


def _read_state_dict_file(path: Path) -> dict:
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ImportError(f"reading {path} needs the safetensors package: pip install safetensors") from None
        return load_file(path)
    if path.suffix in (".bin", ".pt", ".pth"):
        return torch.load(path, map_location="cpu", weights_only=True)
    raise ValueError(f"unsupported weights file {path}; expected .safetensors, .bin, .pt or .pth")


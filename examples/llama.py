"""A small Llama-style decoder in one file, on nanoflash's attention.

    model = Llama(LlamaConfig(attn="triton"))
    logits, loss = model(idx, targets)        # idx, targets: (B, T) token ids

What differs from GPT-2 (model.py): RMSNorm instead of LayerNorm, rotary position embeddings on q
and k instead of learned position vectors, grouped-query attention (n_kv_head < n_head: several
query heads read one shared key/value head), a SwiGLU MLP, and no biases anywhere.

The input and output embeddings are tied. At this width the (vocab, n_embd) matrix is already more
than half of the model (25.8M of the default 48.3M parameters); a second one would add 25.8M
parameters that only map to and from tokens, none that add depth, for a data set of 300k tokens.
Llama 3.2's small models (1B, 3B) tie theirs too.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import attention, available_backends


@dataclass
class LlamaConfig:
    block_size: int = 1024  # longest sequence: the number of positions RoPE precomputes
    vocab_size: int = 50304  # GPT-2's tokenizer, padded to a multiple of 64
    n_layer: int = 8
    n_head: int = 8  # query heads
    n_kv_head: int = 2  # key/value heads, each shared by n_head // n_kv_head query heads
    n_embd: int = 512
    ffn_dim: int = 0  # SwiGLU hidden width; 0: 8/3 * n_embd rounded up to a multiple of 64
    rope_theta: float = 10000.0  # base of RoPE's wavelengths
    norm_eps: float = 1e-5
    attn: str = "sdpa"  # attention backend, one of attention.available_backends()

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                             "pick n_head among the divisors of n_embd")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}; each kv "
                             "head serves an equal group of query heads, so pick n_kv_head among the divisors of n_head")
        if self.head_dim % 2:
            raise ValueError(f"head size n_embd // n_head = {self.head_dim} is odd; RoPE rotates channel pairs, "
                             "so choose n_embd and n_head with an even quotient")
        if self.attn not in available_backends():
            raise ValueError(f"unknown attention backend attn={self.attn!r}; "
                             f"choose one of: {', '.join(available_backends())}")
        if not self.ffn_dim:
            # 8/3: SwiGLU's three matrices then hold as many weights as a 4x GELU MLP's two
            self.ffn_dim = 64 * math.ceil(8 * self.n_embd / 3 / 64)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def rope_angles(head_dim: int, n_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each (n_positions, head_dim // 2): channel pair i of the
    vector at position t turns by t * theta^(-2i / head_dim), fast for the first pairs, slow for the last."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (hs/2,)
    angles = torch.outer(torch.arange(n_positions, dtype=torch.float32), inv_freq)  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, nh, hs) by its positions' angles (T, hs/2). Channel i pairs with channel
    i + hs/2. A rotation keeps every vector's norm, and rotating q by angle(m) and k by angle(n) makes
    q.k depend on m - n alone: attention sees relative positions."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, hs/2): the same for every head
    x1, x2 = x.float().chunk(2, dim=-1)  # in fp32: bf16 angles would blur positions far apart
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)  # back to the autocast dtype, which the attention backends expect of q, k and v alike


class GroupedQueryAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.backend = config.attn
        self.wq = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.wk = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.wv = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.size()
        q = apply_rope(self.wq(x).view(B, T, self.n_head, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(B, T, self.n_kv_head, self.head_dim), cos, sin)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim)
        # (B, T, nh, hs) -> (B, nh, T, hs) as views. k and v keep their n_kv_head heads: every
        # backend maps query head h to kv head h // (n_head // n_kv_head) itself, so no copy of k
        # and v per query head is ever made.
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = attention(q, k, v, causal=True, backend=self.backend)  # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    """silu(gate(x)) * up(x): the gate decides, per channel, how much of up(x) passes."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(config.n_embd, config.ffn_dim, bias=False)
        self.up = nn.Linear(config.n_embd, config.ffn_dim, bias=False)
        self.down = nn.Linear(config.ffn_dim, config.n_embd, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = GroupedQueryAttention(config)
        self.mlp_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied: see the module docstring
        # buffers, so .to(device) moves them; not persistent: they are recomputed, never trained
        cos, sin = rope_angles(config.head_dim, config.block_size, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self):
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # RMSNorm gains keep their init of 1
            std = 0.02
            # wo and down each add to the residual stream, 2 * n_layer times in all; shrinking them
            # keeps the stream's variance from growing with depth
            if name.endswith(("wo.weight", "down.weight")):
                std /= math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx, targets=None):
        """idx, targets: (B, T) int64. Returns logits (B, T, vocab) and the mean cross-entropy
        (None without targets); targets equal to -1 are ignored."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, seq_len) token ids, got shape {tuple(idx.shape)}; "
                             "use idx[None] for a single sequence")
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}; crop the input "
                             f"or build the model with LlamaConfig(block_size={T})")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hs/2)
        x = self.tok_embeddings(idx)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # the tied embedding counts once

    def configure_optimizer(self, weight_decay: float, learning_rate: float, betas: tuple[float, float],
                            fused: bool = False) -> torch.optim.AdamW:
        """AdamW that decays the matrices (linear layers, the embedding) and leaves the RMSNorm gains
        alone: a gain scales a whole channel, and pulling it towards 0 would silence it, not regularise."""
        matrices = [p for p in self.parameters() if p.dim() == 2]
        gains = [p for p in self.parameters() if p.dim() == 1]
        groups = [{"params": matrices, "weight_decay": weight_decay}, {"params": gains, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)

"""Sampling from GPT (model.py) with a KV cache: GPT.generate() comes from GenerationMixin.

    out = model.eval().generate(idx, 100)     # idx (B, T) -> (B, T + 100), prompt first

Each layer keeps its keys and values in a KVCache; after one forward over the prompt (the prefill), a DecodeStep
runs one token at a time, on CUDA replayed from a CUDA graph. docs/decoding.md explains why.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import get_backend


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

    def __init__(self, model: nn.Module, caches: list[KVCache], token: torch.Tensor, cuda_graph: bool):
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


class GenerationMixin:
    """generate() for model.GPT, which provides what it reads: config (block_size, attn, window, doc_mask),
    transformer.h (one KVCache per block) and forward(idx, kv_caches=...) -> (logits, loss)."""

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

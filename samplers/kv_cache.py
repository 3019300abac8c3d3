"""The torch engine's static KV cache: K and V of every decode slot, allocated once, and the attention of each
kind of forward pass over it (samplers/torch_model.py's ``Transformer`` takes an ``Attend``; a hybrid model's
attention layers have one of their own inside samplers/state_cache.py's ``HybridCache``).

    cache = KVCache(model.args, slots=64, max_len=512)
    model(prompts, positions, cache.prefill(slots, src), last=lengths - 1)     # prompts from position 0
    model(suffixes, positions, cache.extend(slots, starts), last=lengths - 1)  # after kept K/V (multi-turn)
    model.decode(tokens, pos, cache)                                           # one token per running slot
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from .torch_model import ModelArgs

# attend(layer, q [B, T, heads, hd], k [B, T, kv_heads, hd], v [B, T, kv_heads, hd]) -> [B, T, heads * hd]
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]


class KVCache(nn.Module):
    """K and V of every slot: ``[layers, slots, kv_heads, max_len, head_dim]``, allocated once.

    ``prefill`` and ``decode`` return the attention function of one forward
    pass, which writes that pass's K/V into the cache and attends."""

    def __init__(self, args: ModelArgs, slots: int, max_len: int, dtype=torch.float32, device="cpu") -> None:
        super().__init__()
        shape = (args.n_layers, slots, args.n_kv_heads, max_len, args.head_dim)
        self.k = nn.Buffer(torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.v = nn.Buffer(torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.slots, self.max_len = slots, max_len

    def prefill(self, slots: Tensor, src: Tensor) -> Attend:
        """Attention of right-padded prompts ``[G, T]`` (causal within each prompt); row ``i`` of the prompt
        K/V is written into slot ``slots[j]`` for every ``j`` with ``src[j] == i``: a group's n samples share
        one prefill. Padding writes K/V past a prompt's end, which decoding masks and then overwrites."""

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            g, t = q.shape[:2]
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [G, kv_heads, T, hd]
            self.k[layer, slots, :, :t] = k[src]
            self.v[layer, slots, :, :t] = v[src]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, enable_gqa=True)
            return out.transpose(1, 2).reshape(g, t, -1)

        return attend

    def extend(self, slots: Tensor, starts: Tensor, kv_len: int | None = None) -> Attend:
        """Attention of right-padded continuations ``[G, T]`` of slots ``slots`` whose cache already holds
        ``starts[g]`` tokens (a multi-turn row's earlier turns, restored with ``restore``): token t of row g is
        written at ``starts[g] + t`` and attends to its slot's positions up to its own. Padding writes past a
        row's end, which decoding masks and then overwrites. ``kv_len``: ``min(max(starts) + T, max_len)``
        when the caller knows it (else read from ``starts``: a device->host read)."""

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            g, t = q.shape[:2]
            pos = (starts[:, None] + torch.arange(t, device=starts.device)).clamp_(max=self.max_len - 1)  # [G, T]
            self.k[layer][slots[:, None], :, pos] = k  # [G, T, kv_heads, hd] into (slot, position) pairs
            self.v[layer][slots[:, None], :, pos] = v
            n = int(pos.max()) + 1 if kv_len is None else kv_len
            visible = torch.arange(n, device=pos.device)[None, None, :] <= pos[:, :, None]  # [G, T, n]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), self.k[layer, slots, :, :n],
                                                 self.v[layer, slots, :, :n], attn_mask=visible[:, None],
                                                 enable_gqa=True)
            return out.transpose(1, 2).reshape(g, t, -1)

        return attend

    def release(self, slots: list[int]) -> None:
        """Nothing to free: every slot keeps its ``max_len`` positions (samplers/paged_kv.py frees blocks)."""

    def plan_decode(self, positions: np.ndarray) -> None:
        """Nothing to plan: a decode step reads ``[:B, :, :kv_len]`` (samplers/paged_kv.py lays out blocks)."""

    def save(self, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """A copy of slot ``slot``'s K/V at positions ``< length``: ``[layers, kv_heads, length, hd]`` each."""
        return self.k[:, slot, :, :length].clone(), self.v[:, slot, :, :length].clone()

    def restore(self, slot: int, kv: tuple[Tensor, Tensor]) -> None:
        """Put a saved K/V back, into slot ``slot`` (positions from 0)."""
        n = kv[0].shape[2]
        self.k[:, slot, :, :n] = kv[0]
        self.v[:, slot, :, :n] = kv[1]

    def decode(self, positions: Tensor, kv_len: int) -> Attend:
        """Attention of one new token per slot ``0..B-1``, written at ``positions[b]``; slot b attends to its
        positions ``0..positions[b]`` (``kv_len`` > every position, <= ``max_len``: the part of the cache read). No
        device->host read: a CUDA graph can capture it (samplers/cuda_graphs.py)."""
        b = positions.shape[0]
        _, _, n_kv, max_len, hd = self.k.shape
        if kv_len > max_len:  # else a shape error in the first layer's matmul, which names neither
            raise ValueError(f"a decode step attending to {kv_len} positions, but the KV cache holds {max_len} a "
                             "slot (TorchEngine._ensure_cache sizes it)")
        slot_heads = torch.arange(b * n_kv, device=positions.device)  # (slot, kv head) pairs in [B, kv] order
        flat = slot_heads * max_len + positions[:, None].expand(b, n_kv).reshape(-1)  # row in k[layer].view(-1, hd)
        visible = torch.arange(kv_len, device=positions.device) <= positions[:, None]
        mask = torch.zeros(visible.shape, dtype=self.k.dtype, device=positions.device).masked_fill_(~visible, -torch.inf)
        mask = mask[:, None, None, :]  # additive, [B, 1, 1, kv_len]

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            self.k[layer].view(-1, hd).index_copy_(0, flat, k.reshape(-1, hd))
            self.v[layer].view(-1, hd).index_copy_(0, flat, v.reshape(-1, hd))
            # two batched matmuls with the heads of a kv group as query rows (q head h reads kv head
            # h // group, as transformers' repeat_kv): one new token per slot is too little work for the
            # CPU flash kernel, which took ~2x as long here (~280 vs ~150 us a layer at 64 slots)
            q = q.reshape(b, n_kv, -1, hd) * hd**-0.5
            scores = torch.matmul(q, self.k[layer, :b, :, :kv_len].transpose(-1, -2)).add_(mask)
            out = torch.matmul(torch.softmax(scores, dim=-1), self.v[layer, :b, :, :kv_len])
            return out.reshape(b, 1, -1)

        return attend

    def move(self, dst: Tensor, src: Tensor, kv_len: int, host: tuple[np.ndarray, ...] | None = None) -> None:
        """Copy slots ``src`` into slots ``dst`` (positions ``< kv_len``): compacts the running slots (``host``: the
        same indices on the host, which a paged cache reads)."""
        self.k[:, dst, :, :kv_len] = self.k[:, src, :, :kv_len]
        self.v[:, dst, :, :kv_len] = self.v[:, src, :, :kv_len]

"""The torch engine's paged KV cache: K and V in fixed-size blocks of one shared pool, each decode slot holding
only the blocks its own tokens fill (vLLM's PagedAttention, Kwon et al. 2023), with ``KVCache``'s interface.

    cache = PagedKVCache(model.args, slots=64, max_len=32768, blocks=4097, block_size=16)
    cache.grow(slot, tokens)           # False: too few free blocks (the engine makes the row wait, or preempts)
    model(prompts, positions, cache.prefill(slots, src), last=lengths - 1)
    cache.plan_decode(host_positions)  # which blocks the next decode step reads (host bookkeeping, no read)
    model.decode(tokens, pos, cache)
    cache.release(slot)                # its blocks back to the free list

Why: the static ``KVCache`` reserves ``max_len`` positions for every slot, so one 16K-token row among short ones
makes every slot cost 16K positions. Here the memory is ``blocks x block_size`` tokens in all, shared: rows of
very different lengths take what they fill, rounded up to a block.

Layout: ``k``, ``v`` ``[layers, blocks, kv_heads, block_size, head_dim]``, head-major inside a block, so a decode
step gathers whole blocks (``index_select``) and multiplies them as they lie, each head's ``[block_size, hd]`` one
matrix (token-major blocks needed a permuted copy per layer: ~1.3x the step's time on CPU); a token's K is then
``kv_heads`` rows of ``k[layer].view(-1, head_dim)``, written by one ``index_copy_``. Block 0
is scratch and never handed out: a slot's block table holds 0 past its own blocks, so the writes a right-padded
prefill makes past a row's blocks land there, and nothing unmasked ever reads it. ``table [slots, max_len /
block_size]`` (long, on the device) maps a slot's i-th block to its pool block; the host keeps the same lists
(``owned``) and the free list, so allocating never reads the device.

Decode attention (``decode``) runs over the blocks in flight only: the blocks of slots 0..B-1 that hold a token at
or before the slot's position, gathered as ``[NB, block_size, kv_heads, hd]`` (NB = the tokens in flight / block
size, plus at most one partly filled block per slot). Each block's scores against its slot's query heads are one
batched matmul ``[NB, kv_heads, group, hd] x [NB, kv_heads, hd, block_size]``, masked past the slot's position;
the softmax across a slot's blocks is a segment softmax (each block's max and exp-sum, reduced per slot by
``scatter_reduce_``/``index_add_``, the flash-decoding split). Gathering every slot padded to the longest row
(``[B, longest, ...]``) would cost what the static cache costs; gathering single tokens (a segment softmax per
token) would gather the query heads once per token instead of once per block and lose the matmul. No device->host
read inside: the host knows every slot's position and lays out the blocks in flight before the step
(``plan_decode``). Its shapes follow the blocks in flight, so the engine does not capture CUDA graphs of it
(samplers/torch_engine.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .kv_cache import Attend

if TYPE_CHECKING:
    from .torch_model import ModelArgs

SCRATCH = 0  # the pool block that takes writes past a slot's own blocks; never allocated


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device``: pinned and asynchronous on CUDA (a pageable copy would make the host wait for
    the queued steps, as the engine's own ``_to_device`` avoids)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class PagedKVCache(nn.Module):
    """K and V in ``blocks`` blocks of ``block_size`` tokens shared by ``slots`` decode slots of up to
    ``max_len`` tokens each; ``KVCache``'s passes plus the allocator (``grow``, ``release``, ``free_blocks``)."""

    def __init__(self, args: ModelArgs, slots: int, max_len: int, dtype=torch.float32, device="cpu", *,
                 blocks: int, block_size: int = 16) -> None:
        super().__init__()
        if blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks (one is scratch), got {blocks}")
        shape = (args.n_layers, blocks, args.n_kv_heads, block_size, args.head_dim)
        self.k = nn.Buffer(torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.v = nn.Buffer(torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.slots, self.max_len, self.block_size, self.blocks = slots, max_len, block_size, blocks
        width = -(-max_len // block_size)
        self.table = nn.Buffer(torch.full((slots, width), SCRATCH, dtype=torch.long, device=device),
                               persistent=False)
        self.owned: list[list[int]] = [[] for _ in range(slots)]  # the host's copy of each slot's table
        self.free = list(range(blocks - 1, SCRATCH, -1))  # pop() hands out the lowest ids first
        self.plan: tuple[int, Tensor, Tensor, Tensor] | None = None  # plan_decode's: slots, blocks in flight

    # --- the allocator (host bookkeeping; the device table follows with a small host->device copy) ---

    @property
    def free_blocks(self) -> int:
        return len(self.free)

    @property
    def used_blocks(self) -> int:
        return self.blocks - 1 - len(self.free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def missing(self, slot: int, tokens: int) -> int:
        """Blocks slot ``slot`` lacks to hold ``tokens`` tokens."""
        return max(0, self.blocks_for(tokens) - len(self.owned[slot]))

    def grow(self, slot: int, tokens: int, strict: bool = False) -> bool:
        """Give slot ``slot`` blocks for its first ``tokens`` positions; False (and nothing taken) when too few
        are free, or with ``strict`` an error (the caller counted them)."""
        need = self.missing(slot, tokens)
        if need > len(self.free):
            if strict:
                raise RuntimeError(f"slot {slot} needs {need} KV blocks for {tokens} tokens, {len(self.free)} free")
            return False
        if need:
            new = [self.free.pop() for _ in range(need)]
            have = len(self.owned[slot])
            self.owned[slot] += new
            self.table[slot, have: have + need] = to_device(torch.tensor(new, dtype=torch.long), self.table.device)
        return True

    def release(self, slots: list[int]) -> None:
        """The slots' blocks back to the free list (their K/V is gone)."""
        for slot in slots:
            if self.owned[slot]:
                self.free += reversed(self.owned[slot])
                self.table[slot, : len(self.owned[slot])] = SCRATCH
                self.owned[slot] = []

    def make_room(self, positions: np.ndarray, age: np.ndarray) -> list[int]:
        """Give slots ``0..B-1`` the block for their next token (at host ``positions``), oldest first (``age``:
        admission order); when none is free, release the newest slots' blocks. The released slots, newest first
        (the engine preempts their rows)."""
        lacking = [b for b in range(len(positions)) if self.missing(b, int(positions[b]) + 1)]
        if len(lacking) <= len(self.free):  # the usual case: no row waits
            for b in lacking:
                self.grow(b, int(positions[b]) + 1, strict=True)
            return []
        order, victims = np.argsort(age, kind="stable").tolist(), []
        newest = len(order)  # order[newest:] are released
        for i, b in enumerate(order):
            if i >= newest:
                break
            while not self.grow(b, int(positions[b]) + 1):
                newest -= 1
                victims.append(order[newest])
                self.release([order[newest]])
                if newest == i:  # it was the newest itself
                    break
        return victims

    def move(self, dst: Tensor, src: Tensor, kv_len: int, host: tuple[np.ndarray, np.ndarray]) -> None:
        """Slots ``src`` take the places of slots ``dst`` (released before: the done rows' holes; ``host``: the
        same indices on the host): their block tables move, their K/V stays where it is (compaction copies no
        K/V)."""
        for d, s in zip(*(x.tolist() for x in host)):
            if self.owned[d]:
                raise RuntimeError(f"slot {d} still holds KV blocks")
            self.owned[d], self.owned[s] = self.owned[s], []
        self.table[dst] = self.table[src]
        self.table[src] = SCRATCH

    # --- the passes ---

    def _rows(self, slots: Tensor, pos: Tensor) -> Tensor:
        """Rows ``[S, T, kv_heads]`` of a layer's flat pool ``[blocks * kv_heads * block_size, hd]`` that hold the
        heads of positions ``pos [S, T]`` of slots ``slots [S]``."""
        bs, n_kv = self.block_size, self.k.shape[2]
        first = self.table[slots[:, None], pos // bs] * (n_kv * bs) + pos % bs  # head 0's row
        return first[..., None] + torch.arange(n_kv, device=pos.device) * bs

    def _flat(self, pool: Tensor, layer: int) -> Tensor:
        return pool[layer].view(-1, pool.shape[-1])  # [blocks * kv_heads * block_size, hd]

    def prefill(self, slots: Tensor, src: Tensor) -> Attend:
        """Attention of right-padded prompts ``[G, T]`` (causal within each prompt); prompt ``src[j]``'s K/V goes
        into slot ``slots[j]``'s blocks (which must hold its length: ``grow``). Padding past a slot's blocks lands
        in the scratch block."""

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            g, t = q.shape[:2]
            rows = self._rows(slots, torch.arange(t, device=q.device).expand(len(slots), t)).reshape(-1)
            self._flat(self.k, layer).index_copy_(0, rows, k[src].reshape(-1, k.shape[-1]))
            self._flat(self.v, layer).index_copy_(0, rows, v[src].reshape(-1, v.shape[-1]))
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True)
            return out.transpose(1, 2).reshape(g, t, -1)

        return attend

    def extend(self, slots: Tensor, starts: Tensor, kv_len: int | None = None) -> Attend:
        """Attention of right-padded continuations ``[G, T]`` of slots that hold ``starts[g]`` tokens (a restored
        multi-turn row): written at ``starts[g] + t``, each attending to its slot's positions up to its own. The
        continuations' slots are gathered padded to the longest (``kv_len``), as a prefill pads its prompts."""

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            g, t = q.shape[:2]
            pos = (starts[:, None] + torch.arange(t, device=starts.device)).clamp_(max=self.max_len - 1)  # [G, T]
            write = self._rows(slots, pos).reshape(-1)
            self._flat(self.k, layer).index_copy_(0, write, k.reshape(-1, k.shape[-1]))
            self._flat(self.v, layer).index_copy_(0, write, v.reshape(-1, v.shape[-1]))
            n = int(pos.max()) + 1 if kv_len is None else kv_len
            read = self._rows(slots, torch.arange(n, device=q.device).expand(g, n))  # [G, n, kv_heads]
            keys = self._flat(self.k, layer)[read].transpose(1, 2)  # [G, kv_heads, n, hd]
            values = self._flat(self.v, layer)[read].transpose(1, 2)
            visible = torch.arange(n, device=pos.device)[None, None, :] <= pos[:, :, None]  # [G, T, n]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=visible[:, None],
                                                 enable_gqa=True)
            return out.transpose(1, 2).reshape(g, t, -1)

        return attend

    def save(self, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """A copy of slot ``slot``'s K/V at positions ``< length``: ``[layers, length, kv_heads, hd]`` each (kept
        outside the pool, as the static cache keeps it outside its slots)."""
        rows = self._rows(to_device(torch.tensor([slot]), self.table.device),
                          torch.arange(length, device=self.table.device)[None])[0]  # [length, kv_heads]
        flat = self.k.view(self.k.shape[0], -1, self.k.shape[-1])
        return flat[:, rows], self.v.view(flat.shape)[:, rows]  # advanced indexing: copies

    def restore(self, slot: int, kv: tuple[Tensor, Tensor]) -> None:
        """Put a saved K/V back into slot ``slot`` (positions from 0; the slot must hold them: ``grow``)."""
        n = kv[0].shape[1]
        rows = self._rows(to_device(torch.tensor([slot]), self.table.device),
                          torch.arange(n, device=self.table.device)[None])[0]
        self.k.view(self.k.shape[0], -1, self.k.shape[-1])[:, rows] = kv[0]
        self.v.view(self.v.shape[0], -1, self.v.shape[-1])[:, rows] = kv[1]

    def plan_decode(self, positions: np.ndarray) -> None:
        """Lay out the next decode step's blocks in flight for slots ``0..len(positions)-1`` at host
        ``positions`` (each slot's block for its position must exist: ``grow``): which pool block, whose slot,
        which of its positions are visible. A host->device copy, no read."""
        used = positions // self.block_size + 1  # blocks each slot reads, its new token's included
        blocks = np.concatenate([self.owned[b][:u] for b, u in enumerate(used.tolist())]).astype(np.int64)
        slot = np.repeat(np.arange(len(positions)), used)
        first = (np.arange(len(blocks)) - np.repeat(np.cumsum(used) - used, used)) * self.block_size
        visible = first[:, None] + np.arange(self.block_size) <= positions[slot][:, None]  # [NB, block_size]
        dev = self.table.device
        mask = torch.zeros(visible.shape, dtype=self.k.dtype).masked_fill_(~torch.from_numpy(visible), -torch.inf)
        self.plan = (len(positions), to_device(torch.from_numpy(blocks), dev), to_device(torch.from_numpy(slot), dev),
                     to_device(mask, dev))

    def decode(self, positions: Tensor, kv_len: int) -> Attend:
        """Attention of one new token per slot ``0..B-1`` at ``positions[b]`` over the blocks ``plan_decode``
        laid out (``kv_len`` is the static cache's; unused)."""
        b = positions.shape[0]
        if self.plan is None or self.plan[0] != b:
            raise RuntimeError(f"plan_decode for {b} slots must come before their decode step")
        _, blocks, owner, mask = self.plan
        write = self._rows(torch.arange(b, device=positions.device), positions[:, None]).reshape(-1)  # [B * kv]
        mask = mask[:, None, None, :]  # additive, [NB, 1, 1, block_size]
        owner_3d = owner[:, None, None]

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            n_kv, hd = k.shape[2:]
            self._flat(self.k, layer).index_copy_(0, write, k.reshape(-1, hd))
            self._flat(self.v, layer).index_copy_(0, write, v.reshape(-1, hd))
            keys = self.k[layer].index_select(0, blocks)  # [NB, kv_heads, block_size, hd]
            values = self.v[layer].index_select(0, blocks)
            q = (q.reshape(b, n_kv, -1, hd) * hd**-0.5).index_select(0, owner)  # [NB, kv_heads, group, hd]
            scores = torch.matmul(q, keys.transpose(-1, -2)).add_(mask).float()  # [NB, kv_heads, group, block_size]
            top = scores.amax(-1)  # every block holds its slot's position 0 or an earlier one: finite
            peak = top.new_full((b, *top.shape[1:]), -torch.inf).scatter_reduce_(0, owner_3d.expand_as(top), top, "amax")
            e = torch.exp(scores - peak.index_select(0, owner)[..., None])
            total = top.new_zeros(peak.shape).index_add_(0, owner, e.sum(-1))
            out = torch.matmul(e.to(values.dtype), values).float()  # [NB, kv_heads, group, hd]
            out = top.new_zeros((b, *out.shape[1:])).index_add_(0, owner, out) / total[..., None]
            return out.to(q.dtype).reshape(b, 1, -1)

        return attend

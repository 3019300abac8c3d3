"""The torch engine's Mamba-2 state cache, and the hybrid cache of a model with Mamba-2 and attention layers
(samplers/nemotron_h_model.py): per Mamba layer and decode slot the conv window and the SSM state, allocated once,
sized and freed like the KV cache, with the KV cache's operations.

    cache = HybridCache(KVCache(KVShape(attention_layers, kv_heads, head_dim), slots, max_len),
                        StateCache(mamba_layers, slots, conv_dim, kernel, heads, head_dim, state))
    model(prompts, positions, cache.prefill(slots, src), last=lengths - 1)     # right-padded prompts
    model(suffixes, positions, cache.extend(slots, starts), last=lengths - 1)  # after a kept state (multi-turn)
    model.decode(tokens, pos, cache)                                           # one token per running slot

A Mamba-2 layer's state after t tokens is O(1) in t: the last ``kernel - 1`` inputs of its causal depthwise conv
(``[conv_dim, kernel - 1]``, the model's dtype) and the SSM state ``h [heads, head_dim, state]`` (fp32, as HF's
``mamba_ssm_cache_dtype``). A pass's ``ssm(layer, mixer, xbc, dt, lengths)`` takes the mixer's in_proj outputs
(``xbc [B, T, conv_dim]`` before the conv, ``dt [B, T, heads]`` before softplus) and returns the SSM's output
``y [B, T, heads * head_dim]`` (fp32, D skip included, before the gated norm), updating the slots' states:

- prefill and extend: the conv over the window (zeros for a prompt, the slot's for a continuation) and the chunked
  scan (``chunk_scan``, the state-space dual form of Mamba-2) from the initial state (zeros, or the slot's). Right
  padding must not reach the final state: past a row's length its ``dt`` is 0, so the SSM state is carried through
  unchanged (``exp(0 · A) = 1``, ``0 · x = 0``), and its conv window is gathered at its true end.
- decode: the one-step recurrence, ``h = exp(dt·A) h + dt · x Bᵀ``, ``y = h C + D x``, in place on slots 0..B-1
  (no device->host read: a CUDA graph can capture it).

The math is that of transformers 5.19's torch path (models/nemotron_h/modeling_nemotron_h.py: ``causal_conv1d_fn``,
``mamba2_chunk_scan``, ``mamba2_selective_state_update``; Dao & Gu 2024, "Transformers are SSMs", listing 1),
with one difference: HF clamps ``dt`` to ``time_step_min`` in the chunked scan but not in its one-step update;
here both clamp (``dt_min``), so a decoded token's state equals the one the trainer's forward (the chunked scan)
computes for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .kv_cache import Attend, KVCache
from .paged_kv import PagedKVCache


class MambaParams(Protocol):
    """What a pass reads of a Mamba-2 mixer (samplers/nemotron_h_model.py ``Mamba2``)."""

    conv1d: torch.nn.Conv1d  # depthwise, weight [conv_dim, 1, kernel]
    dt_bias: Tensor  # [heads]
    A_log: Tensor  # [heads]: A = -exp(A_log)
    D: Tensor  # [heads]
    inner: int  # heads * head_dim: x's width in xbc (then B, then C: groups * state each)
    heads: int
    head_dim: int
    groups: int
    state_size: int
    chunk_size: int
    dt_min: float  # dt's floor (HF: the mixer's time_step_limit, (time_step_min, inf))


# ssm(layer, mixer, xbc [B, T, conv_dim], dt [B, T, heads], lengths [B] or None) -> y [B, T, heads * head_dim]
Scan = Callable[[int, MambaParams, Tensor, Tensor, Tensor | None], Tensor]


class Pass(NamedTuple):
    """One forward pass's cache operations: attention layers call ``attend``, Mamba layers ``ssm``."""

    attend: Attend
    ssm: Scan


class KVShape(NamedTuple):
    """What ``KVCache`` reads of a model's args: here the attention layers alone, indexed compactly."""

    n_layers: int
    n_kv_heads: int
    head_dim: int


# --- the math ----------------------------------------------------------------------------------------------------


def causal_conv(xbc: Tensor, window: Tensor, m: MambaParams) -> tuple[Tensor, Tensor]:
    """silu(depthwise causal conv) of ``xbc [B, T, C]`` after ``window [B, C, kernel - 1]`` (the inputs before it):
    ``[B, T, C]``, and the conv's whole input ``[B, C, kernel - 1 + T]`` (the next window is cut from it)."""
    full = torch.cat([window.to(xbc.dtype), xbc.transpose(1, 2)], dim=-1)
    out = F.conv1d(full, m.conv1d.weight, m.conv1d.bias, groups=full.shape[1])  # [B, C, T]: no padding needed
    return F.silu(out).transpose(1, 2), full


def conv_step(full: Tensor, m: MambaParams) -> Tensor:
    """silu of the conv's one output of ``full [B, C, kernel]`` (the window, then the new input): ``[B, C]``. A
    multiply and a sum: F.conv1d on so short an input took ~20x as long on CPU (mkldnn's set-up per call)."""
    out = (full * m.conv1d.weight[:, 0]).sum(-1)
    return F.silu(out if m.conv1d.bias is None else out + m.conv1d.bias)


def end_window(full: Tensor, lengths: Tensor | None, kernel_1: int) -> Tensor:
    """The conv window at each row's true end: ``full``'s columns ``[L, L + kernel - 1)`` (L: the row's length)."""
    if lengths is None:
        return full[:, :, full.shape[2] - kernel_1:]
    idx = lengths[:, None] + torch.arange(kernel_1, device=full.device)  # [B, kernel - 1]
    return full.gather(2, idx[:, None, :].expand(full.shape[0], full.shape[1], kernel_1))


def ssm_inputs(xbc: Tensor, dt: Tensor, m: MambaParams, valid: Tensor | None
               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x ``[..., heads, head_dim]``, B and C ``[..., groups, state]`` (fp32), dt ``[..., heads]`` (softplus of
    dt + dt_bias, floored at ``dt_min``, 0 where not ``valid``) and A ``[heads]`` of the conv's output ``xbc``."""
    gn = m.groups * m.state_size
    x, b, c = xbc.float().split([m.inner, gn, gn], dim=-1)
    lead = x.shape[:-1]
    dt = F.softplus(dt.float() + m.dt_bias.float()).clamp(min=m.dt_min)
    if valid is not None:  # right padding: the state passes through unchanged
        dt = dt * valid[..., None]
    return (x.view(*lead, m.heads, m.head_dim), b.view(*lead, m.groups, m.state_size),
            c.view(*lead, m.groups, m.state_size), dt, -torch.exp(m.A_log.float()))


def segment_sum(a: Tensor) -> Tensor:
    """``out[..., i, j] = a[..., j+1] + ... + a[..., i]`` for j <= i (0 on the diagonal), -inf above it: the log
    of the decay from position j to position i. By a masked cumulative sum, stabler than differences of cumsums."""
    n = a.shape[-1]
    a = a[..., None].expand(*a.shape, n)  # [..., i, j] = a[i]
    a = a.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=-1), 0)
    out = a.cumsum(dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device)), -torch.inf)


def chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk: int, initial: Tensor | None = None
               ) -> tuple[Tensor, Tensor]:
    """The SSM over a sequence in chunks of ``chunk`` positions: ``y [b, t, h, p]`` and the final state
    ``[b, h, p, n]``, all fp32. ``x [b, t, h, p]``, ``dt [b, t, h]``, ``A [h]``, ``B``/``C [b, t, g, n]`` (a group
    serves h/g heads), ``initial [b, h, p, n]`` (zeros if None). Within a chunk the output is a masked
    "attention" of C against B weighted by the decay between positions; across chunks a recurrence over the
    chunks' end states (HF's ``mamba2_chunk_scan``; Dao & Gu 2024, listing 1). Letters: b batch, c chunk, l and
    s positions in a chunk, h head, p head dim, n state."""
    b, t, h, p = x.shape
    B = B.repeat_interleave(h // B.shape[2], dim=2)
    C = C.repeat_interleave(h // C.shape[2], dim=2)
    pad = (-t) % chunk

    def chunked(z: Tensor) -> Tensor:  # [b, t, ...] -> [b, c, l, ...]; padding: dt = 0, x = 0, so no effect
        z = F.pad(z, (0, 0) * (z.dim() - 2) + (0, pad))
        return z.view(b, -1, chunk, *z.shape[2:])

    xdt = chunked(x * dt[..., None])  # the discretised input dt·x
    a = chunked(dt * A).permute(0, 3, 1, 2)  # [b, h, c, l]: log of each step's decay
    B, C = chunked(B), chunked(C)
    a_cum = a.cumsum(dim=-1)
    # 1. within each chunk (the diagonal blocks)
    decay = torch.exp(segment_sum(a))  # [b, h, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * decay.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, xdt)
    # 2. each chunk's contribution to the state at its end
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [b, h, c, l]
    states = torch.einsum("bclhn,bclhp->bchpn", B * to_end.permute(0, 2, 3, 1)[..., None], xdt)
    # 3. the states at the chunks' starts, from the initial state and every earlier chunk's
    start = torch.zeros_like(states[:, :1]) if initial is None else initial[:, None].to(states.dtype)
    states = torch.cat([start, states], dim=1)  # [b, c + 1, h, p, n]
    across = torch.exp(segment_sum(F.pad(a_cum[..., -1], (1, 0))))  # [b, h, c + 1, c + 1]
    states = torch.einsum("bhzc,bchpn->bzhpn", across, states)
    states, final = states[:, :-1], states[:, -1]
    # 4. each position's output from its chunk's start state
    y_off = torch.einsum("bclhn,bchpn->bclhp", C, states) * torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(b, -1, h, p)[:, :t]
    return y, final


# --- the cache ---------------------------------------------------------------------------------------------------


class StateCache(torch.nn.Module):
    """Conv windows ``[layers, slots, conv_dim, kernel - 1]`` (``dtype``) and SSM states ``[layers, slots, heads,
    head_dim, state]`` (fp32) of every Mamba layer and decode slot, allocated once."""

    def __init__(self, layers: int, slots: int, conv_dim: int, kernel: int, heads: int, head_dim: int, state: int,
                 dtype=torch.float32, device="cpu") -> None:
        super().__init__()
        self.conv = torch.nn.Buffer(torch.zeros(layers, slots, conv_dim, kernel - 1, dtype=dtype, device=device),
                                    persistent=False)
        self.ssm = torch.nn.Buffer(torch.zeros(layers, slots, heads, head_dim, state, device=device), persistent=False)
        self.slots = slots

    def _scan(self, layer: int, m: MambaParams, xbc: Tensor, dt: Tensor, lengths: Tensor | None, window: Tensor,
              initial: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """(y [B, T, heads * head_dim], the end windows, the final states) of right-padded rows from
        ``window`` and ``initial``."""
        b, t, _ = xbc.shape
        conv, full = causal_conv(xbc, window, m)
        valid = None if lengths is None else torch.arange(t, device=xbc.device) < lengths[:, None]
        x, B, C, dt, A = ssm_inputs(conv, dt, m, valid)
        y, final = chunk_scan(x, dt, A, B, C, m.chunk_size, initial)
        y = y + x * m.D.float()[:, None]
        return y.reshape(b, t, -1), end_window(full, lengths, self.conv.shape[-1]), final

    def prefill(self, slots: Tensor, src: Tensor) -> Scan:
        """The SSM of right-padded prompts ``[G, T]`` from a zero state; the state at row ``i``'s end goes into slot
        ``slots[j]`` for every ``j`` with ``src[j] == i`` (a group's n samples share one prefill)."""

        def ssm(layer: int, m: MambaParams, xbc: Tensor, dt: Tensor, lengths: Tensor | None) -> Tensor:
            window = xbc.new_zeros(xbc.shape[0], xbc.shape[2], self.conv.shape[-1])
            y, end, final = self._scan(layer, m, xbc, dt, lengths, window, None)
            self.conv[layer, slots] = end[src].to(self.conv.dtype)
            self.ssm[layer, slots] = final[src]
            return y

        return ssm

    def extend(self, slots: Tensor) -> Scan:
        """The SSM of right-padded continuations ``[G, T]``, row g from slot ``slots[g]``'s state (a multi-turn
        row's earlier turns, restored with ``restore``); the state at each row's end goes back into its slot."""

        def ssm(layer: int, m: MambaParams, xbc: Tensor, dt: Tensor, lengths: Tensor | None) -> Tensor:
            y, end, final = self._scan(layer, m, xbc, dt, lengths, self.conv[layer, slots], self.ssm[layer, slots])
            self.conv[layer, slots] = end.to(self.conv.dtype)
            self.ssm[layer, slots] = final
            return y

        return ssm

    def decode(self, rows: int) -> Scan:
        """One new token per slot ``0..rows-1``: the one-step recurrence, the slots' states updated in place."""

        def ssm(layer: int, m: MambaParams, xbc: Tensor, dt: Tensor, lengths: Tensor | None) -> Tensor:
            window, h = self.conv[layer, :rows], self.ssm[layer, :rows]  # views: updated in place
            full = torch.cat([window, xbc.transpose(1, 2).to(window.dtype)], dim=-1)  # [B, C, kernel]
            window.copy_(full[:, :, 1:])
            x, B, C, dt, A = ssm_inputs(conv_step(full, m), dt[:, 0], m, None)  # x [B, h, p], B/C [B, g, n], dt [B, h]
            B = B.repeat_interleave(m.heads // m.groups, dim=1)  # [B, h, n]
            C = C.repeat_interleave(m.heads // m.groups, dim=1)
            h.mul_(torch.exp(dt * A)[..., None, None]).add_((dt[..., None] * x)[..., None] * B[:, :, None, :])
            y = torch.einsum("bhpn,bhn->bhp", h, C) + x * m.D.float()[:, None]
            return y.reshape(rows, 1, -1)

        return ssm

    def save(self, slot: int) -> tuple[Tensor, Tensor]:
        """A copy of slot ``slot``'s state: conv windows and SSM states of every layer."""
        return self.conv[:, slot].clone(), self.ssm[:, slot].clone()

    def restore(self, slot: int, saved: tuple[Tensor, Tensor]) -> None:
        self.conv[:, slot] = saved[0]
        self.ssm[:, slot] = saved[1]

    def move(self, dst: Tensor, src: Tensor) -> None:
        """Copy slots ``src`` into slots ``dst``: compacts the running slots."""
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]


class HybridCache:
    """K/V of the attention layers (a ``KVCache`` over them alone) and the state of the Mamba layers (a
    ``StateCache``), with ``KVCache``'s interface: each pass returns a ``Pass`` of both."""

    def __init__(self, kv: KVCache | PagedKVCache, state: StateCache) -> None:
        self.kv, self.state = kv, state
        self.slots, self.max_len = kv.slots, kv.max_len

    def prefill(self, slots: Tensor, src: Tensor) -> Pass:
        return Pass(self.kv.prefill(slots, src), self.state.prefill(slots, src))

    def extend(self, slots: Tensor, starts: Tensor, kv_len: int | None = None) -> Pass:
        return Pass(self.kv.extend(slots, starts, kv_len), self.state.extend(slots))

    def decode(self, positions: Tensor, kv_len: int) -> Pass:
        return Pass(self.kv.decode(positions, kv_len), self.state.decode(positions.shape[0]))

    def save(self, slot: int, length: int) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """Slot ``slot``'s K/V at positions ``< length`` and its Mamba state (at the same point: after ``length``
        tokens)."""
        return self.kv.save(slot, length), self.state.save(slot)

    def restore(self, slot: int, saved: tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]) -> None:
        self.kv.restore(slot, saved[0])
        self.state.restore(slot, saved[1])

    def move(self, dst: Tensor, src: Tensor, kv_len: int, host: tuple[np.ndarray, ...] | None = None) -> None:
        self.kv.move(dst, src, kv_len, host)
        self.state.move(dst, src)

    # the K/V part's allocator, paged or not (samplers/paged_kv.py); the Mamba state is O(1) a slot, one per slot

    def release(self, slots: list[int]) -> None:
        self.kv.release(slots)

    def plan_decode(self, positions: np.ndarray) -> None:
        self.kv.plan_decode(positions)

    def grow(self, slot: int, tokens: int, strict: bool = False) -> bool:
        return self.kv.grow(slot, tokens, strict)

    def make_room(self, positions: np.ndarray, age: np.ndarray) -> list[int]:
        return self.kv.make_room(positions, age)

    def blocks_for(self, tokens: int) -> int:
        return self.kv.blocks_for(tokens)

    @property
    def free_blocks(self) -> int:
        return self.kv.free_blocks

    @property
    def used_blocks(self) -> int:
        return self.kv.used_blocks

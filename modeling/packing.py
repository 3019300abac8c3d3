"""Pack variable-length rows into one padding-free sequence, and back.

RL rollouts have long-tailed lengths, so a right-padded [N, L] batch spends most of
its attention and MLP work on padding. ``pack`` concatenates each row's real tokens
(row i holds ``lengths[i]`` tokens at the start, right padding after) into [1, T]
sequences with position ids restarting at 0 for every row; ``packed_forward`` runs
an HF causal LM on one such pack so that no token attends across rows; ``unpack``
scatters per-token outputs back to the padded [rows, L, ...] layout.

Convention (flash-attn varlen): within a pack, row k occupies tokens
``cu_seqlens[k] : cu_seqlens[k+1]`` (int32, length rows+1, starting at 0, ending at
T); ``max_seqlen`` is its longest row; ``rows[k]`` is that row's index in the padded
batch. Rows of length 0 are left out of every pack (``unpack`` leaves them zero).

How attention stays block-diagonal (transformers 5.19):
- sdpa / eager / flex_attention: with ``attention_mask=None`` and no cache, ``masking_utils.
  _preprocess_mask_arguments`` calls ``find_packed_sequence_indices(position_ids)``
  (a new row starts wherever the position does not grow by 1) and
  ``create_causal_mask`` ANDs the causal mask with "same row". This is skipped as
  soon as a cache exists, and HF configs default to ``use_cache=True`` (the model
  would build a DynamicCache), so ``packed_forward`` passes ``use_cache=False``.
  Cost: sdpa then gets a materialised [1, 1, T, T] boolean mask (T² bytes), and its
  attention costs T² (not Σ len²): cap packs with ``max_tokens``. sdpa and eager are
  tested; flex_attention was checked by hand (its first call compiles for a minute).
- flash_attention_2/3/4: ``_flash_attention_forward`` takes ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` kwargs and calls ``flash_attn_varlen_func`` with them; passing
  them (rather than letting it infer them from position ids) saves a device sync
  per layer.

Mamba-2 layers (Nemotron-H) see neither mask nor cu_seqlens: ``packed_forward`` (and the trainer's lanes,
modeling/policy.py) pass them ``seq_idx``, each token's row, which modeling/mamba.py's mixer forward honours
(its conv never reads another row, its SSM state restarts at every row).

Run the tests with ``pytest tests/test_packing.py``; the benchmark with
``python bench/packing.py --quick``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import Tensor

from . import mamba
from .logprobs import token_logprobs

# Attention implementations for which transformers builds the block-diagonal mask itself
# from position_ids, and those that take flash-attn varlen kwargs. Anything else (a custom
# kernel outside masking_utils) would silently attend across rows, so it is refused.
MASK_FROM_POSITIONS = frozenset({"sdpa", "eager", "flex_attention"})
VARLEN_KWARGS = frozenset({"flash_attention_2", "flash_attention_3", "flash_attention_4", "varlen"})


@dataclasses.dataclass(frozen=True)
class Packed:
    """Some rows of a right-padded batch, concatenated without padding."""

    input_ids: Tensor  # [1, T] long: the rows' real tokens, back to back
    position_ids: Tensor  # [1, T] long: 0 .. lengths[k]-1 within each row
    cu_seqlens: Tensor  # [rows + 1] int32: row k is tokens cu_seqlens[k]:cu_seqlens[k+1]
    max_seqlen: int  # the longest row in this pack
    rows: Tensor  # [rows] long: each row's index in the padded batch, in pack order
    lengths: Tensor  # [rows] long: each row's token count

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def token_rows(self) -> Tensor:
        """[T] long: for every packed token, its row's index within this pack (0 .. rows-1)."""
        slots = torch.arange(len(self.rows), device=self.lengths.device)
        return slots.repeat_interleave(self.lengths, output_size=self.num_tokens)

    def to(self, device: torch.device | str) -> Packed:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: v.to(device) for k, v in fields.items() if isinstance(v, Tensor)})


def _group_rows(lengths: list[int], max_tokens: int | None) -> list[list[int]]:
    """Rows in batch order, cut into packs of at most max_tokens (a longer row gets its own)."""
    packs, current, size = [], [], 0
    for row, n in enumerate(lengths):
        if n == 0:
            continue
        if current and max_tokens is not None and size + n > max_tokens:
            packs.append(current)
            current, size = [], 0
        current.append(row)
        size += n
    if current:
        packs.append(current)
    return packs


def pack(input_ids: Tensor, lengths: Tensor, max_tokens: int | None = None) -> list[Packed]:
    """Right-padded input_ids [N, L] with lengths [N] -> packs of at most max_tokens tokens.

    Rows keep their batch order (greedy, no bin-packing: groups of a GRPO batch stay
    adjacent). One ``lengths.tolist()``: a device sync if lengths is on an accelerator.
    """
    n_rows, width = input_ids.shape
    lengths_list = [int(n) for n in lengths.tolist()]
    if len(lengths_list) != n_rows:
        raise ValueError(f"{len(lengths_list)} lengths for {n_rows} rows")
    if any(n < 0 or n > width for n in lengths_list):
        raise ValueError(f"lengths must lie in [0, {width}], got {lengths_list}")
    device = input_ids.device
    positions = torch.arange(width, device=device)
    lengths = lengths.to(device=device, dtype=torch.long)
    real = positions[None, :] < lengths[:, None]  # [N, L]
    out = []
    for members in _group_rows(lengths_list, max_tokens):
        rows = torch.tensor(members, device=device)
        keep = real[rows]
        row_lengths = lengths[rows]
        cu = torch.zeros(len(members) + 1, dtype=torch.int32, device=device)
        cu[1:] = row_lengths.cumsum(0)
        out.append(Packed(
            input_ids=input_ids[rows][keep].unsqueeze(0),  # boolean indexing reads row-major
            position_ids=positions.expand(len(members), width)[keep].unsqueeze(0),
            cu_seqlens=cu,
            max_seqlen=max(lengths_list[r] for r in members),
            rows=rows,
            lengths=row_lengths,
        ))
    return out


def unpack(values: Tensor, packed: Packed, length: int) -> Tensor:
    """Per-token values [1, T, ...] -> [rows, length, ...] in pack order, zeros at padding.

    Differentiable (``index_copy``); scatter into the full batch with ``out[packed.rows] = ...``.
    """
    rest = values.shape[2:]
    dest = packed.token_rows() * length + packed.position_ids[0]
    flat = values.new_zeros((len(packed.rows) * length, *rest)).index_copy(0, dest, values[0])
    return flat.view(len(packed.rows), length, *rest)


def pack_values(values: Tensor, packed: Packed) -> Tensor:
    """The inverse of unpack: per-token values of the padded batch [N, L, ...] -> [1, T, ...].

    For moving masks, per-token loss weights or reference log-probs into a pack's layout.
    """
    batch_rows = packed.rows[packed.token_rows()]
    return values[batch_rows, packed.position_ids[0]].unsqueeze(0)


def packed_forward(model, packed: Packed, hidden_states: bool = False) -> Tensor:
    """Logits [1, T, V] (or the last hidden states [1, T, H]) of an HF causal LM on one pack.

    With ``hidden_states=True`` only the base model runs (``model.base_model``, i.e.
    ``model.model`` for Qwen3): apply the LM head yourself, e.g. in chunks.
    """
    impl = model.config._attn_implementation
    kwargs = {}
    if impl in VARLEN_KWARGS:
        cu = packed.cu_seqlens
        kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=packed.max_seqlen,
                      max_length_k=packed.max_seqlen)
    elif impl not in MASK_FROM_POSITIONS:
        raise ValueError(f"packed_forward does not know how {impl!r} keeps packed rows apart; "
                         f"use one of {sorted(MASK_FROM_POSITIONS | VARLEN_KWARGS)}")
    # attention_mask=None and use_cache=False: the two conditions under which transformers
    # derives the per-row causal mask from position_ids (see the module docstring).
    net = model.base_model if hidden_states else model
    out = net(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
              use_cache=False, **kwargs, **mamba.row_kwargs(model, packed.position_ids))
    return out.last_hidden_state if hidden_states else out.logits


def packed_token_logprobs(logits: Tensor, packed: Packed, temperature: float = 1.0) -> Tensor:
    """Per-token log-probs [1, T] of a pack: as ``losses.token_logprobs`` row by row.

    out[p] = log_softmax(logits[p-1] / T)[input_ids[p]] within a row, and 0 at each
    row's first token, which has no prediction (in the packed layout the logit before it
    belongs to the previous row, so it is zeroed rather than left as a cross-row value).
    """
    lp = token_logprobs(logits, packed.input_ids, temperature=temperature)
    starts = packed.cu_seqlens[:-1].long()
    return lp.index_fill(1, starts, 0.0)


@dataclasses.dataclass(frozen=True)
class Lanes:
    """Rows bin-packed into lanes of one width: a [lanes, width] batch in which every lane holds whole rows
    back to back, position ids restarting per row (the free tail of a lane restarts too, as a row of its
    own that nothing reads). Row i's token t sits at ``[lane[i], offset[i] + t]``."""

    input_ids: Tensor  # [lanes, width] long
    position_ids: Tensor  # [lanes, width] long
    lane: Tensor  # [N] long
    offset: Tensor  # [N] long


def pack_lanes(input_ids: Tensor, lengths: Tensor, width: int | None = None, pad_id: int = 0) -> Lanes:
    """Right-padded input_ids [N, L] with lengths [N] -> lanes of ``width`` (default: the longest row),
    first-fit decreasing.

    For attention that needs a mask (SDPA, eager): transformers builds the per-row block mask of a
    [lanes, width] batch from position_ids, so attention per token is at most ``width`` (as for the
    padded batch) while the MLPs run on about the real tokens only; one forward pass for the batch."""
    n, length = input_ids.shape
    sizes = [int(x) for x in lengths.tolist()]
    width = width or max(sizes, default=1)
    if max(sizes, default=0) > width:
        raise ValueError(f"a row of {max(sizes)} tokens does not fit lanes of {width}")
    free: list[int] = []  # room left in each lane
    lane, offset = [0] * n, [0] * n
    for i in sorted(range(n), key=lambda r: -sizes[r]):
        k = next((j for j, room in enumerate(free) if room >= sizes[i]), len(free))
        if k == len(free):
            free.append(width)
        lane[i], offset[i] = k, width - free[k]
        free[k] -= sizes[i]
    device = input_ids.device
    ids = torch.full((max(len(free), 1), width), pad_id, dtype=input_ids.dtype, device=device)
    pos = torch.arange(width, device=device).repeat(ids.shape[0], 1)
    lane_t, offset_t = torch.tensor(lane, device=device), torch.tensor(offset, device=device)
    for i in range(n):
        ids[lane[i], offset[i]: offset[i] + sizes[i]] = input_ids[i, : sizes[i]]
        pos[lane[i], offset[i]: offset[i] + sizes[i]] = torch.arange(sizes[i], device=device)
    for k, room in enumerate(free):  # the free tail: positions from 0 again, a separate "row"
        pos[k, width - room:] = torch.arange(room, device=device)
    return Lanes(ids, pos, lane_t, offset_t)


@dataclasses.dataclass(frozen=True)
class SharedPrefix:
    """A batch whose rows share prompts (a GRPO group: G responses to one prompt), laid out so that each
    distinct prompt runs through the model once.

    Row i is ``prefix + suffix``: its prefix is every token before its first target (the prompt), its suffix
    the rest (the response). Pass 1 runs the U distinct prefixes, right-padded to [U, P]. Pass 2 runs the
    suffixes bin-packed into lanes, each lane holding suffixes of one prefix only, with that prefix's keys and
    values of pass 1 as the past: ``mask`` lets a suffix token see its prefix's real tokens and, causally, its
    own suffix; a lane's free tail sees only itself. Gradients flow through the shared keys and values, so the
    numbers are those of running every row in full, at about (U·P + Σ suffix) tokens instead of Σ rows.
    """

    prefix_ids: Tensor  # [U, P] long, right-padded
    prefix_lens: Tensor  # [U] long
    lane_ids: Tensor  # [lanes, W] long: suffix tokens
    lane_pos: Tensor  # [lanes, W] long: their positions (a row's suffix starts at its prefix length)
    lane_prefix: Tensor  # [lanes] long: the prefix every row of the lane continues
    mask: Tensor  # [lanes, 1, W, P + W] bool: True = attend (past columns first)
    row_prefix: Tensor  # [N] long (rows without targets: 0, never read)
    row_start: Tensor  # [N] long: prefix length of the row = column of its first suffix token
    row_lane: Tensor  # [N] long
    row_offset: Tensor  # [N] long: the row's suffix token t (column row_start + t) is at [row_lane, row_offset + t]


def share_prefixes(input_ids: Tensor, lengths: Tensor, target_mask: Tensor, pad_id: int = 0,
                   row_per_lane: bool = False) -> SharedPrefix | None:
    """The shared-prefix layout of a right-padded batch, or None when no two rows share a prefix (then
    it would only cost a second pass). Rows without targets are left out. ``row_per_lane``: one suffix per lane,
    for a model with recurrent (Mamba) layers: a lane continues its prefix's state, which a second suffix in the
    same lane would not see (it would continue the first suffix's)."""
    n = input_ids.shape[0]
    has = target_mask.any(dim=1)
    start = torch.where(has, target_mask.int().argmax(dim=1), 0)
    sizes, starts, with_targets = lengths.tolist(), start.tolist(), has.tolist()
    keyed: dict[tuple, int] = {}
    row_prefix = [0] * n
    for i in range(n):
        if with_targets[i]:  # only the prefix goes to Python, never the (long) responses
            row_prefix[i] = keyed.setdefault(tuple(input_ids[i, : starts[i]].tolist()), len(keyed))
    if len(keyed) == sum(with_targets):
        return None
    device = input_ids.device
    prefixes = list(keyed)
    width_p = max(len(p) for p in prefixes)
    prefix_ids = torch.full((len(prefixes), width_p), pad_id, dtype=input_ids.dtype)
    for u, p in enumerate(prefixes):
        prefix_ids[u, : len(p)] = torch.tensor(p, dtype=input_ids.dtype)
    prefix_lens = torch.tensor([len(p) for p in prefixes])

    # suffixes first-fit decreasing into lanes as wide as the longest, one prefix per lane
    suffix = [sizes[i] - starts[i] for i in range(n)]
    width = max(suffix[i] for i in range(n) if with_targets[i])
    lanes: list[tuple[int, int]] = []  # (prefix, room left)
    row_lane, row_offset = [0] * n, [0] * n
    for i in sorted((i for i in range(n) if with_targets[i]), key=lambda r: (row_prefix[r], -suffix[r])):
        u = row_prefix[i]
        k = None if row_per_lane else next(
            (j for j in range(len(lanes) - 1, -1, -1) if lanes[j][0] == u and lanes[j][1] >= suffix[i]), None)
        if k is None:
            lanes.append((u, width))
            k = len(lanes) - 1
        row_lane[i], row_offset[i] = k, width - lanes[k][1]
        lanes[k] = (u, lanes[k][1] - suffix[i])
    lane_ids = torch.full((len(lanes), width), pad_id, dtype=input_ids.dtype)
    lane_pos = torch.zeros((len(lanes), width), dtype=torch.long)
    segment = -1 - torch.arange(width).repeat(len(lanes), 1)  # free tail: each position its own segment
    for i in range(n):
        if with_targets[i]:
            k, o, s = row_lane[i], row_offset[i], suffix[i]
            lane_ids[k, o: o + s] = input_ids[i, starts[i]: sizes[i]]
            lane_pos[k, o: o + s] = torch.arange(starts[i], sizes[i])
            segment[k, o: o + s] = i
    lane_prefix = torch.tensor([u for u, _ in lanes])
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    own = (segment[:, :, None] == segment[:, None, :]) & causal  # [lanes, W, W]
    real = segment >= 0
    past = (torch.arange(width_p)[None, None, :] < prefix_lens[lane_prefix][:, None, None]) & real[:, :, None]
    mask = torch.cat([past, own], dim=2)[:, None]
    t = dict(device=device)
    return SharedPrefix(prefix_ids.to(**t), prefix_lens.to(**t), lane_ids.to(**t), lane_pos.to(**t),
                        lane_prefix.to(**t), mask.to(**t), torch.tensor(row_prefix, **t), start,
                        torch.tensor(row_lane, **t), torch.tensor(row_offset, **t))


def shared_prefix_hidden(model, s: SharedPrefix, rows: Tensor, cols: Tensor, around=None) -> Tensor:
    """Last hidden states [M, H] at positions ``cols - 1`` of ``rows`` (the ones predicting tokens
    ``cols``), through the two passes of ``s`` (an HF causal LM's base model, sdpa or eager attention).
    ``around(i)``: a context for pass i (0: the prefixes, 1: the suffix lanes), e.g. routing replay's.

    Mamba layers (modeling/mamba.py; ``s`` built with ``row_per_lane``): pass 1 stores each prefix's conv window
    and SSM state at its last real token, and each lane starts from its prefix's, as a cache continues."""
    from transformers import DynamicCache

    around = around or (lambda i: contextlib.nullcontext())
    base = model.base_model
    positions = torch.arange(s.prefix_ids.shape[1], device=s.prefix_ids.device)[None]
    padding = positions < s.prefix_lens[:, None]
    with around(0):  # seq_idx (Mamba layers): one row each, the states at its end
        out = base(input_ids=s.prefix_ids, attention_mask=padding.long(), use_cache=True,
                   **mamba.row_kwargs(model, positions.expand(padding.shape)))
    past = DynamicCache(config=model.config)
    for layer, cached in enumerate(out.past_key_values.layers):
        if getattr(cached, "conv_states", None) is not None and cached.is_conv_states_initialized[0]:  # Mamba
            past.update_conv_state(cached.conv_states[0].index_select(0, s.lane_prefix), layer,
                                   conv_kernel_size=cached.conv_states[0].shape[-1])
            past.update_recurrent_state(cached.recurrent_states[0].index_select(0, s.lane_prefix), layer)
        if getattr(cached, "keys", None) is not None:  # attention (a MoE or MLP layer caches nothing)
            past.update(cached.keys.index_select(0, s.lane_prefix), cached.values.index_select(0, s.lane_prefix),
                        layer)
    mask = s.mask
    if model.config._attn_implementation == "eager":  # eager adds the mask to the scores
        mask = torch.zeros(mask.shape, dtype=out.last_hidden_state.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(out.last_hidden_state.dtype).min)
    with around(1):
        lanes = base(input_ids=s.lane_ids, position_ids=s.lane_pos, attention_mask=mask, past_key_values=past,
                     use_cache=True).last_hidden_state
    prev, start = cols - 1, s.row_start[rows]
    in_prefix = (prev < start)[:, None]
    from_prefix = out.last_hidden_state[s.row_prefix[rows], prev.clamp(max=s.prefix_ids.shape[1] - 1)]
    from_lane = lanes[s.row_lane[rows], (s.row_offset[rows] + prev - start).clamp(min=0)]
    return torch.where(in_prefix, from_prefix, from_lane)

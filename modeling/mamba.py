"""Mamba-2 layers in the trainer's layouts: a mixer forward that keeps packed rows apart.

    mamba.install(model)                          # NemotronH's Mamba-2 mixers take ``seq_idx``; 0: none in the model
    model.base_model(input_ids=lanes, position_ids=pos, **mamba.row_kwargs(model, pos))   # {"seq_idx": [B, T]}

Why. A lane or a varlen pack (modeling/packing.py) holds several rows back to back. Attention keeps them
apart through position ids (transformers builds a block mask) or cu_seqlens; a Mamba-2 mixer sees neither.
transformers 5.19's ``NemotronHMamba2Mixer.forward`` on its torch path (``causal_conv1d_fn``: one ``F.conv1d``
over the whole sequence; ``mamba2_chunk_scan``: one scan over it) runs the conv window and the SSM state
straight across a row boundary, so a row starts from the previous row's state: wrong log-probs, no error.
The ``seq_idx`` / ``cu_seqlens`` kwargs it forwards reach only the CUDA kernels of ``mamba_ssm`` /
``causal_conv1d`` (``use_kernel_func_from_hub_with_fallback`` picks those when installed, else the torch
function, and keeps only the kwargs the picked function declares: the torch ones drop them). Those packages
are absent here and cannot be installed on the GPU machines we get, so this module gives the torch path the
same ``seq_idx`` semantics.

The mixer (per head; t a token, seg(t) its row within the lane, K the conv width, h_t ∈ R^{P×N} the state):

    xBC'_t = silu(b + Σ_{j<K} w_{K-1-j} ⊙ xBC_{t-j} · [seg(t-j) = seg(t)])        conv never reads another row
    dt_t   = clamp(softplus(dt_t + dt_bias), dt_min),   a_t = A·dt_t  (A = -exp(A_log) < 0)
    h_t    = exp(a_t)·h_{t-1}·[seg(t) = seg(t-1)] + dt_t·x_t B_tᵀ,   y_t = h_t C_t + D·x_t   state reset per row

computed chunk by chunk like transformers' ``mamba2_chunk_scan`` (chunks of Q = ``config.chunk_size``), with
the boundary as a decay of -inf (a factor 0) wherever a sum crosses rows:

    Y_diag[l] = Σ_{s≤l in the chunk, seg s = seg l} exp(Σ_{s<i≤l} a_i) (C_l·B_s) dt_s x_s
    S_c       = Σ_{l in chunk c, seg l = seg(end of c)} exp(Σ_{l<i≤end} a_i) dt_l x_l B_lᵀ          chunk states
    H_c       = Σ_{z≤c, row(z) = row(c)} exp(Σ_{z<j≤c} a_chunk_j) S_z                            state at chunk ends
    Y_off[l]  = exp(Σ_{start<i≤l} a_i) C_l H_{c-1} · [seg l = row(c-1)]                          the state carried in

(row(c): the row of chunk c's last token; the state before the first token is 0), which
is mamba_ssm's ``seq_idx`` contract. A row then gives the numbers it gives alone, whatever shares its lane
(tests/test_nemotron_h_trainer.py, fp32, 1e-5).

Why not through transformers' own switch: ``use_kernel_func_from_hub_with_fallback`` fixes each function when
the modeling file is imported (the ``kernels`` package's hub kernel if ``use_kernels=True``, else ``mamba_ssm`` /
``causal_conv1d`` if importable, else the torch function); another function can only come in through the
``kernels`` package's kernel mapping (a hub or local kernel repository, ``kernelize``), which is not installed
here and would swap it for every model of the process. So this stays scoped to the models a Policy wraps:

Installed by swapping each mixer's class for a subclass whose ``forward`` takes ``seq_idx`` (``MIXERS``: one
entry per mixer family; others may follow): the subclass is still a ``NemotronHMamba2Mixer``, FSDP2's per-layer
wrapping of the blocks is untouched, and without ``seq_idx`` (the padded layout, generation, a cache) it is
transformers' own forward. It also serves the shared-prefix layout's first pass (``seq_idx`` all 0, a fresh cache,
a right padding mask): it stores each row's conv window and SSM state at the row's last real token, where
transformers' own forward stores them after the padding (the state decays through it, the window holds padding).

What it buys (tiny Nemotron-H, 12 long-tailed rows: 1404 tokens, the longest 500; Policy forward + backward on
one CPU thread): padded 1.02 s, lanes 0.27 s, varlen packs 0.26 s. What the row masks cost: one mixer's forward +
backward on 4 x 2048 tokens, transformers' torch path 0.334 s, this one 0.337 s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cascade_rl.protocol.registry import Registry

from . import context_parallel

ATTR = "_cascade_rl_mamba_layers"


def seq_idx_from_positions(position_ids: Tensor) -> Tensor:
    """[B, T] int32: each token's row within its lane (0, 1, ...), a new row wherever the position does not grow
    by 1 (as transformers' ``find_packed_sequence_indices`` reads a pack; a lane's free tail is its own row)."""
    new = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return F.pad(new.int().cumsum(1, dtype=torch.int32), (1, 0))


def segment_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor) -> Tensor:
    """Depthwise causal conv of x [B, T, C] with weight [C, K] that reads only its own row: out_t =
    b + Σ_j w[:, K-1-j] x_{t-j} [seg(t-j) = seg(t)] (F.conv1d with K-1 zeros of left padding, per row)."""
    k, t = weight.shape[-1], x.shape[1]
    xp = F.pad(x.to(weight.dtype), (0, 0, k - 1, 0))
    sp = F.pad(seq_idx, (k - 1, 0), value=-1)
    out = xp[:, k - 1:] * weight[:, k - 1]
    for j in range(1, k):
        same = (sp[:, k - 1 - j: k - 1 - j + t] == seq_idx)[..., None]
        out = out + xp[:, k - 1 - j: k - 1 - j + t] * same * weight[:, k - 1 - j]
    return out if bias is None else out + bias


def _segsum(a: Tensor) -> Tensor:
    """[..., Q] -> [..., Q, Q]: out[l, s] = Σ_{s<i≤l} a_i for s ≤ l, -inf above the diagonal (transformers'
    ``segment_sum``: masked cumsums, no differences of cumsums, so no cancellation)."""
    q = a.shape[-1]
    x = a[..., None].expand(*a.shape, q)
    x = x.masked_fill(~torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), -1), 0)
    out = x.cumsum(-2)
    return out.masked_fill(~torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device)), -torch.inf)


def _chunks(x: Tensor, pad: int, q: int) -> Tensor:
    """[B, T, ...] -> [B, T/Q, Q, ...] after ``pad`` zeros at the end of T."""
    x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.reshape(x.shape[0], -1, q, *x.shape[2:])


def segment_chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk: int, D: Tensor,
                       dt_bias: Tensor, dt_limit: tuple[float, float], seq_idx: Tensor,
                       keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """transformers' ``mamba2_chunk_scan`` with rows: x [B, T, H, P], dt [B, T, H] (before bias and softplus),
    A [H], B/C [B, T, G, N], seq_idx [B, T] non-decreasing along T. Returns y [B, T, H, P] (fp32) and the state
    at the end [B, H, P, N] (that of the last row). ``keep`` [B, T] (bool): tokens that advance the state; the
    others (right padding) leave it as it is (dt = 0), so the state at the end is the last kept token's."""
    b, t, h, p = x.shape
    dt = F.softplus(dt + dt_bias.to(dt.dtype)).clamp(dt_limit[0], dt_limit[1])
    if keep is not None:
        dt = dt * keep[..., None]
    x = x.float()
    B = B.float().repeat_interleave(h // B.shape[2], dim=2, output_size=h)
    C = C.float().repeat_interleave(h // C.shape[2], dim=2, output_size=h)
    pad = (-t) % chunk
    d_residual = D[..., None] * F.pad(x, (0, 0, 0, 0, 0, pad))
    x = x * dt[..., None].float()
    a = A.to(x.dtype) * dt.float()
    seg = torch.cat([seq_idx, seq_idx[:, -1:].expand(b, pad)], dim=1).view(b, -1, chunk)  # padding: the last row
    x, a, B, C = (_chunks(v, pad, chunk) for v in (x, a, B, C))  # [b, c, l, h(, p | n)]
    a = a.permute(0, 3, 1, 2)  # [b, h, c, l]
    a_cum = a.cumsum(-1)
    same = seg[:, :, :, None] == seg[:, :, None, :]  # [b, c, l, s]

    # 1. within each chunk: decay exp(Σ a) between two tokens of one row, 0 across rows
    decay = torch.exp(_segsum(a).masked_fill(~same[:, None], -torch.inf))  # [b, h, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * decay.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, x)

    # 2. each chunk's state at its end, from the tokens of its last row
    last = seg[:, :, -1]  # [b, c]
    to_end = torch.exp(a_cum[..., -1:] - a_cum) * (seg == last[..., None])[:, None]  # [b, h, c, l]
    states = torch.einsum("bclhn,bclhp->bchpn", B * to_end.permute(0, 2, 3, 1)[..., None], x)

    # 3. states across chunks: carried only while the row goes on
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)  # [b, c+1, h, p, n]
    rows = torch.cat([seg[:, :1, 0], last], dim=1)  # [b, c+1]: the row of the initial state and of each chunk end
    across = _segsum(F.pad(a_cum[..., -1], (1, 0))).masked_fill(~(rows[:, :, None] == rows[:, None, :])[:, None],
                                                                -torch.inf)
    carried = torch.einsum("bzch,bzhpn->bchpn", torch.exp(across).transpose(1, 3), states)
    states, final = carried[:, :-1], carried[:, -1]

    # 4. the state carried into each chunk, read by the tokens of its row
    from_start = torch.exp(a_cum) * (seg == rows[:, :-1, None])[:, None]  # [b, h, c, l]
    y_off = torch.einsum("bclhn,bchpn->bclhp", C, states) * from_start.permute(0, 2, 3, 1)[..., None]

    y = (y_diag + y_off).reshape(b, -1, h, p) + d_residual
    return y[:, :t], final


def _mask(x: Tensor, mask: Tensor | None) -> Tensor:
    """transformers' ``apply_mask_to_padding_states``: padding tokens' values zeroed (mask [B, T] or None)."""
    return x if mask is None else (x * mask[:, :, None]).to(x.dtype)


def nemotron_h_forward(mixer: nn.Module, hidden_states: Tensor, seq_idx: Tensor, attention_mask: Tensor | None = None,
                       cache_params=None) -> Tensor:
    """``NemotronHMamba2Mixer.forward``'s torch path with rows (``seq_idx`` [B, T]); ``cache_params`` (fresh):
    store each row's conv window and state at its last kept token (``attention_mask``: right padding)."""
    b, t, _ = hidden_states.shape
    dtype = hidden_states.dtype
    gate, xbc, dt = mixer.in_proj(_mask(hidden_states, attention_mask)).split(
        [mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    if cache_params is not None:  # the last K inputs of the conv, per row (zeros before a row's start)
        k = mixer.conv_kernel_size
        ends = (attention_mask.sum(1) if attention_mask is not None else xbc.new_full((b,), t)).long()
        at = ends[:, None] - k + torch.arange(k, device=xbc.device)  # [b, K]
        window = xbc.gather(1, at.clamp(min=0)[..., None].expand(b, k, xbc.shape[-1])) * (at >= 0)[..., None]
        cache_params.update_conv_state(window.transpose(1, 2), mixer.layer_idx, conv_kernel_size=k)
    cp = context_parallel.of(mixer) if cache_params is None and attention_mask is None else None
    if cp is None:
        xbc = segment_conv1d(xbc, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, seq_idx)
    else:  # this rank's part of a split sequence: the conv reads the rank before's last inputs too
        k = mixer.conv_kernel_size
        x_halo, rows_halo = context_parallel.conv_halo(xbc, seq_idx, k, cp)
        xbc = segment_conv1d(x_halo, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, rows_halo)[:, k - 1:]
    xbc = mixer.act(xbc).to(dtype)
    x, B, C = _mask(xbc, attention_mask).split(
        [mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size, mixer.n_groups * mixer.ssm_state_size],
        dim=-1)
    heads, groups = (b, t, mixer.num_heads, mixer.head_dim), (b, t, mixer.n_groups, mixer.ssm_state_size)
    y, final = segment_chunk_scan(x.view(heads), dt, -torch.exp(mixer.A_log.float()), B.view(groups), C.view(groups),
                                  mixer.chunk_size, mixer.D, mixer.dt_bias, mixer.time_step_limit, seq_idx,
                                  keep=None if attention_mask is None else attention_mask.bool())
    if cp is not None:  # the state the ranks before carry into this one's first row
        dt = F.softplus(dt + mixer.dt_bias.to(dt.dtype)).clamp(*mixer.time_step_limit)
        C = C.view(groups).float().repeat_interleave(mixer.num_heads // mixer.n_groups, dim=2)
        y = context_parallel.carry_in(y, final, -torch.exp(mixer.A_log.float()) * dt.float(), C, seq_idx, cp)
    if cache_params is not None:
        cache_params.update_recurrent_state(final, layer_idx=mixer.layer_idx)
    y = mixer.norm(y.reshape(b, t, -1), gate)
    return mixer.out_proj(y.to(dtype))


# HF mixer class name -> fn(mixer, hidden_states, seq_idx, attention_mask, cache_params) -> output
MIXERS = Registry("Mamba mixer")
MIXERS.register("NemotronHMamba2Mixer")(nemotron_h_forward)

_SUBCLASSES: dict[type, type] = {}


def _with_rows(cls: type) -> type:
    """``cls`` with a forward that also takes ``seq_idx``; without it, ``cls``'s own forward."""
    if cls not in _SUBCLASSES:
        rows_forward = MIXERS[cls.__name__]

        def forward(self, hidden_states, cache_params=None, attention_mask=None, seq_idx=None, **kwargs):
            if seq_idx is None:
                return cls.forward(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                                   **kwargs)
            if cache_params is not None and cache_params.has_previous_state(self.layer_idx):
                raise ValueError("rows in a pack (seq_idx) cannot continue a cache: each row would need its own state")
            return rows_forward(self, hidden_states, seq_idx, attention_mask, cache_params)

        _SUBCLASSES[cls] = type(f"{cls.__name__}Rows", (cls,), {"forward": forward, "__module__": __name__,
                                                                 "__doc__": f"{cls.__name__} taking seq_idx."})
    return _SUBCLASSES[cls]


def install(model: nn.Module) -> int:
    """Give every Mamba mixer of ``model`` the row-aware forward (once; idempotent). Returns how many it has."""
    count = getattr(model, ATTR, None)
    if count is None:
        count = 0
        for module in model.modules():
            if type(module) in _SUBCLASSES.values():
                count += 1
            elif type(module).__name__ in MIXERS:
                module.__class__ = _with_rows(type(module))
                count += 1
        setattr(model, ATTR, count)
    return count


def row_kwargs(model: nn.Module, position_ids: Tensor) -> dict:
    """The forward kwargs that keep a lane's or a pack's rows apart in its Mamba layers: ``{"seq_idx": ...}``,
    or nothing for a model without any (so attention-only models see no new kwarg)."""
    return {"seq_idx": seq_idx_from_positions(position_ids)} if install(model) else {}


def unsupported_recurrence(model: nn.Module) -> str | None:
    """The class name of a recurrent mixer (Mamba, gated delta net, short conv) ``MIXERS`` cannot keep rows apart in, if
    the model has one: packed layouts would leak its state from row to row, so such a model runs padded."""
    for module in model.modules():
        name = type(module).__name__
        if type(module) in _SUBCLASSES.values() or name in MIXERS:
            continue
        # a state-space decay (Mamba-1/2, Falcon-H1, Bamba, gated delta nets: A_log) or a short conv (LFM2)
        if isinstance(getattr(module, "A_log", None), nn.Parameter) or name.endswith("ShortConv"):
            return name
    return None

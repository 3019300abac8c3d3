"""The trainer's attention: which implementation runs, and ``varlen``, torch's own FlashAttention varlen kernel.

    attn = resolve_attn_impl(cfg.model.attn_impl, device)     # "auto" -> "varlen" on CUDA, "sdpa" on the CPU
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)

Packed training (modeling/packing.py, docs/ARCHITECTURE.md §2: the trainer and the teachers share that path)
wants a varlen kernel: [1, T] packs whose rows are told apart by ``cu_seqlens``, no [T, T] mask. The
flash-attn package gives one (``flash_attention_2``) but is usually absent and cannot be installed on the
GPU machines we get (no internet there). torch >= 2.10 ships FlashAttention varlen itself,
``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16, sm80+); this module registers it with
transformers as the attention implementation ``"varlen"``:

- ``AttentionInterface``: ``varlen_attention_forward`` receives the ``cu_seq_lens_q/k`` and ``max_length_q/k``
  kwargs that ``packing.packed_forward`` passes for names in ``packing.VARLEN_KWARGS`` (as transformers'
  ``flash_attention_2`` does). Without them it finds the rows itself: from a 2D padding mask (the padded
  layout, ``Policy(pack=False)``), else from ``position_ids`` (a position 0 starts a row), else one row per
  batch row; these cost a device sync per layer.
- ``AttentionMaskInterface``: transformers' ``flash_attention_mask``, so that no [T, T] mask is ever built
  (only a 2D padding mask reaches the kernel, and only when some token is padding).

torch's signature changed between releases: 2.10 takes ``is_causal``, 2.11 ``window_size`` (``(-1, 0)`` is
causal), later releases (2.13 here) add ``enable_gqa``. The call inspects the signature of the function it is
about to call and uses what is there (grouped-query attention without ``enable_gqa``: k/v heads repeated to
the query's).

The kernel is looked up on every call (``torch.nn.attention.varlen.varlen_attn``), so the CPU tests substitute
a plain-torch reference of its contract there (tests/test_attention.py).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from .choices import AttnImpl

NAME = "varlen"
CHOICES = tuple(AttnImpl)
# Devices where varlen_attn only takes fp16/bf16 (its FlashAttention kernel); a set so tests can add "cpu".
HALF_ONLY_DEVICES = {"cuda"}


# --- the kernel and its signature -------------------------------------------------------------------------


def varlen_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen`` (torch >= 2.10)."""
    try:
        return importlib.util.find_spec("torch.nn.attention.varlen") is not None
    except ModuleNotFoundError:
        return False


def _kernel() -> Callable:
    """torch's varlen_attn, looked up at call time so that a test can substitute a reference for it."""
    from torch.nn.attention import varlen

    return varlen.varlen_attn


@functools.lru_cache(maxsize=16)
def _signature_kwargs(fn: Callable, causal: bool) -> tuple[dict, bool]:
    """(the keyword that makes ``fn`` causal or not, whether ``fn`` takes ``enable_gqa``) from its signature.

    torch 2.11+: ``window_size=(-1, 0)`` is causal, ``(-1, -1)`` full (a tuple: 2.11 tests ``== (-1, 0)``);
    torch 2.10: ``is_causal``."""
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        mode = {"window_size": (-1, 0) if causal else (-1, -1)}
    elif "is_causal" in params:
        mode = {"is_causal": causal}
    else:
        raise RuntimeError(f"torch {torch.__version__}: varlen_attn{inspect.signature(fn)} takes neither "
                           "window_size nor is_causal; set model.attn_impl=sdpa (or flash_attention_2)")
    return mode, "enable_gqa" in params


def call_varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                scale: float | None, causal: bool = True) -> Tensor:
    """varlen_attn on q [T, Hq, D], k/v [T, Hkv, D] (Hkv divides Hq) -> [T, Hq, D] in q's dtype."""
    fn = _kernel()
    mode, takes_gqa = _signature_kwargs(fn, causal)
    gqa = {}
    if k.shape[1] != q.shape[1]:
        if takes_gqa:
            gqa = {"enable_gqa": True}
        else:  # kv head j serves query heads j*n .. j*n+n-1, as transformers' repeat_kv
            n = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
    dtype = q.dtype
    if dtype == torch.float32 and q.device.type in HALF_ONLY_DEVICES:
        # FlashAttention takes fp16/bf16 only: an fp32 model (model.dtype=fp32 on a GPU) attends in bf16,
        # as transformers' flash_attention_2 does; everything around attention stays fp32.
        q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    out = fn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, **mode, **gqa)
    return out.to(dtype)


# --- where the rows are --------------------------------------------------------------------------------


def _cu_seqlens(lengths: Tensor) -> Tensor:
    """Row lengths [N] -> cu_seqlens [N + 1] int32 starting at 0."""
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _rows_from_positions(position_ids: Tensor | None, batch: int, length: int, device) -> tuple[Tensor, int]:
    """cu_seqlens and longest row of a [batch, length] input flattened to [batch * length]: a row starts at every
    batch row and wherever the position is 0 (packed rows, as transformers' masking_utils reads them)."""
    starts = torch.zeros(batch, length, dtype=torch.bool, device=device)
    starts[:, 0] = True
    if position_ids is not None:
        starts |= position_ids.expand(batch, length).to(device) == 0
    (begin,) = starts.flatten().nonzero(as_tuple=True)
    cu = torch.cat([begin, begin.new_tensor([batch * length])]).to(torch.int32)
    return cu, int(cu.diff().max())


def varlen_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, softcap: float | None = None,
                             is_causal: bool | None = None, s_aux: Tensor | None = None,
                             **kwargs) -> tuple[Tensor, None]:
    """transformers' attention contract: query [B, Hq, T, D], key/value [B, Hkv, T, D] -> ([B, T, Hq, D], None).

    Rows (see the module docstring): ``cu_seq_lens_q`` & co. when given (packed, B = 1), else the padding mask,
    else ``position_ids``. No KV cache (the trainer's forward has none), no dropout, sliding window, softcap or
    attention sinks: those are refused rather than silently ignored."""
    _refuse_unsupported(module, query, key, dropout, sliding_window, softcap, s_aux)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    batch, heads, length, dim = query.shape
    # [B, H, T, D] -> [B*T, H, D]; free when the projections were made [B, T, H, D] and transposed (HF models)
    q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], x.shape[3]) for x in (query, key, value))
    if "cu_seq_lens_q" in kwargs:
        if attention_mask is not None or batch != 1:
            raise ValueError("varlen attention: cu_seq_lens_q is for one packed [1, T] sequence without an "
                             f"attention mask (got batch {batch}, mask {attention_mask is not None})")
        out = call_varlen(q, k, v, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], kwargs["max_length_q"],
                          kwargs["max_length_k"], scaling, causal)
    elif attention_mask is not None:
        out = _padded(q, k, v, attention_mask, scaling, causal)
    else:
        cu, longest = _rows_from_positions(kwargs.get("position_ids"), batch, length, query.device)
        out = call_varlen(q, k, v, cu, cu, longest, longest, scaling, causal)
    return out.reshape(batch, length, heads, out.shape[-1]), None


def _padded(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None, causal: bool) -> Tensor:
    """A right- (or left-) padded batch (``mask`` [B, T], True = real token): only the real tokens go through
    the kernel, each batch row one sequence; padding positions come out zero."""
    if mask.dim() != 2:
        raise ValueError(f"varlen attention takes a 2D padding mask, got shape {tuple(mask.shape)}")
    real = mask.bool()
    (keep,) = real.flatten().nonzero(as_tuple=True)
    lengths = real.sum(1)
    cu = _cu_seqlens(lengths)
    longest = int(lengths.max())
    out = call_varlen(q[keep], k[keep], v[keep], cu, cu, longest, longest, scale, causal)
    return out.new_zeros(q.shape[0], *out.shape[1:]).index_copy(0, keep, out)


def _refuse_unsupported(module, query, key, dropout, sliding_window, softcap, s_aux) -> None:
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"varlen attention serves the trainer's forward without a KV cache: {key.shape[2]} keys "
                         f"for {query.shape[2]} queries (generate with the samplers, or use sdpa)")
    refused = {"dropout": dropout if dropout else None, "sliding_window": sliding_window, "softcap": softcap,
               "s_aux (attention sinks)": s_aux}
    named = [name for name, value in refused.items() if value is not None]
    if named:
        raise NotImplementedError(f"varlen attention does not implement {', '.join(named)} "
                                  f"({type(module).__name__}); use model.attn_impl=sdpa or flash_attention_2")


# --- registration and the choice ----------------------------------------------------------------------------


def register() -> None:
    """Make ``attn_implementation="varlen"`` known to transformers (idempotent; done on import too)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


def _varlen_unusable(device: torch.device) -> str | None:
    """Why torch's varlen kernel cannot run on ``device``, or None when it can."""
    if device.type != "cuda":
        return f"it runs on CUDA GPUs only, not on {device.type}"
    if not varlen_available():
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10 does)"
    if not torch.backends.cuda.is_flash_attention_available():
        return f"torch {torch.__version__} was built without FlashAttention"
    if torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 0):
        return f"FlashAttention needs an sm80+ GPU (Ampere or newer), {torch.cuda.get_device_name(device)} is not"
    return None


def resolve_attn_impl(requested: str, device: torch.device | str) -> str:
    """``model.attn_impl`` -> the ``attn_implementation`` to load the model with on ``device``.

    auto: varlen where torch's kernel runs (CUDA, sm80+, torch >= 2.10), else sdpa. varlen and
    flash_attention_2 are refused, with what to set instead, where they cannot run; sdpa and eager pass."""
    device = torch.device(device)
    if requested == "auto":
        requested = "sdpa" if _varlen_unusable(device) else NAME
    if requested == NAME:
        reason = _varlen_unusable(device)
        if reason:
            raise ValueError(f"model.attn_impl=varlen: torch's FlashAttention varlen kernel cannot run here: {reason}. "
                             "Set model.attn_impl=sdpa (or auto, which picks sdpa here).")
        register()
    elif requested == "flash_attention_2":
        if device.type != "cuda":
            raise ValueError(f"model.attn_impl=flash_attention_2 runs on CUDA GPUs only, not on {device.type}: "
                             "set model.attn_impl=sdpa (or auto)")
        if importlib.util.find_spec("flash_attn") is None:
            raise ValueError("model.attn_impl=flash_attention_2 needs the flash-attn package, which is not "
                             "installed: set model.attn_impl=varlen (torch's own FlashAttention varlen kernel) or auto")
    elif requested not in CHOICES:
        raise ValueError(f"unknown model.attn_impl={requested!r}: choose one of {', '.join(CHOICES)}")
    return requested


register()

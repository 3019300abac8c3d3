"""modeling/packing.py: pack/unpack bookkeeping, and packed forwards equal to per-row forwards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cascade_rl.modeling.logprobs import token_logprobs
from cascade_rl.modeling.packing import pack, pack_values, packed_forward, packed_token_logprobs, unpack

WIDTH = 24
LENGTHS = [7, 1, 24, 12, 1, 3, 18, 9]  # a full-width row, length-1 rows, a mix


def padded_batch(lengths: list[int], width: int = WIDTH, vocab: int = 300, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=gen)
    lengths = torch.tensor(lengths)
    real = torch.arange(width)[None, :] < lengths[:, None]
    return torch.where(real, ids, 0), lengths, real


def load(model_dir: str, attn: str = "sdpa"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)


# --- bookkeeping -------------------------------------------------------------------------


def test_pack_hand_checked():
    ids, lengths, _ = padded_batch([3, 1, 2], width=4)
    (p,) = pack(ids, lengths)
    assert p.input_ids.tolist() == [ids[0, :3].tolist() + ids[1, :1].tolist() + ids[2, :2].tolist()]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert p.max_seqlen == 3 and p.rows.tolist() == [0, 1, 2] and p.num_tokens == 6
    assert p.token_rows().tolist() == [0, 0, 0, 1, 2, 2]
    assert torch.equal(p.to("cpu").cu_seqlens, p.cu_seqlens) and p.to("cpu").max_seqlen == 3


@pytest.mark.parametrize("max_tokens", [None, 1, 10, 24, 30, 1000])
def test_round_trip(max_tokens):
    ids, lengths, real = padded_batch(LENGTHS)
    packs = pack(ids, lengths, max_tokens)
    # every row exactly once, in batch order
    assert torch.cat([p.rows for p in packs]).tolist() == list(range(len(LENGTHS)))
    for p in packs:
        assert p.num_tokens == int(p.cu_seqlens[-1]) == int(p.lengths.sum())
        assert max_tokens is None or p.num_tokens <= max_tokens or len(p.rows) == 1
        assert p.max_seqlen == int(p.lengths.max())
        # positions restart at 0 at every cu_seqlens boundary and count up within a row
        for k in range(len(p.rows)):
            a, b = int(p.cu_seqlens[k]), int(p.cu_seqlens[k + 1])
            assert p.position_ids[0, a:b].tolist() == list(range(b - a))
    # ids and a per-token float payload come back with zeros at the padding
    out = torch.full_like(ids, -1)
    payload = torch.randn(len(LENGTHS), WIDTH, 3) * real[..., None]
    back = torch.zeros_like(payload)
    for p in packs:
        out[p.rows] = unpack(p.input_ids[..., None], p, WIDTH)[..., 0]
        back[p.rows] = unpack(pack_values(payload, p), p, WIDTH)
    assert torch.equal(out, ids)
    assert torch.equal(back, payload)


def test_max_tokens_splits_greedily_and_isolates_long_rows():
    ids, lengths, _ = padded_batch([3, 4, 10, 2, 1, 5], width=10)
    packs = pack(ids, lengths, max_tokens=7)
    assert [p.rows.tolist() for p in packs] == [[0, 1], [2], [3, 4], [5]]
    assert [p.num_tokens for p in packs] == [7, 10, 3, 5]


def test_empty_rows_are_left_out():
    ids, lengths, _ = padded_batch([2, 0, 3], width=4)
    (p,) = pack(ids, lengths)
    assert p.rows.tolist() == [0, 2] and p.cu_seqlens.tolist() == [0, 2, 5]
    with pytest.raises(ValueError):
        pack(ids, torch.tensor([2, 5, 3]))


def test_unpack_is_differentiable():
    ids, lengths, _ = padded_batch([2, 3], width=4)
    (p,) = pack(ids, lengths)
    values = torch.randn(1, p.num_tokens, requires_grad=True)
    unpack(values, p, 4).sum().backward()
    assert torch.equal(values.grad, torch.ones_like(values))


# --- packed forward == per-row forward ----------------------------------------------------


def reference_logprobs(model, ids, lengths) -> torch.Tensor:
    """Each row alone, without padding: the ground truth."""
    out = torch.zeros(ids.shape)
    for i, n in enumerate(lengths.tolist()):
        out[i, :n] = token_logprobs(model(input_ids=ids[i:i + 1, :n]).logits, ids[i:i + 1, :n])[0]
    return out


def packed_logprobs(model, ids, lengths, max_tokens=None, hidden_states=False) -> torch.Tensor:
    out = torch.zeros(ids.shape)
    for p in pack(ids, lengths, max_tokens):
        if hidden_states:
            logits = model.lm_head(packed_forward(model, p, hidden_states=True))
        else:
            logits = packed_forward(model, p)
        out[p.rows] = unpack(packed_token_logprobs(logits, p), p, ids.shape[1])
    return out


@pytest.mark.parametrize("arch", ["tiny_dense_model", "tiny_model"])
def test_packed_logprobs_equal_per_row(arch, request):
    model = load(request.getfixturevalue(arch)).eval()
    ids, lengths, real = padded_batch(LENGTHS, vocab=model.config.vocab_size)
    with torch.no_grad():
        ref = reference_logprobs(model, ids, lengths)
        padded = token_logprobs(model(input_ids=ids, attention_mask=real.long()).logits, ids) * real
        for max_tokens, hidden in [(None, False), (30, False), (None, True)]:
            got = packed_logprobs(model, ids, lengths, max_tokens, hidden)
            assert (got - ref).abs().max() <= 1e-5, (max_tokens, hidden)
        # the trainer's current layout (right-padded batch with attention_mask) agrees too
        assert (padded - ref).abs().max() <= 1e-5


def test_eager_attention_is_block_diagonal_too(tiny_dense_model):
    model = load(tiny_dense_model, attn="eager").eval()
    ids, lengths, _ = padded_batch(LENGTHS, vocab=model.config.vocab_size)
    with torch.no_grad():
        assert (packed_logprobs(model, ids, lengths) - reference_logprobs(model, ids, lengths)).abs().max() <= 1e-5


def test_without_use_cache_false_rows_would_leak(tiny_dense_model):
    # Why packed_forward passes use_cache=False: with the config's default use_cache=True the
    # model builds a cache, and transformers then skips the packed-sequence mask.
    model = load(tiny_dense_model).eval()
    ids, lengths, _ = padded_batch(LENGTHS, vocab=model.config.vocab_size)
    (p,) = pack(ids, lengths)
    with torch.no_grad():
        leaky = model(input_ids=p.input_ids, position_ids=p.position_ids).logits
        assert (leaky - packed_forward(model, p)).abs().max() > 1e-2


def reference_varlen_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """flash_attn_varlen_func in plain torch: causal attention within each cu_seqlens segment."""
    cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    assert attention_mask is None and torch.equal(cu, kwargs["cu_seq_lens_k"]) and cu.dtype == torch.int32
    assert isinstance(max_len, int) and max_len == int(cu.diff().max())
    segments = [
        F.scaled_dot_product_attention(query[..., a:b, :], key[..., a:b, :], value[..., a:b, :], is_causal=True,
                                       scale=scaling, enable_gqa=True)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
    ]
    return torch.cat(segments, dim=2).transpose(1, 2), None


def test_flash_attention_path_gets_varlen_kwargs(tiny_dense_model, monkeypatch):
    # No flash-attn on CPU: stand in a torch reference for it, to check that packed_forward's
    # cu_seqlens kwargs reach the attention layers and describe the rows correctly.
    calls = []

    def varlen(*args, **kwargs):
        calls.append(1)
        return reference_varlen_attention(*args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flash_attention_2", varlen)
    model = load(tiny_dense_model).eval()
    ids, lengths, _ = padded_batch(LENGTHS, vocab=model.config.vocab_size)
    with torch.no_grad():
        ref = reference_logprobs(model, ids, lengths)
        model.config._attn_implementation = "flash_attention_2"
        got = packed_logprobs(model, ids, lengths, max_tokens=30)
    assert len(calls) == model.config.num_hidden_layers * len(pack(ids, lengths, max_tokens=30))
    assert (got - ref).abs().max() <= 1e-5


def test_unknown_attention_is_refused(tiny_dense_model):
    model = load(tiny_dense_model)
    model.config._attn_implementation = "paged|eager"
    ids, lengths, _ = padded_batch([2, 3], width=4)
    with pytest.raises(ValueError, match="keeps packed rows apart"):
        packed_forward(model, pack(ids, lengths)[0])


@pytest.mark.parametrize("arch", ["tiny_dense_model", "tiny_model"])
def test_gradients_match_padded(arch, request):
    """A linear per-token loss: padded batch (trainer's layout) vs packs split by max_tokens."""
    model = load(request.getfixturevalue(arch)).train()
    ids, lengths, real = padded_batch(LENGTHS, vocab=model.config.vocab_size)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)) * real
    weights[:, 0] = 0.0  # position 0 has no log-prob

    logits = model(input_ids=ids, attention_mask=real.long()).logits
    (token_logprobs(logits, ids) * weights).sum().backward()
    padded = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    for p in pack(ids, lengths, max_tokens=30):  # several packs, gradients accumulated
        lp = packed_token_logprobs(packed_forward(model, p), p)
        (lp * pack_values(weights, p)).sum().backward()
    packed = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    assert padded.keys() == packed.keys()
    for name, grad in padded.items():
        torch.testing.assert_close(packed[name], grad, rtol=1e-4, atol=1e-5, msg=name)

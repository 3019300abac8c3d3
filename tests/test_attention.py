"""modeling/attention.py: the "varlen" attention (torch's FlashAttention varlen kernel) and the attention choice.

varlen_attn does not run on the CPU, so these tests put plain-torch references of its contract in its place
(``torch.nn.attention.varlen.varlen_attn``, which the module looks up on every call), one per signature torch
has shipped, and check that a GQA model through it gives sdpa's log-probs: that proves the layout, the
grouped-query heads, the scaling, the causal keyword and the rows (cu_seqlens, padding mask, position ids).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_policy import rows  # the ragged batch the layouts are compared on
from torch.nn.attention import varlen as torch_varlen
from transformers import AutoModelForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cascade_rl.modeling import attention
from cascade_rl.modeling.attention import resolve_attn_impl, varlen_attention_forward
from cascade_rl.modeling.packing import VARLEN_KWARGS, pack, packed_forward
from cascade_rl.modeling.policy import Policy

# --- references of varlen_attn's contract: q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens int32 ------------------

CALLS: list[dict] = []


def reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, causal, gqa):
    """Attention within each cu_seqlens segment, in plain torch; asserts what the kernel would require."""
    assert query.dim() == key.dim() == value.dim() == 3 and key.shape == value.shape
    assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
    assert int(cu_seq_q[0]) == 0 and int(cu_seq_q[-1]) == query.shape[0] == key.shape[0]
    assert isinstance(max_q, int) and max_q == max_k == int(cu_seq_q.diff().max())
    assert gqa or key.shape[1] == query.shape[1], "a kernel without enable_gqa needs as many k/v heads as q heads"
    CALLS.append(dict(dtype=query.dtype, q_heads=query.shape[1], kv_heads=key.shape[1], causal=causal,
                      segments=len(cu_seq_q) - 1))
    out = [F.scaled_dot_product_attention(query[a:b].transpose(0, 1), key[a:b].transpose(0, 1),
                                          value[a:b].transpose(0, 1), is_causal=causal, scale=scale,
                                          enable_gqa=True).transpose(0, 1)
           for a, b in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist())]
    return torch.cat(out)


def window_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13 (installed here): window_size and enable_gqa."""
    assert isinstance(window_size, tuple) and window_size in ((-1, 0), (-1, -1)), window_size
    return reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                     causal=window_size == (-1, 0), gqa=enable_gqa)


def window(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
           window_size=(-1, -1)):
    """torch 2.11: window_size (it tests ``window_size == (-1, 0)``: a tuple), no enable_gqa."""
    assert isinstance(window_size, tuple) and window_size in ((-1, 0), (-1, -1)), window_size
    return reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                     causal=window_size == (-1, 0), gqa=False)


def is_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None, scale=None):
    """torch 2.10: is_causal, no enable_gqa."""
    return reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, causal=is_causal, gqa=False)


SIGNATURES = {"window_gqa": window_gqa, "window": window, "is_causal": is_causal}


@pytest.fixture
def kernel(monkeypatch):
    """kernel(name): put that reference where modeling/attention.py finds varlen_attn."""
    CALLS.clear()

    def use(name: str):
        monkeypatch.setattr(torch_varlen, "varlen_attn", SIGNATURES[name])
        return SIGNATURES[name]

    return use


# --- the model through it ------------------------------------------------------------------------------


def load(path: str, attn: str):
    """The model with a non-default attention scale (0.05, not head_dim ** -0.5), so that a kernel called
    without ``scale=`` (which would fall back to the default) gives different numbers."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    for layer in model.base_model.layers:
        assert layer.self_attn.scaling != 0.05
        layer.self_attn.scaling = 0.05
    return model


def policy_outputs(model, pack_rows: bool):
    ids, lengths, target = rows()
    policy = Policy(model, temperature=0.7, chunk_tokens=5, pack=pack_rows, pack_tokens=20)
    lp, ent = policy(ids, lengths, target, with_entropy=True)
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
    ((lp * w).sum() + 0.3 * (ent * w).sum()).backward()
    return lp.detach(), ent.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got, ref):
    lp, ent, grads = got
    ref_lp, ref_ent, ref_grads = ref
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("signature", list(SIGNATURES))
@pytest.mark.parametrize("model_fixture", ["tiny_dense_model", "tiny_model"])
def test_packed_policy_through_varlen_equals_sdpa(model_fixture, signature, request, kernel):
    path = request.getfixturevalue(model_fixture)
    kernel(signature)
    model = load(path, "varlen")  # from_pretrained accepts the registered name
    assert model.config._attn_implementation == "varlen" and "varlen" in VARLEN_KWARGS
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA is exercised
    got = policy_outputs(model, pack_rows=True)
    ref = policy_outputs(load(path, "sdpa"), pack_rows=False)
    assert_same(got, ref)

    ids, lengths, _ = rows()
    packs = pack(ids, lengths, 20)
    assert len(packs) > 1  # several [1, T] packs, each with its own cu_seqlens
    assert len(CALLS) == model.config.num_hidden_layers * len(packs)  # forward only: backward is autograd's
    assert [c["segments"] for c in CALLS[:: model.config.num_hidden_layers]] == [len(p.rows) for p in packs]
    assert all(c["causal"] and c["dtype"] == torch.float32 for c in CALLS)
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    expected_kv = kv if signature == "window_gqa" else heads  # repeated k/v heads where enable_gqa is missing
    assert all(c["q_heads"] == heads and c["kv_heads"] == expected_kv for c in CALLS)


def test_padded_policy_through_varlen_equals_sdpa(tiny_dense_model, kernel):
    """Policy(pack=False): a right-padded batch with a 2D mask; only real tokens reach the kernel."""
    kernel("window")
    got = policy_outputs(load(tiny_dense_model, "varlen"), pack_rows=False)
    assert_same(got, policy_outputs(load(tiny_dense_model, "sdpa"), pack_rows=False))
    assert CALLS and all(c["segments"] == 5 for c in CALLS)


def test_without_cu_seqlens_rows_come_from_position_ids(tiny_dense_model, kernel):
    """A packed call that does not pass cu_seq_lens (and a plain batch, even with positions not from 0) still
    keeps rows apart."""
    kernel("window_gqa")
    ids, lengths, _ = rows()
    (p,) = pack(ids, lengths)
    model, ref = load(tiny_dense_model, "varlen").eval(), load(tiny_dense_model, "sdpa").eval()
    with torch.no_grad():
        got = model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False).logits
        torch.testing.assert_close(got, packed_forward(ref, p), atol=1e-5, rtol=0)
        for positions in (None, torch.arange(ids.shape[1]).expand(ids.shape) + 5):
            torch.testing.assert_close(model(input_ids=ids, position_ids=positions, use_cache=False).logits,
                                       ref(input_ids=ids, position_ids=positions, use_cache=False).logits,
                                       atol=1e-5, rtol=0)


def test_fp32_attends_in_bf16_where_the_kernel_is_half_only(tiny_dense_model, kernel, monkeypatch):
    kernel("window_gqa")
    monkeypatch.setattr(attention, "HALF_ONLY_DEVICES", {"cpu"})  # pretend the CPU is such a device
    ids, lengths, _ = rows()
    (p,) = pack(ids, lengths)
    with torch.no_grad():
        got = packed_forward(load(tiny_dense_model, "varlen").eval(), p)
        ref = packed_forward(load(tiny_dense_model, "sdpa").eval(), p)
    assert got.dtype == torch.float32 and CALLS and all(c["dtype"] == torch.bfloat16 for c in CALLS)
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()  # bf16 attention: close, not equal


def test_the_mask_function_builds_no_mask():
    assert ALL_MASK_ATTENTION_FUNCTIONS["varlen"] is flash_attention_mask
    assert ALL_ATTENTION_FUNCTIONS["varlen"] is varlen_attention_forward


def test_a_kernel_without_a_causal_keyword_is_refused(monkeypatch):
    monkeypatch.setattr(torch_varlen, "varlen_attn", lambda q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None: q)
    q = torch.zeros(1, 2, 3, 4)
    cu = dict(cu_seq_lens_q=torch.tensor([0, 3], dtype=torch.int32), max_length_q=3, max_length_k=3)
    cu["cu_seq_lens_k"] = cu["cu_seq_lens_q"]
    with pytest.raises(RuntimeError, match="neither window_size nor is_causal"):
        varlen_attention_forward(torch.nn.Module(), q, q, q, None, **cu)


@pytest.mark.parametrize("kwargs, match", [(dict(sliding_window=4), "sliding_window"), (dict(dropout=0.1), "dropout"),
                                           (dict(softcap=30.0), "softcap")])
def test_unsupported_options_are_refused(kwargs, match, kernel):
    kernel("window_gqa")
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(NotImplementedError, match=match):
        varlen_attention_forward(torch.nn.Module(), q, q, q, None, **kwargs)
    with pytest.raises(ValueError, match="KV cache"):
        varlen_attention_forward(torch.nn.Module(), q, torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), None)


# --- resolve_attn_impl ------------------------------------------------------------------------------------


@pytest.fixture
def flash_built(monkeypatch):
    """Pretend this torch was built with FlashAttention (the CPU wheel is not), as CUDA wheels are."""
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)


def test_auto_picks_varlen_on_cuda_and_sdpa_on_the_cpu(flash_built, monkeypatch):
    assert resolve_attn_impl("auto", "cpu") == "sdpa"
    assert resolve_attn_impl("auto", torch.device("cuda", 0)) == "varlen"
    assert resolve_attn_impl("varlen", "cuda:0") == "varlen"
    monkeypatch.setattr(attention, "varlen_available", lambda: False)  # torch < 2.10
    assert resolve_attn_impl("auto", "cuda") == "sdpa"
    with pytest.raises(ValueError, match=r"no torch.nn.attention.varlen.*model.attn_impl=sdpa"):
        resolve_attn_impl("varlen", "cuda")


def test_varlen_is_refused_where_it_cannot_run(flash_built, monkeypatch):
    with pytest.raises(ValueError, match=r"CUDA GPUs only, not on cpu.*model.attn_impl=sdpa"):
        resolve_attn_impl("varlen", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ValueError, match="sm80"):
        resolve_attn_impl("varlen", "cuda")
    assert resolve_attn_impl("auto", "cuda") == "sdpa"


def test_flash_attention_2_needs_its_package_and_cuda(monkeypatch):
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        resolve_attn_impl("flash_attention_2", "cpu")
    real_find_spec = attention.importlib.util.find_spec
    monkeypatch.setattr(attention.importlib.util, "find_spec",
                        lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"flash-attn package.*model.attn_impl=varlen"):
        resolve_attn_impl("flash_attention_2", "cuda")


def test_sdpa_and_eager_pass_and_unknown_names_are_refused():
    assert resolve_attn_impl("sdpa", "cpu") == "sdpa"
    assert resolve_attn_impl("eager", torch.device("cpu")) == "eager"
    with pytest.raises(ValueError, match=r"unknown model.attn_impl='flash'.*auto, varlen, flash_attention_2, sdpa"):
        resolve_attn_impl("flash", "cpu")

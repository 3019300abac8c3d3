"""The trainer's log-prob path (modeling/policy.py): packed and padded rows, chunked LM head, all equal
to transformers' full-logits forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cascade_rl.modeling.logprobs import token_logprobs
from cascade_rl.modeling.policy import Policy


def rows(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, width = 5, 14
    lengths = torch.tensor([14, 9, 3, 11, 6])
    ids = torch.randint(3, 300, (n, width), generator=g)
    target = torch.zeros(n, width, dtype=torch.bool)
    for i, (length, prompt) in enumerate(zip(lengths.tolist(), [5, 4, 2, 6, 3])):
        ids[i, length:] = 0  # padding
        target[i, prompt:length] = True  # response tokens
    return ids, lengths, target


def naive(model, ids, lengths, target, temperature):
    """Full logits of each row on its own (no padding at all), then log-softmax and entropy."""
    lp = torch.zeros(ids.shape)
    ent = torch.zeros(ids.shape)
    for i, n in enumerate(lengths.tolist()):
        logits = model(input_ids=ids[i : i + 1, :n]).logits.float() / temperature
        lp[i, :n] = token_logprobs(logits * temperature, ids[i : i + 1, :n], temperature)[0]
        p = torch.softmax(logits[0, :-1], -1)
        ent[i, 1:n] = -(p * torch.log_softmax(logits[0, :-1], -1)).sum(-1)
    return lp * target, ent * target


@pytest.mark.parametrize("layout", ["lanes", "padded", "varlen"])
@pytest.mark.parametrize("model_fixture", ["tiny_model", "tiny_dense_model"])
def test_policy_matches_full_logits_values_and_gradients(model_fixture, layout, request, monkeypatch):
    path = request.getfixturevalue(model_fixture)
    ids, lengths, target = rows()
    temperature = 0.7
    ref_model = AutoModelForCausalLM.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    if layout == "varlen":  # no flash-attn on CPU: its varlen contract in plain torch (tests/test_packing.py)
        from test_packing import reference_varlen_attention
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flash_attention_2", reference_varlen_attention)
        model.config._attn_implementation = "flash_attention_2"
    # pack_tokens 20: the varlen layout splits the batch into several [1, T] packs
    policy = Policy(model, temperature=temperature, chunk_tokens=5, pack=layout != "padded", pack_tokens=20)
    lp, ent = policy(ids, lengths, target, with_entropy=True)
    ref_lp, ref_ent = naive(ref_model, ids, lengths, target, temperature)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    assert (lp[~target] == 0).all() and (ent[~target] == 0).all()

    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
    ((lp * w).sum() + 0.3 * (ent * w).sum()).backward()
    ((ref_lp * w).sum() + 0.3 * (ref_ent * w).sum()).backward()
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        q = ref_params[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_policy_refuses_a_target_at_position_zero(tiny_dense_model):
    ids, lengths, target = rows()
    target[0, 0] = True
    with pytest.raises(ValueError, match="first token"):
        Policy(AutoModelForCausalLM.from_pretrained(tiny_dense_model))(ids, lengths, target)


def test_lanes_hold_whole_rows_and_fewer_tokens_than_padding():
    from cascade_rl.modeling.packing import pack_lanes

    ids, lengths, _ = rows()
    lanes = pack_lanes(ids, lengths)
    assert lanes.input_ids.shape == (4, 14)  # first-fit decreasing: 14 | 11+3 | 9 | 6, 4 lanes for 5 rows
    for i, n in enumerate(lengths.tolist()):
        lane, off = lanes.lane[i], lanes.offset[i]
        assert torch.equal(lanes.input_ids[lane, off:off + n], ids[i, :n])
        assert lanes.position_ids[lane, off:off + n].tolist() == list(range(n))


def test_triton_logprob_kernel_in_the_policy_matches_torch(tiny_dense_model):
    """trainer.logprob_impl=triton: the fused kernel (interpreter on CPU) gives the chunked torch numbers."""
    pytest.importorskip("triton")
    ids, lengths, target = rows()
    out = {}
    for impl in ("torch", "triton"):
        model = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
        lp, ent = Policy(model, temperature=0.7, logprob_impl=impl)(ids, lengths, target, with_entropy=True)
        (lp.sum() + 0.5 * ent.sum()).backward()
        out[impl] = (lp.detach(), ent.detach(), model.lm_head.weight.grad.clone(),
                     model.model.layers[-1].mlp.down_proj.weight.grad.clone())
    for a, b in zip(out["torch"], out["triton"]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def grouped_rows():
    """GRPO-shaped rows: three prompts, each answered several times (response lengths 1 to 9), one row with
    no target at all and one whose targets skip a token (a masked tool output)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (n,), generator=g) for n in (4, 6, 2)]
    spec = [(0, 5), (0, 1), (0, 9), (1, 3), (1, 7), (1, 2), (1, 4), (2, 6), (2, 3)]
    width = max(len(prompts[p]) + r for p, r in spec)
    ids = torch.zeros(len(spec), width, dtype=torch.long)
    target = torch.zeros(len(spec), width, dtype=torch.bool)
    lengths = torch.tensor([len(prompts[p]) + r for p, r in spec])
    for i, (p, r) in enumerate(spec):
        n = len(prompts[p])
        ids[i, :n] = prompts[p]
        ids[i, n: n + r] = torch.randint(3, 300, (r,), generator=g)
        target[i, n: n + r] = True
    target[5] = False  # no targets: left out of the layout
    target[4, len(prompts[1]) + 2] = False  # a gap in the targets
    return ids, lengths, target


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_fixture", ["tiny_model", "tiny_dense_model"])
def test_shared_prefix_layout_matches_full_logits_values_and_gradients(model_fixture, attn, request):
    """Each prompt run once, its responses on its keys/values: the numbers (and gradients, through the shared
    keys/values) of running every row in full."""
    from cascade_rl.modeling.packing import share_prefixes

    path = request.getfixturevalue(model_fixture)
    ids, lengths, target = grouped_rows()
    layout = share_prefixes(ids, lengths, target)
    assert layout is not None and layout.prefix_ids.shape[0] == 3
    assert layout.prefix_ids.numel() + layout.lane_ids.numel() < int(lengths.sum())  # less work than the rows
    ref_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)
    lp, ent = Policy(model, temperature=0.7, chunk_tokens=5)(ids, lengths, target, with_entropy=True)
    ref_lp, ref_ent = naive(ref_model, ids, lengths, target, 0.7)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
    ((lp * w).sum() + 0.3 * (ent * w).sum()).backward()
    ((ref_lp * w).sum() + 0.3 * (ref_ent * w).sum()).backward()
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None or ref_params[name].grad is not None:
            torch.testing.assert_close(p.grad, ref_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_rows_without_a_shared_prompt_keep_the_one_pass_layout():
    from cascade_rl.modeling.packing import share_prefixes

    ids, lengths, target = rows()  # five different prompts
    assert share_prefixes(ids, lengths, target) is None

"""The trainer, its reference and the teachers on Nemotron-H (hybrid Mamba-2 + attention + MoE): every log-prob
layout (padded, lanes, varlen packs, shared prefixes) gives transformers' own numbers row by row, a lane never
leaks Mamba state from one row into the next (modeling/mamba.py), a GRPO and a MOPD step train it, a teacher
serves it, FSDP2 on 2 ranks equals 1."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import built_once
from test_policy import naive
from test_trainer import MOPD_RUN, cfg, make_batch, policy_logprobs
from transformers import AutoModelForCausalLM

from cascade_rl.learner.trainer import train_step
from cascade_rl.modeling import mamba
from cascade_rl.modeling.packing import pack_lanes, share_prefixes
from cascade_rl.modeling.policy import Policy


@pytest.fixture(scope="module")
def nh_model(tmp_path_factory) -> str:
    """The tiny Nemotron-H (learner/tiny_model.py: MEMEM*E, Mamba-2 chunk_size 32)."""
    from cascade_rl.learner.tiny_model import make_tiny_model

    return built_once(tmp_path_factory, "tiny-nemotron-h",
                      lambda d: str(make_tiny_model(d / "nemotron-h", arch="nemotron_h")))


def grouped_rows():
    """GRPO-shaped rows of 30 to 100 tokens (chunks of 32: rows span chunks, and a row in a lane starts mid-chunk):
    three prompts answered several times, one row with no target and one whose targets skip a token."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g) for n in (21, 35, 9)]
    spec = [(0, 40), (0, 12), (0, 70), (1, 30), (1, 55), (1, 20), (2, 21), (2, 60)]
    width = max(len(prompts[p]) + r for p, r in spec)
    ids = torch.zeros(len(spec), width, dtype=torch.long)
    target = torch.zeros(len(spec), width, dtype=torch.bool)
    lengths = torch.tensor([len(prompts[p]) + r for p, r in spec])
    for i, (p, r) in enumerate(spec):
        n = len(prompts[p])
        ids[i, :n] = prompts[p]
        ids[i, n: n + r] = torch.randint(3, 300, (r,), generator=g)
        target[i, n: n + r] = True
    target[5] = False
    target[4, len(prompts[1]) + 7] = False
    return ids, lengths, target


def test_a_lane_of_two_rows_gives_each_row_alone_where_transformers_leaks_state(nh_model):
    """Two rows back to back in one lane (position ids restarting): with seq_idx each row's hidden states are
    its own; transformers' torch path alone (attention kept apart by the mask) runs Mamba state across."""
    model = AutoModelForCausalLM.from_pretrained(nh_model)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, 300, (45,), generator=g), torch.randint(3, 300, (60,), generator=g)
    lane = torch.cat([a, b])[None]
    pos = torch.cat([torch.arange(45), torch.arange(60)])[None]
    with torch.no_grad():
        alone = [model.base_model(input_ids=r[None], use_cache=False).last_hidden_state[0] for r in (a, b)]
        leaked = model.base_model(input_ids=lane, position_ids=pos, use_cache=False).last_hidden_state[0]
        assert mamba.install(model) == 3  # MEMEM*E: three Mamba-2 layers
        kept = model.base_model(input_ids=lane, position_ids=pos, use_cache=False,
                                **mamba.row_kwargs(model, pos)).last_hidden_state[0]
    torch.testing.assert_close(kept[:45], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(kept[45:], alone[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(leaked[:45], alone[0], atol=1e-5, rtol=0)  # the first row has nothing before it
    assert (leaked[45:] - alone[1]).abs().max() > 1e-2  # the second starts from the first's conv window and state


LAYOUTS = {  # Policy arguments of each layout the trainer can be configured with
    "padded": dict(pack=False),
    "lanes": dict(pack=True, share_prefix=False),
    "varlen": dict(pack=True, pack_tokens=150),  # several [1, T] packs of two or more rows each
    "shared_prefix": dict(pack=True, share_prefix=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_gives_transformers_logprobs_values_and_gradients(nh_model, layout, monkeypatch):
    """Each layout's log-probs, entropies and gradients equal transformers' own forward of each row alone
    (``model(input_ids).logits`` log-softmaxed at the targets), fp32."""
    ids, lengths, target = grouped_rows()
    ref_model = AutoModelForCausalLM.from_pretrained(nh_model)
    model = AutoModelForCausalLM.from_pretrained(nh_model)
    if layout == "varlen":  # no flash-attn on CPU: its varlen contract in plain torch (tests/test_packing.py)
        from test_packing import reference_varlen_attention
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flash_attention_2", reference_varlen_attention)
        model.config._attn_implementation = "flash_attention_2"
    if layout == "lanes":
        lanes = pack_lanes(ids, lengths)
        assert len(lanes.input_ids) < len(ids)  # some lane holds two rows: a boundary inside it
    if layout == "shared_prefix":
        shared = share_prefixes(ids, lengths, target, row_per_lane=True)
        assert shared is not None and len(shared.prefix_ids) == 3
    policy = Policy(model, temperature=0.7, chunk_tokens=16, **LAYOUTS[layout])
    lp, ent = policy(ids, lengths, target, with_entropy=True)
    ref_lp, ref_ent = naive(ref_model, ids, lengths, target, 0.7)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)

    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
    ((lp * w).sum() + 0.3 * (ent * w).sum()).backward()
    ((ref_lp * w).sum() + 0.3 * (ref_ent * w).sum()).backward()
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        q = ref_params[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:  # a conv bias's gradient sums ~700 terms up to ~150: rounding ~1e-6 of its largest
            scale = float(q.grad.abs().max())
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5 + 4e-6 * scale, rtol=1e-4, msg=name)


@pytest.mark.parametrize("responses", [(1, 1, 1), (1, 3, 40)])
def test_shared_prefixes_shorter_than_the_conv_and_one_token_suffixes(nh_model, responses):
    """Edge cases of the shared-prefix layout's Mamba states: a 2-token prompt (shorter than the conv window: its
    window is zero-padded), suffixes of one token (transformers' continuation then takes its one-step decode path)."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (n,), generator=g) for n in (2, 33)]
    spec = [(p, r) for p in (0, 1) for r in responses]
    ids = torch.zeros(len(spec), max(len(prompts[p]) + r for p, r in spec), dtype=torch.long)
    target = torch.zeros(ids.shape, dtype=torch.bool)
    lengths = torch.tensor([len(prompts[p]) + r for p, r in spec])
    for i, (p, r) in enumerate(spec):
        n = len(prompts[p])
        ids[i, :n], ids[i, n: n + r] = prompts[p], torch.randint(3, 300, (r,), generator=g)
        target[i, n: n + r] = True
    model = AutoModelForCausalLM.from_pretrained(nh_model)
    with torch.no_grad():
        got = Policy(model, share_prefix=True)(ids, lengths, target)[0]
        want = naive(model, ids, lengths, target, 1.0)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["lanes", "varlen", "shared_prefix"])
def test_routing_replay_in_every_layout_gives_the_padded_numbers(nh_model, layout, monkeypatch):
    """R3 (modeling/routing.py) on Nemotron-H: random routes (the same at each position of every row, as a group's
    shared prompt has them) replayed in a packed layout give the padded layout's replayed log-probs, Mamba layers
    and all: the routes follow each token wherever the layout puts it."""
    from cascade_rl.modeling.routing import moe_routers

    ids, lengths, target = grouped_rows()
    model = AutoModelForCausalLM.from_pretrained(nh_model)
    layers, k = len(moe_routers(model)), model.config.num_experts_per_tok
    picks = torch.rand((ids.shape[1], layers, 8), generator=torch.Generator().manual_seed(5)).argsort(-1)[..., :k]
    real = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    routes = torch.where(real[..., None, None], picks.expand(len(ids), -1, -1, -1), -1).to(torch.int16)
    with torch.no_grad():
        padded = Policy(model, pack=False, routing_replay=True)(ids, lengths, target, routes=routes)[0]
        own = Policy(model, pack=False)(ids, lengths, target)[0]
        if layout == "varlen":
            from test_packing import reference_varlen_attention
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flash_attention_2", reference_varlen_attention)
            model.config._attn_implementation = "flash_attention_2"
        got = Policy(model, routing_replay=True, **LAYOUTS[layout])(ids, lengths, target, routes=routes)[0]
    assert (padded - own).abs().max() > 0.05  # the routes replayed are not the model's own
    torch.testing.assert_close(got, padded, atol=1e-5, rtol=0)


def test_a_grpo_step_with_a_reference_trains_it(nh_model, tmp_path):
    """The trainer as a launch builds it (compose("tiny"), learner.trainer.build, a KL term: the frozen reference
    too) takes a GRPO step on 60-token rows: the reference gives the policy's log-probs before it, the loss is
    finite, every kind of layer's weights moved, rewarded rows went up and the others down."""
    from cascade_rl.learner import parallel
    from cascade_rl.learner.trainer import build
    from cascade_rl.supervisor.config import compose

    c = compose("tiny", [f"model.path={nh_model}", f"run_dir={tmp_path}", "trainer.lr=1e-2", "trainer.warmup_steps=0",
                         "trainer.correction=none", "run.algorithm=grpo", "trainer.kl_coef=0.01"], check=False)
    policy, reference, opt, _, _ = build(c, parallel.Ranks())
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    batch = make_batch(prompt=20, resp=40)
    lp0 = policy_logprobs(policy.model, batch)
    with torch.no_grad():
        ref_lp = reference(batch.input_ids, batch.lengths, batch.response_mask)[0]
    torch.testing.assert_close(ref_lp, lp0, atol=1e-5, rtol=0)
    metrics = train_step(policy, opt, batch, c.trainer, 0, reference, run=c.run)
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0 and metrics["kl_ref"] == pytest.approx(0, abs=1e-6)
    after = policy.model.state_dict()
    for part in ("mixer.A_log", "mixer.conv1d.weight", "mixer.in_proj.weight", "mixer.q_proj.weight",
                 "mixer.experts.down_proj", "mixer.shared_experts.up_proj.weight"):
        moved = [k for k in after if part in k and not torch.equal(after[k], before[k])]
        assert moved, part
    delta = ((policy_logprobs(policy.model, batch) - lp0) * batch.response_mask).sum(-1)
    rewarded = batch.rewards == 1
    assert delta[rewarded].mean() > 0 > delta[~rewarded].mean()


def test_a_mopd_step_moves_the_student_toward_a_nemotron_h_teacher(nh_model):
    teacher = AutoModelForCausalLM.from_pretrained(nh_model)
    with torch.no_grad():  # a different policy: perturbed weights
        for p in teacher.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    student = AutoModelForCausalLM.from_pretrained(nh_model)
    batch = make_batch(prompt=20, resp=40)
    batch.teacher_logprobs = policy_logprobs(teacher, batch)
    batch.inf_logprobs = policy_logprobs(student, batch)
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    metrics = train_step(Policy(student), opt, batch, cfg(correction="icepop"), step=0, run=MOPD_RUN)
    assert np.isfinite(metrics["loss"]) and metrics["mopd/reverse_kl"] != 0.0
    after = policy_logprobs(student, batch)
    m = batch.response_mask
    assert (after - batch.teacher_logprobs)[m].abs().mean() < (batch.inf_logprobs - batch.teacher_logprobs)[m].abs().mean()


def test_a_teacher_serves_it_with_the_trainers_logprobs(nh_model, tmp_path):
    """teachers/server.py's Teacher on a Nemotron-H checkpoint: its log-probs of ragged groups (shared prompts)
    equal the trainer's Policy on the same tokens, and transformers' own forward of each row."""
    from test_teacher import groups, run_config, trainer_logprobs

    from cascade_rl.teachers.server import Teacher, batch_rows

    c = run_config(nh_model, tmp_path)
    teacher = Teacher.load(nh_model, ["math"], c)
    requests = groups(4, 3, temperature=0.8)
    assert all(not teacher.check(r) for r in requests)
    got = np.concatenate(teacher.logprobs(requests))
    want = trainer_logprobs(nh_model, c, requests)
    assert np.abs(got - want).max() <= 1e-5
    ids, lengths, mask = batch_rows(requests)
    with torch.no_grad():
        hf = naive(AutoModelForCausalLM.from_pretrained(nh_model), ids, lengths, mask, 0.8)[0][mask].numpy()
    assert np.abs(got - hf).max() <= 1e-5


def test_two_ranks_equal_one_rank(nh_model, request, tmp_path):
    """FSDP2 (learner/parallel.py shards each NemotronHBlock, then the root) on 2 CPU ranks: the 1-rank steps."""
    import test_parallel

    test_parallel.test_two_ranks_equal_one_rank("nh_model", False, 1, request, tmp_path)


def test_describe_counts_routed_experts_by_any_name(nh_model):
    from cascade_rl.modeling.models import describe, num_experts

    model = AutoModelForCausalLM.from_pretrained(nh_model)
    assert num_experts(model.config) == 8  # Nemotron-H: n_routed_experts
    assert "experts=" in describe(model)


def test_a_recurrent_layer_without_row_support_runs_padded_with_one_warning(caplog):
    """A linear-attention layer modeling/mamba.py does not know (Qwen3-Next's gated delta net) would leak its state
    in lanes too: such a model's Policy runs padded, says so once, and gives transformers' numbers."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                             linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                             layer_types=["linear_attention", "full_attention"], max_position_embeddings=128)
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    ids, lengths = torch.randint(3, 60, (3, 30), generator=g), torch.tensor([30, 12, 17])
    target = torch.zeros(ids.shape, dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        ids[i, n:] = 0
        target[i, 5:n] = True
    with caplog.at_level("WARNING", logger="cascade_rl.modeling.policy"):
        policy = Policy(model, pack=True)
    assert not policy.pack
    assert [r.getMessage() for r in caplog.records] == [
        "Qwen3NextGatedDeltaNet keeps no row boundary in a packed sequence (its state would leak from row to row): "
        "this model's log-probs run padded (trainer.pack off)"]
    with torch.no_grad():
        torch.testing.assert_close(policy(ids, lengths, target)[0], naive(model, ids, lengths, target, 1.0)[0],
                                   atol=1e-6, rtol=0)

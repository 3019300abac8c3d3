"""Rollout routing replay (R3): the engine's experts come back with each sample, travel with the rollout, and
the trainer's routers take them (modeling/routing.py).

The reference for "the trainer replays the engine's routes" is written here independently of the hook: each
row alone, padded, through an HF model whose routers are replaced by a function that returns the given experts
with weights from the router's own softmax. The trainer's layouts (shared prefixes, lanes, padded) must give
the same log-probs.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from cascade_rl.learner.trainer import Batch, train_step
from cascade_rl.modeling.policy import Policy
from cascade_rl.modeling.routing import moe_routers
from cascade_rl.orchestrator.batch import batch_routes
from cascade_rl.protocol.codec import decode, encode
from cascade_rl.protocol.messages import Rollout, WorkKey
from cascade_rl.protocol.rows import pad
from cascade_rl.samplers.engine import GenerationRequest
from cascade_rl.samplers.kv_cache import KVCache
from cascade_rl.samplers.torch_engine import TorchEngine


def sample(model_path: str, dtype: str = "float32", cpu_kernels: bool | None = None, groups: int = 3, n: int = 3):
    """Groups of rollouts with routes: (prompts, samples per group)."""
    engine = TorchEngine(model_path, dtype=dtype, return_routes=True, cpu_kernels=cpu_kernels)
    prompts = [np.array([1, 5, 7 + g, 9, 11 + 2 * g][: 3 + g % 3], np.int32) for g in range(groups)]
    reqs = [GenerationRequest(f"g{g}", p, n, 1.0, 1.0, 10, [], seed=g) for g, p in enumerate(prompts)]
    return prompts, engine.generate(reqs)


def to_batch(prompts, groups) -> tuple[Batch, torch.Tensor]:
    """A right-padded trainer batch with the rollouts' routes laid out as the orchestrator lays them."""
    rows = [(p, s) for p, g in zip(prompts, groups) for s in g]
    width = max(len(p) + len(s.response_ids) for p, s in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (p, s) in enumerate(rows):
        ids[i, : len(p)] = torch.from_numpy(p.astype(np.int64))
        ids[i, len(p): len(p) + len(s.response_ids)] = torch.from_numpy(s.response_ids.astype(np.int64))
        mask[i, len(p): len(p) + len(s.response_ids)] = True
    key = WorkKey.sample("g", 0)
    rollouts = [Rollout(key, "math", p, s.response_ids, s.logprobs, routes=s.routes) for p, s in rows]
    lengths = torch.tensor([len(p) + len(s.response_ids) for p, s in rows])
    routes = torch.from_numpy(pad(batch_routes(rollouts, lengths.numpy()), lengths.numpy(), -1))  # as the trainer pads
    inf = torch.zeros(len(rows), width)
    for i, (p, s) in enumerate(rows):
        inf[i, len(p): len(p) + len(s.response_ids)] = torch.from_numpy(s.logprobs)
    batch = Batch(ids, lengths, mask, mask.clone(), inf, torch.rand(len(rows)), len(groups[0]), routes=routes)
    return batch, routes


def forced_logprobs(model, batch: Batch, routes: torch.Tensor) -> torch.Tensor:
    """Each row alone through ``model`` with every router returning ``routes`` (the reference)."""
    routers = moe_routers(model)
    saved = [r.forward for r in routers]
    out = torch.zeros(batch.input_ids.shape)
    try:
        for i in range(len(batch.lengths)):
            n = int(batch.lengths[i])
            for layer, router in enumerate(routers):
                given = routes[i, :n, layer].long()

                def forced(self, h, given=given):
                    logits = F.linear(h.reshape(-1, self.hidden_dim), self.weight)
                    own = torch.topk(logits, self.top_k, dim=-1).indices
                    ids = torch.where((given >= 0).all(-1, keepdim=True), given, own)  # the last token: its own
                    w = torch.softmax(logits, -1, dtype=torch.float).gather(1, ids)
                    return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), ids

                router.forward = types.MethodType(forced, router)
            single = Policy(model, pack=False)
            lp, _ = single(batch.input_ids[i: i + 1, :n], batch.lengths[i: i + 1], batch.response_mask[i: i + 1, :n])
            out[i, :n] = lp[0]
    finally:
        for r, f in zip(routers, saved):
            r.forward = f
    return out


def random_routes(routes: torch.Tensor, experts: int, seed: int = 0) -> torch.Tensor:
    """Routes unlike anything the model would pick: k distinct random experts per (position, layer), the same in
    every row (a group's rows share their prompt's routes: the engine prefills it once)."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand((*routes.shape[1:-1], experts), generator=g).argsort(-1)[..., : routes.shape[-1]]
    return torch.where(routes >= 0, picks.to(routes.dtype), routes)


# --- the engine ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, cpu_kernels", [("float32", True), ("float32", False), ("bfloat16", False)])
def test_engine_routes_are_the_experts_of_every_token_it_ran(tiny_model, dtype, cpu_kernels):
    """A sample's routes cover its prompt and its response but the last token, and are the experts a forward of
    those tokens picks (the C++ decode op, the torch path and bf16 alike: fp32 exactly, bf16 nearly)."""
    prompts, groups = sample(tiny_model, dtype, cpu_kernels)
    engine = TorchEngine(tiny_model, dtype=dtype, return_routes=True, cpu_kernels=False)
    agree = total = 0
    for p, g in zip(prompts, groups):
        for s in g:
            assert s.routes.dtype == np.int16 and s.routes.shape == (len(p) + len(s.response_ids) - 1, 4, 2)
            ids = torch.from_numpy(np.concatenate([p, s.response_ids[:-1]]).astype(np.int64))[None]
            cache = KVCache(engine.model.args, 1, 64, engine.dtype, engine.device)
            engine.model(ids, torch.arange(ids.shape[1])[None], cache.prefill(torch.tensor([0]), torch.tensor([0])))
            full = engine.model.last_routes()[0].sort(-1).values.numpy()
            agree += int((full == np.sort(s.routes, -1)).all(-1).sum())
            total += full.shape[0] * full.shape[1]
    assert agree / total >= (1.0 if dtype == "float32" else 0.98), (agree, total)


def test_engine_without_return_routes_sends_none(tiny_model, tiny_dense_model):
    for path, ask in ((tiny_model, False), (tiny_dense_model, True)):  # not asked; a dense model has none
        engine = TorchEngine(path, return_routes=ask)
        out = engine.generate([GenerationRequest("a", np.array([1, 2, 3], np.int32), 2, 1.0, 1.0, 4, [], seed=0)])
        assert all(s.routes is None for s in out[0])


def test_kept_prefix_turns_carry_the_routes_of_their_earlier_turns(tiny_model):
    """Multi-turn: a row's next turn restores its K/V and prefills only the new tokens; its routes still cover
    the whole prompt, the kept part's from the earlier turn."""
    engine = TorchEngine(tiny_model, return_routes=True)
    eos = engine.eos_ids
    engine.eos_ids = torch.arange(engine.vocab_size)  # the first turn stops after one token (a stopped row is kept)
    first = engine.generate([GenerationRequest("a", np.array([1, 2, 3], np.int32), 1, 1.0, 1.0, 6, [], seed=0,
                                               prefix_keys=["row"])])[0][0]
    engine.eos_ids = eos
    assert first.finish_reason == "stop" and first.routes.shape[0] == 3
    prompt = np.concatenate([[1, 2, 3], first.response_ids, [4, 5]]).astype(np.int32)
    second = engine.generate([GenerationRequest("b", prompt, 1, 1.0, 1.0, 6, [], seed=1,
                                                prefix_keys=["row"])])[0][0]
    assert engine.counters["prefix_hits"] == 1
    assert second.routes.shape[0] == len(prompt) + len(second.response_ids) - 1
    np.testing.assert_array_equal(second.routes[: len(first.routes)], first.routes)
    assert (second.routes >= 0).all()


# --- the trainer -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pack, share_prefix", [(True, True), (True, False), (False, False)])
def test_replay_equals_a_forward_with_the_routes_forced(tiny_model, pack, share_prefix):
    """With replay, each layout's log-probs equal the per-row forward with the routes forced; without it they
    differ (random routes: most differ from the model's own choice)."""
    prompts, groups = sample(tiny_model)
    batch, routes = to_batch(prompts, groups)
    forced = random_routes(routes, experts=8)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    expected = forced_logprobs(model, batch, forced)
    replay = Policy(model, pack=pack, share_prefix=share_prefix, routing_replay=True)
    with torch.no_grad():
        got, _ = replay(batch.input_ids, batch.lengths, batch.response_mask, routes=forced)
    m = batch.response_mask
    torch.testing.assert_close(got[m], expected[m], atol=1e-5, rtol=1e-5)
    stats = replay.replay.take_stats()
    assert int(stats["routes"]) > 0 and int(stats["disagree"]) / int(stats["routes"]) > 0.5
    plain = Policy(AutoModelForCausalLM.from_pretrained(tiny_model), pack=pack, share_prefix=share_prefix)
    with torch.no_grad():
        own, _ = plain(batch.input_ids, batch.lengths, batch.response_mask, routes=forced)
    assert (own[m] - expected[m]).abs().max() > 0.05


def test_replay_of_a_bf16_rollout_equals_the_forced_forward_and_its_router_still_learns(tiny_model):
    """A bf16 engine's rollouts, a bf16 trainer: replayed log-probs equal the forced forward's (bf16 rounding of
    different layouts aside), and the router weights get a gradient through the replayed weights."""
    prompts, groups = sample(tiny_model, "bfloat16", cpu_kernels=False)
    batch, routes = to_batch(prompts, groups)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    expected = forced_logprobs(model, batch, routes)
    policy = Policy(model, routing_replay=True)
    got, _ = policy(batch.input_ids, batch.lengths, batch.response_mask, routes=routes)
    m = batch.response_mask
    torch.testing.assert_close(got[m].detach(), expected[m], atol=0.05, rtol=0.02)
    (got[m].sum()).backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(model))


def test_train_step_reports_route_disagreement(tiny_model):
    """The engine's own fp32 routes: the trainer's fp32 routers agree almost everywhere (ties aside); random
    routes: most disagree. Replayed or not, the step reports the fraction; a batch without routes, nothing."""
    prompts, groups = sample(tiny_model)
    batch, routes = to_batch(prompts, groups)
    cfg = OmegaConf.create(dict(algorithm="grpo", lr=0.0, warmup_steps=0, warmup_start_lr=0.0, max_grad_norm=1.0,
                                micro_batch_groups=0, correction="none", geo_band=[0.99, 1.01], eps_low=0.5,
                                eps_high=2.0, kl_coef=0.0, entropy_coef=0.0, steps=1, lr_decay="none"))
    for replay, given, low, high in ((False, routes, 0.0, 0.02), (True, random_routes(routes, 8), 0.5, 1.0)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model)
        b = Batch(**{**batch.__dict__, "routes": given})
        metrics = train_step(Policy(model, routing_replay=replay), torch.optim.SGD(model.parameters(), lr=0.0), b,
                             cfg, 0, run=cfg)
        assert low <= metrics["routing/disagree_frac"] <= high, metrics["routing/disagree_frac"]
        # every (token, layer) route of the batch, a group's shared prompt once (the trainer runs it once)
        assert 0 < metrics["routing/routes"] <= int((given[..., 0] >= 0).sum())
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    b = Batch(**{**batch.__dict__, "routes": None})
    metrics = train_step(Policy(model), torch.optim.SGD(model.parameters(), lr=0.0), b, cfg, 0, run=cfg)
    assert "routing/disagree_frac" not in metrics


# --- the wire and the batch ------------------------------------------------------------------------------------


def test_routes_travel_with_the_rollout_into_the_train_batch(tiny_model):
    prompts, groups = sample(tiny_model, groups=1, n=2)
    s = groups[0][0]
    r = Rollout(WorkKey.sample("g", 0), "math", prompts[0], s.response_ids, s.logprobs, routes=s.routes)
    back = decode(encode(r))
    np.testing.assert_array_equal(back.routes, s.routes)
    short = Rollout(WorkKey.sample("g", 0), "math", prompts[0], s.response_ids, s.logprobs, routes=s.routes[:-1])
    assert "routes for" in short.validate()
    width = len(prompts[0]) + len(s.response_ids)
    other = Rollout(WorkKey.sample("g", 0).answer(1), "math", prompts[0], s.response_ids, s.logprobs)  # no routes
    out = batch_routes([r, other], np.array([width, width]))
    assert out.shape == (2 * width, 4, 2) and out.dtype == np.int16  # packed: row after row
    np.testing.assert_array_equal(out[: len(s.routes)], s.routes)
    assert (out[len(s.routes):] == -1).all()  # the first row's last token, then the row that came without
    assert batch_routes([other], np.array([width])) is None


def test_a_launch_that_wants_routes_from_an_engine_that_cannot_give_them_is_refused(tmp_path):
    from cascade_rl.supervisor.config import ConfigError, compose

    for engine in ("vllm", "sglang"):
        with pytest.raises(ConfigError, match=f"routing_replay.*{engine}"):
            compose("tiny", ["trainer.routing_replay=true", f"sampler.engine={engine}", f"run_dir={tmp_path}"],
                    check=True)


def test_sources_index_the_int16_routes_first_and_each_layer_widens_its_own():
    """``sources`` gathers the call's tokens from the engine's int16 routes without widening them (a micro-batch's
    routes in int64 are 4x its int16 bytes: ~3 GB at 64 x 16K x 48 layers x 8); each router's hook widens only
    its own layer, and replays exactly the routes of the tokens ``src`` names (-1: the router's own choice)."""
    from cascade_rl.kernels.moe import Routing
    from cascade_rl.modeling.routing import RoutingReplay

    class Router(torch.nn.Module):  # HF Qwen3MoeTopKRouter's output: (logits, weights, ids)
        top_k = 2

        def forward(self, h):
            logits = h @ torch.arange(8.0).repeat(h.shape[-1], 1)
            weights, ids = torch.topk(torch.softmax(logits, -1), self.top_k, dim=-1)
            return logits, weights, ids

    n, length, layers, k = 3, 5, 2, 2
    g = torch.Generator().manual_seed(0)
    routes = torch.randint(0, 8, (n, length, layers, k), dtype=torch.int16, generator=g)
    routes[1, 3:] = -1  # no routes there: the router's own
    src = torch.tensor([[7, -1, 0, 14, 8, 9]])  # a lane: rows 1 and 0 and 2, a free slot
    replay = RoutingReplay([Router(), Router()], replay=True, routing=Routing(2))  # Qwen3-MoE's
    with replay.sources(routes, src):
        held = replay._ids
        assert held.dtype == torch.int16 and tuple(held.shape) == (6, layers, k)  # indexed, not widened
        flat = routes.reshape(-1, layers, k)
        for j, s in enumerate(src[0].tolist()):
            expected = flat[s] if s >= 0 else torch.full((layers, k), -1, dtype=torch.int16)
            assert torch.equal(held[j], expected), j
        h = torch.randn(6, 4, generator=g)
        for layer, router in enumerate(replay.routers):
            _, weights, ids = router(h)
            own = torch.topk(h @ torch.arange(8.0).repeat(4, 1), k, dim=-1).indices
            given = (held[:, layer] >= 0).all(-1)
            assert ids.dtype == torch.long
            assert torch.equal(ids[given], held[given, layer].long()) and torch.equal(ids[~given], own[~given])
            torch.testing.assert_close(weights.sum(-1), torch.ones(6))
    assert replay._ids is None

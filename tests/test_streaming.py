"""Streaming a step to the trainer in parts (orchestrator.stream_tokens): the orchestrator's rules for parts, the
trainer's step accumulated over them (the same update as the whole batch), and a launch whose trainer gets its
first part before the step's last group is scored, with the weights a barrier replay of the same rollouts gives."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from cascade_rl.learner.step import Step
from cascade_rl.learner.trainer import Batch, train_step
from cascade_rl.modeling.models import load_model
from cascade_rl.modeling.policy import Policy
from cascade_rl.orchestrator.assembly import Assembly, shares, tokens
from cascade_rl.orchestrator.groups import Group
from cascade_rl.orchestrator.refill import KeepRate, to_dispatch
from cascade_rl.protocol.messages import Rollout, SamplingParams, WorkKey
from cascade_rl.protocol.rows import from_padded

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import RUN, cfg, make_batch  # noqa: E402

CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]


# ------------------------------------------------------------------ the orchestrator's parts


def group(k: int, tokens: int) -> Group:
    """Group ``k`` (dispatch order) of 2 rows, ``tokens`` tokens in all."""
    g = Group(f"s0g{k}", None, np.zeros(1, np.int32), 2, SamplingParams(), 0, True, 0)
    for i in range(2):
        g.rollouts[i] = Rollout(WorkKey.sample(g.group_id, 0).answer(i), "math", np.zeros(tokens // 2 - 1, np.int32),
                                np.zeros(1, np.int32), np.zeros(1, np.float32), "stop", 0)
    return g


def test_without_streaming_the_step_is_one_part_in_dispatch_order():
    parts = Assembly(4, order=lambda g: int(g.group_id[3:]))
    assert parts.add([group(3, 100), group(1, 100)]) == []
    (part,) = parts.add([group(2, 100), group(0, 100)])
    assert [g.group_id for g in part.groups] == ["s0g0", "s0g1", "s0g2", "s0g3"]
    assert (part.index, part.last, parts.done) == (0, True, True)


def test_parts_hold_enough_tokens_split_evenly_and_the_last_completes_the_step():
    parts = Assembly(6, dp=2, stream_tokens=150)
    assert parts.add([group(0, 200)]) == []  # enough tokens, but one group does not split between 2 ranks
    (first,) = parts.add([group(1, 10)])
    assert ([g.group_id for g in first.groups], first.index, first.last) == (["s0g0", "s0g1"], 0, False)
    assert parts.add([group(2, 50), group(3, 50)]) == []  # 100 tokens: not yet
    assert parts.add([group(4, 60)]) == []  # 160 tokens, in 3 groups
    (last,) = parts.add([group(5, 10)])  # the step's sixth group: whatever is pending completes it
    assert ([g.group_id for g in last.groups], last.index, last.last) == (["s0g2", "s0g3", "s0g4", "s0g5"], 1, True)
    assert parts.done


def test_each_rank_gets_as_many_groups_with_balanced_tokens():
    groups = [group(k, t) for k, t in enumerate([400, 40, 300, 60, 200, 100])]
    first, second = shares(groups, 2)
    assert len(first) == len(second) == 3
    assert sorted(g.group_id for g in first + second) == sorted(g.group_id for g in groups)
    load = [sum(tokens(g) for g in s) for s in (first, second)]
    assert abs(load[0] - load[1]) <= 60, load  # contiguous halves would be 740 against 360
    assert [g.group_id for g in first] == sorted(g.group_id for g in first)  # each share in the groups' order
    with pytest.raises(ValueError, match="5 groups do not split among 2"):
        shares(groups[:5], 2)


def test_a_step_never_takes_more_groups_than_it_trains():
    parts = Assembly(2, stream_tokens=1)
    parts.add([group(0, 4), group(1, 4)])
    with pytest.raises(ValueError, match="3 groups kept for a step of 2"):
        parts.add([group(2, 4)])
    with pytest.raises(ValueError, match="a step of 3 groups on 2 data-parallel ranks"):
        Assembly(3, dp=2)


# ------------------------------------------------------------------ the trainer's step over parts


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("micro", [1, 2])
def test_parts_make_the_update_of_the_whole_batch_bit_for_bit(tiny_dense_model, micro):
    """The step's groups in two parts of two give the whole batch's update, bit for bit, when the micro-batches
    are the same groups in the same order; the metrics agree too."""
    batch = make_batch(groups=4, seed=3)
    c = cfg(micro_batch_groups=micro, lr=1e-3)
    whole = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
    opt = torch.optim.AdamW(whole.parameters(), lr=1e-3)
    expected = train_step(Policy(whole), opt, batch, c, step=0, run=RUN)
    parted = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
    opt2 = torch.optim.AdamW(parted.parameters(), lr=1e-3)
    step = Step(Policy(parted), opt2, c, 0, run=RUN, groups=4)
    step.add(batch.rows(slice(0, 8)))
    assert not step.complete
    step.add(batch.rows(slice(8, 16)))
    got = step.finish()
    assert all(torch.equal(a, b) for a, b in zip(params(whole).values(), params(parted).values()))
    assert got.keys() == expected.keys()
    for k in expected:
        assert got[k] == pytest.approx(expected[k], rel=1e-6, abs=1e-9), k


def test_parts_in_another_order_make_the_same_update_to_rounding(tiny_dense_model):
    batch = make_batch(groups=4, seed=5)
    models = [AutoModelForCausalLM.from_pretrained(tiny_dense_model) for _ in range(2)]
    for model, order in zip(models, ([slice(0, 8), slice(8, 16)], [slice(12, 16), slice(0, 12)])):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        step = Step(Policy(model), opt, cfg(), 0, run=RUN, groups=4)
        for rows in order:
            step.add(batch.rows(rows))
        step.finish()
    for (name, a), b in zip(params(models[0]).items(), params(models[1]).values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


def test_a_step_refuses_extra_groups_and_an_early_finish(tiny_dense_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_dense_model)
    step = Step(Policy(model), torch.optim.SGD(model.parameters(), lr=0.0), cfg(), 0, run=RUN, groups=3)
    step.add(make_batch(groups=2))
    with pytest.raises(ValueError, match="the step took 2 of its 3 groups"):
        step.finish()
    with pytest.raises(ValueError, match="parts of 4 groups for a step of 3"):
        step.add(make_batch(groups=2))


# ------------------------------------------------------------------ a launch


def launch_scored_by(tmp_path: Path, model: str, reward: str, *overrides: str) -> Path:
    """A ``tiny`` launch (no evaluation) on 40 prompts "i + 1 =" of a domain scored by ``reward``, a Python
    expression of ``response`` and ``reference`` (the answer, i + 1), registered by a verifier plugin: its run_dir."""
    run_dir, data, plugin = tmp_path / "run", tmp_path / "prompts.jsonl", tmp_path / "reward.py"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "domain": "test_reward", "answer": str(i + 1)}) + "\n"
                            for i in range(40)))
    plugin.write_text("from cascade_rl.verifiers.registry import register_verifier\n\n\n"
                      "@register_verifier('test_reward')\n"
                      f"def reward(response, reference, metadata):\n    return {reward}\n")
    r = subprocess.run([*CLI, "launch", "tiny", f"run_dir={run_dir}", f"model.path={model}", f"data.files=[{data}]",
                        f"verifier.plugins=[{plugin}]", "supervisor.progress=plain", "orchestrator.eval_n=0",
                        "orchestrator.eval_greedy=false", *overrides], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return run_dir


def replay_barrier(model_path: str, run_dir: Path, c, steps: int) -> dict[str, torch.Tensor]:
    """The launch's saved rollouts (rollouts.jsonl), each step as one batch in the order the trainer trained them,
    trained from the start as the barrier mode would (``train_step``, the trainer's own optimizer)."""
    from cascade_rl.learner.optim import MasterAdamW

    rows = defaultdict(list)
    for line in (run_dir / "rollouts.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows[r["step"]].append(r)
    model = load_model(model_path, c)  # as the trainer loads it: model.dtype, attention and experts
    policy = Policy(model, c.sampling.temperature, c.trainer.logprob_chunk_tokens, c.trainer.pack,
                    c.trainer.pack_tokens, c.trainer.logprob_impl, c.trainer.share_prefix)
    opt = MasterAdamW([p for p in policy.parameters() if p.requires_grad], lr=c.trainer.lr,
                      betas=tuple(c.trainer.betas), weight_decay=c.trainer.weight_decay)
    for s in range(steps):
        step_rows = rows[s]
        width = max(len(r["ids"]) for r in step_rows)
        ids = np.zeros((len(step_rows), width), np.int32)
        mask, inf = np.zeros(ids.shape, bool), np.zeros(ids.shape, np.float32)
        for i, r in enumerate(step_rows):
            n = len(r["ids"])
            ids[i, :n], mask[i, :n], inf[i, :n] = r["ids"], r["loss_mask"], r["logprobs"]
        msg = from_padded(step=s, group_size=c.run.group_size, input_ids=ids, response_mask=mask, inf_logprobs=inf,
                          rewards=np.array([r["reward"] for r in step_rows], np.float32),
                          versions=np.zeros(len(step_rows), np.int32), lengths=[len(r["ids"]) for r in step_rows])
        train_step(policy, opt, Batch.from_message(msg), c.trainer, s, run=c.run)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_a_streamed_launch_trains_parts_before_the_last_group_is_scored(tiny_model, tmp_path):
    """One group at a time at the sampler (slots = group size, 0.3 s a generate call), every kept group its own
    part: the trainer's first part of each step comes before the step's last group is settled in the ledger, the
    trainer's ids are the ledger's, and the final weights are the ones a barrier replay of the same rollouts gives
    (rewards that differ within each group: a response of an odd length wins, so every step moves the weights)."""
    run_dir = launch_scored_by(tmp_path, tiny_model, "float(len(response) % 2)", "run.steps=2",
                               "run.prompts_per_step=4", "sampler.slots=4", "sampler.delay_s=0.3",
                               "orchestrator.stream_tokens=1", "orchestrator.save_rollouts=true",
                               "trainer.micro_batch_groups=1", "trainer.threads=1")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["books"]["trainer_ids"]["match"] and summary["books"]["lost"] == 0
    ledger = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    trained = [json.loads(x) for x in (run_dir / "trained_ids.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == [0, 1]
    for t in trained:
        settled = [x["t"] for x in ledger if x["step"] == t["step"] and x.get("fate") in ("trained", "filtered", "stale")]
        first_part = t["parts"][0][0]
        assert len(t["parts"]) > 1 and sum(n for _, n in t["parts"]) == len(t["ids"])
        assert first_part < max(settled), (t, max(settled))  # training began before the step's last group settled
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["trainer/parts"] > 1 for m in metrics if "trainer/parts" in m)
    c = OmegaConf.load(run_dir / "config.yaml")
    start = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the trainer's (trainer.threads=1): the same kernels, the same rounding
    try:
        expected = replay_barrier(tiny_model, run_dir, c, 2)
    finally:
        torch.set_num_threads(threads)
    final = AutoModelForCausalLM.from_pretrained(next((run_dir / "checkpoints").glob("step_*2"))).state_dict()
    assert set(final) <= set(expected) and len(final) > 10
    changed = 0
    for name, value in final.items():
        assert torch.equal(value, expected[name].to(value.dtype)), name
        changed += not torch.equal(value, start[name].to(value.dtype))
    assert changed > len(final) // 2  # the steps moved the weights: the equality is of trained weights


# ------------------------------------------------------------------ refills and over-dispatch


def test_without_over_dispatch_a_step_keeps_what_it_needs_in_flight():
    assert to_dispatch(missing=16, in_flight=0, keep_rate=0.3, most=1.0) == 16
    assert to_dispatch(missing=5, in_flight=3, keep_rate=0.3, most=1.0) == 2  # 3 filtered: replaced at once
    assert to_dispatch(missing=0, in_flight=3, keep_rate=0.3, most=1.0) == 0


def test_over_dispatch_divides_by_the_keep_rate_up_to_its_most():
    assert to_dispatch(missing=10, in_flight=0, keep_rate=0.5, most=4.0) == 20
    assert to_dispatch(missing=10, in_flight=15, keep_rate=0.5, most=4.0) == 5
    assert to_dispatch(missing=10, in_flight=0, keep_rate=0.01, most=4.0) == 40  # capped
    assert to_dispatch(missing=10, in_flight=0, keep_rate=1.0, most=4.0) == 10  # nothing filtered: no surplus
    rate = KeepRate()
    assert rate.value == 1.0
    rate.add(kept=0, settled=1)
    assert rate.value == 0.8  # one filtered group among the prior's four kept
    rate.add(kept=1, settled=4)
    assert rate.value == pytest.approx(5 / 9)
    rate.add(kept=0, settled=300)  # the last WINDOW groups only
    assert rate.value == pytest.approx(4 / 260)


def test_cancelled_groups_are_filtered_as_surplus_and_free_their_sampler(tmp_path):
    from test_orchestrator_core import PROMPT, ROW, S0, V0, Clock, join, ledger_lines, make, rollout, sent

    from cascade_rl.protocol.messages import PromptRequest

    core = make(Clock(), tmp_path)
    join(core, S0, "sampler", slots=4)
    join(core, V0, "verifier")
    g = core.add_group(ROW, PROMPT, 4, SamplingParams(), train=True, step=0)
    (ident, req), = sent(core, PromptRequest)
    core.receive(ident, rollout(req, 0))
    assert core.pool.items("sampler") == 1
    core.cancel([g], "surplus: step 0 was complete")
    assert core.pool.items("sampler") == 0 and core.pool.items("verifier") == 0
    core.receive(ident, rollout(req, 1))  # late: dropped, written as a duplicate of its settled id
    books = core.books()
    assert books["filtered"] == 4 and books["lost"] == 0 and books["filtered_reasons"] == {
        "surplus: step 0 was complete": 4}
    assert [x["fate"] for x in ledger_lines(tmp_path)].count("filtered") == 4


@pytest.mark.slow
def test_over_dispatch_with_filtering_and_streaming_closes_the_books(tiny_model, tmp_path):
    """Dynamic filtering drops about half the groups (rows with an even answer always reward 1), the keep rate so
    learnt makes later steps dispatch ahead (orchestrator.over_dispatch=3), the groups a complete step no longer
    needs are cancelled as surplus, and every rollout still has one fate, the trainer's ids the ledger's."""
    run_dir = launch_scored_by(tmp_path, tiny_model, "1.0 if int(reference) % 2 == 0 else float(len(response) % 2)",
                               "run.steps=3", "orchestrator.dynamic_filtering=true", "orchestrator.over_dispatch=3",
                               "orchestrator.stream_tokens=1")
    books = json.loads((run_dir / "summary.json").read_text())["books"]
    assert books["lost"] == 0 and books["in_flight"] == 0 and books["trainer_ids"]["match"]
    assert books["trained"] == 3 * 8 * 4 and books["filtered_reasons"].get("uniform_rewards", 0) > 0
    assert set(books["filtered_reasons"]) <= {"uniform_rewards", *(f"surplus: step {s} was complete" for s in range(3))}
    assert books["dispatched"] == books["trained"] + books["filtered"]
    log = (run_dir / "logs" / "orchestrator.log").read_text()
    assert "step 1: " in log and "ahead; keep rate" in log, log[-2000:]

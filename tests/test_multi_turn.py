"""Multi-turn rollouts, token-exact: the chat template's side (data/render.py ``TurnRenderer``), the orchestrator's
rules for trajectories (orchestrator/core.py and its trajectories.py) driven by messages and a fake clock, and the
batch the trainer gets (observation tokens carry no loss). Real engines and a real launch:
tests/test_multi_turn_launch.py. The ``Trajectories`` component alone: tests/test_trajectories.py."""

from __future__ import annotations

import numpy as np
import pytest

from cascade_rl.data.rows import Row
from cascade_rl.orchestrator import trajectory
from cascade_rl.orchestrator.batch import build_batch
from cascade_rl.orchestrator.core import Core
from cascade_rl.orchestrator.ledger import Ledger
from cascade_rl.orchestrator.rules import Rules
from cascade_rl.protocol import records
from cascade_rl.protocol.messages import (
    EnvReply,
    EnvRequest,
    PromptRequest,
    Ready,
    Rollout,
    SamplingParams,
    Score,
    ScoreRequest,
    WorkKey,
)
from cascade_rl.protocol.rows import pad
from cascade_rl.protocol.sockets import UNREACHABLE

CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(47*83)"}}</tool_call>'
USER = ({"role": "user", "content": "Calculate 47 * 83. Use the python tool. Put the final answer in \\boxed{}."},)
S0, S1, V0, E0, E1 = b"sampler-0", b"sampler-1", b"verifier-0", b"environment-0", b"environment-1"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def model_turn(tokenizer, text: str) -> np.ndarray:
    """A model turn as the engine returns it: its tokens, ending with the end-of-turn token."""
    return np.array(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id], np.int32)


def template_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    """The template's rendering of a whole conversation, tokenised by the template call itself."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        enable_thinking=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# --------------------------------------------------------------------------- the template's side


def test_trajectory_ids_equal_the_templates_rendering_at_every_boundary(tokenizer, turns):
    """assistant -> tool -> assistant -> tool -> assistant: the trajectory built turn by turn (model tokens as
    sampled, observations from ``observation_ids``) is token for token the template's rendering of the whole
    conversation, each model turn's end-of-turn and the template's separator after it included."""
    render = turns.render
    ids = render.ids(USER)
    messages = list(USER)
    for k, (text, tool) in enumerate([(f"</think>\n\n{CALL}", "3901\n"), (f"</think>\n\n{CALL}", "oops\n")]):
        turn = model_turn(tokenizer, text)
        ids += turn.tolist()
        messages += [{"role": "assistant", "content": turns.assistant_text(turn)}, {"role": "tool", "content": tool}]
        obs = turns.observation_ids(np.array(ids), messages)
        assert tokenizer.decode(obs).startswith("\n"), "the template's newline after <|im_end|> is the observation's"
        ids += obs
        expected = template_ids(tokenizer, messages, add_generation_prompt=True)
        assert ids == expected, f"boundary {k}: trajectory ids differ from the template's"
    final = model_turn(tokenizer, "</think>\n\n\\boxed{3901}")
    ids += final.tolist()
    messages.append({"role": "assistant", "content": turns.assistant_text(final)})
    whole = template_ids(tokenizer, messages, add_generation_prompt=False)
    assert ids == whole[: len(ids)] and tokenizer.decode(whole[len(ids):]) == "\n"  # template's own close


def test_a_template_that_rewrites_history_is_refused_with_where(tokenizer, turns):
    turn = model_turn(tokenizer, f"</think>\n\n{CALL}")
    ids = turns.render.ids(USER) + turn.tolist()
    rewritten = [*USER, {"role": "assistant", "content": "something else"}, {"role": "tool", "content": "1"}]
    with pytest.raises(ValueError, match="does not extend the trajectory"):
        turns.observation_ids(np.array(ids), rewritten)


# --------------------------------------------------------------------------- the orchestrator's rules


def make(clock, turns, tmp_path, **options) -> Core:
    return Core(Rules(**options), decode=lambda ids: "", ledger=Ledger(tmp_path / "ledger.jsonl"), clock=clock,
                template=turns)


def join(core: Core, ident: bytes, role: str, domains=("tool_use",), slots: int = 64) -> None:
    core.receive(ident, Ready(ident.decode(), role, slots, 0, list(domains)))


def sent(core: Core, kind: type) -> list[tuple[bytes, object]]:
    """What the core sent of ``kind`` since it was last asked (messages of other kinds wait for their turn)."""
    core.dispatch()
    unread = core.__dict__.setdefault("unread", [])
    unread += core.take_outbox()
    out = [(i, m) for i, m in unread if isinstance(m, kind)]
    unread[:] = [(i, m) for i, m in unread if not isinstance(m, kind)]
    return out


def turn_rollout(req: PromptRequest, index: int, ids: np.ndarray, finish: str = "stop", sampler: str = "s0") -> Rollout:
    return Rollout(req.key.answer(index), req.domain, req.prompt_ids, ids, np.full(len(ids), -0.25, np.float32),
                   finish, 0, sampler)


@pytest.fixture
def world(tokenizer, turns, tmp_path):
    clock = Clock()
    core = make(clock, turns, tmp_path, max_turns=3, env_timeout_s=10.0)
    join(core, S0, "sampler", ())
    join(core, V0, "verifier")
    join(core, E0, "environment", ("python",))
    row = Row("r0", USER, "tool_use", "3901", {})
    prompt = np.array(turns.render.ids(USER), np.int32)
    g = core.add_group(row, prompt, 2, SamplingParams(max_tokens=64), train=True, step=0, env="python")
    return clock, core, g, prompt


def test_a_trajectory_through_sampler_environment_and_verifier(world, tokenizer, tmp_path):
    clock, core, g, prompt = world
    (s, req), = sent(core, PromptRequest)
    call, answer = model_turn(tokenizer, f"</think>\n\n{CALL}"), model_turn(tokenizer, "</think>\n\n\\boxed{3901}")
    core.receive(s, turn_rollout(req, 0, call))
    core.receive(s, turn_rollout(req, 1, answer))  # row 1 answers at once: no tool call -> its env says done
    steps = dict((m.key, m) for _, m in sent(core, EnvRequest))
    assert set(steps) == {WorkKey.step(g.group_id, 0, "env", 1, 0), WorkKey.step(g.group_id, 1, "env", 1, 0)}
    assert sorted(map(str, steps)) == [f"{g.group_id}/0:env1/0", f"{g.group_id}/1:env1/0"]  # as logs name them
    step0 = steps[WorkKey.step(g.group_id, 0, "env", 1, 0)]
    assert step0.env == "python" and step0.messages[-1]["role"] == "assistant" and CALL in step0.messages[-1]["content"]
    core.receive(E0, EnvReply(step0.key, False, [{"role": "tool", "content": "3901\n"}], {"cells": ["print(47*83)"]},
                              tool_calls=1))
    core.receive(E0, EnvReply(WorkKey.step(g.group_id, 1, "env", 1, 0), True))
    (s2, cont), = sent(core, PromptRequest)  # row 0's second turn: the whole trajectory is its prompt
    assert cont.key == WorkKey.step(g.group_id, 0, "gen", 1, 0) and cont.n == 1 and cont.keep
    used = len(cont.prompt_ids) - len(prompt)  # the turn samples at most what the budget leaves
    assert cont.sampling.max_tokens == min(64, 3 * 64 - used)
    core.receive(s2, turn_rollout(cont, 0, answer))
    (_, step2), = sent(core, EnvRequest)
    assert step2.key == WorkKey.step(g.group_id, 0, "env", 2, 0) and step2.state == {"cells": ["print(47*83)"]}
    core.receive(E0, EnvReply(step2.key, True))
    scores = sent(core, ScoreRequest)
    assert sorted(r.text.endswith("\\boxed{3901}") for _, r in scores) == [True, True]  # the final turn is scored
    for v, r in scores:
        core.receive(v, Score(r.key, 1.0, True))
    assert g.complete
    t0 = g.trajectories[0]
    assert t0.turn == 2 and t0.tool_calls == 1
    # the trained rollout: prompt, model turn, observation, model turn; the loss on the model's tokens only
    r0 = g.rollouts[0]
    assert r0.response_ids.tolist() == cont.prompt_ids[len(prompt):].tolist() + answer.tolist()
    obs = len(cont.prompt_ids) - len(prompt) - len(call)
    assert r0.loss_mask.tolist() == [True] * len(call) + [False] * obs + [True] * len(answer)
    assert (r0.inf_logprobs[~r0.loss_mask] == 0).all()
    kept = core.settle([g])
    batch = build_batch(0, kept, 2, False, False, {})
    row0 = pad(batch.response_mask, batch.lengths)[0]
    assert row0.sum() == len(call) + len(answer) and not row0[len(prompt) + len(call): len(cont.prompt_ids)].any()
    assert pad(batch.input_ids, batch.lengths)[0, : len(cont.prompt_ids)].tolist() == cont.prompt_ids.tolist()
    summary = trajectory.summary(list(g.trajectories.values()))
    assert summary["turns_mean"] == 1.5 and summary["tool_calls_mean"] == 0.5
    assert summary["observation_token_frac"] == pytest.approx(obs / (len(call) + obs + 2 * len(answer)))


def test_an_environment_worker_killed_mid_trajectory_loses_nothing(world, tokenizer, tmp_path):
    """The worker holding a step goes away: the step (with its state) goes to another environment worker under
    the same key; a late reply from the first counts as a duplicate in the ledger, and the rollout has one fate."""
    clock, core, g, _ = world
    join(core, E1, "environment", ("python",))
    (s, req), = sent(core, PromptRequest)
    call = model_turn(tokenizer, f"</think>\n\n{CALL}")
    for i in range(2):
        core.receive(s, turn_rollout(req, i, call))
    first = {m.key: ident for ident, m in sent(core, EnvRequest)}
    victim = first[WorkKey.step(g.group_id, 0, "env", 1, 0)]
    other = E1 if victim == E0 else E0
    core.receive(victim, UNREACHABLE)
    again = {m.key: ident for ident, m in sent(core, EnvRequest)}
    lost_keys = [k for k, ident in first.items() if ident == victim]
    assert set(again) == set(lost_keys) and set(again.values()) == {other}
    for key in {**first, **again}:
        if key in again or first[key] == other:
            core.receive(other, EnvReply(key, True))
    core.receive(victim, EnvReply(lost_keys[0], True))  # the dead worker's reply arrives after all
    for v, r in sent(core, ScoreRequest):
        core.receive(v, Score(r.key, 0.0, True))
    assert g.complete
    core.trained(core.settle([g]))
    lines = [x for x in records.read(tmp_path / "ledger.jsonl") if "fate" in x]  # dispatches are events
    fates = [(x["id"], x["fate"]) for x in lines]
    assert sorted(f for f in fates if f[1] == "trained") == [(f"{g.group_id}/0", "trained"),
                                                             (f"{g.group_id}/1", "trained")]
    assert ("duplicate" in {f for _, f in fates}) and core.books()["lost"] == 0


def test_a_step_past_its_deadline_is_sent_again_and_env_errors_fail_the_group(world, tokenizer):
    clock, core, g, _ = world
    (s, req), = sent(core, PromptRequest)
    call = model_turn(tokenizer, f"</think>\n\n{CALL}")
    for i in range(2):
        core.receive(s, turn_rollout(req, i, call))
    first = sent(core, EnvRequest)
    clock.now = 11.0
    core.expire()
    again = sent(core, EnvRequest)
    assert sorted(str(m.key) for _, m in again) == sorted(str(m.key) for _, m in first)
    core.receive(E0, EnvReply(again[0][1].key, False, ok=False, error="no environment 'pythn'"))
    assert g.complete and g.error.startswith("env_error: no environment")


def test_a_truncated_turn_or_the_last_turn_ends_the_trajectory(world, tokenizer):
    clock, core, g, _ = world
    (s, req), = sent(core, PromptRequest)
    call = model_turn(tokenizer, f"</think>\n\n{CALL}")
    core.receive(s, turn_rollout(req, 0, call[:-1], finish="length"))  # cut at max_tokens: no step
    core.receive(s, turn_rollout(req, 1, call))
    (_, step), = sent(core, EnvRequest)
    assert (step.key.group, step.key.index, step.key.kind) == (g.group_id, 1, "env")
    assert g.trajectories[0].phase == "done" and 0 in g.rollouts
    # row 1 keeps calling: after max_turns (3) model turns it ends without another step
    for turn in (1, 2):
        core.receive(E0, EnvReply(WorkKey.step(g.group_id, 1, "env", turn, 0), False,
                                  [{"role": "tool", "content": "3901\n"}]))
        (s2, cont), = sent(core, PromptRequest)
        core.receive(s2, turn_rollout(cont, 1, call))
        if turn == 1:
            (_, step), = sent(core, EnvRequest)
    assert not sent(core, EnvRequest) and g.trajectories[1].turn == 3 and 1 in g.rollouts


@pytest.mark.skipif(not __import__("cascade_rl.verifiers.sandbox", fromlist=["x"]).isolation_available(),
                    reason="the python tool's sandbox needs root on Linux")
def test_hanging_crashing_and_fork_bombing_tools_fail_closed_and_the_trajectory_goes_on(tokenizer, turns, tmp_path):
    """The real python environment (sandboxed) answers each hostile call with an error observation and the reason;
    the model's next turn still comes, the rollout is trained, and the ledger has exactly one fate for each."""
    from cascade_rl.environments.base import EnvSettings
    from cascade_rl.environments.registry import build_environment
    from cascade_rl.environments.steps import run_step

    hostile = {"hang": "while True: pass", "crash": "import os; os.kill(os.getpid(), 9)",
               "fork bomb": "import os\\nwhile True: os.fork()"}
    env = build_environment("python", EnvSettings(tool_timeout_s=2.0, max_processes=16))
    clock = Clock()
    core = make(clock, turns, tmp_path, max_turns=2, env_timeout_s=30.0)
    join(core, S0, "sampler", ())
    join(core, V0, "verifier")
    join(core, E0, "environment", ("python",))
    g = core.add_group(Row("r0", USER, "tool_use", "3901", {}), np.array(turns.render.ids(USER), np.int32),
                       len(hostile), SamplingParams(max_tokens=64), train=True, step=0, env="python")
    (s, req), = sent(core, PromptRequest)
    for i, code in enumerate(hostile.values()):
        call = f'</think>\n\n<tool_call>{{"name": "python", "arguments": {{"code": "{code}"}}}}</tool_call>'
        core.receive(s, turn_rollout(req, i, model_turn(tokenizer, call)))
    observations = {}
    for _, step in sent(core, EnvRequest):
        reply = run_step(env, step)
        assert reply.ok and reply.tool_errors == 1, reply
        observations[step.key.index] = reply.tool_messages[0]["content"]
        core.receive(E0, reply)
    assert "timed out" in observations[0] and "killed by signal 9" in observations[1], observations
    assert "Resource temporarily unavailable" in observations[2] or "timed out" in observations[2], observations
    for s2, cont in sent(core, PromptRequest):  # the model recovers: its next turn answers
        core.receive(s2, turn_rollout(cont, cont.key.index, model_turn(tokenizer, "</think>\n\n\\boxed{3901}")))
    for v, r in sent(core, ScoreRequest):
        core.receive(v, Score(r.key, 1.0, True))
    assert g.complete and not g.error
    assert [g.trajectories[i].tool_errors for i in range(3)] == [1, 1, 1] and g.trajectories[0].timeouts == 1
    core.trained(core.settle([g]))
    fates = [(x["id"], x["fate"]) for x in records.read(tmp_path / "ledger.jsonl") if "fate" in x]
    assert sorted(fates) == [(f"{g.group_id}/{i}", "trained") for i in range(3)] and core.books()["lost"] == 0

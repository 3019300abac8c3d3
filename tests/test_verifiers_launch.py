"""PrimeIntellect ``verifiers`` environments trained unchanged (``data.verifiers_env``): a ``SingleTurnEnv`` and a
``ToolEnv`` (tests/test_agents_verifiers.py), each a real launch of 2 steps where the environment's dataset is the prompt set, its own
rollout runs against the run's gateway, and its rubric's scores are the rewards trained on."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from test_agents_verifiers import ENV_MODULE  # its SingleTurnEnv and ToolEnv; rubric calls logged
from test_launch import CLI


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["single", "tool"])
def test_a_verifiers_environment_trains_two_steps_on_its_rubrics_rewards(tiny_model, tmp_path, kind):
    (tmp_path / "my_env.py").write_text(ENV_MODULE)
    run_dir = tmp_path / "run"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"), VF_TEST_SCORED=str(tmp_path / "scored.jsonl"))
    r = subprocess.run([*CLI, "launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}",
                        f"data.verifiers_env={tmp_path / 'my_env.py'}", f"+data.verifiers_args.kind={kind}", "+data.verifiers_args.n=12",
                        "run.steps=2", "run.prompts_per_step=2", "run.group_size=2", "orchestrator.eval_n=0",
                        "orchestrator.dynamic_filtering=false", "orchestrator.save_rollouts=true",
                        "supervisor.progress=none"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    books = summary["books"]
    assert books["trained"] == 8 and books["lost"] == 0 and books["trainer_ids"]["match"], books
    scored = [json.loads(x) for x in (tmp_path / "scored.jsonl").read_text().splitlines()]
    trained = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(trained) == 8 and all(t["row"].startswith("verifiers-train-") for t in trained)
    data = {f"verifiers-train-{i}": str(2 * i) for i in range(12)}
    for t in trained:  # each reward trained on is one the rubric gave for that row's answer
        assert {"answer": data[t["row"]], "reward": pytest.approx(t["reward"])} in scored, t["row"]
    assert sum(t["loss_mask"].count(1) for t in trained) > 0

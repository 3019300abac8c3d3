"""One base, many heads (teachers/server.py ``Teacher.load_heads``): MOPD teachers that are LoRA adapters of one
base share one teacher server, which holds the base once and selects each request's adapter by its domain. Its
log-probs, and so a MOPD step, equal those of one teacher per merged full model; the supervisor groups such
teachers into one server (supervisor/procs.py ``teacher_groups``), and that server, started as a launch starts
it, answers each domain with its own adapter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_lora_export import make_adapter
from test_teacher import Orchestrator, groups, run_config

from cascade_rl.learner.losses import mopd_loss
from cascade_rl.modeling.models import load_model
from cascade_rl.modeling.policy import Policy
from cascade_rl.supervisor.export import merge_to
from cascade_rl.supervisor.procs import teacher_args, teacher_groups
from cascade_rl.teachers.server import Teacher, batch_rows


@pytest.fixture(scope="module")
def heads(tiny_model, tmp_path_factory) -> dict:
    """Two LoRA checkpoints of the tiny base (math, code) and each one's merged full model."""
    root = tmp_path_factory.mktemp("lora-teachers")
    out = {}
    for seed, domain in enumerate(("math", "code"), start=1):
        adapter = make_adapter(tiny_model, root / f"{domain}-adapter", seed=seed)
        out[domain] = (adapter, merge_to(adapter, root / f"{domain}-merged"))
    return out


def mixed(seed: int) -> list:
    """math and code requests interleaved, at two temperatures."""
    reqs = groups(seed, 3, 1.0, "math") + groups(seed + 1, 3, 1.0, "code") + groups(seed + 2, 2, 0.7, "code")
    return [reqs[i] for i in np.random.default_rng(seed).permutation(len(reqs))]


def test_one_base_many_heads_equals_one_teacher_per_merged_model(tiny_model, heads, tmp_path):
    cfg = run_config(tiny_model, tmp_path)
    many = Teacher.load_heads(tiny_model, {d: str(a) for d, (a, _) in heads.items()}, ["mcqa"], cfg)
    assert many.domains == ["code", "math", "mcqa"]
    full = {d: Teacher.load(str(m), [d], cfg) for d, (_, m) in heads.items()}
    base = Teacher.load(tiny_model, ["mcqa"], cfg)
    reqs = mixed(0) + groups(9, 2, 1.0, "mcqa")  # mcqa: the base itself (its adapters off)
    assert many.forwards(reqs) == 4  # (1.0, math), (1.0, code), (0.7, code), (1.0, base)
    got = many.logprobs(reqs)
    want: dict = {}  # each domain's requests from its own full model, in one batch
    for domain in ("math", "code", "mcqa"):
        mine = [r for r in reqs if r.domain == domain]
        want.update(zip((r.key for r in mine), (full.get(domain) or base).logprobs(mine)))
    for req, values in zip(reqs, got):
        np.testing.assert_allclose(values, want[req.key], atol=1e-5, rtol=0)
    # the heads differ from each other and from the base (the comparison above is not vacuous)
    req = reqs[0]
    others = [t.logprobs([req])[0] for t in (*full.values(), base) if req.domain not in t.domains]
    assert len(others) == 2 and all(np.abs(o - got[0]).max() > 1e-3 for o in others)

    # a MOPD step (the loss and its gradient) of a student on these requests: the same with either teachers
    student = Policy(load_model(tiny_model, cfg), 1.0)
    for temperature in (1.0, 0.7):
        members = [i for i, r in enumerate(reqs) if r.temperature == temperature]
        group = [reqs[i] for i in members]
        ids, lengths, mask = batch_rows(group)
        student.temperature = temperature

        def step(teacher_values, ids=ids, lengths=lengths, mask=mask):
            student.model.zero_grad()
            lp, _ = student(ids, lengths, mask)
            teacher_lp = torch.zeros_like(lp)
            teacher_lp[mask] = torch.from_numpy(np.concatenate(teacher_values))
            loss = mopd_loss(lp, teacher_lp, lp.detach(), mask)
            loss.backward()
            return loss.item(), {n: p.grad.clone() for n, p in student.model.named_parameters() if p.grad is not None}

        loss_heads, grads_heads = step([got[i] for i in members])
        loss_full, grads_full = step([want[r.key] for r in group])
        assert abs(loss_heads - loss_full) < 1e-5 and grads_heads.keys() == grads_full.keys()
        for n in grads_full:
            torch.testing.assert_close(grads_heads[n], grads_full[n], atol=1e-5, rtol=1e-4)


def test_the_supervisor_groups_adapters_of_one_base_into_one_server(tiny_model, heads, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    teachers = {"math": str(heads["math"][0]), "code": str(heads["code"][0]), "mcqa": tiny_model,
                "chat": str(other)}
    groups_ = teacher_groups(teachers)
    base = str(Path(tiny_model).resolve())
    assert groups_ == {str(other.resolve()): {"chat": ""},
                       base: {"code": str(heads["code"][0].resolve()), "math": str(heads["math"][0].resolve()),
                              "mcqa": ""}}
    assert teacher_args(base, groups_[base]) == [
        "--model", base, "--domains", "code,math,mcqa",
        "--adapter", f"code={heads['code'][0].resolve()}", "--adapter", f"math={heads['math'][0].resolve()}"]
    # full checkpoints: one server each, as before
    assert teacher_args(*next(iter(teacher_groups({"a": tiny_model, "b": tiny_model}).items()))) == [
        "--model", base, "--domains", "a,b"]


@pytest.mark.slow
def test_a_teacher_server_of_adapters_answers_each_domain_with_its_head(tiny_model, heads, tmp_path):
    cfg = run_config(tiny_model, tmp_path)
    o = Orchestrator(cfg, tmp_path)
    (model, members), = teacher_groups({d: str(a) for d, (a, _) in heads.items()}).items()
    o.logs["teacher-0"] = log = open(tmp_path / "teacher-0.log", "wb")
    import subprocess
    import sys

    o.procs["teacher-0"] = subprocess.Popen(
        [sys.executable, "-P", "-m", "cascade_rl.teachers.server", "--config", str(o.config), "--worker-id",
         "teacher-0", *teacher_args(model, members)], stdout=log, stderr=log)
    try:
        o.wait_ready("teacher-0")
        assert o.readies[-1].domains == ["code", "math"]
        reqs = mixed(3)
        for r in reqs:
            o.send("teacher-0", r)
        replies = o.replies_for([r.key for r in reqs])
        assert all(m.ok for m in replies), [m.error for m in replies]
        full = {d: Teacher.load(str(m), [d], cfg) for d, (_, m) in heads.items()}
        for r, m in zip(reqs, replies):
            np.testing.assert_allclose(m.logprobs, full[r.domain].logprobs([r])[0], atol=1e-5, rtol=0)
    finally:
        o.close()

"""Teacher servers (teachers/server.py) as real processes, driven over a real ROUTER socket by the test (in the
orchestrator's seat) with a real PULL socket for heartbeats (the supervisor's): the log-probs equal the
trainer's own on the same checkpoint, groups that arrive together share one forward, two teachers with their
own checkpoints answer only their own domains, bad requests get an error reply or are counted, and SIGTERM
drains and exits 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from cascade_rl.learner.trainer import Batch
from cascade_rl.modeling.policy import Policy
from cascade_rl.protocol.codec import decode, encode
from cascade_rl.protocol.messages import Heartbeat, Ready, Score, TeacherLogprobs, TeacherRequest, WorkKey
from cascade_rl.protocol.rows import from_padded
from cascade_rl.protocol.sockets import bind_router, recv, recv_routed, send
from cascade_rl.supervisor.config import compose
from cascade_rl.teachers.server import Teacher, batch_rows

EXPECT = (Ready, TeacherLogprobs)
VOCAB = 321  # the tiny model's (learner/tiny_model.py: its BPE, then <think>, </think>, <tool_call>, </tool_call>)


# --------------------------------------------------------------------------- helpers


def run_config(model: str, run_dir: Path):
    # check=False: the launch rules are the supervisor's; a teacher reads model, trainer and endpoints only
    cfg = compose("tiny", [f"model.path={model}", f"run_dir={run_dir}", "supervisor.heartbeat_s=0.2",
                           "teacher.threads=1"], check=False)
    cfg.endpoints.update({"orchestrator": f"ipc://{run_dir}/orch", "heartbeat": f"ipc://{run_dir}/beat"})
    return cfg


def groups(seed: int, n_groups: int, temperature: float = 1.0, domain: str = "math") -> list[TeacherRequest]:
    """Ragged groups: prompts of 3..30 tokens, 1..4 responses of 1..40 tokens each."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        lens = rng.integers(1, 41, size=int(rng.integers(1, 5))).astype(np.int32)
        out.append(TeacherRequest(WorkKey.teacher(f"s{seed}g{g}", 0), domain, rng.integers(0, VOCAB, int(rng.integers(3, 31)), np.int32),
                                  rng.integers(0, VOCAB, int(lens.sum()), np.int32), lens, temperature))
    return out


def trainer_logprobs(model: str, cfg, requests: list[TeacherRequest]) -> np.ndarray:
    """The trainer's own log-probs of the requests' response tokens, concatenated in request order: each
    temperature's sequences as one TrainBatch (group by group, right-padded), through ``Batch.from_message``
    and the Policy that ``learner.trainer.build`` makes, called as in ``train_step``."""
    t, out = cfg.trainer, {}
    for temperature in {r.temperature for r in requests}:
        subset = [r for r in requests if r.temperature == temperature]
        rows = [np.concatenate([r.prompt_ids, y]) for r in subset
                for y in np.split(r.response_ids, np.cumsum(r.response_lens)[:-1])]
        prompts = [len(r.prompt_ids) for r in subset for _ in r.response_lens]
        n, length = len(rows), max(map(len, rows))
        ids, mask = np.zeros((n, length), np.int32), np.zeros((n, length), bool)
        for i, (row, p) in enumerate(zip(rows, prompts)):
            ids[i, : len(row)], mask[i, p : len(row)] = row, True
        msg = from_padded(step=0, group_size=1, input_ids=ids, response_mask=mask,
                          inf_logprobs=np.zeros((n, length), np.float32), rewards=np.zeros(n, np.float32),
                          versions=np.zeros(n, np.int32))
        batch = Batch.from_message(decode(encode(msg)))
        policy = Policy(AutoModelForCausalLM.from_pretrained(model), temperature, t.logprob_chunk_tokens, t.pack,
                        t.pack_tokens, t.logprob_impl)
        policy.train()
        lp, _ = policy(batch.input_ids, batch.lengths, batch.response_mask, with_entropy=True)
        values = lp.detach()[batch.response_mask].numpy()
        for r, v in zip(subset, np.split(values, np.cumsum([len(r.response_ids) for r in subset])[:-1])):
            out[r.key] = v
    return np.concatenate([out[r.key] for r in requests])


class Orchestrator:
    """The orchestrator's ROUTER and the supervisor's heartbeat PULL, with the teachers that connect to them."""

    def __init__(self, cfg, run_dir: Path) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.config = run_dir / "config.yaml"
        self.config.write_text(OmegaConf.to_yaml(cfg))
        ctx = zmq.Context.instance()
        self.router = bind_router(ctx, cfg.endpoints.orchestrator)
        self.beats = ctx.socket(zmq.PULL)
        self.beats.setsockopt(zmq.LINGER, 0)
        self.beats.bind(cfg.endpoints.heartbeat)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict = {}
        self.idents: dict[str, bytes] = {}
        self.readies: list[Ready] = []
        self.replies: dict[WorkKey, TeacherLogprobs] = {}
        self.counters: dict[str, dict] = {}

    def start(self, worker_id: str, model: str, domains: str) -> None:
        log = self.logs[worker_id] = open(self.run_dir / f"{worker_id}.log", "wb")  # stdout and stderr
        self.procs[worker_id] = subprocess.Popen(
            [sys.executable, "-P", "-m", "cascade_rl.teachers.server", "--config", str(self.config), "--worker-id",
             worker_id, "--model", model, "--domains", domains], stdout=log, stderr=log)

    def wait_ready(self, *worker_ids: str, timeout_s: float = 90.0) -> None:
        t_end = time.monotonic() + timeout_s
        while not set(worker_ids) <= set(self.idents):
            assert time.monotonic() < t_end, f"no Ready from {set(worker_ids) - set(self.idents)}"
            self._poll(0.1)

    def send(self, worker_id: str, msg) -> None:
        send(self.router, msg, identity=self.idents[worker_id])

    def send_raw(self, worker_id: str, frames: list[bytes]) -> None:
        self.router.send_multipart([self.idents[worker_id], *frames])

    def replies_for(self, keys: list[WorkKey], timeout_s: float = 30.0) -> list[TeacherLogprobs]:
        t_end = time.monotonic() + timeout_s
        while not set(keys) <= set(self.replies):
            assert time.monotonic() < t_end, f"no reply for {set(keys) - set(self.replies)}"
            self._poll(0.1)
        return [self.replies.pop(k) for k in keys]

    def until(self, cond, timeout_s: float = 10.0) -> None:
        t_end = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < t_end, "timed out"
            self._poll(0.1)

    def counters_of(self, worker_id: str, until=lambda c: True, timeout_s: float = 10.0) -> dict:
        """The newest heartbeat counters of ``worker_id`` once ``until(counters)`` holds; read at least two
        heartbeat periods after the call, so they include everything the worker did before it."""
        t_fresh = time.monotonic() + 2.5 * self.cfg.supervisor.heartbeat_s
        while time.monotonic() < t_fresh:
            self._poll(0.05)
        t_end = time.monotonic() + timeout_s
        while not until(self.counters.get(worker_id, {})):
            assert time.monotonic() < t_end, f"{worker_id} counters {self.counters.get(worker_id)}"
            self._poll(0.1)
        return self.counters[worker_id]

    def _poll(self, timeout_s: float) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.beats, zmq.POLLIN)
        events = dict(poller.poll(int(timeout_s * 1000)))
        while self.router in events and self.router.poll(0):
            ident, msg = recv_routed(self.router, EXPECT)
            if isinstance(msg, Ready):
                self.idents[msg.worker_id] = ident
                self.readies.append(msg)
            else:
                assert msg.key not in self.replies, f"two replies for {msg.key}"
                self.replies[msg.key] = msg
        while self.beats in events and self.beats.poll(0):
            beat = recv(self.beats, (Heartbeat,))
            self.counters[beat.worker_id] = {**beat.counters, "state": beat.state}

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()
        for f in self.logs.values():
            f.close()
        self.router.close(linger=0)
        self.beats.close(linger=0)


@pytest.fixture(scope="module")
def perturbed_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model with every weight scaled by 1.02: another checkpoint of the same architecture."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.02)
    out = tmp_path_factory.mktemp("models") / "perturbed"
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def orch(tiny_model, perturbed_model, tmp_path_factory):
    """Teachers on one orchestrator socket: teacher-a (the tiny model: math, mcqa), teacher-b (the perturbed
    copy: code), and teacher-c (the tiny model: math) for the SIGTERM test; started together, as a launch
    would (each loads its model in its own process)."""
    run_dir = tmp_path_factory.mktemp("teacher-run")
    o = Orchestrator(run_config(tiny_model, run_dir), run_dir)
    o.start("teacher-a", tiny_model, "math,mcqa")
    o.start("teacher-b", perturbed_model, "code")
    o.start("teacher-c", tiny_model, "math")
    try:
        o.wait_ready("teacher-a", "teacher-b", "teacher-c")
        yield o
    finally:
        o.close()


# --------------------------------------------------------------------------- in-process


def test_batch_rows_put_response_tokens_in_request_order_and_check_names_the_problem(tiny_model):
    reqs = [TeacherRequest(WorkKey.teacher("a", 0), "math", np.array([5, 6], np.int32), np.array([7, 8, 9], np.int32),
                           np.array([1, 2], np.int32)),
            TeacherRequest(WorkKey.teacher("b", 0), "math", np.array([1], np.int32), np.array([4], np.int32), np.array([1], np.int32))]
    ids, lengths, mask = batch_rows(reqs)
    assert ids.tolist() == [[5, 6, 7, 0], [5, 6, 8, 9], [1, 4, 0, 0]] and lengths.tolist() == [3, 4, 2]
    assert ids[mask].tolist() == [7, 8, 9, 4]  # row-major mask order = the requests' response_ids

    cfg = run_config(tiny_model, Path("/nonexistent"))
    teacher = Teacher.load(tiny_model, ["math"], cfg)
    assert teacher.check(reqs[0]) == ""
    bad = TeacherRequest(WorkKey.teacher("c", 0), "math", np.array([1, VOCAB], np.int32), np.array([2], np.int32), np.array([1], np.int32))
    assert f"prompt_ids: token id {VOCAB} out of range [0, {VOCAB})" in teacher.check(bad)
    bad.prompt_ids = np.zeros(0, np.int32)
    assert "empty prompt" in teacher.check(bad)
    bad.prompt_ids, bad.domain = np.ones(500, np.int32), "code"
    assert "not served" in teacher.check(bad)
    bad.domain, bad.response_ids, bad.response_lens = "math", np.ones(13, np.int32), np.array([13], np.int32)
    assert "513 tokens exceeds the model's max_position_embeddings 512" in teacher.check(bad)


# --------------------------------------------------------------------------- processes


@pytest.mark.slow
def test_logprobs_equal_the_trainers_and_a_burst_shares_one_forward(orch, tiny_model):
    before = orch.counters_of("teacher-a", lambda c: "batches" in c)
    reqs = groups(1, 4, temperature=1.0) + groups(2, 4, temperature=0.7)  # 8 ragged groups, two temperatures
    for r in reqs:
        orch.send("teacher-a", r)
    replies = orch.replies_for([r.key for r in reqs])
    assert all(m.ok and m.error == "" and m.worker_id == "teacher-a" for m in replies)
    assert [len(m.logprobs) for m in replies] == [len(r.response_ids) for r in reqs]
    got = np.concatenate([m.logprobs for m in replies])
    want = trainer_logprobs(tiny_model, orch.cfg, reqs)
    delta = float(np.abs(got - want).max())
    assert delta <= 1e-5, delta
    assert (got < 0).all() and np.isfinite(got).all()
    # the groups sent back to back were batched, not answered one by one: one batch, one forward per
    # temperature (a scheduler hiccup on a loaded machine may split the burst once)
    c = orch.counters_of("teacher-a", lambda c: c["requests"] >= before["requests"] + len(reqs))
    assert c["batches"] - before["batches"] <= 2 and c["forwards"] - before["forwards"] <= 3, (before, c)
    assert len({m.t_teacher for m in replies}) == c["batches"] - before["batches"]
    print(f"\nteacher vs trainer: max |delta| {delta:.2e} over {len(got)} tokens")


@pytest.mark.slow
def test_two_teachers_answer_only_their_own_domains_with_their_own_checkpoints(orch, tiny_model, perturbed_model):
    domains = {r.worker_id: r.domains for r in orch.readies if not r.draining}
    assert domains["teacher-a"] == ["math", "mcqa"] and domains["teacher-b"] == ["code"]
    assert all(r.role == "teacher" and r.slots > 0 for r in orch.readies if not r.draining)

    a, b = groups(3, 2, domain="mcqa"), groups(3, 2, domain="code")  # the same sequences, keys made distinct
    for r in b:
        r.key = WorkKey.teacher("code-" + r.key.group, 0)
    wrong_a = TeacherRequest(WorkKey.teacher("a-code", 0), "code", a[0].prompt_ids, a[0].response_ids, a[0].response_lens)
    wrong_b = TeacherRequest(WorkKey.teacher("b-math", 0), "math", a[0].prompt_ids, a[0].response_ids, a[0].response_lens)
    for r in [*a, wrong_a]:
        orch.send("teacher-a", r)
    for r in [*b, wrong_b]:
        orch.send("teacher-b", r)
    got_a = orch.replies_for([r.key for r in a])
    got_b = orch.replies_for([r.key for r in b])
    err_a, err_b = orch.replies_for([wrong_a.key, wrong_b.key])
    assert not err_a.ok and "domain 'code' is not served" in err_a.error and len(err_a.logprobs) == 0
    assert not err_b.ok and "domain 'math' is not served" in err_b.error and err_b.worker_id == "teacher-b"

    lp_a, lp_b = np.concatenate([m.logprobs for m in got_a]), np.concatenate([m.logprobs for m in got_b])
    assert np.abs(lp_a - lp_b).max() > 1e-2  # different checkpoints, different teachers
    assert np.abs(lp_a - trainer_logprobs(tiny_model, orch.cfg, a)).max() <= 1e-5
    assert np.abs(lp_b - trainer_logprobs(perturbed_model, orch.cfg, b)).max() <= 1e-5


@pytest.mark.slow
def test_bad_requests_get_an_error_or_are_counted_and_the_teacher_goes_on(orch):
    base = orch.counters_of("teacher-a", lambda c: "errors" in c)
    good = groups(4, 1)[0]

    def like(name: str, **fields) -> TeacherRequest:
        return TeacherRequest(**{**good.__dict__, "key": WorkKey.teacher(name, 0), **fields})

    errors = {
        "oov": like("oov", response_ids=np.where(np.arange(len(good.response_ids)) == 0, 10**6, good.response_ids)),
        "negative": like("negative", prompt_ids=np.array([-1, 5], np.int32)),
        "too-long": like("too-long", prompt_ids=np.ones(600, np.int32)),
        "domain": like("domain", domain="poetry"),
        "empty-prompt": like("empty-prompt", prompt_ids=np.zeros(0, np.int32)),
        "late": like("late", deadline_s=1e-9),
    }
    for r in errors.values():
        orch.send("teacher-a", r)
    # malformed: not a message, a request whose lengths do not add up, an empty response, a type not for it
    orch.send_raw("teacher-a", [b"\x00garbage"])
    orch.send_raw("teacher-a", [b"\x81\xa1t\xa3bad", b"extra"])
    orch.send("teacher-a", like("lens", response_lens=np.array([len(good.response_ids) + 1], np.int32)))
    orch.send("teacher-a", like("empty", response_ids=np.zeros(0, np.int32), response_lens=np.array([0], np.int32)))
    orch.send("teacher-a", Score(WorkKey.score("k", 0, 0), 1.0, True))
    orch.send("teacher-a", good)

    replies = dict(zip(errors, orch.replies_for([r.key for r in errors.values()])))
    assert all(not m.ok and len(m.logprobs) == 0 for m in replies.values())
    assert f"response_ids: token id 1000000 out of range [0, {VOCAB})" in replies["oov"].error
    assert "prompt_ids: token id -1 out of range" in replies["negative"].error
    assert "exceeds the model's max_position_embeddings 512" in replies["too-long"].error
    assert "domain 'poetry' is not served" in replies["domain"].error
    assert "empty prompt" in replies["empty-prompt"].error
    assert "deadline" in replies["late"].error
    (ok,) = orch.replies_for([good.key])
    assert ok.ok and len(ok.logprobs) == len(good.response_ids)
    assert {WorkKey.teacher("lens", 0), WorkKey.teacher("empty", 0)}.isdisjoint(orch.replies)  # malformed: no reply, counted below

    c = orch.counters_of("teacher-a", lambda c: c["malformed"] >= base["malformed"] + 5
                         and c["errors"] >= base["errors"] + len(errors))
    assert c["errors"] - base["errors"] == len(errors) and c["expired"] - base["expired"] == 1
    assert c["malformed"] - base["malformed"] == 5 and c["busy_s"] > 0 and c["tokens"] > base["tokens"]
    assert orch.procs["teacher-a"].poll() is None, "the teacher died"


@pytest.mark.slow
def test_sigterm_drains_what_it_holds_and_exits_0(orch):
    reqs = groups(5, 3)
    for r in reqs:
        orch.send("teacher-c", r)
    orch.procs["teacher-c"].send_signal(signal.SIGTERM)
    replies = orch.replies_for([r.key for r in reqs])
    assert all(m.ok for m in replies)  # what it held (or got before the orchestrator read its notice) is answered
    assert orch.procs["teacher-c"].wait(timeout=15) == 0
    orch.until(lambda: any(r.worker_id == "teacher-c" and r.draining and r.slots == 0 for r in orch.readies))


def test_a_moe_teacher_keeps_one_hook_per_router_however_many_batches(tiny_model, tmp_path):
    """A teacher serving a MoE model for many batches: each router keeps the one forward hook routing replay
    installs (a Policy built per forward used to add one per router per batch, for the life of the run), and
    wrapping the model in more Policies adds none."""
    from cascade_rl.modeling.routing import moe_routers

    cfg = run_config(tiny_model, tmp_path)
    teacher = Teacher(AutoModelForCausalLM.from_pretrained(tiny_model), ["math"], cfg.trainer)
    routers = moe_routers(teacher.model)
    assert routers
    for seed in range(5):
        requests = groups(seed, 2, temperature=[0.6, 1.0][seed % 2])
        assert all(not teacher.check(r) for r in requests)
        teacher.logprobs(requests)
    Policy(teacher.model, routing_replay=True)
    assert [len(r._forward_hooks) for r in routers] == [1] * len(routers)

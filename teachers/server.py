"""Teacher server: TeacherRequests in, TeacherLogprobs out; token log-probs under one frozen checkpoint (MOPD).

    python -m cascade_rl.teachers.server --config RUN_DIR/config.yaml --worker-id teacher-0 \\
        --model PATH --domains math,mcqa
    python -m cascade_rl.teachers.server ... --model BASE --domains math,code \\
        --adapter math=CKPT_A --adapter code=CKPT_B        # one base, one LoRA head per checkpoint

Started by the supervisor, one process per teacher checkpoint, except that the teacher checkpoints that are LoRA
adapters (a ``trainer.lora`` run's) of one base share one process (supervisor/procs.py ``teacher_groups``): it
holds the base once and one peft adapter per checkpoint (``PeftModel.from_pretrained`` / ``load_adapter``, not
merged), and runs each request under its domain's adapter (``set_adapter``; the domains ``--adapter`` does not
name, if any, under the base itself: its adapters off), so a step whose teachers are adapters of one base equals
the same step with their merged full models in one process each, in one base's memory. It loads the HF
checkpoint at ``--model`` as the trainer does (modeling/models.py: ``model.dtype``,
``model.attn_impl``, ``model.moe_impl``; frozen, eval mode) on its device (``gpus.teachers``:
the i-th teacher server on the i-th GPU listed; none: the CPU), connects to the orchestrator like
every worker, on the worker runtime (protocol/runtime.py: ``Ready`` with role
"teacher", its ``teacher.slots`` and ``domains``; heartbeats to the supervisor)
and loops: collect the requests that have arrived (after the first,
``teacher.batch_window_s`` more for the rest of a burst), take them in
arrival order up to ``teacher.max_batch_tokens`` sequence tokens, and answer them all
from ONE no-grad forward over their sequences (prompt + response i, one row
each). The forward is the trainer's own (``modeling.policy.Policy`` with the
run's ``trainer.pack``/``pack_tokens``/``logprob_chunk_tokens``/
``logprob_impl``: packed rows, LM head in chunks, no [tokens x vocab] logits),
so a teacher's log-probs of a checkpoint equal the trainer's of the same
checkpoint, a hybrid Mamba-2 one (Nemotron-H) included: the Policy keeps packed rows
apart in its Mamba layers too (modeling/mamba.py; tests/test_nemotron_h_trainer.py). Requests of a batch that ask for different temperatures run one
forward per temperature (a stage samples at one, so in practice one), and with adapters one per domain's adapter.

A request the model cannot serve (a domain not served here, an empty prompt, a
token id outside the vocabulary, a sequence longer than
``max_position_embeddings``, not started within its ``deadline_s``) gets
``TeacherLogprobs(ok=False, error=...)``; a message that does not decode is
counted (heartbeat counter ``malformed``) and logged. Neither stops the server.
SIGTERM drains: ``Ready(draining=True)``, answer what is held and what arrives
in the next quiet second, then exit 0.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from cascade_rl.modeling.models import describe, load_model
from cascade_rl.modeling.policy import Policy
from cascade_rl.protocol.devices import role_device
from cascade_rl.protocol.messages import TeacherLogprobs, TeacherRequest
from cascade_rl.protocol.runtime import Pending, Service, WorkerRuntime
from cascade_rl.protocol.worker_main import worker_start

log = logging.getLogger("teacher")

# --------------------------------------------------------------------------- the computation (no sockets)


def sequence_tokens(req: TeacherRequest) -> int:
    """Tokens the forward runs for ``req``: the prompt once per response, plus the responses."""
    return len(req.prompt_ids) * len(req.response_lens) + len(req.response_ids)


def batch_rows(requests: list[TeacherRequest]) -> tuple[Tensor, Tensor, Tensor]:
    """The requests' sequences as the trainer's batch: one row per (request, response), prompt then response,
    right-padded. Returns input_ids [N, L], lengths [N] and the mask [N, L] of the response tokens; read
    row-major, the masked positions are the requests' ``response_ids`` in order."""
    rows = [(r.prompt_ids, y) for r in requests for y in np.split(r.response_ids, np.cumsum(r.response_lens)[:-1])]
    lengths = np.array([len(p) + len(y) for p, y in rows], np.int64)
    ids = np.zeros((len(rows), int(lengths.max())), np.int64)
    mask = np.zeros(ids.shape, bool)
    for i, (p, y) in enumerate(rows):
        ids[i, : len(p)], ids[i, len(p) : lengths[i]] = p, y
        mask[i, len(p) : lengths[i]] = True
    return torch.from_numpy(ids), torch.from_numpy(lengths), torch.from_numpy(mask)


class Teacher:
    """A frozen checkpoint and the trainer's log-prob path; no sockets, so tests and tools use it in-process."""

    def __init__(self, model: nn.Module, domains: list[str], trainer_cfg, peft=None,
                 heads: dict[str, str] | None = None) -> None:
        """``trainer_cfg``: the run's ``trainer`` section, whose log-prob settings the teacher shares. One base,
        many heads: ``peft`` the ``PeftModel`` whose base is ``model`` (its LoRA layers injected in ``model``),
        ``heads`` {domain: its adapter's name}; the other domains run the base (adapters off)."""
        self.model = model.requires_grad_(False).eval()
        self.domains = sorted(set(domains))
        self.peft, self.heads = peft, dict(heads or {})
        t = trainer_cfg
        # one Policy for the life of the server, its temperature set per forward (a Policy per forward would add
        # its router hooks to an MoE model each batch)
        self.policy = Policy(self.model, 1.0, chunk_tokens=t.logprob_chunk_tokens, pack=t.pack,
                             pack_tokens=t.pack_tokens, logprob_impl=t.logprob_impl)
        head = model.get_output_embeddings().weight
        self.vocab = min(head.shape[0], model.get_input_embeddings().num_embeddings)
        self.max_len = getattr(model.config, "max_position_embeddings", None)

    @classmethod
    def load(cls, path: str, domains: list[str], cfg, device: torch.device | str = "cpu") -> Teacher:
        """The checkpoint at ``path`` as the trainer would load it (modeling/models.py), on ``device``."""
        return cls(load_model(path, cfg, device), domains, cfg.trainer)

    @classmethod
    def load_heads(cls, base: str, adapters: dict[str, str], domains: list[str], cfg,
                   device: torch.device | str = "cpu") -> Teacher:
        """One base, many heads: the model at ``base`` (loaded as the trainer would) and, unmerged, one peft
        adapter per distinct checkpoint of ``adapters`` ({domain: LoRA checkpoint of ``base``}); ``domains``
        beyond those of ``adapters`` are served by the base."""
        from peft import PeftModel

        model = load_model(base, cfg, device)
        names: dict[str, str] = {}  # checkpoint -> adapter name (a domain may contain what a module name cannot)
        for domain in sorted(adapters):
            names.setdefault(str(Path(adapters[domain]).resolve()), f"head{len(names)}")
        peft = None
        for path, name in names.items():
            if peft is None:
                peft = PeftModel.from_pretrained(model, path, adapter_name=name)
            else:
                peft.load_adapter(path, adapter_name=name)
        heads = {d: names[str(Path(p).resolve())] for d, p in adapters.items()}
        return cls(peft.get_base_model(), [*domains, *adapters], cfg.trainer, peft, heads)

    def head(self, domain: str) -> str | None:
        """The adapter that answers ``domain`` (None: the model itself, or the base of a one-base-many-heads)."""
        return self.heads.get(domain)

    def forwards(self, requests: list[TeacherRequest]) -> int:
        """How many forwards ``logprobs(requests)`` runs: one per (temperature, adapter)."""
        return len({(r.temperature, self.head(r.domain)) for r in requests})

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def check(self, req: TeacherRequest) -> str:
        """Why this model cannot answer ``req`` ("" if it can). The codec has checked the lengths."""
        if req.domain not in self.domains:
            return f"domain {req.domain!r} is not served here (this teacher serves {self.domains})"
        if len(req.prompt_ids) == 0:
            return "empty prompt: the first response token would have no prediction"
        longest = len(req.prompt_ids) + int(req.response_lens.max())
        if self.max_len is not None and longest > self.max_len:
            return f"a sequence of {longest} tokens exceeds the model's max_position_embeddings {self.max_len}"
        for name in ("prompt_ids", "response_ids"):
            ids = getattr(req, name)
            bad = ids[(ids < 0) | (ids >= self.vocab)]
            if len(bad):
                return f"{name}: token id {int(bad[0])} out of range [0, {self.vocab})"
        return ""

    def logprobs(self, requests: list[TeacherRequest]) -> list[np.ndarray]:
        """Each request's log-probs of its response tokens (float32, ``response_ids`` order). One forward per
        distinct temperature among ``requests`` (and, one base with many heads, per adapter); call ``check`` on
        each first."""
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(requests)
        by_forward = collections.defaultdict(list)
        for i, req in enumerate(requests):
            by_forward[req.temperature, self.head(req.domain)].append(i)
        for (temperature, head), members in by_forward.items():
            group = [requests[i] for i in members]
            ids, lengths, mask = (t.to(self.device) for t in batch_rows(group))
            with torch.inference_mode(), self.adapter(head):
                self.policy.temperature = temperature
                lp, _ = self.policy(ids, lengths, mask)
            flat = lp[mask].float().cpu().numpy()  # row-major: request by request, response by response
            bounds = np.cumsum([len(r.response_ids) for r in group])[:-1]
            for i, values in zip(members, np.split(flat, bounds)):
                out[i] = values
        return out

    def adapter(self, head: str | None):
        """The span in which the model computes ``head``'s function (None: the model itself, or the base)."""
        if self.peft is None:
            return contextlib.nullcontext()
        if head is None:
            return self.peft.disable_adapter()
        self.peft.set_adapter(head, inference_mode=True)  # inference_mode: its parameters stay frozen
        return contextlib.nullcontext()


# --------------------------------------------------------------------------- the worker


class Server(Service):
    """The teacher's ``Service`` (protocol/runtime.py): batches of requests up to ``max_batch_tokens``, each batch
    answered from one forward."""

    role = "teacher"

    def __init__(self, teacher: Teacher, worker_id: str, slots: int, max_batch_tokens: int) -> None:
        self.teacher, self.worker_id, self.domains = teacher, worker_id, teacher.domains
        self.where = describe(teacher.model)  # for heartbeats: where the model runs (it never moves)
        self.slots, self.max_batch_tokens = slots, max_batch_tokens
        self.counters = {"requests": 0, "sequences": 0, "tokens": 0, "errors": 0, "expired": 0, "batches": 0,
                         "forwards": 0, "busy_s": 0.0}
        self.state = "idle"

    def status(self) -> dict:
        return {"state": self.state, "counters": {**self.counters, "device": self.where}}

    def take(self, pending: collections.deque[Pending]) -> list[Pending]:
        """The oldest pending requests, up to ``max_batch_tokens`` (always at least one)."""
        batch, tokens = [], 0
        while pending and (not batch or tokens + sequence_tokens(pending[0].request) <= self.max_batch_tokens):
            batch.append(pending.popleft())
            tokens += sequence_tokens(batch[-1].request)
        return batch

    def check(self, item: Pending) -> str:
        req = item.request
        reason = self.teacher.check(req)
        if not reason and time.monotonic() - item.arrived > req.deadline_s:
            self.counters["expired"] += 1
            reason = f"deadline: not started within {req.deadline_s:g} s"
        return reason

    def serve(self, batch: list[Pending], reply, collect) -> None:
        good = [item.request for item in batch]
        self.state = "busy"
        t0 = time.perf_counter()
        try:
            logprobs = self.teacher.logprobs(good)
        finally:  # a failing forward: the runtime answers these requests with the reason
            self.state = "idle"
        dt = time.perf_counter() - t0
        self.counters["batches"] += 1
        self.counters["forwards"] += self.teacher.forwards(good)
        self.counters["busy_s"] += dt
        self.counters["sequences"] += sum(len(r.response_lens) for r in good)
        self.counters["tokens"] += sum(sequence_tokens(r) for r in good)
        for item, values in zip(batch, logprobs):
            self.counters["requests"] += 1
            reply(item, TeacherLogprobs(item.request.key, values, True, "", self.worker_id, dt))

    def error_reply(self, req: TeacherRequest, reason: str) -> list[TeacherLogprobs]:
        self.counters["requests"] += 1
        self.counters["errors"] += 1
        return [TeacherLogprobs(req.key, np.zeros(0, np.float32), False, reason, self.worker_id)]


def main(argv: list[str] | None = None) -> None:
    # --- arguments: the run config, plus this teacher's checkpoint and domains
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--model", required=True, help="HF checkpoint directory of this teacher (frozen)")
    extra.add_argument("--domains", required=True, help="comma-separated domains this teacher answers")
    extra.add_argument("--adapter", action="append", default=[], metavar="DOMAIN=CHECKPOINT",
                       help="a LoRA checkpoint of --model that answers DOMAIN (repeat: one base, many heads)")
    known, rest = extra.parse_known_args(argv)
    args, cfg = worker_start(__doc__.splitlines()[0], rest)
    domains = [d.strip() for d in known.domains.split(",") if d.strip()]
    if not domains:
        raise SystemExit("--domains: name at least one domain")
    adapters = dict(a.partition("=")[::2] for a in known.adapter)
    if not all(adapters) or not all(adapters.values()) or len(adapters) != len(known.adapter):
        raise SystemExit(f"--adapter: DOMAIN=CHECKPOINT, one per domain (got {known.adapter})")
    t = cfg.teacher
    if t.threads and not cfg.get("inline"):
        torch.set_num_threads(t.threads)

    # --- model, then serve on the worker runtime
    if adapters:
        teacher = Teacher.load_heads(known.model, adapters, [d for d in domains if d not in adapters], cfg,
                                     role_device(cfg, "teacher"))
    else:
        teacher = Teacher.load(known.model, domains, cfg, role_device(cfg, "teacher"))
    log.info("teacher %s serving %s on %s (vocab %d, max length %s)%s", known.model, teacher.domains,
             describe(teacher.model), teacher.vocab, teacher.max_len,
             "".join(f"; {d} by adapter {p}" for d, p in sorted(adapters.items())))
    WorkerRuntime(Server(teacher, args.worker_id, t.slots, t.max_batch_tokens), cfg, args.worker_id,
                  t.batch_window_s, expect=(TeacherRequest,)).run()


if __name__ == "__main__":
    main()

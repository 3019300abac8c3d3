"""Trainer: TrainBatches in, GRPO or MOPD steps, weights and checkpoints out.

    python -m cascade_rl.learner.trainer --config RUN_DIR/config.yaml --worker-id trainer-0
    torchrun --nproc-per-node 2 -m cascade_rl.learner.trainer ...      # trainer.world_size = 2

The model is an HF causal LM loaded from ``model.path`` (policy version 0), or
from a checkpoint with ``run.resume_from``. Each ``TrainBatch`` is one
optimizer step (version + 1): per-token log-probs of the response tokens at
the sampling temperature (modeling/policy.py: packed rows, LM head in chunks,
no [tokens x vocab] logits), the stage's objective (learner/objectives.py:
GRPO with its options, or MOPD), AdamW with a linear warm-up and grad-norm
clipping. After the step the new weights are published through the weight
transport (``WeightsReady`` on the PUB socket, and to the orchestrator so it
can hand them to late samplers), then ``StepDone`` carries the step's metrics.
Checkpoints (learner/checkpoint.py) are HF directories plus optimizer, RNG and
the orchestrator's data cursor, written atomically.

With several ranks (learner/parallel.py) every rank has its own link to the
orchestrator, which sends each its own share of every part (balanced by tokens:
orchestrator/assembly.py); rank 0 alone publishes weights and reports steps, and
every rank trains on its share of the groups under FSDP2.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from cascade_rl.modeling.models import describe, load_model
from cascade_rl.modeling.policy import Policy
from cascade_rl.protocol import exits, records
from cascade_rl.protocol.devices import role_device
from cascade_rl.protocol.messages import Ready, StepDone, TrainBatch
from cascade_rl.protocol.sockets import WorkerLink
from cascade_rl.protocol.worker_main import worker_start
from cascade_rl.weights.notices import NoticePublisher
from cascade_rl.weights.registry import TRANSPORTS

from . import checkpoint, lora, parallel
from .batch import Batch, Part  # noqa: F401  (Batch: the trainer's API as before)
from .optim import MasterAdamW
from .step import Step, lr_at, routing_stats  # noqa: F401  (lr_at, routing_stats: the trainer's API as before)

log = logging.getLogger("trainer")


def step_share(msg: TrainBatch, ranks: parallel.Ranks) -> int:
    """This rank's groups in the step ``msg`` is a part of (``step_groups``; 0: ``msg`` is the whole step)."""
    groups = msg.step_groups or len(msg.rewards) // msg.group_size
    if groups % ranks.dp_size:
        raise ValueError(f"a step of {groups} groups does not split among {ranks.dp_size} data-parallel ranks")
    return groups // ranks.dp_size


def train_step(policy: Policy, optimizer, batch: Batch, cfg, step: int,
               reference: Policy | None = None, *, run) -> dict[str, float]:
    """One optimizer step of ``run.algorithm`` on ``batch`` (this rank's share of the step, in one part) with the
    ``trainer`` section ``cfg`` and the ``run`` section (``algorithm``, ``steps``); returns its metrics."""
    one = Step(policy, optimizer, cfg, step, reference, run=run, groups=len(batch.rewards) // batch.group_size)
    one.add(batch)
    return one.finish()


def build(cfg, ranks: parallel.Ranks, device: torch.device | str = "cpu"):
    """Policy on ``device`` (FSDP2-sharded on several ranks), frozen reference if kl_coef > 0, AdamW (fp32 master
    weights and moments for bf16 parameters), tokenizer, and the state to resume from (``{"step": 0, "extra":
    {}}`` for a fresh stage)."""
    t = cfg.trainer
    resume = checkpoint.resolve(cfg.run.resume_from, Path(cfg.run_dir))
    adapted = lora.enabled(t.lora)  # LoRA: the base from model.path, the adapter (trained, resumed) on top
    model = load_model(cfg.model.path if adapted else resume or cfg.model.path, cfg, device)
    if adapted:
        model = lora.attach(model, t.lora, cfg.model.path)
    reference = None
    if t.kl_coef > 0 and not adapted:  # the stage's starting policy; each rank holds a full copy (no gradient)
        reference = Policy(load_model(cfg.model.path, cfg, device).requires_grad_(False).eval(),
                           cfg.sampling.temperature, t.logprob_chunk_tokens, t.pack, t.pack_tokens, t.logprob_impl,
                           t.share_prefix, t.routing_replay)
    policy = parallel.parallelize(
        Policy(model, cfg.sampling.temperature, t.logprob_chunk_tokens, t.pack, t.pack_tokens, t.logprob_impl,
               t.share_prefix, t.routing_replay, activation_checkpointing=t.activation_checkpointing,
               context_parallel=ranks.context),
        ranks)
    if adapted and t.kl_coef > 0:  # the base: the policy with its adapters off, no second copy
        reference = lora.BaseReference(policy)
    optimizer = MasterAdamW([p for p in policy.parameters() if p.requires_grad], lr=lr_at(0, t, cfg.run.steps),
                            betas=tuple(t.betas), weight_decay=t.weight_decay)
    state = {"step": 0, "extra": {}}
    if resume and adapted:
        lora.load_adapter(policy, resume)
    if resume:
        state = load_state(resume, policy, optimizer, ranks)
        log.info("resumed from %s at step %d", resume, state["step"])
    return policy, reference, optimizer, AutoTokenizer.from_pretrained(cfg.model.path), state


def save_state(policy: Policy, optimizer, tokenizer, run_dir: Path, step: int, extra: dict,
               ranks: parallel.Ranks) -> str:
    """An atomic checkpoint (a collective with several ranks: all gather, rank 0 writes)."""
    out = checkpoint.step_dir(Path(run_dir) / "checkpoints", step)
    if lora.attached(policy.model):  # LoRA: the adapter in peft's format, and its optimizer state
        adapter = lora.AdapterWriter(lora.AdapterSource(policy).state_dict(), lora.config_dict(policy.model))
        if not ranks.distributed:
            return str(checkpoint.save(out, adapter, tokenizer, optimizer, step, extra))
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optim = get_optimizer_state_dict(policy, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                     cpu_offload=True))
        if ranks.main:
            checkpoint.save(out, adapter, tokenizer, None, step, extra, optim_state=optim)
        return str(out)
    if not ranks.distributed:
        return str(checkpoint.save(out, policy.model, tokenizer, optimizer, step, extra))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    held = parallel.full_state_dict(policy, ranks, master=True)  # fp32 where FSDP2 holds bf16 weights' masters
    optim = get_optimizer_state_dict(policy, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                 cpu_offload=True))
    if ranks.main:
        dtypes = parallel.weight_dtypes(policy)
        for name, state in optim["state"].items():  # the optimizer's "master", as one rank saves it
            if name in held and dtypes.get(name, held[name].dtype) != held[name].dtype:
                state["master"] = held[name]
        weights = {k: v.to(dtypes.get(k, v.dtype)) for k, v in held.items()}  # the HF files in the model's dtype
        checkpoint.save(out, policy.model, tokenizer, None, step, extra, state_dict=strip_prefix(weights),
                        optim_state=optim)
    return str(out)


def publish(transport, policy: Policy, ranks: parallel.Ranks, version: int):
    """The policy's weights as ``version`` through ``transport`` (rank 0); under FSDP2 every rank takes part in
    the gathers, one parameter at a time. Rank 0's ``WeightsReady``, None on the others."""
    adapted = lora.attached(policy.model)  # LoRA: the adapter alone, its config in the notice
    weights = lora.AdapterSource(policy) if adapted else parallel.publishable(policy, ranks)
    if not ranks.main:
        weights.drain()
        return None
    notice = transport.publish(weights, version)
    return dataclasses.replace(notice, adapter=lora.config_dict(policy.model)) if adapted else notice


def strip_prefix(weights):
    """A gathered Policy state dict in the HF model's names (``model.`` dropped); a module or None as is."""
    if not isinstance(weights, dict):
        return weights
    return {k.removeprefix("model."): v for k, v in weights.items()}


def load_state(path: Path, policy: Policy, optimizer, ranks: parallel.Ranks) -> dict:
    """Optimizer state, RNG and step of a checkpoint (the weights were loaded with the model)."""
    if not ranks.distributed:
        return checkpoint.load(path, None, optimizer)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    full = torch.load(path / checkpoint.STATE_FILE, map_location="cpu", weights_only=True)["optimizer"]
    # the fp32 masters go back into FSDP2's fp32 shards (the HF files hold their bf16 rounding)
    parallel.load_masters(policy, {k: s.pop("master") for k, s in full["state"].items() if "master" in s})
    set_optimizer_state_dict(policy, optimizer, optim_state_dict=full,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return checkpoint.load(path, None, None)


def main(argv: list[str] | None = None) -> None:
    # --- config, ranks, model, optimizer (and resume)
    args, cfg = worker_start(__doc__.splitlines()[0], argv, default_id="trainer-0")
    tcfg, run_dir = cfg.trainer, Path(cfg.run_dir)
    device = role_device(cfg, "trainer")  # cuda:LOCAL_RANK when gpus.trainer names GPUs, else cpu
    ranks = parallel.init(tcfg.world_size, device, tcfg.context_parallel)
    torch.manual_seed(cfg.run.seed)
    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)
    policy, reference, optimizer, tokenizer, state = build(cfg, ranks, device)
    where = describe(policy.model)
    log.info("trainer rank %d of %d on %s (experts %s, log-probs %s)", ranks.rank, ranks.world_size, where,
             cfg.model.moe_impl, tcfg.logprob_impl)
    version = state["step"]
    trained_ids = None  # rank 0: the rollout ids of every step it trains (orchestrator/ledger.py compares them)
    if ranks.main:
        records.keep_steps_before(run_dir / records.TRAINED_IDS_FILE, version)  # resumed at step s: steps s.. are redone
        trained_ids = records.Appender(run_dir / records.TRAINED_IDS_FILE)

    # --- rank 0: the weights' transport and PUB
    notices = transport = None
    status = {"state": "waiting", "version": version,
              "counters": {"steps": version, "train_s": 0.0, "device": where}}
    if ranks.main:
        options = dict(cfg.weights_options.get(cfg.weights_transport) or {})  # typed per transport in the schema
        # the address samplers on other hosts reach us at: this node's in a Ray run (supervisor/launchers/)
        if cfg.weights_transport in ("stream", "delta", "nccl") and not options["host"] and (
                host := os.environ.get("CASCADE_RL_NODE_IP") or cfg.host):
            options["host"] = host
        transport = TRANSPORTS[cfg.weights_transport](run_id=cfg.run_id, **options)
        notices = NoticePublisher(cfg.endpoints.weights, args.worker_id).start()  # binds, or raises here
    # every rank: its own link, on which the orchestrator sends it its own share of each batch (rank 0 also beats)
    link_id = args.worker_id if ranks.main else f"{args.worker_id}.rank{ranks.rank}"
    link = WorkerLink(link_id, "trainer", cfg.endpoints.orchestrator,
                      cfg.endpoints.get("heartbeat") if ranks.main else None, None,
                      expect=(TrainBatch,), status=lambda: status, heartbeat_s=cfg.supervisor.heartbeat_s).start()
    link.send(Ready(link_id, "trainer", slots=1, version=version, rank=ranks.rank))
    if version:  # resumed: samplers start from model.path, so hand them the checkpoint's weights first
        if notice := publish(transport, policy, ranks, version):
            notices.send(notice)
            link.send(notice)

    # --- loop: a step's TrainBatch parts (one, unless orchestrator.stream_tokens) = one optimizer step = one version
    step, step_id, ids, received, t_first = None, -1, [], [], 0.0  # the step assembled: its parts' ids and arrivals
    try:
        while version < cfg.run.steps:
            msg: TrainBatch = link.inbox.get()  # this rank's share of the part
            status["state"] = "training"
            received.append([round(time.time(), 3), len(msg.ids)])  # when each part came (the streaming test's clock)
            if step is None:
                t_first = time.perf_counter()
                step, step_id = Step(policy, optimizer, tcfg, version, reference, run=cfg.run,
                                     groups=step_share(msg, ranks)), msg.step
            elif msg.step != step_id:
                raise RuntimeError(f"a part of step {msg.step} arrived while step {step_id} had {step.seen} of its "
                                   f"{step.groups} groups: the orchestrator sends a step's parts together")
            step.add(Part.from_message(msg).to(device))  # packed; each micro-batch padded on the device
            ids += msg.ids
            if not msg.last:
                continue
            t0 = time.perf_counter()
            metrics = parallel.reduce_metrics(step.finish(), ranks)
            version += 1
            notice = publish(transport, policy, ranks, version)  # rank 0's notice; a collective under FSDP2
            by_rank = parallel.gather_ids(ids, ranks)  # the step's ids, each rank's (its share of every part)
            if ranks.main:  # before the checkpoint: a resume from it keeps this step's line (records.keep_steps_before)
                trained_ids.write({"step": msg.step, "ids": [i for r in by_rank for i in r], "parts": received,
                                   **({"ranks": by_rank} if ranks.distributed else {})})
            checkpoint_dir = ""
            if version == cfg.run.steps or (tcfg.save_every and version % tcfg.save_every == 0):
                checkpoint_dir = save_state(policy, optimizer, tokenizer, run_dir, version,
                                            {"policy_version": version, "orchestrator": dict(msg.cursor)}, ranks)
                if ranks.main:
                    checkpoint.prune(run_dir / "checkpoints", tcfg.keep_checkpoints)
            # busy: the parts' forward and backward, the update, publishing and the checkpoint; not the waits between
            metrics["train_s"] = step.compute_s + time.perf_counter() - t0
            metrics["step_span_s"] = time.perf_counter() - t_first  # the first part in to the step done
            metrics["parts"] = len(received)
            metrics["tokens_per_s"] = step.tokens * ranks.dp_size / metrics["train_s"]
            step, ids, received = None, [], []
            metrics["weights_bytes"] = notice.nbytes if notice is not None else 0  # what each sampler receives
            if notice is not None and hasattr(transport, "metrics"):  # delta: the version's delta (a resync: the file)
                metrics["weights_bytes"] = transport.metrics["bytes"]
                metrics["weights_changed_frac"] = transport.metrics["changed_frac"]
            if not ranks.main:
                continue
            notices.send(notice)  # samplers apply it at their next safe point
            link.send(notice)  # the orchestrator forwards it to samplers that join late
            status.update(state="waiting", version=version)
            status["counters"].update(steps=version, train_s=status["counters"]["train_s"] + metrics["train_s"])
            link.send(StepDone(step=msg.step, version=version, metrics=metrics, checkpoint=checkpoint_dir))
            log.info("step %d: loss %.4f reward %.3f grad_norm %.3f (%.2fs)", version, metrics["loss"],
                     metrics["reward_mean"], metrics["grad_norm"], metrics["train_s"])
        status["state"] = "done"
        # keep serving heartbeats until the supervisor stops us, so the final weights stay readable
        while True:
            time.sleep(3600)
    except Exception as e:
        if exits.disk_full(e, run_dir):  # the supervisor stops the run and says so; the last checkpoint stands
            log.error("no space left in run_dir=%s at step %d (%s): the checkpoints before it are whole", run_dir,
                      version, e)
            raise SystemExit(exits.DISK_FULL) from e
        raise
    finally:
        link.close()
        if ranks.main:
            notices.close()
            transport.close()
            trained_ids.close()
        parallel.close(ranks)


if __name__ == "__main__":
    main()

"""learner/optim.py: AdamW with fp32 master weights and moments for bf16 parameters.

fp32 parameters: exactly torch's AdamW. bf16 parameters: the fp32 master follows fp32 AdamW exactly, the
parameter is its rounding, updates too small for bf16 accumulate, micro-batch gradients accumulate in fp32 (and
are clipped there), checkpoints keep the state fp32, and it runs on FSDP2's DTensor shards (two CPU ranks, gloo) with torch's distributed optimizer state dicts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from cascade_rl.learner.optim import MasterAdamW, clip_grad_norm_

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def grads(step: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in like]


def run(optimizer, ps, steps, first=0, lrs=None):
    for step in range(first, first + steps):
        if lrs is not None:
            for group in optimizer.param_groups:  # as the trainer does (warm-up)
                group["lr"] = lrs[step]
        for p, g in zip(ps, grads(step, ps)):
            p.grad = g.to(p.dtype)
        optimizer.step()


LRS = [1e-3 * (k + 1) for k in range(10)]


def test_fp32_parameters_are_exactly_torch_adamw():
    mine, theirs = params(torch.float32), params(torch.float32)
    opt = MasterAdamW(mine, **HYPER)
    ref = torch.optim.AdamW(theirs, **HYPER, foreach=False)
    run(opt, mine, 6, lrs=LRS)
    run(ref, theirs, 6, lrs=LRS)
    for p, q in zip(mine, theirs):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=0)
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}  # no master: the parameter is its own
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], ref.state[q][key], atol=1e-7, rtol=0)
        assert opt.state[p]["step"].dtype == torch.float32 and float(opt.state[p]["step"]) == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_tensor_update_gives_the_one_at_a_time_bits(dtype):
    """``foreach`` (the default: one op over every parameter of a bucket) and the loop over parameters: the same
    parameters, masters and moments, bit for bit, with weight decay, a changing lr, and a parameter that joins
    late (its own step count: a bucket of its own)."""
    late = torch.randn(4, 3, generator=torch.Generator().manual_seed(9))
    sides = []
    for foreach in (True, False):
        ps = [*params(dtype), late.clone().to(dtype).requires_grad_()]
        opt = MasterAdamW(ps, **HYPER, foreach=foreach)
        for step in range(5):
            for group in opt.param_groups:
                group["lr"] = LRS[step]
            for p, g in zip(ps, grads(step, ps)):
                p.grad = g.to(dtype) if (p is not ps[-1] or step >= 2) else None
            opt.step()
            opt.zero_grad()
        sides.append((ps, opt))
    (mine, fast), (theirs, slow) = sides
    assert {float(fast.state[p]["step"]) for p in mine} == {5.0, 3.0}
    for p, q in zip(mine, theirs):
        assert torch.equal(p, q)
        for key in slow.state[q]:
            assert torch.equal(fast.state[p][key], slow.state[q][key]), key


def test_bf16_master_follows_fp32_adamw_and_the_parameter_is_its_rounding():
    mine = params(torch.bfloat16)
    shadow = [p.detach().float().requires_grad_() for p in mine]  # fp32 AdamW on the same grads
    opt = MasterAdamW(mine, **HYPER)
    ref = torch.optim.AdamW(shadow, **HYPER, foreach=False)
    for step in range(5):
        for p, q, g in zip(mine, shadow, grads(step, mine)):
            p.grad = g.to(torch.bfloat16)
            q.grad = p.grad.float()
        opt.step()
        ref.step()
        for p, q in zip(mine, shadow):
            state = opt.state[p]
            assert {k: v.dtype for k, v in state.items()} == dict.fromkeys(
                ("step", "exp_avg", "exp_avg_sq", "master"), torch.float32)
            torch.testing.assert_close(state["master"], q.detach(), atol=1e-7, rtol=0)
            assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), state["master"].to(torch.bfloat16))
    assert any(not torch.equal(p.detach().float(), opt.state[p]["master"]) for p in mine)  # they do differ


def test_updates_too_small_for_bf16_accumulate_in_the_master():
    # bf16 spacing at 1.0 is 2^-7 (below it 2^-8): an AdamW step of ~lr = 1e-4 rounds away every time
    mine = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    plain = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    opt, ref = MasterAdamW([mine], lr=1e-4), torch.optim.AdamW([plain], lr=1e-4, weight_decay=0.0)
    for step in range(100):
        mine.grad, plain.grad = torch.ones_like(mine), torch.ones_like(plain)
        opt.step()
        ref.step()
        if step == 0:
            assert (mine == 1).all()  # one step does not move the bf16 value...
            assert (opt.state[mine]["master"] < 1).all()  # ...but it is in the master
    assert (plain == 1).all()  # plain AdamW on bf16 never moves it
    torch.testing.assert_close(opt.state[mine]["master"], torch.full((8,), 0.99), atol=1e-5, rtol=0)
    assert (mine < 0.995).all() and torch.equal(mine.detach(), opt.state[mine]["master"].to(torch.bfloat16))


def bf16_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(torch.bfloat16)


def model_step(model, optimizer, step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(9, 6, generator=g).to(torch.bfloat16)
    loss = model(x).float().pow(2).mean()
    loss.backward()
    clip_grad_norm_(model, optimizer, 1.0)  # the trainer's: MasterAdamW clips its fp32 accumulators
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_state_dict_round_trip_keeps_fp32_state_and_resumes_exactly(tmp_path):
    model = bf16_model()
    opt = MasterAdamW(model.parameters(), **HYPER)
    for step in range(3):
        model_step(model, opt, step)
    torch.save(opt.state_dict(), tmp_path / "optim.pt")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    model_step(model, opt, 3)  # the uninterrupted run's next step

    resumed = bf16_model(seed=1)
    resumed.load_state_dict(weights)
    opt2 = MasterAdamW(resumed.parameters(), **HYPER)
    saved = torch.load(tmp_path / "optim.pt", map_location="cpu", weights_only=True)
    opt2.load_state_dict(saved)
    for p in resumed.parameters():
        state = opt2.state[p]
        assert {k: v.dtype for k, v in state.items()} == dict.fromkeys(
            ("step", "exp_avg", "exp_avg_sq", "master"), torch.float32)
        assert not any(v is w for v in state.values() for w in saved["state"][0].values())  # copies, not aliases
    model_step(resumed, opt2, 3)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(opt.state[p]["master"], opt2.state[q]["master"]), name
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"]), name

    # why load_state_dict is overridden: torch's own casts the state to the parameter's dtype (bf16)
    plain = MasterAdamW(bf16_model().parameters(), **HYPER)
    torch.optim.Optimizer.load_state_dict(plain, saved)
    assert next(iter(plain.state.values()))["master"].dtype == torch.bfloat16


def test_a_plain_adamw_checkpoint_gets_a_master_on_the_next_step():
    model = bf16_model()
    plain = torch.optim.AdamW(model.parameters(), **HYPER)
    model_step(model, plain, 0)
    opt = MasterAdamW(model.parameters(), **HYPER)
    opt.load_state_dict(plain.state_dict())
    model_step(model, opt, 1)
    assert all(s["master"].dtype == torch.float32 and s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


@pytest.mark.parametrize("model_fixture", ["tiny_dense_model", "tiny_model"])
def test_a_bf16_tiny_model_learns_a_fixed_batch(model_fixture, request):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model_fixture), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    opt = MasterAdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)
    ids = torch.randint(3, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(6):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        clip_grad_norm_(model, opt, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    p = model.get_output_embeddings().weight
    assert torch.equal(p.detach(), opt.state[p]["master"].to(torch.bfloat16))



# --- fp32 gradient accumulation across micro-batches ---------------------------------------------------------


def micro_batches(k: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 6, generator=g).to(torch.bfloat16) for _ in range(k)]


def test_micro_batch_grads_accumulate_in_fp32_and_the_step_and_clip_use_them():
    """bf16 parameters, 12 backward passes: the optimizer's gradient is the fp32 sum of the 12 bf16 grads (the
    same values each backward alone gives, in the same order); ``p.grad`` holds none of it; clipping scales the
    fp32 sums and reports their norm; the step applies them; zero_grad drops them."""
    xs = micro_batches(12)
    alone = bf16_model()  # each micro-batch's own bf16 grad, summed in fp32 here
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in alone.parameters()]
    for x in xs:
        alone(x).float().pow(2).mean().backward()
        for e, p in zip(expected, alone.parameters()):
            e += p.grad.float()
        alone.zero_grad(set_to_none=True)

    model = bf16_model()
    opt = MasterAdamW(model.parameters(), **HYPER)
    for x in xs:
        model(x).float().pow(2).mean().backward()
    assert all(p.grad is None for p in model.parameters())  # freed by the hook: no bf16 accumulation
    grads = opt.grads()
    assert [g.dtype for g in grads] == [torch.float32] * len(expected)
    for g, e in zip(grads, expected):
        assert torch.equal(g, e)
    norm = clip_grad_norm_(model, opt, 0.5)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(torch.stack([e.norm() for e in expected])))
    assert norm > 0.5
    scale = 0.5 / (norm + 1e-6)
    for g, e in zip(opt.grads(), expected):
        torch.testing.assert_close(g, e * scale, atol=0, rtol=1e-6)

    shadow = [p.detach().float().requires_grad_() for p in model.parameters()]  # fp32 AdamW on the clipped sums
    ref = torch.optim.AdamW(shadow, **HYPER, foreach=False)
    for q, g in zip(shadow, opt.grads()):
        q.grad = g.clone()
    opt.step()
    ref.step()
    for p, q in zip(model.parameters(), shadow):
        torch.testing.assert_close(opt.state[p]["master"], q.detach(), atol=1e-7, rtol=0)
    opt.zero_grad(set_to_none=True)
    assert opt.grads() == [] and not opt.fp32_grads


def test_small_micro_batch_grads_added_to_a_large_one_survive_in_fp32_not_in_bf16():
    """A large gradient (1.0) then 100 small ones (1e-3): in bf16 each addition rounds back to 1.0 (its spacing at
    1 is 2^-7), so bf16 accumulation loses all of them; the fp32 accumulator keeps them: 1 + 100 * bf16(1e-3)."""
    small = torch.tensor(1e-3, dtype=torch.bfloat16)

    def backward_all(p):
        (p * torch.ones(4, dtype=torch.bfloat16)).sum().backward()
        for _ in range(100):
            (p * small).sum().backward()

    fp32_acc = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    opt = MasterAdamW([fp32_acc], lr=1e-3)
    backward_all(fp32_acc)
    torch.testing.assert_close(opt.grads()[0], torch.full((4,), 1 + 100 * small.item()), atol=1e-5, rtol=0)

    bf16_acc = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    MasterAdamW([bf16_acc], lr=1e-3, fp32_grads=False)  # the old behaviour: autograd sums into the bf16 p.grad
    backward_all(bf16_acc)
    assert torch.equal(bf16_acc.grad, torch.ones(4, dtype=torch.bfloat16))  # 100 small grads lost

# --- FSDP2: DTensor shards and torch's distributed optimizer state dicts (as learner/trainer.py uses them) ---

DIST_SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from cascade_rl.learner.optim import MasterAdamW

    HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def model():
        torch.manual_seed(0)  # 33 rows: uneven shards over two ranks
        return nn.Sequential(nn.Linear(6, 33), nn.Tanh(), nn.Linear(33, 3)).to(torch.bfloat16)

    def step(m, opt, k):
        g = torch.Generator().manual_seed(k)  # every rank the same batch: the averaged grad is the 1-rank grad
        m(torch.randn(9, 6, generator=g).to(torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), sys.argv[1]
    single, sharded = model(), model()
    for layer in sharded[::2]:
        fully_shard(layer)
    fully_shard(sharded)
    # the shards multi-tensor (DTensor foreach ops, as on CUDA), the single rank one parameter at a time (the CPU's
    # default): the same bits
    opt1, opt2 = MasterAdamW(single.parameters(), **HYPER), MasterAdamW(sharded.parameters(), **HYPER, foreach=True)
    for k in range(3):
        step(single, opt1, k)
        step(sharded, opt2, k)
    report = {"dtensor": all(isinstance(p, DTensor) for p in sharded.parameters()),
              "state_dtypes": sorted({str(v.dtype) for s in opt2.state.values() for v in s.values()}),
              "master_is_dtensor": all(isinstance(s["master"], DTensor) for s in opt2.state.values())}
    report["param_diff"] = max((full(q).float() - p.float()).abs().max().item()
                               for p, q in zip(single.parameters(), sharded.parameters()))
    report["master_diff"] = max((full(opt2.state[q]["master"]) - opt1.state[p]["master"]).abs().max().item()
                                for p, q in zip(single.parameters(), sharded.parameters()))

    # save as the trainer does (full, on the CPU; rank 0 writes), resume into a fresh sharded model
    osd = get_optimizer_state_dict(sharded, opt2, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        report["saved_dtypes"] = sorted({str(v.dtype) for s in osd["state"].values() for v in s.values()})
        torch.save(osd, out + ".pt")
    dist.barrier()
    resumed = model()
    resumed.load_state_dict({k: full(v) for k, v in sharded.state_dict().items()})
    for layer in resumed[::2]:
        fully_shard(layer)
    fully_shard(resumed)
    opt3 = MasterAdamW(resumed.parameters(), **HYPER, foreach=True)
    loaded = torch.load(out + ".pt", map_location="cpu", weights_only=True)
    set_optimizer_state_dict(resumed, opt3, optim_state_dict=loaded,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    report["loaded_dtypes"] = sorted({str(v.dtype) for s in opt3.state.values() for v in s.values()})
    step(sharded, opt2, 3)
    step(resumed, opt3, 3)
    report["resume_param_diff"] = max((full(p).float() - full(q).float()).abs().max().item()
                                      for p, q in zip(sharded.parameters(), resumed.parameters()))
    report["resume_master_diff"] = max(
        (full(opt2.state[p]["master"]) - full(opt3.state[q]["master"])).abs().max().item()
        for p, q in zip(sharded.parameters(), resumed.parameters()))
    if rank == 0:
        json.dump(report, open(out, "w"))
    dist.barrier()  # neither rank tears gloo down while the other still talks to it (SIGABRT at exit)
    dist.destroy_process_group()
''')


def test_fsdp2_shards_step_like_one_rank_and_resume_exactly(tmp_path):
    script, out = tmp_path / "dist_optim.py", tmp_path / "report.json"
    script.write_text(DIST_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONSAFEPATH="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(script), str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dtensor"] and report["master_is_dtensor"], report
    assert report["state_dtypes"] == report["saved_dtypes"] == report["loaded_dtypes"] == ["torch.float32"], report
    assert report["param_diff"] == 0 and report["master_diff"] == 0, report
    assert report["resume_param_diff"] == 0 and report["resume_master_diff"] == 0, report

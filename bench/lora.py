"""LoRA RL (``trainer.lora``) against full fine-tuning: trainer memory and step time, bytes and time per weight version.

    .venv/bin/python bench/lora.py [--quick | --smoke] [--sizes 50m,wide] [--ranks 8,64] [--steps N]

The trainer as a run builds it (learner/trainer.py ``build`` of ``compose("tiny", [model.path=..., trainer.lora.rank=R,
trainer.kl_coef=0])``: fp32, packed, the ``grouped`` experts, MasterAdamW on what requires grad), on random Qwen3-MoE
models: ``50m`` (``make-tiny-model --size 50m``: hidden 512, 8 layers, 8 experts of 512, 57M parameters) and
``wide`` (a slice of Qwen3-30B-A3B's real layer shape: hidden 2048, 32 / 4 heads of 128, experts 768 wide, top-8,
but 2 layers, 16 experts and 50m's 321-token vocabulary, so that full fine-tuning fits in this machine's memory and a
step in a minute of 2 cores; real_shapes.py's one real layer, 1.2B parameters with its 152K vocabulary, needs
~15 GB for AdamW's state alone). LoRA adapts q/k/v/o (Qwen3-MoE has no dense MLP; the fused routed experts are not
adapted, learner/lora.py). Each (size, mode) in a child process of its own: ``full`` (the baseline, same run), ``r8``,
``r64``. The batch: ``--groups`` x ``--group-size`` rows of 64 prompt + 256 response tokens (random ids, rewards 0/1
within each group), ``--steps`` ``train_step``s:

  build_gib      RSS once built (weights, adapters)
  step_gib       peak RSS over the steps minus ``build_gib`` (activations, gradients, optimizer state)
  optim_bytes    the optimizer's state (every tensor in ``optimizer.state``), after the steps
  trainable      parameters that require grad
  step_s         median seconds of a step, the first (warm-up, the optimizer's state allocated) left out; one
                 torch thread (as real_shapes.py: with two on this shared 2-core machine, steps of the same
                 child varied 2.5-18 s as neighbours came and went)

Then, in the same child, one weight version after another through ``publish`` (learner/trainer.py) with the ``shm``
transport (a safetensors file in /dev/shm, checksummed): the adapter alone (``AdapterSource``) for LoRA, every
weight for ``full``; ``nbytes`` (the notice's) and the median seconds over ``--rounds`` versions; and the
receiving side's apply, the torch engine's (samplers/torch_engine.py) ``load_adapter`` (merged into W0 of the
adapted modules) or ``load_weights``, median seconds over the same versions. The ratios are LoRA / full.
``--smoke``: the ``tiny`` random model, 1 group of 2 rows of 8 + 8 tokens, one step, ``full`` and ``r8``, 1 version.
Writes bench/results/lora.json; the last stdout line is the summary JSON object.
"""

from __future__ import annotations

import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, machine, random_model, results_dir, run_child, write_result  # noqa: E402

PROMPT, RESPONSE = 64, 256
WIDE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
            num_local_experts=16, num_experts=16, num_experts_per_tok=8, num_hidden_layers=2, intermediate_size=6144,
            mlp_only_layers=[])  # Qwen3-30B-A3B's layer (hidden, heads, expert width, top-8), 16 experts, 2 layers


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def wide_model(under: Path) -> Path:
    """50m's tokenizer and config with ``WIDE``'s shape, random weights (seed 0), saved once under ``under``."""
    out = under / "lora-wide"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base, _ = random_model("50m", under)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp, ignore=shutil.ignore_patterns("model.safetensors"))
    cfg = json.loads((tmp / "config.json").read_text()) | WIDE
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp), dtype=torch.float32).save_pretrained(tmp)
    tmp.rename(out)
    return out


def make_batch(groups: int, g: int, prompt: int, resp: int, vocab: int, seed: int = 0):
    import numpy as np

    from cascade_rl.learner.trainer import Batch
    from cascade_rl.protocol.rows import from_padded

    rng = np.random.default_rng(seed)
    n = groups * g
    ids = rng.integers(5, vocab, size=(n, prompt + resp)).astype(np.int32)
    mask = np.zeros((n, prompt + resp), bool)
    mask[:, prompt:] = True
    rewards = np.tile((np.arange(g) % 2).astype(np.float32), groups)  # half of each group rewarded
    inf = np.full((n, prompt + resp), -2.0, np.float32) * mask
    return Batch.from_message(from_padded(step=0, group_size=g, input_ids=ids, response_mask=mask, inf_logprobs=inf,
                                              rewards=rewards, versions=np.zeros(n, np.int32)))


def child(spec: str) -> None:
    """One (model, rank): build, ``steps`` train steps, ``rounds`` published versions applied by a torch engine;
    prints the row's JSON."""
    import torch

    from cascade_rl.learner import parallel
    from cascade_rl.learner.trainer import build, publish, train_step
    from cascade_rl.supervisor.config import compose
    from cascade_rl.weights.shm import ShmTransport

    s = json.loads(spec)
    torch.set_num_threads(1)  # as real_shapes.py: on 2 shared cores a second spinning thread measures the neighbours
    torch.manual_seed(0)
    run_dir = tempfile.mkdtemp(prefix="bench-lora-")
    cfg = compose("tiny", [f"model.path={s['model']}", f"run_dir={run_dir}", f"trainer.lora.rank={s['rank']}",
                           "trainer.kl_coef=0.0"], check=False)
    t0 = time.perf_counter()
    policy, reference, optimizer, _, _ = build(cfg, parallel.Ranks())
    build_s = time.perf_counter() - t0
    built = rss_gib()
    vocab = policy.model.config.vocab_size
    batch = make_batch(s["groups"], s["g"], s["prompt"], s["resp"], vocab)
    times = []
    for step in range(s["steps"]):
        t0 = time.perf_counter()
        metrics = train_step(policy, optimizer, batch, cfg.trainer, step, reference, run=cfg.run)
        times.append(time.perf_counter() - t0)
    peak = peak_gib()
    optim = sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
                if isinstance(t, torch.Tensor))
    row = {"build_gib": round(built, 3), "step_gib": round(peak - built, 3), "peak_gib": round(peak, 3),
           "optim_bytes": optim, "trainable": sum(p.numel() for p in policy.parameters() if p.requires_grad),
           "params": sum(p.numel() for p in policy.parameters()),
           "step_s": round(statistics.median(times[1:] or times), 3), "step_min_s": round(min(times[1:] or times), 3),
           "step_times": [round(t, 3) for t in times],
           "build_s": round(build_s, 2), "grad_norm": metrics["grad_norm"]}

    from cascade_rl.samplers import torch_engine

    engine = torch_engine.TorchEngine(s["model"], max_batch=1)
    can_apply = hasattr(engine, "load_adapter") or s["rank"] == 0
    transport = ShmTransport(run_id=f"bench-lora-{Path(run_dir).name}")
    pub, apply, nbytes = [], [], None
    try:
        for version in range(1, s["rounds"] + 1):
            t0 = time.perf_counter()
            notice = publish(transport, policy, parallel.Ranks(), version)
            pub.append(time.perf_counter() - t0)
            nbytes = notice.nbytes
            if can_apply:
                path = notice.uri.removeprefix("file://")
                t0 = time.perf_counter()
                if notice.adapter:
                    engine.load_adapter(path, version, notice.adapter)
                else:
                    engine.load_weights(path, version)
                apply.append(time.perf_counter() - t0)
    finally:
        transport.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    row.update(publish_bytes=nbytes, publish_s=round(statistics.median(pub), 4),
               apply_s=round(statistics.median(apply), 4) if apply else None,
               apply="load_adapter" if s["rank"] and apply else "load_weights" if apply else "absent")
    print(json.dumps(row), flush=True)


def measure(spec: dict, timeout: float) -> dict:
    """``child`` in a process of its own: its last stdout line, or {"error": ...}."""
    return run_child(__file__, ["--child", json.dumps(spec)], timeout)


def ratio(a, b) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(argv[1])
        return {}
    ap = bench_parser(__doc__, quick="50m only, 2 steps a mode",
                      smoke="the tiny model, 2 rows of 16 tokens, one step (the code path, no figures)")
    ap.add_argument("--sizes", default="", help="comma-separated: 50m, wide (default: both; --quick: 50m)")
    ap.add_argument("--ranks", default="8,64", help="comma-separated LoRA ranks beside full fine-tuning")
    ap.add_argument("--steps", type=int, default=0, help="train steps a mode (default 3; --quick 2)")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="weight versions published a mode")
    args = ap.parse_args(argv)
    under = results_dir(True) / "models" if args.smoke else None
    if args.smoke:
        sizes, ranks, steps, rounds = ["tiny"], [8], 1, 1
        shape = (1, 2, 8, 8)
    else:
        sizes = args.sizes.split(",") if args.sizes else ["50m"] if args.quick else ["50m", "wide"]
        ranks = [int(r) for r in args.ranks.split(",")]
        steps, rounds = args.steps or (2 if args.quick else 3), args.rounds
        shape = (args.groups, args.group_size, PROMPT, RESPONSE)
    rows: dict[str, dict] = {}
    models: dict[str, str] = {}
    for size in sizes:
        model = wide_model(under or Path(__file__).resolve().parent / "results" / "models") if size == "wide" \
            else random_model(size, under)[0]
        models[size] = str(model)
        rows[size] = {}
        for mode, rank in [("full", 0), *[(f"r{r}", r) for r in ranks]]:
            spec = {"model": str(model), "rank": rank, "groups": shape[0], "g": shape[1], "prompt": shape[2],
                    "resp": shape[3], "steps": steps, "rounds": rounds}
            rows[size][mode] = measure(spec, timeout=1800)
            print(json.dumps({"size": size, "mode": mode, **rows[size][mode]}), file=sys.stderr, flush=True)
        full = rows[size]["full"]
        for mode, r in rows[size].items():
            if mode != "full" and "step_gib" in r and "step_gib" in full:
                r["vs_full"] = {k: ratio(r[k], full[k]) for k in ("step_gib", "optim_bytes", "trainable", "step_s",
                                                                  "step_min_s", "publish_bytes", "publish_s", "apply_s")}
    batch = {"groups": shape[0], "group_size": shape[1], "prompt": shape[2], "response": shape[3], "steps": steps,
             "publish_rounds": rounds}
    path = results_dir(args.smoke) / "lora.json"  # sizes measured by an earlier run (--sizes) are kept
    old = json.loads(path.read_text()) if path.is_file() and not args.smoke else {}
    rows = {**old.get("rows", {}), **rows}
    models = {**old.get("models", {}), **models}
    batches = {**old.get("batches", {}), **{s: batch for s in sizes}}
    size = "50m" if "50m" in rows else sizes[0]
    lo = next((m for m in rows[size] if m != "full" and "vs_full" in rows[size][m]), None)
    full = rows[size]["full"]
    summary = {"name": "lora", "metric": f"trainer step memory GiB, {size}, LoRA {lo} (peak RSS less RSS once built)",
               "value": rows[size][lo]["step_gib"] if lo else None, "baseline": "full fine-tuning",
               "baseline_value": full.get("step_gib"), "ratio": rows[size][lo]["vs_full"]["step_gib"] if lo else None,
               "target": None, "pass": None}
    record = {**summary, "machine": machine(), "models": models, "batches": batches,
              "settings": "compose('tiny'): fp32, packed, grouped experts, MasterAdamW, kl_coef 0, lora alpha 16, "
                          "targets q/k/v/o (the experts are not adapted); publish: shm transport",
              "rows": rows}
    return write_result(summary, record, smoke=args.smoke)


if __name__ == "__main__":
    main()

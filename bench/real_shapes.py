"""Real layer shapes on this machine: Nemotron-3-Nano-30B-A3B and Qwen3-30B-A3B, a few layers each (issue 35, 5).

    .venv/bin/python bench/real_shapes.py [--smoke] [--layers N] [--tokens N] [--rows N] [--context N]

Each model is built with transformers' own classes (``NemotronHForCausalLM``, ``Qwen3MoeForCausalLM``) at the real
per-layer shape and the real vocabulary, with as few layers as make the point: Nano ``ME*`` (one Mamba-2, one MoE,
one attention layer; ``--layers N``: Nano's own pattern cut at N, e.g. 14 on a GPU), Qwen3 one layer (N layers). bf16
everywhere (the CPU has bf16 GEMMs: AMX/AVX512-BF16; the Mamba-2 path is transformers' torch scan), random weights
(seed 0), the routers' correction bias random as a trained one is. Per model, each role in a child process of its
own so that the peak memory (``ru_maxrss``; on CUDA also ``max_memory_allocated``) is that role's alone:

  build    the model from its config, saved (config.json + one safetensors of HF's in-memory names) to a temp dir
  trainer  a trainer step: forward + backward of the mean next-token log-prob (modeling/logprobs.py
           ``token_logprobs``, the trainer's own) over ``--tokens`` tokens, with transformers' experts (``hf``: its
           default ``grouped_mm``) and ours (``use_moe_impl(model, "grouped")``) on the same model, alternating;
           the input embedding is frozen on CPU (its dense [V, H] gradient would cost 0.7 GB of the 10 GiB cap)
  engine   a sampler decode step through the torch engine's model class (samplers/models.py ``model_class``:
           samplers/nemotron_h_model.py ``NemotronH`` / samplers/torch_model.py ``Transformer``) loaded from the
           saved directory: ``--rows`` rows prefilled to ``--context`` tokens, then one-token decode steps
  hf       the same decode step with transformers' forward and its cache (prefill with ``logits_to_keep=1``)
  triton   kernels/moe.py's Triton experts (``impl="triton"``) against ``grouped`` on a real-shaped slice (real hidden
           size and expert width, 4 experts, 16 tokens, top-2, fp32), forward and gradients, max |diff|. On CPU in
           Triton's interpreter (``TRITON_INTERPRET=1``): its time is no speed figure, and it is slow: 16x16x16
           tiles, one interpreted program each, so at Nano's slice (2688 x 1856, forward and the weight gradients)
           it ran past 24 minutes on this machine (2026-12-03) and was stopped; ``--roles`` leaves it out, the GPU
           run (bench/gpu_checks.sh) compiles it.

Timing: one warm-up, then ``--rounds`` (2) timed rounds; the figure is the best, synchronized on CUDA. The
prefill's first call is the warm-up and is reported too (``prefill_cold_s``: on a GPU it loads each kernel; the
first H200 run timed only that, unsynchronized, and read the engine's prefill as half HF's speed). One torch thread on CPU (a 2-core
machine shared with others: a second spinning thread measures the neighbours). A child whose RSS passes
``--rss-cap-gib`` (9.5) is killed (the machine is shared); a trainer killed so is run once more with the LM head
frozen too, and the result says so. ``--smoke``: the same roles at tiny shapes (hidden 64, 4 experts) in this
process (no child: the imports would cost more than the run), seconds. Writes bench/results/real_shapes.json; the last stdout line is the
summary JSON object.

Where the shapes come from: the HF ``config.json`` of fine-tunes of Nano that keep its architecture
(OpenResearcher/OpenResearcher-30B-A3B, HebArabNlpProject/Hebatron: hidden 2688, ``hybrid_override_pattern``
MEMEM*E..., 128 routed experts top-6, ``moe_intermediate_size`` 1856, shared expert 3712, ``n_group`` 1, Mamba 64
heads x 64, ``n_groups`` 8, conv 4, chunk 128, 32 heads / 2 KV heads of 128, ``mlp_hidden_act`` relu2); the rest
(``ssm_state_size`` 128, ``routed_scaling_factor`` 2.5, vocabulary 131072) from the issue's description of Nano,
not found in those excerpts; Qwen3-30B-A3B from Qwen3-Coder-30B-A3B's config.json and MindSpeed-RL's
qwen3_30b_a3b.yaml (hidden 2048, 128 experts top-8, width 768, 32 / 4 heads of 128, vocabulary 151936, untied).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import bench_parser, machine, write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"  # Nemotron-3-Nano's 52 layers
LAYER = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}  # HF's layers_block_type


def nano(layers: int, smoke: bool) -> dict:
    """NemotronHConfig kwargs of Nano's layer shape; ``layers`` 0: ``ME*``, else Nano's pattern cut at ``layers``."""
    pattern = "ME*" if not layers else NANO_PATTERN[:layers]
    real = dict(hidden_size=2688, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
                moe_shared_expert_intermediate_size=3712, mamba_num_heads=64, mamba_head_dim=64, n_groups=8,
                ssm_state_size=128, chunk_size=128, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                vocab_size=131072, intermediate_size=1856)
    if smoke:
        real.update(hidden_size=64, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    moe_shared_expert_intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                    ssm_state_size=16, chunk_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    vocab_size=512, intermediate_size=32)
    return dict(real, layers_block_type=[LAYER[c] for c in pattern], conv_kernel=4, n_group=1, topk_group=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, mlp_hidden_act="relu2", tie_word_embeddings=False,
                max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def qwen3(layers: int, smoke: bool) -> dict:
    """Qwen3MoeConfig kwargs of Qwen3-30B-A3B's layer shape, ``layers`` (0: 1) layers."""
    real = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, intermediate_size=6144)
    if smoke:
        real.update(hidden_size=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512, intermediate_size=128)
    return dict(real, num_hidden_layers=layers or 1, norm_topk_prob=True, decoder_sparse_step=1, rope_theta=1e7,
                tie_word_embeddings=False, max_position_embeddings=4096, rms_norm_eps=1e-6)


# model -> (its config kwargs, transformers' config and model class names, the expert activation)
MODELS = {
    "nemotron_3_nano_30b_a3b": (nano, "NemotronHConfig", "NemotronHForCausalLM", "relu2"),
    "qwen3_30b_a3b": (qwen3, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "swiglu"),
}


# --- the roles, each run in a child process ---------------------------------------------------------------------


def peak() -> dict:
    """This process's peak RSS (and, on CUDA, peak allocated) so far, in GiB."""
    out = {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    if torch.cuda.is_available():
        out["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def rss_now() -> float:
    """VmRSS of this process now, GiB."""
    kib = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmRSS"))
    return round(kib / 2**20, 2)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cold(fn) -> float:
    """One call, the first of its kind in this process (CUDA loads each kernel at its first launch), seconds."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return round(time.perf_counter() - t0, 4)


def timed(fn, rounds: int, warm_up: bool = True) -> float:
    """Best of ``rounds`` calls after one warm-up (``warm_up=False``: the caller's call was it), seconds."""
    if warm_up:
        fn()
    best = float("inf")
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return round(best, 4)


def hf_model(model: str, args):
    """The transformers model of ``model`` from its config, random (seed 0), bf16, on the device."""
    import transformers

    kwargs, config_cls, model_cls, _ = MODELS[model]
    cfg = getattr(transformers, config_cls)(**kwargs(args.layers, args.smoke))
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(args.device):
        m = getattr(transformers, model_cls)(cfg)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():  # a trained router's correction bias is not zero (learner/tiny_model.py does the same)
        for name, buf in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.uniform_(-0.05, 0.05)
    return m


def role_build(model: str, args) -> dict:
    """Save the model as HF's in-memory names in shards of about 1 GB (samplers/torch_model.py
    ``read_safetensors`` reads the index): a single file would be serialised whole in memory, a second copy of
    the weights."""
    from safetensors.torch import save_file

    m = hf_model(model, args)
    m.config.save_pretrained(args.dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, t in m.state_dict().items():
        if shards[-1] and sum(v.nbytes for v in shards[-1].values()) + t.nbytes > 2**30:
            shards.append({})
        shards[-1][name] = t.contiguous()
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(Path(args.dir) / file))
        weight_map |= dict.fromkeys(shard, file)
    (Path(args.dir) / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {"params": sum(p.numel() for p in m.parameters()), "shards": len(shards)}


def role_trainer(model: str, args) -> dict:
    """Forward + backward of the mean next-token log-prob, experts hf vs grouped on the same model."""
    from cascade_rl.modeling.experts import use_moe_impl
    from cascade_rl.modeling.logprobs import token_logprobs

    m = hf_model(model, args).train()
    frozen = [w for w in args.frozen.split(",") if w]
    for what in frozen:  # on CPU, for the memory cap: dense [V, H] gradients the step does not need to show
        {"embed": m.get_input_embeddings(), "head": m.get_output_embeddings()}[what].weight.requires_grad_(False)
    rows = max(1, args.tokens // 512) if not args.smoke else 2
    ids = torch.randint(m.config.vocab_size, (rows, args.tokens // rows), device=args.device)
    hf_impl = m.config._experts_implementation  # transformers' default ("grouped_mm")

    def step() -> None:
        lp = token_logprobs(m(input_ids=ids, use_cache=False).logits, ids)
        (-lp[:, 1:].mean()).backward()
        for p in m.parameters():
            p.grad = None

    def use(impl: str) -> None:
        m.set_experts_implementation(hf_impl) if impl == "hf" else use_moe_impl(m, impl)

    times: dict[str, float] = {}
    for impl in ("hf", "grouped"):  # warm-up each, then the rounds alternate
        use(impl)
        step()
    for _ in range(args.rounds):
        for impl in ("hf", "grouped"):
            use(impl)
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times[impl] = min(times.get(impl, float("inf")), round(time.perf_counter() - t0, 4))
    return {"tokens": ids.numel(), "frozen": frozen, "step_s": times, "hf_over_grouped": round(times["hf"] / times["grouped"], 3),
            "experts_hf": hf_impl}


def decode_inputs(vocab: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(vocab, (args.rows, args.context), generator=g)
    steps = torch.randint(vocab, (args.rounds + 1, args.rows), generator=g)
    return prompts.to(args.device), steps.to(args.device)


@torch.no_grad()
def role_engine(model: str, args) -> dict:
    """The torch engine's model class, loaded from the saved directory: prefill, then one-token decode steps."""
    from transformers import AutoConfig

    from cascade_rl.samplers.models import model_class

    cls = model_class(AutoConfig.from_pretrained(args.dir).model_type)
    t0 = time.perf_counter()
    m = cls.from_pretrained(args.dir, dtype=torch.bfloat16, device=args.device, moe_impl="grouped")
    load_s = round(time.perf_counter() - t0, 2)
    prompts, steps = decode_inputs(m.args.vocab_size, args)
    slots = torch.arange(args.rows, device=args.device)
    cache = m.new_cache(args.rows, args.context + args.rounds + 2, dtype=torch.bfloat16, device=args.device)
    positions = torch.arange(args.context, device=args.device).expand(args.rows, -1)
    last = torch.full_like(slots, args.context - 1)

    def prefill() -> None:  # from a zero state into the same slots: each call leaves the same cache
        m(prompts, positions, cache.prefill(slots, slots), last=last)

    prefill_cold_s = cold(prefill)
    prefill_s = timed(prefill, args.rounds, warm_up=False)
    at = iter(range(args.rounds + 1))

    def step() -> None:
        i = next(at)
        m.decode(steps[i], torch.full_like(slots, args.context + i), cache, kv_len=args.context + i + 1)

    return {"impl": f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}, grouped experts", "load_s": load_s,
            "prefill_s": prefill_s, "prefill_cold_s": prefill_cold_s, "decode_step_s": timed(step, args.rounds),
            "rss_after_gib": rss_now()}


@torch.no_grad()
def role_hf(model: str, args) -> dict:
    """transformers' forward with its cache: a prefill keeping the last logits, then one-token decode steps."""
    m = hf_model(model, args).eval()
    prompts, steps = decode_inputs(m.config.vocab_size, args)
    cache = None

    def prefill() -> None:  # a new cache each call: the decode steps continue the last one
        nonlocal cache
        cache = m(input_ids=prompts, use_cache=True, logits_to_keep=1).past_key_values

    prefill_cold_s = cold(prefill)
    prefill_s = timed(prefill, args.rounds, warm_up=False)
    at = iter(range(args.rounds + 1))

    def step() -> None:
        m(input_ids=steps[next(at)][:, None], past_key_values=cache, use_cache=True)

    return {"impl": f"{type(m).__name__} forward with {type(cache).__name__}", "prefill_s": prefill_s,
            "prefill_cold_s": prefill_cold_s, "decode_step_s": timed(step, args.rounds), "rss_after_gib": rss_now()}


def role_triton(model: str, args) -> dict:
    """Triton experts vs grouped on a real-shaped slice: outputs and gradients, fp32."""
    from cascade_rl.kernels.moe import moe_experts

    kwargs, _, _, activation = MODELS[model]
    cfg = kwargs(0, args.smoke)
    hidden = cfg["hidden_size"]
    width = cfg["moe_intermediate_size"]
    experts, tokens, k = 4, 16, 2
    g = torch.Generator().manual_seed(2)
    first = width * (2 if activation == "swiglu" else 1)
    x = torch.randn(tokens, hidden, generator=g)
    up = torch.randn(experts, first, hidden, generator=g) * hidden**-0.5
    down = torch.randn(experts, hidden, width, generator=g) * width**-0.5
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g)
    dy = torch.randn(tokens, hidden, generator=g)
    out = {}
    for impl in ("grouped", "triton"):
        leaves = [t.clone().to(args.device).requires_grad_(True) for t in (x, up, down)]
        t0 = time.perf_counter()
        y = moe_experts(leaves[0], w.to(args.device), ids.to(args.device), leaves[1], leaves[2], impl=impl,
                        activation=activation)
        y.backward(dy.to(args.device))
        sync()
        out[impl] = (time.perf_counter() - t0, [y.detach().cpu()] + [t.grad.cpu() for t in leaves])
    names = ("y", "d_x", "d_up", "d_down")
    diff = {n: float((a - b).abs().max()) for n, a, b in zip(names, out["triton"][1], out["grouped"][1])}
    scale = {n: float(b.abs().max()) for n, b in zip(names, out["grouped"][1])}
    return {"slice": f"{tokens} tokens, {experts} experts top-{k}, hidden {hidden}, width {width}, {activation}, fp32",
            "interpreted": os.environ.get("TRITON_INTERPRET") == "1", "max_abs_diff": diff,
            "max_rel_diff": max(diff[n] / max(scale[n], 1e-30) for n in names),
            "triton_s": round(out["triton"][0], 2), "grouped_s": round(out["grouped"][0], 4)}


ROLES = {"build": role_build, "trainer": role_trainer, "engine": role_engine, "hf": role_hf, "triton": role_triton}


def child(role: str, model: str, args) -> None:
    result = ROLES[role](model, args)
    print(json.dumps({**result, **peak()}), flush=True)


# --- the parent -------------------------------------------------------------------------------------------------


def watch(proc: subprocess.Popen, cap_gib: float) -> bool:
    """Wait for ``proc``, killing it if its RSS passes ``cap_gib`` (this machine is shared); True if killed."""
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            kib = next(int(ln.split()[1]) for ln in status.read_text().splitlines() if ln.startswith("VmRSS"))
        except (OSError, StopIteration):
            kib = 0
        if kib > cap_gib * 2**20:
            proc.kill()
            proc.wait()
            return True
        time.sleep(0.05)
    return False


def run_role(role: str, model: str, args, argv: list[str]) -> dict:
    """One role in a child process (killed past ``--rss-cap-gib``); its JSON line, or {"error": ...} (the other
    roles still run). In a smoke run, in this process: the same functions, without the imports' seconds."""
    if args.smoke:
        return {**ROLES[role](model, args), **peak()}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if role == "triton" and args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, __file__, "--child", role, model, "--dir", args.dir, *argv]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        killed = watch(proc, args.rss_cap_gib)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    wall = round(time.perf_counter() - t0, 1)
    if killed or proc.returncode:
        why = f"killed past {args.rss_cap_gib} GiB RSS" if killed else f"exit {proc.returncode}"
        print(f"[{model} {role}] {why}: {stderr[-2000:]}", file=sys.stderr, flush=True)
        return {"error": f"{why}: {stderr.strip().splitlines()[-1] if stderr.strip() else ''}", "wall_s": wall}
    result = {**json.loads(stdout.strip().splitlines()[-1]), "wall_s": wall}
    print(f"[{model} {role}] {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = bench_parser(__doc__, quick="the same as a full run (it is one step per figure already)",
                      smoke="tiny shapes, the same code path: seconds")
    ap.add_argument("--layers", type=int, default=0, help="Nano's pattern cut at N layers / Qwen3 N layers "
                    "(default: Nano ME*, Qwen3 1)")
    ap.add_argument("--tokens", type=int, default=0, help="trainer tokens (default 1024; smoke 64)")
    ap.add_argument("--rows", type=int, default=0, help="decode rows (default 16; smoke 2)")
    ap.add_argument("--context", type=int, default=0, help="decode context (default 512; smoke 32)")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds after the warm-up")
    ap.add_argument("--threads", type=int, default=1, help="CPU torch threads")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    ap.add_argument("--roles", default="trainer,engine,hf,triton", help="of trainer, engine, hf, triton")
    ap.add_argument("--frozen", default=None, help="trainer weights without a gradient: embed, head (default: embed "
                    "on CPU, none on CUDA)")
    ap.add_argument("--rss-cap-gib", type=float, default=9.5, help="a child past this RSS is killed")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--child", nargs=2, metavar=("ROLE", "MODEL"), help=argparse_suppress())
    ap.add_argument("--dir", help=argparse_suppress())
    args = ap.parse_args(argv)
    args.tokens = args.tokens or (64 if args.smoke else 1024)
    args.rows = args.rows or (2 if args.smoke else 16)
    args.context = args.context or (32 if args.smoke else 512)
    if args.frozen is None:
        args.frozen = "embed" if args.device == "cpu" else ""
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.smoke and args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels/moe_triton.py is first imported
    if args.child:
        child(*args.child, args)
        return {}
    passed = list(argv if argv is not None else sys.argv[1:])
    roles = [r for r in args.roles.split(",") if r]
    results: dict[str, dict] = {}
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix=f"real-{model}-") as d:
            args.dir = d
            results[model] = {"build": run_role("build", model, args, passed)} if {"engine"} & set(roles) else {}
            for role in roles:
                results[model][role] = run_role(role, model, args, passed)
            if "killed" in results[model].get("trainer", {}).get("error", "") and "head" not in args.frozen:
                # past the cap: once more without the LM head's gradient, said so in the result
                results[model]["trainer"] = {"first_try": results[model]["trainer"], **run_role(
                    "trainer", model, args, [*passed, "--frozen", "embed,head"])}
    head = results.get("nemotron_3_nano_30b_a3b", next(iter(results.values())))
    steps = head.get("trainer", {}).get("step_s", {})
    ours, theirs = steps.get("grouped"), steps.get("hf")
    summary = {
        "name": "real_shapes",
        "metric": f"Nemotron-3-Nano-30B-A3B real-shape layers (ME*), trainer step s (fwd+bwd, {args.tokens} tokens, "
                  f"bf16, {args.device}), grouped experts",
        "value": ours, "baseline": "transformers' own experts (grouped_mm), same model, same run",
        "baseline_value": theirs, "ratio": round(theirs / ours, 3) if ours and theirs else None, "target": None,
        "pass": None, "machine": machine(),
    }
    full = {**summary, "results": results, "layers": args.layers, "tokens": args.tokens, "rows": args.rows,
            "context": args.context, "rounds": args.rounds, "threads": args.threads, "device": args.device}
    return write_result(summary, full, smoke=args.smoke)


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()

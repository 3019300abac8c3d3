"""cascade-rl GRPO vs TRL's GRPOTrainer: the same model, prompts, reward and hardware, runs alternating.

    .venv/bin/python bench/vs_trl.py [--quick | --smoke] [--rounds 3] [--steps 20] [--size tiny|10m|50m]   (make bench-trl)

The setup, identical for both (issue 9): the SFT'd tiny Qwen3-MoE of ``make run`` (models/tiny-sft; built
here if missing), reasoning-gym arithmetic, the prompts cascade-rl's orchestrator draws (seed 0) fed to TRL in
the same order, 8 prompts x 8 generations per step, at most 64 completion tokens, temperature 1, lr 3e-6
constant, no KL, fp32 on CPU, the strict boxed-answer math reward (``verifiers.math.score_math``, called from
TRL's reward function), the same number of steps. Three systems run in every round, in an order that rotates:

- ``ours_sync``: ``cascade-rl launch`` strictly on-policy (max_staleness 0), every process real (orchestrator,
  trainer, torch-engine sampler, verifier pool) over ZeroMQ;
- ``ours_async``: the same with max_staleness 1 (one batch sampled ahead, truncated importance weights;
  sampler and trainer one thread each, as they now run at once);
- ``trl``: TRL 1.16 ``GRPOTrainer`` (bench/_trl_grpo.py) in its own virtual environment, ``.venv-trl``, built
  here on first use (TRL is never a dependency of the project): use_cpu, bf16 off, no vLLM, no reporting,
  one 64-row micro-batch per step, gradient checkpointing off (TRL's default is on; it only costs time here).

``--size 10m|50m``: the same with ``make-tiny-model --size`` models (Qwen3-MoE, 10.7M and 56.8M parameters, random
weights, built once under bench/results/models by ``_common.random_model``): their responses run to the 64-token
limit on both sides, so each step samples 8 x 8 x 64 tokens and the reward is 0 (the step still computes every
loss term; timing is what these sizes measure). Target there: <= 0.5x; at tiny <= 0.40x in every round.

Per run: median step wall time over the steps after ``--warmup``, generation tokens/s, trainer seconds per
step, peak memory (each process's peak RSS, summed over the run's process tree) and reward per step.
The headline is the median over rounds of ``ours_sync / trl`` step time, each ratio from one round (the runs
of a round are back to back, so machine drift cancels), with its range. Writes bench/results/vs_trl.json.

``--smoke``: one round of 2 steps of 2 prompts x 2, 8 tokens, on a random tiny model and a few rows of data;
ours_sync alone, launched ``--inline`` (every role a thread of one process: about a third of the CPU of a
launch's process tree), no TRL (the ratios are null): the code path in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, machine, math_data, random_model, sft_model, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TRL_VENV = ROOT / ".venv-trl"
TRL_VERSION = "1.16.0"
CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]
TARGETS = {"tiny": 0.40, "10m": 0.5, "50m": 0.5}  # ours_sync step time / TRL step time, in every round
STEPS = {"tiny": 20, "10m": 10, "50m": 6}  # per run (--steps overrides)
SETUP = {"prompts_per_step": 8, "group_size": 8, "max_tokens": 64, "lr": 3e-6, "seed": 0, "smoke": False}
SMOKE_SETUP = {"prompts_per_step": 2, "group_size": 2, "max_tokens": 8, "smoke": True}  # --smoke: over SETUP


def trl_python() -> Path:
    """.venv-trl/bin/python with TRL, torch and the project's own pins of the libraries both load the model
    and the reward with; the project itself installed without dependencies (for the reward function)."""
    py = TRL_VENV / "bin" / "python"
    pins = [f"torch=={metadata.version('torch').split('+')[0]}", f"trl=={TRL_VERSION}"] + [
        f"{p}=={metadata.version(p)}" for p in ("transformers", "tokenizers", "safetensors", "reasoning-gym",
                                                "math-verify")]
    stamp = TRL_VENV / ".installed"
    if stamp.exists() and stamp.read_text() == "\n".join(pins):
        return py
    print(f"building {TRL_VENV} (TRL {TRL_VERSION}; a few minutes, once)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(TRL_VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, pins[0]], check=True)  # first and pinned: the CPU wheel, never a CUDA build
    subprocess.run([*pip, *pins], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio"], check=True)
    stamp.write_text("\n".join(pins))
    return py


def model_dir(size: str = "tiny") -> Path:
    """The SFT'd tiny model of ``make run`` (built the same way if missing, about 3 minutes; a smoke run's: random),
    or the random-weight model of ``size``."""
    return sft_model(SETUP["smoke"]) if size == "tiny" else random_model(size)[0]


def write_prompts(model: Path, steps: int, path: Path) -> None:
    """The prompts of cascade-rl's first ``steps`` steps, in the order its orchestrator draws them: the same
    files prepared the same way, the same seeded draw order, the same chat-template rendering."""
    from transformers import AutoTokenizer

    from cascade_rl.data.prepare import prepare
    from cascade_rl.data.promptset import PromptStream
    from cascade_rl.data.render import PromptRenderer
    from cascade_rl.supervisor.config import compose

    tokenizer = AutoTokenizer.from_pretrained(model)
    data = compose(None, [*math_data(smoke=SETUP["smoke"]), f"data.seed={SETUP['seed']}"], check=False).data  # run_ours's data section
    with tempfile.TemporaryDirectory() as tmp:
        prepare(data, tokenizer, Path(tmp))
        stream, render = PromptStream(Path(tmp), SETUP["seed"]), PromptRenderer(tokenizer, data.thinking)
        with open(path, "w") as f:
            for _ in range(steps * SETUP["prompts_per_step"]):
                row = stream.next()
                f.write(json.dumps({"question": row.question, "answer": row.answer,
                                    "prompt_ids": render.ids(row.messages)}) + "\n")


class TreeMemory:
    """Peak RSS of a process tree: every process's own peak (VmHWM, kept by the kernel) summed over the
    processes seen, polled every ``every_s`` from /proc/PID/status. An upper bound of the tree's peak: the
    processes need not peak together, and pages they share (torch's libraries) count once per process.
    (Summing /proc/PID/smaps_rollup instead gives PSS, but walking a process's mappings takes its mmap
    lock: at 10 Hz that slowed cascade-rl's trainer by a third.)"""

    def __init__(self, pid: int, every_s: float = 0.25) -> None:
        self.pid, self.every_s = pid, every_s
        self.peaks: dict[int, int] = {}  # pid -> VmHWM, kB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    @property
    def peak_rss_mb(self) -> float:
        return sum(self.peaks.values()) / 1024

    def tree(self) -> list[int]:
        """The process and its descendants, parents first."""
        try:
            return [self.pid] + [c.pid for c in psutil.Process(self.pid).children(recursive=True)]
        except psutil.Error:
            return [self.pid]

    def _poll(self) -> None:
        while not self._stop.is_set():
            for pid in self.tree():
                try:
                    with open(f"/proc/{pid}/status") as f:
                        hwm = next((int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")), 0)
                except OSError:
                    continue
                self.peaks[pid] = max(self.peaks.get(pid, 0), hwm)
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_tree(cmd: list[str], env: dict | None = None, timeout: float = 1800) -> tuple[str, TreeMemory]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    mem = TreeMemory(proc.pid)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in reversed(mem.tree()):  # the workers run in sessions of their own: kill the whole tree
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        out, _ = proc.communicate()
        raise RuntimeError(f"{' '.join(cmd[:4])} ... ran past {timeout} s:\n{out[-3000:]}") from None
    finally:
        mem.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{out[-3000:]}")
    return out, mem


def run_ours(staleness: int, model: Path, steps: int, work: Path) -> dict:
    run_dir = work / f"ours-k{staleness}-{time.monotonic_ns()}"
    s = SETUP
    args = ["launch", "tiny", *(["--inline"] if s["smoke"] else []), f"run_dir={run_dir}", f"model.path={model}", f"run.steps={steps}",
            f"run.prompts_per_step={s['prompts_per_step']}", f"run.group_size={s['group_size']}",
            f"sampling.max_tokens={s['max_tokens']}", "sampling.temperature=1.0", f"trainer.lr={s['lr']}",
            "trainer.kl_coef=0", *math_data(smoke=s["smoke"]), f"data.seed={s['seed']}",
            "model.dtype=float32", "orchestrator.eval_n=0", "orchestrator.eval_greedy=false",
            "supervisor.progress=none", f"orchestrator.max_staleness={staleness}",
            f"trainer.correction={'icepop' if staleness > 0 else 'none'}",
            # strictly on-policy, sampler and trainer take turns: each gets both cores; async they run at once,
            # one thread each (two each oversubscribe 2 cores: measured slower)
            *(["sampler.threads=1", "trainer.threads=1"] if staleness else ["sampler.threads=0"])]
    t0 = time.perf_counter()
    _, mem = run_tree([*CLI, *args], env=dict(os.environ, XDG_STATE_HOME=str(work / "state")))
    wall = time.perf_counter() - t0
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_out = []
    for prev, m in zip(rows, rows[1:]):
        if "version" not in m:
            continue
        # one step's wall time: from the previous metrics line to this one (with max_staleness 1 the next
        # batch is sampled during this step's training, so the sampler's own time overlaps)
        steps_out.append({"step": m["step"], "step_s": m["time"] - prev["time"], "sample_s": m["sample_s"],
                          "gen_tokens_per_s": m["gen_tokens_per_s"], "train_s": m["trainer/train_s"],
                          "reward_mean": m["reward_mean"], "response_len_mean": m["response_len_mean"]})
    books = summary["books"]
    if books["lost"] or books["trained"] != steps * s["prompts_per_step"] * s["group_size"]:
        raise RuntimeError(f"rollouts not all trained: {books}")
    return {"system": f"ours_{'async' if staleness else 'sync'}", "steps": steps_out, "wall_s": wall,
            "loop_s": summary["loop_s"], "startup_s": wall - summary["loop_s"],
            "peak_rss_mb": mem.peak_rss_mb, "books": books}


def run_trl(py: Path, model: Path, prompts: Path, steps: int, work: Path) -> dict:
    out = work / f"trl-{time.monotonic_ns()}.json"
    s = SETUP
    cmd = [str(py), str(ROOT / "bench" / "_trl_grpo.py"), "--model", str(model), "--prompts", str(prompts),
           "--steps", str(steps), "--out", str(out), "--prompts-per-step", str(s["prompts_per_step"]),
           "--group-size", str(s["group_size"]), "--max-tokens", str(s["max_tokens"]), "--lr", str(s["lr"]),
           "--seed", str(s["seed"])]
    t0 = time.perf_counter()
    _, mem = run_tree(cmd, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    wall = time.perf_counter() - t0
    res = json.loads(out.read_text())
    return {**res, "wall_s": wall, "peak_rss_mb": mem.peak_rss_mb}


def digest(run: dict, warmup: int) -> dict:
    """Medians over the steps after warm-up, and the reward over all steps."""
    after = run["steps"][warmup:] or run["steps"]

    def med(k):
        return statistics.median(x[k] for x in after)

    return {"step_s": med("step_s"), "sample_s": med("sample_s"), "train_s": med("train_s"),
            "gen_tokens_per_s": med("gen_tokens_per_s"), "reward_mean": statistics.mean(x["reward_mean"]
                                                                                        for x in run["steps"]),
            "peak_rss_mb": run["peak_rss_mb"], "wall_s": run["wall_s"]}


def against_trl(table: dict, ratios: dict[str, list[float]], target: float) -> dict:
    """The summary's comparison with TRL: each round's ours / TRL step-time ratio, their median and range."""
    sync_ratio = statistics.median(ratios["ours_sync"])
    async_ratio = statistics.median(ratios["ours_async"])
    return {"baseline_value": round(table["trl"]["step_s"], 4), "ratio": round(sync_ratio, 3),
            "ratio_range": [round(min(ratios["ours_sync"]), 3), round(max(ratios["ours_sync"]), 3)],
            "per_round": [round(x, 3) for x in ratios["ours_sync"]],
            "async_ratio": round(async_ratio, 3), "pass": max(ratios["ours_sync"]) <= target,
            # the second target: async below sync. On 2 shared CPU cores it is not (the sampler
            # and the trainer run at once on the same cores); reported, not hidden
            "async_below_sync": async_ratio < sync_ratio}


def main(argv: list[str] | None = None) -> dict:
    ap = bench_parser(__doc__, quick="1 round of 10 steps",
                      smoke="1 round of 2 tiny steps, ours_sync alone, inline: seconds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the step-time medians")
    ap.add_argument("--size", choices=sorted(TARGETS), default="tiny", help="the model (see the docstring)")
    args = ap.parse_args(argv)
    if args.smoke:
        SETUP.update(SMOKE_SETUP)  # every side reads the setup from here
        args.rounds, args.steps, args.size = 1, 2, "tiny"
    rounds = args.rounds or (1 if args.quick else 3)
    steps = args.steps or (10 if args.quick and args.size == "tiny" else STEPS[args.size])
    warmup = min(args.warmup, steps - 3)
    systems = ["ours_sync"] if args.smoke else ["ours_sync", "trl", "ours_async"]
    py = trl_python() if "trl" in systems else None
    model = model_dir(args.size)
    work = Path(tempfile.mkdtemp(prefix="crl-vs-trl-"))
    prompts = work / "prompts.jsonl"  # TRL's
    if "trl" in systems:
        write_prompts(model, steps, prompts)
    runs: list[dict] = []
    for r in range(rounds):
        for name in systems[r % len(systems):] + systems[: r % len(systems)]:
            run = (run_trl(py, model, prompts, steps, work) if name == "trl"
                   else run_ours(int(name == "ours_async"), model, steps, work))
            run.update(system=name, round=r, summary=digest(run, warmup))
            runs.append(run)
            d = run["summary"]
            print(f"round {r} {name}: {d['step_s']:.3f} s/step (sample {d['sample_s']:.3f}, train "
                  f"{d['train_s']:.3f}), {d['gen_tokens_per_s']:.0f} gen tok/s, reward {d['reward_mean']:.3f}, "
                  f"peak RSS {d['peak_rss_mb']:.0f} MiB", file=sys.stderr)

    def of(name, r):
        return next(x["summary"] for x in runs if x["system"] == name and x["round"] == r)

    table = {}
    for name in systems:
        xs = [x["summary"] for x in runs if x["system"] == name]
        table[name] = {k: statistics.median(x[k] for x in xs) for k in xs[0]}
        table[name]["step_s_range"] = [min(x["step_s"] for x in xs), max(x["step_s"] for x in xs)]
        table[name]["reward_per_step"] = [statistics.mean(x["steps"][i]["reward_mean"] for x in runs
                                                          if x["system"] == name) for i in range(steps)]
    summary = {"name": "vs_trl" if args.size == "tiny" else f"vs_trl_{args.size}",
               "metric": f"GRPO step wall time, cascade-rl strictly on-policy / TRL GRPOTrainer ({args.size} MoE, "
                         f"{SETUP['prompts_per_step']}x{SETUP['group_size']} rollouts, {SETUP['max_tokens']} tokens, "
                         "median after warm-up)",
               "value": round(table["ours_sync"]["step_s"], 4), "baseline": f"TRL {TRL_VERSION} GRPOTrainer",
               "baseline_value": None, "ratio": None, "target": f"<= {TARGETS[args.size]} every round", "pass": None,
               "machine": machine()}
    ratios = None
    if "trl" in systems:  # only a smoke run goes without: ours measured, nothing to compare with
        ratios = {name: [of(name, r)["step_s"] / of("trl", r)["step_s"] for r in range(rounds)]
                  for name in ("ours_sync", "ours_async")}
        summary.update(against_trl(table, ratios, TARGETS[args.size]))
    out = {**summary, "setup": SETUP, "size": args.size, "steps": steps, "rounds": rounds, "warmup": warmup,
           "ratios": ratios, "table": table, "runs": runs, "quick": args.quick}
    return write_result(summary, out, smoke=args.smoke)


if __name__ == "__main__":
    main()

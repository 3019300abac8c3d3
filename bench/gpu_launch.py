"""A full MOPD launch with every role on ONE GPU: trainer + sampler + teacher server sharing GPU 0.

    python bench/gpu_launch.py [--size tiny|50m] [--engine torch|vllm] [--device cuda|cpu] [--quick]
                               [--steps N --prompts N --group N --max-tokens N] [--timeout S] [-- OVERRIDE ...]

Builds, offline and cached under ``--work`` (default runs/gpu_launch/): a student model (``cascade-rl
make-tiny-model --size SIZE --task cascade``), its teacher (the same architecture and tokenizer, another seed:
``--seed 1``; a few-step SFT would cost minutes on the GPU machine's CPUs, and a random teacher drives the
reverse-KL advantage just as well for a check), and the arithmetic prompts (``cascade-rl make-data arithmetic``).
Then launches ``cascade-rl launch tiny stage=mopd`` with the teacher serving the math domain and, on CUDA::

    gpus.trainer=[0] gpus.samplers=[0] gpus.teachers=[0] gpus.memory={trainer: 0.35, sampler: 0.3, teacher: 0.15}
    model.dtype=bf16 model.attn_impl=varlen model.moe_impl=triton trainer.logprob_impl=triton

``--device cpu`` (the default without CUDA) runs the same launch on the same code path with no ``gpus``, fp32,
SDPA, HF's experts and the torch log-prob path, so this script is exercised on a machine without a GPU (and by
``make bench``). ``--engine vllm`` samples with vLLM (``sampler.engine=vllm``; it takes
``gpus.memory.sampler`` as its memory share).

Run sizes (steps x prompts x group, max tokens; a random model almost never stops, so responses run to max
tokens): CUDA tiny 8 x 32 x 4, 256; CUDA 50m 6 x 32 x 4, 256 (about a minute or two each on an H200, most of it
process start-up and Triton compiles); CPU 3 x 8 x 4, 24 (configs/run/tiny.yaml); ``--quick`` fewer.

Reads the run's summary.json, metrics.jsonl and worker logs and checks: the launch exited 0; the books close
(every rollout in exactly one column: dispatched = trained + filtered + stale, none lost or in flight, and
trained = steps x prompts x group); the engine/trainer log-prob mismatch is recorded every step and finite and
small (mean |Δ| < 0.05 in bf16, < 1e-4 in fp32); every model role ran on the device asked for; the final
checkpoint's tensors are in the launch's dtype. Writes bench/results/gpu_launch_<size>_<engine>_<device>.json
with those checks and the figures (median s/step, trainer tokens/s, sampler tokens/s, mismatch, books, wall
times); the last stdout line is the summary JSON object (docs/ARCHITECTURE.md §9; there is no baseline: this is a
check with figures, ``pass`` is every check). Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

from _common import machine  # noqa: E402  (bench/ is on sys.path when a script runs)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]
DOMAIN = "math"  # the arithmetic task's verifier; its teacher is the --seed 1 model
MISMATCH_MEAN_MAX = {"bf16": 0.05, "fp32": 1e-4}  # bf16 rounds log-probs to ~3 significant digits

# (steps, prompts per step, group size, max tokens) by device and size; quick: a smoke run
RUN_SIZES = {
    ("cuda", "tiny"): (8, 32, 4, 256),
    ("cuda", "50m"): (6, 32, 4, 256),
    ("cpu", "tiny"): (3, 8, 4, 24),
    ("cpu", "50m"): (2, 8, 4, 24),
}
QUICK_SIZES = {"cuda": (3, 16, 4, 128), "cpu": (2, 8, 4, 16)}


def device_overrides(device: str, engine: str) -> list[str]:
    """Placement, dtype and kernels: every role on GPU 0 with a memory split, or every role on the CPU."""
    if device == "cuda":
        out = ["gpus.trainer=[0]", "gpus.samplers=[0]", "gpus.teachers=[0]",
               "gpus.memory={trainer: 0.35, sampler: 0.3, teacher: 0.15}", "model.dtype=bf16",
               "model.attn_impl=varlen", "model.moe_impl=triton", "trainer.logprob_impl=triton"]
    else:
        out = ["model.dtype=fp32", "model.attn_impl=sdpa", "model.moe_impl=hf", "trainer.logprob_impl=torch"]
    return out + [f"sampler.engine={engine}"]


# --- building the model, the teacher and the data ------------------------------------------------------------


def cli(*args: str, log: Path) -> None:
    """One cascade-rl command; its output appended to ``log``, raised with its tail if it fails."""
    with open(log, "a") as f:
        f.write(f"$ cascade-rl {' '.join(args)}\n")
        f.flush()
        r = subprocess.run([*CLI, *args], stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        raise RuntimeError(f"cascade-rl {args[0]} failed (exit {r.returncode}):\n{tail(log)}")


def build(work: Path, size: str, log: Path) -> dict[str, str]:
    """Student, teacher and data under ``work`` (each built once; a directory is complete once its marker exists)."""
    student, teacher, data = work / f"model-{size}", work / f"teacher-{size}", work / "data"
    for path, seed in ((student, 0), (teacher, 1)):
        if not (path / "cascade_rl.json").is_file():
            cli("make-tiny-model", "--out", str(path), "--size", size, "--task", "cascade", "--seed", str(seed),
                log=log)
    if not (data / "manifest.json").is_file():
        cli("make-data", "arithmetic", "--out", str(data), "--heldout", "16", "--rl", "2000", "--sft", "8", log=log)
    if (student / "tokenizer.json").read_bytes() != (teacher / "tokenizer.json").read_bytes():
        raise RuntimeError("teacher and student tokenizers differ: MOPD needs one vocabulary")
    return {"student": str(student), "teacher": str(teacher), "train": str(data / "rl" / "arithmetic.jsonl"),
            "heldout": str(data / "heldout" / "arithmetic.jsonl")}


# --- the launch -------------------------------------------------------------------------------------------------


def stop_run(proc: subprocess.Popen, run_dir: Path) -> None:
    """Stop a launch that outlived its time: SIGTERM to the supervisor (it drains and stops its workers), then
    SIGKILL to whatever of this run is left. Workers run in sessions of their own, so a killed supervisor would
    leave them holding the GPU for the next check: they are found by this run's config path on their command
    line (each is started with ``--config RUN_DIR/config.yaml``), i.e. only processes this launch started."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    marker = str(run_dir / "config.yaml").encode()
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            if marker in (pid_dir / "cmdline").read_bytes():
                os.kill(int(pid_dir.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


class Stopped(Exception):
    """SIGTERM (gpu_checks.sh's `timeout` for this part): stop the run, still write what there is."""


def launch(cmd: list[str], run_dir: Path, log: Path, env: dict, timeout: float) -> tuple[int | str, float]:
    """Run the supervisor; (its exit code, or "timeout" / "SIGTERM", wall seconds). The run is stopped on any
    way out."""
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        except Stopped:
            rc = "SIGTERM"
        finally:  # Ctrl-C too
            stop_run(proc, run_dir)
    return rc, time.perf_counter() - t0


# --- reading the run --------------------------------------------------------------------------------------------


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def safetensors_dtypes(ckpt: Path) -> list[str]:
    """The tensor dtypes of a checkpoint's safetensors files, from their JSON headers (no torch needed)."""
    dtypes = set()
    for f in sorted(ckpt.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        dtypes |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    return sorted(dtypes)


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def read_run(run_dir: Path, expect: dict) -> tuple[dict, list[str]]:
    """Figures of a finished run, and every check it fails (empty: all passed)."""
    problems: list[str] = []
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return {}, [f"no {summary_path}: the run did not finish"]
    summary = json.loads(summary_path.read_text())
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps = [m for m in metrics if "version" in m]  # training steps (evaluation rows have no version)

    books = summary.get("books", {})
    trained_expected = expect["steps"] * expect["prompts"] * expect["group"]
    if summary.get("steps") != expect["steps"] or len(steps) != expect["steps"]:
        problems.append(f"steps: summary {summary.get('steps')}, metrics {len(steps)}, expected {expect['steps']}")
    if books.get("lost") != 0 or books.get("in_flight") != 0:
        problems.append(f"books: lost {books.get('lost')}, in flight {books.get('in_flight')} (want 0, 0)")
    if books.get("dispatched") != books.get("trained", 0) + books.get("filtered", 0) + books.get("stale", 0):
        problems.append(f"books do not close: dispatched {books.get('dispatched')} != trained + filtered + stale")
    if books.get("trained") != trained_expected:
        problems.append(f"books: trained {books.get('trained')}, expected {trained_expected}")

    mismatch = summary.get("mismatch", {})
    per_step = [m.get("trainer/mismatch/abs_diff_mean") for m in steps]
    limit = MISMATCH_MEAN_MAX[expect["dtype"]]
    if not mismatch or any(v is None for v in per_step):
        problems.append("log-prob mismatch (trainer/mismatch/*) missing from summary.json or a step's metrics")
    elif not all(math.isfinite(v) for v in [*mismatch.values(), *per_step]):
        problems.append(f"log-prob mismatch not finite: {mismatch}")
    elif mismatch["abs_diff_mean"] >= limit:
        problems.append(f"log-prob mismatch mean |Δ| {mismatch['abs_diff_mean']:.3g} >= {limit} ({expect['dtype']})")

    devices = {w["id"]: w.get("counters", {}).get("device") for w in summary.get("workers", [])
               if w["role"] in ("trainer", "sampler", "teacher")}
    gpus = {w["id"]: w.get("gpus") for w in summary.get("workers", []) if w["role"] != "orchestrator"}
    for wid, dev in devices.items():
        if not dev:
            problems.append(f"{wid}: no device recorded in summary.json workers[].counters.device")
        elif dev.split()[0] in ("vllm", "sglang"):  # an engine of its own: "vllm bf16 gpus=[0]" (samplers/worker.py)
            if ("gpus=" in dev) != (expect["device"] == "cuda"):
                problems.append(f"{wid} ran on {dev!r}, expected {expect['device']}")
        elif not dev.startswith(expect["device"]):
            problems.append(f"{wid} ran on {dev!r}, expected {expect['device']}")

    ckpt = Path(summary.get("checkpoint") or "")
    ckpt_dtypes = safetensors_dtypes(ckpt) if summary.get("checkpoint") and ckpt.is_dir() else []
    want_dtype = {"bf16": "BF16", "fp32": "F32"}[expect["dtype"]]
    if ckpt_dtypes != [want_dtype]:
        problems.append(f"checkpoint {ckpt} tensors are {ckpt_dtypes}, expected [{want_dtype}]")

    samplers = [w for w in summary.get("workers", []) if w["role"] == "sampler"]
    engine_tokens = sum(w["counters"].get("tokens", 0) for w in samplers)
    engine_s = sum(w["counters"].get("gen_s", 0.0) for w in samplers)
    teacher_busy = sum(w["counters"].get("busy_s", 0.0) for w in summary.get("workers", []) if w["role"] == "teacher")
    figures = {
        "steps": len(steps),
        "step_s_median": median([m["step_s"] for m in steps]),
        "step_s": [round(m["step_s"], 3) for m in steps],  # the first holds Triton compiles and warm-up
        "step_s_median_after_first": median([m["step_s"] for m in steps[1:]]),
        "sample_s_median": median([m["sample_s"] for m in steps]),
        "train_s_median": median([m["trainer/train_s"] for m in steps if "trainer/train_s" in m]),
        "trainer_tokens_per_s_median": median([m["trainer/tokens_per_s"] for m in steps
                                               if "trainer/tokens_per_s" in m]),
        "sampler_tokens_per_s_median": median([m["gen_tokens_per_s"] for m in steps]),  # response tokens / sample_s
        "sampler_engine_tokens_per_s": round(engine_tokens / engine_s, 1) if engine_s else None,  # inside the engine
        "teacher_busy_s": round(teacher_busy, 2),
        "response_len_mean": median([m["response_len_mean"] for m in steps]),
        "mopd_reverse_kl": [m.get("trainer/mopd/reverse_kl") for m in steps],
        "mismatch": mismatch,
        "mismatch_abs_diff_mean_per_step": per_step,
        # MoE routes the trainer's routers pick otherwise than the engine did (with routing replay: then replayed)
        "routing_disagree_frac_per_step": [m.get("trainer/routing/disagree_frac") for m in steps],
        "books": books,
        "books_closed": not any(p.startswith("books") for p in problems),
        "devices": devices,
        "gpus": gpus,
        "checkpoint": str(ckpt) if summary.get("checkpoint") else "",
        "checkpoint_dtypes": ckpt_dtypes,
        "run_wall_s": round(summary.get("wall_s", 0.0), 2),
        "loop_s": round(summary.get("loop_s", 0.0), 2),
        "trainer_busy_frac": summary.get("trainer_busy_frac"),
        "heldout_accuracy_before": summary.get("heldout_accuracy_before"),
        "heldout_accuracy_after": summary.get("heldout_accuracy_after"),
        "restarts": summary.get("restarts"),
    }
    return figures, problems


# --- main -------------------------------------------------------------------------------------------------------


def on_sigterm(*_) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: stopping the run takes up to 30 s
    raise Stopped()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("tiny", "50m"), default="tiny")
    ap.add_argument("--engine", choices=("torch", "vllm"), default="torch")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if torch sees one")
    ap.add_argument("--quick", action="store_true", help="a smoke run (fewer steps, prompts and tokens)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--prompts", type=int, help="prompts per step")
    ap.add_argument("--group", type=int, help="responses per prompt")
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds the launch may take before it is stopped")
    ap.add_argument("--work", default=str(ROOT / "runs" / "gpu_launch"), help="models, data and runs (cached)")
    ap.add_argument("overrides", nargs="*", help="more launch overrides (after --)")
    args = ap.parse_args(argv)
    # gpu_checks.sh stops a part that outlives its time with SIGTERM (`timeout`): the launch is stopped and the
    # results written all the same (while building, it just exits)
    signal.signal(signal.SIGTERM, on_sigterm)

    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    steps, prompts, group, max_tokens = QUICK_SIZES[args.device] if args.quick else RUN_SIZES[(args.device,
                                                                                                 args.size)]
    steps, prompts = args.steps or steps, args.prompts or prompts
    group, max_tokens = args.group or group, args.max_tokens or max_tokens
    dtype = "bf16" if args.device == "cuda" else "fp32"
    tag = f"{args.size}_{args.engine}_{args.device}"
    work = Path(args.work).resolve()
    run_dir = work / f"run-{tag}"
    work.mkdir(parents=True, exist_ok=True)
    log = work / f"{tag}.log"
    log.write_text("")

    t0 = time.perf_counter()
    paths = build(work, args.size, log)
    build_s = time.perf_counter() - t0

    overrides = [
        "stage=mopd", "run.algorithm=mopd", f"run_dir={run_dir}", f"model.path={paths['student']}",
        f"+teacher.checkpoints.{DOMAIN}={paths['teacher']}", f"data.files=[{paths['train']}]",
        f"data.eval_files=[{paths['heldout']}]", "data.eval_per_domain=16", f"run.steps={steps}",
        f"run.prompts_per_step={prompts}", f"run.group_size={group}", f"sampling.max_tokens={max_tokens}",
        "supervisor.progress=plain", *device_overrides(args.device, args.engine), *args.overrides,
    ]  # fmt: skip
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    env = dict(os.environ, XDG_STATE_HOME=str(work / "state"))  # `ctl`'s latest-run pointer stays in work/
    rc, launch_s = launch([*CLI, "launch", "tiny", *overrides], run_dir, log, env, args.timeout)

    figures, problems = read_run(run_dir, {"steps": steps, "prompts": prompts, "group": group, "dtype": dtype,
                                           "device": args.device})
    if rc != 0:
        problems.insert(0, {"timeout": f"launch stopped: over its --timeout of {args.timeout:.0f} s",
                            "SIGTERM": "launch stopped: SIGTERM (over its part's time in gpu_checks.sh)"}.get(
            rc, f"launch exited {rc}"))
    passed = not problems
    summary = {
        "name": "gpu_launch",
        "metric": f"MOPD launch, {args.size} model, {args.engine} sampler, every role on one {args.device} "
        f"({dtype}): median s/step over {steps} steps of {prompts}x{group}, {max_tokens} max tokens",
        "value": figures.get("step_s_median"), "baseline": None, "baseline_value": None, "ratio": None,
        "target": None, "pass": passed, "machine": machine(),
        "trainer_tokens_per_s": figures.get("trainer_tokens_per_s_median"),
        "sampler_tokens_per_s": figures.get("sampler_tokens_per_s_median"),
        "mismatch_abs_diff_mean": figures.get("mismatch", {}).get("abs_diff_mean"),
        "books_closed": figures.get("books_closed", False), "wall_s": round(time.perf_counter() - t0, 1),
        "problems": problems,
    }  # fmt: skip
    full = {**summary, "size": args.size, "engine": args.engine, "device": args.device, "dtype": dtype,
            "steps": steps, "prompts_per_step": prompts, "group_size": group, "max_tokens": max_tokens,
            "build_s": round(build_s, 1), "launch_s": round(launch_s, 1), "overrides": overrides,
            "run_dir": str(run_dir), "figures": figures, "date": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    if not passed:
        full["log_tail"] = tail(log, 60)
        full["trainer_log_tail"] = tail(run_dir / "logs" / "trainer-0.log", 30)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"gpu_launch_{tag}.json").write_text(json.dumps(full, indent=2))
    if not passed:
        print("\n".join(problems) + "\n--- launch log (tail) ---\n" + full["log_tail"], file=sys.stderr)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["pass"] else 1)

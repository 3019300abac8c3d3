"""bench/gpu_checks.sh's one JSON, rebuilt from what its parts left so far (it runs after every part).

    python3 bench/gpu_checks_report.py LOGS_DIR BUDGET_S [--final] [--table]

Reads LOGS_DIR (bench/results/gpu_checks: per part NAME.start, .rc, .secs, .cap, .skip, .log; machine.json;
tests.jsonl from bench/gpu_checks_pytest.py, tests.xml from pytest) and the scripts' own result files in its
parent (bench/results), and writes LOGS_DIR/../gpu_checks.json atomically. A part is

    pending      not started yet (--final: "not_run")
    running      started, not finished (--final: "interrupted", the whole run was cut while it ran)
    ok           exit 0                   failed       another exit
    timed_out    stopped at its cap (exit 124, or 137: SIGKILL after the kill grace)
    skipped      with the reason

Standard library only: it runs in a second, with no torch import.
"""

from __future__ import annotations

import json
import os
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

PARTS = ["install", "machine", "launch_tiny", "tests", "weight_transport", "moe_kernels", "logprob_kernel",
         "optimizer_step", "real_shapes", "launch_50m", "launch_vllm"]  # the order gpu_checks.sh runs them in
# each script's own result JSON (a launch's name ends in the device it ran on: cuda, or cpu in a rehearsal)
FIGURES = {"moe_kernels": ["moe_kernels.json"], "logprob_kernel": ["logprob_kernel.json"],
           "optimizer_step": ["optimizer_step.json"],
           "real_shapes": ["real_shapes.json"], "weight_transport": ["weight_transport.json"],
           **{name: [f"gpu_launch_{run}_{dev}.json" for dev in ("cuda", "cpu")]
              for name, run in (("launch_tiny", "tiny_torch"), ("launch_50m", "50m_torch"),
                                ("launch_vllm", "tiny_vllm"))}}
TIMED_OUT = (124, 137)  # `timeout`'s exit after SIGTERM; SIGKILL after the grace


def read(path: Path, default: str | None = None) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return default


def read_int(path: Path) -> int | None:
    try:
        return int((read(path) or "").strip())
    except ValueError:
        return None


def tail(text: str | None, n: int = 40) -> str:
    return "\n".join((text or "").splitlines()[-n:])


def tests_from_jsonl(path: Path) -> dict | None:
    """Per-test outcomes as bench/gpu_checks_pytest.py wrote them, each flushed when its test ended."""
    text = read(path)
    if text is None:
        return None
    results: dict[str, dict] = {}
    started: list[str] = []
    interrupted = None
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by SIGKILL
            continue
        if rec.get("event") == "start":
            started.append(rec["test"])
        elif rec.get("event") == "result":
            results[rec["test"]] = {k: v for k, v in rec.items() if k not in ("event", "test")}
        elif rec.get("event") == "interrupted":
            interrupted = rec
    unfinished = [t for t in started if t not in results]
    out = summarize(results)
    if unfinished:  # the test that was running when the part was stopped (SIGTERM or SIGKILL)
        out["running_when_stopped"] = unfinished[-1]
    if interrupted:  # pytest ended its session on the cap's SIGTERM (its JUnit XML was written too)
        out["interrupted_by"] = interrupted.get("signal") or "KeyboardInterrupt"
    return out


def tests_from_xml(path: Path) -> dict | None:
    """The same from pytest's JUnit XML (written only when pytest ends its session)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    results = {}
    for c in suite.findall("testcase") if suite is not None else []:
        if c.get("name") is None:  # the test pytest was interrupted in
            continue
        name = f"{c.get('classname')}::{c.get('name')}"
        bad = c.find("failure") if c.find("failure") is not None else c.find("error")
        skip = c.find("skipped")
        entry = {"outcome": "failed" if bad is not None else "skipped" if skip is not None else "passed",
                 "seconds": float(c.get("time") or 0)}
        if bad is not None or skip is not None:
            entry["message"] = ((bad if bad is not None else skip).get("message") or "")[:2000]
        results[name] = entry
    return summarize(results)


def summarize(results: dict[str, dict]) -> dict:
    count = {o: sum(r["outcome"] == o for r in results.values()) for o in ("passed", "failed", "error", "skipped")}
    return {"tests": len(results), **count,
            "failures": {t: r.get("message", "") for t, r in results.items() if r["outcome"] in ("failed", "error")},
            "skips": {t: r.get("message", "") for t, r in results.items() if r["outcome"] == "skipped"},
            "per_test": {t: [r["outcome"], r.get("seconds")] for t, r in results.items()}}


def figures(name: str, logs: Path, results: Path) -> dict | None:
    if name == "tests":
        return tests_from_jsonl(logs / "tests.jsonl") or tests_from_xml(logs / "tests.xml")
    if name == "machine":
        return None  # the machine is the JSON's top-level "machine"
    for file in FIGURES.get(name, []):
        text = read(results / file)
        if text:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                return {"error": f"{file}: {e}"}
            return data.get("summary", data) if name == "weight_transport" else data
    return None


def part(name: str, logs: Path, results: Path, final: bool) -> dict:
    skip = read(logs / f"{name}.skip")
    if skip is not None:
        return {"status": "skipped", "reason": skip.strip()}
    started = read_int(logs / f"{name}.start")
    if started is None:
        return {"status": "not_run", "reason": "the run ended before this part"} if final else {"status": "pending"}
    rc, cap = read_int(logs / f"{name}.rc"), read_int(logs / f"{name}.cap")
    entry: dict = {"cap_s": cap}
    if rc is None:  # started and not finished: running now, or the whole run was cut here
        entry |= {"status": "interrupted" if final else "running", "seconds": int(time.time()) - started}
        if final:
            entry["reason"] = "the run ended (was killed) while this part ran"
    else:
        entry |= {"status": "ok" if rc == 0 else "timed_out" if rc in TIMED_OUT else "failed", "exit": rc,
                  "seconds": read_int(logs / f"{name}.secs")}
        if rc in TIMED_OUT:
            entry["reason"] = f"stopped at its cap of {cap} s" + (" (SIGKILL after the grace)" if rc == 137 else "")
    if entry["status"] != "ok":
        entry["log_tail"] = tail(read(logs / f"{name}.log"))
    fig = figures(name, logs, results)
    if fig is not None:
        entry["figures"] = fig
    return entry


def build(logs: Path, budget_s: int, final: bool = False) -> dict:
    results = logs.parent
    parts = {name: part(name, logs, results, final) for name in PARTS}
    try:
        machine = json.loads(read(logs / "machine.json") or "{}")
    except json.JSONDecodeError:
        machine = {}
    failed = [n for n, p in parts.items() if p["status"] in ("failed", "timed_out", "interrupted")]
    unfinished = ("pending", "running", "interrupted", "not_run")
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "budget_s": budget_s, "final": final,
            "done": [n for n, p in parts.items() if p["status"] not in unfinished],
            "ok": not failed and all(p["status"] in ("ok", "skipped") for p in parts.values()),
            "not_ok": failed, "gpu": machine.get("gpu"), "torch": machine.get("torch"),
            "triton": machine.get("triton"), "driver": machine.get("driver"), "machine": machine, "parts": parts}


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)  # a reader (or a kill) never sees half a file


def table(data: dict) -> str:
    lines = [f"{'part':17s} {'status':11s} {'s':>4s}  headline"]
    for name, p in data["parts"].items():
        fig = p.get("figures") or {}
        if name == "tests" and fig:
            head = (f"{fig['passed']} passed, {fig['failed']} failed, {fig['error']} errors, {fig['skipped']} "
                    f"skipped" + (f"; running when stopped: {fig['running_when_stopped']}"
                                  if "running_when_stopped" in fig else ""))
        elif "value" in fig:
            head = f"{(fig.get('metric') or '')[:90]} = {fig.get('value')} (pass {fig.get('pass')})"
        else:
            head = p.get("reason", "")
        lines.append(f"{name:17s} {p['status']:11s} {p.get('seconds') or 0:4d}  {head}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    logs, budget_s = Path(argv[0]), int(argv[1])
    data = build(logs, budget_s, final="--final" in argv)
    out = logs.parent / "gpu_checks.json"
    write_json(out, data)
    if "--table" in argv:
        print(table(data))
        print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""The ``cascade-rl`` command line.

    cascade-rl make-tiny-model --out models/tiny [--arch qwen3_moe|qwen3|qwen2|llama|nemotron_h|deepseek_v3|gpt_oss|qwen3_5_moe]
                               [--untied] [--size tiny|10m|50m]
                               [--task cascade] [--vocab-size 512] [--max-len 512]
    cascade-rl make-data NAME --out DIR [--heldout N --rl N --sft N]   # the built-in miniature tasks as JSONL files
    cascade-rl data check FILE... [--model DIR] [data.fields.prompt=question ...]   # every bad row, FILE:LINE: reason
    cascade-rl sft [model=DIR] [out=DIR] [files=[FILE,...]] [steps=N] ...
    cascade-rl launch PRESET|CONFIG.yaml [hydra overrides]   e.g. launch tiny run_dir=/tmp/r
    cascade-rl launch PRESET --dry-run                       print the resolved config
    cascade-rl launch PRESET --inline                        every role a thread of one process (debuggers, py-spy)
    cascade-rl plan [PRESET|CONFIG.yaml] [hydra overrides] [--gpu-memory 80GiB|h200] [--json] [--check]
                                                             peak memory per role and GPU; what to change if it does not fit
    cascade-rl export [--merge] RUN_OR_CHECKPOINT --out DIR   # a checkpoint as a model dir (LoRA: --merge merges it)
    cascade-rl ctl [--run-dir DIR] status [--json]
    cascade-rl ctl [--run-dir DIR] stop
    cascade-rl ctl [--run-dir DIR] swap verifier DOMAIN NAME   # new workers score DOMAIN with NAME; old ones drain
    cascade-rl ctl [--run-dir DIR] scale samplers=N            # add samplers, or drain the newest

Exit codes: 0 done; 1 the run failed, or the data has bad rows (each printed as FILE:LINE: reason);
2 a config or command-line mistake (printed as one message that says what to change); 3 ``plan --check``: some
role does not fit its GPU (the plan says which setting to change; without --check, plan exits 0 once printed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import zmq


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from cascade_rl.learner.tiny_model import make_tiny_model

    from .console import no_progress_bars

    no_progress_bars()
    out = make_tiny_model(args.out, arch=args.arch, size=args.size, task=args.task, seed=args.seed,
                          tie_word_embeddings=not args.untied, vocab_size=args.vocab_size, max_len=args.max_len)
    print(json.loads((out / "cascade_rl.json").read_text()) | {"out": str(out)})
    return 0


def cmd_make_data(args: argparse.Namespace) -> int:
    from cascade_rl.data.builtin import write_task_files

    sizes = {"heldout": args.heldout, "rl": args.rl, "sft": args.sft}
    files = write_task_files(args.name, args.out, sizes, seed=args.seed)
    for split, by_task in files.items():
        for task, path in by_task.items():
            print(f"{split:8s} {task:18s} {path}")
    return 0


def cmd_data_check(args: argparse.Namespace) -> int:
    from .data_check import check

    return check(args.files, args.model, args.overrides)


def cmd_sft(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from cascade_rl.learner.sft import SFTConfig, run_sft

    from .config_errors import ConfigError, explain
    from .console import no_progress_bars

    no_progress_bars()  # its own "sft step" lines are the progress
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(SFTConfig), OmegaConf.from_dotlist(args.overrides))
    except Exception as e:  # an unknown key or a value of the wrong type: one line, exit 2
        raise ConfigError(explain(e, SFTConfig)) from None
    result = run_sft(SFTConfig(**OmegaConf.to_container(cfg)))
    print(json.dumps(result))
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from .config import compose, to_yaml

    cfg = compose(args.preset, args.overrides)
    if args.dry_run:
        print(to_yaml(cfg))
        return 0
    from . import console
    from .launch import Supervisor

    console.quiet(Path(cfg.run_dir) / "logs" / "supervisor.log")  # before the data is prepared: it loads a tokenizer
    return Supervisor(cfg, inline=args.inline).run()


def cmd_plan(args: argparse.Namespace) -> int:
    from .memory_report import plan_command

    return plan_command(args.preset, args.overrides, args.gpu_memory, args.json, args.check)


def cmd_cascade(args: argparse.Namespace) -> int:
    from .cascade import Cascade, load_config

    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(cfg))
        return 0
    from . import console

    console.quiet(Path(cfg.run_dir) / "logs" / "cascade.log")  # its evaluations' and its stages' supervisors' records
    return Cascade(cfg).run()


def _control_endpoint(run_dir: str | None) -> tuple[str, str]:
    """The run's control endpoint and its key file ("" when the run has none), from its supervisor.json."""
    from .launch import state_dir

    if run_dir is None:
        latest = state_dir() / "latest_run"
        if not latest.is_file():
            raise SystemExit("no run recorded yet; pass --run-dir")
        run_dir = latest.read_text().strip()
    info = Path(run_dir) / "supervisor.json"
    if not info.is_file():
        raise SystemExit(f"{run_dir} has no supervisor.json: not a launch directory")
    info = json.loads(info.read_text())
    return info["control"], info.get("auth_keys", "")


def cmd_ctl(args: argparse.Namespace) -> int:
    from cascade_rl.protocol import auth
    from cascade_rl.protocol.messages import Control, ControlReply
    from cascade_rl.protocol.sockets import recv, send

    endpoint, keys = _control_endpoint(args.run_dir)
    try:  # the run's key file (0600, this user's): without it a tcp control socket never answers
        auth.install(auth.RunKeys.load(keys) if keys else None)
    except auth.AuthError as e:
        raise SystemExit(f"ctl: {e}") from None
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    auth.connect(sock, endpoint)
    request = {}
    if args.op == "swap":
        request = {"role": args.role, "domain": args.domain, "impl": args.impl}
    elif args.op == "scale":  # ctl scale samplers=N
        key, sep, value = args.role.partition("=")
        if not sep or not value.isdigit():
            raise SystemExit(f"ctl scale wants ROLEs=N (e.g. samplers=2), got {args.role!r}")
        request = {key: int(value)}
    send(sock, Control(args.op, request))
    if not sock.poll(5000):
        print("supervisor did not answer within 5 s (is the run still going?)", file=sys.stderr)
        return 2
    reply = recv(sock, (ControlReply,))
    if not reply.ok:
        print(f"error: {reply.error}", file=sys.stderr)
        return 1
    if args.op == "swap":
        print(json.dumps(reply.result))
        return _wait_for_swap(sock, reply.result, args.timeout) if args.wait else 0
    if args.op == "status":
        workers = reply.result["workers"]
        if args.json:
            print(json.dumps(workers))
        else:
            from rich.console import Console
            from rich.table import Table

            table = Table("role", "id", "node", "pid", "state", "version", "restarts", "throughput", "device",
                          "recent failures", title=reply.result["run_dir"])
            for w in workers:
                c = w["counters"]
                rate = c.get("tokens", 0) / c["gen_s"] if c.get("gen_s") else None
                table.add_row(w["role"], w["id"], w.get("node") or "local", str(w["pid"]), w["state"], str(w["version"]), str(w["restarts"]),
                              f"{rate:.0f} tok/s" if rate else "-", str(c.get("device", "")), _failures(w))
            Console().print(table)
    else:
        print(json.dumps(reply.result))
    return 0


def _failures(row: dict) -> str:
    """A worker's failures within the restart window: how many, and how the last one died."""
    failures = row.get("failures", [])
    if not failures:
        return "-"
    last = failures[-1]
    return f"{len(failures)}; last {last['ago_s']:.0f} s ago: {last['why']}"


def _wait_for_swap(sock, started: dict, timeout_s: float) -> int:
    """Poll the supervisor until the retiring workers are gone (drained and exited)."""
    import time

    from cascade_rl.protocol.messages import Control, ControlReply
    from cascade_rl.protocol.sockets import recv, send

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        send(sock, Control("status", {}))
        if not sock.poll(5000):
            print("supervisor stopped answering", file=sys.stderr)
            return 2
        rows = {w["id"]: w["state"] for w in recv(sock, (ControlReply,)).result["workers"]}
        if all(rows.get(w, "").startswith("retired") for w in started["retiring"]):
            print(json.dumps({"swapped": started["impl"], "retired": started["retiring"],
                              "serving": started["started"]}))
            return 0
        time.sleep(0.3)
    print(f"swap did not finish within {timeout_s} s", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cascade-rl", description="Cascade RL + MOPD post-training")
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make-tiny-model", help="build a small random HF model + tokenizer offline")
    m.add_argument("--out", required=True)
    m.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "qwen3", "qwen2", "llama", "nemotron_h",
                                                           "deepseek_v3", "gpt_oss", "qwen3_5_moe"],
                   help="qwen2 and llama are sampled with sampler.engine=vllm "
                        "(the torch engine serves qwen3*, nemotron_h)")
    m.add_argument("--untied", action="store_true", help="an LM head of its own instead of the tied embedding")
    m.add_argument("--size", default="tiny", choices=["tiny", "10m", "50m"])
    m.add_argument("--task", default="arithmetic",
                   help="task or mixture of data/tasks.py whose text trains the tokenizer (e.g. cascade)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary trained on the task's text")
    m.add_argument("--max-len", type=int, default=512, help="context length (max_position_embeddings)")
    m.set_defaults(fn=cmd_make_tiny_model)

    md = sub.add_parser("make-data", help="write the built-in miniature tasks as data files (JSONL)")
    md.add_argument("name", help="a task or mixture of data/tasks.py (e.g. cascade, arithmetic)")
    md.add_argument("--out", required=True, help="directory: OUT/{heldout,rl,sft}/TASK.jsonl")
    md.add_argument("--heldout", type=int, default=64, help="held-out rows per task")
    md.add_argument("--rl", type=int, default=2000, help="RL prompts per task (fewer where questions are held out)")
    md.add_argument("--sft", type=int, default=1000, help="SFT rows per task, with worked solutions")
    md.add_argument("--seed", type=int, default=0)
    md.set_defaults(fn=cmd_make_data)

    d = sub.add_parser("data", help="check data files: rows per domain, prompt lengths, every bad row")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    dc = dsub.add_parser("check", help="validate files as a launch would; exit 1 if any row is bad")
    dc.add_argument("files", nargs="+", help="data files (PATH or PATH:WEIGHT), then any key=value launch overrides "
                                             "(data.fields.prompt=question, verifier.plugins=[my.py], ...)")
    dc.add_argument("--model", default=None, help="HF model directory: prompt lengths in its tokens, overlong check")
    dc.set_defaults(fn=cmd_data_check)

    s = sub.add_parser("sft", help="supervised warm start on the task's worked solutions")
    s.add_argument("overrides", nargs="*", help="key=value (see learner/sft.py SFTConfig)")
    s.set_defaults(fn=cmd_sft)

    launch = sub.add_parser("launch", help="start a run: supervisor, orchestrator, trainer, samplers, verifiers")
    launch.add_argument("preset", help="a preset of configs/run/ (e.g. tiny, demo) or a YAML file")
    launch.add_argument("overrides", nargs="*", help="hydra overrides, e.g. run.steps=5 run_dir=/tmp/r")
    launch.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    launch.add_argument("--inline", action="store_true",
                        help="every role a thread of this process (inproc sockets): for a debugger or py-spy")
    launch.set_defaults(fn=cmd_launch)

    pl = sub.add_parser("plan", help="expected peak memory per role and GPU (no model is built), what to change")
    pl.add_argument("preset", nargs="?", default=None,
                    help="a preset of configs/run/ or a YAML file; none (or a first key=value): the paper's scale")
    pl.add_argument("overrides", nargs="*", help="hydra overrides, e.g. stage=code_rl model.dtype=bf16")
    pl.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU: 80GiB, 141, or h100 | h200 | b200 ...")
    pl.add_argument("--json", action="store_true", help="the plan as JSON")
    pl.add_argument("--check", action="store_true", help="exit 3 when a role does not fit")
    pl.set_defaults(fn=cmd_plan)

    cas = sub.add_parser("cascade", help="run RL stages in order, evaluate every checkpoint, MOPD from the best")
    cas.add_argument("config", help="a config of configs/cascade/ (e.g. demo) or a YAML file")
    cas.add_argument("overrides", nargs="*", help="key=value, e.g. run_dir=runs/c eval.n=8")
    cas.add_argument("--dry-run", action="store_true", help="print the resolved cascade config and exit")
    cas.set_defaults(fn=cmd_cascade)

    from .export import add_parser as add_export
    from .ray_node import add_parser as add_ray_node

    add_export(sub)

    add_ray_node(sub)

    c = sub.add_parser("ctl", help="talk to a running supervisor")
    c.add_argument("--run-dir", default=None, help="default: the newest run")
    c.add_argument("op", choices=["status", "stop", "swap", "scale"])
    c.add_argument("role", nargs="?", default="verifier", help="swap: the role (verifier); scale: samplers=N")
    c.add_argument("domain", nargs="?", default="", help="swap: the domain whose verifier changes")
    c.add_argument("impl", nargs="?", default="", help="swap: the registered verifier to score it with")
    c.add_argument("--json", action="store_true")
    c.add_argument("--no-wait", dest="wait", action="store_false", help="swap: return once the new workers start")
    c.add_argument("--timeout", type=float, default=120.0, help="swap: seconds to wait for the old workers to drain")
    c.set_defaults(fn=cmd_ctl)

    args, extra = p.parse_known_args(argv)  # data check: FILE... and key=value overrides around --model
    if extra and hasattr(args, "overrides") and args.cmd != "data" and all("=" in w for w in extra):
        args.overrides += extra  # overrides after a flag: launch tiny --inline run.steps=5
        extra = []
    if extra and args.cmd != "data":
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "data":
        words = [*args.files, *extra]
        args.overrides = [w for w in words if "=" in w and not Path(w).exists()]
        args.files = [w for w in words if w not in args.overrides]
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Run a command; a mistake in the config or the data is a message, not a traceback."""
    from cascade_rl.data.sources import DataError

    from .config_errors import ConfigError
    from .console import err
    from .export import ExportError
    from .launchers import LaunchError
    from .run_data import BadData, refusal

    try:
        return args.fn(args)
    except (ConfigError, DataError, LaunchError, ExportError) as e:
        print(f"cascade-rl: {e}", file=err())  # err(): the terminal, also once a launch's stderr is its log
        return 2
    except BadData as e:
        print("\n".join(refusal(e.report)), file=err())
        return 1


if __name__ == "__main__":
    sys.exit(main())

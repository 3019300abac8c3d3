"""A launch's data, prepared before any process starts: validated, split, written to ``run_dir/data``.

    report = prepare_run_data(cfg)   # raises BadData (every bad row, FILE:LINE: reason), ConfigError or DataError

The supervisor calls it first; the orchestrator then opens ``run_dir/data``
memory-mapped (data/promptset.py). It imports the user's reward modules
(``verifier.plugins``) so their domains are known, reads every row
(data/prepare.py), refuses a file with no rows and a run with no row to train on
(DataError, whatever ``data.on_bad_row`` says), and settles the rules that need the data: which domains the
verifier workers serve (``verifier.domains``, filled with the data's
domains when empty), that judge-scored domains have a judge model
(``verifier.judge.model``, or one the supervisor serves: supervisor/judge.py)
and, for MOPD, that every trained domain has a teacher.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from omegaconf import DictConfig
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from cascade_rl.data.prepare import Report, prepare
from cascade_rl.data.sources import DataError

from .config_errors import ConfigError


class BadData(ValueError):
    """Rows that are bad, with ``data.on_bad_row=error``: the launch is refused with every line."""

    def __init__(self, report: Report) -> None:
        super().__init__(f"{sum(report.bad.values())} bad rows")
        self.report = report


def refusal(report: Report) -> list[str]:
    """What a refused launch prints: every bad row's line, then the counts and what to do."""
    lines = [str(b) for b in report.bad_lines if b.kind in report.bad]
    total = sum(report.bad.values())
    if total > len(lines):
        lines.append(f"... and {total - len(lines)} more (all of them: cascade-rl data check FILES)")
    counts = ", ".join(f"{kind}: {n}" for kind, n in report.bad.most_common())
    lines.append(f"{total} bad rows ({counts}): fix them, or set data.on_bad_row=skip to train without them")
    return lines


def registered_domains(plugins: list[str]) -> set[str]:
    from cascade_rl.verifiers.registry import GROUP_VERIFIERS, VERIFIERS, load_plugins

    load_plugins(plugins)
    return set(VERIFIERS) | set(GROUP_VERIFIERS)


def prepare_run_data(cfg: DictConfig) -> Report:
    from cascade_rl.data.tokenizer import load_tokenizer

    v = cfg.verifier
    # workers run with their own working directory in mind: give them absolute paths to the user's modules
    v.plugins = [str(Path(p).resolve()) if p.endswith(".py") else p for p in v.plugins]
    domains = registered_domains(list(v.plugins))
    try:
        tokenizer = load_tokenizer(cfg.model.path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path={cfg.model.path}: no tokenizer loads from it: {e}") from None
    if cfg.data.verifiers_env:  # its dataset as prompt files the run reads like the user's own
        add_verifiers_rows(cfg)
    with _reading(cfg.supervisor.progress) as on_read:
        report = prepare(cfg.data, tokenizer, Path(cfg.run_dir) / "data", domains, on_read=on_read)
    if report.empty:
        raise DataError("; ".join(f"{e}: no rows" for e in report.empty) + " (an empty file: fill it or leave it out)")
    if report.bad and cfg.data.on_bad_row == "error":
        raise BadData(report)
    if not report.domains["train"]:
        raise DataError(f"data.files: no row to train on in {', '.join(cfg.data.files)} ({no_rows_why(report)})")
    # the held-out domains only where the stage evaluates (a cascade's stages leave that to the runner: a stage
    # of math then starts no judge for the held-out chat)
    evaluates = cfg.orchestrator.eval_n > 0 or cfg.orchestrator.eval_greedy
    used = sorted(set(report.domains["train"]) | (set(report.domains["eval"]) if evaluates else set()))
    if not v.domains:
        v.domains = used
    elif unserved := sorted(set(used) - set(v.domains)):
        raise ConfigError(f"verifier.domains={list(v.domains)} does not serve {unserved}, "
                          f"domains of the data (leave it empty to serve every domain of the data)")
    from cascade_rl.verifiers.registry import JUDGED_DOMAINS

    if (judged := sorted(set(v.domains) & JUDGED_DOMAINS)) and not v.judge.model:
        raise ConfigError(f"domains {judged} are scored by a judge model: set verifier.judge.model and "
                          f"verifier.judge.base_url (its OpenAI-compatible endpoint, e.g. a vLLM server), or serve "
                          f"one: verifier.judge.serve=torch (or vllm) verifier.judge.path=DIR")
    cfg.environment.serve = environments_of(cfg, report, used)
    if AGENT in cfg.environment.serve and cfg.run.algorithm == "mopd":
        raise ConfigError("run.algorithm=mopd with agent rows (env: agent): a teacher scores a row as one sequence "
                          "after the row's prompt, but an agent's row is the prompts its agent made, segments and "
                          "all; train agent rows with run.algorithm=grpo")
    if cfg.run.algorithm == "mopd":
        trained = set(report.domains["train"])
        if untaught := sorted(trained - set(cfg.teacher.checkpoints)):
            raise ConfigError(f"run.algorithm=mopd: no teacher for {untaught}; set +teacher.checkpoints.DOMAIN=CHECKPOINT_DIR "
                              f"(the cascade runner picks each domain's best checkpoint)")
        # a teacher of a domain the data does not hold would be a process with nothing to do
        cfg.teacher.checkpoints = {d: p for d, p in cfg.teacher.checkpoints.items() if d in trained}
    if cfg.supervisor.progress != "none":
        print(describe(report), flush=True)
    return report


AGENT = "agent"  # the env of rows a user's agent runs (docs/ARCHITECTURE.md §14): served by agent.fn / agent.command


def environments_of(cfg: DictConfig, report: Report, domains: list[str]) -> list[str]:
    """The environments the data's multi-turn rows use (their ``env``, else ``environment.defaults`` of their
    domain), each registered (built-ins, or ``environment.plugins``), or ``agent`` with an agent configured."""
    e = cfg.environment
    e.plugins = [str(Path(p).resolve()) if p.endswith(".py") else p for p in e.plugins]
    wanted = sorted(set(report.envs) | {e.defaults[d] for d in domains if e.defaults.get(d)})
    if not wanted:
        return []
    from cascade_rl.environments.registry import ENVIRONMENTS, load_environments

    if cfg.agent.fn and ".py:" in cfg.agent.fn:  # workers get an absolute path to the user's file
        path, _, name = cfg.agent.fn.rpartition(":")
        cfg.agent.fn = f"{Path(path).resolve()}:{name}"
    if AGENT in wanted and not (cfg.agent.fn or cfg.agent.command or cfg.data.verifiers_env):
        raise ConfigError("the data has rows whose env is 'agent' but no agent is set: agent.fn=module:function (or "
                          "path.py:function), agent.command=[program, args...], or data.verifiers_env=MODULE")
    load_environments(list(e.plugins))
    if unknown := [name for name in wanted if name not in ENVIRONMENTS and name != AGENT]:
        raise ConfigError(f"the data names environments {unknown} that are not registered (registered: "
                          f"{sorted(ENVIRONMENTS)}; a module of yours can add one: environment.plugins)")
    return wanted


def add_verifiers_rows(cfg: DictConfig) -> None:
    """``data.verifiers_env``'s dataset (and its eval dataset, held out) written as JSONL under run_dir/data/verifiers
    and added to ``data.files`` / ``data.eval_files``: rows of env ``agent``, run by the environment's own rollout."""
    import cascade_rl.verifiers
    from cascade_rl.data.verifiers_source import verifiers_rows

    # `python -m cascade_rl...` from a checkout puts it on sys.path, where our verifiers/ folder would stand in for
    # PrimeIntellect's package of that name (the editable install maps cascade_rl without sys.path)
    checkout = Path(cascade_rl.verifiers.__file__).resolve().parent.parent
    sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != checkout]
    if cfg.data.verifiers_env.endswith(".py"):
        cfg.data.verifiers_env = str(Path(cfg.data.verifiers_env).resolve())
    out = Path(cfg.run_dir) / "data" / "verifiers"
    out.mkdir(parents=True, exist_ok=True)
    try:
        train, held_out = verifiers_rows(cfg.data.verifiers_env, dict(cfg.data.verifiers_args))
    except Exception as e:  # the user's module: its import, load_environment() or dataset
        raise ConfigError(f"data.verifiers_env={cfg.data.verifiers_env}: {type(e).__name__}: {e}") from None
    for name, rows, key in (("train", train, "files"), ("eval", held_out, "eval_files")):
        if not rows:
            continue
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"id": r.id, "prompt": list(r.messages), "domain": r.domain,
                                            "answer": r.answer, "metadata": r.metadata, "env": r.env}) + "\n"
                                for r in rows))
        cfg.data[key] = [*cfg.data[key], str(path)]


def no_rows_why(report: Report) -> str:
    """Where the rows read went, when none is left to train on."""
    held_out = sum(report.domains["eval"].values())
    went = [f"{n} bad ({kind})" for kind, n in report.bad.items()] + [f"{n} {why}" for why, n in
                                                                      report.dropped.items()]
    went += [f"{held_out} held out"] if held_out else []
    return f"{report.read} rows read: " + (", ".join(went) or "none kept")


def describe(report: Report) -> str:
    """One line a launch prints about its data."""
    rows = report.to_json()["rows"]
    domains = ", ".join(f"{d} {n}" for d, n in sorted(report.domains["train"].items()))
    line = f"data: {rows['train']} training prompts ({domains}), {rows['eval']} held out"
    if report.bad:
        line += f"; {sum(report.bad.values())} bad rows skipped ({', '.join(f'{k}: {n}' for k, n in report.bad.items())})"
    if report.dropped:
        line += "; dropped " + ", ".join(f"{k}: {n}" for k, n in report.dropped.items())
    return line


@contextlib.contextmanager
def _reading(mode: str):
    """A live count of the rows read, on a terminal (a million rows take a while); else nothing."""
    if mode in ("none", "plain") or (mode == "auto" and not sys.stdout.isatty()):
        yield None
        return
    columns = (SpinnerColumn(), TextColumn("preparing data: {task.completed:,} rows read"), TimeElapsedColumn())
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task("data", total=None)
        yield lambda n: progress.update(task, completed=n)


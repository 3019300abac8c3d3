"""Live progress of a launch: a rich panel on a terminal, plain lines elsewhere.

The numbers come from heartbeats only (the orchestrator's ``last`` metrics and
every worker's state), so drawing never touches a socket or a device.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def _fmt(value, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


class Display:
    def __init__(self, mode: str, steps: int, run_dir: Path) -> None:
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode, self.steps, self.run_dir = mode, steps, run_dir
        self.console = Console()
        self.progress = Progress(TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[info]}"), console=self.console)
        self.task = self.progress.add_task("steps", total=steps, info="starting")
        # stderr stays where it is: the log (supervisor/console.py), not lines above the panel
        self.live = Live(console=self.console, refresh_per_second=4, redirect_stderr=False) if mode == "rich" else None
        self._last_printed: dict | None = None

    def __enter__(self) -> Display:
        if self.live:
            self.live.__enter__()
        elif self.mode == "plain":
            print(f"run_dir: {self.run_dir}", flush=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def update(self, orch: dict, workers: list[dict]) -> None:
        last = orch.get("last", {})
        state = orch.get("state", "starting")
        books = orch.get("books", {})
        mopd = f" | reverse KL {_fmt(last['trainer/mopd/reverse_kl'])}" if "trainer/mopd/reverse_kl" in last else ""
        info = (f"{state} | reward {_fmt(last.get('reward_mean'))}{mopd} | heldout acc "
                f"{_fmt(last.get('heldout_accuracy'))} | {_fmt(last.get('gen_tokens_per_s'), '.0f')} tok/s | "
                f"staleness {_fmt(last.get('staleness_mean'), '.1f')} | logp mismatch "
                f"{_fmt(last.get('trainer/mismatch/abs_diff_mean'), '.1e')} (max "
                f"{_fmt(last.get('trainer/mismatch/abs_diff_max'), '.1e')})")
        self.progress.update(self.task, completed=orch.get("step", 0), info=info)
        if self.live:
            table = Table("role", "id", "pid", "state", "version", "restarts", "device", box=None)
            for w in workers:
                table.add_row(w["role"], w["id"], str(w["pid"]), w["state"], str(w["version"]), str(w["restarts"]),
                              str(w["counters"].get("device", "")))
            books_line = " ".join(f"{k}={v}" for k, v in books.items() if not isinstance(v, (dict, list)))
            self.live.update(Group(self.progress, table, f"books: {books_line}"))
        elif self.mode == "plain" and last and last != self._last_printed:
            self._last_printed = last
            print(f"step {last.get('step')}/{self.steps} | {info}", flush=True)

    def final(self, summary: dict) -> None:
        if self.mode == "none":
            return
        table = Table(title="run summary", show_header=False)
        if "heldout_accuracy_before" in summary:  # orchestrator.eval_n=0: not evaluated in the stage
            table.add_row("held-out accuracy before RL (avg@k, T=1)", _fmt(summary["heldout_accuracy_before"]))
            table.add_row("held-out accuracy after RL (avg@k, T=1)", _fmt(summary["heldout_accuracy_after"]))
        if "heldout_greedy_accuracy_before" in summary:
            table.add_row("held-out greedy accuracy before RL", _fmt(summary["heldout_greedy_accuracy_before"]))
            table.add_row("held-out greedy accuracy after RL", _fmt(summary["heldout_greedy_accuracy_after"]))
        for name, gain in summary.get("heldout_gain", {}).items():
            table.add_row(f"{name} gain (95% CI)",
                          f"{gain['delta']:+.3f} [{gain['ci95_low']:+.3f}, {gain['ci95_high']:+.3f}]")
        if mismatch := summary.get("mismatch"):
            table.add_row("log-prob mismatch |inf − train| mean / max",
                          f"{mismatch['abs_diff_mean']:.2e} / {mismatch['abs_diff_max']:.2e}")
            table.add_row("tokens with ratio outside [0.5, 2]", f"{mismatch['outside_band']:.2%}")
        table.add_row("steps", str(summary["steps"]))
        table.add_row("wall time", f"{summary['wall_s']:.1f} s")
        for k, v in summary["books"].items():
            if k == "trainer_ids":  # the trainer's ids against the ledger's
                v = f"{'equal to' if v['match'] else 'DIFFER from'} the ledger's ({v['trainer_trained']} trained)"
            elif isinstance(v, (dict, list)) and not v:
                continue
            table.add_row(f"books.{k}", str(v))
        self.console.print(table)
        # below the table, not in it: a cell of a narrow console (a pipe: 80 columns) cuts a long path with "…"
        self.console.print(f"summary: {self.run_dir / 'summary.json'}", soft_wrap=True)

    def notice(self, text: str) -> None:
        """Something the user should read now (a stall), whatever the mode but none."""
        if self.mode != "none":
            self.console.print(f"[bold yellow]{text}[/]", soft_wrap=True)  # a path stays one line: copy-pastable

    def failed(self, reason: str) -> None:
        self.console.print(f"[bold red]run failed:[/] {reason} (logs in {self.run_dir / 'logs'})", soft_wrap=True)

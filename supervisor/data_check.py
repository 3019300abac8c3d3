"""``cascade-rl data check``: the launch's data validation on its own, with every bad row printed.

    cascade-rl data check prompts.jsonl more.parquet:2 --model models/tiny-sft
    cascade-rl data check raw.jsonl data.fields.prompt=question data.default_domain=math \\
        verifier.plugins=[my_rewards.py]

Prints one line per bad row, ``FILE:LINE: reason`` (as they are found, so a
huge file streams), then rows per domain, prompt-length percentiles (in the
model's tokens with ``--model``, chat template included; else in characters)
and the count of each reason. Exits 1 when any row is bad (an overlong prompt
included: a launch drops those), when a file has no rows (``FILE: no rows``) or
when no row at all is left to train on, 0 when every row would train. A
``data.map`` that does not load is one line, exit 2.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from cascade_rl.data.prepare import OVERLONG, BadLine, Report, prepare

from .config import compose
from .run_data import registered_domains


def check(files: list[str], model: str | None, overrides: list[str]) -> int:
    cfg = compose(None, overrides, check=False)
    cfg.data.files = list(files)
    tokenizer = None
    if model:
        from cascade_rl.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model)
    domains = registered_domains(list(cfg.verifier.plugins))

    def show(line: BadLine) -> None:
        print(line, flush=True)

    report = prepare(cfg.data, tokenizer, None, domains, on_bad=show)
    console = Console(highlight=False)
    console.print(summary(report))
    unit = "tokens" if tokenizer else "characters (--model DIR: tokens)"
    for split in ("train", "eval"):
        if p := report.percentiles(split):
            console.print(f"{split} prompt {unit}: " + ", ".join(f"{k} {v}" for k, v in p.items()))
    for kind, n in [*report.bad.most_common(), *report.dropped.most_common()]:
        console.print(f"{kind}: {n} rows")
    for empty in report.empty:  # a launch refuses these whatever data.on_bad_row says (print: no wrapping)
        print(f"{empty.partition(': ')[2]}: no rows", flush=True)
    if nothing := not any(report.domains[split] for split in ("train", "eval")):
        print(f"no row to train on in {', '.join(files)}", flush=True)
    bad = sum(report.bad.values()) + report.dropped[OVERLONG]
    verdict = (f"{bad} bad rows" if bad else "nothing to train on" if nothing else
               f"{len(report.empty)} files with no rows" if report.empty else "")
    console.print(f"[bold red]{verdict}" if verdict else "[bold green]every row is valid")
    return 1 if bad or report.empty or nothing else 0


def summary(report: Report) -> Table:
    splits = [s for s in ("train", "eval") if report.domains[s] or report.sources[s]]
    table = Table("domain", *splits, title="rows per domain")
    for domain in sorted(set().union(*(report.domains[s] for s in splits))):
        table.add_row(domain, *(str(report.domains[s][domain]) for s in splits))
    table.add_row("[bold]all", *(f"[bold]{sum(report.domains[s].values())}" for s in splits))
    return table

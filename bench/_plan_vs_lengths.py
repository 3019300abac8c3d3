"""``cascade-rl plan``'s trainer terms against bench/lengths.py's measured steps, from its JSON results (no rerun).

    .venv/bin/python bench/_plan_vs_lengths.py [bench/results/lengths.json bench/results/lengths-50m.json]

For each measured (tokens, mode): the plan's step (activations + gradients + the log-prob chunk, fp32, one row,
bench/lengths.py's padded layout) against ``step_gib`` (the child's peak RSS less its RSS once the model is
loaded), and per term: the activations' growth per token against the measured slope between the two longest
lengths, the fixed terms (gradients, chunk) against the intercept of a line through the measured points. RSS
counts what glibc's allocator keeps besides torch's live tensors, so the plan (torch's live tensors, checked to
a few per cent in tests/test_memory_plan.py) is expected to read low. Prints a Markdown table (BENCHMARKS.md).

(A table for BENCHMARKS.md, not a benchmark of its own: the leading underscore keeps it out of `make bench` and its
smoke test, which run every bench/*.py as a measurement with a summary line.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from cascade_rl.supervisor.memory_plan import GiB, TrainerSettings, activation_per_token, trainer_terms  # noqa: E402
from cascade_rl.supervisor.memory_shapes import shape_from_config  # noqa: E402


def model_config(size: str) -> dict:
    """The random model's config.json (bench/lengths.py built it), else its shape from make-tiny-model's SIZES."""
    path = ROOT / "bench" / "results" / "models" / f"scaling-{size}" / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    from cascade_rl.learner.tiny_model import SIZES

    hidden, layers, heads, kv_heads, ffn, expert_ffn = SIZES[size]
    return dict(model_type="qwen3_moe", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=hidden // heads, intermediate_size=ffn, vocab_size=321,
                moe_intermediate_size=expert_ffn, num_experts=8, num_experts_per_tok=2, tie_word_embeddings=True)


def planned(shape, tokens: int, checkpointing: bool) -> dict[str, float]:
    s = TrainerSettings(dtype_bytes=4, world_size=1, context_parallel=1, checkpointing=checkpointing,
                        prompts_per_step=1, group_size=1, micro_batch_groups=1, seq_tokens=tokens, chunk_tokens=1024)
    return {t.name: t.bytes for t in trainer_terms(shape, s) if t.name in ("activations", "gradients", "log-prob chunk")}


def line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return slope, my - slope * mx


def compare(path: Path) -> list[str]:
    record = json.loads(path.read_text())
    size = record["model"].split()[0]
    shape = shape_from_config(model_config(size))
    rows = [f"\n{path.name}: {record['model']}\n",
            "| tokens | mode | measured GiB (RSS) | plan GiB | error |", "| --- | --- | --- | --- | --- |"]
    for mode, ck in (("kept", False), ("checkpointed", True)):
        points = []
        for tokens, r in sorted(record["rows"].items(), key=lambda kv: int(kv[0])):
            if "step_gib" not in r.get(mode, {}):
                continue
            measured, plan = r[mode]["step_gib"], sum(planned(shape, int(tokens), ck).values()) / GiB
            points.append((int(tokens), measured * GiB))
            rows.append(f"| {int(tokens):,} | {mode} | {measured:.3f} | {plan:.3f} | {plan / measured - 1:+.0%} |")
        fixed = sum(v for k, v in planned(shape, 1, ck).items() if k != "activations")
        per_token = activation_per_token(shape, 4, ck)
        if len(points) >= 2:
            slope = (points[-1][1] - points[-2][1]) / (points[-1][0] - points[-2][0])
            _, intercept = line(points)
            rows.append(f"| per token, {mode} | activations | {slope / 1024:.1f} KiB (last two lengths) | "
                        f"{per_token / 1024:.1f} KiB | {per_token / slope - 1:+.0%} |")
            rows.append(f"| fixed, {mode} | gradients + chunk | {intercept / 2**20:.1f} MiB (intercept) | "
                        f"{fixed / 2**20:.1f} MiB | |")
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    paths = [Path(p) for p in argv] or [ROOT / "bench" / "results" / n for n in ("lengths.json", "lengths-50m.json")]
    for path in paths:
        if path.is_file():
            print("\n".join(compare(path)))
        else:
            print(f"{path}: not measured here (bench/lengths.py writes it)")


if __name__ == "__main__":
    main()

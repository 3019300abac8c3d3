"""From complete groups to the trainer's ``TrainBatch`` and to a step's metrics: pure functions, no IO."""

from __future__ import annotations

import numpy as np

from cascade_rl.protocol.messages import StepDone, TrainBatch

from . import trajectory
from .groups import Group, rewards


def build_batch(step: int, groups: list[Group], group_size: int, mopd: bool, overlong_penalty: bool,
                cursor: dict[str, int]) -> TrainBatch:
    """Rows group by group (prompt + response), packed one after another (protocol/rows.py), each with its
    rollout id, the sampler's log-probs, the reward trained on and, under MOPD, the teacher's log-probs."""
    rows = [(g.rollout_id(i), g.rollouts[i], g.masked) for g in groups for i in range(g.n)]
    rollouts = [r for _, r, _ in rows]
    lengths = np.array([len(r.prompt_ids) + len(r.response_ids) for r in rollouts], np.int32)
    teacher = [lp for g in groups for lp in g.teacher] if mopd else None
    return TrainBatch(
        step=step,
        group_size=group_size,
        input_ids=_cat([np.concatenate([r.prompt_ids, r.response_ids]) for r in rollouts], np.int32),
        # the response's tokens (a multi-turn row's: the model's, not the tools' output)
        response_mask=_cat([_row(r, True if r.loss_mask is None else r.loss_mask, bool) for r in rollouts], bool),
        inf_logprobs=_cat([_row(r, r.inf_logprobs, np.float32) for r in rollouts], np.float32),
        rewards=np.concatenate([rewards(g, overlong_penalty) for g in groups]),
        versions=np.array([r.policy_version for r in rollouts], np.int32),
        lengths=lengths,
        teacher_logprobs=None if teacher is None else _cat([_row(r, lp, np.float32) for r, lp in zip(rollouts, teacher)],
                                                            np.float32),
        loss_masked=np.array([masked for _, _, masked in rows], bool),
        routes=batch_routes(rollouts, lengths),
        cursor=dict(cursor),
        ids=[rid for rid, _, _ in rows],
        segment_starts=batch_segments(rollouts),
    )


def _row(r, response, dtype) -> np.ndarray:
    """A per-token array of rollout ``r``'s row: 0 over its prompt, then ``response`` (a value per response token,
    or one for all)."""
    out = np.zeros(len(r.prompt_ids) + len(r.response_ids), dtype)
    out[len(r.prompt_ids):] = response
    return out


def _cat(rows: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(rows) if rows else np.zeros(0, dtype)


def batch_segments(rollouts: list) -> np.ndarray | None:
    """Where each row's later segments start [N, S] (-1: none), or None when no row has more than one."""
    most = max((len(r.segment_starts) for r in rollouts if r.segment_starts is not None), default=0)
    if not most:
        return None
    out = np.full((len(rollouts), most), -1, np.int32)
    for i, r in enumerate(rollouts):
        if r.segment_starts is not None:
            out[i, : len(r.segment_starts)] = r.segment_starts  # positions in prompt + response: the row's
    return out


def version_span(r) -> int:
    """Newest minus oldest policy version among a rollout's tokens (0 unless the sampler took new weights while
    it generated the rollout)."""
    if r.token_versions is None or not len(r.token_versions):
        return 0
    return int(r.token_versions.max()) - r.policy_version


def batch_routes(rollouts: list, lengths: np.ndarray) -> np.ndarray | None:
    """The rows' routes, packed [sum(lengths), MoE layers, top_k] (-1 where a row has none: its last token, a
    rollout that came without), or None when no rollout carries any."""
    shapes = {r.routes.shape[1:] for r in rollouts if r.routes is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"rollouts of one batch carry routes of different shapes {sorted(shapes)}: one model, "
                         "one engine kind per run")
    out = np.full((int(lengths.sum(dtype=np.int64)), *shapes.pop()), -1, np.int16)
    start = 0
    for r, n in zip(rollouts, lengths.tolist()):
        if r.routes is not None:
            out[start : start + len(r.routes)] = r.routes
        start += n
    return out


def step_metrics(step: int, version: int, groups: list[Group], overlong_penalty: bool, t_sample: float,
                 t_step: float, done: StepDone) -> dict:
    """One line of metrics.jsonl: what was sampled and scored for ``step``, and the trainer's own metrics."""
    rollouts = [g.rollouts[i] for g in groups for i in range(g.n)]
    trained_rewards = np.concatenate([rewards(g, overlong_penalty) for g in groups])
    tokens = sum(len(r.response_ids) for r in rollouts)
    return {
        "step": step + 1,
        "version": version,
        "reward_mean": float(np.mean(trained_rewards)),
        "verifier_reward_mean": float(np.mean([g.scores[i].reward for g in groups for i in range(g.n)])),
        "masked_groups": sum(g.masked for g in groups),
        "response_len_mean": tokens / len(rollouts),
        "truncated_frac": float(np.mean([r.finish_reason == "length" for r in rollouts])),
        "staleness_mean": float(np.mean([step - r.policy_version for r in rollouts])),
        "staleness_max": max(step - r.policy_version for r in rollouts),  # <= orchestrator.max_staleness
        "version_span_max": max(version_span(r) for r in rollouts),  # in-flight updates: > 0
        "gen_tokens_per_s": tokens / max(t_sample, 1e-9),
        **{f"multi_turn/{k}": v
           for k, v in trajectory.summary([t for g in groups for t in g.trajectories.values()]).items()},
        "sample_s": t_sample,
        "step_s": t_step,
        **{f"trainer/{k}": v for k, v in done.metrics.items()},
    }


def mismatch_summary(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Engine vs trainer log-probs over the run: mean of the per-step means and fractions, max of the maxima."""
    if not per_step:
        return {}
    out = {k: float(np.mean([m[k] for m in per_step])) for k in per_step[0] if k != "abs_diff_max"}
    return {**out, "abs_diff_max": max(m["abs_diff_max"] for m in per_step)}

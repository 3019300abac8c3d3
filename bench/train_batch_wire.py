"""A step's TrainBatch on the wire: rows packed (protocol version 3) against right-padded (version 2).

    .venv/bin/python bench/train_batch_wire.py [--quick | --smoke] [--rounds N]

One trainer rank's share of a step at the paper's lengths: 8 groups of 16 rollouts, each a 1K-token prompt and a
response drawn long-tailed (log-normal, median 6K tokens, capped at the 49K of the paper's RL stages; ``--quick``
caps at 16K), with the sampler's log-probs, MOPD's teacher log-probs and, in the second case, the engine's routes
at Nemotron-3-Nano's shape (23 MoE layers, top-6, int16: 276 bytes a token, routing replay). Per round, each
layout in turn, the whole path from the orchestrator's rollouts to the trainer's ``Batch``:

  build     the orchestrator's arrays from its complete groups: packed, ``build_batch`` itself (orchestrator/
            batch.py, then ``encode``); padded, an [N, L] array per field filled row by row (the version 2
            ``build_batch``)
  send      the frames over a real ZeroMQ PUSH/PULL pair (ipc), sent and received in full; packed frames are
            ``encode``'s; padded ones the same frames with the padded arrays in place of the packed ones
  trainer   the trainer's micro-batches of one group each: packed, ``Part.from_message`` then each micro-batch
            padded to its own longest row (``Part.rows``); padded, the version 2 ``Batch.from_message`` (the
            padded arrays taken as they are, each row's length recovered from its response mask) and each
            micro-batch a view of the whole width

Reports bytes on the wire and the median seconds of each part and of the whole; ratio = packed / padded time
(< 1: packed faster). Writes bench/results/train_batch_wire.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_parser, machine, write_result  # noqa: E402

GROUPS, GROUP_SIZE, PROMPT = 8, 16, 1024
ROUTES = (23, 6)  # Nemotron-3-Nano: MoE layers, top-k


def groups(cap: int, routes: bool, seed: int = 0) -> list:
    """One rank's complete groups, as the orchestrator holds them (scored, with the teacher's log-probs)."""
    from cascade_rl.data.rows import Row
    from cascade_rl.orchestrator.groups import Group
    from cascade_rl.protocol.messages import Rollout, SamplingParams, Score, WorkKey

    rng = np.random.default_rng(seed)
    out = []
    for k in range(GROUPS):
        key = WorkKey.sample(f"g{k}", 0)
        prompt = rng.integers(0, 131_072, PROMPT, dtype=np.int32)
        g = Group(key.group, Row(f"row-{k}", (), "math", "", {}), prompt, GROUP_SIZE, SamplingParams(), 0, True,
                  teacher=[])
        for i in range(GROUP_SIZE):
            n = int(min(cap, max(16, rng.lognormal(np.log(6144), 1.0))))
            g.rollouts[i] = Rollout(key.answer(i), "math", prompt, rng.integers(0, 131_072, n, dtype=np.int32),
                                    -rng.random(n, dtype=np.float32),
                                    routes=rng.integers(0, 128, (PROMPT + n - 1, *ROUTES), dtype=np.int16)
                                    if routes else None)
            g.scores[i] = Score(key.answer(i), 0.0, True)
            g.teacher.append(-rng.random(n, dtype=np.float32))
        out.append(g)
    return out


def padded_arrays(groups: list) -> dict[str, np.ndarray]:
    """The version 2 batch: every per-token field right-padded to the longest row."""
    rows = [(g.rollouts[i], g.teacher[i]) for g in groups for i in range(g.n)]
    n, width = len(rows), max(PROMPT + len(r.response_ids) for r, _ in rows)
    out = {"input_ids": np.zeros((n, width), np.int32), "response_mask": np.zeros((n, width), bool),
           "inf_logprobs": np.zeros((n, width), np.float32), "teacher_logprobs": np.zeros((n, width), np.float32)}
    if rows[0][0].routes is not None:
        out["routes"] = np.full((n, width, *ROUTES), -1, np.int16)
    for i, (r, teacher) in enumerate(rows):
        k = len(r.response_ids)
        out["input_ids"][i, :PROMPT], out["input_ids"][i, PROMPT : PROMPT + k] = r.prompt_ids, r.response_ids
        out["response_mask"][i, PROMPT : PROMPT + k] = True
        out["inf_logprobs"][i, PROMPT : PROMPT + k] = r.inf_logprobs
        out["teacher_logprobs"][i, PROMPT : PROMPT + k] = teacher
        if "routes" in out:
            out["routes"][i, : len(r.routes)] = r.routes
    return out


def padded_trainer(arrays: dict[str, np.ndarray]):
    """The version 2 ``Batch.from_message``: tensors of the padded arrays, lengths from the response mask."""
    import torch

    mask = torch.from_numpy(arrays["response_mask"])
    lengths = torch.where(mask, torch.arange(mask.shape[1]) + 1, 0).amax(dim=1)
    tensors = [torch.from_numpy(arrays["input_ids"]).long(), lengths, mask, mask.clone(),
               *(torch.from_numpy(arrays[k]) for k in ("inf_logprobs", "teacher_logprobs", "routes") if k in arrays)]
    return [[t[g : g + GROUP_SIZE] for t in tensors] for g in range(0, len(lengths), GROUP_SIZE)]


def one_round(groups, push, pull) -> dict[str, dict[str, float]]:
    from cascade_rl.learner.batch import Part
    from cascade_rl.orchestrator.batch import build_batch
    from cascade_rl.protocol import decode, encode

    out = {}
    t0 = time.perf_counter()
    msg = build_batch(0, groups, GROUP_SIZE, mopd=True, overlong_penalty=False, cursor={})
    frames = encode(msg)
    t1 = time.perf_counter()
    push.send_multipart(frames, copy=False)
    got = pull.recv_multipart(copy=False)
    t2 = time.perf_counter()
    part = Part.from_message(decode(got))
    [part.rows(sl) for sl in part.groups(1)]
    t3 = time.perf_counter()
    out["packed"] = {"build_s": t1 - t0, "send_s": t2 - t1, "trainer_s": t3 - t2, "total_s": t3 - t0,
                     "bytes": sum(len(memoryview(f)) for f in frames)}
    t0 = time.perf_counter()
    arrays = padded_arrays(groups)
    frames = [frames[0], *(memoryview(a).cast("B") for a in arrays.values())]  # a header, then the arrays' bytes
    t1 = time.perf_counter()
    push.send_multipart(frames, copy=False)
    got = pull.recv_multipart(copy=False)
    t2 = time.perf_counter()
    padded_trainer({k: np.frombuffer(g.buffer, a.dtype).reshape(a.shape) for (k, a), g in zip(arrays.items(), got[1:])})
    t3 = time.perf_counter()
    out["padded"] = {"build_s": t1 - t0, "send_s": t2 - t1, "trainer_s": t3 - t2, "total_s": t3 - t0,
                     "bytes": sum(len(memoryview(f)) for f in frames)}
    return out


def run_case(cap: int, routes: bool, rounds: int, push, pull) -> dict:
    step = groups(cap, routes)
    lengths = [PROMPT + len(g.rollouts[i].response_ids) for g in step for i in range(g.n)]
    per = [one_round(step, push, pull) for _ in range(rounds + 1)][1:]  # round 0 warms up
    med = {lay: {k: statistics.median(r[lay][k] for r in per) for k in per[0][lay]} for lay in ("packed", "padded")}
    return {"rows": len(lengths), "tokens": sum(lengths), "longest": max(lengths),
            "median_row": int(statistics.median(lengths)), "routes": routes, "median": med,
            "bytes_ratio": round(med["packed"]["bytes"] / med["padded"]["bytes"], 4),
            "time_ratio": round(med["packed"]["total_s"] / med["padded"]["total_s"], 4)}


def main() -> dict:
    import tempfile

    import zmq

    ap = bench_parser(__doc__, quick="responses capped at 16K tokens, 3 rounds", smoke="capped at 1K, 1 round: no figures")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per case")
    args = ap.parse_args()
    cap = 1024 if args.smoke else 16_384 if args.quick else 49_152
    rounds = 1 if args.smoke else 3 if args.quick else args.rounds
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        pull.bind(f"ipc://{tmp}/wire")
        push.connect(f"ipc://{tmp}/wire")
        cases = {"no_routes": run_case(cap, False, rounds, push, pull),
                 "nano_routes": run_case(cap, True, rounds, push, pull)}
        push.close(0), pull.close(0)
    ctx.term()
    head = cases["nano_routes"]
    summary = {
        "name": "train_batch_wire",
        "metric": f"orchestrator -> trainer s for one rank's step ({head['rows']} rows, {head['tokens']} tokens, "
                  f"longest {head['longest']}), packed rows, with Nano's routes",
        "value": round(head["median"]["packed"]["total_s"], 4),
        "baseline": "right-padded rows (protocol version 2)",
        "baseline_value": round(head["median"]["padded"]["total_s"], 4),
        "ratio": head["time_ratio"],
        "target": None,
        "pass": None,
        "machine": machine(),
        "bytes_ratio": {k: c["bytes_ratio"] for k, c in cases.items()},
    }
    return write_result(summary, {**summary, "cap": cap, "rounds": rounds, "cases": cases}, smoke=args.smoke)


if __name__ == "__main__":
    main()

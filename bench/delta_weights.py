"""Delta weight sync: how much of a bf16 model one AdamW step at lr 3e-6 changes, and a version's bytes and time
through the ``delta`` transport against the full ``stream``, in the same run.

    .venv/bin/python bench/delta_weights.py [--size 50m] [--steps 8] [--lr 3e-6] [--quick | --smoke]

Builds a random ``make-tiny-model`` model of ``--size`` (50m: 512 wide, 8 layers, MoE; bench/_common.py
``random_model``), loads it in bf16 as the trainer does, and takes ``--steps`` optimizer steps of
learner/optim.py ``MasterAdamW`` (fp32 masters and moments, the trainer's) at the paper's lr 3e-6 on next-token
loss over make run's arithmetic SFT text (8 rows of 128 tokens). After each step the model is published as a
version through both transports, and a receiver in this process takes it (an engine that copies nothing, so the
figure is the transport's alone):

* ``stream`` (baseline): ``StreamTransport.publish`` (snapshot + checksum) + ``stream.resolve`` (every chunk over
  TCP on 127.0.0.1, written to /dev/shm, hashed on arrival).
* ``delta``: ``DeltaTransport.publish`` (the same snapshot + the diff against the version before) + ``delta.load``
  (the delta fetched over the same kind of socket, checked, applied to the kept copy, the whole file re-hashed).
  A second delta publisher with ``zlib_level=1`` reports its bytes and publish time (``zlib1_*``).

Per step: the fraction of elements whose bf16 bits changed, the bytes each transport moves per version, the
publish and receive seconds, and what the bytes would take on a 10 Gb/s link (loopback TCP here moves GB/s, so
the measured seconds understate what a network saves). The headline is the median over versions of delta bytes /
full bytes (target <= 0.5). ``--quick``: the 10m model, 4 steps; ``--smoke``: the tiny model, 2 steps of 2 rows.
Writes bench/results/delta_weights.json; the last stdout line is the summary.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, builtin_data, random_model, sft_model, write_result  # noqa: E402

LINK_BPS = 10e9 / 8  # a 10 Gb/s network, bytes per second


class NullEngine:
    """Takes weights and copies nothing: the receiver's cost alone."""

    version = 0

    def load_weights(self, path: str, version: int) -> None:
        self.version = version

    def load_tensors(self, tensors: dict, version: int) -> None:
        self.version = version


def batches(tokenizer, rows: int, length: int, smoke: bool):
    """Endless [rows, length] token batches of make run's arithmetic SFT text (prompt + response), packed."""
    path = builtin_data(smoke)["sft"]["arithmetic"]
    text = [json.loads(line) for line in open(path)]
    ids = [t for r in text for t in tokenizer(r["prompt"] + " " + r["response"] + "\n")["input_ids"]]
    ids = torch.tensor(ids * (1 + rows * length // max(1, len(ids))))
    step = rows * length
    while True:
        for start in range(0, len(ids) - step + 1, step):
            yield ids[start : start + step].reshape(rows, length)


def main() -> None:
    ap = bench_parser(__doc__, quick="the 10m model, 4 steps (make bench)", smoke="the tiny model, 2 steps: seconds")
    ap.add_argument("--size", default="50m")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-6)
    args = ap.parse_args()

    # --- model, optimizer, data
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cascade_rl.learner.optim import MasterAdamW
    from cascade_rl.weights import delta, stream
    from cascade_rl.weights.registry import TRANSPORTS

    rows, length = (2, 32) if args.smoke else (8, 128)
    if args.smoke:
        args.size, args.steps, model_dir = "tiny", 2, sft_model(smoke=True)
    else:
        args.size, args.steps = ("10m", 4) if args.quick else (args.size, args.steps)
        model_dir = random_model(args.size)[0]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    optimizer = MasterAdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
    data = batches(tokenizer, rows, length, args.smoke)

    # --- transports: both publish every version; one receiver each
    run_id = f"bench-delta-{uuid.uuid4().hex[:6]}"
    full = TRANSPORTS["stream"](run_id=run_id, endpoint="tcp://127.0.0.1:0")
    deltas = TRANSPORTS["delta"](run_id=run_id, endpoint="tcp://127.0.0.1:0")  # the default: no zlib
    zipped = TRANSPORTS["delta"](run_id=run_id, endpoint="tcp://127.0.0.1:0", zlib_level=1)  # bytes and publish only
    engine = NullEngine()

    def version(v: int) -> dict:
        t0 = time.perf_counter()
        notice = full.publish(model, v)
        t1 = time.perf_counter()
        stream.resolve(notice, run_id, 60)
        t2 = time.perf_counter()
        dnotice = deltas.publish(model, v)
        t3 = time.perf_counter()
        before = dict(delta.COUNTS)
        delta.load(engine, dnotice, run_id)
        t4 = time.perf_counter()
        zipped.publish(model, v)
        t5 = time.perf_counter()
        m = deltas.metrics
        return {"version": v, "changed_frac": m["changed_frac"], "full_bytes": notice.nbytes,
                "delta_bytes": m["bytes"], "index_bytes": m.get("index_bytes", 0), "zlib_saved": m.get("zlib_saved", 0),
                "diff_s": m["delta_s"], "stream_publish_s": t1 - t0, "stream_receive_s": t2 - t1,
                "delta_publish_s": t3 - t2, "delta_receive_s": t4 - t3,
                "zlib_bytes": zipped.metrics["bytes"], "zlib_publish_s": t5 - t4,
                "resynced": delta.COUNTS["resyncs"] > before["resyncs"]}

    # --- loop: one step, one version through both
    runs = [version(0)]  # the starting weights: every receiver's first version is a full resync
    try:
        for v in range(1, args.steps + 1):
            x = next(data)
            t0 = time.perf_counter()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step_s = time.perf_counter() - t0
            runs.append(version(v) | {"loss": loss.item(), "step_s": step_s})
            r = runs[-1]
            print(f"v{v}: loss {r['loss']:.3f}, changed {r['changed_frac']:.2%}, delta {r['delta_bytes'] / 1e6:.1f} MB "
                  f"vs {r['full_bytes'] / 1e6:.1f} MB, receive {r['delta_receive_s'] * 1e3:.0f} vs "
                  f"{r['stream_receive_s'] * 1e3:.0f} ms", file=sys.stderr)
    finally:
        for t in (full, deltas, zipped):
            t.close()

    # --- summary: medians over the versions after the first (deltas)
    steps = [r for r in runs[1:] if not r["resynced"]]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in steps)

    ratio = med("delta_bytes") / med("full_bytes")
    time_full = med("stream_publish_s") + med("stream_receive_s")
    time_delta = med("delta_publish_s") + med("delta_receive_s")
    summary = {
        "name": "delta_weights",
        "metric": f"bytes per version through the delta transport at {args.size} (bf16, MasterAdamW lr {args.lr:g})",
        "value": round(med("delta_bytes") / 1e6, 2), "baseline": "the full file (stream)",
        "baseline_value": round(med("full_bytes") / 1e6, 2), "ratio": round(ratio, 3), "target": "<= 0.5",
        "pass": ratio <= 0.5,
        "size": args.size, "params": params, "steps": args.steps, "lr": args.lr,
        "changed_frac_per_step": [round(r["changed_frac"], 4) for r in runs[1:]],
        "changed_frac_median": round(med("changed_frac"), 4),
        "index_share": round(med("index_bytes") / med("delta_bytes"), 3),
        "zlib1_MB": round(med("zlib_bytes") / 1e6, 2), "zlib1_publish_ms": round(med("zlib_publish_s") * 1e3, 1),
        "diff_ms": round(med("diff_s") * 1e3, 1),
        "stream_publish_ms": round(med("stream_publish_s") * 1e3, 1),
        "stream_receive_ms": round(med("stream_receive_s") * 1e3, 1),
        "delta_publish_ms": round(med("delta_publish_s") * 1e3, 1),
        "delta_receive_ms": round(med("delta_receive_s") * 1e3, 1),
        "time_ratio_loopback": round(time_delta / time_full, 3),
        "link_10gbps_ms": {"stream": round(med("full_bytes") / LINK_BPS * 1e3, 1),
                           "delta": round(med("delta_bytes") / LINK_BPS * 1e3, 1)},
        "step_s": round(med("step_s"), 2),
    }
    write_result(summary, {"summary": summary, "runs": runs}, smoke=args.smoke)


if __name__ == "__main__":
    main()

"""What a run's dashboards hold, read back through each library's own files and clients: W&B's offline run files
(its transaction log of protobuf records, the file ``wandb sync`` uploads) and MLflow's ``MlflowClient``."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of chunks, each a 7-byte header + data
HEADER = 7


def _chunks(buf: bytes):
    pos, pending = HEADER, b""  # the file opens with its own 7-byte header (":W&B", magic, version)
    while pos + HEADER <= len(buf):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, n, kind = struct.unpack_from("<IHB", buf, pos)
        data, pos = buf[pos + HEADER:pos + HEADER + n], pos + HEADER + n
        if kind == 0:
            return
        pending = data if kind in (1, 2) else pending + data  # full, first | middle, last
        if kind in (1, 4):
            yield pending


def wandb_runs(run_dir: Path) -> list[dict]:
    """Every offline W&B run under ``run_dir/wandb``, in order: id, group, job type, config keys, and its history
    as {step: {metric: value}}."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")):
        run = {"file": path, "history": {}, "config": {}, "artifacts": []}
        for data in _chunks(path.read_bytes()):
            record = pb.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                r = record.run
                run.update(id=r.run_id, group=r.run_group, job_type=r.job_type, name=r.display_name)
                run["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
            elif kind == "config":
                run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                step = record.history.step.num
                values = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                run["history"].setdefault(step, {}).update(
                    {k: v for k, v in values.items() if not k.startswith("_")})
            elif kind == "artifact":
                run["artifacts"].append(record.artifact.name)
        run["history"] = {step: values for step, values in run["history"].items() if values}
        runs.append(run)
    return runs


def mlflow_metrics(uri: str, run_id: str) -> dict[int, dict[str, float]]:
    """An MLflow run's metrics as {step: {metric: value}} (every value of every metric)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    out: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, key):
            out.setdefault(m.step, {})[key] = m.value
    return out


def jsonl_by_step(path: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl as the dashboards see it: per step, the numbers of its lines (later lines win); steps with
    none left out."""
    out: dict[int, dict[str, float]] = {}
    for line in Path(path).read_text().splitlines():
        m = json.loads(line)
        out.setdefault(m["step"], {}).update(
            {k: float(v) for k, v in m.items()
             if k not in ("step", "time") and isinstance(v, int | float) and not isinstance(v, bool)})
    return {step: values for step, values in out.items() if values}

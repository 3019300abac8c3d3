"""Publishing side of weight transports, registered by name.

``shm`` (default on one machine): the trainer writes the policy as one
safetensors file under /dev/shm (atomic rename, so a reader never sees a
partial file), keeps the newest ``keep`` versions, and announces each with a
``WeightsReady`` carrying size and checksum. Samplers resolve it with
``cascade_rl.protocol.weights.resolve`` and load it in place.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file, save_model

from cascade_rl.protocol.messages import WeightsReady
from cascade_rl.protocol.registry import Registry
from cascade_rl.protocol.weights import file_checksum, shm_dir

TRANSPORTS = Registry("weight transport")  # name -> class(run_id) with publish(model, version), close()
register_transport = TRANSPORTS.register


@register_transport("shm")
class ShmTransport:
    def __init__(self, run_id: str, keep: int = 2) -> None:
        self.dir = shm_dir(run_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._published: list[Path] = []

    def publish(self, model: torch.nn.Module | dict[str, torch.Tensor], version: int) -> WeightsReady:
        """``model``: the policy, or its full state dict in HF names (gathered from FSDP2 shards)."""
        path = self.dir / f"policy-v{version:06d}.safetensors"
        tmp = path.with_suffix(".tmp")
        if isinstance(model, dict):
            save_file(unshared(model), str(tmp))
        else:
            save_model(model, str(tmp))  # handles tied embeddings (shared tensors)
        os.replace(tmp, path)
        self._published.append(path)
        while len(self._published) > self.keep:
            self._published.pop(0).unlink(missing_ok=True)
        return WeightsReady(
            version=version, uri=f"file://{path}", nbytes=path.stat().st_size, checksum=file_checksum(path)
        )

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors with no storage shared between names (safetensors refuses shared ones; tied
    embeddings are one tensor under two names): a second name gets a copy."""
    seen, out = set(), {}
    for name, t in state.items():
        t = t.contiguous()
        out[name] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    return out

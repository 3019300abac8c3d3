"""Multi-rank training: torch.distributed + FSDP2, applied to an HF causal LM in visible order.

    torchrun --nproc-per-node 2 -m cascade_rl.learner.trainer --config RUN_DIR/config.yaml

The supervisor starts the trainer this way when ``trainer.world_size > 1``.
Every rank holds a shard of the weights and optimizer state (``fully_shard``
on each decoder layer, then on the root), runs forward/backward on its own
``1/world_size`` of the batch's groups and lets FSDP average the gradients
(reduce-scatter); so a step equals the one-rank step on the whole batch as long
as every rank's loss is the mean over its equal share (whole groups, validated
at launch). Rank 0 alone talks to the orchestrator; it broadcasts each
``TrainBatch`` to the other ranks and gathers the full weights for publishing
and checkpoints. Backends: gloo on CPU, NCCL on CUDA.

Run the equivalence test (2 CPU ranks against 1): ``pytest tests/test_parallel.py``.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cascade_rl.protocol.codec import decode, encode


@dataclasses.dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init(world_size: int, device: torch.device | str = "cpu") -> Ranks:
    """Join the process group torchrun set up (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``...); one rank:
    nothing to join. NCCL when this rank's ``device`` (protocol/devices.py ``role_device``, which made
    cuda:LOCAL_RANK current) is a GPU, gloo on the CPU."""
    if world_size <= 1:
        return Ranks()
    if int(os.environ.get("WORLD_SIZE", "1")) != world_size:
        raise RuntimeError(f"trainer.world_size={world_size} but torchrun started "
                           f"{os.environ.get('WORLD_SIZE', 1)} ranks")
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, device_id=torch.device(device) if backend == "nccl" else None)
    return Ranks(dist.get_rank(), dist.get_world_size())


def parallelize(policy: nn.Module, ranks: Ranks) -> nn.Module:
    """FSDP2: shard each decoder layer of the policy's HF model, then the root (embeddings, final norm,
    LM head: gathered for the policy's forward, which runs the base model and the chunked LM head)."""
    if not ranks.distributed:
        return policy
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # bf16 parameters: gradients are summed across ranks in fp32, then stored in the parameters' dtype
    # (learner/optim.py keeps the fp32 master); fp32 parameters: no change
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in policy.model.base_model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(policy, mp_policy=mp)
    return policy


def full_state_dict(model: nn.Module, ranks: Ranks) -> dict[str, Tensor] | None:
    """The unsharded weights on rank 0 (CPU), ``None`` on the others; a collective: every rank calls it."""
    if not ranks.distributed:
        return dict(model.state_dict())
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if ranks.main else None


def broadcast_message(msg, ranks: Ranks):
    """Rank 0's message to every rank (codec frames over the process group: the same bytes as on the wire)."""
    if not ranks.distributed:
        return msg
    box = [[bytes(f) for f in encode(msg)] if ranks.main else None]
    dist.broadcast_object_list(box, src=0)
    return decode(box[0])


def shard_rows(n_groups: int, group_size: int, ranks: Ranks) -> slice:
    """This rank's rows: a contiguous, equal share of whole groups."""
    per_rank = n_groups // ranks.world_size
    return slice(ranks.rank * per_rank * group_size, (ranks.rank + 1) * per_rank * group_size)


SUMMED = ("response_tokens", "zero_adv_groups", "masked_rows", "routing/routes")


def reduce_metrics(metrics: dict[str, float], ranks: Ranks) -> dict[str, float]:
    """Every rank's step metrics combined: counts summed, ``*_max`` maxed, the rest averaged (equal
    shares, so the mean of rank means is the batch mean for per-group and per-row quantities)."""
    if not ranks.distributed:
        return metrics
    keys = sorted(metrics)
    # NCCL reduces device tensors only: the current GPU (role_device made it current), gloo host ones
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device)
    summed, maxed = values.clone(), values.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
    out = {}
    for i, k in enumerate(keys):
        if k in SUMMED:
            out[k] = summed[i].item()
        elif k.endswith("_max") or k == "lr":
            out[k] = maxed[i].item()
        else:
            out[k] = summed[i].item() / ranks.world_size
    return out


def close(ranks: Ranks) -> None:
    if ranks.distributed and dist.is_initialized():
        dist.destroy_process_group()

"""Multi-rank training: torch.distributed + FSDP2, applied to an HF causal LM in visible order.

    torchrun --nproc-per-node 2 -m cascade_rl.learner.trainer --config RUN_DIR/config.yaml

The supervisor starts the trainer this way when ``trainer.world_size > 1``.
Every rank holds a shard of the weights and optimizer state (``fully_shard``
on each decoder layer, then on the root), runs forward/backward on its own
``1/world_size`` of the batch's groups and lets FSDP average the gradients
(reduce-scatter, in fp32: bf16 weights are held as fp32 shards and computed in
bf16, ``parallelize``); so a step equals the one-rank step on the whole batch as
long as every rank's loss is the mean over its equal share (whole groups,
validated at launch). Each rank receives its own share of every ``TrainBatch`` part
from the orchestrator over its own link. Publishing gathers one parameter at a time
while rank 0's transport writes it (``GatheredWeights``); checkpoints gather the
full state dict. Backends: gloo on CPU, NCCL on CUDA.

Run the equivalence test (2 CPU ranks against 1): ``pytest tests/test_parallel.py``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cascade_rl.modeling.context_parallel import ContextParallel
from cascade_rl.weights.layout import file_order

from .optim import LOW_PRECISION


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This rank among ``world_size``; ``cp`` consecutive ranks share each sequence (context parallelism,
    ``context``), the ``world_size / cp`` such groups split the batch (data parallelism)."""

    rank: int = 0
    world_size: int = 1
    cp: int = 1
    context: ContextParallel | None = dataclasses.field(default=None, compare=False)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp


def init(world_size: int, device: torch.device | str = "cpu", context_parallel: int = 1) -> Ranks:
    """Join the process group torchrun set up (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``...); one rank:
    nothing to join. NCCL when this rank's ``device`` (protocol/devices.py ``role_device``, which made
    cuda:LOCAL_RANK current) is a GPU, gloo on the CPU. ``context_parallel`` consecutive ranks form each
    context-parallel group (one process group each, made by every rank)."""
    if world_size <= 1:
        return Ranks()
    if int(os.environ.get("WORLD_SIZE", "1")) != world_size:
        raise RuntimeError(f"trainer.world_size={world_size} but torchrun started "
                           f"{os.environ.get('WORLD_SIZE', 1)} ranks")
    if world_size % context_parallel:
        raise ValueError(f"trainer.context_parallel={context_parallel} must divide trainer.world_size={world_size}")
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, device_id=torch.device(device) if backend == "nccl" else None)
    rank = dist.get_rank()
    context = None
    if context_parallel > 1:
        for first in range(0, world_size, context_parallel):  # every rank makes every group, in the same order
            group = dist.new_group(list(range(first, first + context_parallel)))
            if first <= rank < first + context_parallel:
                context = ContextParallel(group, rank - first, context_parallel)
    return Ranks(rank, world_size, context_parallel, context)


def parallelize(policy: nn.Module, ranks: Ranks) -> nn.Module:
    """FSDP2: shard each decoder layer of the policy's HF model, then the root (embeddings, final norm,
    LM head: gathered for the policy's forward, which runs the base model and the chunked LM head).

    bf16 (fp16) parameters become fp32 shards before sharding: they are the master weights (learner/optim.py
    then keeps no copy of its own), the forward and backward compute in bf16 (``param_dtype``: FSDP2 casts
    the gathered parameters), gradients are reduce-scattered in fp32 and accumulate in the fp32 sharded grads
    across micro-batches. ``policy.weight_dtypes`` records each parameter's dtype before: what is published
    and checkpointed (``GatheredWeights``, ``full_state_dict``). (An fp32 parameter of a bf16 model, e.g. one
    HF keeps in fp32, is computed in bf16 here: FSDP2 has one ``param_dtype`` per sharded module.)"""
    if not ranks.distributed:
        return policy
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtypes = {name: p.dtype for name, p in policy.named_parameters(remove_duplicate=False)}
    low = {d for d in dtypes.values() if d in LOW_PRECISION}
    if len(low) > 1:
        raise ValueError(f"FSDP2 computes in one dtype; the model's parameters are {sorted(map(str, low))}")
    for p in policy.parameters():  # tied parameters once; a frozen one (LoRA's base) stays as it is: no master
        if p.dtype in LOW_PRECISION and p.requires_grad:
            p.data = p.data.float()
    policy.weight_dtypes = dtypes
    mp = MixedPrecisionPolicy(param_dtype=next(iter(low), None), reduce_dtype=torch.float32)
    for layer in policy.model.base_model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(policy, mp_policy=mp)
    return policy


def weight_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Parameter name -> its dtype before ``parallelize`` made it an fp32 master (empty on one rank)."""
    return getattr(model, "weight_dtypes", {})


def full_state_dict(model: nn.Module, ranks: Ranks, master: bool = False) -> dict[str, Tensor] | None:
    """The unsharded weights on rank 0 (CPU), ``None`` on the others; a collective: every rank calls it.
    In the model's dtypes (bf16 for a bf16 model), or ``master``: as FSDP2 holds them (fp32). Checkpoints only:
    publishing gathers one tensor at a time (``GatheredWeights``)."""
    if not ranks.distributed:
        return dict(model.state_dict())
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not ranks.main:
        return None
    if not master:
        dtypes = weight_dtypes(model)
        for k, v in state.items():  # one tensor at a time: the fp32 one is freed as its cast replaces it
            state[k] = v.to(dtypes.get(k, v.dtype))
    return state


def load_masters(model: nn.Module, masters: dict[str, Tensor]) -> None:
    """Full fp32 values (a checkpoint's, by parameter name) into the model's fp32 shards. Every rank holds
    ``masters`` and slices its own shard: no communication."""
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if name in masters:
                full = masters[name].to(device=p.device, dtype=p.dtype)
                p.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None))


class Gathered:
    """Tensors (some FSDP2 shards) as a ``TensorSource`` (weights/layout.py): ``_tensors`` by published name and
    their ``specs``; each shard is gathered (``DTensor.full_tensor()``, a collective) when read and cast to its spec's
    dtype. Every rank reads the same names in the same order: rank 0 through ``transport.publish``, the others
    through ``drain()``."""

    _tensors: dict[str, Tensor]
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    metadata: dict[str, str]
    device: torch.device

    def read(self, names: list[str]) -> Iterator[Tensor]:
        for name in names:
            t = self._tensors[name].detach()
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()  # every rank: an all-gather of this one parameter
            yield t.to(self.specs[name][0])

    def drain(self) -> None:
        """What a rank other than 0 does while rank 0 publishes: the same gathers, in the file's order."""
        for _ in self.read(file_order(self.specs)):
            pass


class GatheredWeights(Gathered):
    """An FSDP2 policy's full weights as a ``TensorSource`` (weights/layout.py), in the HF model's names and
    its dtypes: each tensor is gathered (``DTensor.full_tensor()``, a collective) when a transport reads it,
    cast, written and dropped, so a rank holds one full parameter beyond its shards, never a state dict (30B
    in bf16: 60 GB of host memory otherwise). Tied weights are read once and named in the metadata, as
    ``save_model`` and the one-rank publish write them: the file is the one-rank file byte for byte.

    Every rank reads the same names in the same order: rank 0 through ``transport.publish``, the others
    through ``drain()``."""

    def __init__(self, policy: nn.Module, prefix: str = "model.") -> None:
        from safetensors.torch import _remove_duplicate_names

        dtypes = weight_dtypes(policy)
        ids = {name: id(t) for name, t in (*policy.named_parameters(remove_duplicate=False),
                                           *policy.named_buffers(remove_duplicate=False))}
        state = {k.removeprefix(prefix): (k, v) for k, v in policy.state_dict().items()}  # shards: nothing gathered
        # save_model's choice of the name a tied tensor is stored under (and the metadata's order): its own rule
        # on stand-ins, one tiny tensor per distinct parameter
        stand_in: dict[int, Tensor] = {}
        proxy = {k: stand_in.setdefault(ids.get(fqn, id(v)), torch.empty(1)) for k, (fqn, v) in state.items()}
        self.metadata: dict[str, str] = {}
        for kept, dropped in _remove_duplicate_names(proxy).items():
            for name in dropped:
                self.metadata[name] = kept
                del state[name]
        self._tensors = {k: v for k, (_, v) in state.items()}
        self.specs = {k: (dtypes.get(fqn, v.dtype), tuple(v.shape)) for k, (fqn, v) in state.items()}
        self.device = next(iter(self._tensors.values())).device if self._tensors else torch.device("cpu")


def publishable(policy: nn.Module, ranks: Ranks):
    """What a weight transport publishes: the HF model itself on one rank, a ``GatheredWeights`` under FSDP2."""
    return GatheredWeights(policy) if ranks.distributed else policy.model


def gather_ids(ids: list[str], ranks: Ranks) -> list[list[str]]:
    """Each data-parallel rank's rollout ids on rank 0 (the first rank of each context-parallel group: its peers
    trained the same rows); ``[ids]`` on one rank, [] on the others."""
    if not ranks.distributed:
        return [ids]
    out = [None] * ranks.world_size if ranks.main else None
    dist.gather_object(ids, out, dst=0)
    return [out[r] for r in range(0, ranks.world_size, ranks.cp)] if ranks.main else []


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
        if k in SUMMED:  # the ranks of one context-parallel group count the same rows
            out[k] = summed[i].item() / ranks.cp
        elif k.endswith("_max") or k == "lr":
            out[k] = maxed[i].item()
        else:
            out[k] = summed[i].item() / ranks.world_size
    return out


def close(ranks: Ranks) -> None:
    if ranks.distributed and dist.is_initialized():
        dist.destroy_process_group()

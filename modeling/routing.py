"""Rollout routing replay (R3) in the trainer: an HF MoE model's routers take the experts the engine chose.

    replay = RoutingReplay.install(model, replay=True)   # a forward hook on every MoE router (None: no experts)
    with replay.sources(routes, src):                    # routes [N, L, layers, k] (-1: none), src: the layout
        model.base_model(...)                             # every router of this forward replays
    replay.take_stats()                                   # {"disagree": tensor, "routes": tensor}

A rollout's routes are the expert ids the sampler's engine picked for each token at each MoE layer
(``Rollout.routes``). The trainer's forward of the same tokens can pick others: its kernels and precision
differ, so a router logit near a tie flips (about 10 % of routes of a 30B MoE in bf16). With ``replay`` the
hook keeps the router's own logits but swaps its choice for the engine's, weighted by the model's MoE family
(kernels/moe_families.py ``moe_family(model.config).routing``; kernels/moe.py ``weigh_experts``), e = engine's ids:

    softmax_topk (Qwen3-MoE, Qwen3-Next, Qwen3.5):  p = softmax(logits) (fp32),  w_k = p[e_k] / Σ_j p[e_j]
                                                    (norm_topk_prob; else w_k = p[e_k])
    sigmoid_group_topk (Nemotron-H, DeepSeek-V3):   s = sigmoid(logits),  w_k = scaling · s[e_k] / (Σ_j s[e_j] + 1e-20)
                                                    (norm_topk_prob; else scaling · s[e_k])

The correction bias and the group limit decide which experts the router picks, not how the picked ones are weighed,
so neither enters a replayed weight. The experts, hence the log-probs, are the engine's and the router still gets
its gradient through w. The hook wraps the router (HF ``Qwen3MoeTopKRouter``, ``NemotronHTopkRouter``, ...:
``(logits, weights, ids)``) and leaves the experts alone, so it holds for every ``model.moe_impl`` (hf, grouped,
torch, triton). Either way it counts the (token, layer) routes whose expert set differs from the engine's:
``routing/disagree_frac`` in the step's metrics.

Layouts: the trainer runs rows padded, bin-packed into lanes, as shared prefixes or varlen packs
(modeling/packing.py); each forward sees its tokens flattened in its own order. ``src`` maps that order back
to the padded batch: entry j is the flat index ``row · L + t`` of the token at position j of the call, or -1
for a position no row owns (a lane's free tail). The ``*_sources`` functions below give it per layout.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor, nn

from ..kernels.moe import Routing, weigh_experts
from ..kernels.moe_families import moe_family


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router of every sparse MoE block, in layer order (a block: a module with ``gate`` and ``experts``)."""
    return [m.gate for m in model.modules() if hasattr(m, "experts") and isinstance(getattr(m, "gate", None),
                                                                                      nn.Module)]


class _RouterHooks:
    """The one forward hook of each router of a model, installed with the first ``RoutingReplay`` over it and
    shared by every later one (a teacher or a test wraps one model in many Policies: a hook per Policy would pile
    up for the life of the process). It hands a router's output to the replay whose ``sources`` is open, if any."""

    ATTR = "_cascade_rl_router_hooks"

    def __init__(self, routers: list[nn.Module]) -> None:
        self.active: RoutingReplay | None = None
        for layer, router in enumerate(routers):
            setattr(router, self.ATTR, self)
            router.register_forward_hook(functools.partial(self._hook, layer))

    @classmethod
    def of(cls, routers: list[nn.Module]) -> _RouterHooks:
        return getattr(routers[0], cls.ATTR, None) or cls(routers)

    def _hook(self, layer: int, router: nn.Module, args, output):
        return None if self.active is None else self.active.route(layer, router, output)


class RoutingReplay:
    def __init__(self, routers: list[nn.Module], replay: bool, routing: Routing) -> None:
        self.routers, self.replay, self.routing = routers, replay, routing  # routing: the model's MoE family's
        self._ids: Tensor | None = None  # [tokens of the call, layers, k] the routes' dtype (int16), -1: route freely
        self._disagree: Tensor | int = 0
        self._routes: Tensor | int = 0
        self._counting = True  # off while a checkpointed layer recomputes: its routes were counted in the forward
        self._hooks = _RouterHooks.of(routers)

    @classmethod
    def install(cls, model: nn.Module, replay: bool = True) -> RoutingReplay | None:
        routers = moe_routers(model)
        if not routers:
            return None
        family = moe_family(model.config)
        if family is None:
            raise ValueError(f"routing replay: model_type {model.config.model_type!r} has MoE routers but no "
                             "kernels/moe_families.py family to weigh replayed experts with")
        return cls(routers, replay, family.routing)

    @property
    def layers(self) -> int:
        return len(self.routers)

    @contextlib.contextmanager
    def sources(self, routes: Tensor, src: Tensor):
        """Route the forwards inside by ``routes`` [N, L, layers, k] laid out as ``src`` (any shape; flattened
        in the call's token order; -1 = no row's token)."""
        n, length, layers, k = routes.shape
        if layers != self.layers:
            raise ValueError(f"the rollouts carry routes of {layers} MoE layers, the model has {self.layers}")
        # index first, widen after: the routes stay in the engine's int16 (a view, no copy) and only this call's
        # tokens are gathered; each hook widens its own layer to int64 ([T, k]). Widening the whole micro-batch
        # first costs 4x its routes (64 rows x 16K x 48 layers x 8: ~3 GB a pack).
        flat = routes.reshape(n * length, layers, k)
        src = src.reshape(-1).to(flat.device)
        self._ids = flat[src.clamp(min=0)].masked_fill_((src < 0)[:, None, None], -1)
        outer, self._hooks.active = self._hooks.active, self
        try:
            yield
        finally:
            self._ids, self._hooks.active = None, outer

    def checkpoint_context(self):
        """``torch.utils.checkpoint``'s ``context_fn`` for activation checkpointing: called as a checkpointed layer
        runs forward, it keeps the replay open then (its ``sources``, if any); the layer's recompute runs in the
        backward, after ``sources`` closed, and routes inside the second context exactly as its forward did,
        without counting those routes again."""
        hooks = self._hooks
        active = hooks.active
        ids = None if active is None else active._ids

        @contextlib.contextmanager
        def recompute():
            outer = hooks.active, None if active is None else (active._ids, active._counting)
            hooks.active = active
            if active is not None:
                active._ids, active._counting = ids, False
            try:
                yield
            finally:
                if active is not None:
                    active._ids, active._counting = outer[1]
                hooks.active = outer[0]

        return contextlib.nullcontext(), recompute()

    def take_stats(self) -> dict[str, Tensor | int]:
        """(token, layer) routes compared since the last call, and how many of them the trainer chose otherwise."""
        out = {"disagree": self._disagree, "routes": self._routes}
        self._disagree = self._routes = 0
        return out

    def route(self, layer: int, router: nn.Module, output):
        """A router's forward hook while ``sources`` is open: compare its experts with the routes', and take
        the routes' when replaying (the hook's return value replaces the router's output)."""
        if self._ids is None:
            return None
        logits, weights, own = output
        forced = self._ids[:, layer].long()  # this layer only: [T, k]
        if forced.shape[0] != own.shape[0]:
            raise RuntimeError(f"routing replay: {forced.shape[0]} routes for a forward of {own.shape[0]} tokens")
        given = (forced >= 0).all(dim=-1)
        if self._counting:
            differ = (own.sort(dim=-1).values != forced.sort(dim=-1).values).any(dim=-1) & given
            self._disagree = self._disagree + differ.sum()
            self._routes = self._routes + given.sum()
        if not self.replay:
            return None
        ids = torch.where(given[:, None], forced, own)
        return logits, weigh_experts(logits, ids, self.routing).to(weights.dtype), ids



# --- where each layout's tokens come from in the padded batch ----------------------------------------------------


def padded_sources(lengths: Tensor, length: int) -> Tensor:
    """The padded batch itself [N, L]: token t of row i is i·L + t; padding -1."""
    n = lengths.shape[0]
    pos = torch.arange(length, device=lengths.device)
    flat = torch.arange(n, device=lengths.device)[:, None] * length + pos
    return torch.where(pos[None, :] < lengths[:, None], flat, -1)


def lane_sources(lane: Tensor, offset: Tensor, lengths: Tensor, lanes: int, width: int, length: int) -> Tensor:
    """Rows bin-packed into lanes [lanes, width] (modeling/packing.py ``Lanes``)."""
    src = torch.full((lanes, width), -1, dtype=torch.long, device=lengths.device)
    for i, (k, o, n) in enumerate(zip(lane.tolist(), offset.tolist(), lengths.tolist())):
        src[k, o: o + n] = i * length + torch.arange(n, device=lengths.device)
    return src


def prefix_sources(s, lengths: Tensor, has_targets: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """The two passes of a ``SharedPrefix`` (rows without targets are in neither): (prefixes [U, P], suffix
    lanes [lanes, W]). A prefix's routes are those of the first row that continues it (the rows of a group
    share one prefill in the engine)."""
    device = s.prefix_ids.device
    prefix = torch.full(tuple(s.prefix_ids.shape), -1, dtype=torch.long, device=device)
    lanes = torch.full(tuple(s.lane_ids.shape), -1, dtype=torch.long, device=device)
    seen: set[int] = set()
    for i, (has, start, end, u, k, o) in enumerate(zip(
            has_targets.tolist(), s.row_start.tolist(), lengths.tolist(), s.row_prefix.tolist(),
            s.row_lane.tolist(), s.row_offset.tolist())):
        if not has:
            continue
        if u not in seen:
            seen.add(u)
            prefix[u, :start] = i * length + torch.arange(start, device=device)
        lanes[k, o: o + end - start] = i * length + start + torch.arange(end - start, device=device)
    return prefix, lanes


def pack_sources(packed, length: int) -> Tensor:
    """A varlen pack [1, T] (modeling/packing.py ``Packed``)."""
    return (packed.rows[packed.token_rows()] * length + packed.position_ids[0])[None]

"""Where a process may go on a Ray cluster: the rules, apart from Ray's calls (supervisor/launchers/ray_launcher.py).

    bundle(cfg.ray.sampler)                                   # {"CPU": 1.0}: what one sampler reserves
    selector = choose(cfg.ray.sampler.labels, nodes, avoid)  # the first label selector a live node matches

``nodes`` are Ray's node records (``ray.nodes()``: NodeID, Alive, NodeManagerAddress, Labels, Resources).
A role's ``labels`` lists selectors in order of preference; a placement takes the first one that some live node
outside ``avoid`` (nodes where a host was just lost) matches and can hold, then the first any live node matches
(Ray waits there for room). The chosen selector also keeps the placement off the avoided nodes, so a worker of a
dying node is not placed back on it in the seconds before Ray declares the node dead.
"""

from __future__ import annotations

from . import LaunchError

# the roles a launcher=ray run places, each with its own section of ``ray`` (supervisor/schema_ray.py)
RAY_ROLES = ("orchestrator", "trainer", "sampler", "verifier", "teacher", "environment")
NODE_ID = "ray.io/node-id"  # the label Ray gives every node: its id


class PlacementError(LaunchError):
    """No node of the cluster can ever hold a process as its role's ``ray`` section asks."""


def bundle(spec) -> dict[str, float]:
    """What one process of a role reserves: CPUs, GPUs, custom resources (zero amounts left out)."""
    wanted = {"CPU": float(spec.cpus), "GPU": float(spec.gpus), **{k: float(v) for k, v in spec.resources.items()}}
    return {k: v for k, v in wanted.items() if v > 0}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether a node with ``labels`` satisfies ``selector`` (values: ``v``, ``!v``, ``in(a,b)``, ``!in(a,b)``)."""
    for key, want in selector.items():
        have = labels.get(key)
        negate = want.startswith("!")
        want = want[1:] if negate else want
        options = [v.strip() for v in want[3:-1].split(",")] if want.startswith("in(") else [want]
        if (have in options) == negate:
            return False
    return True


def holds(node: dict, need: dict[str, float]) -> bool:
    """Whether the node has (in total, free or not) every resource ``need`` asks."""
    return all(node.get("Resources", {}).get(k, 0.0) >= v for k, v in need.items())


def choose(preferences, nodes: list[dict], need: dict[str, float], avoid: set[str] = frozenset()) -> dict[str, str]:
    """The label selector of the placement (Ray's ``bundle_label_selector`` entry): the first of
    ``preferences`` (``[]``: any node) matched by a live node that can hold ``need``, preferring nodes not in
    ``avoid``, which the selector then excludes. Raises PlacementError when no live node ever could."""
    options = [dict(p) for p in preferences] or [{}]
    live = [n for n in nodes if n.get("Alive")]
    trusted = [n for n in live if n["NodeID"] not in avoid]
    for pool, exclude in ((trusted, bool(avoid)), (live, False)):
        for selector in options:
            if any(matches(selector, n.get("Labels", {})) and holds(n, need) for n in pool):
                if exclude and NODE_ID not in selector:
                    selector[NODE_ID] = f"!in({','.join(sorted(avoid))})"
                return selector
    raise PlacementError(f"no live node can hold {need or 'a process'} with labels "
                         f"{' or '.join(str(s) for s in options)}; the cluster has: {describe(nodes)}")


def describe(nodes: list[dict]) -> str:
    """One line per node: address, alive or dead, labels (Ray's own left out), resources."""
    rows = []
    for n in nodes:
        labels = {k: v for k, v in n.get("Labels", {}).items() if not k.startswith("ray.io/")}
        res = {k: v for k, v in n.get("Resources", {}).items()
               if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
        rows.append(f"{n.get('NodeManagerAddress')} ({'alive' if n.get('Alive') else 'dead'}, labels {labels}, "
                    f"resources {res})")
    return "; ".join(rows) or "no nodes"

"""How the torch engine applies a LoRA run's weight versions: merged into its own weights (weights/adapters.py).

    merger = AdapterMerger()
    merger.apply(model, tensors, config)   # W = W0 + scale * B @ A on every adapted module, in place
    merger.reset()                         # new full weights arrived: they are the base from now on

Each version merges from the base's W0 (a copy of the adapted modules' weights, taken the first time a module is
adapted), never over the previous version's merge; a module an earlier version adapted and this one does not goes
back to W0.

Merged rather than computed beside the base (x @ A^T @ B^T per target on every forward): measured by
tests/test_lora_engines.py ``measure_costs`` (2 shared CPU cores, fp32, r=8 on q/k/v/o), a merge costs 0.22 ms a
version on the tiny model and ~270 ms at hidden 1024 x 28 layers, while beside the base adds 0.11 ms to every 64-row
decode step of the tiny model (+75 % on its q/k/v/o matmuls) and at hidden 1024 3.8 ms (64 rows) or 0.96 ms (1 row)
a step (+4 %): the merge is paid back after ~70-280 decode steps of one version, and prefills would pay beside the
base too (BENCHMARKS.md).
"""

from __future__ import annotations

import inspect

from torch import Tensor

from ..weights import adapters


class AdapterMerger:
    def __init__(self) -> None:
        self.base: dict[str, Tensor] | None = None  # the base's weights of the adapted modules, by HF name

    def reset(self) -> None:
        """New full weights: a later adapter applies over them."""
        self.base = None

    def apply(self, model, tensors: dict[str, Tensor], config: dict) -> None:
        """The adapter ``tensors`` (peft's names) with its ``config`` merged into ``model``'s weights in place
        (samplers/torch_model.py ``load_hf_state_dict``: captured decode graphs stay valid)."""
        wanted = [f"{m}.weight" for m in adapters.pairs(tensors)]
        if self.base is None:
            self.base = {}
        if new := [k for k in wanted if k not in self.base]:
            current = model.hf_state_dict()  # the base's weights for modules no earlier version adapted
            if missing := [k for k in new if k not in current]:
                raise ValueError(f"the adapter adapts {missing[:3]}, which this model does not have")
            self.base.update({k: current[k].detach().clone() for k in new})
        merged = adapters.merge(self.base, tensors, config)
        merged.update({k: w0 for k, w0 in self.base.items() if k not in merged})
        model.load_hf_state_dict(merged, **partial(model, merged))


def partial(model, tensors: dict[str, Tensor]) -> dict:
    """``load_hf_state_dict``'s keyword for some weights: ``partial=True`` where the model takes it, else the rest of
    its weights given as they are (``tensors`` is then completed in place)."""
    if "partial" in inspect.signature(model.load_hf_state_dict).parameters:
        return {"partial": True}
    for k, t in model.hf_state_dict().items():
        tensors.setdefault(k, t)
    return {}

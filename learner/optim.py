"""AdamW with fp32 master weights and fp32 moments, for training bf16 (or fp16) parameters.

    optimizer = MasterAdamW(policy.parameters(), lr=3e-6, betas=(0.9, 0.999), weight_decay=0.0)

Why: with ``model.dtype=bf16`` the model's parameters are bf16, so the Triton kernels, the varlen attention
and the samplers all see the same bf16 weights. But bf16 keeps 8 significant bits: at 1.0 its spacing is
2^-7 ≈ 0.0078, while an RL step moves a weight by about lr = 2e-6..3e-6 (docs/ARCHITECTURE.md §4). Applied to
the bf16 parameter directly, such an update rounds away and the policy never changes. As mixed-precision
training does, this optimizer keeps per low-precision parameter an fp32 master copy and fp32 moments
(``exp_avg``, ``exp_avg_sq``), applies the AdamW update to the master in fp32, and writes the rounded result
back into the parameter: small updates accumulate in the master until they move the bf16 value.

fp32 (or fp64) parameters are their own master: for them this is exactly ``torch.optim.AdamW`` (its
single-tensor path, decoupled weight decay, the same bias correction), with no extra copy.

Gradients accumulate in fp32. A step's gradient is the sum of its micro-batches' (learner/trainer.py): summed in
a bf16 ``p.grad`` each addition rounds to 8 bits, so many small micro-batch gradients added to a large one vanish
as the small updates would. So for every bf16 parameter on one rank a hook (``register_post_accumulate_grad_hook``)
adds each backward's bf16 grad into an fp32 buffer and frees ``p.grad``; ``step`` and ``clip_grad_norm_`` use the
buffers (``grads()``), ``zero_grad`` drops them. Under FSDP2 (learner/parallel.py) the sharded parameters are fp32
(the master), the forward computes in bf16 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``) and
the reduce-scattered grads are fp32 shards that accumulate in fp32: no hook there (DTensor parameters get none).
Memory for a bf16 parameter on one rank: 2 (param) + 4 (fp32 grad; a bf16 grad lives only until its hook) + 4
(master) + 8 (moments) = 18 bytes; under FSDP2, 4 (fp32 shard) + 4 (grad) + 8 = 16 bytes, sharded.

On CUDA the update runs as torch's multi-tensor ``_foreach_*`` ops over every parameter of a group that shares a device,
a state dtype, a step count and (FSDP2's DTensor shards, learner/parallel.py) a mesh and placements: each op one
dispatch, and on CUDA one fused kernel per chunk of tensors, where a loop over parameters launches ~8 kernels and,
on DTensors, 8 trips through DTensor's dispatch per parameter. ``foreach=False`` is that loop
(``torch.optim.adam._single_tensor_adam``'s ops, one parameter at a time), the CPU's default: there it was faster
(bench/optimizer_step.py: each tensor stays in cache through its 8 ops). Both run the same ops in the same order:
the same bits on the CPU, FSDP2's shards included (tests/test_optim.py); on CUDA torch's single-tensor division by
a scalar multiplies by its reciprocal, which may differ from the multi-tensor kernel's division in the last bit. The master, the moments and the grad of a sharded parameter are DTensors with the
parameter's placements. Checkpoints (docs/ARCHITECTURE.md §6) hold the fp32 state:
``load_state_dict`` keeps it fp32 where ``torch.optim.Optimizer`` would cast it to the bf16 parameter's dtype.
Tests: tests/test_optim.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

# Parameters kept in these dtypes get an fp32 master copy and fp32 moments.
LOW_PRECISION = (torch.bfloat16, torch.float16)


def needs_master(p: Tensor) -> bool:
    """Whether ``p`` is stored in too few bits to take AdamW's small updates itself."""
    return p.dtype in LOW_PRECISION


def is_sharded(p: Tensor) -> bool:
    """A DTensor (FSDP2 shard): its grads are reduced and accumulated by FSDP2 itself."""
    return hasattr(p, "full_tensor")


def _scalar(x: float | Tensor) -> float:
    """A hyperparameter as a Python float (the trainer sets ``group["lr"]`` as a float; a tensor works too)."""
    return x.item() if isinstance(x, Tensor) else float(x)


class MasterAdamW(Optimizer):
    """``torch.optim.AdamW`` whose update of a bf16/fp16 parameter runs on an fp32 master copy.

    State per parameter: ``step`` (a float32 scalar tensor on the CPU, as torch keeps it), ``exp_avg`` and
    ``exp_avg_sq`` (fp32 for low-precision parameters, else the parameter's dtype), and ``master`` (fp32) for
    low-precision parameters only. ``param_groups`` hold the model's own parameters, so the trainer sets
    ``group["lr"]`` as with any optimizer; it clips with ``clip_grad_norm_`` (module function), which for this
    optimizer clips the fp32 accumulators.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 fp32_grads: bool = True, foreach: bool | None = None) -> None:
        """``fp32_grads``: accumulate the grads of low-precision parameters in fp32 (see the module docstring).
        ``foreach``: update many parameters per op (multi-tensor); False: one parameter at a time; None: multi-tensor
        when every parameter is on CUDA, as torch's AdamW (on a CPU the loop was faster: bench/optimizer_step.py)."""
        if not 0.0 <= _scalar(lr):
            raise ValueError(f"invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"invalid epsilon: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        every = [p for group in self.param_groups for p in group["params"]]
        self.foreach = foreach if foreach is not None else bool(every) and all(p.is_cuda for p in every)
        self.fp32_grads: dict[Tensor, Tensor] = {}  # low-precision parameter -> its step's gradient so far, fp32
        if fp32_grads:
            for group in self.param_groups:
                for p in group["params"]:
                    if needs_master(p) and p.requires_grad and not is_sharded(p):
                        p.register_post_accumulate_grad_hook(self._accumulate)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step for every parameter that has a grad (``closure`` as in ``torch.optim``: torch's
        distributed checkpoint helpers call ``step(closure=None)`` to create the state before loading it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            live = [(p, grad) for p in group["params"] if (grad := self.grad(p)) is not None]
            if self.foreach:
                for bucket in self._buckets(live):
                    self._update_many(bucket, group)
            else:
                for p, grad in live:
                    self._update(p, grad, group)
        return loss

    # --- gradients: fp32 accumulators for low-precision parameters -------------------------------------------

    def _accumulate(self, p: Tensor) -> None:
        """After a backward has accumulated into ``p.grad`` (bf16): add it to the fp32 buffer, free it."""
        acc = self.fp32_grads.get(p)
        if acc is None:
            self.fp32_grads[p] = p.grad.float()  # a new fp32 tensor (the bf16 grad is freed below)
        else:
            acc.add_(p.grad)  # fp32 += bf16: the bf16 value widened exactly, the sum rounded to fp32
        p.grad = None

    def grad(self, p: Tensor) -> Tensor | None:
        """The gradient ``step`` applies to ``p``: its fp32 accumulator, else ``p.grad``."""
        acc = self.fp32_grads.get(p)
        return acc if acc is not None else p.grad

    def grads(self) -> list[Tensor]:
        """Every gradient ``step`` would apply (fp32 accumulators and plain grads), in parameter order."""
        return [g for group in self.param_groups for p in group["params"] if (g := self.grad(p)) is not None]

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over ``grads()``: the 2-norm of all of them (returned), and each
        scaled by ``max_norm / norm`` when that is below 1. Without fp32 accumulators (fp32 parameters, FSDP2's
        DTensor shards) it is torch's own on the parameters (under FSDP2 a DTensor: ``.full_tensor()`` it)."""
        if not self.fp32_grads:
            params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        grads = self.grads()
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's rule: no division by a zero norm
        for g in grads:
            g.mul_(coef.to(g.device))
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``Optimizer.zero_grad`` and the fp32 accumulators dropped (their memory freed until the next backward)."""
        super().zero_grad(set_to_none)
        self.fp32_grads.clear()

    def _state(self, p: Tensor) -> dict[str, Any]:
        """The parameter's state, created on first use (a master is also added to a state loaded from a plain
        AdamW checkpoint, which has none)."""
        state = self.state[p]
        if needs_master(p) and "master" not in state:
            state["master"] = p.detach().float()  # a new fp32 tensor (a DTensor shard under FSDP2)
        if "step" not in state:
            like = state.get("master", p).detach()
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(like, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)
        return state

    def _update(self, p: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        """torch.optim.adam._single_tensor_adam (decoupled weight decay, not capturable), on the fp32 master when
        the parameter is low-precision, then the master rounded back into the parameter."""
        if grad.is_sparse:
            raise RuntimeError("MasterAdamW does not support sparse gradients")
        state = self._state(p)
        lr, (beta1, beta2) = _scalar(group["lr"]), group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        master = state.get("master", p)
        grad = grad.float() if master is not p else grad
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]

        state["step"] += 1
        step = state["step"].item()  # a CPU tensor: no device sync
        if weight_decay != 0:
            master.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        master.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
        if master is not p:
            p.copy_(master)  # round to nearest into bf16/fp16

    def _buckets(self, live: list[tuple[Tensor, Tensor]]) -> list[list[tuple[Tensor, Tensor]]]:
        """``(parameter, grad)`` pairs grouped so that one multi-tensor op can take each group: the same device,
        state dtype and step count, and for DTensor shards the same mesh and placements."""
        buckets: dict[tuple, list[tuple[Tensor, Tensor]]] = {}
        for p, grad in live:
            state = self._state(p)
            master = state.get("master", p)
            layout = (p.device_mesh, tuple(p.placements)) if is_sharded(p) else None
            key = (master.device, master.dtype, float(state["step"]), layout)
            buckets.setdefault(key, []).append((p, grad))
        return list(buckets.values())

    def _update_many(self, bucket: list[tuple[Tensor, Tensor]], group: dict[str, Any]) -> None:
        """``_update`` of every parameter in ``bucket`` at once, op by op with ``torch._foreach_*``: the same ops in
        the same order."""
        if any(grad.is_sparse for _, grad in bucket):
            raise RuntimeError("MasterAdamW does not support sparse gradients")
        states = [self._state(p) for p, _ in bucket]
        lr, (beta1, beta2) = _scalar(group["lr"]), group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        masters = [state.get("master", p) for (p, _), state in zip(bucket, states)]
        grads = [grad.float() if master is not p else grad for (p, grad), master in zip(bucket, masters)]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]

        for state in states:
            state["step"] += 1
        step = states[0]["step"].item()  # one count per bucket; a CPU tensor: no device sync
        if weight_decay != 0:
            torch._foreach_mul_(masters, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(masters, exp_avgs, denom, value=-(lr / bias_correction1))
        low = [(p, master) for (p, _), master in zip(bucket, masters) if master is not p]
        if low and is_sharded(low[0][0]):  # DTensor has no sharding rule for _foreach_copy_ (torch 2.13)
            for p, master in low:
                p.copy_(master)
        elif low:  # round to nearest into bf16/fp16
            torch._foreach_copy_([p for p, _ in low], [master for _, master in low])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``Optimizer.load_state_dict``, then every floating state tensor of a low-precision parameter set
        again from ``state_dict`` as fp32 on the parameter's device.

        torch casts floating state to the parameter's dtype (``_process_value_according_to_param_policy``),
        which for a bf16 parameter would round the master and the moments to bf16: the resumed run would then
        differ from the uninterrupted one. The values are taken from ``state_dict`` itself, never from the
        downcast copy, and copied (torch would alias ``step``, which the next step increments in place);
        ``step`` stays where it was saved (the CPU), as torch keeps it."""
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for param_id, p in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(param_id)
            if saved is None or not needs_master(p):
                continue
            for key, value in saved.items():
                if isinstance(value, Tensor) and value.is_floating_point():
                    # copy=True: never share storage with the caller's dict (another optimizer's live state)
                    device = value.device if key == "step" else p.device
                    self.state[p][key] = value.to(device=device, dtype=torch.float32, copy=True)


def clip_grad_norm_(model: torch.nn.Module, optimizer: Optimizer, max_norm: float) -> Tensor:
    """Clip the gradients ``optimizer`` will apply to ``model``'s parameters to 2-norm ``max_norm``; returns the
    norm before clipping. ``MasterAdamW``: its own (the fp32 accumulators); any other optimizer: torch's."""
    if isinstance(optimizer, MasterAdamW):
        return optimizer.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

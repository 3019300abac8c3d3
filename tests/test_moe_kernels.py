"""kernels/moe.py: Triton kernels vs torch reference vs HF Qwen3MoeSparseMoeBlock, values and gradients.

Without CUDA the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py and again here
before the import), fp32, all tiles 16: the shapes below are small but cross tile edges (N, H, I not multiples of
16), and cover top-1/2/4, N=1, one expert taking every token, and experts left empty.
"""

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, i.e. at import

from cascade_rl.kernels import moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and not moe.INTERPRETED,
    reason="no CUDA, and cascade_rl.kernels.moe was imported before TRITON_INTERPRET=1 was set",
)


@dataclass(frozen=True)
class Case:
    n: int
    h: int
    i: int
    e: int
    k: int
    force: str = ""  # "expert0": expert 0 is every token's first choice; "expert0_last_empty": and expert e-1 unused

    def __str__(self) -> str:
        return f"n{self.n}-h{self.h}-i{self.i}-e{self.e}-k{self.k}{'-' + self.force if self.force else ''}"


CASES = [
    Case(24, 40, 24, 4, 1),
    Case(19, 40, 40, 6, 2),
    Case(13, 48, 24, 6, 4),
    Case(1, 40, 24, 4, 2),
    Case(24, 40, 24, 4, 1, "expert0"),  # one expert takes all 24 rows (two blocks), three are empty
    Case(17, 36, 20, 5, 2, "expert0_last_empty"),
]
TOL = dict(rtol=1e-4, atol=1e-5)


def make_inputs(case: Case, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(case.n, case.h, generator=g)
    router = torch.randn(case.e, case.h, generator=g) * (0.1 if case.force else 0.5)
    if case.force:  # x[:, 0] = 1 adds router[:, 0] to every token's logits
        x[:, 0] = 1.0
        router[:, 0] = 0.0
        router[0, 0] = 4.0
        if case.force == "expert0_last_empty":
            router[-1, 0] = -4.0
    gate_up = torch.randn(case.e, 2 * case.i, case.h, generator=g) / case.h**0.5
    down = torch.randn(case.e, case.h, case.i, generator=g) / case.i**0.5
    dy = torch.randn(case.n, case.h, generator=g)
    tensors = [t.to(DEVICE).requires_grad_() for t in (x, router, gate_up, down)]
    return tensors, dy.to(DEVICE)


def run_ours(case: Case, impl: str):
    (x, router, gate_up, down), dy = make_inputs(case)
    y = moe.moe_forward(x, router, gate_up, down, case.k, impl=impl)
    return y.detach(), torch.autograd.grad(y, (x, router, gate_up, down), dy)


def run_hf(case: Case):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=case.h, moe_intermediate_size=case.i, num_experts=case.e, num_experts_per_tok=case.k,
        norm_topk_prob=True, hidden_act="silu",
    )  # fmt: skip
    cfg._experts_implementation = "eager"  # HF's per-expert loop
    block = Qwen3MoeSparseMoeBlock(cfg).to(DEVICE)
    (x, router, gate_up, down), dy = make_inputs(case)
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
    y = block(x[None]).squeeze(0)
    params = (x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)
    return y.detach(), torch.autograd.grad(y, params, dy)


def assert_same(got, want, **tol):
    names = ("y", "dx", "drouter", "dgate_up", "ddown")
    for name, a, b in zip(names, (got[0], *got[1]), (want[0], *want[1])):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}", **(tol or TOL))


# --- routing and layout (torch, fast) -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in CASES if c.force], ids=str)
def test_forced_routing_is_as_intended(case):
    (x, router, _, _), _ = make_inputs(case)
    _, _, ids = moe.route(x, router, case.k)
    assert (ids[:, 0] == 0).all()
    assert set(ids.flatten().tolist()) <= set(range(case.e - 1 if case.force == "expert0_last_empty" else case.e))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_plan_layout(case):
    (x, router, _, _), _ = make_inputs(case)
    _, _, ids = moe.route(x.detach(), router.detach(), case.k)
    bm = 16
    plan = moe.plan_blocks(ids, case.e, bm)
    start = plan.expert_start.tolist()
    counts = torch.bincount(ids.flatten(), minlength=case.e).tolist()
    flat = ids.flatten()
    assert start[0] == 0 and plan.sorted_pair.numel() % bm == 0 and plan.sorted_pair.numel() >= start[-1]
    for e in range(case.e):
        region = plan.sorted_pair[start[e] : start[e + 1]]
        assert (start[e + 1] - start[e]) == -(-counts[e] // bm) * bm  # padded to a multiple of the block
        real = region[region >= 0].long()
        assert real.numel() == counts[e] and (flat[real] == e).all()
        assert (real.diff() > 0).all()  # stable: pairs keep token order inside an expert
        assert (plan.block_expert[start[e] // bm : start[e + 1] // bm] == e).all()
    assert (plan.block_expert[start[-1] // bm :] == -1).all()
    assert (plan.sorted_pair[start[-1] :] == -1).all()
    assert (plan.sorted_pair[plan.pair_row.long()] == torch.arange(flat.numel(), dtype=torch.int32)).all()


# --- torch reference and the blocked algorithm's algebra (torch, fast) -------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=str)
def test_torch_reference_matches_hf(case):
    assert_same(run_ours(case, "torch"), run_hf(case))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_blocked_algorithm_on_torch_stages_matches_reference(case):
    """The autograd Function of the Triton path, run on the kernels' torch twins: checks the backward algebra."""
    (x, router, gate_up, down), dy = make_inputs(case)
    _, w, ids = moe.route(x, router, case.k)
    y = moe.experts_blocked(x, w, ids, gate_up, down, stages=moe.TORCH_STAGES, block_m=16)
    got = y.detach(), torch.autograd.grad(y, (x, router, gate_up, down), dy)
    assert_same(got, run_ours(case, "torch"))


def test_moe_forward_router_logits_and_bad_impl():
    case = CASES[1]
    (x, router, gate_up, down), _ = make_inputs(case)
    y, logits = moe.moe_forward(x, router, gate_up, down, case.k, return_router_logits=True)
    torch.testing.assert_close(logits, x @ router.T)
    with pytest.raises(ValueError, match="unknown moe impl"):
        moe.moe_forward(x, router, gate_up, down, case.k, impl="cuda")


# --- Triton ----------------------------------------------------------------------------------------------------


@needs_triton
def test_each_triton_kernel_matches_its_torch_twin():
    case = Case(21, 40, 24, 5, 2, "expert0_last_empty")  # ragged, one expert empty, nothing a multiple of 16
    (x, router, gate_up, down), dy = make_inputs(case)
    x, gate_up, down = x.detach(), gate_up.detach(), down.detach()
    _, w, ids = moe.route(x, router.detach(), case.k)
    plan = moe.plan_blocks(ids, case.e, moe._blocks(x).m)
    used = int(plan.expert_start[-1])  # rows past the last used block are never written or read
    tri, ref = moe.TRITON_STAGES, moe.TORCH_STAGES

    h, act = tri.gate_up_swiglu(x, gate_up, plan, True)
    h_ref, act_ref = ref.gate_up_swiglu(x, gate_up, plan, True)
    torch.testing.assert_close(h[:used], h_ref[:used], **TOL)
    torch.testing.assert_close(act[:used], act_ref[:used], **TOL)
    assert tri.gate_up_swiglu(x, gate_up, plan, False)[0] is None

    o = tri.grouped_mm(act_ref, down.mT, plan)
    o_ref = ref.grouped_mm(act_ref, down.mT, plan)
    torch.testing.assert_close(o[:used], o_ref[:used], **TOL)
    torch.testing.assert_close(tri.combine(o_ref, w, plan), ref.combine(o_ref, w, plan), **TOL)
    torch.testing.assert_close(tri.combine(o_ref, None, plan), ref.combine(o_ref, None, plan), **TOL)

    d_o, dw = tri.combine_bwd(dy, o_ref, w, plan)
    d_o_ref, dw_ref = ref.combine_bwd(dy, o_ref, w, plan)
    torch.testing.assert_close(d_o[:used], d_o_ref[:used], **TOL)
    torch.testing.assert_close(dw, dw_ref, **TOL)

    dh = tri.grouped_mm_swiglu_bwd(d_o_ref, down, h_ref, plan)
    dh_ref = ref.grouped_mm_swiglu_bwd(d_o_ref, down, h_ref, plan)
    torch.testing.assert_close(dh[:used], dh_ref[:used], **TOL)
    dxp = tri.grouped_mm(dh_ref, gate_up, plan)
    torch.testing.assert_close(dxp[:used], ref.grouped_mm(dh_ref, gate_up, plan)[:used], **TOL)

    d_gate_up = tri.grouped_wgrad(dh_ref, x, plan, case.e, True)
    torch.testing.assert_close(d_gate_up, ref.grouped_wgrad(dh_ref, x, plan, case.e, True), **TOL)
    assert (d_gate_up[-1] == 0).all()  # the empty expert's gradient is written, as zeros
    d_down = tri.grouped_wgrad(d_o_ref, act_ref, plan, case.e, False)
    torch.testing.assert_close(d_down, ref.grouped_wgrad(d_o_ref, act_ref, plan, case.e, False), **TOL)


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_matches_reference_and_hf(case):
    got = run_ours(case, "triton")
    assert_same(got, run_ours(case, "torch"))
    assert_same(got, run_hf(case))


@needs_triton
def test_triton_forward_without_grad():
    case = CASES[2]
    (x, router, gate_up, down), _ = make_inputs(case)
    with torch.no_grad():
        y = moe.moe_forward(x, router, gate_up, down, case.k, impl="triton")
        torch.testing.assert_close(y, moe.moe_forward(x, router, gate_up, down, case.k), **TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton needs a GPU (untested on CPU)")
def test_triton_bf16_on_gpu_close_to_fp32_reference():
    case = Case(1000, 512, 256, 16, 4)
    (x, router, gate_up, down), dy = make_inputs(case)
    want = moe.moe_forward(x, router, gate_up, down, case.k)
    want_grads = torch.autograd.grad(want, (x, gate_up, down), dy)
    bf = [t.detach().bfloat16().requires_grad_() for t in (x, router, gate_up, down)]
    _, w, ids = moe.route(x.detach(), router.detach(), case.k)  # same routing as fp32, so only rounding differs
    y = moe.moe_experts(bf[0], w.bfloat16().requires_grad_(), ids, bf[2], bf[3], impl="triton")
    grads = torch.autograd.grad(y, (bf[0], bf[2], bf[3]), dy.bfloat16())
    for got, ref in zip((y, *grads), (want, *want_grads)):
        rel = (got.float() - ref).norm() / ref.norm()
        assert rel < 2e-2, rel

"""kernels/moe.py and kernels/moe_blocked.py: Triton kernels vs torch reference vs HF Qwen3MoeSparseMoeBlock, values
and gradients.

Without CUDA the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py and again here
before the import), fp32, all tiles 16: the shapes below are small but cross tile edges (N, H, I not multiples of
16), and cover top-1/2/4, N=1, one expert taking every token, and experts left empty. With CUDA every test runs on
the GPU (``DEVICE``): tensors are made on the CPU from seeded generators and moved there, and anything built next
to them is built on their device. Ahead-of-time compilation for sm_90 is tests/test_triton_aot.py.
"""

import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, i.e. at import

from cascade_rl.kernels import moe  # noqa: E402
from cascade_rl.kernels import moe_blocked as blocked  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and not blocked.INTERPRETED,
    reason="no CUDA, and cascade_rl.kernels.moe_triton was imported before TRITON_INTERPRET=1 was set",
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


def make_inputs(case: Case, seed: int = 0, activation: str = "swiglu"):
    """(x, router, gate_up, down) leaves and dy; gate_up [E, 2I, H] for SwiGLU, [E, I, H] (up_proj) for relu2."""
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
    if not moe.GATED[activation]:
        gate_up = gate_up[:, : case.i]
    down = torch.randn(case.e, case.h, case.i, generator=g) / case.i**0.5
    dy = torch.randn(case.n, case.h, generator=g)
    tensors = [t.to(DEVICE).requires_grad_() for t in (x, router, gate_up, down)]
    return tensors, dy.to(DEVICE)


def run_ours(case: Case, impl: str, activation: str = "swiglu"):
    (x, router, gate_up, down), dy = make_inputs(case, activation=activation)
    y = moe.moe_forward(x, router, gate_up, down, case.k, impl=impl, activation=activation)
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
    _, _, ids = moe.route(x, router, moe.Routing(case.k))
    assert (ids[:, 0] == 0).all()
    assert set(ids.flatten().tolist()) <= set(range(case.e - 1 if case.force == "expert0_last_empty" else case.e))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_plan_layout(case):
    (x, router, _, _), _ = make_inputs(case)
    _, _, ids = moe.route(x.detach(), router.detach(), moe.Routing(case.k))
    bm = 16
    plan = blocked.plan_blocks(ids, case.e, bm)
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
    pairs = torch.arange(flat.numel(), dtype=torch.int32, device=plan.sorted_pair.device)
    assert (plan.sorted_pair[plan.pair_row.long()] == pairs).all()


def test_plan_has_no_data_dependent_shape():
    """On the meta device tensors have shapes and no values: a host sync (``.item()``, ``bincount``'s output size,
    ``nonzero``) raises there, so this is a CPU check that the plan costs no device sync on a GPU."""
    ids = torch.empty(50, 6, dtype=torch.long, device="meta")
    plan = blocked.plan_blocks(ids, 128, 64)
    assert plan.sorted_pair.device.type == "meta" and plan.sorted_pair.numel() % 64 == 0
    assert plan.block_expert.numel() == plan.sorted_pair.numel() // 64 and plan.expert_start.numel() == 129


def test_expert_counts_match_bincount():
    ids = torch.randint(0, 7, (300,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    ids[ids == 3] = 4  # an empty expert
    counts = moe.expert_counts(ids.sort().values, 9)  # and two experts past the largest id
    assert torch.equal(counts, torch.bincount(ids, minlength=9))


def test_launch_blocks_is_the_launchers_tile_choice():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        gpu = blocked.launch_blocks(dtype, interpreted=False)
        assert gpu.m % gpu.k == 0  # grouped_wgrad steps through a layout block in K tiles
        assert blocked.launch_blocks(dtype, interpreted=True) == blocked.INTERPRETER_BLOCKS
    assert blocked.launch_blocks(torch.float32, interpreted=False) == blocked.CUDA_BLOCKS[32]
    assert blocked.launch_blocks(torch.bfloat16, interpreted=False) == blocked.CUDA_BLOCKS[16]
    x = torch.zeros(2, 2, device=DEVICE)
    assert blocked._blocks(x) == blocked.launch_blocks(torch.float32, interpreted=blocked.INTERPRETED)
    with pytest.raises(TypeError, match="float64"):
        blocked.launch_blocks(torch.float64, interpreted=False)


# --- torch reference and the blocked algorithm's algebra (torch, fast) -------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=str)
def test_torch_reference_matches_hf(case):
    assert_same(run_ours(case, "torch"), run_hf(case))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_blocked_algorithm_on_torch_stages_matches_reference(case):
    """The autograd Function of the Triton path, run on the kernels' torch twins: checks the backward algebra."""
    (x, router, gate_up, down), dy = make_inputs(case)
    _, w, ids = moe.route(x, router, moe.Routing(case.k))
    y = blocked.experts_blocked(x, w, ids, gate_up, down, stages=blocked.TORCH_STAGES, block_m=16)
    got = y.detach(), torch.autograd.grad(y, (x, router, gate_up, down), dy)
    assert_same(got, run_ours(case, "torch"))


def test_moe_forward_router_logits_and_bad_impl():
    case = CASES[1]
    (x, router, gate_up, down), _ = make_inputs(case)
    y, logits = moe.moe_forward(x, router, gate_up, down, case.k, return_router_logits=True)
    torch.testing.assert_close(logits, x @ router.T)
    with pytest.raises(ValueError, match="unknown moe impl"):
        moe.moe_forward(x, router, gate_up, down, case.k, impl="cuda")


# --- routing: the router families (kernels/moe.py ROUTERS) ----------------------------------------------------------


@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_topk_is_hfs_routing_and_weighs_its_own_choice_alike(normalize):
    """select (top-k logits, then their softmax) is HF's softmax-top-k-renormalise to rounding; ``weigh`` (the
    routing replay's weights, HF's formula) gives the same weights for the experts select chose."""
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    routing = moe.Routing(3, normalize)
    weights, ids = moe.select_experts(logits, routing)
    probs, want_ids = torch.softmax(logits, -1).topk(3, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True) if normalize else probs)
    torch.testing.assert_close(moe.ROUTERS["softmax_topk"].weigh(logits, ids, routing), weights)
    with pytest.raises(ValueError, match="unknown router"):
        moe.select_experts(logits, moe.Routing(3, router="sigmoid"))


def test_the_moe_block_does_not_import_triton():
    """The engine's and the trainer's torch experts load without triton; only impl='triton' imports it."""
    import subprocess
    import sys

    code = "import sys, cascade_rl.kernels.moe, cascade_rl.samplers.torch_model; print('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


# --- the default experts path (transformers' grouped_mm with our gathers) -------------------------------------------


def _experts_grouped_index_add(x, topk_weights, topk_ids, gate_up, down):
    """experts_grouped as it was: k outputs combined by an ``index_add`` in x's dtype (atomics on CUDA)."""
    from transformers.integrations.moe import _grouped_mm

    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    offsets = torch.bincount(flat, minlength=gate_up.shape[0]).cumsum(0).to(torch.int32)
    gate, up = _grouped_mm(x.index_select(0, token), gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    out = _grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)
    out = out * topk_weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(out.dtype)
    return x.new_zeros(x.shape).index_add(0, token, out.to(x.dtype))


@pytest.mark.parametrize("impl", ["grouped", "dense"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_grouped_and_dense_match_reference(case, impl):
    assert_same(run_ours(case, impl), run_ours(case, "torch"))


def _relu2_loop(x, topk_weights, topk_ids, up, down):
    """Squared-ReLU experts as HF NemotronHExperts computes them: a loop over (token, slot), fp32 weights."""
    y = torch.zeros(x.shape, dtype=topk_weights.dtype, device=x.device)
    for n in range(x.shape[0]):
        for k, e in enumerate(topk_ids[n].tolist()):
            y[n] += topk_weights[n, k] * (down[e] @ F.relu(up[e] @ x[n]) ** 2)
    return y.to(x.dtype)


@pytest.mark.parametrize("case", CASES[:4], ids=str)
def test_relu2_reference_matches_a_per_token_loop(case):
    (x, router, up, down), dy = make_inputs(case, activation="relu2")
    y = moe.moe_forward(x, router, up, down, case.k, activation="relu2")
    _, w, ids = moe.route(x, router, moe.Routing(case.k))
    want = _relu2_loop(x, w, ids, up, down)
    params = (x, router, up, down)
    got = y.detach(), torch.autograd.grad(y, params, dy)
    assert_same(got, (want.detach(), torch.autograd.grad(want, params, dy)))


@pytest.mark.parametrize("impl", ["grouped", "dense", "blocked"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_relu2_impls_match_reference(case, impl):
    """Squared-ReLU experts (not gated, gate_up = up_proj [E, I, H]): grouped, dense and the blocked algorithm on
    the kernels' torch twins against the torch reference, values and gradients."""
    if impl != "blocked":
        got = run_ours(case, impl, "relu2")
    else:
        (x, router, up, down), dy = make_inputs(case, activation="relu2")
        _, w, ids = moe.route(x, router, moe.Routing(case.k))
        y = blocked.experts_blocked(x, w, ids, up, down, stages=blocked.TORCH_STAGES, block_m=16, activation="relu2")
        got = y.detach(), torch.autograd.grad(y, (x, router, up, down), dy)
    assert_same(got, run_ours(case, "torch", "relu2"))


@pytest.mark.parametrize("impl", ["grouped", "dense", "torch"])
def test_experts_take_fp32_weights_with_bf16_tensors(impl):
    """The sigmoid routers' weights stay fp32 (HF's); the experts then return x's dtype, as HF's do."""
    case = CASES[1]
    (x, router, up, down), _ = make_inputs(case, activation="relu2")
    routing = moe.Routing(case.k, router="sigmoid_group_topk", n_group=2, topk_group=1, scaling=2.5)
    _, w, ids = moe.route(x.detach().bfloat16(), router.detach(), routing)
    assert w.dtype == torch.float32
    bf = [t.detach().bfloat16() for t in (x, up, down)]
    y = moe.moe_experts(bf[0], w, ids, bf[1], bf[2], impl, "relu2")
    want = moe.moe_experts(*(t.float() for t in (bf[0], w)), ids, *(t.float() for t in bf[1:]), "torch", "relu2")
    assert y.dtype == torch.bfloat16
    assert ((y.float() - want).norm() / want.norm()) < 2e-2


def test_grouped_bf16_combines_in_fp32_deterministically():
    """bf16: closer to the fp32 result on the same (bf16-rounded) numbers than the old ``index_add`` in bf16,
    and the same bits on a second run (forward and gradients)."""
    case = Case(512, 256, 128, 16, 6)
    (x, router, gate_up, down), dy = make_inputs(case)
    _, w, ids = moe.route(x.detach(), router.detach(), moe.Routing(case.k))
    bf = [t.detach().bfloat16() for t in (x, w, gate_up, down)]
    want = moe.experts_grouped(bf[0].float(), bf[1].float(), ids, bf[2].float(), bf[3].float())

    def err(y):
        return ((y.float() - want).norm() / want.norm()).item()

    new, old = err(moe.experts_grouped(bf[0], bf[1], ids, bf[2], bf[3])), err(_experts_grouped_index_add(*bf[:2], ids, *bf[2:]))
    assert new < old, (new, old)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in bf]
        y = moe.experts_grouped(leaves[0], leaves[1], ids, leaves[2], leaves[3])
        runs.append((y.detach(), *torch.autograd.grad(y, leaves, dy.bfloat16())))
    for name, a, b in zip(("y", "dx", "dweights", "dgate_up", "ddown"), *runs, strict=True):
        assert torch.equal(a, b), f"{name}: a second run gave other bits (max |Δ| {(a - b).abs().max().item():.3g})"


# Autograd nodes that accumulate through an index (index_add, index_put_(accumulate), scatter_add, forward or
# backward): atomic adds on CUDA, in an arbitrary order, so other bits on another run where an index repeats.
ACCUMULATING_NODES = {"IndexSelectBackward0", "IndexBackward0", "GatherBackward0", "EmbeddingBackward0",
                      "IndexAddBackward0", "ScatterAddBackward0", "IndexPutBackward0"}


def test_grouped_graph_has_no_accumulating_index_op():
    """Determinism by construction, checked on CPU (where index_add is sequential and hides the GPU's failure):
    no node of the grouped experts' autograd graph scatters with atomics."""
    (x, router, gate_up, down), _ = make_inputs(CASES[2])
    _, w, ids = moe.route(x.detach(), router.detach(), moe.Routing(CASES[2].k))
    seen, todo = set(), [moe.experts_grouped(x, w.requires_grad_(), ids, gate_up, down).grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(fn for fn, _ in node.next_functions)
    names = {type(node).__name__ for node in seen}
    assert "_TokenRowsBackward" in names and not names & ACCUMULATING_NODES, sorted(names)


def test_grouped_without_tokens():
    case = Case(0, 40, 24, 4, 2)
    (x, router, gate_up, down), _ = make_inputs(case)
    y = moe.moe_forward(x, router, gate_up, down, case.k, impl="grouped")
    assert y.shape == (0, case.h)


def test_grouped_has_no_data_dependent_shape():
    """The meta device (see test_plan_has_no_data_dependent_shape): no sync in our part of the grouped path."""
    n, h, i, e, k = 40, 64, 32, 8, 2
    meta = dict(device="meta", dtype=torch.bfloat16, requires_grad=True)
    x, w = torch.empty(n, h, **meta), torch.empty(n, k, **meta)
    gate_up, down = torch.empty(e, 2 * i, h, **meta), torch.empty(e, h, i, **meta)
    y = moe.experts_grouped(x, w, torch.empty(n, k, dtype=torch.long, device="meta"), gate_up, down)
    grads = torch.autograd.grad(y, (x, w, gate_up, down), torch.empty_like(y))
    assert y.shape == (n, h) and [g.shape for g in grads] == [t.shape for t in (x, w, gate_up, down)]


# --- Triton ----------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_each_triton_kernel_matches_its_torch_twin(activation):
    case = Case(21, 40, 24, 5, 2, "expert0_last_empty")  # ragged, one expert empty, nothing a multiple of 16
    (x, router, gate_up, down), dy = make_inputs(case, activation=activation)
    x, gate_up, down = x.detach(), gate_up.detach(), down.detach()
    _, w, ids = moe.route(x, router.detach(), moe.Routing(case.k))
    plan = blocked.plan_blocks(ids, case.e, blocked._blocks(x).m)
    used = int(plan.expert_start[-1])  # rows past the last used block are never written or read
    tri, ref = blocked.TRITON_STAGES, blocked.TORCH_STAGES

    h, act = tri.gate_up_act(x, gate_up, plan, True, activation)
    h_ref, act_ref = ref.gate_up_act(x, gate_up, plan, True, activation)
    assert h.shape == h_ref.shape == (plan.sorted_pair.numel(), gate_up.shape[1]) and act.shape[1] == case.i
    torch.testing.assert_close(h[:used], h_ref[:used], **TOL)
    torch.testing.assert_close(act[:used], act_ref[:used], **TOL)
    assert tri.gate_up_act(x, gate_up, plan, False, activation)[0] is None

    o = tri.grouped_mm(act_ref, down.mT, plan)
    o_ref = ref.grouped_mm(act_ref, down.mT, plan)
    torch.testing.assert_close(o[:used], o_ref[:used], **TOL)
    torch.testing.assert_close(tri.combine(o_ref, w, plan), ref.combine(o_ref, w, plan), **TOL)
    torch.testing.assert_close(tri.combine(o_ref, None, plan), ref.combine(o_ref, None, plan), **TOL)

    d_o, dw = tri.combine_bwd(dy, o_ref, w, plan)
    d_o_ref, dw_ref = ref.combine_bwd(dy, o_ref, w, plan)
    torch.testing.assert_close(d_o[:used], d_o_ref[:used], **TOL)
    torch.testing.assert_close(dw, dw_ref, **TOL)

    dh = tri.grouped_mm_act_bwd(d_o_ref, down, h_ref, plan, activation)
    dh_ref = ref.grouped_mm_act_bwd(d_o_ref, down, h_ref, plan, activation)
    assert dh.shape == h_ref.shape
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
@pytest.mark.parametrize("case", CASES[1:3] + CASES[5:], ids=str)
def test_triton_relu2_matches_reference(case):
    assert_same(run_ours(case, "triton", "relu2"), run_ours(case, "torch", "relu2"))


@needs_triton
def test_triton_forward_without_grad():
    case = CASES[2]
    (x, router, gate_up, down), _ = make_inputs(case)
    with torch.no_grad():
        y = moe.moe_forward(x, router, gate_up, down, case.k, impl="triton")
        torch.testing.assert_close(y, moe.moe_forward(x, router, gate_up, down, case.k), **TOL)


@pytest.mark.parametrize("stages", ["triton", "torch_twins"])
def test_blocked_bf16_close_to_fp32_reference(stages):
    """bf16 blocked experts (the Triton kernels on a GPU; their torch twins anywhere, which checks this test's own
    reference on CPU) against the fp32 torch experts on the same routing, the weights a leaf of both: values and
    every gradient within bf16 rounding. (The reference was once the whole MoE block: its dx then held the
    router's path too, x -> logits -> weights, which the experts alone never see: 0.86 relative error on an H200.)
    The interpreter's bf16 ``tl.dot`` is wrong (triton 3.9: relative error 4e9 on one 16x16 tile), so the
    kernels' bf16 run needs CUDA; ``test_each_triton_kernel_matches_its_torch_twin`` covers them in fp32."""
    if stages == "triton" and not torch.cuda.is_available():
        pytest.skip("bf16 Triton needs a GPU (Triton's interpreter gets bf16 tl.dot wrong)")
    case = Case(1000, 512, 256, 16, 4)  # several M, N and K tiles per expert at the CUDA tiles
    (x, router, gate_up, down), dy = make_inputs(case)
    _, w, ids = moe.route(x.detach(), router.detach(), moe.Routing(case.k))  # fp32 routing: only rounding differs
    leaves = [x, w.detach().requires_grad_(), gate_up, down]
    want = moe.moe_experts(leaves[0], leaves[1], ids, leaves[2], leaves[3])
    want_grads = torch.autograd.grad(want, leaves, dy)
    bf = [t.detach().bfloat16().requires_grad_() for t in leaves]
    if stages == "triton":
        y = moe.moe_experts(bf[0], bf[1], ids, bf[2], bf[3], impl="triton")
    else:
        y = blocked.experts_blocked(bf[0], bf[1], ids, bf[2], bf[3], stages=blocked.TORCH_STAGES, block_m=64)
    grads = torch.autograd.grad(y, bf, dy.bfloat16())
    assert y.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    for name, got, ref in zip(("y", "dx", "dweights", "dgate_up", "ddown"), (y, *grads), (want, *want_grads)):
        rel = ((got.float() - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, f"{name}: relative error {rel:.4g}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device syncs exist only with a device")
@pytest.mark.parametrize("impl", ["grouped", "triton"])
def test_bf16_forward_and_backward_never_sync_the_gpu(impl):
    """bf16 on CUDA: routing, the plan, the kernels and autograd run without a host sync (torch raises on one).
    fp32 grouped is exempt: torch's grouped_mm fallback for fp32 copies the offsets to the host."""
    case = Case(256, 128, 64, 8, 2)
    (x, router, gate_up, down), dy = make_inputs(case)
    leaves = [t.detach().bfloat16().requires_grad_() for t in (x, router, gate_up, down)]
    moe.moe_forward(*leaves, case.k, impl=impl)  # compile / warm up outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = moe.moe_forward(*leaves, case.k, impl=impl)
        torch.autograd.grad(y, leaves, dy.bfloat16())
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_triton_fuses_every_activation_and_refuses_others():
    """Every kernels/moe.py activation has its Triton epilogue (fused, gated as ``GATED`` says); one without is
    refused by the kernels and their twins alike, never run by a silent fallback."""
    assert set(blocked.FUSED_ACTIVATIONS) == set(moe.ACTIVATIONS)
    case = CASES[1]
    (x, router, gate_up, down), _ = make_inputs(case)
    _, w, ids = moe.route(x.detach(), router.detach(), moe.Routing(case.k))
    with pytest.raises(NotImplementedError, match="gelu"):
        blocked.experts_triton(x, w, ids, gate_up, down, "gelu")
    with pytest.raises(NotImplementedError, match="gelu"):
        blocked.experts_blocked(x, w, ids, gate_up, down, stages=blocked.TORCH_STAGES, activation="gelu")
    with pytest.raises(ValueError, match="unknown expert activation"):
        moe.moe_experts(x, w, ids, gate_up, down, impl="grouped", activation="gelu")


@needs_triton
def test_triton_refuses_tensors_on_two_devices():
    case = CASES[1]
    (x, router, gate_up, down), _ = make_inputs(case)
    _, w, ids = moe.route(x.detach(), router.detach(), moe.Routing(case.k))
    with pytest.raises(ValueError, match="one device"):
        moe.experts_triton(x.detach(), w, ids, gate_up.detach().to("meta"), down.detach())

"""Every Triton kernel of kernels/ compiled ahead of time for sm_90 (H100/H200), on a machine without a GPU.

The interpreter runs the kernels' arithmetic but not the compiler: unsupported ops, layouts, shared memory and
registers only show when a kernel is compiled for a real target. This test compiles exactly what a GPU would launch:
a subprocess (without ``TRITON_INTERPRET``, so the kernels are JIT functions) replaces each kernel by a recorder,
runs the real launchers, forward and backward, on meta tensors (shapes and dtypes, no memory) of realistic models,
and hands every recorded launch to Triton's own argument specialisation (what ``kernel[grid](...)`` does: pointer
alignment, integers equal to 1 or divisible by 16) and to ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``.
The tiles are the launchers' (``kernels.moe_triton.launch_blocks``, ``kernels.logprob._tiles``).

Printed per compiled kernel: shared memory (asserted within an sm_90 block's 227 KB), registers per thread and
the spill stack (``cuobjdump``). Spills depend on the Triton version (the compiler's register allocation moves
between releases), so they are only bounded here, not required to be zero; they cost speed, not correctness.

    .venv/bin/pytest -q -s tests/test_triton_aot.py           # ~1-2 minutes on 2 cores
    .venv/bin/python tests/test_triton_aot.py                # the subprocess alone: one JSON line per kernel
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SM90_SHARED_LIMIT = 232448  # bytes: the opt-in maximum of one thread block on sm_90 (227 KB)
SPILL_BOUND = 64  # bytes of spill stack per thread; 0 for every kernel with triton 3.6.0, 3.7.1 and 3.9.0
H200_SMS = 132

# name -> (hidden, expert hidden, experts, top-k); 8,192 tokens per micro-batch.
MOE_SHAPES = {
    "nemotron3-nano-like": (2688, 1856, 128, 6),
    "qwen3-30b-a3b-like": (2048, 768, 128, 8),
}
# name -> the expert activations compiled at that shape: Nano's own squared ReLU (no gate: up [E, I, H]), and SwiGLU
# (gate | up [E, 2I, H]) at both
MOE_ACTIVATIONS = {"nemotron3-nano-like": ("relu2", "swiglu"), "qwen3-30b-a3b-like": ("swiglu",)}
GATED = {"swiglu": 2, "relu2": 1}  # rows of the first projection per expert unit
# name -> (hidden, vocabulary)
LM_HEADS = {"nemotron3-nano-like": (2688, 131072), "qwen3-30b-a3b-like": (2048, 151936)}
TOKENS = 8192
DTYPES = ("bfloat16", "float32")


# --- the subprocess -------------------------------------------------------------------------------------------


def _record(module, launches: list) -> None:
    """Replace every ``*_kernel`` JIT function of ``module`` by a recorder of ``kernel[grid](*args, **kwargs)``."""
    from triton.runtime.jit import JITFunction

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.fn, args, kwargs))

    for name, obj in list(vars(module).items()):
        if isinstance(obj, JITFunction) and name.endswith("_kernel"):
            setattr(module, name, Recorder(obj))


def _moe_launches(launches: list) -> None:
    import torch

    from cascade_rl.kernels import moe_blocked

    for (label, (hidden, inter, experts, top_k)) in MOE_SHAPES.items():
        for act in MOE_ACTIVATIONS[label]:
            for dtype in DTYPES:
                meta = dict(device="meta", dtype=getattr(torch, dtype), requires_grad=True)
                x, w = torch.empty(TOKENS, hidden, **meta), torch.empty(TOKENS, top_k, **meta)
                gate_up = torch.empty(experts, GATED[act] * inter, hidden, **meta)
                down = torch.empty(experts, hidden, inter, **meta)
                ids = torch.empty(TOKENS, top_k, dtype=torch.long, device="meta")
                start = len(launches)
                # the training step: h saved, then every backward; then inference: h not saved
                y = moe_blocked.experts_blocked(x, w, ids, gate_up, down, activation=act)
                torch.autograd.grad(y, (x, w, gate_up, down), torch.empty_like(y))
                with torch.no_grad():
                    moe_blocked.experts_blocked(x, w, ids, gate_up, down, activation=act)
                launches[start:] = [(*launch, f"{label} {act} {dtype}") for launch in launches[start:]]


def _logprob_launches(launches: list) -> None:
    import torch

    from cascade_rl.kernels import logprob

    logprob._target_programs = lambda device: 2 * H200_SMS  # the meta device has no SM count; an H200's
    for (label, (hidden, vocab)) in LM_HEADS.items():
        for dtype in DTYPES:
            for entropy in (False, True):
                meta = dict(device="meta", dtype=getattr(torch, dtype), requires_grad=True)
                h, w = torch.empty(TOKENS, hidden, **meta), torch.empty(vocab, hidden, **meta)
                y = torch.empty(TOKENS, dtype=torch.long, device="meta")
                start = len(launches)
                lp, ent = logprob._LinearLogprobsTriton.apply(h, w, y, 1.0, entropy)
                loss = lp.sum() + (ent.sum() if entropy else 0)
                torch.autograd.grad(loss, (h, w))
                launches[start:] = [(*launch, f"{label} {dtype}") for launch in launches[start:]]


def _resources(cubin: bytes) -> dict:
    import tempfile

    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    line = next(ln for ln in usage.splitlines() if "REG:" in ln)
    fields = dict(kv.split(":", 1) for kv in line.split() if ":" in kv)
    return {"regs": int(fields["REG"]), "spill_stack": int(fields["STACK"]), "local": int(fields.get("LOCAL", 0))}


def compile_all() -> list[dict]:
    """Record every launch of both modules' launchers, compile each distinct specialisation for sm_90."""
    import warnings

    warnings.filterwarnings("ignore")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from cascade_rl.kernels import logprob, moe_triton

    assert not (moe_triton.INTERPRETED or logprob.INTERPRETED), "run without TRITON_INTERPRET"
    launches: list = []
    _record(moe_triton, launches)
    _record(logprob, launches)
    _moe_launches(launches)
    _logprob_launches(launches)

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    compiled: dict = {}
    for fn, args, kwargs, where in launches:
        # As JITFunction.run does before it compiles: bind, specialise, pack (triton 3.6 - 3.9).
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        key = (fn.__name__, str(specialization), str(options))
        if key in compiled:
            compiled[key]["shapes"].append(where)
            continue
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
        names = list(signature)
        consts = {names[path[0]]: value for path, value in constexprs.items()
                  if names[path[0]].isupper() and not names[path[0]].startswith("stride")}
        compiled[key] = {"kernel": fn.__name__, "module": fn.__module__.rsplit(".", 1)[-1],
                         "dtype": where.split()[-1], "constexprs": consts, "num_warps": options.num_warps,
                         "num_stages": options.num_stages, "shared": kernel.metadata.shared,
                         **_resources(kernel.asm["cubin"]), "shapes": [where]}
    return [dict(entry, triton=triton.__version__) for entry in compiled.values()]


# --- the test --------------------------------------------------------------------------------------------------


def _kernel_names() -> set[str]:
    """Every ``*_kernel`` of the two modules, read from their source (importing them here would interpret them)."""
    root = Path(__file__).resolve().parents[1] / "kernels"
    names = set()
    for module in ("moe_triton.py", "logprob.py"):
        lines = (root / module).read_text().splitlines()
        names |= {ln.split("(")[0].removeprefix("def ") for prev, ln in zip(lines, lines[1:])
                  if prev.startswith("@triton.jit") and ln.startswith("def ") and ln.split("(")[0].endswith("_kernel")}
    return names


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_within_its_shared_memory():
    triton = pytest.importorskip("triton")
    nvidia_bin = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (nvidia_bin / "ptxas").exists() or not (nvidia_bin / "cuobjdump").exists():
        pytest.skip("this triton has no bundled ptxas/cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    kernels = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    print(f"\ntriton {kernels[0]['triton']}, sm_90; shared memory in bytes, registers per thread, spill stack")
    for k in kernels:
        print(f"{k['module']:>10} {k['kernel']:<28} {k['dtype']:<8} {k['num_warps']}w/{k['num_stages']}s "
              f"shared {k['shared']:>6}  regs {k['regs']:>3}  spill {k['spill_stack']:>4}  {k['constexprs']}")
    assert {k["kernel"] for k in kernels} == _kernel_names()  # every kernel, at least once
    fused = {(k["kernel"], k["constexprs"].get("ACT", k["constexprs"].get("ACT_BWD"))) for k in kernels}
    for act in ("swiglu", "relu2"):  # each fused activation, forward and backward
        assert {("_gate_up_act_kernel", act), ("_grouped_mm_kernel", act)} <= fused, (act, sorted(map(str, fused)))
    for k in kernels:
        assert k["shared"] <= SM90_SHARED_LIMIT, k
        assert k["spill_stack"] <= SPILL_BOUND, k


if __name__ == "__main__":
    for entry in compile_all():
        print(json.dumps(entry))

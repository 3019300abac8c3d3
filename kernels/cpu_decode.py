"""C++ CPU kernels of the torch engine's decode step (kernels/cpu_decode.cpp), built on first use.

    from cascade_rl.kernels import cpu_decode
    if cpu_decode.available():
        y = cpu_decode.moe_forward(x, router, w13, w2, top_k, normalize)          # [N, H]
        o = cpu_decode.attend_decode(qkv, qk_norm, cos, sin, k_cache, v_cache, positions, heads, eps)

Built with torch's ``cpp_extension`` (g++ and ninja) into the environment's own folder
(``<sys.prefix>/torch_extensions``; ``TORCH_EXTENSIONS_DIR`` where it is set), in a subfolder named by
the source's hash (``build_dir``): the first build takes about half a minute, later processes load the
built library. Not the user-wide ``~/.cache/torch_extensions``, and not one folder for every source: two
checkouts on one machine would rebuild it in turn, each build minutes on a busy machine, and samplers
starting meanwhile wait on its lock. A builder killed midway leaves torch's lock file behind; the build
holds a kernel lock too, and clears the stale file under it (``_build``). The
ops register under ``torch.ops.cascade_rl_cpu``. fp32 only; the engine keeps
its torch path for other dtypes and devices, and when no compiler is present
(``available()`` is False and ``build_error()`` says why).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
log = logging.getLogger(__name__)
_NO_ROUTES = torch.empty(0, dtype=torch.long)  # the ops' "no routes wanted"


FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


def build_dir() -> Path:
    """Where the library is built: named by what goes into it (the source, torch's version, the flags), so checkouts
    with the same source share one build and different ones never rebuild each other's."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(FLAGS).encode()).hexdigest()
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")
    return root / f"cascade_rl_cpu_decode_{key[:12]}"


@functools.cache
def _build() -> str | None:
    """Build and load the library once per process; the error text if that fails. Builds are serialised by an
    advisory lock the kernel drops when its holder dies: torch's own lock is a file that a builder killed midway
    (a SIGKILL, the OOM killer) leaves behind, and every process after it would wait on that file forever."""
    from torch.utils.cpp_extension import load

    where = build_dir()
    try:
        where.mkdir(parents=True, exist_ok=True)
        with open(where / ".build.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (where / "lock").unlink(missing_ok=True)  # torch's baton: no live builder holds it while we hold ours
            load(name=where.name, sources=[str(SOURCE)], is_python_module=False, build_directory=str(where),
                 extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a build failure: the torch path still works
        log.warning("C++ CPU decode kernels unavailable (%s); the torch engine uses its torch ops", e)
        return f"{type(e).__name__}: {e}"
    return None


def available() -> bool:
    return _build() is None


def build_error() -> str | None:
    return _build()


def rms_norm(x, weight, eps: float):
    _build()
    return torch.ops.cascade_rl_cpu.rms_norm(x, weight, eps)


def moe_forward(x, router, w13, w2, top_k: int, normalize: bool, routes=None):
    """``routes``: an int64 [N, top_k] tensor the op fills with each token's experts (None: not wanted)."""
    _build()
    return torch.ops.cascade_rl_cpu.moe_forward(x, router, w13, w2, top_k, normalize,
                                                _NO_ROUTES if routes is None else routes)


def attend_decode(qkv, qk_norm, cos, sin, k_cache, v_cache, positions, heads: int, eps: float):
    _build()
    return torch.ops.cascade_rl_cpu.attend_decode(qkv, qk_norm, cos, sin, k_cache, v_cache, positions, heads, eps)


def decode_forward(tokens, positions, weights, rope_cos, rope_sin, k_cache, v_cache, heads: int, top_k: int,
                   normalize: bool, eps: float, routes=None):
    """``routes``: an int64 [layers, B, top_k] tensor the op fills with the experts of each MoE layer (dense
    layers' rows are left as they are; None: not wanted)."""
    _build()
    return torch.ops.cascade_rl_cpu.decode_forward(tokens, positions, weights, rope_cos, rope_sin, k_cache, v_cache,
                                                   heads, top_k, normalize, eps,
                                                   _NO_ROUTES if routes is None else routes)

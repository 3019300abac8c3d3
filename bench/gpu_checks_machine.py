"""What the GPU machine is, and the facts about it that can break a launch without saying so.

    python3 bench/gpu_checks_machine.py OUT.json      # bench/gpu_checks.sh's `machine` part

Writes one JSON object: Python, torch, CUDA, Triton and the driver; the GPU; the packages a launch imports;
and three answers only that machine can give:

- ``dev_shm``: the size of /dev/shm. The shm weight transport and torch's CPU tensor IPC live there; a
  container's default 64 MiB tmpfs breaks both (``dev_shm.too_small`` is set under 1 GiB).
- ``compute_mode``: nvidia-smi's. ``Exclusive_Process`` lets one process hold the GPU, so trainer, sampler and
  teacher cannot share it (``launch_tiny`` would fail at the second CUDA context).
- ``cuda_ipc``: whether one process can map another's CUDA memory (the ``cuda_ipc`` weight transport). A real
  probe: a parent puts a CUDA tensor on a torch.multiprocessing queue (a cudaIpcMemHandle underneath), a
  spawned child maps it, reads it and writes into it, and the parent sees the write. Bounded by
  ``--ipc-timeout``; without CUDA it records "no cuda".

The file is written first without the probe, then again with it, so a probe that hangs past the part's cap
still leaves the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHM_MIN_BYTES = 1 << 30  # below this the 1B-parameter weight transport check cannot fit in /dev/shm


def write(path: Path, info: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))  # one line: gpu_checks.sh greps it for "cuda_available": true
    os.replace(tmp, path)


def dev_shm() -> dict:
    try:
        st = os.statvfs("/dev/shm")
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    return {"size_bytes": size, "free_bytes": free, "size_gib": round(size / 2**30, 2),
            "too_small": size < SHM_MIN_BYTES}


def nvidia_smi() -> dict:
    """Driver version, compute mode, name and memory, from nvidia-smi (NVML through nvidia-ml-py otherwise)."""
    fields = ["name", "driver_version", "compute_mode", "memory.total", "mig.mode.current"]
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            out = subprocess.run([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            if out.returncode == 0 and out.stdout.strip():
                values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
                return dict(zip(fields, values))
            return {"error": f"nvidia-smi exit {out.returncode}: {(out.stderr or out.stdout).strip()[-300:]}"}
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"error": f"nvidia-smi: {type(e).__name__}: {e}"}
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        modes = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
        return {"driver_version": pynvml.nvmlSystemGetDriverVersion(),
                "compute_mode": modes.get(pynvml.nvmlDeviceGetComputeMode(h), "unknown"), "source": "nvml"}
    except Exception as e:  # no NVIDIA driver here (a CPU rehearsal)
        return {"error": f"no nvidia-smi, and NVML: {type(e).__name__}: {e}"}


def dist_version(module: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(module.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return "importable"


def versions() -> dict:
    info: dict = {"python": platform.python_version(), "executable": sys.executable, "cpus": os.cpu_count()}
    try:
        import torch

        info |= {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info |= {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1),
                     "capability": f"{p.major}.{p.minor}", "gpus": torch.cuda.device_count()}
    except Exception as e:
        info["torch_error"] = f"{type(e).__name__}: {e}"
    for name in ("triton", "transformers", "tokenizers", "numpy", "zmq", "pytest_timeout", "vllm",
                 "cascade_rl.supervisor.cli"):
        if name == "vllm":  # importing vllm takes seconds: only whether it is there
            import importlib.util

            info[name] = "installed" if importlib.util.find_spec(name) else "missing"
            continue
        try:
            module = __import__(name, fromlist=["_"])
            info[name] = getattr(module, "__version__", None) or dist_version(name)
        except Exception as e:
            info[name] = f"missing: {type(e).__name__}: {e}"
    return info


# --- the CUDA IPC probe -------------------------------------------------------------------------------------------


def _ipc_child(tensors, answers) -> None:
    """Map the parent's CUDA tensor (torch opens its cudaIpcMemHandle), read it, then write into it."""
    try:
        import torch

        t = tensors.get(timeout=60)
        total = float(t.sum().item())
        t.add_(1.0)
        torch.cuda.synchronize()
        answers.put({"read_sum": total})
        tensors.get(timeout=60)  # hold the mapping until the parent has read the write
    except Exception as e:
        answers.put({"error": f"{type(e).__name__}: {e}"})


def cuda_ipc(timeout_s: float) -> dict:
    try:
        import torch
    except Exception as e:
        return {"allowed": None, "error": f"no torch: {e}"}
    if not torch.cuda.is_available():
        return {"allowed": "no cuda"}
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    tensors, answers = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_child, args=(tensors, answers), daemon=True)
    x = torch.arange(1024, dtype=torch.float32, device="cuda")  # sum 523776
    result: dict = {}
    try:
        child.start()
        tensors.put(x)
        got = answers.get(timeout=timeout_s)
        if "error" in got:
            result = {"allowed": False, "error": got["error"][:500]}
        else:
            torch.cuda.synchronize()
            read_ok = got["read_sum"] == 523776.0
            write_seen = float(x.sum().item()) == 523776.0 + 1024
            result = {"allowed": read_ok and write_seen, "child_read_ok": read_ok, "parent_saw_write": write_seen}
        tensors.put(None)
    except queue.Empty:
        result = {"allowed": False, "error": f"no answer from the child in {timeout_s:.0f} s (hung mapping it?)"}
    except Exception as e:
        result = {"allowed": False, "error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join(5)
    return result | {"seconds": round(time.perf_counter() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--ipc-timeout", type=float, default=25.0, help="seconds to wait for the IPC probe's child")
    args = ap.parse_args()
    info = versions() | {"dev_shm": dev_shm(), "nvidia_smi": nvidia_smi(), "cuda_ipc": {"allowed": "not probed yet"}}
    info["compute_mode"] = info["nvidia_smi"].get("compute_mode")
    info["driver"] = info["nvidia_smi"].get("driver_version")
    write(args.out, info)
    info["cuda_ipc"] = cuda_ipc(args.ipc_timeout)
    write(args.out, info)
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()

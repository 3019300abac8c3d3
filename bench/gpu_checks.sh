#!/usr/bin/env bash
# Every GPU check at once, in one call of the GPU machine (a session gets ~15 minutes of device time in all):
#
#   bash bench/gpu_checks.sh          # on the GPU machine: its python3 (or $PY), .whl/ carried along
#
# Parts, each under its own `timeout` and never stopping the others:
#   install         the carried wheels (.whl/, made here by bench/gpu_wheels.sh) and this project into /tmp/site
#   tests           the kernel tests and tests/test_gpu.py on real CUDA (TRITON_INTERPRET unset)
#   launch_tiny     bench/gpu_launch.py: a full MOPD launch, trainer + sampler + teacher sharing GPU 0 (tiny model),
#                   bf16, Triton experts replaying the engine's routes (trainer.routing_replay)
#   weight_transport bench/weight_transport.py: shm vs cuda_ipc publish + load in another process (tiny, 1B bf16)
#   moe_kernels     bench/moe_kernels.py: Triton vs torch._grouped_mm vs the per-expert loop (vs the torch reference)
#   logprob_kernel  bench/logprob_kernel.py: the fused Triton LM-head log-prob kernel vs chunked torch vs full logits
#   launch_50m      the same launch with the 50m model
#   launch_vllm     the tiny launch with sampler.engine=vllm (skipped where `import vllm` fails)
# Ends with ONE JSON, bench/results/gpu_checks.json (copied to $OUT with the logs when $OUT is set): the GPU,
# torch/triton versions, and per part its status (ok | failed, with the tail of its log | skipped, with why) and
# figures. The whole run stays inside GPU_CHECKS_BUDGET_S (default 540 s, under the device tool's 10 minutes a
# command): a part gets its own cap or what is left, whichever is less, and is skipped when too little is left.
#
#   GPU_CHECKS_ONLY=tests,launch_tiny   run only these parts (install always runs)
#   GPU_CHECKS_ALLOW_CPU=1              run the parts without CUDA too (a rehearsal on a CPU machine)
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
BUDGET_S=${GPU_CHECKS_BUDGET_S:-540}
ONLY=${GPU_CHECKS_ONLY:-}
LOGS=bench/results/gpu_checks   # one NAME.log / NAME.rc / NAME.secs / NAME.skip per part
DEADLINE=$(($(date +%s) + BUDGET_S))
RESERVE_S=15                    # kept back for writing the JSON at the end
unset TRITON_INTERPRET          # tests/conftest.py sets it only without CUDA; here the kernels must compile
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no internet there: never wait on the hub
rm -rf "$LOGS" && mkdir -p "$LOGS"

wanted() { [ -z "$ONLY" ] || [ "$1" = install ] || [[ ",$ONLY," == *",$1,"* ]]; }
skip() { echo "$2" >"$LOGS/$1.skip"; echo "[$1] skipped: $2"; }

# part NAME CAP_S COMMAND...: COMMAND under `timeout` (SIGTERM, then SIGKILL 45 s later: gpu_launch.py stops
# its run on SIGTERM and still writes its results), output to NAME.log
part() {
  local name=$1 cap=$2
  shift 2
  wanted "$name" || { skip "$name" "not in GPU_CHECKS_ONLY=$ONLY"; return; }
  local left=$((DEADLINE - $(date +%s) - RESERVE_S))
  if ((left < 30)); then skip "$name" "the ${BUDGET_S} s budget was spent before it"; return; fi
  ((cap > left)) && cap=$left
  echo "[$name] up to ${cap} s: $*"
  local t0=$(date +%s)
  timeout -k 45 "$cap" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$rc" >"$LOGS/$name.rc"
  echo "$(($(date +%s) - t0))" >"$LOGS/$name.secs"
  echo "$cap" >"$LOGS/$name.cap"
  echo "[$name] exit $rc after $(cat "$LOGS/$name.secs") s"
}

# --- (a) install: carried wheels, then this project (pip's own build, offline; else a link per subpackage) ------
install_packages() {
  mkdir -p "$SITE"
  if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl ||
      return 1
  else
    echo "no .whl/: using the packages $PY has (bash bench/gpu_wheels.sh makes the wheels; carry .whl)"
  fi
  if PYTHONPATH= "$PY" -c "import cascade_rl.supervisor.cli" 2>/dev/null; then
    echo "cascade_rl already importable from $PY"
  elif ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade \
    --target "$SITE" .; then
    # no setuptools >= 69 there: the same layout pyproject.toml maps (cascade_rl.X = ./X), as links to this tree
    echo "pip could not build the project offline; linking its folders into $SITE/cascade_rl instead"
    rm -rf "$SITE/cascade_rl" && mkdir -p "$SITE/cascade_rl"
    for d in protocol data supervisor orchestrator learner modeling samplers verifiers teachers kernels configs environments; do
      ln -sfn "$PWD/$d" "$SITE/cascade_rl/$d"
    done
  fi
}
export -f install_packages
export PY SITE
part install 120 bash -c install_packages
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# the machine, for the JSON (and whether there is a GPU at all)
"$PY" - >"$LOGS/machine.json" 2>>"$LOGS/machine.err" <<'EOF'
import json, platform
info = {"python": platform.python_version()}
try:
    import torch
    info |= {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info |= {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}",
                 "gpus": torch.cuda.device_count()}
    import triton
    info["triton"] = triton.__version__
except Exception as e:
    info["error"] = f"{type(e).__name__}: {e}"
for name in ("transformers", "tokenizers", "numpy", "zmq", "cascade_rl.supervisor.cli"):
    try:
        module = __import__(name, fromlist=["_"])
        info[name] = getattr(module, "__version__", "importable")
    except Exception as e:
        info[name] = f"missing: {type(e).__name__}: {e}"
print(json.dumps(info))
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$LOGS/nvidia-smi.txt" 2>&1
cat "$LOGS/machine.json"

NO_GPU=
if ! grep -q '"cuda_available": true' "$LOGS/machine.json" && [ -z "${GPU_CHECKS_ALLOW_CPU:-}" ]; then
  NO_GPU="torch sees no CUDA device (see machine in the JSON)"
fi
gpu_part() { if [ -n "$NO_GPU" ]; then skip "$1" "$NO_GPU"; else part "$@"; fi; }

# --- (b) kernel tests and the GPU tests --------------------------------------------------------------------------
gpu_part tests 180 "$PY" -m pytest -q -rfEs -p no:cacheprovider --junitxml="$LOGS/tests.xml" \
  tests/test_moe_kernels.py tests/test_logprob_kernel.py tests/test_experts.py tests/test_gpu.py \
  tests/test_weight_transport.py::test_cuda_ipc_loads_bitwise_in_another_process \
  tests/test_weight_transport.py::test_cuda_ipc_torn_read_across_processes

# --- (d) launch, tiny: the first end-to-end run on a GPU matters more than the kernel figures, so it goes first
rm -f bench/results/gpu_launch_*.json bench/results/moe_kernels.json bench/results/logprob_kernel.json
gpu_part launch_tiny 150 "$PY" bench/gpu_launch.py --size tiny -- trainer.routing_replay=true  # bf16, Triton experts, R3

# --- weights between processes on one GPU: shm vs cuda_ipc ---------------------------------------------------------
rm -f bench/results/weight_transport.json
gpu_part weight_transport 100 "$PY" bench/weight_transport.py --quick

# --- (c) kernel benchmarks (full shapes, fewer rounds than their default to fit the budget) -----------------------
gpu_part moe_kernels 100 "$PY" bench/moe_kernels.py --rounds 5
gpu_part logprob_kernel 100 "$PY" bench/logprob_kernel.py --rounds 3

# --- (d) launch, 50m ---------------------------------------------------------------------------------------------
gpu_part launch_50m 150 "$PY" bench/gpu_launch.py --size 50m

# --- (e) launch with vLLM, where it is installed -------------------------------------------------------------------
if [ -z "$NO_GPU" ] && wanted launch_vllm; then
  if VLLM_ERR=$(timeout 90 "$PY" -c "import vllm" 2>&1); then
    part launch_vllm 150 "$PY" bench/gpu_launch.py --size tiny --engine vllm
  else
    skip launch_vllm "import vllm failed with $PY: $(echo "$VLLM_ERR" | tail -1 | cut -c1-200)"
  fi
else
  skip launch_vllm "${NO_GPU:-not in GPU_CHECKS_ONLY=$ONLY}"
fi

# --- one JSON ----------------------------------------------------------------------------------------------------
"$PY" - "$LOGS" "$BUDGET_S" <<'EOF'
import json, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

logs, budget = Path(sys.argv[1]), int(sys.argv[2])
results = logs.parent
PARTS = ["install", "tests", "launch_tiny", "weight_transport", "moe_kernels", "logprob_kernel", "launch_50m",
         "launch_vllm"]
# each script's own result JSON (a launch's name ends in the device it ran on: cuda, or cpu in a rehearsal)
FIGURES = {"moe_kernels": ["moe_kernels.json"], "logprob_kernel": ["logprob_kernel.json"],
           "weight_transport": ["weight_transport.json"],
           **{name: [f"gpu_launch_{run}_{dev}.json" for dev in ("cuda", "cpu")]
              for name, run in (("launch_tiny", "tiny_torch"), ("launch_50m", "50m_torch"),
                                ("launch_vllm", "tiny_vllm"))}}


def read(path: Path, default=None):
    try:
        return path.read_text(errors="replace")
    except OSError:
        return default


def tail(text: str, n: int = 40) -> str:
    return "\n".join((text or "").splitlines()[-n:])


def figures(name: str) -> dict | None:
    if name == "tests":  # counts and failures from pytest's JUnit XML
        try:
            root = ET.parse(logs / "tests.xml").getroot()
        except (OSError, ET.ParseError):
            return None
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        cases = suite.findall("testcase")
        failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases
                  if c.find("failure") is not None or c.find("error") is not None]
        skipped = {f"{c.get('classname')}::{c.get('name')}": c.find("skipped").get("message", "")
                   for c in cases if c.find("skipped") is not None}
        return {"tests": len(cases), "failed": len(failed), "skipped": len(skipped),
                "passed": len(cases) - len(failed) - len(skipped), "failures": failed, "skips": skipped}
    for path in FIGURES.get(name, []):
        text = read(results / path)
        if text:
            data = json.loads(text)
            return data.get("summary", data) if name == "weight_transport" else data
    return None


parts = {}
for name in PARTS:
    skip = read(logs / f"{name}.skip")
    if skip is not None:
        parts[name] = {"status": "skipped", "reason": skip.strip()}
        continue
    rc = int(read(logs / f"{name}.rc", "-1").strip() or -1)
    entry = {"status": "ok" if rc == 0 else "failed", "exit": rc, "seconds": int(read(logs / f"{name}.secs", "0")),
             "cap_s": int(read(logs / f"{name}.cap", "0"))}
    if rc in (124, 137):
        entry["reason"] = f"timed out after {entry['cap_s']} s"
    if rc != 0:
        entry["log_tail"] = tail(read(logs / f"{name}.log", ""))
    fig = figures(name)
    if fig is not None:
        entry["figures"] = fig
    parts[name] = entry

machine = json.loads(read(logs / "machine.json", "{}") or "{}")
machine["nvidia_smi"] = (read(logs / "nvidia-smi.txt", "") or "").strip()
out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "budget_s": budget, "machine": machine,
       "gpu": machine.get("gpu"), "torch": machine.get("torch"), "triton": machine.get("triton"),
       "ok": all(p["status"] != "failed" for p in parts.values()), "parts": parts}
(results / "gpu_checks.json").write_text(json.dumps(out, indent=1))

# a short table for whoever reads the command's output
print(f"\n{'part':15s} {'status':8s} {'s':>4s}  headline")
for name, p in parts.items():
    fig = p.get("figures") or {}
    if name == "tests" and fig:
        head = f"{fig['passed']} passed, {fig['failed']} failed, {fig['skipped']} skipped"
    elif "value" in fig:
        head = f"{fig.get('metric', '')[:90]} = {fig.get('value')} (pass {fig.get('pass')})"
    else:
        head = p.get("reason", "")
    print(f"{name:15s} {p['status']:8s} {p.get('seconds', 0):4d}  {head}")
print(f"wrote {results / 'gpu_checks.json'}")
EOF

# what comes back from the device tool: the JSON, and every log in one archive (its files: at most 8)
if [ -n "${OUT:-}" ]; then
  cp bench/results/gpu_checks.json "$OUT/"
  tar -czf "$OUT/gpu_checks_logs.tar.gz" "$LOGS" bench/results/*.json \
    $(ls -d runs/gpu_launch/*.log runs/gpu_launch/run-*/logs runs/gpu_launch/run-*/*.json* 2>/dev/null) 2>/dev/null
  ls -la "$OUT"
fi

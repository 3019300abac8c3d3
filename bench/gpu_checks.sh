#!/usr/bin/env bash
# Every GPU check, in two calls of the GPU machine (a session gets ~15 minutes of device time in all, one command at
# most 600 s; on 2026-12-04 a call's start and transfers took ~30 s, and the parts ~700 s in all):
#
#   bash bench/gpu_checks.sh                              # everything (more than one call holds)
#   GPU_CHECKS_ONLY=first bash bench/gpu_checks.sh        # call 1 (~380 s): launch_tiny, tests, the kernel benches
#   GPU_CHECKS_ONLY=second bash bench/gpu_checks.sh       # call 2 (~340 s): real_shapes, launch_50m, launch_vllm
#
# on the GPU machine: its python3 (or $PY), .whl/ carried along. Call 2 right after call 1 finds the machine warm.
#
# Parts, in this order, each under its own `timeout` (cap / kill grace, in s) and never stopping the others:
#   install          45/10  the carried wheels (.whl/, made by bench/gpu_wheels.sh) and this project into /tmp/site;
#                           a wheel set pip refuses is retried wheel by wheel, and the project install (then its
#                           link fallback) runs whatever the wheels did
#   machine          50/10  bench/gpu_checks_machine.py -> machine.json: versions (torch, Triton, driver), the GPU,
#                           /dev/shm's size, the compute mode, and a real two-process CUDA IPC probe (25 s bound)
#   launch_tiny     150/35  bench/gpu_launch.py: a full MOPD launch, trainer + sampler + teacher sharing GPU 0 (tiny
#                           model), bf16, Triton experts replaying the engine's routes (trainer.routing_replay)
#   tests           210/15  the torch engine's CUDA-graph decode tests, pinned publishing, the two cross-process CUDA
#                           IPC tests, the nccl transport's two (GPU weights staged on the host for gloo; a real NCCL
#                           broadcast cuda:0 -> a sampler on cuda:1, skipped with one GPU), tests/test_gpu.py's
#                           in-process tests (the bf16 kernel path, LoRA's round trip), tests/test_experts.py and the
#                           kernel tests,
#                           on real CUDA (TRITON_INTERPRET unset); 60 s per test
#   weight_transport 60/10  bench/weight_transport.py --quick: shm vs cuda_ipc publish + load in another process
#   moe_kernels      75/10  bench/moe_kernels.py --rounds 5: Triton vs torch._grouped_mm vs the per-expert loop
#   logprob_kernel   75/10  bench/logprob_kernel.py --rounds 3: the fused LM-head log-prob kernel vs chunked torch
#   optimizer_step   60/10  bench/optimizer_step.py --quick: MasterAdamW's multi-tensor step on CUDA vs the loop
#   real_shapes     240/15  bench/real_shapes.py --layers 7: one whole Nano block (MEMEM*E) and 7 Qwen3-30B-A3B layers
#                           at their real shapes: trainer step (8192 tokens), decode (64 rows at 1024), Triton compiled
#   launch_50m      150/35  the same launch with the 50m model
#   launch_vllm     120/35  the tiny launch with sampler.engine=vllm (skipped where vllm is not installed)
#
# Why this order and these caps. GPU_CHECKS_BUDGET_S (540 s) holds everything, kill graces and the final report
# included, so the device tool's 600 s call keeps a minute for start-up, transfers and a killed part's clean-up.
# A part gets its cap or what is left (less its grace and a 10 s reserve), whichever is less, and is skipped, saying
# so, when under 20 s are left: the parts run in order of value, so a budget that runs out costs the least.
# install and machine are cheap (seconds) and everything needs them. launch_tiny is the headline: the end-to-end
# run on a GPU (three processes, ZeroMQ, weights, the bf16 kernels; 100 s on the H200, 41 s of it building the
# models and data); it also warms Triton's cache for the kernel variants the tests share with it. tests compile the most kernel variants
# (the slowest to compile) and come second: they localise a failure the launch only shows. They leave out what runs
# elsewhere: tests/test_gpu.py's three-process launch (launch_tiny does that launch, timed) and the ahead-of-time
# sm_90 compiles (tests/test_triton_aot.py: ptxas needs no GPU, the CPU suite runs
# them, and they cost 12+ compiles of this cap). The benchmarks follow, cheapest first; launch_50m last among the
# runs (it repeats launch_tiny at a larger size); vLLM is not on that machine.
#
# Nothing measured is lost. After every part (and every GPU_CHECKS_TICK_S, 30 s, while one runs, and from an EXIT
# trap) bench/gpu_checks_report.py rebuilds bench/results/gpu_checks.json from what the parts left: per part its
# status (pending | running | ok | failed | timed_out | skipped, with why | interrupted / not_run when the run itself
# was cut), seconds, cap, log tail and figures. With $OUT set it goes there at once, with machine.json and
# gpu_checks_logs.tar.gz (every log and result file so far): 3 of the device tool's 8 files. The tests part writes
# one JSON line per test as it ends (bench/gpu_checks_pytest.py), and turns the cap's SIGTERM into pytest's own
# interrupt, so a part stopped at its cap still reports each finished test and names the one it stopped in.
#
#   GPU_CHECKS_ONLY=tests,launch_tiny   run only these parts (install and machine always run); `first` and `second`
#                                       name the two calls' sets
#   GPU_CHECKS_ALLOW_CPU=1              run the parts without CUDA too (a rehearsal on a CPU machine)
#   GPU_CHECKS_CAP_<PART>=S             another cap for a part (GPU_CHECKS_CAP_TESTS=300); GPU_CHECKS_GRACE_S=S
#                                       another kill grace for every part
#   GPU_CHECKS_TESTS="a.py b.py::t"     the tests part's selection; GPU_CHECKS_TEST_TIMEOUT_S=60 its per-test cap
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
BUDGET_S=${GPU_CHECKS_BUDGET_S:-540}
ONLY=${GPU_CHECKS_ONLY:-}
case $ONLY in  # the two calls that hold every part (times measured on an H200, 2026-12-04)
  first) ONLY=launch_tiny,tests,weight_transport,moe_kernels,logprob_kernel,optimizer_step ;;
  second) ONLY=real_shapes,launch_50m,launch_vllm ;;
esac
TICK_S=${GPU_CHECKS_TICK_S:-30}
RESULTS=bench/results
LOGS=$RESULTS/gpu_checks  # per part NAME.log / .start / .rc / .secs / .cap / .skip
DEADLINE=$(($(date +%s) + BUDGET_S))
RESERVE_S=10   # kept back for the final report and archive
MIN_PART_S=20  # a part with less left than this is skipped
unset TRITON_INTERPRET  # tests/conftest.py sets it only without CUDA; here the kernels must compile
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no internet there: never wait on the hub
rm -rf "$LOGS" && mkdir -p "$LOGS"
# figures of an earlier run must not pass for this one's
rm -f "$RESULTS"/gpu_checks.json "$RESULTS"/gpu_launch_*.json "$RESULTS"/moe_kernels.json \
  "$RESULTS"/logprob_kernel.json "$RESULTS"/weight_transport.json "$RESULTS"/real_shapes.json \
  "$RESULTS"/optimizer_step.json

# --- publishing: the JSON, and with $OUT what comes back from the device tool ------------------------------------
publish() {  # publish [--final --table]
  "$PY" bench/gpu_checks_report.py "$LOGS" "$BUDGET_S" "$@" || echo "[report] exit $? (the parts' files stay)"
  [ -n "${OUT:-}" ] || return 0
  # each written beside, then renamed: a kill mid-copy leaves the previous file whole
  cp -f "$RESULTS/gpu_checks.json" "$OUT/gpu_checks.json.tmp" 2>/dev/null && mv -f "$OUT/gpu_checks.json"{.tmp,}
  cp -f "$LOGS/machine.json" "$OUT/machine.json.tmp" 2>/dev/null && mv -f "$OUT/machine.json"{.tmp,}
  local tgz=$OUT/gpu_checks_logs.tar.gz.tmp
  tar -czf "$tgz" --warning=none --exclude='*.safetensors' "$LOGS" "$RESULTS"/*.json \
    $(ls -d runs/gpu_launch/*.log runs/gpu_launch/run-*/logs runs/gpu_launch/run-*/*.json* 2>/dev/null) 2>/dev/null
  # the device tool returns files of at most 16 MiB: over 15 MB, the launches' run folders stay behind
  (($(stat -c %s "$tgz" 2>/dev/null || echo 0) > 15000000)) &&
    tar -czf "$tgz" --warning=none "$LOGS" "$RESULTS"/*.json $(ls runs/gpu_launch/*.log 2>/dev/null) 2>/dev/null
  mv -f "$tgz" "$OUT/gpu_checks_logs.tar.gz" 2>/dev/null
  return 0
}

# while a part runs, the JSON and $OUT are refreshed every TICK_S (the tests part's finished tests, a launch's logs)
ticker() {
  local nap=
  trap 'kill $nap 2>/dev/null; exit 0' TERM  # `wait` returns at once on TERM; a publish under way ends first
  while :; do
    sleep "$TICK_S" &
    nap=$!
    wait "$nap"
    publish >/dev/null 2>&1
  done
}
TICKER=
stop_ticker() {  # lets a publish in progress finish (its TERM trap waits for it), so none races the next
  [ -n "$TICKER" ] || return 0
  kill -TERM "$TICKER" 2>/dev/null
  wait "$TICKER" 2>/dev/null
  TICKER=
}
on_exit() {
  trap - EXIT TERM INT HUP
  stop_ticker
  publish --final --table
  [ -n "${OUT:-}" ] && ls -la "$OUT"
}
trap on_exit EXIT
trap 'exit 143' TERM INT HUP

wanted() { [ -z "$ONLY" ] || [ "$1" = install ] || [ "$1" = machine ] || [[ ",$ONLY," == *",$1,"* ]]; }
skip() { echo "$2" >"$LOGS/$1.skip"; echo "[$1] skipped: $2"; }

# part NAME CAP_S GRACE_S COMMAND...: COMMAND under `timeout` (SIGTERM at the cap, SIGKILL GRACE_S later:
# gpu_launch.py stops its run on SIGTERM and still writes its results; pytest ends its session), output to NAME.log
part() {
  local name=$1 cap=$2 grace=$3
  shift 3
  wanted "$name" || { skip "$name" "not in GPU_CHECKS_ONLY=$ONLY"; return 0; }
  local var="GPU_CHECKS_CAP_${name^^}"
  cap=${!var:-$cap}
  grace=${GPU_CHECKS_GRACE_S:-$grace}
  local left=$((DEADLINE - $(date +%s) - RESERVE_S - grace))
  if ((left < MIN_PART_S)); then skip "$name" "the ${BUDGET_S} s budget was spent before it"; return 0; fi
  ((cap > left)) && cap=$left
  echo "$cap" >"$LOGS/$name.cap"
  local t0
  t0=$(date +%s)
  echo "$t0" >"$LOGS/$name.start"
  publish  # the JSON names the parts done so far, and this one as running
  echo "[$name] up to ${cap} s (+${grace} s grace): $*"
  ticker &
  TICKER=$!
  timeout -k "$grace" "$cap" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  stop_ticker
  echo "$(($(date +%s) - t0))" >"$LOGS/$name.secs"
  echo "$rc" >"$LOGS/$name.rc"
  echo "[$name] exit $rc after $(cat "$LOGS/$name.secs") s"
  publish
}

# --- install: carried wheels, then this project (pip's own build, offline; else a link per subpackage) ----------
link_project() {  # the layout pyproject.toml maps (cascade_rl.X = ./X), as links to this tree
  rm -rf "$SITE/cascade_rl" && mkdir -p "$SITE/cascade_rl"
  local pkg dir
  while read -r pkg dir; do ln -sfn "$PWD/$dir" "$SITE/cascade_rl/${pkg#cascade_rl.}"; done < <("$PY" -c \
    "import tomllib; [print(*kv) for kv in tomllib.load(open('pyproject.toml', 'rb'))['tool']['setuptools']['package-dir'].items()]")
}
not_installed() {  # the tree's modules and data files that $SITE/cascade_rl lacks (a short packages list)
  "$PY" - "$SITE" <<'EOF'
import sys, tomllib
from pathlib import Path
site = Path(sys.argv[1])
for pkg, folder in tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"].items():
    for f in sorted(Path(folder).rglob("*")):
        if f.suffix in (".py", ".yaml", ".cpp") and "__pycache__" not in f.parts:
            if not (site / pkg.replace(".", "/") / f.relative_to(folder)).is_file():
                print(f)
EOF
}
install_packages() {
  local status=0
  mkdir -p "$SITE"
  if [ -d .whl ]; then
    local pip=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE")
    if ! "${pip[@]}" .whl/*.whl; then
      echo "pip refused the wheel set: installing them one by one"
      status=1
      for w in .whl/*.whl; do "${pip[@]}" "$w" || echo "FAILED: $w"; done
    fi
  else
    echo "no .whl/: using the packages $PY has (bash bench/gpu_wheels.sh makes the wheels; carry .whl)"
  fi
  if PYTHONPATH= "$PY" -c "import cascade_rl.supervisor.cli" 2>/dev/null; then
    echo "cascade_rl already importable from $PY"
  elif ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade \
    --target "$SITE" .; then
    echo "pip could not build the project offline (no setuptools >= 69 there?); linking its folders instead"
    link_project
  else
    local missing
    missing=$(not_installed)
    if [ -n "$missing" ]; then
      echo "the installed project lacks $(echo "$missing" | wc -l) of the tree's files ($(echo "$missing" | head -3 |
        tr '\n' ' ')...): pyproject.toml's packages are short; linking its folders instead"
      status=1
      link_project
    fi
  fi
  if PYTHONPATH="$SITE" "$PY" -c "import cascade_rl.supervisor.cli"; then echo "cascade_rl imports"; else status=1; fi
  return $status
}
export -f install_packages link_project not_installed
export PY SITE
part install 45 10 bash -c install_packages
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# --- the machine: versions, /dev/shm, compute mode, CUDA IPC (and whether there is a GPU at all) ----------------
part machine 50 10 "$PY" bench/gpu_checks_machine.py "$LOGS/machine.json" --ipc-timeout 25
NO_GPU=
if ! grep -qs '"cuda_available": true' "$LOGS/machine.json" && [ -z "${GPU_CHECKS_ALLOW_CPU:-}" ]; then
  NO_GPU="torch sees no CUDA device (see machine in the JSON)"
fi
gpu_part() { if [ -n "$NO_GPU" ]; then skip "$1" "$NO_GPU"; else part "$@"; fi; }

# --- launch, tiny: the first end-to-end run on a GPU ------------------------------------------------------------
gpu_part launch_tiny 150 35 "$PY" bench/gpu_launch.py --size tiny -- trainer.routing_replay=true  # bf16, Triton, R3

# --- the kernel tests and the in-process GPU tests ----------------------------------------------------------------
# shellcheck disable=SC2206  # the selection is a list of words
# the newest CUDA code first (seconds each: the engine's CUDA graphs, pinned publishing, CUDA IPC across processes,
# the nccl transport),
# then the kernels, whose many Triton compiles are what a cap cuts short (each finished test is kept regardless)
TESTS=(${GPU_CHECKS_TESTS:-tests/test_torch_engine.py::test_cuda_graph_decode_has_no_sync
  tests/test_torch_engine.py::test_cuda_graph_decode_equals_eager
  tests/test_torch_engine.py::test_cuda_graph_capture_failure_falls_back_to_eager
  tests/test_torch_engine.py::test_experts_choice_is_grouped_on_cuda_where_grouped_mm_serves_the_dtype
  tests/test_weight_transport.py::test_a_gpu_model_publishes_the_cpu_models_bytes_through_pinned_buffers
  tests/test_weight_transport.py::test_cuda_ipc_loads_bitwise_in_another_process
  tests/test_weight_transport.py::test_cuda_ipc_torn_read_across_processes
  tests/test_nccl_weights.py::test_gpu_weights_staged_on_the_host_for_gloo
  tests/test_nccl_weights.py::test_nccl_broadcast_from_cuda0_to_a_sampler_on_cuda1
  tests/test_gpu.py tests/test_experts.py tests/test_moe_kernels.py tests/test_logprob_kernel.py})
PER_TEST=()  # pytest-timeout (on the GPU machine; in the dev extra): one stuck test fails alone, the rest run
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(-o "timeout=${GPU_CHECKS_TEST_TIMEOUT_S:-60}")
gpu_part tests 210 15 env GPU_CHECKS_TESTS_JSONL="$LOGS/tests.jsonl" PYTHONPATH="$PYTHONPATH:$PWD/bench" \
  "$PY" -m pytest -q -rfEs -p no:cacheprovider -p gpu_checks_pytest --junitxml="$LOGS/tests.xml" "${PER_TEST[@]}" \
  --deselect tests/test_gpu.py::test_mopd_launch_with_trainer_sampler_and_teacher_on_one_gpu "${TESTS[@]}"

# --- weights between processes on one GPU, then the kernel benchmarks (full shapes, fewer rounds) ----------------
gpu_part weight_transport 60 10 "$PY" bench/weight_transport.py --quick
gpu_part moe_kernels 75 10 "$PY" bench/moe_kernels.py --rounds 5
gpu_part logprob_kernel 75 10 "$PY" bench/logprob_kernel.py --rounds 3
gpu_part optimizer_step 60 10 "$PY" bench/optimizer_step.py --quick  # multi-tensor AdamW on CUDA vs the loop
# the real-shape layers at more depth than the CPU holds (about 9 GB of bf16 weights a model, saved and loaded once
# for the engine); host RSS is no constraint there (the engine reads its checkpoint into host memory first)
gpu_part real_shapes 240 15 "$PY" bench/real_shapes.py --layers 7 --tokens 8192 --rows 64 --context 1024 \
  --rss-cap-gib 100

# --- launch, 50m ---------------------------------------------------------------------------------------------------
gpu_part launch_50m 150 35 "$PY" bench/gpu_launch.py --size 50m

# --- launch with vLLM, where it is installed (machine.json says; importing it is tried only then) -----------------
if [ -n "$NO_GPU" ] || ! wanted launch_vllm; then
  skip launch_vllm "${NO_GPU:-not in GPU_CHECKS_ONLY=$ONLY}"
elif ! grep -qs '"vllm": "installed"' "$LOGS/machine.json"; then
  skip launch_vllm "vllm is not installed for $PY"
elif ((DEADLINE - $(date +%s) - RESERVE_S - 35 < 2 * MIN_PART_S)); then  # the import, then the launch
  skip launch_vllm "the ${BUDGET_S} s budget was spent before it"
elif ! VLLM_ERR=$(timeout "$MIN_PART_S" "$PY" -c "import vllm" 2>&1); then
  skip launch_vllm "import vllm failed with $PY: $(echo "$VLLM_ERR" | tail -1 | cut -c1-200)"
else
  part launch_vllm 120 35 "$PY" bench/gpu_launch.py --size tiny --engine vllm
fi
# the EXIT trap writes the final JSON, prints its table and refreshes $OUT

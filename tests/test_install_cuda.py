"""`pip install .` on a CUDA Linux machine: the dependencies resolve against torch's CUDA wheel.

    pytest tests/test_install_cuda.py          (~20 s, plus ~60 s for the vllm extra; needs the package registry)

Here ``make install`` takes torch's ``+cpu`` wheel from local disk, and that wheel declares no Triton, so a
Triton pin that contradicts torch's own resolves here and fails on every GPU machine. This test asks pip's
resolver, in dry-run mode, what ``pip install .`` (and ``.[vllm]``) would install on this platform with only
the registry: the CUDA wheel of torch, whose Triton pin must be the Triton it picks. Only metadata travels
(PEP 658), never the multi-GB wheels; a few pure-Python sdists among the dependencies (langdetect, antlr4,
zss, ...) are built for their metadata, which is why this runs on the host's own tags rather than with
``--platform``: pip allows ``--platform`` only with ``--only-binary=:all:``, which those sdists fail.
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
GPU_IMAGE_TRITON = "3.6.0"  # the Triton of the GPU machine's image (bench/gpu_checks.sh runs there)
TORCH_CUDA_TRITON = "3.7.1"  # torch 2.13.0's CUDA wheel: triton==3.7.1 (its metadata; checked against it below)


def triton_requirement() -> Requirement:
    reqs = [Requirement(r) for r in PYPROJECT["dependencies"]]
    return next(r for r in reqs if r.name == "triton")


def test_the_triton_range_admits_every_triton_we_run():
    """The GPU image's Triton, torch's CUDA wheel's and the Makefile's pin for the CPU interpreter."""
    spec = triton_requirement().specifier
    pinned = re.search(r"triton==([\w.]+)", (ROOT / "Makefile").read_text())
    assert pinned, "the Makefile pins Triton beside torch (make install's CPU interpreter)"
    for version in (GPU_IMAGE_TRITON, TORCH_CUDA_TRITON, pinned.group(1)):
        assert spec.contains(version), f"pyproject's triton{spec} refuses {version}"


def resolve(requirements: list[str], tmp_path: Path) -> list[dict]:
    """What pip would install for ``requirements`` from the registry alone (dry run): the report's entries."""
    req_file, report = tmp_path / "requirements.txt", tmp_path / "report.json"
    req_file.write_text("\n".join(requirements) + "\n")
    # --isolated: no pip config or PIP_* variables, so this machine's local +cpu torch (find-links) is not preferred;
    # --target: nothing installed in this environment counts as satisfying a requirement.
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--quiet", "--ignore-installed",
           "--target", str(tmp_path / "target"), "--report", str(report), "--timeout", "30", "--retries", "2",
           "-r", str(req_file)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"pip's resolver ran past {e.timeout} s (is the package registry reachable?): {' '.join(cmd)}")
    if out.returncode != 0:
        pytest.fail(f"pip cannot resolve these dependencies against the registry (a conflict, or no registry):\n"
                    f"{out.stderr[-4000:]}")
    return json.loads(report.read_text())["install"]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                    reason="torch's CUDA wheel is the registry's torch on Linux x86_64 only")
@pytest.mark.parametrize("extra", ["", "vllm"])
def test_dependencies_resolve_against_torchs_cuda_wheel(extra, tmp_path):
    requirements = list(PYPROJECT["dependencies"]) + list(PYPROJECT["optional-dependencies"].get(extra, []))
    installs = {item["metadata"]["name"].lower(): item for item in resolve(requirements, tmp_path)}

    torch = installs["torch"]
    assert Version(torch["metadata"]["version"]).local is None, "a +cpu torch: the registry's CUDA wheel was wanted"
    assert re.search(r"manylinux.*x86_64\.whl$", torch["download_info"]["url"]), torch["download_info"]["url"]
    env = default_environment()
    pins = [Requirement(r) for r in torch["metadata"].get("requires_dist", [])]
    pins = [r for r in pins if r.name == "triton" and (r.marker is None or r.marker.evaluate(env | {"extra": ""}))]
    assert pins, "torch's CUDA wheel names its Triton"
    triton = installs["triton"]["metadata"]["version"]
    assert pins[0].specifier.contains(triton), f"resolved triton {triton}, torch wants {pins[0].specifier}"
    assert triton_requirement().specifier.contains(triton)
    assert str(pins[0].specifier) == f"=={TORCH_CUDA_TRITON}", "torch's Triton changed: update TORCH_CUDA_TRITON"

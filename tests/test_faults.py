"""supervisor/faults.py on real processes: a real OOM kill in a real memory cgroup (64 MiB limit) is told apart
from a SIGKILL of ours, and a sampled worker's RSS (its children's included) makes it into the explanation.

The cgroup tests need root and a writable cgroup hierarchy (v1's memory controller or v2); they skip, saying
why, where cgroups cannot be created. The cgroup is ``<name>/worker``: the worker's processes run in the child,
the watch reads the parent, as the supervisor's own cgroup holds its workers' (v1 counts per cgroup: the watch
must sum the descendants).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from cascade_rl.supervisor.faults import MemoryWatch, cgroup_oom_kills, human_bytes, own_memory_cgroup

LIMIT = 64 << 20
HOG = "x = bytearray(1 << 30)"  # a GiB, every page written (bytearray zero-fills): far over the limit


def _v2_root() -> Path | None:
    """The v2 hierarchy if the memory controller is there (pure v2: /sys/fs/cgroup), else None."""
    root = Path("/sys/fs/cgroup")
    controllers = root / "cgroup.controllers"
    return root if controllers.exists() and "memory" in controllers.read_text().split() else None


# each hierarchy's knobs, the first one required: the swap knob may be missing (swap off, or not accounted)
LIMIT_FILES = {
    "v1": {"memory.limit_in_bytes": str(LIMIT), "memory.memsw.limit_in_bytes": str(LIMIT)},
    "v2": {"memory.max": str(LIMIT), "memory.swap.max": "0"},
}


def _limit(cg: Path) -> None:
    """Cap the cgroup at LIMIT, swap included where the knob exists."""
    files = LIMIT_FILES["v1" if _v2_root() is None else "v2"]
    for i, (name, value) in enumerate(files.items()):
        try:
            (cg / name).write_text(value)
        except OSError:
            assert i > 0, f"cannot limit {cg}"


def _make_cgroup() -> Path:
    """A fresh ``<name>/worker`` memory cgroup pair; the parent returned. Skips where cgroups can't be created."""
    v1 = Path("/sys/fs/cgroup/memory")
    root = _v2_root() or (v1 if (v1 / "memory.oom_control").exists() else None)
    if root is None:
        pytest.skip("no cgroup v1 memory hierarchy or v2 memory controller is mounted")
    parent = root / f"cascade_faults_{uuid.uuid4().hex[:8]}"
    try:
        parent.mkdir()
        if root != v1:
            (parent / "cgroup.subtree_control").write_text("+memory")
        (parent / "worker").mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup under {root} (root and a writable hierarchy needed): {e}")
    _limit(parent / "worker")
    return parent


@pytest.fixture
def cgroup():
    """A memory cgroup with a 64 MiB child ``worker``, removed (after its processes are gone) at the end."""
    parent = _make_cgroup()
    yield parent
    for cg in (parent / "worker", parent):
        for _ in range(50):  # a killed process leaves the cgroup a moment after it is reaped
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def _start_in(cg: Path, code: str) -> subprocess.Popen:
    """A python process that runs ``code`` inside the cgroup (the shell moves itself in, then execs python)."""
    line = f"echo $$ > {cg / 'cgroup.procs'} && exec {sys.executable} -c '{code}'"
    return subprocess.Popen(["sh", "-c", line], stdout=subprocess.PIPE)


def _wait_dead_unreaped(proc: subprocess.Popen) -> None:
    """Wait until the process has died but is not reaped yet (a zombie), as the supervisor may find it."""
    deadline = time.monotonic() + 10
    while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the process did not die"
        time.sleep(0.01)


def _reap(proc: subprocess.Popen) -> int:
    """Wait for the process and close its pipe; its return code."""
    proc.communicate()
    return proc.returncode


def test_oom_kill_is_told_apart_from_our_sigkill(cgroup):
    watch = MemoryWatch(cgroup_dir=cgroup)
    assert watch.oom_kills() == 0

    hog = _start_in(cgroup / "worker", HOG)
    _wait_dead_unreaped(hog)
    watch.sample({"w": hog.pid})  # a sample while the death is unnoticed keeps the kill for explain
    assert _reap(hog) == -signal.SIGKILL
    why = watch.explain("w", hog.returncode)
    assert why.startswith("killed by SIGKILL: the kernel's OOM killer (oom_kill in ")
    assert why.endswith("went 0 -> 1)"), why
    assert watch.oom_kills() == 1

    sleeper = _start_in(cgroup / "worker", "import time; print(1, flush=True); time.sleep(60)")
    sleeper.stdout.readline()
    watch.sample({"w": sleeper.pid})
    os.kill(sleeper.pid, signal.SIGKILL)
    assert _reap(sleeper) == -signal.SIGKILL
    why = watch.explain("w", sleeper.returncode)
    assert why.startswith("killed by SIGKILL (not the OOM killer: the cgroup's oom_kill count is unchanged)"), why
    assert "its last RSS" in why


def test_two_oom_kills_are_each_explained_once(cgroup):
    watch = MemoryWatch(cgroup_dir=cgroup)
    hogs = [_start_in(cgroup / "worker", HOG) for _ in range(2)]
    assert [_reap(h) for h in hogs] == [-signal.SIGKILL] * 2
    whys = [watch.explain(f"w{i}", -signal.SIGKILL) for i in range(3)]
    assert ["OOM killer (" in why for why in whys] == [True, True, False], whys


def test_v1_parent_count_excludes_children_so_the_watch_sums_them(cgroup):
    """What the kernel does here: on v1 a parent's own oom_kill stays 0 after a kill in its child; on v2 it counts."""
    hog = _start_in(cgroup / "worker", HOG)
    assert _reap(hog) == -signal.SIGKILL
    own = (cgroup / "memory.oom_control").read_text() if (cgroup / "memory.oom_control").exists() else None
    if own is not None:
        assert "oom_kill 0" in own.splitlines()
    assert cgroup_oom_kills(cgroup)[0] == 1


def test_sample_records_a_process_tree_rss_and_explain_quotes_it():
    # sh keeps running after python (the ``; true``), so the 100 MB are its child's: the tree is summed
    code = "x = bytearray(100 << 20); print(1, flush=True); import time; time.sleep(60)"
    worker = subprocess.Popen(
        ["sh", "-c", f"{sys.executable} -c '{code}'; true"], stdout=subprocess.PIPE, start_new_session=True
    )
    worker.stdout.readline()
    watch = MemoryWatch()
    watch.sample({"w": worker.pid, "gone": 2**22 + 1})
    os.killpg(worker.pid, signal.SIGKILL)
    assert _reap(worker) == -signal.SIGKILL
    watch.sample({"w": worker.pid})  # reaped: the last sample stands
    assert watch.last_rss("w") >= 100 << 20
    assert watch.last_rss("gone") is None
    assert watch.explain("w", worker.returncode).endswith(f"; its last RSS {human_bytes(watch.last_rss('w'))}")


def test_exits_and_other_signals():
    watch = MemoryWatch(cgroup_dir=Path("/nonexistent"))
    assert watch.oom_kills() is None
    assert watch.explain("w", None) == "no heartbeat (hung)"
    assert watch.explain("w", 1) == "exited with code 1"
    assert watch.explain("w", -signal.SIGSEGV) == "killed by SIGSEGV"
    assert "no readable cgroup OOM-kill count" in watch.explain("w", -signal.SIGKILL)


def test_finds_its_own_memory_cgroup():
    cg = own_memory_cgroup()
    if cg is None:
        pytest.skip("this process is in no readable memory cgroup")
    assert MemoryWatch().cgroup_dir == cg
    assert isinstance(MemoryWatch().oom_kills(), int)

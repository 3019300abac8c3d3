"""How a worker process died, with evidence: was it the kernel's OOM killer?

A worker the OOM killer takes dies of SIGKILL, exactly like one we kill ourselves; the exit code alone cannot
tell them apart. The evidence is the memory cgroup's OOM-kill counter: if it went up while the worker died of
SIGKILL, the OOM killer did it. ``MemoryWatch`` keeps that counter's baseline and each worker's last RSS (its
children's included: a worker's torchrun ranks or engine are its memory too), so the stall report and the worker's
log can say e.g. ``killed by SIGKILL: the kernel's OOM killer (...went 3 -> 4); its last RSS 1.2 GiB``.

Where the counter lives:

* cgroup v2: ``<cgroup>/memory.events``, line ``oom_kill N``; it already counts the cgroup's descendants.
* cgroup v1: ``<cgroup>/memory.oom_control``, line ``oom_kill N``; it counts that cgroup alone (checked: an OOM
  kill in a child cgroup leaves the parent's count at 0), so the counts of every descendant are summed.

Standard library and psutil only: the supervisor imports this without torch.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_MEMORY_ROOT = CGROUP_ROOT / "memory"  # where cgroup v1 mounts the memory controller's hierarchy
V2_ROOTS = (CGROUP_ROOT, CGROUP_ROOT / "unified")  # cgroup v2 alone, or the hybrid layout's v2 mount
V2_FILE, V1_FILE = "memory.events", "memory.oom_control"


# --- finding and reading the cgroup's OOM-kill counter -------------------------------------------------------------


def own_memory_cgroup(proc_cgroup: Path = Path("/proc/self/cgroup")) -> Path | None:
    """This process's memory cgroup directory: v1's ``N:memory:/path`` line if the memory controller is mounted as
    v1, else v2's ``0::/path`` where its ``memory.events`` exists; None if neither is found."""
    try:
        entries = [line.split(":", 2) for line in proc_cgroup.read_text().splitlines()]
    except OSError:
        return None
    candidates = [V1_MEMORY_ROOT / path.lstrip("/") for _, ctl, path in entries if "memory" in ctl.split(",")]
    candidates += [
        root / path.lstrip("/") for hier, ctl, path in entries if hier == "0" and not ctl for root in V2_ROOTS
    ]
    return next((c for c in candidates if (c / V1_FILE).exists() or (c / V2_FILE).exists()), None)


def read_oom_kill(file: Path) -> int | None:
    """The ``oom_kill N`` line of a cgroup memory file (v1 ``memory.oom_control`` or v2 ``memory.events``)."""
    try:
        lines = file.read_text().splitlines()
    except OSError:
        return None
    counts = [int(value) for key, _, value in (line.partition(" ") for line in lines) if key == "oom_kill"]
    return counts[0] if counts else None


def v1_counter_files(cgroup_dir: Path) -> list[Path]:
    """Every ``memory.oom_control`` at and below a v1 cgroup: v1 counts OOM kills per cgroup, not per subtree."""
    return [Path(top) / V1_FILE for top, _, files in os.walk(cgroup_dir) if V1_FILE in files]


def cgroup_oom_kills(cgroup_dir: Path) -> tuple[int | None, str]:
    """The OOM kills in a cgroup and its descendants, and where that number was read (for the explanation)."""
    if (cgroup_dir / V2_FILE).exists():
        return read_oom_kill(cgroup_dir / V2_FILE), str(cgroup_dir / V2_FILE)
    counts = [n for n in map(read_oom_kill, v1_counter_files(cgroup_dir)) if n is not None]
    return (sum(counts) if counts else None), f"{cgroup_dir / V1_FILE} and its descendants'"


# --- a process tree's memory -----------------------------------------------------------------------------------------


def tree_rss(pid: int) -> int | None:
    """The resident memory of a process and all its descendants, in bytes; None if it is gone or a zombie (dead,
    not yet reaped: its last sample is what to report). A descendant that vanishes meanwhile is skipped."""
    try:
        root = psutil.Process(pid)
        if root.status() == psutil.STATUS_ZOMBIE:
            return None
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    return sum(_rss_or_zero(p) for p in procs)


def _rss_or_zero(proc: psutil.Process) -> int:
    """One process's RSS; 0 once it has exited (children come and go between listing and reading)."""
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return 0


def human_bytes(n: int) -> str:
    """``1.2 GiB`` from a GiB up, else ``80 MiB``."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal 77`` for a number the signal module does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# --- the watch -------------------------------------------------------------------------------------------------------


class MemoryWatch:
    """Samples the evidence (the cgroup's OOM-kill count, each worker's RSS) to explain a worker's death later.

    The count's baseline moves forward when a sample finds every worker still running (an OOM kill then took some
    other process: a worker's child, a sandbox) and by one for each SIGKILL that ``explain`` blames on the OOM
    killer, so two OOM kills are each explained once, and a kill not yet noticed by the supervisor (its worker is
    a zombie or gone at the sample) is kept for ``explain``.
    """

    def __init__(self, cgroup_dir: Path | None = None):
        """``cgroup_dir``: the memory cgroup to read OOM kills from; default: this process's own."""
        self.cgroup_dir = cgroup_dir if cgroup_dir is not None else own_memory_cgroup()
        self._rss: dict[str, int] = {}
        self._baseline = self.oom_kills()

    def oom_kills(self) -> int | None:
        """The OOM kills counted in the cgroup (and below) now; None when no cgroup file can be read."""
        return self._read()[0]

    def _read(self) -> tuple[int | None, str]:
        """The count now and where it was read."""
        return cgroup_oom_kills(self.cgroup_dir) if self.cgroup_dir is not None else (None, "")

    def sample(self, pids: dict[str, int]) -> None:
        """Record each worker's RSS (with its children's) now; cheap enough to call every couple of seconds."""
        sizes = {worker_id: tree_rss(pid) for worker_id, pid in pids.items()}
        self._rss.update({worker_id: rss for worker_id, rss in sizes.items() if rss is not None})
        if None not in sizes.values():
            self._baseline = self.oom_kills()

    def last_rss(self, worker_id: str) -> int | None:
        """The worker's RSS at its last sample that found it alive, in bytes; None if never sampled."""
        return self._rss.get(worker_id)

    def explain(self, worker_id: str, returncode: int | None) -> str:
        """One line on how the worker died: its exit code, the signal, and for SIGKILL whether the OOM killer did it
        and its last RSS. ``returncode`` None: it is still running but stopped heartbeating."""
        if returncode is None:
            return "no heartbeat (hung)"
        if returncode >= 0:
            return f"exited with code {returncode}"
        death = f"killed by {signal_name(-returncode)}"
        if -returncode != signal.SIGKILL:
            return death
        rss = self.last_rss(worker_id)
        return death + self._oom_verdict() + (f"; its last RSS {human_bytes(rss)}" if rss is not None else "")

    def _oom_verdict(self) -> str:
        """Why a SIGKILL came: the OOM killer if the count rose past the baseline (one kill is used up), else not."""
        now, source = self._read()
        before = self._baseline
        if now is None or before is None:
            return " (no readable cgroup OOM-kill count to say whether the OOM killer did it)"
        if now <= before:
            self._baseline = now
            return " (not the OOM killer: the cgroup's oom_kill count is unchanged)"
        self._baseline = before + 1
        return f": the kernel's OOM killer (oom_kill in {source} went {before} -> {now})"

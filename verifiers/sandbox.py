"""Run an untrusted Python program in a throwaway Linux sandbox and capture its output.

    from cascade_rl.verifiers.sandbox import SandboxConfig, run_python
    r = run_python("print(int(input()) * 2)", stdin="21\\n", config=SandboxConfig(timeout_s=2))
    r.ok, r.stdout, r.reason      # -> True, "42\\n", ""

Needs root on Linux, with CAP_SYS_ADMIN (in a container: ``--privileged`` or ``--cap-add
SYS_ADMIN`` and a seccomp/AppArmor profile that allows unshare and mount). Without it
``run_python`` raises :class:`SandboxUnavailable` (fail closed) unless
``allow_unsandboxed=True``, a debugging mode that keeps only the rlimits, the timeout
and an empty environment (no namespaces, runs as the caller, cwd a host temp dir).
Run the checks with ``pytest tests/test_sandbox.py``; the cost with ``python bench/sandbox.py``.

Threat model
------------
The program is model output from RL training: arbitrary Python, possibly hostile by
accident (fork loops, huge allocations, infinite loops) or learned reward hacking
(read the tests or the expected output, touch the verifier, exit early). It must not
reach the network, see or change host files, read the verifier's secrets, signal or
outlive the verifier, or starve the machine beyond its limits. Out of scope: kernel
exploits (there is no seccomp filter; the kernel's whole syscall surface is reachable
by an unprivileged user) and side channels.

Process tree
------------
::

    verifier (parent) ──Popen──▶ L launcher, root, host pid namespace, own session
                                  └─fork─▶ I init, pid 1 of a new pid namespace, root
                                             └─fork─▶ W worker, uid 61000+slot, exec python

L and I run trusted code (``_LAUNCHER`` below, a ``python -I -S -c`` script, so no
``preexec_fn``: safe to call from many threads). L unshares the namespaces and forks
I; I builds the filesystem, forks W and reaps; W drops privileges and execs the
program. L exists only because a new pid namespace takes effect for children.

Layers (``tests/test_sandbox.py`` has a hostile program for each)
------------------------------------------------------------------
1. Network: a new network namespace (CLONE_NEWNET) with only a loopback that is down;
   every connect fails with ENETUNREACH, the host's 127.0.0.1 included. Abstract unix
   sockets are per namespace; path unix sockets are not reachable (layer 3 hides them).
2. Processes: a new pid namespace (CLONE_NEWPID). W sees only itself, its children and
   I; the verifier's pid does not exist there, so ``os.kill(ppid)``, ``kill -9 -1`` and
   ``/proc/<pid>/environ`` cannot reach it. When I exits (after W exits, on its own
   deadline alarm, or killed) the kernel SIGKILLs everything left in the namespace and
   waits for it, so a grandchild that ``setsid()``-ed out of the process group dies
   too. Also new IPC and UTS namespaces.
3. Filesystem: a new mount namespace (private propagation, nothing leaks to the
   host) and ``chroot`` into a fresh tmpfs holding read-only, nosuid binds of /usr,
   /lib*, /bin, /sbin, /etc, the interpreter's prefix, /dev/{null,zero,full,random,
   urandom}, a fresh /proc of the new pid namespace, and one writable tmpfs at /tmp
   (size ``disk_mb``, owned by W's uid, also at /dev/shm). /tmp is the program's cwd,
   HOME and TMPDIR: its private temp dir. It vanishes with the mount namespace, so it
   is deleted even if the verifier dies. Nothing else is visible (no /root, /home,
   /work, /run, host /tmp: no datasets with expected outputs, no sockets); everything
   else is read-only (EROFS). The host-side mount point is an empty root-only dir that
   the parent removes.
4. Identity: W runs as an unprivileged uid/gid (``uid_base + slot``, no supplementary
   groups, ``PR_SET_NO_NEW_PRIVS`` so setuid binaries do not elevate). It cannot
   signal or ptrace root processes (I, L), read their /proc entries, or write files
   it does not own. One uid per concurrent slot, claimed with an ``flock`` on
   ``/tmp/cascade-rl-sandbox/uid-<uid>.lock``, so RLIMIT_NPROC (which counts per real
   uid) is a per-sandbox limit and slots never see each other's files or processes,
   also across verifier processes. The uids must be unused on the host (checked
   against the passwd database). Being chrooted, W cannot create user namespaces
   (EPERM), so it cannot gain namespace-root capabilities either.
5. Resources: rlimits on W: address space (``memory_mb``; Python raises MemoryError,
   reported as reason "memory"), CPU seconds (``timeout_s`` rounded up + 1; SIGXCPU),
   processes+threads (``max_processes``, enforced because W is not root), file size,
   open files, no core dumps. Output is capped by the parent (``max_output_bytes``,
   reason "output limit"); stderr keeps its last ``stderr_keep_bytes``.
6. Time: the parent's wall-clock deadline (``timeout_s``) asks L to kill I (SIGTERM
   to L; L SIGKILLs I and reaps it, so no orphaned zombie is left), and escalates to
   SIGKILL of L's process group if L does not answer. I has its own alarm a little
   later (``timeout_s`` rounded up + 2 s) and I dies with L (PDEATHSIG), so nothing
   outlives a crashed verifier (L then becomes an orphan for the host's init to reap). Any process of the slot's uid that is still alive after a kill
   (none is expected) is SIGKILLed before the slot is handed out again.
7. Environment: L, I and W get an empty environment; W gets PATH, HOME, TMPDIR, LANG
   only. The interpreter runs as ``python -I -S`` (ignore PYTHON* variables, user site
   and site-packages: stdlib only); the ``exit``/``quit`` builtins that ``site`` would
   add are set to ``sys.exit`` so competitive-programming code that calls ``exit()``
   still works.

Cost: two interpreter starts (L with ctypes, then W), a fork, five unshares (~0.6 ms) and
a dozen mounts: ~31 ms per ``print(1)`` on the 2-core dev VM, vs ~24 ms for a plain
``python -c`` with site and ~9 ms for ``python -I -S -c`` (bench/sandbox.py). A
persistent root fork-server in place of L would save its ~11 ms start if it matters.
"""

from __future__ import annotations

import fcntl
import math
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .errors import VerifierUnavailable

STATE_DIR = "/tmp/cascade-rl-sandbox"  # fixed (not $TMPDIR): every verifier process on the machine must share it
RUN_DIR_PREFIX = "run-"  # host mount points, one per run, in the state dir


class SandboxError(VerifierUnavailable):
    """The sandbox itself failed (not the program): an infrastructure error, never a wrong answer (a verifier that
    lets it through fails its group with the reason: verifiers/errors.py)."""


class SandboxUnavailable(SandboxError):
    """Isolation cannot be set up here (not root, no namespaces); raised instead of running unsandboxed."""


def _default_python() -> str:
    return os.path.realpath(sys.executable)


@dataclass(frozen=True)
class SandboxConfig:
    timeout_s: float = 5.0
    """Wall-clock limit from spawn to exit, interpreter start included."""
    memory_mb: int = 512
    """RLIMIT_AS of the program (virtual memory; Python raises MemoryError past it)."""
    max_processes: int = 32
    """RLIMIT_NPROC of the program's uid: processes plus threads, the program itself included."""
    max_output_bytes: int = 8 << 20
    """stdout (and separately stderr) beyond this kills the program with reason "output limit"."""
    stderr_keep_bytes: int = 8192
    """How much of the end of stderr is kept in the result."""
    disk_mb: int = 64
    """Size of the program's writable tmpfs (/tmp, its cwd)."""
    max_file_mb: int = 64
    """RLIMIT_FSIZE."""
    max_open_files: int = 256
    """RLIMIT_NOFILE."""
    python: str = field(default_factory=_default_python)
    """Interpreter for the program (and the launcher); its prefix is bound read-only into the sandbox."""
    python_flags: tuple[str, ...] = ("-I", "-S")
    """Interpreter flags of the program: -I ignores PYTHON* variables and the user site, -S skips site-packages
    (stdlib only; ``exit``/``quit`` are provided anyway). Drop -S to let it import the interpreter's packages."""
    ro_paths: tuple[str, ...] = ()
    """Extra host paths bound read-only at the same place (e.g. packages the program may import)."""
    uid_base: int = 61000
    """The program runs as uid/gid ``uid_base + slot``; these uids must be unused on the host."""
    slots: int = 64
    """Concurrent sandboxes per machine (one uid each); a run waits for a free slot."""
    state_dir: str = STATE_DIR
    """Root-only dir for the uid lock files and the per-run mount points; all users of a uid range share one."""
    allow_unsandboxed: bool = False
    """Where isolation is unavailable, run with rlimits + timeout only instead of raising (debugging only)."""


@dataclass(frozen=True)
class RunResult:
    stdout: str
    stderr: str
    """The last ``stderr_keep_bytes`` of stderr."""
    exit_code: int | None
    """None when the program did not exit by itself (signal, timeout, output limit)."""
    signal: int | None
    """The signal that ended the program, if one did."""
    wall_s: float
    reason: str
    """"" when the program exited 0; else "timeout", "memory", "output limit", "killed by signal N",
    "cpu time limit" or "exit code N"."""
    max_rss_kb: int = 0
    cpu_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.reason


# The launcher: L, then (after fork) I, then W (verifiers/sandbox_launcher.py, run as root with -I -S).
_LAUNCHER = (Path(__file__).parent / "sandbox_launcher.py").read_text()


def _launcher_argv(cfg: SandboxConfig, code_fd: int, status_fd: int, uid: int, root: str, isolate: bool) -> list[str]:
    python = os.path.realpath(cfg.python)
    prefix = os.path.dirname(os.path.dirname(python))  # .../bin/python3.11 -> the install prefix
    ro_paths = "\n".join(os.path.realpath(p) for p in (prefix, *cfg.ro_paths))
    return [python, "-I", "-S", "-c", _LAUNCHER, str(code_fd), str(status_fd), str(uid), root, repr(cfg.timeout_s),
            str(cfg.memory_mb << 20), str(cfg.max_processes), str(cfg.max_file_mb << 20), str(cfg.max_open_files),
            str(cfg.disk_mb), python, " ".join(cfg.python_flags), "1" if isolate else "0", ro_paths]


# --- uid slots ------------------------------------------------------------------------------

_slot_lock = threading.Lock()
_next_slot = 0
_swept: set[int] = set()  # uids checked for leftovers of an earlier (crashed) process


def _state_dir(path: str) -> str:
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SandboxError(f"{path} must be a directory owned by uid {os.geteuid()} with mode 0700")
    return path


def _check_uids(cfg: SandboxConfig) -> None:
    for uid in range(cfg.uid_base, cfg.uid_base + cfg.slots):
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            continue
        raise SandboxError(f"sandbox uid {uid} belongs to user {user!r}; set SandboxConfig.uid_base to an unused range")


def pids_of_uid(uid: int) -> list[int]:
    """Host pids whose real, effective, saved or filesystem uid is ``uid`` (zombies included)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        if str(uid).encode() in line.split()[1:]:
                            pids.append(int(name))
                        break
        except OSError:  # exited meanwhile
            pass
    return pids


def kill_uid(uid: int, wait_s: float = 10.0) -> int:
    """SIGKILL every process of ``uid`` until none is left; returns how many were found at first."""
    deadline = time.monotonic() + wait_s
    found = pids = pids_of_uid(uid)
    while pids:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise SandboxError(f"processes {pids} of sandbox uid {uid} survive SIGKILL")
        time.sleep(0.002)
        pids = pids_of_uid(uid)
    return len(found)


@contextmanager
def _uid_slot(cfg: SandboxConfig, wait_s: float = 60.0) -> Iterator[int]:
    """Claim a uid no other sandbox (in any process on this machine) is using, for the duration."""
    global _next_slot
    state = _state_dir(cfg.state_dir)
    deadline = time.monotonic() + wait_s
    while True:
        with _slot_lock:
            start = _next_slot
            _next_slot = (_next_slot + 1) % cfg.slots
        for i in range(cfg.slots):
            uid = cfg.uid_base + (start + i) % cfg.slots
            fd = os.open(os.path.join(state, f"uid-{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                if uid not in _swept:
                    kill_uid(uid)
                    _swept.add(uid)
                yield uid
                return
            finally:
                os.close(fd)  # releases the flock
        if time.monotonic() > deadline:
            raise SandboxError(f"no free sandbox slot among {cfg.slots} within {wait_s:.0f} s")
        time.sleep(0.005)


# --- running --------------------------------------------------------------------------------

_checked: set[tuple[int, int]] = set()


def isolation_available() -> bool:
    """Whether this process can build the sandbox (root on Linux); the definitive check is the launch."""
    return sys.platform == "linux" and os.geteuid() == 0


def run_python(code: str, stdin: str | bytes = "", config: SandboxConfig | None = None) -> RunResult:
    """Run ``code`` as a program (``python main.py``) with ``stdin``; never raises for the program's failures.

    Raises :class:`SandboxUnavailable` where isolation cannot be set up (unless
    ``config.allow_unsandboxed``) and :class:`SandboxError` if the sandbox itself breaks.
    """
    cfg = config or SandboxConfig()
    isolate = isolation_available()
    if not isolate and not cfg.allow_unsandboxed:
        raise SandboxUnavailable("the code sandbox needs root on Linux (namespaces, mounts, setuid); run the verifier "
                                 "as root, or set SandboxConfig.allow_unsandboxed=True to run without isolation "
                                 "(debugging only)")
    if isolate and (cfg.uid_base, cfg.slots) not in _checked:
        _check_uids(cfg)
        _checked.add((cfg.uid_base, cfg.slots))
    data = stdin.encode(errors="replace") if isinstance(stdin, str) else stdin
    slot = _uid_slot(cfg) if isolate else _no_slot()
    with slot as uid:
        root = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX, dir=_state_dir(cfg.state_dir))
        try:
            return _run(cfg, code.encode(errors="replace"), data, uid, root, isolate)
        finally:
            if isolate:
                os.rmdir(root)  # empty: the mounts lived in the sandbox's mount namespace only
            else:
                shutil.rmtree(root, ignore_errors=True)


@contextmanager
def _no_slot() -> Iterator[int]:
    yield os.geteuid()


def _run(cfg: SandboxConfig, program: bytes, stdin: bytes, uid: int, root: str, isolate: bool) -> RunResult:
    code_fd = os.memfd_create("program")
    status_r, status_w = os.pipe()
    try:
        view = memoryview(program)
        while view:
            view = view[os.write(code_fd, view):]
        t0 = time.monotonic()
        proc = subprocess.Popen(_launcher_argv(cfg, code_fd, status_w, uid, root, isolate), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(code_fd, status_w),
                                start_new_session=True, env={}, cwd="/")
    finally:
        os.close(code_fd)
        os.close(status_w)
    try:
        out, err, err_total, status, killed = _communicate(proc, stdin, status_r, t0 + cfg.timeout_s, cfg)
    except BaseException:
        _stop(proc, isolate)
        raise
    finally:
        os.close(status_r)
    if killed or not isolate:
        _stop(proc, isolate)
    else:
        proc.wait()  # L exits right after I, which exits right after W
    wall = time.monotonic() - t0
    if killed and isolate:
        kill_uid(uid)  # normally a no-op: the namespace died with I; but never hand out a slot with survivors
    return _result(cfg, proc, out, err, err_total, status, killed, isolate, wall)


def _communicate(proc: subprocess.Popen, stdin: bytes, status_fd: int, deadline: float,
                 cfg: SandboxConfig) -> tuple[bytes, bytes, int, str, str]:
    """Feed stdin and read stdout, stderr and the status pipe until all three close or a limit is hit.

    Returns (stdout, stderr tail, stderr bytes in all, status text, why it was cut short or "").
    """
    out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    out, err, status = bytearray(), bytearray(), bytearray()
    err_total, pos, killed, keep = 0, 0, "", cfg.stderr_keep_bytes
    sel = selectors.DefaultSelector()
    for fd in (out_fd, err_fd, status_fd):
        sel.register(fd, selectors.EVENT_READ)
    if stdin:
        os.set_blocking(in_fd, False)
        sel.register(in_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    readers = 3
    try:
        while readers and not killed:  # stdin left unread when the program exits is dropped
            left = deadline - time.monotonic()
            if left <= 0:
                killed = "timeout"
                break
            for key, _ in sel.select(left):
                fd = key.fd
                if fd == in_fd:
                    try:
                        pos += os.write(fd, stdin[pos:pos + (1 << 16)])
                    except BlockingIOError:
                        continue
                    except OSError:  # EPIPE: the program closed stdin or exited
                        pos = len(stdin)
                    if pos >= len(stdin):
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    sel.unregister(fd)
                    readers -= 1
                elif fd == status_fd:
                    status += chunk
                elif fd == out_fd:
                    out += chunk
                    if len(out) > cfg.max_output_bytes:
                        killed = "output limit"
                else:
                    err_total += len(chunk)
                    err += chunk
                    if len(err) > 2 * keep:  # keep the tail: that is where the traceback ends
                        del err[:-keep]
                    if err_total > cfg.max_output_bytes:
                        killed = "output limit"
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()
    tail = bytes(err[-keep:]) if keep else b""
    return bytes(out), tail, err_total, status.decode(errors="replace"), killed


def _stop(proc: subprocess.Popen, isolate: bool) -> None:
    """Kill the run: ask L to kill I (the namespace goes with it); SIGKILL the group if L does not answer."""
    if isolate and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5.0)  # normally well under 1 s, also for a fork bomb on a loaded machine
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # L not yet reaped, so its pid (= pgid) cannot have been reused
    except ProcessLookupError:
        pass
    proc.wait()


def _result(cfg: SandboxConfig, proc: subprocess.Popen, out: bytes, err: bytes, err_total: int, status: str,
            killed: str, isolate: bool, wall: float) -> RunResult:
    stdout = out.decode(errors="replace")
    stderr = err.decode(errors="replace")
    if err_total > len(err):
        stderr = f"[{err_total - len(err)} bytes cut]\n" + stderr
    lines = status.split("\n")
    first = lines[0].split(" ", 1) if lines[0] else [""]
    if first[0] == "unavailable":
        raise SandboxUnavailable(f"cannot create namespaces ({first[1]}); the code sandbox needs root with "
                                 "CAP_SYS_ADMIN (e.g. docker --privileged)")
    if first[0] == "error":
        raise SandboxError(first[1])
    if killed:
        return RunResult(stdout, stderr, None, None, wall, killed)
    if first[0] == "timeout":
        return RunResult(stdout, stderr, None, signal.SIGKILL, wall, "timeout")
    if isolate:
        if first[0] not in ("exit", "signal"):
            raise SandboxError(f"sandbox launcher ended without a status (exit code {proc.returncode})")
        kind, num, rss, cpu = lines[0].split()
        code, rss_kb, cpu_s = int(num), int(rss), float(cpu)
    else:
        kind, code = ("signal", -proc.returncode) if proc.returncode < 0 else ("exit", proc.returncode)
        rss_kb, cpu_s = 0, 0.0
    if kind == "signal":
        if code == signal.SIGXCPU or (code == signal.SIGKILL and cpu_s >= math.ceil(cfg.timeout_s) + 1):
            reason = "cpu time limit"
        else:
            reason = f"killed by signal {code}"
        return RunResult(stdout, stderr, None, code, wall, reason, rss_kb, cpu_s)
    if code == 0:
        reason = ""
    elif "MemoryError" in stderr[-2000:]:
        reason = "memory"
    else:
        reason = f"exit code {code}"
    return RunResult(stdout, stderr, code, None, wall, reason, rss_kb, cpu_s)

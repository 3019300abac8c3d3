"""The code sandbox against hostile programs: each must fail or be contained within timeout + 1 s,
leave no process and no temp dir behind, and leave the host and this test process untouched."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from cascade_rl.verifiers import sandbox
from cascade_rl.verifiers.sandbox import SandboxConfig, SandboxUnavailable, run_python

pytestmark = pytest.mark.skipif(not sandbox.isolation_available(), reason="the sandbox needs root on Linux")

TIMEOUT_S = 2.0
UID_BASE, SLOTS = 62000, 8  # a range of our own, so a sandbox running elsewhere on the machine cannot interfere


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> SandboxConfig:
    state = tmp_path_factory.mktemp("sandbox-state")
    state.chmod(0o700)
    return SandboxConfig(timeout_s=TIMEOUT_S, memory_mb=256, uid_base=UID_BASE, slots=SLOTS, state_dir=str(state))


def sandbox_pids() -> list[tuple[int, int]]:
    """(pid, uid) of every host process running as one of the test range's uids."""
    found = []
    for uid in range(UID_BASE, UID_BASE + SLOTS):
        found += [(pid, uid) for pid in sandbox.pids_of_uid(uid)]
    return found


def unreaped_children() -> list[str]:
    """Our own child processes (zombies included): every launcher must have been reaped."""
    me, out = str(os.getpid()), []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        fields = dict(ln.split(":\t", 1) for ln in status.splitlines() if ":\t" in ln)
        if fields.get("PPid", "").strip() == me:
            out.append(f"{name} {fields.get('Name', '').strip()} {fields.get('State', '').strip()}")
    return out


def run_hostile(code: str, cfg: SandboxConfig, stdin: str = "") -> sandbox.RunResult:
    before = set(unreaped_children())  # other tests in this process may have left children of their own
    r = run_python(code, stdin, cfg)
    assert r.wall_s <= cfg.timeout_s + 1.0, r
    assert sandbox_pids() == [], "sandbox processes survived the run"
    assert [c for c in unreaped_children() if c not in before] == []
    assert [p for p in os.listdir(cfg.state_dir) if p.startswith(sandbox.RUN_DIR_PREFIX)] == [], "temp dir left"
    return r


def test_runs_a_program_with_stdin_and_reports_exit(cfg):
    r = run_hostile("import sys\nprint(sum(map(int, sys.stdin.read().split())))", cfg, stdin="1 2\n3\n")
    assert r.ok and r.stdout == "6\n" and r.reason == ""
    r = run_hostile("print('partial')\nexit(3)", cfg)  # exit() works although site is not loaded
    assert (r.exit_code, r.reason, r.stdout) == (3, "exit code 3", "partial\n")
    r = run_hostile("import os\nos.kill(os.getpid(), 11)", cfg)
    assert (r.signal, r.reason) == (11, "killed by signal 11")


def test_large_stdin_and_stdout_round_trip(cfg):
    data = "".join(f"{i}\n" for i in range(200_000))  # ~1.3 MB: more than a pipe buffer both ways
    r = run_hostile("import sys\nsys.stdout.write(sys.stdin.read())", cfg, stdin=data)
    assert r.ok and r.stdout == data


def test_fork_bomb_is_capped_and_killed(cfg):
    r = run_hostile("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", cfg)
    assert not r.ok and r.reason in ("timeout", "cpu time limit")
    assert subprocess.run(["true"]).returncode == 0  # this process can still fork


def test_fork_bomb_hits_the_process_limit(cfg):
    code = (
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n"
        "        n += 1\nexcept OSError as e:\n    print(n, type(e).__name__, flush=True)\n    os._exit(0)"
    )
    r = run_hostile(code, cfg)
    n, err = r.stdout.split()
    assert int(n) < cfg.max_processes and err == "BlockingIOError"  # EAGAIN from RLIMIT_NPROC of the slot uid


def test_memory_bomb_fails_with_memory(cfg):
    r = run_hostile("a = []\nwhile True:\n    a.append(bytearray(32 << 20))", cfg)
    assert (r.ok, r.reason) == (False, "memory")
    assert run_hostile("x = ' ' * (10 ** 10)", cfg).reason == "memory"


def test_infinite_loop_times_out(cfg):
    t0 = time.monotonic()
    r = run_hostile("while True:\n    pass", cfg)
    assert r.reason == "timeout" and r.exit_code is None
    assert TIMEOUT_S <= time.monotonic() - t0 <= TIMEOUT_S + 1.0


def test_output_flood_is_cut(cfg):
    r = run_hostile("while True:\n    print('x' * 10000)", replace(cfg, max_output_bytes=1 << 20))
    assert r.reason == "output limit" and r.wall_s < 1.0
    r = run_hostile(
        "import sys\nwhile True:\n    sys.stderr.write('e' * 10000)", replace(cfg, max_output_bytes=1 << 20)
    )
    assert r.reason == "output limit" and 0 < len(r.stderr) <= cfg.stderr_keep_bytes + 100


def test_no_network_not_even_the_hosts_loopback(cfg):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('localhost', {port})]:\n"
            "    try:\n"
            "        socket.create_connection(addr, timeout=1).close()\n"
            "        print('connected', addr)\n"
            "    except OSError as e:\n"
            "        print('blocked', type(e).__name__)\n"
            "print([name for _, name in socket.if_nameindex()])"
        )
        r = run_hostile(code, cfg)
        assert r.ok and "connected" not in r.stdout and r.stdout.count("blocked") == 3, r.stdout
        assert r.stdout.splitlines()[-1] == "['lo']"
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the host's port


def test_cannot_write_outside_its_temp_dir_or_see_host_files(cfg, tmp_path):
    name = f"owned-{secrets.token_hex(4)}"
    targets = [
        f"/tmp/{name}",
        f"/root/{name}",
        f"/etc/{name}",
        f"/{name}",
        f"/usr/{name}",
        f"/dev/shm/{name}",
        f"{tmp_path}/{name}",
        f"/proc/{name}",
    ]
    code = (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('refused', path, type(e).__name__)\n"
        f"print('visible', [p for p in ['/work', '/home', '/run', {str(Path.cwd())!r}, {sys.executable!r},"
        " '/root/.bashrc', '/var'] if os.path.exists(p)])\n"
        "print('cwd', os.getcwd(), os.listdir('.'))"
    )
    r = run_hostile(code, cfg)
    lines = r.stdout.splitlines()
    wrote = {ln.split()[1] for ln in lines if ln.startswith("wrote")}
    assert wrote <= {f"/tmp/{name}", f"/dev/shm/{name}"}, lines  # /tmp is its own private tmpfs (the cwd)
    assert sum(ln.startswith("refused") for ln in lines) == len(targets) - len(wrote)
    assert "visible []" in lines
    assert any(ln.startswith("cwd /tmp") for ln in lines)
    for path in targets:  # and nothing appeared on the host
        assert not os.path.exists(path), path


def test_cannot_gain_privileges(cfg):
    code = ("import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "print('userns', libc.unshare(0x10000000), ctypes.get_errno())\n"  # CLONE_NEWUSER: EPERM in a chroot
            "for what, call in [('setuid', lambda: os.setuid(0)), ('shadow', lambda: open('/etc/shadow').read()),\n"
            "                   ('init maps', lambda: open('/proc/1/maps').read())]:\n"
            "    try:\n"
            "        call()\n"
            "        print(what, 'allowed')\n"
            "    except OSError as e:\n"
            "        print(what, 'refused', type(e).__name__)\n"
            "print('uid', os.getuid(), os.getgid(), os.getgroups())")
    lines = run_hostile(code, cfg).stdout.splitlines()
    assert lines[0] == "userns -1 1"  # EPERM
    assert lines[1:4] == ["setuid refused PermissionError", "shadow refused PermissionError",
                          "init maps refused PermissionError"]
    uid = int(lines[4].split()[1])
    assert UID_BASE <= uid < UID_BASE + SLOTS and lines[4] == f"uid {uid} {uid} []"


def test_cannot_read_the_parents_environment(cfg, monkeypatch):
    secret = secrets.token_hex(16)
    monkeypatch.setenv("CASCADE_SANDBOX_SECRET", secret)
    code = (
        "import os, glob\n"
        "print(dict(os.environ))\n"
        f"for path in ['/proc/{os.getpid()}/environ', f'/proc/{{os.getppid()}}/environ'] + glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        print(path, open(path, 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(path, 'refused', type(e).__name__)"
    )
    r = run_hostile(code, cfg)
    assert r.ok and secret not in r.stdout and "CASCADE_SANDBOX_SECRET" not in r.stdout
    assert f"/proc/{os.getpid()}/environ refused" in r.stdout  # our pid does not exist in its pid namespace
    assert "/proc/1/environ refused PermissionError" in r.stdout  # the sandbox's init runs as root


def test_cannot_kill_the_parent(cfg):
    code = (
        "import os, signal\n"
        f"for target in [{os.getpid()}, os.getppid(), -1]:\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "        print('sent', target)\n"
        "    except OSError as e:\n"
        "        print('refused', target, type(e).__name__)\n"
        "print('still here')"
    )
    r = run_hostile(code, cfg)
    assert r.ok and r.stdout.splitlines()[-1] == "still here", r.stdout
    assert f"refused {os.getpid()}" in r.stdout  # our pid does not exist in its pid namespace
    assert "refused 1 PermissionError" in r.stdout  # its parent is the namespace's init, which runs as root
    # A shell's kill -9 -1 kills every process of the slot uid but the shell: the program itself included.
    r = run_hostile("import os\nos.system('kill -9 -1')\nprint('after')", cfg)
    assert r.reason == "killed by signal 9"


def test_escaped_grandchild_is_killed_when_the_program_exits(cfg):
    # The grandchild leaves the process group (setsid) and keeps stdout open; the run must still end at once.
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "print('parent done', flush=True)"
    )
    t0 = time.monotonic()
    r = run_hostile(code, cfg)
    assert r.ok and r.stdout == "parent done\n" and time.monotonic() - t0 < 1.0


def test_escaped_grandchild_is_killed_on_timeout(cfg):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.close(1)\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "time.sleep(60)"
    )
    assert run_hostile(code, cfg).reason == "timeout"


def test_concurrent_sandboxes_are_separate(cfg):
    code = (
        "import os, time\n"
        "open(f'mine-{os.getuid()}', 'w').close()\n"
        "time.sleep(0.5)\n"
        "print(os.getuid(), sorted(os.listdir('.')))"
    )
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda _: run_python(code, "", cfg), range(4)))
    assert time.monotonic() - t0 < 4 * 0.5  # they overlapped
    uids = set()
    for r in results:
        uid, listing = r.stdout.split(" ", 1)
        assert listing.strip() == str(sorted(["main.py", f"mine-{uid}"]))
        uids.add(int(uid))
    assert len(uids) == 4 and all(UID_BASE <= u < UID_BASE + SLOTS for u in uids)
    assert sandbox_pids() == []


def test_fails_closed_without_isolation(cfg, monkeypatch):
    monkeypatch.setattr(sandbox, "isolation_available", lambda: False)
    with pytest.raises(SandboxUnavailable, match="needs root"):
        run_python("print(1)", "", cfg)
    loose = replace(cfg, allow_unsandboxed=True)
    r = run_python("import os\nprint(os.environ.get('CASCADE_X', 'clean'))", "", loose)
    assert r.ok and r.stdout == "clean\n"
    assert run_python("while True:\n    pass", "", loose).reason == "timeout"


def test_nothing_outlives_a_crashed_verifier(cfg):
    # The verifier dies (SIGKILL) mid-run: the sandbox's own init alarm (timeout + 2 s) still ends the program.
    script = (
        "import sys\nfrom cascade_rl.verifiers.sandbox import SandboxConfig, run_python\n"
        f"run_python('import time\\ntime.sleep(60)', '', SandboxConfig(timeout_s=1.0, uid_base={UID_BASE}, "
        f"slots={SLOTS}, state_dir={cfg.state_dir!r}))"
    )
    verifier = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 10
    while not sandbox_pids():  # wait until the program runs
        assert time.monotonic() < deadline and verifier.poll() is None
        time.sleep(0.05)
    verifier.kill()
    verifier.wait()
    killed_at = time.monotonic()
    while sandbox_pids():
        assert time.monotonic() - killed_at < 1.0 + 2 + 1, sandbox_pids()
        time.sleep(0.05)
    # Its launcher was orphaned, not reaped by us; the host mount point is left for the next run to ignore.
    for d in Path(cfg.state_dir).glob(sandbox.RUN_DIR_PREFIX + "*"):
        d.rmdir()


def test_kill_uid_sweeps_a_uid(cfg):
    uid = UID_BASE + SLOTS - 1
    procs = [subprocess.Popen(["sleep", "60"], user=uid, group=uid) for _ in range(3)]
    assert sorted(sandbox.pids_of_uid(uid)) == sorted(p.pid for p in procs)
    for p in procs:  # zombies count as processes of the uid until reaped: reap them as they die
        threading.Thread(target=p.wait, daemon=True).start()
    assert sandbox.kill_uid(uid) == 3
    assert sandbox.pids_of_uid(uid) == [] and all(p.wait(timeout=1) == -9 for p in procs)

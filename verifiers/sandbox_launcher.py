"""The sandbox's launcher (verifiers/sandbox.py): L, then (after fork) I, then W. Never imported: its text is
run as ``python -I -S -c`` by root, so only builtins and ctypes (every import here is paid on each run).
argv: see ``sandbox._launcher_argv``."""
import _signal
import ctypes
import os
import sys

(code_fd, status_fd, uid, root, timeout_s, mem, nproc, fsize, nofile, disk_mb, python, py_flags, isolate,
 ro_paths) = sys.argv[1:]
code_fd, status_fd, uid, nproc, fsize, nofile, mem, disk_mb = map(
    int, (code_fd, status_fd, uid, nproc, fsize, nofile, mem, disk_mb))
timeout_s = float(timeout_s)
ro_paths = [p for p in ro_paths.split("\n") if p]
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
NS = 0x00020000 | 0x04000000 | 0x08000000 | 0x20000000 | 0x40000000  # NEWNS|NEWUTS|NEWIPC|NEWPID|NEWNET
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SIGKILL, SIGTERM, SIGALRM, SIGPIPE, SIGXFSZ = 9, 15, 14, 13, 25
os.set_inheritable(status_fd, False)  # W must not inherit it


def report(msg):
    os.write(status_fd, (msg.replace("\n", " ") + "\n").encode())


def check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {src} on {dst}")


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def make_readonly(path, mounts):
    """Read-only + nosuid for `path` and every mount below it (mount_setattr, Linux >= 5.12)."""
    attr = MountAttr(1 | 2, 0, 0, 0)  # MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID
    if libc.syscall(442, -100, path.encode(), 0x8000, ctypes.byref(attr), ctypes.sizeof(attr)) == 0:
        return  # 442: mount_setattr; -100: AT_FDCWD; 0x8000: AT_RECURSIVE
    if ctypes.get_errno() != 38:  # ENOSYS: older kernel, remount one by one (submounts of binds stay as they are)
        check(-1, f"mount_setattr {path}")
    for dst, dev in [(path, False)] + mounts:
        flags = MS_REMOUNT | MS_RDONLY | MS_NOSUID | (0 if dev else MS_NODEV) | (MS_BIND if dst != path else 0)
        mount(None, dst, None, flags)


def set_rlimit(res, value):
    check(libc.setrlimit(res, (ctypes.c_ulong * 2)(value, value)), f"setrlimit {res}")


def read_program():
    os.lseek(code_fd, 0, 0)
    chunks = []
    while chunk := os.read(code_fd, 1 << 20):
        chunks.append(chunk)
    os.close(code_fd)
    return b"".join(chunks)


def build_root(program):
    """The sandbox's filesystem under `root`, which becomes / for W (see layer 3)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # first: no mount below may propagate to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    binds, covered = [], []
    for path in ["/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc"] + ro_paths:
        if not os.path.lexists(path) or any(path == c or path.startswith(c + "/") for c in covered):
            continue
        if os.path.islink(path):  # merged-/usr layouts: /bin -> usr/bin
            os.symlink(os.readlink(path), root + path)
            continue
        os.makedirs(root + path, exist_ok=True)
        mount(path, root + path, None, MS_BIND | MS_REC)
        binds.append((root + path, False))
        covered.append(path)
    os.mkdir(root + "/dev")
    for name in ("null", "zero", "full", "random", "urandom"):
        open(root + "/dev/" + name, "w").close()
        mount("/dev/" + name, root + "/dev/" + name, None, MS_BIND)
        binds.append((root + "/dev/" + name, True))
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, root + "/dev/" + name)
    for d in ("/proc", "/tmp", "/dev/shm"):
        os.mkdir(root + d)
    make_readonly(root, binds)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={disk_mb}m,nr_inodes=16384,mode=700,uid={uid},gid={uid}")
    with open(root + "/tmp/main.py", "wb") as f:
        f.write(program)
    mount(root + "/tmp", root + "/dev/shm", None, MS_BIND)


def exec_worker(cwd):
    """W: limits, drop to the slot uid, exec the program. Never returns."""
    try:
        cpu = math_ceil(timeout_s) + 1
        check(libc.setrlimit(0, (ctypes.c_ulong * 2)(cpu, cpu + 1)), "cpu")  # RLIMIT_CPU: SIGXCPU, then SIGKILL
        set_rlimit(9, mem)  # RLIMIT_AS
        set_rlimit(1, fsize)  # RLIMIT_FSIZE
        set_rlimit(7, nofile)  # RLIMIT_NOFILE
        set_rlimit(4, 0)  # RLIMIT_CORE
        if isolate == "1":
            set_rlimit(6, nproc)  # RLIMIT_NPROC: per real uid, so per slot
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
            check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "pdeathsig")  # after setuid, which clears it
        for sig in (SIGPIPE, SIGXFSZ, SIGTERM, SIGALRM):
            _signal.signal(sig, _signal.SIG_DFL)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}
        prelude = ('__import__("builtins").exit = __import__("builtins").quit = __import__("sys").exit; '
                   '__import__("sys").argv[:] = ["main.py"]; __file__ = "main.py"; '
                   'exec(compile(open("main.py", "rb").read(), "main.py", "exec"))')
        os.execve(python, [python, *py_flags.split(), "-c", prelude], env)
    except BaseException as e:
        report(f"error worker setup: {e!r}")
    os._exit(127)


def math_ceil(x):
    return int(x) + (x > int(x))


def to_devnull():
    fd = os.open("/dev/null", os.O_RDWR)
    for i in (0, 1, 2):
        os.dup2(fd, i)
    os.close(fd)


def run_init(lifeline):
    """I: pid 1 of the new pid namespace. Builds the root, runs W, reports W's status, exits."""
    try:
        check(libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "pdeathsig")
        os.set_blocking(lifeline, False)
        try:
            if os.read(lifeline, 1) == b"":  # L died before PDEATHSIG was armed
                os._exit(1)
        except BlockingIOError:
            pass
        os.close(lifeline)
        build_root(read_program())
        os.chroot(root)
        os.chdir("/tmp")
    except BaseException as e:
        report(f"error sandbox setup: {e!r}")
        os._exit(1)
    w = os.fork()
    if w == 0:
        exec_worker("/tmp")
    to_devnull()  # the pipes' EOF should mean: W and its children are done

    def on_alarm(signum, frame):  # backstop deadline, independent of the parent
        os.kill(-1, SIGKILL)
        report("timeout")
        os._exit(0)

    _signal.signal(SIGALRM, on_alarm)
    _signal.alarm(math_ceil(timeout_s) + 2)
    while True:  # reap orphans re-parented to pid 1 until W itself exits
        pid, status, ru = os.wait4(-1, 0)
        if pid == w:
            break
    cpu = ru.ru_utime + ru.ru_stime
    if os.WIFSIGNALED(status):
        report(f"signal {os.WTERMSIG(status)} {ru.ru_maxrss} {cpu:.4f}")
    else:
        report(f"exit {os.WEXITSTATUS(status)} {ru.ru_maxrss} {cpu:.4f}")
    os._exit(0)  # the kernel now kills whatever W left behind in the namespace


def run_launcher():
    """L: unshare, fork I, wait for it. SIGTERM from the parent means: kill I now."""
    os.umask(0o022)
    if isolate != "1":  # unsandboxed debugging mode: L becomes W in the host namespaces
        os.chdir(root)
        with open("main.py", "wb") as f:
            f.write(read_program())
        exec_worker(root)
    try:
        check(libc.unshare(NS), "unshare")
    except OSError as e:
        report(f"unavailable {e}")
        os._exit(1)
    child = 0

    def on_term(signum, frame):
        if child:
            os.kill(child, SIGKILL)  # safe: I is our unreaped child, its pid cannot be reused
        else:
            os._exit(1)

    _signal.signal(SIGTERM, on_term)
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(w)
        run_init(r)
    os.close(r)
    os.close(status_fd)
    os.close(code_fd)
    to_devnull()
    os.waitpid(child, 0)
    os._exit(0)


run_launcher()

"""A real two-node Slurm cluster on this machine: slurmctld and node n1 here, node n2's slurmd in a network
namespace of its own (so a job step on n2 runs there), munge for authentication; daemons in the foreground,
stopped with the cluster. Needs root and Slurm's daemons (Debian: apt install slurmctld slurmd slurm-client munge).

    with SlurmCluster() as slurm:               # slurm.env: SLURM_CONF for sbatch, squeue...
        subprocess.run(["sbatch", "--wait", "--nodes=2", script, ...], env=slurm.env)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from netns import Netns

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "sinfo", "nsenter")


def missing() -> list[str]:
    """Slurm's programs this machine lacks ([]: a cluster can be built)."""
    return [d for d in DAEMONS if not shutil.which(d)]


class SlurmCluster:
    def __init__(self) -> None:
        k = 100 + os.getpid() % 150
        # its own folder, open to all for traversal: munged refuses a socket under a folder others cannot enter
        # (pytest's temp folders are 0700)
        self.root = Path(f"/tmp/crlslurm{os.getpid()}")
        self.netns = Netns(f"crls{os.getpid()}", f"10.233.{k}.1", f"10.233.{k}.2")
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs: list[subprocess.Popen] = []

    def _config(self) -> str:
        r, host, port = self.root, socket.gethostname(), 17000 + os.getpid() % 20000
        return "\n".join([
            "ClusterName=crltest", f"SlurmctldHost={host}({self.netns.host_ip})",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={r}/munge.sock",
            "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool-%n",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log", f"SlurmdLogFile={r}/slurmd-%n.log",
            f"SlurmctldPort={port}", f"SlurmdPort={port + 1}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "KillWait=2",  # a job's steps get SIGKILL 2 s after SIGTERM when it ends (the Ray daemons' steps)
            f"NodeName=n1 NodeHostname={host} NodeAddr={self.netns.host_ip} CPUs=2 RealMemory=8000 State=UNKNOWN",
            f"NodeName=n2 NodeHostname={host} NodeAddr={self.netns.ns_ip} CPUs=2 RealMemory=8000 State=UNKNOWN",
            "PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE", ""])

    def _daemon(self, *cmd: str) -> None:
        log = open(self.root / f"{cmd[-1] if cmd[-2] == '-N' else Path(cmd[0]).name}.out", "ab")
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def __enter__(self) -> SlurmCluster:
        r = self.root
        r.mkdir(mode=0o755, exist_ok=True)
        r.chmod(0o755)
        for d in ("state", "spool-n1", "spool-n2"):
            (r / d).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._config())
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.netns.__enter__()
        try:
            self._daemon("munged", "-F", f"--key-file={key}", f"--socket={r}/munge.sock", f"--pid-file={r}/munged.pid",
                         f"--log-file={r}/munged.log", f"--seed-file={r}/munge.seed")
            time.sleep(0.5)
            self._daemon("slurmctld", "-D")
            time.sleep(1.0)
            self._daemon("slurmd", "-D", "-N", "n1")
            # nsenter, not `ip netns exec`: the latter mounts a fresh /sys, without the cgroup tree slurmd reads
            self._daemon("nsenter", f"--net=/var/run/netns/{self.netns.name}", "slurmd", "-D", "-N", "n2")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                out = subprocess.run(["sinfo", "-h", "-o", "%t %D"], capture_output=True, text=True,
                                     env=self.env).stdout.split()
                if out == ["idle", "2"]:
                    return self
                time.sleep(0.5)
            raise RuntimeError(f"Slurm's two nodes are not idle after 60 s: sinfo says {out}; see {r}/*.log")
        except BaseException:
            self.__exit__()
            raise

    def wait_job(self, job_id: str, timeout_s: float) -> tuple[str, str]:
        """(JobState, ExitCode) of a job once it has ended, polled every 0.5 s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = subprocess.run(["scontrol", "show", "job", job_id, "-o"], capture_output=True, text=True,
                                 env=self.env).stdout
            fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
            if fields.get("JobState") not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return fields["JobState"], fields.get("ExitCode", "")
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still running after {timeout_s} s")

    def _steps(self) -> list[int]:
        """Our cluster's step daemons (slurmstepd, detached from slurmd): those whose SLURM_CONF is ours."""
        mine = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if mine in environ.read_bytes().split(b"\0") and b"slurmstepd" in (environ.parent / "cmdline").read_bytes():
                    pids.append(int(environ.parent.name))
            except OSError:
                continue
        return pids

    def __exit__(self, *exc) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True)
        deadline = time.monotonic() + 20  # the steps end (KillWait) before their daemons stop
        while self._steps() and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in self._steps():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        for p in reversed(self.procs):
            p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.netns.__exit__()
        shutil.rmtree(self.root, ignore_errors=True)

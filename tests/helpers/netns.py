"""A network namespace joined to this one by a veth pair: a second "host" on this machine (root only).

    with Netns("crl123", "10.232.5.1", "10.232.5.2") as ns:    # this side .1, the namespace .2
        subprocess.run(["ip", "netns", "exec", ns.name, ...])
"""

from __future__ import annotations

import subprocess


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Netns:
    def __init__(self, name: str, host_ip: str, ns_ip: str) -> None:
        self.name, self.host_ip, self.ns_ip = name, host_ip, ns_ip
        self.host_if, self.ns_if = f"{name}h"[-15:], f"{name}n"[-15:]

    def __enter__(self) -> Netns:
        sh("ip", "netns", "add", self.name)
        try:
            sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            sh("ip", "link", "set", self.ns_if, "netns", self.name)
            sh("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
            sh("ip", "link", "set", self.host_if, "up")
            for cmd in (["ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if],
                        ["ip", "link", "set", self.ns_if, "up"], ["ip", "link", "set", "lo", "up"]):
                sh("ip", "netns", "exec", self.name, *cmd)
        except BaseException:
            self.__exit__()
            raise
        return self

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

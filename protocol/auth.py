"""Who may talk to a run: ZeroMQ CURVE on every tcp socket (docs/ARCHITECTURE.md §6, "Authentication").

The supervisor makes two keypairs per launch (``RunKeys.generate``): one for every socket that binds
(servers: the orchestrator's ROUTER, the supervisor's heartbeat PULL and control REP, the trainer's
weights PUB, the stream transport's ROUTER) and one for every socket that connects (clients: workers'
DEALER/SUB/PUSH, the stream receiver, ``cascade-rl ctl``). It writes them to ``run_dir/auth.keys``,
created with mode 0600 (``O_CREAT|O_EXCL``, never world-readable), and puts that file's *path* in
``config.yaml`` (``auth_keys``); config.yaml itself holds no secret. Each process loads the file once
(``install_from_config``, called by ``worker_start``) and from then on every socket is made reachable
through ``bind``/``connect`` here, which apply CURVE when the endpoint is tcp and keys are installed:

* a server socket gets the run's server secret key and ``curve_server``, and its context a ZAP
  authenticator (``zmq.auth.thread.ThreadAuthenticator``) that admits only the run's client public key:
  a peer without CURVE, with other keys, or that learnt the server's public key but not the run's
  client secret never completes the handshake -- no message crosses in either direction;
* a client socket gets the run's client keypair and the server's public key.

ipc endpoints (one machine) stay plain: their socket folder (and the run's /dev/shm weights folder) is
mode 0700, so only the run's user reaches them -- the same user who can read the key file anyway.
Without keys installed (``auth=false``, or sockets made outside a launch, as in unit tests) ``bind`` and
``connect`` are plain bind and connect.
"""

from __future__ import annotations

import hmac
import json
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

KEY_FILE = "auth.keys"  # in run_dir


class AuthError(RuntimeError):
    """The run's keys cannot be made, read or used (no CURVE in libzmq, a missing or exposed key file)."""


def curve_available() -> bool:
    return bool(zmq.has("curve"))


@dataclass(frozen=True)
class RunKeys:
    """The run's two CURVE keypairs, each key z85-encoded (40 bytes)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> RunKeys:
        if not curve_available():
            raise AuthError(f"this libzmq ({zmq.zmq_version()}) has no CURVE security: install a pyzmq wheel "
                            f"(it bundles libsodium), or set auth=false on a trusted network")
        (sp, ss), (cp, cs) = zmq.curve_keypair(), zmq.curve_keypair()
        return cls(sp, ss, cp, cs)

    def write(self, path: str | Path) -> Path:
        """Write the keys to ``path`` readable by this user only (0600). An older file there (a resumed
        run_dir) is replaced: it is unlinked first, then the new one created exclusively (O_EXCL: never
        written through a link someone else planted)."""
        path = Path(path)
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({k: v.decode() for k, v in self.__dict__.items()}, f)
        return path

    @classmethod
    def load(cls, path: str | Path) -> RunKeys:
        path = Path(path)
        try:
            st = path.stat()
            data = json.loads(path.read_text())
            keys = cls(**{k: data[k].encode() for k in cls.__dataclass_fields__})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise AuthError(f"cannot read the run's key file {path}: {e}") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AuthError(f"the run's key file {path} is readable by others (mode {st.st_mode & 0o777:o}): "
                            f"refusing it; it must be 0600")
        return keys


_lock = threading.Lock()
_keys: RunKeys | None = None
_authenticators: dict[int, ThreadAuthenticator] = {}  # id(context) -> its ZAP handler


def install(keys: RunKeys | None) -> None:
    """Use ``keys`` for every socket this process binds or connects from now on (None: plain sockets)."""
    global _keys
    _keys = keys


def installed() -> RunKeys | None:
    return _keys


def install_from_config(cfg) -> RunKeys | None:
    """Install the keys of the run whose resolved config is ``cfg`` (its ``auth_keys`` file), if it has any."""
    path = cfg.get("auth_keys") if hasattr(cfg, "get") else None
    install(RunKeys.load(path) if path else None)
    return _keys


def applies(endpoint: str) -> bool:
    """Whether a socket on ``endpoint`` gets CURVE in this process: a tcp endpoint with keys installed."""
    return _keys is not None and endpoint.startswith("tcp://")


class _RunClient:
    """ZAP credentials provider: admit the run's client public key and nothing else."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.public)


def _authenticator(ctx: zmq.Context, keys: RunKeys) -> None:
    with _lock:
        auth = _authenticators.get(id(ctx))
        if auth is None or auth.context is not ctx:
            auth = ThreadAuthenticator(ctx)
            auth.start()
            _authenticators[id(ctx)] = auth
        auth.configure_curve_callback("*", credentials_provider=_RunClient(keys.client_public))


def release(ctx: zmq.Context) -> None:
    """Stop the ZAP handler of ``ctx`` (before ``ctx.term()``: its socket would hold the term up)."""
    with _lock:
        auth = _authenticators.pop(id(ctx), None)
    if auth is not None:
        auth.stop()


def secure(sock: zmq.Socket, endpoint: str, server: bool) -> zmq.Socket:
    """Apply the run's CURVE keys to ``sock`` (before it binds or connects ``endpoint``) as a server or a
    client; a no-op for ipc/inproc endpoints or with no keys installed."""
    keys = _keys
    if keys is None or not endpoint.startswith("tcp://"):
        return sock
    if server:
        _authenticator(sock.context, keys)  # before bind: a CURVE server with no ZAP handler admits any key
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True
    else:
        sock.curve_secretkey = keys.client_secret
        sock.curve_publickey = keys.client_public
        sock.curve_serverkey = keys.server_public
    return sock


def bind(sock: zmq.Socket, endpoint: str) -> zmq.Socket:
    """``sock.bind(endpoint)`` as a CURVE server where that applies (every binding socket of a run)."""
    secure(sock, endpoint, server=True).bind(endpoint)
    return sock


def connect(sock: zmq.Socket, endpoint: str) -> zmq.Socket:
    """``sock.connect(endpoint)`` as a CURVE client where that applies (every connecting socket of a run)."""
    secure(sock, endpoint, server=False).connect(endpoint)
    return sock


def private_dir(path: str | Path) -> Path:
    """Make ``path`` (and missing parents) and restrict it to this user (0700): a run's ipc socket folder
    and its /dev/shm weights folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path

"""Authentication (protocol/auth.py): CURVE on tcp sockets admits the run's clients and no one else; a real
tcp launch ignores an intruder that knows every endpoint."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import zmq

from cascade_rl.protocol import auth
from cascade_rl.protocol.messages import Control, ControlReply, Ready, WeightsReady
from cascade_rl.protocol.sockets import bind_router, recv, recv_routed, send

CLI = [sys.executable, "-m", "cascade_rl.supervisor.cli"]
pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


@pytest.fixture
def keys():
    keys = auth.RunKeys.generate()
    auth.install(keys)
    yield keys
    auth.install(None)


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    auth.release(ctx)
    ctx.destroy(linger=0)


def _port_endpoint(sock: zmq.Socket) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _intruder(ctx: zmq.Context, kind: int, endpoint: str, how: str, keys: auth.RunKeys) -> zmq.Socket:
    """A client that is not the run's: plain, or CURVE with its own keypair and the server's public key
    (it learnt that, but not the run's client secret)."""
    sock = ctx.socket(kind)
    sock.linger = 0
    if kind == zmq.DEALER:
        sock.identity = f"intruder-{how}".encode()
    if how == "curve-own-keys":
        public, secret = zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, keys.server_public
    if kind == zmq.SUB:
        sock.subscribe(b"")
    sock.connect(endpoint)
    return sock


def test_key_file_is_private_made_exclusively_and_refused_when_exposed(tmp_path):
    keys = auth.RunKeys.generate()
    path = keys.write(tmp_path / auth.KEY_FILE)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert auth.RunKeys.load(path) == keys
    again = auth.RunKeys.generate().write(path)  # a resumed run_dir: a fresh file, still 0600
    assert stat.S_IMODE(again.stat().st_mode) == 0o600 and auth.RunKeys.load(path) != keys
    os.chmod(path, 0o644)
    with pytest.raises(auth.AuthError, match="readable by others"):
        auth.RunKeys.load(path)
    with pytest.raises(auth.AuthError, match="cannot read"):
        auth.RunKeys.load(tmp_path / "missing")


def test_curve_server_admits_the_runs_clients_only(keys, ctx):
    router = bind_router(ctx, "tcp://127.0.0.1:0")  # the orchestrator's ROUTER, as it makes it
    endpoint = _port_endpoint(router)
    pub = ctx.socket(zmq.PUB)
    pub.linger = 0
    auth.bind(pub, "tcp://127.0.0.1:0")
    pub_endpoint = _port_endpoint(pub)
    assert router.curve_server and pub.curve_server

    # intruders first: plain, and CURVE with the server's public key but not the run's client keys
    intruders = [(_intruder(ctx, zmq.DEALER, endpoint, how, keys), _intruder(ctx, zmq.SUB, pub_endpoint, how, keys))
                 for how in ("plain", "curve-own-keys")]
    for dealer, _ in intruders:
        send(dealer, Ready("verifier-0", "verifier", slots=4, version=0))
    # the run's own client, made as every worker makes its sockets
    good = auth.connect(ctx.socket(zmq.DEALER), endpoint)
    good_sub = auth.connect(ctx.socket(zmq.SUB), pub_endpoint)
    good_sub.subscribe(b"")
    good.linger = good_sub.linger = 0
    send(good, Ready("sampler-0", "sampler", slots=1, version=0))
    assert router.poll(5000), "the run's client was refused"
    ident, msg = recv_routed(router, (Ready,))
    assert msg.worker_id == "sampler-0"
    send(router, WeightsReady(version=1, uri="file:///x"), identity=ident)
    assert good.poll(5000) and recv(good, (WeightsReady,)).version == 1
    deadline = time.monotonic() + 5
    while not good_sub.poll(100) and time.monotonic() < deadline:  # a SUB joins a moment after connecting
        send(pub, WeightsReady(version=2, uri="file:///y"))
    assert recv(good_sub, (WeightsReady,)).version == 2
    for _ in range(5):
        send(pub, WeightsReady(version=3, uri="file:///z"))
        time.sleep(0.1)

    # nothing crossed with an intruder in either direction
    assert not router.poll(1000)  # no Ready of theirs arrived (only the good one did)
    for dealer, sub in intruders:
        assert not dealer.poll(0) and not sub.poll(0)
    for how in ("plain", "curve-own-keys"):  # and the ROUTER never learnt a route to them (ROUTER_MANDATORY)
        with pytest.raises(zmq.ZMQError):
            send(router, WeightsReady(version=4, uri="file:///w"), identity=f"intruder-{how}".encode())
    for s in (good, good_sub, *(s for pair in intruders for s in pair)):
        s.close(0)


def test_ipc_endpoints_stay_plain_and_no_keys_means_plain_tcp(tmp_path, ctx):
    auth.install(auth.RunKeys.generate())
    try:
        rep = auth.bind(ctx.socket(zmq.REP), f"ipc://{tmp_path}/control")
        assert not rep.curve_server
        req = ctx.socket(zmq.REQ)
        req.connect(f"ipc://{tmp_path}/control")  # a plain client: the folder's mode is the guard here
        send(req, Control("status", {}))
        assert rep.poll(5000) and recv(rep, (Control,)).op == "status"
        send(rep, ControlReply(True, {}))
        assert req.poll(5000)
    finally:
        auth.install(None)
    plain = auth.bind(ctx.socket(zmq.PULL), "tcp://127.0.0.1:0")
    assert not plain.curve_server
    for s in (rep, req, plain):
        s.close(0)


def test_private_dir_is_the_users_only(tmp_path):
    path = auth.private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


# --------------------------------------------------------------------------- a real run over tcp

INTRUDER = textwrap.dedent("""
    # Knows the run's endpoints (config.yaml is world-readable) but not its keys. Joins as a verifier that
    # answers every score request with reward 1.0, subscribes to the weights, and tries ctl stop.
    import json, sys, time
    import zmq, yaml
    from cascade_rl.protocol.messages import Control, Ready, Score, ScoreRequest, GroupScoreRequest, WeightsReady
    from cascade_rl.protocol.sockets import recv, send

    endpoints = yaml.safe_load(open(sys.argv[1]))["endpoints"]
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER); dealer.linger = 0
    dealer.identity = b"verifier-intruder"
    dealer.connect(endpoints["orchestrator"])
    sub = ctx.socket(zmq.SUB); sub.linger = 0; sub.subscribe(b""); sub.connect(endpoints["weights"])
    ctl = ctx.socket(zmq.REQ); ctl.linger = 0; ctl.connect(endpoints["control"])
    beat = ctx.socket(zmq.PUSH); beat.linger = 0; beat.connect(endpoints["heartbeat"])
    send(dealer, Ready("verifier-intruder", "verifier", slots=64, version=0, domains=["math"]))
    send(ctl, Control("stop", {}))
    got = {"work": 0, "weights": 0, "control": 0, "connected": True}
    end = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < end:  # until the test ends it
        for sock, key in ((dealer, "work"), (sub, "weights"), (ctl, "control")):
            if sock.poll(50):
                msg = recv(sock)
                got[key] += 1
                if isinstance(msg, (ScoreRequest, GroupScoreRequest)):
                    send(dealer, Score(msg.key, reward=1.0, ok=True))
        with open(sys.argv[2], "w") as f:
            json.dump(got, f)
""")


@pytest.mark.slow
def test_a_tcp_run_gives_an_intruder_nothing_and_trains_on_nothing_of_theirs(tiny_model, math_data, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"))
    proc = subprocess.Popen([*CLI, "launch", "tiny", f"run_dir={run_dir}", f"model.path={tiny_model}", *math_data,
                             "host=127.0.0.1", "weights_transport=stream", "supervisor.progress=none"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (run_dir / "supervisor.json").is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    report = tmp_path / "intruder.json"
    intruder = subprocess.Popen([sys.executable, "-c", INTRUDER, str(run_dir / "config.yaml"), str(report), "150"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # the run's own client (ctl, with the run's key file) is answered meanwhile
        status = subprocess.run([*CLI, "ctl", "--run-dir", str(run_dir), "status", "--json"], capture_output=True,
                                text=True, env=env, timeout=30)
        out, _ = proc.communicate(timeout=150)
    finally:
        proc.kill() if proc.poll() is None else None
        intruder.kill()
    i_out, _ = intruder.communicate(timeout=30)
    assert proc.returncode == 0, out[-3000:]
    got = json.loads(report.read_text())  # written by the intruder while the whole run went on
    assert got == {"work": 0, "weights": 0, "control": 0, "connected": True}, i_out
    assert status.returncode == 0, status.stderr
    assert {w["role"] for w in json.loads(status.stdout)} >= {"orchestrator", "trainer"}

    config = (run_dir / "config.yaml").read_text()
    assert "tcp://127.0.0.1:" in config and "ipc://" not in config
    keys_path = run_dir / auth.KEY_FILE
    assert stat.S_IMODE(keys_path.stat().st_mode) == 0o600
    keys = auth.RunKeys.load(keys_path)
    for secret in (keys.server_secret, keys.client_secret):
        assert secret.decode() not in config  # config.yaml holds the key file's path only

    summary = json.loads((run_dir / "summary.json").read_text())
    books = summary["books"]
    steps, groups, g = 3, 8, 4  # configs/run/tiny.yaml, as in tests/test_launch.py
    assert summary["steps"] == steps and summary["policy_version"] == steps
    assert books["lost"] == 0 and books["in_flight"] == 0 and books["duplicates_dropped"] == 0
    assert books["dispatched"] == books["trained"] + books["filtered"] + books["stale"]
    assert books["trained"] == steps * groups * g
    assert "verifier-intruder" not in (run_dir / "logs" / "orchestrator.log").read_text()  # never joined
    log = (run_dir / "logs" / "sampler-0.log").read_text()
    assert "cannot load weights" not in log  # the run's own sampler got the streamed weights


def test_a_tcp_launch_is_refused_without_curve_in_libzmq(tiny_model, math_data, tmp_path, monkeypatch):
    from cascade_rl.supervisor.config import compose
    from cascade_rl.supervisor.config_errors import ConfigError
    from cascade_rl.supervisor.launch import Supervisor

    monkeypatch.setattr(auth, "curve_available", lambda: False)
    cfg = compose("tiny", [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model}", *math_data, "host=127.0.0.1"])
    with pytest.raises(ConfigError, match="no CURVE security.*auth=false"):
        Supervisor(cfg)
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before any endpoint, key or process

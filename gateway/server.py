"""The gateway process: the OpenAI-compatible chat API users' agents call, in front of the orchestrator.

    python -m cascade_rl.gateway.server --config RUN_DIR/config.yaml --worker-id gateway-0

Started by the supervisor when the data has agent rows (``gateway`` in supervisor/procs.py ``ROLES``). It loads
the model's tokenizer (torch-free, data/tokenizer.py) and chat template, reads the run's gateway secret
(``gateway.secret_file``), connects a ``WorkerLink`` to the orchestrator (``Ready(slots=0)``: it takes no work,
it asks for it; heartbeats with the counters of gateway/calls.py) and serves HTTP on ``gateway.host`` (else the run's
``host``, else 127.0.0.1) : ``gateway.port``, the address of ``gateway.base_url`` (supervisor/gateway_setup.py):

- ``POST /v1/chat/completions`` (``Authorization: Bearer <session key>``): one model call of the key's trajectory
  (gateway/api.py reads the request, gateway/sessions.py turns it into token ids, gateway/calls.py sends
  ``GatewayGenerate`` and waits); a ``chat.completion`` with ``tool_calls`` parsed from the sampled text;
- ``POST /rl/reward`` (same auth): ``{"reward": number}`` -> ``GatewayReward`` to the orchestrator;
- ``GET /v1/models`` (auth): the served name; ``GET /health`` (no auth): 200.

Errors have OpenAI's shape (401 without a valid session key). A dispatcher thread hands each arriving ``Rollout``
or ``GatewayRefused`` / ``GatewayEnded`` to the call waiting for its key, and forgets idle sessions. SIGTERM stops it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time

from cascade_rl.data.render import PromptRenderer, TurnRenderer
from cascade_rl.data.tokenizer import load_tokenizer
from cascade_rl.protocol.agents import GatewayEnded, GatewayRefused, read_secret
from cascade_rl.protocol.messages import Ready, Rollout
from cascade_rl.protocol.sockets import WorkerLink
from cascade_rl.protocol.worker_main import worker_start
from cascade_rl.samplers.json_http import JsonHandler, JsonServer

from .api import RunSampling
from .calls import Gateway
from .sessions import SessionRules

log = logging.getLogger("gateway")

SWEEP_S = 60.0  # how often the dispatcher looks for idle sessions


def build_gateway(cfg) -> Gateway:
    """The gateway of a run's config (tokenizer, template, secret, sampling); its ``send`` is set by ``start``."""
    render = PromptRenderer(load_tokenizer(cfg.model.path), thinking=bool(cfg.data.thinking))
    sampling = cfg.sampling
    run = RunSampling(float(sampling.temperature), float(sampling.top_p), int(sampling.max_tokens))
    gw_cfg = cfg.gateway
    return Gateway(SessionRules(TurnRenderer(render)), read_secret(gw_cfg.secret_file), None, run,
                   served_name=str(gw_cfg.served_name), call_timeout_s=float(gw_cfg.call_timeout_s))


def handler_for(gateway: Gateway) -> type[JsonHandler]:
    class Handler(JsonHandler):
        name = "the gateway"
        routes = {
            ("GET", "/health"): lambda handler, body: (200, {"status": "ok"}, {}),
            ("GET", "/v1/models"): lambda handler, body: gateway.models(handler.bearer()),
            ("POST", "/v1/chat/completions"): lambda handler, body: gateway.chat(handler.bearer(), body),
            ("POST", "/rl/reward"): lambda handler, body: gateway.reward(handler.bearer(), body),
        }

    return Handler


@dataclasses.dataclass
class Running:
    """A started gateway: its HTTP server, its link to the orchestrator and its dispatcher."""

    gateway: Gateway
    httpd: JsonServer
    link: WorkerLink
    stop: threading.Event

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.link.close()


def dispatch(gateway: Gateway, inbox: queue.Queue, stop: threading.Event) -> None:
    """The dispatcher thread: each answer to the call waiting for it; idle sessions forgotten every ``SWEEP_S``."""
    next_sweep = time.monotonic() + SWEEP_S
    while not stop.is_set():
        try:
            msg = inbox.get(timeout=0.5)
        except queue.Empty:
            msg = None
        if isinstance(msg, (Rollout, GatewayRefused, GatewayEnded)):
            gateway.resolve(msg)
        if time.monotonic() >= next_sweep:
            if dropped := gateway.sweep():
                log.info("forgot %d idle sessions", dropped)
            next_sweep = time.monotonic() + SWEEP_S


def start(gateway: Gateway, cfg, worker_id: str) -> Running:
    """Connect to the orchestrator (Ready), start the dispatcher and serve HTTP on the config's host and port."""
    ep = cfg.endpoints
    link = WorkerLink(worker_id, "gateway", ep.orchestrator, ep.get("heartbeat") or None, None,
                      expect=(Rollout, GatewayRefused, GatewayEnded), status=gateway.status,
                      heartbeat_s=float(cfg.supervisor.heartbeat_s))
    link.start()
    gateway.send = link.send
    link.send(Ready(worker_id, "gateway", slots=0))
    host, port = cfg.gateway.host or cfg.get("host") or "127.0.0.1", int(cfg.gateway.port)  # as its base_url says
    try:
        httpd = JsonServer((host, port), handler_for(gateway))
    except OSError as e:
        link.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {e}") from None
    stop = threading.Event()
    threading.Thread(target=dispatch, args=(gateway, link.inbox, stop), name="dispatch", daemon=True).start()
    threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()
    return Running(gateway, httpd, link, stop)


def main(argv: list[str] | None = None) -> None:
    args, cfg = worker_start(__doc__.splitlines()[0], argv)
    running = start(build_gateway(cfg), cfg, args.worker_id)
    log.info("serving %s as %r at %s/v1", cfg.model.path, cfg.gateway.served_name, running.url)
    try:
        while True:
            time.sleep(3600)
    finally:  # SIGTERM is a SystemExit here (worker_start)
        log.info("stopped: %s", json.dumps(running.gateway.status()["counters"]))
        running.close()


if __name__ == "__main__":
    main()

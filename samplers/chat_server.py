"""An OpenAI-compatible chat server over a sampler engine: how the supervisor serves the judge model.

    python -m cascade_rl.samplers.chat_server --model DIR --port 8000 [--host 127.0.0.1] [--served-model-name judge]
        [--engine torch] [--max-batch 64] [--batch-window-s 0.005] [--max-tokens-default 256] [--threads 0]
    curl -s localhost:8000/v1/chat/completions -d '{"model": "judge", "messages": [{"role": "user", "content": "hi"}]}'

``verifier.judge.serve=torch`` starts it (supervisor/judge.py); the GenRM and LLM-judge verifiers call it
through verifiers/llm_judge.py ``ChatClient``, as they would call vLLM. Endpoints:

- ``GET /health``: 200 once the model is loaded (503 while it loads: clients retry a 5xx);
- ``GET /v1/models``: the served name, as an OpenAI model list;
- ``POST /v1/chat/completions``: ``{model, messages, max_tokens, temperature, top_p, seed, n (1), stop,
  chat_template_kwargs}`` -> an OpenAI ``chat.completion`` (samplers/chat_api.py reads the request and writes
  the reply; errors are vLLM's: 404 for another model name, 400 for a bad request or a prompt over the context);
- ``GET /stats``: requests, batches, the largest batch, tokens (how well concurrent requests batch).

Prompts are rendered in the model's own chat template and the reply is the decoded generated tokens
(special tokens skipped; ``<think>``/``</think>`` stay, the judges read the verdict after the last one).
Request threads (``ThreadingHTTPServer``) put jobs on a queue; ONE engine thread takes a burst (the first
job, then whatever arrives within ``--batch-window-s``, up to ``--max-batch``) and generates it with one
``generate`` call, so concurrent judge calls decode together. Temperature 0 is greedy; a ``seed`` seeds the
batch it lands in (the torch engine draws one generator per batch), so only greedy replies repeat exactly.
SIGTERM stops it: the socket closes, requests still waiting get 503, exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable

from .chat_api import ApiError, ChatRequest, completion, model_list, parse_chat
from .engine import ENGINES, GenerationRequest, Sample, register_builtin_engines
from .json_http import JsonHandler, JsonServer

log = logging.getLogger("chat_server")


@dataclasses.dataclass
class Job:
    """One completion waiting for the engine thread; ``done`` is set with ``sample`` or ``error``."""

    request: GenerationRequest
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    sample: Sample | None = None
    error: ApiError | None = None


class Batcher:
    """The engine thread: bursts of jobs, one ``generate`` call per burst."""

    def __init__(self, engine, max_batch: int, window_s: float) -> None:
        self.engine, self.max_batch, self.window_s = engine, max_batch, window_s
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.lock = threading.Lock()
        self.stats = {"requests": 0, "batches": 0, "largest_batch": 0, "batched_requests": 0, "active": 0,
                      "prompt_tokens": 0, "completion_tokens": 0, "errors": 0}
        self.stopped = False

    def submit(self, request: GenerationRequest) -> Sample:
        """Blocks the calling request thread until its sample is generated; raises ``ApiError``."""
        job = Job(request)
        if self.stopped:
            raise ApiError(503, "the server is shutting down", "ServiceUnavailableError")
        self.jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.sample

    def run(self) -> None:
        while (first := self.jobs.get()) is not None:
            burst, t_end = [first], time.monotonic() + self.window_s
            while len(burst) < self.max_batch:  # the rest of the burst: concurrent judge calls decode together
                try:
                    job = self.jobs.get(timeout=max(0.0, t_end - time.monotonic()))
                except queue.Empty:
                    break
                if job is None:
                    self.jobs.put(None)  # stop after this burst
                    break
                burst.append(job)
            self._generate(burst)
        self._fail_waiting()

    def _generate(self, burst: list[Job]) -> None:
        with self.lock:
            self.stats["active"] = len(burst)
        t0 = time.perf_counter()
        try:
            groups = self.engine.generate([job.request for job in burst])
        except Exception as e:  # the engine's failure is every job's answer; the server lives on
            log.exception("generate failed for a batch of %d", len(burst))
            for job in burst:
                job.error = ApiError(500, f"generation failed: {type(e).__name__}: {e}", "InternalServerError")
                job.done.set()
            with self.lock:
                self.stats["errors"] += len(burst)
                self.stats["active"] = 0
            return
        for job, samples in zip(burst, groups):
            job.sample = samples[0]
            job.done.set()
        with self.lock:
            s = self.stats
            s["requests"] += len(burst)
            s["batches"] += 1
            s["largest_batch"] = max(s["largest_batch"], len(burst))
            s["batched_requests"] += len(burst) if len(burst) > 1 else 0
            s["prompt_tokens"] += sum(len(job.request.prompt_ids) for job in burst)
            s["completion_tokens"] += sum(len(job.sample.response_ids) for job in burst)
            s["active"] = 0
        log.debug("batch of %d in %.3f s", len(burst), time.perf_counter() - t0)

    def stop(self) -> None:
        self.stopped = True
        self.jobs.put(None)

    def _fail_waiting(self) -> None:
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.error = ApiError(503, "the server is shutting down", "ServiceUnavailableError")
                job.done.set()

    def snapshot(self) -> dict:
        with self.lock:
            return {**self.stats, "queued": self.jobs.qsize()}


class ChatServer:
    """The model (loaded after the socket is bound, so /health can say 503 meanwhile) and its routes."""

    def __init__(self, model: str, served_name: str, engine: str = "torch", device: str = "cpu",
                 dtype: str = "float32", max_batch: int = 64, batch_window_s: float = 0.005,
                 max_tokens_default: int = 256) -> None:
        self.model, self.served_name, self.engine_name = model, served_name, engine
        self.device, self.dtype = device, dtype
        self.max_batch, self.batch_window_s, self.max_tokens_default = max_batch, batch_window_s, max_tokens_default
        self.batcher: Batcher | None = None
        self.tokenizer = None
        # request threads share one fast tokenizer: a Rust tokenizer used from two threads at once can fail with
        # "Already borrowed" (transformers may reset its padding/truncation state per call), so one at a time
        self.tokenizer_lock = threading.Lock()
        self.max_context = 0
        self.routes: dict[tuple[str, str], Callable[[dict | None], tuple[int, dict]]] = {
            ("GET", "/health"): self.health,
            ("GET", "/v1/models"): lambda _: (200, model_list(self.served_name)),
            ("GET", "/stats"): self.stats,
            ("POST", "/v1/chat/completions"): self.chat,
        }

    def load(self) -> None:
        """Tokenizer and engine (seconds for a tiny model, minutes for a large one), then the engine thread."""
        from transformers import AutoConfig, AutoTokenizer

        register_builtin_engines()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        engine = ENGINES[self.engine_name](self.model, device=self.device, dtype=self.dtype)
        self.max_context = int(getattr(engine, "max_context", 0) or AutoConfig.from_pretrained(self.model)
                               .max_position_embeddings)
        self.batcher = Batcher(engine, self.max_batch, self.batch_window_s)
        threading.Thread(target=self.batcher.run, name="engine", daemon=True).start()

    def health(self, _body) -> tuple[int, dict]:
        if self.batcher is None:
            raise ApiError(503, "the model is loading", "ServiceUnavailableError")
        return 200, {"status": "ok"}

    def stats(self, _body) -> tuple[int, dict]:
        return 200, self.batcher.snapshot() if self.batcher else {}

    def chat(self, body: dict | None) -> tuple[int, dict]:
        self.health(None)
        req: ChatRequest = parse_chat(body, self.served_name, self.max_tokens_default)
        with self.tokenizer_lock:
            try:
                text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False,
                                                          **req.chat_template_kwargs)
            except Exception as e:  # a template that refuses these messages (an unknown role, a bad kwarg)
                raise ApiError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}") \
                    from None
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) + req.max_tokens > self.max_context:
            raise ApiError(400, f"This model's maximum context length is {self.max_context} tokens. However, you "
                                f"requested {len(ids) + req.max_tokens} tokens ({len(ids)} in the messages, "
                                f"{req.max_tokens} in the completion). Please reduce the length of the messages or "
                                f"completion.")
        gen = req.generation(ids)
        if reason := self.batcher.engine.check(gen):
            raise ApiError(400, reason)
        sample = self.batcher.submit(gen)
        with self.tokenizer_lock:
            reply = self.tokenizer.decode(sample.response_ids.tolist(), skip_special_tokens=True)
        return 200, completion(self.served_name, reply, sample.finish_reason, len(ids), len(sample.response_ids))


def _as_route(route: Callable[[dict | None], tuple[int, dict]]):
    """A chat-server route (body -> status, payload) as a JsonHandler's (handler, body -> status, payload, headers)."""
    return lambda _handler, body: (*route(body), {})


def handler_for(server: ChatServer) -> type[JsonHandler]:
    class Handler(JsonHandler):
        routes = {key: _as_route(route) for key, route in server.routes.items()}

        def warn(self, status: int) -> bool:
            return status >= 500 and status != 503  # 503: loading or stopping, what /health polls see

    return Handler


class _Stop(Exception):
    """SIGTERM: leave the main thread's wait (or the model load) and shut down."""


def _on_sigterm(*_) -> None:
    raise _Stop


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory (weights, tokenizer, chat template)")
    p.add_argument("--port", type=int, default=8000, help="0: a free port (logged)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--served-model-name", default="judge", help="the name requests must give as `model`")
    p.add_argument("--engine", default="torch", help="a sampler engine registered in samplers/engine.py")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    p.add_argument("--max-batch", type=int, default=64, help="most requests generated in one engine call")
    p.add_argument("--batch-window-s", type=float, default=0.005,
                   help="after the first request of a burst, how long to wait for the rest")
    p.add_argument("--max-tokens-default", type=int, default=256, help="max_tokens of a request that gives none")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.max_batch < 1 or args.batch_window_s < 0 or args.max_tokens_default < 1:
        p.error("need --max-batch >= 1, --batch-window-s >= 0 and --max-tokens-default >= 1")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s judge %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to the log
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    server = ChatServer(args.model, args.served_model_name, args.engine, args.device, args.dtype, args.max_batch,
                        args.batch_window_s, args.max_tokens_default)
    try:
        httpd = JsonServer((args.host, args.port), handler_for(server))
    except OSError as e:
        raise SystemExit(f"cannot listen on {args.host}:{args.port}: {e}") from None
    host, port = httpd.server_address[:2]
    threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()
    try:
        log.info("listening on http://%s:%d; loading %s (engine %s, %s)", host, port, args.model, args.engine,
                 args.device)
        t0 = time.perf_counter()
        try:
            server.load()
        except _Stop:
            raise
        except Exception as e:  # a directory that is not a model, an architecture the engine refuses: one line
            log.debug("load failed", exc_info=True)
            raise SystemExit(f"cannot serve {args.model} with the {args.engine} engine: {type(e).__name__}: {e}") \
                from None
        log.info("serving %s as %r at http://%s:%d (loaded in %.1f s)", args.model, args.served_model_name, host,
                 port, time.perf_counter() - t0)
        while True:
            time.sleep(3600)
    except _Stop:
        log.info("SIGTERM: stopping")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop is enough
        httpd.shutdown()
        httpd.server_close()
        if server.batcher is not None:
            log.info("stopped: %s", json.dumps(server.batcher.snapshot()))
            server.batcher.stop()


if __name__ == "__main__":
    main()

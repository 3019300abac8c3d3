"""The SGLang engine: the engine interface over an SGLang server's native HTTP API.

    sampler.engine=sglang gpus.samplers=[1]     (GPU machines with `pip install sglang`)

Each sampler talks to one SGLang server, a process of its own that the supervisor
starts on the sampler's GPU (``server_command``: ``python -m sglang.launch_server
--model-path DIR --port P ...`` with the options of ``sampler.sglang``), watches and
stops with the run; its log is ``logs/sglang-i.log``. ``sampler.sglang.url`` points
every sampler at a server you run yourself instead. The sampler process itself holds
no model and no GPU memory. SGLang needs CUDA, so on CPU-only machines the supervisor
refuses this engine before launch and its tests skip with that reason. Endpoints used
(SGLang's documented native API):

* ``GET /health`` — readiness;
* ``POST /generate`` with ``input_ids`` (one row per sample: the radix cache
  shares the prompt's prefill among a group's rows), ``sampling_params``
  (``temperature, top_p, max_new_tokens, stop, no_stop_trim``) and
  ``return_logprob=true``; per-token log-probs come from
  ``meta_info.output_token_logprobs`` as ``[logprob, token_id, text]``;
* ``POST /update_weights_from_disk`` with ``model_path`` — an HF directory, so
  a published safetensors file is staged as one (the base model's config and
  tokenizer files linked beside it) before the call.
* LoRA runs (``trainer.lora.rank`` > 0): the server starts with ``--enable-lora``, ``--max-lora-rank`` and
  ``--lora-target-modules`` (the run's targets); each version's adapter is written as a peft directory
  (weights/adapters.py ``write_dir``) and loaded with ``POST /load_lora_adapter`` (``lora_name`` "v<version>",
  ``lora_path``), the previous one dropped with ``POST /unload_lora_adapter``; every ``/generate`` row then names
  it (``lora_path``).

Log-prob contract (as the torch engine): the sampled token's log-prob under the
temperature-scaled distribution before top-p. SGLang reports log-probs of the
raw logits unless told otherwise, which equals the contract at T = 1 and
top_p = 1 (the paper's RL setting), so ``check`` refuses other settings rather
than hand the trainer biased numbers. Greedy requests (T = 0) are served.

Stop strings: SGLang matches them on decoded text (``Req.tail_str`` decodes the last tokens with
the server's tokenizer), as the torch engine does, so the server loads the model's tokenizer by
default. Rollouts stay token-exact either way: ``input_ids`` in, the sampled ids out of
``output_token_logprobs``. ``sampler.sglang.skip_tokenizer_init=true`` starts it without one (no
detokenizing per token), and SGLang then cannot match ``stop`` (0.5.21 rejects the request), so
``check`` refuses such requests with the reason. With its tokenizer SGLang also ends a row on the
tokenizer's EOS, besides the generation config's (the torch engine's). Stop strings are not
translated into ``stop_token_ids``: a token id matches only that token, while a string also ends
a response where it is split across tokens or ends a longer one.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from ..protocol.devices import dtype_name, memory_fraction
from ..weights.adapters import DEFAULT_TARGETS
from .engine import GenerationRequest, Sample, check_request, register_engine

HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "special_tokens_map.json")


def sglang_unavailable() -> str:
    """Why SGLang cannot run here ('' if it can)."""
    try:
        import sglang  # noqa: F401
    except ImportError:
        return "sglang is not installed (it needs CUDA; pip install sglang on a GPU machine)"
    import torch

    if not torch.cuda.is_available():
        return "SGLang needs a CUDA GPU and none is visible"
    return ""


def stop_refusal(request: GenerationRequest, skip_tokenizer_init: bool) -> str:
    """Why a server started with ``--skip-tokenizer-init`` cannot serve ``request`` ('' if it can)."""
    if skip_tokenizer_init and request.stop:
        return (f"stop strings {list(request.stop)} need the SGLang server's tokenizer (it matches them on decoded "
                f"text): set sampler.sglang.skip_tokenizer_init=false (and start your own server without "
                f"--skip-tokenizer-init)")
    return ""


def generate_payload(rows: list[GenerationRequest]) -> dict:
    """The ``POST /generate`` body for one row per entry of ``rows`` (a request repeated ``n`` times): token ids in,
    the sampled ids and their log-probs out (``meta_info.output_token_logprobs``); stop strings kept in the
    response (``no_stop_trim``) as the other engines keep them."""
    params = [{"temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_tokens,
               "no_stop_trim": True, "skip_special_tokens": False,
               **({"stop": list(r.stop)} if r.stop else {}),
               **({"sampling_seed": r.seed} if r.seed is not None else {})} for r in rows]
    return {"input_ids": [r.prompt_ids.tolist() for r in rows], "sampling_params": params,
            "return_logprob": True, "logprob_start_len": -1}


def _post(url: str, payload: dict, timeout: float) -> dict | list:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def server_command(cfg, port: int) -> list[str]:
    """The command line of the SGLang server the supervisor starts for one sampler (its GPU is the sampler's,
    given as CUDA_VISIBLE_DEVICES): the run's model and dtype, the sampler's memory share, the tokenizer unless
    ``sampler.sglang.skip_tokenizer_init``, ``sampler.sglang.args``."""
    s = cfg.sampler.sglang
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(cfg.model.path), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype_name(cfg.model.dtype), "--random-seed", str(int(cfg.run.seed))]
    if s.skip_tokenizer_init:  # no tokenizer: no stop strings (module docstring)
        cmd.append("--skip-tokenizer-init")
    share = float(s.mem_fraction_static) or memory_fraction(cfg, "sampler")
    if share:
        cmd += ["--mem-fraction-static", f"{share:g}"]
    lora = cfg.trainer.lora
    if lora.rank:  # the adapters of a LoRA run: one at a time (load_adapter), on the modules the trainer adapts
        cmd += ["--enable-lora", "--max-lora-rank", str(int(lora.rank)), "--max-loras-per-batch", "1",
                "--lora-target-modules", *(lora.targets or DEFAULT_TARGETS)]
    return cmd + [str(a) for a in s.args]


@register_engine("sglang")
class SGLangEngine:
    gpu_memory = "server"  # the model lives in the SGLang server process (samplers/engine.py)

    @classmethod
    def from_config(cls, cfg, device, url: str = "") -> SGLangEngine:
        """The engine over ``url`` (the server the supervisor started for this sampler) or
        ``sampler.sglang.url`` (a server of your own)."""
        s = cfg.sampler.sglang
        url = url or s.url
        if not url:
            raise RuntimeError("sglang engine: no server URL (the supervisor passes --engine-url; or set "
                               "sampler.sglang.url)")
        return cls(cfg.model.path, url, startup_s=float(s.startup_s), request_timeout_s=float(s.request_timeout_s),
                   skip_tokenizer_init=bool(s.skip_tokenizer_init))

    def __init__(self, model_path: str, url: str, startup_s: float = 600.0, request_timeout_s: float = 600.0,
                 skip_tokenizer_init: bool = False) -> None:
        """``skip_tokenizer_init``: the server runs without a tokenizer, so requests with stop strings are refused."""
        from transformers import AutoConfig

        self.model_path = str(Path(model_path).resolve())
        cfg = AutoConfig.from_pretrained(self.model_path)
        self.vocab_size, self.max_context = cfg.vocab_size, cfg.max_position_embeddings
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.timeout = request_timeout_s
        self.skip_tokenizer_init = skip_tokenizer_init
        self.version = 0
        self.url = url.rstrip("/")
        self.lora = ""  # the adapter every /generate row names (load_adapter); "": the base
        self._wait_healthy(startup_s)

    def _wait_healthy(self, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"sglang server at {self.url} not healthy after {limit_s:.0f} s (its log: logs/sglang-*.log; "
                           f"raise sampler.sglang.startup_s?)")

    def check(self, request: GenerationRequest) -> str:
        reason = check_request(request, self.vocab_size, self.max_context)
        reason = reason or stop_refusal(request, self.skip_tokenizer_init)
        if reason:
            return reason
        if request.temperature not in (0.0, 1.0) or (request.temperature > 0 and request.top_p < 1.0):
            return ("sglang engine serves temperature 1 with top_p 1, or greedy: its log-probs are of the raw "
                    "logits, which match the trainer's only there")
        return ""

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        rows = [r for r in requests for _ in range(r.n)]
        payload = generate_payload(rows)
        if self.lora:
            payload["lora_path"] = [self.lora] * len(rows)
        outputs = _post(f"{self.url}/generate", payload, self.timeout)
        if not isinstance(outputs, list) or len(outputs) != len(rows):
            raise RuntimeError(f"sglang /generate returned {type(outputs).__name__} for {len(rows)} rows")
        samples = [self._sample(out) for out in outputs]
        grouped, start = [], 0
        for r in requests:
            grouped.append(samples[start : start + r.n])
            start += r.n
        return grouped

    @staticmethod
    def _sample(out: dict) -> Sample:
        meta = out["meta_info"]
        triples = meta["output_token_logprobs"]
        ids = np.array([t[1] for t in triples], np.int32)
        logprobs = np.array([t[0] for t in triples], np.float32)
        finish = (meta.get("finish_reason") or {}).get("type", "length")
        if finish not in ("stop", "length"):
            raise RuntimeError(f"sglang finish reason {finish!r}: {meta.get('finish_reason')}")
        return Sample(ids, logprobs, finish)

    def load_weights(self, path: str, version: int) -> None:
        staged = self._stage(path, version)
        reply = _post(f"{self.url}/update_weights_from_disk", {"model_path": str(staged)}, self.timeout)
        shutil.rmtree(staged, ignore_errors=True)
        if not reply.get("success"):
            raise RuntimeError(f"sglang update_weights_from_disk failed: {reply.get('message')}")
        self.version = version

    def load_adapter(self, path: str, version: int, config: dict) -> None:
        """A LoRA run's version: the adapter file at ``path`` as a peft directory beside it, loaded by the server
        under the name ``v<version>`` (the server must run with ``--enable-lora``: ``server_command``), then the
        previous version's adapter unloaded."""
        from ..weights import adapters

        name = f"v{version:06d}"
        folder = adapters.write_dir(Path(path).parent / f"sglang-lora-{name}", config, path)
        reply = _post(f"{self.url}/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}, self.timeout)
        if not reply.get("success"):
            shutil.rmtree(folder, ignore_errors=True)
            raise RuntimeError(f"sglang load_lora_adapter failed: {reply.get('error_message') or reply}")
        old, self.lora, self.version = self.lora, name, version
        if old:
            _post(f"{self.url}/unload_lora_adapter", {"lora_name": old}, self.timeout)
            shutil.rmtree(Path(path).parent / f"sglang-lora-{old}", ignore_errors=True)

    def _stage(self, path: str, version: int) -> Path:
        """An HF directory for ``path``: the base model's config/tokenizer files and the new weights.
        ``save_model`` keeps ``lm_head.weight`` for tied embeddings; loaders read the embedding's name."""
        from safetensors.torch import load_file, save_file

        staged = Path(path).parent / f"sglang-v{version:06d}"
        staged.mkdir(exist_ok=True)
        for name in HF_FILES:
            src = Path(self.model_path) / name
            if src.is_file() and not (staged / name).exists():
                (staged / name).symlink_to(src)
        weights = load_file(path)
        if self.tied and "lm_head.weight" in weights and "model.embed_tokens.weight" not in weights:
            weights["model.embed_tokens.weight"] = weights.pop("lm_head.weight")
        save_file(weights, str(staged / "model.safetensors"))
        return staged

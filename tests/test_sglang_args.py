"""The SGLang engine's server command and requests, on the CPU (SGLang itself needs CUDA).

    pytest tests/test_sglang_args.py

Stop strings: SGLang matches them on decoded text, so its server loads the tokenizer unless
``sampler.sglang.skip_tokenizer_init``, and then the engine refuses requests with stop strings
(samplers/sglang_engine.py). A stand-in HTTP server checks what the engine sends and reads.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from cascade_rl.samplers.engine import GenerationRequest
from cascade_rl.samplers.sglang_engine import SGLangEngine, generate_payload, server_command, stop_refusal
from cascade_rl.supervisor.config import compose


def cfg_of(*overrides: str):
    return compose(None, ["model.path=/models/m", *overrides], check=False)


def req(stop=(), n=1, seed=None) -> GenerationRequest:
    return GenerationRequest("k", np.array([5, 6, 7], np.int32), n, 1.0, 1.0, 8, list(stop), seed)


@pytest.mark.parametrize("skip, flagged", [("false", False), ("true", True)])
def test_the_server_loads_its_tokenizer_unless_told_not_to(skip, flagged):
    cmd = server_command(cfg_of(f"sampler.sglang.skip_tokenizer_init={skip}"), 31000)
    assert ("--skip-tokenizer-init" in cmd) is flagged
    assert cmd[cmd.index("--model-path") + 1] == "/models/m"


def test_stop_strings_are_refused_only_without_a_tokenizer():
    assert stop_refusal(req(stop=["\n\n"]), skip_tokenizer_init=False) == ""
    assert stop_refusal(req(), skip_tokenizer_init=True) == ""
    reason = stop_refusal(req(stop=["\n\n"]), skip_tokenizer_init=True)
    assert "sampler.sglang.skip_tokenizer_init=false" in reason


def test_the_payload_is_token_ids_in_with_stop_strings_kept():
    payload = generate_payload([req(stop=["</answer>"], seed=3), req()])
    assert payload["input_ids"] == [[5, 6, 7], [5, 6, 7]] and payload["return_logprob"] is True
    first, second = payload["sampling_params"]
    assert first["stop"] == ["</answer>"] and first["no_stop_trim"] is True and first["sampling_seed"] == 3
    assert "stop" not in second and "sampling_seed" not in second  # a server without a tokenizer takes it too
    assert first["skip_special_tokens"] is False and first["max_new_tokens"] == 8


class FakeSGLang(BaseHTTPRequestHandler):
    """/health, and /generate answering every row with tokens 11, 12 and a stop finish."""

    bodies: list[dict] = []
    paths: list[str] = []

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        self.paths.append(self.path)
        if self.path.endswith("_lora_adapter"):  # /load_lora_adapter, /unload_lora_adapter
            out = {"success": True, "error_message": "", "loaded_adapters": {}}
        else:
            out = [{"meta_info": {"output_token_logprobs": [[-0.5, 11, None], [-0.25, 12, None]],
                                  "finish_reason": {"type": "stop", "matched": "x"}}} for _ in body["input_ids"]]
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeSGLang)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("skip", [False, True])
def test_the_engine_sends_stop_strings_or_refuses_them(server, tiny_model, skip):
    FakeSGLang.bodies.clear()
    cfg = compose(None, [f"model.path={tiny_model}", f"sampler.sglang.url={server}",
                         f"sampler.sglang.skip_tokenizer_init={str(skip).lower()}"], check=False)
    engine = SGLangEngine.from_config(cfg, "cpu")
    stopped = req(stop=["\n"], n=2)
    assert bool(engine.check(stopped)) is skip and engine.check(req()) == ""
    requests = [req()] if skip else [stopped, req()]
    groups = engine.generate(requests)
    assert [len(g) for g in groups] == [r.n for r in requests]
    assert groups[0][0].response_ids.tolist() == [11, 12] and groups[0][0].finish_reason == "stop"
    sent = FakeSGLang.bodies[-1]["sampling_params"]
    assert [p.get("stop") for p in sent] == ([None] if skip else [["\n"], ["\n"], None])


def test_a_lora_run_starts_the_server_with_lora_and_loads_each_version_as_an_adapter(server, tiny_model, tmp_path):
    """trainer.lora: the server command enables LoRA for the run's rank and targets; each version's adapter file
    becomes a peft directory that /load_lora_adapter loads (the previous one unloaded), and /generate names it."""
    cmd = server_command(cfg_of("trainer.lora.rank=16", "trainer.lora.targets=[q_proj,v_proj]"), 30000)
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16" and "--enable-lora" in cmd
    assert cmd[cmd.index("--lora-target-modules") + 1:][:2] == ["q_proj", "v_proj"]
    assert "--enable-lora" not in server_command(cfg_of(), 30000)

    FakeSGLang.bodies.clear()
    FakeSGLang.paths.clear()
    engine = SGLangEngine.from_config(compose(None, [f"model.path={tiny_model}", f"sampler.sglang.url={server}"],
                                              check=False), "cpu")
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    for version in (1, 2):
        weights = tmp_path / f"v{version}" / "adapter_model.safetensors"
        weights.parent.mkdir()
        weights.write_bytes(b"adapter bytes")
        engine.load_adapter(str(weights), version, config)
        assert engine.version == version
        loaded = FakeSGLang.bodies[FakeSGLang.paths.index("/load_lora_adapter", len(FakeSGLang.paths) - 2)]
        folder = Path(loaded["lora_path"])
        assert loaded["lora_name"] == f"v{version:06d}" and json.loads((folder / "adapter_config.json").read_text()) == config
        assert (folder / "adapter_model.safetensors").read_bytes() == b"adapter bytes"
    assert FakeSGLang.paths[-1] == "/unload_lora_adapter" and FakeSGLang.bodies[-1] == {"lora_name": "v000001"}
    engine.generate([req(n=2)])
    assert FakeSGLang.bodies[-1]["lora_path"] == ["v000002", "v000002"]


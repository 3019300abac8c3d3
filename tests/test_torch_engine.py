"""The built-in torch engine: log-probs, stopping, bad requests, weight reload, continuous batching.

The reference is transformers' own model loaded from the same directory (the
engine runs samplers/torch_model.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file, save_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from cascade_rl.learner.trainer import Batch
from cascade_rl.modeling.logprobs import token_logprobs
from cascade_rl.protocol.rows import from_padded
from cascade_rl.samplers.engine import GenerationRequest
from cascade_rl.samplers.torch_engine import TorchEngine

QUESTIONS = ["Calculate 4 - 1. Put the final answer in \\boxed{}.", "Calculate 10 - 8 + 0.", "Calculate 7 + 2 + 9 - 3."]


def prompt_ids(engine: TorchEngine, question: str) -> np.ndarray:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                tokenize=False)
    return np.array(engine.tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)


def request(engine, q, n=3, max_tokens=20, temperature=1.0, top_p=1.0, stop=(), seed=None):
    return GenerationRequest("k", prompt_ids(engine, q), n, temperature, top_p, max_tokens, list(stop), seed)


@pytest.fixture(params=["tiny_model", "tiny_dense_model"])
def model_dir(request) -> str:
    return request.getfixturevalue(request.param)


@pytest.fixture
def engine(model_dir):
    return TorchEngine(model_dir)


def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path).eval()


def trainer_logprobs(hf, reqs, groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs the trainer computes for the same tokens: right-padded batch, as learner/trainer.py does."""
    rows = [(r.prompt_ids, s) for r, g in zip(reqs, groups) for s in g]
    width = max(len(p) + len(s.response_ids) for p, s in rows)
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), bool)
    inf = np.zeros((len(rows), width), np.float32)
    for i, (p, s) in enumerate(rows):
        ids[i, : len(p)] = p
        ids[i, len(p) : len(p) + len(s.response_ids)] = s.response_ids
        mask[i, len(p) : len(p) + len(s.response_ids)] = True
        inf[i, len(p) : len(p) + len(s.response_ids)] = s.logprobs
    msg = from_padded(step=0, group_size=1, input_ids=ids, response_mask=mask, inf_logprobs=inf,
                      rewards=np.zeros(len(rows), np.float32), versions=np.zeros(len(rows), np.int32))
    batch = Batch.from_message(msg)
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return token_logprobs(logits, batch.input_ids), batch.inf_logprobs, batch.response_mask


def test_engine_logprobs_equal_trainer_logprobs(engine, model_dir):
    reqs = [request(engine, q, n=4) for q in QUESTIONS]  # different prompt lengths: one padded prefill
    groups = engine.generate(reqs)
    assert [len(g) for g in groups] == [4, 4, 4]
    trainer, inf, mask = trainer_logprobs(hf_model(model_dir), reqs, groups)
    assert mask.sum() > 0
    assert (trainer - inf)[mask].abs().max().item() <= 1e-4


def test_temperature_scaled_logprobs_match(engine, model_dir):
    reqs = [request(engine, q, n=2, temperature=0.7) for q in QUESTIONS]
    groups = engine.generate(reqs)
    hf = hf_model(model_dir)
    rows = [(r.prompt_ids, s) for r, g in zip(reqs, groups) for s in g]
    for p, s in rows:
        full = torch.tensor(np.concatenate([p, s.response_ids]).astype(np.int64))[None]
        with torch.no_grad():
            logits = hf(input_ids=full).logits
        lp = token_logprobs(logits, full, temperature=0.7)[0, len(p):]
        assert (lp - torch.from_numpy(s.logprobs)).abs().max().item() <= 1e-4


def test_max_tokens_and_finish_reasons(tiny_model):
    engine = TorchEngine(tiny_model)
    groups = engine.generate([request(engine, QUESTIONS[0], n=5, max_tokens=7),
                              request(engine, QUESTIONS[1], n=2, max_tokens=3)])
    for g, limit in zip(groups, (7, 3)):
        for s in g:
            assert 1 <= len(s.response_ids) <= limit
            assert len(s.logprobs) == len(s.response_ids)
            assert np.all(s.logprobs <= 0)
            if s.finish_reason == "length":
                assert len(s.response_ids) == limit
            else:
                assert s.finish_reason == "stop" and s.response_ids[-1] in engine.eos_ids.tolist()


def generate_favouring_eos(engine: TorchEngine, req: GenerationRequest):
    """One group sampled with the end-of-turn token made (almost) certain at every step."""
    eos = int(engine.eos_ids[0])

    def favour_eos(module, args, output):
        output[..., eos] += 100.0
        return output

    handle = engine.model.register_forward_hook(favour_eos)  # prefills
    decode = engine.model.decode  # decode steps (with the CPU kernels one C++ op, no forward call)
    engine.model.decode = lambda *a: favour_eos(None, None, decode(*a))
    try:
        return engine.generate([req])[0]
    finally:
        handle.remove()
        del engine.model.decode


def test_eos_stops_a_sequence(tiny_model):
    engine = TorchEngine(tiny_model)
    eos = int(engine.eos_ids[0])
    group = generate_favouring_eos(engine, request(engine, QUESTIONS[0], n=4, max_tokens=30))
    for s in group:
        assert s.finish_reason == "stop"
        assert s.response_ids.tolist() == [eos]
        assert s.logprobs[0] > -1e-3


def test_greedy_is_deterministic(tiny_model):
    engine = TorchEngine(tiny_model)
    a = engine.generate([request(engine, QUESTIONS[0], n=1, max_tokens=30, temperature=0.0)])[0][0]
    b = engine.generate([request(engine, QUESTIONS[0], n=1, max_tokens=30, temperature=0.0)])[0][0]
    np.testing.assert_array_equal(a.response_ids, b.response_ids)


def test_stop_strings(tiny_model):
    engine = TorchEngine(tiny_model)
    free = engine.generate([request(engine, QUESTIONS[2], n=1, max_tokens=12, temperature=0.0)])[0][0]
    text = engine.tokenizer.decode(free.response_ids)
    # stop at the text of the greedy response's third token: the stopped response is its first three tokens
    stop = engine.tokenizer.decode(free.response_ids[:3])
    stopped = engine.generate([request(engine, QUESTIONS[2], n=1, max_tokens=12, temperature=0.0, stop=[stop])])[0][0]
    assert text.startswith(stop)
    assert stopped.finish_reason == "stop"
    assert engine.tokenizer.decode(stopped.response_ids).endswith(stop)
    assert len(stopped.response_ids) <= 3


def test_bad_requests_are_refused_with_a_reason(tiny_model):
    engine = TorchEngine(tiny_model)
    good = request(engine, QUESTIONS[0])
    assert engine.check(good) == ""
    cases = {
        "empty prompt": GenerationRequest("k", np.zeros(0, np.int32), 1, 1.0, 1.0, 8, []),
        "n must be positive": GenerationRequest("k", good.prompt_ids, 0, 1.0, 1.0, 8, []),
        "exceeds the model context": GenerationRequest("k", good.prompt_ids, 1, 1.0, 1.0, 10**6, []),
        "out of range": GenerationRequest("k", np.array([1, 10**6], np.int32), 1, 1.0, 1.0, 8, []),
        "top_p": GenerationRequest("k", good.prompt_ids, 1, 1.0, 0.0, 8, []),
        "temperature": GenerationRequest("k", good.prompt_ids, 1, -1.0, 1.0, 8, []),
    }
    for reason, req in cases.items():
        assert reason in engine.check(req)


def test_top_p_restricts_to_the_nucleus(tiny_model):
    engine = TorchEngine(tiny_model)
    torch.manual_seed(0)
    # top_p tiny: only the most likely token survives, so sampling equals greedy decoding
    nucleus = engine.generate([request(engine, QUESTIONS[1], n=3, max_tokens=10, top_p=1e-6)])[0]
    greedy = engine.generate([request(engine, QUESTIONS[1], n=1, max_tokens=10, temperature=0.0)])[0][0]
    for s in nucleus:
        np.testing.assert_array_equal(s.response_ids, greedy.response_ids)


def test_weight_reload_takes_effect(tiny_model, tmp_path):
    engine = TorchEngine(tiny_model)
    reqs = [request(engine, QUESTIONS[0], n=2, max_tokens=10)]
    before = engine.generate(reqs)
    other = hf_model(tiny_model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path / "w.safetensors"
    save_model(other, str(path))  # as the trainer publishes (weights/shm.py)
    engine.load_weights(str(path), version=7)
    assert engine.version == 7
    ours, theirs = engine.model.hf_state_dict(), other.state_dict()
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name
    trainer, inf, mask = trainer_logprobs(other, reqs, engine.generate(reqs))
    assert (trainer - inf)[mask].abs().max().item() <= 1e-4  # the engine samples from the new weights
    old_trainer, _, old_mask = trainer_logprobs(other, reqs, before)
    old_inf = torch.cat([torch.from_numpy(s.logprobs) for s in before[0]])
    assert not torch.allclose(old_trainer[old_mask], old_inf, atol=1e-3)


def test_weight_reload_from_tensors_equals_the_file_one(tiny_model, tmp_path):
    """``load_tensors`` (the cuda_ipc transport): the file's tensors (tied ones once) as tensors, copied, so the
    trainer may reuse its buffer afterwards; the parameters end up as the file would leave them."""
    from cascade_rl.weights.layout import named_tensors

    engine = TorchEngine(tiny_model)
    other = hf_model(tiny_model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tensors = {k: t.clone() for k, t in named_tensors(other)[0].items()}
    engine.load_tensors(tensors, version=3)
    for t in tensors.values():
        t.zero_()
    via_tensors = {k: v.clone() for k, v in engine.model.state_dict().items()}
    save_model(other, str(tmp_path / "w.safetensors"))
    engine.load_weights(str(tmp_path / "w.safetensors"), version=4)
    assert engine.version == 4
    assert all(torch.equal(via_tensors[k], v) for k, v in engine.model.state_dict().items())


def test_weights_with_a_wrong_name_are_refused(tiny_model, tmp_path):
    engine = TorchEngine(tiny_model)
    other = hf_model(tiny_model)
    path = tmp_path / "w.safetensors"
    save_model(other, str(path))
    tensors = load_file(str(path))
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(RuntimeError, match="unexpected"):
        engine.load_weights(str(tmp_path / "bad.safetensors"), version=1)
    del tensors["model.layers.0.mlp.extra.weight"], tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "short.safetensors"))
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        engine.load_weights(str(tmp_path / "short.safetensors"), version=1)
    assert engine.version == 0


# --- continuous batching ---


def test_more_sequences_than_slots_all_finish_with_trainer_logprobs(model_dir):
    engine = TorchEngine(model_dir, max_batch=4)  # 14 rows through 4 slots: rows join as others finish
    reqs = [request(engine, QUESTIONS[i % 3], n=n, max_tokens=m) for i, (n, m) in enumerate([(3, 5), (5, 17), (2, 9),
                                                                                           (4, 12)])]
    groups = engine.generate(reqs)
    assert [len(g) for g in groups] == [3, 5, 2, 4]
    for r, g in zip(reqs, groups):
        for s in g:
            assert 1 <= len(s.response_ids) <= r.max_tokens
            assert s.finish_reason == "stop" or len(s.response_ids) == r.max_tokens
    trainer, inf, mask = trainer_logprobs(hf_model(model_dir), reqs, groups)
    assert (trainer - inf)[mask].abs().max().item() <= 1e-4  # compaction and refilled slots kept the right K/V


def test_slots_count_does_not_change_greedy_results(tiny_model):
    wide, narrow = TorchEngine(tiny_model), TorchEngine(tiny_model, max_batch=3)
    reqs = [request(wide, q, n=2, max_tokens=m, temperature=0.0) for q, m in zip(QUESTIONS, (6, 20, 11))]
    for a, b in zip(wide.generate(reqs), narrow.generate(reqs)):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.response_ids, y.response_ids)
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_shared_prefill_equals_separate_prefill(tiny_model):
    engine = TorchEngine(tiny_model)
    # one request with n=4 (one prefill, K/V copied into 4 slots) vs 4 requests with n=1 (4 prefills)
    torch.manual_seed(3)
    shared = engine.generate([request(engine, QUESTIONS[2], n=4, max_tokens=15)])[0]
    torch.manual_seed(3)
    separate = [g[0] for g in engine.generate([request(engine, QUESTIONS[2], n=1, max_tokens=15) for _ in range(4)])]
    for a, b in zip(shared, separate):  # same RNG state, same rows in the same order: the same draws
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_ignore_eos_runs_every_row_to_max_tokens(tiny_model):
    engine = TorchEngine(tiny_model, ignore_eos=True)
    eos = int(engine.eos_ids[0])
    group = generate_favouring_eos(engine, request(engine, QUESTIONS[0], n=3, max_tokens=6))
    for s in group:
        assert s.finish_reason == "length" and s.response_ids.tolist() == [eos] * 6


def test_generate_refuses_a_bad_request(tiny_model):
    engine = TorchEngine(tiny_model)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([request(engine, QUESTIONS[0], top_p=0.0)])


def test_each_request_is_reported_as_soon_as_its_rows_are_done(tiny_model):
    """on_done(i, samples) fires once per request, when its last row finishes (a short request before a
    long one), with exactly the samples generate returns."""
    engine = TorchEngine(tiny_model, ignore_eos=True)  # rows run to max_tokens: a known finishing order
    seen = []
    groups = engine.generate([request(engine, QUESTIONS[0], n=2, max_tokens=12),
                              request(engine, QUESTIONS[1], n=3, max_tokens=4),
                              request(engine, QUESTIONS[2], n=1, max_tokens=8)],
                             on_done=lambda i, samples: seen.append((i, samples)))
    assert [i for i, _ in seen] == [1, 2, 0]
    for i, samples in seen:
        assert len(samples) == len(groups[i])
        for a, b in zip(samples, groups[i]):
            assert np.array_equal(a.response_ids, b.response_ids) and np.array_equal(a.logprobs, b.logprobs)
            assert a.finish_reason == b.finish_reason == "length"


def test_next_turns_near_the_context_end_batched_with_longer_ones(tiny_model):
    """Two rows' next turns restored from their kept K/V in one call: a short continuation late in the context and
    a long one early. Padded to the longest, the short one's padding runs past the context: the engine must clamp
    those positions (they are never read), not fail, and the late row's answer must equal its answer alone."""
    engine = TorchEngine(tiny_model)
    context = engine.max_context
    rng = np.random.default_rng(0)
    late = rng.integers(5, 200, context - 40).astype(np.int32)
    early = rng.integers(5, 200, 30).astype(np.int32)
    eos = int(engine.eos_ids[0])

    def favour_eos(module, args, output):  # the first turns end at once, so each row's K/V is kept
        output[..., eos] += 100.0
        return output

    handle = engine.model.register_forward_hook(favour_eos)
    try:
        first = engine.generate([GenerationRequest("late", late, 1, 0.0, 1.0, 4, [], prefix_keys=["late"]),
                                 GenerationRequest("early", early, 1, 0.0, 1.0, 4, [], prefix_keys=["early"])])
    finally:
        handle.remove()
    assert [g[0].finish_reason for g in first] == ["stop", "stop"]
    late2 = np.concatenate([late, first[0][0].response_ids, rng.integers(5, 200, 3).astype(np.int32)])
    early2 = np.concatenate([early, first[1][0].response_ids, rng.integers(5, 200, 60).astype(np.int32)])
    assert len(late2) + 4 <= context < len(late2) - 4 + 60  # padded to the early row's width it would overflow
    hits = engine.counters["prefix_hits"]
    both = engine.generate([GenerationRequest("late", late2, 1, 0.0, 1.0, 4, [], prefix_keys=["late"]),
                            GenerationRequest("early", early2, 1, 0.0, 1.0, 4, [], prefix_keys=["early"])])
    assert engine.counters["prefix_hits"] == hits + 2  # both restored from their kept K/V
    alone = TorchEngine(tiny_model).generate([GenerationRequest("x", late2, 1, 0.0, 1.0, 4, [])])
    assert both[0][0].response_ids.tolist() == alone[0][0].response_ids.tolist()
    np.testing.assert_allclose(both[0][0].logprobs, alone[0][0].logprobs, atol=1e-4)


# --- experts choice (8c) and the decode step's host reads (CUDA graphs) ---


def test_experts_choice_is_grouped_on_cuda_where_grouped_mm_serves_the_dtype():
    """A pure function of (device, dtype, config): grouped experts (k/E of dense's FLOPs, and no host read: a
    CUDA graph holds them) on CUDA in bf16 on sm_90 / sm_100; dense where CUDA's ``_grouped_mm`` would fall back
    to a host-reading loop; the C++ op on CPU in fp32; grouped on CPU otherwise."""
    from cascade_rl.samplers.torch_model import choose_experts

    assert choose_experts("cuda", torch.bfloat16, (9, 0)) == "grouped"
    assert choose_experts("cuda", torch.bfloat16, (10, 0)) == "grouped"
    assert choose_experts("cuda", torch.float32, (9, 0)) == "dense"
    assert choose_experts("cuda", torch.bfloat16, (8, 0)) == "dense"
    assert choose_experts("cpu", torch.float32, None, cpu_kernels=True) == "cpu"
    assert choose_experts("cpu", torch.float32, None, cpu_kernels=True, forced="dense") == "cpu"
    assert choose_experts("cpu", torch.bfloat16) == "grouped"
    assert choose_experts("cpu", torch.float32, None, forced="dense") == "dense"
    with pytest.raises(ValueError, match="moe_impl"):
        choose_experts("cpu", torch.float32, None, forced="nope")


def test_grouped_experts_give_the_dense_tokens_and_logprobs(tiny_model):
    """The engine's grouped experts (kernels/moe.py's, what CUDA runs in bf16) sample what dense ones do, forced on
    CPU (torch ops, no C++ kernels): greedy and seeded rows."""
    out = {}
    for impl in ("dense", "grouped"):
        engine = TorchEngine(tiny_model, cpu_kernels=False, moe_impl=impl)
        assert engine.experts == impl and {m.impl for m in engine.model.moe_blocks()} == {impl}
        reqs = [request(engine, QUESTIONS[0], n=2, max_tokens=16, temperature=0.0),
                request(engine, QUESTIONS[1], n=3, max_tokens=16, seed=5)]
        out[impl] = [s for g in engine.generate(reqs) for s in g]
    for a, b in zip(out["dense"], out["grouped"]):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def mixed_requests(engine, rows: int):
    """``rows`` rows: greedy, top-p, seeded, stop strings and multi-turn keys mixed."""
    kinds = [dict(temperature=0.0), dict(stop=["1", "="]), dict(top_p=0.8), dict(temperature=0.7, seed=3)]
    reqs = []
    for i in range(rows):
        r = request(engine, QUESTIONS[i % 3], n=1, max_tokens=6 + 3 * (i % 4), **kinds[i % 4])
        reqs.append(dataclasses.replace(r, key=f"r{i}", prefix_keys=[f"r{i}"] if i % 2 else []))
    return reqs


class HostReadGuard(TorchDispatchMode):
    """Records every aten op; the ones that read the device from the host (``.item()`` and kin) or size their
    output by the data (a sync on CUDA, and no CUDA graph can hold them) are what a decode step must not run."""

    SYNCING = {"item", "_local_scalar_dense", "nonzero", "bincount", "masked_select", "unique", "_unique2", "unique_dim"}

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "repeat_interleave" and func._overloadname != "self_int":
            name = "repeat_interleave(tensor repeats)"  # sizes its output by the repeats' sum
        if name == "index" and any(t is not None and t.dtype == torch.bool for t in args[1]):
            name = "index(bool mask)"  # a boolean mask sizes the output by the data
        self.ops.append(name)
        return func(*args, **(kwargs or {}))

    def reads(self) -> list[str]:
        return [op for op in self.ops if op in self.SYNCING or "(" in op]


@pytest.mark.parametrize("impl", ["cpu-kernels", "torch-ops"])
@pytest.mark.parametrize("rows,max_batch", [(1, 256), (12, 256), (12, 5)])
def test_one_host_read_per_decode_step(tiny_model, impl, rows, max_batch):
    """Every device->host read of ``generate`` goes through ``TorchEngine._read`` (Python's reads of a tensor
    raise elsewhere) and a step makes exactly one (its tokens and log-probs), whatever the batch size: admission,
    stop checks, retiring and multi-turn keeping run on the host's own bookkeeping. torch-ops is the code a GPU
    runs (grouped experts)."""
    kw = dict(cpu_kernels=False, moe_impl="grouped") if impl == "torch-ops" else {}
    engine = TorchEngine(tiny_model, max_batch=max_batch, **kw)
    reqs = mixed_requests(engine, rows)
    eos = int(engine.eos_ids[0])

    def favour_eos(module, args, output):  # the first turns end at once, so each keyed row's K/V is kept
        output[..., eos] += 100.0
        return output

    handle = engine.model.register_forward_hook(favour_eos)
    try:
        engine.generate(reqs)
    finally:
        handle.remove()
    turns = [dataclasses.replace(r, prompt_ids=np.concatenate([r.prompt_ids, [11, 12]]).astype(np.int32))
             for r in reqs]
    engine.counters.clear()
    inside = []
    read = engine._read
    engine._read = lambda t: (inside.append(1), read(t), inside.pop())[1]

    def forbidden(name):
        method = getattr(torch.Tensor, name)

        def guarded(self, *a, **k):
            assert inside, f"Tensor.{name} outside TorchEngine._read: a device->host read the count misses"
            return method(self, *a, **k)
        return name, method, guarded

    patched = [forbidden(n) for n in ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__")]
    try:
        for name, _, guarded in patched:
            setattr(torch.Tensor, name, guarded)
        groups = engine.generate(turns)
    finally:
        for name, method, _ in patched:
            setattr(torch.Tensor, name, method)
    c = engine.counters
    assert sum(len(g) for g in groups) == rows
    assert c["prefix_hits"] == rows // 2 and c["decode_steps"] > 0
    assert c["host_reads"] == c["steps"] >= c["decode_steps"]  # one read a step


@pytest.mark.parametrize("impl", ["torch-ops", "cpu-kernels"])
def test_the_decode_step_reads_nothing_on_the_host(tiny_model, impl):
    """``TorchEngine._step`` (what a CUDA graph captures) runs no op that reads the device from the host or sizes
    its output by the data, with routes, top-p and greedy rows on: checked op by op."""
    kw = dict(cpu_kernels=False) if impl == "torch-ops" else {}
    engine = TorchEngine(tiny_model, return_routes=True, **kw)
    assert engine.experts == ("grouped" if impl == "torch-ops" else "cpu")
    engine.generate([request(engine, QUESTIONS[0], n=4, max_tokens=3)])  # a cache, buffers, K/V
    guard = HostReadGuard()
    with torch.inference_mode(), guard:
        engine._step(4, engine.cache.max_len, True, True)  # the longest a graph pads a step to
    assert guard.ops and not guard.reads()
    if impl == "torch-ops":
        assert "_grouped_mm" in guard.ops
        with torch.inference_mode(), pytest.raises(ValueError, match="the KV cache holds 128"):
            engine._step(4, engine.cache.max_len + 1, True, True)  # past the cache: said so, not a shape error


def test_a_routes_run_reads_once_a_step_and_once_a_request(tiny_model):
    engine = TorchEngine(tiny_model, return_routes=True)
    reqs = [request(engine, q, n=3, max_tokens=9) for q in QUESTIONS]
    groups = engine.generate(reqs)
    c = engine.counters
    assert all(s.routes is not None for g in groups for s in g)
    assert c["host_reads"] == c["steps"] + len(reqs)  # the routes of each request, when its rows are done


# --- CUDA (bench/gpu_checks.sh): the graph-captured decode step ---

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_has_no_sync(tiny_model, dtype):
    """The decode step on CUDA in eager mode under ``set_sync_debug_mode("error")``: an op that syncs raises
    and is named (a graph capture would fail on it, less legibly). At the cache's length (128 here: the prompt
    and 3 tokens, rounded up), the longest a graph pads a step to."""
    engine = TorchEngine(tiny_model, dtype=dtype, device="cuda", return_routes=True, cuda_graphs=False)
    assert engine.experts == ("grouped" if dtype == "bfloat16" else "dense")
    engine.generate([request(engine, QUESTIONS[0], n=4, max_tokens=3)])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            engine._step(4, engine.cache.max_len, True, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_equals_eager(tiny_model, dtype):
    """Graph replays (padded batch and length buckets) sample what eager steps do; greedy rows, so the same
    tokens, and log-probs to the dtype's rounding; continuous batching, stop strings and routes on."""
    graphs = TorchEngine(tiny_model, dtype=dtype, device="cuda", return_routes=True, max_batch=6)
    eager = TorchEngine(tiny_model, dtype=dtype, device="cuda", return_routes=True, max_batch=6, cuda_graphs=False)
    reqs = [request(graphs, q, n=3, max_tokens=12 + 4 * i, temperature=0.0, stop=["=" * (i + 1)])
            for i, q in enumerate(QUESTIONS)]
    a, b = graphs.generate(reqs), eager.generate(reqs)
    assert graphs.graphs is not None and graphs.graphs.enabled and graphs.graphs.graphs  # replayed, not eager
    assert eager.graphs is None
    tol = 1e-4 if dtype == "float32" else 5e-2
    for x, y in zip([s for g in a for s in g], [s for g in b for s in g]):
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=tol)
        np.testing.assert_array_equal(x.routes, y.routes)
    assert graphs.counters["host_reads"] == graphs.counters["steps"] + len(reqs)


@cuda
def test_cuda_graph_capture_failure_falls_back_to_eager(tiny_model, caplog):
    """A capture that fails turns graphs off for that engine, which decodes the same tokens eagerly, and leaves
    the process whole (the first GPU run, torch 2.11: the default CUDA generator stayed in capture mode, and
    every later random draw of the process raised): the caller's stream is current again, the default generator
    draws with its seed kept and its offset advancing, a seeded one draws, the allocator empties its cache (an
    internal assert while it counts a capture under way), and a new engine captures and replays its graphs."""
    engine = TorchEngine(tiny_model, device="cuda")
    step = engine._step

    def syncing(*a):  # a step that reads the device: capture raises
        step(*a)
        engine.buf.out.sum().item()

    engine._ensure_cache(3, 64)
    engine.graphs.step = syncing
    stream = torch.cuda.current_stream()
    groups = engine.generate([request(engine, QUESTIONS[0], n=3, max_tokens=8, temperature=0.0)])
    assert not engine.graphs.enabled and "decoding eagerly" in caplog.text
    assert "out of capture mode" not in caplog.text  # the trivial capture of the recovery did not fail
    assert torch.cuda.current_stream() == stream
    default = torch.cuda.default_generators[torch.cuda.current_device()]
    seed, offset = default.initial_seed(), default.get_offset()
    torch.randn(3, device="cuda")
    assert default.initial_seed() == seed and default.get_offset() > offset
    torch.rand(3, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    fresh = TorchEngine(tiny_model, device="cuda")
    ref = fresh.generate([request(fresh, QUESTIONS[0], n=3, max_tokens=8, temperature=0.0)])
    assert fresh.graphs.enabled and fresh.graphs.graphs  # captured and replayed after the failure
    for x, y in zip(groups[0], ref[0]):  # graphs sample what eager steps do: test_cuda_graph_decode_equals_eager
        np.testing.assert_array_equal(x.response_ids, y.response_ids)

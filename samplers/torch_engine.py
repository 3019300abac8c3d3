"""The built-in torch engine: batched sampling with a KV cache over any HF causal LM.

All requests handed to ``generate`` form one left-padded batch (n rows per
request); one prefill fills the KV cache, then one token per row per decode
step. Log-probs are those of the sampled token under the temperature-scaled
distribution before top-p truncation (what the trainer recomputes at the same
temperature), so engine/trainer mismatch is measurable token by token.

Finished rows keep decoding padding until the whole batch is done; continuous
batching and a preallocated cache belong to the fast engine (issue 3).
"""

from __future__ import annotations

import numpy as np
import torch
from safetensors.torch import load_model
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from .engine import GenerationRequest, Sample, check_request, register_engine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob. ``temperature == 0`` rows are greedy (log-prob at T=1)."""
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    if bool((top_p < 1.0).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = (sorted_p.cumsum(-1) - sorted_p) >= top_p[:, None]  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@register_engine("torch")
class TorchEngine:
    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [self.tokenizer.eos_token_id])
        self.eos_ids = torch.tensor(eos, device=self.device)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos[0]
        self.vocab_size = self.model.config.vocab_size
        self.max_context = self.model.config.max_position_embeddings
        self.version = 0

    def check(self, request: GenerationRequest) -> str:
        return check_request(request, self.vocab_size, self.max_context)

    def load_weights(self, path: str, version: int) -> None:
        load_model(self.model, path, strict=True, device=str(self.device))
        self.version = version

    @torch.inference_mode()
    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        rows = [r for r in requests for _ in range(r.n)]
        batch, width = len(rows), max(len(r.prompt_ids) for r in rows)
        dev = self.device
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long, device=dev)
        attention = torch.zeros((batch, width), dtype=torch.long, device=dev)
        for i, r in enumerate(rows):  # left padding: every row's next token lands in the same column
            input_ids[i, width - len(r.prompt_ids) :] = torch.from_numpy(r.prompt_ids.astype(np.int64))
            attention[i, width - len(r.prompt_ids) :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        temperature = torch.tensor([r.temperature for r in rows], device=dev)
        top_p = torch.tensor([r.top_p for r in rows], device=dev)
        max_tokens = torch.tensor([r.max_tokens for r in rows], device=dev)
        seeds = [r.seed for r in requests if r.seed is not None]
        generator = torch.Generator(device=dev).manual_seed(hash(tuple(seeds)) & 0xFFFFFFFF) if seeds else None

        cache = DynamicCache()
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                         past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1, :].float()
        next_pos = positions[:, -1] + 1
        tokens_out, logps_out = [], []
        done = torch.zeros(batch, dtype=torch.bool, device=dev)
        finish = ["length"] * batch
        lengths = torch.zeros(batch, dtype=torch.long, device=dev)
        for _ in range(int(max_tokens.max())):
            tokens, logps = sample_tokens(logits, temperature, top_p, generator)
            tokens = torch.where(done, torch.full_like(tokens, self.pad_id), tokens)
            tokens_out.append(tokens)
            logps_out.append(logps)
            lengths += (~done).long()
            hit_eos = torch.isin(tokens, self.eos_ids) & ~done
            for i in self._stop_rows(rows, tokens_out, done):
                hit_eos[i] = True
            for i in hit_eos.nonzero().flatten().tolist():
                finish[i] = "stop"
            done |= hit_eos | (lengths >= max_tokens)
            if bool(done.all()):
                break
            attention = torch.cat([attention, torch.ones((batch, 1), dtype=attention.dtype, device=dev)], dim=1)
            out = self.model(input_ids=tokens[:, None], attention_mask=attention, position_ids=next_pos[:, None],
                             past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1

        all_tokens = torch.stack(tokens_out, 1).to(torch.int32).cpu().numpy()
        all_logps = torch.stack(logps_out, 1).float().cpu().numpy()
        samples = [
            Sample(all_tokens[i, : lengths[i]].copy(), all_logps[i, : lengths[i]].copy(), finish[i])
            for i in range(batch)
        ]
        grouped, start = [], 0
        for r in requests:
            grouped.append(samples[start : start + r.n])
            start += r.n
        return grouped

    def _stop_rows(self, rows: list[GenerationRequest], tokens_out: list[torch.Tensor], done: torch.Tensor):
        """Rows whose response text now ends in one of their stop strings."""
        for i, r in enumerate(rows):
            if r.stop and not bool(done[i]):
                tail = self.tokenizer.decode([int(t[i]) for t in tokens_out[-16:]])
                if any(tail.endswith(s) for s in r.stop):
                    yield i

"""The trainer's view of an HF causal LM: per-token log-probs (and entropy) of the response tokens.

    policy = Policy(AutoModelForCausalLM.from_pretrained(path), temperature=1.0)
    logprobs, entropy = policy(input_ids, lengths, response_mask, with_entropy=True)   # [N, L] each

Never builds [tokens x vocab] logits: the base model gives hidden states, and
``modeling.logprobs.linear_logprobs`` (or the fused Triton kernel of kernels/logprob.py,
``logprob_impl="triton"``) applies the LM head in chunks, only at the
positions that predict a response token (prompt positions cost no LM-head work
at all). Layouts (``modeling.packing``), all giving the same numbers
(tests/test_policy.py):

- ``pack=True`` with a varlen kernel (CUDA: ``varlen``, torch's own FlashAttention varlen,
  modeling/attention.py; or ``flash_attention_2``): padding-free [1, T] sequences of at most
  ``pack_tokens``, rows told apart by cu_seqlens.
- ``pack=True`` otherwise (SDPA, eager): rows bin-packed into lanes as wide as
  the longest row, position ids restarting per row. transformers turns those
  into a per-row block mask; packing everything into one [1, T] row instead
  would make SDPA attend over T x T (measured: 7x slower steps in the demo).
- ``pack=False``: the right-padded batch with an attention mask.

- ``context_parallel`` (modeling/context_parallel.py): each [1, T] pack split across the group's ranks, every layer
  on ``T / cp`` tokens (Ulysses attention, Mamba-2 states passed from rank to rank); the log-probs of the whole pack
  gathered on every rank, so the loss is the 1-rank one.

Mamba-2 layers (Nemotron-H) keep rows apart through ``seq_idx`` (modeling/mamba.py, installed here); the shared
prefix layout gives them each prefix's conv and SSM state, one suffix a lane. A model with a recurrent layer
mamba.py does not know runs padded (logged once): its state would leak from row to row in a lane or a pack.

The module is the unit FSDP2 shards last (``learner.parallel.parallelize``):
its forward runs the base model and reads the LM head weight, so the root's
parameters are gathered for exactly that span.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cascade_rl.protocol.registry import Registry

from . import context_parallel as cp_mod
from . import logprobs as torch_logprobs
from . import mamba, routing
from .packing import (
    VARLEN_KWARGS,
    pack,
    pack_lanes,
    pack_values,
    packed_forward,
    share_prefixes,
    shared_prefix_hidden,
    unpack,
)

log = logging.getLogger(__name__)

# name -> fn(hidden [M, H], weight [V, H], targets [M], temperature, chunk_tokens, with_entropy)
#         -> (logprob [M], entropy [M] | None)            (``trainer.logprob_impl``)
LOGPROB_IMPLS = Registry("log-prob implementation")
LOGPROB_IMPLS.register("torch")(torch_logprobs.linear_logprobs)


@LOGPROB_IMPLS.register("triton")
def triton_logprobs(*args, **kwargs):
    """kernels/logprob.py: the fused Triton kernel (CUDA; on CPU only under TRITON_INTERPRET=1, for tests)."""
    from cascade_rl.kernels.logprob import linear_logprobs

    return linear_logprobs(*args, **kwargs)


class Policy(nn.Module):
    def __init__(self, model: nn.Module, temperature: float = 1.0, chunk_tokens: int = 1024,
                 pack: bool = True, pack_tokens: int = 8192, logprob_impl: str = "torch",
                 share_prefix: bool = True, routing_replay: bool = False,
                 activation_checkpointing: bool = False, context_parallel: cp_mod.ContextParallel | None = None
                 ) -> None:
        """``pack_tokens`` caps one packed sequence: with SDPA transformers builds a [T, T] mask for it
        (flash-attn varlen needs none), so a micro-batch runs as several packs of at most that size.
        ``routing_replay``: an MoE model's routers take the experts of the ``routes`` a forward is given
        (modeling/routing.py); without it the routes are only compared with the model's own choice.
        ``activation_checkpointing``: each decoder layer recomputed in the backward (schema ``trainer.
        activation_checkpointing``); no shared prefixes then. ``context_parallel``: the ranks each pack is split
        across (learner/parallel.py ``Ranks.context``); the model's attention becomes Ulysses over its own kernel."""
        super().__init__()
        self.model = model
        self.temperature, self.chunk_tokens, self.pack, self.pack_tokens = temperature, chunk_tokens, pack, pack_tokens
        self.linear_logprobs = LOGPROB_IMPLS[logprob_impl]
        self.share_prefix = share_prefix
        self.replay = routing.RoutingReplay.install(model, routing_replay)  # None for a dense model
        self.recurrent = mamba.install(model) > 0  # Mamba layers that take seq_idx: one suffix a lane
        if activation_checkpointing:
            # non-reentrant: FSDP2 and kwargs-only layer inputs work with it; R3's context is restored for the recompute
            kwargs = {"use_reentrant": False}
            if self.replay is not None:
                kwargs["context_fn"] = self.replay.checkpoint_context
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            self.share_prefix = False  # the recompute would append the prefix's K/V to its cache again
        self.context = None if context_parallel is None or context_parallel.size == 1 else \
            cp_mod.install(model, context_parallel)
        if pack and (unknown := mamba.unsupported_recurrence(model)):
            log.warning("%s keeps no row boundary in a packed sequence (its state would leak from row to row): "
                        "this model's log-probs run padded (trainer.pack off)", unknown)
            self.pack = False
        if self.context is not None and not self.pack:
            raise ValueError("context parallelism splits packed sequences; this model runs padded (trainer.pack)")

    def forward(self, input_ids: Tensor, lengths: Tensor, target_mask: Tensor,
                with_entropy: bool = False, routes: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """input_ids [N, L] right-padded with ``lengths`` [N] real tokens; ``target_mask`` [N, L] marks the
        tokens (t >= 1) whose log-prob is wanted. Returns log-probs and entropies [N, L] (fp32), 0 elsewhere;
        the entropy at t is that of the distribution token t was drawn from. ``routes`` [N, L, MoE layers, k]:
        the engine's experts of each token (-1: none), replayed or compared (``routing_replay``)."""
        if bool(target_mask[:, 0].any()):
            raise ValueError("a row's first token has no prediction: target_mask[:, 0] must be False")
        head = self.model.get_output_embeddings().weight
        n, length = input_ids.shape
        rows, cols = target_mask.nonzero(as_tuple=True)
        if routes is not None and self.replay is None:
            routes = None  # a dense model: nothing to route
        if self.context is not None:
            return self._varlen(input_ids, lengths, target_mask, head, with_entropy, routes)
        if self.pack and self.model.config._attn_implementation in VARLEN_KWARGS:
            return self._varlen(input_ids, lengths, target_mask, head, with_entropy, routes)
        shared = (share_prefixes(input_ids, lengths, target_mask, row_per_lane=self.recurrent)
                  if self.pack and self.share_prefix and self.model.config._attn_implementation in ("sdpa", "eager")
                  else None)
        if shared is not None:  # each distinct prompt once, then the responses with its keys/values as the past
            passes = (routing.prefix_sources(shared, lengths, target_mask.any(dim=1), length)
                      if routes is not None else (None, None))
            h = shared_prefix_hidden(self.model, shared, rows, cols, around=lambda i: self._routed(routes, passes[i]))
        elif self.pack:  # rows bin-packed into lanes as wide as the longest: one pass, block-diagonal attention
            lanes = pack_lanes(input_ids, lengths)  # lane tails hold token 0: never read, attend only themselves
            src = None if routes is None else routing.lane_sources(lanes.lane, lanes.offset, lengths,
                                                                   *lanes.input_ids.shape, length)
            with self._routed(routes, src):
                hidden = self.model.base_model(input_ids=lanes.input_ids, position_ids=lanes.position_ids,
                                               attention_mask=None, use_cache=False,
                                               **mamba.row_kwargs(self.model, lanes.position_ids)).last_hidden_state
            h = hidden[lanes.lane[rows], lanes.offset[rows] + cols - 1]
        else:
            src = None if routes is None else routing.padded_sources(lengths, length)
            with self._routed(routes, src):
                hidden = self.model.base_model(input_ids=input_ids, use_cache=False,
                                               attention_mask=self._padding_mask(lengths, length)).last_hidden_state
            h = hidden[rows, cols - 1]  # [M, H] of hidden [N, L, H]
        lp, ent = self.linear_logprobs(h, head, input_ids[rows, cols], self.temperature, self.chunk_tokens,
                                       with_entropy)
        flat = rows * length + cols
        return self._scatter(lp, flat, n, length), self._scatter(ent, flat, n, length)

    def _routed(self, routes: Tensor | None, src: Tensor | None):
        """The forwards inside take (or are compared with) ``routes`` laid out as ``src``; none: as they are."""
        if routes is None:
            return contextlib.nullcontext()
        return self.replay.sources(routes, src)

    def _varlen(self, input_ids, lengths, target_mask, head, with_entropy, routes=None):
        """A varlen kernel: [1, T] packs of at most ``pack_tokens`` with cu_seqlens, no mask at all."""
        n, length = input_ids.shape
        logprobs = input_ids.new_zeros((n, length), dtype=torch.float32)
        entropy = torch.zeros_like(logprobs) if with_entropy else None
        for p in pack(input_ids, lengths, self.pack_tokens):
            (where,) = pack_values(target_mask, p)[0].nonzero(as_tuple=True)  # never a row's first token
            if self.context is not None:
                lp, ent = self._split_pack(p, where, head, with_entropy, routes, length)
            else:
                with self._routed(routes, None if routes is None else routing.pack_sources(p, length)):
                    hidden = packed_forward(self.model, p, hidden_states=True)[0]  # [T, H]
                lp, ent = self.linear_logprobs(hidden[where - 1], head, p.input_ids[0, where], self.temperature,
                                               self.chunk_tokens, with_entropy)
            logprobs = logprobs.index_copy(0, p.rows, unpack(self._scatter(lp, where, 1, p.num_tokens)[..., None],
                                                             p, length)[..., 0])
            if with_entropy:
                entropy = entropy.index_copy(0, p.rows, unpack(self._scatter(ent, where, 1, p.num_tokens)[..., None],
                                                               p, length)[..., 0])
        return logprobs, entropy

    def _split_pack(self, p, where, head, with_entropy, routes, length):
        """Log-probs (and entropies) at ``where`` of pack ``p`` with its tokens split across the context-parallel
        ranks: padded to a multiple of their number (the padding a row of its own), each rank's forward on its
        share, the LM head on the positions its hidden states predict from, the results summed on every rank."""
        cp = self.context
        n = p.num_tokens
        pad = (-n) % cp.size
        ids = F.pad(p.input_ids, (0, pad))
        pos = torch.cat([p.position_ids, torch.arange(pad, device=ids.device)[None]], dim=1)
        cu = torch.cat([p.cu_seqlens, p.cu_seqlens.new_tensor([n + pad])]) if pad else p.cu_seqlens
        mine = cp.split(n + pad)
        kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(p.max_seqlen, pad),
                      max_length_k=max(p.max_seqlen, pad))
        if self.recurrent:
            kwargs["seq_idx"] = mamba.seq_idx_from_positions(pos)[:, mine]
        src = None
        if routes is not None:
            src = F.pad(routing.pack_sources(p, length), (0, pad), value=-1)[:, mine]
        with self._routed(routes, src):
            hidden = self.model.base_model(input_ids=ids[:, mine], position_ids=pos[:, mine], attention_mask=None,
                                           use_cache=False, **kwargs).last_hidden_state[0]  # [T / cp, H]
        here = (where - 1 >= mine.start) & (where - 1 < mine.stop)  # targets predicted from my tokens
        lp, ent = self.linear_logprobs(hidden[where[here] - 1 - mine.start], head, p.input_ids[0, where[here]],
                                       self.temperature, self.chunk_tokens, with_entropy)
        lp = cp_mod.replicated_sum(lp.new_zeros(len(where)).masked_scatter(here, lp), cp)
        if ent is not None:
            ent = cp_mod.replicated_sum(ent.new_zeros(len(where)).masked_scatter(here, ent), cp)
        return lp, ent

    @staticmethod
    def _padding_mask(lengths: Tensor, length: int) -> Tensor:
        return (torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]).long()

    @staticmethod
    def _scatter(values: Tensor | None, flat: Tensor, n: int, length: int) -> Tensor | None:
        """values [M] at flat positions of an [n, length] zero tensor (differentiable)."""
        if values is None:
            return None
        return values.new_zeros(n * length).index_copy(0, flat, values).view(n, length)

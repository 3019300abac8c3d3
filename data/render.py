"""Prompts as the policy sees them: the conversation in the model's own chat template.

    render = PromptRenderer(tokenizer, thinking=True)
    ids = render.ids(row.messages)         # token ids the sampler continues
    text = render.prefix + response_text   # the assistant turn the verifier scores

The generation prompt comes from the template with ``add_generation_prompt``;
``thinking`` is handed to it as ``enable_thinking`` (Qwen3-style templates
open a ``<think>`` block, or emit an empty one when off; templates without the
switch ignore it). Whatever of the assistant turn the template already wrote
from the last ``<think>`` on (``"<think>\\n"`` in thinking mode) is the
``prefix``: verifiers get the whole turn, reasoning included, so they can tell
the reasoning from the final answer.
"""

from __future__ import annotations

from collections.abc import Sequence

THINK = "<think>"


class PromptRenderer:
    def __init__(self, tokenizer, thinking: bool = True) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {getattr(tokenizer, 'name_or_path', 'the model')} has no chat "
                             f"template: prompts are rendered with the model's own template (add one to "
                             f"tokenizer_config.json / chat_template.jinja)")
        self.tokenizer, self.thinking = tokenizer, thinking
        probe = [{"role": "user", "content": "?"}]
        with_prompt, without = self.text(probe), self._template(probe, add_generation_prompt=False)
        generation = with_prompt[len(without):] if with_prompt.startswith(without) else ""
        self.prefix = generation[generation.rfind(THINK):] if THINK in generation else ""

    def _template(self, messages: Sequence, add_generation_prompt: bool, tools: Sequence[dict] | None = None):
        """The rendered text of one conversation, or of each of a list of conversations; ``tools``: the OpenAI
        function schemas the template lists (an agent's request, gateway/sessions.py)."""
        return self.tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                  add_generation_prompt=add_generation_prompt, tokenize=False,
                                                  enable_thinking=self.thinking)

    def text(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        return self._template(messages, add_generation_prompt=True, tools=tools)

    def ids(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        # the template writes the special tokens (BOS, turn markers) itself: add none on top
        return self.tokenizer(self.text(messages, tools), add_special_tokens=False)["input_ids"]

    def lengths(self, conversations: Sequence[Sequence[dict]]) -> list[int]:
        """Prompt tokens of many conversations (one batched tokenizer call; a fast tokenizer's Rust backend
        directly, which skips transformers' conversion of every encoding to Python lists)."""
        if not conversations:
            return []
        texts = self._template([list(m) for m in conversations], add_generation_prompt=True)  # one batched call
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return [len(e) for e in backend.encode_batch(texts, add_special_tokens=False)]
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]


def parting(a: str, b: str) -> str:
    """Where two texts part: the first differing character and a little of each from there."""
    at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at character {at} {a[at:at + 30]!r} vs {b[at:at + 30]!r}"


class TurnRenderer:
    """The chat template's side of multi-turn rollouts (orchestrator/trajectory.py), token-exact at every boundary.

        turns = TurnRenderer(render)
        text = turns.assistant_text(turn_ids)                         # the assistant message of a model turn
        ids = turns.observation_ids(trajectory_ids, messages)         # what follows it: tool turn(s), next prompt

    The model's tokens are kept as sampled. What follows a model turn is cut from the template's rendering of
    the whole conversation (tool turns last, with the next generation prompt) after the text the trajectory's
    ids decode to, and only that part is tokenised: whatever the template writes between the model's end of
    turn and the tool turn (a newline, a role header) is in it, so no separator is dropped or doubled. A
    template that does not render the conversation as an extension of the trajectory (one that rewrites an
    earlier turn, such as dropping its reasoning) is refused with the place where they part.
    """

    def __init__(self, render: PromptRenderer) -> None:
        self.render, self.tokenizer = render, render.tokenizer
        eos = self.tokenizer.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or ())

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def assistant_text(self, turn_ids) -> str:
        """The assistant message's content: what the generation prompt opened (``render.prefix``) and the turn's
        text, its end-of-turn token left to the template."""
        ids = list(turn_ids)
        while ids and ids[-1] in self.eos_ids:
            ids.pop()
        return self.render.prefix + self.decode(ids)

    def observation_ids(self, trajectory_ids, messages: Sequence[dict],
                        tools: Sequence[dict] | None = None) -> list[int]:
        so_far = self.decode(trajectory_ids)
        full = self.render.text(messages, tools)
        if not full.startswith(so_far):
            raise ValueError(f"the chat template does not extend the trajectory: {parting(so_far, full)} (trajectory "
                             f"vs template; multi-turn needs a template that renders earlier turns as they were "
                             f"generated)")
        return self.tokenizer(full[len(so_far):], add_special_tokens=False)["input_ids"]

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

    def _template(self, messages: Sequence, add_generation_prompt: bool):
        """The rendered text of one conversation, or of each of a list of conversations."""
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, enable_thinking=self.thinking)

    def text(self, messages: Sequence[dict]) -> str:
        return self._template(messages, add_generation_prompt=True)

    def ids(self, messages: Sequence[dict]) -> list[int]:
        # the template writes the special tokens (BOS, turn markers) itself: add none on top
        return self.tokenizer(self.text(messages), add_special_tokens=False)["input_ids"]

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

"""`generate(messages=[...])`: a system prompt and a multi-turn chat through the model's template.

    engine.generate(messages=[{"role": "system", "content": "Answer in one line."},
                              {"role": "user", "content": "What is SSD?"},
                              {"role": "assistant", "content": "Speculative ..."},
                              {"role": "user", "content": "And Saguaro?"}])

`messages` is one conversation (a list of {"role", "content"} dicts) or a list of them, one per
prompt of the batch. Each is checked (`ssd_jax.models.tokenizer.check_messages`) and rendered by
the target tokenizer's chat template with the assistant's turn opened; every error is a ValueError
raised before anything compiles.
"""
from __future__ import annotations

from typing import Any

from ssd_jax.models.tokenizer import check_messages


def conversations(messages: Any) -> list[list[dict]]:
    """`messages` as a list of conversations: one conversation (a list of dicts) -> [it]; a list
    of conversations as it is; each checked by `check_messages` (its index named on an error)."""
    if isinstance(messages, (list, tuple)) and messages and \
            all(isinstance(c, (list, tuple)) for c in messages):
        out = []
        for i, conv in enumerate(messages):
            try:
                out.append(check_messages(conv))
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}") from None
        return out
    return [check_messages(messages)]


def chat_prompts(tokenizer, prompts, messages, chat: bool) -> tuple[Any, bool]:
    """(prompts, chat) for `Engine.generate`: unchanged without `messages`; with them, one
    rendered prompt text per conversation and chat False (the template is applied already).
    Raises ValueError for prompts and messages both given, a bad message list, a model without
    a tokenizer or a chat template."""
    if messages is None:
        if prompts is None:
            raise ValueError("give prompts (text or token ids) or messages=[{'role', 'content'}, "
                             "...]")
        return prompts, chat
    if prompts is not None:
        raise ValueError("give prompts or messages, not both")
    convs = conversations(messages)
    if tokenizer is None:
        raise ValueError("messages need the target's tokenizer and its chat template; this "
                         "model has no tokenizer (give token ids as prompts)")
    if not callable(getattr(tokenizer, "apply_chat_template", None)) or \
            not getattr(tokenizer, "chat_template", True):
        raise ValueError("this model's tokenizer has no chat template, so messages cannot be "
                         "rendered: give the prompt as text")
    return [tokenizer.apply_chat_template(c) for c in convs], False

"""Chat rendering by deltas (`flowgraph.agent.render.ChatRenderer`): the pieces of a
conversation are the conversation, the separator after a stop token is kept, and
templates that cannot render an episode turn by turn are refused, saying why."""

from __future__ import annotations

import pytest

from flowgraph.agent.render import ChatRenderer, TemplateError
from flowgraph.nodes.models import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-lm")


NEWLINE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
           "{% if m['role'] == 'assistant' %}<|eos|>{% endif %}{{ '\\n' }}{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""ChatML's shape: a newline after every message, the assistant's after its stop token."""
THINKING = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
            "<|assistant|>{{ m['content'].split('</think>')[-1] }}<|eos|>"
            "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|eos|>"
            "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""Drops the reasoning of every assistant turn but the last (as Qwen3's template does)."""
BOS_EACH = ("{% for m in messages %}<|bos|><|{{ m['role'] }}|>{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}<|eos|>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_the_first_prompt_and_a_delta_are_the_conversations_ids(tok):
    r = ChatRenderer(tok, stop_ids=[tok.eos_token_id])
    messages = [{"role": "user", "content": "What is 6*7?"}]
    prompt = r.prompt(messages)
    sampled = [*tok("42", add_special_tokens=False).input_ids, tok.eos_token_id]
    delta = r.delta([{"role": "tool", "content": "ok"}])
    whole = tok.apply_chat_template(
        [*messages, {"role": "assistant", "content": "42"}, {"role": "tool", "content": "ok"}],
        add_generation_prompt=True, tokenize=False)
    assert prompt + sampled + delta == tok(whole, add_special_tokens=False).input_ids
    assert r.tail == ""


def test_the_separator_after_a_stop_token_is_kept_and_a_cut_turn_is_closed(tok):
    r = ChatRenderer(tok, NEWLINE, stop_ids=[tok.eos_token_id])
    assert r.close == "<|eos|>\n" and r.tail == "\n"
    new = [{"role": "user", "content": "more"}]
    assert tok.decode(r.delta(new)) == "\n<|user|>more\n<|assistant|>"
    assert tok.decode(r.delta(new, stopped=False)) == "<|eos|>\n<|user|>more\n<|assistant|>"


@pytest.mark.parametrize("template, message", [
    (THINKING, "does not extend a conversation as a prefix"),
    (BOS_EACH, "writes the BOS token '<|bos|>' before a later message"),
])
def test_templates_that_rewrite_the_history_are_refused(tok, template, message):
    with pytest.raises(TemplateError, match=message) as info:
        ChatRenderer(tok, template, stop_ids=[tok.eos_token_id])
    assert "chat_template" in str(info.value)  # what to do


def test_no_template_at_all_is_refused(tok):
    bare = load_tokenizer("builtin:tiny-lm")
    bare.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        ChatRenderer(bare)

"""Messages to token ids, turn by turn: the first prompt, then each new message as a delta.

A multi-turn episode is trained on the ids the policy sampled, so the history is never
decoded and re-encoded (re-tokenizing a sampled turn can give other ids: TRL #5224,
verl #3960). What is rendered is only what the policy did not sample: the first
prompt, and after each turn the new messages (tool results, the env's reply) with the
next generation prompt, as the text the chat template adds to a conversation:

    delta(new) = tail + render(BASE + new, generation prompt)[len(render(BASE)):]

BASE is a fixed conversation ending with an assistant turn, so the delta does not
depend on the history. `tail` is what the template writes after an assistant turn's
stop token (ChatML's newline after `<|im_end|>`, nothing for most), or the whole
closing when the turn was cut before its stop token: a separator the template puts
between turns is never dropped (verl #6921).

That holds only for a template that extends a conversation as a prefix: each
message's text is appended, nothing earlier is rewritten. `ChatRenderer` probes the
template on a conversation with every role and refuses one that does not — a thinking
template that strips earlier turns' reasoning (verl #6854, prime-rl #1334), one that
writes a BOS before every message, one whose pieces tokenize differently from the
whole — saying why and what to do.

Multi-turn SFT (`flowgraph.nodes.data.sft.conversation_spans`) marks its assistant turns
with the same renderer (`ChatRenderer.spans`). Torch-free: only the tokenizer.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

from flowgraph.agent.env import Message
from flowgraph.choices import SHOW_TOOLS
from flowgraph.errors import FlowgraphError

__all__ = ["ChatRenderer", "TemplateError", "tools_system_message"]

_BASE: list[Message] = [{"role": "user", "content": "Hi."},
                        {"role": "assistant", "content": "Hello."}]
_PROBE: list[Message] = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "What is 6*7?"},
    {"role": "assistant", "content": "<think>\nUse the tool.\n</think>\n\n<tool_call>\n"
                                     '{"name": "mul", "arguments": {"a": 6, "b": 7}}\n'
                                     "</tool_call>"},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "<think>\nIt said 42.\n</think>\n\n42"},
    {"role": "user", "content": "And 6*8?"},
    {"role": "assistant", "content": "48"},
]
"""A conversation with every role and reasoning in the assistant turns."""


class TemplateError(FlowgraphError):
    """A chat template that cannot render an episode turn by turn."""


class ChatRenderer:
    """A tokenizer's chat template (or `template`), rendering an episode's pieces.

    `tools` are the episode's tool schemas (`Tool.schema()`), shown as `show_tools`
    says (`SHOW_TOOLS`): by default passed to the template as
    `apply_chat_template(tools=...)` (a Qwen / Hermes template lists them in the system
    prompt). Raises `TemplateError` when the template does not extend a conversation as
    a prefix, or is to show tools it does not render (TRL refuses such a template too:
    the policy would be trained on prompts that never show its tools).
    """

    def __init__(self, tokenizer: Any, template: str | None = None,
                 tools: Sequence[dict[str, Any]] = (), stop_ids: Sequence[int] = (),
                 probe: bool = True, show_tools: str = "template") -> None:
        if show_tools not in SHOW_TOOLS:
            raise ValueError(f"show_tools is {show_tools!r}; one of {', '.join(SHOW_TOOLS)}")
        self.show_tools = show_tools
        self._shown: dict[tuple[str, ...], list[str]] = {}
        """Tool names -> those the template leaves out (probed once, shared by copies)."""
        if template is None and getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError("the tokenizer has no chat template (a base model?); an agent "
                                "rollout renders messages with one: give the rollout's "
                                "`chat_template` (a Jinja text or a .jinja file)")
        self.tokenizer, self.template, self.tools = tokenizer, template, list(tools)
        self.close = self._closing()
        stops = [tokenizer.decode([i]) for i in stop_ids]
        stop = next((s for s in stops if s and self.close.startswith(s)), "")
        self.tail = self.close[len(stop):]
        """What follows an assistant turn that ended with its stop token."""
        if probe:
            self.check()
        self.check_tools()

    def with_tools(self, tools: Sequence[dict[str, Any]]) -> ChatRenderer:
        """This renderer listing `tools` (schemas) instead (the template, once probed,
        need not be again: what it writes after a turn does not depend on them);
        TemplateError when the template is to show them and does not."""
        if list(tools) == self.tools:
            return self
        other = copy.copy(self)
        other.tools = list(tools)
        other.check_tools()
        return other

    def check_tools(self) -> None:
        """Refuse a template that leaves this renderer's tools out of the prompt when it is
        the one to show them (`show_tools: template`): a first prompt rendered with the
        tools must differ from one without them and name every tool."""
        if self.show_tools != "template" or not self.tools:
            return
        names = tuple(_tool_name(t) for t in self.tools)
        if names not in self._shown:
            hi: list[Message] = [{"role": "user", "content": "Hi."}]
            with_tools = self._render(hi, True, self.tools)
            self._shown[names] = list(names) if with_tools == self._render(hi, True, []) \
                else [n for n in names if n not in with_tools]
        left_out = self._shown[names]
        if left_out:
            raise TemplateError(
                f"the chat template does not show the episode's tools in the prompt "
                f"(rendered with `tools=`, the prompt leaves out {', '.join(left_out)}): the "
                "policy would be trained on prompts that never show its tools. Give the "
                "rollout a `chat_template` that renders `tools` (the model's own, as Qwen's "
                "and Llama 3's do), or set `show_tools: system` (flowgraph lists them in a "
                "system message, in the hermes <tool_call> format), or `show_tools: none` "
                "when no prompt is to list them (a model trained on its tools, an env "
                "whose prompt describes them)")

    def text(self, messages: Sequence[Message], generation: bool) -> str:
        return self._render(messages, generation, self.tools)

    def _render(self, messages: Sequence[Message], generation: bool,
                tools: Sequence[dict[str, Any]]) -> str:
        given = list(messages)
        if tools and self.show_tools == "system":
            given = _with_tools_message(given, tools)
        out: str = self.tokenizer.apply_chat_template(
            given, tools=list(tools) or None if self.show_tools == "template" else None,
            chat_template=self.template, add_generation_prompt=generation, tokenize=False)
        return out

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The first prompt: `messages` with the generation prompt."""
        return self.ids(self.text(messages, True))

    def delta(self, new: Sequence[Message], stopped: bool = True) -> list[int]:
        """The ids that follow a sampled assistant turn: its closing (`tail` when the
        turn ended with its stop token, the whole closing when it was cut), `new`'s
        messages and the next generation prompt."""
        return self.ids((self.tail if stopped else self.close) + self._added(_BASE, new))

    def spans(self, messages: Sequence[Message], first: int) -> list[tuple[list[int], bool]]:
        """A whole conversation after `messages[:first]` (which ends before an assistant
        turn) as (ids, assistant) spans: each assistant message as the template writes
        it, each run of other messages with the next generation prompt, each the text
        the template adds to the conversation so far (multi-turn SFT's loss mask).
        TemplateError when a prefix's text does not start the next one's."""
        spans: list[tuple[str, bool]] = []
        done, i = self.text(messages[:first], True), first
        while i < len(messages):
            j = i + 1
            if messages[i]["role"] != "assistant":
                while messages[j]["role"] != "assistant":
                    j += 1
            upto = self.text(messages[:j], messages[i]["role"] != "assistant")
            if not upto.startswith(done):
                raise TemplateError(self._not_prefix(messages[:i], messages[i:j]))
            spans.append((upto[len(done):], messages[i]["role"] == "assistant"))
            done, i = upto, j
        ids = self.tokenizer([t for t, _ in spans], add_special_tokens=False).input_ids
        return [(list(t), trained) for t, (_, trained) in zip(ids, spans, strict=True)]

    def _added(self, before: Sequence[Message], new: Sequence[Message]) -> str:
        head = self.text(before, False)
        full = self.text([*before, *new], True)
        if not full.startswith(head):
            raise TemplateError(self._not_prefix(before, new))
        return full[len(head):]

    def _closing(self) -> str:
        """What the template writes after an assistant message's content."""
        text = self.text(_BASE, False)
        content = str(_BASE[-1]["content"])
        at = text.rfind(content)
        if at < 0:
            raise TemplateError("the chat template does not write an assistant message's "
                                f"content as it is (rendering {_BASE} gave {text!r})")
        return text[at + len(content):]

    def check(self) -> None:
        """Refuse a template that cannot render `_PROBE` turn by turn: each prefix's text
        must start the next one's, no piece may carry the BOS token, and the pieces'
        ids must be the whole conversation's ids."""
        pieces: list[list[int]] = []
        done = ""
        for k in range(1, len(_PROBE) + 1):
            generation = k < len(_PROBE) and _PROBE[k]["role"] == "assistant"
            upto = self.text(_PROBE[:k], generation)
            if not upto.startswith(done):
                raise TemplateError(self._not_prefix(_PROBE[:k - 1], _PROBE[k - 1:k]))
            piece = upto[len(done):]
            bos = getattr(self.tokenizer, "bos_token", None)
            if k > 1 and bos and bos in piece:
                raise TemplateError(
                    f"the chat template writes the BOS token {bos!r} before a later message "
                    f"({_PROBE[k - 1]['role']}): the model would see a new document start "
                    "mid-episode. Give the rollout a `chat_template` that writes BOS once")
            pieces.append(self.ids(piece))
            done = upto
        whole = self.ids(done)
        if [t for p in pieces for t in p] != whole:
            raise TemplateError(
                "the chat template's pieces tokenize differently from the whole "
                "conversation (a token spans the boundary between two messages), so the "
                "ids of a turn would depend on what follows it. Give the rollout a "
                "`chat_template` whose messages end on a special token")

    def _not_prefix(self, before: Sequence[Message], new: Sequence[Message]) -> str:
        roles = [m["role"] for m in before]
        return (f"the chat template does not extend a conversation as a prefix: the text "
                f"of messages {roles} is not the start of the text after adding a "
                f"{new[0]['role']} message. A template that rewrites earlier turns (a "
                "thinking model's template dropping earlier <think> blocks, as Qwen3's "
                "does) would train the policy on a history it never saw. Give the rollout "
                "a `chat_template` that keeps every turn as it was written (for Qwen3: "
                "one that keeps reasoning_content in every turn); an SFT row: or split "
                "it into one row per answer")


def _tool_name(schema: dict[str, Any]) -> str:
    function = schema.get("function")
    return str((function if isinstance(function, dict) else schema).get("name", "?"))


def tools_system_message(tools: Sequence[dict[str, Any]]) -> str:
    """The tools' JSON schemas as a system message lists them (`show_tools: system`), with
    how to call one in the hermes format the default parser reads."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou can call the functions whose JSON schemas are listed in "
            f"<tools></tools>:\n<tools>\n{listed}\n</tools>\n\nTo call one, write its "
            "name and arguments as a JSON object inside <tool_call></tool_call>:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON '
            "object>}\n</tool_call>")


def _with_tools_message(messages: list[Message], tools: Sequence[dict[str, Any]]
                        ) -> list[Message]:
    """`messages` with the tools listed in their system message (appended to the first
    message's content when it is one, else a system message of its own ahead)."""
    listing = tools_system_message(tools)
    if messages and messages[0]["role"] == "system" and isinstance(messages[0]["content"], str):
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{listing}"},
                *messages[1:]]
    return [{"role": "system", "content": listing}, *messages]

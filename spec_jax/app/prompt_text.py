"""Request text -> prompt token ids for the HTTP API, safely:

  - `check_messages`: OpenAI's chat messages in either content form (a string, or a list of
    text parts, joined with "\\n" as vLLM does); image, audio and file parts refused by name;
    OpenAI's roles only ("developer" is read as "system");
  - `PromptText`: what a tokenizer and chat template allow, worked out once per server: the roles
    the template renders (`roles`, found by rendering each), the chat prompt's ids with
    special-token text inside message content kept as ordinary text (`chat_ids`), and a bound
    on how many tokens a text can be at least, so that a huge prompt is refused before it is
    tokenized (`fewest_tokens`).

Errors are ValueError with a message naming the message and field; the API answers them as a 400
naming `messages`.
"""

from __future__ import annotations

import re
from typing import Any

OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")
_NULL_ONLY = ("tool_calls", "function_call", "audio", "refusal", "annotations", "name")
_PROBE = "spec-jax-role-probe"
# Normalisation (NFKC composes up to three code points into one) can shrink text before it is
# split into tokens: the bound on a text's fewest tokens allows for that.
NORMALISATION_SLACK = 4


def _content(where: str, content: Any) -> str:
    """A message's content as one string: text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ValueError(f"'{where}.content' must be a string or a non-empty list of text parts.")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}:
            texts.append(part["text"])
        elif isinstance(kind, str) and kind != "text":
            raise ValueError(f"'{where}.content[{j}]' is a {kind!r} part; this server's model reads text only: "
                             "send the message as text parts or a string.")
        else:
            raise ValueError(f"'{where}.content[{j}]' must be a text part, {{\"type\": \"text\", \"text\": \"...\"}}.")
    return "\n".join(texts)


def check_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI chat messages -> [{role, content}] (plus tool_call_id for a tool message)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects.")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(f"'{where}' must be an object whose 'role' and 'content' are set.")
        role = message["role"]
        if role not in OPENAI_ROLES:
            raise ValueError(f"'{where}.role' is {role!r}; a role is one of {', '.join(OPENAI_ROLES)}.")
        for key, value in message.items():
            if key in _NULL_ONLY and value is not None:
                raise ValueError(f"'{where}.{key}' is not supported by this server (no tools, audio or participant "
                                 "names); leave it out.")
            if key not in _NULL_ONLY and key not in ("role", "content", "tool_call_id"):
                raise ValueError(f"'{where}.{key}' is not a message field; a message has 'role' and 'content'.")
        entry = {"role": "system" if role == "developer" else role, "content": _content(where, message["content"])}
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            entry["tool_call_id"] = message["tool_call_id"]
        checked.append(entry)
    return checked


class PromptText:
    """A tokenizer and its chat template, as the API turns request text into ids."""

    def __init__(self, tokenizer: Any, chat_template: str | None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_ids = {i for i, t in added.items() if getattr(t, "special", False)}
        texts = sorted((str(added[i]) for i in self.special_ids), key=len, reverse=True)
        self.special_text = re.compile("|".join(map(re.escape, texts))) if texts else None
        self.longest_token = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.roles = self._template_roles() if self.chat_template else frozenset()

    def fewest_tokens(self, chars: int) -> int:
        """A lower bound on the tokens of any text of `chars` characters (no token holds more than
        `longest_token` characters of it)."""
        return -(-chars // (self.longest_token * NORMALISATION_SLACK))

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template,
                                                  add_generation_prompt=True, tokenize=False)

    def _template_roles(self) -> frozenset[str]:
        """The roles whose content the template renders (a template may raise on a role, or drop it)."""
        hi = {"role": "user", "content": "hi"}
        trials = {"system": [{"role": "system", "content": _PROBE}, hi],
                  "user": [{"role": "user", "content": _PROBE}],
                  "assistant": [hi, {"role": "assistant", "content": _PROBE}],
                  "tool": [hi, {"role": "assistant", "content": "ok"},
                           {"role": "tool", "content": _PROBE, "tool_call_id": "call_0"}]}
        roles = set()
        for role, messages in trials.items():
            try:
                if _PROBE in self._render(messages):
                    roles.add(role)
            except Exception:  # noqa: BLE001 - a template that refuses the role raises anything
                pass
        return frozenset(roles)

    def check_roles(self, messages: list[dict[str, str]]) -> None:
        for i, message in enumerate(messages):
            if message["role"] not in self.roles:
                read_as = " ('developer' is read as 'system')" if message["role"] == "system" else ""
                raise ValueError(f"'messages[{i}].role' is {message['role']!r}, which this model's chat template "
                                 f"does not take{read_as}; it takes {', '.join(sorted(self.roles)) or 'none'}.")

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat prompt's ids. Special-token text inside a message's content ("<|im_end|>" typed
        by a user) becomes ordinary tokens: only the template's own markers are control tokens."""
        from spec_jax.checkpoints import apply_chat_template

        if self.special_text is None or not any(self.special_text.search(m["content"]) for m in messages):
            return apply_chat_template(self.tokenizer, messages, self.chat_template)
        text = self._render(messages)
        spans, at = [], 0
        for i, message in enumerate(messages):
            found = text.find(message["content"], at)
            if found < 0 and self.special_text.search(message["content"]):
                raise ValueError(f"'messages[{i}].content' holds special-token text that this chat template "
                                 "changes, so it cannot be kept as text; remove it.")
            if found >= 0:
                spans.append((found, found + len(message["content"])))
                at = found + len(message["content"])
        return self._ids_with_spans_as_text(text, spans)

    def _ids_with_spans_as_text(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """`text`'s ids, except that a special token inside a span is text: each stretch between
        two of the template's control tokens that holds one is tokenized again with special
        tokens split."""
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        out, stretch, start, injected = [], [], 0, False

        def end_stretch(end: int) -> None:
            nonlocal stretch, injected
            out.extend(self.tokenizer(text[start:end], add_special_tokens=False, split_special_tokens=True)
                       ["input_ids"] if injected else stretch)
            stretch, injected = [], False

        for token, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"]):
            inside = any(s <= a and b <= e for s, e in spans)
            if token in self.special_ids and not inside:  # the template's own marker
                end_stretch(a)
                out.append(token)
                start = b
            else:
                stretch.append(token)
                injected |= token in self.special_ids
        end_stretch(len(text))
        return out

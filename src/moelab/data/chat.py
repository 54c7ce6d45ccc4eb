"""Conversations as data: the chat form's checks, its templates, and where the assistant speaks.

A conversation is the Hugging Face / OpenAI chat form, ``{"messages": [{"role": ..., "content": ...},
...]}``: roles ``system``, ``user``, ``assistant`` and ``tool``, content a string, at least one
assistant turn. ``problem(messages)`` says in one phrase what is wrong with one, or None.

A template turns a conversation into text. ``ChatTemplate.of(folder)`` takes the ``chat_template``
of a tokenizer's ``tokenizer_config.json`` (a string, or the one named "default" of a list; else the
folder's ``chat_template.jinja``, where transformers now saves it) and
renders it with Jinja2 as transformers' ``apply_chat_template`` does: a sandboxed environment that
trims blocks, loop controls, ``tojson``, ``raise_exception`` and ``strftime_now``, with the
tokenizer's ``bos_token`` and ``eos_token`` and the special tokens it names. A folder without one
(a tokenizer moelab trained) gets moelab's own, ``MOELAB_TEMPLATE`` (ChatML's form, whose markers
``SPECIAL_TOKENS`` a moelab tokenizer holds as special tokens).

``assistant_spans(messages)`` gives the characters of the rendered text that the assistant wrote,
each turn's content and the marker that ends it, found by rendering the conversation turn by turn
(a template whose text for the first turns changes when later turns follow cannot give spans and is
refused). These spans become the loss mask of supervised fine-tuning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from moelab.errors import UsageError

ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
# ChatML, the form of Qwen's and many other templates: each turn between its markers
MOELAB_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def problem(messages) -> str | None:
    """What makes ``messages`` no conversation, in one phrase; None when it is one."""
    if not isinstance(messages, list) or not messages:
        return '"messages" must be a non-empty list of {"role", "content"} objects'
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f'message {i} has no "role"'
        if m["role"] not in ROLES:
            return f"message {i} has an unknown role {m['role']!r} (known: {', '.join(ROLES)})"
        if not isinstance(m.get("content"), str):
            return f'message {i} ({m["role"]}) has no "content" string'
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn: nothing to learn from"
    return None


def _environment():
    """Jinja2's sandbox as transformers sets it up for chat templates."""
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class Generation(
        Extension
    ):  # {% generation %}...{% endgeneration %}: transformers' assistant marks, rendered as is
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):  # {"content": ..., "__type": "AddedToken"}
        return tok.get("content")
    return tok


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the template's text
    origin: str  # where it came from: "<folder>/tokenizer_config.json" or "moelab"
    special: dict  # bos_token, eos_token, ... as the template sees them

    @classmethod
    def of(cls, folder: str | Path | None) -> ChatTemplate:
        """The template of a tokenizer's folder (its tokenizer_config.json's chat_template), else moelab's own."""
        path = Path(folder) / "tokenizer_config.json" if folder else None
        if path is None or not path.is_file():
            return cls(MOELAB_TEMPLATE, "moelab", {"eos_token": "<|endoftext|>"})
        try:
            conf = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path}: not readable as JSON ({exc})") from None
        tpl = conf.get("chat_template")
        if not tpl and (path.parent / "chat_template.jinja").is_file():  # transformers' own file, since v4.47
            tpl, path = (
                (path.parent / "chat_template.jinja").read_text(encoding="utf-8"),
                path.parent / "chat_template.jinja",
            )
        if isinstance(tpl, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            tpl = named.get("default")
        if not tpl:
            return cls(MOELAB_TEMPLATE, "moelab", {"eos_token": _token_text(conf.get("eos_token")) or "<|endoftext|>"})
        special = {k: _token_text(v) for k, v in conf.items() if k.endswith("_token") and _token_text(v) is not None}
        return cls(tpl, str(path), special)

    @classmethod
    def for_tokenizer(cls, spec: str) -> ChatTemplate:
        """The template of a run's ``data.tokenizer`` (a tokenizer.json or its folder; "" for a tokenizer
        moelab trained: moelab's own)."""
        path = Path(spec) if spec else None
        return cls.of(path if path is None or path.is_dir() else path.parent)

    @property
    def ends(self) -> list[str]:
        """What ends the assistant's turn: moelab's end marker, or the tokenizer's end-of-sequence token."""
        if self.origin == "moelab":
            return ["<|im_end|>"]
        return [v for v in (self.special.get("eos_token"),) if v]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text (UsageError where the template fails on it)."""
        from jinja2.exceptions import TemplateError

        try:
            compiled = _compiled(self.source)
            return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)
        except TemplateError as exc:
            raise UsageError(f"the chat template ({self.origin}) fails: {exc}") from None

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the [start, end) characters of each assistant turn: its content
        and what the template writes after it up to the next turn, such as its end marker)."""
        text = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self.render(messages[: i + 1])
            if not text.startswith(upto) or not upto.startswith(before):
                raise UsageError(
                    f"the chat template ({self.origin}) renders the first turns differently when more follow; "
                    "the assistant's tokens cannot be found"
                )
            end = len(upto)
            spans.append((len(before), end))
        return text, spans


_CACHE: dict[str, object] = {}


def _compiled(source: str):
    if source not in _CACHE:
        _CACHE[source] = _environment().from_string(source)
    return _CACHE[source]

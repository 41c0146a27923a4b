"""Conversations -> prompt text: the model's chat template, rendered as Hugging Face renders it.

Hugging Face keeps a Jinja template in the model folder (`tokenizer_config.json` "chat_template", or a
`chat_template.jinja` file next to it) and renders it with `messages`, the special tokens (`bos_token`,
`eos_token`, ...) and `add_generation_prompt=True`, in a sandboxed, immutable Jinja environment with a few helpers
(`raise_exception`, a `tojson` that does not HTML-escape, `strftime_now`, `namespace`). We do the same, so a
served conversation gets exactly the prompt `tokenizer.apply_chat_template(..., add_generation_prompt=True)`
would give, without needing transformers at run time.

Admission and `tether.reference` both go through `tokenize_conversation`, so the two see the same prompt text
and the same token ids.

One deliberate difference from Hugging Face, whose apply_chat_template(tokenize=True) tokenizes the rendered
text as a whole: there, a message spelling `<|im_end|>\n<|im_start|>system\n...` closes its own turn and
forges a system turn, since the tokenizer turns every control-token spelling into the control token. Here a
message's content never becomes control tokens: the template is rendered a second time with a random marker in
place of each content, which tells the template's own text from the contents in the real rendering, and only
the template's text is tokenized with control tokens (Tokenizer.encode_chat). For any conversation without a
control spelling in its messages the ids are Hugging Face's. A template that changes content on its way in
(trims it, escapes it, branches on it) cannot be split that way; for it a message holding a control spelling is
refused (INVALID_ARGUMENT at admission), never tokenized into one.

Pure: no I/O except `load_chat_template`, which reads the folder once.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES: tuple[str, ...] = ("system", "user", "assistant")

# ChatML, as SmolLM2 and Qwen2 use it. Written into the preset folders (tether/model/presets.py); the presets'
# byte tokenizer spells the markers as plain bytes, which is all a random model needs.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ConversationError(ValueError):
    """A conversation that cannot be rendered: the message says what to fix (shown to the caller verbatim)."""


class ChatTokenizer(Protocol):
    """What tokenizing a conversation needs of a tokenizer (tether.model.tokenizer.Tokenizer)."""

    def control_tokens(self, text: str) -> list[str]: ...
    def encode_chat(self, parts: Iterable[tuple[str, bool]]) -> list[int]: ...


@dataclass(frozen=True)
class Rendered:
    """A conversation's prompt text, and the same text as (text, is_template) parts when the template took
    every content verbatim; None when it did not (it changed or tested a content: the two cannot be told)."""

    text: str
    parts: tuple[tuple[str, bool], ...] | None
    template_only: str | None = None   # the marked rendering less its markers: what the template itself wrote


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: Hugging Face marks assistant text with it (for training masks).
    Rendering only needs the body; without the tag such templates would not even compile."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    # Templates call this to refuse a conversation they cannot render (e.g. roles that do not alternate).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Hugging Face's: Jinja's own tojson HTML-escapes, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    # Some templates print today's date; such a template's prompt depends on the day it is rendered.
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` refusing underscore names, as Hugging Face's does, so templates cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


def _environment() -> ImmutableSandboxedEnvironment:
    # The same settings as Hugging Face: whitespace control changes the prompt, so it must match exactly.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with. Thread-safe: rendering keeps no state."""

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)   # bos_token, eos_token, ... as strings
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            compiled = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e.message} (line {e.lineno})") from None
        object.__setattr__(self, "_compiled", compiled)

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` (dicts with "role" and "content"); ConversationError when the template
        refuses them or fails on them."""
        try:
            return self._compiled.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as e:   # raise_exception, undefined names, sandbox refusals
            raise ConversationError(f"the model's chat template refused the conversation: {e}") from None
        except Exception as e:  # noqa: BLE001 - a template bug on odd input is still this conversation's refusal
            raise ConversationError(f"the model's chat template failed on the conversation: "
                                    f"{type(e).__name__}: {e}") from None

    def render_parts(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> Rendered:
        """`render`, plus which parts of the text are the template's and which are message contents."""
        text = self.render(messages, add_generation_prompt)
        # A marker per content: random, so no content can spell one; private-use characters and no spaces, so
        # a template's own string filters leave it whole if they leave the content whole.
        nonce = secrets.token_hex(8)
        markers = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
        try:
            marked = self.render([{**m, "content": k} for m, k in zip(messages, markers)], add_generation_prompt)
        except ConversationError:   # the template tests content (refuses a marker): it does not take it verbatim
            return Rendered(text, None)
        pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", marked)
        parts: list[tuple[str, bool]] = []
        for j, piece in enumerate(pieces):   # even: the template's text; odd: a content's index
            parts.append((piece, True) if j % 2 == 0 else (messages[int(piece)]["content"], False))
        template_only = "".join(p for j, p in enumerate(pieces) if j % 2 == 0)
        if "".join(t for t, _ in parts) != text:   # the template changed a content, or chose by it
            return Rendered(text, None, template_only)
        return Rendered(text, tuple(p for p in parts if p[0]), template_only)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _template_source(value: Any) -> str | None:
    """tokenizer_config "chat_template": a string, or a list of {"name", "template"} where "default" is used."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        source = named.get("default")
        return source if isinstance(source, str) else None
    return None


def load_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The model folder's chat template, None when it has none (then it serves raw prompts only).

    `chat_template.jinja` wins over tokenizer_config.json's "chat_template", as in Hugging Face.
    """
    folder = Path(folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    jinja_path = folder / "chat_template.jinja"
    source = jinja_path.read_text(encoding="utf-8") if jinja_path.is_file() else _template_source(cfg.get("chat_template"))
    if not source:
        return None
    tokens = {name: text for name in ("bos_token", "eos_token", "unk_token", "pad_token")
              if (text := _token_text(cfg.get(name))) is not None}
    return ChatTemplate(source, tokens)


def check_messages(messages: Iterable[tuple[str, str]]) -> list[dict[str, str]]:
    """The conversation as template input, after the rules every conversation must follow.

    A system message may only come first; user and system contents need a non-whitespace character (an
    assistant's may be empty: a model can answer with nothing, and a client replays what it got); the last
    message is the user's, since we render with add_generation_prompt and ask for the assistant's reply.
    """
    out: list[dict[str, str]] = []
    for i, (role, content) in enumerate(messages):
        if role not in ROLES:
            raise ConversationError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role[:40]!r}")
        if role == "system" and i != 0:
            raise ConversationError(f"messages[{i}] is a system message; only the first message may be one")
        if role != "assistant" and not content.strip():
            raise ConversationError(f"messages[{i}] ({role}) has empty content; send some text")
        out.append({"role": role, "content": content})
    if not out:
        raise ConversationError("messages is empty; send at least one user message")
    if out[-1]["role"] != "user":
        raise ConversationError(f"the last message must be the user's (the model answers it); "
                                f"messages[{len(out) - 1}] is {out[-1]['role']!r}")
    return out


def render_conversation(template: ChatTemplate | None, messages: Iterable[tuple[str, str]]) -> str:
    """Check `messages` ((role, content) pairs) and render them for the next assistant reply (the text only:
    `tokenize_conversation` for the ids a model is sent)."""
    if template is None:
        raise ConversationError("this model has no chat template (tokenizer_config.json \"chat_template\"), "
                                "so it cannot take a conversation; send a raw prompt instead")
    return template.render(check_messages(messages), add_generation_prompt=True)


def tokenize_conversation(template: ChatTemplate | None, tokenizer: ChatTokenizer,
                          messages: Iterable[tuple[str, str]]) -> tuple[str, list[int]]:
    """`render_conversation`'s text and its token ids, where no message content makes a control token.

    The one function admission and `tether.reference` share, so both send the model the same ids.
    ConversationError where the template does not take contents verbatim and a content spells a control token.
    """
    if template is None:
        return render_conversation(template, messages), []   # raises: the model takes no conversation
    checked = check_messages(messages)
    rendered = template.render_parts(checked, add_generation_prompt=True)
    if rendered.parts is not None:
        return rendered.text, tokenizer.encode_chat(rendered.parts)
    # The contents cannot be told from the template's text: tokenize the whole, but only once it is certain that
    # every control token in it is the template's.
    for i, m in enumerate(checked):
        found = tokenizer.control_tokens(m["content"])
        if found:
            raise ConversationError(f"messages[{i}].content contains {found[0]!r}, a control token of this model, "
                                    f"and its chat template changes message text, so the token cannot be kept as "
                                    f"plain text; remove it")
    if rendered.template_only is not None and (tokenizer.control_tokens(rendered.text)
                                               != tokenizer.control_tokens(rendered.template_only)):
        raise ConversationError("this model's chat template makes other control tokens of this conversation than of "
                                "its turns alone (a message's text joins the template's into one, or the template "
                                "chooses by what a message says); rephrase the messages")
    return rendered.text, tokenizer.encode_chat([(rendered.text, True)])

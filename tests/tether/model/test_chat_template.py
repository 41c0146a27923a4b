"""Chat templates: rendered as Hugging Face renders them, sandboxed, and the conversation rules."""

from __future__ import annotations

import json

import pytest

from tether.model.chat_template import (CHATML_TEMPLATE, ChatTemplate, ConversationError, check_messages,
                                        load_chat_template, render_conversation)

CHAT = [("system", "You are terse."), ("user", "Hi"), ("assistant", "Hello."), ("user", "你好？")]

# Shapes real models ship: Llama-2 (raise_exception, bos/eos, alternation), Zephyr-like (eos after each turn),
# a tojson/namespace user (tool-style), and ChatML.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
ZEPHYR = (
    "{% for message in messages %}\n"
    "{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
    "{% endfor %}"
)
TOJSON = (
    "{%- set ns = namespace(n=0) -%}"
    "{%- for m in messages -%}{%- set ns.n = ns.n + 1 -%}{{ m | tojson }}\n{%- endfor -%}"
    "{{ ns.n }}{% if add_generation_prompt %}<go>{% endif %}"
)
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}


def dicts(pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_chatml_renders_each_message_and_the_generation_prompt():
    text = render_conversation(ChatTemplate(CHATML_TEMPLATE), CHAT)
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n你好？<|im_end|>\n"
                    "<|im_start|>assistant\n")


@pytest.mark.parametrize("source", [CHATML_TEMPLATE, LLAMA2, ZEPHYR, TOJSON])
@pytest.mark.parametrize("chat", [CHAT[1:2], CHAT[1:], CHAT, [("user", 'a "quoted" <b>&</b>\n\ttab')]])
def test_renders_exactly_as_hugging_face(source, chat):
    hf = pytest.importorskip("transformers.utils.chat_template_utils")
    ours = ChatTemplate(source, TOKENS)
    try:
        want = hf.render_jinja_template([dicts(chat)], chat_template=source, add_generation_prompt=True,
                                        **TOKENS)[0][0]
    except Exception as e:  # noqa: BLE001 - then ours must refuse too
        with pytest.raises(ConversationError, match="alternate"):
            render_conversation(ours, chat)
        assert "alternate" in str(e)
        return
    assert render_conversation(ours, chat) == want


def test_template_refusal_is_a_conversation_error_with_the_templates_message():
    with pytest.raises(ConversationError, match="refused the conversation: Conversation roles must alternate"):
        render_conversation(ChatTemplate(LLAMA2, TOKENS), [("user", "a"), ("user", "b")])


def test_sandbox_blocks_reaching_python_internals():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ConversationError):
        ChatTemplate(evil).render(dicts(CHAT[1:2]))
    mutate = "{{ messages.append({'role': 'user', 'content': 'x'}) }}"   # immutable: no mutation either
    with pytest.raises(ConversationError):
        ChatTemplate(mutate).render(dicts(CHAT[1:2]))
    with pytest.raises(ConversationError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(dicts(CHAT[1:2]))


def test_a_template_that_does_not_compile_is_refused_at_load():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_generation_tag_compiles_and_renders_its_body():
    t = ChatTemplate("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
    assert t.render(dicts(CHAT[1:2])) == "[Hi]"


@pytest.mark.parametrize("messages,fragment", [
    ([], "messages is empty"),
    ([("tool", "x")], "messages[0].role must be one of system, user, assistant; got 'tool'"),
    ([("User", "x")], "got 'User'"),
    ([("user", "a"), ("system", "s"), ("user", "b")], "messages[1] is a system message; only the first"),
    ([("user", "  \n")], "messages[0] (user) has empty content"),
    ([("system", ""), ("user", "x")], "messages[0] (system) has empty content"),
    ([("user", "q"), ("assistant", "a")], "the last message must be the user's"),
    ([("system", "s")], "the last message must be the user's"),
])
def test_conversation_rules(messages, fragment):
    with pytest.raises(ConversationError) as e:
        check_messages(messages)
    assert fragment in str(e.value)


def test_an_assistant_may_have_answered_with_nothing():
    assert check_messages([("user", "q"), ("assistant", ""), ("user", "again")])[1] == {"role": "assistant",
                                                                                       "content": ""}


def test_a_model_without_a_template_takes_no_conversation(tmp_path):
    assert load_chat_template(tmp_path) is None
    with pytest.raises(ConversationError, match="no chat template"):
        render_conversation(None, CHAT[1:2])


def test_load_reads_tokenizer_config_special_tokens_and_named_templates(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "no"}, {"name": "default", "template": "{{ bos_token }}"
                                                                    "{{ messages[0].content }}{{ eos_token }}"}],
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
    t = load_chat_template(tmp_path)
    assert t is not None and t.render(dicts(CHAT[1:2])) == "<s>Hi</s>"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")   # the separate file wins
    assert load_chat_template(tmp_path).render(dicts(CHAT)) == "J4"


def test_presets_carry_the_chatml_template():
    from tether.model.presets import ensure_preset
    t = load_chat_template(ensure_preset("tiny"))
    assert t is not None and t.source == CHATML_TEMPLATE

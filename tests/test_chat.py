"""Conversations (moelab.data.chat): templates render as transformers' apply_chat_template renders
them, the assistant's characters are exactly its turns, and a bad conversation is named."""

from __future__ import annotations

import json

import pytest

from moelab.data.chat import MOELAB_TEMPLATE, ChatTemplate, problem
from moelab.errors import UsageError

CONVERSATIONS = [
    [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}],
    [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "A function that doubles x?"},
        {"role": "assistant", "content": "def double(x):\n    return 2 * x"},
        {"role": "user", "content": 'And triples it? {"json": 1}'},
        {"role": "assistant", "content": "def triple(x):\n    return 3 * x"},
    ],
]
# three templates of the forms found in the wild: ChatML (moelab's own), Llama 3's header form with a bos
# and a check that raises, and one with tojson, loop controls and transformers' generation marks
LLAMA = (
    "{{- bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
FANCY = """{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
  {% if m.role == 'assistant' %}
<|assistant|>{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}
  {% else %}
<|{{ m.role }}|>{{ m.content | tojson }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def _hf_tokenizer(template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   chat_template=template)  # fmt: skip


@pytest.mark.parametrize("template", [MOELAB_TEMPLATE, LLAMA, FANCY], ids=["chatml", "llama", "fancy"])
def test_templates_render_as_transformers_renders_them(template, tmp_path):
    hf = _hf_tokenizer(template)
    hf.save_pretrained(tmp_path)  # tokenizer_config.json (or chat_template.jinja) as transformers writes it
    mine = ChatTemplate.of(tmp_path)
    assert mine.origin != "moelab" and mine.special["bos_token"] == "<s>"
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert mine.render(messages, add_generation_prompt=prompt) == want


def test_the_assistant_s_characters_are_its_turns_hand_checked():
    text, spans = ChatTemplate.of(None).assistant_spans(CONVERSATIONS[1])
    assert [text[a:b] for a, b in spans] == [
        "def double(x):\n    return 2 * x<|im_end|>\n",
        "def triple(x):\n    return 3 * x<|im_end|>\n",
    ]
    prompt = text[: spans[0][0]]
    assert prompt == (
        "<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\nA function that doubles x?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # the rest: the second user turn and the assistant's header, never the assistant's own words
    assert (
        text[spans[0][1] : spans[1][0]]
        == '<|im_start|>user\nAnd triples it? {"json": 1}<|im_end|>\n<|im_start|>assistant\n'
    )
    assert spans[1][1] == len(text)


def test_a_template_that_rewrites_earlier_turns_gives_no_spans(tmp_path):
    # shows only the last turn: the first turns' text changes when more follow
    last_only = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": last_only}))
    with pytest.raises(UsageError, match="renders the first turns differently"):
        ChatTemplate.of(tmp_path).assistant_spans(CONVERSATIONS[1])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ raise_exception('no') }}"}))
    with pytest.raises(UsageError, match="the chat template .* fails: no"):
        ChatTemplate.of(tmp_path).render(CONVERSATIONS[0])


@pytest.mark.parametrize(
    "messages,says",
    [
        ([], "non-empty list"),
        ([{"content": "x"}], 'message 0 has no "role"'),
        ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
        ([{"role": "user", "content": 3}], 'message 0 (user) has no "content" string'),
        ([{"role": "user", "content": "hi"}], "no assistant turn"),
    ],
)
def test_a_bad_conversation_is_named(messages, says):
    assert says in problem(messages)
    assert problem(CONVERSATIONS[0]) is None


def test_sample_chat_renders_the_run_s_template(tmp_path):
    """`moelab sample --chat`: one user turn (or a --messages file) through the run's template, ready for
    the assistant, ending at the template's end of turn; moelab's own where the tokenizer has none."""
    import argparse
    import types

    from moelab.cli.use import _prompt_text

    def args(**kw):
        base = {"chat": True, "prompt": None, "messages": None}
        return argparse.Namespace(**{**base, **kw})

    own = types.SimpleNamespace(data=types.SimpleNamespace(tokenizer=""))
    text, stops = _prompt_text(args(prompt="Hi?"), own)
    assert text == "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n" and stops == ["<|im_end|>"]
    hf = _hf_tokenizer(LLAMA)
    hf.save_pretrained(tmp_path / "tok")
    theirs = types.SimpleNamespace(data=types.SimpleNamespace(tokenizer=str(tmp_path / "tok")))
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps({"messages": CONVERSATIONS[1][:4]}))
    text, stops = _prompt_text(args(messages=str(conv)), theirs)
    assert text == hf.apply_chat_template(CONVERSATIONS[1][:4], tokenize=False, add_generation_prompt=True)
    assert stops == ["</s>"]
    assert _prompt_text(args(chat=False, prompt="def f("), own) == ("def f(", [])
    with pytest.raises(UsageError, match="--chat: give one of --prompt TEXT"):
        _prompt_text(args(prompt="x", messages=str(conv)), own)
    conv.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}))
    with pytest.raises(UsageError, match="unknown role 'robot'"):
        _prompt_text(args(messages=str(conv)), own)


def test_the_offline_conversation_set_is_made_of_conversations(tmp_path):
    from moelab.data import chat_examples

    rows = chat_examples.conversations()
    assert len(rows) > 200 and all(problem(r["messages"]) is None for r in rows)
    asked = {r["messages"][0]["content"] for r in rows}
    assert "What does textwrap.dedent do?" in asked and len(asked) == len(rows)  # no question twice
    n = chat_examples.write(tmp_path / "a.jsonl", seed=1)
    chat_examples.write(tmp_path / "b.jsonl", seed=1)
    assert n == len(rows) and (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()

"""Chat templates from every place HF keeps them, compared with transformers'
own loading and rendering; the budgeted sandbox; --chat-template resolution."""

from __future__ import annotations

import json
import os
import time

import pytest

from enginecore.model.chat_templates import (
    detect_content_format,
    find_chat_templates,
    load_chat_template,
)
from enginecore.model.template_sandbox import TemplateLimitError
from enginecore.model.tokenizer import Tokenizer
from server_helpers import make_tiny_chat_model

DEFAULT = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
           "{% if add_generation_prompt %}[assistant]{% endif %}")
TOOL_USE = ("TOOLS={{ tools | map(attribute='function.name') | join(',') }}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
PARTS = ("{% for m in messages %}{{ m['role'] }}:{% for p in m['content'] %}"
         "{{ p['text'] }}|{% endfor %}{% endfor %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def _hf_tokenizer(folder: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"),
                                   bos_token="<s>", eos_token="</s>")


def _saved(tmp_path, name: str, template) -> str:
    """A folder written by transformers' save_pretrained with ``template``."""
    src = make_tiny_chat_model(str(tmp_path / f"{name}-src"))
    tok = _hf_tokenizer(src)
    tok.chat_template = template
    out = str(tmp_path / name)
    tok.save_pretrained(out)
    return out


def _same_as_transformers(folder: str, tools=None) -> str:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_dir(folder).apply_chat_template(MESSAGES, tools=tools)
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    return ours


def test_save_pretrained_writes_chat_template_jinja_and_it_is_read(tmp_path):
    folder = _saved(tmp_path, "single", DEFAULT)
    assert os.path.exists(os.path.join(folder, "chat_template.jinja"))
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        assert "chat_template" not in json.load(f)
    assert _same_as_transformers(folder) == "[system]be brief[user]hi[assistant]"


def test_named_templates_saved_by_transformers_pick_tool_use_with_tools(tmp_path):
    folder = _saved(tmp_path, "named", {"default": DEFAULT, "tool_use": TOOL_USE})
    assert os.path.exists(os.path.join(folder, "additional_chat_templates", "tool_use.jinja"))
    assert _same_as_transformers(folder) == "[system]be brief[user]hi[assistant]"
    assert _same_as_transformers(folder, TOOLS) == "TOOLS=get_weather<system>be brief<user>hi"


def test_named_list_in_tokenizer_config(tmp_path):
    folder = make_tiny_chat_model(str(tmp_path / "list"))
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["chat_template"] = [{"name": "default", "template": DEFAULT},
                            {"name": "tool_use", "template": TOOL_USE}]
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    assert _same_as_transformers(folder) == "[system]be brief[user]hi[assistant]"
    assert _same_as_transformers(folder, TOOLS).startswith("TOOLS=get_weather")


def test_precedence_jinja_over_tokenizer_config_over_legacy_json(tmp_path):
    folder = make_tiny_chat_model(str(tmp_path / "all"))  # tokenizer_config has one
    with open(os.path.join(folder, "chat_template.json"), "w") as f:
        json.dump({"chat_template": "LEGACY"}, f)
    assert find_chat_templates(folder).origin.endswith("tokenizer_config.json")
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write("JINJA")
    found = find_chat_templates(folder)
    assert found.templates == {"default": "JINJA"}
    _same_as_transformers(folder)
    os.remove(os.path.join(folder, "chat_template.jinja"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    assert find_chat_templates(folder).templates == {"default": "LEGACY"}


def test_no_template_names_where_it_looked(tmp_path):
    folder = make_tiny_chat_model(str(tmp_path / "none"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    with pytest.raises(ValueError, match="no chat template") as e:
        Tokenizer.from_dir(folder).apply_chat_template(MESSAGES)
    for name in ("chat_template.jinja", "tokenizer_config.json", "chat_template.json",
                 "--chat-template"):
        assert name in str(e.value)


def test_load_chat_template_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(DEFAULT)
    assert load_chat_template(str(path)) == DEFAULT
    assert load_chat_template(DEFAULT) == DEFAULT
    legacy = tmp_path / "chat_template.json"
    legacy.write_text(json.dumps({"chat_template": DEFAULT}))
    assert load_chat_template(str(legacy)) == DEFAULT
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_content_format_auto_string_openai(tmp_path):
    assert detect_content_format(DEFAULT) == "string"
    assert detect_content_format(PARTS) == "openai"
    folder = make_tiny_chat_model(str(tmp_path / "parts"))
    tok = Tokenizer.from_dir(folder)
    tok.chat_template = PARTS
    assert tok.apply_chat_template(MESSAGES) == "system:be brief|user:hi|"
    tok.content_format = "string"  # each character of the string is a "part" with no text
    assert tok.apply_chat_template(MESSAGES) == "system:" + "|" * 8 + "user:||"


# -- the sandbox's budgets -------------------------------------------------------------
NESTED = "{% for i in range(100000) %}{% for j in range(200) %}{% endfor %}{% endfor %}hi"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_dir(make_tiny_chat_model(str(tmp_path_factory.mktemp("sbx"))))


@pytest.mark.parametrize("template, match", [
    (NESTED, "loop steps|longer than"),
    (("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
      "{% endfor %}{{ ns.s|length }}"), "characters"),
    ("{{ 'x' * 1000000000 }}", "characters"),
    ("{{ 'x'|center(1000000000) }}", "width"),
    ("{{ '%0999999999d' % 1 }}", "format width"),
    ("{{ 10 ** 10000000 }}", "exponent"),
    ("{% for i in range(1000000) %}{% endfor %}", "range"),
    (("{% for i in range(3000) %}{% for j in range(3000) %}x{% endfor %}{% endfor %}"),
     "loop steps|characters|longer than"),
])
def test_request_templates_are_cut_off(tok, template, match):
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError, match=match):
        tok.apply_chat_template(MESSAGES, chat_template=template, untrusted_template=True)
    assert time.monotonic() - t0 < 5


def test_cut_off_templates_are_value_errors_and_good_ones_render(tok):
    assert issubclass(TemplateLimitError, ValueError)
    ok = "{% for i in range(3) %}{% for j in range(3) %}{{ i }}{{ j }}{% endfor %}{% endfor %}"
    assert tok.apply_chat_template(MESSAGES, chat_template=ok, untrusted_template=True) == \
        "000102101112202122"
    # the model's own template is trusted more (a long conversation renders)
    many = [{"role": "user", "content": "x"}] * 20_000
    assert tok.apply_chat_template(many).count("x") == 20_000


def test_compiled_template_cache_is_bounded(tok):
    for i in range(200):
        tok.apply_chat_template(MESSAGES, chat_template=f"{{{{ {i} }}}}",
                                untrusted_template=True)
    assert len(tok._cache) <= tok._cache.capacity


# What transformers' template environment has beyond plain jinja2: loop controls,
# {% generation %} blocks, and a tojson that does not HTML-escape and takes json.dumps'
# options. A template using them renders as transformers renders it.
TRANSFORMERS_ENV = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{% generation %}<{{ m['role'] }}>{% endgeneration %}{{ m['content'] }}"
    "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
    "TOOLS={{ tools | tojson }}|{{ tools | tojson(indent=2, sort_keys=True) }}"
    "|{{ tools | tojson(separators=(',', ':'), ensure_ascii=True) }}"
)
TRICKY_TOOLS = [{"type": "function", "function": {
    "name": "html_tool", "description": "returns <b>bold</b> & 'quoted' text, café",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def test_transformers_template_environment_loop_controls_generation_and_tojson(tmp_path):
    rendered = _same_as_transformers(_saved(tmp_path, "env", TRANSFORMERS_ENV),
                                     tools=TRICKY_TOOLS)
    assert "<system>" not in rendered and "<user>hi" in rendered
    assert "<b>bold</b> & 'quoted' text, café" in rendered  # not \u003cb\u003e...
    assert "caf\\u00e9" in rendered  # ensure_ascii=True where the template asks


NONE_AND_REASONING = (
    "{% for m in messages %}<{{ m['role'] }}>{% if m.content is defined %}C={{ m.content }}"
    "{% endif %}{% if m.tool_calls is defined %}T={{ m.tool_calls | length }}{% endif %}"
    "{% if m.reasoning_content is defined %}R={{ m.reasoning_content }}/{{ m.thinking }}"
    "{% endif %}{% endfor %}")


def test_messages_reach_the_template_as_transformers_hands_them_over(tmp_path):
    """OpenAI clients send ``null`` fields back (``"tool_calls": null`` on a plain
    assistant turn, ``"content": null`` beside tool calls): transformers drops them, so a
    template's ``is defined`` test holds; reasoning under ``reasoning`` / ``thinking``
    is also seen as ``reasoning_content`` (and the reverse)."""
    from transformers import AutoTokenizer

    messages = [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": None, "reasoning": "think first",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "done", "tool_calls": None, "refusal": None},
    ]
    folder = _saved(tmp_path, "none", NONE_AND_REASONING)
    ours = Tokenizer.from_dir(folder).apply_chat_template(messages, add_generation_prompt=False)
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False)
    assert ours == theirs == ("<user>C=hi<assistant>T=1R=think first/think first<tool>C=42"
                              "<assistant>C=done")

"""Probe tests on real templates with the real Qwen3.6 tokenizer (no mocks)."""

from __future__ import annotations

import json

import pytest

from templates_helpers import TEMPLATES_DIR

STRICT_CHATML = (
    "{%- for m in messages %}"
    "{%- if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + m.role) }}{% endif %}"
    "{%- if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be first.') }}{% endif %}"
    "{%- set prev = messages[loop.index0 - 1].role if not loop.first else 'none' %}"
    "{%- if m.role == 'user' and prev not in ['none', 'system', 'assistant'] %}"
    "{{ raise_exception('Roles must alternate user/assistant.') }}{% endif %}"
    "{%- if m.role == 'assistant' and prev != 'user' %}"
    "{{ raise_exception('An assistant turn must follow a user turn.') }}{% endif %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_qwen36_probe_records_its_quirks(tok):
    from dflash_etl.templates import probe_template

    p = probe_template(tok)
    assert p.template_source == "tokenizer"
    assert "No user query found in messages." in p.rejected_role_orders["assistant_only"]
    assert "No user query found in messages." in p.rejected_role_orders["system,assistant"]
    assert "Unexpected message role." in p.rejected_role_orders["developer,user,assistant"]
    assert "user,assistant,user,assistant" in p.accepted_role_orders
    assert not p.has_generation_tags and not p.generation_mask_usable
    assert p.renders_tools and p.tool_role == "native" and p.tool_call_args == "object"
    assert p.reasoning_key == "reasoning_content"
    assert p.reasoning_placement == "after_last_user"
    assert p.injects_empty_think
    assert not p.prefix_stable and p.stable_kwargs == {"preserve_thinking": True}
    assert p.generation_prompt == "<|im_start|>assistant\n<think>\n"
    assert p.eot_text == "<|im_end|>" and p.post_eot == "\n" and p.eot_source == "template"
    assert not p.appends_assistant_header
    assert p.thinking_kwargs == ["enable_thinking"]
    assert p.strategy == "render_diff" and "preserve_thinking" in p.reason
    json.dumps(p.to_dict())  # JSON-able for the manifest


def test_strict_chatml_probe_is_prefix_stable(tok):
    from dflash_etl.templates import probe_template

    p = probe_template(tok, STRICT_CHATML)
    assert p.template_source == "argument"
    assert "alternate" in p.rejected_role_orders["user,user,assistant"]
    assert "follow a user" in p.rejected_role_orders["assistant_only"]
    assert "Unknown role: developer" in p.rejected_role_orders["developer,user,assistant"]
    assert p.prefix_stable and p.generation_prefill == ""
    assert p.strategy == "render_diff"
    assert not p.renders_tools and p.tool_call_args is None
    assert p.reasoning_placement == "never"


def test_unrenderable_template_raises_clear_error(tok):
    from dflash_etl.templates import TemplateUnusable, probe_template

    with pytest.raises(TemplateUnusable, match=r"renders no valid conversation.*nope"):
        probe_template(tok, "{{ raise_exception('nope') }}")
    with pytest.raises(TemplateUnusable, match="drops the user or assistant"):
        probe_template(tok, "{% for m in messages %}{{ m.role }}{% endfor %}")


def test_no_end_of_turn_marker_falls_back_to_eos(tok):
    from dflash_etl.templates import probe_template

    glm_like = (
        "[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    p = probe_template(tok, glm_like)
    assert p.eot_text == "" and p.eot_source == "tokenizer_eos"
    assert p.eos_fallback_token == tok.eos_token and p.eos_fallback_id == tok.eos_token_id
    assert "falls back" in " ".join(p.notes)
    assert p.strategy == "per_turn" and "no end-of-turn marker" in p.reason


def test_appended_assistant_header_detected(tok):
    from dflash_etl.templates import probe_template

    appends = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n"
    )
    p = probe_template(tok, appends)
    assert p.appends_assistant_header
    assert (
        p.eot_text == "<|im_end|>" and p.post_eot == "\n<|im_start|>assistant"
    )  # jinja drops one final newline


def test_generation_prompt_prefill_detected_qwq(tok):
    from dflash_etl.templates import probe_template

    p = probe_template(tok, (TEMPLATES_DIR / "Qwen-QwQ-32B.jinja").read_text())
    assert "<think>" in p.generation_prefill
    assert p.reasoning_inline and p.reasoning_placement == "after_last_user"
    assert p.strategy == "per_turn"


def test_bos_supplied_from_generation_config(tok):
    from dflash_etl.templates import probe_template

    assert tok.bos_token is None  # the Qwen tokenizer has none; generation_config.json does
    tmpl = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}</s>{% endfor %}"
    p = probe_template(tok, tmpl)
    assert p.render_kwargs["bos_token"] == "<|endoftext|>"
    assert p.template_uses_bos and p.template_emits_bos
    assert any("generation_config.json" in s for s in p.supplied)


def test_generation_tags_probed(tok):
    from dflash_etl.templates import probe_template

    tmpl = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
        "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    p = probe_template(tok, tmpl)
    assert p.has_generation_tags and p.generation_mask_usable
    assert p.strategy == "generation"

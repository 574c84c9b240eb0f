"""`render` calls transformers' compiled template directly (it is the stage's hottest call); here it
must give exactly what `apply_chat_template` gives, or fail where it fails, on the real fixture
templates with the messages the stage prepares for each (every prefix, with and without the
generation prompt, with each thinking-mode variant the probe found).

Every fixture template, as in the conformance test (DFLASH_CONFORMANCE=sample: every fourth plus
Qwen3.6).
"""

from __future__ import annotations

import os

import pytest

from dflash_etl.templates import MaskPolicy, MaskRefused, TemplateUnusable, probe_template
from dflash_etl.templates.limits import RenderError
from dflash_etl.templates.masks.prepare import _prepare
from dflash_etl.templates.render import render, render_with_transformers
from templates_helpers import (
    TEMPLATES_DIR,
    qwen_tokenizer,
    representative_conversations,
    require_fixtures,
)

QWEN36 = "qwen36/Qwen3.6-27B.official-reconstructed.jinja"


def _templates():
    if not TEMPLATES_DIR.is_dir():
        return []
    paths = sorted(TEMPLATES_DIR.rglob("*.jinja"))
    if os.environ.get("DFLASH_CONFORMANCE") == "sample":
        paths = sorted({*paths[::4], TEMPLATES_DIR / QWEN36})
    return paths


@pytest.fixture(autouse=True)
def _one_clock(monkeypatch):
    """transformers' strftime_now reads the time the render reads (templates that print it)."""
    import datetime

    from transformers.utils import chat_template_utils

    from dflash_etl.templates.limits import RenderLimits, render_time

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return render_time(RenderLimits().clock)

    monkeypatch.setattr(chat_template_utils, "datetime", Frozen)


def _reference(tok, messages, **kw):
    try:
        out = render_with_transformers(tok, messages, **kw)
    except Exception as exc:  # any template error is a valid outcome, if both agree
        return ("error", type(exc).__name__)
    return ("text", out[0] if isinstance(out, list) else out)


def _direct(tok, messages, **kw):
    try:
        return ("text", render(tok, messages, **kw))
    except RenderError as exc:
        return ("error", str(exc).split(":", 1)[0])


@pytest.mark.parametrize("path", _templates(),
                         ids=lambda p: p.relative_to(TEMPLATES_DIR).as_posix())
def test_direct_render_equals_apply_chat_template(path):
    require_fixtures()
    tok = qwen_tokenizer()
    source = path.read_text(encoding="utf-8")
    try:
        probe = probe_template(tok, source)
    except TemplateUnusable:
        pytest.skip("transformers cannot render this template at all")
    variants = [probe.render_kwargs] + [{**probe.render_kwargs, k: v}
                                        for k in probe.thinking_kwargs for v in (True, False)]
    compared = 0
    for conv in representative_conversations():
        try:
            prep = _prepare(conv, probe, MaskPolicy())
        except MaskRefused:  # refused before any render (e.g. an empty assistant turn)
            continue
        for n in range(1, len(prep.messages) + 1):
            for generation_prompt in (False, True):
                for kw in variants:
                    args = {"chat_template": source, "tools": prep.tools,
                            "add_generation_prompt": generation_prompt, "kwargs": kw}
                    want = _reference(tok, prep.messages[:n], **args)
                    got = _direct(tok, prep.messages[:n], **args)
                    assert got == want, (conv["id"], n, generation_prompt, kw)
                    compared += want[0] == "text"
    assert compared > 0, "no render succeeded: the comparison checked nothing"


# Templates are untrusted code: the render's caching sandbox must refuse what transformers' sandbox
# refuses (dunder access, mutating the inputs, str.format reaching attributes), with the same kind
# of error, and render the harmless uses of the same objects identically.
HOSTILE = {
    "dunder on a message": "{{ messages[0].__class__.__mro__ }}",
    "dunder on a string": "{{ messages[0]['content'].__class__.__base__.__subclasses__() }}",
    "mutating the messages": "{{ messages.append(messages[0]) }}{{ messages | length }}",
    "mutating a message": "{% set m = messages[0] %}{{ m.update({'role': 'x'}) }}{{ m.role }}",
    "str.format to attributes": "{{ '{0.__class__.__mro__}'.format(messages[0]['content']) }}",
    "format through a namespace": "{% set ns = namespace(f='{0.__class__}'.format) %}{{ ns.f(1) }}",
    "macro and loop attributes": (
        "{% macro m(x) %}{{ x.content | upper }}{% endmacro %}{% for msg in messages %}"
        "{{ loop.index0 }}{{ m(msg) }}{{ loop.last }}{{ msg.get('role') }}{{ msg.missing }}"
        "{% endfor %}"),
    "private attribute of a loop": "{% for m in messages %}{{ loop._after }}{% endfor %}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_caching_sandbox_refuses_what_transformers_refuses(name):
    require_fixtures()
    tok = qwen_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    want = _reference(tok, messages, chat_template=HOSTILE[name])
    got = _direct(tok, messages, chat_template=HOSTILE[name])
    assert got == want
    assert messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    if name.startswith(("dunder", "mutating", "str.format", "format")):
        assert got[0] == "error" or "class" not in got[1], got


def test_every_render_reads_one_clock():
    """A template that prints the time renders a conversation's prompt and its full text alike
    (else the render-diff finds the prompt is not a prefix whenever the clock ticks between),
    and reads a fixed time unless told "now": a rerun on another day gives the same rows."""
    import time

    from dflash_etl.templates.limits import PROCESS_START, RenderLimits, render_limits

    require_fixtures()
    tok = qwen_tokenizer()
    template = "{{ strftime_now('%Y-%m-%d %H:%M:%S.%f') }}{{ messages[0]['content'] }}"
    messages = [{"role": "user", "content": "hi"}]
    first = render(tok, messages, chat_template=template)
    time.sleep(0.01)
    assert render(tok, messages, chat_template=template) == first
    assert first.startswith("2025-01-01 00:00:00")
    with render_limits(RenderLimits(clock="2031-05-06T07:08:09")):
        assert render(tok, messages, chat_template=template).startswith("2031-05-06 07:08:09")
    with render_limits(RenderLimits(clock="now")):
        assert render(tok, messages, chat_template=template).startswith(
            PROCESS_START.strftime("%Y-%m-%d %H:%M:%S"))

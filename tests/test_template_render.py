"""`render` calls transformers' compiled template directly (it is the stage's hottest call); here it
must give exactly what `apply_chat_template` gives, or fail where it fails, on the real fixture
templates with the messages the stage prepares for each (every prefix, with and without the
generation prompt, with each thinking-mode variant the probe found).

Every fourth fixture template plus Qwen3.6, as in the conformance test; DFLASH_CONFORMANCE=all
checks all of them.
"""

from __future__ import annotations

import os

import pytest

from dflash_etl.templates import MaskPolicy, MaskRefused, TemplateUnusable, probe_template
from dflash_etl.templates.masks import _prepare
from dflash_etl.templates.render import RenderError, render, render_with_transformers
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
    if os.environ.get("DFLASH_CONFORMANCE") != "all":
        paths = sorted({*paths[::4], TEMPLATES_DIR / QWEN36})
    return paths


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

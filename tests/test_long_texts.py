"""A row far longer than seq_length is encoded from its first characters (a margin past
seq_length tokens), not whole: the rows are the ones the whole text gives, token for token, and
the tokenizer never sees the whole of a long message. Real Qwen3.6 tokenizer and template."""

from __future__ import annotations

import random

import pytest

hyp = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dflash_etl.templates import MaskPolicy, MaskRefused, probe_template  # noqa: E402
from dflash_etl.templates.masks import encoding  # noqa: E402
from dflash_etl.templates.masks.conversations import tokenize_conversations  # noqa: E402


def _m(role: str, content: str, reasoning: str | None = None) -> dict:
    return {"role": role, "content": content, "reasoning": reasoning, "tool_calls": None,
            "tool_call_id": None, "name": None}


@pytest.fixture(scope="module")
def qprobe(tok):
    return probe_template(tok)


class _Watched:
    """The tokenizer, its backend's encodes recorded (the longest text it was given)."""

    def __init__(self, tok) -> None:
        self._tok, self.longest = tok, 0
        backend = tok.backend_tokenizer
        watched = self

        class Backend:
            def encode(self, text, **kw):
                watched.longest = max(watched.longest, len(text))
                return backend.encode(text, **kw)

            def encode_batch(self, texts, **kw):
                watched.longest = max([watched.longest, *map(len, texts)])
                return backend.encode_batch(texts, **kw)

            def __getattr__(self, name):
                return getattr(backend, name)

        self.backend_tokenizer = Backend()

    def __getattr__(self, name):
        return getattr(self._tok, name)


def _whole(monkeypatch, convs, tok, probe, policy):
    """The rows as the whole texts give them: no cut."""
    with monkeypatch.context() as m:
        m.setattr(encoding, "CUT_CHARS_PER_TOKEN", 10**12)
        return tokenize_conversations(convs, tok, probe, policy)


def _same(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if isinstance(w, MaskRefused):
            assert isinstance(g, MaskRefused) and g.code == w.code, (g, w)
            continue
        assert not isinstance(g, MaskRefused), g
        assert [(r.input_ids, r.loss_mask, r.turn, r.truncated, r.strategy) for r in g] == \
               [(r.input_ids, r.loss_mask, r.turn, r.truncated, r.strategy) for r in w]


def test_a_long_message_is_cut_before_the_tokenizer_and_gives_the_whole_text_s_rows(
        tok, qprobe, monkeypatch):
    rng = random.Random(1)
    words = ["the", "model", "draft", "token", "并且", "def", "x = 1;", "\n", "  ", "42"]
    huge = " ".join(rng.choice(words) for _ in range(120_000))  # about 500 kB
    convs = [{"id": "a", "messages": [_m("user", "Summarise this: " + huge),
                                      _m("assistant", "A summary.")], "tools": None},
             {"id": "b", "messages": [_m("user", "Continue."), _m("assistant", huge)],
              "tools": None},
             {"id": "c", "messages": [_m("user", "Short."), _m("assistant", "Short reply.")],
              "tools": None}]
    policy = MaskPolicy(seq_length=2048)
    watched = _Watched(tok)
    got = tokenize_conversations(convs, watched, qprobe, policy)
    assert watched.longest <= encoding.cut_chars(2048) * 1.5 < len(huge) / 10
    want = _whole(monkeypatch, convs, tok, qprobe, policy)
    _same(got, want)
    assert isinstance(got[0], MaskRefused) and got[0].code == "too_few_supervised_tokens"
    (row,) = got[1]
    assert row.truncated and len(row.input_ids) == 2048 and sum(row.loss_mask) > 2000
    assert "truncated_right:2048+->2048" not in row.normalizations  # the count is the cut's
    assert any(n.startswith("truncated_right:") and n.endswith("+->2048")
               for n in row.normalizations)
    with pytest.raises(MaskRefused, match=r"\d+\+ tokens > seq_length 2048"):
        result = tokenize_conversations(convs[1:2], tok, qprobe,
                                        MaskPolicy(seq_length=2048, truncation="drop"))[0]
        raise result


def test_a_cut_that_could_change_the_tokens_kept_encodes_the_whole_text(tok, qprobe,
                                                                         monkeypatch):
    """A run of spaces (tokens of many characters: the cut holds fewer than seq_length tokens)
    is encoded whole, and its rows are the same."""
    convs = [{"id": "s", "messages": [_m("user", "Pad:"), _m("assistant", "ok" + " " * 40_000
                                                              + "end")], "tools": None}]
    policy = MaskPolicy(seq_length=600)
    watched = _Watched(tok)
    got = tokenize_conversations(convs, watched, qprobe, policy)
    assert watched.longest > 40_000
    _same(got, _whole(monkeypatch, convs, tok, qprobe, policy))


_PIECES = st.sampled_from(["word", "Tokens", " ", "   ", "\n", "\n\n", "中文", "ß", "123", "—",
                           "{}", "def f(x):", "\t", "...", "é", "😀", "<b>",
                           "a" * 50, " " * 30, "=" * 20])


@st.composite
def _long_conversations(draw):
    def text(lo: int, hi: int) -> str:
        n = draw(st.integers(lo, hi))
        seed = draw(st.integers(0, 2**16))
        pieces = draw(st.lists(_PIECES, min_size=3, max_size=12, unique=True))
        rng = random.Random(seed)
        return "".join(rng.choice(pieces) for _ in range(n))

    messages = []
    for _ in range(draw(st.integers(1, 3))):
        messages.append(_m("user", text(1, 3000)))
        reasoning = text(1, 2000) if draw(st.booleans()) else None
        messages.append(_m("assistant", text(1, 3000), reasoning))
    return {"id": "h", "messages": messages, "tools": None}


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(conv=_long_conversations(), seq_length=st.integers(16, 300),
       chars_per_token=st.integers(1, 8), strategy=st.sampled_from(["auto", "per_turn"]),
       truncation=st.sampled_from(["right", "drop"]))
def test_cut_rows_are_the_whole_text_s_rows(tok, qprobe, monkeypatch, conv, seq_length,
                                            chars_per_token, strategy, truncation):
    """A property: conversations of random texts (words, runs of spaces and letters,
    newlines, CJK, emoji, markup), any seq_length, strategy and truncation, cut far
    tighter than by default (a margin of 16 characters, 1 to 8 characters a token, so that
    most rows are cut and many cuts fall inside a token or a run): the rows (or the refusal)
    are those of the whole texts."""
    policy = MaskPolicy(seq_length=seq_length, strategy=strategy, truncation=truncation)
    with monkeypatch.context() as m:
        m.setattr(encoding, "CUT_MARGIN_CHARS", 16)
        m.setattr(encoding, "CUT_CHARS_PER_TOKEN", chars_per_token)
        got = tokenize_conversations([conv], tok, qprobe, policy)
    _same(got, _whole(monkeypatch, [conv], tok, qprobe, policy))

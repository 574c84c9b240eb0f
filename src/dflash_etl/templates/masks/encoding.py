"""Row texts to token ids, with the character offsets the masks need looked up lazily."""

from __future__ import annotations

import bisect
import operator
import re
from typing import Any

_START = operator.itemgetter(0)
CUT_CHARS_PER_TOKEN = 8
CUT_MARGIN_CHARS = 4096
_SUPERVISED_RUN = re.compile(rb"\x01+")


class _Encoded:
    """A row's token ids, and its tokens' character offsets looked up where they are needed:
    a mask needs the offsets at the reply spans' edges only, and the full offsets list costs
    more to build (a tuple per token) than the rest of a row's mask.

    A row is one encoded piece, or two (a per-turn row: prompt and reply); each piece is a
    tokenizers `Encoding` or a list of (start, end) offsets, with its first token and first
    character in the row.
    """

    __slots__ = ("_pieces", "ids", "kept_chars")

    def __init__(self, ids: list[int], pieces: list[tuple[Any, int, int, int]]) -> None:
        self.ids = ids
        self._pieces = pieces  # (encoding or offsets list, first token, first char, chars)
        # a text cut before encoding (`encode_cut`): its tokens are the whole text's up to
        # this character, and past it not looked at; None: the whole text was encoded
        self.kept_chars: int | None = None

    @classmethod
    def join(cls, texts: tuple[str, ...], encodings: list[Any]) -> _Encoded:
        ids: list[int] = []
        pieces = []
        char = 0
        for text, enc in zip(texts, encodings, strict=True):
            if isinstance(enc, tuple):  # (ids, offsets) from a slow tokenizer
                piece_ids, enc = enc
            else:
                piece_ids = enc.ids
            pieces.append((enc, len(ids), char, len(text)))
            ids = ids + piece_ids if ids else piece_ids
            char += len(text)
        return cls(ids, pieces)

    def __len__(self) -> int:
        return len(self.ids)

    def _piece_of_token(self, t: int) -> tuple[Any, int, int, int]:
        pieces = self._pieces
        return pieces[-1] if len(pieces) > 1 and t >= pieces[-1][1] else pieces[0]

    def span(self, t: int) -> tuple[int, int]:
        """Character (start, end) of token t in the row text."""
        enc, first_token, first_char, _ = self._piece_of_token(t)
        a, b = enc[t - first_token] if isinstance(enc, list) else enc.token_to_chars(
            t - first_token)
        return a + first_char, b + first_char

    def first_at_or_after(self, c: int) -> int:
        """Index of the first token starting at character c or later (len when none): what a
        bisection over every token's start gives (starts never decrease)."""
        pieces = self._pieces
        k = len(pieces) - 1 if len(pieces) > 1 and c >= pieces[-1][2] else 0
        enc, first_token, first_char, chars = pieces[k]
        local = c - first_char
        if isinstance(enc, list):
            return first_token + bisect.bisect_left(enc, local, key=_START)
        n = (pieces[k + 1][1] if k + 1 < len(pieces) else len(self.ids)) - first_token
        t = enc.char_to_token(local) if local < chars else n  # a guess, made exact below
        if t is None:  # a character no token covers
            return first_token + bisect.bisect_left(enc.offsets, local, key=_START)
        while t < n and enc.token_to_chars(t)[0] < local:
            t += 1
        while t > 0 and enc.token_to_chars(t - 1)[0] >= local:
            t -= 1
        return first_token + t


def _encode(tokenizer: Any, text: str) -> Any:
    """A tokenizers Encoding (or ids and char offsets from a slow tokenizer) without special
    tokens (the rendered template is authoritative).

    Uses the fast tokenizer's backend directly (same ids, far less per-call overhead).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False)
    out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(out["input_ids"]), [tuple(o) for o in out["offset_mapping"]]


def _decode(tokenizer: Any, ids: list[int]) -> str:
    """Token ids to text with special tokens kept and no clean-up (the backend directly: the
    wrapper's argument conversion costs more than the decode)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _encode_many(tokenizer: Any, texts: list[str]) -> list[Any]:
    """`_encode` of each text, in one batch (less per-call overhead than one call per text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return [_encode(tokenizer, text) for text in texts]
    return backend.encode_batch(texts, add_special_tokens=False)


def _encode_row(tokenizer: Any, text: str, split_at: int | None,
                seq_length: int | None = None) -> _Encoded:
    """Encode a row; a per-turn row encodes prompt and reply separately (see module doc); a
    row longer than `cut_chars(seq_length)` from its cut (`encode_cut`)."""
    pieces = _pieces(text, split_at)
    if seq_length is not None and 0 < cut_chars(seq_length) < len(text):
        return encode_cut(tokenizer, pieces, seq_length)
    return _Encoded.join(pieces, [_encode(tokenizer, piece) for piece in pieces])


def cut_chars(seq_length: int | None) -> int:
    """How much of a row text is encoded when the row will be cut at `seq_length` tokens (0:
    all of it): a 12 MB message is not tokenized whole (gigabytes of offsets) to keep its
    first 8k tokens. Tokens rarely average CUT_CHARS_PER_TOKEN characters; a row where they
    do is encoded whole (`encode_cut`)."""
    return 0 if seq_length is None else seq_length * CUT_CHARS_PER_TOKEN + CUT_MARGIN_CHARS


def cut_pieces(pieces: tuple[str, ...], chars: int) -> tuple[str, ...]:
    """The pieces' first `chars` characters, piece by piece."""
    out = []
    for piece in pieces:
        out.append(piece[:max(chars, 0)])
        chars -= len(piece)
    return tuple(out)


def encode_cut(tokenizer: Any, pieces: tuple[str, ...], seq_length: int,
               encodings: list[Any] | None = None) -> _Encoded:
    """A long row's encoding from its first `cut_chars` characters (`encodings`: theirs, when
    the caller encoded them in a batch), or from the whole text where the cut could change
    the tokens kept: no more than seq_length tokens in the cut (long tokens: a run of
    spaces), or a longer cut that starts with other tokens (a cut inside one pre-token)."""
    chars = cut_chars(seq_length)
    cut = cut_pieces(pieces, chars)
    if encodings is None:
        encodings = [_encode(tokenizer, piece) for piece in cut]
    encoded = _Encoded.join(cut, encodings)
    if len(encoded.ids) > seq_length:
        longer = cut_pieces(pieces, chars + chars // 2)
        check = _Encoded.join(longer, [_encode(tokenizer, piece) for piece in longer])
        if check.ids[:seq_length + 1] == encoded.ids[:seq_length + 1]:
            encoded.kept_chars = encoded.span(seq_length)[1]
            return encoded
    return _Encoded.join(pieces, [_encode(tokenizer, piece) for piece in pieces])


def _pieces(text: str, split_at: int | None) -> tuple[str, ...]:
    """The texts the tokenizer encodes for a row, in order."""
    return (text,) if split_at is None else (text[:split_at], text[split_at:])


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in a 0/1 mask (found in C: the mask as bytes)."""
    return [m.span() for m in _SUPERVISED_RUN.finditer(bytes(mask))]


def _longest_run(mask: list[int]) -> int:
    return max((e - s for s, e in _runs(mask)), default=0)

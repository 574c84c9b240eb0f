"""The words the mix filters compare, whatever script or disguise a text is written in.

A leak evaded by one invisible character is still a leak, so a text is compared as its words
after NFKC (fullwidth and mathematical letters become ASCII, ligatures split), lower case,
Cyrillic and Greek look-alikes of Latin letters read as those letters, and format characters
(zero-width spaces and joiners, soft hyphens, bidi marks: Unicode Cf) and combining marks
(Mn, Me) dropped, so that nothing invisible splits a word. A word is a run of letters and
digits; a Han, Hiragana or Katakana character is a word of its own (those scripts write no
spaces). An ASCII text, most of an English corpus, is only lower-cased.

`normalize` leaves a text whose only characters outside ASCII are word characters: the batch
path (ngrams.split_words) splits its UTF-8 bytes with a byte table and finds exactly `words`.
"""

from __future__ import annotations

import functools
import re
import unicodedata

import pyarrow as pa
import pyarrow.compute as pc

WORD = re.compile("[a-z0-9\u0080-\U0010ffff]+")  # on a normalized text
MANY_CHANGES = 16  # distinct characters to change in a text before one pass is cheaper
_ASCII = bytes(range(128))
_SPACED_SCRIPTS = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
                             "\U00020000-\U0003134f]")
# lower-case look-alikes (after str.lower) of Latin letters
_HOMOGLYPHS = {
    # Cyrillic
    "а": "a", "в": "b", "е": "e", "ё": "e", "і": "i", "ї": "i", "ј": "j", "к": "k",
    "м": "m", "н": "h", "о": "o", "р": "p", "с": "c", "т": "t", "у": "y", "х": "x", "ѕ": "s",
    "ԁ": "d", "ԛ": "q", "ԝ": "w", "һ": "h", "ӏ": "l", "ь": "b",
    # Greek
    "α": "a", "β": "b", "γ": "y", "ε": "e", "ζ": "z", "η": "n", "ι": "i", "κ": "k", "μ": "m",
    "ν": "v", "ο": "o", "ρ": "p", "τ": "t", "υ": "u", "χ": "x", "ω": "w", "ϲ": "c",
    # Latin and IPA
    "ı": "i", "ȷ": "j", "ɡ": "g", "ɑ": "a", "ʏ": "y",
}


@functools.cache
def _replacement(char: str) -> str:
    """What a lower-case character outside ASCII becomes: the Latin letter it looks like,
    nothing (a format character or mark), itself between spaces (Han, kana: each a word),
    itself (another letter or digit), or a space (punctuation, symbols, spaces)."""
    if char in _HOMOGLYPHS:
        return _HOMOGLYPHS[char]
    if unicodedata.category(char) in ("Cf", "Mn", "Me"):
        return ""
    if _SPACED_SCRIPTS.match(char):
        return f" {char} "
    return char if char.isalnum() else " "


class _Table(dict):
    """str.translate's table of every character, each filled in when first met."""

    def __missing__(self, code: int) -> str | int:
        self[code] = code if code < 0x80 else _replacement(chr(code))
        return self[code]


_TABLE = _Table()


def normalize(text: str) -> str:
    """The text as the mix filters read it: its words, separated by non-word characters."""
    if text.isascii():
        return text.lower()
    text = unicodedata.normalize("NFKC", text).lower()
    changes = [(char, replacement) for char in set(text.encode().translate(None, _ASCII)
                                                   .decode())  # its characters outside ASCII
               if (replacement := _replacement(char)) != char]
    if len(changes) > MANY_CHANGES:  # Chinese: one pass
        return text.translate(_TABLE)
    for char, replacement in changes:  # a few quotes and dashes: a fast scan each
        text = text.replace(char, replacement)
    return text


def words(text: str) -> list[str]:
    return WORD.findall(normalize(text))


def normalize_array(texts: list[str] | pa.Array | pa.ChunkedArray) -> pa.LargeStringArray:
    """`normalize` of each text of a batch (a null text is empty): Arrow lower-cases the ASCII
    texts, Python normalizes only the others."""
    array = pa.array(texts, pa.large_string()) if isinstance(texts, list) else texts
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    array = pc.fill_null(array.cast(pa.large_string()), "")
    lowered = pc.ascii_lower(array)
    other = pc.invert(pc.string_is_ascii(array))
    if pc.any(other).as_py():
        normalized = [normalize(t) for t in array.filter(other).to_pylist()]
        lowered = pc.replace_with_mask(lowered, other, pa.array(normalized, pa.large_string()))
    return lowered.combine_chunks() if isinstance(lowered, pa.ChunkedArray) else lowered

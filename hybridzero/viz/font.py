"""A compact 5x7 bitmap font for chart labels.

Each glyph is 14 hex digits: 7 rows top to bottom, one byte per row, bit 4 = leftmost of the 5 columns.
Lowercase letters are drawn with the uppercase glyphs; characters without a glyph are drawn as ``?``.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType

GLYPH_WIDTH = 5
GLYPH_HEIGHT = 7
ADVANCE = GLYPH_WIDTH + 1  # one blank column between characters

_GLYPHS: Mapping[str, str] = MappingProxyType({
    "0": "0E11131519110E", "1": "040C040404040E", "2": "0E11010204081F",
    "3": "1F02040201110E", "4": "02060A121F0202", "5": "1F101E0101110E",
    "6": "0608101E11110E", "7": "1F010204080808", "8": "0E11110E11110E", "9": "0E11110F01020C",
    "A": "0E11111F111111", "B": "1E11111E11111E", "C": "0E11101010110E", "D": "1C12111111121C",
    "E": "1F10101E10101F", "F": "1F10101E101010", "G": "0E11101711110F",
    "H": "1111111F111111", "I": "0E04040404040E", "J": "0702020202120C", "K": "11121418141211",
    "L": "1010101010101F", "M": "111B1515111111", "N": "11111915131111", "O": "0E11111111110E",
    "P": "1E11111E101010", "Q": "0E11111115120D", "R": "1E11111E141211", "S": "0F10100E01011E",
    "T": "1F040404040404", "U": "1111111111110E", "V": "11111111110A04",
    "W": "1111111515150A", "X": "11110A040A1111", "Y": "11110A04040404", "Z": "1F01020408101F",
    ".": "00000000000C0C", "-": "0000001F000000", "_": "0000000000001F",
    ":": "000C0C000C0C00", "/": "01020204080810", "(": "02040808080402", ")": "08040202020408",
    "%": "18190204081303", "=": "00001F001F0000", "+": "0004041F040400", " ": "00000000000000",
    ",": "000000000C0408", "?": "0E110102040004", "'": "04040800000000",
    "[": "0E08080808080E", "]": "0E02020202020E", "<": "02040810080402", ">": "08040201020408",
    "#": "0A0A1F0A1F0A0A", "*": "0004150E150400", "!": "04040404040004", "|": "04040404040404",
})


def glyph_rows(char: str) -> tuple[int, ...]:
    """The 7 row bitmasks of ``char`` (uppercase glyph for a lowercase letter, ``?`` when unknown)."""
    code = _GLYPHS.get(char) or _GLYPHS.get(char.upper()) or _GLYPHS["?"]
    return tuple(int(code[i:i + 2], 16) for i in range(0, 2 * GLYPH_HEIGHT, 2))


def text_width(text: str, scale: int = 1) -> int:
    """Pixel width of ``text`` at ``scale`` (no trailing blank column)."""
    return max(0, len(text) * ADVANCE * scale - scale)


def text_pixels(text: str, scale: int = 1) -> Iterator[tuple[int, int]]:
    """Lit ``(dx, dy)`` offsets of ``text`` drawn left to right from its top-left corner at ``scale``."""
    for index, char in enumerate(text):
        left = index * ADVANCE * scale
        for row, bits in enumerate(glyph_rows(char)):
            for col in range(GLYPH_WIDTH):
                if bits & (1 << (GLYPH_WIDTH - 1 - col)):
                    for sy in range(scale):
                        for sx in range(scale):
                            yield left + col * scale + sx, row * scale + sy

"""The pure-Python PNG chart writer (hybridzero.viz), checked with a tiny PNG decoder written here."""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from hybridzero.viz import line_chart
from hybridzero.viz.font import glyph_rows, text_width
from hybridzero.viz.png import PALETTE, PNG_SIGNATURE, Canvas, nice_ticks, tick_label

Color = tuple[int, int, int]


@dataclass(frozen=True)
class Image:
    """A decoded 8-bit RGB image; ``rows[y][x]`` is a pixel."""

    width: int
    height: int
    rows: list[list[Color]]

    def colors(self) -> set[Color]:
        return {pixel for row in self.rows for pixel in row}


def decode_png(data: bytes) -> Image:
    """Decode an 8-bit RGB, non-interlaced PNG whose rows all use filter 0, verifying every chunk CRC."""
    assert data[:8] == PNG_SIGNATURE
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC in {kind!r}"
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
        if kind == b"IEND":
            break
    width, height, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert (depth, color_type, interlace) == (8, 2, 0)
    raw = zlib.decompress(idat)
    stride = 3 * width
    assert len(raw) == height * (stride + 1)
    rows = []
    for y in range(height):
        line = raw[y * (stride + 1):(y + 1) * (stride + 1)]
        assert line[0] == 0, "filter type must be 0"
        rows.append([(line[i], line[i + 1], line[i + 2]) for i in range(1, stride + 1, 3)])
    return Image(width, height, rows)


def read_png(path: Path) -> Image:
    return decode_png(path.read_bytes())


def test_line_pixels_have_series_color(tmp_path: Path) -> None:
    points = [(float(i), float(i)) for i in range(11)]  # y = x: a diagonal through the plot area
    path = line_chart(tmp_path / "sub" / "c.png", {"reward": points}, "Reward", "step", "score", 320, 240)
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    image = read_png(path)
    assert (image.width, image.height) == (320, 240)
    blue = PALETTE[0]
    lit = [(x, y) for y, row in enumerate(image.rows) for x, pixel in enumerate(row) if pixel == blue]
    assert len(lit) > 200  # the 2 px line (and the legend swatch)
    # the line rises left to right: among lit pixels right of the legend, x and y are anti-correlated
    line = [(x, y) for x, y in lit if y > 60]
    left_half = [y for x, y in line if x < 160]
    right_half = [y for x, y in line if x >= 200]
    assert left_half and right_half and min(left_half) > max(right_half) - 10
    assert sum(left_half) / len(left_half) > sum(right_half) / len(right_half)


def test_two_series_two_colors(tmp_path: Path) -> None:
    series = {"a": [(0, 0.0), (1, 1.0)], "b": [(0, 1.0), (1, 0.0)]}
    image = read_png(line_chart(tmp_path / "c.png", series, "T", "x", "y"))
    assert PALETTE[0] in image.colors() and PALETTE[1] in image.colors()


@pytest.mark.parametrize(
    "series",
    [
        {"const": [(0, 3.0), (1, 3.0), (2, 3.0)]},
        {"zero": [(0, 0.0), (5, 0.0)]},
        {"nan": [(0, math.nan), (1, 2.0), (2, math.inf), (3, 1.0), (4, -math.inf), (math.nan, 5.0)]},
        {"one": [(7, -1.5)]},
        {"all_nan": [(0, math.nan)], "ok": [(1, 1.0), (2, 2.0)]},
        {"tiny": [(0, 1e-9), (1, 2e-9)], "huge": [(0, 1e12), (1e9, -1e12)]},
    ],
)
def test_awkward_series_do_not_crash(tmp_path: Path, series: dict[str, list[tuple[float, float]]]) -> None:
    image = read_png(line_chart(tmp_path / "c.png", series, "awkward", "x", "y"))
    assert PALETTE[0] in image.colors()


def test_single_point_is_a_visible_dot(tmp_path: Path) -> None:
    image = read_png(line_chart(tmp_path / "c.png", {"p": [(1, 1.0)]}, "dot", "x", "y", 300, 200))
    lit = [(x, y) for y, row in enumerate(image.rows) for x, pixel in enumerate(row) if pixel == PALETTE[0]]
    assert any(y > 60 for _, y in lit)  # not only the legend swatch


def test_empty_chart_says_no_data(tmp_path: Path) -> None:
    empty = read_png(line_chart(tmp_path / "e.png", {}, "nothing", "x", "y"))
    only_nan = read_png(line_chart(tmp_path / "n.png", {"s": [(0, math.nan)]}, "nothing", "x", "y"))
    assert empty.width == 640 and empty.height == 400
    assert PALETTE[0] not in empty.colors()
    assert PALETTE[0] in only_nan.colors()  # legend swatch only


def test_too_small_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="too small"):
        line_chart(tmp_path / "c.png", {}, "t", "x", "y", 100, 100)


def test_font_and_ticks() -> None:
    assert glyph_rows("a") == glyph_rows("A") and glyph_rows("~") == glyph_rows("?")
    assert len(glyph_rows("0")) == 7 and all(0 <= row < 32 for row in glyph_rows("8"))
    assert text_width("ab") == 11
    assert nice_ticks(0.0, 1.0, 5) == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert nice_ticks(-3.0, 7.0, 5) == pytest.approx([-2.0, 0.0, 2.0, 4.0, 6.0])
    assert tick_label(0.30000000000000004, 0.1) == "0.3"
    assert tick_label(3e7, 1e7) == "3e7" and tick_label(0.0, 1.0) == "0"


def test_canvas_line_and_clipping() -> None:
    canvas = Canvas(10, 5)
    canvas.line(-3, 2, 20, 2, (1, 2, 3))
    assert all(canvas.get(x, 2) == (1, 2, 3) for x in range(10))
    assert canvas.get(0, 0) == (255, 255, 255)
    image = decode_png(canvas.png_bytes())
    assert image.rows[2][9] == (1, 2, 3)

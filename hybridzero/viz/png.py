"""Pure-Python PNG line charts (zlib + struct only): axes with ticks, a legend, a title, 2 px lines.

The image is 8-bit RGB, non-interlaced, every scanline stored with filter type 0. Non-finite points are not
drawn (a line breaks there); a run of one finite point is drawn as a dot; a constant series gets a padded
y range; a chart with no finite point at all says "no data".
"""
from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridzero.viz.font import GLYPH_HEIGHT, text_pixels, text_width

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GRID: Color = (225, 225, 225)
TEXT: Color = (40, 40, 40)
PALETTE: tuple[Color, ...] = (
    (31, 100, 200), (220, 50, 40), (40, 150, 60), (240, 130, 0),
    (140, 80, 190), (120, 80, 60), (220, 90, 170), (20, 170, 190),
)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PLOTTABLE = 1e300  # larger magnitudes would overflow the range arithmetic; treated like non-finite


class Canvas:
    """An RGB pixel buffer; every drawing call clips to the canvas.

    Invariant: ``len(self.pixels) == 3 * width * height``, row-major, top row first.
    """

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        if width <= 0 or height <= 0:
            raise ValueError(f"canvas size must be positive, got {width}x{height}")
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        """Paint one pixel (ignored outside the canvas)."""
        if 0 <= x < self.width and 0 <= y < self.height:
            offset = 3 * (y * self.width + x)
            self.pixels[offset:offset + 3] = bytes(color)

    def get(self, x: int, y: int) -> Color:
        """The color at ``(x, y)``."""
        offset = 3 * (y * self.width + x)
        r, g, b = self.pixels[offset:offset + 3]
        return (r, g, b)

    def fill_rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill the inclusive rectangle ``[x0, x1] x [y0, y1]``."""
        for y in range(max(0, y0), min(self.height - 1, y1) + 1):
            for x in range(max(0, x0), min(self.width - 1, x1) + 1):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, thickness: int = 1) -> None:
        """Bresenham line; with ``thickness`` t each step paints a t x t square."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for oy in range(thickness):
                for ox in range(thickness):
                    self.set(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                return
            doubled = 2 * err
            if doubled >= dy:
                err += dy
                x0 += sx
            if doubled <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: Color, scale: int = 1) -> None:
        """Draw ``text`` with its top-left corner at ``(x, y)``."""
        for dx, dy in text_pixels(text, scale):
            self.set(x + dx, y + dy, color)

    def vtext(self, x: int, y: int, text: str, color: Color) -> None:
        """Draw ``text`` rotated a quarter turn counter-clockwise, reading upwards from ``(x, y)``."""
        for dx, dy in text_pixels(text):
            self.set(x + dy, y - dx, color)

    def png_bytes(self) -> bytes:
        """The canvas as a PNG file."""
        return encode_png(self.width, self.height, bytes(self.pixels))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """An 8-bit RGB PNG of ``rgb`` (row-major, ``3 * width * height`` bytes), filter type 0 on every row."""
    stride = 3 * width
    if len(rgb) != stride * height:
        raise ValueError(f"expected {stride * height} bytes of RGB, got {len(rgb)}")
    raw = b"".join(b"\x00" + rgb[row * stride:(row + 1) * stride] for row in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9))
            + _chunk(b"IEND", b""))


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) inside ``[lo, hi]``; requires ``lo < hi``."""
    raw = (hi - lo) / max(1, target)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    norm = raw / magnitude
    step = magnitude * (1.0 if norm < 1.5 else 2.0 if norm < 3.0 else 5.0 if norm < 7.0 else 10.0)
    first = math.ceil(lo / step - 1e-9)
    ticks = []
    k = first
    while k * step <= hi + step * 1e-9:
        value = k * step
        ticks.append(0.0 if abs(value) < step * 1e-9 else value)
        k += 1
    return ticks


def tick_label(value: float, step: float) -> str:
    """A short label for ``value`` on an axis whose ticks are ``step`` apart."""
    if value == 0:
        return "0"
    if 1e-4 <= step and abs(value) < 1e6:
        decimals = max(0, -math.floor(math.log10(step) + 1e-9))
        return f"{value:.{decimals}f}"
    mantissa, _, exponent = f"{value:.3g}".partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def _value_range(values: Sequence[float], pad_fraction: float) -> tuple[float, float]:
    """``(lo, hi)`` covering ``values`` with a margin; never empty even for one distinct value."""
    lo, hi = min(values), max(values)
    if hi - lo <= abs(hi) * 1e-12:
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * pad_fraction
    return lo - pad, hi + pad


@dataclass(frozen=True)
class _Frame:
    """Pixel rectangle of the plot area and the data range it shows. Invariant: left < right, top < bottom."""

    left: int
    top: int
    right: int
    bottom: int
    x_range: tuple[float, float]
    y_range: tuple[float, float]

    def to_pixel(self, x: float, y: float) -> tuple[int, int]:
        (x0, x1), (y0, y1) = self.x_range, self.y_range
        px = self.left + (x - x0) / (x1 - x0) * (self.right - self.left)
        py = self.bottom - (y - y0) / (y1 - y0) * (self.bottom - self.top)
        return round(px), round(py)


def _finite(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in points if abs(float(x)) < _PLOTTABLE and abs(float(y)) < _PLOTTABLE]


def _fit_text(text: str, max_width: int, scale: int = 1) -> str:
    """``text`` shortened with ``..`` so it is at most ``max_width`` pixels wide."""
    if text_width(text, scale) <= max_width:
        return text
    while text and text_width(text + "..", scale) > max_width:
        text = text[:-1]
    return text + ".." if text else ""


def _draw_title(canvas: Canvas, title: str) -> int:
    """Centered title (2x when it fits); returns the y just below it."""
    scale = 2 if text_width(title, 2) <= canvas.width - 16 else 1
    title = _fit_text(title, canvas.width - 16, scale)
    canvas.text((canvas.width - text_width(title, scale)) // 2, 6, title, TEXT, scale)
    return 6 + GLYPH_HEIGHT * scale + 8


def _draw_legend(canvas: Canvas, names: Sequence[str], left: int, top: int) -> int:
    """Color swatch + name per series, wrapped over rows; returns the y just below the legend."""
    x, y, right = left, top, canvas.width - 12
    for index, name in enumerate(names):
        label = _fit_text(name, right - left - 14)
        entry = 14 + text_width(label) + 14
        if x > left and x + entry > right:
            x, y = left, y + GLYPH_HEIGHT + 5
        color = PALETTE[index % len(PALETTE)]
        canvas.fill_rect(x, y, x + 9, y + GLYPH_HEIGHT - 1, color)
        canvas.text(x + 14, y, label, color)
        x += entry
    return y + GLYPH_HEIGHT + 8 if names else top


def _y_tick_labels(y_range: tuple[float, float]) -> list[str]:
    """Labels of the y ticks of ``y_range``, as :func:`_draw_axes` writes them."""
    ticks = nice_ticks(*y_range, 5)
    step = ticks[1] - ticks[0] if len(ticks) > 1 else y_range[1] - y_range[0]
    return [tick_label(value, step) for value in ticks] or ["0"]


def _draw_axes(canvas: Canvas, frame: _Frame, xlabel: str, ylabel: str) -> None:
    """Grid, frame, tick marks with labels and the two axis labels."""
    (x0, x1), (y0, y1) = frame.x_range, frame.y_range
    x_ticks, y_ticks = nice_ticks(x0, x1, 6), nice_ticks(y0, y1, 5)
    x_step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else x1 - x0
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else y1 - y0
    for value in x_ticks:
        px, _ = frame.to_pixel(value, y0)
        canvas.line(px, frame.top, px, frame.bottom, GRID)
        canvas.line(px, frame.bottom, px, frame.bottom + 4, BLACK)
        label = tick_label(value, x_step)
        canvas.text(px - text_width(label) // 2, frame.bottom + 7, label, TEXT)
    for value in y_ticks:
        _, py = frame.to_pixel(x0, value)
        canvas.line(frame.left, py, frame.right, py, GRID)
        canvas.line(frame.left - 4, py, frame.left, py, BLACK)
        label = tick_label(value, y_step)
        canvas.text(frame.left - 7 - text_width(label), py - GLYPH_HEIGHT // 2, label, TEXT)
    for ax, ay, bx, by in ((frame.left, frame.top, frame.left, frame.bottom),
                           (frame.left, frame.bottom, frame.right, frame.bottom),
                           (frame.left, frame.top, frame.right, frame.top),
                           (frame.right, frame.top, frame.right, frame.bottom)):
        canvas.line(ax, ay, bx, by, BLACK)
    xlabel = _fit_text(xlabel, frame.right - frame.left)
    canvas.text((frame.left + frame.right - text_width(xlabel)) // 2, canvas.height - GLYPH_HEIGHT - 4, xlabel, TEXT)
    ylabel = _fit_text(ylabel, frame.bottom - frame.top)
    canvas.vtext(4, (frame.top + frame.bottom + text_width(ylabel)) // 2, ylabel, TEXT)


def _draw_series(canvas: Canvas, frame: _Frame, points: Sequence[tuple[float, float]], color: Color) -> None:
    """Connect consecutive plottable points; a point with no plottable neighbour becomes a 4x4 dot."""
    runs: list[list[tuple[int, int]]] = [[]]
    for x, y in points:
        if abs(float(x)) < _PLOTTABLE and abs(float(y)) < _PLOTTABLE:
            pixel = frame.to_pixel(float(x), float(y))
            if not runs[-1] or runs[-1][-1] != pixel:
                runs[-1].append(pixel)
        elif runs[-1]:
            runs.append([])
    for run in runs:
        if len(run) == 1:
            (px, py), = run
            canvas.fill_rect(px - 1, py - 1, px + 2, py + 2, color)
        for (ax, ay), (bx, by) in itertools.pairwise(run):
            canvas.line(ax, ay, bx, by, color, thickness=2)


def line_chart(
    path: Path | str,
    series: Mapping[str, Sequence[tuple[float, float]]],
    title: str,
    xlabel: str,
    ylabel: str,
    width: int = 640,
    height: int = 400,
) -> Path:
    """Write a PNG line chart of ``series`` (name -> ``(x, y)`` points, drawn in order) to ``path``.

    Creates the parent directory; returns the path. Raises ``ValueError`` when ``width < 200`` or
    ``height < 150`` (no room for axes and labels).
    """
    if width < 200 or height < 150:
        raise ValueError(f"chart too small: {width}x{height} (minimum 200x150)")
    canvas = Canvas(width, height)
    legend_top = _draw_title(canvas, title)
    plottable = {name: _finite(points) for name, points in series.items()}
    xs = [x for points in plottable.values() for x, _ in points]
    ys = [y for points in plottable.values() for _, y in points]
    y_range = _value_range(ys, 0.05) if ys else (0.0, 1.0)
    left = 4 + GLYPH_HEIGHT + 6 + max(text_width(label) for label in _y_tick_labels(y_range)) + 8
    top = _draw_legend(canvas, list(series), left, legend_top)
    frame = _Frame(left, max(top, legend_top) + 4, width - 16, height - 34,
                   _value_range(xs, 0.0) if xs else (0.0, 1.0), y_range)
    if frame.bottom - frame.top < 20:
        raise ValueError(f"chart too small for {len(series)} legend entries: {width}x{height}")
    _draw_axes(canvas, frame, xlabel, ylabel)
    if not xs:
        message = "no data"
        canvas.text((frame.left + frame.right - text_width(message, 2)) // 2,
                    (frame.top + frame.bottom) // 2 - GLYPH_HEIGHT, message, TEXT, 2)
    for index, points in enumerate(series.values()):
        _draw_series(canvas, frame, points, PALETTE[index % len(PALETTE)])
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(canvas.png_bytes())
    return out

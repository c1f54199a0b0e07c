"""A minimal TensorBoard scalar event-file writer and reader, with no tensorboard / protobuf dependency.

File format (what TensorBoard globs as ``events.out.tfevents.*``): a sequence of TFRecords::

    uint64 length (little endian) | uint32 masked_crc32c(length bytes) | payload | uint32 masked_crc32c(payload)

with ``masked(crc) = ((crc >> 15) | (crc << 17)) + 0xA282EAD8 (mod 2**32)``. Each payload is a serialized
``tensorflow.Event`` protobuf, encoded by hand here::

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

The first record of every file carries only ``file_version = "brain.Event:2"``.
"""
from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

FILE_VERSION = "brain.Event:2"
_CRC32C_POLY = 0x82F63B78  # Castagnoli, bit-reversed
_MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF


def _crc32c_table() -> tuple[int, ...]:
    """The 256-entry lookup table of the reflected CRC-32C."""
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _CRC32C_POLY if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC_TABLE: tuple[int, ...] = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``; ``crc32c(b"123456789") == 0xE3069283``."""
    crc = _U32
    table = _CRC_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ _U32


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 and add a constant, so CRCs of CRCs stay well distributed."""
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & _U32) + _MASK_DELTA) & _U32


def frame_record(payload: bytes) -> bytes:
    """One TFRecord holding ``payload``."""
    length = struct.pack("<Q", len(payload))
    return length + struct.pack("<I", masked_crc32c(length)) + payload + struct.pack("<I", masked_crc32c(payload))


# ---------------------------------------------------------------- protobuf encoding
def _varint(value: int) -> bytes:
    """Base-128 varint; negative values as 64-bit two's complement (protobuf int64)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _length_delimited(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def _pack_float32(value: float) -> bytes:
    """``value`` as a little-endian float32; finite values beyond float32 range become +-inf."""
    try:
        return struct.pack("<f", value)
    except OverflowError:
        return struct.pack("<f", math.copysign(math.inf, value))


def encode_scalar_event(wall_time: float, step: int, scalars: Mapping[str, float]) -> bytes:
    """Serialized ``Event`` with one ``Summary`` holding a ``simple_value`` (float32) per tag."""
    values = b"".join(
        _length_delimited(1, _length_delimited(1, tag.encode("utf-8")) + _key(2, 5) + _pack_float32(value))
        for tag, value in scalars.items()
    )
    return _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step) + _length_delimited(5, values)


def encode_version_event(wall_time: float) -> bytes:
    """Serialized first ``Event`` of a file: only the wall time and ``file_version``."""
    return _key(1, 1) + struct.pack("<d", wall_time) + _length_delimited(3, FILE_VERSION.encode("ascii"))


# ---------------------------------------------------------------- protobuf decoding
def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint in event payload")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, pos


def _fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """Yield ``(field, wire_type, value)``: ints for varint / fixed wire types, bytes for length-delimited."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(data, pos)
            yield field, wire_type, value
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            if pos + size > len(data):
                raise ValueError("truncated fixed-width field in event payload")
            yield field, wire_type, data[pos:pos + size]
            pos += size
        elif wire_type == 2:
            size, pos = _read_varint(data, pos)
            if pos + size > len(data):
                raise ValueError("truncated length-delimited field in event payload")
            yield field, wire_type, data[pos:pos + size]
            pos += size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type}")


def _decode_value(data: bytes) -> tuple[str, float] | None:
    tag, value = None, None
    for field, wire_type, raw in _fields(data):
        if field == 1 and wire_type == 2 and isinstance(raw, bytes):
            tag = raw.decode("utf-8")
        elif field == 2 and wire_type == 5 and isinstance(raw, bytes):
            value = struct.unpack("<f", raw)[0]
    return (tag, value) if tag is not None and value is not None else None


def decode_event_scalars(payload: bytes) -> list[tuple[int, str, float]]:
    """``(step, tag, simple_value)`` for every scalar of one serialized ``Event`` (none for a version event)."""
    step, summaries = 0, []
    for field, wire_type, raw in _fields(payload):
        if field == 2 and wire_type == 0 and isinstance(raw, int):
            step = raw - (1 << 64) if raw >= 1 << 63 else raw
        elif field == 5 and wire_type == 2 and isinstance(raw, bytes):
            summaries.append(raw)
    out = []
    for summary in summaries:
        for field, wire_type, raw in _fields(summary):
            if field == 1 and wire_type == 2 and isinstance(raw, bytes):
                decoded = _decode_value(raw)
                if decoded is not None:
                    out.append((step, decoded[0], decoded[1]))
    return out


def read_records(path: Path | str) -> list[bytes]:
    """The payloads of a TFRecord file; ``ValueError`` on a bad length / payload CRC or a truncated record."""
    data = Path(path).read_bytes()
    pos, payloads = 0, []
    while pos < len(data):
        if pos + 12 > len(data):
            raise ValueError(f"{path}: truncated record header at byte {pos}")
        length_bytes = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", length_bytes)
        (length_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        if masked_crc32c(length_bytes) != length_crc:
            raise ValueError(f"{path}: length CRC mismatch at byte {pos}")
        start, end = pos + 12, pos + 12 + length
        if end + 4 > len(data):
            raise ValueError(f"{path}: truncated record payload at byte {pos}")
        payload = data[start:end]
        (payload_crc,) = struct.unpack("<I", data[end:end + 4])
        if masked_crc32c(payload) != payload_crc:
            raise ValueError(f"{path}: payload CRC mismatch in record at byte {pos}")
        payloads.append(payload)
        pos = end + 4
    return payloads


def read_scalars(path: Path | str) -> list[tuple[int, str, float]]:
    """All ``(step, tag, value)`` scalars of an event file in write order, after verifying every CRC."""
    return [scalar for payload in read_records(path) for scalar in decode_event_scalars(payload)]


def _new_event_path(log_dir: Path) -> Path:
    """A not-yet-existing ``events.out.tfevents.{time}.{host}.{pid}.{n}`` in ``log_dir``."""
    stem = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
    n = 0
    while (log_dir / f"{stem}.{n}").exists():
        n += 1
    return log_dir / f"{stem}.{n}"


class EventWriter:
    """Appends scalar summaries to a fresh event file in ``log_dir`` (created if missing).

    Invariant: the file always starts with the ``file_version`` record and every record written is complete
    (records are written in one ``write`` call); data reaches the OS on :meth:`flush` / :meth:`close`.
    """

    def __init__(self, log_dir: Path | str) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.path = _new_event_path(self.log_dir)
        self._file = self.path.open("xb")
        self._file.write(frame_record(encode_version_event(time.time())))
        self._file.flush()

    def add_scalars(self, step: int, scalars: Mapping[str, float], wall_time: float | None = None) -> None:
        """Write one event at ``step`` holding every ``tag -> value`` of ``scalars`` (stored as float32)."""
        if self._file.closed:
            raise ValueError(f"EventWriter for {self.path} is closed")
        if not scalars:
            return
        stamp = time.time() if wall_time is None else float(wall_time)
        values = {str(tag): float(value) for tag, value in scalars.items()}
        self._file.write(frame_record(encode_scalar_event(stamp, int(step), values)))

    def flush(self) -> None:
        """Push buffered records to the OS so a running TensorBoard sees them."""
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        """Flush and close; idempotent."""
        if not self._file.closed:
            self._file.flush()
            self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

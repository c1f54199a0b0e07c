"""The hand-rolled TensorBoard event writer/reader (hybridzero.rlhf.tensorboard): CRCs, framing, round trip."""
from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest

from hybridzero.rlhf.tensorboard import (
    EventWriter,
    crc32c,
    masked_crc32c,
    read_records,
    read_scalars,
)


def test_crc32c_check_values() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert crc32c(b"\xff" * 32) == 0x62A8AB43  # RFC 3720 B.4: 32 bytes of ones
    assert crc32c(bytes(range(32))) == 0x46DD794E  # RFC 3720 B.4: incrementing


def test_masked_crc_formula() -> None:
    crc = crc32c(b"abc")
    expected = ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) % 2**32
    assert masked_crc32c(b"abc") == expected


def _write(log_dir: Path) -> Path:
    with EventWriter(log_dir) as writer:
        writer.add_scalars(1, {"ppo/reward": 0.5, "ppo/kl": 0.125}, wall_time=100.0)
        writer.add_scalars(2, {"ppo/reward": -1.25})
        writer.add_scalars(3, {"ppo/kl": math.nan, "ppo/big": 1e40})
        writer.add_scalars(2**40, {"x": 3.0})
        writer.add_scalars(4, {})  # no-op
        return writer.path


def test_round_trip(tmp_path: Path) -> None:
    path = _write(tmp_path / "tb")
    assert path.name.startswith("events.out.tfevents.") and path.name.endswith(".0")
    scalars = read_scalars(path)
    assert scalars[:3] == [(1, "ppo/reward", 0.5), (1, "ppo/kl", 0.125), (2, "ppo/reward", -1.25)]
    assert scalars[3][:2] == (3, "ppo/kl") and math.isnan(scalars[3][2])
    assert scalars[4] == (3, "ppo/big", math.inf)
    assert scalars[5] == (2**40, "x", 3.0)
    assert len(scalars) == 6
    first = read_records(path)[0]
    assert b"brain.Event:2" in first
    assert struct.unpack("<d", first[1:9])[0] > 1e9  # wall_time of the version record


def test_second_writer_gets_new_file(tmp_path: Path) -> None:
    a = _write(tmp_path)
    b = _write(tmp_path)
    assert a != b and a.exists() and b.exists()


def test_corrupted_byte_detected(tmp_path: Path) -> None:
    path = _write(tmp_path)
    data = bytearray(path.read_bytes())
    for index, label in ((len(data) - 10, "payload CRC"), (len(data) - 1, "payload CRC"), (9, "length CRC")):
        broken = bytearray(data)
        broken[index] ^= 0x01
        path.write_bytes(bytes(broken))
        with pytest.raises(ValueError, match=label):
            read_scalars(path)
    path.write_bytes(bytes(data[:-3]))
    with pytest.raises(ValueError, match="truncated"):
        read_scalars(path)


def test_closed_writer_refuses(tmp_path: Path) -> None:
    writer = EventWriter(tmp_path)
    writer.close()
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.add_scalars(1, {"a": 1.0})


def test_tensorboard_reads_our_file(tmp_path: Path) -> None:
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    path = _write(tmp_path)
    acc = accumulator.EventAccumulator(str(path))
    acc.Reload()
    assert "ppo/reward" in acc.Tags()["scalars"]
    assert [(e.step, e.value) for e in acc.Scalars("ppo/reward")] == [(1, 0.5), (2, -1.25)]

"""Device and link profiles: public figures read from ``data/profiles.json`` (never written into the formulas).

A :class:`DeviceProfile` is one accelerator (peak throughput per compute dtype, memory, memory bandwidth, its host
link); a :class:`LinkProfile` is one interconnect (bandwidth per direction per rank, latency per ring step).
``--link intra=nvlink4,inter=ib-200`` picks the two link classes of a cluster; each side also accepts a number in
Gb/s (``inter=100`` is 100 Gb/s, latency of InfiniBand).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

__all__ = ["DeviceProfile", "LinkProfile", "Links", "device_profile", "link_profile", "links_for", "profile_names"]


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator's public figures (see ``data/profiles.json`` for the meaning of each field)."""

    name: str
    memory_gib: float
    tflops: dict[str, float]
    efficiency: float
    hbm_gbps: float
    host_link: str
    shared: bool
    cpu_adam_gelems: float
    nvme_gbps: float

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes."""
        return int(self.memory_gib * 2**30)

    def flops_per_s(self, dtype: str) -> float:
        """Sustained FLOP/s for ``dtype`` (peak x efficiency)."""
        return self.tflops[dtype] * 1e12 * self.efficiency


@dataclass(frozen=True)
class LinkProfile:
    """One interconnect: ``gbps`` GB/s per direction per rank, ``latency_us`` per ring step."""

    name: str
    gbps: float
    latency_us: float

    def seconds(self, wire_bytes: float, steps: int) -> float:
        """Time to send ``wire_bytes`` in ``steps`` ring steps."""
        return steps * self.latency_us * 1e-6 + wire_bytes / (self.gbps * 1e9)


@dataclass(frozen=True)
class Links:
    """The two link classes of a cluster."""

    intra: LinkProfile
    inter: LinkProfile


@cache
def _data() -> dict[str, Any]:
    text = resources.files("hybridzero.plan").joinpath("data/profiles.json").read_text(encoding="utf-8")
    return dict(json.loads(text))


def profile_names() -> tuple[list[str], list[str]]:
    """Known device and link names."""
    return sorted(_data()["devices"]), sorted(_data()["links"])


def device_profile(name: str) -> DeviceProfile:
    """The device profile ``name``; raises ValueError naming the valid ones."""
    devices = _data()["devices"]
    if name not in devices:
        raise ValueError(f"--device {name!r} is not a known profile; valid: {', '.join(sorted(devices))}")
    d = devices[name]
    return DeviceProfile(
        name=name,
        memory_gib=float(d["memory_gib"]),
        tflops={k: float(v) for k, v in d["tflops"].items()},
        efficiency=float(d["efficiency"]),
        hbm_gbps=float(d["hbm_gbps"]),
        host_link=str(d["host_link"]),
        shared=bool(d["shared"]),
        cpu_adam_gelems=float(d["cpu_adam_gelems"]),
        nvme_gbps=float(d["nvme_gbps"]),
    )


def link_profile(name: str) -> LinkProfile:
    """The link ``name``, or ``<number>`` Gb/s (InfiniBand latency); raises ValueError naming the valid ones."""
    links = _data()["links"]
    if name in links:
        return LinkProfile(name, float(links[name]["gbps"]), float(links[name]["latency_us"]))
    try:
        gbits = float(name)
    except ValueError:
        raise ValueError(
            f"link {name!r} is not a known profile or a number of Gb/s; valid: {', '.join(sorted(links))}"
        ) from None
    if not gbits > 0:
        raise ValueError(f"link bandwidth {name!r} Gb/s must be positive")
    return LinkProfile(f"{gbits:g}Gb/s", gbits / 8, float(links["ib-100"]["latency_us"]))


def links_for(device: str, spec: str | None = None) -> Links:
    """The device's default links, overridden by ``spec`` (``intra=NAME,inter=NAME``, either part optional)."""
    chosen = dict(_data()["defaults"].get(device, {"intra": "nvlink3", "inter": "ib-200"}))
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("intra", "inter"):
            raise ValueError(f"--link part {part!r} is invalid: use intra=NAME and/or inter=NAME")
        chosen[key.strip()] = value.strip()
    return Links(link_profile(chosen["intra"]), link_profile(chosen["inter"]))

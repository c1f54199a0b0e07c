"""Step-time estimate: a stated roofline model over the predicted ledger (pure functions).

* Compute: matmul FLOPs per token -- forward ``2 P + 4 L s d`` (``P`` parameters used as matmuls: embedding
  lookups excluded, a tied output head counted; ``d`` = heads x head_dim), backward ``2 P + 2 P_trainable + 8 L s d``
  (input gradients always, weight gradients for trainable parameters), one more forward with activation
  checkpointing -- at the device's peak for the compute dtype times its ``efficiency``. Ranks that share one device
  (the ``cpu`` profile) divide its throughput.
* Communication: every ledger entry on its link class -- ``hpz`` and ``node`` groups intra-node, ``cross`` inter-node,
  ``world`` inter-node when it spans nodes -- as a ring: ``calls x ring steps x latency + wire bytes / bandwidth``.
* Overlap, as the engine does it: gathers overlap compute when prefetch is on (the first gather of each phase
  waits); reduce-scatters overlap the backward with ``overlap_comm`` (never with qgZ, which is synchronous); the step's
  collectives, the optimizer and offload copies do not overlap. Ranks sharing a device (``cpu``) overlap nothing.
* Optimizer: Adam is memory-bound, 28 bytes per stepped element (read param, grad, two moments; write three) at the
  device's memory bandwidth, or the host's Adam throughput with ZeRO-Offload, plus the PCIe copies (gathered shards
  host-to-device, reduced gradients device-to-host in fp32) and, with NVMe, the state read and written once.

Left out (docs/plan.md): kernel launch overheads, non-matmul operations (norms, softmax, elementwise: they dominate
small models in bf16 on CPU), allocator and fragmentation, stragglers, NCCL's tree and NVLS algorithms, congestion.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridzero.comm.ledger import Ledger
from hybridzero.plan.profiles import DeviceProfile, LinkProfile, Links, link_profile

__all__ = ["Flops", "StepTime", "StepWork", "link_class", "ring_steps", "step_time", "transformer_flops"]

ADAM_BYTES_PER_ELEMENT = 28


@dataclass(frozen=True)
class Flops:
    """FLOPs of one micro-batch on one rank."""

    forward: float
    backward: float
    recompute: float

    @property
    def total(self) -> float:
        """Forward + backward + recomputation."""
        return self.forward + self.backward + self.recompute


def transformer_flops(
    matmul_params: int,
    trainable_params: int,
    layers: int,
    attn_dim: int,
    tokens: int,
    seq_len: int,
    checkpointing: bool,
) -> Flops:
    """Matmul FLOPs of ``tokens`` tokens in sequences of ``seq_len`` (see module docstring)."""
    attn = 4 * layers * seq_len * attn_dim
    fwd = tokens * (2 * matmul_params + attn)
    bwd = tokens * (2 * matmul_params + 2 * trainable_params + 2 * attn)
    return Flops(float(fwd), float(bwd), float(fwd) if checkpointing else 0.0)


def link_class(group: str, nodes: int) -> str:
    """``intra`` or ``inter``: the slowest link a collective on ``group`` crosses."""
    if group in ("hpz", "node"):
        return "intra"
    if group == "cross":
        return "inter"
    return "inter" if nodes > 1 else "intra"


def ring_steps(collective: str, world: int) -> int:
    """Latency steps of one ring collective over ``world`` ranks."""
    if world <= 1:
        return 0
    if collective == "all_reduce":
        return 2 * (world - 1)
    if collective in ("all_gather", "grad_all_gather", "reduce_scatter"):
        return world - 1
    return 1


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by part; ``total`` is what the roofline model predicts."""

    compute: float
    comm: dict[str, float]  # per phase: forward, backward (gathers), reduce, step, generate
    exposed_comm: float
    optimizer: float
    offload: float

    @property
    def total(self) -> float:
        """Compute + exposed communication + optimizer + offload copies."""
        return self.compute + self.exposed_comm + self.optimizer + self.offload


def _comm_seconds(ledger: Ledger, group_sizes: dict[str, int], nodes: int, links: Links) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, entry in ledger.items():
        link: LinkProfile = links.intra if link_class(key.group, nodes) == "intra" else links.inter
        steps = entry.calls * ring_steps(key.collective, group_sizes.get(key.group, 1))
        part = "reduce" if key.collective == "reduce_scatter" or key.collective == "grad_all_gather" else key.phase
        out[part] = out.get(part, 0.0) + link.seconds(entry.wire_bytes, steps)
    return out


@dataclass(frozen=True)
class StepWork:
    """What one rank does in one optimizer step, as the plan predicts it (the roofline's input)."""

    flops: Flops  # of one micro-batch
    micro_steps: int
    ledger: Ledger
    group_sizes: dict[str, int]  # ranks of each ledger group
    nodes: int
    dtype: str
    prefetch: bool
    overlap_reduce: bool
    stepped_elements: int  # optimizer elements on this rank
    offload: str  # "none", "cpu" or "nvme"
    pcie_bytes: int  # host<->device copies of offload
    state_file_bytes: int  # optimizer state in NVMe files


def step_time(work: StepWork, device: DeviceProfile, links: Links, ranks_per_device: int) -> StepTime:
    """The roofline estimate of one optimizer step on one rank (see module docstring)."""
    rate = device.flops_per_s(work.dtype) / (ranks_per_device if device.shared else 1)
    fwd = work.micro_steps * (work.flops.forward + work.flops.recompute) / rate
    bwd = work.micro_steps * work.flops.backward / rate
    comm = _comm_seconds(work.ledger, work.group_sizes, work.nodes, links)
    overlap = not device.shared
    exposed = comm.get("step", 0.0)
    for phase, compute in (("forward", fwd), ("backward", bwd)):
        gathers = comm.get(phase, 0.0)
        exposed += max(0.0, gathers - compute) if work.prefetch and overlap else gathers
    reduce = comm.get("reduce", 0.0)
    exposed += max(0.0, reduce - bwd) if work.overlap_reduce and overlap else reduce
    if work.offload == "none":
        optimizer = work.stepped_elements * ADAM_BYTES_PER_ELEMENT / (device.hbm_gbps * 1e9)
        copies = 0.0
    else:
        optimizer = work.stepped_elements / (device.cpu_adam_gelems * 1e9)
        host = 0.0 if device.host_link == "none" else work.pcie_bytes / (link_profile(device.host_link).gbps * 1e9)
        copies = host + 2 * work.state_file_bytes / (device.nvme_gbps * 1e9)
    return StepTime(fwd + bwd, comm, exposed, optimizer, copies)

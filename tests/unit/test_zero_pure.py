"""Pure pieces of the ZeRO layer: layout math, group planning, prefetch traces, the ledger."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hybridzero.comm.ledger import Ledger
from hybridzero.zero.layout import ALIGN, PARTITION_ALIGN, build_layout, intersect, padded_numel
from hybridzero.zero.partition import PERSISTENT, ROOT, find_blocks, plan_groups
from hybridzero.zero.prefetch import Prefetcher
from tests.harness.models import MODEL_FACTORIES


@given(numel=st.integers(0, 10_000), world=st.integers(1, 9))
def test_padded_numel_bounds(numel: int, world: int) -> None:
    padded = padded_numel(numel, world)
    assert padded % world == 0
    assert padded >= max(numel, 1)
    assert padded < max(numel, 1) + world


@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=6), world=st.integers(1, 9))
def test_layout_partitions_start_aligned(sizes: list[int], world: int) -> None:
    """Every rank's partition starts at a multiple of ``PARTITION_ALIGN`` elements (4 bytes in 16-bit, DeepSpeed's
    ``nccl_start_alignment_factor``); padding stays under one alignment unit per rank (none needed over one rank)."""
    layout = build_layout([f"p{i}" for i in range(len(sizes))], [torch.Size([s]) for s in sizes], world)
    align = PARTITION_ALIGN if world > 1 else 1
    assert all(layout.shard_range(r)[0] % align == 0 for r in range(world))
    assert layout.numel <= layout.padded_numel < layout.numel + align * world


@settings(max_examples=50)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=6), world=st.integers(1, 5))
def test_layout_every_element_in_exactly_one_shard(sizes: list[int], world: int) -> None:
    layout = build_layout([f"p{i}" for i in range(len(sizes))], [torch.Size([s]) for s in sizes], world)
    assert layout.numel == layout.specs[-1].end >= sum(sizes)
    covered = [0] * layout.padded_numel
    for r in range(world):
        lo, hi = layout.shard_range(r)
        for i in range(lo, hi):
            covered[i] += 1
    assert covered == [1] * layout.padded_numel
    ends = [spec.end for spec in layout.specs]
    assert ends[-1] == layout.numel
    assert all(s.offset % ALIGN == 0 and e <= s.offset < e + ALIGN for s, e in zip(layout.specs[1:], ends))


def test_local_ranges_and_intersect() -> None:
    layout = build_layout(["a", "b"], [torch.Size([3, 2]), torch.Size([5])], 4)  # b at 16: 21 -> padded 24, S = 6
    assert [s.offset for s in layout.specs] == [0, ALIGN]
    assert layout.padded_numel == 24 and layout.shard_numel == 6
    assert layout.local_ranges(0, (0, 6)) == (0, 6)
    assert layout.local_ranges(2, (16, 21)) == (4, 6)
    assert layout.local_ranges(3, (16, 21)) == (0, 3)
    assert layout.local_ranges(3, (0, 6)) is None
    assert intersect((0, 2), (2, 4)) is None


def test_padded_numel_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="world_size"):
        padded_numel(3, 0)


@pytest.mark.parametrize("name", sorted(MODEL_FACTORIES))
def test_plan_covers_every_parameter_once(name: str) -> None:
    model = MODEL_FACTORIES[name]()
    blocks = find_blocks(model)
    assert len(blocks) == 2
    plans = plan_groups(model, persistence_threshold=0)
    names = [n for p in plans for n in p.param_names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert plans[0].name == ROOT and [p.name for p in plans[1:]] == blocks


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def test_blocks_of_a_sequential_stack_when_no_module_list() -> None:
    """A model without a homogeneous ``nn.ModuleList`` (timm-style ``nn.Sequential(*blocks)``) gets the largest
    homogeneous ``nn.Sequential``'s children as blocks (before: one root group, gathered for the whole forward);
    mixed Sequentials (Linear, ReLU, ...) are not stacks; a ModuleList of blocks still wins over a Sequential."""

    class Vit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(3, 7)
            self.blocks = nn.Sequential(*[_Block(7) for _ in range(3)])
            self.head = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 2))  # mixed: not a stack

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(self.embed(x)))

    vit = Vit()
    assert find_blocks(vit) == ["blocks.0", "blocks.1", "blocks.2"]
    plans = plan_groups(vit, persistence_threshold=0)
    assert [p.name for p in plans] == [ROOT, "blocks.0", "blocks.1", "blocks.2"]
    assert plans[1].param_names == ("blocks.0.fc.weight", "blocks.0.fc.bias")
    assert set(plans[0].param_names) == {n for n, _ in vit.named_parameters() if not n.startswith("blocks.")}
    named = nn.Sequential()
    named.add_module("first", _Block(5))
    named.add_module("second", _Block(5))
    assert find_blocks(named) == ["first", "second"]  # its own child names
    assert find_blocks(nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))) == []

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([_Block(3), _Block(3)])
            self.big = nn.Sequential(_Block(11), _Block(11))

    assert find_blocks(Both()) == ["layers.0", "layers.1"]


def test_sibling_blocks_of_one_user_class_when_no_container() -> None:
    """Blocks registered one by one (``self.first = Block()``) are blocks when the model has no stack container;
    torch's own layers side by side (``fc1``/``fc2``), a lone block, and parameter-less siblings are not; a weight
    two siblings share joins the root group."""

    class Siblings(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(3, 5)
            self.first, self.second, self.third = _Block(5), _Block(5), _Block(5)
            self.fc1, self.fc2 = nn.Linear(5, 5), nn.Linear(5, 5)

    model = Siblings()
    assert find_blocks(model) == ["first", "second", "third"]
    plans = plan_groups(model, persistence_threshold=0)
    assert [p.name for p in plans] == [ROOT, "first", "second", "third"]
    assert set(plans[0].param_names) == {
        n for n, _ in model.named_parameters() if n.split(".")[0] in ("embed", "fc1", "fc2")
    }

    class TorchLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.only = nn.Linear(3, 5), nn.Linear(5, 2), _Block(2)

    assert find_blocks(TorchLayers()) == []

    class Empty(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    class NoParams(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.head = Empty(), Empty(), nn.Linear(3, 3)

    assert find_blocks(NoParams()) == []
    tied = Siblings()
    tied.second.fc.weight = tied.first.fc.weight
    by_name = {p.name: p for p in plan_groups(tied, persistence_threshold=0)}
    assert "first.fc.weight" in by_name[ROOT].param_names
    assert "first.fc.weight" not in by_name["first"].param_names + by_name["second"].param_names


def test_tied_weights_go_to_root_and_small_ones_persist() -> None:
    model = MODEL_FACTORIES["gpt2_tied"]()
    plans = plan_groups(model, persistence_threshold=100)
    by_name = {p.name: p for p in plans}
    assert "transformer.wte.weight" in by_name[ROOT].param_names  # shared with lm_head
    assert all(model.get_parameter(n).numel() <= 100 for n in by_name[PERSISTENT].param_names)
    assert by_name[PERSISTENT].replicated and not by_name[ROOT].replicated


def test_persistence_threshold_is_inclusive_as_in_deepspeed() -> None:
    """DeepSpeed keeps a parameter whole when ``numel <= stage3_param_persistence_threshold``: a weight of exactly
    the threshold persists, one element more does not; threshold 0 persists nothing that has elements."""
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(101, 1, bias=False))  # 100 + 10 elements, then 101

    def persistent(threshold: int) -> tuple[str, ...]:
        plans = {p.name: p.param_names for p in plan_groups(model, persistence_threshold=threshold)}
        return plans.get(PERSISTENT, ())

    assert persistent(100) == ("0.weight", "0.bias")
    assert persistent(99) == ("0.bias",)
    assert persistent(101) == ("0.weight", "0.bias", "1.weight")
    assert persistent(0) == ()


def test_prefetch_follows_trace_and_invalidates_on_deviation() -> None:
    pf = Prefetcher(bucket_elems=100, max_live_elems=1000, max_reuse_distance=0)
    pf.begin("forward")
    assert [pf.observe(g) for g in (0, 1, 2)] == [[], [], []]  # nothing learned yet
    pf.end()
    pf.begin("forward")
    assert pf.observe(0) == [1, 2]
    assert pf.observe(2) == []  # deviation: prefetch off for the rest of the phase
    assert pf.observe(1) == []
    pf.end()
    assert pf.invalidations == 1 and pf.traces["forward"] == (0, 2, 1)
    pf.begin("forward")
    assert pf.observe(0) == [2, 1]
    pf.end()  # ended early: counted, relearned
    assert pf.invalidations == 2 and pf.traces["forward"] == (0,)


def test_upcoming_is_the_whole_trace_before_the_first_use_and_keep_distance_is_the_larger() -> None:
    """``upcoming`` (what a root without parameters prefetches at its pre-forward): the valid trace while nothing of
    the phase is observed, else nothing; ``keep_distance``: the reuse distance or the prefetch bucket, the larger."""
    pf = Prefetcher(bucket_elems=100, max_live_elems=1000, max_reuse_distance=0)
    pf.begin("forward")
    assert pf.upcoming() == []  # no trace yet
    [pf.observe(g) for g in (3, 1, 2)]
    pf.end()
    assert pf.upcoming() == []  # between phases
    pf.begin("forward")
    assert pf.upcoming() == [3, 1, 2]
    pf.observe(3)
    assert pf.upcoming() == []  # the first use launches the rest itself
    assert pf.keep_distance == 100
    assert Prefetcher(10, 1000, 50).keep_distance == 50 and Prefetcher(0, 1000, 0).keep_distance == 0


def test_reuse_distance() -> None:
    pf = Prefetcher(bucket_elems=10, max_live_elems=100, max_reuse_distance=5)
    pf.begin("forward"), [pf.observe(g) for g in (0, 1, 0, 2)], pf.end()
    pf.begin("forward")
    pf.observe(0)
    assert pf.reused_soon(0, lambda gid: 3)  # one group of 3 in between
    assert not Prefetcher(10, 100, 2).reused_soon(0, lambda gid: 3)


def test_ledger_totals_and_filters() -> None:
    ledger = Ledger()
    ledger.record("all_gather", "world", "forward", 100, 50)
    ledger.record("all_gather", "world", "backward", 100, 50)
    ledger.record("reduce_scatter", "world", "backward", 80, 40)
    assert ledger.total("all_gather").calls == 2
    assert ledger.total(phase="backward").bytes == 180
    assert ledger.total(collective="reduce_scatter", phase="forward").calls == 0
    assert "reduce_scatter" in ledger.table()
    assert len(ledger.snapshot()) == 3


def test_ledger_window_without_reset() -> None:
    ledger = Ledger()
    ledger.record("broadcast", "world", "init", 10, 0)
    mark = ledger.copy()
    ledger.record("all_gather", "world", "forward", 100, 50)
    ledger.record("broadcast", "world", "init", 10, 0)
    window = ledger.since(mark)
    assert window.total().calls == 2 and window.total("all_gather").bytes == 100
    assert ledger.total("broadcast").calls == 2 and mark.total().calls == 1


def test_registered_external_parameters_join_the_root_group() -> None:
    """``register_external_parameter(module, p)`` before ``initialize``: ``p`` leaves its block's group for the root
    group (persistent if small enough); unregistering undoes it; a parameter of another model is refused by name."""
    from hybridzero.zero.external import (
        external_parameter_names,
        register_external_parameter,
        unregister_external_parameter,
    )

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([_Block(7), _Block(7)])

    model = Two()
    register_external_parameter(model.layers[1], model.layers[0].fc.weight)
    register_external_parameter(model.layers[1], model.layers[0].fc.bias)
    assert external_parameter_names(model) == {"layers.0.fc.weight", "layers.0.fc.bias"}
    names = external_parameter_names(model)
    plans = {p.name: p.param_names for p in plan_groups(model, persistence_threshold=7, external=names)}
    assert plans == {
        ROOT: ("layers.0.fc.weight",),
        "layers.1": ("layers.1.fc.weight",),
        PERSISTENT: ("layers.0.fc.bias", "layers.1.fc.bias"),
    }
    unregister_external_parameter(model.layers[1], model.layers[0].fc.weight)
    assert external_parameter_names(model) == {"layers.0.fc.bias"}
    with pytest.raises(ValueError, match="not registered"):
        unregister_external_parameter(model.layers[1], model.layers[0].fc.weight)
    register_external_parameter(model.layers[0], nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match="'layers.0'.*not a parameter of the model"):
        external_parameter_names(model)
    with pytest.raises(TypeError, match="nn.Parameter"):
        register_external_parameter(model, torch.zeros(3))  # type: ignore[arg-type]

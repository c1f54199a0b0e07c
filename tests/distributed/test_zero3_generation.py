"""Generation on plain ZeRO-3 engines (no hybrid engine): a DeepSpeed-Chat step-3 sequence over four engines, the
exact gather/release order of a train step, all-gathers during ``generate``, and submodules called directly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.harness.spawn import WorldPool
from tests.workers.phases import (
    LARGE_BUCKET,
    Phase,
    block_output,
    direct_calls_probe,
    event_probe,
    generate_bytes_probe,
    phase_data,
    repeat_block_opt,
)
from tests.workers.rlhf_sequence import RlhfSpec, combined_step, engine_sequence, new_tokens, reference_sequence

_TIMEOUT_S = 180.0
_B0, _B1 = "model.decoder.layers.0", "model.decoder.layers.1"


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The workers' thread count in this process (same kernels, same rounding), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _assert_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float, what: str) -> None:
    """Same names; every tensor bitwise equal (``atol == 0``) or within ``atol``."""
    assert got.keys() == want.keys(), what
    for name, value in want.items():
        if atol == 0.0:
            assert torch.equal(got[name], value), f"{what}: {name} differs"
        else:
            diff = (got[name] - value).abs().max().item()
            assert diff <= atol, f"{what}: {name} differs by {diff}"


@pytest.mark.slow
@pytest.mark.parametrize("ppo_epochs", [1, 2])
@pytest.mark.parametrize("generation_batches", [1, 2, 3, 4])
@pytest.mark.parametrize("world_size", [2, 3])
def test_rlhf_step3_sequence_without_hybrid_engine(
    world: Any, world_size: int, generation_batches: int, ppo_epochs: int
) -> None:
    """Actor/reference/critic/reward ZeRO-3 engines through generate (ranks stopping at different steps), no-grad
    scoring and PPO training: every engine quiescent after every phase (asserted in the workers), prefetch on and
    off bitwise identical, and both equal to the single-process reference (same tokens, parameters within 1e-6)."""
    spec = RlhfSpec(generation_batches=generation_batches, ppo_epochs=ppo_epochs)
    pool: WorldPool = world(world_size)
    on = pool.run(engine_sequence, spec, timeout=_TIMEOUT_S)
    off = pool.run(engine_sequence, spec.replace(prefetch_bucket_size=0), timeout=_TIMEOUT_S)
    ref = reference_sequence(spec, world_size)
    lengths = {new_tokens(spec, r, 0) for r in range(world_size)}
    assert len(lengths) > 1  # ranks really do finish generating at different steps
    for a, b in zip(on, off):
        assert all(n > 0 for n in a["prefetches"].values()) and not any(b["prefetches"].values())
    for rank in range(world_size):
        for a, b, c in zip(on[rank]["generated"], off[rank]["generated"], ref["generated"][rank], strict=True):
            assert torch.equal(a, b) and torch.equal(a, c), f"rank {rank} generated different tokens"
    for model in ("actor", "critic"):
        _assert_params(on[0][model], off[0][model], 0.0, f"{model}: prefetch on vs off")
        _assert_params(on[0][model], ref[model], 1e-6, f"{model}: engine vs reference")


def _expected_train_events() -> dict[str, list[tuple[str, str, str]]]:
    """Prefetch off: the root group spans the whole root forward; blocks are gathered around their own forward; in
    backward the root output's hook gathers root first, each block is released as soon as its gradients are all in,
    and root (whose embedding gradient arrives last) is released last."""

    def phase(kind: str) -> list[tuple[str, str]]:
        """(what, group) of one phase: root around the blocks, blocks in execution order."""
        blocks = [_B0, _B1] if kind == "forward" else [_B1, _B0]
        around_blocks = [(what, b) for b in blocks for what in ("gather", "release")]
        return [("gather", "root"), *around_blocks, ("release", "root")]

    return {kind: [(what, group, kind) for what, group in phase(kind)] for kind in ("forward", "backward")}


_PLAIN_MIX: list[Phase] = [
    ("generate", 4),
    ("train", 0),
    ("eval", 0),
    ("train", 0),
    ("generate", 2),
    ("nograd", 0),
    ("train", 0),
]
_TWICE_MIX: list[Phase] = [("generate", 3), ("train", 0), ("twice", 0), ("train", 0), ("generate", 2), ("train", 0)]


def _kind_switches(phases: list[Phase]) -> int:
    """How often consecutive phases differ in kind."""
    return sum(a[0] != b[0] for a, b in zip(phases, phases[1:]))


def test_event_order_of_a_train_step_and_trace_invalidations(world: Any) -> None:
    """The recorded gather/release events of a train forward+backward are exactly the expected order (prefetch off);
    with a prefetch bucket holding the model, a traced step first prefetches the upcoming blocks and keeps every
    group gathered into the backward (reuse distance 0, DeepSpeed's prefetch rule); mixing
    generate, eval and no-grad forwards with training never invalidates the trace, and a block called twice in one
    forward invalidates it at most once per phase-kind switch."""
    pool: WorldPool = world(2)
    expected = _expected_train_events()
    off = pool.run(event_probe, 0, _PLAIN_MIX, timeout=_TIMEOUT_S)
    for rank in off:
        assert rank["groups"] == ["root", _B0, _B1]
        for iteration in rank["iterations"]:
            assert iteration == expected
        assert rank["mixed_invalidations"] == 0
    on = pool.run(event_probe, LARGE_BUCKET, _TWICE_MIX, timeout=_TIMEOUT_S)
    # a bucket holding the model keeps every group from the traced forward into its backward (DeepSpeed's prefetcher
    # leaves gathered what it would fetch again): no release in the forward, no gather in the backward
    kept = {
        "forward": [("gather", g, "forward") for g in ("root", _B0, _B1)],
        "backward": [("release", g, "backward") for g in (_B1, _B0, "root")],
    }
    for rank in on:
        assert rank["iterations"][0] == expected  # no trace yet: nothing to prefetch
        traced = rank["iterations"][1]
        prefetched = [e for e in traced["forward"] if e[0] == "prefetch"]
        assert prefetched == [("prefetch", g, "forward") for g in (_B0, _B1)]
        assert traced["forward"][: len(prefetched)] == prefetched  # launched before anything is waited on
        for kind in ("forward", "backward"):
            assert [e for e in traced[kind] if e[0] != "prefetch"] == kept[kind]
        assert 0 < rank["mixed_invalidations"] <= _kind_switches(_TWICE_MIX)


def test_generate_all_gathers_equal_forwards_times_groups(world: Any) -> None:
    """A 16-token greedy generate at world 2 (prefetch off, nothing persistent, same prompts on both ranks so nobody
    stops early) issues exactly one all-gather per group per forward and, besides them, only the synced-generation
    guard's one 4-byte exchange per forward (runtime/synced_generation.py); it moves exactly that many bytes and leaves
    the engine quiescent (asserted in the worker)."""
    results = world(2).run(generate_bytes_probe, 16, timeout=_TIMEOUT_S)
    for r in results:
        assert r["forwards"] == 16  # prefill + 15 decoding steps
        assert r["generated"].shape[1] == 4 + 16
        assert r["gather_calls"] == r["forwards"] * r["groups"]
        assert r["gather_bytes"] == r["forwards"] * r["group_bytes"]
        assert r["other_calls"] == 0
        assert (r["sync_calls"], r["sync_bytes"]) == (r["forwards"], 4 * r["forwards"])
    assert torch.equal(results[0]["generated"], results[1]["generated"])


def test_directly_called_submodules(world: Any) -> None:
    """``engine.module.get_input_embeddings()(ids)`` equals the unsharded model's; embedding → project_in → block 1
    called directly with grad, then backward and an SGD step, leaves the engine quiescent (asserted in the worker)
    and updates the parameters exactly like the unsharded reference of the same per-rank calls."""
    lr, world_size = 0.5, 2
    results = world(world_size).run(direct_calls_probe, lr, timeout=_TIMEOUT_S)
    with _one_thread():
        model = repeat_block_opt(0)
        decoder = model.model.decoder
        with torch.no_grad():
            for rank, r in enumerate(results):
                assert torch.equal(r["embedded"], model.get_input_embeddings()(phase_data(0, rank)))

        def rank_loss(rank: int) -> torch.Tensor:
            """The unsharded twin of ``rank``'s direct calls (its loss must equal the engine's bit for bit)."""
            embedded = model.get_input_embeddings()(phase_data(0, rank))
            loss = block_output(decoder.layers[1](decoder.project_in(embedded))).pow(2).mean()
            assert torch.equal(loss.detach(), results[rank]["loss"])
            return loss

        combined_step(
            model, torch.optim.SGD(model.parameters(), lr=lr), [lambda r=r: rank_loss(r) for r in range(world_size)]
        )
        want = {n: p.detach() for n, p in model.named_parameters()}
    _assert_params(results[0]["params"], want, 1e-6, "direct calls vs reference")

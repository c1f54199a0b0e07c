"""``deepspeed.checkpointing`` (``hybridzero.runtime.activation_checkpointing``): a checkpointed block gives the
plain block's values and gradients bitwise, dropout included (the forward's RNG state replayed); settings from the
config block and the arguments, bad ones refused naming them; the Megatron RNG tracker's streams."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hybridzero.runtime import activation_checkpointing as ac


@pytest.fixture(autouse=True)
def _restore_settings() -> Iterator[None]:
    """The API is process-wide (DeepSpeed's contract): each test leaves the settings and tracker as it found them."""
    saved = dataclasses.replace(ac.SETTINGS)
    states, seeds = dict(ac.TRACKER.states), set(ac.TRACKER.seeds)
    rng = torch.get_rng_state()
    yield
    for f in dataclasses.fields(saved):
        setattr(ac.SETTINGS, f.name, getattr(saved, f.name))
    ac.TRACKER.states, ac.TRACKER.seeds = states, seeds
    torch.set_rng_state(rng)


class _Block(torch.nn.Module):
    """Linear -> GELU -> dropout (default generator) -> dropout (the tracker's model-parallel stream, Megatron's
    tensor-parallel dropout) -> Linear, scaled by a keyword tensor (9 x 7: no dimension divisible by 2-4)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(9, 7), torch.nn.Linear(7, 9)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(torch.nn.functional.gelu(self.a(x)), 0.3)
        with ac.get_cuda_rng_tracker().fork():
            h = torch.nn.functional.dropout(h, 0.3)
        return self.b(h) * scale


def _run(wrap: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(5, 9, requires_grad=True)
    scale = torch.tensor(1.5, requires_grad=True)
    ac.model_parallel_cuda_manual_seed(1)  # the dropout masks: both streams
    out = wrap(block, x, scale)
    out.square().sum().backward()
    grads = [x.grad, scale.grad] + [p.grad for p in block.parameters()]
    return out.detach(), [g for g in grads if g is not None]


def _plain(block: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return block(x, scale=scale)


@pytest.mark.parametrize("cpu_checkpointing", [False, True])
def test_checkpoint_equals_the_plain_block_bitwise(cpu_checkpointing: bool) -> None:
    ac.configure(None, checkpoint_in_cpu=cpu_checkpointing, synchronize=True, profile=True)
    want, want_grads = _run(_plain)
    for wrap in (
        lambda block, x, scale: ac.checkpoint(block, x, scale=scale),  # a keyword tensor takes part in autograd
        lambda block, x, scale: ac.non_reentrant_checkpoint(lambda a, s: block(a, scale=s), x, scale),
    ):
        got, got_grads = _run(wrap)
        assert torch.equal(got, want)
        assert len(got_grads) == len(want_grads) == 6
        assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))


def test_settings_from_the_block_then_arguments(tmp_path: Any) -> None:
    config = {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True, "profile": True}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    ac.configure(SimpleNamespace(get_model_parallel_world_size=lambda: 1), deepspeed_config=str(path), profile=False)
    assert ac.is_configured()
    s = ac.SETTINGS
    assert (s.partition_activations, s.cpu_checkpointing, s.profile, s.synchronize) == (True, True, False, False)
    ac.set_num_layers(12)
    ac.reset()
    assert ac.SETTINGS.num_layers == 12 and ac.is_configured()


@pytest.mark.parametrize(
    ("mpu", "config", "kwargs", "named"),
    [
        (None, {"activation_checkpointing": {"cpu_checkpoint": True}}, {}, "cpu_checkpoint"),
        (SimpleNamespace(get_model_parallel_world_size=lambda: 2), None, {}, "model-parallel size 2"),
        (None, None, {"contiguous_checkpointing": True}, "number_checkpoints"),
    ],
)
def test_bad_settings_are_refused_naming_them(mpu: Any, config: Any, kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ac.configure(mpu, deepspeed_config=config, **kwargs)


def test_rng_tracker_streams() -> None:
    """``model_parallel_cuda_manual_seed(s)``: the default stream is seed ``s``'s, the model-parallel stream seed
    ``s + 2718``'s and continues across forks; a fork leaves the default stream where it was."""
    ac.model_parallel_cuda_manual_seed(7)
    tracker = ac.get_cuda_rng_tracker()
    first = torch.rand(3)
    with tracker.fork():
        forked = torch.rand(4)
    with tracker.fork():
        forked_again = torch.rand(4)
    second = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))
    torch.manual_seed(7 + 2718)
    assert torch.equal(torch.cat([forked, forked_again]), torch.rand(8))
    ac.model_parallel_reconfigure_tp_seed(9)
    with tracker.fork():
        reseeded = torch.rand(2)
    torch.manual_seed(9 + 2718)
    assert torch.equal(reseeded, torch.rand(2))
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("other", 7 + 2718)
    with pytest.raises(KeyError, match="no state 'missing'"):
        with tracker.fork("missing"):
            pass

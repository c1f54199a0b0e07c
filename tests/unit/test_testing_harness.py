"""Single-process tests of the test harness: tiny models, synthetic data, pool arguments."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.harness.data import make_token_batches
from tests.harness.models import (
    MODEL_FACTORIES,
    WithScalar,
    block_numels,
    find_blocks,
    rest_numel,
    tiny_gpt2,
    tiny_llama,
    tiny_opt,
)
from tests.harness.spawn import _worker_env

FACTORIES: dict[str, Callable[..., nn.Module]] = {
    **MODEL_FACTORIES,
    "opt_noproj": lambda seed=0, **kw: tiny_opt(seed, project=False, **kw),
    "opt_noproj_postln": lambda seed=0, **kw: tiny_opt(seed, project=False, pre_ln=False, **kw),
}


def _ids(model: nn.Module, batch: int = 2, seq: int = 7, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch, seq), generator=generator)


def test_registry_names() -> None:
    assert set(MODEL_FACTORIES) == {"llama", "opt", "opt_postln", "gpt2_tied", "gpt2_untied"}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_numels_are_coprime_with_12(name: str) -> None:
    model = FACTORIES[name]()
    blocks = block_numels(model)
    rest = rest_numel(model)
    assert len(blocks) == 2
    for numel in [*blocks, rest]:
        assert math.gcd(numel, 12) == 1, (name, blocks, rest)
    assert sum(blocks) + rest == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_small_fp32_eager_no_dropout(name: str) -> None:
    model = FACTORIES[name]()
    config = model.config
    assert 97 <= config.vocab_size <= 131 and 20 <= config.hidden_size <= 40
    assert config._attn_implementation == "eager"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(m.p == 0 for m in model.modules() if isinstance(m, nn.Dropout))
    assert len(block_numels(FACTORIES[name](num_hidden_layers=3))) == 3


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_same_seed_same_weights(name: str) -> None:
    first, second, other = FACTORIES[name](seed=3), FACTORIES[name](seed=3), FACTORIES[name](seed=4)
    for (key, a), b, c in zip(first.state_dict().items(), second.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b), key
    assert not all(torch.equal(a, c) for a, c in zip(first.parameters(), other.parameters()))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_forward_backward_and_generate(name: str) -> None:
    model = FACTORIES[name]()
    ids = _ids(model)
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    with torch.no_grad():
        generated = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False
        )
    assert generated.shape == (2, 11) and torch.equal(generated[:, :7], ids)


def test_llama_grouped_query_attention() -> None:
    model = tiny_llama()
    config = model.config
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.head_dim % 2 == 0 and config.head_dim * config.num_attention_heads != config.hidden_size
    attention = model.model.layers[0].self_attn
    assert attention.k_proj.out_features == config.num_key_value_heads * config.head_dim
    assert attention.q_proj.out_features == config.num_attention_heads * config.head_dim
    assert model.lm_head.weight is not model.model.embed_tokens.weight


@pytest.mark.parametrize("pre_ln", [True, False])
@pytest.mark.parametrize("project", [True, False])
def test_opt_projection_and_layer_norm(project: bool, pre_ln: bool) -> None:
    model = tiny_opt(project=project, pre_ln=pre_ln)
    decoder = model.model.decoder
    assert (decoder.project_in is not None) == project and (decoder.project_out is not None) == project
    assert (decoder.final_layer_norm is not None) == pre_ln
    assert model.lm_head.weight is decoder.embed_tokens.weight


def test_gpt2_tied_and_untied() -> None:
    tied, untied = tiny_gpt2(tied=True), tiny_gpt2(tied=False)
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert find_blocks(tied) is tied.transformer.h


@pytest.mark.parametrize("name", ["llama", "gpt2_untied"])
def test_with_scalar_matches_inner_loss(name: str) -> None:
    wrapped = WithScalar(MODEL_FACTORIES[name]())
    ids = _ids(wrapped.model)
    labels = ids.clone()
    labels[:, :2] = -100
    out = wrapped(ids, labels=labels, attention_mask=torch.ones_like(ids))
    reference = wrapped.model(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, reference.loss)
    torch.testing.assert_close(out.logits, reference.logits)
    assert wrapped.logit_scale.numel() == 1 and wrapped.logit_scale.item() == 1.0
    out.loss.backward()
    assert wrapped.logit_scale.grad is not None and wrapped.logit_scale.grad.abs().item() > 0
    assert block_numels(wrapped) == block_numels(wrapped.model)
    assert rest_numel(wrapped) == rest_numel(wrapped.model) + 1
    assert wrapped(ids).loss is None


def test_with_scalar_scales_logits() -> None:
    wrapped = WithScalar(tiny_opt())
    ids = _ids(wrapped.model)
    base = wrapped(ids).logits
    with torch.no_grad():
        wrapped.logit_scale.fill_(2.0)
    torch.testing.assert_close(wrapped(ids).logits, 2 * base)


def test_token_batches_layout_and_determinism() -> None:
    kwargs = dict(steps=3, accumulation=2, world_size=4, micro_batch=5, seq_len=6, vocab_size=97)
    batches = make_token_batches(0, **kwargs)
    assert batches.shape == (3, 2, 4, 5, 6) and batches.dtype == torch.int64
    assert int(batches.min()) >= 0 and int(batches.max()) < 97
    assert torch.equal(batches, make_token_batches(0, **kwargs))
    assert not torch.equal(batches, make_token_batches(1, **kwargs))
    torch.manual_seed(0)
    state = torch.get_rng_state()
    make_token_batches(0, **kwargs)
    assert torch.equal(state, torch.get_rng_state())
    with pytest.raises(ValueError):
        make_token_batches(0, **{**kwargs, "steps": 0})


def test_worker_env_simulates_nodes() -> None:
    env = _worker_env(5, 6, 1234, {"LOCAL_WORLD_SIZE": "2", "EXTRA": "x"})
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "6" and env["MASTER_PORT"] == "1234"
    assert env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "2"
    assert env["GROUP_RANK"] == env["NODE_RANK"] == "2" and env["EXTRA"] == "x"
    single = _worker_env(2, 3, 1, {})
    assert single["LOCAL_RANK"] == "2" and single["LOCAL_WORLD_SIZE"] == "3" and single["NODE_RANK"] == "0"

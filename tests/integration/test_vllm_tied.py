"""A colocated vLLM engine on a model with **tied** input/output embeddings (SmolLM2's layout): after every sync its
greedy tokens equal Hugging Face's for the trainer's weights and its log-probs of those tokens agree with the
trainer's own.

vLLM's LM head then shares the embedding's matrix, so no synced tensor is addressed to it and ``reload_weights`` puts
back the head's packed state from before the sync: without the refresh in ``VLLMEngine.sync_weights`` the CPU build
computed the logits with the engine's dummy start weights (tokens matched neither model). One engine per module
(vLLM's start is slow); head size 32 for vLLM's CPU attention, the other dimensions odd."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [3], [40, 41, 42, 43, 44, 45, 46]]
NEW = 9


@pytest.fixture(scope="module")
def setup() -> Any:
    import hybridzero
    from hybridzero.rlhf.rollout.backends import VLLMEngine, VLLMOptions
    from tests.harness.models import tiny_llama

    model = tiny_llama(seed=11, head_dim=32, max_position_embeddings=64, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-2}},
    }
    engine, *_ = hybridzero.initialize(model=model, config=cfg, model_parameters=model.parameters())
    vllm = VLLMEngine(engine.module.config, VLLMOptions(dtype="fp32", kv_cache_gb=0.05, max_model_len=64), 1, 0)
    vllm.start()
    yield engine, vllm
    vllm.stop()


def _hf(engine: Any) -> tuple[list[list[int]], list[list[float]]]:
    """The trainer's greedy tokens for each prompt and its own log-probs of them (fp32, gathered weights)."""
    tokens, logprobs = [], []
    for p in PROMPTS:
        ids = engine.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            logits = engine(input_ids=ids).logits[0, len(p) - 1 : -1].float()
        new = ids[0, len(p) :]
        tokens.append(new.tolist())
        logprobs.append(torch.log_softmax(logits, -1).gather(-1, new[:, None])[:, 0].tolist())
    return tokens, logprobs


def _check(engine: Any, vllm: Any) -> None:
    from hybridzero.rlhf.rollout.backends import SamplingSpec

    want_tokens, want_lp = _hf(engine)
    got = vllm.generate(PROMPTS, SamplingSpec(NEW, None))
    assert got.tokens == want_tokens
    # fp32 on both sides, different kernels (oneDNN vs torch): log-probs agree to ~1e-5 absolute at this size; a
    # stale head is off by whole nats
    for g, w in zip(got.logprobs or [], want_lp):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-4, rtol=0), (g, w)


def test_tied_head_follows_every_sync(setup: Any) -> None:
    engine, vllm = setup
    vllm.sync_weights(engine)  # the first sync replaces vLLM's dummy start weights
    _check(engine, vllm)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        for _ in range(2):  # updates that move the shared matrix
            ids = torch.randint(3, 113, (2, 11), generator=gen)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        vllm.sync_weights(engine)
        _check(engine, vllm)

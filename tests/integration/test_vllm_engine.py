"""One colocated vLLM engine (world 1, fp32, in this test process) fed from a ZeRO-3 engine: greedy tokens equal
Hugging Face's for the same weights before and after training updates, the tensors it was handed are the trainer's
full parameters bit for bit (and so are the parameters vLLM keeps readable), and every sync is counted in the ledger.

vLLM's engine start is slow (tens of seconds here), so the module starts exactly one engine and asks everything of
it. The model's head size is 32, one vLLM's CPU attention accepts; every other dimension is odd-sized."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [3], [40, 41, 42, 43, 44, 45, 46]]
NEW = 9
EOS = 2


def _model() -> Any:
    from tests.harness.models import tiny_llama

    # head_dim 32 (vLLM's CPU attention: 32, 64, ...); hidden 35 and 5 query heads sharing 1 kv head stay odd
    return tiny_llama(seed=11, head_dim=32, max_position_embeddings=64)


@pytest.fixture(scope="module")
def setup() -> Any:
    import hybridzero
    from hybridzero.rlhf.rollout.backends import VLLMEngine, VLLMOptions

    model = _model()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-2}},
    }
    engine, *_ = hybridzero.initialize(model=model, config=cfg, model_parameters=model.parameters())
    vllm = VLLMEngine(engine.module.config, VLLMOptions(dtype="fp32", kv_cache_gb=0.05, max_model_len=64), 1, 0)
    vllm.keep_sent = True
    vllm.start()
    yield engine, vllm
    vllm.stop()


def _hf_greedy(engine: Any, eos: int | None) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        kwargs = {"eos_token_id": eos} if eos is not None else {}
        ids = engine.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs)
        toks = ids[0, len(p) :].tolist()
        if eos is not None and eos in toks:
            toks = toks[: toks.index(eos) + 1]
        out.append(toks)
    return out


def _full_params(engine: Any) -> dict[str, torch.Tensor]:
    from hybridzero.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _check_synced(engine: Any, vllm: Any) -> None:
    from hybridzero.rlhf.rollout.backends import SamplingSpec

    full = _full_params(engine)
    assert set(vllm.sent) == set(full)
    assert all(torch.equal(vllm.sent[n], full[n]) for n in full)  # handed over bit for bit
    kept = vllm.llm.apply_model(lambda m: {n: p.detach().clone() for n, p in m.named_parameters() if p.numel()})[0]
    readable = [n for n in kept if n in full]  # embeddings, norms, lm_head (its CPU build repacks the linears)
    assert "model.norm.weight" in readable and "lm_head.weight" in readable
    for n in readable:
        assert torch.equal(kept[n][: full[n].shape[0]], full[n]), n  # vLLM pads the vocabulary rows
    for eos in (None, EOS):
        got = vllm.generate(PROMPTS, SamplingSpec(NEW, eos)).tokens
        assert got == _hf_greedy(engine, eos)


def test_greedy_tokens_and_weights_equal_the_trainers_before_and_after_updates(setup: Any) -> None:
    engine, vllm = setup
    vllm.sync_weights(engine)
    _check_synced(engine, vllm)
    groups = len({g.owner for g in engine.coordinator.groups if not g.always_full})
    gen = torch.Generator().manual_seed(1)
    for step in range(3):  # N training updates, then one sync
        ids = torch.randint(3, 97, (2, 11), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    before = {n: t.clone() for n, t in vllm.sent.items()}
    stats = vllm.sync_weights(engine)
    assert any(not torch.equal(before[n], vllm.sent[n]) for n in before)  # the weights did move
    _check_synced(engine, vllm)
    assert stats.syncs == 2 and len(stats.history) == 2 and stats.bytes > 0
    ledger = engine.comm.ledger
    assert ledger.total("weight_sync", phase="rollout_sync").calls == stats.buckets == 2 * groups
    assert ledger.total("all_gather", phase="rollout_sync").calls == 2 * len(
        [g for g in engine.coordinator.groups if not g.always_full]
    )


def test_sampling_is_seeded_per_prompt_and_reports_the_sampler_logprobs(setup: Any) -> None:
    from hybridzero.rlhf.rollout.backends import SamplingSpec

    engine, vllm = setup
    if vllm.synced_step is None:
        vllm.sync_weights(engine)
    spec = SamplingSpec(NEW, None, seeds=[11, 12, 13, 14], temperature=1.0)
    a = vllm.generate(PROMPTS, spec)
    b = vllm.generate(list(reversed(PROMPTS)), SamplingSpec(NEW, None, seeds=[14, 13, 12, 11]))
    assert a.tokens == list(reversed(b.tokens))  # the same seed gives the same answer wherever it sits
    assert a.logprobs is not None and [len(x) for x in a.logprobs] == [NEW] * len(PROMPTS)
    assert all(lp <= 0.0 and lp == lp for row in a.logprobs for lp in row)

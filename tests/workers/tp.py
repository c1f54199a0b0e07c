"""Per-rank checks of tensor-parallel generation (``hybrid_engine.inference_tp_size``), for the worker pool.

The tiny models here have head and intermediate counts divisible by 4 (tensor parallelism needs whole heads per
rank; HF's Llama config also wants the hidden size divisible by the head count), so their numels are mostly even;
the OPT and GPT-2 root groups (odd vocabularies and position tables) still pad. Grouped-query attention (8 query
heads over 4 kv heads) and OPT's project_in/out are in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.harness.models import tiny_gpt2, tiny_llama, tiny_opt
from tests.harness.parity import RunSpec, ds_config

MODELS = ("llama", "opt", "gpt2", "llama_lora")
_GEN = {"max_new_tokens": 6, "do_sample": False}


def tp_model(name: str, seed: int = 0) -> nn.Module:
    """A tiny model whose heads and MLP split over 2 and 4 ranks (``llama_lora``: LoRA on every block linear, with
    non-zero adapters so merging matters)."""
    if name.startswith("llama"):
        model: nn.Module = tiny_llama(
            seed, hidden_size=40, num_attention_heads=8, num_key_value_heads=4, head_dim=6, intermediate_size=44
        )
    elif name == "opt":
        model = tiny_opt(seed, hidden_size=36, num_attention_heads=4, ffn_dim=44)
    else:
        model = tiny_gpt2(seed, n_embd=36, n_head=4, n_inner=44)
    if name == "llama_lora":
        from hybridzero.lora import convert_linear_layer_to_lora

        convert_linear_layer_to_lora(model, "layers.", 3, seed=seed)
        gen = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_left" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def _config(world: int, tp: int, layers_per_gather: int = 8, stage: int = 3) -> dict[str, Any]:
    cfg = ds_config(RunSpec(prefetch_bucket_size=10**9, stage=stage), world)
    cfg["hybrid_engine"] = {"enabled": True, "inference_tp_size": tp, "tp_gather_partition_size": layers_per_gather}
    return cfg


def prompts(rank: int, vocab: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-dependent batch size (2, 1, 3, 1 rows) and width (4 + rank); rows left-padded to different lengths, as
    the RLHF rollout pads its prompts."""
    gen = torch.Generator().manual_seed(500 + rank)
    rows, width = (2, 1, 3, 1)[rank % 4], 4 + rank
    ids = torch.randint(3, vocab, (rows, width), generator=gen)
    mask = torch.ones_like(ids)
    for r in range(1, rows):  # row r has r leading pads
        ids[r, :r], mask[r, :r] = pad, 0
    return ids, mask


def _projection_numel(model: nn.Module, name: str) -> int:
    """Elements of every split projection (weights, and the biases of column-parallel ones), from the shapes."""
    from hybridzero.runtime.tp_plans import FAMILIES, ROW

    family = FAMILIES[model.config.model_type]
    total = 0
    for layer in model.get_submodule(family.layers).children():
        for split in family.splits:
            sub = layer.get_submodule(split.path)
            total += sub.weight.numel()
            if split.kind != ROW and getattr(sub, "bias", None) is not None:
                total += sub.bias.numel()
    return total


def _sampled_equal(ref: nn.Module, engine: Any, ids: torch.Tensor, mask: torch.Tensor, pad: int, rank: int) -> bool:
    """The rollout's per-row sampling noise (a caller's logits processor) gives the unsharded model's samples."""
    from transformers import LogitsProcessorList

    from hybridzero.rlhf.rollout.generate import SampleNoise

    seeds = [1000 * rank + r for r in range(ids.shape[0])]

    def kw() -> dict[str, Any]:
        return {**_GEN, "pad_token_id": pad, "logits_processor": LogitsProcessorList([SampleNoise(seeds, 0.8, 5)])}

    return torch.equal(
        engine.generate(ids, attention_mask=mask, **kw()), ref.generate(ids, attention_mask=mask, **kw())
    )


def tp_checks(tp: int) -> dict[str, Any]:
    """For every model: greedy tokens vs the unsharded model's (masked and unmasked prompts, an EOS that stops one
    rank's batch early), the group's all-reduce count, held bytes vs the shapes, shards and memory untouched."""
    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out: dict[str, Any] = {}
    for name in MODELS:
        ref = tp_model(name)
        engine, *_ = hybridzero.initialize(model=tp_model(name), config=_config(world, tp, layers_per_gather=1))
        vocab, pad = int(ref.config.vocab_size), int(ref.config.pad_token_id)
        ids, mask = prompts(rank, vocab, pad)
        probe, probe_mask = prompts(1, vocab, pad)
        with torch.no_grad():  # EOS := rank 1's first greedy token: rank 1's own (1-row) batch stops after one token
            eos = int(ref.generate(probe, attention_mask=probe_mask, pad_token_id=pad, **_GEN)[0, probe.shape[1]])
            kw = {**_GEN, "pad_token_id": pad, "eos_token_id": eos}
            want = ref.generate(ids, attention_mask=mask, **kw)
            plain = ids[:1, rank % 2 :]  # unpadded prompt, no mask given: HF's default mask
            want_plain = ref.generate(plain, pad_token_id=pad, **_GEN)
            masters = [g.master.clone() for g in engine.groups]
            mem0 = engine.memory_report()
            mark = engine.comm_ledger().copy()
            got = engine.generate(ids, attention_mask=mask, **kw)
            window = engine.comm_ledger().since(mark)
            got_plain = engine.generate(plain, pad_token_id=pad, **_GEN)
            sampled = name != "llama" or _sampled_equal(ref, engine, ids, mask, pad, rank)
        stats = engine.tp_generator.last_stats
        engine.assert_quiescent()
        out[name] = {
            "equal": torch.equal(got, want),
            "equal_plain": torch.equal(got_plain, want_plain),
            "sampled_equal": sampled,
            "new_tokens": got.shape[1] - ids.shape[1],
            "shape": tuple(got.shape) == tuple(want.shape),
            "tp_all_reduces": window.total("all_reduce", "tp", "generate").calls,
            "layers": int(getattr(ref.config, "num_hidden_layers", getattr(ref.config, "n_layer", 0))),
            "projection_bytes": stats.projection_bytes,
            "projection_full_bytes": 4 * _projection_numel(ref, name),
            "held_bytes": stats.held_bytes,
            "peak_bytes": stats.peak_bytes,
            "full_hybrid_bytes": stats.full_hybrid_bytes,
            "resident_bytes": stats.resident_bytes,
            "block_bytes": max(g.numel * 4 for g in engine.groups if g.owner),
            "masters_untouched": all(torch.equal(a, g.master) for a, g in zip(masters, engine.groups)),
            "memory_restored": mem0 == engine.memory_report(),
        }
    out["more"] = _more_checks(tp, world, rank)
    return out


def _more_checks(tp: int, world: int, rank: int) -> dict[str, Any]:
    """Requests refused on every rank of the group (agreed errors: the engine stays usable); the peak bytes with
    every layer gathered at once (``tp_gather_partition_size`` >= layers)."""
    import hybridzero

    errors: dict[str, Any] = {}
    ids = torch.randint(3, 100, (1, 4), generator=torch.Generator().manual_seed(rank))
    bad, *_ = hybridzero.initialize(model=tiny_llama(0), config=_config(world, tp))  # 5 heads, 1 kv head
    good, *_ = hybridzero.initialize(model=tp_model("llama"), config=_config(world, tp))
    for what, engine, kwargs in (
        ("sizes", bad, {}),
        ("beams", good, {"num_beams": 2} if rank == 0 else {}),
        ("mismatch", good, {"min_new_tokens": 1 + rank % 2}),
    ):
        try:
            engine.generate(ids, max_new_tokens=2, pad_token_id=0, **kwargs)
            errors[what] = ""
        except ValueError as exc:
            errors[what] = str(exc)
    errors["alive"] = str(tuple(good.generate(ids, max_new_tokens=2, pad_token_id=0).shape))
    stats = good.tp_generator.last_stats
    errors["peak_all_layers"] = (stats.peak_bytes, stats.full_hybrid_bytes)
    return errors


def tp_train_cycles(tp: int, steps: int = 3) -> dict[str, Any]:
    """``steps`` cycles of train step -> (tensor-parallel generate, when ``tp``) -> train step on the Llama;
    returns rank 0's full parameters (for a bitwise comparison with ``tp = 0``: no generation)."""
    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine, *_ = hybridzero.initialize(model=tp_model("llama"), config=_config(world, max(tp, 1)))
    gen = torch.Generator().manual_seed(900)
    data = torch.randint(3, 113, (steps, 2, world, 2, 9), generator=gen)
    for step in range(steps):
        for half in range(2):
            batch = data[step, half, rank]
            engine.backward(engine(input_ids=batch, labels=batch).loss)
            engine.step()
            if half == 0 and tp:
                with torch.no_grad():
                    engine.generate(batch[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
                engine.assert_quiescent()
    params = engine.full_parameters()
    return {"params": params if rank == 0 else None}

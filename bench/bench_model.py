"""The benchmark workload: a small Llama, its DeepSpeed config, learnable synthetic data, one measured step.

Shared by ``python -m hybridzero train-demo`` and ``bench/bench_zero3.py`` so that both run exactly the same work.

Model (:func:`benchmark_llama`): vocab 8192, hidden 256, intermediate 688, 4 blocks, 4 query heads sharing 2 KV
heads (head_dim 64), untied embeddings, eager attention, fp32, about 7.1 M parameters (28 MiB fp32): 2.1 M in each
of ``embed_tokens`` and ``lm_head`` and 0.73 M per block.

Data (:func:`synthetic_batches`): uniform random tokens, but drawn from a small fixed *pool* of sequences that is
cycled. At initialisation the loss is about ``log(8192) ≈ 9.01`` (uniform next-token guess); because the same
sequences come back every few steps the model first learns the pool's token frequencies and then memorises the
sequences, so the loss visibly falls within tens of steps. A never-repeating random stream would stay at ≈ 9.01
forever and show nothing.

Variants (:func:`model_overrides`, selected by name from :data:`MODEL_CHOICES`): ``"bench"`` (the model above),
``"tiny"`` (:func:`tiny_overrides`, smoke tests) and ``"100m"`` (:func:`overrides_100m`, a Llama-shaped point of
exactly 100,092,672 parameters for a larger-model measurement).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import transformers

__all__ = [
    "INITIAL_LOSS",
    "MICRO_BATCH",
    "MODEL_CHOICES",
    "SEQ_LEN",
    "StepMetrics",
    "benchmark_config",
    "benchmark_llama",
    "measured_step",
    "model_overrides",
    "overrides_100m",
    "prefetch_bucket_for",
    "reduce_bucket_for",
    "synthetic_batches",
    "tiny_overrides",
]

MICRO_BATCH: int = 4
"""Per-rank micro-batch (sequences)."""
SEQ_LEN: int = 64
"""Tokens per sequence."""
VOCAB: int = 8192
"""Benchmark vocabulary size."""
INITIAL_LOSS: float = math.log(VOCAB)
"""Expected loss of the freshly initialised benchmark model: ``log(8192) ≈ 9.01``."""

PREFETCH_BUCKET_ELEMS: int = 1_500_000
"""``stage3_prefetch_bucket_size`` (elements): two blocks (2 × 0.73 M) may be gathered ahead of use."""

PERSISTENCE_THRESHOLD: int = 0
"""``stage3_param_persistence_threshold``: 0, nothing stays replicated.

Justification: this engine gathers a whole transformer block per all-gather, so a block's small tensors (its two
RMSNorm weights, 256 elements each) ride along in the block's gather at no extra call. Keeping them replicated
would save no gather but add an all-reduce of their gradients every step and their optimizer state on every rank.
DeepSpeed's default (100 000) exists because DeepSpeed gathers per parameter, which this engine does not.
"""


def tiny_overrides() -> dict[str, Any]:
    """``LlamaConfig`` overrides for a tiny variant (smoke tests, 2 CPU cores): vocab 512, hidden 64, 2 blocks.

    A new dict on every call; pass it as ``benchmark_llama(**tiny_overrides())``.
    """
    return {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }


def overrides_100m() -> dict[str, Any]:
    """``LlamaConfig`` overrides for the ~100 M-parameter point: exactly 100,092,672 parameters (382 MiB fp32).

    Vocab 16000, hidden 768, intermediate 2048, 12 blocks, 12 query heads sharing 4 KV heads (head_dim 64), untied
    embeddings: 2 × 16000 × 768 = 24,576,000 in ``embed_tokens`` + ``lm_head``, 6,292,992 per block (attention
    1,572,864, MLP 4,718,592, two norms 1,536), 768 in the final norm. (Vocab 32000 would give 124,668,672.)
    A new dict on every call.
    """
    return {
        "vocab_size": 16000,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
    }


MODEL_CHOICES: tuple[str, ...] = ("bench", "tiny", "100m")
"""Names accepted by :func:`model_overrides` (and the benchmarks' ``--model``)."""


def model_overrides(name: str) -> dict[str, Any]:
    """The ``LlamaConfig`` overrides of the variant ``name`` (one of :data:`MODEL_CHOICES`; ``"bench"``: none)."""
    if name == "bench":
        return {}
    if name == "tiny":
        return tiny_overrides()
    if name == "100m":
        return overrides_100m()
    raise ValueError(f"model must be one of {MODEL_CHOICES}, got {name!r}")


def prefetch_bucket_for(name: str) -> int:
    """``stage3_prefetch_bucket_size`` for the variant ``name``: two of its blocks (elements), as for ``"bench"``.

    ``"bench"`` and ``"tiny"``: :data:`PREFETCH_BUCKET_ELEMS`; ``"100m"``: 12,600,000 (2 × 6.29 M per block).
    """
    model_overrides(name)  # validates the name
    return 12_600_000 if name == "100m" else PREFETCH_BUCKET_ELEMS


def reduce_bucket_for(name: str) -> int | None:
    """``reduce_bucket_size`` for the variant ``name``: the prefetch bucket (two blocks) for ``"100m"``, so gradient
    reduction overlaps the backward (DeepSpeed's default 5e8 would hold the whole model in one bucket); ``None``
    (DeepSpeed's default) for the small models, whose whole gradient is one bucket either way."""
    return prefetch_bucket_for(name) if name == "100m" else None


def benchmark_llama(seed: int = 0, **overrides: Any) -> transformers.LlamaForCausalLM:
    """The benchmark Llama in fp32 train mode; bit-identical weights for the same ``seed`` and ``overrides``.

    ``overrides`` go to ``transformers.LlamaConfig`` (e.g. :func:`tiny_overrides`). Initialisation runs under a
    forked RNG seeded with ``seed``, so the caller's global torch RNG is left untouched.
    """
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 2 * SEQ_LEN,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "use_cache": False,
    }
    kwargs.update(overrides)
    kwargs.setdefault("attn_implementation", "eager")
    config = transformers.LlamaConfig(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
    model.to(torch.float32)
    model.train()
    return model


def benchmark_config(
    world_size: int,
    *,
    dtype: str = "fp32",
    steps: int | None = None,
    lr: float = 1e-3,
    micro_batch: int = MICRO_BATCH,
    clipping: float = 1.0,
    prefetch_bucket_size: int = PREFETCH_BUCKET_ELEMS,
    persistence_threshold: int = PERSISTENCE_THRESHOLD,
    reduce_bucket_size: int | None = None,
) -> dict[str, Any]:
    """The DeepSpeed JSON config of the benchmark: ZeRO-3, AdamW, clipping, prefetch on, no accumulation.

    ``dtype`` is ``"fp32"`` or ``"bf16"`` (bf16 compute, fp32 master weights). With ``steps`` a ``WarmupDecayLR``
    schedule is added (linear warm-up from ``lr / 10`` over ``max(2, steps // 10)`` steps, then linear decay
    towards 0 at ``steps``); without it the learning rate is constant.
    """
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world_size,
        "gradient_clipping": clipping,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": persistence_threshold,
            "stage3_prefetch_bucket_size": prefetch_bucket_size,
            "overlap_comm": True,
            **({"reduce_bucket_size": reduce_bucket_size} if reduce_bucket_size is not None else {}),
        },
        "bf16": {"enabled": dtype == "bf16"},
    }
    if steps is not None:
        warmup = max(2, steps // 10)
        config["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": lr / 10,
                "warmup_max_lr": lr,
                "warmup_num_steps": warmup,
                "total_num_steps": max(steps, warmup + 1),
                "warmup_type": "linear",
            },
        }
    return config


def synthetic_batches(
    seed: int = 0,
    *,
    steps: int,
    world_size: int,
    micro_batch: int = MICRO_BATCH,
    seq_len: int = SEQ_LEN,
    vocab_size: int = VOCAB,
    pool_size: int = 16,
) -> torch.Tensor:
    """Token ids ``[steps, world_size, micro_batch, seq_len]`` (int64); rank ``r`` trains step ``s`` on ``[s, r]``.

    ``pool_size`` sequences of uniform random tokens are drawn once from a private generator seeded with ``seed``
    and then cycled in order over (step, rank, row), so every sequence recurs every
    ``pool_size / (world_size * micro_batch)`` steps. Loss starts near ``log(vocab_size)`` (≈ 9.01 for 8192) and
    drops as the model memorises the pool (see the module docstring). Depends only on the arguments.
    """
    if min(steps, world_size, micro_batch, seq_len, vocab_size, pool_size) < 1:
        raise ValueError("steps, world_size, micro_batch, seq_len, vocab_size and pool_size must all be >= 1")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    pool = torch.randint(0, vocab_size, (pool_size, seq_len), generator=generator, dtype=torch.int64)
    index = torch.arange(steps * world_size * micro_batch) % pool_size
    return pool[index].view(steps, world_size, micro_batch, seq_len)


@dataclass(frozen=True)
class StepMetrics:
    """What one training step measured on this rank.

    ``*_bytes`` are whole-buffer bytes, ``*_wire_bytes`` what this rank sent on a ring (see
    :mod:`hybridzero.comm.ledger`).
    """

    loss: float
    lr: float
    grad_norm: float
    step_ms: float
    all_gather_bytes: int
    all_gather_calls: int
    reduce_scatter_bytes: int
    reduce_scatter_calls: int
    all_reduce_bytes: int
    all_reduce_calls: int
    all_gather_wire_bytes: int
    reduce_scatter_wire_bytes: int

    def as_dict(self) -> dict[str, float | int]:
        """A JSON-friendly copy."""
        return dict(self.__dict__)


def measured_step(engine: Any, input_ids: torch.Tensor) -> StepMetrics:
    """Forward, backward and step of ``engine`` on ``input_ids`` (labels = inputs), timed, with this step's ledger.

    The ledger is reset before the step, so its totals afterwards are exactly this step's collectives. The time
    covers forward + backward + optimizer step (the ``loss.item()`` sync is outside it).
    """
    ledger = engine.comm_ledger()
    ledger.reset()
    lrs = engine.get_lr()  # the learning rate this step's update uses
    start = time.perf_counter()
    loss = engine(input_ids=input_ids, labels=input_ids).loss
    engine.backward(loss)
    engine.step()
    step_ms = (time.perf_counter() - start) * 1e3
    gather, scatter, reduce = (ledger.total(c) for c in ("all_gather", "reduce_scatter", "all_reduce"))
    return StepMetrics(
        loss=float(loss.detach().float().item()),
        lr=lrs[0] if lrs else float("nan"),
        grad_norm=float(getattr(engine, "last_grad_norm", float("nan"))),
        step_ms=step_ms,
        all_gather_bytes=gather.bytes,
        all_gather_calls=gather.calls,
        reduce_scatter_bytes=scatter.bytes,
        reduce_scatter_calls=scatter.calls,
        all_reduce_bytes=reduce.bytes,
        all_reduce_calls=reduce.calls,
        all_gather_wire_bytes=gather.wire_bytes,
        reduce_scatter_wire_bytes=scatter.wire_bytes,
    )

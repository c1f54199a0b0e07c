"""Step-3 (RLHF) report in the style of DeepSpeed-Chat: throughput as pure functions, and the :class:`Reporter`
that logs one iteration (``metrics.jsonl``, TensorBoard tags ``ppo/<key>`` / ``grpo/<key>``) and prints the report
every ``print_every`` iterations. The reporter is fed plain values (model shapes, a timing template, the
iteration's metrics); it never reads back into the trainer.

Mirrors what DeepSpeed-Chat's ``print_throughput_step3`` reports (end-to-end, generation and training latency,
samples/s, Megatron-style TFLOPs, generation bandwidth), with two counting mistakes of the original fixed; see
:func:`step3_throughput`. Nothing here touches torch, the process group or the clock: the trainer measures the
times and passes plain numbers in.

Units, once for the whole module:

* latencies are the wall time measured by the calling rank (rank 0) for this step;
* ``samples_per_s`` / ``time_per_seq_s`` count generated sequences of **all ranks** (the global batch);
* TFLOPs are **per GPU**: the FLOPs of the global batch divided by ``world_size`` and by the latency;
* generation bandwidth is **per rank**: every decode step reads the whole actor once (ZeRO-3 gathers it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridzero.rlhf.runlog.metrics import RunLog

if TYPE_CHECKING:
    import torch

_TERA = 1e12
_GIGA = 1e9


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs / bandwidth formulas need to know about one model.

    Invariants: all four fields are positive; ``num_params`` counts the full (unpartitioned) model.
    """

    num_layers: int
    hidden_size: int
    vocab_size: int
    num_params: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "vocab_size", "num_params"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelShape.{name} must be positive, got {getattr(self, name)!r}")


def _first_attr(config: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_shape(hf_config: object, num_params: int) -> ModelShape:
    """Read layers / hidden size / vocab size from a HF config (GPT-2 style ``n_layer``/``n_embd`` too).

    ``num_params`` must be the full parameter count (under ZeRO-3 sum ``ds_numel``-like full sizes, not the
    local shards). Raises ``ValueError`` when the config lacks one of the three numbers.
    """
    layers = _first_attr(hf_config, ("num_hidden_layers", "n_layer", "num_layers"))
    hidden = _first_attr(hf_config, ("hidden_size", "n_embd", "d_model"))
    vocab = _first_attr(hf_config, ("vocab_size",))
    if layers is None or hidden is None or vocab is None:
        raise ValueError(
            f"cannot read num_layers/hidden_size/vocab_size from {type(hf_config).__name__} "
            f"(got {layers}, {hidden}, {vocab})"
        )
    return ModelShape(num_layers=layers, hidden_size=hidden, vocab_size=vocab, num_params=int(num_params))


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (bf16 -> 2, fp16 -> 2, fp32 -> 4): what ``Step3Timing.dtype_bytes`` wants."""
    return int(dtype.itemsize)


def checkpoint_factor(gradient_checkpointing: bool, lora_dim: int = 0, hidden_size: int = 1) -> float:
    """Forward-pass multiples per training step: 3 (fwd + 2x bwd), 4 with activation recomputation.

    With LoRA of rank ``lora_dim`` the weight-gradient half of the backward mostly disappears; DeepSpeed-Chat
    subtracts ``1 - 2 * lora_dim / hidden_size`` and so do we.
    """
    factor = 4.0 if gradient_checkpointing else 3.0
    if lora_dim > 0:
        factor -= 1.0 - 2.0 * lora_dim / hidden_size
    return factor


def megatron_flops(shape: ModelShape, batch_size: int, seq_len: int, factor: float) -> float:
    """Megatron-LM's FLOPs of ``factor`` forward passes over ``batch_size`` sequences of ``seq_len`` tokens.

    ``24 * B * s * l * h^2`` is one forward of the dense matmuls (QKV, attention output, 4h MLP), a
    multiply-add counted as 2 FLOPs; the ``s / (6 h)`` term adds ``Q K^T`` and ``A V`` (``s * h``
    multiply-adds each, per token and layer: ``4 * s * h`` FLOPs, i.e. ``2 * s * h`` per product); the
    ``V / (16 l h)`` term adds the LM head. That last term is Megatron's for factor 4, where the LM head
    runs 3 times rather than 4 (it is not recomputed); at factor 3 or 1 it undercounts the LM head by a
    quarter. Kept exactly as DeepSpeed-Chat has it so the numbers stay comparable.
    """
    b, s = float(batch_size), float(seq_len)
    layers, h, vocab = float(shape.num_layers), float(shape.hidden_size), float(shape.vocab_size)
    return 24.0 * factor * b * s * layers * h * h * (1.0 + s / (6.0 * h) + vocab / (16.0 * layers * h))


@dataclass(frozen=True)
class Step3Timing:
    """The measured numbers of one PPO/GRPO step (one experience batch and its training), as seen by one rank.

    * ``e2e_s``: wall time of the whole step (generation, scoring, training).
    * ``generation_s``: wall time of all ``actor.generate`` calls of this step.
    * ``training_s``: wall time of the update(s) of this step (all PPO epochs).
    * ``batch_size``: generated sequences (experience samples) **per rank** this step.
    * ``prompt_len`` / ``answer_len``: padded prompt width and maximum answer length (tokens).
    * ``world_size``: ranks (each held ``batch_size`` sequences; with sequence parallelism the ``s`` ranks of a
      group hold the same ones, each having generated ``1 / s`` of them, so distinct sequences are
      ``batch_size * world_size / sequence_parallel``).
    * ``sequence_parallel``: ranks that share each sequence (Ulysses ``s``; 1 without).
    * ``dtype_bytes``: element size of the compute dtype used for generation (:func:`element_size`).
    * ``unsup_batch_size``: unsupervised (ptx) sequences per rank the actor also trained on this step.
    * ``generation_batches``: ``generate`` calls that produced ``batch_size`` (per-token latency is per call).
    * ``ppo_epochs``: passes of the update over the step's experience (and ptx batch).

    Invariants: times are finite and >= 0; counts are >= 0; ``world_size``, ``generation_batches``,
    ``ppo_epochs``, ``dtype_bytes`` and ``prompt_len + answer_len`` are positive.
    """

    e2e_s: float
    generation_s: float
    training_s: float
    batch_size: int
    prompt_len: int
    answer_len: int
    world_size: int
    gradient_checkpointing: bool
    dtype_bytes: int
    unsup_batch_size: int = 0
    generation_batches: int = 1
    ppo_epochs: int = 1
    sequence_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("e2e_s", "generation_s", "training_s"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"Step3Timing.{name} must be finite and >= 0, got {value!r}")
        for name in ("batch_size", "prompt_len", "answer_len", "unsup_batch_size"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"Step3Timing.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("world_size", "dtype_bytes", "generation_batches", "ppo_epochs", "sequence_parallel"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"Step3Timing.{name} must be positive, got {getattr(self, name)!r}")
        if self.prompt_len + self.answer_len <= 0:
            raise ValueError("Step3Timing: prompt_len + answer_len must be positive")


def _ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, NaN when the denominator is 0 (an unmeasured phase)."""
    return numerator / denominator if denominator > 0 else math.nan


def step3_throughput(actor: ModelShape, critic: ModelShape | None, t: Step3Timing) -> dict[str, float]:
    """DeepSpeed-Chat's step-3 numbers for one step; ``critic=None`` for critic-free algorithms (GRPO).

    Returned keys (units in the module docstring): ``e2e_latency_s``, ``e2e_tflops``, ``samples_per_s``,
    ``time_per_seq_s``, ``gen_latency_s``, ``gen_per_token_latency_ms``, ``gen_tflops``,
    ``gen_bandwidth_gb_s``, ``train_latency_s``, ``train_tflops``, plus ``global_batch_size``,
    ``total_seq_len``, ``answer_seq_len``, ``actor_params_b``, ``critic_params_b`` (NaN without critic)
    for the report lines. A ratio whose time is 0 is NaN.

    Fixed with respect to DeepSpeed-Chat (``dschat/utils/perf.py``):

    (a) **Samples/s with the unsupervised (ptx) mix.** DS-Chat writes ``batch_size = per_device_bs *
        generation_batches * ppo_epochs * world * 1 if unsupervised_dataset_name is None else 2``. Python
        parses that as ``(... * 1) if ... else 2``, so with ptx on the "batch size" becomes the constant 2:
        Samples/sec is ``2 / e2e``, Time/seq is ``e2e / 2`` and the training FLOPs are those of 2 sequences.
        Even the evidently intended ``* (1 if ... else 2)`` would count each ptx sequence as a generated
        experience sample. Here samples are generated experience sequences only, so samples/s does not
        change when ptx is switched on; the ptx sequences are counted where they cost work: in the actor's
        training FLOPs (forward + backward, same sequence length).
    (b) **Generation bandwidth in bf16.** DS-Chat picks bytes/param from the checkpoint's
        ``config.torch_dtype``: 2 only for float16, 4 for float32, and for anything else (bf16 included)
        a non-size (``-1`` printed as the bandwidth in the current file, ``1`` byte in older ones); a bf16
        run thus never gets the 2 bytes it really streams. Here ``dtype_bytes`` is the element size of the
        dtype generation actually computes in, so bf16 bandwidth is half the fp32 one.

    Also different, by construction rather than as a fix: DS-Chat multiplies samples by ``ppo_epochs``
    (sample passes); here ``ppo_epochs`` multiplies the training FLOPs only, so with one PPO epoch (the
    default) samples/s equals DS-Chat's. As in DS-Chat, reference / reward / critic inference forwards
    during experience making are not counted as FLOPs (their time is inside ``e2e_s``).
    """
    seq_len = t.prompt_len + t.answer_len
    data_world = max(t.world_size // t.sequence_parallel, 1)  # distinct sequences: one copy per SP group
    global_batch = t.batch_size * data_world
    trained = global_batch * t.ppo_epochs
    ptx_trained = t.unsup_batch_size * data_world * t.ppo_epochs
    factor = checkpoint_factor(t.gradient_checkpointing)

    actor_train = megatron_flops(actor, trained + ptx_trained, seq_len, factor)
    critic_train = megatron_flops(critic, trained, seq_len, factor) if critic is not None else 0.0
    train_flops = actor_train + critic_train
    gen_flops = megatron_flops(actor, global_batch, seq_len, 1.0)  # forward only, every generated sequence

    per_token_s = _ratio(t.generation_s, t.generation_batches * t.answer_len)
    bandwidth = _ratio(actor.num_params * t.dtype_bytes, per_token_s * _GIGA) if per_token_s > 0 else math.nan
    gpus = float(t.world_size)
    return {
        "e2e_latency_s": t.e2e_s,
        "e2e_tflops": _ratio(train_flops + gen_flops, t.e2e_s * gpus * _TERA),
        "samples_per_s": _ratio(global_batch, t.e2e_s),
        "time_per_seq_s": _ratio(t.e2e_s, global_batch),
        "gen_latency_s": t.generation_s,
        "gen_per_token_latency_ms": per_token_s * 1e3,
        "gen_tflops": _ratio(gen_flops, t.generation_s * gpus * _TERA),
        "gen_bandwidth_gb_s": bandwidth,
        "train_latency_s": t.training_s,
        "train_tflops": _ratio(train_flops, t.training_s * gpus * _TERA),
        "global_batch_size": float(global_batch),
        "total_seq_len": float(seq_len),
        "answer_seq_len": float(t.answer_len),
        "actor_params_b": actor.num_params / _GIGA,
        "critic_params_b": critic.num_params / _GIGA if critic is not None else math.nan,
    }


# (metrics key, label) in display order for the metrics line of :func:`format_step3_lines`.
_METRIC_LABELS: tuple[tuple[str, str], ...] = (
    ("reward", "Average reward score"),
    ("actor_loss", "actor loss"),
    ("critic_loss", "critic loss"),
    ("kl", "KL"),
    ("ptx_loss", "ptx loss"),
    ("rule_score", "rule score"),
    ("ema_reward", "EMA reward score"),
)


def _count(thr: Mapping[str, float], key: str) -> str:
    value = thr.get(key, math.nan)
    return str(int(value)) if math.isfinite(value) else "NA"


def _billions(value: float) -> str:
    """Parameters given in billions, shown in B (or M below 0.1 B, so tiny models do not read 0.000 B)."""
    if not math.isfinite(value) or value == 0:
        return "NA"
    return f"{value:.3f} B" if value >= 0.1 else f"{value * 1e3:.3f} M"


def format_step3_lines(step: int, total: int, thr: Mapping[str, float], metrics: Mapping[str, float]) -> list[str]:
    """DeepSpeed-Chat-like report lines for step ``step`` of ``total`` (``thr`` from :func:`step3_throughput`).

    Units follow the module docstring: Samples/sec, Time/seq and Batch Size are global (all ranks); TFLOPs are
    per GPU; latencies and BW are the reporting rank's. The metrics line shows, in a fixed order, whichever of
    ``reward``, ``actor_loss``, ``critic_loss``, ``kl``, ``ptx_loss``, ``rule_score``, ``ema_reward`` are in
    ``metrics``; it is omitted when none is.
    """
    end_to_end = (
        f"End-to-End => Latency: {thr['e2e_latency_s']:.2f}s, TFLOPs: {thr['e2e_tflops']:.2f}, "
        f"Samples/sec: {thr['samples_per_s']:.2f}, Time/seq {thr['time_per_seq_s']:.2f}s, "
        f"Batch Size: {_count(thr, 'global_batch_size')}, Total Seq. Length: {_count(thr, 'total_seq_len')}"
    )
    generation = (
        f"Generation => Latency: {thr['gen_latency_s']:.2f}s, "
        f"Per-token Latency {thr['gen_per_token_latency_ms']:.2f} ms, TFLOPs: {thr['gen_tflops']:.2f}, "
        f"BW: {thr['gen_bandwidth_gb_s']:.2f} GB/sec, Answer Seq. Length: {_count(thr, 'answer_seq_len')}"
    )
    training = f"Training   => Latency: {thr['train_latency_s']:.2f}s, TFLOPs: {thr['train_tflops']:.2f}"
    params = (
        f"Actor Model Parameters => {_billions(thr.get('actor_params_b', math.nan))}, "
        f"Critic Model Parameters => {_billions(thr.get('critic_params_b', math.nan))}"
    )
    lines = [f"Step: {step}/{total}", end_to_end, generation, training, params]
    shown = [f"{label}: {float(metrics[key]):.4f}" for key, label in _METRIC_LABELS if key in metrics]
    if shown:
        lines.append(" | ".join(shown))
    return lines


class Reporter:
    """Logs every iteration and prints DeepSpeed-Chat's report lines every ``print_every`` iterations (and the last).

    ``timing`` is the run's constant :class:`Step3Timing` (batch sizes, lengths, world, dtype) with zero times; each
    iteration's measured times replace them. Timings are the reporting rank's; metrics are global means.
    """

    def __init__(
        self,
        log: RunLog,
        phase: str,
        actor: ModelShape,
        critic: ModelShape | None,
        timing: Step3Timing,
        print_every: int,
    ) -> None:
        self.log, self.phase, self.actor, self.critic = log, phase, actor, critic
        self.timing, self.print_every = timing, print_every

    def step(self, step: int, total: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """Log iteration ``step`` (1-based) with its throughput numbers; returns everything logged."""
        timing = dataclasses.replace(
            self.timing, e2e_s=metrics["e2e_s"], generation_s=metrics["generation_s"], training_s=metrics["training_s"]
        )
        thr = step3_throughput(self.actor, self.critic, timing)
        numbers = {**metrics, **{k: v for k, v in thr.items() if k not in metrics}}
        self.log.log(step, numbers, phase=self.phase)
        if step % self.print_every == 0 or step == total:
            for line in format_step3_lines(step, total, thr, metrics):
                self.log.print(line)
        return numbers

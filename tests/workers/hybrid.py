"""Per-rank checks of the hybrid engine (module-level functions for the worker pool)."""

from __future__ import annotations

from typing import Any

import torch

from tests.harness.parity import RunSpec, batches_for, build_model, ds_config


def scalar_llama(seed: int = 0) -> torch.nn.Module:
    """The tiny Llama with one extra parameter of a single element (smaller than any world size > 1): a learnable
    logit scale, so generation also covers a parameter whose shard is mostly padding."""
    from transformers import LlamaForCausalLM

    from tests.harness.models import tiny_llama

    class ScalarLlama(LlamaForCausalLM):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.logit_scale = torch.nn.Parameter(torch.tensor(1.25))

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * self.logit_scale
            return out

    base = tiny_llama(seed=seed)
    model = ScalarLlama(base.config)
    model.load_state_dict(base.state_dict(), strict=False)
    return model.eval()


def _model(name: str) -> torch.nn.Module:
    return scalar_llama() if name == "llama_scalar" else build_model(RunSpec(model=name))


class _Boom:
    """A logits processor that raises at a given decode step."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError(f"boom at decode step {self.at}")
        return scores


def _prompts(rank: int, vocab: int) -> torch.Tensor:
    """Rank-dependent batch size (2 on rank 2, else 1) and prompt length (3 + rank)."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randint(3, vocab, (2 if rank == 2 else 1, 3 + rank), generator=gen)


def hybrid_checks(model_name: str) -> dict[str, Any]:
    """Greedy tokens vs the unsharded model (with rank-dependent shapes and an early EOS on odd ranks), logits in
    generation mode vs the ZeRO-3 forward, zero collectives while decoding, memory restored, exception safety."""
    from transformers import LogitsProcessorList

    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    spec = RunSpec(prefetch_bucket_size=10**9)
    ref = _model(model_name).eval()
    engine, *_ = hybridzero.initialize(model=_model(model_name), config=ds_config(spec, world))
    vocab = int(ref.config.vocab_size)
    ids = _prompts(rank, vocab)
    gen_kw: dict[str, Any] = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        first = ref.generate(ids, **gen_kw)[0, ids.shape[1]].item()
        if rank % 2 == 1:
            gen_kw["eos_token_id"] = first  # this rank stops after one token; the others keep decoding
        want = ref.generate(ids, **gen_kw)
        mem0 = engine.memory_report()
        with engine.generation_mode() as mode:
            mark = engine.comm_ledger().copy()
            got = engine.module.generate(ids, synced_gpus=False, **gen_kw)
            decode_calls = engine.comm_ledger().since(mark).total().calls
            gen_logits = engine.module(input_ids=ids).logits
        mem1 = engine.memory_report()
        zero3_logits = engine(input_ids=ids).logits
        ref_logits = ref(input_ids=ids).logits
        api = engine.generate(ids, **gen_kw)
        try:
            engine.generate(
                ids,
                logits_processor=LogitsProcessorList([_Boom(3)]),
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
                pad_token_id=0,
            )
            raised = ""
        except RuntimeError as exc:
            raised = str(exc)
        try:
            engine.generate(ids, max_new_tokens=engine.config.hybrid_engine.max_out_tokens)
            too_long = ""
        except ValueError as exc:
            too_long = str(exc)
        try:  # bucketed mode runs under the failure guard: a too-long request must stay an ordinary error
            engine.generate(ids, max_new_tokens=engine.config.hybrid_engine.max_out_tokens, max_gathered_bytes=1)
            too_long_bucketed = ""
        except ValueError as exc:
            too_long_bucketed = str(exc)
        after = engine(input_ids=ids).logits  # the group is alive: this forward's gathers complete on every rank
    engine.assert_quiescent()
    return {
        "mode": mode,
        "tokens_equal": torch.equal(got, want) and torch.equal(api, want),
        "early_stop": got.shape[1] < ids.shape[1] + 6,
        "decode_collectives": decode_calls,
        "logits_gen_vs_zero3": float((gen_logits - zero3_logits).abs().max()),
        "logits_gen_vs_ref": float((gen_logits - ref_logits).abs().max()),
        "memory_restored": mem0 == mem1 == engine.memory_report(),
        "raised": raised,
        "too_long": too_long,
        "too_long_bucketed": too_long_bucketed,
        "alive_after": torch.equal(after, zero3_logits),
    }


def train_generate_cycles(spec: RunSpec, generate: bool, budget: int | None = None) -> dict[str, Any]:
    """Five cycles of train step → (generate) → train step; parameters and memory reports per cycle."""
    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = build_model(spec)
    engine, *_ = hybridzero.initialize(model=model, config=ds_config(spec, world))
    batches = batches_for(spec, world, int(model.config.vocab_size))
    reports, modes, gathers, gathered = [], [], [], []
    for cycle in range(spec.steps):
        for half in range(2):
            ids = batches[cycle, half % spec.accumulation, rank]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            if half == 0 and generate:
                before = engine.memory_report()
                mark = engine.comm_ledger().copy()
                with torch.no_grad(), engine.generation_mode(budget) as mode:
                    engine.module.generate(
                        ids[:, :4],
                        max_new_tokens=4,
                        min_new_tokens=4,
                        do_sample=False,
                        pad_token_id=0,
                        synced_gpus=mode == "bucketed",
                    )
                window = engine.comm_ledger().since(mark).total("all_gather")
                gathers.append(window.calls)
                gathered.append(window.bytes)
                modes.append(mode)
                reports.append(before == engine.memory_report())
    engine.assert_quiescent()
    params = engine.full_parameters()
    zero3 = [g for g in engine.groups if not g.always_full]
    return {
        "params": params if rank == 0 else None,
        "reports": reports,
        "modes": modes,
        "gathers": gathers,
        "gathered_bytes": gathered,
        "groups": len(zero3),
        "model_bytes": sum(g.numel * g.compute_dtype.itemsize for g in zero3),
    }

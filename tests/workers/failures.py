"""Per-rank functions that fail on purpose, for the failure-propagation tests (module-level: picklable)."""

from __future__ import annotations

import time
from typing import Any

import torch

from tests.harness.parity import RunSpec, batches_for, build_model, ds_config


def init_with_bad_config_on(bad_rank: int, bad: dict[str, Any]) -> str:
    """``initialize`` where only ``bad_rank`` gets a broken config; returns/raises what this rank saw."""
    import hybridzero

    hybridzero.init_distributed()
    rank = torch.distributed.get_rank()
    cfg = ds_config(RunSpec(), torch.distributed.get_world_size())
    if rank == bad_rank:
        cfg = {**cfg, **bad}
    hybridzero.initialize(model=build_model(RunSpec()), config=cfg)
    return "initialized"


def step_fails_on(bad_rank: int) -> float:
    """Train one step; ``bad_rank`` feeds an out-of-vocabulary token, so its forward raises mid-step."""
    import hybridzero

    hybridzero.init_distributed()
    rank = torch.distributed.get_rank()
    spec = RunSpec(model="llama")
    engine, *_ = hybridzero.initialize(
        model=build_model(spec), config=ds_config(spec, torch.distributed.get_world_size())
    )
    ids = torch.randint(0, 100, (2, 9))
    if rank == bad_rank:
        ids[0, 3] = 10_000
    start = time.monotonic()
    try:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    except Exception as exc:
        exc.add_note(f"after {time.monotonic() - start:.1f}s")
        raise
    return float(loss.detach())


# --- a caught failure on one rank; every rank's next collective ---------------------------------------------------
FAILING_RANK = 1


class _FailInBackward(torch.autograd.Function):
    """Identity whose backward raises: a failure in the middle of ``engine.backward`` on one rank."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected failure in backward")


class FlakyAdamW(torch.optim.AdamW):
    """AdamW whose ``step`` raises while ``fail_next`` is set (the test sets it on one rank's engine optimizer)."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if getattr(self, "fail_next", False):
            raise RuntimeError("injected failure in optimizer step")
        return super().step(closure)


def _outcome(fn: Any) -> str:
    """``"ok"`` or ``"<ExceptionType>: <message>"``."""
    try:
        fn()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank saw
        return f"{type(exc).__name__}: {exc}"


def _train_step(engine: Any, ids: torch.Tensor, fail: str = "") -> None:
    """One train step; ``fail`` injects a failure in "forward" (engine call), "module_forward" (the module called
    directly, no engine guard), "backward" or "step"."""
    bad = ids.clone()
    bad[0, 3] = 10_000  # out of vocabulary: the embedding raises IndexError
    if fail == "module_forward":
        engine.module(input_ids=bad, labels=bad)
    loss = engine(input_ids=bad if fail == "forward" else ids, labels=ids).loss
    engine.backward(_FailInBackward.apply(loss) if fail == "backward" else loss)
    engine.optimizer.optimizer.fail_next = fail == "step"  # the torch optimizer behind the facade
    engine.step()


def _wait_for_posted_failure(engine: Any) -> None:
    """Until the failing rank's failure is posted; a staging that never sees it fails instead of timing out quietly
    (a new collective before the failure point would make the failing rank wait for this one)."""
    deadline = time.monotonic() + 60
    while engine.comm.peer_failure() is None:
        if time.monotonic() > deadline:
            raise AssertionError("the failing rank's failure was not posted within 60 s: the staging is wrong")
        time.sleep(0.01)


def _peer_calls(engine: Any, batches: torch.Tensor, rank: int, where: str, timing: str) -> list[Any]:
    """The peer's engine calls from step 1 on. "fast": step 1 up to the failing rank's failure point, then a wait
    until that failure is posted, so every later collective starts after it; "slow": no staging (the failing rank
    waits first, so this rank is already blocked in a collective when the failure happens)."""
    later = [lambda: _train_step(engine, batches[2, 0, rank]), lambda: _train_step(engine, batches[3, 0, rank])]
    ids = batches[1, 0, rank]
    if timing == "slow":
        return [lambda: _train_step(engine, ids), *later]
    loss = engine(input_ids=ids, labels=ids).loss
    if where == "step":  # the failure point is inside step, after its gradient-norm all-reduce, which the peer
        engine.backward(loss)  # joins; its collectives after that one start once the failure is posted
        return [engine.step, lambda: _wait_for_posted_failure(engine), *later]
    _wait_for_posted_failure(engine)
    return [lambda: engine.backward(loss), engine.step, *later]


def caught_failure_then_continue(where: str, timing: str) -> dict[str, Any]:
    """Both ranks train one step; then ``FAILING_RANK`` fails in step 1's ``where`` and catches it, and every rank
    makes its next engine calls (to the end of step 3). Returns what each rank saw and, on the peer, the seconds from
    its next calls' start to their error (well under the process group's timeout: not a timeout)."""
    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    spec = RunSpec(model="llama", optimizer="client", steps=4)
    model = build_model(spec)
    engine, *_ = hybridzero.initialize(
        model=model, config=ds_config(spec, world), optimizer=FlakyAdamW(model.parameters(), lr=spec.lr)
    )
    batches = batches_for(spec, world, int(model.config.vocab_size))
    _train_step(engine, batches[0, 0, rank])
    seen: dict[str, Any] = {"caught": ""}
    if rank == FAILING_RANK:
        if timing == "slow":
            time.sleep(0.5)  # staging only: let the peer block in its collective first
        seen["caught"] = _outcome(lambda: _train_step(engine, batches[1, 0, rank], fail=where))
        calls = [lambda: _train_step(engine, batches[2, 0, rank]), lambda: _train_step(engine, batches[3, 0, rank])]
    else:
        calls = _peer_calls(engine, batches, rank, where, timing)
    start = time.monotonic()
    seen["next"] = _outcome(lambda: [call() for call in calls])
    seen["seconds"] = time.monotonic() - start
    seen["pg"] = torch.distributed.is_initialized()
    return seen


# --- a failure inside ZeRO-3 generation --------------------------------------------------------------------------
class RaiseAt:
    """A logits processor / forward pre-hook that raises at its ``at``-th call."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, first: Any, second: Any) -> Any:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError(f"injected failure at call {self.at}")
        return second if isinstance(second, torch.Tensor) else None


def generate_fails_on_one_rank(kind: str) -> dict[str, Any]:
    """ZeRO-3 generation at world 2 where ``FAILING_RANK`` raises and catches it: ``kind`` "bucketed" is
    ``engine.generate`` on the per-forward path (a logits processor raises at decode step 2), "tp" the same in
    tensor-parallel generation (``inference_tp_size`` = world); "module" is
    ``engine.module.generate`` under the hooks (block 0's forward raises at its 3rd call). Returns each rank's
    outcome, its next engine call's outcome, and whether the rank marked itself failed."""
    from transformers import LogitsProcessorList

    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    spec = RunSpec(model="opt")
    model = build_model(spec)
    config = ds_config(spec, world)
    if kind == "tp":  # tensor-parallel generation: the peer waits in the group's per-step all-gather of scores
        from tests.workers.tp import tp_model

        model, config["hybrid_engine"] = tp_model("opt"), {"inference_tp_size": world}
    engine, *_ = hybridzero.initialize(model=model, config=config)
    ids = batches_for(spec, world, int(model.config.vocab_size))[0, 0, rank][:, :4]
    gen_kw: dict[str, Any] = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    engine.eval()

    def run() -> None:
        with torch.no_grad():
            if kind in ("bucketed", "tp"):
                procs = LogitsProcessorList([RaiseAt(2)] if rank == FAILING_RANK else [])
                budget = 1 if kind == "bucketed" else None
                engine.generate(ids, logits_processor=procs, max_gathered_bytes=budget, **gen_kw)
            else:
                if rank == FAILING_RANK:
                    engine.module.model.decoder.layers[0].register_forward_pre_hook(RaiseAt(3))
                engine.module.generate(ids, **gen_kw)

    start = time.monotonic()
    outcome = _outcome(run)
    seconds = time.monotonic() - start
    return {
        "outcome": outcome,
        "next": _outcome(lambda: engine(input_ids=ids)),
        "seconds": seconds,
        "failed": engine.comm.failures.failed is not None,
    }


# --- non-finite losses in fp32/bf16 ---------------------------------------------------------------------------------
def nonfinite_loss_run(dtype: str, skip: bool, nan_at: int | None, omit: int | None) -> dict[str, Any]:
    """Four steps at ``dtype``; ``FAILING_RANK``'s loss is NaN at step ``nan_at``; step ``omit`` is not run at all.
    ``skip`` sets the engine's ``skip_nonfinite_steps``. Returns master weights (rank 0), counters, applied flags."""
    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    spec = RunSpec(model="llama", steps=4, dtype=dtype)
    model = build_model(spec)
    engine, *_ = hybridzero.initialize(model=model, config=ds_config(spec, world))
    engine.skip_nonfinite_steps = skip
    batches = batches_for(spec, world, int(model.config.vocab_size))
    applied = []
    for s in range(spec.steps):
        if s == omit:
            continue
        ids = batches[s, 0, rank]
        loss = engine(input_ids=ids, labels=ids).loss
        if s == nan_at and rank == FAILING_RANK:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        applied.append(engine.was_step_applied())
        engine.assert_quiescent()
    params = engine.full_parameters()  # a collective: every rank calls it
    return {
        "params": params if rank == 0 else None,
        "applied": applied,
        "skipped": engine.skipped_steps,
        "nonfinite_skipped": engine.nonfinite_skipped_steps,
        "global_steps": engine.global_steps,
    }


# --- a failure inside a GatheredParameters block -------------------------------------------------------------------
def gathered_body_fails_on_one_rank(modifier: bool) -> dict[str, Any]:
    """Every rank enters ``zero.GatheredParameters`` on a block's weight; ``FAILING_RANK``'s body raises and is caught.
    The peer leaves its block normally (with ``modifier`` its exit broadcasts from rank 0; without, it agrees on
    unowned edits with an all-reduce): that collective must raise PeerFailure naming the failing rank, never pair
    with a later collective of the failing rank; the failing rank's next collective is refused."""
    import hybridzero

    hybridzero.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    spec = RunSpec(model="llama", steps=2)
    model = build_model(spec)
    engine, *_ = hybridzero.initialize(model=model, config=ds_config(spec, world))
    batches = batches_for(spec, world, int(model.config.vocab_size))
    _train_step(engine, batches[0, 0, rank])
    target = engine.module.model.layers[0].mlp.up_proj.weight
    seen: dict[str, Any] = {"caught": "", "next": ""}

    def body() -> None:
        with hybridzero.zero.GatheredParameters([target], modifier_rank=0 if modifier else None), torch.no_grad():
            if rank == FAILING_RANK:
                raise ValueError("injected failure inside GatheredParameters")

    if rank == FAILING_RANK:
        seen["caught"] = _outcome(body)
        seen["next"] = _outcome(lambda: _train_step(engine, batches[1, 0, rank]))
    else:
        seen["next"] = _outcome(lambda: (body(), _train_step(engine, batches[1, 0, rank])))
    return seen

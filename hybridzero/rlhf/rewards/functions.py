"""Reward functions for RL with verifiable rewards: loading, calling with a deadline, validating, combining.

**Signature** (TRL's ``GRPOTrainer`` one, so the same function works in both)::

    fn(prompts=list[str], completions=list[str], completion_ids=list[list[int]], **columns) -> list[float | None]

``columns`` are the prompt dataset row's extra columns (every key but ``prompt``), each a list aligned with the
completions (``None`` where a row lacks the key); a function should accept ``**kwargs``. ``None`` means "this function
does not score this sample". Results are combined as TRL does: a weighted sum over the functions that scored the
sample (``nansum``); a sample no source scored is *unscored* (an error or a skipped sample, per the error policy).

**Loading** (:func:`load_reward_function`): ``module:function`` imports an importable module;
``path/to/file.py:function`` runs that file as a fresh module (nothing is registered in
``sys.modules``). Data is never evaluated.

**Isolation and the deadline** (:func:`call_reward_function`; the mechanics in
:mod:`hybridzero.rlhf.rewards.isolation`). With ``timeout > 0`` a call never runs in the trainer's process: a
:class:`~hybridzero.rlhf.rewards.isolation.RewardWorker` (one per
:class:`~hybridzero.rlhf.rewards.sources.RewardSet`, so one per rank) is a child *forked* once that holds the loaded
functions and serves call after call (index and kwargs in, values out, as JSON over pipes); the parent waits at most
``timeout`` seconds and SIGKILLs it after that, and the next call forks a fresh one. Why a process and not a thread:
pure Python can hang forever (an infinite loop, a deadlock, a blocked read) and a thread cannot be stopped — an
abandoned thread would keep burning a core and the next timeout would leak another; a killed child frees
everything. Why fork and not spawn: nothing is pickled (closures and lambdas work, as in TRL) and nothing
re-imported; a crash, ``os._exit``, leaked memory or a mutated global never reaches the trainer. Why a persistent
worker and not a fork per call (what this did before): the fork costs tens of ms in a process holding torch and a
model and is now paid once; a call costs a round trip on the pipes (``bench/bench_reward_calls.py``, a batch of 64
on a loaded 2-core machine: ~0.35 ms in the worker, ~0.17 ms in-process, 24 ms forked per call with a
10M-parameter model held, 47 ms with 100M). State a function keeps across calls (a
cache) therefore persists in the worker — as in-process or in TRL — while staying out of the trainer; the worker
sees the process as it was when forked (globals, ``os.environ``). Without a worker (``worker=None``), or for a
call whose columns are not plain JSON (tuples, bytes, numpy values...), the call runs in a child forked for it
alone (:func:`~hybridzero.rlhf.rewards.isolation.call_forked`; no state kept). A function that touches torch's
threads or CUDA in a forked child may deadlock (then the deadline catches it). ``timeout = 0`` calls the function
in-process (no deadline, no isolation: for debugging and throughput comparisons with trainers that call
in-process, such as TRL).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import signal
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridzero.rlhf.rewards.isolation import RewardCallError, RewardWorker, as_values, call_forked
from hybridzero.rlhf.rewards.values import one_line

__all__ = [
    "RESERVED_KEYWORDS",
    "RewardCallError",
    "RewardError",
    "RewardFunction",
    "RewardSource",
    "RewardWorker",
    "SpecFunction",
    "call_reward_function",
    "check_reward_specs",
    "FunctionScores",
    "combine_rewards",
    "load_reward_function",
    "reward_sources",
    "score_with_functions",
]

RewardFunction = Callable[..., Sequence[float | None]]
RESERVED_KEYWORDS: tuple[str, ...] = ("prompts", "completions", "completion_ids")


class RewardError(ValueError):
    """A reward function failed (raised, hung, died, returned NaN/inf or a wrong length) or a sample was left
    unscored, under ``reward_error_policy = "raise"``; raised on every rank with the same message."""


@dataclass(frozen=True)
class RewardSource:
    """A reward function with its display name (metric ``rewards/<name>``), its spec and its weight."""

    name: str
    spec: str
    fn: RewardFunction
    weight: float


def _import_error(spec: str, where: str, exc: BaseException, path: Path | None) -> ImportError:
    """One line naming the spec, the module or file, the exception and, when known, the line that raised."""
    line = getattr(exc, "lineno", None) if isinstance(exc, SyntaxError) else None
    if line is None and path is not None:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
        line = frames[-1].lineno if frames else None
    at = f" (line {line})" if line else ""
    return ImportError(one_line(f"--reward_funcs {spec!r}: importing {where} raised {type(exc).__name__}{at}: {exc}"))


def load_reward_function(spec: str) -> RewardFunction:
    """The callable named by ``module:function`` or ``path/to/file.py:function`` (``function`` may be dotted:
    ``Class.method``). Raises ``ValueError`` naming the spec and what is wrong, ``FileNotFoundError`` when the file
    is missing, ``ImportError`` (one line, naming the spec and the line) when the module cannot be found or raises
    while it is imported. Runs the module's code in this process: :class:`SpecFunction` defers that to the worker."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"--reward_funcs {spec!r}: expected module:function or path/to/file.py:function")
    path: Path | None = None
    try:
        if where.endswith(".py") or "/" in where or os.sep in where:
            path = Path(where).resolve()
            if not path.is_file():
                raise FileNotFoundError(f"--reward_funcs {spec!r}: no file {where}")
            found = importlib.util.spec_from_file_location(f"hybridzero_reward_{path.stem}", path)
            if found is None or found.loader is None:
                raise ImportError(f"--reward_funcs {spec!r}: cannot load {where} as a Python module")
            module: Any = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except (FileNotFoundError, ImportError) as exc:
        if str(exc).startswith("--reward_funcs"):
            raise
        raise _import_error(spec, where, exc, path) from exc
    except Exception as exc:  # the module's own code raised (SyntaxError, ZeroDivisionError, SystemExit aside)
        raise _import_error(spec, where, exc, path) from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise ValueError(f"--reward_funcs {spec!r}: {where} has no {attr!r}; its callables: {names}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"--reward_funcs {spec!r}: {attr} is a {type(target).__name__}, not a function")
    return target


class SpecFunction:
    """A reward function named by its spec, imported on first use *in the process that calls it* (module
    docstring): with ``reward_timeout > 0`` that is the reward worker (its start-up step, under the deadline), so
    the module's code never runs in the trainer. Its ``__name__`` is the spec's last attribute."""

    def __init__(self, spec: str) -> None:
        where, sep, attr = spec.rpartition(":")
        if not sep or not where or not attr:
            raise ValueError(f"--reward_funcs {spec!r}: expected module:function or path/to/file.py:function")
        self.spec, self.__name__ = spec, attr.rsplit(".", 1)[-1]
        self.__module__ = where
        self.__qualname__ = attr
        self._fn: RewardFunction | None = None

    def load(self) -> RewardFunction:
        """Import the module (once per process) and return the function."""
        if self._fn is None:
            self._fn = load_reward_function(self.spec)
        return self._fn

    def __call__(self, **kwargs: Any) -> Sequence[float | None]:
        return self.load()(**kwargs)


def check_reward_specs(specs: Sequence[str], timeout: float) -> None:
    """Fail early, in one line, on a spec that cannot be loaded: with ``timeout > 0`` each module is imported in a
    contained child under the deadline (a module that hangs or raises at import, or starts processes, never holds
    up or reaches this process); with ``timeout = 0`` in-process. Raises :class:`RewardError` (or the loader's
    ``ValueError``/``ImportError`` in-process)."""
    if not specs:
        return
    if timeout <= 0 or not hasattr(os, "fork"):
        for spec in specs:
            load_reward_function(spec)
        return
    fns = [SpecFunction(spec) for spec in specs]
    probe = RewardWorker(fns, [(f"importing --reward_funcs {f.spec!r}", f.load) for f in fns])
    try:
        probe.start(timeout)
    except RewardCallError as exc:
        raise RewardError(str(exc)) from None
    finally:
        probe.close()


def reward_sources(
    funcs: Sequence[str | RewardFunction], weights: Sequence[float] | None, with_model: bool, lazy: bool = False
) -> tuple[list[RewardSource], float]:
    """The reward functions (specs loaded, or with ``lazy`` wrapped in :class:`SpecFunction` for the worker to
    import; callables as given) with their weights, and the reward model's weight.

    ``weights`` has one entry per function, then one for the reward model when ``with_model``; ``None``: all 1.
    Display names are the functions' ``__name__`` (made unique with ``_2``, ``_3``...)."""
    want = len(funcs) + int(with_model)
    if weights is not None and len(weights) != want:
        raise ValueError(
            f"reward_weights {list(weights)} has {len(weights)} entries; expected {want} "
            f"(one per reward function{', then the reward model' if with_model else ''})"
        )
    ws = [1.0] * want if weights is None else [float(w) for w in weights]
    if not all(math.isfinite(w) for w in ws):
        raise ValueError(f"reward_weights {ws}: every weight must be finite")
    out: list[RewardSource] = []
    seen: dict[str, int] = {}
    for f, w in zip(funcs, ws):
        fn = (SpecFunction(f) if lazy else load_reward_function(f)) if isinstance(f, str) else f
        if not callable(fn):
            raise ValueError(f"reward function {f!r} is not callable")
        base = str(getattr(fn, "__name__", type(fn).__name__))
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}_{seen[base]}"
        spec = f if isinstance(f, str) else f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', base)}"
        out.append(RewardSource(name, spec, fn, w))
    return out, (ws[-1] if with_model else 0.0)


def call_reward_function(
    fn: RewardFunction,
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: Mapping[str, list[Any]],
    *,
    timeout: float,
    worker: RewardWorker | None = None,
    backstop: float = 0.0,
) -> list[float | None]:
    """One call of ``fn`` on a batch; returns ``n`` values (``None`` = not scored). With ``timeout > 0`` it runs in
    ``worker`` (which must hold ``fn``) or, without one, in a child forked for it, under the deadline (module
    docstring); with ``timeout = 0`` in-process, interrupted after ``backstop`` s when that is > 0
    (:func:`_backstop`). Raises :class:`RewardCallError` when it raises, hangs, dies,
    returns a wrong length or type, or NaN/inf (``samples`` then lists the offending indices)."""
    n = len(completions)
    clash = [k for k in columns if k in RESERVED_KEYWORDS]
    if clash:
        raise RewardCallError(f"dataset column(s) {clash} clash with the reward-function arguments {RESERVED_KEYWORDS}")
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    if timeout > 0 and hasattr(os, "fork"):
        index = worker.index_of(fn) if worker is not None else -1  # ValueError: a caller's bug, not the function's
        try:
            if worker is not None:
                values = worker.call(index, kwargs, n, timeout)
            else:
                values = call_forked(fn, kwargs, n, timeout)
        except (OSError, ValueError) as exc:  # fork/pipe/select/JSON trouble of this rank: agreed on as a failed call
            raise RewardCallError(f"could not be called in isolation ({type(exc).__name__}: {exc})") from exc
    else:
        try:
            with _backstop(backstop):
                values = as_values(fn(**kwargs), n)
        except RewardCallError:
            raise
        except Exception as exc:
            raise RewardCallError(one_line(f"raised {type(exc).__name__}: {exc}")) from exc
    bad = [i for i, v in enumerate(values) if v is not None and not math.isfinite(v)]
    if bad:
        raise RewardCallError(f"returned {values[bad[0]]} for {len(bad)} sample(s)", bad)
    return values


class _Interrupted(BaseException):
    """The backstop's alarm (a ``BaseException``: a function's ``except Exception`` cannot swallow it)."""


def _interrupt(signum: int, frame: object) -> None:
    raise _Interrupted


@contextmanager
def _backstop(seconds: float) -> Iterator[None]:
    """In-process calls (``reward_timeout 0``): when ``seconds > 0`` and this is the main thread of a POSIX
    process, a ``SIGALRM`` after ``seconds`` interrupts the call (Python code, ``sleep``, waits on children; not C
    code that never checks for signals) with :class:`RewardCallError`. The previous handler and timer are restored.
    Why: with no deadline of its own, a hang on one rank would otherwise keep its peers waiting until the
    collective timeout, which ends as a transport error naming no function."""
    usable = seconds > 0 and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return
    previous = signal.signal(signal.SIGALRM, _interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _Interrupted:
        raise RewardCallError(
            f"did not return within {seconds:g} s in-process (reward_timeout 0 has no deadline; the run's backstop "
            "is half the collective timeout)"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def combine_rewards(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[S, B]`` per-source rewards (NaN = not scored) and ``[S]`` weights -> ``[B]`` weighted ``nansum``; NaN
    where no source scored the sample (TRL's rule)."""
    scored = ~torch.isnan(values)
    total = torch.where(scored, values * weights[:, None], torch.zeros_like(values)).sum(dim=0)
    return torch.where(scored.any(dim=0), total, torch.full_like(total, float("nan")))


@dataclass(frozen=True)
class FunctionScores:
    """One rank's reward-function results for one batch: ``values [F, B]`` float64 (NaN: not scored or failed),
    ``failed [B]`` (a function failed on the sample) and the first failure's message (``None``: none failed)."""

    values: torch.Tensor
    failed: torch.Tensor
    error: str | None


def score_with_functions(
    sources: Sequence[RewardSource],
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: Mapping[str, list[Any]],
    *,
    timeout: float,
    worker: RewardWorker | None = None,
    backstop: float = 0.0,
) -> FunctionScores:
    """Call every function once on the batch (in ``worker``, which holds them all, when given); a failure marks its
    samples (all of them unless it named some) as failed and is described by function, spec, sample index and
    prompt in ``error``."""
    n = len(completions)
    values = torch.full((len(sources), n), float("nan"), dtype=torch.float64)
    failed = torch.zeros(n, dtype=torch.bool)
    error: str | None = None
    for f, src in enumerate(sources):
        try:
            got = call_reward_function(
                src.fn,
                prompts,
                completions,
                completion_ids,
                columns,
                timeout=timeout,
                worker=worker,
                backstop=backstop,
            )
        except RewardCallError as exc:
            samples = exc.samples if exc.samples else list(range(n))
            failed[samples] = True
            if error is None:
                i = samples[0]
                where = f"sample {i} of {n} (prompt {prompts[i][:80]!r})" if exc.samples else f"a batch of {n}"
                error = f"reward function {src.name!r} ({src.spec}) {exc} -- {where}"
            continue
        values[f] = torch.tensor([float("nan") if v is None else v for v in got], dtype=torch.float64)
    return FunctionScores(values, failed, error)

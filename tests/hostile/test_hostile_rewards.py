"""Hostile reward modules and reward functions (issue 28): every case ends in the specific one-line error naming the
spec / function / value, and leaves no process behind (the reward worker contained and killed)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hybridzero.rlhf.rewards.containment import live_pids
from hybridzero.rlhf.rewards.functions import (
    RewardCallError,
    RewardError,
    call_reward_function,
    check_reward_specs,
    load_reward_function,
)
from hybridzero.rlhf.rewards.isolation import RewardWorker
from tests.workers.rlvr_runs import _child_pids

PROMPTS, TEXTS, IDS = ["1 2 =", "3 4 ="], ["2 1", "x"], [[5, 4, 2], [9]]


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """Asserts that the case left no child process of this test process alive."""
    before = _child_pids()
    yield
    assert live_pids(_child_pids() - before) == []


MODULES: dict[str, tuple[str, str]] = {  # file body -> (expected error text, where)
    "syntax": ("def f(:\n", "raised SyntaxError (line 1)"),
    "raise_at_import": ("x = 1\nraise RuntimeError('no gpu here')\n", "raised RuntimeError (line 2): no gpu here"),
    "zero_division": ("1 / 0\n", "raised ZeroDivisionError (line 1)"),
    "missing_function": ("def g(**kw):\n    return []\n", "has no 'f'; its callables: ['g']"),
    "not_callable": ("f = 3\n", "f is a int, not a function"),
    "import_missing": ("import no_such_module_for_hostile_tests\n", "raised ModuleNotFoundError (line 1)"),
    "multi_line_message": ("raise ValueError('first\\nsecond\\nthird')\n", "raised ValueError (line 1): first"),
    "sys_exit": ("import sys\nsys.exit(4)\n", "raised SystemExit: 4"),
    "os_exit": ("import os\nos._exit(5)\n", "the worker died (exit status 5)"),
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_hostile_reward_module_is_one_line_naming_the_spec(tmp_path: Path, name: str, no_leftovers: None) -> None:
    body, expected = MODULES[name]
    path = tmp_path / f"{name}.py"
    path.write_text(body)
    spec = f"{path}:f"
    with pytest.raises(RewardError) as info:
        check_reward_specs([spec], timeout=30.0)
    message = str(info.value)
    assert "\n" not in message and expected in message and repr(spec) in message, message


def test_a_reward_module_that_hangs_at_import_ends_at_the_deadline(tmp_path: Path, no_leftovers: None) -> None:
    path = tmp_path / "hangs.py"
    path.write_text("import subprocess, time\nsubprocess.Popen(['sleep', '1000'])\ntime.sleep(1000)\n")
    with pytest.raises(RewardError, match=r"importing --reward_funcs '.*hangs.py:f' did not finish within "):
        check_reward_specs([f"{path}:f"], timeout=2.0)


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("", ValueError, "expected module:function"),
        (":", ValueError, "expected module:function"),
        ("os.path", ValueError, "expected module:function"),
        ("no_such_mod_xyz:f", ImportError, "importing no_such_mod_xyz raised ModuleNotFoundError"),
        ("os:sep", ValueError, "sep is a str, not a function"),
        ("../../nope_hostile.py:f", FileNotFoundError, "no file ../../nope_hostile.py"),
        ("/etc/passwd:f", ImportError, "cannot load /etc/passwd|raised"),
    ],
)
def test_bad_specs_in_process(spec: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        load_reward_function(spec)
    assert "\n" not in str(info.value)


def _np32(**kw: Any) -> Any:
    return [np.float32(0.5), np.float64(1.5)]


def _array(**kw: Any) -> Any:
    return np.array([0.25, 2.0], dtype=np.float32)


def _tensor(**kw: Any) -> Any:
    return torch.tensor([1.0, 3.0])


def _torch_scalars(**kw: Any) -> Any:
    return [torch.tensor(1.0), np.int64(2)]


def _tuple(**kw: Any) -> Any:
    return (1, None)


@pytest.mark.parametrize(
    ("fn", "want"),
    [
        (_np32, [0.5, 1.5]),
        (_array, [0.25, 2.0]),
        (_tensor, [1.0, 3.0]),
        (_torch_scalars, [1.0, 2.0]),
        (_tuple, [1.0, None]),
    ],
)
@pytest.mark.parametrize("timeout", [0.0, 30.0])
def test_trl_style_numpy_and_torch_values_are_accepted(fn: Any, want: list[Any], timeout: float) -> None:
    worker = RewardWorker([fn]) if timeout else None
    try:
        assert call_reward_function(fn, PROMPTS, TEXTS, IDS, {}, timeout=timeout, worker=worker) == want
    finally:
        if worker is not None:
            worker.close()


def _bad(result: Any) -> Any:
    def fn(**kw: Any) -> Any:
        return result() if callable(result) else result

    return fn


BAD_RESULTS: dict[str, tuple[Any, str]] = {
    "none": (None, "returned a NoneType"),
    "string": ("1.0", "returned a str ('1.0')"),
    "bytes": (b"ab", "returned a bytes"),
    "dict": ({"a": 1.0, "b": 2.0}, "returned a dict"),
    "set": ({1.0, 2.0}, "returned a set"),
    "generator": (lambda: (x for x in [1.0, 2.0]), "returned a generator"),
    "too_short": ([1.0], "returned 1 values for 2 completions"),
    "too_long": ([1.0] * 5, "returned 5 values for 2 completions"),
    "strings": (["1", "2"], "value 0 is a str ('1')"),
    "nested": ([[1.0], [2.0]], "value 0 is a list"),
    "bools": ([True, False], "value 0 is a bool"),
    "numpy_bool": (np.array([True, False]), "value 0 is a bool"),
    "nan": ([float("nan"), 1.0], "returned nan for 1 sample(s)"),
    "inf": ([1.0, float("inf")], "returned inf for 1 sample(s)"),
    "numpy_nan": (np.array([np.nan, 1.0]), "returned nan for 1 sample(s)"),
    "matrix": (np.zeros((2, 2)), "array of shape (2, 2)"),
    "huge_string_value": (["x" * 100000, 1.0], "value 0 is a str ('xxxx"),
    "complex": ([1j, 2.0], "value 0 is a complex"),
}


@pytest.mark.parametrize("name", sorted(BAD_RESULTS))
def test_a_bad_result_is_one_line_naming_the_value(name: str, no_leftovers: None) -> None:
    result, expected = BAD_RESULTS[name]
    fn = _bad(result)
    worker = RewardWorker([fn])
    try:
        for timeout, w in ((0.0, None), (30.0, worker)):
            with pytest.raises(RewardCallError) as info:
                call_reward_function(fn, PROMPTS, TEXTS, IDS, {}, timeout=timeout, worker=w)
            message = str(info.value)
            assert expected in message and "\n" not in message and len(message) < 400, message
    finally:
        worker.close()


def _raises_huge(**kw: Any) -> Any:
    raise RuntimeError("line one\n" + "y" * 100000)


def _wrong_signature(completions: list[str]) -> Any:
    return [1.0] * len(completions)


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (_raises_huge, "raised RuntimeError: line one"),
        (_wrong_signature, "raised TypeError: "),
        (lambda **kw: os.kill(os.getpid(), 9), "died (signal 9) without returning"),
        (lambda **kw: os._exit(7), "died (exit status 7) without returning"),
    ],
)
def test_a_misbehaving_function_is_one_line_naming_what_happened(fn: Any, expected: str, no_leftovers: None) -> None:
    with RewardWorker([fn]) as worker:
        with pytest.raises(RewardCallError) as info:
            call_reward_function(fn, PROMPTS, TEXTS, IDS, {}, timeout=30.0, worker=worker)
    message = str(info.value)
    assert expected in message and "\n" not in message and len(message) < 400, message


def test_an_in_process_hang_is_interrupted_by_the_backstop() -> None:
    """``reward_timeout 0`` calls in-process; a hang there is interrupted after the backstop (half the collective
    timeout in a run) instead of keeping the peers waiting into a transport error."""

    def spins(**kw: Any) -> Any:
        while True:
            pass

    with pytest.raises(RewardCallError, match=r"did not return within 1 s in-process"):
        call_reward_function(spins, PROMPTS, TEXTS, IDS, {}, timeout=0.0, backstop=1.0)

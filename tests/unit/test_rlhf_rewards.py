"""Reward functions (hybridzero.rlhf.rewards.functions) and the GRPO settings that name them: loading by module or
file path, TRL's call signature with the dataset's extra columns, None/NaN/inf/wrong-length/raise/hang handling
(forked per call and in-process: the same answers and messages), combining sources as TRL's nansum, and the
--algorithm presets / TRL aliases. The persistent worker's lifetime (state kept in it, replaced after a kill or a
death, closed, gone with its parent) is in ``test_reward_worker.py``, which shares this file's prompts, completions
and helpers."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridzero.cli import build_parser
from hybridzero.rlhf.cli import settings_from_args
from hybridzero.rlhf.rewards.functions import (
    RewardCallError,
    call_reward_function,
    combine_rewards,
    load_reward_function,
    reward_sources,
    score_with_functions,
)
from hybridzero.rlhf.rewards.isolation import RewardWorker
from hybridzero.rlhf.rewards.sources import RewardSet
from hybridzero.rlhf.settings import GRPOSettings
from tests.workers import rlvr_rewards

PROMPTS = ["1 2 =", "3 4 ="]
TEXTS = ["2 1", "x"]
IDS = [[5, 4, 2], [9]]


def _call(fn: Any, timeout: float, worker: RewardWorker | None = None, **columns: list[Any]) -> list[float | None]:
    return call_reward_function(fn, PROMPTS, TEXTS, IDS, columns, timeout=timeout, worker=worker)


def _counter() -> Callable[..., list[float]]:
    """A closure counting its calls: each call returns the count so far, for every sample."""
    calls = [0]

    def count(completions: list[str], **kw: Any) -> list[float]:
        calls[0] += 1
        return [float(calls[0])] * len(completions)

    return count


def test_load_by_module_and_by_file(tmp_path: Path) -> None:
    assert load_reward_function("tests.workers.rlvr_rewards:digit_share") is rlvr_rewards.digit_share
    path = tmp_path / "my_rewards.py"
    path.write_text("def score(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    fn = load_reward_function(f"{path}:score")
    assert fn(prompts=PROMPTS, completions=TEXTS, completion_ids=IDS) == [3.0, 1.0]
    assert load_reward_function("os.path:join") is os.path.join  # dotted module, any callable


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("no_colon", ValueError, "expected module:function"),
        ("tests.workers.rlvr_rewards:", ValueError, "expected module:function"),
        ("tests.workers.rlvr_rewards:missing", ValueError, "has no 'missing'.*digit_share"),
        ("tests.workers.rlvr_rewards:annotations", ValueError, "not a function"),
        ("no/such/file.py:f", FileNotFoundError, "no file"),
        ("no_such_module_xyz:f", ImportError, "no_such_module_xyz"),
    ],
)
def test_bad_specs_are_named(spec: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        load_reward_function(spec)


@pytest.mark.parametrize("timeout", [0.0, 30.0])  # in-process, forked
def test_signature_columns_and_none(timeout: float) -> None:
    assert _call(rlvr_rewards.length_bonus, timeout) == [0.3, 0.1]
    assert _call(rlvr_rewards.matches_target, timeout, target=["21", None]) == [1.0, None]
    assert _call(lambda completions, **kw: [kw["level"][0], None], timeout, level=[7, 8]) == [7.0, None]  # closures
    assert _call(lambda **kw: torch.tensor([1.0, 2.0]), timeout) == [1.0, 2.0]


BAD: list[tuple[Callable[..., Any], str, list[int] | None]] = [
    (lambda **kw: [1.0, float("nan")], "returned nan for 1 sample", [1]),
    (lambda **kw: [float("inf"), 0.0], "returned inf", [0]),
    (lambda **kw: [1.0], "returned 1 values for 2 completions", None),
    (lambda **kw: 1.0, "returned a float", None),
    (lambda **kw: ["a", 1.0], "value 0 is a str", [0]),
    (lambda **kw: 1 / 0, "raised ZeroDivisionError", None),
    (lambda **kw: exit(1), "raised SystemExit", None),
]


@pytest.mark.parametrize("timeout", [0.0, 30.0])
@pytest.mark.parametrize(("fn", "match", "samples"), BAD[:-1])
def test_bad_results_name_the_sample(timeout: float, fn: Any, match: str, samples: list[int] | None) -> None:
    with pytest.raises(RewardCallError, match=match) as info:
        _call(fn, timeout)
    assert info.value.samples == samples


def test_a_hang_is_killed_at_the_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(RewardCallError, match="did not return within --reward_timeout 0.5 s"):
        _call(lambda **kw: time.sleep(60), 0.5)
    assert time.monotonic() - start < 30  # killed, not waited for (a loose bound: the machine may be loaded)


def test_a_child_that_dies_or_exits_is_reported() -> None:
    with pytest.raises(RewardCallError, match="died"):
        _call(lambda **kw: os._exit(3), 30.0)
    with pytest.raises(RewardCallError, match="raised SystemExit"):
        _call(lambda **kw: exit(1), 30.0)
    with pytest.raises(RewardCallError, match="clash"):
        _call(rlvr_rewards.digit_share, 30.0, completions=["a", "b"])


def test_score_with_functions_names_function_sample_and_prompt() -> None:
    sources, model_weight = reward_sources(
        ["tests.workers.rlvr_rewards:digit_share", lambda **kw: [0.0, float("nan")]], [1.0, 2.0, 0.5], True
    )
    assert [s.name for s in sources] == ["digit_share", "<lambda>"] and model_weight == 0.5
    out = score_with_functions(sources, PROMPTS, TEXTS, IDS, {}, timeout=30.0)
    assert out.failed.tolist() == [False, True]
    assert out.error is not None and "'<lambda>'" in out.error and "sample 1 of 2 (prompt '3 4 =')" in out.error
    assert out.values[0].tolist() == [2 / 3, 0.0] and math.isnan(float(out.values[1, 1]))
    with pytest.raises(ValueError, match="expected 2 .*then the reward model"):
        reward_sources([rlvr_rewards.digit_share], [1.0], True)
    with pytest.raises(ValueError, match="finite"):
        reward_sources([rlvr_rewards.digit_share], [float("inf")], False)


def test_combine_is_a_weighted_nansum() -> None:
    values = torch.tensor([[1.0, math.nan, math.nan], [2.0, 3.0, math.nan]], dtype=torch.float64)
    total = combine_rewards(values, torch.tensor([1.0, 0.5], dtype=torch.float64))
    assert total[:2].tolist() == [2.0, 1.5] and math.isnan(float(total[2]))  # nobody scored the last one


def _grpo(argv: list[str]) -> GRPOSettings:
    s = settings_from_args(GRPOSettings, build_parser().parse_args(["grpo", *argv]))
    assert isinstance(s, GRPOSettings)
    return s


def test_algorithm_presets_and_explicit_overrides() -> None:
    dapo = _grpo(["--algorithm", "dapo", "--max_completion_length", "40"])
    assert (dapo.loss_type, dapo.cliprange, dapo.clip_high, dapo.grpo_kl_coef) == ("dapo", 0.2, 0.28, 0.0)
    assert dapo.dynamic_sampling and dapo.overlong_buffer_length == 10 and dapo.max_answer_seq_len == 40
    gspo = _grpo(["--algorithm", "gspo", "--epsilon_high", "5e-4"])
    assert gspo.importance_sampling_level == "sequence" and (gspo.cliprange, gspo.clip_high) == (3e-4, 5e-4)
    dr = _grpo(["--algorithm", "dr_grpo", "--beta", "0.02"])
    assert (dr.loss_type, dr.scale_rewards, dr.grpo_kl_coef) == ("dr_grpo", "none", 0.02)
    rloo = _grpo(["--algorithm", "rloo", "--num_generations", "2", "--num_iterations", "3"])
    assert (rloo.baseline, rloo.loss_type, rloo.group_size, rloo.ppo_epochs) == ("leave_one_out", "dr_grpo", 2, 3)
    plain = _grpo([])
    assert (plain.loss_type, plain.scale_rewards, plain.grpo_kl_coef, plain.clip_high) == ("grpo", "group", 0.04, 0.2)


def test_reward_sources_in_the_settings() -> None:
    funcs = ["--reward_funcs", "a:f", "b:g"]
    s = _grpo([*funcs, "--reward_weights", "1", "0.5"])
    assert s.reward_funcs == ["a:f", "b:g"] and s.reward_weights == [1.0, 0.5] and not s.uses_reward_model()
    both = _grpo([*funcs, "--reward_model_name_or_path", "RM", "--reward_weights", "1", "0.5", "2"])
    assert both.uses_reward_model() and both.critic_model_name_or_path == "RM"
    assert _grpo([]).uses_reward_model()  # no function: the reward model, as before
    with pytest.raises(ValueError, match="expected 3 .*then the reward model"):
        GRPOSettings(reward_funcs=["a:f", "b:g"], reward_model=True, reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="same setting"):
        GRPOSettings(num_generations=4, group_size=2)
    with pytest.raises(ValueError, match="no reward source"):
        GRPOSettings(reward_model=False)
    with pytest.raises(ValueError, match="overlong_buffer_length"):
        GRPOSettings(overlong_buffer_length=300)


def test_stop_strings_cut_after_the_string() -> None:
    from hybridzero.rlhf.data.demo_task import build_tokenizer
    from hybridzero.rlhf.rollout.stops import StopOnStrings, cut_after_stop

    tok = build_tokenizer()
    rows = [tok.encode(text, add_special_tokens=False) for text in ("1 = 2 3", "4 5 6 7", "8 9 = =")]
    answers = torch.tensor(rows)
    # "1 =" after 2 tokens; no stop in row 1; row 2 only up to its valid length 3 -> "8 9 =" after 3
    assert cut_after_stop(tok, answers, torch.tensor([4, 4, 3]), ["="]).tolist() == [2, 4, 3]
    assert cut_after_stop(tok, answers, torch.tensor([4, 4, 2]), ["9 ="]).tolist() == [4, 4, 2]  # cut off by length
    prompt = torch.tensor([[tok.convert_tokens_to_ids("5")]] * 3)
    done = StopOnStrings(tok, ["="], prompt_width=1)(torch.cat([prompt, answers[:, :2]], dim=1), torch.zeros(3, 5))
    assert done.tolist() == [True, False, False]  # the prompt's own text is never searched
    with pytest.raises(ValueError, match="non-empty"):
        StopOnStrings(tok, [""], prompt_width=1)


def test_the_cli_names_a_bad_reward_function_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridzero.cli import main
    from tests.workers.rlhf_runs import make_model_dirs

    actor, _ = make_model_dirs(tmp_path)
    argv = ["grpo", "--actor_model_name_or_path", actor, "--data_path", "demo", "--reward_funcs"]
    assert main([*argv, R_MISSING]) == 1
    err = capsys.readouterr().err
    assert "grpo: error: --reward_funcs 'tests.workers.rlvr_rewards:nope'" in err and "digit_share" in err
    assert main([*argv, "tests.workers.rlvr_rewards:digit_share", "--reward_weights", "1", "2"]) == 2
    assert "reward_weights [1.0, 2.0] has 2 entries; expected 1" in capsys.readouterr().err


R_MISSING = "tests.workers.rlvr_rewards:nope"


def test_reward_deadline_must_fit_the_collective_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's functions run one after another: F x reward_timeout reaching the collective timeout the peers wait
    in is warned about up front, naming both values and what would be valid; below it, nothing is said."""
    import warnings

    fns = [_counter(), _counter()]
    monkeypatch.setenv("HYBRIDZERO_TIMEOUT_S", "100")
    with pytest.warns(UserWarning, match=r"reward_timeout 45 s x 2 reward functions .* 100 s .* below 45 s"):
        RewardSet.build(GRPOSettings(reward_timeout=45.0), fns).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RewardSet.build(GRPOSettings(reward_timeout=44.0), fns).close()
        RewardSet.build(GRPOSettings(reward_timeout=0.0), fns).close()  # in-process: no deadline to fit


def test_isolation_trouble_is_a_reward_call_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure of the isolation itself on one rank (fork/pipe refused: EAGAIN, EMFILE) becomes a RewardCallError,
    so the reward set's agreement reports it on every rank instead of this rank leaving the collective alone."""
    from hybridzero.rlhf.rewards import isolation as reward_isolation

    def no_fork() -> int:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(reward_isolation.os, "fork", no_fork)
    with pytest.raises(RewardCallError, match=r"in isolation \(BlockingIOError: .*temporarily unavailable"):
        _call(lambda **kw: [1.0, 1.0], 5.0)

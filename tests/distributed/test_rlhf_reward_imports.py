"""Reward modules are imported in the contained worker under --reward_timeout (issue 28): a module that raises, or
hangs, at import on rank 1 only ends with the same one-line RewardError on both ranks (not a traceback, not a wait
for the collective timeout), and the run leaves no process behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.workers.rlhf_runs import make_model_dirs
from tests.workers.rlvr_runs import failing_reward_run

MODULE = """import os, time
if os.environ.get("RLVR_FAIL_RANK") == os.environ.get("RANK"):
    {action}
def f(completions, **kwargs):
    return [1.0] * len(completions)
"""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_model_dirs(tmp_path_factory.mktemp("import_models"))


def test_a_module_failing_at_import_on_one_rank_is_one_error_everywhere(world, dirs, tmp_path: Path) -> None:
    raises = tmp_path / "raises.py"
    raises.write_text(MODULE.format(action="raise RuntimeError('no checker binary here')"))
    hangs = tmp_path / "hangs.py"
    hangs.write_text(MODULE.format(action="time.sleep(1000)"))
    base = {
        "actor_model_name_or_path": dirs[0],
        "data_path": ["demo"],
        "output_dir": str(tmp_path / "out"),
        "reward_model": False,
        "per_device_generation_batch_size": 4,
        "per_device_training_batch_size": 4,
        "group_size": 2,
        "max_steps": 1,
        "max_prompt_seq_len": 8,
        "max_answer_seq_len": 6,
    }
    cases = [
        (raises, 30.0, "raised RuntimeError (line 3): no checker binary here"),
        (hangs, 3.0, "did not finish within --reward_timeout 3 s (killed)"),
    ]
    for path, timeout, expected in cases:
        knobs = {**base, "reward_funcs": [f"{path}:f"], "reward_timeout": timeout}
        results = world(2).run(failing_reward_run, knobs, 1, timeout=300)
        errors = [r["error"] for r in results]
        assert errors[0] is not None and errors[0] == errors[1], errors
        assert errors[0].startswith("rank 1: ") and f"{path}:f" in errors[0] and expected in errors[0], errors[0]
        assert "\n" not in errors[0]
        assert [r["left"] for r in results] == [[], []]

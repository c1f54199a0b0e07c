"""A reward function that kills its own trainer process (issue 28), in the contained worker (``reward_timeout > 0``,
the function's parent is the trainer) and in-process (``reward_timeout 0``): the killed rank is gone, the survivor
ends with one line naming the reward function and the lost rank -- not a raw gloo error -- and the killed rank's
reward worker does not outlive its trainer."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.harness.spawn import RemoteError
from tests.workers.rlhf_runs import make_model_dirs
from tests.workers.rlvr_runs import trainer_kill_run

MODULE = """import os, signal
def kills_trainer(completions, **kwargs):
    if os.environ.get("RLVR_FAIL_RANK") == os.environ.get("RANK"):
        with open({pid_file!r}, "w") as f:
            f.write(str(os.getpid()))
        os.kill(int(os.environ["TRAINER_PID"]), signal.SIGKILL)
    return [1.0] * len(completions)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_model_dirs(tmp_path_factory.mktemp("kill_models"))


@pytest.mark.slow
@pytest.mark.parametrize("timeout", [5.0, 0.0], ids=["isolated", "in_process"])
def test_a_reward_function_killing_its_trainer_is_one_line_on_the_survivor(
    world, dirs, tmp_path: Path, timeout: float
) -> None:
    pid_file = tmp_path / "caller.pid"
    module = tmp_path / "killer.py"
    module.write_text(MODULE.format(pid_file=str(pid_file)))
    knobs = {
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
        "reward_funcs": [f"{module}:kills_trainer"],
        "reward_timeout": timeout,
    }
    prefix = str(tmp_path / "result")
    with pytest.raises(RemoteError) as info:
        world(2).run(trainer_kill_run, knobs, 1, prefix, timeout=300)
    assert 1 in info.value.failures, info.value  # rank 1 is gone (killed by its own reward function)
    survivor = json.loads(Path(f"{prefix}.rank0.json").read_text())
    error = survivor["error"]
    assert error is not None and "\n" not in error, error
    assert error.startswith("rank 0: rank 1 left during the reward agreement"), error
    assert "['kills_trainer']" in error, error
    assert survivor["left"] == []
    caller = int(pid_file.read_text())
    if timeout > 0:  # the function ran in rank 1's reward worker: it must not outlive its trainer
        assert caller != os.getpid()
        deadline = time.monotonic() + 15.0
        while _alive(caller) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(caller), f"rank 1's reward worker {caller} outlived its killed trainer"

"""DeepSpeed's recovery script and its permissions (hybridzero.checkpoint.recovery), DeepSpeed's deprecation warning
for ``elastic_checkpoint`` at stage 3, both through the loggers DeepSpeed's own tests watch."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from hybridzero.checkpoint.recovery import RECOVERY_SCRIPT, SCRIPT_MARK, make_executable, write_recovery_script

LOG = logging.getLogger("hybridzero.test_recovery")


def test_script_is_written_executable_and_refreshed(tmp_path: Path) -> None:
    path = write_recovery_script(tmp_path, LOG)
    assert path == tmp_path / RECOVERY_SCRIPT and os.access(path, os.X_OK)
    text = path.read_text()
    assert SCRIPT_MARK in text and "from hybridzero.runtime.zero_to_fp32 import main" in text
    path.write_text(text + "# stale\n")
    assert write_recovery_script(tmp_path, LOG) == path and path.read_text() == text  # ours: refreshed
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECOVERY_SCRIPT]  # no temporary file left


def test_a_foreign_file_of_that_name_is_left_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    foreign = tmp_path / RECOVERY_SCRIPT
    foreign.write_text("print('the user wrote this')\n")
    with caplog.at_level(logging.INFO, logger=LOG.name):
        assert write_recovery_script(tmp_path, LOG) is None
    assert foreign.read_text() == "print('the user wrote this')\n"
    assert "not written by hybridzero" in caplog.text


def test_refused_chmod_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "nowhere" / RECOVERY_SCRIPT  # as a share that refuses permissions: chmod raises OSError
    with caplog.at_level(logging.INFO, logger=LOG.name):
        assert make_executable(missing, LOG) is False
    assert "could not make the recovery script" in caplog.text and str(missing) in caplog.text


def test_unwritable_directory_leaves_the_checkpoint_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert write_recovery_script(not_a_dir, LOG) is None
    assert "could not write the recovery script" in caplog.text


def test_engine_method_logs_on_deepspeeds_logger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``engine._change_recovery_script_permissions`` (DeepSpeed's name) reports a refused chmod through
    ``deepspeed.utils.logger.info``."""
    from hybridzero.deepspeed_alias.tree import utils
    from hybridzero.runtime.deepspeed_api import DeepSpeedEngineAPI

    seen: list[Any] = []
    monkeypatch.setattr(utils.logger, "info", lambda message, *a, **k: seen.append(message % a if a else message))
    method = DeepSpeedEngineAPI._change_recovery_script_permissions
    assert method(None, str(tmp_path / "missing.py")) is False  # type: ignore[arg-type]
    assert seen and "could not make the recovery script" in seen[0]
    ok = tmp_path / "ok.py"
    ok.write_text("")
    assert method(None, str(ok)) is True and os.access(ok, os.X_OK)  # type: ignore[arg-type]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_elastic_checkpoint_warns_at_stage_3_only(stage: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridzero.deepspeed_alias.tree import utils
    from hybridzero.deepspeed_alias.tree.runtime.zero.config import DeepSpeedZeroConfig

    seen: list[str] = []
    monkeypatch.setattr(utils.logger, "warning", lambda message, *a, **k: seen.append(str(message)))
    config = DeepSpeedZeroConfig(stage=stage, elastic_checkpoint=True)
    assert config.stage == stage
    warned = any("elastic checkpointing is deprecated" in m.lower() for m in seen)
    assert warned == (stage == 3)
    DeepSpeedZeroConfig(stage=3)
    assert len(seen) == (1 if stage == 3 else 0)  # not without the key


def test_only_our_script_counts_as_a_checkpoint_directory_entry(tmp_path: Path) -> None:
    """Conversions into a save directory accept the script a save left there, and nothing else of that name."""
    from hybridzero.checkpoint.recovery import is_our_script

    path = write_recovery_script(tmp_path, LOG)
    assert path is not None and is_our_script(path)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / RECOVERY_SCRIPT).write_text("print('the user wrote this')\n")
    assert not is_our_script(other / RECOVERY_SCRIPT)
    (other / "link").mkdir()
    os.symlink(path, other / "link" / RECOVERY_SCRIPT)
    assert not is_our_script(other / "link" / RECOVERY_SCRIPT)  # a symlink is never ours

"""The DeepSpeed config every RLHF engine gets: non-finite steps are skipped by default (issue: one rank's NaN loss
must not turn every weight into NaN), and it loads without a 'has no effect' warning."""

from __future__ import annotations

import logging
import warnings

import pytest

from hybridzero.config import load_config
from hybridzero.rlhf.engines import OptimSpec, ds_config


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("trained", [True, False])
def test_rlhf_engines_skip_nonfinite_steps_and_load_silently(
    dtype: str, trained: bool, caplog: pytest.LogCaptureFixture
) -> None:
    optim = OptimSpec(1e-4, 0.0, "cosine", 0, 10) if trained else None
    cfg = ds_config(stage=3, dtype=dtype, micro_batch=2, world_size=1, optim=optim)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.WARNING, logger="hybridzero"):
            loaded = load_config(cfg, world_size=1)
    assert loaded.skip_nonfinite_steps
    assert not [r for r in caplog.records if "no effect" in r.getMessage()], caplog.text

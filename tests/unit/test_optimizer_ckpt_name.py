"""``engine._get_optimizer_ckpt_name``: DeepSpeed's name for the file a checkpoint's optimizer state is read from
(here the tag's ``state.json``), asked by ``load_checkpoint`` only when it loads optimizer state."""

from __future__ import annotations

import os
from pathlib import Path
from unittest.mock import patch

import pytest
import torch


def _engine() -> object:
    import hybridzero

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = hybridzero.initialize(model=torch.nn.Linear(4, 3), config=cfg)
    return engine


def test_name_is_the_state_file_and_asked_only_when_optimizer_state_loads(tmp_path: Path) -> None:
    saved = _engine()
    loss = saved(torch.randn(2, 4)).sum()
    saved.backward(loss)
    saved.step()
    saved.save_checkpoint(str(tmp_path), tag="t1")
    name = saved._get_optimizer_ckpt_name(str(tmp_path), "t1")
    assert name == os.path.join(str(tmp_path), "t1", "state.json") and os.path.isfile(name)
    with pytest.raises(ValueError, match="expp_rank=1"):
        saved._get_optimizer_ckpt_name(str(tmp_path), "t1", expp_rank=1)

    loaded = _engine()
    assert saved.sparse_tensor_module_names == loaded.sparse_tensor_module_names == set()  # every reduction is dense
    with patch.object(loaded, "_get_optimizer_ckpt_name", wraps=loaded._get_optimizer_ckpt_name) as asked:
        loaded.load_checkpoint(str(tmp_path), tag="t1", load_optimizer_states=False)
        asked.assert_not_called()
        loaded.load_checkpoint(str(tmp_path), tag="t1", load_optimizer_states=True)
        asked.assert_called_once()
    want = saved.optimizer.state_dict()["state"]
    got = loaded.optimizer.state_dict()["state"]
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k]["exp_avg"], got[k]["exp_avg"])

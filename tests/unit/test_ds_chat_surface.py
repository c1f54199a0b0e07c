"""The DeepSpeed names DeepSpeed-Chat imports: ``ops.adam``, ``HfDeepSpeedConfig``, ``compression.helper``,
``ZeroParamStatus`` (single process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridzero.compression.helper import recursive_getattr, recursive_setattr
from hybridzero.ops.adam import DeepSpeedCPUAdam, FusedAdam
from hybridzero.optim.factory import rebuild_optimizer
from hybridzero.runtime.hf_ds_config import HfDeepSpeedConfig
from hybridzero.runtime.zero.partition_parameters import ZeroParamStatus


def _steps(opt_cls: type[torch.optim.Optimizer], **kwargs: object) -> torch.Tensor:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(7, 5))
    opt = opt_cls([p], **kwargs)
    for _ in range(3):
        opt.zero_grad()
        (p**2).sum().backward()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam])
def test_adam_names_are_torch_adam_with_deepspeed_semantics(cls: type[torch.optim.Optimizer]) -> None:
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    mode = "adam_w_mode" if cls is FusedAdam else "adamw_mode"
    assert torch.equal(_steps(cls, **kw), _steps(torch.optim.AdamW, **kw))  # default: decoupled decay (AdamW)
    assert torch.equal(_steps(cls, **kw, **{mode: False}), _steps(torch.optim.Adam, **kw))  # L2 mode: Adam
    with pytest.raises(RuntimeError, match="AMSGrad"):
        cls([nn.Parameter(torch.ones(3))], amsgrad=True)
    with pytest.raises(ValueError, match="bias_correction=False"):
        cls([nn.Parameter(torch.ones(3))], bias_correction=False)


def test_adam_rebuilds_as_itself_keeping_its_mode() -> None:
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    client = FusedAdam([{"params": [p], "lr": 5e-4}], lr=1e-3, adam_w_mode=False, weight_decay=0.1)
    rebuilt = rebuild_optimizer(client, [[q]])
    assert type(rebuilt) is FusedAdam and rebuilt.defaults["adam_w_mode"] is False
    assert rebuilt.param_groups[0]["lr"] == 5e-4 and rebuilt.param_groups[0]["decoupled_weight_decay"] is False
    q.grad = torch.ones(3)
    rebuilt.zero_grad()
    assert q.grad is None  # set_grad_none (DeepSpeed's default)


def test_hf_deepspeed_config_answers_transformers_queries(tmp_path: Path) -> None:
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "bf16": {"enabled": True}}
    cfg = HfDeepSpeedConfig(ds)
    assert cfg.is_zero3() and not cfg.is_zero2() and cfg.is_offload()
    assert cfg.get_value("zero_optimization.stage") == 3 and cfg.get_value("a.b", 7) == 7
    assert cfg.is_true("bf16.enabled") and not cfg.is_false("bf16.enabled") and not cfg.is_true("fp16.enabled")
    cfg.del_config_sub_tree("bf16")
    assert "bf16" in ds and cfg.get_value("bf16.enabled") is None  # a private copy
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert HfDeepSpeedConfig(str(path)).is_zero2() and not HfDeepSpeedConfig(path).is_offload()
    with pytest.raises(ValueError, match="dict or the path"):
        HfDeepSpeedConfig("missing.json")


def test_compression_helpers_and_zero_param_status() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(3, 5), nn.ReLU()))
    assert recursive_getattr(model, "0.0") is model[0][0]
    new = nn.Linear(3, 5)
    recursive_setattr(model, "0.0", new)
    assert model[0][0] is new
    with pytest.raises(AttributeError):
        recursive_getattr(model, "0.7")
    assert [s.value for s in ZeroParamStatus] == [1, 2, 3] and ZeroParamStatus.NOT_AVAILABLE.name == "NOT_AVAILABLE"

"""The DeepSpeed names DeepSpeed's ZeRO test files and user code import, served by the alias (issue 31): op
builders, ZeRO-3 leaf modules (API, config block, gather-group plan), ``ZeRORuntimeException``, the launcher's
``--local_rank``, the import-only stand-ins, and ``offload_param`` without ``offload_optimizer`` in the config."""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hybridzero.as_deepspeed import launcher_argv
from hybridzero.config import ConfigError, load_config
from hybridzero.config.models import DEFAULT_LEAF_MODULE_CLASSES, ZeroConfig
from hybridzero.ops.adagrad import DeepSpeedCPUAdagrad
from hybridzero.ops.adam import DeepSpeedCPUAdam
from hybridzero.ops.lion import DeepSpeedCPULion
from hybridzero.ops.op_builder import ALL_BUILDERS, COMPATIBLE_OPS
from hybridzero.runtime.zero_errors import ZeRORuntimeException, check_forced_cpu_optimizer
from hybridzero.zero import leaf
from hybridzero.zero.offload import Placement
from hybridzero.zero.partition import plan_groups

NAMES = {
    "deepspeed.utils.zero_to_fp32": [
        "get_fp32_state_dict_from_zero_checkpoint",
        "load_state_dict_from_zero_checkpoint",
        "convert_zero_checkpoint_to_fp32_state_dict",
    ],
    "deepspeed.utils": [
        "safe_set_full_grad",
        "safe_set_local_grad",
        "safe_update_full_grad_vectorized",
        "set_z3_leaf_modules",
        "unset_z3_leaf_modules",
        "get_z3_leaf_modules",
        "z3_leaf_module",
        "set_z3_leaf_modules_by_name",
        "set_z3_leaf_modules_by_suffix",
        "log_dist",
    ],
    "deepspeed.ops.op_builder": [
        "CPUAdamBuilder",
        "FusedAdamBuilder",
        "AsyncIOBuilder",
        "InferenceBuilder",
        "OpBuilder",
    ],
    "deepspeed.runtime.zero.utils": ["ZeRORuntimeException"],
    "deepspeed.runtime.zero.config": ["DeepSpeedZeroConfig"],
    "deepspeed.runtime.zero.leaf_module_config": ["DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES"],
    "deepspeed.runtime.zero.offload_config": ["OffloadDeviceEnum"],
    "deepspeed.runtime.zero.partition_parameters": ["MultipleAllGatherHandles", "partitioned_param_data_shape"],
    "deepspeed.runtime.zero": ["ZeroParamStatus"],
    "deepspeed.checkpoint.utils": ["get_model_ckpt_name_for_rank"],
    "deepspeed.compression.helper": ["recursive_getattr", "recursive_setattr"],
    "deepspeed.accelerator": ["is_current_accelerator_supported"],
    "deepspeed.git_version_info": ["torch_info"],
    "deepspeed.utils.torch": ["required_torch_version"],
    "deepspeed.pipe": ["PipelineModule", "LayerSpec"],
}


def test_alias_serves_the_names_deepspeed_tests_import() -> None:
    """In a fresh interpreter (the alias serves only while DeepSpeed is absent), every name resolves; the builders
    answer as DeepSpeed's CPU accelerator; stand-ins refuse to be built, naming themselves."""
    lines = ["import hybridzero.as_deepspeed", "import deepspeed"]
    lines += [f"from {mod} import {', '.join(names)}" for mod, names in NAMES.items()]
    lines += [
        "assert CPUAdamBuilder().is_compatible() and FusedAdamBuilder().is_compatible()",
        "assert not InferenceBuilder().is_compatible()",
        "assert deepspeed.ops.__compatible_ops__[InferenceBuilder.NAME] is False",
        "assert deepspeed.ops.__compatible_ops__['cpu_adam'] is True",
        "import hybridzero.utils as u",
        "assert deepspeed.utils.safe_set_full_grad is u.safe_set_full_grad",
        "try:\n    PipelineModule()\nexcept NotImplementedError as e:\n    assert 'PipelineModule' in str(e)",
        "else:\n    raise SystemExit('PipelineModule built')",
        "print('ok')",
    ]
    out = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_op_builders_answer_what_hybridzero_provides() -> None:
    for name in ("cpu_adam", "fused_adam", "cpu_adagrad", "cpu_lion", "fused_lion", "pin_memory"):
        assert COMPATIBLE_OPS[name] is True, name
    for name in ("transformer_inference", "fused_lamb", "deepspeed_ccl_comm", "quantizer"):
        assert COMPATIBLE_OPS[name] is False, name
    builder = ALL_BUILDERS["CPUAdamBuilder"]()
    assert builder.NAME == "cpu_adam"
    with pytest.raises(NotImplementedError, match="cpu_adam"):
        builder.load()


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(5, 5) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(x) for e in self.experts)  # type: ignore[return-value]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(5, 7)
        self.moe = Experts()


def test_leaf_api_marks_and_reports() -> None:
    net = Net()
    assert leaf.set_z3_leaf_modules(net, [Experts]) == [net.moe]
    assert leaf.z3_leaf_module(net.moe) and not leaf.z3_leaf_module(net)
    assert leaf.get_z3_leaf_modules(net) == [net.moe]
    assert leaf.unset_z3_leaf_modules(net, ["Experts"]) == [net.moe] and leaf.get_z3_leaf_modules(net) == []
    with pytest.raises(ValueError, match="Conv2d"):
        leaf.set_z3_leaf_modules(net, [nn.Conv2d])
    assert leaf.set_z3_leaf_modules(net, [nn.Conv2d], raise_if_not_found=False) == []
    assert leaf.set_z3_leaf_modules_by_name(net, ["moe", "nope"], raise_if_not_found=False) == ([net.moe], ["nope"])
    matched, missing = leaf.set_z3_leaf_modules_by_suffix(net, ["experts"])
    assert matched == [net.moe.experts] and missing == []
    with pytest.raises(ValueError, match="nope"):
        leaf.set_z3_leaf_modules_by_name(net, ["nope"])
    assert leaf.leaf_module_names(net) == ["moe"]  # experts are inside the moe leaf: gathered with it


def test_leaf_modules_become_one_gather_group() -> None:
    """Without leaves the experts (the largest homogeneous ModuleList) are three groups; a leaf with a forward of its
    own becomes one group owned by it; a container leaf (ModuleList) or the root goes to the root group."""
    net = Net()
    owners = [p.owner for p in plan_groups(net, 0)]
    assert owners == ["", "moe.experts.0", "moe.experts.1", "moe.experts.2"]
    as_one = plan_groups(net, 0, leaves=["moe"])
    assert [p.owner for p in as_one] == ["", "moe"]
    assert set(as_one[1].param_names) == {n for n, _ in net.named_parameters() if n.startswith("moe.")}
    assert [p.owner for p in plan_groups(net, 0, leaves=["moe.experts"])] == [""]
    assert [p.owner for p in plan_groups(net, 0, leaves=[""])] == [""]
    assert [p.owner for p in plan_groups(net, 0, leaves=["moe.experts.1"])] == owners  # inside a block


def test_leaf_module_config_block() -> None:
    z = ZeroConfig()
    assert z.leaf_module.classes == list(DEFAULT_LEAF_MODULE_CLASSES) and z.leaf_module.names == []
    z = ZeroConfig(leaf_module={"classes": "my.Class", "names": ["a", "a", "b"], "name_suffixes": "tail"})
    assert (z.leaf_module.classes, z.leaf_module.names, z.leaf_module.name_suffixes) == (
        ["my.Class"],
        ["a", "b"],
        ["tail"],
    )
    with pytest.raises(ConfigError, match="leaf_module.names"):
        load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, "leaf_module": {"names": [3]}}}, 1)
    net = Net()
    assert leaf.apply_leaf_config(net, ["Experts"], ["head"], []) == [net.moe, net.head]


def test_offload_param_alone_is_accepted() -> None:
    cfg = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, 1)
    assert cfg.zero.offload_param.device == "cpu" and not cfg.zero.offload_optimizer.enabled
    placement = Placement.build(torch.device("cpu"), "none", "cpu")
    assert placement.params_on_host_only and placement.where("compute_shards") == "host"
    assert not Placement.build(torch.device("cpu"), "cpu", "cpu").params_on_host_only


def test_forced_cpu_optimizer_raises_zero_runtime_exception() -> None:
    """DeepSpeed's ``zero_force_ds_cpu_optimizer``: acts when set true explicitly (hybridzero's default: not set)."""
    params = [nn.Parameter(torch.ones(3))]
    block = {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    forced = load_config({"train_batch_size": 2, "zero_optimization": block, "zero_force_ds_cpu_optimizer": True}, 1)
    with pytest.raises(ZeRORuntimeException, match="zero_force_ds_cpu_optimizer"):
        check_forced_cpu_optimizer(forced, torch.optim.Adam(params))
    check_forced_cpu_optimizer(forced, DeepSpeedCPUAdam(params))
    check_forced_cpu_optimizer(forced, DeepSpeedCPULion(params))  # DeepSpeed's rule: its CPU Adam or CPU Lion
    with pytest.raises(ZeRORuntimeException, match="DeepSpeedCPUAdagrad"):
        check_forced_cpu_optimizer(forced, DeepSpeedCPUAdagrad(params))
    check_forced_cpu_optimizer(
        load_config({"train_batch_size": 2, "zero_optimization": block}, 1), torch.optim.Adam(params)
    )
    assert importlib.import_module("hybridzero.runtime.zero_errors").ZeRORuntimeException is ZeRORuntimeException


def test_runner_passes_local_rank_as_deepspeeds_launcher() -> None:
    assert launcher_argv(["main.py", "--x", "1"], "1", False) == ["main.py", "--local_rank=1", "--x", "1"]
    assert launcher_argv(["main.py"], None, False) == ["main.py"]
    assert launcher_argv(["main.py", "--local_rank", "0"], "1", False) == ["main.py", "--local_rank", "0"]
    assert launcher_argv(["main.py"], "1", True) == ["main.py"]


def test_multiple_all_gather_handles_pass_the_flag() -> None:
    from hybridzero.deepspeed_alias.tree.runtime.zero.partition_parameters import MultipleAllGatherHandles

    seen: list[bool] = []
    handle = SimpleNamespace(wait=lambda handle_dependency=True: seen.append(handle_dependency))
    MultipleAllGatherHandles([handle, handle]).wait(handle_dependency=False)
    assert seen == [False, False]

"""The opt-in ``deepspeed`` alias (``import hybridzero.as_deepspeed``), each check in a fresh subprocess so this
process's imports stay untouched:

* transformers' and accelerate's DeepSpeed detection (``find_spec`` + ``importlib.metadata``) accept it, the version
  says hybridzero, and every ``deepspeed`` name their integrations touch resolves -- to hybridzero's objects, or to a
  stand-in that raises naming the name; modules we do not serve fail on import naming themselves;
* a real ``deepspeed`` on ``sys.path`` always wins (installed before or after the alias), metadata included;
* ``python -m hybridzero.as_deepspeed SCRIPT ARGS`` runs the script with the alias.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]

# Every deepspeed name transformers 5.24 (integrations/deepspeed.py, modeling_utils.py, trainer.py) and accelerate
# 1.16 (accelerator.py, state.py, utils/{deepspeed,dataclasses,other,operations}.py, commands/launch.py) use on the
# ZeRO paths, and what it must be.
_PROVIDED = {
    "deepspeed.initialize": "hybridzero.initialize",
    "deepspeed.init_distributed": "hybridzero.init_distributed",
    "deepspeed.DeepSpeedEngine": "hybridzero.Engine",
    "deepspeed.runtime.engine.DeepSpeedEngine": "hybridzero.Engine",
    "deepspeed.zero.Init": "hybridzero.zero.Init",
    "deepspeed.zero.GatheredParameters": "hybridzero.zero.GatheredParameters",
    "deepspeed.zero.register_external_parameter": "hybridzero.zero.register_external_parameter",
    "deepspeed.zero.unregister_external_parameter": "hybridzero.zero.unregister_external_parameter",
    "deepspeed.runtime.zero.GatheredParameters": "hybridzero.zero.GatheredParameters",
    "deepspeed.comm.get_rank": "hybridzero.comm.get_rank",
    "deepspeed.comm.is_initialized": "hybridzero.comm.is_initialized",
    "deepspeed.comm.init_distributed": "hybridzero.comm.init_distributed",
    "deepspeed.utils.is_initialized": "hybridzero.comm.is_initialized",
    "deepspeed.accelerator.get_accelerator": "hybridzero.accelerator.get_accelerator",
    "deepspeed.runtime.zero.partition_parameters.get_accelerator": "hybridzero.accelerator.get_accelerator",
    "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus": (
        "hybridzero.runtime.zero.partition_parameters.ZeroParamStatus"
    ),
    "deepspeed.ops.adam.DeepSpeedCPUAdam": "hybridzero.ops.adam.DeepSpeedCPUAdam",
    "deepspeed.ops.adam.FusedAdam": "hybridzero.ops.adam.FusedAdam",
    # ALST/Ulysses (accelerate's prepare with ParallelismConfig(sp_backend="deepspeed"), Trainer's SP loss)
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF": (
        "hybridzero.runtime.ulysses_hf.UlyssesSPAttentionHF"
    ),
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter": (
        "hybridzero.runtime.ulysses_data.UlyssesDataLoaderAdapter"
    ),
    "deepspeed.runtime.sequence_parallel.parallel_state_sp.get_sequence_parallel_group": (
        "hybridzero.runtime.sp_state.get_sequence_parallel_group"
    ),
    "deepspeed.utils.groups._get_sequence_parallel_group": "hybridzero.runtime.sp_state.groups_sequence_parallel_group",
    "deepspeed.utils.groups._get_sequence_parallel_world_size": (
        "hybridzero.runtime.sp_state.groups_sequence_parallel_world_size"
    ),
    "deepspeed.utils.groups._get_sequence_parallel_rank": "hybridzero.runtime.sp_state.groups_sequence_parallel_rank",
    "deepspeed.runtime.utils.move_to_device": "hybridzero.runtime.ulysses_data.move_to_device",
}
_VALUES = [
    "deepspeed.__version__",
    "deepspeed.utils.logger",
    "deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES",
    "deepspeed.runtime.zero.partition_parameters.zero_wrapper_for_fp_tensor_constructor",
    "deepspeed.runtime.zero.partition_parameters._orig_torch_arange",
    "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
    "deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME",
]
_STAND_INS = [
    "deepspeed.tp_model_init",
]
_UNSERVED_MODULES = [
    "deepspeed.ops.lamb",
    "deepspeed.sequence.layer",
    "deepspeed.runtime.sequence_parallel.ulysses_linear_attention",
]


def _python(code: str, *args: str, path: tuple[Path, ...] = ()) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, path), str(_REPO)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, *args, "-c", textwrap.dedent(code)] if code else [sys.executable, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_the_alias_is_installed_before_transformers_or_accelerate_decide() -> None:
    """transformers' and accelerate's DeepSpeed integrations decide at their first import whether deepspeed exists
    (accelerate.utils exports DeepSpeedSchedulerWrapper, HfDeepSpeedConfig's base is DeepSpeed's, only then), so
    importing hybridzero.as_deepspeed must not import them before the alias is in place."""
    _python(
        """
        import sys
        import hybridzero.as_deepspeed
        early = [m for m in ("accelerate", "transformers.integrations", "transformers.trainer") if m in sys.modules]
        assert not early, early
        import accelerate.utils
        from transformers.integrations.deepspeed import HfDeepSpeedConfig
        assert hasattr(accelerate.utils, "DeepSpeedSchedulerWrapper")
        assert HfDeepSpeedConfig.__mro__[1] is not object, HfDeepSpeedConfig.__mro__
        """
    )


def test_alias_satisfies_hf_detection_and_serves_every_touched_name() -> None:
    out = _python(
        f"""
        import hybridzero.as_deepspeed
        import importlib, importlib.metadata, importlib.util, pytest

        def resolve(dotted):
            parts = dotted.split(".")
            for i in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                    break
                except ModuleNotFoundError:
                    continue
            for attr in parts[i:]:
                obj = getattr(obj, attr)
            return obj

        assert hybridzero.as_deepspeed.ACTIVE
        assert importlib.util.find_spec("deepspeed") is not None
        meta = importlib.metadata.metadata("deepspeed")
        assert meta["Name"] == "deepspeed" and "hybridzero" in meta["Summary"], dict(meta)
        version = importlib.metadata.version("deepspeed")
        import hybridzero
        assert version == "0.19.8+hybridzero." + hybridzero.__version__, version
        from transformers.integrations.deepspeed import is_deepspeed_available as hf
        from accelerate.utils import is_deepspeed_available as acc
        from accelerate.utils.versions import compare_versions
        assert hf() and acc() and compare_versions("deepspeed", ">=", "0.16.4")
        for name, target in {_PROVIDED!r}.items():
            assert resolve(name) is resolve(target), name
        for name in {_VALUES!r}:
            resolve(name)
        assert resolve("deepspeed.runtime.zero.partition_parameters.zero_wrapper_for_fp_tensor_constructor")(len) is len
        for name in {_STAND_INS!r}:
            with pytest.raises(NotImplementedError, match=name.replace(".", r"\\.")):
                resolve(name)()
        for name in {_UNSERVED_MODULES!r}:  # the error names the first package on the way that is not served
            with pytest.raises(ModuleNotFoundError, match="is not provided by hybridzero") as info:
                importlib.import_module(name)
            assert name.startswith(info.value.name) and str(info.value).startswith(info.value.name), name
        import deepspeed
        with pytest.raises(AttributeError, match=r"deepspeed\\.moe_layer is not provided by hybridzero"):
            deepspeed.moe_layer
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_a_real_deepspeed_is_never_shadowed(tmp_path: Path) -> None:
    fake = tmp_path / "site"
    (fake / "deepspeed").mkdir(parents=True)
    (fake / "deepspeed" / "__init__.py").write_text("REAL = True\n__version__ = '9.9.9'\n")
    (fake / "deepspeed-9.9.9.dist-info").mkdir()
    (fake / "deepspeed-9.9.9.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: deepspeed\nVersion: 9.9.9\n"
    )
    check = """
        import importlib.metadata, deepspeed
        assert deepspeed.REAL and importlib.metadata.version("deepspeed") == "9.9.9"
        print("real")
    """
    # installed while the real one is on sys.path: the alias refuses, with a warning
    out = _python(
        "import warnings\nwith warnings.catch_warnings(record=True) as w:\n    warnings.simplefilter('always')\n"
        "    import hybridzero.as_deepspeed as a\n"
        "assert not a.ACTIVE and 'DeepSpeed is installed' in str(w[0].message)\n" + textwrap.dedent(check),
        path=(fake,),
    )
    assert out.strip() == "real"
    # installed first, the real one appears on sys.path later: the path finder still answers first
    out = _python(
        f"import sys, hybridzero.as_deepspeed as a\nassert a.ACTIVE\nsys.path.insert(0, {str(fake)!r})\n"
        + textwrap.dedent(check)
    )
    assert out.strip() == "real"


def test_runner_runs_a_script_with_the_alias(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    (tmp_path / "helper_mod.py").write_text("X = 7\n")
    script.write_text("import sys, deepspeed, helper_mod\nprint(deepspeed.__version__, sys.argv[1:], helper_mod.X)\n")
    out = _python("", "-m", "hybridzero.as_deepspeed", str(script), "--flag", "v")
    assert out.split()[0].startswith("0.19.8+hybridzero.") and "['--flag', 'v'] 7" in out


def test_config_reads_as_deepspeed_json_and_takes_hf_never_interval() -> None:
    """Accelerate writes ``steps_per_print = inf`` ("never"); transformers reads ``engine.config.get(...)``."""
    from hybridzero.config import load_config

    raw = {"train_batch_size": 2, "steps_per_print": float("inf"), "zero_optimization": {"stage": 3}}
    cfg = load_config(raw, 1)
    assert cfg.steps_per_print > 10**15
    assert cfg.get("zero_optimization", {}).get("stage") == 3 and cfg.get("nothing", 7) == 7


def test_accelerate_maps_a_torch_adagrad_to_deepspeeds_cpu_adagrad() -> None:
    """accelerate's optimizer-offload path swaps a torch optimizer for DeepSpeed's CPU class of the same kind
    (``map_pytorch_optim_to_deepspeed``): Adagrad -> ``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``, served here. It
    passes ``adamw_mode=False``, which DeepSpeed 0.19.8's class refuses with a TypeError; hybridzero's accepts it."""
    _python(
        """
        import hybridzero.as_deepspeed
        import torch
        from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed
        from hybridzero.ops.adagrad import DeepSpeedCPUAdagrad
        from hybridzero.ops.adam import DeepSpeedCPUAdam
        params = [torch.nn.Parameter(torch.ones(3))]
        mapped = map_pytorch_optim_to_deepspeed(torch.optim.Adagrad(params, lr=0.05, weight_decay=0.01))
        assert type(mapped) is DeepSpeedCPUAdagrad, type(mapped)
        assert mapped.defaults["lr"] == 0.05 and mapped.defaults["weight_decay"] == 0.01, mapped.defaults
        assert type(map_pytorch_optim_to_deepspeed(torch.optim.AdamW(params))) is DeepSpeedCPUAdam
        """
    )

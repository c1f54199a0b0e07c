"""``hybridzero plan`` without processes: the published figures it must reproduce (ZeRO's 16 Psi/N, DeepSpeed's
ZeRO-3 estimate, the ZeRO++ paper's cross-node volumes), its profiles and inputs, the CLI (table, JSON, --rlhf,
--search) and its errors. Exactness against real engines: tests/distributed/test_plan_exactness.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridzero.cli import main
from hybridzero.plan.model import LoRAPlan, load_hf_config, meta_model
from hybridzero.plan.planner import Cluster, Workload, plan_model
from hybridzero.plan.profiles import device_profile, link_profile, links_for
from hybridzero.plan.roofline import link_class, ring_steps, transformer_flops

RAW: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
    "fp16": {"enabled": True},
}


@pytest.fixture(scope="module")
def llama7b() -> tuple[Any, Any]:
    hf = load_hf_config("llama-7b")
    return meta_model(hf), hf


def _cluster(nodes: int, gpus: int = 8, device: str = "a100-80gb") -> Cluster:
    return Cluster(nodes, gpus, device_profile(device), links_for(device))


def _zero(**zero: Any) -> dict[str, Any]:
    return {**RAW, "zero_optimization": {**RAW["zero_optimization"], **zero}}


def test_sixteen_psi_over_n(llama7b: tuple[Any, Any]) -> None:
    """ZeRO (Rajbhandari et al. 2020): mixed-precision Adam model states are 16 Psi / N per rank at stage 3; the
    plan's master + gradients + optimizer state equal it exactly for Llama-7B (its numels divide evenly)."""
    model, hf = llama7b
    psi = sum(p.numel() for p in model.parameters())
    assert psi == 6_738_415_616  # the public Llama-7B size: the known shape is right
    for nodes in (1, 8):
        m = plan_model(model, hf, RAW, _cluster(nodes), Workload(2048))["memory"]
        assert m["master_weights"] + m["gradients"] + m["optimizer_state"] == 16 * psi // (8 * nodes)
        assert m["parameters"] == 0  # no persistent group, ZeRO-3 keeps no compute-dtype shard


def test_deepspeed_zero3_estimate_difference_is_explained(llama7b: tuple[Any, Any]) -> None:
    """DeepSpeed's estimate_zero3_model_states_mem_needs (no offload) is 4 x largest_layer + 18 Psi / N. The plan's
    device bytes are 16 Psi / N (no fp16 parameter shard: it is cast from the master at each gather) plus the peak
    gathered buffers the prefetch / reuse settings allow (instead of one fp32 largest layer)."""
    model, hf = llama7b
    psi = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    n = 64
    ds = 4 * largest + int(18 * psi / n)
    m = plan_model(model, hf, RAW, _cluster(8), Workload(2048))["memory"]
    states = sum(v for v in m["placement"]["device"].values())
    assert states == ds - 4 * largest - 2 * psi // n  # the differences, exactly: fp16 shard and largest layer
    # gathered at peak (fp16): the root group (embedding + head = 2 x largest) and the blocks within
    # stage3_max_reuse_distance (1e9 elements) of the forward's end, kept gathered for the backward
    assert 2 * 2 * largest < m["gathered_peak"] <= 2 * (2 * largest + 1_000_000_000)


def test_zeropp_cross_node_volume(llama7b: tuple[Any, Any]) -> None:
    """ZeRO++ (Wang et al. 2023): ZeRO-3 moves 3 M across nodes per step (M = fp16 model bytes); qwZ halves the
    forward gather (int8 + one fp32 scale per block), hpZ keeps the backward gather inside the node, qgZ int4 sends
    one int4 partial sum per node across nodes -- 0.25 M per node, 0.25 M / L per rank."""
    model, hf = llama7b
    big_m = 2 * sum(p.numel() for p in model.parameters())

    def inter(**zero: Any) -> dict[str, float]:
        # nothing kept from forward into backward (no reuse, no prefetch bucket: DeepSpeed's prefetcher keeps what
        # it would fetch again within its bucket), so the backward gathers the whole model again
        zero = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0, **zero}
        plan = plan_model(model, hf, _zero(**zero), _cluster(4), Workload(2048))
        out = {"forward": 0.0, "backward": 0.0, "reduce": 0.0}
        for r in plan["collectives"]:
            if r["link"] == "inter" and r["phase"] != "step":
                key = "reduce" if r["collective"] in ("reduce_scatter", "grad_all_gather") else r["phase"]
                out[key] += r["bytes"] / big_m
        return out

    base = inter()
    assert base == pytest.approx({"forward": 1.0, "backward": 1.0, "reduce": 1.0}, abs=2e-3)
    zpp = inter(
        zero_quantized_weights=True,
        zero_hpz_partition_size=8,
        zero_quantized_gradients=True,
        zero_quantized_gradients_bits=4,
    )
    assert zpp["forward"] == pytest.approx(0.5 * (1 + 4 / 2048), rel=1e-3)  # int8 + an fp32 scale per 2048
    assert zpp["backward"] == 0.0
    assert zpp["reduce"] * 8 == pytest.approx(0.25, rel=0.05)  # per node: the paper's 0.25 M


def test_profiles_and_links() -> None:
    with pytest.raises(ValueError, match="valid: .*h100"):
        device_profile("h1000")
    with pytest.raises(ValueError, match="known profile or a number"):
        link_profile("infiniband")
    assert link_profile("100").gbps == 12.5  # 100 Gb/s
    links = links_for("h100", "inter=eth-100")
    assert (links.intra.name, links.inter.name) == ("nvlink4", "eth-100")
    with pytest.raises(ValueError, match="intra=NAME"):
        links_for("h100", "cross=ib-200")
    assert device_profile("h200").memory_gib == 141
    assert link_class("world", 1) == "intra" and link_class("world", 2) == "inter" and link_class("hpz", 4) == "intra"
    assert ring_steps("all_reduce", 4) == 6 and ring_steps("all_gather", 4) == 3 and ring_steps("all_gather", 1) == 0


def test_flops_count_frozen_weights_once() -> None:
    """LoRA: frozen weights need input gradients (2 P) but no weight gradients; trained ones both (6 P total)."""
    full = transformer_flops(100, 100, 0, 0, tokens=10, seq_len=5, checkpointing=False)
    frozen = transformer_flops(100, 0, 0, 0, tokens=10, seq_len=5, checkpointing=True)
    assert full.total == 6 * 100 * 10
    assert frozen.backward == 2 * 100 * 10 and frozen.recompute == frozen.forward


def test_model_inputs(tmp_path: Path) -> None:
    hf = load_hf_config("opt-350m")
    assert hf.word_embed_proj_dim == 512
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "vocab_size": 101,
            }
        )
    )
    for arg in (tmp_path, tmp_path / "config.json"):
        assert load_hf_config(str(arg)).hidden_size == 64
    with pytest.raises(ValueError, match="neither a known shape"):
        load_hf_config(str(tmp_path / "missing"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="no 'model_type'"):
        load_hf_config(str(tmp_path / "bad.json"))
    lora = meta_model(load_hf_config(str(tmp_path)), lora=LoRAPlan("mlp", 4))
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)


def _config(tmp_path: Path, **zero: Any) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_zero(**zero)))
    return str(path)


def test_cli_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "bench-llama", "--config", _config(tmp_path), "--nodes", "2", "--gpus_per_node", "2"]
    assert main([*args, "--device", "cpu", "--seq_len", "64", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| master weights |" in text and "inter-node total" in text and "step time (roofline)" in text
    plan = json.loads(out.read_text())
    assert plan["config"]["stage"] == 3 and plan["by_link"]["inter"]["calls"] > 0
    assert plan["memory"]["device_total"] > plan["memory"]["master_weights"] > 0


def test_cli_rlhf_and_search(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path)
    base = ["plan", "--model", "bench-llama", "--config", cfg, "--nodes", "1", "--gpus_per_node", "2"]
    out = tmp_path / "rlhf.json"
    assert (
        main(
            [
                *base,
                "--rlhf",
                "actor=bench-llama,critic=opt-350m",
                "--json",
                str(out),
                "--prompt_len",
                "8",
                "--answer_len",
                "8",
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert set(result["models"]) == {"actor", "critic", "reference", "reward"}
    assert result["models"]["reference"]["trainable_parameters"] == 0 and result["fits"]
    assert result["models"]["actor"]["generation"]["kv_cache_bytes"] > 0
    assert "## RLHF step" in capsys.readouterr().out
    found = tmp_path / "search.json"
    assert main([*base, "--search", "--top", "3", "--seq_len", "64", "--json", str(found)]) == 0
    ranked = json.loads(found.read_text())["search"]
    assert len(ranked) == 3
    speeds = [p["tokens_per_s_per_rank"] for p in ranked]
    assert speeds == sorted(speeds, reverse=True)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "llama-8b"], "neither a known shape"),
        (["--device", "tpu"], "is not a known profile"),
        (["--link", "intra=carrier-pigeon"], "carrier-pigeon"),
        (["--rlhf", "policy=llama-7b"], "role=MODEL"),
        (["--lora", "mlp"], "PART:DIM"),
        (["--search", "--rlhf", "actor=bench-llama"], "does not combine with --rlhf"),
    ],
)
def test_cli_errors_name_the_argument(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    args = {"--model": "bench-llama", "--config": _config(tmp_path), "--nodes": "1", "--gpus_per_node": "2"}
    flags = [x for x in extra if x == "--search"]
    extra = [x for x in extra if x != "--search"]
    for key, value in zip(extra[::2], extra[1::2]):
        args[key] = value
    assert main(["plan", *flags, *[x for kv in args.items() for x in kv]]) == 1
    assert message in capsys.readouterr().err


def test_cli_config_error_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config the engine would refuse at this world size is refused by the plan, naming the key."""
    cfg = _config(tmp_path, zero_hpz_partition_size=3)
    assert main(["plan", "--model", "bench-llama", "--config", cfg, "--nodes", "1", "--gpus_per_node", "4"]) == 1
    assert "zero_hpz_partition_size" in capsys.readouterr().err


def test_plan_layering() -> None:
    """``plan/`` sits above the engine's layers and below the CLI: only ``cli.py`` imports it, and it imports
    neither the RLHF pipeline nor the CLI (nor the runtime: it needs the layout rules, not an engine)."""
    import ast

    package = Path(__file__).resolve().parents[2] / "hybridzero"
    for file in package.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        rel = file.relative_to(package).as_posix()
        if rel.startswith("plan/"):
            below = ("hybridzero.rlhf", "hybridzero.cli", "hybridzero.runtime")
            assert not [n for n in names if n.startswith(below)], (rel, names)
        elif rel != "cli.py":
            assert not [n for n in names if n.startswith("hybridzero.plan")], rel


def test_rlhf_plan_with_tensor_parallel_generation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``hybrid_engine.inference_tp_size`` t: the generation phase holds the root group whole and the blocks' bytes / t
    (an estimate of runtime/tp_generate.py), adds 2 all-reduces per layer and token, and never falls back to the
    per-forward mode (the engine refuses ``max_gathered_bytes`` under TP)."""
    results = {}
    for tp in (1, 2):
        cfg = _zero()
        cfg["hybrid_engine"] = {"enabled": True, "inference_tp_size": tp}
        path = tmp_path / f"ds{tp}.json"
        path.write_text(json.dumps(cfg))
        out = tmp_path / f"rlhf{tp}.json"
        args = ["plan", "--model", "bench-llama", "--config", str(path), "--nodes", "1", "--gpus_per_node", "2"]
        assert (
            main([*args, "--rlhf", "actor=bench-llama,critic=bench-llama", "--answer_len", "8", "--json", str(out)])
            == 0
        )
        results[tp] = json.loads(out.read_text())
    whole, split = (results[t]["models"]["actor"]["generation"] for t in (1, 2))
    assert whole["tensor_parallel"] is None and results[1]["generation_mode"] == "full"
    tp = split["tensor_parallel"]
    assert results[2]["generation_mode"] == "tensor-parallel x2" and results[2]["max_gathered_bytes"] is None
    assert whole["gathered_bytes"] // 2 < tp["held_bytes"] < whole["gathered_bytes"]
    assert tp["all_reduces"] == 2 * 8 * 4  # 2 per layer (the bench model's 4) and answer token (8)
    assert "tensor-parallel generation x2 (estimate)" in capsys.readouterr().out

"""Readable tables of a plan (the JSON is the plan dict itself)."""

from __future__ import annotations

from typing import Any

__all__ = ["gib", "model_table", "rlhf_table", "search_table"]


def gib(n: float) -> str:
    """Bytes in GiB (MiB below 1 GiB), for tables."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:,.0f} B"


def _config_line(c: dict[str, Any]) -> str:
    extras = [f"hpZ {c['hpz']}" if c["hpz"] > 1 else "", "qwZ" if c["qwz"] else "", "qgZ" if c["qgz"] else ""]
    extras += [f"offload {c['offload']}" if c["offload"] != "none" else "", "ckpt" if c["checkpointing"] else ""]
    extras.append(f"Ulysses SP {c['sequence_parallel']}" if c.get("sequence_parallel", 1) > 1 else "")
    tail = ", ".join(e for e in extras if e)
    return (
        f"stage {c['stage']}, {c['dtype']}, micro {c['micro_batch']} x gas {c['gradient_accumulation']}, "
        f"seq {c['seq_len']}" + (f", {tail}" if tail else "")
    )


def model_table(plan: dict[str, Any], title: str, device_bytes: int) -> str:
    """One model's plan: memory per rank, collectives per step by link class, step time."""
    m = plan["memory"]
    lines = [
        f"## {title}: {plan['parameters'] / 1e9:.3g} B parameters ({plan['trainable_parameters'] / 1e9:.3g} B "
        f"trainable), {plan['groups']} gather groups",
        _config_line(plan["config"]),
        "",
        "| memory per rank (rank 0) | bytes | where |",
        "|---|---:|---|",
    ]
    where = {cat: place for place, cats in m["placement"].items() for cat in cats}
    for cat in ("parameters", "master_weights", "gradients", "optimizer_state"):
        lines.append(f"| {cat.replace('_', ' ')} | {gib(m[cat])} | {where.get(cat, 'device')} |")
    if m["file_total"]:
        lines.append(f"| optimizer state in files (NVMe) | {gib(m['file_total'])} | file |")
    lines += [
        f"| gathered buffers at peak | {gib(m['gathered_peak'])} | device |",
        f"| activations, no checkpointing (estimate) | {gib(m['activations']['no_checkpointing'])} | device |",
        f"| activations, checkpointing (estimate) | {gib(m['activations']['checkpointing'])} | device |",
        f"| **device total** | **{gib(m['device_total'])}** | of {gib(device_bytes)} |",
        f"| host total | {gib(m['host_total'])} | host |",
        "",
        "| collective | group | phase | link | calls | bytes | wire bytes / rank |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for r in plan["collectives"]:
        lines.append(
            f"| {r['collective']} | {r['group']} | {r['phase']} | {r['link']} | {r['calls']} | {gib(r['bytes'])} | "
            f"{gib(r['wire_bytes'])} |"
        )
    for link, tot in plan["by_link"].items():
        lines.append(
            f"| **{link}-node total** | | | | {tot['calls']} | {gib(tot['bytes'])} | {gib(tot['wire_bytes'])} |"
        )
    t = plan["step_time"]
    lines += [
        "",
        f"step time (roofline): {t['total_s']:.3f} s = compute {t['compute_s']:.3f} + exposed communication "
        f"{t['exposed_comm_s']:.3f} + optimizer {t['optimizer_s']:.3f} + offload copies {t['offload_copies_s']:.3f}",
    ]
    if "generation" in plan:
        g = plan["generation"]
        lines.append(
            f"generation ({g['prompt_tokens']} + {g['answer_tokens']} tokens): gathered {gib(g['gathered_bytes'])}, "
            f"KV cache {gib(g['kv_cache_bytes'])}, gathers {g['gather_s']:.3f} s, decode {g['decode_s']:.3f} s"
        )
        tp = g.get("tensor_parallel")
        if tp:
            lines.append(
                f"tensor-parallel generation x{tp['size']} (estimate): held {gib(tp['held_bytes'])}, peak while "
                f"cutting "
                f"{gib(tp['peak_bytes'])}, {tp['all_reduces']} all-reduces of {gib(tp['all_reduce_bytes'])} in all, "
                f"{tp['all_reduce_s']:.3f} s"
            )
    return "\n".join(lines)


def rlhf_table(result: dict[str, Any], device_bytes: int) -> str:
    """The four models' plans and the PPO step's totals."""
    parts = [model_table(p, role, device_bytes) for role, p in result["models"].items()]
    t = result["ppo_step_s"]
    verdict = "fits" if result["fits"] else "does NOT fit"
    parts.append(
        "## RLHF step\n"
        f"device per rank: resident {gib(result['device_resident_bytes'])} (four models' states) + transient "
        f"{gib(result['device_transient_bytes'])} (largest phase) = {gib(result['device_total'])} of "
        f"{gib(device_bytes)}: {verdict}\n"
        f"generation: {result['generation_mode']}{_budget(result['max_gathered_bytes'])}\n"
        f"PPO step (roofline): generation {t['generation']:.2f} s + experience {t['experience']:.2f} s + training "
        f"{t['training']:.2f} s = {t['total']:.2f} s"
    )
    return "\n\n".join(parts)


def search_table(results: list[dict[str, Any]]) -> str:
    """The ranked candidates."""
    lines = [
        "| # | configuration | device total | step s | tokens/s/rank | inter-node GiB/step |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for i, p in enumerate(results, 1):
        lines.append(
            f"| {i} | {_config_line(p['config'])} | {gib(p['memory']['device_total'])} | "
            f"{p['step_time']['total_s']:.3f} | {p['tokens_per_s_per_rank']:.0f} | "
            f"{p['by_link']['inter']['wire_bytes'] / 2**30:.2f} |"
        )
    if not results:
        lines.append("| | nothing fits: more ranks, a larger device, offload or shorter sequences | | | | |")
    return "\n".join(lines)


def _budget(max_gathered: int | None) -> str:
    """The ``max_gathered_bytes`` to pass to ``engine.generate`` (none under tensor-parallel generation)."""
    return "" if max_gathered is None else f" (max_gathered_bytes {gib(max(0, max_gathered))})"

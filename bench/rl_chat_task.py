"""The realistic-shape RL task of ``bench/bench_rl_smollm2.py``: chat prompts for an instruct model, one verifiable
reward.

A prompt asks for the sum of two numbers from 2 to 49 in the model's own chat template (system turn included, so a
prompt is ~48 tokens of SmolLM2's tokenizer); the reward is 1.0 when the last integer of the completion is the sum
(instruct models at this size tend to answer ``"a + b = c"``), plus a brevity term ``0.5 * max(0, 1 - chars / 200)``
that gives GRPO a signal while the sum is mostly wrong (SmolLM2-135M-Instruct, Q4_1, sampled at temperature 1).
Both trainers get the same rendered prompt strings (no template is applied twice) and this same function. Pure
functions only: no torch, no file writes except :func:`write_prompts`.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["QUESTION", "chat_prompts", "sum_reward", "write_prompts"]

QUESTION = "What is {a} + {b}? Reply with the number only."
_ASKED = re.compile(r"What is (\d+) \+ (\d+)\?")
_INT = re.compile(r"-?\d[\d,]*")


def chat_prompts(n: int, template: Any, seed: int = 0) -> list[str]:
    """``n`` rendered prompts; ``template`` is a tokenizer with a chat template (``apply_chat_template``)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        msgs = [{"role": "user", "content": QUESTION.format(a=a, b=b)}]
        out.append(str(template.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)))
    return out


def sum_reward(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float]:
    """1.0 when the completion's last integer (thousands commas allowed) is the sum the prompt asks for, plus
    ``0.5 * max(0, 1 - len(completion) / 200)``."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    scores = []
    for p, c in zip(prompts, completions):
        asked = _ASKED.findall(p)
        got = _INT.findall(c)
        ok = bool(asked) and bool(got) and got[-1].replace(",", "") == str(sum(map(int, asked[-1])))
        scores.append((1.0 if ok else 0.0) + 0.5 * max(0.0, 1.0 - len(c) / 200))
    return scores


def write_prompts(path: Path, prompts: Sequence[str]) -> Path:
    """``path`` as JSON lines ``{"prompt": ...}`` (the RL steps' prompt-only format)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path

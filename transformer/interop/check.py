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
    to different lengths (so that both padding masks matter). A model whose decoder starts from the pad
    token (`bos_id == pad_id`: Marian's, an imported OPUS-MT model's) reads sources as [... EOS], as
    Marian's encoder does, and its targets start from the pad token."""
    generator = torch.Generator().manual_seed(seed)
    specials = {config.pad_id, config.bos_id, config.eos_id}  # no special token inside a sentence
    limit = min(config.max_len, 14)
    src_start = [] if config.bos_id == config.pad_id else [config.bos_id]

    def sentences(vocab_size: int, lengths: list[int], start: list[int]) -> Tensor:
        ordinary = torch.tensor([i for i in range(vocab_size) if i not in specials])
        rows = [
            torch.cat(
                [
                    torch.tensor(start, dtype=torch.long),
                    ordinary[torch.randint(0, len(ordinary), (length - 2,), generator=generator)],
                    torch.tensor([config.eos_id]),
                ]
            )
            for length in lengths
        ]
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=config.pad_id)

    src = sentences(config.src_vocab_size, [limit, limit // 2, 3, limit - 3], src_start)
    tgt = sentences(config.tgt_vocab_size, [limit // 2, limit, limit - 2, 3], [config.bos_id])
    return src, tgt


def reference_log_probs(model: Seq2SeqTransformer, src: Tensor, tgt: Tensor) -> Tensor:
    """Our log-probabilities (B, T - 1, V) of each next target token, teacher-forced, float32."""
    with torch.no_grad():
        return model.eval()(src, tgt[:, :-1]).float().log_softmax(-1)

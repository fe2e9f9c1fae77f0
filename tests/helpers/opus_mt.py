"""An OPUS-MT-shaped directory's MarianTokenizer without warnings, and its weights trained to copy German."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import transformers

from tests.helpers.datasets import data_dir
from tests.helpers.pretrained import multi30k_lines


def quiet_marian_tokenizer(directory: Path) -> transformers.MarianTokenizer:
    """The directory's MarianTokenizer, loaded without transformers' warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Recommended: pip install sacremoses" (a normalizer not used here)
        return transformers.MarianTokenizer.from_pretrained(directory)


def train_to_copy(directory: Path, steps: int = 100) -> None:
    """Replace the directory's random weights by ones trained with transformers to copy German Multi30k
    sentences (truncated to 16 tokens): a `final_logits_bias` and a `<pad>` embedding (the decoder's start)
    drawn at random first, so that leaving either out of an export would show."""
    tokenizer = quiet_marian_tokenizer(directory)
    config = transformers.MarianConfig.from_pretrained(directory)
    generation = transformers.GenerationConfig.from_pretrained(directory)
    lines = multi30k_lines(data_dir("MULTI30K_DIR"), "train.de.gz", 1984)
    batch = tokenizer(lines, return_tensors="pt", padding=True, truncation=True, max_length=16)
    labels = batch.input_ids.masked_fill(batch.attention_mask.eq(0), -100)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.MarianMTModel(config)
        with torch.no_grad():
            model.final_logits_bias.normal_(0.0, 0.5)
            model.get_input_embeddings().weight[config.pad_token_id].normal_(0.0, 0.02)  # never updated
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(steps):
            rows = slice((step * 32) % 1984, (step * 32) % 1984 + 32)
            loss = model(
                input_ids=batch.input_ids[rows],
                attention_mask=batch.attention_mask[rows],
                labels=labels[rows],
            ).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.generation_config = generation
    model.eval().save_pretrained(directory)

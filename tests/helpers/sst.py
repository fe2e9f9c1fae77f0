"""A tiny SST-2-like directory and the overrides that train a tiny classifier on it in seconds."""

from __future__ import annotations

from pathlib import Path


def write_sst(data: Path) -> Path:
    """A tiny SST-2-like directory (GLUE layout): train, dev, and an unlabeled test."""
    data.mkdir()
    good, bad = (
        ["a great fun film", "warm and funny", "a moving story"],
        ["a dull mess", "boring and flat", "awful"],
    )
    rows = [
        (f"{text} {i}", label) for i in range(20) for label, texts in ((1, good), (0, bad)) for text in texts
    ]
    (data / "train.tsv").write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows))
    (data / "dev.tsv").write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows[:30]))
    # GLUE ships its test split without labels
    (data / "test.tsv").write_text(
        "index\tsentence\n" + "".join(f"{i}\t{t}\n" for i, (t, _) in enumerate(rows[:10]))
    )
    return data


TINY_SST = [
    "data.vocab_size=100",
    "data.max_tokens=128",  # several batches per epoch
    "model.config.d_model=32",
    "model.config.n_heads=2",
    "model.config.d_ff=64",
    "model.config.n_encoder_layers=1",
    "model.scheduler.warmup_steps=2",
    "trainer.max_epochs=2",
    "trainer.num_sanity_val_steps=0",
]

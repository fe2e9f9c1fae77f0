"""Translation checkpoints with random weights for the benchmarks that read one, saved in the layout
train.py writes (what `restore_model`, `load_source` and `transformer.inference` read): a tiny one for the
`--smoke` modes (bench_student, constraints_eval, bench_decode --export-ckpt, serve.load), a joint BPE
trained on Multi30k's first training lines; and one of the `multi30k_de_en` recipe's shape (serve.load),
its shape and vocabulary size read from configs/experiment/multi30k_de_en.yaml, its joint BPE trained on
all of Multi30k's training pairs."""

from __future__ import annotations

import gzip
import itertools
from pathlib import Path

import torch

from data.tokenization import train_bpe
from transformer.config import TransformerConfig
from transformer.evaluation.restore import DATAMODULES
from transformer.model import Seq2SeqTransformer

SMOKE_LINES = 400  # Multi30k training pairs the tokenizer learns from
SMOKE_VOCAB = 300
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPE = CONFIGS / "experiment" / "multi30k_de_en.yaml"  # serve.load's model shape


def _lines(path: Path, n: int | None) -> list[str]:
    """The first `n` lines of a gzipped text file (None: all of them), stripped."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [line.strip() for line in itertools.islice(handle, n)]


def smoke_checkpoint(path: Path, data_dir: str | Path, *, seed: int = 0, d_model: int = 32) -> Path:
    """Write a de -> en checkpoint of a 1+1-layer model with random weights (`seed`) to `path`."""
    data_dir = Path(data_dir)
    texts = _lines(data_dir / "train.de.gz", SMOKE_LINES) + _lines(data_dir / "train.en.gz", SMOKE_LINES)
    tokenizer = train_bpe(texts, SMOKE_VOCAB)
    vocab = tokenizer.vocab_size
    config = TransformerConfig(
        src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=d_model, n_heads=2, n_encoder_layers=1,
        n_decoder_layers=1, d_ff=2 * d_model, dropout=0.0, max_len=128,
    )  # fmt: skip
    decoding = {"beam_size": 2, "length_penalty": 0.6, "max_len_a": 0.0, "max_len_b": 8}
    return _save(path, config, tokenizer, decoding, seed)


def recipe_checkpoint(path: Path, data_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a de -> en checkpoint shaped like `experiment=multi30k_de_en` (model/translation.yaml's config
    under the recipe's, the recipe's vocabulary size; a joint BPE trained on Multi30k's training pairs, as
    its datamodule trains it) with random weights (`seed`) to `path`; its decoding: the validation decoding
    of model/translation.yaml (greedy, at most 1.2 x source length + 10 tokens)."""
    from omegaconf import OmegaConf

    model, recipe = OmegaConf.load(CONFIGS / "model" / "translation.yaml"), OmegaConf.load(RECIPE)
    data = OmegaConf.merge(OmegaConf.load(CONFIGS / "data" / "multi30k.yaml"), recipe.data)
    data_dir = Path(data_dir)
    texts = _lines(data_dir / "train.de.gz", None) + _lines(data_dir / "train.en.gz", None)
    tokenizer = train_bpe(texts, int(data.vocab_size), min_frequency=int(data.min_frequency))
    vocab = tokenizer.vocab_size
    shape = OmegaConf.to_container(OmegaConf.merge(model.config, recipe.model.config))
    config = TransformerConfig(src_vocab_size=vocab, tgt_vocab_size=vocab, **{**shape, "dropout": 0.0})
    return _save(path, config, tokenizer, OmegaConf.to_container(model.decoding), seed)


def _save(path: Path, config: TransformerConfig, tokenizer: object, decoding: dict, seed: int) -> Path:
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(config).eval()
    checkpoint = {
        "state_dict": {f"model.{name}": tensor for name, tensor in model.state_dict().items()},
        "hyper_parameters": {"config": config.to_dict(), "decoding": decoding, "label_smoothing": 0.1},
        DATAMODULES["translation"]: {"tokenizers": {"joint": tokenizer.to_json()}},
        "config": {
            "model": {"_target_": "transformer.training.TranslationTask"},
            "data": {"src_lang": "de", "tgt_lang": "en"},
        },
        "global_step": 0,
        "epoch": 0,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, path)
    return path

"""A tiny one-to-many OPUS-MT directory (issue 65 item 4), made locally as `save_pretrained` writes one and as
OPUS-MT's multilingual vocabularies are built: </s> = 0, <unk> = 1, the target-language labels `>>deu<<`,
`>>fra<<`, `>>spa<<` as pieces of the shared vocabulary, then the SentencePiece pieces, <pad> last. The
SentencePiece models are trained on the synthetic task's English and German (no download, no Multi30k);
the weights are drawn at random (sharp enough that the label changes the output)."""

from __future__ import annotations

import json
from pathlib import Path

import sentencepiece
import torch
import transformers

from data.synthetic import make_synthetic_splits

EOS, UNK = 0, 1
LABELS = {"deu": ">>deu<<", "fra": ">>fra<<", "spa": ">>spa<<"}
SOURCES = ["Today she buys fourteen green balls.", "Yesterday we had one dog.", "They bought one car."]


def _train_spm(path: Path, lines: list[str], vocab_size: int) -> None:
    text = path.with_suffix(".txt")
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(path.with_suffix("")), vocab_size=vocab_size,
        model_type="unigram", character_coverage=1.0, bos_id=-1, eos_id=-1, unk_id=0, minloglevel=2,
    )  # fmt: skip
    path.with_suffix(".model").rename(path)
    for leftover in (text, path.with_suffix(".vocab")):
        leftover.unlink()


def multilingual_opus_mt_directory(directory: Path, seed: int = 0, labels: dict[str, str] = LABELS) -> Path:
    """source.spm, target.spm, vocab.json (with `labels`), tokenizer_config.json (en -> mul), config.json,
    weights and generation_config.json of a tiny MarianMTModel in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    english, german = make_synthetic_splits(seed, {"train": 800})["train"]
    _train_spm(directory / "source.spm", english, 100)
    _train_spm(directory / "target.spm", german, 100)
    pieces: dict[str, None] = {}
    for name in ("source.spm", "target.spm"):
        processor = sentencepiece.SentencePieceProcessor(model_file=str(directory / name))
        pieces.update((processor.id_to_piece(i), None) for i in range(1, processor.get_piece_size()))
    words = [piece for piece in pieces if piece not in ("</s>", "<unk>", "<pad>")]
    vocab = {"</s>": EOS, "<unk>": UNK}
    for label in labels.values():
        vocab[label] = len(vocab)
    first = len(vocab)
    vocab.update((piece, first + i) for i, piece in enumerate(words))
    vocab["<pad>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    settings = {"tokenizer_class": "MarianTokenizer", "separate_vocabs": False, "source_lang": "en",
                "target_lang": "mul"}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    pad = vocab["<pad>"]
    config = transformers.MarianConfig(
        vocab_size=len(vocab), decoder_vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        activation_function="swish", pad_token_id=pad, eos_token_id=EOS, bos_token_id=EOS,
        decoder_start_token_id=pad, forced_eos_token_id=EOS, max_position_embeddings=128,
        scale_embedding=True, share_encoder_decoder_embeddings=True,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.MarianMTModel(config).eval()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "embed_positions" not in name:  # the sinusoid tables Marian rebuilds itself
                    parameter.normal_(0.0, 0.3)
            model.final_logits_bias.normal_()
            model.final_logits_bias[0, EOS] += 1.0  # sentences end at several lengths
    model.generation_config = transformers.GenerationConfig(
        num_beams=1, max_length=64, bad_words_ids=[[pad]], decoder_start_token_id=pad, eos_token_id=EOS,
        pad_token_id=pad, forced_eos_token_id=EOS,
    )  # fmt: skip
    model.save_pretrained(directory)
    return directory

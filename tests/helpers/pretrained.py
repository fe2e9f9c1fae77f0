"""A tiny OPUS-MT model directory, made locally as `save_pretrained` writes one, for the import tests.

`opus_mt_directory` trains a German and an English SentencePiece (unigram) model on Multi30k's training
text, builds one vocabulary from the pieces of both as OPUS-MT's are built (</s> = 0, <unk> = 1, a language
code, the pieces, <pad> last; a few German pieces left out so that <unk> also comes from the vocabulary),
and saves a MarianMTModel shaped like OPUS-MT's (SiLU feed-forward, final_logits_bias, shared embeddings,
the decoder starting from <pad>) with random weights and a generation config that bans <pad>.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import sentencepiece
import tokenizers
import torch
import transformers

EOS, UNK = 0, 1


def multi30k_lines(data_dir: Path, name: str, n: int) -> list[str]:
    with gzip.open(data_dir / name, "rt", encoding="utf-8") as handle:
        return [next(handle).rstrip("\n") for _ in range(n)]


def train_spm(path: Path, lines: list[str], vocab_size: int) -> None:
    text = path.with_suffix(".txt")
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(path.with_suffix("")), vocab_size=vocab_size,
        model_type="unigram", character_coverage=1.0, bos_id=-1, eos_id=-1, unk_id=0, minloglevel=2,
    )  # fmt: skip
    path.with_suffix(".model").rename(path)
    for leftover in (text, path.with_suffix(".vocab")):
        leftover.unlink()


def spm_words(directory: Path) -> list[str]:
    """The pieces of `directory`'s source.spm then target.spm, once each, without </s>, <unk> and <pad>."""
    pieces: dict[str, None] = {}
    for name in ("source.spm", "target.spm"):
        processor = sentencepiece.SentencePieceProcessor(model_file=str(directory / name))
        pieces.update((processor.id_to_piece(i), None) for i in range(1, processor.get_piece_size()))
    return [piece for piece in pieces if piece not in ("</s>", "<unk>", "<pad>")]


def opus_mt_tokenizer_files(directory: Path, data_dir: Path) -> dict[str, int]:
    """source.spm, target.spm, vocab.json and tokenizer_config.json (de -> en) in `directory`; the vocab."""
    directory.mkdir(parents=True, exist_ok=True)
    train_spm(directory / "source.spm", multi30k_lines(data_dir, "train.de.gz", 3000), 400)
    train_spm(directory / "target.spm", multi30k_lines(data_dir, "train.en.gz", 3000), 300)
    words = spm_words(directory)[:-5]
    vocab = {"</s>": EOS, "<unk>": UNK, ">>deu<<": 2, **{p: i + 3 for i, p in enumerate(words)}}
    vocab["<pad>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    settings = {"tokenizer_class": "MarianTokenizer", "separate_vocabs": False, "source_lang": "de",
                "target_lang": "en"}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return vocab


def opus_mt_directory(directory: Path, data_dir: Path, seed: int = 0) -> Path:
    """A complete tiny OPUS-MT de -> en directory (tokenizer files, config, weights, generation config)."""
    vocab = opus_mt_tokenizer_files(directory, data_dir)
    return tiny_marian(directory, vocab, seed, eos_bias=4.0, num_beams=4, max_length=128)


def tiny_marian(
    directory: Path, vocab: dict[str, int], seed: int, *, eos_bias: float, num_beams: int, max_length: int
) -> Path:
    """A tiny MarianMTModel over `vocab` (shared, <pad> its pad and decoder start), its weights drawn with
    `seed`, saved in `directory` with its generation config."""
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
            model.final_logits_bias[0, EOS] += eos_bias  # sentences end at several lengths
    model.generation_config = transformers.GenerationConfig(
        num_beams=num_beams, max_length=max_length, bad_words_ids=[[pad]], decoder_start_token_id=pad,
        eos_token_id=EOS, pad_token_id=pad, forced_eos_token_id=EOS,
    )  # fmt: skip
    model.save_pretrained(directory)
    return directory


# -- BERT-family classifiers ---------------------------------------------------------------------------------
# special tokens in an order that gives them ids other than ours (bert-base: [PAD] 0, [UNK] 100, [CLS] 101,
# [SEP] 102), so that a hard-coded id shows up as a wrong logit
BERT_SPECIALS = ["[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def sst2_lines(data_dir: Path, split: str, n: int) -> list[str]:
    """The first `n` sentences of SST-2's `split` (GLUE layout: dev.tsv, train.tsv.gz)."""
    path = data_dir / f"{split}.tsv"
    opener = open if path.is_file() else gzip.open
    with opener(path if path.is_file() else data_dir / f"{split}.tsv.gz", "rt", encoding="utf-8") as handle:
        next(handle)  # sentence<TAB>label
        return [next(handle).rstrip("\n").rsplit("\t", 1)[0] for _ in range(n)]


def bert_tokenizer_files(directory: Path, data_dir: Path, *, lowercase: bool = True) -> int:
    """A WordPiece vocabulary trained on SST-2 text, saved by transformers' BertTokenizerFast (tokenizer.json,
    tokenizer_config.json) plus vocab.txt; returns its size."""
    from tokenizers import BertWordPieceTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    wordpiece = BertWordPieceTokenizer(lowercase=lowercase)
    wordpiece.train_from_iterator(
        sst2_lines(data_dir, "train", 3000), vocab_size=600, special_tokens=BERT_SPECIALS, show_progress=False
    )
    wordpiece.save_model(str(directory))  # vocab.txt
    # from the trained pipeline itself (transformers 5 builds an empty vocabulary from `vocab_file=`)
    trained = tokenizers.Tokenizer.from_str(wordpiece.to_str())
    fast = transformers.BertTokenizerFast(tokenizer_object=trained, do_lower_case=lowercase)
    fast.save_pretrained(directory)
    return wordpiece.get_vocab_size()


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that every part of the model moves the logits (transformers' init, std 0.02,
    would leave a classifier's outputs nearly constant and a mapping error invisible)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if "LayerNorm" in name or "layer_norm" in name:
                parameter.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.2 * noise)
            else:
                parameter.copy_(0.3 * noise)


def bert_directory(
    directory: Path,
    data_dir: Path,
    *,
    model_type: str = "bert",
    head: bool = True,
    num_labels: int = 3,
    vocab_txt_only: bool = False,
    seed: int = 0,
    **overrides: object,
) -> Path:
    """A tiny BERT (or DistilBERT) directory as `save_pretrained` writes one: hidden 32, 2 layers, 2 heads,
    random weights, a WordPiece tokenizer trained on SST-2 text. `head`: BertForSequenceClassification with
    `num_labels` classes, else BertModel (pooler included); `vocab_txt_only`: no tokenizer.json (older
    hub directories); `overrides`: config values (for the refusals)."""
    vocab_size = bert_tokenizer_files(directory, data_dir)
    if vocab_txt_only:
        (directory / "tokenizer.json").unlink()
    if model_type == "distilbert":
        config = transformers.DistilBertConfig(
            vocab_size=vocab_size, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=128,
            num_labels=num_labels, pad_token_id=0, **overrides,
        )  # fmt: skip
        cls = transformers.DistilBertForSequenceClassification if head else transformers.DistilBertModel
    else:
        config = transformers.BertConfig(
            vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=128, type_vocab_size=2, num_labels=num_labels,
            pad_token_id=0, **overrides,
        )  # fmt: skip
        cls = transformers.BertForSequenceClassification if head else transformers.BertModel
    model = cls(config).eval()
    _randomize(model, seed)
    model.save_pretrained(directory)
    return directory

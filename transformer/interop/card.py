"""The model card (README.md) written beside an exported model: data, recipe, the checkpoint's scores.

Only what the checkpoint itself records is stated: its resolved training config, its step and epoch,
the validation score its checkpoint callback saw, and the run's test metrics when the run's
`metrics.json` names this very file as its best checkpoint. An imported model (aiayn-import) was not
trained here: its card says where it came from (`imported_from`) in place of data and recipe.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from transformer.evaluation.scoring import corpus_scores, score_signatures
from transformer.interop.source import ExportSource

__all__ = ["model_card", "write_model_card"]

_DATA_KEYS = ("source", "data_dir", "src_lang", "tgt_lang", "train_split", "val_split", "test_split",
              "vocab_size", "joint_vocab", "max_len", "bpe_dropout")  # fmt: skip
_RECIPE_KEYS = ("init_from", "label_smoothing", "optimizer", "scheduler")  # init_from: a fine-tuning start
_TRAINER_KEYS = ("max_epochs", "max_steps", "precision", "accumulate_grad_batches", "gradient_clip_val")

_USAGE = {
    "hf": """```python
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{dir}")
model = AutoModelForSeq2SeqLM.from_pretrained("{dir}")
batch = tokenizer(["{example}"], return_tensors="pt", padding=True)
print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))
```

With transformers 4.x also `pipeline("translation", model="{dir}")` (transformers 5 removed that
pipeline). `generate()` uses `generation_config.json`: {decoding}; its length limit is the model's
max_len, since transformers has no per-sentence a * source length + b.""",
    "ctranslate2": """```python
import ctranslate2
from tokenizers import Tokenizer

translator = ctranslate2.Translator("{dir}")
source = Tokenizer.from_file("{dir}/{src_tokenizer}")
target = Tokenizer.from_file("{dir}/{tgt_tokenizer}")
tokens = source.encode("{example}", add_special_tokens=False).tokens
result = translator.translate_batch([tokens], beam_size={beam_size}, length_penalty={length_penalty})
print(target.decode([target.token_to_id(t) for t in result[0].hypotheses[0]]))
```

The model adds `<s>` and `</s>` to the source and starts the decoder from `<s>` itself. On a CPU with
several cores, `ctranslate2.Translator(..., inter_threads=cores, intra_threads=1)` and
`translate_batch(..., max_batch_size=64)` decode that many batches at once.

n-best lists and sampling (back-translation: top-k 10, one hypothesis per sample) through
CTranslate2's own options:

```python
nbest = translator.translate_batch([tokens], beam_size=4, num_hypotheses=4, return_scores=True)
for hypothesis, score in zip(nbest[0].hypotheses, nbest[0].scores):
    print(f"{{score:.4f}}", target.decode([target.token_to_id(t) for t in hypothesis]))
ctranslate2.set_random_seed(1)  # fixes the draws
samples = translator.translate_batch(
    [tokens], beam_size=1, sampling_topk=10, sampling_temperature=1.0, num_hypotheses=3
)
for hypothesis in samples[0].hypotheses:
    print(target.decode([target.token_to_id(t) for t in hypothesis]))
```""",
}

# an imported (OPUS-MT) model: its SentencePiece models tokenize, outside CTranslate2
_SENTENCEPIECE_USAGE = {
    "hf": """```python
from transformers import MarianMTModel, MarianTokenizer

tokenizer = MarianTokenizer.from_pretrained("{dir}")
model = MarianMTModel.from_pretrained("{dir}")
batch = tokenizer(["{example}"], return_tensors="pt", padding=True)
print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))
```

`generate()` uses `generation_config.json`: {decoding}; the decoder starts from `<pad>`, as Marian's;
its length limit is the model's max_len, since transformers has no per-sentence a * source length + b.""",
    "ctranslate2": """```python
import ctranslate2
import sentencepiece

translator = ctranslate2.Translator("{dir}")
source = sentencepiece.SentencePieceProcessor(model_file="{dir}/{src_tokenizer}")
detokenizer = sentencepiece.SentencePieceProcessor(model_file="{dir}/{detokenizer}")
tokens = source.encode("{example}", out_type=str)
result = translator.translate_batch(
    [tokens], beam_size={beam_size}, length_penalty={length_penalty}, suppress_sequences=[["<pad>"]]
)
pieces = [piece for piece in result[0].hypotheses[0] if piece != "<unk>"]
print(detokenizer.decode_pieces(pieces).replace("\u2581", " ").strip())
```

Tokenize outside CTranslate2, as for CTranslate2's own OPUS-MT conversions: the source SentencePiece
model's pieces, without `</s>` (the model adds it; Marian's sources have no `<s>`); a multilingual
model's target-language code goes first as one token (`[">>fra<<", *tokens]`). The decoder starts from
`<pad>`, as Marian's; `suppress_sequences` keeps `<pad>` out of the output, as transformers'
`generate` and this project's search do. Decoding drops `<unk>` and joins the pieces as transformers'
MarianTokenizer does (with `{detokenizer}`).""",
}


def _get(mapping: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(mapping, Mapping) or key not in mapping:
            return None
        mapping = mapping[key]
    return mapping


def _search_text(decoding: Mapping[str, Any]) -> str:
    beam = int(decoding.get("beam_size", 1))
    if beam == 1 or decoding.get("search") == "greedy":
        return "greedy"
    return f"beam {beam}, length penalty alpha {decoding.get('length_penalty')}"


def _decoding_text(decoding: Mapping[str, Any]) -> str:
    limit = f"{decoding.get('max_len_a')} * source length + {decoding.get('max_len_b')}"
    return f"{_search_text(decoding)}, max length {limit}"


def _signatures() -> dict[str, str]:
    """The sacreBLEU signatures of the project's metrics. A signature names the number of references,
    which sacreBLEU knows only after an evaluation: one of a single sentence against itself (1 reference,
    as in training)."""
    corpus_scores(["."], ["."])
    return score_signatures()


def _header(source: ExportSource, target: str, src_lang: str, tgt_lang: str) -> list[str]:
    imported = source.imported_from
    if imported is not None:
        return [
            f"# {imported.get('architecture', 'MarianMTModel')}, {src_lang} -> {tgt_lang}, imported",
            "",
            f"A translation model imported from `{imported.get('source')}` with `aiayn-import` (the aiayn "
            "project), not trained by this project, and exported again with "
            f"`aiayn-export {source.path.name} --to {target}`, which checks that the export computes what "
            'the checkpoint computes (see the project\'s docs/pretrained.md, "Exporting an imported model").',
            "",
        ]
    origin = source.origin
    if origin is not None:  # fine-tuned here from an import
        return [
            f"# {origin.get('architecture', 'MarianMTModel')}, {src_lang} -> {tgt_lang}, fine-tuned",
            "",
            f"A translation model imported from `{origin.get('source')}` with `aiayn-import` (the aiayn "
            "project), fine-tuned by this project, and exported with "
            f"`aiayn-export {source.path.name} --to {target}`, which checks that the export computes what "
            "the checkpoint computes.",
            "",
        ]
    return [
        f"# aiayn Transformer, {src_lang} -> {tgt_lang}",
        "",
        "An encoder-decoder Transformer (Vaswani et al., 2017) trained with the aiayn project and exported "
        "with "
        f"`aiayn-export {source.path.name} --to {target}`, which checks that the export computes what the "
        'checkpoint computes (see the project\'s README, "Export and deploy").',
        "",
    ]


def _model_section(source: ExportSource) -> list[str]:
    """Architecture, vocabulary and size."""
    config = source.config
    return [
        "## Model",
        "",
        f"- {config.n_encoder_layers} encoder + {config.n_decoder_layers} decoder layers, d_model "
        f"{config.d_model}, {config.n_heads} heads, d_ff {config.d_ff}, {config.activation}, "
        f"{'pre-LN' if config.norm_first else 'post-LN'}, {config.positional} positions, max_len "
        f"{config.max_len}",
        f"- vocabulary: {'joint' if source.joint_vocabulary else 'separate'} "
        f"{'BPE' if source.sentencepiece is None else 'SentencePiece (source.spm, target.spm)'}, "
        f"{config.src_vocab_size} source / {config.tgt_vocab_size} target tokens; embeddings tied: "
        f"{config.tie_embeddings}",
        f"- {sum(p.numel() for p in source.model.parameters()):,} parameters",
        *_labels_lines(source),
        "",
    ]


def _labels_lines(source: ExportSource) -> list[str]:
    """A multilingual model's target languages and the label each needs first in the source (issue 65)."""
    labels = (source.language_labels or {}).get("labels") or {}
    if not labels:
        return []
    shown = ", ".join(f"`{labels[lang]}` ({lang})" for lang in sorted(labels))
    first = labels[sorted(labels)[0]]
    position = (source.language_labels or {}).get("position", "start")
    example = f"A dog runs. {first}" if position == "end" else f"{first} A dog runs."
    return [
        f"- multilingual: {len(labels)} target languages, chosen by a label at the {position} of the "
        f"source: {shown}; e.g. `{example}` (the label is one token of the vocabulary)"
    ]


def _data_section(source: ExportSource, data: Mapping[str, Any]) -> list[str]:
    """The run's data settings; the vocabulary as the tokenizers have it: a fine-tuning run takes its start's
    tokenizers (an import's SentencePiece models), whatever `data.vocab_size` says, and a trained BPE may
    end below the size asked for."""
    config, joint = source.config, source.joint_vocabulary
    sizes = (
        f"{config.src_vocab_size}"
        if joint
        else f"{config.src_vocab_size} source / {config.tgt_vocab_size} target"
    )
    kind = "SentencePiece" if source.sentencepiece is not None else "BPE"
    took = _get(source.run_config, "model", "init_from")
    vocabulary = (
        f"- vocabulary: {kind}, {sizes} tokens, the tokenizers of the start (`model.init_from`)"
        if took
        else f"- vocabulary: {'joint ' if joint else ''}{kind}, {sizes} tokens"
        + (f" (`data.vocab_size`: {data['vocab_size']})" if "vocab_size" in data else "")
    )
    skipped = ("vocab_size", "joint_vocab", "bpe_dropout") if took else ("vocab_size", "joint_vocab")
    lines = [f"- `data.{key}`: {data[key]}" for key in _DATA_KEYS if key in data and key not in skipped]
    return ["## Data", "", *lines, vocabulary, ""]


def _init_from_text(source: ExportSource, path: Any) -> str:
    """`model.init_from` as the card names it: the original source of an imported start (the local file's
    path means nothing to a reader of the card), else the checkpoint's file name."""
    origin = (source.started_from or {}).get("imported_from")
    if origin:
        return (
            f"`{origin.get('source')}` (imported with aiayn-import from transformers "
            f"{origin.get('transformers')}; here the file {Path(str(path)).name})"
        )
    return json.dumps(path, default=str)


def _recipe_section(source: ExportSource) -> list[str]:
    """Tags, seed, the checkpoint's place in training, optimization and both decodings."""
    run = source.run_config
    validation = source.hparams.get("decoding") or {}
    trainer = {key: value for key, value in (run.get("trainer") or {}).items() if key in _TRAINER_KEYS}
    return [
        "## Recipe",
        "",
        f"- experiment tags: {', '.join(map(str, run.get('tags') or [])) or 'none'}; seed {run.get('seed')}",
        f"- checkpoint `{source.path.name}`: epoch {source.epoch}, global step {source.global_step}",
        *[
            f"- `model.{key}`: "
            + (_init_from_text(source, value) if key == "init_from" else json.dumps(value, default=str))
            for key in _RECIPE_KEYS
            if (value := _get(run, "model", key)) is not None
        ],
        *(  # how a fine-tuning run (model.init_from) trained: all of it, frozen parts, LoRA adapters
            [f"- `finetune`: {json.dumps(run.get('finetune'), default=str)}"]
            if _get(run, "model", "init_from")
            else []
        ),
        f"- trainer: {json.dumps(trainer, default=str)}",
        f"- validation decoding: {_decoding_text({**validation, 'search': 'auto'})}; test decoding: "
        f"{_decoding_text(source.decoding)}",
        "",
    ]


def _provenance_section(imported: Mapping[str, Any], trained: bool) -> list[str]:
    """Where an imported model came from, as aiayn-import recorded it (`trained`: trained here since)."""
    since = (
        "then trained further by this project (below)"
        if trained
        else "this project changed no weight (the transformers export holds the same weights bit for bit)"
    )
    return [
        "## Where it comes from",
        "",
        f"- source: `{imported.get('source')}` ({imported.get('architecture', 'MarianMTModel')})",
        f"- hub revision: {imported.get('revision') or 'not known (a local directory)'}",
        f"- read with transformers {imported.get('transformers')}",
        f"- training data, recipe and scores: the original model's (see its own model card); {since}",
        "",
    ]


def _scores_section(source: ExportSource, data: Mapping[str, Any]) -> list[str]:
    """The checkpoint's stored metrics as a table with their sacreBLEU signatures, or how to get them."""
    heading = ["## Scores of this checkpoint", ""]
    if not source.scores:
        how = "score it with `python evaluate.py ckpt_path=...`"
        return [*heading, f"No scores are stored with this checkpoint ({how})."]
    return [
        *heading,
        "| metric | value |",
        "|---|---|",
        *[f"| `{name}` | {value:.4g} |" for name, value in sorted(source.scores.items())],
        "",
        f"Validation metrics with the validation decoding, test metrics (split "
        f"`{data.get('test_split', 'test')}`) with the test decoding, both by this project's own search "
        "(the exported model's decoders differ slightly, see the README). sacreBLEU signatures: "
        + "; ".join(f"{name} `{signature}`" for name, signature in _signatures().items()),
    ]


def _usage_section(
    source: ExportSource, target: Literal["hf", "ctranslate2"], tokenizer_files: dict[str, str], src_lang: str
) -> list[str]:
    """How to load and run the export, and how its length penalty differs from ours."""
    beam_size = int(source.decoding.get("beam_size", 1))
    usage = _USAGE if source.sentencepiece is None else _SENTENCEPIECE_USAGE
    return [
        "",
        "## Usage",
        "",
        usage[target].format(
            dir="path/to/this/directory",
            example="Ein Hund läuft." if src_lang == "de" else "A dog runs.",
            decoding=_search_text(source.decoding),
            beam_size=beam_size,
            length_penalty=source.decoding.get("length_penalty", 1.0) if beam_size > 1 else 0.0,
            src_tokenizer=tokenizer_files.get("src", "tokenizer.json"),
            tgt_tokenizer=tokenizer_files.get("tgt", "tokenizer.json"),
            # MarianTokenizer joins the pieces of a shared vocabulary with the source model
            detokenizer=tokenizer_files.get("src" if source.joint_vocabulary else "tgt", "source.spm"),
        ),
        "",
        _length_penalty_text(source.decoding),
        "",
    ]


def _length_penalty_text(decoding: Mapping[str, Any]) -> str:
    """How the checkpoint's length normalization compares with transformers' and CTranslate2's."""
    if decoding.get("length_normalization") == "power":  # an imported model's own (docs/decoding.md)
        return (
            "Length penalty: this checkpoint's beam search divides a hypothesis' log-probability by length "
            "** alpha, length counting EOS, as transformers does; CTranslate2 counts the length without EOS, "
            "so its beam search can rank hypotheses of different lengths differently."
        )
    return (
        "Length penalty: this project's beam search divides a hypothesis' log-probability by GNMT's "
        "((5 + length) / 6) ** alpha; transformers and CTranslate2 divide by length ** alpha. The same alpha "
        "is written here, so beam search can rank hypotheses of different lengths differently."
    )


def model_card(
    source: ExportSource, target: Literal["hf", "ctranslate2"], tokenizer_files: dict[str, str]
) -> str:
    """The card's Markdown text: header, model, data, recipe, scores, usage."""
    data = source.run_config.get("data") or {}
    src_lang, tgt_lang = data.get("src_lang", "src"), data.get("tgt_lang", "tgt")
    trained = source.imported_from is None or bool(source.global_step)  # an import has trained no step
    origin = source.origin  # a fine-tuned import's too (its start's provenance)
    lines = [
        *_header(source, target, src_lang, tgt_lang),
        *_model_section(source),
        *([] if origin is None else _provenance_section(origin, trained)),
        *(_data_section(source, data) if trained else []),
        *(_recipe_section(source) if trained else []),
        *_scores_section(source, data),
        *_usage_section(source, target, tokenizer_files, src_lang),
    ]
    return "\n".join(lines)


def write_model_card(
    source: ExportSource,
    path: Path,
    *,
    target: Literal["hf", "ctranslate2"],
    tokenizer_files: dict[str, str] | None = None,
) -> None:
    path.write_text(model_card(source, target, tokenizer_files or {}), encoding="utf-8")

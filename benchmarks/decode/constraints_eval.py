"""Terminology test of constrained decoding (#39 item 6) on Multi30k de -> en validation.

    python -m benchmarks.decode.constraints_eval CKPT [--data DIR] [--sentences N] [--beam 4] [--out FILE]
    python -m benchmarks.decode.constraints_eval --smoke [CKPT]   # 16 sentences, one round

`--smoke` without a CKPT decodes with a tiny random checkpoint (`benchmarks.common.checkpoints`).

`--data`: a Multi30k directory (default: $MULTI30K_DIR).

For each sentence, up to two reference words that the unconstrained beam search missed (alphabetic, at
least 4 letters, encodable without <unk>) become its required phrases. Reported: constraint satisfaction
(token level: the phrase's pieces in the output; word level: the word among the output's
whitespace-separated words, punctuation around them stripped; required phrases end at word ends), BLEU
with and without constraints over the sentences that got constraints and over all, and the time of
constrained against unconstrained beam search at the same beam size on the constrained sentences (the
two alternated `--repeats` times, the median of each; the ratio is only as good as the machine is quiet).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import string
import tempfile
import time
from pathlib import Path

import sacrebleu
import tokenizers
import torch

from data.tokenization import BPETokenizer
from transformer.evaluation.restore import restore_model
from transformer.evaluation.scoring import checkpoint_decoding
from transformer.search.constraints import TargetRequest
from transformer.search.decoding import DecodingSettings, search


def _lines(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [line.strip() for _, line in zip(range(n), handle)]


def _decode(model, tokenizer, sources, settings, requests=None, batch=32):
    """Texts and token ids of the best hypothesis of each source, in batches of `batch`."""
    config, texts, ids = model.config, [], []
    for start in range(0, len(sources), batch):
        encoded = [tokenizer.encode(s)[: config.max_len] for s in sources[start : start + batch]]
        src = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(e) for e in encoded], batch_first=True, padding_value=config.pad_id
        )
        chunk = requests[start : start + batch] if requests is not None else None
        ends = tokenizer.word_continuations() if chunk is not None else ()
        tokens = search(model, src, settings, requests=chunk, word_continuations=ends)[0][:, 0].tolist()
        rows = [row[: row.index(config.eos_id)] if config.eos_id in row else row for row in tokens]
        ids += rows
        texts += tokenizer.decode_batch(rows)
    return texts, ids


def _terms(reference: str, hypothesis: str, tokenizer: BPETokenizer, most: int = 2) -> list[str]:
    """Reference words the hypothesis lacks (alphabetic, >= 4 letters, no <unk>), first ones first."""
    have, terms = set(hypothesis.split()), []
    for word in reference.split():
        word = word.strip(".,;:!?\"'")
        new = len(word) >= 4 and word.isalpha() and word not in have and word not in terms
        if new and tokenizer.unk_id not in tokenizer.encode(word):
            terms.append(word)
        if len(terms) == most:
            break
    return terms


def _words(text: str) -> set[str]:
    """The whitespace-separated words of `text`, punctuation around them stripped ("dog," -> "dog")."""
    return {word.strip(string.punctuation) for word in text.split()}


def _contains(ids: list[int], phrase: tuple[int, ...]) -> bool:
    return any(tuple(ids[i : i + len(phrase)]) == phrase for i in range(len(ids)))


def _timed(fn, repeats: int) -> tuple[list[float], object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return times, result


def _summary(
    references: list[str],
    free: list[str],
    free_subset: list[str],
    constrained: tuple[list[str], list[list[int]]],
    chosen: list[int],
    terms: list[list[str]],
    requests: list[TargetRequest],
    timings: dict[str, list[float]],
) -> dict[str, object]:
    """Satisfaction, BLEU with and without constraints, and the time ratio."""
    texts, ids = constrained
    n_terms = sum(len(r.include) for r in requests)
    token_met = sum(_contains(ids[k], p) for k, r in enumerate(requests) for p in r.include)
    word_met = sum(w in _words(texts[k]) for k, i in enumerate(chosen) for w in terms[i])
    combined = list(free)
    for k, i in enumerate(chosen):
        combined[i] = texts[k]
    refs_subset = [references[i] for i in chosen]
    bleu = sacrebleu.BLEU(force=True)
    median = {key: statistics.median(value) for key, value in timings.items()}
    return {
        "sentences": len(references),
        "constrained_sentences": len(chosen),
        "constraints": n_terms,
        "satisfied_tokens": token_met / max(n_terms, 1),
        "satisfied_words": word_met / max(n_terms, 1),
        "bleu_all_unconstrained": bleu.corpus_score(free, [references]).score,
        "bleu_all_with_constraints": bleu.corpus_score(combined, [references]).score,
        "bleu_subset_unconstrained": bleu.corpus_score(free_subset, [refs_subset]).score,
        "bleu_subset_constrained": bleu.corpus_score(texts, [refs_subset]).score,
        "seconds_unconstrained": timings["unconstrained"],
        "seconds_constrained": timings["constrained"],
        "time_ratio_constrained_over_unconstrained": median["constrained"] / median["unconstrained"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", type=Path, nargs="?")
    parser.add_argument(
        "--data", type=Path, default=os.environ.get("MULTI30K_DIR"), help="default: $MULTI30K_DIR"
    )
    parser.add_argument("--sentences", type=int, default=1014)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--smoke", action="store_true", help="16 sentences, one round; a tiny model if no CKPT"
    )
    args = parser.parse_args(argv)
    if args.data is None:
        parser.error("--data: no Multi30k directory given and $MULTI30K_DIR is not set")
    if args.ckpt is None and not args.smoke:
        parser.error("give the checkpoint CKPT (or --smoke)")
    if args.smoke:
        args.sentences, args.repeats = min(args.sentences, 16), 1
    with tempfile.TemporaryDirectory() as tmp:
        if args.ckpt is None:
            from benchmarks.common.checkpoints import smoke_checkpoint

            args.ckpt = smoke_checkpoint(Path(tmp) / "smoke.ckpt", args.data)
        evaluate(args)


def evaluate(args: argparse.Namespace) -> None:
    """The terminology test on `args.ckpt` (see the top); print (and write) its JSON."""
    torch.set_grad_enabled(False)
    checkpoint = torch.load(args.ckpt, map_location="cpu", weights_only=True)
    restored = restore_model(checkpoint, args.ckpt)
    model = restored.model.eval()
    saved = restored.datamodule_state["tokenizers"]
    tokenizer = BPETokenizer(tokenizers.Tokenizer.from_str(saved.get("tgt", saved.get("joint"))))
    sources, references = (
        _lines(args.data / "val.de.gz", args.sentences),
        _lines(args.data / "val.en.gz", args.sentences),
    )
    settings = DecodingSettings.from_values(
        {"beam_size": args.beam, "search": "beam"}, checkpoint_decoding(restored.hparams)
    )
    free, _ = _decode(model, tokenizer, sources, settings)
    terms = [_terms(r, h, tokenizer) for r, h in zip(references, free)]
    chosen = [i for i, t in enumerate(terms) if t]
    requests = [
        TargetRequest(include=tuple(tuple(tokenizer.encode(w)[1:-1]) for w in terms[i])) for i in chosen
    ]
    subset = [sources[i] for i in chosen]
    timings: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    constrained = free_subset = None
    for _ in range(args.repeats):  # alternated, so that a busy spell hits both
        t, (free_subset, _) = _timed(lambda: _decode(model, tokenizer, subset, settings), 1)
        timings["unconstrained"] += t
        t, constrained = _timed(lambda: _decode(model, tokenizer, subset, settings, requests), 1)
        timings["constrained"] += t
    result = {"checkpoint": str(args.ckpt), "global_step": restored.global_step, "beam": args.beam}
    result.update(_summary(references, free, free_subset, constrained, chosen, terms, requests, timings))
    result["machine"] = f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

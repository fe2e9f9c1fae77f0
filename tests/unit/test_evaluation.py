"""Scoring on a split (transformer.evaluation) and rebuilding a model from a checkpoint
(transformer.evaluation.restore).

The key property: the scores equal what the Lightning tasks log as `test/*` for the same weights and
batches, so `evaluate.py` reproduces a training run's test step.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import lightning as L
import pytest
import sacrebleu
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.helpers.evaluation import BOS, EOS, PAD, SHORT, V, detokenize, detokenize_batch, tiny_config
from transformer.checkpoint import CheckpointError
from transformer.cli.text_io import stream_lines
from transformer.evaluation.lengths import bleu_by_length, bleu_by_length_by_direction
from transformer.evaluation.restore import last_checkpoints, restore_model, task_of
from transformer.evaluation.scoring import (
    TranslationResult,
    checkpoint_decoding,
    score_classification,
    score_translation,
)
from transformer.search.decoding import DecodingSettings, decode
from transformer.training import ClassificationTask, TranslationTask


def _pad(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])


def _examples(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, V) for _ in range(rng.randint(1, 7))] for _ in range(n)]


def _translation_batches(
    examples: list[list[int]], order: list[int], size: int
) -> list[dict[str, torch.Tensor]]:
    """Copy-task batches (target = source) of the examples in `order`, `size` per batch."""
    batches = []
    for start in range(0, len(order), size):
        ids = order[start : start + size]
        seqs = [[BOS, *examples[i], EOS] for i in ids]
        batches.append(
            {
                "src": _pad(seqs),
                "tgt_in": _pad([s[:-1] for s in seqs]),
                "tgt_out": _pad([s[1:] for s in seqs]),
                "id": torch.tensor(ids),
            }
        )
    return batches


class _Tokenizer:
    decode_batch = staticmethod(detokenize_batch)


class _Data(L.LightningDataModule):
    """Serves fixed test batches and references the way the real datamodules do."""

    test_split = "test"

    def __init__(self, batches: list[dict[str, torch.Tensor]], references: list[str]) -> None:
        super().__init__()
        self.batches, self._references = batches, references
        self.tgt_tokenizer = _Tokenizer()

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None)  # each item is already a batch

    def references(self, split: str) -> list[str]:
        return self._references


def _test_step_metrics(task: L.LightningModule, datamodule: L.LightningDataModule) -> dict[str, float]:
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.test(task, datamodule=datamodule, verbose=False)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


# --- translation -------------------------------------------------------------------------------------


def _translation_setup() -> tuple[TranslationTask, list[list[int]], list[str]]:
    task = TranslationTask(tiny_config(), decoding=SHORT, label_smoothing=0.1)
    examples = _examples(23)
    # References: for half of the sentences the model's own greedy output, so BLEU is far from 0.
    src = _translation_batches(examples, list(range(23)), 23)[0]["src"]
    own = detokenize_batch(decode(task.model, src, DecodingSettings(**SHORT)).tolist())
    references = [own[i] if i % 2 == 0 else detokenize(e) for i, e in enumerate(examples)]
    return task, examples, references


def test_translation_scores_equal_the_task_test_step() -> None:
    task, examples, references = _translation_setup()
    order = list(range(len(examples)))
    random.Random(1).shuffle(order)
    batches = _translation_batches(examples, order, 5)
    logged = _test_step_metrics(task, _Data(batches, references))
    result = score_translation(
        task.model,
        batches,
        decode_ids=detokenize_batch,
        sources=[detokenize(e) for e in examples],
        references=references,
        decoding=DecodingSettings.from_values({}, task.hparams.decoding, "decode."),
        label_smoothing=0.1,
    )
    assert result.metrics["test/bleu"] > 20  # a meaningful comparison, not 0 == 0
    for name in ("bleu", "chrf", "exact_match", "loss", "nll", "ppl", "token_acc"):
        assert result.metrics[f"test/{name}"] == pytest.approx(logged[f"test/{name}"], rel=1e-5, abs=1e-6), (
            name
        )
    assert result.metrics["test/bleu"] == sacrebleu.corpus_bleu(result.hypotheses, [references]).score
    assert result.signatures["bleu"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")


def test_the_test_steps_own_decoding_settings_are_used() -> None:
    """A task may validate with greedy search and test with beam search: evaluation follows the test."""
    task = TranslationTask(
        tiny_config(), decoding=SHORT, test_decoding={"beam_size": 3, "length_penalty": 1.0}
    )
    saved = checkpoint_decoding(task.hparams)
    defaults = dict(DecodingSettings())  # search "auto", one hypothesis, no sampling or constraints
    assert dict(saved) == {**defaults, **SHORT, "beam_size": 3, "length_penalty": 1.0}
    # checkpoints from before test_decoding (and before sampling, n-best and the constraints)
    assert dict(checkpoint_decoding({"decoding": SHORT})) == {**defaults, **SHORT}
    examples = _examples(12, seed=5)
    batches = _translation_batches(examples, list(range(12)), 4)
    references = [detokenize(e) for e in examples]
    logged = _test_step_metrics(task, _Data(batches, references))
    kwargs = {
        "decode_ids": detokenize_batch,
        "sources": references,
        "references": references,
        "label_smoothing": 0.1,
    }
    result = score_translation(
        task.model, batches, decoding=DecodingSettings.from_values({}, saved, "decode."), **kwargs
    )
    assert result.metrics["test/chrf"] == pytest.approx(logged["test/chrf"], rel=1e-6)
    greedy = score_translation(
        task.model, batches, decoding=DecodingSettings.from_values({}, SHORT, "decode."), **kwargs
    )
    assert greedy.hypotheses != result.hypotheses  # the comparison can tell the two settings apart


def test_translation_results_are_in_split_order_whatever_the_batching() -> None:
    task, examples, references = _translation_setup()
    settings = DecodingSettings.from_values({}, SHORT, "decode.")
    kwargs = {
        "decode_ids": detokenize_batch,
        "sources": [detokenize(e) for e in examples],
        "references": references,
        "decoding": settings,
        "label_smoothing": 0.1,
    }
    one_by_one = score_translation(
        task.model, _translation_batches(examples, list(range(len(examples))), 1), **kwargs
    )
    shuffled = list(range(len(examples)))
    random.Random(2).shuffle(shuffled)
    packed = score_translation(task.model, _translation_batches(examples, shuffled, 7), **kwargs)
    assert packed.hypotheses == one_by_one.hypotheses
    assert packed.hypothesis_ids == one_by_one.hypothesis_ids
    assert all(ids[-1] == EOS and EOS not in ids[:-1] for ids in packed.hypothesis_ids)
    for name, value in one_by_one.metrics.items():
        assert packed.metrics[name] == pytest.approx(value, rel=1e-5), name
    # sentence BLEU belongs to the sentence: a hypothesis equal to its reference scores 100
    for hyp, ref, score in zip(packed.hypotheses, references, packed.sentence_bleu):
        if hyp == ref and len(hyp.split()) >= 4:
            assert score == pytest.approx(100.0)


def test_skipped_examples_are_an_error() -> None:
    task, examples, references = _translation_setup()
    batches = _translation_batches(examples, list(range(len(examples) - 1)), 8)
    with pytest.raises(RuntimeError, match="skipped 1 examples"):
        score_translation(
            task.model,
            batches,
            decode_ids=detokenize_batch,
            sources=references,
            references=references,
            decoding=DecodingSettings.from_values({}, SHORT, "decode."),
            label_smoothing=0.1,
        )


def test_beam_search_of_width_one_is_greedy() -> None:
    task, examples, _ = _translation_setup()
    src = _translation_batches(examples, list(range(len(examples))), 32)[0]["src"]
    greedy = decode(task.model, src, DecodingSettings.from_values({"search": "greedy"}, SHORT, "decode."))
    beam = decode(task.model, src, DecodingSettings.from_values({"search": "beam"}, SHORT, "decode."))
    assert torch.equal(greedy, beam)
    wider = decode(task.model, src, DecodingSettings.from_values({"beam_size": 3}, SHORT, "decode."))
    assert wider.size(0) == src.size(0)


def test_decoding_settings() -> None:
    saved = {"beam_size": 1, "length_penalty": 0.6, "max_len_a": 1.2, "max_len_b": 10}
    assert DecodingSettings.from_values({"beam_size": None, "search": None}, saved, "decode.") == {
        **DecodingSettings(),
        **saved,
    }
    assert DecodingSettings.from_values({"beam_size": 4}, saved, "decode.")["beam_size"] == 4
    with pytest.raises(ValueError, match=r"decode\.beam_width"):
        DecodingSettings.from_values({"beam_width": 4}, saved, "decode.")
    with pytest.raises(ValueError, match=r"decode\.beam_size must be an integer >= 1, got 0"):
        DecodingSettings.from_values({"beam_size": 0}, saved, "decode.")
    with pytest.raises(ValueError, match="search=greedy"):
        DecodingSettings.from_values({"search": "greedy", "beam_size": 4}, saved, "decode.")
    with pytest.raises(ValueError, match=r"decode\.search must be one of"):
        DecodingSettings.from_values({"search": "sampling"}, saved, "decode.")
    with pytest.raises(ValueError, match=r"decode\.max_len_b must be >= 0"):
        DecodingSettings.from_values({"max_len_b": -1}, saved, "decode.")
    bad_values = {
        "top_p": [0, -0.5, 1.5, float("nan")],
        "top_k": [-1, 2.5],
        "temperature": [0, -1.0, float("inf")],
        "n_best": [0, 2],  # 2 > beam_size 1 outside sampling
        "min_len": [-1],
        "no_repeat_ngram_size": [-2],
    }
    for key, values in bad_values.items():
        for value in values:
            with pytest.raises(ValueError, match=rf"decode\.{key} must be"):
                DecodingSettings.from_values({key: value}, saved, "decode.")
    sampling = DecodingSettings.from_values({"search": "sample", "n_best": 5, "top_p": 0.9}, saved)
    assert sampling.sampling and sampling.n_best == 5 and not sampling.greedy


def test_stream_lines_keeps_one_output_line_per_input_line() -> None:
    calls: list[list[str]] = []

    def shout(texts: list[str]) -> list[str]:
        calls.append(texts)
        return [t.upper() + ("\nsecond line" if t == "b" else "") for t in texts]

    out = io.StringIO()
    written = stream_lines(io.StringIO("a\n\n  b \r\nc\nd"), out, shout, chunk_lines=2)
    assert out.getvalue() == "A\n\nB second line\nC\nD\n"
    assert written == 5
    assert calls == [["a"], ["b", "c"], ["d"]]  # blank lines never reach the model
    out = io.StringIO()
    assert stream_lines(io.StringIO("\n\n"), out, shout, chunk_lines=1) == 2 and out.getvalue() == "\n\n"
    with pytest.raises(ValueError, match="chunk_lines must be an integer >= 1"):
        stream_lines(io.StringIO("a"), out, shout, chunk_lines=0)


def test_bleu_by_length() -> None:
    sources = ["a b", "a b c d e f", "a", "a b c d e f g h i j k l"]
    references = ["x y z w", "the cat sat on the mat", "one two three four", "p q r s"]
    hypotheses = ["x y z w", "the cat sat on a mat", "nothing", "p q r s"]
    buckets = bleu_by_length(sources, hypotheses, references, [5, 10])
    assert [(b.label, b.count) for b in buckets] == [("1-5", 2), ("6-10", 1), ("11+", 1)]
    assert buckets[0].bleu == pytest.approx(
        sacrebleu.corpus_bleu(["x y z w", "nothing"], [["x y z w", references[2]]]).score
    )
    assert buckets[2].bleu == pytest.approx(100.0)
    assert sum(b.count for b in bleu_by_length(sources, hypotheses, references, [1, 2, 3])) == 4
    with pytest.raises(ValueError, match="edges"):
        bleu_by_length(sources, hypotheses, references, [0, 4])


def test_bleu_by_length_per_direction_without_counting_the_labels() -> None:
    """A multilingual split: buckets per direction, the target-language label not counted as a word."""
    sources = [">>de<< a b c d e", ">>fr<< a b c d e", ">>fr<< a b c d e f g", ">>de<< a"]
    references = ["x y z w", "le chat est sur le tapis", "p q r s", "eins zwei drei"]
    hypotheses = ["x y z w", "le chat est sur un tapis", "p q r s", "nichts"]
    directions = ["en-de", "en-fr", "en-fr", "en-de"]
    result = TranslationResult(
        metrics={},
        signatures={},
        sources=sources,
        references=references,
        hypotheses=hypotheses,
        hypothesis_ids=[[] for _ in sources],
        sentence_bleu=[0.0] * 4,
        directions=directions,
        source_labels=[">>de<<", ">>fr<<"],
    )
    whole = bleu_by_length(sources, hypotheses, references, [5], result.source_labels)
    assert [(b.label, b.count) for b in whole] == [("1-5", 3), ("6+", 1)]  # 5 words, not 6
    by_direction = bleu_by_length_by_direction(result, [5])
    assert [(b.label, b.count) for b in by_direction["en-de"]] == [("1-5", 2)]
    assert [(b.label, b.count) for b in by_direction["en-fr"]] == [("1-5", 1), ("6+", 1)]
    assert by_direction["en-de"][0].bleu == pytest.approx(
        sacrebleu.corpus_bleu([hypotheses[0], hypotheses[3]], [[references[0], references[3]]]).score
    )
    result.directions = []
    assert bleu_by_length_by_direction(result, [5]) == {}


# --- classification ----------------------------------------------------------------------------------


def test_classification_scores_equal_the_task_test_step() -> None:
    task = ClassificationTask(tiny_config(n_decoder_layers=0, tie_embeddings="none"), num_classes=3)
    examples = _examples(40, seed=3)
    labels = [len(e) % 3 for e in examples]
    batches = []
    for start in range(0, 40, 9):
        ids = list(range(start, min(start + 9, 40)))
        batches.append(
            {
                "src": _pad([[BOS, *examples[i], EOS] for i in ids]),
                "label": torch.tensor([labels[i] for i in ids]),
                "id": torch.tensor(ids),
            }
        )
    logged = _test_step_metrics(task, _Data(batches, []))
    result = score_classification(
        task.model, batches, num_examples=40, class_names=["a", "b", "c"], label_smoothing=0.0
    )
    for name in ("acc", "f1", "loss"):
        assert result.metrics[f"test/{name}"] == pytest.approx(logged[f"test/{name}"], rel=1e-5), name
    assert result.labels == labels
    correct = sum(p == g for p, g in zip(result.predictions, labels))
    assert result.metrics["test/acc"] == pytest.approx(correct / 40)
    assert sum(map(sum, result.confusion)) == 40
    assert [result.per_class[c]["support"] for c in "abc"] == [labels.count(k) for k in range(3)]
    # ECE by hand: 15 equal-width bins [k/15, (k+1)/15) of the top-class confidence, L1, weighted by size
    bins: dict[int, list[tuple[float, bool]]] = {}
    for probs, prediction, label in zip(result.probabilities, result.predictions, labels):
        bins.setdefault(int(probs[prediction] * 15), []).append((probs[prediction], prediction == label))
    ece = sum(abs(sum(c for c, _ in b) - sum(ok for _, ok in b)) for b in bins.values()) / 40
    assert result.metrics["test/ece"] == pytest.approx(ece, abs=1e-6) and ece > 0
    with torch.no_grad():
        logits = torch.cat([task.model(b["src"]) for b in batches])
    gold = torch.cat([b["label"] for b in batches])
    assert result.metrics["test/loss"] == pytest.approx(float(F.cross_entropy(logits, gold)), rel=1e-5)
    for probs, prediction in zip(result.probabilities, result.predictions):
        assert sum(probs) == pytest.approx(1.0, abs=1e-5)
        assert probs[prediction] == max(probs)


# --- restoring from checkpoints ------------------------------------------------------------------------


def _checkpoint(task: L.LightningModule, step: int = 5, **extra: object) -> dict[str, object]:
    name = type(task).__name__
    data = "TranslationDataModule" if name == "TranslationTask" else "ClassificationDataModule"
    return {
        "state_dict": task.state_dict(),
        "hyper_parameters": dict(task.hparams),
        "global_step": step,
        "epoch": 0,
        "config": {"model": {"_target_": f"transformer.training.{name}"}, "data": {}},
        data: {"tokenizers": {"joint": "{}"}},
        **extra,
    }


def test_restore_model_round_trip() -> None:
    task = TranslationTask(tiny_config())
    restored = restore_model(_checkpoint(task))
    assert restored.task == "translation"
    assert restored.datamodule_state == {"tokenizers": {"joint": "{}"}}
    assert not restored.model.training
    src = torch.tensor([[BOS, 5, 6, EOS]])
    task.eval()
    torch.testing.assert_close(restored.model(src, src[:, :-1]), task.model(src, src[:, :-1]))
    classifier = ClassificationTask(tiny_config(n_decoder_layers=0, tie_embeddings="none"), num_classes=2)
    restored = restore_model(_checkpoint(classifier))
    assert restored.task == "classification"
    assert task_of(_checkpoint(classifier)) == "classification"


def test_restore_strips_the_compile_prefix() -> None:
    task = TranslationTask(tiny_config())
    checkpoint = _checkpoint(task)
    checkpoint["state_dict"] = {
        k.replace("model.", "model._orig_mod."): v for k, v in task.state_dict().items()
    }
    assert restore_model(checkpoint).task == "translation"


def test_mixed_up_checkpoints_are_refused() -> None:
    translation = _checkpoint(TranslationTask(tiny_config()))
    classification = _checkpoint(
        ClassificationTask(tiny_config(n_decoder_layers=0, tie_embeddings="none"), num_classes=2)
    )
    swapped_config = {**translation, "config": classification["config"]}
    with pytest.raises(CheckpointError, match=r"inconsistent: .*config model\._target_ says classification"):
        restore_model(swapped_config, "x.ckpt")
    swapped_weights = {**classification, "state_dict": translation["state_dict"]}
    with pytest.raises(CheckpointError, match="weights says translation"):
        restore_model(swapped_weights, "x.ckpt")
    other_data = {k: v for k, v in translation.items() if k != "TranslationDataModule"}
    other_data["ClassificationDataModule"] = {}
    with pytest.raises(CheckpointError, match="ClassificationDataModule state says classification"):
        restore_model(other_data, "x.ckpt")
    no_hparams = {k: v for k, v in translation.items() if k != "hyper_parameters"}
    with pytest.raises(CheckpointError, match=r"not written by train\.py"):
        restore_model(no_hparams, "x.ckpt")
    bigger = {
        **translation,
        "hyper_parameters": {**translation["hyper_parameters"], "config": tiny_config(d_ff=64)},
    }
    with pytest.raises(CheckpointError, match=r"x\.ckpt: .*has shape"):
        restore_model(bigger, "x.ckpt")
    broken = {
        **translation,
        "hyper_parameters": {**translation["hyper_parameters"], "config": tiny_config(n_heads=3)},
    }
    with pytest.raises(CheckpointError, match="cannot be built: d_model"):
        restore_model(broken, "x.ckpt")


def test_last_checkpoints_follow_the_global_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    directory = run / "checkpoints"
    directory.mkdir(parents=True)
    task = TranslationTask(tiny_config())
    # names and modification times disagree with the steps on purpose
    for name, step in (("a.ckpt", 30), ("b.ckpt", 10), ("c.ckpt", 20), ("last.ckpt", 30)):
        torch.save(_checkpoint(task, step=step), directory / name)
    assert last_checkpoints(run, 2) == [directory / "c.ckpt", directory / "a.ckpt"]
    assert last_checkpoints(directory, 3) == [directory / n for n in ("b.ckpt", "c.ckpt", "a.ckpt")]
    with pytest.raises(CheckpointError, match=r"average_last=4 needs 4 .*b\.ckpt \(step 10\)"):
        last_checkpoints(run, 4)
    with pytest.raises(ValueError, match="average_last must be an integer >= 1"):
        last_checkpoints(run, 0)
    with pytest.raises(CheckpointError, match="does not exist"):
        last_checkpoints(tmp_path / "nowhere", 1)


def test_corpus_scores_cased_and_lowercased() -> None:
    from transformer.evaluation.scoring import corpus_scores, score_signatures

    refs = ["A man rides a horse on the beach .", "Two dogs play in the snow ."]
    hyps = ["a man rides a horse on the beach .", "Two dogs play in the snow ."]
    scores = corpus_scores(hyps, refs)
    assert scores["bleu_lc"] == pytest.approx(100.0) and scores["bleu"] < 100.0
    assert scores["exact_match"] == 50.0 and 0 < scores["chrf"] < 100
    signatures = score_signatures()
    assert "case:mixed" in signatures["bleu"] and "tok:13a" in signatures["bleu"]
    assert "case:lc" in signatures["bleu_lc"]
    assert corpus_scores([], []) == {"bleu": 0.0, "bleu_lc": 0.0, "chrf": 0.0, "exact_match": 0.0}


def test_ensemble_of_checks_tasks_tokenizers_and_weights() -> None:
    """evaluate.py's ensemble building: one line naming both checkpoints and what differs."""
    from pathlib import Path

    from transformer.cli.errors import ConfigError
    from transformer.cli.evaluate_steps import ensemble_of
    from transformer.evaluation.restore import RestoredModel
    from transformer.search.ensemble import Ensemble

    def member(task: str = "translation", tokenizers: str = "bpe-a") -> RestoredModel:
        model = TranslationTask(tiny_config()).model
        return RestoredModel(task, model, {}, {}, {"tokenizers": {"joint": tokenizers}})  # type: ignore[arg-type]

    paths = [Path("a.ckpt"), Path("b.ckpt")]
    single = member()
    assert ensemble_of([single], paths[:1], None) is single.model
    assert isinstance(ensemble_of([member(), member()], paths, [1.0, 3.0]), Ensemble)
    cases = {
        "b.ckpt is a classification checkpoint, a.ckpt a translation one": (
            [member(), member("classification")],
            None,
        ),
        "b.ckpt and a.ckpt have different tokenizers": ([member(), member(tokenizers="bpe-b")], None),
        "ensemble_weights has 3 values for 2 models": ([member(), member()], [1.0, 1.0, 1.0]),
        "ensemble_weights must be >= 0": ([member(), member()], [1.0, -2.0]),
        "ensemble_weights needs a list of checkpoints": ([member()], [1.0]),
    }
    for message, (members, weights) in cases.items():
        with pytest.raises(ConfigError, match=message):
            ensemble_of(members, paths[: len(members)], weights)
    # the inference API checks an ensemble with the same function, naming its own argument
    from transformer.inference import InferenceError
    from transformer.inference.loading import combined

    with pytest.raises(InferenceError, match=r"^weights has 3 values for 2 models$"):
        combined([member(), member()], paths, [1.0, 1.0, 1.0])
    with pytest.raises(
        InferenceError, match=r"^b\.ckpt is a classification checkpoint, a\.ckpt a translation"
    ):
        combined([member(), member("classification")], paths, None)


def test_data_test_sentences_keeps_the_splits_first_sentences(caplog: pytest.LogCaptureFixture) -> None:
    """evaluate.py's quick subset (`data.test_sentences=N`): the batches, sources and references of the
    scored split are its first N sentences, ids 0..N-1 (issue 51)."""
    from data.datamodules import TranslationDataModule
    from transformer.cli.errors import ConfigError
    from transformer.cli.evaluate_steps import keep_first_sentences

    def datamodule() -> TranslationDataModule:
        sizes = {"train": 200, "val": 20, "test": 30}
        dm = TranslationDataModule(synthetic_sizes=sizes, vocab_size=120, max_tokens=400, max_len=48)
        dm.setup("test")
        return dm

    whole, cut = datamodule(), datamodule()
    with caplog.at_level("INFO"):
        keep_first_sentences(cut, 7, translating=False)
    assert "Scoring the first 7 of the 30 sentences of test (data.test_sentences)" in caplog.text
    assert cut.sources("test") == whole.sources("test")[:7]
    assert cut.references("test") == whole.references("test")[:7]
    ids = sorted(i for batch in cut.test_dataloader() for i in batch["id"].tolist())
    assert ids == list(range(7))
    keep_first_sentences(whole, 100, translating=False)  # more than the split has: all of it
    assert len(whole.sources("test")) == 30
    keep_first_sentences(whole, None, translating=True)  # not given: nothing to check
    for value in (0, -1, 2.5, True, "7"):
        with pytest.raises(ConfigError, match=r"^data.test_sentences must be an integer >= 1 or null"):
            keep_first_sentences(whole, value, translating=False)
    with pytest.raises(ConfigError, match=r"^data.test_sentences cuts the scored split; translate.input"):
        keep_first_sentences(whole, 7, translating=True)

"""Issue 65 item 4 end to end: a multilingual OPUS-MT directory (tests/helpers/multilingual_opus_mt.py, made
locally: `>>deu<<`, `>>fra<<`, `>>spa<<` in its vocabulary) through `aiayn-import`: the checkpoint lists
the labels (`language_labels`) and the summary names them; `target_lang=fra` feeds the model MarianTokenizer's
ids for `>>fra<< text` and gives transformers' `generate` output and log-probabilities for them (Python and
evaluate.py); exported back to transformers, MarianTokenizer loads the labels again and encodes as the
original; the model card lists them; CTranslate2 translates with the label in the source as torch does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")

from data.datamodules import TranslationDataModule  # noqa: E402
from data.labels import LanguageLabels  # noqa: E402
from tests.helpers.cli import run_script  # noqa: E402
from tests.helpers.multilingual_opus_mt import LABELS, SOURCES, multilingual_opus_mt_directory  # noqa: E402
from tests.helpers.opus_mt import quiet_marian_tokenizer  # noqa: E402
from tests.helpers.repo import REPO_ROOT  # noqa: E402
from transformer.checkpoint import load_checkpoint  # noqa: E402
from transformer.inference import CTranslate2Translator, InferenceError, Segment, Translator  # noqa: E402
from transformer.interop.export_hf import export_hf  # noqa: E402
from transformer.interop.import_cli import import_summary, main  # noqa: E402
from transformer.interop.source import load_source  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = ["Hello world", *SOURCES]
LIMIT = {"beam_size": 1, "max_len_a": 0, "max_len_b": 12, "length_penalty": 0.0}  # raw summed log-probs


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the OPUS-MT directory, the imported model.ckpt)."""
    root = tmp_path_factory.mktemp("opus_mt_mul")
    directory = multilingual_opus_mt_directory(root / "opus-mt-en-mul")
    assert main([str(directory), "--output", str(root / "imported")]) == 0
    return directory, root / "imported" / "model.ckpt"


@pytest.fixture(scope="module")
def translator(imported: tuple[Path, Path]) -> Translator:
    return Translator.from_checkpoint(imported[1])


def _marian_log_probs(directory: Path, source: str, tokens: list[int]) -> float:
    """transformers' summed log-probability of `tokens` (EOS included) for `source`, teacher-forced."""
    tokenizer = quiet_marian_tokenizer(directory)
    model = transformers.MarianMTModel.from_pretrained(directory).eval()
    pad = model.config.pad_token_id
    batch = tokenizer([source], return_tensors="pt")
    decoder = torch.tensor([[pad, *tokens[:-1]]])
    with torch.no_grad():
        logits = model(**batch, decoder_input_ids=decoder).logits  # (1, T, V)
    return logits.log_softmax(-1)[0, torch.arange(len(tokens)), torch.tensor(tokens)].sum().item()


def test_the_checkpoint_and_the_summary_list_the_labels(imported: tuple[Path, Path]) -> None:
    saved = load_checkpoint(imported[1])
    assert LanguageLabels.from_state(saved["language_labels"]) == LanguageLabels(LABELS)
    summary = import_summary(imported[1])
    assert "target languages: deu, fra, spa; choose one with translate.target_lang=CODE" in summary


def test_target_lang_feeds_marian_tokenizers_ids_and_gets_its_outputs(
    imported: tuple[Path, Path], translator: Translator
) -> None:
    directory = imported[0]
    tokenizer = quiet_marian_tokenizer(directory)
    marian = transformers.MarianMTModel.from_pretrained(directory).eval()
    assert translator.target_languages.languages == ["deu", "fra", "spa"]
    config = translator.model.config
    scores = {}
    for lang, label in LABELS.items():
        settings = translator.settings(**LIMIT)
        [batch] = translator.decoded_batches(TEXTS, settings, target_langs=[lang] * len(TEXTS))
        for row, index in enumerate(batch.indices):
            ids = [i for i in batch.src[row].tolist() if i != config.pad_id]
            assert ids == tokenizer(f"{label} {TEXTS[index]}").input_ids  # the label first, one token
            # the search keeps every token's real log-probability (a forced EOS's too): transformers',
            # teacher-forced on the labelled source
            tokens = batch.tokens[row, 0].tolist()
            tokens = tokens[1 if tokens[0] == config.bos_id else 0 : tokens.index(config.eos_id) + 1]
            expected = _marian_log_probs(directory, f"{label} {TEXTS[index]}", tokens)
            assert batch.hypotheses[row][0].score == pytest.approx(expected, abs=1e-4)
        ours = translator.translate(TEXTS, target_lang=lang, **LIMIT)
        labelled = tokenizer([f"{label} {text}" for text in TEXTS], return_tensors="pt", padding=True)
        with torch.no_grad():
            generated = marian.generate(**labelled, num_beams=1, max_new_tokens=12, do_sample=False)
        assert [t.text for t in ours] == tokenizer.batch_decode(generated, skip_special_tokens=True)
        scores[lang] = [t.score for t in ours]
    assert scores["deu"] != scores["fra"] != scores["spa"]  # the label reaches the model
    with pytest.raises(InferenceError, match=r"^target_lang: this model is multilingual; .*: deu, fra, spa$"):
        translator.translate(TEXTS)
    with pytest.raises(InferenceError, match=r"^segment 0: target_lang: unknown target language 'fr';"):
        translator.translate([Segment("a", target_lang="fr")])


def test_evaluate_py_translate_target_lang(
    imported: tuple[Path, Path], translator: Translator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hydra import compose, initialize_config_dir

    from evaluate import evaluate

    monkeypatch.setenv("PROJECT_ROOT", str(REPO_ROOT))
    source, target = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("".join(f"{text}\n" for text in TEXTS), encoding="utf-8")
    overrides = [f"ckpt_path={imported[1]}", f"translate.input={source}", f"translate.output={target}",
                 "translate.target_lang=spa", "progress=false", f"paths.output_dir={tmp_path / 'run'}",
                 *(f"decode.{k}={v}" for k, v in LIMIT.items())]  # fmt: skip
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
        assert evaluate(compose("eval", overrides=overrides)) == {}
    expected = [t.text for t in translator.translate(TEXTS, target_lang="spa", **LIMIT)]
    assert target.read_text(encoding="utf-8").splitlines() == expected


def test_exported_back_to_transformers_with_its_labels(imported: tuple[Path, Path], tmp_path: Path) -> None:
    directory, checkpoint = imported
    export_hf(load_source(checkpoint), tmp_path / "hf")
    original, exported = quiet_marian_tokenizer(directory), quiet_marian_tokenizer(tmp_path / "hf")
    assert sorted(exported.supported_language_codes) == sorted(LABELS.values())
    for label in LABELS.values():
        for text in TEXTS:
            assert exported(f"{label} {text}").input_ids == original(f"{label} {text}").input_ids
    assert json.loads((tmp_path / "hf" / "vocab.json").read_text()) == json.loads(
        (directory / "vocab.json").read_text()
    )
    card = (tmp_path / "hf" / "README.md").read_text(encoding="utf-8")
    assert (
        "multilingual: 3 target languages, chosen by a label at the start of the source: `>>deu<<` (deu)"
        in card
    )


def test_ctranslate2_translates_with_the_label(imported: tuple[Path, Path], translator: Translator) -> None:
    ct2 = CTranslate2Translator.from_checkpoint(imported[1])
    assert ct2.target_languages.languages == ["deu", "fra", "spa"]
    for lang in LABELS:
        ours = translator.translate(TEXTS, target_lang=lang, **LIMIT)
        theirs = ct2.translate(TEXTS, target_lang=lang, **LIMIT)
        assert [t.text for t in theirs] == [t.text for t in ours]
        assert [t.score for t in theirs] == pytest.approx([t.score for t in ours], abs=1e-4)


FRENCH = [
    "Aujourd'hui elle achète quatorze balles vertes.",
    "Hier nous avions un chien.",
    "Ils ont acheté une voiture.",
]


@pytest.mark.parametrize(("pair", "error"), [("en-fra", None), ("en-fr", "no label for target language fr")])
def test_fine_tuning_the_import_on_one_of_its_directions(
    imported: tuple[Path, Path], tmp_path: Path, pair: str, error: str | None
) -> None:
    """`model.init_from` the en -> mul import with `data.pairs=[en-fra]` (files named by the model's codes):
    every source gets `>>fra<<`, one piece of its SentencePiece vocabulary, and the fine-tuned checkpoint
    keeps the three labels; a pair named by another code (`fr`) is one error line listing the model's."""
    data_dir = tmp_path / "corpus"
    data_dir.mkdir()
    tgt = pair.split("-")[1]
    for split in ("train", "val", "test_2016_flickr"):
        (data_dir / f"{split}.en").write_text("".join(f"{s}\n" for s in SOURCES[:3]) * 4, encoding="utf-8")
        (data_dir / f"{split}.{tgt}").write_text("".join(f"{s}\n" for s in FRENCH) * 4, encoding="utf-8")
    run_dir = tmp_path / "run"
    result = run_script(
        "train.py",
        ["experiment=finetune_opus_mt", f"model.init_from={imported[1]}", "data.source=parallel",
         f"data.data_dir={data_dir}", "data.src_lang=en", "data.tgt_lang=mul", f"data.pairs=[{pair}]",
         "trainer.max_epochs=1", "test=false", "callbacks.rich_progress_bar=null", f"hydra.run.dir={run_dir}",
         f"paths.cache_dir={tmp_path / 'cache'}"],
        env={**os.environ, "PROJECT_ROOT": str(REPO_ROOT)},
    )  # fmt: skip
    if error is not None:
        assert result.returncode == 1 and "Traceback" not in result.stderr
        last = result.stderr.rstrip().splitlines()[-1]
        assert last.startswith(f"error: data.pairs: the model has {error}; it knows deu, fra, spa"), last
        return
    assert result.returncode == 0, result.stderr[-3000:]
    tuned = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert LanguageLabels.from_state(tuned["language_labels"]) == LanguageLabels(LABELS)
    # what the run trained on: every source's first id is the label's piece (its data, read again)
    data = TranslationDataModule(
        source="parallel", data_dir=data_dir, src_lang="en", tgt_lang="mul", pairs=["en-fra"],
        test_split="test_2016_flickr", max_len=128, show_progress=False,
    )  # fmt: skip
    data.load_state_dict({**tuned["TranslationDataModule"], "language_labels": tuned["language_labels"]})
    data.setup("fit")
    label_id = load_source(imported[1]).sentencepiece.vocab[">>fra<<"]  # type: ignore[union-attr]
    assert {ids[0] for ids in data.tokenized("train")["src_ids"]} == {label_id}

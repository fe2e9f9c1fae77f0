"""Issue 65 item 1: several pairs in one translation datamodule. Temperature sampling over pairs (100k draws
within 2% of n_i^(1/T) / sum), the labels one token of the joint BPE, the label of the target language
before each source, the cache keyed by the pairs and labels, the checkpoint state, and bad settings."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from data import sources, tokenization
from data.datamodules import TranslationDataModule
from data.labels import LABELS_KEY
from data.pairs import PairSampledBatchSampler, check_temperature, parse_pairs, temperature_probabilities
from data.synthetic_numbers import make_items, number_to_french, render

SIZES = {"train": 120, "val": 12, "test": 12}


def _numbers(pairs: list[str] | None, **settings: object) -> TranslationDataModule:
    values: dict[str, object] = dict(
        source="numbers",
        pairs=pairs,
        synthetic_sizes=SIZES,
        vocab_size=200,
        min_frequency=1,
        max_tokens=256,
        max_len=32,
        show_progress=False,
    )
    values.update(settings)
    return TranslationDataModule(**values)  # type: ignore[arg-type]


# --- temperature sampling ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 2.0, 5.0, math.inf])
def test_batches_follow_the_temperature_over_100k_draws(temperature: float) -> None:
    counts = [70_000, 20_000, 10_000]  # one example per batch: an epoch is 100k draws of a pair
    pair_of = np.repeat(np.arange(3), counts)
    expected = np.power(np.asarray(counts, float), 0.0 if math.isinf(temperature) else 1 / temperature)
    expected /= expected.sum()
    probabilities = temperature_probabilities(counts, temperature)
    np.testing.assert_allclose(probabilities, expected)  # against the plain formula
    sampler = PairSampledBatchSampler(np.ones(len(pair_of), int), pair_of, probabilities, 1, seed=3)
    batches = list(sampler)
    assert len(batches) == sum(counts)
    drawn = np.bincount([pair_of[batch[0]] for batch in batches], minlength=3) / len(batches)
    assert np.all(np.abs(drawn - expected) <= 0.02 * expected), (drawn, expected)


def test_each_batch_holds_one_pair_fits_the_budget_and_resumes() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 20, size=900)
    pair_of = np.repeat([0, 1, 2], [600, 200, 100])
    probabilities = temperature_probabilities([600, 200, 100], 2.0)
    sampler = PairSampledBatchSampler(lengths, pair_of, probabilities, 64, seed=1)
    batches = list(sampler)
    for batch in batches:
        assert len({int(pair_of[i]) for i in batch}) == 1
        assert len(batch) * lengths[batch].max() <= 64
    again = PairSampledBatchSampler(lengths, pair_of, probabilities, 64, seed=1)
    again.load_state_dict({"epoch": 0, "batches_yielded": 5})
    assert list(again) == batches[5:]  # a resumed run continues the same list
    sampler.set_epoch(1)
    assert list(sampler) != batches  # a new order every epoch
    ranks = [
        PairSampledBatchSampler(lengths, pair_of, probabilities, 64, seed=1, num_replicas=2, rank=r)
        for r in (0, 1)
    ]
    assert [b for pair in zip(*(list(r) for r in ranks)) for b in pair][: len(batches)] == batches


def test_a_pair_without_examples_is_never_drawn() -> None:
    probabilities = temperature_probabilities([10, 0, 5], math.inf)
    assert probabilities.tolist() == [0.5, 0.0, 0.5]


# --- the built-in multilingual task -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "words"),
    [
        (1, "un"),
        (21, "vingt et un"),
        (71, "soixante et onze"),
        (77, "soixante-dix-sept"),
        (80, "quatre-vingts"),
        (81, "quatre-vingt-un"),
        (91, "quatre-vingt-onze"),
        (100, "cent"),
        (200, "deux cents"),
        (201, "deux cent un"),
        (342, "trois cent quarante-deux"),
        (999, "neuf cent quatre-vingt-dix-neuf"),
    ],
)
def test_french_numbers(n: int, words: str) -> None:
    assert number_to_french(n) == words


def test_items_render_in_every_language_and_splits_are_disjoint() -> None:
    items = make_items(0, {"train": 500, "val": 50, "test": 50})
    pairs = {name: {item[:2] for item in chosen} for name, chosen in items.items()}
    assert not pairs["train"] & (pairs["val"] | pairs["test"]) and not pairs["val"] & pairs["test"]
    assert [render(21, 0, lang, 4) for lang in ("en", "de", "fr")] == [
        "We have twenty-one apples.",
        "Wir haben einundzwanzig Äpfel.",
        "Nous avons vingt et une pommes.",  # French agrees with the feminine noun
    ]
    assert render(1, 1, "de", 0) == "Ich habe einen Hund." and render(1, 0, "fr", 0) == "J'ai une pomme."


# --- the datamodule -----------------------------------------------------------------------------------


def test_labels_are_atomic_tokens_before_every_source() -> None:
    dm = _numbers(["en-de", "en-fr", "de-fr"], bpe_dropout=0.5)
    dm.setup("fit")
    tokenizer = dm.src_tokenizer
    backend = tokenizer.tokenizer
    label_ids = {lang: backend.token_to_id(f">>{lang}<<") for lang in ("de", "fr")}
    assert None not in label_ids.values()
    raw = dm.raw_split("train")
    for src, pair in zip(raw["src"], raw["pair"]):
        target = dm.pairs[pair].tgt
        assert src.startswith(f">>{target}<< ")
    tokenized = dm.tokenized("train")
    targets = [label_ids[dm.pairs[p].tgt] for p in tokenized["pair"]]
    assert [ids[1] for ids in tokenized["src_ids"]] == targets  # BOS, then the label: one token
    # never split: by BPE-dropout's segmentation of each epoch, or with no space around the label
    for epoch in (0, 1):
        segmented = dm._segmented_sources(epoch)
        assert [segmented[i][1] for i in tokenized["id"]] == targets
    for text, lang in (
        (">>fr<< quarante-deux pommes", "fr"),
        (">>de<<zweiundvierzig Äpfel", "de"),
        ("x>>fr<<y", "fr"),
    ):
        ids = tokenizer.encode(text)
        assert ids.count(label_ids[lang]) == 1, [backend.id_to_token(i) for i in ids]


def test_many_to_one_has_no_labels_and_one_pair_is_bilingual() -> None:
    dm = _numbers(["de-en", "fr-en"])
    dm.setup("validate")
    assert dm.language_labels is None and LABELS_KEY not in dm.state_dict()
    assert not any(src.startswith(">>") for src in dm.raw_split("val")["src"])
    assert dm.directions("val") == ["de-en"] * 12 + ["fr-en"] * 12
    assert dm.state_dict()["pairs"] == ["de-en", "fr-en"]
    single = _numbers(["en-de"])
    single.setup("validate")
    assert single.directions("val") is None and single.language_labels is None


def test_the_first_sentences_of_a_multilingual_split_are_taken_per_direction(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """evaluate.py's `data.test_sentences=N`: the first N of each direction, not N of the first one."""
    from transformer.cli.evaluate_steps import keep_first_sentences

    dm = _numbers(["de-en", "fr-en"])
    dm.setup("test")
    whole = dm.raw_split("test")
    caplog.set_level("INFO")
    keep_first_sentences(dm, 5, translating=False)
    assert dm.directions("test") == ["de-en"] * 5 + ["fr-en"] * 5
    cut = dm.raw_split("test")
    firsts = [i for i, p in enumerate(whole["pair"]) if whole["pair"][:i].count(p) < 5]
    assert cut["src"] == [whole["src"][i] for i in firsts]
    assert [len(batch["id"]) for batch in dm.test_dataloader()] and sorted(
        i for batch in dm.test_dataloader() for i in batch["id"].tolist()
    ) == list(range(10))
    assert (
        "first 5 of each direction of the 24 sentences of test (data.test_sentences): 10 in all"
        in caplog.text
    )


def test_a_run_from_a_multilingual_model_keeps_its_labels() -> None:
    """Fine-tuning (`model.init_from`'s datamodule state): the model's labels, also with one pair."""
    trained = _numbers(["en-de", "en-fr", "de-fr"], labels={"position": "end"})
    trained.setup("validate")
    state = trained.state_dict()
    one = _numbers(["en-fr"], labels={"position": "end"})
    one.load_state_dict(state)
    assert one.language_labels == trained.language_labels and not one.multilingual
    one.setup("validate")
    assert all(src.endswith(" >>fr<<") for src in one.raw_split("val")["src"])
    assert one.state_dict()[LABELS_KEY] == state[LABELS_KEY]  # the fine-tuned model still knows de and fr


@pytest.mark.parametrize(
    ("pairs", "labels", "with_labels", "message"),
    [
        (
            ["en-es"],
            None,
            True,
            r"^data\.pairs: the model has no label for target language es; it knows de, fr ",
        ),
        (["en-de", "en-fr"], {"format": "<2{lang}>"}, True, r"^data\.labels: the run spells or places its "),
        (
            ["en-de", "en-fr"],
            {"position": "end"},
            True,
            "'>>de<<' at the end, the model as '>>de<<' at the start",
        ),
        (None, None, True, r"^data\.pairs: the model is multilingual .* data\.pairs=\[en-de\] so that"),
        (["en-de", "en-fr"], None, False, r"^data\.pairs: these pairs label .* trained without labels"),
    ],
)
def test_pairs_a_multilingual_model_cannot_follow_are_refused(
    pairs: list[str] | None, labels: dict | None, with_labels: bool, message: str
) -> None:
    trained = _numbers(["en-de", "en-fr"] if with_labels else ["en-de"])
    trained.setup("validate")
    with pytest.raises(ValueError, match=message):
        _numbers(pairs, labels=labels).load_state_dict(trained.state_dict())


def test_state_records_pairs_and_labels() -> None:
    dm = _numbers(["en-de", "en-fr"], labels={"format": "<2{lang}>"})
    dm.setup("validate")
    state = dm.state_dict()
    assert state["pairs"] == ["en-de", "en-fr"]
    assert state[LABELS_KEY] == {"labels": {"de": "<2de>", "fr": "<2fr>"}, "position": "start"}
    assert dm.raw_split("val")["src"][0].startswith("<2de> ")


def test_labels_at_the_end_of_the_source_are_atomic_tokens_before_eos() -> None:
    dm = _numbers(["en-de", "en-fr"], labels={"position": "end"})
    dm.setup("fit")
    assert dm.state_dict()[LABELS_KEY]["position"] == "end"
    raw = dm.raw_split("train")
    assert all(src.endswith(f" >>{dm.pairs[p].tgt}<<") for src, p in zip(raw["src"], raw["pair"]))
    backend = dm.src_tokenizer.tokenizer
    tokenized = dm.tokenized("train")
    ends = [backend.id_to_token(ids[-2]) for ids in tokenized["src_ids"]]  # the label, then EOS
    assert ends == [f">>{dm.pairs[p].tgt}<<" for p in tokenized["pair"]]


def test_cache_is_keyed_by_pairs_and_labels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trained = []
    real = tokenization.train_bpe
    monkeypatch.setattr(tokenization, "train_bpe", lambda *a, **k: trained.append(1) or real(*a, **k))
    _numbers(["en-de", "en-fr"], cache_dir=tmp_path).setup("fit")
    assert len(trained) == 1
    again = _numbers(["en-de", "en-fr"], cache_dir=tmp_path)
    again.setup("fit")  # the same pairs and labels: tokenizer and tokenized splits from the cache
    assert len(trained) == 1
    assert again.tokenized("train")["pair"][:1] == [0]
    _numbers(["en-de", "de-fr"], cache_dir=tmp_path).setup("fit")
    _numbers(["en-de", "en-fr"], labels={"format": "<2{lang}>"}, cache_dir=tmp_path).setup("fit")
    assert len(trained) == 3  # other pairs, other labels: their own entries
    names = sorted(p.name for p in (tmp_path / "tokenized").iterdir() if not p.name.startswith("."))
    assert any("en-de+en-fr" in name for name in names) and any("en-de+de-fr" in name for name in names)


def test_a_missing_pair_names_itself_and_writes_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "corpus"
    data_dir.mkdir()
    for split in ("train", "val", "test"):
        for lang in ("en", "de"):
            (data_dir / f"{split}.{lang}").write_text("a b c\nd e f\n")
    cache_dir = tmp_path / "cache"
    dm = TranslationDataModule(
        source="parallel", data_dir=data_dir, pairs=["en-de", "en-fr"], vocab_size=50, cache_dir=cache_dir
    )
    with pytest.raises(
        sources.DataError,
        match=r"data\.pairs\[1\] \(en-fr\): missing .*train\.fr",
    ) as err:
        dm.prepare_data()
    assert "\n" not in str(err.value)
    assert not (cache_dir / "tokenized").exists() and not list((cache_dir / "tokenizers").rglob("*.json"))


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        ("en-de", "must be null or a non-empty list"),
        ([], "must be null or a non-empty list"),
        (["ende"], r"data\.pairs\[0\] must be SRC-TGT"),
        (["en-en"], r"data\.pairs\[0\]: source and target language are both 'en'"),
        (["en-de", "en-de"], "lists en-de more than once"),
        ([{"src": "en"}], r"data\.pairs\[0\] must be \{src"),
        ([{"src": "en", "tgt": "de", "dir": "x"}], "unknown keys: \\['dir'\\]"),
        ([{"src": "en", "tgt": "de", "source": "ftp"}], r"data\.pairs\[0\]\.source must be one of"),
    ],
)
def test_bad_pairs_name_the_entry(pairs: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_pairs(pairs)


@pytest.mark.parametrize("value", [0, -1.0, "warm", float("nan"), True])
def test_bad_temperature(value: object) -> None:
    with pytest.raises(ValueError, match=r"data\.sampling_temperature must be a number > 0"):
        check_temperature(value)
    assert check_temperature("inf") == math.inf


def test_bad_settings_with_pairs() -> None:
    with pytest.raises(ValueError, match="synthetic task is English -> German only"):
        TranslationDataModule(source="synthetic", pairs=["en-de", "en-fr"])
    with pytest.raises(ValueError, match=r"data\.labels\.format: a label format must contain"):
        _numbers(["en-de", "en-fr"], labels={"format": "<2x>"})
    with pytest.raises(ValueError, match=r"data\.labels takes format .* and position \(start or end\)"):
        _numbers(["en-de", "en-fr"], labels={"spelling": "x"})
    with pytest.raises(
        ValueError,
        match=r"^data\.labels\.position: a label's position must be one of start, end, got 'first'$",
    ):
        _numbers(["en-de"], labels={"position": "first"})  # refused with one pair too


def test_clean_applies_to_each_pair_with_its_languages() -> None:
    dm = _numbers(["en-de", "en-fr"], clean={"length": {"max_words": 4}})
    assert [(c.src_lang, c.tgt_lang) for c in dm._pair_clean] == [("en", "de"), ("en", "fr")]
    raw = dm.raw_split("train")
    kept = {pair: sum(1 for p in raw["pair"] if p == pair) for pair in (0, 1)}
    assert 0 < kept[0] < SIZES["train"] and 0 < kept[1] < SIZES["train"]
    for src, tgt in zip(raw["src"], raw["tgt"]):
        assert len(src.split()) <= 5 and len(tgt.split()) <= 4  # the label comes after cleaning
    assert len(dm.raw_split("val")) == 2 * SIZES["val"]  # validation is never cleaned

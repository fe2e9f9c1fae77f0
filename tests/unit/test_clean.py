"""Parallel-data cleaning as a whole: `data.clean` settings and their error lines, the report (first and
all rejecting filters, examples, JSON), streaming in bounded memory, the datamodule (train split only,
the cache keys, the log line) and the standalone command `python -m data.clean`."""

from __future__ import annotations

import itertools
import json
import logging
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from data.clean import FILTERS, CleanSettings, fit, judge, new_report
from data.clean.cli import main as clean_main
from data.datamodules import TranslationDataModule
from data.sources import DataError

REPO_ROOT = Path(__file__).resolve().parents[2]
NO_LANGID = {name: {} for name in FILTERS if name not in ("langid", "alignment")}


def test_default_yaml_lists_every_filter_with_the_dataclass_defaults() -> None:
    """configs/data/clean/default.yaml shows the values; the dataclasses own them: they must agree."""
    config = yaml.safe_load((REPO_ROOT / "configs/data/clean/default.yaml").read_text())
    assert list(config) == list(FILTERS)
    for name, settings in config.items():
        made = FILTERS[name]()
        assert settings == made.settings(), name


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"lenght": {}}, r"^clean\.lenght is not a filter; the filters are length, ratio"),
        ({"ratio": {"max": 3}}, r"^clean\.ratio\.max is not a setting of the ratio filter; its settings are"),
        ({"ratio": 3}, r"^clean\.ratio must be a mapping of settings"),
        ({"ratio": {"max_ratio": 0.5}}, r"^clean\.ratio\.max_ratio must be a number >= 1, got 0\.5"),
        ({"ratio": False}, r"^clean names no filter"),
        (["ratio"], r"^clean must be null or a mapping"),
    ],
)
def test_bad_settings(config: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CleanSettings(config, "en", "de")  # type: ignore[arg-type]


def test_a_bad_setting_fails_the_datamodule_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"^clean\.length\.max_words must be an integer >= 1, got -1"):
        TranslationDataModule(clean={"length": {"max_words": -1}})


def test_report_counts_the_first_and_every_rejecting_filter() -> None:
    settings = CleanSettings({"identical": {}, "ratio": {"max_ratio": 1.5}, "numbers": {}}, "en", "de")
    filters = settings.filters()
    report = new_report("test", filters, ("en", "de"))
    pairs = [
        ("A dog runs fast.", "Ein Hund rennt schnell."),  # kept
        ("a", "A."),  # identical only (ratio: 1 vs 2 characters... 2.0 > 1.5: also ratio)
        ("Room 12 is big", "Room 12 is big, really big, yes"),  # ratio only
        ("Room 12", "room 13"),  # numbers only
        ("Room 12", "Room 12"),  # identical
    ]
    verdicts = [rejected for _, _, rejected in judge(pairs, filters, report)]
    assert verdicts == [[], ["identical", "ratio"], ["ratio"], ["numbers"], ["identical"]]
    data = report.as_dict()
    assert (data["pairs"], data["kept"], data["removed"]) == (5, 1, 4)
    counts = {f["name"]: (f["removed"], f["would_remove"]) for f in data["filters"]}
    assert counts == {"identical": (2, 2), "ratio": (1, 2), "numbers": (1, 1)}
    first = data["filters"][0]["examples"][0]
    assert first == {"line": 2, "src": "a", "tgt": "A.", "rejected_by": ["identical", "ratio"]}
    assert data["filters"][1]["settings"] == {"max_ratio": 1.5, "min_chars": 0}
    assert report.summary() == "kept 1 of 5 pairs (20.0%); removed first by identical 2, ratio 1, numbers 1"


def test_report_json_written_whole(tmp_path: Path) -> None:
    filters = CleanSettings({"identical": {}}, "en", "de").filters()
    report = new_report("x", filters, ("en", "de"))
    list(judge([("same", "same"), ("a b", "c d")], filters, report))
    report.write(tmp_path / "clean_report.json")
    assert json.loads((tmp_path / "clean_report.json").read_text()) == report.as_dict()
    assert [p.name for p in tmp_path.iterdir()] == ["clean_report.json"]  # no temporary file left


def test_everything_removed_names_the_filter_that_removed_most() -> None:
    filters = CleanSettings({"numbers": {}, "identical": {}}, "en", "de").filters()
    report = new_report("corpus.en / corpus.de", filters, ("en", "de"))
    list(judge([("x", "x"), ("y", "y"), ("1", "2")], filters, report))
    with pytest.raises(DataError, match=r"removed all 3 pairs; identical removed the most \(2\)"):
        report.check_kept()


def _stream(count: int, produced: list[int], distinct: bool = True) -> Iterator[tuple[str, str]]:
    """`count` distinct long pairs made one at a time (about 1.6 kB each: 3k of them would be 4.8 MB)."""
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "near",
        "the",
        "river",
        "bank",
    ]
    for i in range(count):
        produced[0] += 1
        body = " ".join(words[(i + k) % len(words)] for k in range(120))
        number = i if distinct else i % 100  # distinct: a new word in every pair
        yield f"{number} {body}", f"{number} {body[::-1]}"


def test_judging_streams_in_bounded_memory() -> None:
    """A generator in, verdicts out one at a time: the filters hold no list of the corpus. Memory: the
    duplicates filter's 8-byte digests (a set of 3k: ~0.2 MB), not the 4.8 MB of text."""
    filters = CleanSettings(
        {**NO_LANGID, "length": {"max_words": 500, "max_chars": 5000}}, "en", "de"
    ).filters()
    produced = [0]
    verdicts = judge(_stream(3_000, produced), filters, new_report("stream", filters, ("en", "de")))
    next(verdicts)
    assert produced == [1]  # lazily: one pair read for one verdict
    tracemalloc.start()
    for _ in verdicts:
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert produced == [3_000]
    assert peak < 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_alignment_fit_streams_in_fixed_tables() -> None:
    """The first pass's memory does not grow with the corpus: fixed tables and a bounded buffer."""
    peaks = []
    for count in (1_000, 4_000):
        (alignment,) = CleanSettings({"alignment": {"table_bits": 16}}, "en", "de").filters()
        produced = [0]
        tracemalloc.start()
        alignment.fit(_stream(count, produced, distinct=False), buffered=1 << 14)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert produced == [count]
    # the tables (2 x 2**16 + 2 x 2**12 int32: 0.5 MB), 2**14 buffered word pairs and their copies
    assert peaks[1] < 3 * 2**20, f"peak {peaks[1] / 2**20:.1f} MiB"  # the text alone: 6.4 MB
    assert peaks[1] < 1.2 * peaks[0], peaks


# -- the datamodule ---------------------------------------------------------------------------------
SMALL = {"train": 400, "val": 40, "test": 30}
CLEAN = {"duplicates": {}, "length": {"max_words": 6}}  # about half of the synthetic pairs are longer


def _synthetic(cache_dir: Path, clean: dict | None) -> TranslationDataModule:
    return TranslationDataModule(
        synthetic_sizes=SMALL, vocab_size=150, max_tokens=400, max_len=48, show_progress=False,
        cache_dir=cache_dir, clean=clean,
    )  # fmt: skip


def _entries(cache_dir: Path, kind: str) -> list[str]:
    return sorted(p.name for p in (cache_dir / kind).iterdir() if not p.name.startswith("."))


def test_datamodule_cleans_the_train_split_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    plain = _synthetic(tmp_path, None)
    raw = plain.raw_split("train")
    expected = [(s, t) for s, t in zip(raw["src"], raw["tgt"]) if max(len(s.split()), len(t.split())) <= 6]
    with caplog.at_level(logging.INFO, logger="data.datamodules.translation"):
        cleaned = _synthetic(tmp_path, CLEAN)
        cleaned.setup("fit")
    train = cleaned.raw_split("train")
    assert list(zip(train["src"], train["tgt"])) == expected
    assert 0 < len(train) < len(raw)
    for split in ("val", "test"):  # untouched
        assert cleaned.raw_split(split)["src"][:] == plain.raw_split(split)["src"][:]
    (entry,) = _entries(tmp_path, "cleaned")
    report = json.loads((tmp_path / "cleaned" / entry / "clean_report.json").read_text())
    assert (report["pairs"], report["kept"]) == (len(raw), len(expected))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Cleaned train")]
    assert lines == [
        f"Cleaned train (data.clean): kept {len(expected)} of {len(raw)} pairs "
        f"({100 * len(expected) / len(raw):.1f}%); removed first by duplicates "
        f"{report['filters'][0]['removed']}, length {report['filters'][1]['removed']}; "
        f"report: {tmp_path / 'cleaned' / entry / 'clean_report.json'}"
    ]
    # a later run finds everything cached and still logs the line, once
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="data.datamodules.translation"):
        again = _synthetic(tmp_path, CLEAN)
        again.setup("fit")
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("Cleaned")] == lines


def test_clean_settings_key_the_cache(tmp_path: Path) -> None:
    """Cleaning on, off or with other settings: another cleaned split, tokenizer and tokenized train entry
    (and so val entry: its ids are the tokenizer's); switched off again, the first run's entries."""
    for clean in (None, CLEAN, {**CLEAN, "length": {"max_words": 7}}, None):
        _synthetic(tmp_path, clean).setup("fit")
    tokenized = _entries(tmp_path, "tokenized")
    assert len([e for e in tokenized if "-train-" in e]) == 3
    assert len([e for e in tokenized if "-val-" in e]) == 3
    assert len(_entries(tmp_path, "tokenizers")) == 3
    assert len(_entries(tmp_path, "cleaned")) == 2


def test_datamodule_refuses_a_split_cleaned_away_and_caches_nothing(tmp_path: Path) -> None:
    dm = _synthetic(tmp_path, {"length": {"max_words": 1}, "duplicates": {}})
    with pytest.raises(DataError, match=r"removed all 400 pairs; length removed the most \(400\)"):
        dm.setup("fit")
    assert _entries(tmp_path, "cleaned") == []


# -- the standalone command --------------------------------------------------------------------------
def _files(tmp_path: Path, pairs: list[tuple[str, str]]) -> tuple[Path, Path]:
    src, tgt = tmp_path / "corpus.en", tmp_path / "corpus.de"
    src.write_text("".join(f"{s}\n" for s, _ in pairs))
    tgt.write_text("".join(f"{t}\n" for _, t in pairs))
    return src, tgt


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        clean_main([str(a) for a in argv])
        code = 0
    except SystemExit as exit:
        code = int(exit.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


PAIRS = [
    ("A dog runs in the park.", "Ein Hund rennt im Park."),
    ("A dog runs in the park.", "A dog runs in the park."),  # copy
    ("Two men play 3 games.", "Zwei Männer spielen 4 Spiele."),  # numbers
    ("<b>A cat sleeps.</b>", "Eine Katze schläft."),  # markup
    ("A woman sings\ta song.", "Eine Frau singt ein Lied."),  # a tab inside: one line
]


def test_command_writes_kept_rejected_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, tgt = _files(tmp_path, PAIRS)
    config = tmp_path / "clean.yaml"
    config.write_text("identical: {}\nnumbers: {}\nmarkup: {}\n")
    out_dir = tmp_path / "out"
    code, out, err = _run([src, tgt, "--config", config, "--output-dir", out_dir], capsys)
    assert (code, err) == (0, "")
    assert (
        out.splitlines()[0] == "kept 2 of 5 pairs (40.0%); removed first by identical 1, numbers 1, markup 1"
    )
    assert (out_dir / "corpus.en").read_text() == "A dog runs in the park.\nA woman sings a song.\n"
    assert (out_dir / "corpus.de").read_text() == "Ein Hund rennt im Park.\nEine Frau singt ein Lied.\n"
    assert (out_dir / "rejected.tsv").read_text().splitlines() == [
        "line\trejected_by\tsrc\ttgt",
        "2\tidentical\tA dog runs in the park.\tA dog runs in the park.",
        "3\tnumbers\tTwo men play 3 games.\tZwei Männer spielen 4 Spiele.",
        "4\tmarkup\t<b>A cat sleeps.</b>\tEine Katze schläft.",
    ]
    report = json.loads((out_dir / "clean_report.json").read_text())
    assert (report["pairs"], report["kept"], report["languages"]) == (5, 2, ["en", "de"])
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "clean_report.json",
        "corpus.de",
        "corpus.en",
        "rejected.tsv",
    ]


def test_command_default_config_has_every_filter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("py3langid")
    src, tgt = _files(tmp_path, PAIRS)
    code, _, err = _run([src, tgt, "--output-dir", tmp_path / "out"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "clean_report.json").read_text())
    assert [f["name"] for f in report["filters"]] == list(FILTERS)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("misaligned", r"corpus\.en / .*corpus\.de: source has 5 lines but target has 4 \(misaligned\)"),
        ("missing", r"missing file .*nothing\.en"),
        ("unknown filter", r"clean\.lenght is not a filter"),
        ("bad value", r"clean\.ratio\.max_ratio must be a number >= 1, got 0"),
        ("not yaml", r"--config .*clean\.yaml is not YAML"),
        ("exists", r"out/corpus\.en exists: choose another --output-dir"),
        (
            "all removed",
            r"removed all 5 pairs; length removed the most \(5\): loosen or drop data\.clean\.length",
        ),
        ("no language", r"cannot tell the language of .*corpus\.txt from its name: pass --src-lang"),
    ],
)
def test_command_errors_are_one_line(
    case: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, tgt = _files(tmp_path, PAIRS)
    config = tmp_path / "clean.yaml"
    config.write_text("identical: {}\n")
    out_dir = tmp_path / "out"
    if case == "misaligned":
        tgt.write_text("".join(f"{t}\n" for _, t in PAIRS[:4]))
    elif case == "missing":
        src = tmp_path / "nothing.en"
    elif case == "unknown filter":
        config.write_text("lenght: {}\n")
    elif case == "bad value":
        config.write_text("ratio: {max_ratio: 0}\n")
    elif case == "not yaml":
        config.write_text("ratio: [\n")
    elif case == "exists":
        out_dir.mkdir()
        (out_dir / "corpus.en").write_text("keep me\n")
    elif case == "all removed":
        config.write_text("length: {max_words: 1}\n")
    elif case == "no language":
        src = src.rename(tmp_path / "corpus.txt")
    code, out, err = _run([src, tgt, "--config", config, "--output-dir", out_dir], capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert pytest.importorskip("re").search(message, err), err
    if case == "exists":
        assert (out_dir / "corpus.en").read_text() == "keep me\n"  # nothing overwritten
    elif out_dir.exists():
        assert list(out_dir.iterdir()) == []  # nothing half-written


def test_command_unknown_language(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("py3langid")
    src, tgt = _files(tmp_path, PAIRS)
    code, _, err = _run([src, tgt, "--output-dir", tmp_path / "out", "--tgt-lang", "tlh"], capsys)
    assert code == 2
    assert err.startswith("error: clean.langid cannot check 'tlh': the language identifier does not know it")


def test_pairs_are_generated_not_listed() -> None:
    """`fit` calls its factory once per learning filter; judging reads the stream once more."""
    calls = []

    def pairs() -> Iterator[tuple[str, str]]:
        calls.append(1)
        return itertools.islice(iter([("a b", "c d")] * 3), 3)

    filters = CleanSettings({"alignment": {"table_bits": 12}, "identical": {}}, "en", "de").filters()
    fit(filters, pairs)
    assert len(calls) == 1


def test_clean_summary_for_evaluate_from_the_training_runs_cache(tmp_path: Path) -> None:
    """evaluate.py's report row: read from the cleaned entry's report without loading the split; its
    datamodule has no cache of its own and looks in the training run's."""
    data_dir = tmp_path / "corpus"
    data_dir.mkdir()
    pairs = [*PAIRS[:1], *PAIRS[2:4]] * 2  # the copy is left out; each pair twice: 3 duplicates
    for split in ("train", "val", "test"):
        (data_dir / f"{split}.en").write_text("".join(f"{s}\n" for s, _ in pairs))
        (data_dir / f"{split}.de").write_text("".join(f"{t}\n" for _, t in pairs))
    settings = dict(source="parallel", data_dir=data_dir, vocab_size=60, max_tokens=400, max_len=48,
                    min_frequency=1, show_progress=False)  # fmt: skip
    clean = {"duplicates": {}, "numbers": {}}
    TranslationDataModule(**settings, cache_dir=tmp_path / "cache", clean=clean).setup("fit")
    evaluating = TranslationDataModule(**settings, cache_dir=None, clean=clean)
    (entry,) = _entries(tmp_path / "cache", "cleaned")
    expected = (
        "kept 2 of 6 pairs (33.3%); removed first by duplicates 3, numbers 1; "
        f"report: {tmp_path / 'cache' / 'cleaned' / entry / 'clean_report.json'}"
    )
    assert evaluating.clean_summary(tmp_path / "cache") == expected
    assert evaluating._raw == {}  # nothing loaded
    assert TranslationDataModule(**settings, cache_dir=None, clean=clean).clean_summary() is None
    assert TranslationDataModule(**settings, cache_dir=None).clean_summary(tmp_path / "cache") is None
    other = TranslationDataModule(**settings, cache_dir=None, clean={"duplicates": {"normalized": False}})
    assert other.clean_summary(tmp_path / "cache") is None  # other settings: no such entry

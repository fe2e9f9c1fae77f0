"""Raw sources: real Multi30k / SST-2 files, tiny fixtures for every kind of bad input, hub code paths."""

import gzip
import json
import logging
from pathlib import Path

import datasets
import pytest

from data import sources
from data.sources import (
    DataError,
    check_labeled,
    load_classification_files,
    load_multi30k,
    load_parallel,
    load_parallel_dir,
    load_sst2,
    load_synthetic,
    read_lines,
)


def _write(path: Path, lines: list[str], gz: bool = False) -> Path:
    data = "".join(f"{line}\n" for line in lines).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


# -- real data -------------------------------------------------------------------------------------
def test_multi30k_real_splits(multi30k_dir: Path) -> None:
    data = load_multi30k(multi30k_dir, ["val", "test_2016_flickr"], "en", "de")
    assert {split: len(ds) for split, ds in data.items()} == {"val": 1014, "test_2016_flickr": 1000}
    assert data["val"].column_names == ["src", "tgt"]
    assert data["val"][0]["tgt"].startswith("Eine Gruppe von Männern")
    assert load_multi30k(multi30k_dir, ["val"], "fr", "en")["val"][0]["tgt"] == data["val"][0]["src"]


def test_multi30k_missing_file_lists_present_splits(multi30k_dir: Path) -> None:
    with pytest.raises(
        DataError, match=r"test_2017_mscoco\.en\.gz.*\{split\}\.\{lang\}\.gz.*test_2016_flickr"
    ):
        load_multi30k(multi30k_dir, ["test_2017_mscoco"], "en", "de")
    with pytest.raises(DataError, match=r"val\.cs\.gz"):
        load_multi30k(multi30k_dir, ["val"], "en", "cs")


def test_missing_directory_names_path_and_layout(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=rf"{tmp_path / 'nope'}.*\{{split\}}\.\{{lang\}}\.gz"):
        load_multi30k(tmp_path / "nope", ["train"])
    with pytest.raises(DataError, match=r"nope.*\{split\}\.tsv"):
        load_sst2(tmp_path / "nope", ["train"])


def test_sst2_real(sst2_dir: Path) -> None:
    data = load_sst2(sst2_dir, ["train", "dev"])
    assert (len(data["train"]), len(data["dev"])) == (67349, 872)
    assert data["dev"].features["label"].names == ["negative", "positive"]
    assert set(data["dev"]["label"][:]) == {0, 1}
    assert data["dev"][0] == {"text": "one long string of cliches .", "label": 0}
    with pytest.raises(DataError, match=r"test\.tsv.*dev\.tsv"):
        load_sst2(sst2_dir, ["test"])


# -- parallel files --------------------------------------------------------------------------------
def test_parallel_plain_and_gz(tmp_path: Path) -> None:
    src = _write(tmp_path / "a.en", ["Hello .", "Bye ."])
    tgt = _write(tmp_path / "a.de.gz", ["Hallo .", "Tschüss ."], gz=True)
    assert load_parallel(src, tgt)[:] == {"src": ["Hello .", "Bye ."], "tgt": ["Hallo .", "Tschüss ."]}


def test_parallel_dir_any_split_name(tmp_path: Path) -> None:
    _write(tmp_path / "dev2.en", ["x"])
    _write(tmp_path / "dev2.fr.gz", ["y"], gz=True)
    assert load_parallel_dir(tmp_path, ["dev2"], "en", "fr", "{split}.{lang}")["dev2"][0] == {
        "src": "x",
        "tgt": "y",
    }
    assert sources.list_splits(tmp_path) == {"dev2": ["en", "fr"]}


def test_line_count_mismatch_names_both_counts(tmp_path: Path) -> None:
    src = _write(tmp_path / "train.en", ["a", "b", "c"])
    tgt = _write(tmp_path / "train.de", ["a", "b"])
    with pytest.raises(DataError, match=r"source has 3 lines but target has 2"):
        load_parallel(src, tgt)


def test_invalid_utf8_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "train.de"
    path.write_bytes("gut\nMädchen\n".encode() + b"caf\xe9 latin-1\n")
    with pytest.raises(DataError, match=rf"{path}:3: invalid UTF-8"):
        read_lines(path)
    gz = tmp_path / "train.en.gz"
    gz.write_bytes(gzip.compress(b"ok\n\xff\xfe\n"))
    with pytest.raises(DataError, match=rf"{gz}:2: invalid UTF-8"):
        read_lines(gz)


def test_corrupt_gzip(tmp_path: Path) -> None:
    path = tmp_path / "x.en.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"cannot read .*x\.en\.gz"):
        read_lines(path)


def test_empty_lines_dropped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = _write(tmp_path / "s", ["one", "", "three", "four"])
    tgt = _write(tmp_path / "t", ["eins", "zwei", "  ", "vier"])
    with caplog.at_level(logging.WARNING, logger="data.sources"):
        data = load_parallel(src, tgt)
    assert data["src"][:] == ["one", "four"]
    assert "dropped 2 pairs with an empty line" in caplog.text


def test_empty_split(tmp_path: Path) -> None:
    src = _write(tmp_path / "s", [])
    tgt = _write(tmp_path / "t", [])
    with pytest.raises(DataError, match="split is empty"):
        load_parallel(src, tgt)
    with pytest.raises(DataError, match="split is empty"):
        load_parallel(_write(tmp_path / "s2", ["", ""]), _write(tmp_path / "t2", ["a", ""]))


# -- classification files --------------------------------------------------------------------------
def test_classification_formats_and_columns(tmp_path: Path) -> None:
    _write(tmp_path / "train.tsv", ["id\ttweet\tstars", '1\tgood "film"\tpos', "2\tbad\tneg"])
    _write(tmp_path / "dev.csv.gz", ["tweet,stars", '"fine, really",pos'], gz=True)
    records = [{"tweet": "meh", "stars": "neg"}, {"tweet": "wow", "stars": 1}]
    _write(tmp_path / "test.jsonl", [json.dumps(r) for r in records])
    files = {"train": tmp_path / "train.tsv", "dev": tmp_path / "dev.csv.gz", "test": tmp_path / "test.jsonl"}
    data = load_classification_files(files, "tweet", "stars", label_names=["neg", "pos"])
    assert data["train"][:] == {"text": ['good "film"', "bad"], "label": [1, 0]}
    assert data["dev"][:] == {"text": ["fine, really"], "label": [1]}
    assert data["test"][:] == {"text": ["meh", "wow"], "label": [0, 1]}  # names or indices


def test_label_names_inferred_from_train(tmp_path: Path) -> None:
    _write(tmp_path / "train.tsv", ["text\tlabel", "a\t10", "b\t2", "c\t2"])
    _write(tmp_path / "dev.tsv", ["text\tlabel", "d\t10"])
    files = {"train": tmp_path / "train.tsv", "dev": tmp_path / "dev.tsv"}
    data = load_classification_files(files)
    assert data["train"].features["label"].names == ["2", "10"]  # numeric order, not string order
    assert data["dev"]["label"][:] == [1]


def test_label_not_in_label_set(tmp_path: Path) -> None:
    path = _write(tmp_path / "dev.tsv", ["sentence\tlabel", "ok\t1", "odd\t2"])
    with pytest.raises(
        DataError, match=rf"{path}:3: label '2' is not in the label set \['negative', 'positive'\]"
    ):
        load_classification_files({"dev": path}, "sentence", "label", ["negative", "positive"])


def test_missing_text_column_and_bad_rows(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.tsv", ["text\tlabel", "x\t1"])
    with pytest.raises(DataError, match=r"a\.tsv:1: no column 'sentence'"):
        load_classification_files({"train": path}, "sentence")
    path = _write(tmp_path / "b.tsv", ["text\tlabel", "x\t1", "y"])
    with pytest.raises(DataError, match=r"b\.tsv:3: 1 fields, but the header has 2"):
        load_classification_files({"train": path})
    path = _write(tmp_path / "c.csv", ["text,label"])
    with pytest.raises(DataError, match="split 'train' is empty"):
        load_classification_files({"train": path})
    path = _write(tmp_path / "d.txt", ["text,label"])
    with pytest.raises(DataError, match="unknown format 'txt'"):
        load_classification_files({"train": path})


def test_classification_empty_rows_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _write(tmp_path / "train.tsv", ["text\tlabel", "x\t1", "", " \t0", "y\t0"])
    with caplog.at_level(logging.WARNING, logger="data.sources"):
        data = load_classification_files({"train": path})
    assert data["train"]["text"][:] == ["x", "y"]
    assert "dropped 2 empty lines" in caplog.text


def test_unlabeled_split_refused_for_scoring(tmp_path: Path) -> None:
    """GLUE's test.tsv has no label column ("index<TAB>sentence"): it loads, all -1, and cannot be scored."""
    _write(tmp_path / "train.tsv", ["sentence\tlabel", "good\t1", "bad\t0"])
    _write(tmp_path / "test.tsv", ["index\tsentence", "0\tfine", "1\tawful"])
    data = load_sst2(tmp_path, ["train", "test"])
    assert data["test"]["label"][:] == [-1, -1]
    check_labeled(data["train"], "train")
    with pytest.raises(DataError, match=r"split 'test' is unlabeled \(all labels are -1"):
        check_labeled(data["test"], "test")


def test_partly_unlabeled_split(tmp_path: Path) -> None:
    path = _write(tmp_path / "dev.tsv", ["sentence\tlabel", "a\t1", "b\t-1"])
    with pytest.raises(DataError, match=r"dev\.tsv:3: label -1 \(unlabeled\) in a labeled split"):
        load_classification_files({"dev": path}, "sentence", "label", ["negative", "positive"])


# -- synthetic and hub code paths --------------------------------------------------------------------
def test_synthetic_source() -> None:
    data = load_synthetic(["val"], seed=1, sizes={"train": 10, "val": 5})
    assert len(data["val"]) == 5 and data["val"].column_names == ["src", "tgt"]
    with pytest.raises(DataError, match="not \\['dev'\\]"):
        load_synthetic(["dev"], sizes={"train": 10})


def test_multi30k_hub_maps_split_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network here: the hub call is replaced by a DatasetDict shaped like bentrevett/multi30k."""
    calls = []

    def fake_load_dataset(name: str, config: str | None = None) -> datasets.DatasetDict:
        calls.append((name, config))
        split = datasets.Dataset.from_dict({"en": [" A dog. "], "de": ["Ein Hund."]})
        return datasets.DatasetDict({"train": split, "validation": split, "test": split})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    data = load_multi30k(None, ["val", "test_2016_flickr"], "en", "de")
    assert calls == [("bentrevett/multi30k", None)]
    assert data["val"][0] == {"src": "A dog.", "tgt": "Ein Hund."}
    with pytest.raises(DataError, match="no split 'test_2017_flickr'"):
        load_multi30k(None, ["test_2017_flickr"])
    with pytest.raises(DataError, match="expected 'en' and 'fr'"):
        load_multi30k(None, ["val"], "en", "fr")


def test_translation_hub_column_of_dicts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """WMT-style hub data: a "translation" column of {lang: text} dicts, read with map/filter."""
    rows = [{"de": "Hallo Welt", "en": "Hello world"}, {"de": "", "en": "empty"}, {"de": " Ja ", "en": "Yes"}]

    def fake_load_dataset(name: str, config: str | None = None) -> datasets.DatasetDict:
        assert (name, config) == ("wmt/wmt14", "de-en")
        return datasets.DatasetDict({"train": datasets.Dataset.from_dict({"translation": rows})})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with caplog.at_level(logging.WARNING, logger="data.sources"):
        data = sources.load_translation_hub("wmt/wmt14", ["train"], "de", "en", "de-en")
    assert data["train"][:] == {"src": ["Hallo Welt", "Ja"], "tgt": ["Hello world", "Yes"]}
    assert "dropped 1 pairs" in caplog.text
    with pytest.raises(DataError, match=r"languages \['de', 'en'\], not \['fr'\]"):
        sources.load_translation_hub("wmt/wmt14", ["train"], "de", "fr", "de-en")


def test_sst2_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    features = datasets.Features(
        {"sentence": datasets.Value("string"), "label": datasets.ClassLabel(names=["negative", "positive"])}
    )

    def fake_load_dataset(name: str, config: str | None = None) -> datasets.DatasetDict:
        assert name == sources.SST2_HUB
        labeled = datasets.Dataset.from_dict(
            {"sentence": ["good ", "bad"], "label": [1, 0]}, features=features
        )
        unlabeled = datasets.Dataset.from_dict({"sentence": ["meh"], "label": [-1]}, features=features)
        return datasets.DatasetDict({"train": labeled, "validation": labeled, "test": unlabeled})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    data = load_sst2(None, ["dev", "test"])
    assert data["dev"][:] == {"text": ["good", "bad"], "label": [1, 0]}
    with pytest.raises(DataError, match="unlabeled"):
        check_labeled(data["test"], "test")


# -- the hub datasets as published (tests/assets/hub_schemas.json) ---------------------------------
HUB_SCHEMAS = json.loads((Path(__file__).parents[1] / "assets" / "hub_schemas.json").read_text())
ROW = {"de": "Ein Hund läuft .", "en": "A dog runs ."}


def _published(name: str, config: str | None) -> datasets.DatasetDict:
    """Two rows per split of hub dataset `name`, with exactly its published features and split names."""
    schema = HUB_SCHEMAS[name]
    assert config == schema["config"], (
        f"{name}: the config asks for {config!r}, the hub has {schema['config']!r}"
    )
    features = datasets.Features.from_dict(schema["features"])
    splits = {}
    for split in schema["splits"]:
        if "translation" in features:
            columns: dict = {"translation": [ROW, ROW]}
        elif "sentence" in features:
            label = -1 if split == "test" else 1  # GLUE's test split is unlabeled
            columns = {"idx": [0, 1], "sentence": [" good film ", "good film"], "label": [label, label]}
        else:
            columns = {lang: [ROW[lang], ROW[lang]] for lang in features}
        splits[split] = datasets.Dataset.from_dict(columns, features=features)
    return datasets.DatasetDict(splits)


@pytest.mark.parametrize(
    ("experiment", "hub_name"),
    [
        ("multi30k_de_en", "bentrevett/multi30k"),
        ("sst2", "stanfordnlp/sst2"),
        ("iwslt14_de_en", "bbaaaa/iwslt14-de-en"),
        ("wmt14_en_de_base", "wmt/wmt14"),
    ],
)
def test_hub_loaders_read_the_published_schemas(
    experiment: str, hub_name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each data config's train/val/test splits, through its datamodule's loader, on data shaped like the
    hub dataset's card says (columns, feature types, split names, the config name)."""
    import hydra
    from omegaconf import open_dict

    from tests.helpers.configs import compose_train_cfg

    calls: list[tuple[str, str | None]] = []

    def load_dataset(name: str, config: str | None = None) -> datasets.DatasetDict:
        calls.append((name, config))
        return _published(name, config)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg = compose_train_cfg([f"experiment={experiment}"], output_dir=tmp_path)
    with open_dict(cfg):
        cfg.data.data_dir = None  # from the hub, not a local copy
    module = hydra.utils.instantiate(cfg.data)
    splits = [cfg.data.train_split, cfg.data.val_split, cfg.data.test_split]
    loaded = module._load_raw(splits)
    assert {name for name, _ in calls} == {hub_name}
    for split in splits:
        if "src_lang" in cfg.data:
            row = loaded[split][0]
            assert row == {"src": ROW[cfg.data.src_lang], "tgt": ROW[cfg.data.tgt_lang]}, (split, row)
        else:
            assert loaded[split][:] == {"text": ["good film", "good film"], "label": [1, 1]}
            assert loaded[split].features["label"].names == ["negative", "positive"]
    if hub_name == sources.SST2_HUB:  # GLUE's test split: read, but refused for scoring
        with pytest.raises(DataError, match="unlabeled"):
            check_labeled(module._load_raw(["test"])["test"], "test")


def test_hub_dataset_that_cannot_be_loaded_is_one_data_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network, an unknown name or config: one DataError naming the dataset, not a traceback."""

    def load_dataset(name: str, config: str | None = None) -> datasets.DatasetDict:
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(
        DataError, match=r"cannot load hub dataset 'oops' \(config 'x'\).*OfflineModeIsEnabled"
    ):
        sources.load_translation_hub("oops", ["train"], "de", "en", "x")

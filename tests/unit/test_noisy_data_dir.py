"""benchmarks/data/noisy_data_dir.py: a new directory written whole (in a fresh `.partial-*` beside it,
renamed into place), whatever an earlier crash left; a missing input file or an existing output is one
`error:` line."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from benchmarks.data.noisy_data_dir import main


def _corpus(directory: Path, n: int = 60) -> Path:
    directory.mkdir()
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("de", "en", "fr"):
            lines = [f"{lang} sentence number {i} of the {split} split ." for i in range(n)]
            with gzip.open(directory / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.writelines(line + "\n" for line in lines)
    return directory


def test_a_crashed_runs_partial_directory_is_no_obstacle(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "multi30k")
    out = tmp_path / "noisy"
    (tmp_path / "noisy.partial").mkdir()  # what the earlier layout of a crashed run left
    (tmp_path / "noisy.partial-crashed").mkdir()
    main(["--data-dir", str(corpus), "--output-dir", str(out)])
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["train.de.gz", "train.en.gz", "train.kinds.txt"]
        + [f"{s}.{lang}.gz" for s in ("val", "test_2016_flickr") for lang in ("de", "en")]
    )
    assert len((out / "train.kinds.txt").read_text().splitlines()) == 60
    assert not [
        p
        for p in tmp_path.iterdir()
        if p.name.startswith("noisy.partial-") and p.name != "noisy.partial-crashed"
    ]


def test_a_missing_file_or_an_existing_output_is_one_error_line(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "multi30k")
    (corpus / "val.en.gz").unlink()
    with pytest.raises(SystemExit, match=r"^error: .*val\.en\.gz is missing: --data-dir must hold"):
        main(["--data-dir", str(corpus), "--output-dir", str(tmp_path / "noisy")])
    assert not any(p.name.startswith("noisy") for p in tmp_path.iterdir())
    (tmp_path / "taken").mkdir()
    with pytest.raises(SystemExit, match=r"^error: .*taken exists; choose a new --output-dir$"):
        main(["--data-dir", str(corpus), "--output-dir", str(tmp_path / "taken")])

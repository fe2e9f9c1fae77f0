"""`aiayn-import` of damaged or contradictory model directories: one `error:` line naming the file and what is
wrong, exit status 1, nothing written, and nothing large allocated on the way (sizes are checked against the
weights' headers on the meta device first: `transformer.interop.weights`). Each case damages a copy of a tiny
OPUS-MT or BERT directory (`tests.helpers.pretrained`) that imports cleanly as it is.
"""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from tests.helpers.datasets import data_dir  # noqa: E402
from tests.helpers.pretrained import bert_directory, opus_mt_directory  # noqa: E402
from tests.helpers.refusals import assert_usage_error  # noqa: E402
from transformer.interop.import_cli import main  # noqa: E402
from transformer.interop.source import ExportError  # noqa: E402
from transformer.interop.weights import weight_shapes  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _quiet_transformers():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("built")
    return {
        "marian": opus_mt_directory(root / "opus", data_dir("MULTI30K_DIR")),
        "bert": bert_directory(root / "bert", data_dir("SST2_DIR")),
        "bert-model": bert_directory(root / "bert-model", data_dir("SST2_DIR"), head=False),
    }


@contextlib.contextmanager
def _at_most(extra: int) -> Iterator[None]:
    """The process may map at most `extra` more bytes meanwhile: an allocation of gigabytes fails (and the
    test with it) instead of swapping the machine."""
    mapped = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _edit_config(**changes: object) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        config.update(changes)
        (directory / "config.json").write_text(json.dumps(config))

    return edit


def _truncate(directory: Path) -> None:
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _corrupt_header(directory: Path) -> None:
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[:8] = b"\xff" * 8  # the header's length: far beyond the file
    weights.write_bytes(bytes(data))


def _bad_json_header(directory: Path) -> None:
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[10:20] = b"}" * 10
    weights.write_bytes(bytes(data))


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda directory: (directory / name).write_text(text)


CASES = {
    "marian truncated weights": ("marian", _truncate, "model.safetensors is truncated or corrupt"),
    "marian corrupt header": ("marian", _corrupt_header, "model.safetensors is truncated or corrupt"),
    "marian header not json": ("marian", _bad_json_header, "model.safetensors is truncated or corrupt"),
    "marian d_model": ("marian", _edit_config(d_model=64), "config.json disagrees with its weights"),
    "marian layers": ("marian", _edit_config(encoder_layers=3), "its weights lack model.encoder.layers.2"),
    "marian positions 1e12": (
        "marian",
        _edit_config(max_position_embeddings=10**12),
        "asks for tables of 256000.0 GB",
    ),
    "marian d_model type": ("marian", _edit_config(d_model="abc"), "Field 'd_model' expected int"),
    "marian vocab.json list": ("marian", _write("vocab.json", "[1, 2]"), "not a mapping of pieces to ids"),
    "marian vocab.json cut": ("marian", _write("vocab.json", '{"a": 1'), "tokenizer files cannot be read"),
    "marian no weights": (
        "marian",
        lambda d: (d / "model.safetensors").unlink(),
        "has no weights (model.safetensors or pytorch_model.bin)",
    ),
    "marian positions 1": (
        "marian",
        _edit_config(max_position_embeddings=1),
        "max_len must be an integer >= 2, got 1",
    ),
    "marian empty weights": (
        "marian",
        lambda d: (d / "model.safetensors").write_bytes(b""),
        "model.safetensors is truncated or corrupt",
    ),
    "bert heads": ("bert", _edit_config(num_attention_heads=3), "must be divisible by n_heads (3)"),
    "bert vocab.txt not utf-8": (
        "bert",
        lambda d: ((d / "tokenizer.json").unlink(), (d / "vocab.txt").write_bytes(b"\xff\xfe[PAD]\n")),
        "vocab.txt is not a WordPiece vocabulary",
    ),
    "bert truncated weights": ("bert", _truncate, "model.safetensors is truncated or corrupt"),
    "bert corrupt header": ("bert", _corrupt_header, "model.safetensors is truncated or corrupt"),
    "bert tokenizer.json": (
        "bert",
        _write("tokenizer.json", "{not json"),
        "tokenizer.json is not a tokenizers",
    ),
    "bert tokenizer.json shape": ("bert", _write("tokenizer.json", '{"model": 3}'), "is not a tokenizers"),
    "bert hidden_size": (
        "bert",
        _edit_config(hidden_size=64),
        "config.json disagrees with its weights: bert.embeddings.LayerNorm.bias has shape [32]",
    ),
    "bert vocab_size": (
        "bert",
        _edit_config(vocab_size=605),
        "bert.embeddings.word_embeddings.weight has shape [600, 32] in the weights, [605, 32] by config.json",
    ),
    "bert positions 1e12": (
        "bert",
        _edit_config(max_position_embeddings=10**12),
        "position_embeddings.weight has shape [128, 32] in the weights, [1000000000000, 32] by config.json",
    ),
    "bert labels": (
        "bert",
        _edit_config(id2label={str(i): f"l{i}" for i in range(5)}, label2id={f"l{i}": i for i in range(5)}),
        "classifier.bias has shape [3] in the weights, [5] by config.json",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_directory_is_one_line_and_nothing_written(
    built: dict[str, Path], tmp_path: Path, capsys, case: str
) -> None:
    kind, damage, fragment = CASES[case]
    source = tmp_path / "model"
    shutil.copytree(built[kind], source)
    damage(source)
    with _at_most(2 << 30):
        assert main([str(source), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot import {source}") and "\n" not in err, err
    assert fragment in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("classes", ["1000000000000", "100001", "1"])
def test_a_new_head_of_an_impossible_size_is_refused_before_it_is_allocated(
    built: dict[str, Path], tmp_path: Path, capsys, classes: str
) -> None:
    with _at_most(2 << 30):
        assert (
            main([str(built["bert-model"]), "--output", str(tmp_path / "out"), "--num-classes", classes]) == 1
        )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert f"--num-classes {classes}: a classifier has 2 to 100000 classes" in err
    assert not (tmp_path / "out").exists()


def test_the_weight_shapes_come_from_the_headers_of_either_format(
    built: dict[str, Path], tmp_path: Path
) -> None:
    shapes = weight_shapes(built["bert"])
    assert shapes["bert.embeddings.word_embeddings.weight"] == (600, 32) and shapes["classifier.weight"] == (
        3,
        32,
    )
    state = transformers.BertForSequenceClassification.from_pretrained(built["bert"]).state_dict()
    binary = tmp_path / "bin"
    binary.mkdir()
    torch.save(state, binary / "pytorch_model.bin")
    assert weight_shapes(binary) == {name: tuple(t.shape) for name, t in state.items()}
    data = (binary / "pytorch_model.bin").read_bytes()
    (binary / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError, match=r"pytorch_model\.bin is truncated or corrupt"):
        weight_shapes(binary)


def test_the_undamaged_directories_import(built: dict[str, Path], tmp_path: Path) -> None:
    """The damage, not the check, is what each case above is refused for."""
    with _at_most(2 << 30):
        assert main([str(built["marian"]), "--output", str(tmp_path / "m")]) == 0
        assert main([str(built["bert"]), "--output", str(tmp_path / "b")]) == 0
        assert (
            main([str(built["bert-model"]), "--output", str(tmp_path / "n"), "--num-classes", "100000"]) == 0
        )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["m", "--output", "o", "--num-classes", "abc"],
            "error: argument --num-classes: invalid int value: 'abc'",
        ),
        (["m", "--output", "o", "--num-classes", "1e12"], "error: argument --num-classes: invalid int value"),
        (["m"], "error: the following arguments are required: --output"),
    ],
)
def test_argument_errors_are_one_line_with_the_usage(capsys, argv: list[str], expected: str) -> None:
    assert_usage_error(capsys, main, argv, expected, "aiayn-import")


def test_evaluating_an_import_in_other_languages_is_refused_naming_both(
    built: dict[str, Path], tmp_path: Path, capsys
) -> None:
    """`+data.src_lang=en +data.tgt_lang=de` (Hydra's hint) on a de -> en import decoded nonsense (BLEU 0)."""
    from transformer.checkpoint import load_checkpoint
    from transformer.cli.errors import ConfigError
    from transformer.cli.evaluate_steps import build_datamodule
    from transformer.evaluation.restore import restore_model

    assert main([str(built["marian"]), "--output", str(tmp_path / "out")]) == 0
    path = tmp_path / "out" / "model.ckpt"
    restored = restore_model(load_checkpoint(path), path)
    with pytest.raises(ConfigError) as refused:
        build_datamodule(restored, {"src_lang": "en", "tgt_lang": "de"}, path)
    assert str(refused.value) == (
        f"data.src_lang=en data.tgt_lang=de but checkpoint {path} translates de -> en: evaluate it on data "
        "in its languages"
    )
    with pytest.raises(ConfigError, match=r"^data\.tgt_lang=fr but checkpoint"):
        build_datamodule(restored, {"src_lang": "de", "tgt_lang": "fr"}, path)
    assert build_datamodule(restored, {"src_lang": "de", "tgt_lang": "en"}, path).src_tokenizer is not None

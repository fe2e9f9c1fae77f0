"""aiayn-export's refusals: classification / masked-LM checkpoints, settings a target cannot express,
non-empty output, truncated or unsafe files, exports that compute something else: one `error:` line,
status 1, nothing written. (What the exports compute: test_export.py.)
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
from torch import Tensor

from data.tokenization import train_bpe
from tests.helpers.exports import save_checkpoint, trained_export_model
from tests.helpers.refusals import MaliciousPickle, assert_usage_error
from transformer.interop.export_cli import main
from transformer.model import Seq2SeqTransformer, TransformerClassifier

transformers = pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")

from transformer.interop.ctranslate2 import export_ctranslate2  # noqa: E402
from transformer.interop.export_hf import export_hf  # noqa: E402
from transformer.interop.source import ExportError, load_source  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A trained tiny model, its tokenizer, its checkpoint, and test sources (padded batch)."""
    return trained_export_model(tmp_path_factory.mktemp("export"))


# --- refusals: one error line, status 1, nothing written ---------------------------------------------------


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> str:
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], captured.err
    return lines[0]


def test_refuses_a_classification_checkpoint(trained: dict, tmp_path: Path, capsys) -> None:
    config = dataclasses.replace(trained["model"].config, n_decoder_layers=0)
    classifier = TransformerClassifier(config, num_classes=2)
    ckpt = save_checkpoint(
        tmp_path / "cls.ckpt",
        classifier,
        {"joint": trained["tokenizer"].to_json()},
        hparams={"num_classes": 2},
        datamodule="ClassificationDataModule",
    )
    for target in ("hf", "ctranslate2"):
        _refused(capsys, [str(ckpt), "--to", target, "--output", str(tmp_path / target)], "classification")
        assert not (tmp_path / target).exists()


def test_refuses_a_masked_lm_checkpoint(trained: dict, tmp_path: Path, capsys) -> None:
    ckpt = save_checkpoint(
        tmp_path / "mlm.ckpt", trained["model"], {"joint": "{}"}, hparams={"mask_prob": 0.15}
    )
    _refused(capsys, [str(ckpt), "--to", "hf", "--output", str(tmp_path / "out")], "masked-LM")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "target", "expected"),
    [
        ({"norm_first": True}, "hf", "model.config.norm_first=true (pre-LN)"),
        ({"positional": "learned"}, "hf", "model.config.positional=learned"),
        ({"positional": "rope"}, "hf", "model.config.positional=rope"),
        ({"activation": "swiglu"}, "hf", "model.config.activation=swiglu"),
        ({"embedding_norm": True}, "hf", "model.config.embedding_norm=true"),
        ({"norm_eps": 1e-12}, "hf", "model.config.norm_eps=1e-12"),
    ],
)
def test_refuses_settings_the_target_cannot_express(
    trained: dict, tmp_path: Path, capsys, change: dict, target: str, expected: str
) -> None:
    config = dataclasses.replace(trained["model"].config, **change)
    ckpt = save_checkpoint(
        tmp_path / "m.ckpt", Seq2SeqTransformer(config), {"joint": trained["tokenizer"].to_json()}
    )
    _refused(capsys, [str(ckpt), "--to", target, "--output", str(tmp_path / "out")], expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.ckpt"]  # no output, no staging directory


def test_refuses_separate_tokenizers_for_hf_but_ctranslate2_takes_them(
    trained: dict, tmp_path: Path, capsys
) -> None:
    tokenizer = trained["tokenizer"]
    config = dataclasses.replace(trained["model"].config, tie_embeddings="decoder")
    model = Seq2SeqTransformer(config).eval()
    ckpt = save_checkpoint(
        tmp_path / "m.ckpt", model, {"src": tokenizer.to_json(), "tgt": tokenizer.to_json()}
    )
    _refused(
        capsys, [str(ckpt), "--to", "hf", "--output", str(tmp_path / "hf")], "separate source and target"
    )
    assert main([str(ckpt), "--to", "ctranslate2", "--output", str(tmp_path / "ct2")]) == 0
    assert {"source_tokenizer.json", "target_tokenizer.json"} <= {
        p.name for p in (tmp_path / "ct2").iterdir()
    }


def test_refuses_a_non_empty_output_unless_forced(trained: dict, tmp_path: Path, capsys) -> None:
    """--force replaces an earlier export (of either target), never a directory holding anything else."""
    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    _refused(capsys, [str(trained["ckpt"]), "--to", "ctranslate2", "--output", str(output)], "not empty")
    argv = [str(trained["ckpt"]), "--to", "ctranslate2", "--output", str(output), "--force"]
    _refused(capsys, argv, "holds keep.txt, which this command does not write")
    assert [p.name for p in output.iterdir()] == ["keep.txt"]
    (output / "keep.txt").unlink()
    assert main(argv) == 0
    assert main([str(trained["ckpt"]), "--to", "hf", "--output", str(output), "--force"]) == 0
    assert "model.safetensors" in {p.name for p in output.iterdir()} and not (output / "model.bin").exists()
    assert main(argv) == 0  # and back
    capsys.readouterr()
    (output / "notes").mkdir()
    _refused(capsys, argv, "holds notes, which this command does not write")
    assert (output / "notes").is_dir() and (output / "model.bin").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging leftovers


def test_a_symlinked_output_is_written_through_and_a_loop_refused(
    trained: dict, tmp_path: Path, capsys
) -> None:
    target = tmp_path / "real"
    target.mkdir()
    link, loop = tmp_path / "link", tmp_path / "loop"
    link.symlink_to(target, target_is_directory=True)
    loop.symlink_to(loop)
    _refused(capsys, [str(trained["ckpt"]), "--to", "ctranslate2", "--output", str(loop)], "loop")
    assert main([str(trained["ckpt"]), "--to", "ctranslate2", "--output", str(link)]) == 0
    assert link.is_symlink() and (target / "model.bin").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "loop", "real"]


def test_refuses_an_output_that_holds_the_checkpoint(trained: dict, capsys) -> None:
    """--force replaces the output directory: never the one the checkpoint is read from."""
    directory = trained["ckpt"].parent
    before = sorted(p.name for p in directory.iterdir())
    argv = [str(trained["ckpt"]), "--to", "ctranslate2", "--output", str(directory), "--force"]
    _refused(capsys, argv, "holds the checkpoint")
    assert sorted(p.name for p in directory.iterdir()) == before


def test_refuses_truncated_and_unsafe_checkpoints(trained: dict, tmp_path: Path, capsys) -> None:
    data = trained["ckpt"].read_bytes()
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(data[: len(data) // 2])
    _refused(capsys, [str(truncated), "--to", "hf", "--output", str(tmp_path / "a")], "truncated or corrupt")
    evil = tmp_path / "evil.ckpt"
    payload = MaliciousPickle(tmp_path / "pwned")
    evil.write_bytes(pickle.dumps({"state_dict": {}, "payload": payload}, protocol=2))
    _refused(capsys, [str(evil), "--to", "ctranslate2", "--output", str(tmp_path / "b")], str(evil))
    _refused(
        capsys, [str(tmp_path / "nope.ckpt"), "--to", "hf", "--output", str(tmp_path / "c")], "does not exist"
    )
    assert not (tmp_path / "pwned").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.ckpt", "truncated.ckpt"]


def test_quantization_only_for_ctranslate2(trained: dict, tmp_path: Path, capsys) -> None:
    _refused(
        capsys,
        [str(trained["ckpt"]), "--to", "hf", "--output", str(tmp_path / "x"), "--quantization", "int8"],
        "--quantization applies to --to ctranslate2 only",
    )


def test_load_source_refuses_a_tokenizer_of_another_size(trained: dict, tmp_path: Path) -> None:
    small = train_bpe(["ein kleiner Hund", "zwei kleine Hunde"], 30, min_frequency=1)
    ckpt = save_checkpoint(tmp_path / "m.ckpt", trained["model"], {"joint": small.to_json()})
    with pytest.raises(ExportError, match="tokenizer has"):
        load_source(ckpt)


def test_export_functions_write_nothing_on_refusal(trained: dict, tmp_path: Path) -> None:
    config = dataclasses.replace(trained["model"].config, positional="learned")
    ckpt = save_checkpoint(
        tmp_path / "m.ckpt", Seq2SeqTransformer(config), {"joint": trained["tokenizer"].to_json()}
    )
    source = load_source(ckpt)
    with pytest.raises(ExportError, match="positional=learned"):
        export_hf(source, tmp_path / "hf")
    exported = export_ctranslate2(source, tmp_path / "ct2", quantization="int8")
    assert (
        tmp_path / "ct2" / "model.bin"
    ).is_file() and "int8 weights change the numbers" in exported.checked
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2", "m.ckpt"]


def test_an_export_that_computes_something_else_is_not_written(
    trained: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Every export is loaded back from its files and compared with the checkpoint on a probe batch:
    a wrong weight (here, the permutation left out of one LayerNorm) fails the export."""
    from transformer.interop import marian as hf

    original = hf._marian_state_dict

    def wrong(model: Seq2SeqTransformer) -> dict[str, Tensor]:
        weights = original(model)
        name = "model.encoder.layers.0.final_layer_norm.weight"
        weights[name] = model.encoder.layers[0].norm2.weight.detach().clone()  # not permuted
        return weights

    monkeypatch.setattr(hf, "_marian_state_dict", wrong)
    _refused(capsys, [str(trained["ckpt"]), "--to", "hf", "--output", str(tmp_path / "hf")], "differ from")
    assert not any(tmp_path.iterdir())


def test_a_ctranslate2_export_that_computes_something_else_is_not_written(
    trained: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The same for CTranslate2 (float32, where the comparison is enforced): one feed-forward layer's
    first weight scaled by 1.5 in the converted model fails the export, and nothing is left behind."""
    from transformer.interop import ctranslate2 as ct2

    original = ct2._set_feed_forward
    wrong_layers: list[object] = []

    def wrong(spec, module) -> None:  # type: ignore[no-untyped-def]
        original(spec, module)
        if not wrong_layers:  # the first layer converted only
            wrong_layers.append(spec)
            spec.linear_0.weight = spec.linear_0.weight * 1.5

    monkeypatch.setattr(ct2, "_set_feed_forward", wrong)
    argv = [str(trained["ckpt"]), "--to", "ctranslate2", "--output", str(tmp_path / "ct2")]
    _refused(capsys, argv, "log-probabilities differ from")
    assert wrong_layers and not any(tmp_path.iterdir())


def test_cli_reports_the_measured_difference(trained: dict, tmp_path: Path, capsys) -> None:
    assert main([str(trained["ckpt"]), "--to", "ctranslate2", "--output", str(tmp_path / "ct2")]) == 0
    line = capsys.readouterr().out.strip()
    difference = float(line.rsplit("max |diff| ", 1)[1].rstrip(")"))
    assert difference <= 1e-4, line


def test_an_empty_checkpoint_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    _refused(capsys, [str(empty), "--to", "hf", "--output", str(tmp_path / "out")], "truncated or corrupt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.ckpt"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["m.ckpt", "--to", "onnx", "--output", "out"], "error: argument --to: invalid choice: 'onnx'"),
        (["m.ckpt", "--output", "out"], "error: the following arguments are required: --to"),
    ],
)
def test_argument_errors_are_one_line_with_the_usage(capsys, argv: list[str], expected: str) -> None:
    assert_usage_error(capsys, main, argv, expected, "aiayn-export")

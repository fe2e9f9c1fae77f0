"""`aiayn-import` end to end: a tiny OPUS-MT directory (`tests.helpers.pretrained`) imported as a checkpoint,
then evaluated by `evaluate.py` as users run it, with the translations transformers makes of the same
sentences (MarianTokenizer in, `generate`, MarianTokenizer out); bad input refused with one line and
nothing written; `aiayn-export` of the imported checkpoint as a process.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from tests.helpers.cli import run_script  # noqa: E402
from tests.helpers.datasets import data_dir  # noqa: E402
from tests.helpers.pretrained import multi30k_lines, opus_mt_directory  # noqa: E402
from transformer.checkpoint import load_checkpoint  # noqa: E402
from transformer.interop.import_cli import main  # noqa: E402

pytestmark = pytest.mark.slow  # evaluate.py runs as a process
N_SENTENCES = 30


@pytest.fixture(scope="module")
def opus_dir(tmp_path_factory) -> Path:
    return opus_mt_directory(tmp_path_factory.mktemp("opus-mt-de-en"), data_dir("MULTI30K_DIR"))


@pytest.fixture(scope="module")
def imported(opus_dir: Path, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("imported") / "opus"
    assert main([str(opus_dir), "--output", str(output)]) == 0
    return output / "model.ckpt"


def _refused(capsys, argv: list[str], fragment: str) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert fragment in err, err


def test_the_imported_checkpoint_says_what_it_is(imported: Path, opus_dir: Path) -> None:
    checkpoint = load_checkpoint(imported)  # the safe loader every checkpoint goes through
    config = checkpoint["hyper_parameters"]["config"]
    assert (config["activation"], config["output_bias"], config["bos_id"]) == ("silu", True, config["pad_id"])
    assert checkpoint["hyper_parameters"]["decoding"]["beam_size"] == 4  # its generation config's num_beams
    provenance = checkpoint["imported_from"]
    assert provenance["source"] == str(opus_dir) and provenance["architecture"] == "MarianMTModel"
    assert provenance["transformers"] == transformers.__version__
    assert checkpoint["config"]["data"]["src_lang"] == "de"  # from its tokenizer_config.json


def test_evaluate_translates_an_imported_model_as_transformers_does(
    imported: Path, opus_dir: Path, tmp_path
) -> None:
    data = data_dir("MULTI30K_DIR")
    out = tmp_path / "eval"
    result = run_script(
        "evaluate.py",
        [f"ckpt_path={imported}", f"data.data_dir={data}", "data.test_split=test_2016_flickr",
         f"data.test_sentences={N_SENTENCES}", "decode.beam_size=1", "decode.max_len_a=0",
         "decode.max_len_b=20", f"hydra.run.dir={out}"],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    ours = (out / "hypotheses.txt").read_text(encoding="utf-8").splitlines()
    sources = multi30k_lines(data, "test_2016_flickr.de.gz", N_SENTENCES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Recommended: pip install sacremoses" (a normalizer not used here)
        tokenizer = transformers.MarianTokenizer.from_pretrained(opus_dir)
    marian = transformers.MarianMTModel.from_pretrained(opus_dir).eval()
    batch = tokenizer(sources, return_tensors="pt", padding=True)
    with torch.no_grad():
        generated = marian.generate(**batch, num_beams=1, max_new_tokens=20, do_sample=False)
    theirs = tokenizer.batch_decode(generated, skip_special_tokens=True)
    assert ours == theirs
    assert len(set(ours)) >= 3  # random weights: a few distinct outputs, not one repeated string
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_examples"] == N_SENTENCES and "test/bleu" in metrics


def test_what_cannot_be_imported_is_refused_with_one_line(
    opus_dir: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    out = tmp_path / "out"
    bart = tmp_path / "bart"
    transformers.BartConfig(vocab_size=40).save_pretrained(bart)
    _refused(capsys, [str(bart), "--output", str(out)], "model_type='bart': only Marian (OPUS-MT)")
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((opus_dir / "config.json").read_text())
    _refused(capsys, [str(no_tokenizer), "--output", str(out)], "no tokenizer")
    _refused(capsys, [str(tmp_path / "missing"), "--output", str(out)], "is not a directory")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _refused(capsys, ["Helsinki-NLP/opus-mt-de-en", "--output", str(out)], "pass that directory")
    assert not out.exists()  # nothing written by any of them
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _refused(capsys, [str(opus_dir), "--output", str(out)], "exists and is not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_an_imported_model_translates_text_with_a_prefix_and_a_required_word(
    imported: Path, tmp_path
) -> None:
    """translate.input needs no data directory: the imported checkpoint's tokenizer alone."""
    request = {"src": "Ein Hund läuft im Schnee.", "prefix": "Ball", "constraints": ["gray"]}
    result = run_script(
        "evaluate.py",
        [f"ckpt_path={imported}", "translate.input=-", "translate.format=jsonl", f"hydra.run.dir={tmp_path}"],
        stdin=json.dumps(request) + "\n",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["translation"].startswith("Ball") and "gray" in line["translation"]
    assert line["unsatisfiable"] is False


def test_aiayn_export_exports_the_imported_model(imported: Path, tmp_path) -> None:
    """`aiayn-export` as users run it (a process) on the imported checkpoint: status 0 and one line with the
    measured difference; what the exports compute is tested in tests/unit/test_export_imported.py."""
    out = tmp_path / "ct2"
    argv = [str(imported), "--to", "ctranslate2", "--output", str(out)]
    result = run_script("transformer.interop.export_cli", argv, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip()
    assert "\n" not in line and float(line.rsplit("max |diff| ", 1)[1].rstrip(")")) <= 1e-5, line
    assert "Traceback" not in result.stderr
    assert {"model.bin", "source.spm", "target.spm", "README.md"} <= {p.name for p in out.iterdir()}

"""`evaluate.py ckpt_path=CLS.ckpt classify.input=FILE|-`: a classifier labels the user's own text lines, on a
tiny BERT imported here (`tests.helpers.pretrained.bert_directory`): the labels and probabilities are
transformers' for the same texts, one output line per input line (blank for blank), text and JSONL formats, a
file out; the other task's text option is refused in one line naming the right one. The evaluation of an
imported checkpoint names what it was imported from (console, metrics.json, report.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.helpers.cli import run_script  # noqa: E402
from tests.helpers.datasets import data_dir  # noqa: E402
from tests.helpers.pretrained import bert_directory, sst2_lines  # noqa: E402
from transformer.interop.import_cli import main  # noqa: E402

pytestmark = pytest.mark.slow  # evaluate.py runs as a process


@pytest.fixture(scope="module")
def imported_bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the transformers directory, the imported checkpoint)."""
    root = tmp_path_factory.mktemp("bert")
    source = bert_directory(root / "bert", data_dir("SST2_DIR"), num_labels=2)
    assert main([str(source), "--output", str(root / "imported")]) == 0
    return source, root / "imported" / "model.ckpt"


def _expected(source: Path, texts: list[str]) -> torch.Tensor:
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    model = transformers.BertForSequenceClassification.from_pretrained(source).eval()
    with torch.no_grad():
        return model(**tokenizer(texts, padding=True, return_tensors="pt")).logits.softmax(-1)


def test_classify_input_labels_text_as_transformers_does(imported_bert, tmp_path: Path) -> None:
    source, ckpt = imported_bert
    texts = sst2_lines(data_dir("SST2_DIR"), "dev", 6)
    expected = _expected(source, texts)
    config = transformers.AutoConfig.from_pretrained(source)
    names = [config.id2label[i] for i in range(2)]  # the import keeps transformers' class names
    lines = [texts[0], "", *texts[1:]]
    result = run_script(
        "evaluate.py",
        [
            f"ckpt_path={ckpt}",
            f"hydra.run.dir={tmp_path / 'pipe'}",
            "classify.input=-",
            "classify.chunk_lines=4",
        ],
        stdin="\n".join(lines) + "\n",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout.split("\n")
    assert out[-1] == "" and len(out) - 1 == len(lines) and out[1] == ""  # one line per line, blank kept
    rows = [out[0], *out[2:-1]]
    for row, probabilities in zip(rows, expected, strict=True):
        label, values = row.split("\t")
        given = json.loads(values)
        assert list(given) == names
        assert torch.tensor([given[name] for name in names]) == pytest.approx(probabilities, abs=1e-5)
        assert label == names[int(probabilities.argmax())]
    # a file in, JSONL to a file out; stdout stays empty
    infile, outfile = tmp_path / "texts.txt", tmp_path / "labels.jsonl"
    infile.write_text("\n".join(texts) + "\n", encoding="utf-8")
    result = run_script(
        "evaluate.py",
        [f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'file'}", f"classify.input={infile}",
         f"classify.output={outfile}", "classify.format=jsonl"],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == ""
    items = [json.loads(line) for line in outfile.read_text(encoding="utf-8").splitlines()]
    assert [item["label"] for item in items] == [names[int(p.argmax())] for p in expected]
    got = torch.tensor([[item["probabilities"][name] for name in names] for item in items])
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["translate.input=-"], "(classify.input=FILE or - labels text lines with it)"),
        (["classify.input=-", "classify.format=csv"], "classify.format must be one of ['text', 'jsonl']"),
        (["classify.input=/nonexistent/texts.txt"], "classify.input=/nonexistent/texts.txt is not a file"),
        (["classify.input=-", "data.test_sentences=2"], "classify.input read all their lines"),
    ],
)
def test_classify_input_refusals_are_one_line(imported_bert, tmp_path: Path, args, expected) -> None:
    _, ckpt = imported_bert
    result = run_script(
        "evaluate.py", [f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'e'}", *args], stdin=""
    )
    assert result.returncode == 1 and result.stdout == ""
    assert "Traceback" not in result.stderr
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("error: ") and expected in last, result.stderr[-2000:]


def test_evaluating_an_import_names_where_it_came_from(imported_bert, tmp_path: Path) -> None:
    """metrics.json, report.md and the console name the import's source and transformers version."""
    source, ckpt = imported_bert
    small = tmp_path / "sst2"  # 8 dev sentences in the GLUE layout
    small.mkdir()
    lines = (data_dir("SST2_DIR") / "dev.tsv").read_text(encoding="utf-8").splitlines()[:9]
    (small / "dev.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "eval"
    result = run_script(
        "evaluate.py", [f"ckpt_path={ckpt}", f"data.data_dir={small}", f"hydra.run.dir={out}"]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"weights were imported from {source} (transformers {transformers.__version__})" in result.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["imported_from"]["source"] == str(source) and "init_from" not in metrics
    assert metrics["imported_from"]["transformers"] == transformers.__version__
    assert f"| imported_from | source: {source}, architecture: " in (out / "report.md").read_text()

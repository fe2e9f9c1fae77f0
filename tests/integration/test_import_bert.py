"""`aiayn-import` of a BERT classifier, then `evaluate.py` on it as users run it: a tiny BERT made here
(`tests.helpers.pretrained.bert_directory`) scores 40 SST-2 dev sentences with the class probabilities
transformers gives the same sentences (the unit tests check the logits; this checks the whole command path
once).
"""

from __future__ import annotations

import csv
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
N_SENTENCES = 40


def test_evaluate_scores_an_imported_bert_as_transformers_does(tmp_path: Path) -> None:
    sst2 = data_dir("SST2_DIR")
    source = bert_directory(tmp_path / "bert", sst2, num_labels=2)
    assert main([str(source), "--output", str(tmp_path / "imported")]) == 0
    small = tmp_path / "sst2"  # the first sentences of the dev split, in the GLUE layout
    small.mkdir()
    lines = (sst2 / "dev.tsv").read_text(encoding="utf-8").splitlines()[: N_SENTENCES + 1]
    (small / "dev.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "eval"
    result = run_script(
        "evaluate.py",
        [f"ckpt_path={tmp_path / 'imported' / 'model.ckpt'}", f"data.data_dir={small}",
         f"hydra.run.dir={out}"],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out / "predictions.tsv", encoding="utf-8", newline="") as handle:
        rows = sorted(csv.DictReader(handle, delimiter="\t"), key=lambda row: int(row["id"]))
    ours = torch.tensor([[float(row["p(negative)"]), float(row["p(positive)"])] for row in rows])
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    model = transformers.BertForSequenceClassification.from_pretrained(source).eval()
    with torch.no_grad():
        theirs = model(**tokenizer(sst2_lines(sst2, "dev", N_SENTENCES), padding=True, return_tensors="pt"))
    expected = theirs.logits.softmax(-1)
    assert (ours - expected).abs().max().item() < 1e-4  # the file's four decimals
    predicted = {"negative": 0, "positive": 1}
    assert [predicted[row["prediction"]] for row in rows] == expected.argmax(-1).tolist()
    metrics = json.loads((out / "metrics.json").read_text())
    gold = [int(line.rsplit("\t", 1)[1]) for line in lines[1:]]
    accuracy = sum(p == g for p, g in zip(expected.argmax(-1).tolist(), gold)) / N_SENTENCES
    assert metrics["num_examples"] == N_SENTENCES and metrics["test/acc"] == pytest.approx(accuracy)

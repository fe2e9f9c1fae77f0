"""aiayn-export end to end: a real (tiny) train.py run, exported through the installed command line.

The checkpoint train.py selected is exported to transformers and CTranslate2 (float32 and int8); the
exports decode the run's own test split exactly as our greedy search does, the model card carries the
run's own scores with their sacreBLEU signature, and beam search agrees on most sentences.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import run_script
from tests.helpers.repo import REPO_ROOT
from transformer.search.decoding import beam_search, greedy_search

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")

# the quickstart task, small: a few hundred steps of a d_model 64 model that ends its sentences
TRAIN = [
    "data.synthetic_sizes.train=1500",
    "data.synthetic_sizes.val=40",
    "data.synthetic_sizes.test=60",
    "data.vocab_size=400",
    "model.config.d_model=64",
    "model.config.n_heads=4",
    "model.config.d_ff=128",
    "model.optimizer.lr=3e-3",
    "model.scheduler.warmup_steps=50",
    "model.test_decoding={beam_size: 4, length_penalty: 0.6}",
    "trainer.max_epochs=4",
    "trainer.num_sanity_val_steps=0",
]
LIMIT = 40  # one length limit for every decoder: ours counts EOS in it, CTranslate2 does not


def _run(script: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PROJECT_ROOT": str(REPO_ROOT), "WANDB_MODE": "offline"}
    return run_script(script, args, env=env, timeout=900)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("export_run")
    result = _run(
        "train.py",
        [
            f"hydra.run.dir={root / 'run'}",
            f"paths.cache_dir={root / 'cache'}",
            "logger=csv",
            "trainer=cpu",
            *TRAIN,
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((root / "run" / "metrics.json").read_text())
    ckpt = Path(metrics["best_ckpt_path"])
    exports = {}
    for name, extra in (("hf", []), ("ct2", []), ("ct2_int8", ["--quantization", "int8"])):
        target = "hf" if name == "hf" else "ctranslate2"
        out = root / name
        done = _run(
            "transformer.interop.export_cli", [str(ckpt), "--to", target, "--output", str(out), *extra]
        )
        assert done.returncode == 0 and done.stderr.count("error:") == 0, done.stderr[-3000:]
        assert str(out) in done.stdout
        exports[name] = out
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    from data.sources import load_synthetic

    data = checkpoint["config"]["data"]
    test = load_synthetic(["test"], seed=data["seed"], sizes=data["synthetic_sizes"])["test"]
    from transformer.interop.source import load_source

    return {"metrics": metrics, "source": load_source(ckpt), "texts": test["src"][:], **exports}


def _ours(run: dict, **search) -> list[list[int]]:
    """Our search on the test sources -> token ids without BOS and EOS."""
    from data.tokenization import BPETokenizer

    source = run["source"]
    tokenizer = BPETokenizer.from_json(source.src_tokenizer_json)
    ids = [torch.tensor(tokenizer.encode(text)) for text in run["texts"]]
    src = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=tokenizer.pad_id)
    if search.get("beam_size", 1) == 1:
        tokens = greedy_search(source.model, src, max_len_a=0, max_len_b=LIMIT)
    else:
        tokens = beam_search(source.model, src, max_len_a=0, max_len_b=LIMIT, **search)[0][:, 0]
    eos, pad = tokenizer.eos_id, tokenizer.pad_id
    return [[t for t in row if t not in (eos, pad)] for row in tokens.tolist()]


def _ct2(directory: Path, texts: list[str], **options) -> list[list[int]]:
    import tokenizers

    plain = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    translator = ctranslate2.Translator(str(directory), device="cpu")
    batch = [plain.encode(text, add_special_tokens=False).tokens for text in texts]
    results = translator.translate_batch(batch, max_decoding_length=LIMIT - 1, **options)
    return [[plain.token_to_id(token) for token in result.hypotheses[0]] for result in results]


def _hf(directory: Path, texts: list[str], **options) -> tuple[list[list[int]], list[str]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    generated = model.generate(**batch, max_new_tokens=LIMIT, **options)
    special = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    ids = [[t for t in row if t not in special] for row in generated.tolist()]
    return ids, tokenizer.batch_decode(generated, skip_special_tokens=True)


def test_greedy_equals_ours_in_every_export(run: dict) -> None:
    ours = _ours(run)
    assert _ct2(run["ct2"], run["texts"], beam_size=1) == ours
    hf_ids, hf_texts = _hf(run["hf"], run["texts"], num_beams=1)
    assert hf_ids == ours
    from data.tokenization import BPETokenizer

    tokenizer = BPETokenizer.from_json(run["source"].tgt_tokenizer_json)
    assert hf_texts == [tokenizer.decode(row) for row in ours]


def test_int8_mostly_agrees(run: dict) -> None:
    """int8 weights change the numbers, not (mostly) the translations."""
    ours = _ours(run)
    int8 = _ct2(run["ct2_int8"], run["texts"], beam_size=1)
    assert sum(a == b for a, b in zip(ours, int8)) >= 0.8 * len(ours)


def test_beam_search_agreement(run: dict) -> None:
    """The checkpoint's own test decoding (beam 4, alpha 0.6): the length penalties differ (GNMT vs
    len ** alpha), so only most sentences must agree; with alpha 0 every one."""
    for alpha, required in ((0.0, 1.0), (0.6, 0.8)):
        ours = _ours(run, beam_size=4, length_penalty=alpha)
        ct2 = _ct2(run["ct2"], run["texts"], beam_size=4, length_penalty=alpha)
        hf, _ = _hf(run["hf"], run["texts"], num_beams=4, length_penalty=alpha)
        for theirs in (ct2, hf):
            agreement = sum(a == b for a, b in zip(ours, theirs)) / len(ours)
            assert agreement >= required, (alpha, agreement)


def test_model_card_has_the_runs_scores(run: dict) -> None:
    metrics = run["metrics"]
    for name in ("hf", "ct2"):
        card = (run[name] / "README.md").read_text()
        assert f"| `test/bleu` | {metrics['test/bleu']:.4g} |" in card
        assert "| `val/bleu` |" in card and "nrefs:1|case:mixed|eff:no|tok:13a" in card
        assert f"global step {run['source'].global_step}" in card
    generation = json.loads((run["hf"] / "generation_config.json").read_text())
    assert generation["num_beams"] == 4 and generation["length_penalty"] == 0.6


# transformers 5 removed the "translation" pipeline (and "text2text-generation", "summarization"); the
# newest 4.x is installed beside the environment for this test, with the hub client and tokenizers it pins
TRANSFORMERS_4 = ["transformers>=4.40,<5", "huggingface_hub>=0.34,<1", "tokenizers>=0.22,<0.23"]
PIPELINE = """
import json, sys
import transformers
assert transformers.__version__.startswith("4."), transformers.__version__
directory, texts, limit = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
translate = transformers.pipeline("translation", model=directory, device="cpu")
greedy = [out["translation_text"] for out in translate(texts, num_beams=1, max_new_tokens=limit)]
default = [out["translation_text"] for out in translate(texts, max_new_tokens=limit)]
print(json.dumps({"version": transformers.__version__, "greedy": greedy, "default": default}))
"""


def test_pipeline_translation_with_transformers_4(
    run: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`pipeline("translation", model=DIR)` translates raw text under transformers 4 (pip-installed into a
    directory of its own, the environment untouched, and run in a subprocess): greedy, its text is our
    greedy search's; with the directory's generation_config.json (the checkpoint's beam 4, alpha 0.6), it
    is what the installed transformers' `generate` gives."""
    target = tmp_path_factory.mktemp("transformers4")
    # --no-compile: byte-compiling every module of transformers was four fifths of the install's time;
    # the subprocess compiles the few it imports
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile"]
    pip += ["--target", str(target)]
    install = subprocess.run([*pip, *TRANSFORMERS_4], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, f"pip could not install {TRANSFORMERS_4}: {install.stderr[-2000:]}"
    texts = run["texts"][:20]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(target), str(REPO_ROOT)]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    done = subprocess.run(
        [sys.executable, "-c", PIPELINE, str(run["hf"]), json.dumps(texts), str(LIMIT)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    from data.tokenization import BPETokenizer

    tokenizer = BPETokenizer.from_json(run["source"].tgt_tokenizer_json)
    ours = [tokenizer.decode(row) for row in _ours({**run, "texts": texts})]
    assert result["greedy"] == ours and all(ours), result["version"]
    assert result["default"] == _hf(run["hf"], texts)[1], result["version"]

"""aiayn-export: the transformers (Marian) and CTranslate2 exports compute what our model computes.

A tiny model is trained here for a few hundred steps on the quickstart task (so that it ends its
sentences), saved as a checkpoint in train.py's format, exported, and compared with our own forward
pass and searches: logits on a padded batch, greedy search token for token, beam search with the same
beam size. Refusals (classification / masked-LM checkpoints, settings a target cannot express,
non-empty output, truncated or unsafe files) are one `error:` line, status 1, nothing written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import random
from pathlib import Path

import pytest
import torch
from torch import Tensor

from data.synthetic import generate_pair
from data.tokenization import BPETokenizer, train_bpe
from transformer.config import TransformerConfig
from transformer.interop.export_cli import main
from transformer.model import Seq2SeqTransformer, TransformerClassifier
from transformer.search.decoding import beam_search, greedy_search

transformers = pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")

from transformer.interop.ctranslate2 import export_ctranslate2  # noqa: E402
from transformer.interop.export_hf import export_hf  # noqa: E402
from transformer.interop.marian import to_marian  # noqa: E402
from transformer.interop.source import ExportError, load_source  # noqa: E402

MAX_LEN = 48
DECODING = {"beam_size": 1, "length_penalty": 0.6, "max_len_a": 1.2, "max_len_b": 10}


def _pairs(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [generate_pair(rng) for _ in range(n)]


def _batch(tokenizer: BPETokenizer, texts: list[str]) -> Tensor:
    """(B, L) right-padded ids [BOS ... EOS] of `texts`."""
    ids = [torch.tensor(tokenizer.encode(text)) for text in texts]
    return torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=tokenizer.pad_id)


def _train(
    config: TransformerConfig,
    tokenizer: BPETokenizer,
    pairs: list[tuple[str, str]],
    steps: int,
    tgt_tokenizer: BPETokenizer | None = None,
) -> Seq2SeqTransformer:
    """A few hundred Adam steps of teacher forcing: enough for the model to end its sentences
    (`tgt_tokenizer`: the targets' own, for separate vocabularies; else `tokenizer` for both sides)."""
    torch.manual_seed(0)
    model = Seq2SeqTransformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as fast for a d_model 32 model, and no thread fights on a busy machine
    try:
        _steps(model, optimizer, tokenizer, tgt_tokenizer or tokenizer, pairs, steps)
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def _steps(model: Seq2SeqTransformer, optimizer: torch.optim.Optimizer, tokenizer: BPETokenizer,
           tgt_tokenizer: BPETokenizer, pairs: list[tuple[str, str]], steps: int) -> None:  # fmt: skip
    for step in range(steps):
        chunk = pairs[(step * 16) % len(pairs) :][:16]
        src = _batch(tokenizer, [s for s, _ in chunk])
        tgt = _batch(tgt_tokenizer, [t for _, t in chunk])
        logits = model(src, tgt[:, :-1])  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), tgt[:, 1:], ignore_index=tokenizer.pad_id
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def save_checkpoint(
    path: Path,
    model: torch.nn.Module,
    tokenizers: dict[str, str],
    *,
    hparams: dict | None = None,
    datamodule: str = "TranslationDataModule",
) -> Path:
    """A checkpoint in the layout train.py writes (Lightning's dict: `model.*` weights, the task's
    hyperparameters, the datamodule state with the tokenizer JSON, the resolved run config)."""
    config = model.config
    task = "TranslationTask" if datamodule == "TranslationDataModule" else "ClassificationTask"
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "hyper_parameters": {"config": config.to_dict(), "decoding": DECODING, **(hparams or {})},
            datamodule: {"tokenizers": tokenizers},
            "config": {
                "model": {"_target_": f"transformer.training.{task}"},
                "data": {"src_lang": "en", "tgt_lang": "de"},
            },
            "global_step": 123,
            "epoch": 4,
        },
        path,
    )
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A trained tiny model, its tokenizer, its checkpoint, and test sources (padded batch)."""
    pairs = _pairs(600, seed=1)
    tokenizer = train_bpe([text for pair in pairs for text in pair], 400)
    config = TransformerConfig(
        src_vocab_size=tokenizer.vocab_size,
        d_model=32,
        n_heads=4,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=64,
        dropout=0.0,
        max_len=MAX_LEN,
    )
    model = _train(config, tokenizer, pairs, steps=250)
    root = tmp_path_factory.mktemp("export")
    ckpt = save_checkpoint(root / "model.ckpt", model, {"joint": tokenizer.to_json()})
    tests = _pairs(24, seed=2)
    return {
        "model": model,
        "tokenizer": tokenizer,
        "ckpt": ckpt,
        "root": root,
        "sources": [s for s, _ in tests],
    }


@pytest.fixture(scope="module")
def hf_dir(trained: dict) -> Path:
    assert main([str(trained["ckpt"]), "--to", "hf", "--output", str(trained["root"] / "hf")]) == 0
    return trained["root"] / "hf"


@pytest.fixture(scope="module")
def ct2_dir(trained: dict) -> Path:
    assert main([str(trained["ckpt"]), "--to", "ctranslate2", "--output", str(trained["root"] / "ct2")]) == 0
    return trained["root"] / "ct2"


def _hypotheses(tokens: Tensor, eos_id: int) -> list[list[int]]:
    """Rows of token ids up to and including the first EOS."""
    out = []
    for row in tokens.tolist():
        out.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return out


# --- transformers -----------------------------------------------------------------------------------------


def test_hf_directory_loads_offline(hf_dir: Path) -> None:
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"} <= {
        p.name for p in hf_dir.iterdir()
    }
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir)
    assert type(model).__name__ == "MarianMTModel"
    generation = transformers.GenerationConfig.from_pretrained(hf_dir)
    assert generation.decoder_start_token_id == 1 and generation.suppress_tokens == [0, 1]
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # a name transformers 4 and 5 resolve
    card = (hf_dir / "README.md").read_text()
    assert "## Scores of this checkpoint" in card and "global step 123" in card


def test_hf_logits_equal_ours_on_a_padded_batch(trained: dict, hf_dir: Path) -> None:
    model, tokenizer = trained["model"], trained["tokenizer"]
    marian = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    tests = _pairs(8, seed=3)
    src = _batch(tokenizer, [s for s, _ in tests])
    tgt_in = _batch(tokenizer, [t for _, t in tests])[:, :-1]
    assert src.eq(0).any() and tgt_in.eq(0).any()  # padded on both sides
    with torch.no_grad():
        ours = model(src, tgt_in)  # (B, T, V)
        theirs = marian(input_ids=src, attention_mask=src.ne(0), decoder_input_ids=tgt_in).logits
    real = tgt_in.ne(0)  # padded target positions are don't-cares in both
    assert (ours - theirs)[real].abs().max().item() <= 1e-4


def test_hf_tokenizer_matches_ours(trained: dict, hf_dir: Path) -> None:
    tokenizer = trained["tokenizer"]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for source, target in _pairs(10, seed=4):
        assert hf_tokenizer(source).input_ids == tokenizer.encode(source)
        ids = tokenizer.encode(target)
        assert hf_tokenizer.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids) == target


def test_hf_greedy_generate_equals_our_greedy_search(trained: dict, hf_dir: Path) -> None:
    model, tokenizer = trained["model"], trained["tokenizer"]
    marian = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    src = _batch(tokenizer, trained["sources"])
    ours = greedy_search(model, src, max_len_a=0, max_len_b=30)  # one length limit for both
    theirs = marian.generate(input_ids=src, attention_mask=src.ne(0), num_beams=1, max_new_tokens=30)
    assert theirs[:, 0].eq(1).all()  # the decoder starts from BOS, as ours
    assert _hypotheses(theirs[:, 1:], 2) == _hypotheses(ours, 2)
    assert sum(2 in row for row in _hypotheses(ours, 2)) >= len(trained["sources"]) - 2  # most end by EOS


def test_hf_beam_search_agrees_with_ours(trained: dict, hf_dir: Path) -> None:
    """Same beam size; with length_penalty 0 both rank by the summed log-probability, and every sentence
    must agree; with alpha 0.6 the formulas differ (GNMT vs len ** alpha), most sentences still agree."""
    model, tokenizer = trained["model"], trained["tokenizer"]
    marian = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    src = _batch(tokenizer, trained["sources"])
    for alpha, required in ((0.0, 1.0), (0.6, 0.75)):
        ours, _ = beam_search(model, src, beam_size=4, length_penalty=alpha, max_len_a=0, max_len_b=30)
        theirs = marian.generate(
            input_ids=src, attention_mask=src.ne(0), num_beams=4, length_penalty=alpha, max_new_tokens=30
        )
        ours_rows, theirs_rows = _hypotheses(ours[:, 0], 2), _hypotheses(theirs[:, 1:], 2)
        agreement = sum(a == b for a, b in zip(ours_rows, theirs_rows)) / len(ours_rows)
        assert agreement >= required, (alpha, agreement)


def test_raw_text_translation(trained: dict, hf_dir: Path) -> None:
    """Text in, text out: `pipeline("translation")` where transformers still has it (4.x; version 5 removed
    the task), else the same steps by hand (tokenize, generate, decode); equal to our greedy search's text."""
    tokenizer, model = trained["tokenizer"], trained["model"]
    texts = trained["sources"][:4]
    if int(transformers.__version__.split(".")[0]) < 5:
        translate = transformers.pipeline("translation", model=str(hf_dir), device="cpu")
        outputs = [item["translation_text"] for item in translate(texts, num_beams=1, max_new_tokens=30)]
    else:
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
        marian = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
        batch = hf_tokenizer(texts, return_tensors="pt", padding=True)
        generated = marian.generate(**batch, num_beams=1, max_new_tokens=30)
        outputs = hf_tokenizer.batch_decode(generated, skip_special_tokens=True)
    ours = greedy_search(model, _batch(tokenizer, texts), max_len_a=0, max_len_b=30)
    assert outputs == tokenizer.decode_batch(ours)
    assert all(outputs)


@pytest.mark.parametrize(
    "change", [{"tie_embeddings": "decoder"}, {"tie_embeddings": "none"}, {"scale_embedding": False}]
)
def test_hf_untied_embeddings(trained: dict, change: dict) -> None:
    """Separate encoder / decoder embeddings and output projection keep their own weights in Marian;
    unscaled embeddings (`scale_embedding: false`) are Marian's `scale_embedding=False`."""
    config = dataclasses.replace(trained["model"].config, **change)
    torch.manual_seed(1)
    model = Seq2SeqTransformer(config).eval()
    marian = to_marian(model)
    tests = _pairs(4, seed=5)
    src = _batch(trained["tokenizer"], [s for s, _ in tests])
    tgt_in = _batch(trained["tokenizer"], [t for _, t in tests])[:, :-1]
    with torch.no_grad():
        diff = (
            model(src, tgt_in)
            - marian(input_ids=src, attention_mask=src.ne(0), decoder_input_ids=tgt_in).logits
        )
    assert diff[tgt_in.ne(0)].abs().max().item() <= 1e-4


# --- CTranslate2 ------------------------------------------------------------------------------------------


def _ct2_translate(directory: Path, texts: list[str], **options) -> list[list[int]]:
    """Plain subword tokens in, plain tokens out (as a user runs it) -> token ids (no BOS / EOS)."""
    import tokenizers

    plain = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    batch = [plain.encode(text, add_special_tokens=False).tokens for text in texts]
    compute_type = options.pop("compute_type", "float32")
    translator = ctranslate2.Translator(str(directory), device="cpu", compute_type=compute_type)
    results = translator.translate_batch(batch, **options)
    return [[plain.token_to_id(token) for token in result.hypotheses[0]] for result in results]


def _without_eos(rows: list[list[int]], eos_id: int) -> list[list[int]]:
    return [[token for token in row if token != eos_id] for row in rows]


# Ours counts EOS in its length limit (forcing EOS as the 30th token), CTranslate2 stops after
# max_decoding_length tokens without one: 29 = the same tokens.
LIMIT = {"max_len_a": 0, "max_len_b": 30}
CT2_LIMIT = {"max_decoding_length": 29}


def test_ctranslate2_greedy_equals_ours(trained: dict, ct2_dir: Path) -> None:
    model, tokenizer = trained["model"], trained["tokenizer"]
    src = _batch(tokenizer, trained["sources"])
    ours = _hypotheses(greedy_search(model, src, **LIMIT), tokenizer.eos_id)
    assert sum(row[-1] == tokenizer.eos_id and len(row) < 30 for row in ours) >= len(ours) - 2  # most end
    theirs = _ct2_translate(ct2_dir, trained["sources"], beam_size=1, **CT2_LIMIT)
    assert theirs == _without_eos(ours, tokenizer.eos_id)


def test_ctranslate2_beam_search_agrees_with_ours(trained: dict, ct2_dir: Path) -> None:
    """As for transformers: every sentence with length_penalty 0, most with 0.6 (the formulas differ)."""
    model, tokenizer = trained["model"], trained["tokenizer"]
    src = _batch(tokenizer, trained["sources"])
    for alpha, required in ((0.0, 1.0), (0.6, 0.75)):
        ours, _ = beam_search(model, src, beam_size=4, length_penalty=alpha, **LIMIT)
        theirs = _ct2_translate(ct2_dir, trained["sources"], beam_size=4, length_penalty=alpha, **CT2_LIMIT)
        mine = _without_eos(_hypotheses(ours[:, 0], tokenizer.eos_id), tokenizer.eos_id)
        agreement = sum(a == b for a, b in zip(mine, theirs)) / len(theirs)
        assert agreement >= required, (alpha, agreement)


@pytest.mark.parametrize(
    "change",
    [
        {"positional": "rope"},
        {"positional": "learned", "norm_first": True, "activation": "gelu"},
        {"positional": "rope", "norm_first": True, "activation": "swiglu", "tie_embeddings": "none"},
        {"activation": "silu", "output_bias": True},  # OPUS-MT's feed-forward and final_logits_bias
        # BERT-style embeddings: unscaled, a LayerNorm on the sum (CTranslate2's layernorm_embedding)
        {"positional": "learned", "scale_embedding": False, "embedding_norm": True, "norm_eps": 1e-12},
        {"norm_eps": 0.5},  # an epsilon large enough to change the outputs: exported, not CTranslate2's
    ],
)
def test_ctranslate2_expresses_every_variant(trained: dict, tmp_path: Path, change: dict) -> None:
    """Rotary and learned positions, pre-LN, GELU, SwiGLU, SiLU, an output bias, untied embeddings (random
    weights): CTranslate2's teacher-forced log-probabilities equal ours, and so does greedy search."""
    import tokenizers

    tokenizer = trained["tokenizer"]
    config = dataclasses.replace(trained["model"].config, **change)
    torch.manual_seed(2)
    model = Seq2SeqTransformer(config).eval()
    if config.output_bias:  # initialised to zeros: drawn, so that a bias left out would show
        torch.nn.init.normal_(model.output_projection.bias)
    ckpt = save_checkpoint(tmp_path / "m.ckpt", model, {"joint": tokenizer.to_json()})
    assert main([str(ckpt), "--to", "ctranslate2", "--output", str(tmp_path / "ct2")]) == 0
    tests = _pairs(6, seed=6)
    src, tgt = _batch(tokenizer, [s for s, _ in tests]), _batch(tokenizer, [t for _, t in tests])
    plain = tokenizers.Tokenizer.from_file(str(tmp_path / "ct2" / "tokenizer.json"))
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", compute_type="float32")
    scores = translator.score_batch(
        [plain.encode(s, add_special_tokens=False).tokens for s, _ in tests],
        [plain.encode(t, add_special_tokens=False).tokens for _, t in tests],
    )
    with torch.no_grad():
        log_probs = model(src, tgt[:, :-1]).log_softmax(-1)  # (B, T, V)
    ours = log_probs.gather(-1, tgt[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T): of each next token, then EOS
    for row, score in zip(ours, scores):
        theirs = torch.tensor(score.log_probs)
        assert (row[: len(theirs)] - theirs).abs().max().item() <= 1e-4
    greedy = _hypotheses(greedy_search(model, src, max_len_a=0, max_len_b=12), tokenizer.eos_id)
    translated = _ct2_translate(tmp_path / "ct2", [s for s, _ in tests], beam_size=1, max_decoding_length=11)
    assert translated == _without_eos(greedy, tokenizer.eos_id)


def test_starting_a_translator_leaves_torch_threads_alone(ct2_dir: Path) -> None:
    """A Translator sets the shared OpenMP thread count to its intra_threads (torch followed it: our beam
    search then ran 7-8x slower); inside `keeping_torch_threads` torch keeps its own count."""
    from transformer.interop.ctranslate2 import keeping_torch_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with keeping_torch_threads():
            translator = ctranslate2.Translator(str(ct2_dir), device="cpu", intra_threads=1, inter_threads=2)
        assert torch.get_num_threads() == 2
        del translator
    finally:
        torch.set_num_threads(before)


def test_ctranslate2_config_adds_the_special_tokens(ct2_dir: Path) -> None:
    config = json.loads((ct2_dir / "config.json").read_text())
    assert config["add_source_bos"] and config["add_source_eos"]
    assert config["decoder_start_token"] == "<s>" and config["eos_token"] == "</s>"


def test_ctranslate2_separate_vocabularies_greedy_equals_ours(tmp_path: Path) -> None:
    """A model trained with separate source and target tokenizers (`data.joint_vocab=false`: vocabularies
    of different sizes, one id naming different subwords on each side): sources encoded with the export's
    `source_tokenizer.json`, outputs read with its `target_tokenizer.json`, greedy search equal to ours
    token for token and in text, and teacher-forced log-probabilities equal to ours."""
    import tokenizers

    pairs = _pairs(600, seed=1)
    src_tokenizer = train_bpe([s for s, _ in pairs], 300)  # English
    tgt_tokenizer = train_bpe([t for _, t in pairs], 360)  # German
    config = TransformerConfig(
        src_vocab_size=src_tokenizer.vocab_size,
        tgt_vocab_size=tgt_tokenizer.vocab_size,
        tie_embeddings="decoder",  # "all" needs one vocabulary
        d_model=32,
        n_heads=4,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=64,
        dropout=0.0,
        max_len=MAX_LEN,
    )
    assert config.src_vocab_size != config.tgt_vocab_size
    model = _train(config, src_tokenizer, pairs, steps=250, tgt_tokenizer=tgt_tokenizer)
    ckpt = save_checkpoint(
        tmp_path / "m.ckpt", model, {"src": src_tokenizer.to_json(), "tgt": tgt_tokenizer.to_json()}
    )
    out = tmp_path / "ct2"
    assert main([str(ckpt), "--to", "ctranslate2", "--output", str(out)]) == 0
    assert not (out / "tokenizer.json").exists()
    source = tokenizers.Tokenizer.from_file(str(out / "source_tokenizer.json"))
    target = tokenizers.Tokenizer.from_file(str(out / "target_tokenizer.json"))
    assert source.to_str() == src_tokenizer.to_json() and target.to_str() == tgt_tokenizer.to_json()
    texts = [s for s, _ in _pairs(24, seed=2)]
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type="float32")
    results = translator.translate_batch(
        [source.encode(text, add_special_tokens=False).tokens for text in texts], beam_size=1, **CT2_LIMIT
    )
    theirs = [[target.token_to_id(token) for token in result.hypotheses[0]] for result in results]
    ours = _hypotheses(greedy_search(model, _batch(src_tokenizer, texts), **LIMIT), tgt_tokenizer.eos_id)
    assert sum(row[-1] == tgt_tokenizer.eos_id for row in ours) >= len(ours) - 2  # most end their sentence
    assert theirs == _without_eos(ours, tgt_tokenizer.eos_id)
    assert [target.decode(row) for row in theirs] == tgt_tokenizer.decode_batch(ours)
    subwords = [token for result in results for token in result.hypotheses[0]]
    assert [source.id_to_token(i) for row in theirs for i in row] != subwords  # ids differ between sides

    # the model card's usage example, run as printed (on this directory and a sentence that ours ends)
    code = (out / "README.md").read_text().split("```python\n")[1].split("```")[0]
    k = next(k for k, row in enumerate(ours) if row[-1] == tgt_tokenizer.eos_id)
    code = code.replace("path/to/this/directory", str(out)).replace("A dog runs.", texts[k])
    printed = io.StringIO()
    namespace: dict[str, object] = {}
    with contextlib.redirect_stdout(printed):
        exec(code, namespace)
    assert printed.getvalue().strip() == tgt_tokenizer.decode(ours[k])
    # ...and its n-best and sampling example, run after it as printed: 4 ranked hypotheses, 3 samples
    more = (out / "README.md").read_text().split("```python\n")[2].split("```")[0]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(more, namespace)
    lines = printed.getvalue().splitlines()
    assert len(lines) == 7, lines
    scores = [float(line.split(" ", 1)[0]) for line in lines[:4]]
    assert scores == sorted(scores, reverse=True)
    assert len({line.split(" ", 1)[1] for line in lines[:4]}) == 4  # four different hypotheses
    assert lines[0].split(" ", 1)[1] == tgt_tokenizer.decode(
        _hypotheses(
            beam_search(model, _batch(src_tokenizer, [texts[k]]), beam_size=4, length_penalty=1.0, **LIMIT)[
                0
            ][:, 0],
            tgt_tokenizer.eos_id,
        )[0]
    )

    tests = _pairs(6, seed=6)
    src = _batch(src_tokenizer, [s for s, _ in tests])
    tgt = _batch(tgt_tokenizer, [t for _, t in tests])
    scores = translator.score_batch(
        [source.encode(s, add_special_tokens=False).tokens for s, _ in tests],
        [target.encode(t, add_special_tokens=False).tokens for _, t in tests],
    )
    with torch.no_grad():
        log_probs = model(src, tgt[:, :-1]).log_softmax(-1)  # (B, T, V)
    expected = log_probs.gather(-1, tgt[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T): each next token, then EOS
    for row, score in zip(expected, scores):
        assert (row[: len(score.log_probs)] - torch.tensor(score.log_probs)).abs().max().item() <= 1e-4


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


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_refuses_truncated_and_unsafe_checkpoints(trained: dict, tmp_path: Path, capsys) -> None:
    data = trained["ckpt"].read_bytes()
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(data[: len(data) // 2])
    _refused(capsys, [str(truncated), "--to", "hf", "--output", str(tmp_path / "a")], "truncated or corrupt")
    evil = tmp_path / "evil.ckpt"
    evil.write_bytes(pickle.dumps({"state_dict": {}, "payload": _Payload(tmp_path / "pwned")}, protocol=2))
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
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(expected) and "(usage: aiayn-export " in captured.err

"""aiayn-export: the transformers (Marian) and CTranslate2 exports compute what our model computes.

A tiny model is trained here for a few hundred steps on the quickstart task (so that it ends its
sentences; tests/helpers/exports.py), saved as a checkpoint in train.py's format, exported, and compared
with our own forward pass and searches: logits on a padded batch, greedy search token for token, beam
search with the same beam size. The refusals: test_export_refusals.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
from torch import Tensor

from data.tokenization import train_bpe
from tests.helpers.exports import (
    export_config,
    make_pairs,
    padded_batch,
    save_checkpoint,
    train_tiny,
    trained_export_model,
)
from transformer.interop.export_cli import main
from transformer.model import Seq2SeqTransformer
from transformer.search.decoding import beam_search, greedy_search

transformers = pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")

from transformer.interop.marian import to_marian  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A trained tiny model, its tokenizer, its checkpoint, and test sources (padded batch)."""
    return trained_export_model(tmp_path_factory.mktemp("export"))


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
    tests = make_pairs(8, seed=3)
    src = padded_batch(tokenizer, [s for s, _ in tests])
    tgt_in = padded_batch(tokenizer, [t for _, t in tests])[:, :-1]
    assert src.eq(0).any() and tgt_in.eq(0).any()  # padded on both sides
    with torch.no_grad():
        ours = model(src, tgt_in)  # (B, T, V)
        theirs = marian(input_ids=src, attention_mask=src.ne(0), decoder_input_ids=tgt_in).logits
    real = tgt_in.ne(0)  # padded target positions are don't-cares in both
    assert (ours - theirs)[real].abs().max().item() <= 1e-4


def test_hf_tokenizer_matches_ours(trained: dict, hf_dir: Path) -> None:
    tokenizer = trained["tokenizer"]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for source, target in make_pairs(10, seed=4):
        assert hf_tokenizer(source).input_ids == tokenizer.encode(source)
        ids = tokenizer.encode(target)
        assert hf_tokenizer.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids) == target


def test_hf_greedy_generate_equals_our_greedy_search(trained: dict, hf_dir: Path) -> None:
    model, tokenizer = trained["model"], trained["tokenizer"]
    marian = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    src = padded_batch(tokenizer, trained["sources"])
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
    src = padded_batch(tokenizer, trained["sources"])
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
    ours = greedy_search(model, padded_batch(tokenizer, texts), max_len_a=0, max_len_b=30)
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
    tests = make_pairs(4, seed=5)
    src = padded_batch(trained["tokenizer"], [s for s, _ in tests])
    tgt_in = padded_batch(trained["tokenizer"], [t for _, t in tests])[:, :-1]
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
    src = padded_batch(tokenizer, trained["sources"])
    ours = _hypotheses(greedy_search(model, src, **LIMIT), tokenizer.eos_id)
    assert sum(row[-1] == tokenizer.eos_id and len(row) < 30 for row in ours) >= len(ours) - 2  # most end
    theirs = _ct2_translate(ct2_dir, trained["sources"], beam_size=1, **CT2_LIMIT)
    assert theirs == _without_eos(ours, tokenizer.eos_id)


def test_ctranslate2_beam_search_agrees_with_ours(trained: dict, ct2_dir: Path) -> None:
    """As for transformers: every sentence with length_penalty 0, most with 0.6 (the formulas differ)."""
    model, tokenizer = trained["model"], trained["tokenizer"]
    src = padded_batch(tokenizer, trained["sources"])
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
    tests = make_pairs(6, seed=6)
    src, tgt = padded_batch(tokenizer, [s for s, _ in tests]), padded_batch(tokenizer, [t for _, t in tests])
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

    pairs = make_pairs(600, seed=1)
    src_tokenizer = train_bpe([s for s, _ in pairs], 300)  # English
    tgt_tokenizer = train_bpe([t for _, t in pairs], 360)  # German
    config = export_config(
        src_tokenizer.vocab_size,
        tgt_vocab_size=tgt_tokenizer.vocab_size,
        tie_embeddings="decoder",  # "all" needs one vocabulary
    )
    assert config.src_vocab_size != config.tgt_vocab_size
    model = train_tiny(config, src_tokenizer, pairs, steps=250, tgt_tokenizer=tgt_tokenizer)
    ckpt = save_checkpoint(
        tmp_path / "m.ckpt", model, {"src": src_tokenizer.to_json(), "tgt": tgt_tokenizer.to_json()}
    )
    out = tmp_path / "ct2"
    assert main([str(ckpt), "--to", "ctranslate2", "--output", str(out)]) == 0
    assert not (out / "tokenizer.json").exists()
    source = tokenizers.Tokenizer.from_file(str(out / "source_tokenizer.json"))
    target = tokenizers.Tokenizer.from_file(str(out / "target_tokenizer.json"))
    assert source.to_str() == src_tokenizer.to_json() and target.to_str() == tgt_tokenizer.to_json()
    texts = [s for s, _ in make_pairs(24, seed=2)]
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type="float32")
    results = translator.translate_batch(
        [source.encode(text, add_special_tokens=False).tokens for text in texts], beam_size=1, **CT2_LIMIT
    )
    theirs = [[target.token_to_id(token) for token in result.hypotheses[0]] for result in results]
    src = padded_batch(src_tokenizer, texts)
    ours = _hypotheses(greedy_search(model, src, **LIMIT), tgt_tokenizer.eos_id)
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
    one = padded_batch(src_tokenizer, [texts[k]])
    assert lines[0].split(" ", 1)[1] == tgt_tokenizer.decode(
        _hypotheses(
            beam_search(model, one, beam_size=4, length_penalty=1.0, **LIMIT)[0][:, 0],
            tgt_tokenizer.eos_id,
        )[0]
    )

    tests = make_pairs(6, seed=6)
    src = padded_batch(src_tokenizer, [s for s, _ in tests])
    tgt = padded_batch(tgt_tokenizer, [t for _, t in tests])
    scores = translator.score_batch(
        [source.encode(s, add_special_tokens=False).tokens for s, _ in tests],
        [target.encode(t, add_special_tokens=False).tokens for _, t in tests],
    )
    with torch.no_grad():
        log_probs = model(src, tgt[:, :-1]).log_softmax(-1)  # (B, T, V)
    expected = log_probs.gather(-1, tgt[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T): each next token, then EOS
    for row, score in zip(expected, scores):
        assert (row[: len(score.log_probs)] - torch.tensor(score.log_probs)).abs().max().item() <= 1e-4

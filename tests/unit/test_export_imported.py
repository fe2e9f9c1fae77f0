"""aiayn-export of an imported OPUS-MT model: import, then export `--to hf` and `--to ctranslate2`, the same
outputs again.

A tiny OPUS-MT-shaped directory (`tests.helpers.pretrained`: SentencePiece models trained on Multi30k text,
SiLU, `final_logits_bias`, the pad token as the decoder's start) is given weights trained here for ~100 steps
(seconds) to copy German sentences (random weights repeat one token to the length limit or stop at once,
which says little about a search; copying ends sentences at many lengths), then imported (`import_hf`) and
exported both ways. The transformers export must be the original directory again for transformers'
MarianTokenizer and MarianMTModel (weights bit for bit, token ids, `generate` with the directory's own
generation settings) and give our searches' tokens; the CTranslate2 export, tokenized outside it with its
SentencePiece model as its card says, must give our greedy and beam-4 tokens on the same
Multi30k sentences.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import Tensor

transformers = pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")
sentencepiece = pytest.importorskip("sentencepiece")

from safetensors.torch import load_file  # noqa: E402

from data.sentencepiece_pair import SentencePieceSide  # noqa: E402
from tests.helpers.datasets import data_dir  # noqa: E402
from tests.helpers.opus_mt import quiet_marian_tokenizer, train_to_copy  # noqa: E402
from tests.helpers.pretrained import multi30k_lines, opus_mt_directory, opus_mt_tokenizer_files  # noqa: E402
from transformer.interop.ctranslate2 import export_ctranslate2  # noqa: E402
from transformer.interop.export_cli import main  # noqa: E402
from transformer.interop.export_hf import export_hf  # noqa: E402
from transformer.interop.import_hf import import_hf  # noqa: E402
from transformer.interop.source import ExportError, ExportSource, load_source  # noqa: E402
from transformer.search.decoding import beam_search, greedy_search  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

N_SENTENCES = 100
EOS = 0  # OPUS-MT's </s>; <pad> is the last id
# Ours counts EOS in its length limit (forcing it as the 30th token); CTranslate2 stops after
# max_decoding_length tokens without one, and transformers counts new tokens with EOS: the same tokens.
LIMIT = {"max_len_a": 0, "max_len_b": 30}
CT2_LIMIT = {"max_decoding_length": 29}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The original OPUS-MT-shaped directory, its import, and the import exported both ways."""
    root = tmp_path_factory.mktemp("imported-export")
    opus = opus_mt_directory(root / "opus-mt-de-en", data_dir("MULTI30K_DIR"))
    train_to_copy(opus)
    ckpt = import_hf(opus, root / "imported")
    source = load_source(ckpt)
    hf = export_hf(source, root / "hf")
    ct2 = export_ctranslate2(source, root / "ct2")
    assert hf.max_abs_diff <= 1e-5 and ct2.max_abs_diff <= 1e-5  # the self-check, on the Marian layout
    return {"root": root, "opus": opus, "ckpt": ckpt, "hf": hf.path, "ct2": ct2.path}


@pytest.fixture(scope="module")
def source(dirs: dict[str, Path]) -> ExportSource:
    return load_source(dirs["ckpt"])


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    return multi30k_lines(data_dir("MULTI30K_DIR"), "test_2016_flickr.de.gz", N_SENTENCES)


@pytest.fixture(scope="module")
def src(source: ExportSource, sentences: list[str]) -> Tensor:
    """(N, S) our encoding of the sentences (pieces, </s>; no start token), right-padded with <pad>."""
    side = SentencePieceSide(source.sentencepiece, "src")
    rows = [torch.tensor(ids) for ids in side.encode_batch(sentences)]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=source.config.pad_id)


def _hypotheses(tokens: Tensor) -> list[list[int]]:
    """Rows of token ids up to and including the first EOS."""
    return [row[: row.index(EOS) + 1] if EOS in row else row for row in tokens.tolist()]


def _without_eos(rows: list[list[int]]) -> list[list[int]]:
    return [[token for token in row if token != EOS] for row in rows]


# --- transformers -----------------------------------------------------------------------------------------


def test_hf_export_is_the_original_directory_again(dirs: dict[str, Path]) -> None:
    """The same weights bit for bit, the same SentencePiece files and vocabulary, Marian's start token and
    the original's beam size in its generation settings, and a card that says where the model came from."""
    opus, hf = dirs["opus"], dirs["hf"]
    theirs, ours = load_file(opus / "model.safetensors"), load_file(hf / "model.safetensors")
    weights = [name for name in theirs if "embed_positions" not in name]  # the sinusoids Marian rebuilds
    assert len(weights) > 50 and all(torch.equal(theirs[name], ours[name]) for name in weights)
    for name in ("source.spm", "target.spm"):
        assert (hf / name).read_bytes() == (opus / name).read_bytes()
    vocab = json.loads((opus / "vocab.json").read_text(encoding="utf-8"))
    assert json.loads((hf / "vocab.json").read_text(encoding="utf-8")) == vocab
    settings = json.loads((hf / "tokenizer_config.json").read_text())
    assert (settings["tokenizer_class"], settings["source_lang"], settings["target_lang"]) == (
        "MarianTokenizer", "de", "en"
    )  # fmt: skip
    generation = transformers.GenerationConfig.from_pretrained(hf)
    original = transformers.GenerationConfig.from_pretrained(opus)
    assert generation.decoder_start_token_id == original.decoder_start_token_id == vocab["<pad>"]
    assert generation.num_beams == original.num_beams == 4 and generation.suppress_tokens == [vocab["<pad>"]]
    card = (hf / "README.md").read_text(encoding="utf-8")
    assert f"imported from `{dirs['opus']}`" in card and "not trained" in card
    assert transformers.__version__ in card and "SentencePiece" in card


def test_hf_tokenizer_encodes_and_decodes_as_the_originals(
    dirs: dict[str, Path], source: ExportSource, sentences: list[str], src: Tensor
) -> None:
    original, exported = quiet_marian_tokenizer(dirs["opus"]), quiet_marian_tokenizer(dirs["hf"])
    ids = exported(sentences).input_ids
    assert ids == original(sentences).input_ids
    assert ids == [row[row.ne(source.config.pad_id)].tolist() for row in src]  # and as ours
    assert sum(original.unk_token_id in row for row in ids) >= 1  # a piece missing from the vocabulary
    english = multi30k_lines(data_dir("MULTI30K_DIR"), "test_2016_flickr.en.gz", N_SENTENCES)
    targets = original(text_target=english).input_ids
    assert exported(text_target=english).input_ids == targets
    decoded = exported.batch_decode(targets, skip_special_tokens=True)
    assert decoded == original.batch_decode(targets, skip_special_tokens=True)
    assert decoded == [source.sentencepiece.decode(row) for row in targets]  # and as ours
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert type(transformers.AutoTokenizer.from_pretrained(dirs["hf"])).__name__ == "MarianTokenizer"


def test_hf_generate_equals_the_original_and_ours(
    dirs: dict[str, Path], source: ExportSource, sentences: list[str], src: Tensor
) -> None:
    """Greedy and beam 4 (length penalty 0: all three rank by the summed log-probability) token for token on
    the sentences, text in and text out through MarianTokenizer; and with each directory's own generation
    settings (beam 4, length penalty 1.0), the exported directory generates what the original does."""
    tokenizer = quiet_marian_tokenizer(dirs["hf"])
    original = transformers.MarianMTModel.from_pretrained(dirs["opus"]).eval()
    exported = transformers.MarianMTModel.from_pretrained(dirs["hf"]).eval()
    batch = tokenizer(sentences, return_tensors="pt", padding=True)
    pad = source.config.pad_id
    with torch.no_grad():
        for beam in (1, 4):
            options = {"num_beams": beam, "length_penalty": 0.0, "max_new_tokens": 30, "do_sample": False}
            theirs = original.generate(**batch, **options)
            mine = exported.generate(**batch, **options)
            assert torch.equal(mine, theirs) and theirs[:, 0].eq(pad).all()  # both start from <pad>
            if beam == 1:
                ours = greedy_search(source.model, src, **LIMIT)
            else:
                ours = beam_search(source.model, src, beam_size=4, length_penalty=0.0, **LIMIT)[0][:, 0]
            rows = _hypotheses(ours)
            assert _hypotheses(mine[:, 1:]) == rows, beam
            assert sum(row[-1] == EOS and len(row) < 30 for row in rows) >= N_SENTENCES // 2  # real endings
            assert len({tuple(row) for row in rows}) >= N_SENTENCES // 2  # not one output repeated
            text = tokenizer.batch_decode(mine, skip_special_tokens=True)
            assert text == [source.sentencepiece.decode(row) for row in rows]
        defaults = exported.generate(**batch)  # generation_config.json: beam 4, length penalty 1.0
        assert torch.equal(defaults, original.generate(**batch))


def test_hf_card_usage_runs_as_printed(dirs: dict[str, Path], source: ExportSource) -> None:
    """The card's example translates its sentence as the directory's generate does (its own settings)."""
    code = (dirs["hf"] / "README.md").read_text(encoding="utf-8").split("```python\n")[1].split("```")[0]
    code = code.replace("path/to/this/directory", str(dirs["hf"]))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(code, {})
    tokenizer = quiet_marian_tokenizer(dirs["hf"])
    model = transformers.MarianMTModel.from_pretrained(dirs["hf"]).eval()
    with torch.no_grad():
        expected = tokenizer.batch_decode(
            model.generate(**tokenizer(["Ein Hund läuft."], return_tensors="pt")), skip_special_tokens=True
        )
    assert printed.getvalue().strip() == str(expected)


# --- CTranslate2 ------------------------------------------------------------------------------------------


def _ct2_tokens(directory: Path, sentences: list[str]) -> list[list[str]]:
    """Sources as the card says: pieces of the export's source.spm, no <s> and no </s> (the model adds it)."""
    processor = sentencepiece.SentencePieceProcessor(model_file=str(directory / "source.spm"))
    return [processor.encode(text, out_type=str) for text in sentences]


def _ct2_translate(directory: Path, sentences: list[str], **options: object) -> list[list[int]]:
    vocab = json.loads((directory / "shared_vocabulary.json").read_text(encoding="utf-8"))
    translator = ctranslate2.Translator(str(directory), device="cpu", compute_type="float32")
    results = translator.translate_batch(
        _ct2_tokens(directory, sentences), suppress_sequences=[["<pad>"]], **CT2_LIMIT, **options
    )
    return [[vocab.index(token) for token in result.hypotheses[0]] for result in results]


def test_ctranslate2_config_follows_marian(dirs: dict[str, Path], source: ExportSource) -> None:
    config = json.loads((dirs["ct2"] / "config.json").read_text())
    assert not config["add_source_bos"] and config["add_source_eos"]  # sources: pieces, then </s>
    assert (config["decoder_start_token"], config["eos_token"]) == ("<pad>", "</s>")
    vocab = json.loads((dirs["ct2"] / "shared_vocabulary.json").read_text(encoding="utf-8"))
    assert vocab == source.vocabulary("src")  # <pad> kept (the decoder's start), at its id
    for name in ("source.spm", "target.spm"):
        assert (dirs["ct2"] / name).read_bytes() == (dirs["opus"] / name).read_bytes()


def test_ctranslate2_greedy_and_beam_search_equal_ours(
    dirs: dict[str, Path], source: ExportSource, sentences: list[str], src: Tensor
) -> None:
    """Greedy token for token; beam 4 with length penalty 0 token for token (the same ranking), with 0.6 on
    most sentences (CTranslate2 divides by len ** alpha, ours by GNMT's formula), as for our own models."""
    greedy = _hypotheses(greedy_search(source.model, src, **LIMIT))
    assert sum(row[-1] == EOS and len(row) < 30 for row in greedy) >= N_SENTENCES // 2
    assert _ct2_translate(dirs["ct2"], sentences, beam_size=1) == _without_eos(greedy)
    for alpha, required in ((0.0, 1.0), (0.6, 0.75)):
        ours = beam_search(source.model, src, beam_size=4, length_penalty=alpha, **LIMIT)[0][:, 0]
        theirs = _ct2_translate(dirs["ct2"], sentences, beam_size=4, length_penalty=alpha)
        mine = _without_eos(_hypotheses(ours))
        agreement = sum(a == b for a, b in zip(mine, theirs)) / len(theirs)
        assert agreement >= required, (alpha, agreement)


def test_ctranslate2_card_usage_runs_as_printed(
    dirs: dict[str, Path], source: ExportSource, sentences: list[str], src: Tensor
) -> None:
    """The card's example, run on a sentence of the test set: our beam search's text (its own settings)."""
    decoding = source.decoding
    assert decoding["beam_size"] == 4 and decoding["length_penalty"] == 1.0
    ours = _hypotheses(beam_search(source.model, src, beam_size=4, length_penalty=1.0, **LIMIT)[0][:, 0])
    theirs = _ct2_translate(dirs["ct2"], sentences[:20], beam_size=4, length_penalty=1.0)
    # a sentence ours ends inside the limit and CTranslate2's length penalty (len ** alpha) ranks as ours
    k = next(k for k, row in enumerate(ours[:20]) if row[-1] == EOS and theirs[k] == row[:-1])
    code = (dirs["ct2"] / "README.md").read_text(encoding="utf-8").split("```python\n")[1].split("```")[0]
    code = code.replace("path/to/this/directory", str(dirs["ct2"])).replace("Ein Hund läuft.", sentences[k])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, {})
    assert printed.getvalue().strip() == source.sentencepiece.decode(ours[k])


def test_the_self_check_catches_a_source_bos_on_an_imported_model(
    source: ExportSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export's check runs on the Marian layout: CTranslate2 told to add a start token to the sources
    (as for our own models) computes something else, and nothing is written."""
    from transformer.interop import ctranslate2 as ct2

    original = ct2.to_ctranslate2_spec

    def with_source_bos(changed: ExportSource):  # type: ignore[no-untyped-def]
        spec = original(changed)
        spec.config.add_source_bos = True  # prepends <pad> (bos_token), which Marian's sources never have
        return spec

    monkeypatch.setattr(ct2, "to_ctranslate2_spec", with_source_bos)
    with pytest.raises(ExportError, match="log-probabilities differ"):
        export_ctranslate2(source, tmp_path / "ct2")
    assert not any(tmp_path.iterdir())


def test_the_self_check_catches_a_wrong_marian_tokenizer(
    source: ExportSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transformers export also loads its MarianTokenizer back: with the SentencePiece models swapped
    (German text cut by the English model) it encodes otherwise, and nothing is written."""
    from transformer.interop import export_hf as hf

    original = hf.write_marian_tokenizer

    def swapped(changed: ExportSource, directory: Path) -> None:
        original(changed, directory)
        source_model, target_model = (
            (directory / "source.spm").read_bytes(),
            (directory / "target.spm").read_bytes(),
        )
        (directory / "source.spm").write_bytes(target_model)
        (directory / "target.spm").write_bytes(source_model)

    monkeypatch.setattr(hf, "write_marian_tokenizer", swapped)
    with pytest.raises(ExportError, match="MarianTokenizer does not encode or decode as"):
        export_hf(source, tmp_path / "hf")
    assert not any(tmp_path.iterdir())


def test_the_card_of_an_imported_model_trained_further(source: ExportSource) -> None:
    from transformer.interop.card import model_card

    assert "## Recipe" not in model_card(source, "hf", {})  # an import trained nothing here
    card = model_card(dataclasses.replace(source, global_step=500), "hf", {})
    assert "then trained further by this project" in card and "## Recipe" in card
    assert "changed no weight" not in card
    # a fine-tuning run (model.init_from) names its start and how it trained; a run from scratch neither
    lora = {"freeze": "none", "lora": {"rank": 2}}
    run = {**source.run_config, "model": {"init_from": "pretrained/opus/model.ckpt"}, "finetune": lora}
    card = model_card(dataclasses.replace(source, global_step=500, run_config=run), "hf", {})
    assert '- `model.init_from`: "pretrained/opus/model.ckpt"' in card and '"rank": 2' in card
    scratch = {**source.run_config, "finetune": lora}
    assert "finetune" not in model_card(
        dataclasses.replace(source, global_step=5, run_config=scratch), "hf", {}
    )


# --- separate source and target vocabularies --------------------------------------------------------------


def _separate_vocabularies_directory(directory: Path) -> Path:
    """An OPUS-MT-shaped directory whose source and target have vocabularies of their own (vocab.json with
    the German pieces, target_vocab.json with the English ones, of different sizes; `separate_vocabs` in
    tokenizer_config.json; embeddings not shared), random weights; the special ids the same on both sides."""
    opus_mt_tokenizer_files(directory, data_dir("MULTI30K_DIR"))
    vocabularies = {}
    for spm, name in (("source.spm", "vocab.json"), ("target.spm", "target_vocab.json")):
        processor = sentencepiece.SentencePieceProcessor(model_file=str(directory / spm))
        vocab = {"</s>": 0, "<unk>": 1, "<pad>": 2}
        for i in range(1, processor.get_piece_size()):
            vocab.setdefault(processor.id_to_piece(i), len(vocab))
        (directory / name).write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        vocabularies[name] = vocab
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**settings, "separate_vocabs": True}))
    config = transformers.MarianConfig(
        vocab_size=len(vocabularies["vocab.json"]), decoder_vocab_size=len(vocabularies["target_vocab.json"]),
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, activation_function="swish", pad_token_id=2, eos_token_id=0,
        bos_token_id=0, decoder_start_token_id=2, forced_eos_token_id=0, max_position_embeddings=128,
        scale_embedding=True, share_encoder_decoder_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = transformers.MarianMTModel(config).eval()
        with torch.no_grad():
            model.final_logits_bias.normal_()
    model.save_pretrained(directory)
    return directory


def test_separate_vocabularies_export_both_ways(tmp_path: Path, sentences: list[str]) -> None:
    """An imported model with a target vocabulary of its own: the transformers export is the original again
    (both vocabularies, MarianTokenizer's ids and text, weights bit for bit, greedy `generate`), CTranslate2's
    greedy search gives ours, its output read with the target SentencePiece model."""
    opus = _separate_vocabularies_directory(tmp_path / "opus")
    source = load_source(import_hf(opus, tmp_path / "imported"))
    assert not source.joint_vocabulary and source.config.src_vocab_size != source.config.tgt_vocab_size
    hf = export_hf(source, tmp_path / "hf").path
    for name in ("vocab.json", "target_vocab.json"):
        assert json.loads((hf / name).read_text(encoding="utf-8")) == json.loads((opus / name).read_text())
    original, exported = quiet_marian_tokenizer(opus), quiet_marian_tokenizer(hf)
    english = multi30k_lines(data_dir("MULTI30K_DIR"), "test_2016_flickr.en.gz", N_SENTENCES)
    assert exported(sentences).input_ids == original(sentences).input_ids
    targets = original(text_target=english).input_ids
    assert exported(text_target=english).input_ids == targets
    decoded = exported.batch_decode(targets, skip_special_tokens=True)
    assert decoded == original.batch_decode(targets, skip_special_tokens=True)
    assert decoded == [source.sentencepiece.decode(row) for row in targets]  # and as ours
    assert [source.sentencepiece.encode(text) for text in english] == targets  # the target vocabulary's ids
    sizes = [len(json.loads((opus / name).read_text())) for name in ("vocab.json", "target_vocab.json")]
    assert [SentencePieceSide(source.sentencepiece, side).vocab_size for side in ("src", "tgt")] == sizes
    theirs, ours = load_file(opus / "model.safetensors"), load_file(hf / "model.safetensors")
    assert all(torch.equal(theirs[name], ours[name]) for name in theirs if "embed_positions" not in name)
    batch = exported(sentences, return_tensors="pt", padding=True)
    with torch.no_grad():
        options = {"num_beams": 1, "max_new_tokens": 30, "do_sample": False}
        generated = transformers.MarianMTModel.from_pretrained(hf).eval().generate(**batch, **options)
        assert torch.equal(
            generated, transformers.MarianMTModel.from_pretrained(opus).eval().generate(**batch, **options)
        )
    mine = _hypotheses(greedy_search(source.model, batch.input_ids, **LIMIT))
    assert _hypotheses(generated[:, 1:]) == mine

    ct2 = export_ctranslate2(source, tmp_path / "ct2").path
    target_vocab = json.loads((ct2 / "target_vocabulary.json").read_text(encoding="utf-8"))
    assert target_vocab == source.vocabulary("tgt") != source.vocabulary("src")
    translator = ctranslate2.Translator(str(ct2), device="cpu", compute_type="float32")
    results = translator.translate_batch(
        _ct2_tokens(ct2, sentences), beam_size=1, suppress_sequences=[["<pad>"]], **CT2_LIMIT
    )
    assert [[target_vocab.index(t) for t in r.hypotheses[0]] for r in results] == _without_eos(mine)
    card = (ct2 / "README.md").read_text(encoding="utf-8")  # pieces joined by the target's model
    assert 'SentencePieceProcessor(model_file="path/to/this/directory/target.spm")' in card


# --- the command line -----------------------------------------------------------------------------------


def test_cli_exports_an_imported_checkpoint(dirs: dict[str, Path], tmp_path: Path, capsys) -> None:
    """The command line on an imported checkpoint: status 0, one line with the measured difference."""
    out = tmp_path / "hf"
    assert main([str(dirs["ckpt"]), "--to", "hf", "--output", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and float(line.rsplit("max |diff| ", 1)[1].rstrip(")")) <= 1e-5
    assert (out / "source.spm").is_file() and (out / "model.safetensors").is_file()

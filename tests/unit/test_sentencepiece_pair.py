"""`data.sentencepiece_pair.SentencePiecePair` against transformers' `MarianTokenizer` on the same files.

A Marian tokenizer directory is made here as OPUS-MT's are (`tests.helpers.pretrained`): a German and an
English SentencePiece (unigram) model trained on Multi30k's training text, one vocabulary of the pieces of
both with </s> = 0, <unk> = 1 and <pad> last (a language code token too). On 200 validation sentences the
source and target ids must equal MarianTokenizer's, and so must the text decoded from ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

sentencepiece = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

from data.datamodules import TranslationDataModule  # noqa: E402
from data.sentencepiece_pair import SentencePiecePair, SentencePieceSide  # noqa: E402
from data.tokenization import tokenizer_from_json  # noqa: E402
from tests.helpers.datasets import data_dir  # noqa: E402
from tests.helpers.pretrained import multi30k_lines, opus_mt_tokenizer_files  # noqa: E402


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("opus-mt-de-en")
    opus_mt_tokenizer_files(directory, data_dir("MULTI30K_DIR"))
    return directory


@pytest.fixture(scope="module")
def sentences() -> dict[str, list[str]]:
    data = data_dir("MULTI30K_DIR")
    return {side: multi30k_lines(data, f"val.{side}.gz", 200) for side in ("de", "en")}


@pytest.fixture(scope="module")
def theirs(marian_dir: Path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Recommended: pip install sacremoses" (a normalizer not used here)
        return transformers.MarianTokenizer.from_pretrained(marian_dir)


def test_source_and_target_ids_equal_marian_tokenizer_s(marian_dir, sentences, theirs) -> None:
    ours = SentencePiecePair.from_directory(marian_dir)
    source = [*sentences["de"], ">>deu<< Ein Hund läuft.", "Zeichen wie ©, ½ und ∑ kennt er nicht."]
    assert [ours.encode_source(text) for text in source] == theirs(source)["input_ids"]
    assert [ours.encode(text) for text in sentences["en"]] == theirs(text_target=sentences["en"])["input_ids"]
    assert any(ours.unk_id in ours.encode_source(text) for text in source)  # unknown pieces were exercised
    assert (ours.pad_id, ours.bos_id, ours.eos_id, ours.vocab_size) == (
        theirs.pad_token_id, theirs.pad_token_id, theirs.eos_token_id, len(theirs)
    )  # fmt: skip


def test_decoded_text_equals_marian_tokenizer_s(marian_dir, sentences, theirs) -> None:
    ours = SentencePiecePair.from_directory(marian_dir)
    for text in sentences["en"]:
        ids = ours.encode(text) + [ours.pad_id] * 2  # a hypothesis as a search returns it: EOS, then pads
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids + ours.encode("Two dogs.")) == ours.decode(ids)  # nothing after the first </s>


def test_the_state_round_trips_and_missing_files_are_named(marian_dir, tmp_path: Path) -> None:
    ours = SentencePiecePair.from_directory(marian_dir)
    again = SentencePiecePair.from_state(json.loads(json.dumps(ours.to_state())))  # plain JSON data
    assert again.encode_source("Ein Mann fährt Rad.") == ours.encode_source("Ein Mann fährt Rad.")
    (tmp_path / "source.spm").write_bytes((marian_dir / "source.spm").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"target\.spm: a Marian tokenizer needs source\.spm"):
        SentencePiecePair.from_directory(tmp_path)


def test_each_side_frames_its_sentences_for_the_pipeline(marian_dir) -> None:
    """src: Marian's encoder input; tgt: [start = pad] pieces </s>, so that the collator's tgt_in (all but the
    last) starts from pad as Marian's decoder does and tgt_out (all but the first) ends with </s>."""
    pair = SentencePiecePair.from_directory(marian_dir)
    source, target = SentencePieceSide(pair, "src"), SentencePieceSide(pair, "tgt")
    text = "Zwei Hunde spielen im Schnee."
    assert source.encode(text) == pair.encode_source(text)
    assert target.encode(text) == [pair.pad_id, *pair.encode(text)]
    assert target.decode(target.encode(text)[1:]) == pair.decode(pair.encode(text))
    for side in (source, target):  # the checkpoint's text form, told apart from `tokenizers` JSON
        again = tokenizer_from_json(side.to_json())
        assert isinstance(again, SentencePieceSide) and again.encode(text) == side.encode(text)


def test_a_datamodule_with_the_pair_uses_its_special_ids(marian_dir) -> None:
    """Loaded from a checkpoint's state, the datamodule's pad / start / end ids are the vocabulary's own
    (OPUS-MT: pad last, </s> = 0), not the fixed 0-3 of this project's BPE."""
    pair = SentencePiecePair.from_directory(marian_dir)
    datamodule = TranslationDataModule(src_lang="de", tgt_lang="en")
    assert (datamodule.pad_id, datamodule.bos_id, datamodule.eos_id) == (0, 1, 2)
    state = {"tokenizers": {side: SentencePieceSide(pair, side).to_json() for side in ("src", "tgt")}}
    datamodule.load_state_dict(state)
    assert (datamodule.pad_id, datamodule.bos_id, datamodule.eos_id) == (pair.pad_id, pair.pad_id, 0)
    assert datamodule.state_dict() == state  # written back as read


def test_packed_batches_of_the_pair_keep_the_pad_start_token(marian_dir, sentences) -> None:
    """data.packing=true with an imported OPUS-MT tokenizer: the collator pads with the vocabulary's own pad
    id (the last one), the targets start from it, and the host packing keeps that start token in every row
    (an empty sentence's too) and every token the loss scores."""
    import torch

    from transformer.packing import BatchPacking, TokenPacking, prefix_mask

    pair = SentencePiecePair.from_directory(marian_dir)
    datamodule = TranslationDataModule(src_lang="de", tgt_lang="en", packing=True)
    datamodule.load_state_dict(
        {"tokenizers": {s: SentencePieceSide(pair, s).to_json() for s in ("src", "tgt")}}
    )
    source, target = SentencePieceSide(pair, "src"), SentencePieceSide(pair, "tgt")
    texts = [*zip(sentences["de"][:5], sentences["en"][:5]), ("Hallo.", "")]
    examples = [
        {"id": i, "src_ids": source.encode(de), "tgt_ids": target.encode(en)}
        for i, (de, en) in enumerate(texts)
    ]
    batch = datamodule._collator()(examples)
    pad = pair.pad_id
    assert pad == pair.vocab_size - 1 and batch["tgt_in"][:, 0].eq(pad).all()
    packing = BatchPacking.from_collated(batch["packing"], batch["src"], batch["tgt_in"])
    assert packing.target.keep[:, 0].all()
    assert torch.equal(packing.target.keep, prefix_mask(batch["tgt_in"], pad))
    assert torch.equal(packing.source.keep, batch["src"].ne(pad))
    assert torch.equal(packing.target.pack(batch["tgt_out"]), batch["tgt_out"][batch["tgt_out"].ne(pad)])
    assert torch.equal(packing.target.index, TokenPacking(batch["tgt_out"].ne(pad)).index)


def test_separate_vocabularies_give_each_side_its_own_size_and_ids(marian_dir) -> None:
    """separate_vocabs (target_vocab.json): the source side's size is vocab.json's, the target side's (and
    its special ids) target_vocab.json's."""
    shared = SentencePiecePair.from_directory(marian_dir)
    target_vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(list(shared.vocab)[3:40])}}
    target_vocab["<pad>"] = len(target_vocab)
    pair = SentencePiecePair(shared.source_model, shared.target_model, shared.vocab, target_vocab)
    source, target = SentencePieceSide(pair, "src"), SentencePieceSide(pair, "tgt")
    assert source.vocab_size == len(shared.vocab) != target.vocab_size == len(target_vocab) == pair.vocab_size
    assert (target.pad_id, target.bos_id, target.eos_id) == (len(target_vocab) - 1,) * 2 + (0,)
    assert all(i < len(target_vocab) for i in target.encode("Two dogs play in the snow."))

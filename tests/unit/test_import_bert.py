"""Importing BERT-family classifiers (`transformer.interop.bert`, `aiayn-import`): tiny models made here
(`tests.helpers.pretrained.bert_directory`: hidden 32, 2 layers, random weights, WordPiece trained on SST-2
text) give the logits transformers gives on padded batches, the tokenizer gives BertTokenizerFast's ids, a
BertModel gets a new head, and what ours cannot represent is refused with one line, nothing written.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from data.tokenization import tokenizer_from_json  # noqa: E402
from data.wordpiece import WordPieceTokenizer  # noqa: E402
from tests.helpers.datasets import data_dir  # noqa: E402
from tests.helpers.pretrained import bert_directory, sst2_lines  # noqa: E402
from transformer.checkpoint import load_checkpoint  # noqa: E402
from transformer.config import TransformerConfig  # noqa: E402
from transformer.encoder_only import TransformerClassifier  # noqa: E402
from transformer.evaluation.restore import restore_model  # noqa: E402
from transformer.interop.import_cli import main  # noqa: E402

N_SENTENCES = 200
TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def _quiet_transformers():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    yield
    transformers.logging.set_verbosity(verbosity)
    transformers.logging.enable_progress_bar()


@pytest.fixture(scope="module")
def sst2() -> Path:
    return data_dir("SST2_DIR")


@pytest.fixture(scope="module")
def sentences(sst2: Path) -> list[str]:
    return sst2_lines(sst2, "dev", N_SENTENCES)


@pytest.fixture(scope="module")
def bert_dir(sst2: Path, tmp_path_factory) -> Path:
    return bert_directory(tmp_path_factory.mktemp("bert") / "model", sst2)


def _import(source: Path, output: Path, *extra: str) -> dict:
    assert main([str(source), "--output", str(output), *extra]) == 0
    return load_checkpoint(output / "model.ckpt")


def _logit_difference(
    ours: torch.nn.Module, theirs: torch.nn.Module, source: Path, sentences: list[str]
) -> float:
    """Max |logit difference| over `sentences` in padded batches of 25, each side fed transformers'
    tokenizer's ids (ours finds the padding by the pad id, transformers by the attention mask)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    worst = 0.0
    for start in range(0, len(sentences), 25):
        batch = tokenizer(sentences[start : start + 25], padding=True, return_tensors="pt")
        assert batch.attention_mask.eq(0).any()  # padded: the mask matters
        with torch.no_grad():
            difference = (ours(batch.input_ids) - theirs(**batch).logits).abs().max().item()
        worst = max(worst, difference)
    return worst


def test_the_wordpiece_tokenizer_gives_bert_tokenizer_fasts_ids(bert_dir: Path, sentences, tmp_path) -> None:
    texts = [*sentences, "Ünïcödé café 東京 naïve [SEP] x", "   ", "an unknownwordpiecewithoutend"]
    reference = transformers.AutoTokenizer.from_pretrained(bert_dir)
    ours = WordPieceTokenizer.from_directory(bert_dir)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
        reference.cls_token_id, reference.sep_token_id, reference.pad_token_id,
    ) == (4, 5, 0)  # fmt: skip
    assert ours.encode_batch(texts) == reference(texts).input_ids
    restored = tokenizer_from_json(ours.to_json())  # as a checkpoint stores and restores it
    assert restored.encode_batch(texts) == reference(texts).input_ids
    assert restored.decode(restored.encode(sentences[0])) == reference.decode(
        reference(sentences[0]).input_ids, skip_special_tokens=True
    )
    # a directory with vocab.txt only (older hub models), read with tokenizer_config.json's settings
    vocab_only = tmp_path / "vocab-only"
    vocab_only.mkdir()
    for name in ("vocab.txt", "tokenizer_config.json"):
        (vocab_only / name).write_bytes((bert_dir / name).read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.AutoTokenizer.from_pretrained(vocab_only)
    assert WordPieceTokenizer.from_directory(vocab_only).encode_batch(texts) == reference(texts).input_ids


def test_an_imported_bert_classifier_gives_transformers_logits(bert_dir: Path, sentences, tmp_path) -> None:
    checkpoint = _import(bert_dir, tmp_path / "imported")
    restored = restore_model(checkpoint)  # as evaluate.py rebuilds it
    assert restored.task == "classification" and restored.hparams["pooling"] == "cls_tanh"
    config = restored.model.config
    assert (config.scale_embedding, config.embedding_norm, config.norm_eps) == (False, True, 1e-12)
    assert (config.positional, config.activation, config.norm_first) == ("learned", "gelu", False)
    assert (config.pad_id, config.bos_id, config.eos_id) == (0, 4, 5)
    theirs = transformers.BertForSequenceClassification.from_pretrained(bert_dir).eval()
    assert _logit_difference(restored.model, theirs, bert_dir, sentences) < TOLERANCE
    provenance = checkpoint["imported_from"]
    assert provenance["architecture"] == "BertForSequenceClassification" and provenance["new_head"] is False
    assert provenance["transformers"] == transformers.__version__
    assert checkpoint["config"]["data"]["test_split"] == "dev"  # SST-2's labelled split, as configs/data/sst2
    tokenizer = tokenizer_from_json(checkpoint["ClassificationDataModule"]["tokenizers"]["joint"])
    assert isinstance(tokenizer, WordPieceTokenizer) and tokenizer.vocab_size == config.src_vocab_size


def test_the_token_type_embedding_is_folded_into_the_positions(bert_dir: Path, sentences, tmp_path) -> None:
    """Changing BERT's type-0 vector changes its logits and ours alike (so it is not simply ignored)."""
    theirs = transformers.BertForSequenceClassification.from_pretrained(bert_dir).eval()
    with torch.no_grad():
        # a random vector, not a constant one: the LayerNorm after it would remove a constant
        theirs.bert.embeddings.token_type_embeddings.weight[0] += torch.randn(
            32, generator=torch.Generator().manual_seed(1)
        )
    changed = tmp_path / "changed"
    theirs.save_pretrained(changed)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (changed / name).write_bytes((bert_dir / name).read_bytes())
    restored = restore_model(_import(changed, tmp_path / "imported"))
    assert _logit_difference(restored.model, theirs, changed, sentences[:50]) < TOLERANCE
    original = restore_model(_import(bert_dir, tmp_path / "original"))
    assert _logit_difference(original.model, theirs, changed, sentences[:50]) > 1e-2


def test_an_imported_distilbert_classifier_gives_transformers_logits(sst2: Path, sentences, tmp_path) -> None:
    source = bert_directory(tmp_path / "distilbert", sst2, model_type="distilbert", num_labels=2)
    restored = restore_model(_import(source, tmp_path / "imported"))
    assert restored.hparams["pooling"] == "cls_relu" and restored.hparams["num_classes"] == 2
    theirs = transformers.DistilBertForSequenceClassification.from_pretrained(source).eval()
    assert _logit_difference(restored.model, theirs, source, sentences) < TOLERANCE


def test_a_bert_model_without_a_head_gets_a_new_one(sst2: Path, sentences, tmp_path, capsys) -> None:
    source = bert_directory(tmp_path / "bare", sst2, head=False)
    assert main([str(source), "--output", str(tmp_path / "refused")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "--num-classes N" in err, err
    assert not (tmp_path / "refused").exists()
    checkpoint = _import(source, tmp_path / "imported", "--num-classes", "4")
    restored = restore_model(checkpoint)
    assert restored.hparams["num_classes"] == 4 and checkpoint["imported_from"]["new_head"] is True
    # the encoder and BERT's pretrained pooler are the model's: pooled outputs equal BertModel's
    bare = transformers.BertModel.from_pretrained(source).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    batch = tokenizer(sentences[:25], padding=True, return_tensors="pt")
    model = restored.model
    with torch.no_grad():
        hidden, _ = model.encode(batch.input_ids)
        pooled = model.pooler(hidden[:, 0])
        expected = bare(**batch).pooler_output
        logits = model(batch.input_ids)
    assert (pooled - expected).abs().max().item() < TOLERANCE
    assert logits.shape == (25, 4) and logits.std() > 0  # a head that is not all zeros
    head = model.head.weight
    assert abs(head.std().item() - 0.02) < 0.01  # initialised as transformers initialises a head


def test_a_head_of_another_size_is_refused(bert_dir: Path, tmp_path, capsys) -> None:
    assert main([str(bert_dir), "--output", str(tmp_path / "out"), "--num-classes", "5"]) == 1
    err = capsys.readouterr().err.strip()
    assert "head for 3 classes" in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
        ({"is_decoder": True}, "is_decoder=true"),
        ({"add_cross_attention": True}, "add_cross_attention=true"),
        ({"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
        ({"problem_type": "multi_label_classification"}, "problem_type='multi_label_classification'"),
    ],
)
def test_bert_settings_ours_lacks_are_refused_by_name(
    bert_dir: Path, tmp_path, capsys, change: dict, fragment: str
) -> None:
    config = transformers.AutoConfig.from_pretrained(bert_dir)
    for key, value in change.items():
        setattr(config, key, value)
    source = tmp_path / "source"
    config.save_pretrained(source)  # the config alone: refused before weights or tokenizer are read
    assert main([str(source), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert fragment in err, err
    assert not (tmp_path / "out").exists()


def test_other_architectures_and_missing_tokenizers_are_refused(bert_dir: Path, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    cases = {
        "t5": (transformers.T5Config(vocab_size=40), "model_type='t5'"),
        "gpt2": (transformers.GPT2Config(vocab_size=40), "model_type='gpt2'"),
        "roberta": (transformers.RobertaConfig(vocab_size=40), "model_type='roberta'"),
    }
    for name, (config, fragment) in cases.items():
        config.save_pretrained(tmp_path / name)
        assert main([str(tmp_path / name), "--output", str(out)]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and fragment in err, err
    transformers.MarianConfig(vocab_size=40).save_pretrained(tmp_path / "marian")
    assert main([str(tmp_path / "marian"), "--output", str(out), "--num-classes", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert "--num-classes is for BERT-family classifiers" in err and "\n" not in err, err
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for path in bert_dir.iterdir():
        if not path.name.startswith(("tokenizer", "vocab")):
            (no_tokenizer / path.name).write_bytes(path.read_bytes())
    assert main([str(no_tokenizer), "--output", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "no tokenizer" in err and "tokenizer.json nor vocab.txt" in err and "\n" not in err, err
    assert not out.exists()


def test_the_new_options_default_to_todays_model_and_are_checked() -> None:
    old = TransformerConfig(src_vocab_size=50).to_dict()
    for key in ("scale_embedding", "embedding_norm", "norm_eps"):
        del old[key]  # a checkpoint written before these options existed
    config = TransformerConfig.from_dict(old)
    assert (config.scale_embedding, config.embedding_norm, config.norm_eps) == (True, False, 1e-5)
    model = TransformerClassifier(TransformerConfig.from_dict({**old, "n_decoder_layers": 0}), 2)
    assert not any(name.startswith(("src_embed.norm", "pooler")) for name in model.state_dict())
    for bad in ({"norm_eps": 0.0}, {"embedding_norm": "yes"}, {"scale_embedding": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TransformerConfig(src_vocab_size=50, **bad)


def test_a_from_scratch_bert_shaped_classifier_uses_the_options() -> None:
    """The options are the model's, not the importer's: unscaled embeddings, their LayerNorm with the
    configured epsilon, the tanh pooler, all in a plain config."""
    config = TransformerConfig(
        src_vocab_size=50, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=0, d_ff=32,
        dropout=0.0, positional="learned", scale_embedding=False, embedding_norm=True, norm_eps=1e-12,
    )  # fmt: skip
    model = TransformerClassifier(config, 2, "cls_tanh").eval()
    src = torch.tensor([[1, 7, 9, 2]])
    embedder = model.src_embed
    positions = embedder.positional.embedding.weight[:4]
    expected = torch.nn.functional.layer_norm(
        embedder.embedding(src) + positions, (16,), embedder.norm.weight, embedder.norm.bias, 1e-12
    )
    torch.testing.assert_close(embedder(src), expected)
    assert all(
        norm.eps == 1e-12 for name, norm in model.named_modules() if isinstance(norm, torch.nn.LayerNorm)
    )
    hidden, _ = model.encode(src)
    pooled = torch.tanh(model.pooler[0](hidden[:, 0]))
    torch.testing.assert_close(model(src), model.head(pooled))


def test_a_head_is_found_in_the_weights_when_the_config_names_no_architecture(
    bert_dir: Path, sentences, tmp_path
) -> None:
    """Older hub configs (textattack's SST-2 models among them) have no `architectures`."""
    source = tmp_path / "unnamed"
    source.mkdir()
    for path in bert_dir.iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    settings = json.loads((source / "config.json").read_text())
    del settings["architectures"]
    (source / "config.json").write_text(json.dumps(settings))
    checkpoint = _import(source, tmp_path / "imported")
    assert checkpoint["imported_from"]["new_head"] is False
    theirs = transformers.BertForSequenceClassification.from_pretrained(bert_dir).eval()
    assert _logit_difference(restore_model(checkpoint).model, theirs, bert_dir, sentences[:50]) < TOLERANCE


def test_a_training_config_may_choose_bert_s_pooler() -> None:
    """train.py checks `model.*` against ClassificationTask's signature: the new poolings pass it."""
    from transformer.cli.arguments import ArgumentError, check_arguments
    from transformer.training.classification import ClassificationTask

    for pooling in ("cls_tanh", "cls_relu"):
        check_arguments(ClassificationTask, {"pooling": pooling}, "model")
    with pytest.raises(ArgumentError, match="cls_tanh"):
        check_arguments(ClassificationTask, {"pooling": "pooler"}, "model")


def test_a_distilbert_model_without_a_head_gets_a_new_one(sst2: Path, sentences, tmp_path) -> None:
    """DistilBERT's head (pre_classifier, classifier) is new; the encoder is DistilBertModel's."""
    source = bert_directory(tmp_path / "bare", sst2, model_type="distilbert", head=False)
    restored = restore_model(_import(source, tmp_path / "imported", "--num-classes", "2"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    batch = tokenizer(sentences[:25], padding=True, return_tensors="pt")
    bare = transformers.DistilBertModel.from_pretrained(source).eval()
    with torch.no_grad():
        hidden, padding = restored.model.encode(batch.input_ids)
        expected = bare(**batch).last_hidden_state
    keep = ~padding  # (B, S): the real tokens
    assert (hidden - expected)[keep].abs().max().item() < TOLERANCE
    assert restored.hparams["pooling"] == "cls_relu" and restored.model.head.out_features == 2


@pytest.mark.parametrize("positional", ["learned", "sinusoidal"])
def test_the_embedding_options_give_the_same_vectors_packed_and_padded(positional: str) -> None:
    """The packed path (a translation model's pack_tokens) scales and normalises as the padded one."""
    from transformer.embedding import Embedder
    from transformer.packing import TokenPacking
    from transformer.positional import build_absolute_positional

    torch.manual_seed(0)
    embedder = Embedder(
        torch.nn.Embedding(30, 16), build_absolute_positional(positional, 16, 12), 0.0,
        scale=False, norm=True, norm_eps=1e-12,
    ).eval()  # fmt: skip
    with torch.no_grad():
        embedder.norm.weight.normal_()
        embedder.norm.bias.normal_()
    tokens = torch.tensor([[3, 4, 5, 0, 0], [6, 7, 8, 9, 10]])
    packing = TokenPacking(tokens.ne(0))
    torch.testing.assert_close(embedder(tokens, packing=packing), embedder(tokens)[tokens.ne(0)])


def test_a_translation_model_takes_the_options_too() -> None:
    from transformer.model import Seq2SeqTransformer

    config = TransformerConfig(
        src_vocab_size=40, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32,
        scale_embedding=False, embedding_norm=True, norm_eps=1e-6,
    )  # fmt: skip
    model = Seq2SeqTransformer(config)
    assert model.src_embed.norm is not None and model.tgt_embed.norm is not None
    assert model.src_embed.scale == model.tgt_embed.scale == 1.0
    norms = [module for module in model.modules() if isinstance(module, torch.nn.LayerNorm)]
    assert len(norms) == 2 + 2 + 3 and all(norm.eps == 1e-6 for norm in norms)  # embedders, encoder, decoder


# --- a new head: which weights are copied, which are new and how they start; the class-count bounds ---------


def _head_from_transformers(source: Path, num_classes: int) -> dict[str, torch.Tensor]:
    """What transformers gives a BertModel directory's new head (and a missing pooler) under seed 0."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification.from_pretrained(source, num_labels=num_classes)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def test_a_new_head_is_transformers_seeded_initialisation_and_the_rest_is_copied(
    sst2: Path, tmp_path: Path
) -> None:
    source = bert_directory(tmp_path / "bare", sst2, head=False)
    first = restore_model(_import(source, tmp_path / "one", "--num-classes", "2"))
    second = restore_model(_import(source, tmp_path / "two", "--num-classes", "2"))
    theirs = _head_from_transformers(source, 2)
    head = first.model.head
    assert torch.equal(head.weight, theirs["classifier.weight"]) and torch.equal(
        head.bias, theirs["classifier.bias"]
    )
    assert not head.bias.any() and 0.01 < head.weight.std().item() < 0.03  # normal(0, 0.02), bias 0
    # the same head on every import; the pooler and every other weight are the saved BertModel's
    assert all(torch.equal(v, second.model.state_dict()[k]) for k, v in first.model.state_dict().items())
    bare = transformers.BertModel.from_pretrained(source).state_dict()
    ours = first.model.state_dict()
    assert torch.equal(ours["pooler.0.weight"], bare["pooler.dense.weight"])
    assert torch.equal(ours["pooler.0.bias"], bare["pooler.dense.bias"])
    assert torch.equal(ours["src_embed.embedding.weight"], bare["embeddings.word_embeddings.weight"])
    assert torch.equal(ours["encoder.layers.1.norm2.weight"], bare["encoder.layer.1.output.LayerNorm.weight"])


def test_a_bert_model_saved_without_its_pooler_gets_a_new_one_too(
    sst2: Path, sentences, tmp_path: Path
) -> None:
    """BertModel(add_pooling_layer=False): the pooler is new (transformers' seeded init), as the head;
    the encoder is the saved one's."""
    bare = bert_directory(tmp_path / "bare", sst2, head=False)
    source = tmp_path / "no-pooler"
    transformers.BertModel.from_pretrained(bare, add_pooling_layer=False).save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        (source / name).write_bytes((bare / name).read_bytes())
    checkpoint = _import(source, tmp_path / "imported", "--num-classes", "3")
    assert checkpoint["imported_from"]["new_head"] is True
    model = restore_model(checkpoint).model
    theirs = _head_from_transformers(source, 3)
    for ours, name in (("pooler.0", "bert.pooler.dense"), ("head", "classifier")):
        for part in ("weight", "bias"):
            assert torch.equal(model.state_dict()[f"{ours}.{part}"], theirs[f"{name}.{part}"]), (ours, part)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    batch = tokenizer(sentences[:25], padding=True, return_tensors="pt")
    encoder = transformers.BertModel.from_pretrained(source, add_pooling_layer=False).eval()
    with torch.no_grad():
        hidden, padding = model.encode(batch.input_ids)
        expected = encoder(**batch).last_hidden_state
    assert (hidden - expected)[~padding].abs().max().item() < TOLERANCE


def test_num_classes_bounds_for_a_new_head(sst2: Path, tmp_path: Path, capsys) -> None:
    from transformer.interop.weights import MAX_CLASSES

    source = bert_directory(tmp_path / "bare", sst2, head=False)
    for bad in ("1", "0", str(MAX_CLASSES + 1)):
        assert main([str(source), "--output", str(tmp_path / f"out{bad}"), "--num-classes", bad]) == 1
        err = capsys.readouterr().err.strip()
        assert (
            f"--num-classes {bad}: a classifier has 2 to {MAX_CLASSES} classes" in err and "\n" not in err
        ), err
        assert not (tmp_path / f"out{bad}").exists()
    for good in ("2", str(MAX_CLASSES)):
        restored = restore_model(_import(source, tmp_path / f"out{good}", "--num-classes", good))
        assert restored.hparams["num_classes"] == int(good) == restored.model.head.out_features


def test_a_head_of_the_same_size_is_kept_and_one_fewer_or_more_refused(
    bert_dir: Path, tmp_path, capsys
) -> None:
    """--num-classes equal to the head's is the head itself (not a new one); 2 or 4 against its 3 refused."""
    checkpoint = _import(bert_dir, tmp_path / "same", "--num-classes", "3")
    assert checkpoint["imported_from"]["new_head"] is False
    theirs = transformers.BertForSequenceClassification.from_pretrained(bert_dir).state_dict()
    model = restore_model(checkpoint).model
    assert torch.equal(model.head.weight, theirs["classifier.weight"])
    assert torch.equal(model.head.bias, theirs["classifier.bias"])
    assert torch.equal(model.pooler[0].weight, theirs["bert.pooler.dense.weight"])
    for other in ("2", "4"):
        assert main([str(bert_dir), "--output", str(tmp_path / other), "--num-classes", other]) == 1
        err = capsys.readouterr().err.strip()
        assert f"head for 3 classes, not --num-classes {other}" in err and "\n" not in err, err
        assert not (tmp_path / other).exists()


def test_the_heads_labels_problem_type_and_max_len_are_the_checkpoints(
    sst2: Path, tmp_path: Path, capsys
) -> None:
    """problem_type single_label_classification is ours; the class names come from id2label in id order;
    the data section's max_len is the model's positions; a headed model whose other weights lack one (its
    pooler) is refused rather than given a random one."""
    names = {0: "negative", 1: "neutral", 2: "positive"}
    source = bert_directory(
        tmp_path / "labelled", sst2, problem_type="single_label_classification", id2label=names,
        label2id={v: k for k, v in names.items()}, hidden_dropout_prob=0.15,
        attention_probs_dropout_prob=0.25,
    )  # fmt: skip
    checkpoint = _import(source, tmp_path / "imported")
    assert checkpoint["class_names"] == checkpoint["imported_from"]["labels"] == list(names.values())
    config = restore_model(checkpoint).model.config
    assert checkpoint["config"]["data"]["max_len"] == 128 == config.max_len
    assert (config.dropout, config.attention_dropout) == (0.15, 0.25)  # each BERT rate where ours applies it
    from safetensors.torch import load_file, save_file

    weights = load_file(source / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if not k.startswith("bert.pooler.")}, source / "model.safetensors"
    )
    assert main([str(source), "--output", str(tmp_path / "refused")]) == 1
    err = capsys.readouterr().err.strip()
    assert "its weights lack bert.pooler.dense" in err and "\n" not in err, err
    assert not (tmp_path / "refused").exists()


def test_a_config_with_pruned_heads_is_refused(bert_dir: Path, tmp_path: Path, capsys) -> None:
    config = transformers.AutoConfig.from_pretrained(bert_dir)
    config.pruned_heads = {0: [1]}
    config.save_pretrained(tmp_path / "source")
    assert main([str(tmp_path / "source"), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert "pruned_heads: ours has the same number of heads in every layer" in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()

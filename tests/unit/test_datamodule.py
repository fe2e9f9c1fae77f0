"""DataModules: batches match the raw text by id, tokenizer caching and checkpoint state, real Multi30k and
SST-2, length filtering, unlabeled splits, and an exact mid-epoch resume through a real Lightning Trainer."""

import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from data import synthetic, tokenization
from data.datamodules import ClassificationDataModule, TranslationDataModule
from data.sources import DataError

SMALL = {"train": 400, "val": 40, "test": 30}


def _synthetic(**kwargs: object) -> TranslationDataModule:
    args = {
        "synthetic_sizes": SMALL,
        "vocab_size": 150,
        "max_tokens": 400,
        "max_len": 48,
        "show_progress": False,
    }
    return TranslationDataModule(**{**args, **kwargs})


def _no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tokenizer was trained although a matching one was available")

    monkeypatch.setattr(tokenization, "train_bpe", fail)  # the DataModules call it through the module


def test_translation_batches_match_raw_text() -> None:
    dm = _synthetic()
    dm.prepare_data()
    dm.setup("fit")
    assert dm.src_tokenizer is dm.tgt_tokenizer and dm.src_vocab_size == dm.tgt_vocab_size == 150
    assert (dm.pad_id, dm.bos_id, dm.eos_id) == (0, 1, 2)
    seen, longest = [], []
    for batch in dm.val_dataloader():
        assert set(batch) == {"src", "src_padding_mask", "tgt_in", "tgt_out", "tgt_padding_mask", "id"}
        assert (batch["tgt_in"][:, 0] == dm.bos_id).all()
        for row, i in enumerate(batch["id"].tolist()):
            assert dm.src_tokenizer.decode(batch["src"][row]) == dm.sources("val")[i]
            assert dm.tgt_tokenizer.decode(batch["tgt_out"][row]) == dm.references("val")[i]
        seen += batch["id"].tolist()
        longest.append(int((~batch["src_padding_mask"]).sum(1).max()))
    assert sorted(seen) == list(range(40))
    train = list(dm.train_dataloader())
    assert sorted(i for b in train for i in b["id"].tolist()) == list(range(400))
    assert all(b["src"].numel() <= 400 and b["tgt_in"].numel() <= 400 for b in train)


def test_tokenizer_cached_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _synthetic(cache_dir=tmp_path)
    first.prepare_data()
    first.setup("fit")
    saved = list((tmp_path / "tokenizers").glob("*/tokenizer.json"))
    assert len(saved) == 1
    with monkeypatch.context() as patch:
        _no_training(patch)
        again = _synthetic(cache_dir=tmp_path)
        again.prepare_data()
        again.setup("fit")
    assert again.src_tokenizer.to_json() == first.src_tokenizer.to_json()
    other = _synthetic(cache_dir=tmp_path, seed=1)  # different training text: trained anew, stored apart
    other.prepare_data()
    assert len(list((tmp_path / "tokenizers").glob("*/tokenizer.json"))) == 2


def test_state_dict_restores_tokenizer_and_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    dm = _synthetic(joint_vocab=False)
    dm.setup("fit")
    assert dm.src_tokenizer is not dm.tgt_tokenizer
    assert dm.src_tokenizer.to_json() != dm.tgt_tokenizer.to_json()
    loader = dm.train_dataloader()
    iterator = iter(loader)
    first_batches = [next(iterator)["id"].tolist() for _ in range(3)]
    state = dm.state_dict()
    assert state["train_sampler"] == {"epoch": 0, "batches_yielded": 3}
    with monkeypatch.context() as patch:
        _no_training(patch)
        restored = _synthetic(joint_vocab=False)
        restored.load_state_dict(state)
        restored.setup("fit")
        assert restored.src_tokenizer.to_json() == dm.src_tokenizer.to_json()
        assert restored.tgt_tokenizer.to_json() == dm.tgt_tokenizer.to_json()
        rest = [b["id"].tolist() for b in restored.train_dataloader()]
    assert first_batches + rest == [b["id"].tolist() for b in dm.train_dataloader()]


def test_max_len_filters_train_and_truncates_eval(caplog: pytest.LogCaptureFixture) -> None:
    dm = _synthetic(max_len=24)
    with caplog.at_level(logging.WARNING, logger="data.datamodules"):
        dm.setup("fit")
    train = dm.tokenized("train")
    assert 0 < len(train) < 400
    assert f"train: dropped {400 - len(train)} of 400 examples longer than max_len=24" in caplog.text
    val = dm.tokenized("val")
    assert len(val) == 40 and "val: truncated" in caplog.text  # scores must cover every example
    assert all(len(ids) <= 24 and ids[-1] == dm.eos_id for ids in val["tgt_ids"][:])


def test_predict_raw_texts() -> None:
    dm = _synthetic()
    dm.setup("fit")
    dm.predict_texts = ["we see three cats .", "i have one hundred one old cars and two eggs .", "hi"]
    batches = list(dm.predict_dataloader())
    assert all(set(b) == {"src", "src_padding_mask", "id"} for b in batches)
    decoded = {i: dm.src_tokenizer.decode(row) for b in batches for i, row in zip(b["id"].tolist(), b["src"])}
    assert [decoded[i] for i in range(3)] == dm.predict_texts
    # text_dataloader(texts): the same batches without setting the datamodule's state
    texts, dm.predict_texts = dm.predict_texts, None
    again = list(dm.text_dataloader(texts))
    assert len(again) == len(batches)
    for a, b in zip(again, batches):
        assert torch.equal(a["src"], b["src"]) and torch.equal(a["id"], b["id"])
    assert dm.predict_texts is None


def test_text_batches_are_cut_to_max_len_in_the_texts_order() -> None:
    """A text longer than max_len is cut to max_len tokens keeping its EOS (the model has no positions
    beyond); the batches come in the same order on every call (no shuffling), every text once."""
    dm = _synthetic(max_len=24)
    dm.setup("fit")
    long_text = " ".join(["one hundred one old cars"] * 20)
    texts = ["hi", long_text, "we see three cats .", *(f"i have {n} eggs ." for n in ("one", "two", "three"))]
    first = list(dm.text_dataloader(texts))
    rows = {i: row[row.ne(dm.pad_id)] for b in first for i, row in zip(b["id"].tolist(), b["src"])}
    assert sorted(rows) == list(range(len(texts)))
    assert len(rows[1]) == 24 and rows[1][-1] == dm.eos_id
    assert len(dm.src_tokenizer.encode(long_text)) > 24
    for _ in range(3):
        again = list(dm.text_dataloader(texts))
        assert [b["id"].tolist() for b in again] == [b["id"].tolist() for b in first]
    # many texts: batches in length order (the least padding), as the evaluation sampler sorts them
    many = [" ".join(["one old car"] * (1 + i % 7)) + f" {i % 3} ." for i in range(300)]
    batches = list(dm.text_dataloader(many))
    assert len(batches) > 2
    lengths = [int(row.ne(dm.pad_id).sum()) for b in batches for row in b["src"]]
    assert lengths == sorted(lengths)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="source must be"):
        TranslationDataModule(source="wmt")
    with pytest.raises(ValueError, match=r"max_tokens \(10\) must be at least max_len \(64\)"):
        TranslationDataModule(max_tokens=10, max_len=64)
    with pytest.raises(ValueError, match=r"needs data\.data_dir"):  # when a split is read (text needs none)
        TranslationDataModule(source="parallel").raw_split("test")
    with pytest.raises(ValueError, match="hub_name"):
        ClassificationDataModule(source="hub")
    with pytest.raises(ValueError, match=r"bpe_dropout must be in \[0, 1\), got 1.0"):
        ClassificationDataModule(bpe_dropout=1.0)


def test_multi30k_real(multi30k_dir: Path) -> None:
    dm = TranslationDataModule(
        "multi30k",
        multi30k_dir,
        "de",
        "en",
        test_split="test_2016_flickr",
        vocab_size=2000,
        show_progress=False,
    )
    dm.prepare_data()
    dm.setup("test")
    assert dm.src_vocab_size == 2000 and len(dm.references("test_2016_flickr")) == 1000
    ids = [i for batch in dm.test_dataloader() for i in batch["id"].tolist()]
    assert sorted(ids) == list(range(1000))
    assert dm.sources("test_2016_flickr")[0] == "Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt."
    missing = TranslationDataModule(
        "multi30k", multi30k_dir, test_split="test_2018_flickr", show_progress=False
    )
    with pytest.raises(DataError, match=r"test_2018_flickr\.en\.gz.*splits present"):
        missing.references("test_2018_flickr")


def test_sst2_real(sst2_dir: Path) -> None:
    # Tokenizer trained on dev to stay fast (train.tsv.gz itself is read in test_sources).
    dm = ClassificationDataModule(
        data_dir=sst2_dir, train_split="dev", test_split="dev", vocab_size=1000, show_progress=False
    )
    dm.prepare_data()
    dm.setup("fit")
    assert (dm.class_names, dm.num_classes, dm.vocab_size) == (["negative", "positive"], 2, 1000)
    labels = dm.labels("dev")
    for batch in dm.val_dataloader():
        assert set(batch) == {"src", "src_padding_mask", "label", "id"}
        assert batch["label"].tolist() == [labels[i] for i in batch["id"].tolist()]
        assert (batch["src"][:, 0] == dm.bos_id).all()  # position 0 is the classifier's summary token
    assert dm.state_dict()["class_names"] == ["negative", "positive"]


def test_classification_unlabeled_split_refused_but_predictable(tmp_path: Path) -> None:
    (tmp_path / "train.tsv").write_text("sentence\tlabel\n" + "good film\t1\nbad film\t0\n" * 5)
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\nfine film\t1\n")
    (tmp_path / "test.tsv").write_text("index\tsentence\n0\tgood bad film\n1\tfilm\n")
    dm = ClassificationDataModule(data_dir=tmp_path, vocab_size=30, show_progress=False)
    dm.setup("fit")
    with pytest.raises(DataError, match="split 'test' is unlabeled"):
        dm.setup("test")
    batches = list(dm.predict_dataloader())  # predicting the unlabeled split is fine
    assert sorted(i for b in batches for i in b["id"].tolist()) == [0, 1]


def test_classification_generic_files(tmp_path: Path) -> None:
    rows = ['{"review": "great stuff", "stars": "pos"}', '{"review": "awful", "stars": "neg"}'] * 5
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "valid.jsonl").write_text(rows[1] + "\n")
    dm = ClassificationDataModule(
        "files", tmp_path, val_split="valid", file_pattern="{split}.jsonl", text_column="review",
        label_column="stars", vocab_size=30, show_progress=False,
    )  # fmt: skip
    dm.setup("validate")
    assert dm.class_names == ["neg", "pos"]  # inferred from the training split
    assert next(iter(dm.val_dataloader()))["label"].tolist() == [0]
    with pytest.raises(DataError, match=r"missing .*test\.jsonl"):
        dm.setup("test")


class _Recorder(L.LightningModule):
    """Smallest trainable module: records the ids of every training batch it sees."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 4)
        self.seen: list[list[int]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["id"].tolist())
        return self.embed(batch["src"]).pow(2).mean()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.embed(batch["src"]).pow(2).mean(), batch_size=len(batch["id"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(
    run_dir: Path,
    cache_dir: Path,
    ckpt_path: Path | None = None,
    model: _Recorder | None = None,
    **data: object,
) -> list[list[int]]:
    """Two epochs; checkpoints every 5 steps and, as the project's callbacks do, when validation ends.
    `model` (default: a fresh `_Recorder`) lets the caller read what else it recorded."""
    callbacks = [
        ModelCheckpoint(run_dir, "{step}", every_n_train_steps=5, save_top_k=-1),
        ModelCheckpoint(run_dir, "epoch{epoch}", save_top_k=-1, auto_insert_metric_name=False),
    ]
    trainer = L.Trainer(
        max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, limit_val_batches=1, num_sanity_val_steps=0,
    )  # fmt: skip
    model = _Recorder(150) if model is None else model
    trainer.fit(model, datamodule=_synthetic(cache_dir=cache_dir, **data), ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_resume_continues_exactly(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    full = _fit(tmp_path / "full", cache)
    per_epoch = len(full) // 2
    assert sorted(i for b in full[:per_epoch] for i in b) == list(range(400))  # epoch 0 covers all
    assert full[:per_epoch] != full[per_epoch:]  # epoch 1 reshuffled
    for step in (5, per_epoch + 5 - per_epoch % 5):  # mid epoch 0 and mid epoch 1
        resumed = _fit(tmp_path / f"from{step}", cache, tmp_path / "full" / f"step={step}.ckpt")
        assert resumed == full[step:]
    # Saved when epoch 0's validation ended: resumes with epoch 1.
    assert _fit(tmp_path / "from_epoch0", cache, tmp_path / "full" / "epoch0.ckpt") == full[per_epoch:]


class _SourceRecorder(_Recorder):
    """Also records each example's source ids, by stage, epoch and example id."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.sources: dict[tuple[str, int, int], list[int]] = {}
        self.batch_sizes: list[int] = []  # padded tokens of each training batch

    def _record(self, stage: str, batch: dict[str, torch.Tensor]) -> None:
        for row, i in zip(batch["src"].tolist(), batch["id"].tolist()):
            self.sources[stage, self.current_epoch, i] = [t for t in row if t != tokenization.PAD_ID]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._record("train", batch)
        self.batch_sizes.append(batch["src"].numel())
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._record("val", batch)


def _sources_seen(cache_dir: Path, **kwargs: object) -> tuple[_SourceRecorder, TranslationDataModule]:
    trainer = L.Trainer(
        max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0,
    )  # fmt: skip
    model, dm = _SourceRecorder(150), _synthetic(cache_dir=cache_dir, **kwargs)
    trainer.fit(model, datamodule=dm)
    return model, dm


def _text_files(directory: Path) -> Path:
    """The seed-0 synthetic splits as `{split}.{lang}` files (source="parallel"): text that `seed` leaves
    alone, so that two runs of other seeds differ in the dropout draws and the batch order only."""
    directory.mkdir()
    for split, (english, german) in synthetic.make_synthetic_splits(0, SMALL).items():
        (directory / f"{split}.en").write_text("".join(f"{line}\n" for line in english))
        (directory / f"{split}.de").write_text("".join(f"{line}\n" for line in german))
    return directory


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bpe_dropout_resegments_training_sources_only(tmp_path: Path) -> None:
    files = {"source": "parallel", "data_dir": _text_files(tmp_path / "text")}
    model, dm = _sources_seen(tmp_path, bpe_dropout=0.3, **files)
    seen, tok = model.sources, dm.src_tokenizer
    plain = {(stage, epoch, i): tok.encode(dm.sources(dm.splits[stage])[i]) for stage, epoch, i in seen}
    train = [key for key in seen if key[0] == "train"]
    assert len(train) == 2 * 400
    cut = [key for key in train if len(seen[key]) == dm.max_len]  # more pieces: some exceed max_len
    assert all(seen[key][-1] == dm.eos_id for key in cut) and len(cut) < 100
    kept = [key for key in train if key not in cut]
    assert all(tok.decode(seen[key]) == dm.sources("train")[key[2]] for key in kept)  # same text
    assert sum(seen[key] != plain[key] for key in train) > 100  # in other pieces
    assert sum(seen["train", 0, i] != seen["train", 1, i] for i in range(400)) > 50  # redrawn each epoch
    assert all(seen[key] == plain[key] for key in seen if key[0] == "val")  # evaluation: plain BPE
    # Packed by the re-segmented lengths: the token budget holds, with little padding.
    assert max(model.batch_sizes) <= dm.max_tokens
    assert sum(model.batch_sizes) < 1.1 * sum(len(seen[key]) for key in train)
    # Drawn per (seed, epoch, example): the same seed with other batches gives the same segmentations...
    smaller_batches = _sources_seen(tmp_path, bpe_dropout=0.3, max_tokens=200, **files)[0].sources
    assert all(smaller_batches[key] == seen[key] for key in train)
    # ...another seed, on the same text with the same tokenizer, other ones (for most examples).
    other_model, other_dm = _sources_seen(tmp_path, bpe_dropout=0.3, seed=1, **files)
    assert other_dm.sources("train") == dm.sources("train")
    assert other_dm.src_tokenizer.to_json() == tok.to_json()
    assert other_model.seen != model.seen  # the seed also reorders the batches; compared by example id:
    assert sum(other_model.sources[key] != seen[key] for key in train) > 100
    without = _sources_seen(tmp_path, **files)[0].sources
    assert all(without[key] == plain[key] for key in train)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_resume_with_bpe_dropout_continues_exactly(tmp_path: Path) -> None:
    """Epoch 1 is packed by its own re-segmented lengths; a restart in it rebuilds the same batches and
    feeds every example in the same segmentation as the uninterrupted run."""
    cache = tmp_path / "cache"
    straight = _SourceRecorder(150)
    full = _fit(tmp_path / "full", cache, bpe_dropout=0.2, model=straight)
    per_epoch = next(
        n for n in range(1, len(full)) if sorted(i for b in full[:n] for i in b) == list(range(400))
    )
    step = per_epoch + 5 - per_epoch % 5  # the first checkpoint inside epoch 1
    restarted = _SourceRecorder(150)
    ckpt = tmp_path / "full" / f"step={step}.ckpt"
    resumed = _fit(tmp_path / "resumed", cache, ckpt, bpe_dropout=0.2, model=restarted)
    assert resumed == full[step:]
    # The token ids of every example trained on after the restart: epoch 1's segmentation of it.
    rest = {("train", 1, i) for batch in full[step:] for i in batch}
    trained = {key: ids for key, ids in restarted.sources.items() if key[0] == "train"}
    assert set(trained) == rest
    assert all(trained[key] == straight.sources[key] for key in rest)
    # ...which is not epoch 0's (a resumed run that re-drew from epoch 0 would fail the line above)
    assert any(trained[key] != straight.sources["train", 0, key[2]] for key in rest)

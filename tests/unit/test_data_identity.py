"""What the model is fed did not change with the prepared-data cache: the same tokenizers, ids and batches as
before it (digests pinned on commit 859cf18 by tests/helpers/data_digest.py), with or without the cache, cold
or warm; the vectorized batch packing equals the per-example greedy loop; tokenizer training samples."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data import prepare
from data.batching import TokenBudgetBatchSampler
from data.datamodules import TokenBudgetDataModule, TranslationDataModule
from data.synthetic import make_synthetic_splits
from data.tokenization import CorpusEncoder, normalizers, train_bpe
from tests.helpers.data_digest import digest, fixture_datamodules

# python -c "from tests.helpers.data_digest import main; main()" on 859cf18 (see tests/helpers/data_digest.py)
GOLDEN = {
    "parallel": {
        "test": "c4110429bfeea879",
        "tokenizer": "178986070660dfd8",
        "train": "6ec06d8510679552",
        "train_epoch0": "2bd1e449fe18bc8c",
        "train_epoch1": "94aba3d97b2e2410",
        "val": "de899590e2f3ba7d",
        "val_batches": "a269ce4d4b642114",
    },
    "pool": {
        "test": "c4110429bfeea879",
        "tokenizer": "178986070660dfd8",
        "train": "6ec06d8510679552",
        "train_epoch0": "fad6e59c9be99156",
        "train_epoch1": "2aa66677f39b4cce",
        "val": "de899590e2f3ba7d",
        "val_batches": "a269ce4d4b642114",
    },
    "synthetic": {
        "test": "dc99e14fc0e13020",
        "tokenizer": "ca6dcbe191d87c4c",
        "train": "0e35861baf4544f4",
        "train_epoch0": "04668339fd6cae2f",
        "train_epoch1": "c485dfbc1fbc7774",
        "val": "d18488bd6d113010",
        "val_batches": "2e12799c4ed57f3a",
    },
    "tsv": {
        "test": "7520f4a52e27b8fb",
        "tokenizer": "decd841c43cf7ac9",
        "train": "d8f3725b91ab3f17",
        "train_epoch0": "500a6f1da8d3a552",
        "train_epoch1": "edcb306a451d54a0",
        "val": "7520f4a52e27b8fb",
        "val_batches": "1ea09cc3ae139f14",
    },
}


@pytest.mark.parametrize("cache", ["none", "cold", "warm"])
def test_same_ids_and_batches_as_before_the_cache(tmp_path: Path, cache: str) -> None:
    cache_dir = None if cache == "none" else tmp_path / "cache"
    if cache == "warm":
        for dm in fixture_datamodules(tmp_path / "data", cache_dir).values():
            dm.prepare_data()
            dm.setup(None)
    modules = fixture_datamodules(tmp_path / "data", cache_dir)  # same files, same mtimes: hits when warm
    assert {name: digest(dm) for name, dm in modules.items()} == GOLDEN


def test_same_when_tokenized_in_several_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small chunks, three forked workers: the shards are concatenated in row order."""
    monkeypatch.setattr(prepare, "CHUNK_ROWS", 64)
    monkeypatch.setattr(TokenBudgetDataModule, "_tokenizing_workers", lambda self: 3)
    modules = fixture_datamodules(tmp_path / "data", tmp_path / "cache")
    assert {name: digest(dm) for name, dm in modules.items()} == GOLDEN
    entry = next((tmp_path / "cache" / "tokenized").glob("multi30k-*-train-*"))
    assert len(list(entry.glob("*.arrow"))) == 3


def _greedy_reference(order: list[int], lengths: list[int], max_tokens: int, cap: float) -> list[list[int]]:
    """The per-example packing loop as it was before it was vectorized."""
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for index in order:
        length = lengths[index]
        if batch and ((len(batch) + 1) * max(longest, length) > max_tokens or len(batch) >= cap):
            batches.append(batch)
            batch, longest = [], 0
        batch.append(index)
        longest = max(longest, length)
    batches.append(batch)
    return batches


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=300),
    max_tokens=st.integers(60, 400),
    pool_size=st.one_of(st.none(), st.integers(1, 50)),
    max_sentences=st.one_of(st.none(), st.integers(1, 12)),
    seed=st.integers(0, 3),
)
def test_vectorized_packing_equals_the_greedy_loop(
    lengths: list[int], max_tokens: int, pool_size: int | None, max_sentences: int | None, seed: int
) -> None:
    sampler = TokenBudgetBatchSampler(
        lengths, max_tokens, seed=seed, pool_size=pool_size, max_sentences=max_sentences
    )
    for shuffle in (True, False):
        sampler.shuffle = shuffle
        sampler._cache = None
        rng = np.random.default_rng([seed, 0])
        if shuffle:
            order = rng.permutation(len(lengths))
            pool = pool_size or len(order)
            array = np.asarray(lengths)
            pools = [order[i : i + pool] for i in range(0, len(order), pool)]
            order = np.concatenate([p[np.argsort(array[p], kind="stable")] for p in pools])
        else:
            order = np.argsort(lengths, kind="stable")
        expected = _greedy_reference(order.tolist(), lengths, max_tokens, max_sentences or float("inf"))
        if shuffle:
            expected = [expected[i] for i in rng.permutation(len(expected))]
        assert list(sampler.batches(0)) == expected


def test_batch_list_of_millions_is_a_few_arrays() -> None:
    lengths = np.random.default_rng(0).integers(3, 120, size=2_000_000)
    sampler = TokenBudgetBatchSampler(lengths, 4096, seed=1, num_replicas=2, rank=1)
    batches = sampler.batches()
    assert batches.order.nbytes == 8 * len(lengths)  # one index array, not a list per batch
    assert sum(len(batches[i]) for i in range(0, len(batches), 97)) > 0
    assert max(len(b) * lengths[b].max() for b in (batches[i] for i in range(0, len(batches), 997))) <= 4096


def test_tokenizer_sample_is_seeded_and_in_split_order(tmp_path: Path) -> None:
    dm = TranslationDataModule(synthetic_sizes={"train": 500, "val": 20, "test": 20}, show_progress=False)
    raw = dm.raw_split("train")
    everything, count = prepare.tokenizer_texts(raw, ["src", "tgt"], None)
    texts = [text for batch in everything for text in batch]
    assert count == 1000 and texts == raw["src"][:] + raw["tgt"][:]  # as the vocabulary was always trained
    first, count = prepare.tokenizer_texts(raw, ["src", "tgt"], 100)
    again, _ = prepare.tokenizer_texts(raw, ["src", "tgt"], 100)
    sample = [text for batch in first for text in batch]
    assert count == 200 and sample == [text for batch in again for text in batch]
    rows = np.sort(np.random.default_rng(prepare.SAMPLE_SEED).choice(500, size=100, replace=False))
    assert sample == [raw["src"][int(i)] for i in rows] + [raw["tgt"][int(i)] for i in rows]
    sampled = TranslationDataModule(
        synthetic_sizes={"train": 500, "val": 20, "test": 20},
        show_progress=False,
        vocab_size=120,
        tokenizer_sample_size=100,
    )
    sampled.prepare_data()
    sampled.setup("fit")
    full = TranslationDataModule(synthetic_sizes={"train": 500, "val": 20, "test": 20}, show_progress=False)
    full.setup("fit")
    assert sampled.src_tokenizer.to_json() != full.src_tokenizer.to_json()
    with pytest.raises(ValueError, match="tokenizer_sample_size must be >= 1 or null, got 0"):
        TranslationDataModule(tokenizer_sample_size=0)


# spaces of all kinds, characters NFKC rewrites (some into a space, "´" into space + accent), combining
# marks, the metaspace "▁" itself, special tokens, punctuation, emoji, Hangul jamo, zero-width space
_PIECES = [
    "a", "b", "Hund", "dog", "zwei", " ", "  ", "\u00a0", "´", "\u0301", "é", "e\u0301", "▁", "<s>",
    "</s>", "<", "<pad>", ".", ",", "!", "¿", "'", "-", "\t", "\n", "\u2003", "ﬁ", "①", "Ⅻ", "ǅ",
    "\u1100\u1161", "😀", "1", "\u200b", "x",
]  # fmt: skip
_TEXTS = st.lists(st.sampled_from(_PIECES), max_size=14).map("".join)


@pytest.fixture(scope="module")
def tokenizer() -> object:
    english, german = make_synthetic_splits(0, {"train": 300})["train"]
    return train_bpe([*english, *german, *(p * 3 for p in _PIECES)], 200)


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(_TEXTS, min_size=1, max_size=40), max_chunks=st.sampled_from([0, 5, 1_000_000]))
def test_corpus_encoder_equals_the_tokenizer(tokenizer: object, texts: list[str], max_chunks: int) -> None:
    encoder = CorpusEncoder(tokenizer, max_chunks=max_chunks)
    assert encoder.encode_batch(texts) == tokenizer.encode_batch(texts)
    assert encoder.encode_batch(texts[::-1]) == tokenizer.encode_batch(texts[::-1])  # with chunks known
    assert len(encoder._chunks) <= max_chunks


def test_corpus_encoder_leaves_other_pipelines_to_the_tokenizer(tokenizer: object) -> None:
    other = type(tokenizer).from_json(tokenizer.to_json())
    other.tokenizer.normalizer = normalizers.Lowercase()
    encoder = CorpusEncoder(other)
    texts = ["Zwei Hunde .", "two DOGS"]
    assert encoder.encode_batch(texts) == other.encode_batch(texts) != tokenizer.encode_batch(texts)
    assert not encoder._chunks

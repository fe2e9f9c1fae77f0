"""Several pairs in one translation datamodule (`data.pairs`, docs/multilingual.md): each pair's splits
loaded from its source, cleaned with its own languages' filters, labelled with its target language's label
when the model has more than one, and concatenated with a "pair" column; training batches drawn over the
pairs with temperature sampling (`data.pairs.PairSampledBatchSampler`)."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from data import prepare, sources
from data.clean import CleanSettings, clean_split
from data.labels import (
    DEFAULT_FORMAT,
    LABELS_KEY,
    POSITIONS,
    LanguageLabels,
    check_format,
    check_position,
)
from data.pairs import (
    Pair,
    PairSampledBatchSampler,
    check_temperature,
    pair_counts,
    parse_pairs,
    temperature_probabilities,
)

log = logging.getLogger(__name__)

PAIR_COLUMN = "pair"  # the index of an example's pair in `data.pairs`, kept through tokenizing
_SOURCE_FILES = {"multi30k": sources.MULTI30K_LAYOUT, "parallel": "{split}.{lang}"}


class PairsMixin:
    """What `TranslationDataModule` does with `pairs` (None: one pair, `src_lang` -> `tgt_lang`, as always).

    Labels: the target language's label (`labels.format`, default OPUS-MT's `>>{lang}<<`) is put before
    (`labels.position`: start) or after (end) every source when the pairs have more than one target
    language, and is a special token of the tokenizer (one joint BPE over every language keeps it whole).
    A many-to-one model gets no labels.
    """

    # set by the datamodule's constructor (`_take_pairs`)
    pairs: list[Pair] | None = None
    language_labels: LanguageLabels | None = None
    sampling_temperature: float = 1.0
    _pair_clean: list[CleanSettings] | None = None

    def _take_pairs(
        self,
        pairs: Sequence[Any] | None,
        labels: Mapping[str, Any] | None,
        sampling_temperature: Any,
        clean: Mapping[str, Any] | None,
        extra_train: Sequence[Any] | None,
    ) -> None:
        """Check and keep the multilingual settings (ValueError naming the key at fault)."""
        self.sampling_temperature = check_temperature(sampling_temperature)
        label_format, position = DEFAULT_FORMAT, "start"
        if labels is not None:
            unknown = sorted(set(labels) - {"format", "position"})
            if unknown:
                raise ValueError(
                    f"data.labels takes format (e.g. '>>{{lang}}<<') and position "
                    f"({' or '.join(POSITIONS)}), not {unknown}"
                )
            if labels.get("format") is not None:  # null: the default
                label_format = str(labels["format"])
            if labels.get("position") is not None:
                position = labels["position"]
        try:  # both checked with one pair too: a value that cannot work is refused wherever it is set
            check_position(position)
        except ValueError as err:
            raise ValueError(f"data.labels.position: {err}") from None
        try:
            check_format(label_format)
        except ValueError as err:
            raise ValueError(f"data.labels.format: {err} (e.g. '>>{{lang}}<<')") from None
        if pairs is None:
            return
        self.pairs = parse_pairs(pairs)
        for i, pair in enumerate(self.pairs):
            if (pair.source or self.source) == "synthetic":
                raise ValueError(
                    f"data.pairs[{i}] ({pair.name}): the synthetic task is English -> German only; pairs "
                    "take source numbers (the multilingual number task), multi30k, parallel or hub"
                )
        if extra_train:
            raise ValueError(
                "data.extra_train is not supported with data.pairs (its pairs have no direction)"
            )
        targets = {pair.tgt for pair in self.pairs}
        if len(targets) > 1:  # the format was checked above; the codes by parse_pairs
            self.language_labels = LanguageLabels.for_languages(targets, label_format, position)
        if clean is not None:
            self._pair_clean = [CleanSettings(clean, pair.src, pair.tgt) for pair in self.pairs]

    def adopt_labels(self, state: Mapping[str, Any] | None) -> None:
        """Take the target-language labels a model was trained with (a checkpoint's `LABELS_KEY` state, None:
        a model without labels): the run's sources then carry them, also with one pair (fine-tuning a
        multilingual model on one direction keeps its label). ValueError naming the key when the run's
        pairs or labels cannot follow them: a target language without a label, another spelling or
        position, or labels the model's tokenizer has no tokens for."""
        saved = LanguageLabels.from_state(state)
        targets = sorted({pair.tgt for pair in self.pairs} if self.pairs else {self.tgt_lang})
        if saved is None:
            if self.language_labels is not None:
                raise ValueError(
                    f"data.pairs: these pairs label their sources by target language "
                    f"({', '.join(self.language_labels.tokens)}), but the model was trained without labels "
                    "(its tokenizer has no such tokens): fine-tune it on one target language"
                )
            return
        missing = [lang for lang in targets if lang not in saved.labels]
        if missing:
            raise ValueError(
                f"data.pairs: the model has no label for target language {', '.join(missing)}; it knows "
                f"{', '.join(saved.languages)} (name each pair's target by the model's code)"
            )
        ours = self.language_labels
        if ours is not None and (
            ours.position != saved.position
            or any(ours.labels[lang] != saved.labels[lang] for lang in ours.labels)
        ):
            raise ValueError(
                f"data.labels: the run spells or places its labels as {ours.tokens[0]!r} at the "
                f"{ours.position}, the model as {saved.labels[ours.languages[0]]!r} at the {saved.position}: "
                "set data.labels.format and data.labels.position to the model's"
            )
        if self.pairs is None:
            raise ValueError(
                f"data.pairs: the model is multilingual (labels {', '.join(saved.tokens)}); name the run's "
                f"direction as data.pairs=[{self.src_lang}-{self.tgt_lang}] so that its sources carry their "
                "label"
            )
        self.language_labels = saved

    @property
    def multilingual(self) -> bool:
        """Whether the splits hold more than one direction (scored per direction)."""
        return self.pairs is not None and len(self.pairs) > 1

    def directions(self, split: str) -> list[str] | None:
        """The direction ("en-de") of each example of `split` by id; None for a single pair."""
        if not self.multilingual:
            return None
        assert self.pairs is not None
        names = [pair.name for pair in self.pairs]
        return [names[i] for i in self.raw_split(split)[PAIR_COLUMN]]

    def _first_rows(self, raw: datasets.Dataset, n: int) -> list[int]:
        """`keep_first`'s rows of a split with several directions: the first `n` of each, in split order
        (the split is the pairs' splits one after another: the first n rows would be one direction's)."""
        if not self.multilingual:
            return super()._first_rows(raw, n)  # type: ignore[misc]
        taken: dict[int, int] = {}
        rows = []
        for row, pair in enumerate(int_column(raw, PAIR_COLUMN).tolist()):
            if taken.get(pair, 0) < n:
                taken[pair] = taken.get(pair, 0) + 1
                rows.append(row)
        return rows

    # -- raw splits --------------------------------------------------------------------------------
    def _load_pairs(self, splits: Sequence[str]) -> datasets.DatasetDict:
        """Every pair's `splits`, each (train: cleaned) and labelled, concatenated with the "pair" column."""
        assert self.pairs is not None
        parts: dict[str, list[datasets.Dataset]] = {split: [] for split in splits}
        for index, pair in enumerate(self.pairs):
            try:
                loaded = self._load_pair(pair, splits)
            except sources.DataError as err:
                raise sources.DataError(f"data.pairs[{index}] ({pair.name}): {err}") from None
            for split in splits:
                raw = loaded[split]
                if split == self.splits["train"] and self._pair_clean is not None:
                    raw = self._clean_pair(raw, index)
                parts[split].append(self._labelled(raw, index))
        return datasets.DatasetDict(
            {split: datasets.concatenate_datasets(found) for split, found in parts.items()}
        )

    def _load_pair(self, pair: Pair, splits: Sequence[str]) -> datasets.DatasetDict:
        source = pair.source or self.source
        data_dir = pair.data_dir or self.data_dir
        if source == "numbers":
            return sources.load_numbers(
                splits, pair.src, pair.tgt, seed=self.seed, sizes=self.synthetic_sizes
            )
        if source == "multi30k":
            return sources.load_multi30k(data_dir, splits, pair.src, pair.tgt)
        if source == "parallel":
            if data_dir is None:
                raise sources.DataError(
                    "source parallel needs data_dir (a directory of {split}.{lang}[.gz] files)"
                )
            return sources.load_parallel_dir(data_dir, splits, pair.src, pair.tgt, "{split}.{lang}")
        hub_name = pair.hub_name or self.hub_name
        if not hub_name:
            raise sources.DataError("source hub needs hub_name (a dataset on the HuggingFace hub)")
        return sources.load_translation_hub(
            hub_name, splits, pair.src, pair.tgt, pair.hub_config or self.hub_config, self.hub_split_names
        )

    def _labelled(self, raw: datasets.Dataset, index: int) -> datasets.Dataset:
        """`raw` with its pair index (multilingual: the target label before each source)."""
        assert self.pairs is not None
        labels, tgt = self.language_labels, self.pairs[index].tgt

        def add(batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
            srcs = batch["src"] if labels is None else [labels.labelled(text, tgt) for text in batch["src"]]
            return {"src": srcs, PAIR_COLUMN: [index] * len(srcs)}

        # a map (not a new Arrow file) keeps the fingerprint a function of the data: generated and hub
        # pairs find their cache entries again; its progress bar would print one line per pair and split
        hidden = datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()
        try:
            return raw.map(add, batched=True, load_from_cache_file=False)
        finally:
            if not hidden:
                datasets.enable_progress_bars()

    def _clean_pair(self, raw: datasets.Dataset, index: int) -> datasets.Dataset:
        """The pair's training split through its `data.clean` filters (its own languages); the tokenized
        split, whose cache key holds the filters' settings, is what later runs reuse."""
        assert self.pairs is not None and self._pair_clean is not None
        pair = self.pairs[index]
        directory = Path(tempfile.mkdtemp(dir=datasets.fingerprint.get_temporary_cache_files_directory()))
        cleaned, report = clean_split(
            raw, self._pair_clean[index], directory, f"data.pairs[{index}] ({pair.name})"
        )
        log.info("Cleaned %s of %s (data.clean): %s", self.splits["train"], pair.name, report.summary())
        return cleaned

    def _pair_files(self, split: str) -> list[Path] | None:
        """Every pair's local files of `split`, or None when a pair is generated or from the hub."""
        assert self.pairs is not None
        files: list[Path] = []
        for index, pair in enumerate(self.pairs):
            source = pair.source or self.source
            data_dir = pair.data_dir or self.data_dir
            if source not in _SOURCE_FILES or data_dir is None:
                return None
            try:
                files += sources.parallel_files(data_dir, split, pair.src, pair.tgt, _SOURCE_FILES[source])
            except sources.DataError as err:
                raise sources.DataError(f"data.pairs[{index}] ({pair.name}): {err}") from None
        return files

    def _pair_settings(self) -> dict[str, Any]:
        """The cache keys' part for the pairs: each pair, the labels and the cleaning filters."""
        assert self.pairs is not None
        return {
            "source": self.source,
            "pairs": [pair.key() for pair in self.pairs],
            "labels": None if self.language_labels is None else self.language_labels.to_state(),
            "clean": None if self._pair_clean is None else [c.key() for c in self._pair_clean],
            **({"synthetic_sizes": self.synthetic_sizes} if self.synthetic_sizes else {}),
        }

    # -- training batches ----------------------------------------------------------------------------
    def _pair_sampler(
        self, dataset: datasets.Dataset, lengths: np.ndarray, **settings: Any
    ) -> PairSampledBatchSampler:
        """The training sampler over the pairs of the tokenized training split, logged once per build."""
        assert self.pairs is not None
        pair_of = int_column(dataset, PAIR_COLUMN)
        counts = pair_counts(pair_of, len(self.pairs))
        probabilities = temperature_probabilities(counts, self.sampling_temperature)
        log.info(
            "Drawing training batches over %d pairs (sampling_temperature=%s): %s",
            len(self.pairs),
            self.sampling_temperature,
            ", ".join(
                f"{p.name} {n} examples p={q:.3f}" for p, n, q in zip(self.pairs, counts, probabilities)
            ),
        )
        return PairSampledBatchSampler(lengths, pair_of, probabilities, self.max_tokens, **settings)

    def _pair_state(self) -> dict[str, Any]:
        """What a checkpoint records of the pairs: their directions and (multilingual) the labels."""
        if self.pairs is None:
            return {}
        state: dict[str, Any] = {"pairs": [pair.name for pair in self.pairs]}
        if self.language_labels is not None:
            state[LABELS_KEY] = self.language_labels.to_state()
        return state


def int_column(dataset: datasets.Dataset, column: str) -> np.ndarray:
    """An integer column of a memory-mapped split as one array (no Python int per row)."""
    return prepare.length_array(dataset, column).astype(np.int64)

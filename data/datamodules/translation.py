"""Translation: parallel text (synthetic task, Multi30k, `{split}.{lang}` files or the hub) -> batches of
source and target token ids, with the raw sentences and references by example id."""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import datasets
import numpy as np

from data import cache, sources, synthetic
from data.batching import TokenBudgetBatchSampler, TranslationCollator
from data.clean import REPORT_FILE, CleanSettings, clean_split, summary_line
from data.datamodules.base import TokenBudgetDataModule
from data.datamodules.pairs import PairsMixin
from data.labels import LABELS_KEY
from data.tokenization import BPETokenizer, CorpusEncoder

log = logging.getLogger(__name__)


class TranslationDataModule(PairsMixin, TokenBudgetDataModule):
    """Parallel text -> batches of src, src_padding_mask, tgt_in, tgt_out, tgt_padding_mask, id.

    source: "synthetic" (built-in task, splits train/val/test), "multi30k" (`data_dir` in the official
    `{split}.{lang}.gz` layout, or the hub when `data_dir` is None), "parallel" (`data_dir` with
    `{split}.{lang}` files, plain or .gz) or "hub" (`hub_name`, `hub_config`, `hub_split_names`).

    `extra_train`: more training pairs, read like any local corpus: a list of {"src": FILE, "tgt": FILE,
    "tag": TOKEN or null}, line-aligned text files (distilled targets, back-translated sources); a tag is
    put before each of its sources and becomes a special token of the tokenizer (tagged
    back-translation). `train_copies`: how many times the real training pairs are used (0: only the extra
    pairs, as in distillation on the teachers' targets alone; 2: the real data upsampled twice).

    `packing`: each batch with targets also holds "packing", the kept positions and cumulative lengths of
    its source and target tokens computed here, on the host (`TranslationCollator`), so that the model's
    packed path (no pad tokens; torch's variable-length attention on CUDA) reads nothing back from the GPU.

    `clean`: the parallel-data filters (`data.clean`, docs/data.md#cleaning), a mapping of filter name ->
    settings, or None for none. They run once on the real training split (not `extra_train`, not val or
    test), before the tokenizer learns from it; the cleaned split is a prepared-data cache entry whose key
    holds the filters' settings, with `clean_report.json` beside its Arrow file.

    `pairs` (docs/multilingual.md): None for one pair (`src_lang` -> `tgt_lang`), or several, e.g.
    ["en-de", "en-fr"] or mappings {src, tgt, source, data_dir, hub_name, hub_config} for a pair from its
    own source; one joint tokenizer over every language; the target's label (`labels.format`) before each
    source when there is more than one target language; training batches drawn over the pairs with
    probability proportional to n_i^(1/`sampling_temperature`); validation and test scored per direction
    (`directions`). `source: numbers` is the built-in multilingual task (`data.synthetic_numbers`).
    """

    _text_columns = ("src", "tgt")
    _id_columns = ("src_ids", "tgt_ids")

    def __init__(
        self,
        source: Literal["synthetic", "numbers", "multi30k", "parallel", "hub"] = "synthetic",
        data_dir: str | Path | None = None,
        src_lang: str = "en",
        tgt_lang: str = "de",
        hub_name: str | None = None,
        hub_config: str | None = None,
        hub_split_names: Mapping[str, str] | None = None,
        synthetic_sizes: Mapping[str, int] | None = None,
        joint_vocab: bool = True,
        extra_train: Sequence[Mapping[str, Any]] | None = None,
        train_copies: int = 1,
        packing: bool = False,
        clean: Mapping[str, Any] | None = None,
        pairs: Sequence[Any] | None = None,
        labels: Mapping[str, Any] | None = None,
        sampling_temperature: float | str = 1.0,
        **settings: Any,
    ) -> None:
        super().__init__(
            **settings
        )  # the shared settings (`TokenizedSettings`), checked and kept by the base
        if source not in ("synthetic", "numbers", "multi30k", "parallel", "hub"):
            raise ValueError(f"source must be synthetic, numbers, multi30k, parallel or hub, got {source!r}")
        if source == "hub" and not hub_name and pairs is None:
            raise ValueError("source='hub' needs hub_name (a dataset on the HuggingFace hub)")
        if src_lang == tgt_lang:
            raise ValueError(f"src_lang and tgt_lang must differ, both are {src_lang!r}")
        for split, size in (synthetic_sizes or {}).items():
            if size < 1:
                raise ValueError(f"synthetic_sizes.{split} must be >= 1, got {size}")
        self.source, self.data_dir = source, data_dir
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.hub_name, self.hub_config = hub_name, hub_config
        self.hub_split_names = dict(hub_split_names or {})
        self.synthetic_sizes = None if synthetic_sizes is None else dict(synthetic_sizes)
        self.joint_vocab = joint_vocab
        self.extra_train = [_extra_pair(pair, i) for i, pair in enumerate(extra_train or [])]
        if isinstance(train_copies, bool) or not isinstance(train_copies, int) or train_copies < 0:
            raise ValueError(f"train_copies must be an integer >= 0, got {train_copies!r}")
        if train_copies == 0 and not self.extra_train:
            raise ValueError("train_copies=0 leaves no training pairs: it needs extra_train")
        self.train_copies = train_copies
        if not isinstance(packing, bool):
            raise ValueError(f"packing must be true or false, got {packing!r}")
        self.packing = packing
        self._take_pairs(pairs, labels, sampling_temperature, clean, extra_train)  # PairsMixin
        # several pairs: each is cleaned with its own languages' filters (`_pair_clean`)
        self.clean = None if clean is None or pairs is not None else CleanSettings(clean, src_lang, tgt_lang)
        self._clean_summary: dict[str, str] | None = None  # the cleaned split's report line and file
        self._clean_logged = False

    def _load_raw(self, splits: Sequence[str]) -> datasets.DatasetDict:
        loaded = self._load_real(splits)
        train = self.splits["train"]
        if train in loaded and self.clean is not None:
            loaded[train] = self._cleaned(loaded[train])
        if train in loaded and (self.extra_train or self.train_copies != 1):
            parts = [loaded[train]] * self.train_copies
            parts += [sources.load_parallel(p["src"], p["tgt"], p["tag"]) for p in self.extra_train]
            loaded[train] = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        return loaded

    def _load_real(self, splits: Sequence[str]) -> datasets.DatasetDict:
        """The corpus's own splits (the training split without `extra_train` and `train_copies`)."""
        if self.pairs is not None:
            return self._load_pairs(splits)
        if self.source == "numbers":
            return sources.load_numbers(
                splits, self.src_lang, self.tgt_lang, seed=self.seed, sizes=self.synthetic_sizes
            )
        if self.source == "synthetic":
            # Generating one split draws the others too (they are disjoint): keep them all.
            everything = list(dict.fromkeys([*splits, *(self.synthetic_sizes or synthetic.DEFAULT_SIZES)]))
            return sources.load_synthetic(everything, seed=self.seed, sizes=self.synthetic_sizes)
        if self.source == "multi30k":
            return sources.load_multi30k(self.data_dir, splits, self.src_lang, self.tgt_lang)
        if self.source == "parallel":
            if self.data_dir is None:  # checked here, not at construction: translating text reads no split
                raise sources.DataError(
                    "source='parallel' needs data.data_dir (a directory of {split}.{lang}[.gz] files)"
                )
            return sources.load_parallel_dir(
                self.data_dir, splits, self.src_lang, self.tgt_lang, "{split}.{lang}"
            )
        return sources.load_translation_hub(
            self.hub_name, splits, self.src_lang, self.tgt_lang, self.hub_config, self.hub_split_names
        )

    def _tokenizer_columns(self) -> dict[str, list[str]]:
        # joint: every source, then every target, as the vocabulary has always been trained
        return {"joint": ["src", "tgt"]} if self.joint_vocab else {"src": ["src"], "tgt": ["tgt"]}

    def _files(self, split: str) -> list[Path] | None:
        if self.pairs is not None:
            return self._pair_files(split)
        if self.source == "multi30k" and self.data_dir is not None:
            layout = sources.MULTI30K_LAYOUT
        elif self.source == "parallel":
            layout = "{split}.{lang}"
        else:
            return None
        return list(sources.parallel_files(self.data_dir, split, self.src_lang, self.tgt_lang, layout))

    def _settings(self) -> dict[str, Any]:
        if self.pairs is not None:
            return self._pair_settings()
        if self.source == "numbers":
            return {
                "source": self.source,
                "src_lang": self.src_lang,
                "tgt_lang": self.tgt_lang,
                "sizes": self.synthetic_sizes,
            }
        return {"source": self.source, "src_lang": self.src_lang, "tgt_lang": self.tgt_lang}

    def _special_tokens(self) -> tuple[str, ...]:
        labels = self.language_labels.tokens if self.language_labels is not None else []
        return tuple(dict.fromkeys([*labels, *(p["tag"] for p in self.extra_train if p["tag"])]))

    def _identity(self, split: str) -> dict[str, Any]:
        """The training split's identity also holds the cleaning filters' settings."""
        identity = self._uncleaned_identity(split)
        if split == self.splits["train"] and self.clean is not None:
            identity["clean"] = self.clean.key()
        return identity

    def _uncleaned_identity(self, split: str) -> dict[str, Any]:
        """The training split's identity also names its extra pairs' files and how often the real pairs
        come (the real part: its files, or the fingerprint of the generated / hub split alone)."""
        if split != self.splits["train"] or not (self.extra_train or self.train_copies != 1):
            return super()._identity(split)
        files = self._files(split)
        real = (
            {"files": [cache.file_identity(path) for path in files]}
            if files is not None
            else {"fingerprint": self._load_real([split])[split]._fingerprint}
        )
        extra = [
            {"src": cache.file_identity(p["src"]), "tgt": cache.file_identity(p["tgt"]), "tag": p["tag"]}
            for p in self.extra_train
        ]
        return {**real, "extra_train": extra, "train_copies": self.train_copies}

    # -- cleaning ------------------------------------------------------------------------------------
    def _cleaned(self, raw: datasets.Dataset) -> datasets.Dataset:
        """The real training split through the `clean` filters: from the cache when a run already
        cleaned the same data with the same settings, else cleaned (and cached with its report)."""
        assert self.clean is not None
        train = self.splits["train"]
        files = self._files(train)
        origin = " / ".join(map(str, files)) if files else f"{self.source} split {train!r}"
        if self.cache_dir is None:
            directory = Path(tempfile.mkdtemp(dir=datasets.fingerprint.get_temporary_cache_files_directory()))
            dataset, report = clean_split(raw, self.clean, directory, origin)
            summary = {"line": report.summary(), "report": str(directory / REPORT_FILE)}
        else:
            name, key = self._cleaned_entry(
                {"files": [cache.file_identity(p) for p in files]}
                if files
                else {"fingerprint": raw._fingerprint}
            )
            report_path = self.cache_dir / "cleaned" / f"{name}-{key[:16]}" / REPORT_FILE

            def build(directory: Path) -> tuple[datasets.Dataset, dict[str, Any]]:
                dataset, report = clean_split(raw, self.clean, directory, origin)
                return dataset, {"line": report.summary(), "report": str(report_path)}

            dataset, summary = cache.load_or_build(self.cache_dir / "cleaned", name, key, build)
        self._clean_summary = dict(summary)
        self._log_clean()
        return dataset

    def _cleaned_entry(self, data: dict[str, Any]) -> tuple[str, str]:
        """The name and key of the cleaned training split's cache entry, for raw data identified by `data`."""
        assert self.clean is not None
        key = cache.cache_key(
            {"kind": "cleaned", "data": data, "settings": self._settings(), "clean": self.clean.key()}
        )
        return f"{self._cache_tag('joint')}-{self.splits['train']}-clean", key

    def clean_summary(self, cache_dir: str | Path | None = None) -> str | None:
        """What cleaning did to the training split, in one line with its report's path (evaluate.py's
        report), from the cache entry in `cache_dir` (default: this datamodule's; evaluate.py's has none
        and passes the training run's); None when `clean` is off or the entry is not there (hub data:
        not looked up, as that would load the corpus)."""
        if self.clean is None:
            return None
        if self._clean_summary is None:
            directory = self.cache_dir if cache_dir is None else Path(cache_dir).expanduser()
            files = self._files(self.splits["train"])
            if directory is None or not files or not all(p.is_file() for p in files):
                return None
            name, key = self._cleaned_entry({"files": [cache.file_identity(p) for p in files]})
            path = directory / "cleaned" / f"{name}-{key[:16]}" / REPORT_FILE
            if not path.is_file():
                return None
            self._clean_summary = {"line": summary_line(json.loads(path.read_text())), "report": str(path)}
        return f"{self._clean_summary['line']}; report: {self._clean_summary['report']}"

    def _log_clean(self) -> None:
        """The one line of the training log that says what cleaning removed (once per process)."""
        if self._clean_summary is not None and not self._clean_logged:
            log.info(
                "Cleaned %s (data.clean): %s; report: %s",
                self.splits["train"],
                self._clean_summary["line"],
                self._clean_summary["report"],
            )
            self._clean_logged = True

    def _tokenize(self, split: str, directory: Path) -> tuple[datasets.Dataset, dict[str, Any]]:
        dataset, meta = super()._tokenize(split, directory)
        if split == self.splits["train"] and self._clean_summary is not None:
            meta["clean"] = self._clean_summary  # logged again by runs that find the entry cached
        return dataset, meta

    def _restore_meta(self, meta: Mapping[str, Any]) -> None:
        if "clean" in meta and self.clean is not None:
            self._clean_summary = dict(meta["clean"])
            self._log_clean()

    def _cache_tag(self, side: str) -> str:
        langs = (
            "+".join(pair.name for pair in self.pairs)
            if self.pairs is not None
            else f"{self.src_lang}-{self.tgt_lang}"
            if side == "joint"
            else (self.src_lang, self.tgt_lang)[side == "tgt"]
        )
        return f"{self.source}-{langs}-v{self.vocab_size_requested}"

    def _encode(
        self, batch: Mapping[str, list[Any]], encoders: Mapping[str, CorpusEncoder]
    ) -> dict[str, list[Any]]:
        return {
            "src_ids": encoders["src"].encode_batch(batch["src"]),
            "tgt_ids": encoders["tgt"].encode_batch(batch["tgt"]),
        }

    def _length(self, lengths: Mapping[str, np.ndarray]) -> np.ndarray:
        # tgt_in / tgt_out are one shorter than tgt_ids; the budget bounds both padded tensors.
        return np.maximum(lengths["src_len"], lengths["tgt_len"] - 1)

    def _collator(self) -> TranslationCollator:
        return TranslationCollator(self.pad_id, packing=self.packing)

    def _train_batch_sampler(self, dataset: datasets.Dataset, **settings: Any) -> TokenBudgetBatchSampler:
        if not self.multilingual:
            return super()._train_batch_sampler(dataset, **settings)
        return self._pair_sampler(dataset, self._lengths(dataset), **settings)  # PairsMixin

    def state_dict(self) -> dict[str, Any]:
        """The base's state, plus the pairs' directions and labels (`PairsMixin._pair_state`)."""
        return {**super().state_dict(), **self._pair_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The base's (the tokenizers), and the labels the model was trained with, which the run's pairs
        must agree with and its sources keep (`PairsMixin.adopt_labels`; ValueError naming the key)."""
        self.adopt_labels(state_dict.get(LABELS_KEY))
        super().load_state_dict(state_dict)

    @property
    def tgt_tokenizer(self) -> BPETokenizer:
        return self._tokenizer("tgt")

    @property
    def src_vocab_size(self) -> int:
        return self.src_tokenizer.vocab_size

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt_tokenizer.vocab_size

    def sources(self, split: str) -> list[str]:
        """Raw source sentences of `split`, indexed by the batches' `id`."""
        return self.raw_split(split)["src"][:]

    def references(self, split: str) -> list[str]:
        """Raw target sentences of `split` (detokenized references for sacreBLEU), indexed by `id`."""
        return self.raw_split(split)["tgt"][:]


def _extra_pair(pair: Mapping[str, Any], index: int) -> dict[str, Any]:
    """One `extra_train` entry checked: {"src": path, "tgt": path, "tag": a token without spaces or None}."""
    unknown = sorted(set(pair) - {"src", "tgt", "tag"})
    if unknown or not pair.get("src") or not pair.get("tgt"):
        raise ValueError(
            f"extra_train[{index}] must be {{src: FILE, tgt: FILE, tag: TOKEN or null}}, got {dict(pair)}"
        )
    tag = pair.get("tag")
    if tag is not None and (not isinstance(tag, str) or not tag or any(c.isspace() for c in tag)):
        raise ValueError(f"extra_train[{index}].tag must be one word (e.g. <bt>) or null, got {tag!r}")
    return {"src": str(pair["src"]), "tgt": str(pair["tgt"]), "tag": tag}

"""Classification: labelled text (SST-2, TSV/CSV/JSONL files or the hub) -> batches of token ids and labels,
with the class names kept in the prepared-data cache and the checkpoint."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import datasets
import numpy as np

from data import sources
from data.batching import ClassificationCollator
from data.datamodules.base import TokenBudgetDataModule
from data.tokenization import BPETokenizer, CorpusEncoder


class ClassificationDataModule(TokenBudgetDataModule):
    """Labelled text -> batches of src, src_padding_mask, label, id.

    source: "sst2" (`data_dir` in the GLUE layout `{split}.tsv[.gz]`, or the hub when None), "files"
    (`data_dir` with files named `file_pattern`, TSV/CSV with a header or JSONL, plain or .gz) or
    "hub" (`hub_name`, `hub_config`, `hub_split_names`). Unlabeled splits (all -1) are refused for
    validation and testing but can be predicted.
    """

    _text_columns = ("text",)
    _id_columns = ("src_ids",)
    settings_defaults: ClassVar[Mapping[str, Any]] = {"val_split": "dev", "max_len": 128}  # SST-2: "dev"

    def __init__(
        self,
        source: Literal["sst2", "files", "hub"] = "sst2",
        data_dir: str | Path | None = None,
        file_pattern: str = "{split}.tsv",
        text_column: str = "sentence",
        label_column: str = "label",
        label_names: Sequence[str] | None = None,
        hub_name: str | None = None,
        hub_config: str | None = None,
        hub_split_names: Mapping[str, str] | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(
            **settings
        )  # the shared settings (`TokenizedSettings`), checked and kept by the base
        if source not in ("sst2", "files", "hub"):
            raise ValueError(f"source must be sst2, files or hub, got {source!r}")
        if source == "files" and data_dir is None:
            raise ValueError(f"source='files' needs data_dir (a directory of {file_pattern} files)")
        if source == "hub" and not hub_name:
            raise ValueError("source='hub' needs hub_name (a dataset on the HuggingFace hub)")
        if "{split}" not in file_pattern:
            raise ValueError(f"file_pattern must contain '{{split}}', got {file_pattern!r}")
        self.source, self.data_dir, self.file_pattern = source, data_dir, file_pattern
        self.text_column, self.label_column = text_column, label_column
        self.label_names = None if label_names is None else [str(name) for name in label_names]
        self.hub_name, self.hub_config = hub_name, hub_config
        self.hub_split_names = dict(hub_split_names or {})
        self._class_names: list[str] | None = self.label_names

    def _load_raw(self, splits: Sequence[str]) -> datasets.DatasetDict:
        if self.source == "sst2":
            loaded = sources.load_sst2(self.data_dir, splits)
        elif self.source == "hub":
            loaded = sources.load_classification_hub(
                self.hub_name,
                splits,
                self.text_column,
                self.label_column,
                self.hub_config,
                self.hub_split_names,
            )
        else:
            train = self.splits["train"]
            wanted = list(splits)
            if self._class_names is None and train not in wanted:
                wanted.append(train)  # the label set is inferred from the training split
            files = {split: self._file(split) for split in wanted}
            loaded = sources.load_classification_files(
                files, self.text_column, self.label_column, self._class_names, infer_from=train
            )
        names = loaded[next(iter(loaded))].features["label"].names
        if self._class_names is not None and list(names) != self._class_names:
            raise sources.DataError(
                f"splits {list(splits)} have classes {names}, expected {self._class_names}"
            )
        self._class_names = list(names)
        return loaded

    def _file(self, split: str) -> Path:
        return sources.classification_file(self.data_dir, self.file_pattern, split)

    def _check_split(self, split: str, raw: datasets.Dataset) -> None:
        # Tokenized splits are trained on or scored; unlabeled text goes through predict_dataloader.
        sources.check_labeled(raw, split)

    def _tokenizer_columns(self) -> dict[str, list[str]]:
        return {"joint": ["text"]}

    def _files(self, split: str) -> list[Path] | None:
        if self.source == "sst2" and self.data_dir is not None:
            return [sources.sst2_file(self.data_dir, split)]
        if self.source != "files":
            return None
        train = self.splits["train"]
        inferred = self.label_names is None and split != train  # its label ids come from the train file
        return [self._file(split)] + ([self._file(train)] if inferred else [])

    def _settings(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "text_column": self.text_column,
            "label_column": self.label_column,
            "label_names": self.label_names,
        }

    def _entry_meta(self) -> dict[str, Any]:
        return {"class_names": self.class_names}

    def _restore_meta(self, meta: Mapping[str, Any]) -> None:
        names = list(meta["class_names"])
        if self._class_names is not None and names != self._class_names:
            raise sources.DataError(f"the cached splits have classes {names}, expected {self._class_names}")
        self._class_names = names

    def _cache_tag(self, side: str) -> str:
        return f"{self.source}-{self.text_column}-v{self.vocab_size_requested}"

    def _encode(
        self, batch: Mapping[str, list[Any]], encoders: Mapping[str, CorpusEncoder]
    ) -> dict[str, list[Any]]:
        return {"src_ids": encoders["src"].encode_batch(batch["text"])}

    def _length(self, lengths: Mapping[str, np.ndarray]) -> np.ndarray:
        return lengths["src_len"]

    def _collator(self) -> ClassificationCollator:
        return ClassificationCollator(self.pad_id)

    @property
    def tokenizer(self) -> BPETokenizer:
        return self.src_tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def class_names(self) -> list[str]:
        if self._class_names is None:
            self.raw_split(self.splits["train"])
        assert self._class_names is not None  # set by _load_raw
        return list(self._class_names)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def sources(self, split: str) -> list[str]:
        """Raw texts of `split`, indexed by the batches' `id`."""
        return self.raw_split(split)["text"][:]

    def labels(self, split: str) -> list[int]:
        """Gold label indices of `split` (-1 = unlabeled), indexed by `id`."""
        return self.raw_split(split)["label"][:]

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._class_names is not None:
            state["class_names"] = list(self._class_names)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "class_names" in state_dict:
            self._class_names = list(state_dict["class_names"])

"""Raw splits as `datasets.DatasetDict`: synthetic task, Multi30k, parallel files, classification files, hub.

Translation splits have columns "src", "tgt"; classification splits "text", "label" (a `ClassLabel`,
-1 = unlabeled). Local files are streamed into temporary Arrow files (memory-mapped, never whole-corpus
Python lists, removed at exit) and bad input raises `DataError` with one line naming the file, line or
value at fault. `reading` holds what both tasks share; `translation` and `classification` one task each.
"""

from data.sources.classification import (
    SST2_HUB,
    SST2_HUB_SPLITS,
    SST2_LABELS,
    check_labeled,
    classification_file,
    load_classification_files,
    load_classification_hub,
    load_sst2,
    sst2_file,
)
from data.sources.reading import DataError, arrow_dataset, iter_lines, read_lines
from data.sources.translation import (
    MULTI30K_HUB,
    MULTI30K_HUB_SPLITS,
    MULTI30K_LAYOUT,
    list_splits,
    load_multi30k,
    load_numbers,
    load_parallel,
    load_parallel_dir,
    load_synthetic,
    load_translation_hub,
    parallel_dataset,
    parallel_files,
)

__all__ = [
    "MULTI30K_HUB",
    "MULTI30K_HUB_SPLITS",
    "MULTI30K_LAYOUT",
    "SST2_HUB",
    "SST2_HUB_SPLITS",
    "SST2_LABELS",
    "DataError",
    "arrow_dataset",
    "check_labeled",
    "classification_file",
    "iter_lines",
    "list_splits",
    "load_classification_files",
    "load_classification_hub",
    "load_multi30k",
    "load_numbers",
    "load_parallel",
    "load_parallel_dir",
    "load_sst2",
    "load_synthetic",
    "load_translation_hub",
    "parallel_dataset",
    "parallel_files",
    "read_lines",
    "sst2_file",
]

"""A CSV logger that keeps the rows of the run it continues (Lightning's deletes the earlier metrics.csv) and
never leaves a torn file (a full disk)."""

from __future__ import annotations

import csv
import io
import logging
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from transformer.disk import human_size, write_text

log = logging.getLogger(__name__)


class CSVLogger(LightningCSVLogger):
    """Lightning's CSV logger, except that a run continued in its own directory keeps that directory's
    `metrics.csv` (Lightning's deletes it): the rows of the steps before the ones this run logs stay,
    the later ones (logged by the earlier run after its checkpoint, and logged again now) are replaced.
    """

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(log_dir=self.log_dir)
        return self._experiment


class _ContinuingWriter(ExperimentWriter):
    """Writes the whole `metrics.csv` through a temporary file at each save (Lightning's appends to it):
    a full disk leaves the earlier file whole instead of a torn last row, and ends the run in one line."""

    def _check_log_dir_exists(self) -> None:  # called by __init__ instead of deleting the earlier file
        self._rows: list[dict[str, object]] = []
        self._continued = self._fs.isfile(self.metrics_file_path)
        if not self._continued:
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            reader = csv.DictReader(file)
            self._rows = list(reader)
            self.metrics_keys = sorted(reader.fieldnames or [])

    def save(self) -> None:
        if not self.metrics:
            return
        if self._continued:  # the earlier run's rows from the first step logged again on are replaced
            first_step = min(int(m["step"]) for m in self.metrics)
            self._rows = [row for row in self._rows if int(float(str(row["step"]))) < first_step]
            self._continued = False
        self._record_new_keys()
        rows = [*self._rows, *self.metrics]
        if "://" in str(self.metrics_file_path):  # a remote filesystem: its own upload semantics
            with self._fs.open(self.metrics_file_path, "w", newline="") as file:
                _write_rows(file, self.metrics_keys, rows)
        else:
            buffer = io.StringIO()
            _write_rows(buffer, self.metrics_keys, rows)
            text = buffer.getvalue()
            write_text(self.metrics_file_path, text, f"the CSV log of {human_size(len(text.encode()))}")
        self._rows = rows
        self.metrics = []


def _write_rows(file: Any, keys: list[str], rows: list[dict[str, object]]) -> None:
    writer = csv.DictWriter(file, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)


class WandbLogger(LightningWandbLogger):
    """Lightning's wandb logger without its `anonymous=None`: Lightning passes `anonymous` to `wandb.init`
    even when unset, and wandb >= 0.19 warns "The anonymous setting has no effect and will be removed" for
    any value given, on every run. Left out unless `anonymous` was asked for."""

    def __init__(self, *args: Any, anonymous: bool | None = None, **kwargs: Any) -> None:
        super().__init__(*args, anonymous=anonymous, **kwargs)
        if anonymous is None:
            self._wandb_init.pop("anonymous", None)

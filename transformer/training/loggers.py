"""A CSV logger that keeps the rows of the run it continues (Lightning's deletes the earlier metrics.csv)."""

from __future__ import annotations

import csv
import logging

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

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
    def _check_log_dir_exists(self) -> None:  # called by __init__ instead of deleting the earlier file
        self._earlier: list[dict[str, str]] | None = None
        if not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            reader = csv.DictReader(file)
            self._earlier = list(reader)
            self.metrics_keys = sorted(reader.fieldnames or [])

    def save(self) -> None:
        if self._earlier is not None and self.metrics:
            first_step = min(int(m["step"]) for m in self.metrics)
            kept = [row for row in self._earlier if int(float(row["step"])) < first_step]
            with self._fs.open(self.metrics_file_path, "w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(kept)
            self._earlier = None
        super().save()

"""The TensorBoard + CSV logger of ``configs/extras/csv_logger.yaml``."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only


class TensorBoardCSVLogger(TensorBoardLogger):
    """Lightning's TensorBoardLogger, plus Lightning's CSVLogger writing ``metrics.csv`` into the same run folder.

    Listed side by side, the two loggers would each take the next free ``version_N`` (two folders); here the CSV
    follows the TensorBoard run, resumes into it included, and ``hparams.yaml`` is TensorBoard's.
    """

    @property
    def csv_logger(self) -> CSVLogger:
        if getattr(self, "_csv_logger", None) is None:
            metrics, earlier = Path(self.log_dir) / "metrics.csv", []
            if metrics.is_file():  # Lightning's CSV writer starts its file afresh: a resumed run keeps the earlier rows
                with metrics.open(newline="") as file:
                    earlier = list(csv.DictReader(file))
            self._csv_logger = CSVLogger(self.log_dir, name="", version="")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Experiment logs directory")  # TensorBoard's files belong there
                _ = self._csv_logger.experiment
            for row in earlier:
                values = {key: float(value) for key, value in row.items() if value not in ("", None) and key != "step"}
                self._csv_logger.log_metrics(values, int(row["step"]))
            self._csv_logger.save()
        return self._csv_logger

    @rank_zero_only
    def log_metrics(self, metrics, step=None) -> None:
        super().log_metrics(metrics, step)
        self.csv_logger.log_metrics(metrics, step)

    @rank_zero_only
    def save(self) -> None:
        super().save()
        self.csv_logger.save()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        self.csv_logger.finalize(status)

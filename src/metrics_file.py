"""metrics.csv: one row per epoch, rewritten atomically so a crash never leaves a half-written file."""
import csv
import io
from pathlib import Path
from typing import Dict, List, Optional

from src.atomic_file import write_text_atomic

COLUMNS = ("epoch", "lr", "train_loss", "eval_loss", "top1", "top5", "epoch_seconds", "images_per_second",
           "skipped_steps",  # steps whose update a loss-scale overflow skipped
           "ema_eval_loss", "ema_top1", "ema_top5")  # the EMA weights' evaluation (ema_decay)


class MetricsFile:
    """The rows of output_path/metrics.csv; a resumed run keeps the rows up to its starting epoch."""

    def __init__(self, path: str, keep_epochs_up_to: Optional[int] = None) -> None:
        self.path = Path(path)
        self.rows: List[Dict[str, str]] = []
        if keep_epochs_up_to is not None and self.path.is_file():
            with open(self.path, newline="", encoding="utf-8") as handle:
                self.rows = [row for row in csv.DictReader(handle) if int(row["epoch"]) <= keep_epochs_up_to]

    def append(self, values: Dict[str, object]) -> None:
        unknown = set(values) - set(COLUMNS)
        if unknown:
            raise KeyError(f"not metrics.csv columns: {sorted(unknown)}")
        self.rows.append({column: _format(values.get(column)) for column in COLUMNS})
        self._write()

    def _write(self) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        write_text_atomic(self.path, text.getvalue())


def _format(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)

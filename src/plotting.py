"""PNG figures: training curves from metrics.csv and a confusion matrix. Written atomically (src.atomic_file)."""
from pathlib import Path
from typing import Dict, List, Sequence

import matplotlib
matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402

from src.atomic_file import atomic_write  # noqa: E402


def _save_atomic(figure, path: Path) -> Path:
    try:
        with atomic_write(path) as temp:
            figure.savefig(temp, dpi=100, format="png")
    finally:
        plt.close(figure)
    return path


def _floats(rows: List[Dict[str, str]], key: str):
    return [float(row[key]) if row.get(key) not in (None, "") else np.nan for row in rows]


def plot_training_curves(rows: List[Dict[str, str]], path: str) -> Path:
    """Loss (train, eval), accuracy (top-1, top-5) and learning rate per epoch."""
    epochs = [int(row["epoch"]) for row in rows]
    figure, (loss_ax, acc_ax, lr_ax) = plt.subplots(1, 3, figsize=(15, 4))
    loss_ax.plot(epochs, _floats(rows, "train_loss"), "o-", label="train")
    loss_ax.plot(epochs, _floats(rows, "eval_loss"), "s-", label="eval")
    loss_ax.set(title="loss", xlabel="epoch")
    loss_ax.legend()
    acc_ax.plot(epochs, _floats(rows, "top1"), "o-", label="top-1")
    acc_ax.plot(epochs, _floats(rows, "top5"), "s-", label="top-5")
    acc_ax.set(title="eval accuracy", xlabel="epoch", ylim=(0, 1))
    acc_ax.legend()
    lr_ax.plot(epochs, _floats(rows, "lr"), "o-")
    lr_ax.set(title="learning rate (end of epoch)", xlabel="epoch")
    for axes in (loss_ax, acc_ax, lr_ax):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.tight_layout()
    return _save_atomic(figure, Path(path))


def plot_confusion_matrix(confusion: np.ndarray, names: Sequence[str], path: str) -> Path:
    """Counts per (true, predicted) class, with row-normalised colours."""
    totals = confusion.sum(axis=1, keepdims=True)
    share = confusion / np.maximum(totals, 1)
    size = max(6, 0.6 * len(names))
    figure, axes = plt.subplots(figsize=(size, size))
    axes.imshow(share, cmap="Blues", vmin=0, vmax=1)
    ticks = np.arange(len(names))
    axes.set_xticks(ticks, labels=names, rotation=45, ha="right")
    axes.set_yticks(ticks, labels=names)
    axes.set(xlabel="predicted", ylabel="true", title="confusion matrix")
    if len(names) <= 20:
        for i in range(len(names)):
            for j in range(len(names)):
                axes.text(j, i, str(confusion[i, j]), ha="center", va="center",
                          color="white" if share[i, j] > 0.5 else "black", fontsize=8)
    figure.tight_layout()
    return _save_atomic(figure, Path(path))

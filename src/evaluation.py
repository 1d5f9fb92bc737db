"""Evaluation of a classifier over a dataset: top-1, top-5, mean cross-entropy, per-class accuracy and the
confusion matrix, summed over all ranks of a distributed job."""
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Sequence

import numpy as np
import mindspore as ms
from mindspore import nn

from src.atomic_file import write_text_atomic
from src.collectives import all_reduce_sum


@dataclass
class EvalResult:
    confusion: np.ndarray  # [true class, predicted class] -> count
    loss_sum: float
    top5_correct: int

    @property
    def num_samples(self) -> int:
        return int(self.confusion.sum())

    @property
    def top1(self) -> float:
        return float(np.trace(self.confusion)) / max(self.num_samples, 1)

    @property
    def top5(self) -> float:
        return self.top5_correct / max(self.num_samples, 1)

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.num_samples, 1)

    def per_class_accuracy(self, names: Sequence[str]) -> Dict[str, float]:
        totals = self.confusion.sum(axis=1)
        return {name: (float(self.confusion[i, i]) / totals[i] if totals[i] else float("nan"))
                for i, name in enumerate(names)}


def batch_statistics(logits: np.ndarray, labels: np.ndarray, class_num: int):
    """(confusion counts, summed cross-entropy, top-5 hits) of one batch, computed in float64."""
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss_sum = float(-log_probs[np.arange(len(labels)), labels].sum())
    k = min(5, class_num)
    top_k = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    top5 = int((top_k == labels[:, None]).any(axis=1).sum())
    confusion = np.zeros((class_num, class_num), np.int64)
    np.add.at(confusion, (labels, logits.argmax(axis=1)), 1)
    return confusion, loss_sum, top5


def average_batchnorm_statistics(net: nn.Cell, group_size: int) -> None:
    """Replaces every rank's BatchNorm moving mean/variance by the average over ranks.

    Data parallelism averages gradients, so the trained weights agree, but each rank updates its moving
    statistics from its own batches. Averaging them (as timm's distribute_bn does) makes every rank, and
    so the checkpoint rank 0 writes, evaluate identically. One collective for all of them.
    """
    if group_size <= 1:
        return
    stats = [param for param in net.get_parameters() if param.name.endswith((".moving_mean", ".moving_variance"))]
    flat = np.concatenate([param.asnumpy().ravel() for param in stats]).astype(np.float32)
    averaged = all_reduce_sum(flat) / group_size
    offset = 0
    for param in stats:
        size = int(np.prod(param.shape))
        param.set_data(ms.Tensor(averaged[offset:offset + size].reshape(param.shape), param.dtype))
        offset += size


def evaluate(net: nn.Cell, dataset, class_num: int, group_size: int = 1) -> EvalResult:
    """Runs net in inference mode over dataset (columns image, label); sums over ranks when group_size > 1."""
    net.set_train(False)
    confusion = np.zeros((class_num, class_num), np.int64)
    loss_sum, top5 = 0.0, 0
    for images, labels in dataset.create_tuple_iterator(num_epochs=1):
        logits = net(images).asnumpy()
        batch_confusion, batch_loss, batch_top5 = batch_statistics(logits, labels.asnumpy(), class_num)
        confusion += batch_confusion
        loss_sum += batch_loss
        top5 += batch_top5
    if group_size > 1:
        # One collective for all three; float32 holds counts exactly up to 2**24 images.
        packed = np.concatenate([confusion.ravel(), [loss_sum, top5]]).astype(np.float32)
        packed = all_reduce_sum(packed).astype(np.float64)
        confusion = np.rint(packed[:-2]).astype(np.int64).reshape(class_num, class_num)
        loss_sum, top5 = float(packed[-2]), int(round(packed[-1]))
    return EvalResult(confusion=confusion, loss_sum=loss_sum, top5_correct=top5)


def write_json_atomic(values: Dict, path: Path) -> Path:
    return write_text_atomic(path, json.dumps(values, indent=2) + "\n")


def run_evaluation(config, env, logger: logging.Logger) -> Dict:
    """Evaluates config.checkpoint_path on the test set; writes eval_result.json (and the confusion
    matrix PNG when save_confusion_matrix) to output_path; returns the result dictionary. The stem and input size
    are the checkpoint's unless set (src.weights.loading.settings_from_checkpoint)."""
    from src.data_source import prepare_data
    from src.dataset import class_names, create_dataset
    from src.fused_inference import inference_network
    from src.plotting import plot_confusion_matrix
    from src.resnet import build_resnet
    from src.weights.loading import (checkpoint_semantics, load_weights_report, read_weight_file,
                                     settings_from_checkpoint)

    # The checkpoint first: the stem and input size it records apply unless set, and a bad file fails before the data.
    read = read_weight_file(config.checkpoint_path, config.checkpoint_sha256)
    config = settings_from_checkpoint(config, read[0], config.checkpoint_path, logger)
    data = prepare_data(config, logger, training=False)
    # A models-zoo or mindcv checkpoint runs in its home network's semantics (padding, BatchNorm eps).
    semantics = checkpoint_semantics(read, config.checkpoint_path, logger)
    net = build_resnet(config.model_name, config.class_num, conv_implementation=env.conv_implementation,
                       stem=config.stem, semantics=semantics)
    load_weights_report(net, config.checkpoint_path, config.model_name, logger, read=read, use_ema=config.use_ema)
    dataset = create_dataset(data.eval_path, False, config.batch_size, (config.image_height, config.image_width),
                             env.group_size, env.rank_id, config.eval_num_samples, config.num_parallel_workers,
                             config.seed)
    logger.info("evaluating %s (%s, %s stem, %dx%d) on %s", config.checkpoint_path, config.model_name, config.stem,
                config.image_height, config.image_width, data.describe())
    result = evaluate(inference_network(net), dataset, config.class_num, env.group_size)
    names = class_names(config.class_num)
    values = {
        "top1": result.top1, "top5": result.top5, "loss": result.loss, "num_samples": result.num_samples,
        "checkpoint": str(config.checkpoint_path), "model_name": config.model_name, "stem": config.stem,
        "semantics": semantics,
        "class_num": config.class_num, "data_path": data.eval_path, "synthetic_data": data.synthetic,
        "dataset": data.label or "CIFAR-10",
        "image_size": [config.image_height, config.image_width],
        "per_class_accuracy": result.per_class_accuracy(names),
        "confusion_matrix": result.confusion.tolist(),
    }
    if env.is_main_rank:
        output = Path(config.output_path)
        output.mkdir(parents=True, exist_ok=True)
        write_json_atomic(values, output / "eval_result.json")
        if config.save_confusion_matrix:
            png = plot_confusion_matrix(result.confusion, names, str(output / "confusion_matrix.png"))
            logger.info("wrote %s", png)
        logger.info("top-1 %.4f top-5 %.4f loss %.4f on %d images%s; wrote %s", result.top1, result.top5, result.loss,
                    result.num_samples, data.tag,
                    output / "eval_result.json")
    return values

"""Evaluation metrics: per-batch statistics against torch, EvalResult, and evaluate() on a real pipeline."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mindspore as ms

from src.dataset import RECORD_BYTES, TEST_FILE, create_dataset
from src.evaluation import EvalResult, batch_statistics, evaluate
from src.resnet import resnet18

EVAL_SAMPLES = 40
BATCH = 16
CLASSES = 10

# --------------------------------------------------------------------------------------------- helpers


def reference_statistics(logits: np.ndarray, labels: np.ndarray, class_num: int):
    """(confusion, summed cross-entropy, top-k hits) computed with torch and plain loops."""
    logits64 = torch.from_numpy(np.asarray(logits, np.float64))
    target = torch.from_numpy(np.asarray(labels, np.int64))
    loss_sum = F.cross_entropy(logits64, target, reduction="sum").item()
    k = min(5, class_num)
    top_k = torch.topk(logits64, k, dim=1).indices
    hits = int((top_k == target[:, None]).any(dim=1).sum())
    confusion = np.zeros((class_num, class_num), np.int64)
    for true, predicted in zip(labels, np.argmax(logits, axis=1)):
        confusion[true, predicted] += 1
    return confusion, loss_sum, hits


def random_batch(seed: int, batch: int, class_num: int, scale: float = 3.0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((batch, class_num)) * scale).astype(dtype)
    labels = rng.integers(0, class_num, batch).astype(np.int32)
    return logits, labels


# ------------------------------------------------------------------------------------- batch_statistics


@pytest.mark.parametrize("seed, batch, class_num, scale", [
    (0, 64, 10, 3.0),
    (1, 7, 100, 1.0),
    (2, 1, 6, 2.0),
    (3, 200, 10, 0.05),  # near-uniform predictions
    (4, 50, 10, 400.0),  # huge logits: exp overflows without the max shift
])
def test_batch_statistics_matches_torch(seed, batch, class_num, scale):
    logits, labels = random_batch(seed, batch, class_num, scale)
    confusion, loss_sum, top5 = batch_statistics(logits, labels, class_num)
    ref_confusion, ref_loss, ref_top5 = reference_statistics(logits, labels, class_num)

    assert isinstance(loss_sum, float) and math.isfinite(loss_sum)
    assert loss_sum == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    assert confusion.shape == (class_num, class_num)
    np.testing.assert_array_equal(confusion, ref_confusion)
    assert confusion.sum() == batch
    assert np.trace(confusion) == int((logits.argmax(axis=1) == labels).sum())
    np.testing.assert_array_equal(confusion.sum(axis=1), np.bincount(labels, minlength=class_num))
    assert top5 == ref_top5
    assert np.trace(confusion) <= top5 <= batch


def test_batch_statistics_float32_logits_computed_in_float64():
    logits, labels = random_batch(5, 128, 10, scale=5.0, dtype=np.float32)
    _, loss_sum, top5 = batch_statistics(logits, labels, 10)
    _, ref_loss, ref_top5 = reference_statistics(logits.astype(np.float64), labels, 10)
    assert loss_sum == pytest.approx(ref_loss, rel=1e-12)
    assert top5 == ref_top5


def test_batch_statistics_top5_distinguishes_rank_5_from_rank_6():
    # Label at rank 5 (a hit) and at rank 6 (a miss), with 8 classes.
    logits = np.array([[8, 7, 6, 5, 4, 3, 2, 1], [8, 7, 6, 5, 4, 3, 2, 1]], np.float64)
    labels = np.array([4, 5], np.int32)
    confusion, _, top5 = batch_statistics(logits, labels, 8)
    assert top5 == 1
    assert np.trace(confusion) == 0
    assert confusion[4, 0] == 1 and confusion[5, 0] == 1


def test_batch_statistics_three_classes_topk_is_all():
    logits, labels = random_batch(6, 30, 3)
    confusion, loss_sum, top5 = batch_statistics(logits, labels, 3)
    ref_confusion, ref_loss, _ = reference_statistics(logits, labels, 3)
    assert top5 == 30  # k = min(5, 3) = 3: every label is in the top 3
    assert EvalResult(confusion, loss_sum, top5).top5 == 1.0
    np.testing.assert_array_equal(confusion, ref_confusion)
    assert loss_sum == pytest.approx(ref_loss, rel=1e-12)
    assert np.trace(confusion) < 30  # random logits: top-1 is not perfect, so top-5 is not just top-1


def test_batch_statistics_perfect_and_confident_predictions():
    labels = np.array([0, 1, 2, 3, 4, 5], np.int32)
    logits = np.full((6, 6), -50.0)
    logits[np.arange(6), labels] = 50.0
    confusion, loss_sum, top5 = batch_statistics(logits, labels, 6)
    np.testing.assert_array_equal(confusion, np.eye(6, dtype=np.int64))
    assert top5 == 6
    assert 0.0 <= loss_sum < 1e-30


# ------------------------------------------------------------------------------------------ EvalResult


def test_eval_result_properties():
    confusion = np.array([[3, 1, 0, 0],
                          [2, 2, 0, 0],
                          [0, 0, 0, 0],   # no sample of class 2
                          [0, 1, 1, 0]], np.int64)
    result = EvalResult(confusion=confusion, loss_sum=12.5, top5_correct=9)
    assert result.num_samples == 10
    assert isinstance(result.num_samples, int)
    assert result.top1 == pytest.approx(5 / 10)
    assert result.top5 == pytest.approx(9 / 10)
    assert result.loss == pytest.approx(1.25)
    per_class = result.per_class_accuracy(["a", "b", "c", "d"])
    assert list(per_class) == ["a", "b", "c", "d"]
    assert per_class["a"] == pytest.approx(0.75)
    assert per_class["b"] == pytest.approx(0.5)
    assert math.isnan(per_class["c"])
    assert per_class["d"] == 0.0


def test_eval_result_empty_does_not_divide_by_zero():
    result = EvalResult(confusion=np.zeros((3, 3), np.int64), loss_sum=0.0, top5_correct=0)
    assert result.num_samples == 0
    assert (result.top1, result.top5, result.loss) == (0.0, 0.0, 0.0)
    assert all(math.isnan(value) for value in result.per_class_accuracy(["x", "y", "z"]).values())


def test_eval_result_accumulates_batches_like_one_batch():
    logits, labels = random_batch(7, 45, 10)
    whole = EvalResult(*batch_statistics(logits, labels, 10))
    parts = [batch_statistics(logits[i:i + 16], labels[i:i + 16], 10) for i in range(0, 45, 16)]
    summed = EvalResult(sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts))
    np.testing.assert_array_equal(summed.confusion, whole.confusion)
    assert summed.loss == pytest.approx(whole.loss, rel=1e-12)
    assert summed.top5 == whole.top5 and summed.num_samples == 45


# -------------------------------------------------------------------------------- evaluate on real data


@pytest.fixture(scope="module")
def net():
    ms.set_seed(0)
    model = resnet18(num_classes=CLASSES)
    model.set_train(False)
    return model


def make_dataset(cifar_dir):
    return create_dataset(str(cifar_dir), False, batch_size=BATCH, image_size=(32, 32), num_samples=EVAL_SAMPLES)


def first_test_labels(cifar_dir, count: int) -> np.ndarray:
    """Labels of the first count records of test_batch.bin, read from the raw bytes."""
    raw = np.fromfile(cifar_dir / TEST_FILE, np.uint8, count=count * RECORD_BYTES)
    return raw.reshape(count, RECORD_BYTES)[:, 0].astype(np.int64)


def test_evaluate_counts_every_sample_once(cifar_dir, net):
    dataset = make_dataset(cifar_dir)
    batch_sizes = [int(labels.shape[0]) for _, labels in dataset.create_tuple_iterator(num_epochs=1)]
    assert batch_sizes == [16, 16, 8]  # the last batch is partial and kept
    result = evaluate(net, dataset, CLASSES)
    assert result.num_samples == EVAL_SAMPLES
    assert result.confusion.shape == (CLASSES, CLASSES)
    # Rows of the confusion matrix are the true labels of exactly the first 40 test records.
    np.testing.assert_array_equal(result.confusion.sum(axis=1),
                                  np.bincount(first_test_labels(cifar_dir, EVAL_SAMPLES), minlength=CLASSES))
    assert 0.0 <= result.top1 <= result.top5 <= 1.0
    assert math.isfinite(result.loss) and result.loss > 0


@pytest.mark.slow
def test_evaluate_is_deterministic(cifar_dir, net):
    dataset = make_dataset(cifar_dir)
    first = evaluate(net, dataset, CLASSES)
    again = evaluate(net, dataset, CLASSES)  # the same pipeline iterated a second time
    fresh = evaluate(net, make_dataset(cifar_dir), CLASSES)  # a new pipeline over the same data
    for other in (again, fresh):
        np.testing.assert_array_equal(other.confusion, first.confusion)
        assert other.top5_correct == first.top5_correct
        assert other.loss_sum == first.loss_sum


@pytest.mark.slow
def test_evaluate_loss_equals_mean_of_independent_per_sample_losses(cifar_dir, net):
    dataset = make_dataset(cifar_dir)
    result = evaluate(net, dataset, CLASSES)

    net.set_train(False)
    all_logits, all_labels = [], []
    for images, labels in dataset.create_tuple_iterator(num_epochs=1):
        for index in range(images.shape[0]):  # one image at a time: no batching shared with evaluate()
            all_logits.append(net(images[index:index + 1]).asnumpy()[0])
        all_labels.append(labels.asnumpy())
    logits = np.stack(all_logits).astype(np.float64)
    labels = np.concatenate(all_labels).astype(np.int64)
    assert logits.shape == (EVAL_SAMPLES, CLASSES)
    np.testing.assert_array_equal(labels, first_test_labels(cifar_dir, EVAL_SAMPLES))

    per_sample = F.cross_entropy(torch.from_numpy(logits), torch.from_numpy(labels), reduction="none").numpy()
    assert result.loss == pytest.approx(per_sample.mean(), rel=1e-5)
    assert result.loss_sum == pytest.approx(per_sample.sum(), rel=1e-5)

    ref_confusion, _, ref_top5 = reference_statistics(logits, labels, CLASSES)
    np.testing.assert_array_equal(result.confusion, ref_confusion)
    assert result.top5_correct == ref_top5
    assert result.top1 == pytest.approx(float((logits.argmax(axis=1) == labels).mean()))

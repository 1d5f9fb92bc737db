"""Training augmentation (src/augmentation.py): the batch-level ops' arithmetic, reproducibility of every part from
(seed, epoch) and across a mid-epoch skip in real MindSpore pipelines, soft labels in the loss, and a SIGTERM'd
train.py run with everything on that resumes to the uninterrupted run's weights."""
import re

import numpy as np
import pytest

from conftest import FAST_ARGS, final_digest, run_script, sigterm_training
from src.augmentation import ERASE_SCALE, Augmentation, BatchAugmenter, cutmix_box, erase_box
from src.dataset import create_dataset

EVERYTHING = Augmentation("randaugment", randaugment_num_ops=3, randaugment_magnitude=12, random_erasing=0.5,
                          mixup_alpha=0.2, cutmix_alpha=1.0, mixup_switch_prob=0.5)


def batch_of(size=8, seed=0):
    """Distinct positive images (no pixel is 0) and distinct labels."""
    rng = np.random.default_rng(seed)
    return rng.uniform(0.5, 1.5, (size, 3, 16, 16)).astype(np.float32), np.arange(size, dtype=np.int32)


# ---------------------------------------------------------------- the batch-level ops, on numpy arrays

def test_batch_draws_depend_on_seed_epoch_rank_and_batch_index_only():
    images, labels = batch_of()
    augmenter = BatchAugmenter(EVERYTHING, seed=4, epoch=2, rank_id=1)
    first = augmenter.apply(images.copy(), labels, batch_index=5)
    again = BatchAugmenter(EVERYTHING, seed=4, epoch=2, rank_id=1).apply(images.copy(), labels, batch_index=5)
    assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    for other in (BatchAugmenter(EVERYTHING, 4, 2, 1).apply(images.copy(), labels, 6),
                  BatchAugmenter(EVERYTHING, 4, 3, 1).apply(images.copy(), labels, 5),
                  BatchAugmenter(EVERYTHING, 5, 2, 1).apply(images.copy(), labels, 5),
                  BatchAugmenter(EVERYTHING, 4, 2, 0).apply(images.copy(), labels, 5)):
        assert not np.array_equal(first[0], other[0])


def test_mixup_blends_images_and_labels_with_the_batch_shifted_by_one():
    images, labels = batch_of()
    augmenter = BatchAugmenter(Augmentation(mixup_alpha=0.4, class_num=10), seed=1, epoch=0)
    for index in range(5):
        mixed, targets = augmenter.apply(images.copy(), labels, index)
        assert targets.dtype == np.float32 and targets.shape == (8, 10)
        assert np.allclose(targets.sum(axis=1), 1.0)
        lam = float(targets[0, 0])  # image 0's own class; its partner is image 7
        assert targets[0, 7] == pytest.approx(1 - lam) and 0 <= lam <= 1
        assert np.allclose(mixed, lam * images + (1 - lam) * np.roll(images, 1, axis=0), atol=1e-6)
        assert mixed.dtype == np.float32


def test_cutmix_pastes_one_box_and_weighs_labels_by_its_area():
    images, labels = batch_of()
    augmenter = BatchAugmenter(Augmentation(cutmix_alpha=1.0), seed=2, epoch=0)
    pasted_any = False
    for index in range(10):
        mixed, targets = augmenter.apply(images.copy(), labels, index)
        from_partner = mixed != images  # images are distinct: a pasted pixel differs
        assert np.array_equal(mixed[from_partner], np.roll(images, 1, axis=0)[from_partner])
        share = from_partner[0].mean()  # the box is the same for every image and channel
        assert all(np.array_equal(from_partner[0], mask) for mask in from_partner)
        assert targets[0, 7] == pytest.approx(share) and targets[0, 0] == pytest.approx(1 - share)
        pasted_any |= share > 0
    assert pasted_any


def test_cutmix_box_is_clipped_and_sized_by_lam():
    rng = np.random.default_rng(0)
    for lam in (0.0, 0.3, 0.9, 1.0):
        for _ in range(50):
            y1, y2, x1, x2 = cutmix_box(rng, lam, 32, 24)
            assert 0 <= y1 <= y2 <= 32 and 0 <= x1 <= x2 <= 24
            assert y2 - y1 <= 2 * int(0.5 * np.sqrt(1 - lam) * 32)


def test_switch_probability_picks_mixup_or_cutmix():
    images, labels = batch_of()

    def kinds(switch):
        augmenter = BatchAugmenter(Augmentation(mixup_alpha=1.0, cutmix_alpha=1.0, mixup_switch_prob=switch), 1, 0)
        found = set()
        partners = np.roll(images, 1, axis=0)
        for index in range(20):
            mixed, _ = augmenter.apply(images.copy(), labels, index)
            changed = mixed != images  # CutMix: exactly the partner's pixels; MixUp: blends of both
            found.add("cutmix" if np.array_equal(mixed[changed], partners[changed]) else "mixup")
        return found
    assert kinds(0.0) == {"mixup"} and kinds(1.0) == {"cutmix"} and kinds(0.5) == {"mixup", "cutmix"}


def test_random_erasing_zeroes_one_box_per_erased_image_and_keeps_integer_labels():
    images, labels = batch_of(size=64)
    erased, same_labels = BatchAugmenter(Augmentation(random_erasing=1.0), 3, 0).apply(images.copy(), labels, 0)
    assert same_labels.dtype == np.int32 and np.array_equal(same_labels, labels)
    shares = []
    for image in erased:
        zero = image == 0
        assert all(np.array_equal(zero[0], channel) for channel in zero)
        if zero.any():
            rows, cols = np.nonzero(zero[0])
            assert zero[0].sum() == (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)  # one box
            shares.append(zero[0].mean())
    assert len(shares) >= 60  # a box almost always fits
    assert min(shares) >= ERASE_SCALE[0] * 0.5 and max(shares) <= ERASE_SCALE[1] * 1.5
    untouched, _ = BatchAugmenter(Augmentation(random_erasing=0.0, cutmix_alpha=0.0), 3, 0).apply(
        images.copy(), labels, 0)
    assert np.array_equal(untouched, images)


def test_erase_box_fits_inside_the_image():
    rng = np.random.default_rng(1)
    for _ in range(200):
        box = erase_box(rng, 8, 12)
        if box is not None:
            top, left, height, width = box
            assert 0 <= top and top + height <= 8 and 0 <= left and left + width <= 12


def test_describe_names_what_is_on():
    assert Augmentation().describe() == "none beyond the reference crop and flip"
    assert EVERYTHING.describe() == ("RandAugment (3 ops, magnitude 12), random erasing p=0.5, MixUp alpha 0.2 or "
                                     "CutMix alpha 1 per batch (CutMix with probability 0.5)")


# ---------------------------------------------------------------- real MindSpore pipelines

def epoch_batches(cifar_dir, augment, epoch=1, skip_batches=0, seed=3, **kwargs):
    dataset = create_dataset(str(cifar_dir), True, batch_size=8, image_size=(32, 32), num_samples=48, seed=seed,
                             epoch=epoch, skip_batches=skip_batches, num_parallel_workers=2, augment=augment,
                             **kwargs)
    return list(dataset.create_tuple_iterator(output_numpy=True, num_epochs=1))


def identical(batches_a, batches_b) -> bool:
    return len(batches_a) == len(batches_b) and all(
        np.array_equal(image_a, image_b) and np.array_equal(label_a, label_b)
        for (image_a, label_a), (image_b, label_b) in zip(batches_a, batches_b))


@pytest.mark.slow
@pytest.mark.parametrize("augment", [
    Augmentation("autoaugment"), Augmentation("randaugment"), Augmentation("trivialaugment"),
    Augmentation(random_erasing=0.5), Augmentation(mixup_alpha=0.2), Augmentation(cutmix_alpha=1.0), EVERYTHING,
], ids=["autoaugment", "randaugment", "trivialaugment", "erasing", "mixup", "cutmix", "everything"])
def test_pipelines_repeat_from_seed_and_epoch_and_skip_resumes_exactly(cifar_dir, augment):
    first = epoch_batches(cifar_dir, augment)
    for _ in range(2):  # two workers: the same batches every time
        assert identical(first, epoch_batches(cifar_dir, augment))
    assert identical(first[2:], epoch_batches(cifar_dir, augment, skip_batches=2))
    assert not identical(first, epoch_batches(cifar_dir, augment, epoch=2))
    assert not identical(first, epoch_batches(cifar_dir, None))  # it does something
    labels = first[0][1]
    if augment.mixes:
        assert labels.dtype == np.float32 and labels.shape == (8, 10) and np.allclose(labels.sum(axis=1), 1)
    else:
        assert labels.dtype == np.int32 and labels.shape == (8,)


@pytest.mark.slow
def test_defaults_keep_the_reference_pipeline_and_evaluation_ignores_augmentation(cifar_dir):
    assert identical(epoch_batches(cifar_dir, Augmentation()), epoch_batches(cifar_dir, None))

    def evaluation(augment):
        dataset = create_dataset(str(cifar_dir), False, batch_size=8, image_size=(32, 32), num_samples=16,
                                 augment=augment)
        return list(dataset.create_tuple_iterator(output_numpy=True, num_epochs=1))
    assert identical(evaluation(EVERYTHING), evaluation(None))
    assert evaluation(EVERYTHING)[0][1].dtype == np.int32


@pytest.mark.slow
def test_randaugment_keys_reach_mindspores_op(cifar_dir):
    mild = epoch_batches(cifar_dir, Augmentation("randaugment", randaugment_num_ops=1, randaugment_magnitude=0))
    strong = epoch_batches(cifar_dir, Augmentation("randaugment", randaugment_num_ops=4, randaugment_magnitude=30))
    plain = epoch_batches(cifar_dir, None)
    change = [np.mean([np.abs(a[0] - b[0]).mean() for a, b in zip(batches, plain)]) for batches in (mild, strong)]
    assert change[0] < change[1]


def test_cross_entropy_takes_soft_labels_with_label_smoothing_folded_in():
    """What the training step relies on with MixUp/CutMix: MindSpore's nn.CrossEntropyLoss given class weights
    smooths them as torch does (and as timm folds smoothing into the mixed targets), and one-hot weights give the
    integer labels' loss."""
    from mindspore import Tensor, nn
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(8, 10)) * 3).astype(np.float32)
    labels = rng.integers(0, 10, 8).astype(np.int32)
    onehot = np.eye(10, dtype=np.float32)[labels]
    soft = 0.3 * onehot + 0.7 * np.roll(onehot, 1, axis=0)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    for smoothing in (0.0, 0.1):
        loss = nn.CrossEntropyLoss(label_smoothing=smoothing)
        expected = -((soft * (1 - smoothing) + smoothing / 10) * log_probs).sum(axis=1).mean()
        assert float(loss(Tensor(logits), Tensor(soft)).asnumpy()) == pytest.approx(expected, rel=1e-5)
        assert float(loss(Tensor(logits), Tensor(onehot)).asnumpy()) == pytest.approx(
            float(loss(Tensor(logits), Tensor(labels)).asnumpy()), rel=1e-6)


# ---------------------------------------------------------------- train.py: SIGTERM mid-epoch, then --resume

RECIPE = ["--model_name", "resnet18", "--batch_size", "8", "--train_num_samples", "96", "--eval_num_samples", "16",
          "--epoch_size", "2", "--optimizer", "momentum", "--lr", "0.01", "--label_smoothing", "0.1",
          "--auto_augment", "randaugment", "--random_erasing", "0.5", "--mixup_alpha", "0.2", "--cutmix_alpha", "1.0",
          *FAST_ARGS]



@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_ends_with_the_uninterrupted_weights(cifar_dir, tmp_path):
    args = ["--data_path", str(cifar_dir), *RECIPE]
    straight = run_script("train.py", args + ["--output_path", str(tmp_path / "straight")])
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert ("augmentation: RandAugment (2 ops, magnitude 9), random erasing p=0.5, MixUp alpha 0.2 or CutMix "
            "alpha 1 per batch (CutMix with probability 0.5)") in straight.stdout

    out = tmp_path / "interrupted"
    log_path = tmp_path / "interrupted.log"
    sigterm_training(args + ["--output_path", str(out)], log_path, "epoch 1/2 step 5/12")
    stopped = re.search(r"stopped by SIGTERM.* at epoch 1 step (\d+)", log_path.read_text())
    assert stopped and 5 <= int(stopped.group(1)) < 12, log_path.read_text()[-3000:]
    resumed = run_script("train.py", args + ["--output_path", str(out), "--resume",
                                             str(out / "resnet18-interrupted.ckpt")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert final_digest(resumed.stdout) == final_digest(straight.stdout)

"""CIFAR-10 pipelines: determinism of evaluation, exact shards, num_samples, preprocessing, error lines."""
import shutil

import numpy as np
import pytest

from src.dataset import (CIFAR10_MEAN, CIFAR10_STD, FILE_BYTES, RECORD_BYTES, create_dataset, shard_indices,
                         cifar_files)
from src.errors import UserError


def batches(dataset):
    return [(image, label) for image, label in dataset.create_tuple_iterator(output_numpy=True, num_epochs=1)]


def stacked(dataset):
    parts = batches(dataset)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def raw_records(folder, name, count):
    data = np.fromfile(folder / name, np.uint8, count=count * RECORD_BYTES).reshape(count, RECORD_BYTES)
    return data[:, 0].astype(np.int32), data[:, 1:].reshape(count, 3, 32, 32)


def test_eval_pipeline_is_deterministic_and_in_file_order(cifar_dir):
    first = stacked(create_dataset(str(cifar_dir), False, batch_size=16, image_size=(32, 32), num_samples=50))
    second = stacked(create_dataset(str(cifar_dir), False, batch_size=16, image_size=(32, 32), num_samples=50))
    assert np.array_equal(first[0], second[0]) and np.array_equal(first[1], second[1])
    labels, pixels = raw_records(cifar_dir, "test_batch.bin", 50)
    assert np.array_equal(first[1], labels)
    # Rescale + Normalize with the reference mean/std, CHW layout: pixel-exact against the raw bytes.
    expected = (pixels / 255.0 - np.array(CIFAR10_MEAN)[:, None, None]) / np.array(CIFAR10_STD)[:, None, None]
    assert first[0].dtype == np.float32 and first[0].shape == (50, 3, 32, 32)
    assert np.allclose(first[0], expected, atol=1e-5)


def test_eval_keeps_the_last_partial_batch_and_labels_are_int32(cifar_dir):
    parts = batches(create_dataset(str(cifar_dir), False, batch_size=16, image_size=(32, 32), num_samples=50))
    assert [len(p[1]) for p in parts] == [16, 16, 16, 2]
    assert parts[0][1].dtype == np.int32


def test_resize_to_the_configured_image_size(cifar_dir):
    image, _ = batches(create_dataset(str(cifar_dir), False, batch_size=4, image_size=(224, 160), num_samples=4))[0]
    assert image.shape == (4, 3, 224, 160)


def test_training_drops_the_remainder_and_honours_num_samples(cifar_dir):
    dataset = create_dataset(str(cifar_dir), True, batch_size=16, image_size=(32, 32), num_samples=70)
    assert dataset.get_dataset_size() == 4
    assert all(len(label) == 16 for _, label in batches(dataset))
    assert create_dataset(str(cifar_dir), True, batch_size=100, image_size=(32, 32)).get_dataset_size() == 500


def test_training_augmentation_is_random_per_epoch_and_reproducible(cifar_dir):
    def epoch_images(epoch, seed=1):
        return stacked(create_dataset(str(cifar_dir), True, batch_size=32, image_size=(32, 32), num_samples=64,
                                      seed=seed, epoch=epoch, num_parallel_workers=2))
    first, again, other_epoch = epoch_images(0), epoch_images(0), epoch_images(1)
    assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    assert not np.array_equal(first[0], other_epoch[0])
    assert not np.array_equal(first[0], epoch_images(0, seed=2)[0])
    # Crops and flips change pixels, not which images are used: same label multiset.
    assert sorted(first[1]) == sorted(other_epoch[1])


def test_skip_batches_resumes_with_the_same_augmentation(cifar_dir):
    kwargs = dict(batch_size=8, image_size=(32, 32), num_samples=40, seed=3, epoch=2, num_parallel_workers=2)
    full = batches(create_dataset(str(cifar_dir), True, **kwargs))
    rest = batches(create_dataset(str(cifar_dir), True, skip_batches=2, **kwargs))
    assert len(rest) == len(full) - 2
    for (image_a, label_a), (image_b, label_b) in zip(full[2:], rest):
        assert np.array_equal(image_a, image_b) and np.array_equal(label_a, label_b)


@pytest.mark.parametrize("total, ranks, num_samples", [(10000, 2, 0), (10000, 3, 0), (50, 4, 0), (10000, 3, 7)])
def test_eval_shards_are_disjoint_and_complete(total, ranks, num_samples):
    shards = [shard_indices(total, False, ranks, rank, num_samples) for rank in range(ranks)]
    merged = np.concatenate(shards)
    expected = num_samples or total
    assert len(merged) == expected and len(set(merged.tolist())) == expected
    assert set(merged.tolist()) == set(range(expected))


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_train_shards_are_disjoint_equal_and_shared_across_ranks(ranks):
    shards = [shard_indices(1000, True, ranks, rank, 0, seed=5, epoch=1) for rank in range(ranks)]
    sizes = {len(shard) for shard in shards}
    assert len(sizes) == 1  # every rank runs the same number of steps
    merged = np.concatenate(shards).tolist()
    assert len(merged) == len(set(merged)) == 1000 - 1000 % ranks
    again = shard_indices(1000, True, ranks, 0, 0, seed=5, epoch=1)
    assert np.array_equal(again, shards[0])
    assert not np.array_equal(shard_indices(1000, True, ranks, 0, 0, seed=5, epoch=2), shards[0])


def test_sharded_eval_pipelines_cover_the_data_exactly(cifar_dir):
    labels = [stacked(create_dataset(str(cifar_dir), False, batch_size=8, image_size=(32, 32), rank_size=3,
                                     rank_id=rank, num_samples=20))[1] for rank in range(3)]
    assert [len(part) for part in labels] == [7, 7, 6]
    expected, _ = raw_records(cifar_dir, "test_batch.bin", 20)
    interleaved = np.empty(20, np.int32)
    for rank, part in enumerate(labels):
        interleaved[rank::3] = part
    assert np.array_equal(interleaved, expected)


def test_missing_folder_is_one_clear_line(tmp_path):
    with pytest.raises(UserError) as caught:
        create_dataset(str(tmp_path / "nowhere"), True)
    message = str(caught.value)
    assert "nowhere" in message and "does not exist" in message and "data_batch_1.bin" in message
    assert "\n" not in message


def test_folder_without_bin_files_is_one_clear_line(tmp_path):
    with pytest.raises(UserError, match="has no data_batch_1.bin .. data_batch_5.bin"):
        create_dataset(str(tmp_path), True)
    with pytest.raises(UserError, match="has no test_batch.bin"):
        create_dataset(str(tmp_path), False)


def test_truncated_file_is_one_clear_line(cifar_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(cifar_dir / "test_batch.bin", broken / "test_batch.bin")
    with open(broken / "test_batch.bin", "r+b") as handle:
        handle.truncate(FILE_BYTES - 1000)
    with pytest.raises(UserError) as caught:
        cifar_files(str(broken), training=False)
    assert "test_batch.bin is truncated" in str(caught.value) and f"{FILE_BYTES:,}" in str(caught.value)


def test_zoo_split_layout_evaluates_from_a_folder_with_only_test_batch(cifar_dir, tmp_path):
    verify = tmp_path / "cifar-10-verify-bin"
    verify.mkdir()
    (verify / "test_batch.bin").symlink_to(cifar_dir / "test_batch.bin")
    dataset = create_dataset(str(verify), False, batch_size=10, image_size=(32, 32), num_samples=10)
    assert dataset.get_dataset_size() == 1


def test_fewer_images_than_one_batch_is_refused(cifar_dir):
    with pytest.raises(UserError, match="fewer than one batch"):
        create_dataset(str(cifar_dir), True, batch_size=32, num_samples=16)


def test_worker_count_is_clamped_to_the_cores(cifar_dir):
    # More workers than cores makes mindspore.dataset raise ValueError; the pipeline must still build.
    dataset = create_dataset(str(cifar_dir), False, batch_size=4, image_size=(32, 32), num_samples=4,
                             num_parallel_workers=512)
    assert len(batches(dataset)) == 1

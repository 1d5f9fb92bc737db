"""Training augmentation beyond the reference recipe, each part off by default: an automatic policy
(AutoAugment's CIFAR-10 policy, RandAugment, TrivialAugmentWide), random erasing, and MixUp / CutMix.

Where the parts run in create_dataset's training pipeline:
- the policy: MindSpore's own C++ ops (mindspore.dataset.vision), on the uint8 32x32 image after the reference
  RandomCrop and RandomHorizontalFlip, before Resize and Normalize (torchvision's CIFAR placement). They draw from
  mindspore.dataset's global seed, which create_dataset sets from (seed, epoch).
- random erasing, MixUp and CutMix: numpy, on each batch of normalized CHW images (batch's per_batch_map), with a
  generator keyed by (seed, epoch, rank, batch index). They follow torchvision (RandomErasing; the reference
  scripts' RandomMixUp and RandomCutMix). MindSpore's own ops are not used for these: vision.RandomErasing is a
  Python op drawing from Python's global `random`, so with two workers (or any other user of `random`) it
  differs from run to run; vision.MixUpBatch stops the pipeline with "addition of variable(x1 and x2) of Gamma
  should not be 0" after some batches for alpha below 0.5 (after about 60 batches at 0.2, the usual value).

With MixUp or CutMix on, training labels become soft float32 class weights (batch, class_num); the loss
(nn.CrossEntropyLoss, label smoothing included) takes them as they are. Evaluation is untouched.
"""
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

AUTO_AUGMENT = ("none", "autoaugment", "randaugment", "trivialaugment")
RANDAUGMENT_BINS = 31  # RandAugment's num_magnitude_bins (MindSpore's and torchvision's default): magnitude 0..30
# torchvision.transforms.RandomErasing's defaults (and vision.RandomErasing's): erased area share, aspect ratio,
# value (0 on normalized images: the dataset's mean colour), tries to fit a box.
ERASE_SCALE = (0.02, 0.33)
ERASE_RATIO = (0.3, 3.3)
ERASE_ATTEMPTS = 10
# Seeds of the batch-level generator: a stream of its own next to shard_indices' and augmentation_seed's.
BATCH_STREAM = 2
ERASE_DRAWS, MIX_DRAWS = 0, 1


@dataclass(frozen=True)
class Augmentation:
    """The training augmentation keys of the configuration (see default_config.yaml)."""
    auto_augment: str = "none"
    randaugment_num_ops: int = 2
    randaugment_magnitude: int = 9
    random_erasing: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mixup_switch_prob: float = 0.5
    class_num: int = 10

    @classmethod
    def from_config(cls, config) -> "Augmentation":
        return cls(config.auto_augment, config.randaugment_num_ops, config.randaugment_magnitude,
                   config.random_erasing, config.mixup_alpha, config.cutmix_alpha, config.mixup_switch_prob,
                   config.class_num)

    @property
    def mixes(self) -> bool:
        """MixUp or CutMix is on: the training labels are soft (batch, class_num) float32."""
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    @property
    def per_batch(self) -> bool:
        """Some part runs on the batches (random erasing, MixUp, CutMix)."""
        return self.random_erasing > 0 or self.mixes

    def policy_ops(self) -> list:
        """MindSpore's ops of auto_augment, for uint8 HWC images (empty for none)."""
        from mindspore.dataset import vision  # here: the config loader imports this module's names, not MindSpore
        if self.auto_augment == "autoaugment":
            return [vision.AutoAugment(vision.AutoAugmentPolicy.CIFAR10)]
        if self.auto_augment == "randaugment":
            return [vision.RandAugment(num_ops=self.randaugment_num_ops, magnitude=self.randaugment_magnitude,
                                       num_magnitude_bins=RANDAUGMENT_BINS)]
        if self.auto_augment == "trivialaugment":
            return [vision.TrivialAugmentWide(num_magnitude_bins=RANDAUGMENT_BINS)]
        return []

    def describe(self) -> str:
        """One line for the training log: what is on beyond the reference crop and flip."""
        parts = []
        if self.auto_augment == "autoaugment":
            parts.append("AutoAugment (CIFAR-10 policy)")
        elif self.auto_augment == "randaugment":
            parts.append(f"RandAugment ({self.randaugment_num_ops} ops, magnitude {self.randaugment_magnitude})")
        elif self.auto_augment == "trivialaugment":
            parts.append("TrivialAugmentWide")
        if self.random_erasing > 0:
            parts.append(f"random erasing p={self.random_erasing:g}")
        if self.mixup_alpha > 0 and self.cutmix_alpha > 0:
            parts.append(f"MixUp alpha {self.mixup_alpha:g} or CutMix alpha {self.cutmix_alpha:g} per batch "
                         f"(CutMix with probability {self.mixup_switch_prob:g})")
        elif self.mixup_alpha > 0:
            parts.append(f"MixUp alpha {self.mixup_alpha:g}")
        elif self.cutmix_alpha > 0:
            parts.append(f"CutMix alpha {self.cutmix_alpha:g}")
        return ", ".join(parts) if parts else "none beyond the reference crop and flip"


def erase_box(rng: np.random.Generator, height: int, width: int) -> Optional[Tuple[int, int, int, int]]:
    """(top, left, box height, box width) of a random erasing box, as torchvision's RandomErasing.get_params
    draws it; None when no box fitted in ERASE_ATTEMPTS tries (the image stays as it is)."""
    area = height * width
    log_ratio = np.log(ERASE_RATIO)
    for _ in range(ERASE_ATTEMPTS):
        erase_area = area * rng.uniform(*ERASE_SCALE)
        aspect = np.exp(rng.uniform(*log_ratio))
        box_h = int(round(np.sqrt(erase_area * aspect)))
        box_w = int(round(np.sqrt(erase_area / aspect)))
        if box_h < height and box_w < width:
            return int(rng.integers(0, height - box_h + 1)), int(rng.integers(0, width - box_w + 1)), box_h, box_w
    return None


def cutmix_box(rng: np.random.Generator, lam: float, height: int, width: int) -> Tuple[int, int, int, int]:
    """(y1, y2, x1, x2) of the pasted box for CutMix's lam, as torchvision's reference RandomCutMix: a centre
    anywhere in the image, sides sqrt(1 - lam) of the image's, clipped at the borders."""
    centre_x, centre_y = int(rng.integers(width)), int(rng.integers(height))
    half = 0.5 * np.sqrt(1.0 - lam)
    half_w, half_h = int(half * width), int(half * height)
    return (max(centre_y - half_h, 0), min(centre_y + half_h, height),
            max(centre_x - half_w, 0), min(centre_x + half_w, width))


class BatchAugmenter:
    """batch()'s per_batch_map for random erasing, then MixUp or CutMix, on (images NCHW float32, labels int32).

    Every draw comes from a generator keyed by (seed, epoch, rank_id, batch index): the same batch gets the same
    erasing and mixing in any run, with any number of workers, also when a resumed run skips the batches before.
    """

    def __init__(self, augment: Augmentation, seed: int, epoch: int, rank_id: int = 0) -> None:
        self.augment = augment
        self.key = (seed, epoch, BATCH_STREAM, rank_id)

    def generator(self, batch_index: int, draws: int) -> np.random.Generator:
        return np.random.default_rng([*self.key, batch_index, draws])

    def __call__(self, images: Sequence[np.ndarray], labels: Sequence[np.ndarray], batch_info):
        return self.apply(np.stack(images), np.stack(labels), batch_info.get_batch_num())

    def apply(self, images: np.ndarray, labels: np.ndarray, batch_index: int) -> Tuple[np.ndarray, np.ndarray]:
        """The augmented (images, labels) of batch batch_index: labels soft (batch, class_num) when mixing."""
        augment = self.augment
        images = np.ascontiguousarray(images, np.float32)  # np.stack's own array: written in place
        if augment.random_erasing > 0:
            self.erase(images, self.generator(batch_index, ERASE_DRAWS))
        if not augment.mixes:
            return images, labels
        return self.mix(images, labels, self.generator(batch_index, MIX_DRAWS))

    def erase(self, images: np.ndarray, rng: np.random.Generator) -> None:
        """Random erasing in place: each image, with probability random_erasing, gets a box set to 0."""
        _, _, height, width = images.shape
        for image in images:
            if rng.random() < self.augment.random_erasing:
                box = erase_box(rng, height, width)
                if box is not None:
                    top, left, box_h, box_w = box
                    image[:, top:top + box_h, left:left + box_w] = 0.0

    def mix(self, images: np.ndarray, labels: np.ndarray,
            rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
        """MixUp or CutMix of the batch with itself rolled by one image, as torchvision's reference scripts: one
        lam ~ Beta(alpha, alpha) per batch; CutMix's lam is then the share of the image left outside the box."""
        augment = self.augment
        use_cutmix = augment.cutmix_alpha > 0 and (augment.mixup_alpha == 0 or rng.random() < augment.mixup_switch_prob)
        alpha = augment.cutmix_alpha if use_cutmix else augment.mixup_alpha
        lam = float(rng.beta(alpha, alpha))
        if use_cutmix:
            _, _, height, width = images.shape
            y1, y2, x1, x2 = cutmix_box(rng, lam, height, width)
            images[:, :, y1:y2, x1:x2] = np.roll(images[:, :, y1:y2, x1:x2], 1, axis=0)
            lam = 1.0 - (y2 - y1) * (x2 - x1) / (height * width)
        else:
            partners = np.roll(images, 1, axis=0)
            images *= np.float32(lam)
            partners *= np.float32(1.0 - lam)
            images += partners
        targets = np.eye(augment.class_num, dtype=np.float32)[labels.astype(np.int64)]
        targets = targets * np.float32(lam) + np.roll(targets, 1, axis=0) * np.float32(1.0 - lam)
        return images, targets


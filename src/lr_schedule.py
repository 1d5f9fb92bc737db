"""Per-step learning rates: linear warmup, then constant, cosine, step or poly decay; or one cycle.

The whole schedule is one array indexed by the optimizer's global step, so resuming from a checkpoint
(which stores the global step) continues at the same point of the schedule.
"""
import math

import numpy as np


ONECYCLE_DIV_FACTOR = 25.0  # torch's OneCycleLR default: the cycle starts at base_lr / 25


def build_lr_schedule(schedule: str, base_lr: float, epochs: int, steps_per_epoch: int, warmup_epochs: int = 0,
                      lr_min: float = 0.0, step_epochs: int = 30, gamma: float = 0.1,
                      poly_power: float = 2.0, onecycle_pct_start: float = 0.3) -> np.ndarray:
    """float32 array of epochs * steps_per_epoch learning rates.

    constant: base_lr. cosine: base_lr down to lr_min along half a cosine. step: base_lr * gamma **
    (epoch // step_epochs), as torch's StepLR. poly: lr_min + (base_lr - lr_min) * (1 - t) ** poly_power.
    Warmup rises linearly to base_lr over warmup_epochs; decay runs over the steps after it.
    onecycle: torch's OneCycleLR with cosine annealing (no warmup of its own): from base_lr / 25 up to base_lr
    over the first onecycle_pct_start of the steps, then down to lr_min.
    """
    total = epochs * steps_per_epoch
    if schedule == "onecycle":
        return _one_cycle(base_lr, total, lr_min, onecycle_pct_start).astype(np.float32)
    warmup = min(warmup_epochs * steps_per_epoch, total)
    rates = np.empty(total, np.float64)
    rates[:warmup] = base_lr * (np.arange(warmup) + 1) / max(warmup, 1)
    decay_steps = total - warmup
    progress = np.arange(decay_steps) / max(decay_steps, 1)  # 0 .. just under 1
    if schedule == "constant":
        rates[warmup:] = base_lr
    elif schedule == "cosine":
        rates[warmup:] = lr_min + (base_lr - lr_min) * 0.5 * (1.0 + np.cos(math.pi * progress))
    elif schedule == "step":
        epoch_of_step = np.arange(warmup, total) // steps_per_epoch
        rates[warmup:] = base_lr * gamma ** (epoch_of_step // step_epochs)
    elif schedule == "poly":
        rates[warmup:] = lr_min + (base_lr - lr_min) * (1.0 - progress) ** poly_power
    else:
        raise ValueError(f"unknown lr_schedule {schedule!r}")
    return rates.astype(np.float32)


def _one_cycle(max_lr: float, total: int, final_lr: float, pct_start: float) -> np.ndarray:
    # As torch.optim.lr_scheduler.OneCycleLR: the rise ends at step pct_start * total - 1, each phase a half cosine.
    start_lr = max_lr / ONECYCLE_DIV_FACTOR
    peak = max(float(pct_start * total) - 1.0, 1.0)
    steps = np.arange(total, dtype=np.float64)
    rising = start_lr + (max_lr - start_lr) * 0.5 * (1.0 - np.cos(math.pi * np.minimum(steps / peak, 1.0)))
    fall = np.clip((steps - peak) / max(total - 1 - peak, 1.0), 0.0, 1.0)
    falling = final_lr + (max_lr - final_lr) * 0.5 * (1.0 + np.cos(math.pi * fall))
    return np.where(steps <= peak, rising, falling)


def schedule_from_config(config, steps_per_epoch: int) -> np.ndarray:
    return build_lr_schedule(config.lr_schedule, config.lr, config.epoch_size, steps_per_epoch,
                             config.warmup_epochs, config.lr_min, config.lr_step_epochs, config.lr_gamma,
                             config.lr_poly_power, config.onecycle_pct_start)

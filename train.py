"""Trains a ResNet on CIFAR-10 as configured: python train.py [--config_path FILE] [--key value ...]."""
from pathlib import Path

from src.atomic_file import DiskFullError
from src.model_utils.config import load_config
from src.output_lock import output_folder_lock
from src.trainer import run_training
from src.utils import get_logger, init_env, launcher_rank, run_cli


def main() -> int:
    config = load_config(prog="train.py")
    rank = launcher_rank()
    # Taken before anything is written to output_path (train.log first): a second run there is refused untouched.
    with output_folder_lock(config.output_path, rank):
        logger = get_logger(config.output_path, "train.log", rank_id=rank)
        env = init_env(config, logger, training=True)
        try:
            return run_training(config, env, logger)
        except DiskFullError as full:
            last = Path(config.output_path) / f"{config.model_name}-last.ckpt"  # the trainer's resume point
            raise full.with_then_what(f"resume with --resume {last}" if last.is_file() else "run again") from None


if __name__ == "__main__":
    run_cli(main)

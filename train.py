"""Trains a ResNet on CIFAR-10 as configured: python train.py [--config_path FILE] [--key value ...]."""
from src.model_utils.config import load_config
from src.trainer import run_training
from src.utils import get_logger, init_env, launcher_rank, run_cli


def main() -> int:
    config = load_config(prog="train.py")
    logger = get_logger(config.output_path, "train.log", rank_id=launcher_rank())
    env = init_env(config, logger)
    return run_training(config, env, logger)


if __name__ == "__main__":
    run_cli(main)

"""Evaluates a checkpoint on the CIFAR-10 test set; the last stdout line is the result as JSON.

python eval.py --checkpoint_path output/resnet50-best.ckpt [--config_path FILE] [--key value ...]
"""
import json

from src.evaluation import run_evaluation
from src.model_utils.config import load_config
from src.utils import get_logger, init_env, launcher_rank, run_cli


def main() -> int:
    config = load_config(prog="eval.py")
    logger = get_logger(config.output_path, "eval.log", rank_id=launcher_rank())
    env = init_env(config, logger)
    result = run_evaluation(config, env, logger)
    if env.is_main_rank:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)

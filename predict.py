"""Classifies image files with a checkpoint or an exported .mindir; one line per image, then a JSON summary.

python predict.py --checkpoint_path output/resnet50-best.ckpt [--image_height 32 --image_width 32]
                  [--top_k 3] [--class_names_file names.txt] image.png photo.jpg ...
Exit codes: 0 all classified, 1 some files were not images (each named on one 'error:' line, the others
classified), 2 refused (model, class names, configuration).
"""
import json

from src.inference import run_predict
from src.model_utils.config import load_config
from src.utils import get_logger, init_env, run_cli


def main() -> int:
    config = load_config(prog="predict.py", positional="images")
    if config.checkpoint_path.lower().endswith(".mindir"):  # an exported graph runs MindSpore's own Conv2D
        config = config.replace(conv_implementation="mindspore")
    logger = get_logger(None, rank_id=0)  # console only: predict writes no files
    env = init_env(config, logger)  # also the oneDNN speed setting, before the first convolution
    code, summary = run_predict(config, env, logger)
    print(json.dumps(summary), flush=True)
    return code


if __name__ == "__main__":
    run_cli(main)

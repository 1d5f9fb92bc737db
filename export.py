"""Exports a checkpoint to MINDIR, ONNX or AIR under output_path; the last stdout line is a JSON summary.

python export.py --checkpoint_path output/resnet50-best.ckpt --file_format MINDIR|ONNX|AIR
                 [--file_name NAME] [--batch_size B] [--dynamic_batch] [--verify] [--key value ...]
Exit codes: 0 written, 1 --verify found a difference above tolerance (nothing written), 2 refused.
"""
import json

from src.exporting import check_export_request, run_export
from src.model_utils.config import load_config
from src.utils import get_logger, init_env, run_cli


def main() -> int:
    # Exported files hold MindSpore's own Conv2D, whatever conv_implementation says: they must run anywhere.
    config = load_config(prog="export.py").replace(conv_implementation="mindspore")
    # Refusals that need no device come before MindSpore starts up.
    check_export_request(config.file_format, config.dynamic_batch, config.verify, config.checkpoint_path)
    logger = get_logger(None, rank_id=0)  # console only: the exported file is the output
    env = init_env(config, logger)  # also the oneDNN speed setting, before the first convolution
    code, summary = run_export(config, env, logger)
    print(json.dumps(summary), flush=True)
    return code


if __name__ == "__main__":
    run_cli(main)

"""Converts a PyTorch/torchvision ResNet .pth to this project's MindSpore .ckpt, or back with --reverse.

python convert_pth.py --pth_path in.pth --ckpt_path out.ckpt [--model_name resnet50] [--num_classes N]
                      [--drop_head] [--verify [--tolerance T] [--image_size S]]
python convert_pth.py --reverse --ckpt_path in.ckpt --pth_path out.pth [--verify]

The .pth is read with torch.load(weights_only=True): nothing in it is executed. Every tensor must map onto a
parameter of the architecture with the same shape and every parameter must be there, else the unmatched names
are listed and nothing is written. --verify runs torchvision's network with the .pth and ours with the .ckpt
on the same random batch in eval mode and fails (exit code 1, no output file) above the tolerance.

Weights with a 3x3 conv1 have the cifar stem (--stem cifar in this project): torchvision's network is then built with
conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False) and maxpool = nn.Identity() for --verify.
"""
import argparse
import sys
from typing import List, Optional

from src.architectures import MODEL_NAMES as ARCHITECTURES
from src.errors import OneLineArgumentParser, UserError, run_cli
from src.weights.convert import (DEFAULT_TOLERANCE, Comparison, Conversion, VerificationFailed, convert_ckpt_to_pth,
                                 convert_pth_to_ckpt, torchvision_available, verify_against_torchvision)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _image_size(text: str) -> int:
    value = _positive_int(text)
    if value < 32:  # ResNet's five stride-2 stages need 32 pixels to leave one
        raise argparse.ArgumentTypeError(f"must be at least 32, got {value}")
    return value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="convert_pth.py", description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pth_path", required=True, help="the PyTorch file (input; output with --reverse)")
    parser.add_argument("--ckpt_path", required=True, help="the MindSpore file (output; input with --reverse)")
    parser.add_argument("--model_name", choices=ARCHITECTURES, default=None,
                        help="architecture; default: the one the file's names show (checked when given)")
    parser.add_argument("--num_classes", type=_positive_int, default=None,
                        help="class count; default: fc.weight's rows. Another count needs --drop_head")
    parser.add_argument("--drop_head", action="store_true",
                        help="leave fc out of the .ckpt (fine-tuning to another class count)")
    parser.add_argument("--reverse", action="store_true",
                        help=".ckpt -> .pth that torchvision's load_state_dict(strict=True) accepts")
    parser.add_argument("--verify", action="store_true",
                        help="compare eval-mode logits of torchvision's network and ours (needs torchvision)")
    parser.add_argument("--tolerance", type=_tolerance, default=DEFAULT_TOLERANCE,
                        help="--verify: largest accepted max|logit difference| / max|torch logit| "
                             f"(default {DEFAULT_TOLERANCE:g})")
    parser.add_argument("--image_size", type=_image_size, default=None,
                        help="--verify: height and width of the random batch (default 224; 32 for weights with the "
                             "cifar stem, a 3x3 conv1)")
    return parser


def _print_conversion(conversion: Conversion, source: str, target: str, reverse: bool) -> None:
    for note in conversion.notes:
        print(f"note: {note}")
    head = f"{conversion.num_classes} classes" if conversion.has_head else "no head (--drop_head)"
    what = "tensors (torchvision names)" if reverse else "parameters"
    stem = f" ({conversion.stem} stem)" if conversion.stem != "imagenet" else ""
    print(f"converted {source} -> {target}: {conversion.model_name}{stem}, {head}, {len(conversion.weights)} {what}",
          flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.reverse and args.drop_head:
        raise UserError("--drop_head applies to .pth -> .ckpt only: --reverse writes a .pth torchvision loads "
                        "with strict=True, which needs the head")
    if args.verify and not torchvision_available():
        raise UserError("--verify needs torchvision (pip install -r requirements-dev.txt); nothing was written. "
                        "Run without --verify to convert only")
    if args.verify:
        import mindspore as ms
        from src.utils import apply_cpu_speed_setting
        apply_cpu_speed_setting()  # before MindSpore's first convolution: oneDNN reads it once
        # Compare like with like: torch runs on the CPU in float32, so ours does too (an accelerator's
        # reduced-precision convolutions would measure the device, not the conversion); one forward per network
        # needs no graph compilation.
        ms.set_device("CPU")
        ms.set_context(mode=ms.PYNATIVE_MODE)

    measured: List[Comparison] = []
    check = verify_against_torchvision(args.tolerance, args.image_size, report=measured.append) \
        if args.verify else None
    source, target = (args.ckpt_path, args.pth_path) if args.reverse else (args.pth_path, args.ckpt_path)
    try:
        if args.reverse:
            conversion = convert_ckpt_to_pth(args.ckpt_path, args.pth_path, args.model_name, args.num_classes,
                                             check=check)
        else:
            conversion = convert_pth_to_ckpt(args.pth_path, args.ckpt_path, args.model_name, args.num_classes,
                                             args.drop_head, check=check)
    except VerificationFailed as failure:
        print(f"verify FAILED: {failure.comparison.describe()}; {target} was not written", file=sys.stderr,
              flush=True)
        return 1
    _print_conversion(conversion, source, target, args.reverse)
    if measured:
        print(f"verify passed: {measured[0].describe()}", flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)

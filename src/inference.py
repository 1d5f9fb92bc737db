"""Classification of image files with a checkpoint (.ckpt, .pth: anything src.weights.loading reads)
or an exported .mindir, preprocessed exactly as evaluation preprocesses CIFAR-10's test images.

Images are decoded by OpenCV (any size, grey or colour, jpg/png/bmp/...), converted to RGB (the order of
CIFAR-10's planes and so of what the network was trained on), then go through the evaluation transforms of
src/dataset.py: Resize (bilinear) to the network's input size unless already that size, Rescale 1/255,
Normalize with CIFAR-10's mean/std, HWC2CHW. The same mindspore.dataset.vision ops run here eagerly, so a
CIFAR test image saved as PNG gets the logits eval.py's pipeline gives it.
"""
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from src.dataset import eval_transforms
from src.errors import UserError

# Not models: a clearer refusal than "damaged checkpoint" for files people may try by mistake.
UNSUPPORTED_MODEL_SUFFIXES = {".onnx": "run ONNX files with onnxruntime", ".air": "AIR files run on Ascend only"}


class ImageError(Exception):
    """One input file could not be read as an image: reported on one line, the other files go on."""


# ---------------------------------------------------------------- decoding and preprocessing

def read_image(path: str) -> np.ndarray:
    """The image at path as RGB uint8 HWC (grey images get three equal channels). Raises ImageError.

    The bytes are read here and decoded with cv2.imdecode, which uses the same decoders and flags as
    cv2.imread, because imread answers None for every failure alike: a missing file, a directory, no read
    permission and a non-image get different messages this way (and non-ASCII paths work on Windows).
    """
    import cv2
    file = Path(path)
    try:
        data = np.fromfile(str(file), dtype=np.uint8)
    except FileNotFoundError:
        raise ImageError("no such file") from None
    except IsADirectoryError:
        raise ImageError("is a directory, not an image file") from None
    except PermissionError:
        raise ImageError("cannot be read (permission denied)") from None
    except OSError as exc:
        raise ImageError(f"cannot be read ({exc.strerror or exc})") from None
    if data.size == 0:
        raise ImageError("is empty (0 bytes)")
    try:
        # IMREAD_COLOR: 3 channels whatever the file holds (grey is replicated, alpha dropped, 16-bit
        # scaled to 8-bit), EXIF orientation applied.
        image = cv2.imdecode(data, cv2.IMREAD_COLOR)
    except cv2.error:
        image = None
    if image is None:
        raise ImageError("is not an image OpenCV can decode (jpg, png, bmp, ...)")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)  # OpenCV decodes to BGR; the network was trained on RGB


def preprocess(image: np.ndarray, target_hw: Tuple[int, int]) -> np.ndarray:
    """RGB uint8 HWC -> the network's float32 CHW input, as evaluation computes it."""
    for transform in eval_transforms(target_hw, source_hw=image.shape[:2]):
        image = transform(image)
    return np.asarray(image, dtype=np.float32)


# ---------------------------------------------------------------- class names

def load_class_names(path: str, class_num: int) -> Sequence[str]:
    """Class names: one per line of path (trailing blank lines ignored), or CIFAR-10's when path is empty.

    Raises UserError when the file is missing or its count differs from the model's class count.
    """
    from src.dataset import class_names
    if not path:
        return class_names(class_num)
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8-sig").splitlines()
    except FileNotFoundError:
        raise UserError(f"class_names_file {file} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"class_names_file {file} cannot be read as UTF-8 text ({exc})") from None
    names = [line.strip() for line in lines]
    while names and not names[-1]:
        names.pop()
    if len(names) != class_num:
        raise UserError(f"class_names_file {file} has {len(names)} names, the model has {class_num} classes: "
                        "give one name per line, in class-index order")
    empty = [str(index + 1) for index, name in enumerate(names) if not name]
    if empty:
        raise UserError(f"class_names_file {file} has empty lines among the names (line {', '.join(empty[:3])})")
    return tuple(names)


# ---------------------------------------------------------------- models

@dataclass
class Classifier:
    """A model that maps a float32 NCHW batch to logits, with what the caller must know to feed it."""
    run: Callable[[np.ndarray], np.ndarray]
    image_size: Tuple[int, int]
    class_num: int
    fixed_batch: Optional[int]  # the only batch size the model takes, or None for any
    description: str

    def logits(self, images: np.ndarray, batch_size: int) -> np.ndarray:
        """Logits for images (N, 3, H, W), fed in batches of batch_size (of the model's fixed batch if it has one).

        A short last batch is padded with zeros up to the batch size and the padding's outputs dropped:
        a fixed-batch model needs that, and a network in graph mode is then not compiled a second time
        for the odd size. In inference mode each image's output depends on that image only.
        """
        size = self.fixed_batch or batch_size
        outputs = []
        for start in range(0, len(images), size):
            batch = images[start:start + size]
            count = len(batch)
            if count < size:
                batch = np.concatenate([batch, np.zeros((size - count, *batch.shape[1:]), batch.dtype)])
            outputs.append(np.asarray(self.run(np.ascontiguousarray(batch)))[:count])
        return np.concatenate(outputs) if outputs else np.zeros((0, self.class_num), np.float32)


def network_classifier(checkpoint_path: str, model_name: str, class_num: int, image_size: Tuple[int, int],
                       logger: Optional[logging.Logger] = None, sha256: str = "",
                       conv_implementation: str = "mindspore", stem: str = "imagenet",
                       read: Optional[Tuple[Dict, Optional[str]]] = None, use_ema: bool = True,
                       semantics: str = "torch") -> Classifier:
    """The network with a checkpoint's weights (its EMA weights when it has them and use_ema), loaded through
    src.weights.loading.load_weights_report (any format it reads: this project's .ckpt, PyTorch .pth, models-zoo
    and mindcv checkpoints). read: the file as read_weight_file returned it, when the caller has read it already.
    semantics: the network's (src/architectures.py SEMANTICS; checkpoint_semantics tells a checkpoint's)."""
    import mindspore as ms
    from src.fused_inference import inference_network
    from src.resnet import build_resnet
    from src.weights.loading import load_weights_report
    net = build_resnet(model_name, class_num, conv_implementation=conv_implementation, stem=stem, semantics=semantics)
    load_weights_report(net, checkpoint_path, model_name, logger, sha256=sha256, read=read, use_ema=use_ema)
    inference_net = inference_network(net)  # in inference mode; fused into one native call a layer when it can
    return Classifier(run=lambda batch: inference_net(ms.Tensor(batch)).asnumpy(), image_size=tuple(image_size),
                      class_num=class_num, fixed_batch=None, description=f"{model_name} from {checkpoint_path}")


def mindir_signature(path: str) -> Tuple[List[int], List[int]]:
    """(input dims, output dims) recorded in a MindIR file, -1 for a dynamic dimension. Raises UserError.

    Parsed with MindSpore's own protobuf schema: it refuses a damaged file in one line before ms.load
    (which prints a C++ error) and tells the input size and batch the model was exported with.
    """
    from google.protobuf.message import DecodeError
    from mindspore.train import mind_ir_pb2
    file = Path(path)
    if not file.is_file():
        raise UserError(f"model {file} does not exist")
    model = mind_ir_pb2.ModelProto()
    try:
        model.ParseFromString(file.read_bytes())
    except (DecodeError, ValueError):
        raise UserError(f"{file} is damaged or not a MindIR file (it does not parse); export it again "
                        "with export.py") from None
    graph = model.graph
    if len(graph.input) != 1 or not graph.input[0].tensor or not graph.output or not graph.output[0].tensor:
        raise UserError(f"{file} is not a single-input image classifier MindIR (inputs: {len(graph.input)})")
    inputs = [int(d) for d in graph.input[0].tensor[0].dims]
    outputs = [int(d) for d in graph.output[0].tensor[0].dims]
    if len(inputs) != 4 or inputs[1] not in (3, -1) or len(outputs) != 2:
        raise UserError(f"{file} takes input {inputs} and gives {outputs}: expected an image classifier "
                        "with input (N, 3, H, W) and output (N, classes)")
    return inputs, outputs


def mindir_classifier(path: str, image_size: Tuple[int, int], class_num: int, sha256: str = "") -> Classifier:
    """An exported .mindir through nn.GraphCell. Input size, fixed batch and class count come from the file;
    image_size and class_num only fill in dimensions the file leaves dynamic. sha256 pins the file."""
    import mindspore as ms
    from mindspore import nn
    from src.weights.files import verify_sha256
    inputs, outputs = mindir_signature(path)
    verify_sha256(Path(path), sha256)
    size = (inputs[2] if inputs[2] > 0 else image_size[0], inputs[3] if inputs[3] > 0 else image_size[1])
    try:
        graph = nn.GraphCell(ms.load(str(path)))
    except (RuntimeError, ValueError, TypeError):
        raise UserError(f"{path} is damaged or not a MindIR file MindSpore can load; export it again") from None
    return Classifier(run=lambda batch: graph(ms.Tensor(batch)).asnumpy(), image_size=(int(size[0]), int(size[1])),
                      class_num=outputs[1] if outputs[1] > 0 else class_num,
                      fixed_batch=inputs[0] if inputs[0] > 0 else None, description=f"MindIR {path}")


def is_mindir(model_path: str) -> bool:
    """Whether model_path is an exported .mindir (True) or a checkpoint (False). Raises UserError for no path and
    for model files predict.py cannot run."""
    if not model_path:
        raise UserError("no model given: pass --checkpoint_path FILE (.ckpt, .pth or an exported .mindir)")
    suffix = Path(model_path).suffix.lower()
    if suffix in UNSUPPORTED_MODEL_SUFFIXES:
        raise UserError(f"predict.py cannot run {model_path}: {UNSUPPORTED_MODEL_SUFFIXES[suffix]}; "
                        "pass a .ckpt, a .pth or a .mindir")
    return suffix == ".mindir"


def load_classifier(model_path: str, model_name: str, class_num: int, image_size: Tuple[int, int],
                    logger: Optional[logging.Logger] = None, sha256: str = "",
                    conv_implementation: str = "mindspore", stem: str = "imagenet",
                    read: Optional[Tuple[Dict, Optional[str]]] = None, use_ema: bool = True,
                    semantics: str = "torch") -> Classifier:
    """A .mindir runs as exported (its stem and input size are in the graph); anything else is a checkpoint for
    load_weights_report. Raises UserError."""
    if is_mindir(model_path):
        return mindir_classifier(model_path, image_size, class_num, sha256)
    return network_classifier(model_path, model_name, class_num, image_size, logger, sha256, conv_implementation,
                              stem, read, use_ema, semantics)


# ---------------------------------------------------------------- prediction

def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64 (exact enough that probabilities sum to 1 to ~1e-15)."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def top_k(probabilities: np.ndarray, k: int) -> List[int]:
    """Indices of the k largest probabilities, largest first; ties keep class order."""
    return [int(i) for i in np.argsort(-probabilities, kind="stable")[:k]]


@dataclass
class Predictions:
    paths: List[str] = field(default_factory=list)
    logits: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    errors: List[Tuple[str, str]] = field(default_factory=list)  # (path, why it was not classified)


def predict_files(classifier: Classifier, paths: Sequence[str], batch_size: int,
                  on_error: Optional[Callable[[str, str], None]] = None) -> Predictions:
    """Logits of every path that decodes, batch by batch (memory for one batch of inputs, whatever the
    number of files); the others are reported through on_error(path, reason) and collected, never raised."""
    # A batch no larger than the number of files: one image is not padded to a batch of 32.
    size = classifier.fixed_batch or max(1, min(batch_size, len(paths)))
    result = Predictions()
    logits: List[np.ndarray] = []
    pending: List[np.ndarray] = []

    def run_pending() -> None:
        logits.append(classifier.logits(np.stack(pending), size))
        pending.clear()

    for path in paths:
        try:
            pending.append(preprocess(read_image(path), classifier.image_size))
        except ImageError as exc:
            result.errors.append((path, str(exc)))
            if on_error:
                on_error(path, str(exc))
            continue
        result.paths.append(path)
        if len(pending) == size:
            run_pending()
    if pending:
        run_pending()
    if logits:
        result.logits = np.concatenate(logits)
    return result


def format_line(path: str, probabilities: np.ndarray, names: Sequence[str], k: int) -> str:
    """'path: name1 0.912, name2 0.041, ...' for the top k classes."""
    return f"{path}: " + ", ".join(f"{names[i]} {probabilities[i]:.3f}" for i in top_k(probabilities, k))


def run_predict(config, env, logger: logging.Logger) -> Tuple[int, Dict]:
    """predict.py's work after init_env: (exit code, summary). Exit code 1 when any file was not classified."""
    paths = list(config.arguments)
    if not paths:
        raise UserError("no images given: python predict.py --checkpoint_path MODEL image.png [more images ...]")
    # The model first: its class count decides how many names the class_names_file must have. A checkpoint's
    # recorded stem and input size apply unless set.
    read, semantics = None, "torch"
    if not is_mindir(config.checkpoint_path):
        from src.weights.loading import checkpoint_semantics, read_weight_file, settings_from_checkpoint
        read = read_weight_file(config.checkpoint_path, config.checkpoint_sha256)
        config = settings_from_checkpoint(config, read[0], config.checkpoint_path, logger)
        semantics = checkpoint_semantics(read, config.checkpoint_path, logger)  # a foreign zoo's home network
    classifier = load_classifier(config.checkpoint_path, config.model_name, config.class_num,
                                 (config.image_height, config.image_width), logger, config.checkpoint_sha256,
                                 env.conv_implementation, config.stem, read, config.use_ema, semantics)
    names = load_class_names(config.class_names_file, classifier.class_num)
    logger.info("classifying %d file(s) with %s at %dx%d", len(paths), classifier.description,
                *classifier.image_size)

    def report(path: str, reason: str) -> None:
        print(f"error: {path}: {reason}", file=sys.stderr, flush=True)

    predictions = predict_files(classifier, paths, config.batch_size, on_error=report)
    k = min(config.top_k, classifier.class_num)
    probabilities = softmax(predictions.logits) if len(predictions.paths) else predictions.logits
    records = []
    for path, row in zip(predictions.paths, probabilities):
        print(format_line(path, row, names, k), flush=True)
        records.append({"path": path, "top_k": [{"class": names[i], "index": i, "probability": float(row[i])}
                                                for i in top_k(row, k)]})
    summary = {
        "model": str(config.checkpoint_path), "image_size": list(classifier.image_size),
        "num_classified": len(predictions.paths), "num_errors": len(predictions.errors),
        "predictions": records,
        "errors": [{"path": path, "error": reason} for path, reason in predictions.errors],
    }
    return (1 if predictions.errors else 0), summary

"""predict.py: real OpenCV decoding of generated PNG/JPEG/BMP files (colour, grey, any size), exactly the
evaluation preprocessing, checkpoints and exported MINDIR files (fixed and dynamic batch), per-file errors
that let the other files through, and each refusal."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_one_line_error, read_ckpt_entries, run_script
from test_export import make_checkpoint, network_from

SMALL = ["--model_name", "resnet18", "--image_height", "32", "--image_width", "32"]
LINE = re.compile(r"^(?P<path>.+): (?P<entries>[^:]+)$")


def cifar_test_images(cifar_dir: Path, count: int) -> np.ndarray:
    """The first count test_batch.bin records as RGB uint8 HWC images, read from the bytes directly."""
    records = np.fromfile(cifar_dir / "test_batch.bin", np.uint8, count=count * 3073).reshape(count, 3073)
    return records[:, 1:].reshape(count, 3, 32, 32).transpose(0, 2, 3, 1).copy()


def save_with_pil(image: np.ndarray, path: Path, **options) -> Path:
    """Written with Pillow from RGB (or grey) arrays: independent of OpenCV, so a BGR/RGB mix-up in predict
    cannot cancel out against the writer."""
    from PIL import Image
    Image.fromarray(image).save(path, **options)
    return path


def probabilities_of(net, rgb_images) -> np.ndarray:
    import mindspore as ms
    from src.inference import preprocess, softmax
    batch = np.stack([preprocess(image, (32, 32)) for image in rgb_images])
    return softmax(net(ms.Tensor(batch)).asnumpy())


def parse_lines(stdout: str):
    """{path: [(class name, probability), ...]} from predict.py's per-image lines."""
    parsed = {}
    for line in stdout.splitlines():
        match = LINE.match(line)
        if match and not line.startswith("{") and not re.match(r"^\d{4}-\d\d-\d\d ", line):
            entries = [entry.rsplit(" ", 1) for entry in match.group("entries").split(", ")]
            parsed[match.group("path")] = [(name, float(value)) for name, value in entries]
    return parsed


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "r18.ckpt")


@pytest.fixture(scope="module")
def reference_net(checkpoint):
    return network_from(checkpoint)


@pytest.fixture(scope="module")
def images(tmp_path_factory, cifar_dir):
    """Generated files of every kind predict must read, and the RGB pixels each one holds."""
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(5)
    colour = cifar_test_images(cifar_dir, 2)
    grey = rng.integers(0, 256, (32, 32), dtype=np.uint8)
    photo = rng.integers(0, 256, (45, 57, 3), dtype=np.uint8)  # not 32x32: goes through Resize
    photo[10:30, 15:40] = (250, 20, 20)  # a red patch: colour order matters
    files = {
        "colour.png": (save_with_pil(colour[0], folder / "colour.png"), colour[0]),
        "grey.png": (save_with_pil(grey, folder / "grey.png"), np.stack([grey] * 3, axis=-1)),
        "colour.bmp": (save_with_pil(colour[1], folder / "colour.bmp"), colour[1]),
        "photo.jpg": (save_with_pil(photo, folder / "photo.jpg", quality=95), None),
    }
    from PIL import Image
    decoded = np.asarray(Image.open(files["photo.jpg"][0]).convert("RGB"))  # what the JPEG holds after coding
    files["photo.jpg"] = (files["photo.jpg"][0], decoded)
    return files


# ---------------------------------------------------------------- decoding and preprocessing

def test_read_image_gives_rgb_for_colour_grey_and_all_formats(images):
    from src.inference import read_image
    for name, (path, pixels) in images.items():
        decoded = read_image(str(path))
        assert decoded.dtype == np.uint8 and decoded.shape == pixels.shape, name
        if name == "photo.jpg":  # lossy: libjpeg in OpenCV and Pillow may round differently
            assert np.abs(decoded.astype(int) - pixels).max() <= 2
        else:
            assert np.array_equal(decoded, pixels), name  # exact, and RGB (not OpenCV's BGR)


@pytest.mark.parametrize("image_size", [(32, 32), pytest.param((48, 40), marks=pytest.mark.slow)])
def test_png_of_cifar_test_images_gives_the_eval_pipeline_logits(cifar_dir, reference_net, tmp_path, image_size):
    """A CIFAR test image saved as PNG gets the input tensor and logits eval.py's pipeline gives it, at
    CIFAR's size (no Resize) and at another size (bilinear Resize)."""
    import mindspore as ms
    from src.dataset import create_dataset
    from src.inference import Classifier, predict_files, preprocess, read_image
    count, batch_size = 10, 4
    paths = [str(save_with_pil(image, tmp_path / f"test{index}.png"))
             for index, image in enumerate(cifar_test_images(cifar_dir, count))]
    dataset = create_dataset(str(cifar_dir), False, batch_size, image_size, num_samples=count,
                             num_parallel_workers=2)
    pipeline_inputs, pipeline_logits = [], []
    for batch, _ in dataset.create_tuple_iterator(num_epochs=1, output_numpy=True):
        pipeline_inputs.append(batch)
        pipeline_logits.append(reference_net(ms.Tensor(batch)).asnumpy())
    pipeline_inputs, pipeline_logits = np.concatenate(pipeline_inputs), np.concatenate(pipeline_logits)
    ours = np.stack([preprocess(read_image(path), image_size) for path in paths])
    assert ours.dtype == pipeline_inputs.dtype and np.array_equal(ours, pipeline_inputs)  # bit-identical inputs
    seen = []
    classifier = Classifier(run=lambda b: (seen.append(len(b)), reference_net(ms.Tensor(b)).asnumpy())[1],
                            image_size=image_size, class_num=10, fixed_batch=None, description="test")
    predictions = predict_files(classifier, paths, batch_size)
    assert predictions.paths == paths and not predictions.errors
    assert seen == [4, 4, 4]  # 10 images: the last 2 padded, so graph mode compiles one batch shape only
    assert np.max(np.abs(predictions.logits - pipeline_logits)) <= 1e-5


# ---------------------------------------------------------------- the command line

@pytest.mark.slow
def test_cli_classifies_png_grey_bmp_and_jpeg(images, checkpoint, reference_net):
    paths = [str(path) for path, _ in images.values()]
    process = run_script("predict.py", ["--checkpoint_path", str(checkpoint), *SMALL, "--top_k", "3",
                                        "--batch_size", "3", *paths])  # 4 images: a padded second batch
    assert process.returncode == 0, process.stderr[-3000:]
    assert "error:" not in process.stderr
    lines = parse_lines(process.stdout)
    assert list(lines) == paths
    summary = json.loads(process.stdout.strip().splitlines()[-1])
    assert summary["num_classified"] == 4 and summary["num_errors"] == 0 and summary["image_size"] == [32, 32]
    from src.dataset import CIFAR10_CLASSES
    expected = probabilities_of(reference_net, [pixels for _, pixels in images.values()])
    for (name, _), path, row, record in zip(images.items(), paths, expected, summary["predictions"]):
        assert record["path"] == path and len(record["top_k"]) == 3
        assert [entry["index"] for entry in record["top_k"]] == list(np.argsort(-row, kind="stable")[:3])
        got = np.array([entry["probability"] for entry in record["top_k"]])
        assert np.max(np.abs(got - row[[entry["index"] for entry in record["top_k"]]])) <= 1e-5, name
        assert [n for n, _ in lines[path]] == [CIFAR10_CLASSES[entry["index"]] for entry in record["top_k"]]
        assert [p for _, p in lines[path]] == [round(p, 3) for p in got]
    # The check above can fail: with red and blue swapped, the colour images get other probabilities.
    swapped = probabilities_of(reference_net, [images["colour.png"][1][..., ::-1]])
    assert np.max(np.abs(swapped[0] - expected[0])) > 1e-4


@pytest.mark.slow
def test_files_that_are_not_images_are_named_and_the_others_classified(images, checkpoint, tmp_path):
    notes = tmp_path / "notes.png"
    notes.write_text("not a picture\n")  # an image's suffix, text inside
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    missing = tmp_path / "missing.bmp"
    good = [str(images["colour.png"][0]), str(images["photo.jpg"][0])]
    process = run_script("predict.py", ["--checkpoint_path", str(checkpoint), *SMALL,
                                        good[0], str(notes), str(missing), str(empty), good[1]])
    assert process.returncode == 1, process.stderr[-3000:]
    assert "Traceback" not in process.stderr
    errors = [line for line in process.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {notes}: is not an image OpenCV can decode (jpg, png, bmp, ...)",
                      f"error: {missing}: no such file", f"error: {empty}: is empty (0 bytes)"]
    assert list(parse_lines(process.stdout)) == good
    summary = json.loads(process.stdout.strip().splitlines()[-1])
    assert summary["num_classified"] == 2 and [e["path"] for e in summary["errors"]] == [str(notes), str(missing),
                                                                                         str(empty)]


@pytest.mark.slow
def test_exported_mindir_with_class_names_file(images, checkpoint, reference_net, tmp_path):
    """A fixed-batch .mindir: its input size comes from the file (no --image_height given: the default 224
    would be wrong), its batch of 2 is padded for 3 images, and the names come from a file."""
    from src.exporting import export_network
    model = export_network(reference_net, tmp_path / "r18.mindir", "MINDIR", 2, (32, 32)).path
    names = [f"label-{index}" for index in range(10)]
    names_file = tmp_path / "names.txt"
    names_file.write_text("\n".join(names) + "\n\n")  # trailing blank lines are ignored
    paths = [str(images[name][0]) for name in ("colour.png", "grey.png", "colour.bmp")]
    process = run_script("predict.py", ["--checkpoint_path", str(model), "--class_names_file", str(names_file),
                                        "--top_k", "2", *paths])
    assert process.returncode == 0, process.stderr[-3000:]
    summary = json.loads(process.stdout.strip().splitlines()[-1])
    assert summary["image_size"] == [32, 32]
    expected = probabilities_of(reference_net, [images[name][1] for name in ("colour.png", "grey.png", "colour.bmp")])
    for path, row, record in zip(paths, expected, summary["predictions"]):
        top = list(np.argsort(-row, kind="stable")[:2])
        assert [entry["class"] for entry in record["top_k"]] == [names[i] for i in top]
        assert np.max(np.abs(np.array([e["probability"] for e in record["top_k"]]) - row[top])) <= 1e-5
        assert [name for name, _ in parse_lines(process.stdout)[path]] == [names[i] for i in top]


@pytest.mark.parametrize("dynamic_batch", [False, True])
@pytest.mark.slow
def test_mindir_classifier_feeds_the_batch_the_file_takes(images, reference_net, tmp_path, dynamic_batch):
    import mindspore as ms
    from src.exporting import export_network
    from src.inference import mindir_classifier, preprocess
    model = export_network(reference_net, tmp_path / "m.mindir", "MINDIR", 2, (32, 32), dynamic_batch).path
    classifier = mindir_classifier(str(model), (224, 224), 10)
    assert classifier.image_size == (32, 32) and classifier.class_num == 10
    assert classifier.fixed_batch == (None if dynamic_batch else 2)
    seen = []
    run = classifier.run
    classifier.run = lambda batch: (seen.append(len(batch)), run(batch))[1]
    inputs = np.stack([preprocess(pixels, (32, 32)) for _, pixels in images.values()][:3])
    logits = classifier.logits(inputs, batch_size=3)
    assert seen == ([3] if dynamic_batch else [2, 2])  # the short last batch padded to the fixed size
    assert np.max(np.abs(logits - reference_net(ms.Tensor(inputs)).asnumpy())) <= 1e-5


@pytest.mark.slow
def test_pth_checkpoint(images, checkpoint, reference_net, tmp_path):
    """A PyTorch state_dict with torchvision's names, read through load_weights_report."""
    torch = pytest.importorskip("torch")
    from src.weights.names import mindspore_to_torch_name
    state = {mindspore_to_torch_name(name): torch.from_numpy(value.asnumpy())
             for name, value in read_ckpt_entries(checkpoint).items()}
    pth = tmp_path / "r18.pth"
    torch.save(state, pth)
    process = run_script("predict.py", ["--checkpoint_path", str(pth), *SMALL, str(images["colour.png"][0])])
    assert process.returncode == 0, process.stderr[-3000:]
    record = json.loads(process.stdout.strip().splitlines()[-1])["predictions"][0]
    row = probabilities_of(reference_net, [images["colour.png"][1]])[0]
    assert record["top_k"][0]["index"] == int(np.argmax(row))
    assert record["top_k"][0]["probability"] == pytest.approx(float(row.max()), abs=1e-5)


# ---------------------------------------------------------------- refusals: one line, exit code 2

# Each case starts predict.py (a few seconds): no_images runs in the fast loop, the others are slow (pytest.ini).
@pytest.mark.parametrize("case", [case if case == "no_images" else pytest.param(case, marks=pytest.mark.slow)
                                  for case in ["short_names_file", "missing_names_file", "missing_checkpoint",
                                               "damaged_checkpoint", "damaged_mindir", "no_images", "onnx_model"]])
def test_refusals(case, images, checkpoint, tmp_path):
    model = str(checkpoint)
    extra = []
    if case == "short_names_file":
        names = tmp_path / "names.txt"
        names.write_text("cat\ndog\n")
        extra, fragments = ["--class_names_file", str(names)], [str(names), "2 names", "10 classes"]
    elif case == "missing_names_file":
        names = tmp_path / "absent.txt"
        extra, fragments = ["--class_names_file", str(names)], [str(names), "does not exist"]
    elif case == "missing_checkpoint":
        model = str(tmp_path / "absent.ckpt")
        fragments = [model, "does not exist"]
    elif case == "damaged_checkpoint":
        data = checkpoint.read_bytes()
        damaged = tmp_path / "damaged.ckpt"
        damaged.write_bytes(data[: len(data) // 3])
        model, fragments = str(damaged), [str(damaged), "damaged"]
    elif case == "damaged_mindir":
        damaged = tmp_path / "damaged.mindir"
        damaged.write_bytes(checkpoint.read_bytes()[:5000])
        model, fragments = str(damaged), [str(damaged), "not a MindIR file"]
    elif case == "onnx_model":
        model = str(tmp_path / "model.onnx")
        Path(model).write_bytes(b"\x08\x07")
        fragments = [model, "onnxruntime"]
    else:
        fragments = ["no images given"]
    image_args = [] if case == "no_images" else [str(images["colour.png"][0])]
    process = run_script("predict.py", ["--checkpoint_path", model, *SMALL, *extra, *image_args])
    assert_one_line_error(process, *fragments)
    assert parse_lines(process.stdout) == {}  # nothing classified

"""Foreign checkpoints give their home zoo's logits: the network built with the semantics a checkpoint's format
implies (src/architectures.py SEMANTICS, src.weights.loading.checkpoint_semantics) computes what mindcv's ResNet
(its own code, mindcv 0.3.0, when installed) and the models zoo's ResNet (a look-alike of official/cv/ResNet, which
pip cannot install: tests/test_checkpoint_formats.py ZooResNet) compute with the same weights, to 1e-5 relative;
'same' padding as an explicit pad (SamePad) equals MindSpore's pad_mode 'same'; the fused network refuses 'same'
padding and runs models_zoo ResNet-18; ONNX and MINDIR exports of the 'same' variants verify."""
import logging

import numpy as np
import pytest

import mindspore as ms
from mindspore import nn

from conftest import rel_diff
from src.architectures import MINDCV, MODELS_ZOO, TORCH, variant_of
from src.resnet import SamePad, build_resnet
from src.weights.loading import checkpoint_semantics, load_weights_report, read_weight_file
from src.weights.names import FORMAT_TITLES, HOME_SEMANTICS, MINDCV as MINDCV_FORMAT, OURS, ZOO
from test_checkpoint_formats import ZooResNet, randomise, save_like_training

LOGGER_NAME = "test_home_semantics"
# Even (64: 'same' is asymmetric at every stride-2 layer) and odd (65: symmetric at the stem) input sizes.
SIZES = (64, 65)


@pytest.fixture
def logger(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    return logging.getLogger(LOGGER_NAME)


def images(size: int, batch: int = 2) -> np.ndarray:
    return np.random.default_rng(size).normal(size=(batch, 3, size, size)).astype(np.float32)


def logits(net: nn.Cell, batch: np.ndarray) -> np.ndarray:
    net.set_train(False)
    return net(ms.Tensor(batch)).asnumpy()


def home_network(path, model_name: str, logger, class_num: int = 10, **kwargs):
    """What eval.py, export.py and predict.py build for a checkpoint: its format's semantics, its weights."""
    read = read_weight_file(str(path))
    semantics = checkpoint_semantics(read, str(path), logger)
    net = build_resnet(model_name, class_num, semantics=semantics, **kwargs)
    report = load_weights_report(net, str(path), model_name, logger, read=read)
    return net, semantics, report


# ------------------------------------------------------------------------------------------ SamePad, variants


@pytest.mark.parametrize("kernel, stride", [(3, 2), (7, 2), (3, 1)])
@pytest.mark.parametrize("size", [8, 9, 10, 15])
def test_same_pad_then_valid_is_mindspores_same(kernel, stride, size):
    rng = np.random.default_rng(size * 10 + kernel)
    x = rng.normal(size=(2, 3, size, size + 1)).astype(np.float32)
    same = nn.Conv2d(3, 4, kernel, stride, pad_mode="same")
    valid = nn.Conv2d(3, 4, kernel, stride, pad_mode="valid")
    valid.weight.set_data(same.weight.value().copy())
    padded = SamePad(kernel, stride)(ms.Tensor(x))
    np.testing.assert_allclose(valid(padded).asnumpy(), same(ms.Tensor(x)).asnumpy(), rtol=1e-6, atol=1e-6)
    relu_x = ms.Tensor(np.maximum(x, 0))  # a max pool of post-ReLU input: zeros pad like -inf
    np.testing.assert_array_equal(nn.MaxPool2d(kernel, stride, pad_mode="valid")(SamePad(kernel, stride)(relu_x)).asnumpy(),
                                  nn.MaxPool2d(kernel, stride, pad_mode="same")(relu_x).asnumpy())


@pytest.mark.slow
def test_semantics_keep_the_parameter_names_and_set_eps():
    names = {s: [(p.name, tuple(p.shape)) for p in build_resnet("resnet50", 10, semantics=s).get_parameters()]
             for s in (TORCH, MINDCV, MODELS_ZOO)}
    assert names[TORCH] == names[MINDCV] == names[MODELS_ZOO]
    zoo50 = build_resnet("resnet50", 10, semantics=MODELS_ZOO)
    assert {cell.eps for _, cell in zoo50.cells_and_names() if isinstance(cell, nn.BatchNorm2d)} == {1e-4}
    zoo18 = build_resnet("resnet18", 10, semantics=MODELS_ZOO)
    assert zoo18.bn1.eps == 1e-5 and zoo18.layer2[0].downsample[1].eps == 1e-5 and zoo18.layer2[0].bn1.eps == 1e-4
    assert not zoo18.same_padding and zoo50.same_padding and build_resnet("resnet18", 10, semantics=MINDCV).same_padding
    assert variant_of(TORCH, "resnet152") == variant_of(TORCH, "resnet18")
    with pytest.raises(ValueError, match="unknown semantics"):
        build_resnet("resnet18", 10, semantics="keras")


def test_each_format_has_its_home_semantics():
    assert HOME_SEMANTICS == {OURS: TORCH, "torch": TORCH, ZOO: MODELS_ZOO, MINDCV_FORMAT: MINDCV}
    assert set(HOME_SEMANTICS) == set(FORMAT_TITLES)


# ------------------------------------------------------------------------------------------------ mindcv


def saved_mindcv_network(tmp_path_factory, depth: int, seed: int):
    """(checkpoint path, network): mindcv's own resnet{depth} (random init, BatchNorm statistics randomised) saved
    with ms.save_checkpoint."""
    mindcv_models = pytest.importorskip("mindcv.models")
    net = getattr(mindcv_models, f"resnet{depth}")(num_classes=10)
    randomise(net, seed=seed)
    path = tmp_path_factory.mktemp(f"mindcv{depth}") / f"mindcv-resnet{depth}.ckpt"
    ms.save_checkpoint(net, str(path))
    return path, net


@pytest.fixture(scope="module")
def mindcv_resnet50(tmp_path_factory):
    return saved_mindcv_network(tmp_path_factory, 50, seed=21)


@pytest.mark.slow
def test_mindcv_resnet50_gives_mindcvs_logits(mindcv_resnet50, logger, caplog):
    path, source = mindcv_resnet50
    net, semantics, report = home_network(path, "resnet50", logger)
    assert semantics == MINDCV and report.fmt == MINDCV_FORMAT and report.match.unmatched == []
    assert "building the network with mindcv semantics" in caplog.text
    assert "it computes what mindcv's network computes" in caplog.text
    for size in SIZES:
        theirs = logits(source, images(size))
        difference = rel_diff(logits(net, images(size)), theirs)
        print(f"\n  mindcv resnet50 {size}x{size}: home-semantics logits vs mindcv's, max rel {difference:.2g}")
        assert difference < 1e-5
    torch_net = build_resnet("resnet50", 10)  # this project's semantics: the max pool differs
    load_weights_report(torch_net, str(path), "resnet50", logger)
    assert rel_diff(logits(torch_net, images(64)), logits(source, images(64))) > 1e-3


# -------------------------------------------------------------------------------------------- models zoo


@pytest.fixture(scope="module")
def zoo_checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zoo")
    made = {}

    def make(depth: str):
        if depth not in made:
            net = ZooResNet(depth, 10)
            randomise(net, seed=31 + len(made))
            path = folder / f"zoo-{depth}.ckpt"
            save_like_training(net, path, ZOO)
            made[depth] = (path, net)
        return made[depth]
    return make


@pytest.mark.parametrize("depth", ["resnet18", "resnet50"])
@pytest.mark.slow
def test_models_zoo_checkpoint_gives_the_zoo_networks_logits(zoo_checkpoints, logger, caplog, depth):
    path, source = zoo_checkpoints(depth)
    net, semantics, report = home_network(path, depth, logger)
    assert semantics == MODELS_ZOO and report.fmt == ZOO
    # The zoo's eps is in the network: the moving variances load as they are.
    values = {p.name: p.asnumpy() for p in source.get_parameters()}
    np.testing.assert_array_equal(net.layer1[0].bn2.moving_variance.asnumpy(),
                                  values["layer1.0.bn2d.moving_variance" if depth == "resnet18" else
                                         "layer1.0.bn2.moving_variance"])
    assert "raised by 9e-5" not in caplog.text and "models_zoo semantics" in caplog.text
    for size in SIZES:
        difference = rel_diff(logits(net, images(size)), logits(source, images(size)))
        print(f"\n  models zoo {depth} {size}x{size}: home-semantics logits vs the zoo network's, max rel "
              f"{difference:.2g}")
        assert difference < 1e-5


# ---------------------------------------------------------------------------------- fused inference, export


@pytest.mark.slow
def test_fused_inference_refuses_same_padding_and_runs_zoo_resnet18(zoo_checkpoints, logger):
    from src.fused_inference import FusedResNet, inference_network, why_not_fusable
    from src.onednn_conv import native_library
    for semantics in (MINDCV, MODELS_ZOO):
        net = build_resnet("resnet50" if semantics == MODELS_ZOO else "resnet18", 10, semantics=semantics)
        assert "pad 'same'" in why_not_fusable(net)
        assert inference_network(net) is net
    if native_library()[0] is None:
        pytest.skip("the native convolution library is not built")
    path, source = zoo_checkpoints("resnet18")
    net, _, _ = home_network(path, "resnet18", logger, conv_implementation="onednn_blocked")
    fused = inference_network(net)
    assert isinstance(fused, FusedResNet)  # only BatchNorm eps differs: folded per BatchNorm
    batch = images(64)
    assert rel_diff(fused(ms.Tensor(batch)).asnumpy(), logits(source, batch)) < 1e-5


@pytest.mark.slow
def test_blocked_convolutions_run_the_same_padded_layers():
    """'same' as SamePad + a 'valid' convolution: the native blocked kernels run every convolution."""
    from src.onednn_conv import BlockedConv2d, native_library
    if native_library()[0] is None:
        pytest.skip("the native convolution library is not built")
    net = build_resnet("resnet50", 10, semantics=MODELS_ZOO, conv_implementation="onednn_blocked")
    convs = [cell for _, cell in net.cells_and_names() if isinstance(cell, nn.Conv2d)]
    assert all(isinstance(conv, BlockedConv2d) and conv.blocked_op is not None for conv in convs)
    plain = build_resnet("resnet50", 10, semantics=MODELS_ZOO)
    ms.load_param_into_net(plain, {p.name: p for p in net.get_parameters()}, strict_load=True)
    batch = images(64)
    assert rel_diff(logits(net, batch), logits(plain, batch)) < 1e-5


@pytest.mark.parametrize("file_format", ["ONNX", "MINDIR"])
@pytest.mark.slow
def test_same_padding_variants_export_and_verify(tmp_path, file_format):
    if file_format == "ONNX":
        pytest.importorskip("onnxruntime")
    from src.exporting import export_network
    net = build_resnet("resnet50", 10, semantics=MODELS_ZOO)
    randomise(net, seed=41)
    result = export_network(net, tmp_path / f"zoo50.{file_format.lower()}", file_format, 2, (64, 64), verify=True)
    assert result.path is not None and all(d.ok for d in result.differences), \
        [d.describe() for d in result.differences]
    print(f"\n  models_zoo resnet50 {file_format}: {result.differences[0].describe()}")


# ------------------------------------------------------------------------------------------------ fine-tuning


@pytest.mark.slow
def test_fine_tuning_trains_with_the_projects_semantics_and_says_so(zoo_checkpoints, logger, caplog):
    from src.model_utils.config import load_config
    from src.weights.pretrained import load_pretrained
    path, _ = zoo_checkpoints("resnet18")
    net = build_resnet("resnet18", 10)
    load_pretrained(net, load_config(["--model_name", "resnet18", "--class_num", "10", "--pretrained", str(path)]),
                    logger)
    assert "training with this project's torch semantics, not the models_zoo semantics" in caplog.text
    assert "raised by 9e-5" in caplog.text  # converted: the eps difference moves into the moving variances


# ------------------------------------------------------------------------------------- the scripts, end to end


@pytest.fixture(scope="module")
def mindcv_resnet18(tmp_path_factory):
    return saved_mindcv_network(tmp_path_factory, 18, seed=22)


SCRIPT_ARGS = ["--model_name", "resnet18", "--class_num", "10", "--image_height", "64", "--image_width", "64"]


@pytest.mark.slow
def test_export_script_exports_mindcvs_network(mindcv_resnet18, tmp_path):
    import json
    onnxruntime = pytest.importorskip("onnxruntime")
    from conftest import run_script
    path, source = mindcv_resnet18
    process = run_script("export.py", ["--checkpoint_path", str(path), "--output_path", str(tmp_path), *SCRIPT_ARGS,
                                       "--file_format", "ONNX", "--batch_size", "2", "--verify"])
    assert process.returncode == 0, process.stderr[-3000:]
    summary = json.loads(process.stdout.strip().splitlines()[-1])
    assert summary["semantics"] == MINDCV and summary["verify"][0]["ok"]
    session = onnxruntime.InferenceSession(summary["file"], providers=["CPUExecutionProvider"])
    batch = images(64)
    exported = session.run(None, {session.get_inputs()[0].name: batch})[0]
    difference = rel_diff(exported, logits(source, batch))
    print(f"\n  export.py ONNX of a mindcv resnet18 vs mindcv's network: max rel {difference:.2g}")
    assert difference < 1e-5


@pytest.mark.slow
def test_predict_script_gives_mindcvs_probabilities(mindcv_resnet18, tmp_path):
    import json
    import cv2
    from conftest import run_script
    from src.inference import preprocess, softmax
    path, source = mindcv_resnet18
    image = np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    png = tmp_path / "image.png"
    cv2.imwrite(str(png), image[:, :, ::-1])  # RGB -> OpenCV's BGR
    process = run_script("predict.py", ["--checkpoint_path", str(path), *SCRIPT_ARGS, "--top_k", "3", str(png)])
    assert process.returncode == 0, process.stderr[-3000:]
    assert "building the network with mindcv semantics" in process.stderr + process.stdout
    [record] = json.loads(process.stdout.strip().splitlines()[-1])["predictions"]
    expected = softmax(logits(source, preprocess(image, (64, 64))[None]))[0]
    for entry in record["top_k"]:
        assert abs(entry["probability"] - expected[entry["index"]]) < 1e-5


@pytest.mark.slow
def test_eval_script_gives_mindcvs_loss(mindcv_resnet18, tmp_path, cifar_dir):
    import json
    from conftest import run_script
    from src.dataset import create_dataset
    from src.evaluation import batch_statistics
    path, source = mindcv_resnet18
    process = run_script("eval.py", ["--checkpoint_path", str(path), "--data_path", str(cifar_dir), "--output_path",
                                     str(tmp_path), *SCRIPT_ARGS, "--eval_num_samples", "64", "--batch_size", "32"])
    assert process.returncode == 0, process.stderr[-3000:]
    result = json.loads((tmp_path / "eval_result.json").read_text())
    assert result["semantics"] == MINDCV and result["num_samples"] == 64
    loss_sum = 0.0
    source.set_train(False)
    for batch, labels in create_dataset(str(cifar_dir), False, 32, (64, 64), num_samples=64,
                                        num_parallel_workers=1).create_tuple_iterator(num_epochs=1):
        loss_sum += batch_statistics(source(batch).asnumpy(), labels.asnumpy(), 10)[1]
    assert abs(result["loss"] - loss_sum / 64) <= 1e-5 * abs(loss_sum / 64)

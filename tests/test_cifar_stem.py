"""The cifar stem (--stem cifar: a 3x3 stride-1 conv1, no max pool): the network, the config key, how checkpoints
record it and the input size (and how eval.py, export.py and predict.py use that), conversion to and from
torchvision's cifar-stem network, and the fused inference network. Torchvision parity: tests/test_torch_parity.py
(the -cifar cases)."""
import json
from pathlib import Path

import numpy as np
import pytest

import mindspore as ms
from mindspore import nn
from mindspore.nn.utils import no_init_parameters

from conftest import (FAST_ARGS, assert_one_line_error, one_line_user_error, read_ckpt_entries, rel_diff,
                      run_script)
from src.errors import UserError
from src.model_utils.config import load_config
from src.resnet import build_resnet
from src.weights.loading import network_weights, recorded_settings, settings_from_checkpoint
from src.weights.names import stem_of_weights


def parameter_shapes(net: nn.Cell):
    return {param.name: tuple(param.shape) for param in net.get_parameters()}


# ------------------------------------------------------------------------------------------------ the network

@pytest.mark.parametrize("model_name", ["resnet18", pytest.param("resnet50", marks=pytest.mark.slow)])
def test_cifar_stem_has_the_imagenet_stems_names_and_a_3x3_conv1(model_name):
    with no_init_parameters():  # names and shapes only
        cifar, imagenet = build_resnet(model_name, 10, stem="cifar"), build_resnet(model_name, 10)
    cifar_shapes, imagenet_shapes = parameter_shapes(cifar), parameter_shapes(imagenet)
    assert list(cifar_shapes) == list(imagenet_shapes)  # same names, same order: checkpoints line up
    assert cifar_shapes.pop("conv1.weight") == (64, 3, 3, 3)
    assert imagenet_shapes.pop("conv1.weight") == (64, 3, 7, 7)
    assert cifar_shapes == imagenet_shapes
    assert (cifar.stem, imagenet.stem) == ("cifar", "imagenet")
    assert isinstance(cifar.maxpool, nn.Identity)
    conv1 = cifar.conv1
    assert (conv1.stride[-1], conv1.pad_mode, conv1.padding, conv1.has_bias) == (1, "pad", 1, False)


@pytest.mark.slow
def test_cifar_stem_keeps_the_input_size_until_layer2():
    net = build_resnet("resnet18", 10, stem="cifar")
    net.set_train(False)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32))
    stem_out = net.maxpool(net.relu(net.bn1(net.conv1(x))))
    assert stem_out.shape == (2, 64, 32, 32)  # the imagenet stem gives 8x8 here
    assert net.layer4(net.layer3(net.layer2(net.layer1(stem_out)))).shape == (2, 512, 4, 4)
    assert net(x).shape == (2, 10)


@pytest.mark.slow
def test_the_parameter_count_is_torchvisions_cifar_stem_networks():
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    from src.weights.convert import torchvision_resnet
    from src.resnet import count_trainable_parameters
    tv_net = torchvision_resnet("resnet18", 10, "cifar")
    assert count_trainable_parameters(build_resnet("resnet18", 10, stem="cifar")) == \
        sum(p.numel() for p in tv_net.parameters())
    assert isinstance(tv_net.maxpool, torch.nn.Identity) and tuple(tv_net.conv1.weight.shape) == (64, 3, 3, 3)


def test_an_unknown_stem_is_refused():
    with pytest.raises(ValueError, match="stem"):
        build_resnet("resnet18", 10, stem="tiny")
    with pytest.raises(UserError) as excinfo:
        load_config(["--stem", "Cifar"])
    one_line_user_error(excinfo, "stem", "imagenet, cifar", "did you mean cifar?")


# ------------------------------------------------------------------------------------------------ config

def test_config_knows_which_keys_the_user_set(tmp_path):
    overlay = tmp_path / "mine.yaml"
    overlay.write_text("image_height: 32\nstem: cifar\n")
    config = load_config(["--config_path", str(overlay), "--image_width", "32", "--stem", "imagenet"])
    assert config.explicit_keys == {"image_height", "image_width", "stem"}
    assert config.where_set("image_height") == f"in {overlay}"
    assert config.where_set("stem") == "on the command line" and config.stem == "imagenet"  # the command line wins
    assert not config.is_set("model_name") and config.where_set("model_name") == ""
    # A value the program replaces is not the user's; the user's keys stay marked.
    changed = config.replace(model_name="resnet18", image_width=64)
    assert not changed.is_set("model_name") and changed.is_set("image_width")
    assert load_config([]).explicit_keys == frozenset()


# ------------------------------------------------------------------------------------- what checkpoints show

def test_conv1_shape_shows_the_stem_in_any_naming():
    assert stem_of_weights({"conv1.weight": np.zeros((64, 3, 3, 3))}) == "cifar"
    assert stem_of_weights({"conv1.weight": np.zeros((64, 3, 7, 7))}) == "imagenet"
    assert stem_of_weights({"network.conv1.weight": np.zeros((64, 3, 3, 3)),
                            "network.layer1.0.conv1.weight": np.zeros((64, 64, 3, 3))}) == "cifar"
    assert stem_of_weights({"conv1.weight": np.zeros((64, 3, 5, 5))}) is None
    assert stem_of_weights({"layer1.0.conv1.weight": np.zeros((64, 64, 3, 3))}) is None


def recorded(stem="cifar", height=32, width=32, kernel=3):
    """Entries as train.py's checkpoint holds them (read back: ints as tensors, the stem as a string)."""
    entries = {"conv1.weight": np.zeros((64, 3, kernel, kernel), np.float32), "stem": stem,
               "image_height": ms.Tensor(np.array(height, np.int64)), "image_width": ms.Tensor(np.array(width, np.int64))}
    return {key: value for key, value in entries.items() if value is not None}


def test_settings_the_user_did_not_set_come_from_the_checkpoint():
    config = settings_from_checkpoint(load_config([]), recorded(), "r18.ckpt")
    assert (config.stem, config.image_height, config.image_width) == ("cifar", 32, 32)
    # Set and agreeing: accepted.
    config = settings_from_checkpoint(load_config(["--stem", "cifar", "--image_height", "32"]), recorded(), "r18.ckpt")
    assert (config.stem, config.image_height, config.image_width) == ("cifar", 32, 32)
    # A converted torch file: no records, its 3x3 conv1 shows the stem; the input size stays the configuration's.
    torch_like = {"conv1.weight": np.zeros((64, 3, 3, 3), np.float32)}
    config = settings_from_checkpoint(load_config(["--image_height", "40"]), torch_like, "r18.pth")
    assert (config.stem, config.image_height, config.image_width) == ("cifar", 40, 224)
    assert recorded_settings({"conv1.weight": np.zeros((64, 3, 7, 7))}) == {
        "stem": ("imagenet", "has the imagenet stem (conv1.weight 64x3x7x7)")}
    assert recorded_settings({}) == {}


def test_a_contradicting_value_the_user_set_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError) as excinfo:
        settings_from_checkpoint(load_config(["--stem", "imagenet"]), recorded(), "r18.ckpt")
    one_line_user_error(excinfo, "stem imagenet (set on the command line)", "r18.ckpt", "cifar stem",
                        "drop --stem to use the checkpoint's cifar")
    overlay = tmp_path / "big.yaml"
    overlay.write_text("image_width: 224\n")
    with pytest.raises(UserError) as excinfo:
        settings_from_checkpoint(load_config(["--config_path", str(overlay)]), recorded(), "r18.ckpt")
    one_line_user_error(excinfo, f"image_width 224 (set in {overlay})", "records image_width 32",
                        "remove image_width from the file")
    # A foreign file with torchvision's 7x7 conv1 is the imagenet stem: --stem cifar contradicts it.
    with pytest.raises(UserError) as excinfo:
        settings_from_checkpoint(load_config(["--stem", "cifar"]), {"conv1.weight": np.zeros((64, 3, 7, 7))}, "x.pth")
    one_line_user_error(excinfo, "stem cifar", "imagenet stem (conv1.weight 64x3x7x7)")


def test_weights_of_the_other_stem_are_refused_with_the_stem_to_pass():
    with no_init_parameters():  # names and shapes only
        cifar_net, imagenet_net = build_resnet("resnet18", 10, stem="cifar"), build_resnet("resnet18", 10)
    cifar_weights = {param.name: np.zeros(param.shape, np.float32) for param in cifar_net.get_parameters()}
    with pytest.raises(UserError) as excinfo:
        network_weights(cifar_weights, imagenet_net, "r18.ckpt", "resnet18")
    one_line_user_error(excinfo, "r18.ckpt holds cifar-stem weights (conv1.weight 64x3x3x3)", "imagenet stem",
                        "pass --stem cifar")
    assert set(network_weights(cifar_weights, cifar_net, "r18.ckpt", "resnet18")) == set(cifar_weights)


# ------------------------------------------------------------------------------------------------ fused inference

@pytest.mark.parametrize("model_name, layout", [("resnet18", "auto"), ("resnet18", "nhwc"), ("resnet50", "auto")])
@pytest.mark.slow
def test_fused_network_runs_the_cifar_stem(model_name, layout):
    """FusedResNet skips the max pool for the cifar stem and computes what the plain network computes."""
    from src.fused_inference import FusedResNet, inference_network
    from test_fused_inference import randomise_statistics
    rng = np.random.default_rng(5)
    net = build_resnet(model_name, 10, conv_implementation="onednn_blocked", stem="cifar")
    randomise_statistics(net, rng)
    fused = inference_network(net, layout=layout)
    assert isinstance(fused, FusedResNet) and not fused.has_maxpool
    images = rng.standard_normal((2, 3, 32, 32)).astype(np.float32)
    plain = build_resnet(model_name, 10, stem="cifar")
    ms.load_param_into_net(plain, {p.name: p for p in net.get_parameters()}, strict_load=True)
    plain.set_train(False)
    expected = plain(ms.Tensor(images)).asnumpy()
    logits = fused(ms.Tensor(images)).asnumpy()
    print(f"\n  {model_name} cifar stem {layout}: fused vs plain logits rel {rel_diff(logits, expected):.2g}")
    assert rel_diff(logits, expected) < 1e-5


def test_a_network_with_another_pool_is_not_fused():
    from src.fused_inference import why_not_fusable
    with no_init_parameters():
        net = build_resnet("resnet18", 10, conv_implementation="onednn_blocked", stem="cifar")
    assert why_not_fusable(net) is None
    net.maxpool = nn.MaxPool2d(3, 2, pad_mode="same")
    assert "max pool" in why_not_fusable(net)


# ------------------------------------------------------------------------------------------------ convert_pth.py

@pytest.mark.slow
def test_convert_pth_round_trip_with_verify(tmp_path):
    """A torchvision cifar-stem ResNet-18 .pth -> .ckpt -> .pth, each way verified against torchvision's cifar-stem
    network (at 32x32 by default); the tensors come back bit-identical."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    from conftest import randomise_batchnorm
    from src.weights.convert import torchvision_resnet
    torch.manual_seed(3)
    tv_net = torchvision_resnet("resnet18", 10, "cifar")
    randomise_batchnorm(tv_net, np.random.default_rng(3))
    pth, ckpt, back = tmp_path / "r18c.pth", tmp_path / "r18c.ckpt", tmp_path / "back.pth"
    torch.save(tv_net.state_dict(), pth)
    process = run_script("convert_pth.py", ["--pth_path", str(pth), "--ckpt_path", str(ckpt), "--verify"])
    assert process.returncode == 0, process.stderr[-3000:]
    assert "resnet18 (cifar stem), 10 classes" in process.stdout
    assert "verify passed" in process.stdout and "at 32x32" in process.stdout
    assert tuple(read_ckpt_entries(ckpt)["conv1.weight"].shape) == (64, 3, 3, 3)
    process = run_script("convert_pth.py", ["--reverse", "--ckpt_path", str(ckpt), "--pth_path", str(back),
                                            "--verify"])
    assert process.returncode == 0, process.stderr[-3000:]
    assert "verify passed" in process.stdout
    original, restored = torch.load(pth, weights_only=True), torch.load(back, weights_only=True)
    assert list(original) == list(restored)
    assert all(torch.equal(original[key], restored[key]) for key in original)


# ------------------------------------------------------------- train.py -> eval.py / export.py / predict.py

@pytest.fixture(scope="module")
def cifar_run(cifar_dir, tmp_path_factory):
    """train.py --stem cifar: ResNet-18 at 32x32, one short epoch."""
    out = tmp_path_factory.mktemp("cifar_stem")
    process = run_script("train.py", ["--data_path", str(cifar_dir), "--output_path", str(out), "--model_name",
                                      "resnet18", "--stem", "cifar", "--epoch_size", "1", "--batch_size", "8",
                                      "--train_num_samples", "16", "--eval_num_samples", "8", *FAST_ARGS])
    assert process.returncode == 0, process.stderr[-3000:]
    return out


@pytest.mark.slow
def test_train_writes_the_stem_and_input_size_into_its_checkpoints(cifar_run):
    entries = read_ckpt_entries(cifar_run / "resnet18-last.ckpt")
    assert entries["stem"] == "cifar"
    assert int(entries["image_height"].asnumpy()) == 32 and int(entries["image_width"].asnumpy()) == 32
    assert tuple(entries["conv1.weight"].shape) == (64, 3, 3, 3)


NO_SIZE = ["--num_parallel_workers", "2"]  # FAST_ARGS without the image size: it comes from the checkpoint


@pytest.mark.slow
def test_eval_takes_stem_and_input_size_from_the_checkpoint(cifar_run, cifar_dir, tmp_path):
    process = run_script("eval.py", ["--data_path", str(cifar_dir), "--output_path", str(tmp_path), "--model_name",
                                     "resnet18", "--checkpoint_path", str(cifar_run / "resnet18-last.ckpt"),
                                     "--eval_num_samples", "8", *NO_SIZE])
    assert process.returncode == 0, process.stderr[-3000:]
    result = json.loads(process.stdout.strip().splitlines()[-1])
    assert result["stem"] == "cifar" and result["image_size"] == [32, 32]
    assert "settings from checkpoint" in process.stdout


@pytest.mark.slow
def test_eval_refuses_a_stem_that_contradicts_the_checkpoint(cifar_run, cifar_dir, tmp_path):
    process = run_script("eval.py", ["--data_path", str(cifar_dir), "--output_path", str(tmp_path), "--model_name",
                                     "resnet18", "--checkpoint_path", str(cifar_run / "resnet18-last.ckpt"),
                                     "--stem", "imagenet", *NO_SIZE])
    assert_one_line_error(process, "stem imagenet (set on the command line)", "cifar stem", "drop --stem")


@pytest.mark.slow
def test_onnx_export_of_the_cifar_stem_verifies_at_the_recorded_size(cifar_run, tmp_path):
    """ONNX through onnxruntime: the stem's 3x3 stride-1 convolution and the missing pool export as they run."""
    pytest.importorskip("onnxruntime")
    process = run_script("export.py", ["--checkpoint_path", str(cifar_run / "resnet18-last.ckpt"), "--model_name",
                                       "resnet18", "--file_format", "ONNX", "--batch_size", "2", "--verify",
                                       "--output_path", str(tmp_path)])
    assert process.returncode == 0, process.stderr[-3000:]
    summary = json.loads(process.stdout.strip().splitlines()[-1])
    assert summary["stem"] == "cifar" and summary["input_shape"] == [2, 3, 32, 32]
    assert summary["verify"][0]["ok"] and summary["verify"][0]["max_rel_diff"] < 1e-5
    assert Path(summary["file"]).is_file()


@pytest.mark.slow
def test_mindir_export_and_predict_use_the_recorded_size(cifar_run, cifar_dir, tmp_path):
    """export.py MINDIR (--verify: identical), then predict.py with the checkpoint and with the export: the same
    probabilities; a contradicting --image_height is refused."""
    from test_predict import cifar_test_images, parse_lines, save_with_pil
    checkpoint = str(cifar_run / "resnet18-last.ckpt")
    process = run_script("export.py", ["--checkpoint_path", checkpoint, "--model_name", "resnet18", "--file_format",
                                       "MINDIR", "--batch_size", "2", "--verify", "--output_path", str(tmp_path)])
    assert process.returncode == 0, process.stderr[-3000:]
    mindir = json.loads(process.stdout.strip().splitlines()[-1])["file"]
    images = [str(save_with_pil(image, tmp_path / f"{index}.png"))
              for index, image in enumerate(cifar_test_images(cifar_dir, 3))]
    outputs = []
    for model in (checkpoint, mindir):
        process = run_script("predict.py", ["--checkpoint_path", model, "--model_name", "resnet18", "--top_k", "10",
                                            *images])
        assert process.returncode == 0, process.stderr[-3000:]
        assert json.loads(process.stdout.strip().splitlines()[-1])["image_size"] == [32, 32]
        outputs.append(parse_lines(process.stdout))
    for path in images:
        by_checkpoint, by_mindir = dict(outputs[0][path]), dict(outputs[1][path])
        assert by_checkpoint.keys() == by_mindir.keys()
        assert all(abs(by_checkpoint[name] - by_mindir[name]) <= 2e-3 for name in by_checkpoint)  # 3 decimals
    process = run_script("predict.py", ["--checkpoint_path", checkpoint, "--model_name", "resnet18",
                                        "--image_height", "64", *images])
    assert_one_line_error(process, "image_height 64 (set on the command line)", "records image_height 32",
                          "drop --image_height")

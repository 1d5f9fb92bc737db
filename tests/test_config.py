"""Configuration: yaml defaults, --config_path overlays, typed --key value overrides and refusals."""
import subprocess
import sys

import pytest

from conftest import REPO, assert_one_line_error
from src.errors import UserError
from src.model_utils.config import CHOICES, load_config

REQUIRED_KEYS = (
    "data_path eval_data_path output_path checkpoint_path resume device_target device_id context_mode seed "
    "model_name class_num image_height image_width batch_size epoch_size optimizer lr lr_schedule warmup_epochs "
    "momentum weight_decay label_smoothing amp_level loss_scale dataset_sink_mode train_num_samples "
    "eval_num_samples eval_interval keep_checkpoint_max num_parallel_workers").split()


def test_defaults_are_the_reference_recipe():
    config = load_config([])
    assert (config.optimizer, config.lr, config.weight_decay) == ("adam", 0.001, 1e-5)
    assert (config.batch_size, config.epoch_size, config.class_num) == (32, 90, 10)
    assert (config.image_height, config.image_width) == (224, 224)
    assert (config.amp_level, config.loss_scale, config.loss_scale_type) == ("auto", 1024.0, "fixed")
    assert (config.context_mode, config.seed, config.lr_schedule) == ("graph", 1, "constant")
    assert config.device_target == "Auto"
    # Augmentation beyond the reference crop and flip is off.
    assert (config.auto_augment, config.random_erasing, config.mixup_alpha, config.cutmix_alpha) == ("none", 0, 0, 0)
    for key in REQUIRED_KEYS:
        assert hasattr(config, key), key


def test_overrides_are_typed_from_the_yaml():
    config = load_config(["--lr", "0.05", "--batch_size=8", "--model_name", "resnet18", "--data_path", "/x"])
    assert config.lr == 0.05 and isinstance(config.lr, float)
    assert config.batch_size == 8 and isinstance(config.batch_size, int)
    assert config.model_name == "resnet18" and config.data_path == "/x"
    assert load_config(["--loss_scale", "7"]).loss_scale == 7.0  # an integer is a valid float


@pytest.mark.parametrize("text, expected", [("true", True), ("True", True), ("TRUE", True), ("false", False),
                                            ("False", False), ("fAlSe", False)])
def test_bools_take_true_false_in_any_case(text, expected):
    assert load_config(["--dataset_sink_mode", text]).dataset_sink_mode is expected


@pytest.mark.parametrize("argv, fragments", [
    (["--dataset_sink_mode", "yes"], ["dataset_sink_mode", "true or false", "'yes'"]),
    (["--batch_size", "abc"], ["batch_size", "integer", "'abc'"]),
    (["--batch_size", "3.5"], ["batch_size", "integer"]),
    (["--lr", "fast"], ["'lr'", "number"]),
    (["--lr", "0"], ["'lr'", "greater than 0"]),
    (["--batch_size", "0"], ["batch_size", "at least 1"]),
    (["--label_smoothing", "1.5"], ["label_smoothing", "[0, 1)"]),
    (["--optimizer", "sgd"], ["optimizer", "adam, momentum", "'sgd'"]),
    (["--device_target", "cpu"], ["device_target", "did you mean CPU"]),
    (["--lr_schedule", "linear"], ["lr_schedule", "constant, cosine, step, poly"]),
    (["--warmup_epochs", "5", "--epoch_size", "2"], ["warmup_epochs", "epoch_size"]),
    (["--lr"], ["--lr needs a value"]),
    (["--amp_level", "O4"], ["amp_level", "auto, O0, O1, O2, O3", "'O4'"]),
    (["--loss_scale_type", "Dynamic"], ["loss_scale_type", "fixed, dynamic", "did you mean dynamic"]),
    (["--loss_scale", "0.5"], ["loss_scale", "at least 1"]),
    (["--sink_size", "0"], ["sink_size", "-1 (the whole epoch) or at least 1"]),
    (["--save_checkpoint_steps", "-5"], ["save_checkpoint_steps", "0 (epoch ends only) or a positive count"]),
    (["--ema_decay", "1"], ["ema_decay", "in [0, 1)"]),
    (["--auto_augment", "RandAugment"], ["auto_augment", "none, autoaugment, randaugment, trivialaugment",
                                         "did you mean randaugment"]),
    (["--auto_augment", "autoaug"], ["auto_augment", "'autoaug'"]),
    (["--randaugment_magnitude", "31"], ["randaugment_magnitude", "from 0 to 30", "31"]),
    (["--randaugment_num_ops", "0"], ["randaugment_num_ops", "at least 1"]),
    (["--random_erasing", "1.5"], ["random_erasing", "a probability in [0, 1]"]),
    (["--mixup_alpha", "-0.2"], ["mixup_alpha", "0 (off) or more"]),
    (["--cutmix_alpha", "on"], ["cutmix_alpha", "a number", "'on'"]),
    (["--mixup_switch_prob", "2"], ["mixup_switch_prob", "a probability in [0, 1]"]),
    (["stray"], ["unexpected command-line argument 'stray'"]),
])
def test_bad_values_are_refused_naming_the_key(argv, fragments):
    with pytest.raises(UserError) as caught:
        load_config(argv)
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_unknown_key_is_refused_with_close_matches():
    with pytest.raises(UserError) as caught:
        load_config(["--lr_shedule", "cosine"])
    assert "unknown config key 'lr_shedule'" in str(caught.value)
    assert "lr_schedule" in str(caught.value)
    with pytest.raises(UserError, match="see --help"):
        load_config(["--zzzz", "1"])


def test_config_path_overlays_and_command_line_wins(tmp_path):
    overlay = tmp_path / "mine.yaml"
    overlay.write_text("epoch_size: 3\nlr: 0.1\nzero_init_residual: true\n")
    config = load_config(["--config_path", str(overlay), "--lr", "0.2"])
    assert config.epoch_size == 3 and config.zero_init_residual is True
    assert config.lr == 0.2  # the command line beats the file
    assert config.batch_size == 32  # untouched keys keep the defaults
    assert config.config_path == str(overlay)


@pytest.mark.parametrize("content, fragments", [
    ("epochs: 3\n", ["unknown config key 'epochs'", "mine.yaml", "epoch_size"]),
    ("batch_size: 32.5\n", ["batch_size", "mine.yaml", "integer"]),
    ("batch_size: [1, 2\n", ["mine.yaml", "not valid yaml"]),
    ("- just\n- a list\n", ["mine.yaml", "mapping"]),
])
def test_bad_config_files_are_refused_naming_the_file(tmp_path, content, fragments):
    overlay = tmp_path / "mine.yaml"
    overlay.write_text(content)
    with pytest.raises(UserError) as caught:
        load_config(["--config_path", str(overlay)])
    assert "\n" not in str(caught.value)
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_missing_config_file_is_refused(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(["--config_path", str(tmp_path / "nope.yaml")])


def test_quickstart_config_is_valid():
    config = load_config(["--config_path", str(REPO / "configs" / "quickstart.yaml")])
    assert config.synthetic_data is True and (config.image_height, config.image_width) == (32, 32)


def test_replace_gives_a_checked_copy():
    config = load_config([])
    changed = config.replace(batch_size="16")
    assert changed.batch_size == 16 and config.batch_size == 32
    with pytest.raises(UserError):
        config.replace(batch_size=0)
    with pytest.raises(AttributeError):
        config.batch_size = 3


def test_every_choice_key_has_a_valid_default():
    config = load_config([])
    for key, allowed in CHOICES.items():
        assert getattr(config, key) in allowed


@pytest.mark.slow
def test_importing_parses_nothing():
    # A module-level config parsed at import would choke on foreign argv; ours parses only when asked.
    code = "import sys; sys.argv = ['x', '--no_such_key', '1']; import src.model_utils.config, src.trainer; print('ok')"
    process = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert process.returncode == 0 and "ok" in process.stdout, process.stderr[-2000:]


@pytest.mark.slow
def test_help_lists_keys_and_exits_zero():
    process = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert process.returncode == 0
    assert "--lr_schedule" in process.stdout and "constant|cosine|step|poly" in process.stdout


def test_cli_refusal_is_one_line_and_exit_code_2():
    from conftest import run_script
    process = run_script("train.py", ["--batch_sise", "8"])
    assert_one_line_error(process, "batch_sise", "batch_size")


def test_a_bool_key_alone_means_true():
    config = load_config(["--dataset_sink_mode", "--lr", "0.1"])
    assert config.dataset_sink_mode is True and config.lr == 0.1
    assert load_config(["--verify"]).verify is True
    assert load_config(["--verify", "FALSE"]).verify is False


def test_positional_arguments_only_where_allowed():
    config = load_config(["a.png", "--top_k", "3", "b.png", "--verify"], positional="images")
    assert config.arguments == ("a.png", "b.png") and config.top_k == 3 and config.verify is True
    with pytest.raises(UserError, match="unexpected command-line argument 'a.png'"):
        load_config(["a.png"])

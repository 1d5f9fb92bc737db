"""README.md stays true to the code: its test command is CI's, and every config key is documented."""
import re

import yaml

from conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def fenced_commands(text: str):
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    test_command = "python -m pip install -r requirements-dev.txt && python -m pytest -q -n 2 --dist loadfile"
    assert ci_lines[-1] == test_command
    assert test_command in fenced_commands(README)
    # ... inside a virtualenv made new in a temporary folder for each run, as a newcomer would install.
    assert any(line.startswith('python3 -m venv "$VENV_PARENT/') for line in ci_lines)
    assert any("mktemp -d" in line for line in ci_lines)
    assert any(line.startswith('source "$VENV_PARENT/') and line.endswith('/bin/activate"') for line in ci_lines)


def test_quickstart_command_is_in_the_readme():
    assert ("python -m pip install -r requirements.txt && python train.py --config_path configs/quickstart.yaml"
            in fenced_commands(README))


def test_every_config_key_is_documented():
    defaults = next(yaml.safe_load_all((REPO / "default_config.yaml").read_text()))
    for key in defaults:
        assert f"| `{key}` |" in README, key


def test_metrics_columns_in_readme_match_the_code():
    from src.metrics_file import COLUMNS
    assert ",".join(COLUMNS) in README

"""README.md and docs/ stay true to the code: the README's test command is CI's, its fast loop selects by the
marker pytest.ini registers, every config key is documented with the yaml's own description, the README stays
short, and the text cites no commits and links only to files in the repository."""
import configparser
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
import yaml

from conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")
DOCS = sorted((REPO / "docs").glob("*.md"))
CONFIGURATION = REPO / "docs" / "configuration.md"
KEY_TABLE_HEADER = "| key | default | description | allowed values |"


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


def test_readme_names_the_fast_loop_and_pytest_ini_registers_slow():
    """The fast loop (README, "Tests") selects by the `slow` marker, which pytest.ini registers; no default
    -m in pytest.ini deselects anything, so the full suite (CI's command) still runs every test."""
    assert 'python -m pytest -m "not slow"' in fenced_commands(README)
    ini = configparser.ConfigParser()
    ini.read(REPO / "pytest.ini", encoding="utf-8")
    markers = [line.strip() for line in ini.get("pytest", "markers").splitlines() if line.strip()]
    assert any(re.match(r"slow: \S", marker) for marker in markers), markers
    addopts = ini.get("pytest", "addopts", fallback="").split()
    assert "-m" not in addopts and not any(option.startswith("-m") for option in addopts), addopts


@pytest.mark.slow
def test_pytest_ini_removes_the_folders_of_tests_that_passed(tmp_path):
    """A whole run writes about 15 GB into tmp_path folders: with the repository's pytest.ini, a passing
    test's folder goes when it ends and a failing test's stays for a look."""
    kept = tmp_path / "kept"
    (tmp_path / "test_probe.py").write_text(
        "def test_passes(tmp_path):\n"
        "    (tmp_path / 'checkpoint.ckpt').write_bytes(b'0' * 1024)\n"
        "def test_fails(tmp_path):\n"
        "    (tmp_path / 'checkpoint.ckpt').write_bytes(b'0' * 1024)\n"
        "    assert False\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(REPO / "pytest.ini"),
                    "--rootdir", str(tmp_path), "--basetemp", str(kept), str(tmp_path / "test_probe.py")],
                   cwd=tmp_path, capture_output=True, text=True, timeout=120)
    left = sorted(path.parent.name for path in kept.glob("*/checkpoint.ckpt") if not path.parent.is_symlink())
    assert left == ["test_fails0"], left


def test_quickstart_command_is_in_the_readme():
    assert ("python -m pip install -r requirements.txt && python train.py --config_path configs/quickstart.yaml"
            in fenced_commands(README))


def key_table_rows(text: str):
    """The cells of each row of the key table: the table under KEY_TABLE_HEADER, to its first non-row line."""
    lines = text.splitlines()
    assert lines.count(KEY_TABLE_HEADER) == 1, f"one key table headed {KEY_TABLE_HEADER!r}"
    start = lines.index(KEY_TABLE_HEADER) + 2  # past the header and its |---| line
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_configuration_page_has_one_row_per_key_with_the_yaml_description():
    from src.model_utils.config import CHOICES, VALUE_RULES
    defaults, descriptions = list(yaml.safe_load_all((REPO / "default_config.yaml").read_text()))[:2]
    text = CONFIGURATION.read_text(encoding="utf-8")
    rows = key_table_rows(text)
    assert all(len(row) == 4 for row in rows), [row for row in rows if len(row) != 4]
    keys = [row[0] for row in rows]
    assert keys == [f"`{key}`" for key in defaults]  # every key, once, in the yaml's order, nothing else
    for (_, default, description, allowed), (key, value) in zip(rows, defaults.items()):
        assert description == descriptions[key], key
        shown = str(value).lower() if isinstance(value, bool) else ('""' if value == "" else str(value))
        assert default == f"`{shown}`", key
        for choice in CHOICES.get(key, ()):
            assert f"`{choice}`" in allowed, (key, choice)
        if key in VALUE_RULES:
            assert VALUE_RULES[key][1] in allowed, key
    # No second row for a key elsewhere on the page.
    for key in defaults:
        assert len(re.findall(rf"^\| `{re.escape(key)}` \|", text, re.M)) == 1, key


def test_readme_is_at_most_250_lines():
    assert len(README.splitlines()) <= 250


def test_docs_cite_no_commits_and_nothing_outside_the_repository():
    commit = re.compile(r"commits? `?[0-9a-f]{7,40}`?", re.I)
    for path in [REPO / "README.md", *DOCS]:
        text = path.read_text(encoding="utf-8")
        assert not commit.findall(text), (path.name, commit.findall(text))
        assert "../shared" not in text, path.name


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {github_anchor(heading) for heading in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_relative_link_points_to_a_file_in_the_repository():
    assert DOCS, "docs/*.md"
    link = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
    checked = 0
    for path in [REPO / "README.md", *DOCS]:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        for target in link.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
                continue
            file_part, _, anchor = unquote(target).partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            assert linked == REPO or REPO in linked.parents, (path.name, target)
            assert linked.exists(), (path.name, target)
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked), (path.name, target)
            checked += 1
    assert checked


def test_metrics_columns_in_the_docs_match_the_code():
    from src.metrics_file import COLUMNS
    assert ",".join(COLUMNS) in (REPO / "docs" / "training.md").read_text(encoding="utf-8")

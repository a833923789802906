"""docs/reference/configuration.md is generated from the config's field docs (cputrain.config.reference):
the committed page must be what the generator gives now, and it must hold every key `--help-config` lists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from harness.run_cli_here import run_cli_here

from cputrain.config import reference
from cputrain.config.file import describe_fields

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "reference" / "configuration.md"


def test_the_committed_reference_is_what_the_config_gives():
    assert reference.PAGE == PAGE
    assert PAGE.exists(), f"{PAGE.relative_to(REPO)} is missing; generate it: {reference.REGENERATE}"
    assert PAGE.read_text() == reference.render(), (
        f"{PAGE.relative_to(REPO)} differs from the config's field docs (a key added, removed or its docstring "
        f"changed?); regenerate it: {reference.REGENERATE}")


def test_every_key_help_config_lists_is_in_the_reference():
    result = run_cli_here("train", "--help-config")
    assert result.returncode == 0, result.stderr
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.strip()]
    assert listed == [key for key, _, _ in describe_fields()]
    documented = set(re.findall(r"^\| `([\w.]+)` \|", PAGE.read_text(), re.M))
    missing = [key for key in listed if key not in documented]
    assert not missing, f"keys of --help-config not in {PAGE.relative_to(REPO)}: {missing}; run {reference.REGENERATE}"
    assert documented == set(listed)


def test_every_description_and_default_is_on_the_page():
    text = reference.render()
    for key, _, doc in describe_fields():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{key}` |"))
        assert doc.split()[0].replace("|", "\\|") in row, key


def test_check_mode_fails_on_a_stale_page_naming_the_command(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(reference.render().replace("| `seed` |", "| `seed_gone` |"))
    assert reference.main(["--check", "--out", str(stale)]) == 1
    assert reference.main(["--out", str(stale)]) == 0
    assert reference.main(["--check", "--out", str(stale)]) == 0
    assert stale.read_text() == reference.render()


def test_the_module_entry_point_writes_the_page(tmp_path):
    out = tmp_path / "page.md"
    done = subprocess.run([sys.executable, "-m", "cputrain.config.reference", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == reference.render()

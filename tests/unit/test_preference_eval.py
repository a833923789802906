"""`cputrain eval` on a preference run, refused before any data or model is read where the run has
no reference to score pairs against (tests/e2e/test_preference.py evaluates real runs)."""

from __future__ import annotations

import shutil

import yaml

from harness.run_cli_here import run_cli_here


def test_a_dpo_run_from_random_weights_has_no_reference_to_eval_against(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run / "model")
    (run / "config.yaml").write_text(yaml.safe_dump({
        "model": {"name_or_path": None}, "train": {"objective": "dpo"},
        "data": {"source": "builtin:pydoc-dpo", "format": "preference", "cache_dir": str(tmp_path / "cache")}}))
    proc = run_cli_here("eval", run, "hardware.threads=1")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "trained from random weights" in proc.stderr, proc.stderr
    assert not (tmp_path / "cache").exists()  # refused before the data was read

"""The tiers hold: a fast test that would start a training process fails before it starts one, and
a test's folder says its tier. The first test also shows that the tier conftest's fixture sets is
the one the runners read (were they two copies of `harness.tiers`, the runners would see the
default, slow, and let the command through)."""

from __future__ import annotations

import pytest

from harness import tiers
from harness.repo import TESTS
from harness.run_cli import run_cli
from harness.start_cli import start_cli

SLOW_TIER_ADVICE = "this test starts a training process: mark it @pytest.mark.slow"


def test_a_fast_test_that_would_train_fails_before_any_process_starts():
    assert not tiers.RUNNING["slow"]
    with pytest.raises(pytest.fail.Exception, match=SLOW_TIER_ADVICE):
        run_cli("train", "no.such.key=1")
    with pytest.raises(pytest.fail.Exception, match=SLOW_TIER_ADVICE):
        start_cli("train", "no.such.key=1")


def test_what_counts_as_training():
    assert tiers.starts_training(["train"])
    assert tiers.starts_training(["train", "configs/demo-sft.yaml", "train.max_steps=2"])
    for args in (["train", "--dry-run"], ["train", "--help-config"], ["train", "-h"], ["plan"], []):
        assert not tiers.starts_training(args), args


@pytest.mark.slow
def test_a_slow_test_is_let_through():
    assert tiers.RUNNING["slow"]
    tiers.refuse_training_in_fast_tier(["train"])  # does not fail the test


def test_the_folder_says_the_tier():
    assert tiers.in_slow_folder(TESTS / "e2e" / "test_resume.py")
    assert tiers.in_slow_folder(TESTS / "distributed" / "test_faults.py")
    assert not tiers.in_slow_folder(TESTS / "unit" / "test_config.py")
    assert not tiers.in_slow_folder(TESTS / "harness" / "test_tiers.py")

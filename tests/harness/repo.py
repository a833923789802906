"""The folders the tests run from and read."""

from __future__ import annotations

from pathlib import Path

HARNESS = Path(__file__).resolve().parent
TESTS = HARNESS.parent
REPO = TESTS.parent
SHARED = REPO.parent / "shared"  # the Kubernetes CRD schemas and the Shakespeare corpus live beside the repository

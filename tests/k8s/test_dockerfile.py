"""The image installs with the one install script that the README, the Makefile and CI run."""

from __future__ import annotations

import re

from harness.repo import REPO


def test_dockerfile_installs_with_the_shared_script():
    text = (REPO / "Dockerfile").read_text()
    runs = [line for line in re.split(r"\n(?=[A-Z]+ )", text) if line.startswith("RUN ")]
    assert any("scripts/install.sh" in r for r in runs), "the image must install with scripts/install.sh"
    assert not any(re.search(r"pip3? install", r) for r in runs), "install steps belong in scripts/install.sh"
    copied = re.findall(r"^COPY (.+?) \S+$", text, re.M)
    assert any("scripts" in c for c in copied) and any("cputrain" in c for c in copied)
    # the same script is what `make test` (CI) and the README run
    assert "scripts/install.sh" in (REPO / "Makefile").read_text()
    assert "scripts/install.sh" in (REPO / "README.md").read_text()
    assert "CPUTRAIN_VENV=none" in text  # install into the image's interpreter, as the script documents

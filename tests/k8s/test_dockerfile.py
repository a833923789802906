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


def test_the_image_and_make_install_give_ranks_tcmalloc(tmp_path):
    """tcmalloc is what `auto` preloads, and a sharded rank's speed on it (docs/benchmarks/network.md):
    the image installs it, `make install` runs scripts/install-tcmalloc.sh, and that script, where it
    cannot install (no apt-get here), says so in one line and fails nothing."""
    import os
    import shutil
    import subprocess

    assert "libgoogle-perftools4" in (REPO / "Dockerfile").read_text()
    install_target = (REPO / "Makefile").read_text().split("\ninstall:\n", 1)[1].split("\n\n", 1)[0]
    assert "scripts/install-tcmalloc.sh" in install_target
    bin_dir = tmp_path / "bin"  # a PATH with `id` and nothing else: no apt-get
    bin_dir.mkdir()
    (bin_dir / "id").symlink_to(shutil.which("id"))
    done = subprocess.run(["/bin/bash", str(REPO / "scripts" / "install-tcmalloc.sh")], capture_output=True, text=True,
                          env={**os.environ, "PATH": str(bin_dir)}, timeout=30)
    assert done.returncode == 0, done.stderr
    from cputrain.native.allocator import find_allocator

    if find_allocator("tcmalloc") is None:
        assert done.stdout.startswith("note: tcmalloc not installed") and "libtcmalloc-minimal4" in done.stdout
    else:  # already there: nothing to do, nothing said
        assert done.stdout == ""

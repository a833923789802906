"""The OpenMP waits `cputrain train` sets: before torch loads libgomp, and never over the user's own."""

import json
import os
import subprocess
import sys
from pathlib import Path

from cputrain.native.openmp_waits import WAITS, describe, waits_to_set

REPO = Path(__file__).resolve().parents[2]

# Records the wait variables at the moment anything first imports torch, then runs the command as
# the command line does (cli.main() with no argv).
AT_TORCH_IMPORT = r"""
import json, os, sys

seen = {}

class AtTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.update({k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")})
        return None

sys.meta_path.insert(0, AtTorch())
sys.argv = ["cputrain", "train", "--dry-run", "output_dir=" + sys.argv[1]]
from cputrain.cli import main
code = main()
print("AT_TORCH " + json.dumps(seen))
sys.exit(code)
"""


def test_the_command_sets_the_waits_before_torch_is_loaded(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (*WAITS, "KMP_BLOCKTIME")}
    env["LD_PRELOAD"] = ""
    proc = subprocess.run([sys.executable, "-c", AT_TORCH_IMPORT, str(tmp_path / "run")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.split("AT_TORCH ", 1)[1])
    assert seen == WAITS  # libgomp, loaded with torch, reads them once
    assert "OpenMP waits: OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT=300000 (" in proc.stdout


def test_the_users_own_waits_and_runtime_are_kept():
    assert waits_to_set({}) == WAITS
    assert waits_to_set({"PATH": "/bin"}) == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}
    for own in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}, {"KMP_BLOCKTIME": "1"},
                {"LD_PRELOAD": "/opt/intel/lib/libiomp5.so"}):
        assert waits_to_set(own) == {}, own
    assert describe({"OMP_WAIT_POLICY": "PASSIVE"}) == \
        "OpenMP waits: OMP_WAIT_POLICY=PASSIVE (set in the environment, kept)"
    assert describe({}) == "OpenMP waits: libgomp's defaults"  # a process not started by the command
    assert "Intel's runtime" in describe({"LD_PRELOAD": "/x/libiomp5.so"})
    assert describe(dict(WAITS)).startswith("OpenMP waits: OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT=300000 (")

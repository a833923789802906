"""A finished rank lets go of its process group while the interpreter is whole.

Gloo threads still alive at interpreter teardown can abort a rank that has finished its run
(SIGABRT, "terminate called without an active exception"), and the agent then fails the whole
run. DDP's own import of torch.distributed.nn used to pin the group for the life of the process;
cputrain imports it before the group exists, so destroying the group joins its threads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from harness.cli_env import cli_env
from harness.repo import REPO
from dist_helpers import free_port

pytestmark = pytest.mark.slow

RANK_SCRIPT = textwrap.dedent("""
    import json
    import os
    import sys

    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from cputrain.distributed import process_group as pg

    pg.init_process_group("gloo", world_size=2)
    model = DistributedDataParallel(nn.Linear(8, 8))
    model(torch.randn(4, 8)).sum().backward()
    living = pg.collective_threads()
    del model
    pg.destroy()
    report = {"living": living, "after": pg.collective_threads()}
    with open(os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}.json"), "w") as f:
        json.dump(report, f)
""")


def test_destroy_joins_the_gloo_threads_after_ddp(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    # The check below means something only if the group did run gloo threads.
    assert all(any("gloo" in name for name in r["living"]) for r in reports), reports
    assert [r["after"] for r in reports] == [[], []], reports

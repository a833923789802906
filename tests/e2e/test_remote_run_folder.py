"""A run folder given as an fsspec URL that is not a local path (as s3:// or an FSx mount named
by URL would be): every rank writes its checkpoint shards through fsspec, a resume on another
rank count reads them back, and the export is staged locally and uploaded.

The file system is `remotelike://` (tests/e2e/remote_fs): local disk underneath, so the test
can look at what landed, but fsspec and DCP treat it as remote.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.cli_env import cli_env
from harness.run_cli import run_cli
from harness.tiny_run import tiny_overrides

REMOTE_FS = Path(__file__).parent / "remote_fs"


def test_checkpoints_resume_and_export_through_an_fsspec_url(tmp_path, cache_dir):
    out = tmp_path / "run"
    url = f"remotelike://{out}"
    writes = tmp_path / "writes.log"
    scratch = tmp_path / "scratch"  # the processes' TMPDIR: where the export is staged
    scratch.mkdir()
    env = cli_env(PYTHONPATH=os.pathsep.join([str(REMOTE_FS), os.environ.get("PYTHONPATH", "")]),
                  REMOTELIKE_WRITE_LOG=writes, TMPDIR=scratch)
    common = {"output_dir": url, "train.max_steps": 8, "train.eval_every": 100, "train.checkpoint_every": 4,
              "parallel.strategy": "fsdp"}
    run_cli("train", *tiny_overrides(out, cache_dir, **common, **{"train.stop_at_step": 4}), "--nproc-per-node", 2,
            env=env, check=True)
    shards = sorted(p.name for p in (out / "checkpoints" / "step-000004" / "state").glob("*.distcp"))
    assert len(shards) == 2, f"one shard file per rank under the URL's folder: {shards}"
    through_fsspec = {Path(line).name for line in writes.read_text().splitlines()}
    assert set(shards) <= through_fsspec, "checkpoint shards were written to the local disk, not through the URL"

    second = run_cli("train", *tiny_overrides(out, cache_dir, **common), env=env, check=True)  # 1 rank now
    assert "resumed from" in second.stderr and "(step 4)" in second.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9)), steps
    assert (out / "checkpoints" / "step-000008" / "trainer_state.json").is_file()

    from safetensors.torch import load_file

    weights = load_file(out / "model" / "model.safetensors")  # staged locally, then uploaded
    assert weights and all(t.isfinite().all() for t in weights.values())
    staged = sorted(p.name for p in scratch.glob("cputrain-export-*"))
    assert not staged, f"the export's local staging was left behind: {staged}"

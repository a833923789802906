"""Every way of starting the ranks ends in the same training.

    (b') PET_NNODES … PET_MASTER_PORT, plain `cputrain train`  what Kubeflow Trainer injects
    (c)  python -m torch.distributed.run … -m cputrain train   an outside torchrun
    (d)  two processes with OpenMPI's OMPI_COMM_WORLD_*        what `mpirun -x MASTER_ADDR -x MASTER_PORT` sets
         (where no mpirun is installed; where one is, the real ones below)
    (d') a real mpirun: MPICH's `mpirun -n 2` stopped and resumed, Open MPI's `mpirun -n 2`, and
         MPICH over two hosts (network namespaces) from a hostfile, 2 ranks each
    (e)  plain python, world size 1                            every variable a library reads is set

Each logs the losses of the one-rank run that test_parity_resume.py and test_zero3.py compare
with (trained once per session) to 1e-4 relative, what the parity test asks of 2-rank DDP started
by `cputrain train --nproc-per-node 2` (the agent started by cputrain itself, mode (a)).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from harness.cli_env import cli_env
from harness.repo import REPO
from harness.run_cli import run_cli
from harness.tiny_run import tiny_overrides
from harness.warm_client import warm
from dist_helpers import HOST_ADDRS, HOST_LINK, assert_no_survivors, free_port, losses, two_hosts

pytestmark = pytest.mark.slow

STEPS = 10
# global batch 8 = micro-batch 2 × 2 ranks × 2 accumulation (× 4 on one rank)
SINGLE = {"train.max_steps": STEPS, "train.micro_batch_size": 2, "train.eval_every": 100}  # test_parity_resume's
COMMON = {**SINGLE, "train.checkpoint_every": 100, "parallel.strategy": "ddp"}

# What a library may read without a default (HF Trainer, DeepSpeed, accelerate read several of them).
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_same_training(out, ref: dict[int, float], tolerance: float = 1e-4) -> dict:
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    worst = max(_rel(got[s], ref[s]) for s in ref)
    assert worst <= tolerance, f"losses differ from one rank by {worst:.2e} (relative)"
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "model" / "model.safetensors").is_file()
    return summary


@pytest.fixture(scope="module")
def reference(tmp_path_factory, trained_run):
    """One rank, trained once per session (test_parity_resume.py and test_zero3.py compare with the same run)."""
    out = tmp_path_factory.mktemp("single") / "run"
    trained_run(out, **SINGLE)
    return losses(out)


def test_pet_variables_start_the_agent(reference, tmp_path, cache_dir):
    """(b'): Kubeflow Trainer's PET_* variables and a plain `cputrain train`, no launch flags."""
    out = tmp_path / "pet"
    # the agent is a fresh interpreter (an environment of its own); its 2 ranks are forked by the warm rank server
    env = cli_env(PET_NNODES=1, PET_NPROC_PER_NODE=2, PET_NODE_RANK=0, PET_MASTER_ADDR="127.0.0.1",
                  PET_MASTER_PORT=free_port(), **warm().ranks.exec_env())
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **COMMON), env=env, check=True)
    assert "2 rank(s) started by torchrun" in proc.stderr
    summary = _assert_same_training(out, reference)
    assert summary["world_size"] == 2
    assert_no_survivors(out)


def test_outside_torchrun(reference, tmp_path, cache_dir):
    """(c): torchrun is the outside launcher; cputrain runs as its worker and sets its own threads."""
    out = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "cputrain", "train", *tiny_overrides(out, cache_dir, **COMMON)]
    # the outside torchrun runs its ranks with PYTHON_EXEC: the warm rank server forks them (`python -u -m cputrain`)
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(**warm().ranks.exec_env()), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 rank(s) started by torchrun" in proc.stderr
    assert "launch plan" not in proc.stderr  # no second agent inside the outside one
    summary = _assert_same_training(out, reference)
    assert summary["world_size"] == 2 and summary["threads_per_rank"] == 1
    assert_no_survivors(out)


MPICH = shutil.which("mpiexec.hydra") or shutil.which("mpirun.mpich")
OPEN_MPI = shutil.which("mpirun.openmpi")
NO_MPICH = "MPICH is not installed (scripts/install-mpi.sh installs MPICH and Open MPI)"


@pytest.mark.skipif(MPICH is not None or OPEN_MPI is not None, reason="a real mpirun is tested below")
def test_mpirun_variables(reference, tmp_path, cache_dir):
    """(d): two processes started as OpenMPI's mpirun starts them (no MPI library needed)."""
    out = tmp_path / "mpirun"
    port = free_port()
    procs = []
    for rank in range(2):
        env = cli_env(OMPI_COMM_WORLD_RANK=rank, OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_LOCAL_RANK=rank,
                      OMPI_COMM_WORLD_LOCAL_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-m", "cputrain", "train",
                                       *tiny_overrides(out, cache_dir, **COMMON)],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    assert "2 rank(s) started by mpirun" in results[0][1]
    summary = _assert_same_training(out, reference)
    assert summary["world_size"] == 2
    assert_no_survivors(out)


# (e) runs the real command in plain python, then reads the variables the way libraries do:
# os.environ[...] without a default, which is where recipes die with KeyError: 'LOCAL_RANK'.
PLAIN_PYTHON = """
import json, os, sys
from cputrain.cli import main
code = main(["train", *sys.argv[1:]])
print(json.dumps({"exit": code, "env": {k: os.environ[k] for k in %r}}))
""" % (RANK_VARIABLES,)


def test_plain_python_world_size_one(reference, tmp_path, cache_dir):
    out = tmp_path / "python"
    overrides = tiny_overrides(out, cache_dir, **{**COMMON, "parallel.strategy": "single"})
    proc = subprocess.run([sys.executable, "-c", PLAIN_PYTHON, *overrides], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 rank(s) started by python" in proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["exit"] == 0
    env = result["env"]
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("0", "1", "0", "1")
    assert env["NODE_RANK"] == env["GROUP_RANK"] == "0" and env["MASTER_ADDR"] and env["MASTER_PORT"].isdigit()
    # one rank with 4 micro-batches of 2, started by plain python, trains like the reference
    _assert_same_training(out, reference)


def _mpirun(*command, out, cache_dir, timeout: int = 300, env: dict | None = None, forked: bool = True, **extra):
    """`MPIRUN-COMMAND python -m cputrain train` on the tiny run's overrides, waited for. `forked`:
    the `python` mpirun starts for each rank is the rank stand-in, so the warm rank server forks
    the rank in its place (the rank gets the stand-in's environment, streams and network
    namespace, ~4.7 s of CPU less a rank); not where the test reads what mpirun's binding did to
    the process it started (a forked rank has the server's affinity)."""
    python, launch_env = (warm().ranks.python, warm().ranks.exec_env()) if forked else (sys.executable, {})
    train = [python, "-m", "cputrain", "train", *tiny_overrides(out, cache_dir, **{**COMMON, **extra})]
    return subprocess.run([*map(str, command), *train], cwd=REPO, env=cli_env(**launch_env, **(env or {})),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(MPICH is None, reason=NO_MPICH)
def test_mpich_mpirun_trains_stops_and_resumes_like_one_rank(reference, tmp_path, cache_dir):
    """(d'): `mpirun -n 2 cputrain train`, stopped at step 5 and run again: one rank's losses."""
    out = tmp_path / "mpich"
    stopped = _mpirun(MPICH, "-n", 2, "-genv", "MASTER_PORT", free_port(), out=out, cache_dir=cache_dir,
                      **{"train.stop_at_step": 5})
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "2 rank(s) started by mpirun" in stopped.stderr
    resumed = _mpirun(MPICH, "-n", 2, "-genv", "MASTER_PORT", free_port(), out=out, cache_dir=cache_dir)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    summary = _assert_same_training(out, reference)
    assert summary["world_size"] == 2
    assert_no_survivors(out)


@pytest.mark.skipif(OPEN_MPI is None, reason="Open MPI is not installed (scripts/install-mpi.sh)")
def test_open_mpi_mpirun_trains_like_one_rank(reference, tmp_path, cache_dir):
    """(d'): Open MPI's `mpirun -n 2 --bind-to none` (it binds each of 2 ranks to one core
    otherwise); as root it asks for its two confirmation variables."""
    out = tmp_path / "openmpi"
    proc = _mpirun(OPEN_MPI, "-n", 2, "--bind-to", "none", "-x", f"MASTER_PORT={free_port()}", out=out,
                   cache_dir=cache_dir, env={"OMPI_ALLOW_RUN_AS_ROOT": 1, "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": 1})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 rank(s) started by mpirun" in proc.stderr
    assert _assert_same_training(out, reference)["world_size"] == 2
    assert_no_survivors(out)


@pytest.mark.skipif(OPEN_MPI is None, reason="Open MPI is not installed (scripts/install-mpi.sh)")
def test_open_mpi_binding_gives_each_rank_its_own_cores(tmp_path, cache_dir):
    """Open MPI's default binding (each of 2 ranks on one core): the rank's threads are the cores
    it was bound to, said with the flag that hands the placement to cputrain."""
    proc = _mpirun(OPEN_MPI, "-n", 2, "-x", f"MASTER_PORT={free_port()}", out=tmp_path / "bound", cache_dir=cache_dir,
                   env={"OMPI_ALLOW_RUN_AS_ROOT": 1, "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": 1}, forked=False,
                   **{"hardware.threads": "auto", "train.max_steps": 1})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mpirun bound this rank to 1 physical core(s)" in proc.stderr and "--bind-to none" in proc.stderr


def _netns_ssh(path, hosts) -> str:
    """An `ssh HOST COMMAND` for MPICH's launcher that runs COMMAND in HOST's network namespace."""
    cases = "\n".join(f"  {addr}) ns={ns} ;;" for ns, addr in hosts)
    path.write_text(f"""#!/bin/sh
while [ "${{1#-}}" != "$1" ]; do shift; done  # ssh's options (-x)
host="$1"; shift
case "$host" in
{cases}
  *) echo "no such host: $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" sh -c "$*"
""")
    path.chmod(0o755)
    return str(path)


@pytest.mark.netns
@pytest.mark.skipif(MPICH is None, reason=NO_MPICH)
def test_mpich_hostfile_two_hosts_two_ranks_each(reference, tmp_path, cache_dir):
    """(d'): `mpirun -f hostfile -n 4 -ppn 2` over two hosts (network namespaces joined by a veth
    pair; MPICH starts its proxy on the other host through an ssh that enters its namespace),
    stopped at step 5 and run again: one rank's losses. Without MASTER_ADDR the ranks stop at once, each with one line saying what to pass."""
    with two_hosts() as hosts:
        hostfile = tmp_path / "hosts"
        hostfile.write_text("".join(f"{addr}:2\n" for _, addr in hosts))
        launch = ["ip", "netns", "exec", hosts[0][0], MPICH, "-f", hostfile, "-n", 4, "-ppn", 2,
                  "-launcher", "ssh", "-launcher-exec", _netns_ssh(tmp_path / "netns-ssh", hosts),
                  "-iface", HOST_LINK, "-wdir", REPO, "-genv", "GLOO_SOCKET_IFNAME", HOST_LINK]
        out = tmp_path / "two-hosts"
        refused = _mpirun(*launch, out=out, cache_dir=cache_dir, timeout=120)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        errors = [line for line in refused.stderr.splitlines() if "error" in line]
        assert errors and all("MASTER_ADDR is not set" in line for line in errors), refused.stderr[-3000:]
        rendezvous = ["-genv", "MASTER_ADDR", HOST_ADDRS[0], "-genv", "MASTER_PORT"]
        stopped = _mpirun(*launch, *rendezvous, 29557, out=out, cache_dir=cache_dir, **{"train.stop_at_step": 5})
        assert stopped.returncode == 0, stopped.stderr[-3000:]
        assert "4 rank(s) started by mpirun" in stopped.stderr
        proc = _mpirun(*launch, *rendezvous, 29558, out=out, cache_dir=cache_dir)
        assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr[-3000:]
        summary = _assert_same_training(out, reference)
        assert summary["world_size"] == 4 and summary["threads_per_rank"] == 1
    assert_no_survivors(out)

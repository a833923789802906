"""torchrun's elastic agent, started by cputrain: what it starts on this node (NodeLaunch), its
command line, and its failures as one line.

The agent is torch.distributed.run's own (its argument parser, LaunchConfig and
elastic_launch), with a c10d rendezvous: the node with node_rank 0 hosts the store at
rdzv_endpoint, the others connect to it. Restarts after a lost rank (launch.max_restarts)
are the agent's; each restarted rank resumes from the newest complete checkpoint. Deciding
what to start, and whether to start the agent at all, is cputrain.training.launch's.
"""

from __future__ import annotations

import errno
import glob
import json
import logging
import os
import signal
import socket
import uuid
from dataclasses import dataclass, field

from cputrain.config import Config
from cputrain.distributed.addresses import route_address
from cputrain.distributed.host_watch import HostWatch
from cputrain.distributed.lost_peer import lost_node_named
from cputrain.native.allocator import AllocatorChoice, preload_env
from cputrain.native.openmp_waits import describe as describe_waits
from cputrain.errors import ConfigError, Diverged, PeerLost, Stopped, UserError
from cputrain.config.resolve import AGENT_SETTINGS_VAR

log = logging.getLogger("cputrain")


class LaunchError(UserError):
    """The ranks could not be started, or they failed."""

    def __init__(self, message: str, exit_code: int = 2, label: str = UserError.label):
        super().__init__(message)
        self.exit_code, self.label = exit_code, label


# torchrun reads PET_<FLAG> for each of its flags; Kubeflow Trainer sets these on every node.
_PET_KEYS = {
    "PET_NNODES": "launch.nnodes",
    "PET_NPROC_PER_NODE": "launch.nproc_per_node",
    "PET_NODE_RANK": "launch.node_rank",
    "PET_RDZV_ENDPOINT": "launch.rdzv_endpoint",
    "PET_MAX_RESTARTS": "launch.max_restarts",
}


def pet_overrides(environ: dict | None = None) -> list[str]:
    """torchrun's PET_* variables as config overrides (they yield to explicit flags and key=value)."""
    env = os.environ if environ is None else environ
    out = []
    for var, key in _PET_KEYS.items():
        value = env.get(var)
        if value is None or value == "":
            continue
        if key != "launch.rdzv_endpoint" and not value.isdigit():
            raise ConfigError(f"{var}={value!r} must be a whole number (cputrain needs a fixed {key})")
        out.append(f"{key}={value}")
    if "PET_RDZV_ENDPOINT" not in env and env.get("PET_MASTER_ADDR"):
        out.append(f"launch.rdzv_endpoint={env['PET_MASTER_ADDR']}:{env.get('PET_MASTER_PORT', '29500')}")
    return out


@dataclass
class RankPlacement:
    """Where one rank of this node runs: its threads and cores (the memory per rank is plan/'s)."""
    rank: int
    local_rank: int
    threads: int
    cpus: list[int] | None


@dataclass
class NodeLaunch:
    """What this node's agent starts, decided and explained before any rank exists."""
    nnodes: int
    nproc_per_node: int
    node_rank: int
    endpoint: str
    is_host: bool
    allocator: AllocatorChoice
    reasons: list[tuple[str, str, str]]
    placement_reason: str
    settings: dict  # the resolved values of every "auto" key (resolve.settings_of), handed to the ranks
    ranks: list[RankPlacement] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def lines(self) -> list[str]:
        out = [f"launch plan for node {self.node_rank} of {self.nnodes}: {self.nproc_per_node} rank(s) here, "
               f"world size {self.world_size}, rendezvous c10d at "
               + (self.endpoint if not self.endpoint.endswith(":0") else f"{self.endpoint[:-2]} (a free port)")
               + (" (this node hosts it)" if self.is_host else "")]
        for key, value, why in self.reasons:
            out.append(f"  {key} = {value}: {why}")
        out.append(f"  cores: {self.placement_reason}")
        lib = self.allocator.library or "none"
        out.append(f"  allocator: {lib} ({self.allocator.reason})")
        out.append(f"  {describe_waits()}")
        for r in self.ranks:
            cpus = "any (not pinned)" if r.cpus is None else ",".join(map(str, r.cpus))
            out.append(f"  rank {r.rank} (local {r.local_rank}): {r.threads} thread(s), OMP_NUM_THREADS={r.threads}, "
                       f"cpus {cpus}")
        return out


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"launch.rdzv_endpoint '{endpoint}' must be host:port, e.g. 10.0.0.1:29400")
    return host, int(port)


def check_port_free(endpoint: str) -> None:
    """The hosting node binds the rendezvous port; fail now, naming it, if something holds it."""
    host, port = split_endpoint(endpoint)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("" if host not in ("127.0.0.1", "localhost") else host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LaunchError(f"port {port} of the rendezvous endpoint {endpoint} is already in use; "
                                  "choose another port in --rdzv-endpoint") from None
            raise LaunchError(f"cannot listen on the rendezvous endpoint {endpoint}: {exc.strerror}") from None


def torchrun_args(plan: NodeLaunch, cfg: Config, worker_args: list[str]) -> list[str]:
    """The torchrun command line (without `torchrun`) that starts this node's ranks."""
    timeout = cfg.launch.rdzv_timeout_s
    # One rendezvous id per run folder, so every node of a run joins the same rendezvous.
    run_id = "cputrain-" + uuid.uuid5(uuid.NAMESPACE_URL, cfg.output_dir).hex[:12]
    return [
        f"--nnodes={plan.nnodes}",
        f"--nproc-per-node={plan.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={plan.endpoint}",
        f"--rdzv-id={run_id}",
        # is_host: node 0 hosts the store (no guessing from host names, which fails in containers);
        # read_timeout bounds how long a node waits to reach an endpoint that is not there.
        f"--rdzv-conf=is_host={int(plan.is_host)},join_timeout={timeout},read_timeout={timeout}",
        f"--max-restarts={cfg.launch.max_restarts}",
        # After a SIGTERM the agent forwards it and waits this long for the ranks to save.
        f"--shutdown-timeout={cfg.launch.stop_timeout_s}",
        # The address the agent advertises to the other nodes: the one on the route to node 0.
        *([f"--local-addr={route_address(*split_endpoint(plan.endpoint))}"] if plan.nnodes > 1 else []),
        "--monitor-interval=0.5",
        "-m", "cputrain", "train", *worker_args,
    ]


def _recorded(failure) -> str:
    """What a failed rank recorded: "ErrorClass: message" (ErrorHandler.record_exception), or the agent's text."""
    message = failure.message
    if isinstance(message, dict):  # what ErrorHandler.record_exception wrote: {"message": ..., "extraInfo": ...}
        message = message.get("message", "")
    return message if isinstance(message, str) else ""


def _rank_message(failure) -> str:
    """The cputrain error a failed rank recorded, or ""."""
    message = _recorded(failure)
    if message == "<NONE>" or message.startswith("To enable traceback") or (
            failure.exitcode < 0 and message.startswith("Signal ")):
        return ""  # no error file: the rank died without a cputrain error (signal, crash, bug)
    for prefix in ("ConfigError: ", "DataError: ", "ModelError: ", "RunFolderError: ", "UserError: ", "LaunchError: ",
                   "Diverged: ", "Stopped: ", "PeerLost: "):
        message = message.removeprefix(prefix)
    return message


def _blame_order(rank: int, failure) -> tuple:
    """Which failed rank to name: the agent stops the others once one fails, and their collectives
    fail on the vanished peer, so a rank that failed by itself comes first. In order: a cputrain
    error (exit 2 or 3), a death by a signal the agent does not send (SIGKILL from the OOM killer,
    SIGSEGV), an error of its own, a rank that only lost its peers (PeerLost) or was stopped by
    the agent's SIGTERM; then the earliest, then the lowest rank."""
    code = failure.exitcode
    if code in (2, Diverged.exit_code):
        kind = 0
    elif code < 0 and -code not in (signal.SIGTERM, signal.SIGINT):
        kind = 1
    elif code > 0 and not _recorded(failure).startswith(f"{PeerLost.__name__}: "):
        kind = 2
    else:
        kind = 3
    return kind, failure.timestamp, rank


def _failure_message(err) -> LaunchError:
    """One line from the agent's ChildFailedError: the first failed rank's own error message."""
    failures = sorted(err.failures.items())
    if all(f.exitcode == Stopped.exit_code for _, f in failures):  # a stop asked for, checkpoint saved
        return LaunchError(_rank_message(failures[0][1]) or "stopped by a signal; re-run the same command to resume",
                           exit_code=Stopped.exit_code, label=Stopped.label)
    rank, first = min(failures, key=lambda item: _blame_order(*item))
    message = _rank_message(first)
    exit_codes = {f.exitcode for _, f in failures}
    if not message:
        killed_by = first.signal_name() if first.exitcode < 0 else None
        message = f"exited with {killed_by}" if killed_by else f"exited with code {first.exitcode}"
        if killed_by == "SIGKILL":
            message += (" (killed from outside: the kernel's OOM killer sends it when memory runs out; `dmesg` says "
                        "which, and `cputrain plan` what a rank needs)")
    exit_code = next((c for c in (2, Diverged.exit_code) if c in exit_codes), 1)
    after = ""
    if _recorded(first).startswith(f"{PeerLost.__name__}: ") and lost_node_named(message):
        # Only peers lost, on another node: nothing here to fix, the node is to be brought back.
        after = ("; run the same command on every node to resume from the newest checkpoint (with "
                 "launch.max_restarts > 0 the nodes left wait launch.rdzv_timeout_s for it instead)")
    return LaunchError(f"{len(failures)} rank(s) failed; rank {rank} first: {message.splitlines()[0]}{after}",
                       exit_code=exit_code)


def _lost_before(log_dir: str) -> str | None:
    """The newest PeerLost line a rank of this agent recorded (torchrun keeps each rank's error
    file under its log folder, one folder per restart), or None."""
    newest: tuple[str, str] | None = None
    for path in glob.glob(os.path.join(log_dir, "**", "error.json"), recursive=True):
        try:
            with open(path) as f:
                recorded = json.load(f).get("message", {})
        except (OSError, ValueError, AttributeError):
            continue
        message = recorded.get("message", "") if isinstance(recorded, dict) else ""
        stamp = str(recorded.get("extraInfo", {}).get("timestamp", "")) if isinstance(recorded, dict) else ""
        if message.startswith(f"{PeerLost.__name__}: ") and (newest is None or stamp >= newest[0]):
            newest = (stamp, message.removeprefix(f"{PeerLost.__name__}: "))
    return newest[1] if newest else None


def _not_back(lost: str, cfg: Config) -> LaunchError:
    """The restart's rendezvous timed out: the node the ranks lost did not come back."""
    named = lost_node_named(lost)
    who, again = (named[1], f"on it (or on a replacement with --node-rank {named[0]})") if named else (
        "a rank of another node", "on every node")
    first = lost.split(": ", 1)[0]  # "rank 0 stopped"
    return LaunchError(f"{who} was lost ({first}) and did not rejoin within {cfg.launch.rdzv_timeout_s}s "
                       f"(launch.rdzv_timeout_s) of the restart; run the same `cputrain train` {again} and here: "
                       "the run resumes from the newest checkpoint")


def run_agent(plan: NodeLaunch, cfg: Config, worker_args: list[str]) -> dict:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    if plan.is_host:
        check_port_free(plan.endpoint)
    # Each rank's environment: threads = cores ÷ ranks (torchrun would set 1), and the allocator.
    os.environ["OMP_NUM_THREADS"] = str(plan.ranks[0].threads)
    # What "auto" resolved to here: every rank resolves again and must come to the same values.
    os.environ[AGENT_SETTINGS_VAR] = json.dumps(plan.settings)
    preload_env(plan.allocator, os.environ)
    # Where the ranks meet. On one node: on the agent's own store (torch's shared rendezvous store,
    # bound on a free port as it opens), under a prefix of the restart round
    # (process_group.agent_store_of_this_round). Sharing off, the agent picks a free port and rank 0
    # binds it seconds later, after its imports, and any process's outgoing connection can take the
    # port in between (EADDRINUSE: it failed a run of the test suite). Across nodes sharing stays off:
    # node 0's agent publishes the shared store's address only in the first round, so a node that
    # rejoins with a new agent waits for it until the rendezvous times out (test_node_loss).
    if plan.nnodes > 1:
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = parse_args(torchrun_args(plan, cfg, worker_args))
    config, cmd, cmd_args = config_from_args(args)
    log.info("starting %d rank(s) on this node through the torchrun agent (rendezvous %s, max restarts %d)",
             plan.nproc_per_node, plan.endpoint, cfg.launch.max_restarts)
    if not plan.is_host:  # node 0 hosts the rendezvous: only the other nodes can lose it
        HostWatch(*split_endpoint(plan.endpoint), patience_s=cfg.launch.rdzv_timeout_s).start()
    try:
        return elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as err:
        raise _failure_message(err) from None
    except SignalException as err:
        # The agent was told to stop (a pod's SIGTERM): it has forwarded the signal and waited up to
        # launch.stop_timeout_s for the ranks, which finish their step and save (rank 0 printed where).
        raise LaunchError(f"stopped by {signal.Signals(err.sigval).name}: the ranks were given "
                          f"{cfg.launch.stop_timeout_s} s (launch.stop_timeout_s) to finish their step and save a "
                          "checkpoint; re-run the same command to resume", exit_code=Stopped.exit_code,
                          label=Stopped.label) from None
    except RendezvousTimeoutError:
        lost = _lost_before(config.logs_specs.root_log_dir)
        if lost is not None:  # the rendezvous of a restart, waiting for a node that did not come back
            raise _not_back(lost, cfg) from None
        raise LaunchError(f"rendezvous at {plan.endpoint} timed out after {cfg.launch.rdzv_timeout_s}s: not all "
                          f"{plan.nnodes} nodes joined; start `cputrain train --nnodes {plan.nnodes}` on every node "
                          "or raise launch.rdzv_timeout_s") from None
    except RendezvousError as err:
        cause = str(err.__cause__ or err).strip().splitlines()[0] if str(err.__cause__ or err).strip() else ""
        raise LaunchError(f"could not reach the rendezvous endpoint {plan.endpoint} within "
                          f"{cfg.launch.rdzv_timeout_s}s ({cause[:160]}); check that node 0 runs "
                          "`cputrain train --node-rank 0` there and that the port is open") from None

"""Disjoint core sets per rank, whole NUMA nodes where they divide; the allocator search."""

from __future__ import annotations

import dataclasses

from cputrain.native.allocator import allocator_choice, preload_env
from cputrain.distributed.placement import core_sets
from cputrain.config import Config
from cputrain.hardware import Core, detect, parse_cpu_list
from cputrain.config.resolve import resolve


def _machine(numa_nodes: int, cores_per_node: int):
    cores = [Core(cpu=n * cores_per_node + i, socket=n, numa_node=n) for n in range(numa_nodes) for i in range(cores_per_node)]
    return dataclasses.replace(detect(), cores=cores, numa_nodes=numa_nodes, sockets=numa_nodes)


def test_ranks_get_whole_numa_nodes_and_never_share_a_core():
    hw = _machine(numa_nodes=2, cores_per_node=16)
    plan = core_sets(hw, 2)
    assert plan.sets == [list(range(16)), list(range(16, 32))]
    assert "NUMA" in plan.reason
    four = core_sets(hw, 4).sets
    assert [len(s) for s in four] == [8, 8, 8, 8]
    assert len({c for s in four for c in s}) == 32  # disjoint
    assert all({c // 16 for c in s} in ({0}, {1}) for s in four)  # each inside one node


def test_uneven_split_leaves_spare_cores_idle():
    plan = core_sets(_machine(numa_nodes=1, cores_per_node=8), 3)
    assert [len(s) for s in plan.sets] == [2, 2, 2] and "idle" in plan.reason


def test_a_rank_mpirun_bound_takes_its_own_cores_not_a_share_of_them():
    """Under Intel MPI's pin domains (or Open MPI's binding) a rank sees only its own cores: 14 of
    a 28-core node for 2 ranks. Those are its threads; divided again by the ranks they would be 7."""
    share = _machine(numa_nodes=1, cores_per_node=14)
    bound = resolve(Config(), share, world_size=2, local_world_size=2, bound_by_launcher=True)
    assert bound.config.hardware.threads == 14
    assert any("mpirun bound this rank" in why for key, _, why in bound.reasons if key == "hardware.threads")
    node = _machine(numa_nodes=1, cores_per_node=28)  # not bound: the node's cores, divided
    assert resolve(Config(), node, world_size=2, local_world_size=2).config.hardware.threads == 14


def test_cpu_lists_as_the_kernel_writes_them():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}


def test_allocator_found_and_preloaded(tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    choice = allocator_choice("auto", environ={}, dirs=[str(tmp_path)])
    assert choice.library == str(lib)
    env = {"LD_PRELOAD": "/other.so"}
    preload_env(choice, env)
    assert env["LD_PRELOAD"] == f"{lib}:/other.so"
    assert allocator_choice("system", environ={}, dirs=[str(tmp_path)]).library is None
    assert allocator_choice("auto", environ={}, dirs=[str(tmp_path / "none")]).library is None


def test_auto_takes_tcmalloc_never_jemalloc_and_says_why(tmp_path):
    """jemalloc measured 0.92–1.00× glibc's speed in fp32 (benchmarks/step_time/fp32_choices.py) and 0.74–0.95×
    in bf16 (benchmarks/memory/allocator.py): auto leaves it alone even where it is the only one installed;
    asked for by name, it is used. tcmalloc was fastest in every row of both; the reason cites the
    figures of the run's own precision, and tcmalloc's memory price where it was measured."""
    (tmp_path / "libjemalloc.so.2").write_bytes(b"")
    for precision in ("fp32", "bf16", None):
        auto = allocator_choice("auto", environ={}, dirs=[str(tmp_path)], precision=precision)
        assert auto.library is None and auto.name == "system" and "no tcmalloc installed" in auto.reason
    assert allocator_choice("jemalloc", environ={}, dirs=[str(tmp_path)]).library == str(tmp_path / "libjemalloc.so.2")
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    fp32 = allocator_choice("auto", environ={}, dirs=[str(tmp_path)], precision="fp32")
    bf16 = allocator_choice("auto", environ={}, dirs=[str(tmp_path)], precision="bf16")
    assert fp32.library == bf16.library == str(tmp_path / "libtcmalloc.so.4")
    assert "1.17× with a 128k-vocabulary head" in fp32.reason and "AVX512-BF16" not in fp32.reason
    assert "1.12× with LoRA on ~300M" in bf16.reason and "step peak" in bf16.reason and "AVX2" not in bf16.reason
    unresolved = allocator_choice("auto", environ={}, dirs=[str(tmp_path)])  # precision still `auto`: both
    assert "fp32 tokens/s" in unresolved.reason and "bf16 tokens/s" in unresolved.reason


def test_a_one_process_run_is_started_again_once_with_the_allocator(tmp_path):
    from cputrain.native.allocator import REEXEC_MARK, reexec_env

    lib = tmp_path / "libtcmalloc.so.4"
    lib.write_bytes(b"")
    choice = allocator_choice("auto", environ={}, dirs=[str(tmp_path)])
    env = reexec_env(choice, {"LD_PRELOAD": "/other.so", "PATH": "/bin"})
    assert env["LD_PRELOAD"] == f"{lib}:/other.so" and env[REEXEC_MARK] == "1" and env["PATH"] == "/bin"
    assert env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]  # no "large alloc" lines in the training log
    assert reexec_env(choice, env) is None  # started again once, never twice
    assert reexec_env(allocator_choice("system", environ={}), {}) is None


def test_without_tcmalloc_auto_tunes_glibc_on_whole_tensor_strategies_only(tmp_path):
    """No tcmalloc: single and ddp keep what a step frees (glibc-tuned); fsdp and zero3 keep glibc
    as is (their memory is the point, and they pin its mmap threshold); a strategy not known yet
    (the agent's dry report before resolving) is glibc as is."""
    nothing = [str(tmp_path / "none")]
    for strategy in ("single", "ddp"):
        choice = allocator_choice("auto", environ={}, dirs=nothing, precision="bf16", strategy=strategy)
        assert choice.name == "glibc-tuned" and choice.library is None and "step peak" in choice.reason
    for strategy in ("fsdp", "zero3", None):
        assert allocator_choice("auto", environ={}, dirs=nothing, strategy=strategy).name == "system"
    for strategy in ("fsdp", "zero3"):  # where tcmalloc matters most, the reason says what it would give
        reason = allocator_choice("auto", environ={}, dirs=nothing, strategy=strategy).reason
        assert "apt install" in reason and "× faster" in reason and "sharded_rank" in reason
    asked = allocator_choice("glibc-tuned", environ={}, dirs=nothing, strategy="fsdp")
    assert asked.name == "glibc-tuned" and asked.library is None
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")  # installed: tcmalloc, whatever the strategy
    assert allocator_choice("auto", environ={}, dirs=[str(tmp_path)], strategy="single").name == "tcmalloc"


# A fresh interpreter (no torch) mallocs 64 MiB, touches it, frees it, and prints its resident
# MiB after the free; with `tune` it first calls tune_glibc.
_FREE_64_MIB = """
import ctypes, os, sys
sys.path.insert(0, {repo!r})
if {tune}:
    from cputrain.native.allocator import tune_glibc
    assert tune_glibc()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
block = libc.malloc(64 << 20)
ctypes.memset(block, 1, 64 << 20)
libc.free(ctypes.c_void_p(block))
print(int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20)
"""


def test_tuned_glibc_keeps_a_freed_block_for_the_next_step():
    """As is, glibc maps a 64 MiB block of its own and unmaps it when freed (the next step maps
    and zeroes it again); tuned, the block comes from the heap and stays resident after the free."""
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    resident = {tune: int(subprocess.run([sys.executable, "-c", _FREE_64_MIB.format(repo=repo, tune=tune)],
                                         capture_output=True, text=True, check=True).stdout)
                for tune in (False, True)}
    assert resident[True] - resident[False] > 48, resident

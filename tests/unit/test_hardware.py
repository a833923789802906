"""Hardware facts read from /proc and /sys, and the peak FLOP/s formula."""

from __future__ import annotations

import os

import pytest

from cputrain.hardware import FLAGS_OF_INTEREST, detect, peak_flops, report_lines


def test_detect_matches_what_the_os_reports():
    hw = detect()
    allowed = len(os.sched_getaffinity(0))
    assert hw.logical_cpus == allowed
    assert 1 <= hw.physical_cores <= allowed
    assert len({c.cpu for c in hw.cores}) == hw.physical_cores  # one logical CPU per physical core
    assert 1 <= hw.sockets <= hw.physical_cores and 1 <= hw.numa_nodes <= hw.physical_cores
    assert 0.5 < hw.memory_gib < 1e5
    assert set(hw.flags) == set(FLAGS_OF_INTEREST)
    cpuinfo = open("/proc/cpuinfo").read()
    flags_line = next(line for line in cpuinfo.splitlines() if line.startswith("flags")).split()
    for flag in FLAGS_OF_INTEREST:
        assert hw.flags[flag] == (flag in flags_line), flag
    assert hw.backends["gloo"] is True
    assert hw.peak_flops["fp32"] > 0 and set(hw.peak_formula) == set(hw.peak_flops)


def test_peak_formula_avx2_fma():
    flags = {"avx2": True, "fma": True}
    peaks, formulas = peak_flops(flags, cores=2, clock_ghz=3.0)
    # 2 cores × 3 GHz × (2 FMA pipes × 8 lanes × 2)
    assert peaks["fp32"] == pytest.approx(2 * 3e9 * 32)
    assert "2 cores × 3.00 GHz × 32 FLOP/cycle" in formulas["fp32"]
    assert peaks["bf16"] < peaks["fp32"] / 50  # emulated bf16 is far below fp32
    assert "emulated" in formulas["bf16"]


def test_peak_formula_avx512_and_amx():
    peaks, _ = peak_flops({"avx512f": True, "fma": True, "avx512_bf16": True}, cores=4, clock_ghz=2.0)
    assert peaks["fp32"] == pytest.approx(4 * 2e9 * 64)
    assert peaks["bf16"] == pytest.approx(4 * 2e9 * 128)
    peaks, formulas = peak_flops({"avx512f": True, "fma": True, "amx_bf16": True, "amx_tile": True}, cores=4, clock_ghz=2.0)
    assert peaks["bf16"] == pytest.approx(4 * 2e9 * 1024)
    assert "AMX" in formulas["bf16"]


def test_report_lines_show_every_fact():
    text = "\n".join(report_lines(detect()))
    for word in ("physical", "socket", "NUMA", "GiB", "amx_bf16=", "avx2=", "torch", "gloo=", "peak fp32", "FLOP/cycle"):
        assert word in text, word


def test_a_containers_memory_limit_is_what_a_rank_may_plan_on(tmp_path):
    """A pod reads the node's memory in /proc/meminfo but is killed at its cgroup limit."""
    from cputrain.hardware import memory_limit_bytes

    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    assert memory_limit_bytes((str(v2), str(v1))) is None  # no cgroup files: no limit
    v2.write_text("max\n")
    assert memory_limit_bytes((str(v2), str(v1))) is None
    v2.write_text(f"{28 * 2**30}\n")
    assert memory_limit_bytes((str(v2), str(v1))) == 28 * 2**30
    v2.unlink()
    v1.write_text("9223372036854771712\n")  # cgroup v1's "unlimited", page-rounded 2^63
    assert memory_limit_bytes((str(v2), str(v1))) is None
    v1.write_text(f"{12 * 2**30}\n")
    assert memory_limit_bytes((str(v2), str(v1))) == 12 * 2**30

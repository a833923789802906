"""The run's last line: its wall time against the budget, and the machine's speed beside it."""

from __future__ import annotations

from harness import budget


class _Lines:
    def __init__(self):
        self.lines = []

    def write_line(self, line, **markup):
        self.lines.append(line)


def test_the_last_line_says_the_machines_speed_at_both_ends_and_warns_past_half_of_ci():
    out = _Lines()
    budget.report_wall_time(out, 900, 188.4, 151.2)
    assert len(out.lines) == 1 and out.lines[0].startswith("suite wall time: 900 s on ")
    assert out.lines[0].endswith("; fp32 matmul 2048² 188 GFLOP/s at the start, 151 at the end")
    quiet = _Lines()
    budget.report_wall_time(quiet, 50 * 60)  # the fast tier: no speed timed; past 45 min, a warning
    assert "GFLOP/s" not in quiet.lines[0] and quiet.lines[1].startswith("warning: the suite took 50 min")


def test_the_speed_is_timed_in_gflops():
    assert 1 < budget.matmul_gflops() < 100_000

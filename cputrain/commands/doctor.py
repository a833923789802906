"""`cputrain doctor`: the hardware, the torch build, the measured matmul peaks and what every
`auto` setting resolves to for one rank on this machine."""

from __future__ import annotations

import argparse
import json
import os


def add_parser(sub) -> argparse.ArgumentParser:
    doctor = sub.add_parser("doctor", help="show the hardware, the torch build and what `auto` settings resolve to")
    doctor.add_argument("--json", action="store_true", help="print the facts as JSON")
    return doctor


def run(args) -> int:
    from cputrain.config import Config
    from cputrain.distributed.env import normalize
    from cputrain.hardware import detect, report_lines
    from cputrain.config.resolve import resolve

    hw = detect()
    ranks = normalize(dict(os.environ))
    res = resolve(Config(), hw, world_size=ranks.world_size, local_world_size=ranks.local_world_size)
    from cputrain.metrics.measured_peak import machine_peaks

    measured = machine_peaks(hw, threads=res.config.hardware.threads)
    if args.json:
        from dataclasses import asdict

        facts = asdict(hw)
        facts["measured_peak_flops"] = {p: {"flops": f, "how": how} for p, (f, how) in measured.items()}
        facts["auto"] = {k: {"value": v, "reason": why} for k, v, why in res.reasons}
        print(json.dumps(facts, indent=2, default=str))
        return 0
    from cputrain.native.libs import report_lines as native_lib_lines

    for line in report_lines(hw) + native_lib_lines():
        print(line)
    for precision, (flops, how) in measured.items():
        share = flops / hw.peak_flops[precision]
        print(f"measured {precision:<5} {flops / 1e9:9.1f} GFLOP/s = {share:.0%} of the peak above ({how}; best seen here)")
    print("auto settings for one rank on this machine:")
    for key, value, why in res.reasons:
        print(f"  {key} = {value}: {why}")
    return 0

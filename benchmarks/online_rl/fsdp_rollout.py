"""Rollouts from an FSDP2-sharded policy: the fused decoder (the ranks gather the weights once, then
each decodes alone) against the model's own modules (every decode step gathers every block from the
other ranks). Writes block `fsdp_rollout` of docs/benchmarks/online-rl.md.

    python benchmarks/online_rl/fsdp_rollout.py           # demo size and ~100M, bf16 and fp32: run it alone
    python benchmarks/online_rl/fsdp_rollout.py --quick   # a tiny model, one run: prints the block only

Two gloo ranks on this machine (one thread each, a file rendezvous), each with its own share of
GRPO's batch: 4 prompts × 8 generations = 32 rows a rank, 48 new tokens, every row to the end (random
weights, no stop token). The policy is sharded as the fsdp strategy shards it (each decoder block a
unit, then the root), bf16 as the strategy computes it (fp32 shards, FSDP2's mixed-precision policy
gathering them in bf16), fp32 without a policy. Each cell: the two paths alternated `--runs` times
(the order reversed each run), the median of rank 0's tokens/s; a rollout's time includes the
fused path's gather and copy of the weights.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.online_rl.rollouts import ARCH_100M, QUICK_ARCH, VOCAB_100M, batch, build, demo_shape  # noqa: E402
from benchmarks.runner.blocks import block_parser, print_and_write_block  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402

WORLD = 2
PROMPTS, GENERATIONS, NEW_TOKENS = 4, 8, 48


def _rank(rank: int, rendezvous: str, cells: list, runs: int, quick: bool, results) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from cputrain.model.skeleton import decoder_blocks
    from cputrain.rollouts.decoder_weights import decoder_weights
    from cputrain.rollouts.sampling import SamplingSettings, sample

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    try:
        found = {}
        for size, arch, vocab, precision in cells:
            model = build(arch, vocab, torch.float32).train()
            policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if precision == "bf16" else {}
            for block in decoder_blocks(model):
                fully_shard(block, **policy)
            fully_shard(model, **policy)
            held = decoder_weights(model, None)
            fused_mib = sum(t.numel() * t.element_size() for t in [held.embed, held.head] + [
                w for b in held.blocks for w in (b.qkv, b.out, b.gate_up, b.down)]) / 2**20
            del held
            rows = batch(vocab, *((2, 2) if quick else (PROMPTS, GENERATIONS)))
            # each rank its own prompts: rank 1's are the batch reversed
            rows = rows if rank == 0 else rows[::-1]
            new = 8 if quick else NEW_TOKENS
            settings = SamplingSettings(max_new_tokens=new, temperature=1.0)

            def any_running(local: bool) -> bool:
                flag = torch.tensor([int(local)])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                return bool(flag.item())

            speeds = {"fused": [], "modules": []}
            for run in range(runs):
                for path in (("fused", "modules") if run % 2 == 0 else ("modules", "fused")):
                    dist.barrier()
                    start = time.perf_counter()
                    rollout = sample(model, rows, settings, torch.Generator().manual_seed(run), any_running,
                                     fused=path == "fused")
                    seconds = time.perf_counter() - start
                    assert rollout.path == path and rollout.new_tokens == len(rows) * new
                    speeds[path].append(rollout.new_tokens / seconds)
            found[(size, precision)] = {"fused": statistics.median(speeds["fused"]),
                                        "modules": statistics.median(speeds["modules"]), "fused_mib": fused_mib,
                                        "rows": len(rows), "new": new}
            print(rank, size, precision, found[(size, precision)], flush=True)
        results[rank] = found
    finally:
        dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    from cputrain.hardware import detect

    parser = block_parser("online-rl.md", 3)
    args = parser.parse_args()
    precisions = ["bf16", "fp32"] if detect().has_fast_bf16 or args.quick else ["fp32"]
    sizes = {"quick": (QUICK_ARCH, 512)} if args.quick else {"demo": demo_shape(), "~100M": (ARCH_100M, VOCAB_100M)}
    cells = [(size, arch, vocab, precision) for size, (arch, vocab) in sizes.items() for precision in precisions]
    runs = 1 if args.quick else args.runs
    results = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_rank, args=(f"file://{folder}/rendezvous", cells, runs, args.quick, results),
                           nprocs=WORLD, start_method="spawn")
    found = results[0]
    prompts, generations = (2, 2) if args.quick else (PROMPTS, GENERATIONS)
    lines = [machine_line(), "",
             f"`python benchmarks/online_rl/fsdp_rollout.py{' --quick' if args.quick else ''}`: {WORLD} gloo ranks "
             f"on this machine, 1 thread each, the policy sharded by FSDP2 (blocks, then the root), "
             f"{prompts * generations} rows a rank ({prompts} prompts × {generations} "
             f"generations), {found[(cells[0][0], cells[0][3])]['new']} new tokens each, temperature 1, no row "
             f"stopping early; rank 0's tokens/s, median of {runs} alternated run(s); the fused rollout's time "
             "includes gathering and copying the weights.", "",
             "| size | precision | modules tokens/s | fused tokens/s | fused ÷ modules | fused weights a rank MiB |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for size, _, _, precision in cells:
        cell = found[(size, precision)]
        lines.append(f"| {size} | {precision} | {cell['modules']:,.0f} | {cell['fused']:,.0f} | "
                     f"{cell['fused'] / cell['modules']:.2f}× | {cell['fused_mib']:,.1f} |")
    print_and_write_block("fsdp_rollout", "\n".join(lines), args.doc, args.quick)


if __name__ == "__main__":
    main()

"""The MFU a time plan assumes: this project's own measurements (docs/benchmarks/), one row per
precision × CPU kind × what is trained, each naming the block and machine it comes from.

MFU here is the trainer's (cputrain.metrics.flops): model FLOPs per second ÷ the theoretical
peak of the cores used. A run that recomputed checkpointed blocks did more work than its MFU
counts, so each row also keeps `executed_per_model_flops` (FLOPs the cores ran ÷ FLOPs counted):
the rate at which the cores execute FLOPs is MFU × that ratio, and the plan spends that rate on
its own step's FLOPs, recompute included.

Every figure so far is from 2 cores of a virtual machine; a whole server's MFU (more cores share
the memory bandwidth) is still to be measured, and the plan says so when it uses a row.
"""

from __future__ import annotations

from dataclasses import dataclass

AMX_VM = "Intel Xeon with AMX, 2 cores"
BF16_EPYC = "AMD EPYC with AVX512-BF16 (no AMX), 2 cores"
AVX512_EPYC = "AMD EPYC with AVX-512, 2 cores"
AVX2_EPYC = "AMD EPYC with AVX2 only, 2 cores"


@dataclass(frozen=True)
class MeasuredMfu:
    precision: str  # fp32 | bf16
    cpu: str  # amx | avx512_bf16 | avx512 | avx2: the best matmul instructions of the machine measured
    training: str  # full | lora
    mfu: float  # model FLOPs ÷ theoretical peak, as the run logged it
    executed_per_model_flops: float  # > 1 where the run recomputed checkpointed blocks
    block: str  # the <!-- bench: NAME --> block of a page of docs/benchmarks/
    machine: str
    what: str

    @property
    def executed_share_of_peak(self) -> float:
        """The share of the peak at which the cores ran FLOPs, recompute included."""
        return self.mfu * self.executed_per_model_flops

    def describe(self) -> str:
        return f"{self.mfu:.1%} from docs/benchmarks/, block {self.block} ({self.what}; {self.machine})"


ROWS = (
    # 32 compiled Llama-3-8B layers and the chunked head, each measured, put together: 17.8 tokens/s
    # on 2 cores, no block recomputed.
    MeasuredMfu("bf16", "amx", "full", 0.161, 1.0, "layer_mfu", AMX_VM,
                "a full Llama-3-8B step from its measured compiled layers and head"),
    # 1.77 s per Llama-3-8B-shaped LoRA layer (r=16, seven projections), seq 2048: (4·218.11M +
    # 2·1.31M + 12·4096·2048) FLOP/token × 2048 tokens = 2.00 TFLOP in 1.77 s = 21.2% of 5,325 GFLOP/s.
    MeasuredMfu("bf16", "amx", "lora", 0.212, 1.0, "lora_8b-layer", AMX_VM,
                "Llama-3-8B-shaped LoRA layers, eager, without the head"),
    # The whole 8B LoRA step, 30 of 32 blocks checkpointed: ~29 TFLOP recomputed beside the 68.5
    # counted (2·218.11M + 4·4096·2048 FLOP/token per recomputed block × 30 × 2048 tokens).
    MeasuredMfu("bf16", "avx512_bf16", "lora", 0.362, 1.42, "lora_8b-bf16", BF16_EPYC,
                "a whole Llama-3-8B LoRA step, 30 of 32 blocks checkpointed"),
    # 2 ranks × 1 thread under DDP: the step's ~8% of communication (loopback) is inside this MFU.
    MeasuredMfu("fp32", "avx512", "full", 0.467, 1.0, "strategies", AVX512_EPYC,
                "a ~34M Llama under 2-rank DDP, seq 512"),
    # seq 256; the block does not record whether blocks were checkpointed: counted as none.
    MeasuredMfu("fp32", "avx2", "lora", 0.258, 1.0, "lora_8b-fp32", AVX2_EPYC,
                "a whole Llama-3-8B LoRA step at seq 256"),
)
# What stands in for a CPU kind with no row of its own, nearest first.
NEAREST_CPU = {"amx": ("amx", "avx512_bf16", "avx512", "avx2"), "avx512_bf16": ("avx512_bf16", "amx", "avx512", "avx2"),
               "avx512": ("avx512", "avx512_bf16", "avx2", "amx"), "avx2": ("avx2", "avx512", "avx512_bf16", "amx")}


def cpu_kind(flags: dict[str, bool]) -> str:
    """The kind of a CPU as the table names it, from cputrain.hardware's flags."""
    for kind in ("amx_bf16", "avx512_bf16", "avx512f", "avx2"):
        if flags.get(kind):
            return {"amx_bf16": "amx", "avx512f": "avx512"}.get(kind, kind)
    return "avx2"


@dataclass(frozen=True)
class MfuChoice:
    row: MeasuredMfu
    exact: bool  # the row is of this precision, CPU kind and training

    def describe(self) -> str:
        text = self.row.describe()
        if not self.exact:
            text += " — the nearest measured row: none yet for this precision, CPU and training"
        if self.row.cpu == "amx" or not self.exact:
            text += "; a whole AMX instance's MFU is still to be measured"
        return text


def measured_mfu(precision: str, cpu: str, lora: bool) -> MfuChoice:
    """The row for `precision` on a CPU of kind `cpu`, full fine-tuning or LoRA: the exact one,
    else the same precision and training on the nearest CPU kind, else the other training."""
    training = "lora" if lora else "full"
    order = NEAREST_CPU.get(cpu, NEAREST_CPU["avx2"])
    for wanted_training in (training, "full" if lora else "lora"):
        for kind in order:
            for row in ROWS:
                if (row.precision, row.cpu, row.training) == (precision, kind, wanted_training):
                    return MfuChoice(row, exact=(kind, wanted_training) == (cpu, training))
    raise ValueError(f"no measured MFU for precision {precision}")

"""Where each benchmark's block lives in docs/benchmarks/: its page, and the section of that page.

The pages are ordered by the question a reader brings (speed against the Hugging Face Trainer,
where a step's time goes, memory, LoRA, ...), not by when a block was first measured, so a script
cannot simply append its block to a file: it is registered here, by name or by a pattern that
covers the names a script derives (`allocator-<precision>`, `lora_8b-<precision>-<overrides>`).
The first entry that matches a name is its place.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"

# (block name or fnmatch pattern, page under docs/benchmarks/, section heading as written on the page).
# A section of None: the block carries a heading of the page's section level itself (`## ...`), so it
# heads its own section, placed at the end of the page when first written.
BLOCK_PAGES: tuple[tuple[str, str, str | None], ...] = (
    ("vs_hf_trainer", "vs-hf-trainer.md", "## cputrain vs the Hugging Face Trainer"),
    ("vs_hf_trainer-*", "vs-hf-trainer.md", "## cputrain vs the Hugging Face Trainer"),
    ("step_profile", "step-time.md", "## The step, operator by operator"),
    ("layer_mfu", "step-time.md", "## MFU of Llama-3-8B's layers"),
    ("bf16_step", "step-time.md", "## The bf16 step"),
    ("bf16_end_to_end", "step-time.md", "## The bf16 step"),
    ("fp32_choices-*", "step-time.md", "## The fp32 step"),
    ("weights-check", "step-time.md", None),
    ("plan-vs-actual", "memory.md", "## The memory plan against measurement"),
    ("sharded_load", "memory.md", "## Loading a model on several ranks"),
    ("allocator-*", "memory.md", "## Which malloc"),
    ("heap_retention", "memory.md", "## What the heap keeps after a step"),
    ("shared_mask", "memory.md", "## A row's own mask"),
    # lora.py writes block lora holding one inner block per part; the parts measured later sit
    # in sections of their own.
    ("lora", "lora.md", "## LoRA against full fine-tuning and peft"),
    ("lora_300m", "lora.md", "## LoRA against full fine-tuning and peft"),
    ("lora_vs-peft", "lora.md", "## LoRA against full fine-tuning and peft"),
    ("lora_8b-layer", "lora.md", "## LoRA against full fine-tuning and peft"),
    ("lora_compile", "lora.md", "## Compiled blocks with LoRA"),
    ("lora_compile-timed", "lora.md", "## Compiled blocks with LoRA"),
    ("lora_checkpointing", "lora.md", "## Activation checkpointing with LoRA"),
    ("lora_base-dtype", "lora.md", "## A bf16-stored base under fp32 compute"),
    ("lora_8b-*", "lora.md", "## Llama-3-8B LoRA on one machine"),
    ("scale_out", "network.md", "## Ranks on one machine"),
    ("strategies", "network.md", "## Strategies: DDP, FSDP, ZeRO-3 and offload"),
    ("gloo_link", "network.md", "## gloo over a shaped link"),
    ("gloo_link-runs", "network.md", "## 2-node runs against the time plan"),
    ("reduce_dtype_drift", "network.md", "## Gradients reduced in bf16"),
    ("fsdp_layouts", "network.md", "## FSDP layouts over a shaped link"),
    ("fsdp_prefetch", "network.md", "## FSDP's gathers issued a block ahead"),
    ("fsdp_overlap", "network.md", "## gather_once's reduce-scatter left running behind the backward"),
    ("sharded_rank", "network.md", "## A sharded rank against the single strategy"),
    ("sharded_rank_fp32", "network.md", "## A sharded rank against the single strategy"),
    ("sharded_rank_bf16", "network.md", "## A sharded rank against the single strategy"),
    ("two_ranks", "network.md", "## A sharded rank against the single strategy"),
    ("two_ranks_34m", "network.md", "## A sharded rank against the single strategy"),
    ("two_ranks_overlap", "network.md", "## gather_once's reduce-scatter left running behind the backward"),
    ("zero3_fetch", "network.md", "## A sharded rank against the single strategy"),
    ("openmp_waits", "network.md", "## A sharded rank against the single strategy"),
    ("zero3_persistence", "network.md", "## A sharded rank against the single strategy"),
    ("zero3_reduce_bucket", "network.md", "## A sharded rank against the single strategy"),
    ("zero3_reduce_bucket_fp32", "network.md", "## A sharded rank against the single strategy"),
    ("data_prep", "data.md", "## Preparing a corpus: cputrain against run_clm"),
    ("ranks_preparing", "data.md", "## Every rank of a node at a missing cache"),
    ("gguf_vs_transformers", "export.md", "## GGUF files against transformers"),
    ("sft", "sft-and-dpo.md", "## SFT against TRL"),
    ("dpo", "sft-and-dpo.md", "## DPO against TRL"),
    ("dpo_memory", "sft-and-dpo.md", "## DPO's memory against SFT's"),
    ("preference_head", "sft-and-dpo.md", "## The preference head, plain and block-wise"),
    ("shared_prompt", "sft-and-dpo.md", "## Pairs that share their prompt"),
    ("kto", "sft-and-dpo.md", "## KTO against TRL"),
    ("reward_model", "sft-and-dpo.md", "## Reward models against TRL"),
    ("revision-parity", "revision-parity.md", None),
    ("revision-parity-sharded", "revision-parity.md", None),
    ("rollouts", "online-rl.md", "## Rollouts: sample() against generate()"),
    ("rollouts_fp32", "online-rl.md", "## Rollouts: sample() against generate()"),
    ("rollouts_prompt_length", "online-rl.md", "## Rollouts: sample() against generate()"),
    ("llama_cpp_rollout", "online-rl.md", "## llama.cpp as the rollout's decoder"),
    ("fsdp_rollout", "online-rl.md", "## Rollouts from a sharded policy"),
    ("grpo_step", "online-rl.md", "## A GRPO step against TRL's GRPOTrainer"),
    ("grpo_step_fp32", "online-rl.md", "## A GRPO step against TRL's GRPOTrainer"),
    ("rl_head", "online-rl.md", "## The log-probabilities' head, whole and block-wise"),
)

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+\S")
OPEN = re.compile(r"^<!-- bench: \S+ -->$")
CLOSE = re.compile(r"^<!-- /bench: \S+ -->$")


def place_of(name: str) -> tuple[str, str | None]:
    """(page, section heading) of block `name`; an unregistered name is refused."""
    for pattern, page, section in BLOCK_PAGES:
        if fnmatch.fnmatchcase(name, pattern):
            return page, section
    raise ValueError(f"block {name!r} has no place in docs/benchmarks/: register it in benchmarks/runner/pages.py "
                     f"(BLOCK_PAGES: the name or a pattern for it, its page and the section it belongs under)")


def page_of(name: str, docs: Path = DOCS) -> Path:
    return docs / place_of(name)[0]


def section_span(text: str, heading: str) -> tuple[int, int] | None:
    """Character offsets of the section under `heading` (a line of the page, outside code fences):
    from the heading to the next heading of its level or higher, or the page's end. Headings inside
    blocks count, so a block that heads its own section (`## ...`) ends the one before it, at the
    block's opening marker."""
    level = len(heading) - len(heading.lstrip("#"))
    start = None
    offset, in_fence = 0, False
    open_blocks: list[int] = []  # offsets of the opening markers of the blocks the line is inside
    for line in text.splitlines(keepends=True):
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            if OPEN.match(line):
                open_blocks.append(offset)
            elif CLOSE.match(line) and open_blocks:
                open_blocks.pop()
            elif start is None and line.rstrip("\n") == heading:
                start = offset
            elif start is not None:
                match = HEADING.match(line)
                if match and len(match.group(1)) <= level:
                    return start, open_blocks[0] if open_blocks else offset
        offset += len(line)
    return None if start is None else (start, len(text))


def insert_into_section(text: str, section: str | None, block: str) -> str:
    """`text` with `block` added at the end of its section (the section added at the page's end if the
    page has none of that heading yet)."""
    span = None if section is None else section_span(text, section)
    if span is None:
        head = f"{section}\n\n" if section is not None else ""
        return (text.rstrip() + "\n\n" if text.strip() else "") + head + block + "\n"
    _, end = span
    before, after = text[:end].rstrip(), text[end:]
    return before + "\n\n" + block + "\n" + ("\n" + after if after else "")

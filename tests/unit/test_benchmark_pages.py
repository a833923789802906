"""benchmarks/runner/report.py's write_block puts each benchmark's block on its page of docs/benchmarks/ and
in its section, as benchmarks/runner/pages.py registers them: an existing block is replaced where it stands,
a new one lands at the end of its section, and an unregistered name is refused."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # benchmarks/ is not installed; appended so the installed cputrain still wins

from benchmarks.runner.pages import BLOCK_PAGES, DOCS, place_of, section_span  # noqa: E402
from benchmarks.runner.blocks import write_block  # noqa: E402

MEMORY_PAGE = """# Memory and allocators

Intro.

## Which malloc

<!-- bench: allocator-bf16 -->
### Which malloc, bf16
old figures
<!-- /bench: allocator-bf16 -->

**What the allocator figures decided.** Hand-written.

## What the heap keeps after a step

<!-- bench: heap_retention -->
heap figures
<!-- /bench: heap_retention -->
"""


def test_an_existing_block_is_replaced_where_it_stands(tmp_path):
    (tmp_path / "memory.md").write_text(MEMORY_PAGE)
    write_block("allocator-bf16", "### Which malloc, bf16\nnew figures\n", tmp_path)
    assert (tmp_path / "memory.md").read_text() == MEMORY_PAGE.replace("old figures", "new figures")


def test_a_new_block_lands_at_the_end_of_its_section(tmp_path):
    (tmp_path / "memory.md").write_text(MEMORY_PAGE)
    write_block("allocator-fp32", "fp32 figures", tmp_path)
    text = (tmp_path / "memory.md").read_text()
    block = "<!-- bench: allocator-fp32 -->\nfp32 figures\n<!-- /bench: allocator-fp32 -->"
    assert text == MEMORY_PAGE.replace("Hand-written.\n\n", f"Hand-written.\n\n{block}\n\n")
    # written again, it is replaced, not added twice
    write_block("allocator-fp32", "fp32 figures, rerun", tmp_path)
    assert (tmp_path / "memory.md").read_text().count("<!-- bench: allocator-fp32 -->") == 1


def test_a_block_heading_its_own_section_ends_the_section_before_it(tmp_path):
    page = ("# Where a step's time goes\n\n## The fp32 step\n\n<!-- bench: fp32_choices-demo -->\ndemo\n"
            "<!-- /bench: fp32_choices-demo -->\n\n<!-- bench: weights-check -->\n## The per-step weights check\n"
            "check\n<!-- /bench: weights-check -->\n")
    (tmp_path / "step-time.md").write_text(page)
    write_block("fp32_choices-1b", "1b", tmp_path)
    text = (tmp_path / "step-time.md").read_text()
    assert text.index("fp32_choices-demo -->") < text.index("bench: fp32_choices-1b") < text.index("bench: weights-check")


def test_a_missing_page_or_section_is_started(tmp_path):
    write_block("dpo", "dpo figures", tmp_path)
    assert (tmp_path / "sft-and-dpo.md").read_text() == (
        "## DPO against TRL\n\n<!-- bench: dpo -->\ndpo figures\n<!-- /bench: dpo -->\n")
    write_block("sft", "sft figures", tmp_path)
    text = (tmp_path / "sft-and-dpo.md").read_text()
    assert text.endswith("## SFT against TRL\n\n<!-- bench: sft -->\nsft figures\n<!-- /bench: sft -->\n")


def test_an_unregistered_name_is_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(ValueError, match=r"'nobody-registered-this' .*register it in benchmarks/runner/pages.py"):
        write_block("nobody-registered-this", "figures", tmp_path)
    assert not list(tmp_path.iterdir())


def test_patterns_cover_the_names_scripts_derive():
    assert place_of("lora_8b-bf16-model.compile=false") == ("lora.md", "## Llama-3-8B LoRA on one machine")
    assert place_of("lora_8b-layer")[1] == "## LoRA against full fine-tuning and peft"  # exact name before the pattern
    assert place_of("vs_hf_trainer-fp32-avx512-aten-avx2")[0] == "vs-hf-trainer.md"
    assert place_of("allocator-fp32") == ("memory.md", "## Which malloc")


def test_every_block_of_the_pages_sits_where_the_registry_places_it():
    found = 0
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        for match in re.finditer(r"<!-- bench: (\S+) -->", text):
            found += 1
            name, (registered_page, section) = match.group(1), place_of(match.group(1))
            assert registered_page == page.name, f"block {name} is on {page.name}, registered for {registered_page}"
            if section is not None:
                span = section_span(text, section)
                assert span and span[0] < match.start() < span[1], f"block {name} is not under {section!r}"
    assert found > 30


def test_each_page_has_its_subpackage_of_scripts_and_each_subpackage_a_page():
    """benchmarks/<page>/ (the page's name with `_` for `-`) holds the scripts that measure for
    docs/benchmarks/<page>.md; benchmarks/runner/ holds what they share."""
    pages = {page.stem.replace("-", "_") for page in DOCS.glob("*.md") if page.name != "README.md"}
    packages = {init.parent.name for init in (REPO / "benchmarks").glob("*/__init__.py")}
    assert packages == pages | {"runner"}
    assert not [script.name for script in (REPO / "benchmarks").glob("*.py") if script.name != "__init__.py"]
    registered = {page for _, page, _ in BLOCK_PAGES}
    assert registered == {f"{package.replace('_', '-')}.md" for package in pages}


def test_the_trainer_comparison_heads_each_block_by_precision_and_unit(monkeypatch):
    import torch

    import cputrain.hardware
    from benchmarks.vs_hf_trainer.vs_hf_trainer import block_heading

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cputrain.hardware, "detect", lambda: SimpleNamespace(flags={"avx512_bf16": True}))
    assert block_heading(["fp32"]) == "### fp32 on AVX-512"
    assert block_heading(["bf16"]) == "### bf16 on AVX512-BF16 (no AMX)"
    monkeypatch.setattr(cputrain.hardware, "detect", lambda: SimpleNamespace(flags={"amx_bf16": True}))
    assert block_heading(["fp32", "bf16"]) == "### fp32 on AVX-512 and bf16 on AMX"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(cputrain.hardware, "detect", lambda: SimpleNamespace(flags={}))
    assert block_heading(["fp32"]) == "### fp32 on AVX2"


def test_a_block_says_the_command_as_run_from_the_repository(monkeypatch):
    from benchmarks.runner.blocks import command_as_run

    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks/network/two_ranks.py"), "--sizes", "34m", "--no-glibc"])
    assert command_as_run() == "python benchmarks/network/two_ranks.py --sizes 34m --no-glibc"
    monkeypatch.setattr(sys, "argv", ["/elsewhere/script.py"])  # outside the repository: its whole path
    assert command_as_run() == "python /elsewhere/script.py"

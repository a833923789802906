"""A local run folder's loss.png and sample.txt, written by rank 0 once model/ is exported."""

from __future__ import annotations

from pathlib import Path

from cputrain.metrics.jsonl import MetricsJsonl
from cputrain.metrics.plot import plot_losses
from cputrain.run_folder.layout import RunFolder


def write_plot_and_sample(run: RunFolder, sample_tokens: int, seed: int, prompt_ids: list[int] | None) -> None:
    """loss.png (metrics.plot owns it) and, `sample_tokens` > 0, sample.txt: text generated from the
    exported model, from "The" after pretraining (`prompt_ids` None), the answer to a held-out prompt
    after fine-tuning on examples. A reward model writes no text: its caller passes 0. A run folder
    in object storage gets neither (they are for a person looking at a local folder)."""
    local = run.local_path()
    if local is None:
        return
    if sample_tokens > 0:
        from cputrain.finished.generate import generate_text  # transformers' generation: only when sampling

        text = generate_text(f"{local}/model", prompt="The", max_new_tokens=sample_tokens, seed=seed,
                             prompt_ids=prompt_ids)
        (Path(local) / "sample.txt").write_text(text + "\n")
    plot_losses(MetricsJsonl(run).rows(), Path(local) / "loss.png")

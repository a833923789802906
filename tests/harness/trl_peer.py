"""What the comparisons with TRL's trainers share (tests/e2e/test_*_vs_trl.py): cputrain's initial
LoRA adapters put into TRL's model (peft and cputrain draw the A matrices from different random
streams, so both must start from the same), TRL's logged rows collected, and the pairs both sides
train on."""

from __future__ import annotations


def cputrain_adapters(base, rank: int, alpha: float, seed: int, head: str = "lm") -> dict:
    """cputrain's initial adapters for a run on the model folder `base` (model.lora.rank and
    alpha, the run's seed; head "score" for a reward model), parameter name → tensor."""
    import torch

    from cputrain import model as models
    from cputrain.config import LoraConfig, ModelConfig
    from cputrain.lora.adapters import add_adapters

    cfg = ModelConfig(name_or_path=str(base), attn_implementation="sdpa")
    source = models.resolve_source(cfg, None)
    models.fit_head(source.hf_config, head, source.hf_config.pad_token_id)
    skeleton = models.build_skeleton(source, cfg)
    return add_adapters(skeleton, LoraConfig(rank=rank, alpha=alpha), frozen_dtype=torch.float32, seed=seed)


def start_from(trl_model, adapters: dict) -> None:
    """Overwrite the adapters of TRL's peft model with `adapters` (cputrain_adapters')."""
    import torch

    copied = 0
    with torch.no_grad():
        for name, param in trl_model.named_parameters():
            if ".lora_" in name:
                param.copy_(adapters[name.removeprefix("base_model.model.")])
                copied += 1
    assert copied == len(adapters), (copied, len(adapters))


def logged_rows(trainer) -> list[dict]:
    """The rows TRL's trainer logs, filled as it trains."""
    from transformers import TrainerCallback

    rows: list[dict] = []
    trainer.add_callback(type("Rows", (TrainerCallback,), {
        "on_log": lambda self, a, state, control, logs=None, **kw: rows.append(dict(logs or {}))})())
    return rows


def write_topic_pairs(path, pairs: int) -> None:
    """`pairs` preference pairs from pydoc's help topics: "what is <topic>?" answered (chosen) by
    that topic's opening words and (rejected) by the next topic's, of 40–115 characters."""
    import json

    from pydoc_data.topics import topics

    names = sorted(topics)[:pairs + 1]
    texts = [" " + " ".join(topics[n].split())[: 40 + 25 * (i % 4)] for i, n in enumerate(names)]
    with open(path, "w") as f:
        for i in range(pairs):
            f.write(json.dumps({"prompt": f"Question: what is {names[i]}?\nAnswer:", "chosen": texts[i],
                                "rejected": texts[i + 1]}) + "\n")

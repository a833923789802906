"""A reward model's run folder (train.objective=reward) as a reward function: the prompt and the
completion, as text, tokenized by the reward model's own tokenizer and scored in this process (its
score at the last token, as transformers' sequence classifier pools)."""

from __future__ import annotations

import torch

from cputrain.errors import ConfigError, ModelError
from cputrain.rewards.builtin import completion_text


def _text(tokenizer, prompt, completion) -> str:
    """What the reward model reads: a conversation rendered with its chat template, else the prompt
    followed by the completion."""
    if isinstance(prompt, list) and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": completion_text(completion)}],
                                             tokenize=False)
    prompt_text = prompt if isinstance(prompt, str) else "".join(str(m.get("content", "")) for m in prompt)
    return prompt_text + completion_text(completion)


def reward_model_function(path: str):
    """The reward function of the reward model in `path` (a run folder or its model/); refused in one
    line where it holds no reward model."""
    from cputrain.finished.load import is_reward_model, load_for_inference, model_folder
    from cputrain.finished.score import _score

    try:
        folder = model_folder(path)
    except ModelError as err:
        raise ConfigError(f"train.rewards: '{path}' is not a reward model: {err}") from None
    if not is_reward_model(folder):
        raise ConfigError(f"train.rewards: the model in '{folder}' is not a reward model (a sequence classifier); "
                          "train one with train.objective=reward, or name a function module:function")
    loaded = []  # loaded at its first call: preflight only checks the folder

    @torch.no_grad()
    def score(prompts, completions, **columns) -> list[float]:
        if not loaded:
            loaded.extend(load_for_inference(path))
        model, tokenizer = loaded
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        texts = [_text(tokenizer, p, c) for p, c in zip(prompts, completions)]
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] or [pad_id] for t in texts]
        return _score(model, ids, pad_id, False)

    score.__name__ = folder
    return score

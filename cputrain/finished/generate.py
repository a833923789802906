"""Text sampled from a finished model (`cputrain generate`, and the sample a run writes when it
ends): a prompt continued, or a user's message answered in the model's chat template."""

from __future__ import annotations

import torch

from cputrain.errors import ModelError
from cputrain.finished.load import is_reward_model, load_for_inference, model_folder


@torch.no_grad()
def generate_text(path: str, prompt: str, max_new_tokens: int = 80, temperature: float = 0.8,
                  top_k: int = 50, seed: int = 0, chat: bool = False, prompt_ids: list[int] | None = None) -> str:
    """The prompt and what the model writes after it. `chat`: the prompt is a user's message,
    rendered with the model's chat template and a generation prompt; the reply ends at the end of
    the turn and is returned alone. `prompt_ids`: token ids to continue instead of `prompt`."""
    from cputrain.data.chat_template import render, template_variables
    from cputrain.model.folder_description import generation_end_ids

    if is_reward_model(model_folder(path)):
        raise ModelError(f"the model in '{model_folder(path)}' is a reward model: it scores text, it does not write "
                         "any; score records with `cputrain score`")
    model, tokenizer = load_for_inference(path)
    # Sampling from NaN logits fails deep inside torch.multinomial; say what is wrong instead.
    damaged = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if damaged:
        raise ModelError(f"the model in '{model_folder(path)}' has non-finite weights (NaN or inf) in {len(damaged)} "
                         f"tensor(s), e.g. {damaged[0]}: it diverged in training; retrain with a lower train.lr")
    torch.manual_seed(seed)
    # EOS, and the end of a chat turn where the tokenizer has one: where the exported
    # generation_config.json ends a generation too
    stop = generation_end_ids(tokenizer)
    if chat:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ModelError(f"the model in '{model_folder(path)}' has no chat template; train it on chat data "
                             "(data.format=chat) or generate without --chat")
        prompt = render(template, [{"role": "user", "content": prompt}], template_variables(tokenizer),
                        add_generation_prompt=True)
    if prompt_ids is not None:
        ids = torch.tensor([prompt_ids], dtype=torch.long)
    else:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    if ids.shape[1] == 0:
        ids = torch.tensor([[tokenizer.eos_token_id]])
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=temperature > 0, temperature=temperature or None,
        top_k=top_k, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, eos_token_id=stop,
    )
    if chat:
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    return tokenizer.decode(out[0], skip_special_tokens=True)

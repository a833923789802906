"""grpo and rloo against TRL 1.16's GRPOTrainer and RLOOTrainer on the same tiny model, prompts,
completions and rewards: TRL's generation is replaced by fixed completions (no sampling is
compared), TRL's prompt ids are recorded and fed to cputrain's objective, and both sides take two
optimizer steps (AdamW, constant learning rate, gradient clipping at 1.0). The loss and gradient
norm of step 1 agree to 1e-4, of step 2 to 1e-3, for each loss type, with and without the KL to the
reference (LoRA: the adapters off), LoRA and full weights. A mutant check shows the comparison
catches a changed advantage and a changed clipping. In-process; TRL runs where installed."""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch

from cputrain.objectives import rl_loss
from cputrain.objectives.online_rl import GrpoObjective, RlooObjective

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.slow  # TRL's trainers, 18 times: about 50 s

NUM_GENERATIONS, PROMPTS, MAX_COMPLETION = 4, 2, 6
LR = 0.05  # large enough that step 2 sees moved weights (and, with beta, a KL above 0)


def _reward(completion_ids) -> list[float]:
    # a fixed function of the tokens: the same figures on both sides, varied within the first group
    # (its std far from 1, so that an advantage not divided by it shows); the second group's all equal
    # (std 0: advantages 0; with beta 0 its completions are left out of cputrain's training rows, so
    # every beta-0 case checks that leaving them out changes nothing)
    return [2.0 * ((sum(c) * 7 + len(c)) % 5) if i < NUM_GENERATIONS else 3.0 for i, c in enumerate(completion_ids)]


def trl_reward(prompts, completions, completion_ids, **kwargs):
    return _reward(completion_ids)


def _completions(step: int, eos: int) -> list[list[int]]:
    """8 completions of lengths 2…6, some stopped by EOS, others clipped at MAX_COMPLETION."""
    out = []
    for i in range(NUM_GENERATIONS * PROMPTS):
        length = 2 + (i * 3 + step) % (MAX_COMPLETION - 1)
        ids = [10 + (i * 5 + j * 3 + step * 11) % 40 for j in range(length)]
        out.append(ids + [eos] if length < MAX_COMPLETION and i % 2 else ids)
    return [c[:MAX_COMPLETION] for c in out]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from cputrain.data.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _equal_length_prompts(tok) -> list[str]:
    """Two prompts of as many tokens: TRL left-pads shorter prompts without shifting their positions,
    which no packed trainer reproduces; with equal lengths no prompt is padded."""
    candidates = ["a b c d", "e f g h", "the value of", "a list of", "the class is", "if the", "for a", "in the"]
    by_length: dict[int, list[str]] = {}
    for text in candidates:
        by_length.setdefault(len(tok(text)["input_ids"]), []).append(text)
    return next(texts[:2] for texts in by_length.values() if len(texts) >= 2)


def _run_trl(kind: str, base, lora: bool, tok, tmp_path, loss_type: str, beta: float, num_iterations: int = 1):
    """(TRL's prompt ids of each generation, its losses, its gradient norms, the model as TRL built it
    before its first step: with LoRA, TRL's new adapters on the base, whose reference is the adapters off)."""
    import datasets

    eos = tok.eos_token_id
    prompts = _equal_length_prompts(tok)
    common = dict(output_dir=str(tmp_path / kind), report_to=[], use_cpu=True, max_steps=2, logging_steps=1,
                  per_device_train_batch_size=NUM_GENERATIONS * PROMPTS, num_generations=NUM_GENERATIONS,
                  max_completion_length=MAX_COMPLETION, learning_rate=LR, lr_scheduler_type="constant",
                  weight_decay=0.0, max_grad_norm=1.0, beta=beta, save_strategy="no", seed=0,
                  gradient_accumulation_steps=1, bf16=False, num_iterations=num_iterations)
    if kind == "grpo":
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer

        common["loss_type"] = loss_type
    else:
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Trainer
    torch.manual_seed(0)
    trainer = Trainer(model=copy.deepcopy(base), reward_funcs=trl_reward, args=Config(**common), processing_class=tok,
                      train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in prompts] * 4),
                      peft_config=_lora_config() if lora else None)
    # the weights as TRL starts from (with LoRA its new adapters), in a model of cputrain's own: a
    # deep copy of TRL's would keep the forward accelerate bound to TRL's instance
    initial = copy.deepcopy(base)
    if lora:
        from peft import get_peft_model

        initial = get_peft_model(initial, _lora_config())
    initial.load_state_dict({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    seen, losses = [], []

    def fixed(self, prompt_ids, *args, **kwargs):
        step = len(seen)
        seen.append([list(p) for p in prompt_ids])
        completions = _completions(step, eos)
        return (completions, None) if kind == "grpo" else completions

    original = Trainer._compute_loss

    def recorded(self, model, inputs):
        loss = original(self, model, inputs)
        losses.append(float(loss))
        return loss

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "_generate_single_turn", fixed)
        mp.setattr(Trainer, "_compute_loss", recorded)
        trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return seen, losses, [float(n) for n in norms], initial


def _cfg(loss_type: str, beta: float, **over):
    cfg = dict(num_generations=NUM_GENERATIONS, max_completion_length=MAX_COMPLETION, temperature=1.0,
               loss_type=loss_type, scale_rewards="group", normalize_advantages=False, epsilon=0.2,
               epsilon_high=None, num_iterations=1, rl_beta=beta)
    cfg.update(over)
    return SimpleNamespace(**cfg)


def _run_ours(objective_class, model, seen, eos: int, loss_type: str, beta: float, lora: bool,
              num_iterations: int = 1, advantages=None, chunked: bool = False):
    reference = (lambda m: m.disable_adapter()) if lora else None
    if chunked:  # model.chunked_loss: the block-wise head, installed as the trainer does
        from cputrain.kernels.chunked_head import install_chunked_loss

        install_chunked_loss(model.get_base_model() if lora else model)
    objective = objective_class(_cfg(loss_type, beta, num_iterations=num_iterations), reference, chunked)
    objective.pad_id = eos
    if advantages is not None:  # a mutant: another advantage
        objective.advantages = advantages
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for step in range(2):
        if step % num_iterations == 0:  # TRL samples once every num_iterations steps
            completions = _completions(step // num_iterations, eos)
            scores = torch.tensor(_reward(completions)).unsqueeze(1)
            batches = objective.batches_from_completions(model, seen[step // num_iterations], completions, scores,
                                                         len(completions), contextlib.nullcontext)
            # the equal group's completions leave the rows where the loss has no KL term
            assert sum(b.skipped_completions for b in batches) == (NUM_GENERATIONS if beta == 0 else 0)
        divisor = sum(objective.items(b) for b in batches)
        model.train()
        total = 0.0
        for batch in batches:
            loss, _ = objective.loss(model, batch, divisor)
            loss.backward()
            total += float(loss)
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, norms


# (objective, loss_type, beta, LoRA, num_iterations μ, the block-wise head): μ = 2 trains step 2 on step
# 1's rollouts, where the ratio to the old policy leaves 1 and the clipping acts; the block-wise head
# (model.chunked_loss) on a case of each objective, full weights and LoRA with the reference
CASES = [("grpo", "grpo", 0.0, False, 1, False), ("grpo", "dapo", 0.0, False, 1, False),
         ("grpo", "dr_grpo", 0.0, False, 1, False), ("grpo", "grpo", 0.0, True, 1, False),
         ("grpo", "dapo", 0.0, True, 1, False), ("grpo", "dr_grpo", 0.0, True, 1, False),
         ("grpo", "grpo", 0.04, True, 1, False), ("grpo", "dapo", 0.04, True, 1, False),
         ("grpo", "dr_grpo", 0.04, True, 1, False), ("grpo", "dapo", 0.0, False, 2, False),
         ("grpo", "dapo", 0.04, True, 2, False), ("rloo", None, 0.0, False, 1, False),
         ("rloo", None, 0.0, True, 1, False), ("rloo", None, 0.05, True, 1, False), ("rloo", None, 0.0, False, 2, False),
         ("grpo", "dapo", 0.0, False, 2, True), ("grpo", "grpo", 0.04, True, 1, True), ("rloo", None, 0.05, True, 1, True)]


@pytest.mark.parametrize("kind,loss_type,beta,lora,mu,chunked", CASES,
                         ids=[f"{k}-{t or 'seq'}-beta{b}-{'lora' if lo else 'full'}-mu{m}{'-chunked' if c else ''}"
                              for k, t, b, lo, m, c in CASES])
def test_loss_and_grad_norm_equal_trls(kind, loss_type, beta, lora, mu, chunked, base, tok, tmp_path):
    objective_class = GrpoObjective if kind == "grpo" else RlooObjective
    seen, trl_losses, trl_norms, initial = _run_trl(kind, base, lora, tok, tmp_path, loss_type or "grpo", beta, mu)
    assert len(seen) == 2 // mu and len({len(p) for step in seen for p in step}) == 1  # equal prompts: no padding
    losses, norms = _run_ours(objective_class, initial, seen, tok.eos_token_id, loss_type or "grpo",
                              beta, lora, mu, chunked=chunked)
    print(f"{kind} {loss_type} beta={beta} lora={lora} chunked={chunked}: TRL loss {trl_losses} grad {trl_norms}; "
          f"cputrain loss {losses} grad {norms}")
    assert losses[0] == pytest.approx(trl_losses[0], abs=1e-4)
    assert norms[0] == pytest.approx(trl_norms[0], abs=1e-4, rel=1e-4)
    assert losses[1] == pytest.approx(trl_losses[1], abs=1e-3)
    assert norms[1] == pytest.approx(trl_norms[1], abs=1e-3, rel=1e-3)


def test_the_comparison_catches_a_changed_advantage_or_clipping(base, tok, tmp_path, monkeypatch):
    """Mutants: the advantage without its std scaling (step 1 differs), and the clipping taken out
    (step 2 of μ = 2, where the ratio to the sampling policy leaves the clipping range, differs)."""
    from cputrain.objectives import online_rl

    seen, trl_losses, trl_norms, initial = _run_trl("grpo", base, False, tok, tmp_path, "dapo", 0.0, 2)
    losses, norms = _run_ours(GrpoObjective, copy.deepcopy(initial), seen, tok.eos_token_id, "dapo", 0.0, False, 2)
    assert norms[1] == pytest.approx(trl_norms[1], abs=1e-3, rel=1e-3)  # the unmutated code agrees

    def unscaled(rewards):
        return rl_loss.group_advantages(rewards, NUM_GENERATIONS, "none")[0]

    losses, norms = _run_ours(GrpoObjective, copy.deepcopy(initial), seen, tok.eos_token_id, "dapo", 0.0, False, 2,
                              advantages=unscaled)
    assert abs(norms[0] - trl_norms[0]) > 1e-3, "a changed advantage went unnoticed"
    original = rl_loss.grpo_loss

    def unclipped(logps, old, advantages, mask, loss_type, low, high, *args, **kwargs):
        return original(logps, old, advantages, mask, loss_type, 10.0, 10.0, *args, **kwargs)

    monkeypatch.setattr(online_rl.rl_loss, "grpo_loss", unclipped)
    losses, norms = _run_ours(GrpoObjective, copy.deepcopy(initial), seen, tok.eos_token_id, "dapo", 0.0, False, 2)
    assert abs(losses[1] - trl_losses[1]) > 1e-3 or abs(norms[1] - trl_norms[1]) > 1e-3, \
        "a changed clipping went unnoticed"

"""Online RL's shared-prompt rows (objectives.rollout_rows, rollout_batch): a group's prompt laid out
once with its completions after it gives each completion token the log-probability and gradient of
the one-completion-a-row layout (fp32, 1e-5), attended a completion at a time under sdpa and eager
(kernels/shared_prompt_attention.py) and under the row's mask, for whole, split and several groups
of uneven lengths; the FLOP estimate shares a long prompt's short completions and not a short
prompt's long ones; a shared row stays within one-a-row's positions and the plan's query-key pairs
(under the row's mask, under its cap); the batch survives the run state's round trip."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from cputrain.objectives.rollout_batch import completion_logps, rollout_batch
from cputrain.objectives.rollout_rows import WIDTH_CAP, grouped, row_choice, shared_pairs

VOCAB = 64
MASKED = "cputrain_test_masked_sdpa"  # an attention kernel shared_prompt_attention does not follow


@pytest.fixture(autouse=True, scope="module")
def _masked_kernel():
    """MASKED: transformers' sdpa function and mask under another name, so that shared rows take the
    row's 4D mask as any kernel shared_prompt_attention does not follow would."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(MASKED, sdpa_attention_forward)
    AttentionMaskInterface.register(MASKED, sdpa_mask)


def _model(attn: str):
    """A tiny Llama attending through `attn`; "masked" is sdpa under the row's mask: a kernel
    shared_prompt_attention does not follow (flex attention's name), the sdpa function under it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config._attn_implementation = MASKED if attn == "masked" else attn
    return LlamaForCausalLM(config).float()


def _tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _micro_batches(case: str) -> list[tuple[list[list[int]], list[list[int]]]]:
    """(prompt ids, completion ids) of each micro-batch; a group's members adjacent."""
    g = torch.Generator().manual_seed(len(case))
    a, b = _tokens(g, 7), _tokens(g, 4)
    lengths = [5, 1, 9, 3]
    if case == "one group":
        return [([a] * 4, [_tokens(g, n) for n in lengths])]
    if case == "two groups":
        return [([a] * 4 + [b] * 4, [_tokens(g, n) for n in lengths + [2, 6, 1, 4]])]
    # "split": three groups of 4 cut into micro-batches of 6: the middle group across both
    prompts = [a] * 4 + [b] * 4 + [_tokens(g, 11)] * 4
    completions = [_tokens(g, n) for n in lengths * 3]
    return [(prompts[:6], completions[:6]), (prompts[6:], completions[6:])]


def _logps(model, prompts, completions, shared: bool):
    rows = grouped(prompts, completions, cap=1000) if shared else None
    batch = rollout_batch(prompts, completions, pad_id=0, rows=rows)
    if shared:  # the layout under test: fewer rows than completions
        assert len(batch.input_ids) < len(completions) and batch.shares_prompts
    return completion_logps(model, batch, temperature=0.7), batch


@pytest.mark.parametrize("attn", ["sdpa", "eager", "masked"])
@pytest.mark.parametrize("case", ["one group", "split", "two groups"])
def test_shared_rows_give_every_token_the_log_probability_and_gradient_of_one_completion_a_row(attn, case):
    model = _model(attn)
    for prompts, completions in _micro_batches(case):
        results = []
        for shared in (False, True):
            model.zero_grad()
            logps, batch = _logps(model, prompts, completions, shared)
            weights = torch.linspace(-1, 2, logps.numel()).view_as(logps)  # every token its own weight
            (logps * weights).sum().backward()
            results.append((logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, batch))
        (plain, plain_grads, unshared), (logps, grads, batch) = results
        assert torch.equal(batch.completion_mask, unshared.completion_mask)
        assert torch.equal(batch.completion_ids, unshared.completion_ids)
        assert batch.trained_targets == unshared.trained_targets == batch.completion_tokens
        torch.testing.assert_close(logps, plain, atol=1e-5, rtol=0)
        assert (logps[batch.completion_mask > 0] < 0).all()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain_grads[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("frozen_head, bf16", [(False, False), (True, False), (False, True)],
                         ids=["trained head", "frozen head", "bf16 autocast"])
def test_the_block_wise_head_gives_each_completion_token_the_whole_logits_figures(frozen_head, bf16):
    """model.chunked_loss: only the positions that predict a completion token go through the head,
    in blocks smaller than the micro-batch (3 here), at temperature 0.7; every token's
    log-probability and every gradient equal the whole logits' (fp32: 1e-5; under bf16 autocast
    the log-probabilities to 1e-2 and each gradient to 2% of its norm: bf16 rounds the logits'
    gradient at other points), in rows sharing their prompt and one completion a row, with the head
    trained and frozen (LoRA's)."""
    from cputrain.kernels import chunked_logps
    from cputrain.kernels.chunked_head import install_chunked_loss

    (prompts, completions), = _micro_batches("two groups")
    whole, blocks = _model("sdpa"), _model("sdpa")
    install_chunked_loss(blocks)
    for model in (whole, blocks):
        model.lm_head.requires_grad_(not frozen_head)
    for shared in (False, True):
        rows = grouped(prompts, completions, cap=1000) if shared else None
        batch = rollout_batch(prompts, completions, pad_id=0, rows=rows)
        results = []
        for model, chunked in ((whole, False), (blocks, True)):
            model.zero_grad()
            with pytest.MonkeyPatch.context() as mp, torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                mp.setattr(chunked_logps, "block_rows", lambda vocab: 3)
                logps = completion_logps(model, batch, temperature=0.7, chunked=chunked)
            weights = torch.linspace(-1, 2, logps.numel()).view_as(logps)
            (logps * weights).sum().backward()
            results.append((logps.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        (plain, plain_grads), (logps, grads) = results
        assert logps.shape == plain.shape == batch.completion_mask.shape
        torch.testing.assert_close(logps, plain, atol=1e-2 if bf16 else 1e-5, rtol=0)
        assert torch.equal(logps == 0, batch.completion_mask == 0)  # 0 past each completion's end, only there
        assert grads.keys() == plain_grads.keys() and ("lm_head.weight" in grads) is not frozen_head
        for name, grad in grads.items():
            if bf16:
                assert float((grad - plain_grads[name]).norm()) <= 2e-2 * float(plain_grads[name].norm()), name
            else:
                torch.testing.assert_close(grad, plain_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_a_shared_row_is_attended_a_completion_at_a_time_under_the_kernels_it_follows(monkeypatch):
    """sdpa and eager: shared_prompt_attention runs in every block and no row mask is built; another
    kernel gets the row's mask."""
    from cputrain.kernels import shared_prompt_attention as kernel
    from cputrain.objectives.rollout_batch import RolloutBatch

    calls, masks = [], []
    real, real_mask = kernel.shared_prompt_attention, RolloutBatch.row_mask
    monkeypatch.setattr(kernel, "shared_prompt_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(RolloutBatch, "row_mask", lambda self: masks.append(1) or real_mask(self))
    (prompts, completions), = _micro_batches("two groups")
    for attn, expected_calls, expected_masks in (("sdpa", 2, 0), ("eager", 2, 0), ("masked", 0, 1)):
        calls.clear(), masks.clear()
        model = _model(attn)
        with torch.no_grad():
            _logps(model, prompts, completions, shared=True)
        assert (len(calls), len(masks)) == (expected_calls, expected_masks), attn
        assert model.config._attn_implementation == (MASKED if attn == "masked" else attn)  # restored


def test_a_completion_sees_its_prompt_and_itself_not_its_siblings():
    model = _model("sdpa")
    (prompts, completions), = _micro_batches("one group")
    with torch.no_grad():
        base, _ = _logps(model, prompts, completions, shared=True)
        changed = [completions[0], [7] * len(completions[1]), completions[2], completions[3]]
        after, _ = _logps(model, prompts, changed, shared=True)
        other_prompt, _ = _logps(model, [[9] * 7] * 4, completions, shared=True)
    keep = [0, 2, 3]
    torch.testing.assert_close(after[keep], base[keep], atol=1e-6, rtol=0)  # a sibling changed: nothing else moves
    assert not torch.allclose(other_prompt, base, atol=1e-3)  # the prompt is seen


def test_the_targets_are_each_completions_own_tokens_not_the_next_position():
    """In a shared row the position after the prompt's last holds the first completion's token
    only: every completion's first target is its own."""
    prompts, completions = [[5, 6, 7]] * 3, [[20, 21], [30], [40, 41, 42]]
    batch = rollout_batch(prompts, completions, pad_id=0, rows=[[0, 1, 2]])
    assert batch.input_ids.tolist() == [[5, 6, 7, 20, 21, 30, 40, 41, 42]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 3, 4, 5]]
    assert batch.predicted_from.tolist() == [[2, 3, 0], [2, 0, 0], [2, 6, 7]]
    assert batch.completion_ids.tolist() == [[20, 21, 0], [30, 0, 0], [40, 41, 42]]
    assert batch.completion_starts.tolist() == [3, 5, 6]
    mask = batch.row_mask()[0, 0].int().tolist()
    assert mask[5] == [1, 1, 1, 0, 0, 1, 0, 0, 0]  # the second completion: the prompt and itself
    assert mask[8] == [1, 1, 1, 0, 0, 0, 1, 1, 1]


# a ~100M Llama's sizes (hidden 768, 12 layers; a 32k vocabulary), as the estimate reads a config
CONFIG = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12,
          "intermediate_size": 3072, "vocab_size": 32000, "_attn_implementation": "sdpa"}


def test_a_long_prompt_with_short_completions_is_shared():
    prompts, completions = [list(range(300))] * 8, [[1] * 20] * 8
    choice = row_choice(CONFIG, prompts, completions, seq_len=512)
    assert choice.rows == [list(range(8))]
    assert choice.shared_flops < 0.3 * choice.unshared_flops  # 7 of 8 prompts' positions not computed
    assert "shared" in choice.described() and "not shared" not in choice.described()


def test_long_completions_after_a_short_prompt_are_not_shared():
    """16 generations of 1,000 tokens after a 5-token prompt: the masked attention of a shared row
    outgrows the prompts' linear work (and a row would pass the cap anyway at seq_len 1,024)."""
    prompts, completions = [[1] * 5] * 16, [[2] * 1000] * 16
    choice = row_choice(CONFIG, prompts, completions, seq_len=4096)  # a cap of 16k: room for every completion
    assert len(grouped(prompts, completions, choice.cap)) == 1
    assert choice.rows is None and choice.shared_flops > choice.unshared_flops
    assert "not shared" in choice.described()


def test_a_shared_row_under_its_mask_stays_within_its_cap_and_the_plans_query_key_pairs():
    """A kernel shared_prompt_attention does not follow: the row's width² mask bounds the sharing."""
    masked = {**CONFIG, "_attn_implementation": "flex_attention"}
    prompts, completions = [[1] * 20] * 64, [[2] * 10] * 64
    choice = row_choice(masked, prompts, completions, seq_len=64)
    assert choice.cap == WIDTH_CAP * 64 and choice.rows is not None and len(choice.rows) > 1
    widths = [20 + 10 * len(r) for r in choice.rows]
    assert max(widths) == choice.width <= choice.cap
    assert len(choice.rows) * choice.width**2 <= 64 * 64**2  # the plan's eager matrices: micro-batch × seq_len²
    assert sorted(i for r in choice.rows for i in r) == list(range(64))
    # the GRPO benchmark's shape: a group of 8 × 48 after 17 in one row (401 wide) would hold more
    # query-key pairs than 8 rows of data.seq_len 128; 4 a row (209 wide) do not
    prompts, completions = [[1] * 17] * 8, [[2] * 48] * 8
    choice = row_choice(masked, prompts, completions, seq_len=128)
    assert choice.rows is not None and choice.most == 4 and choice.width == 17 + 4 * 48
    # a group of 16 × 1,024 tokens after 1,024 at seq_len 2,048 is never one 17k-wide row
    big = grouped([[1] * 1024] * 16, [[2] * 1024] * 16, WIDTH_CAP * 2048)
    assert max(1024 + 1024 * len(r) for r in big) <= WIDTH_CAP * 2048


def test_a_group_attended_a_completion_at_a_time_shares_one_row():
    """sdpa and eager: no width² tensor, so a group's completions share one row where that holds no
    more positions than one a row; its query-key pairs stay within the plan's micro-batch × seq_len²."""
    prompts, completions = [[1] * 17] * 8, [[2] * 48] * 8  # the GRPO benchmark's shape
    for kernel in ("sdpa", "eager"):
        choice = row_choice({**CONFIG, "_attn_implementation": kernel}, prompts, completions, seq_len=128)
        assert choice.rows == [list(range(8))] and choice.width == 17 + 8 * 48 <= choice.cap == 8 * 65
        assert choice.shared_flops < 0.85 * choice.unshared_flops
        config = {**CONFIG, "_attn_implementation": kernel}
        assert shared_pairs(config, prompts, completions, choice.rows, choice.width) <= 8 * 128**2


def test_long_completions_share_their_prompt_a_completion_at_a_time():
    """An 8B Llama's sizes, 16 × 1,024-token completions after a 500-token prompt, seq_len 2,048:
    attended a completion at a time the group shares one row (16.9k wide, 28% fewer FLOPs); under
    the row's mask a few a row (the cap, and the attention outgrowing the savings)."""
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 128256}
    prompts, completions = [[1] * 500] * 16, [[2] * 1024] * 16
    choice = row_choice(config, prompts, completions, seq_len=2048)
    assert choice.most == 16 and choice.width == 500 + 16 * 1024
    assert choice.shared_flops < 0.75 * choice.unshared_flops and choice.shared_positions < choice.unshared_positions
    masked = row_choice({**config, "_attn_implementation": "flex_attention"}, prompts, completions, seq_len=2048)
    assert masked.rows is not None and 1 < masked.most < 16
    assert masked.width == 500 + 1024 * masked.most <= masked.cap == 8192
    assert choice.shared_flops < masked.shared_flops < masked.unshared_flops


def test_different_prompts_never_share_a_row():
    prompts, completions = [[1, 2], [1, 2], [1, 3], [1, 2]], [[5], [6], [7], [8]]
    assert grouped(prompts, completions, 100) == [[0, 1], [2], [3]]


def test_a_shared_batch_survives_the_objectives_state_round_trip():
    from cputrain.objectives.online_rl import GrpoObjective

    model = _model("sdpa")
    cfg = SimpleNamespace(num_generations=4, num_iterations=2, temperature=1.0, loss_type="dapo", epsilon=0.2,
                          epsilon_high=None, rl_beta=0.0, scale_rewards="group", max_completion_length=9)
    objective = GrpoObjective(cfg)
    (prompts, completions), = _micro_batches("two groups")
    scores = torch.arange(8, dtype=torch.float32).unsqueeze(1) % 3
    import contextlib

    batches = objective.batches_from_completions(model, prompts, completions, scores, 8, contextlib.nullcontext)
    objective.kept, objective.iteration = batches, 1
    assert batches[0].shares_prompts and len(batches[0].input_ids) == 2  # the two groups' rows
    buffer = io.BytesIO()
    torch.save(objective.state_dict(), buffer)
    buffer.seek(0)
    restored = GrpoObjective(cfg)
    restored.load_state_dict(torch.load(buffer, weights_only=False))
    (before,), (after,) = batches, restored.kept
    for name in ("input_ids", "position_ids", "completion_starts", "completion_mask", "predicted_from",
                 "completion_ids", "completion_rows", "advantages", "old_logps"):
        assert torch.equal(getattr(after, name), getattr(before, name)), name
    with torch.no_grad():
        torch.testing.assert_close(completion_logps(model, after, 1.0), completion_logps(model, before, 1.0))


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_completions_of_advantage_zero_leave_the_rows_and_change_nothing(kind, monkeypatch):
    """With no KL term a completion of advantage 0 adds 0 to the loss and its gradient: the rows
    leave out the equal group, and the step's loss, gradients, divisor and figure sums (clip
    ratios' divisors) equal those of every completion trained; each micro-batch keeps a row."""
    import contextlib

    from cputrain.objectives import online_rl

    cfg = SimpleNamespace(num_generations=4, num_iterations=1, temperature=1.0, loss_type="dapo", epsilon=0.2,
                          epsilon_high=None, rl_beta=0.0, scale_rewards="group", max_completion_length=9,
                          normalize_advantages=False)
    (prompts, completions), = _micro_batches("two groups")
    scores = torch.tensor([[0.0], [2.0], [1.0], [2.0], [0.7], [0.7], [0.7], [0.7]])  # the second group equal

    def step(keep_all: bool):
        model = _model("sdpa")
        objective = (online_rl.GrpoObjective if kind == "grpo" else online_rl.RlooObjective)(cfg)
        with monkeypatch.context() as patch:
            if keep_all:
                patch.setattr(online_rl, "_trained", lambda cut, advantages, completion_ids: list(cut))
            batches = objective.batches_from_completions(model, prompts, completions, scores, 3,
                                                         contextlib.nullcontext)
        divisor = sum(objective.items(b) for b in batches)
        total, sums = 0.0, 0
        for batch in batches:
            loss, figures = objective.loss(model, batch, divisor)
            loss.backward()
            total, sums = total + float(loss), sums + figures
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return batches, divisor, total, sums, grads

    skipped, divisor, loss, sums, grads = step(keep_all=False)
    every, divisor_all, loss_all, sums_all, grads_all = step(keep_all=True)
    # micro-batches of 3: [a a a] [a b b] [b b]; the last keeps its shortest completion to run at all
    assert [b.skipped_completions for b in skipped] == [0, 2, 1] and [b.completions for b in skipped] == [3, 1, 1]
    assert [b.completions for b in every] == [3, 3, 2]
    assert divisor == divisor_all and torch.equal(sums, sums_all)
    assert loss == pytest.approx(loss_all, abs=1e-7)
    torch.testing.assert_close(grads, grads_all, rtol=1e-5, atol=1e-7)
    assert float(grads.abs().sum()) > 0


def test_run_state_saved_before_the_targets_were_kept_still_loads():
    prompts, completions = [[5, 6, 7], [8, 9]], [[20, 21], [30]]
    batch = rollout_batch(prompts, completions, pad_id=0)
    from cputrain.objectives.rollout_batch import RolloutBatch

    old = {k: v for k, v in vars(batch).items() if v is not None and k not in ("completion_ids", "completion_rows")}
    again = RolloutBatch(**old)
    assert torch.equal(again.completion_ids, batch.completion_ids)
    assert torch.equal(again.completion_rows, batch.completion_rows)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_shared_row_takes_the_attention_dropout_of_a_training_forward(attn):
    """A model with attention dropout: two training forwards of the same shared rows differ, two
    evaluation forwards are equal (transformers hands the kernel 0 outside training)."""
    model = _model(attn)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    (prompts, completions), = _micro_batches("two groups")
    with torch.no_grad():
        model.train()
        first, _ = _logps(model, prompts, completions, shared=True)
        second, _ = _logps(model, prompts, completions, shared=True)
        model.eval()
        third, _ = _logps(model, prompts, completions, shared=True)
        fourth, _ = _logps(model, prompts, completions, shared=True)
    assert not torch.equal(first, second)
    assert torch.equal(third, fourth)


def test_picked_positions_give_the_same_gradient_every_time_on_two_threads():
    """A shared row's completions are all predicted first from the prompt's last position, so the
    picked positions repeat; their gradients must add in one order, not in atomic adds racing
    across threads (two runs of the same GRPO command parted after a few steps)."""
    from cputrain.kernels.chunked_logps import positions_of

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 60, 512, generator=g, requires_grad=True)
    rows = torch.tensor([0] * 9 + [1] * 3)  # the first row's group spans the two threads' halves of the work
    positions = torch.randint(0, 60, (12, 20), generator=g)
    positions[:, 0] = 9  # every completion's first token predicted from one position of its row
    upstream = torch.randn(12, 20, 512, generator=g)
    assert torch.equal(positions_of(x, rows, positions), x[rows[:, None], positions])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sums = set()
        for _ in range(20):
            x.grad = None
            positions_of(x, rows, positions).backward(upstream)
            sums.add(x.grad.double().pow(2).sum().item())
    finally:
        torch.set_num_threads(threads)
    assert len(sums) == 1

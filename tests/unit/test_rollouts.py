"""Rollouts: sample() against transformers' generate, its sampling reproducible from the generator,
its stops and clips, a LoRA-wrapped policy, and the model's modes restored."""

from __future__ import annotations

import pytest
import torch

from cputrain.rollouts.decoder_weights import why_not_fused
from cputrain.rollouts.sampling import SamplingSettings, sample

VOCAB = 97
PROMPTS = [[5, 9, 13, 2, 44, 71, 8], [3, 17], [60, 61, 62, 63], [11]]  # lengths differ: rows are left-padded


def tiny_llama(seed: int = 0, dtype=torch.float32, attn_implementation: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=0)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()


def generate_greedy(model, prompt_ids, max_new_tokens, stop=()):
    """transformers' greedy completion of each prompt alone: unpadded, cut after its stop token."""
    completions = []
    for prompt in prompt_ids:
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                             eos_token_id=list(stop) or None, pad_token_id=0)
        completions.append(out[0, len(prompt):].tolist())
    return completions


def _seeded(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=["fused", "modules"])
def path(request, monkeypatch):
    """Each rollout path a test runs on: the fused decoder on the policy's merged weights (what a
    Llama takes), or the model's own modules (what any other model takes)."""
    if request.param == "modules":
        from cputrain.rollouts import sampling

        monkeypatch.setattr(sampling, "decoder_weights", lambda model, dtype: None)
        monkeypatch.setattr(sampling, "runs_fused", lambda model: False)
    return request.param


@pytest.fixture
def modules_only(monkeypatch):
    from cputrain.rollouts import sampling

    monkeypatch.setattr(sampling, "decoder_weights", lambda model, dtype: None)
    monkeypatch.setattr(sampling, "runs_fused", lambda model: False)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_greedy_equals_generate_for_prompts_of_different_lengths(attn_implementation, path):
    """Token for token, each prompt against generate on it alone; the model's attention implementation
    is its own again after."""
    model = tiny_llama(attn_implementation=attn_implementation)
    rollout = sample(model, PROMPTS, SamplingSettings(max_new_tokens=10, temperature=0), _seeded())
    assert rollout.path == path
    assert model.config._attn_implementation == attn_implementation
    assert rollout.completion_ids == generate_greedy(model, PROMPTS, 10)
    assert rollout.stopped == [False] * len(PROMPTS)
    assert rollout.new_tokens == 10 * len(PROMPTS)


def test_greedy_equals_generate_over_several_pages_of_the_fused_cache():
    """A rollout longer than one page of the fused decoder's cache (paged_kv_cache.PAGE_POSITIONS):
    its attention spans pages, the last one partly written, and rows ending early leave the batch."""
    from cputrain.rollouts.kv_cache_size import PAGE_POSITIONS

    model = tiny_llama()
    new = 2 * PAGE_POSITIONS + 5
    rollout = sample(model, PROMPTS, SamplingSettings(max_new_tokens=new, temperature=0), _seeded())
    assert rollout.path == "fused"
    assert rollout.completion_ids == generate_greedy(model, PROMPTS, new)
    stop = rollout.completion_ids[1][PAGE_POSITIONS]  # a token one row writes on its second page
    stopped = sample(model, PROMPTS, SamplingSettings(max_new_tokens=new, temperature=0, stop_token_ids=(stop,)),
                     _seeded())
    assert stopped.completion_ids == generate_greedy(model, PROMPTS, new, stop=(stop,))


def test_a_sliding_window_model_attends_within_its_window():
    """A window the rollout's own masks do not know: the model's own masks and attention run, and
    greedy still equals generate past the window."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           sliding_window=4, pad_token_id=0)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    rollout = sample(model, PROMPTS, SamplingSettings(max_new_tokens=8, temperature=0), _seeded())
    assert rollout.path == "modules"
    assert rollout.completion_ids == generate_greedy(model, PROMPTS, 8)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_other_families_equal_generate_fused_where_their_blocks_are_a_llamas(family):
    """Qwen2's blocks are a Llama's with biases on the query, key and value projections: the fused
    decoder takes them (biases fused too). Qwen3 normalises its queries and keys: its own modules run."""
    import transformers

    config_class = getattr(transformers, f"{family.capitalize()}Config")
    model_class = getattr(transformers, f"{family.capitalize()}ForCausalLM")
    config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    model = model_class(config).eval()
    if family == "qwen2":
        for layer in model.model.layers:  # nonzero biases, so that a bias left out changes the completions
            torch.nn.init.normal_(layer.self_attn.k_proj.bias, std=0.5)
    rollout = sample(model, PROMPTS, SamplingSettings(max_new_tokens=8, temperature=0), _seeded())
    assert rollout.path == {"qwen2": "fused", "qwen3": "modules"}[family]
    why = why_not_fused(model)  # what the run's log says once
    assert why is None if family == "qwen2" else why.startswith("model type 'qwen3' is not one of"), why
    assert rollout.completion_ids == generate_greedy(model, PROMPTS, 8)


def test_a_prompt_repeated_in_the_batch_is_prefilled_once_and_completed_per_row(path):
    """GRPO's generations: the rows of one prompt share its prefill, and each writes its own completion."""
    model = tiny_llama()
    rows = [p for p in PROMPTS[:3] for _ in range(3)]
    greedy = sample(model, rows, SamplingSettings(max_new_tokens=8, temperature=0), _seeded())
    assert greedy.completion_ids == generate_greedy(model, rows, 8)
    sampled = sample(model, rows, SamplingSettings(max_new_tokens=8, temperature=1.5), _seeded(11)).completion_ids
    assert len({tuple(c) for c in sampled[:3]}) > 1  # the copies of one prompt draw apart


def test_a_prompts_rows_read_its_keys_once_until_rows_leave_the_batch(monkeypatch):
    """The fused decoder's cache holds each prompt's keys and values once for the rows that complete
    it (GRPO's layout: a prompt's rows one after another), where each row held a copy. When rows end
    and leave the batch, the prompt part is copied out to the rows left. Greedy equals generate
    either way, over more than one page of generated positions, under grouped-query attention."""
    from cputrain.rollouts import fused_decoder, sampling
    from cputrain.rollouts.kv_cache_size import PAGE_POSITIONS

    caches = []

    class Kept(fused_decoder.FusedDecoder):
        def __init__(self, *args):
            super().__init__(*args)
            caches.append(self.cache)

    monkeypatch.setattr(sampling, "FusedDecoder", Kept)
    model = tiny_llama()
    kv_heads = model.config.num_key_value_heads
    rows = [p for p in PROMPTS[:3] for _ in range(4)]
    new = PAGE_POSITIONS + 5
    free = sample(model, rows, SamplingSettings(max_new_tokens=new, temperature=0), _seeded())
    assert free.completion_ids == generate_greedy(model, rows, new)
    shared = caches[-1]
    assert shared.rows_per_prompt == 4 and shared.prompt_keys[0].shape[0] == 3 * kv_heads
    assert shared.keys[0][0].shape[0] == 12 * kv_heads  # generated positions: one a row

    # a token the first prompt's rows write first at their third place or later: they end there
    first = free.completion_ids[0]
    stop = first[next(i for i, token in enumerate(first) if i >= 2 and first.index(token) == i)]
    stopped = sample(model, rows, SamplingSettings(max_new_tokens=new, temperature=0, stop_token_ids=(stop,)),
                     _seeded())
    assert stopped.completion_ids == generate_greedy(model, rows, new, stop=(stop,))
    assert stopped.stopped[:4] == [True] * 4
    left = caches[-1]
    assert left.rows_per_prompt == 1 and left.mask.shape[0] < len(rows)
    assert left.prompt_keys[0].shape[0] == left.mask.shape[0] * kv_heads  # copied out, one a row left


def test_stop_tokens_end_a_row_and_stopped_says_so(path):
    model = tiny_llama()
    free = sample(model, PROMPTS, SamplingSettings(max_new_tokens=10, temperature=0), _seeded()).completion_ids
    # a token the first row writes first at its third place or later: it ends there, the others where they meet it
    at = next(i for i, token in enumerate(free[0]) if i >= 2 and free[0].index(token) == i)
    stop = free[0][at]
    rollout = sample(model, PROMPTS, SamplingSettings(max_new_tokens=10, temperature=0, stop_token_ids=(stop,)),
                     _seeded())
    assert rollout.completion_ids[0] == free[0][:at + 1]
    for completion, was_free, stopped in zip(rollout.completion_ids, free, rollout.stopped):
        cut = was_free.index(stop) + 1 if stop in was_free else len(was_free)
        assert completion == was_free[:cut]
        assert stopped == (stop in was_free)
    assert rollout.completion_ids == generate_greedy(model, PROMPTS, 10, stop=(stop,))
    assert rollout.new_tokens == sum(len(c) for c in rollout.completion_ids)


def test_max_new_tokens_clips():
    model = tiny_llama()
    long = sample(model, PROMPTS, SamplingSettings(max_new_tokens=9, temperature=0), _seeded())
    short = sample(model, PROMPTS, SamplingSettings(max_new_tokens=3, temperature=0), _seeded())
    assert short.completion_ids == [c[:3] for c in long.completion_ids]
    assert short.stopped == [False] * len(PROMPTS)


def test_seeded_sampling_is_reproducible_and_resumes_from_the_generator_state():
    model = tiny_llama()
    settings = SamplingSettings(max_new_tokens=8, temperature=0.9, top_p=0.95, top_k=20)
    generator = _seeded(7)
    first = sample(model, PROMPTS, settings, generator).completion_ids
    state = generator.get_state()
    second = sample(model, PROMPTS, settings, generator).completion_ids
    assert sample(model, PROMPTS, settings, _seeded(7)).completion_ids == first
    resumed = torch.Generator()
    resumed.set_state(state)
    assert sample(model, PROMPTS, settings, resumed).completion_ids == second
    assert second != first  # the generator moved on


def test_sampling_draws_only_from_the_generator():
    model = tiny_llama()
    settings = SamplingSettings(max_new_tokens=6, temperature=1.0)
    torch.manual_seed(0)
    first = sample(model, PROMPTS, settings, _seeded(3)).completion_ids
    torch.manual_seed(99)
    assert sample(model, PROMPTS, settings, _seeded(3)).completion_ids == first


def test_top_k_one_is_greedy():
    model = tiny_llama()
    greedy = sample(model, PROMPTS, SamplingSettings(max_new_tokens=8, temperature=0), _seeded())
    top1 = sample(model, PROMPTS, SamplingSettings(max_new_tokens=8, temperature=1.3, top_k=1), _seeded())
    assert top1.completion_ids == greedy.completion_ids


def test_the_warpers_match_transformers():
    """temperature, then top-k, then top-p, as transformers' logits processors leave the scores."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from cputrain.rollouts.token_draw import warped_scores

    logits = torch.randn(5, VOCAB, generator=_seeded(5))
    settings = SamplingSettings(max_new_tokens=1, temperature=0.7, top_k=30, top_p=0.8)
    expected = logits
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(30), TopPLogitsWarper(0.8)):
        expected = warper(None, expected)
    assert torch.equal(warped_scores(logits, settings.temperature, settings.top_k, settings.top_p), expected)


def test_the_draw_follows_the_warped_distribution():
    """One uniform number a row against the cumulative distribution: the tokens come as often as the
    warped probabilities say, and a token top-k or top-p removed never comes."""
    from cputrain.rollouts.token_draw import next_tokens, warped_scores

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]]).repeat(40_000, 1)
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.8, 4, 1.0), (1.3, 0, 0.7)):
        expected = warped_scores(logits[:1], temperature, top_k, top_p).softmax(dim=-1)[0]
        drawn = next_tokens(logits, temperature, top_k, top_p, _seeded(21))
        frequency = torch.bincount(drawn, minlength=6).float() / len(drawn)
        assert torch.allclose(frequency, expected, atol=0.01), (frequency, expected)
        assert not frequency[expected == 0].any()


def test_top_k_and_top_p_among_the_likeliest_tokens_draw_as_the_full_sort():
    """Top-k and top-p drawn among the k (or NUCLEUS_CANDIDATES) most likely tokens follow the
    warped distribution of the whole vocabulary; a row whose nucleus may reach past the candidates
    (a flat row) falls back to the full sort and still does."""
    from cputrain.rollouts.token_draw import NUCLEUS_CANDIDATES, next_tokens, warped_scores

    vocab = 4 * NUCLEUS_CANDIDATES
    peaked = torch.full((vocab,), -4.0)
    peaked[[3, 70, 500, 901]] = torch.tensor([2.0, 1.5, 1.0, 0.2])
    flat = torch.randn(vocab, generator=_seeded(8)) * 0.1
    flat[[11, 12]] = 1.0
    for row in (peaked, flat):
        logits = row.repeat(40_000, 1)
        for temperature, top_k, top_p in ((1.0, 0, 0.9), (0.7, 3, 1.0), (1.2, 40, 0.8)):
            expected = warped_scores(logits[:1], temperature, top_k, top_p).softmax(dim=-1)[0]
            drawn = next_tokens(logits, temperature, top_k, top_p, _seeded(22))
            frequency = torch.bincount(drawn, minlength=vocab).float() / len(drawn)
            assert (frequency - expected).abs().max() < 0.01, (temperature, top_k, top_p)
            assert not frequency[expected == 0].any()


def test_a_lora_wrapped_model_samples_and_its_modes_are_restored(path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                    init_lora_weights=False))
    model.train()
    model.base_model.model.model.embed_tokens.eval()  # a module left in its own mode stays in it
    modes = {name: m.training for name, m in model.named_modules()}
    rollout = sample(model, PROMPTS, SamplingSettings(max_new_tokens=6, temperature=0), _seeded())
    assert {name: m.training for name, m in model.named_modules()} == modes
    model.eval()
    assert rollout.completion_ids == generate_greedy(model, PROMPTS, 6)
    with model.disable_adapter():  # the adapters count: without them the completions differ
        assert sample(model, PROMPTS, SamplingSettings(max_new_tokens=6, temperature=0),
                      _seeded()).completion_ids != rollout.completion_ids


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_without_the_decode_attention_the_models_own_attention_gets_its_own_masks(monkeypatch, attn_implementation,
                                                                                  modules_only):
    """Where transformers has no AttentionInterface, the model attends with its own sdpa or eager,
    and the masks take its form: the completions are the same."""
    import contextlib

    from cputrain.rollouts import sampling

    model = tiny_llama(attn_implementation=attn_implementation)
    ours = sample(model, PROMPTS, SamplingSettings(max_new_tokens=6, temperature=0), _seeded()).completion_ids
    monkeypatch.setattr(sampling, "decode_attention", lambda config: contextlib.nullcontext(False))
    assert sample(model, PROMPTS, SamplingSettings(max_new_tokens=6, temperature=0), _seeded()).completion_ids == ours


def test_a_model_with_activation_checkpointing_in_train_mode_samples_as_without(path):
    model = tiny_llama()
    plain = sample(model, PROMPTS, SamplingSettings(max_new_tokens=6, temperature=0), _seeded()).completion_ids
    # transformers 5.x's name for gradient_checkpointing_enable, which it deprecates
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    assert sample(model, PROMPTS, SamplingSettings(max_new_tokens=6, temperature=0), _seeded()).completion_ids == plain
    assert model.training


def test_a_ddp_wrapped_model_samples_from_its_replica(tmp_path):
    """DDP's forward broadcasts buffers (a collective) every call: sample() decodes with the replica
    inside, so ranks need not step together; the wrapper's modes are restored too."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = tiny_llama()
        expected = sample(model, PROMPTS, SamplingSettings(max_new_tokens=5, temperature=0), _seeded()).completion_ids
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        wrapped.train()
        got = sample(wrapped, PROMPTS, SamplingSettings(max_new_tokens=5, temperature=0), _seeded()).completion_ids
        assert got == expected
        assert wrapped.training and model.training
    finally:
        dist.destroy_process_group()


def test_no_grad_and_timings():
    model = tiny_llama()
    rollout = sample(model, PROMPTS, SamplingSettings(max_new_tokens=4, temperature=0), _seeded())
    assert rollout.prefill_s > 0 and rollout.decode_s >= 0
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("prompts", [[], [[4, 5]]])
def test_an_empty_or_single_batch(prompts):
    rollout = sample(tiny_llama(), prompts, SamplingSettings(max_new_tokens=3, temperature=0), _seeded())
    assert len(rollout.completion_ids) == len(prompts) == len(rollout.stopped)


def test_kv_cache_bytes_is_what_the_rollout_cache_holds():
    """The plan's figure equals the bytes sample()'s cache allocates, for a GQA model, in fp32 and bf16."""
    from cputrain.rollouts.kv_cache import cache_keyword, rollout_cache
    from cputrain.rollouts.kv_cache_size import kv_cache_bytes

    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_llama(dtype=dtype)
        rows, width, new = 3, 5, 7
        cache = rollout_cache(model.config, width + new)
        model(input_ids=torch.ones((rows, width), dtype=torch.long), use_cache=True,
              **{cache_keyword(model): cache})
        held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.key_store, layer.value_store))
        assert kv_cache_bytes(model.config, rows, width + new, dtype) == held
        assert kv_cache_bytes(model.config.to_dict(), rows, width + new, str(dtype).removeprefix("torch.")) == held


def test_kv_cache_bytes_of_the_demo_shape():
    from cputrain.rollouts.kv_cache_size import kv_cache_bytes

    demo = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4}
    # 2 (keys, values) × 4 layers × 64 rows × 256 (heads × head_dim) × 176 positions × 2 bytes
    assert kv_cache_bytes(demo, rows=64, max_len=176, dtype="bf16") == 2 * 4 * 64 * 256 * 176 * 2
    with pytest.raises(ValueError, match="no element size"):
        kv_cache_bytes(demo, rows=1, max_len=1, dtype="int3")


def test_under_the_trainers_bf16_autocast_the_cache_holds_bf16(monkeypatch, modules_only):
    """The trainer holds fp32 weights and computes in bf16 under autocast: sample() called inside its
    autocast keeps the cache in bf16 (what attention's products read), its completions as long as asked."""
    from cputrain.rollouts import kv_cache, sampling

    caches = []

    def kept(config, capacity):
        caches.append(kv_cache.rollout_cache(config, capacity))
        return caches[-1]

    monkeypatch.setattr(sampling, "rollout_cache", kept)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rollout = sample(tiny_llama(), PROMPTS, SamplingSettings(max_new_tokens=5, temperature=1.0), _seeded())
    assert [len(c) for c in rollout.completion_ids] == [5] * len(PROMPTS)
    assert all(0 <= t < VOCAB for c in rollout.completion_ids for t in c)
    assert {layer.key_store.dtype for layer in caches[0].layers} == {torch.bfloat16}


def test_under_the_trainers_bf16_autocast_the_fused_decoder_computes_in_bf16(monkeypatch):
    """Under the trainer's autocast over fp32 weights, the fused rollout casts the weights to bf16 once
    (not every product, every token) and keeps its cache in bf16; the model's weights stay fp32."""
    from cputrain.rollouts import fused_decoder, sampling

    decoders = []

    class Kept(fused_decoder.FusedDecoder):
        def __init__(self, *args):
            super().__init__(*args)
            decoders.append(self)

    monkeypatch.setattr(sampling, "FusedDecoder", Kept)
    model = tiny_llama()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rollout = sample(model, PROMPTS, SamplingSettings(max_new_tokens=5, temperature=1.0), _seeded())
    assert rollout.path == "fused" and [len(c) for c in rollout.completion_ids] == [5] * len(PROMPTS)
    assert {page.dtype for pages in decoders[0].cache.keys for page in pages} == {torch.bfloat16}
    assert {b.qkv.dtype for b in decoders[0].w.blocks} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_the_forwards_keywords_are_seen_through_the_chunked_head_and_peft(modules_only):
    """The chunked head replaces the instance's forward with one taking **kwargs: the rollout still
    passes its cache as `cache` and asks for the last position's logits only, and greedy equals
    generate's."""
    from peft import LoraConfig, get_peft_model

    from cputrain.kernels.chunked_head import install_chunked_loss
    from cputrain.rollouts.kv_cache import cache_keyword

    model = tiny_llama()
    expected = generate_greedy(model, PROMPTS, 4)
    install_chunked_loss(model)
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=True))
    head_rows = []
    model.lm_head.register_forward_hook(lambda _, args, out: head_rows.append(args[0].shape[1]))
    rollout = sample(wrapped, PROMPTS, SamplingSettings(max_new_tokens=4, temperature=0.0), _seeded())
    assert rollout.completion_ids == expected
    assert cache_keyword(wrapped) == "cache"  # not transformers 5's deprecated past_key_values
    assert head_rows and set(head_rows) == {1}, f"the head ran on {head_rows} positions, not the last one only"

"""sampling.py: token_logprobs against the naive log-softmax (values and gradients), the lean decode
against transformers' generate, generation that follows the flags alone, top-k then top-p as
transformers does, and the sampled distribution (chi-square). Tolerances: fp32 on both sides,
differing in summation order only (~1e-7), are compared at 1e-5; a test that needs another bound
states it.
"""

import collections
import math

import pytest
import torch

import grpo
import sampling
from grpo import grpo_loss
from helpers import decode_with_drawn_logprobs, left_padded_batch, tiny_llama
from sampling import token_logprobs
from support import decode, demo


def naive_logprobs(model, ids, attention, c, temperature):
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[
        :, -c - 1 : -1
    ]
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[:, -c:, None]).squeeze(-1)


def logprobs_and_grad(model, fn):
    model.zero_grad()
    logps = fn()
    (logps * torch.linspace(-1, 1, logps.numel()).view_as(logps)).sum().backward()
    return logps.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def count_cache_repeats(monkeypatch):
    """Spy on DynamicCache.batch_repeat_interleave: the prompt-once path calls it, the plain path
    does not."""
    from transformers import DynamicCache

    calls = []
    original = DynamicCache.batch_repeat_interleave

    def spy(self, repeats):
        calls.append(repeats)
        return original(self, repeats)

    monkeypatch.setattr(DynamicCache, "batch_repeat_interleave", spy)
    return calls


def left_padded_prompts(lengths, vocab_size, seed=1):
    """[B, P] ids and mask, left-padded with id 0, prompts of the given lengths (random ids >=
    2)."""
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids, mask = (
        torch.zeros(len(lengths), P, dtype=torch.long),
        torch.zeros(len(lengths), P, dtype=torch.long),
    )
    for i, n in enumerate(lengths):
        ids[i, P - n :] = torch.randint(2, vocab_size, (n,), generator=g)
        mask[i, P - n :] = 1
    return ids, mask


def small_llama(seed=0):
    """demo.py's builder with grouped-query attention, pad id 0 and EOS id 1 in its generation
    config."""
    return demo.tiny_llama(97, seed, num_key_value_heads=2, tie_word_embeddings=False).eval()


def chi_square_bound(dof, z=3.719):
    """The chi-square quantile of dof degrees of freedom at the normal quantile z (3.719: p =
    1e-4), by the Wilson-Hilferty approximation (within 1% of the exact quantile for dof >= 3)."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def hf_warpers(scores, temperature, top_k, top_p):
    """transformers' own sampling warpers, in generate()'s order."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores


# --- token_logprobs: equal to the naive log-softmax, the prompt once per group, the chunked head
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [1, 4], ids=["plain", "prompt-once-per-group"])
@pytest.mark.parametrize("plain_head", [True, False], ids=["chunked-lm-head", "logits-path"])
def test_token_logprobs_equal_naive_with_left_padding_and_temperature_0_7(
    group_size, plain_head, monkeypatch
):
    # Tolerance: both sides are fp32 and differ only in summation order: ~1e-7, the issue asks 1e-5.
    if not plain_head:
        monkeypatch.setattr(sampling, "PLAIN_HEAD_MODEL_TYPES", set())  # force the logits fallback
    model = tiny_llama()
    ids, attention = left_padded_batch(group_size=4)
    attention[1, -2:] = 0  # tokens after an EOS
    expected, expected_grad = logprobs_and_grad(
        model, lambda: naive_logprobs(model, ids, attention, 5, 0.7)
    )
    logps, grad = logprobs_and_grad(
        model,
        lambda: token_logprobs(model, ids, attention, 5, 0.7, group_size=group_size, chunk_size=3),
    )
    assert logps.dtype == torch.float32 and logps.shape == (12, 5)
    torch.testing.assert_close(logps, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)
    # and the temperature matters: at T = 1 the values differ
    assert (token_logprobs(model, ids, attention, 5, 1.0) - logps).abs().max() > 1e-3


@pytest.mark.parametrize("group_size", [1, 4], ids=["plain", "prompt-once-per-group"])
@pytest.mark.parametrize("plain_head", [True, False], ids=["chunked-lm-head", "logits-path"])
def test_entropy_from_the_chunked_head_equals_the_naive_softmax_entropy(
    group_size, plain_head, monkeypatch
):
    # fp32 on both sides, differing in summation order only (~1e-7); 1e-5 as for the log-probs.
    if not plain_head:
        monkeypatch.setattr(sampling, "PLAIN_HEAD_MODEL_TYPES", set())
    model = tiny_llama()
    ids, attention = left_padded_batch(group_size=4)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    logits = (
        model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -6:-1]
        / 0.7
    )
    expected = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)  # [12, 5]
    logps, entropy = token_logprobs(
        model, ids, attention, 5, 0.7, group_size=group_size, chunk_size=3, entropy=True
    )
    torch.testing.assert_close(entropy, expected.detach(), rtol=0, atol=1e-5)
    assert not entropy.requires_grad and logps.requires_grad
    # H is in (0, log V]
    assert 0 < entropy.min() and entropy.max() <= math.log(model.config.vocab_size) + 1e-5


def test_token_logprobs_with_gradient_checkpointing_falls_back_to_plain_path():
    model = tiny_llama()
    ids, attention = left_padded_batch(group_size=4)
    expected = naive_logprobs(model, ids, attention, 5, 1.0).detach()
    getattr(
        model, "activation_checkpointing_enable", model.gradient_checkpointing_enable
    )()  # renamed in 5.x
    model.train()
    logps = token_logprobs(model, ids, attention, 5, group_size=4)
    torch.testing.assert_close(logps.detach(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "group_size,checkpointing,expected_calls",
    [(1, False, []), (4, False, [4]), (4, True, [])],
    ids=["plain", "prompt-once", "checkpointing-falls-back"],
)
def test_token_logprobs_takes_the_prompt_once_path_only_where_it_can(
    monkeypatch, group_size, checkpointing, expected_calls
):
    calls = count_cache_repeats(monkeypatch)
    model = tiny_llama()
    if checkpointing:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        model.train()
    ids, attention = left_padded_batch(group_size=4)
    token_logprobs(model, ids, attention, 5, group_size=group_size)
    assert calls == expected_calls


def test_linear_logprobs_under_bf16_autocast_match_autograd_of_the_same_bf16_head():
    # Under autocast the model's lm-head matmul runs in bf16; ours must compute (and differentiate)
    # the same thing. Reference: autograd through (h.bf16 @ W.bf16ᵀ).float() / T. Both sides use
    # bf16 matmuls of identical inputs; they differ only in how bf16 partial results are summed
    # (ours accumulates chunk gradients of W in fp32), so they agree to bf16 resolution: rtol 2e-2
    # is ~5 units of bf16's 2^-8 relative rounding.
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(37, 16, generator=gen) * 3).requires_grad_()
    weight = (torch.randn(50, 16, generator=gen)).requires_grad_()
    targets = torch.randint(0, 50, (37,), generator=gen)
    upstream = torch.randn(37, generator=gen)
    logits = (hidden.bfloat16() @ weight.bfloat16().T).float() / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    exp_h, exp_w = torch.autograd.grad((expected * upstream).sum(), [hidden, weight])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # 5 chunks, the last one partial
        got, _ = sampling._LinearLogprobs.apply(hidden, weight, targets, 0.7, 8)
    got_h, got_w = torch.autograd.grad((got * upstream).sum(), [hidden, weight])
    assert got.dtype == torch.float32 and hidden.grad is None
    # the same bf16 logits, fp32 after
    torch.testing.assert_close(got, expected.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(got_h, exp_h, rtol=2e-2, atol=2e-2 * exp_h.abs().max().item())
    torch.testing.assert_close(got_w, exp_w, rtol=2e-2, atol=2e-2 * exp_w.abs().max().item())


def test_token_logprobs_equal_the_log_probs_generate_sampled_from():
    # generate's processed scores at temperature 0.7 (no top-k/top-p) are exactly the distribution
    # each token was drawn from; token_logprobs must give the same log-probs for the drawn tokens
    # (left-padded, fp32: 1e-5).
    model = tiny_llama()
    ids, attention = left_padded_batch(group_size=1, completion_length=1)
    prompt, prompt_mask = ids[:, :-1], attention[:, :-1]
    torch.manual_seed(0)
    out = model.generate(
        input_ids=prompt,
        attention_mask=prompt_mask,
        do_sample=True,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        max_new_tokens=6,
        min_new_tokens=6,
        num_return_sequences=4,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    completion = out.sequences[:, prompt.shape[1] :]  # [B*4, 6]
    sampled = torch.stack(
        [
            torch.log_softmax(s.float(), -1).gather(-1, completion[:, t : t + 1]).squeeze(-1)
            for t, s in enumerate(out.scores)
        ],
        dim=1,
    )
    mask = torch.cat([prompt_mask.repeat_interleave(4, 0), torch.ones_like(completion)], dim=1)
    logps = token_logprobs(model, out.sequences, mask, 6, temperature=0.7, group_size=4)
    torch.testing.assert_close(logps, sampled, rtol=0, atol=1e-5)


# --- the decode path: each prompt prefilled once, finished rows leave the batch
# --------------------------------------------------------------------------------------------------


def test_decode_gives_transformers_greedy_sequences_with_left_padding_and_prefills_each_prompt_once():
    model = small_llama()
    # the 1-token prompt's prefill columns are all padding
    ids, mask = left_padded_prompts([5, 1, 8, 3], 97)
    # top-k = 1: sampling keeps only the argmax, so decode is greedy and must equal transformers'
    # greedy generate (on the prompts repeated G times) token for token, EOS and the padding after
    # it included.
    settings = sampling.Sampling(temperature=1.0, top_k=1, top_p=1.0, max_new_tokens=12)
    batches = []
    model.model.embed_tokens.register_forward_pre_hook(
        lambda m, args: batches.append(tuple(args[0].shape))
    )
    ours = decode.generate(model, ids, mask, settings, 3, [demo.EOS], demo.PAD)
    assert batches[0] == (4, 8)  # the B prompts once, not B*G rows
    assert batches[1] == (12, 1)
    hf = model.generate(
        input_ids=ids.repeat_interleave(3, 0),
        attention_mask=mask.repeat_interleave(3, 0),
        do_sample=False,
        max_new_tokens=12,
        eos_token_id=demo.EOS,
        pad_token_id=demo.PAD,
    )[:, 8:]
    assert torch.equal(ours, hf)
    assert len({tuple(row) for row in ours.tolist()}) > 1  # not a degenerate all-equal output


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


@pytest.mark.parametrize(
    "device,amp",
    [("cpu", None), ("cpu", torch.bfloat16), pytest.param("cuda", torch.bfloat16, marks=CUDA)],
    ids=["fp32", "bf16-autocast", "cuda-bf16-autocast"],
)
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (12, 0.9)], ids=["full", "top-k-top-p"])
def test_train_pys_plain_decode_draws_the_lean_decodes_tokens_bit_for_bit(
    device, amp, top_k, top_p
):
    # decode.plain_decode is lean_decode without the trainer's options, written out for reading:
    # from the same random numbers the same tokens, in the precision runs use, with left-padded
    # prompts of different lengths and rows leaving the batch at EOS at different steps.
    model = small_llama().to(device)
    # EOS's logit raised by 1.5 (e^1.5: 4.5 times as likely): rows end early, at different steps
    model.lm_head.register_forward_hook(lambda m, i, out: [out[..., demo.EOS].add_(1.5)] and None)
    ids, mask = (x.to(device) for x in left_padded_prompts([5, 1, 8, 3], 97))
    settings = sampling.Sampling(temperature=0.9, top_k=top_k, top_p=top_p, max_new_tokens=16)
    outs = []
    for engine in (decode.lean_decode, decode.plain_decode):
        torch.manual_seed(3)
        with sampling.autocast(device, amp):
            outs.append(engine(model, ids, mask, settings, 3, [demo.EOS], demo.PAD))
        outs.append(torch.rand(1, device=device))  # the RNG left where lean_decode leaves it
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    lengths = grpo.completion_mask(outs[0], [demo.EOS]).sum(1)
    assert len(lengths) == 12 and len(set(lengths.tolist())) >= 4  # rows ended apart
    assert (lengths < 16).sum() >= 6  # and most of them early: the leave-the-batch path ran


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_train_pys_sample_groups_gives_the_trainers_rollouts_bit_for_bit(amp):
    import dataclasses

    model, tokenizer = demo.model_and_tokenizer(seed=0)
    # train.py samples with its model in training mode (under gradient checkpointing too, where a
    # forward in training mode runs without a cache): the decode must take it to eval, with no
    # autograd graph, and give it back as it came
    sampling.enable_gradient_checkpointing(model)
    model.train()
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append((torch.is_grad_enabled(), m.training)))
    prompts = ["1 + 2 =", "7 =", "4 + 4 + 1 ="]  # different lengths: left padding
    settings = sampling.Sampling(temperature=1.0, max_new_tokens=10)
    got = []
    for sample in (sampling.sample_rollouts, sampling.sample_groups):
        torch.manual_seed(5)
        got.append(sample(model, tokenizer, prompts, settings, 4, amp))
    for field in dataclasses.fields(sampling.Rollouts):
        ours, theirs = getattr(got[1], field.name), getattr(got[0], field.name)
        same = torch.equal(ours, theirs) if isinstance(ours, torch.Tensor) else ours == theirs
        assert same, field.name
    P = got[1].prompt_length
    assert not got[1].attention_mask[:, :P].all()  # the padding reached the rollouts' mask
    assert got[1].truncated.any() and not got[1].truncated.all()  # both kinds of rows
    assert seen and set(seen) == {(False, False)}  # no graph, eval mode, at every forward
    assert model.training  # as it came


def test_plain_decode_hands_a_model_without_a_static_cache_to_generate(monkeypatch):
    model = small_llama()
    ids, mask = left_padded_prompts([5, 2], 97)
    settings = sampling.Sampling(temperature=1.0, top_k=1, max_new_tokens=6)  # greedy
    lean = decode.plain_decode(model, ids, mask, settings, 2, [demo.EOS], demo.PAD)
    monkeypatch.setattr(decode, "uses_lean_decode", lambda model, settings: False)
    calls, real = [], model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: calls.append(kw) or real(**kw))
    assert torch.equal(decode.plain_decode(model, ids, mask, settings, 2, [demo.EOS], 0), lean)
    assert len(calls) == 1


def test_finished_rows_leave_the_batch_and_forced_lengths_end_where_they_say():
    from scripts import bench

    model = small_llama()
    ids, mask = left_padded_prompts([4, 6], 97)
    settings = sampling.Sampling(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8)
    lengths = torch.tensor([3, 8, 2, 9, 5, 2])  # 9 > 8: no EOS (truncated)
    batches = []
    model.model.embed_tokens.register_forward_pre_hook(
        lambda m, args: batches.append(args[0].shape[0])
    )
    torch.manual_seed(0)
    # bench.py's, from outside decode: a forward hook on the model
    with bench.forced_lengths_in_decode(model, lengths, demo.EOS):
        out = decode.generate(model, ids, mask, settings, 3, [demo.EOS], demo.PAD)
    # The prefill (B = 2), then the token of step t (t = 1..7) is fed for the rows still without EOS
    # after it.
    assert batches == [2, 6, 4, 3, 3, 2, 2, 2]
    assert out.shape == (6, 8)
    completion_mask = grpo.completion_mask(out, [demo.EOS])
    assert completion_mask.sum(1).tolist() == [3, 8, 2, 8, 5, 2]
    assert [row.index(demo.EOS) + 1 if demo.EOS in row else None for row in out.tolist()] == [
        3,
        8,
        2,
        None,
        5,
        2,
    ]
    assert (out[completion_mask == 0] == demo.PAD).all()
    # A first token comes from the prompt's one prefill, shared by its G rows: a length of 1 holds
    # for a whole group (which then leaves the batch at once), and is refused for part of one.
    with bench.forced_lengths_in_decode(model, torch.tensor([1, 1, 1, 4, 9, 2]), demo.EOS):
        out = decode.generate(model, ids, mask, settings, 3, [demo.EOS], demo.PAD)
    assert grpo.completion_mask(out, [demo.EOS]).sum(1).tolist() == [1, 1, 1, 4, 8, 2]
    with (
        pytest.raises(ValueError, match="whole group"),
        bench.forced_lengths_in_decode(model, torch.tensor([3, 8, 1, 9, 5, 2]), demo.EOS),
    ):
        decode.generate(model, ids, mask, settings, 3, [demo.EOS], demo.PAD)


def test_bench_forces_the_same_completion_lengths_in_transformers_generate_as_in_decode():
    # bench.py --real-length: TRL's side samples with transformers' generate() and
    # bench.ForcedLengths (through bench.force_lengths, which hands each generate call its step's
    # lengths), ours with decode() inside bench.forced_lengths_in_decode. Both must end every row
    # where the lengths say (9 > 8 new tokens: cut off, no EOS).
    from scripts import bench

    model = small_llama()
    ids, mask = left_padded_prompts([5, 5], 97)
    lengths = torch.tensor([3, 8, 2, 9, 5, 2])
    bench.force_lengths(model, [lengths])
    torch.manual_seed(0)
    hf = model.generate(
        input_ids=ids.repeat_interleave(3, 0),
        attention_mask=mask.repeat_interleave(3, 0),
        do_sample=True,
        top_k=50,
        max_new_tokens=8,
        eos_token_id=demo.EOS,
        pad_token_id=demo.PAD,
    )
    with bench.forced_lengths_in_decode(model, lengths, demo.EOS):
        ours = decode.generate(
            model, ids, mask, sampling.Sampling(0.9, 50, 0.9, 8), 3, [demo.EOS], demo.PAD
        )
    for completions in (hf[:, 5:], ours):
        assert grpo.completion_mask(completions, [demo.EOS]).sum(1).tolist() == [3, 8, 2, 8, 5, 2]
        assert (
            completions == demo.EOS
        ).sum().item() == 5  # EOS only where forced: every row but the 9's


@pytest.mark.slow
def test_bench_forced_lengths_end_where_they_say_in_the_compiled_decode_too():
    # Compiled, decode keeps every planned row in the batch (here 8 for 6 real rows): the rows that
    # bench.forced_lengths_in_decode forces are the real ones, padding rows never written out. Same
    # lengths as eager.
    from scripts import bench

    model = small_llama()
    ids, mask = left_padded_prompts([4, 6], 97)
    settings = sampling.Sampling(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8)
    lengths = torch.tensor([3, 8, 2, 9, 5, 2])
    sampling.compile_model(model, "aot_eager")
    decode.plan_decode(model, rows=[8], length=6 + 8)
    with bench.forced_lengths_in_decode(model, lengths, demo.EOS):
        out = decode.generate(model, ids, mask, settings, 3, [demo.EOS], demo.PAD)
    assert out.shape == (6, 8)
    assert grpo.completion_mask(out, [demo.EOS]).sum(1).tolist() == [3, 8, 2, 8, 5, 2]


def test_bench_times_the_loop_itself(tmp_path):
    # bench.py --step (and --vs-trl's side A) runs trainer.train, not a copy of its step: 2 steps of
    # the tiny config with forced real lengths call train's own policy_update twice and frozen_logps
    # twice (beta > 0), and the phases and completion tokens it reports are those calls'.
    import argparse
    from unittest import mock

    import trainer
    from scripts import bench

    a = argparse.Namespace(
        config="tiny",
        batch_size=1,
        num_generations=4,
        prompt_len=8,
        max_new_tokens=16,
        steps=1,
        warmup=1,
        real_length=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.04,
        num_iterations=1,
        lr=1e-5,
        dtype="fp32",
        compile=None,
    )
    calls = collections.Counter()

    def spy(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    with (
        mock.patch.object(trainer, "policy_update", spy("update", trainer.policy_update)),
        mock.patch.object(trainer, "frozen_logps", spy("ref", trainer.frozen_logps)),
        mock.patch.object(bench, "DEVICE", "cpu"),
    ):
        result = bench.worker_ours(a)
    assert calls == {"update": 2, "ref": 2}
    lengths = bench.forced_lengths(a)  # [2, 4]: seed 0, in [16 / 8, 16]
    assert result["tokens"] == int(lengths[1].clamp(max=16).sum())
    (step,) = result["steps"]
    assert set(step) == {"generate", "rewards", "ref+old logps", "policy fwd+bwd+opt", "step"}
    assert step["step"][0] >= sum(step[k][0] for k in step if k != "step")


def test_decode_log_probs_are_what_token_logprobs_gives_its_samples():
    # Top-k and top-p off: decode samples from softmax(logits / 0.7), the distribution
    # token_logprobs evaluates; the log-prob each token was drawn with must be token_logprobs' value
    # for it (left-padded prompts of three lengths, rows of several lengths; fp32 through different
    # batch shapes and a static vs repeated cache: 1e-5).
    model = small_llama()
    ids, mask = left_padded_prompts([7, 4, 2], 97)
    settings = sampling.Sampling(temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=40)
    torch.manual_seed(0)
    completions, drawn = decode_with_drawn_logprobs(
        model, ids, mask, settings, 4, [demo.EOS], demo.PAD
    )
    completion_mask = grpo.completion_mask(completions, [demo.EOS])
    # rows of several lengths: some left the batch early
    assert len(set(completion_mask.sum(1).tolist())) > 2
    full = torch.cat([ids.repeat_interleave(4, 0), completions], 1)
    attention = torch.cat([mask.repeat_interleave(4, 0), completion_mask], 1)
    logps = token_logprobs(
        model, full, attention, completions.shape[1], temperature=0.7, group_size=4
    )
    torch.testing.assert_close(logps * completion_mask, drawn, rtol=0, atol=1e-5)


# --- generation: the flags only, the exact distribution, long prompts
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("path", ["decode", "generate"])
def test_two_token_completions_follow_the_exact_distribution_of_temperature_top_k_top_p(
    path, monkeypatch
):
    # The exact probability of every two-token completion (or of EOS first) from one prompt,
    # computed from the model's logits through transformers-equal warpers (T = 0.5, top-k 4, top-p
    # 0.8), against the counts of 6,000 samples: a chi-square test at p = 1e-4 (one fixed seed, so
    # the result is the same at every run). decode() is the lean path; "generate" is transformers'
    # generate() with our processor, the path it replaced. A token outside the survivors has
    # probability 0 and fails the test by itself.
    model, T, k, p, N = small_llama(), 0.5, 4, 0.8, 6000
    ids, mask = left_padded_prompts([5], 97)
    warp = decode.TemperatureTopKTopP(T, k, p)
    with torch.no_grad():
        first = warp(None, model(input_ids=ids, attention_mask=mask).logits[:, -1]).softmax(-1)[0]
        exact = {}
        for t1 in first.nonzero().squeeze(1).tolist():
            if t1 == demo.EOS:
                exact[(t1,)] = first[t1].item()
                continue
            seq = torch.cat([ids, torch.tensor([[t1]])], 1)
            second = warp(
                None, model(input_ids=seq, attention_mask=torch.ones_like(seq)).logits[:, -1]
            ).softmax(-1)
            exact.update(
                {
                    (t1, t2): first[t1].item() * second[0, t2].item()
                    for t2 in second[0].nonzero().squeeze(1).tolist()
                }
            )
    # a distribution with spread, not one token
    assert 6 <= len(exact) <= 16 and max(exact.values()) < 0.5
    if path == "generate":
        monkeypatch.setattr(decode, "uses_lean_decode", lambda model, settings: False)
    torch.manual_seed(0)
    out = decode.generate(model, ids, mask, sampling.Sampling(T, k, p, 2), N, [demo.EOS], demo.PAD)
    counts = collections.Counter(
        tuple(row[:1]) if row[0] == demo.EOS else tuple(row) for row in out.tolist()
    )
    assert set(counts) <= set(exact)  # nothing outside the survivors
    chi2 = sum((counts[o] - N * q) ** 2 / (N * q) for o, q in exact.items())
    assert chi2 < chi_square_bound(len(exact) - 1)


@pytest.mark.parametrize(
    "limit, context, expected",
    [(5, 512, 5), (None, 16, 10), (None, 512, 20)],
    ids=["--max-prompt-length 5", "context 16 - 6 new tokens", "fits"],
)
def test_a_prompt_longer_than_the_limit_keeps_its_last_tokens_with_a_warning(
    limit, context, expected, capsys
):
    model = demo.tiny_llama(len(demo.WORDS), 0, max_position_embeddings=context)
    tokenizer = demo.word_tokenizer(demo.WORDS)
    prompt = " ".join(demo.WORDS[2:22])  # 20 tokens
    rollouts = sampling.sample_rollouts(
        model,
        tokenizer,
        [prompt, "3 + 4 ="],
        sampling.Sampling(max_new_tokens=6, max_prompt_length=limit),
        group_size=2,
    )
    P = rollouts.prompt_length
    assert (
        P == expected
        and rollouts.input_ids[0, :P].tolist() == tokenizer(prompt).input_ids[-expected:]
    )
    assert ("1 prompt(s) longer than" in capsys.readouterr().err) == (expected < 20)


@pytest.mark.parametrize("path", ["decode", "generate"])
def test_generation_follows_the_flags_not_the_checkpoints_generation_config(path, monkeypatch):
    settings = sampling.Sampling(temperature=0.7, top_k=20, top_p=0.8, max_new_tokens=10)
    ids, mask = left_padded_prompts([4, 6], 97)
    clean, polluted = small_llama(), small_llama()
    gc = polluted.generation_config
    gc.repetition_penalty, gc.no_repeat_ngram_size, gc.suppress_tokens, gc.min_p = (
        2.0,
        2,
        [5, 6, 7],
        0.5,
    )
    gc.temperature, gc.top_k, gc.top_p, gc.min_new_tokens = 0.1, 3, 0.2, 10
    used = []
    real = type(polluted)._get_logits_processor

    def record(self, generation_config, *a, **kw):
        used.append(real(self, generation_config, *a, **kw))
        return used[-1]

    # transformers' generate(), where decode() does not run (beam search, FSDP)
    if path == "generate":
        monkeypatch.setattr(decode, "uses_lean_decode", lambda model, settings: False)
    monkeypatch.setattr(type(polluted), "_get_logits_processor", record)
    out = {}
    for name, model in (("clean", clean), ("polluted", polluted)):
        torch.manual_seed(0)
        out[name] = decode.generate(model, ids, mask, settings, 3, [demo.EOS], demo.PAD)
    # same seed, same samples: the checkpoint's settings unused
    assert torch.equal(out["clean"], out["polluted"])
    assert len({tuple(row) for row in out["clean"].tolist()}) > 1
    assert polluted.generation_config.repetition_penalty == 2.0  # and left as they were
    # decode() never builds transformers' processors
    assert len(used) == (2 if path == "generate" else 0)
    # the only processor: ours, with the flags' values (no repetition penalty, min-p, ...)
    for processors in used:
        assert [type(p) for p in processors] == [decode.TemperatureTopKTopP]
        assert (processors[0].temperature, processors[0].top_k, processors[0].top_p) == (
            0.7,
            20,
            0.8,
        )


# --- top-k then top-p on the survivors, as transformers does
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [0, 1, 5, 50, 1000])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
def test_one_processor_equals_hf_temperature_then_top_k_then_top_p_on_random_logits(top_k, top_p):
    scores = torch.randn(32, 1000, generator=torch.Generator().manual_seed(top_k)) * 3
    scores[0, :10] = float("-inf")  # as after min_new_tokens' EOS ban
    ours = decode.TemperatureTopKTopP(0.7, top_k, top_p)(None, scores)
    # same survivors, same logits: same probabilities
    assert torch.equal(ours, hf_warpers(scores, 0.7, top_k, top_p))


@pytest.mark.parametrize(
    "top_p, survivors", [(1.0, [0, 1, 2, 3, 4]), (0.99, [0, 1, 2, 3, 4]), (0.8, [0, 1]), (0.5, [0])]
)
def test_top_k_3_keeps_all_tokens_tied_with_the_third_like_hf(top_p, survivors):
    # logits 5, 4, then 2 three times: top-k=3 keeps all five (ties with the 3rd survive, as in HF).
    # Probabilities over them 0.658, 0.242, 0.033 x3: ascending cumulative 0.033 0.066 0.098 0.341
    # 1, so top-p 0.8 drops the three tied tokens (cumulative <= 0.2) and 0.5 also token 1. No top-p
    # cut falls inside the tied block (where HF's own result depends on torch.sort's unstable order
    # of equal logits).
    scores = torch.tensor([[5.0, 4.0, 2.0, 2.0, 2.0, 1.0, 0.0, -1.0]]).repeat(2, 1)
    scores[1] = scores[1].flip(0)  # the same logits in reverse vocabulary order
    ours = decode.TemperatureTopKTopP(1.0, 3, top_p)(None, scores)
    assert torch.equal(ours, hf_warpers(scores, 1.0, 3, top_p))
    assert torch.isfinite(ours[0]).nonzero().flatten().tolist() == survivors
    assert torch.equal(ours[0][survivors], scores[0][survivors])


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5])
def test_step_1_token_logprobs_of_the_policy_and_the_reference_give_loss_minus_2_and_kl_0(beta):
    # test_grpo.py's step-1 example, on a real model: token_logprobs with and without a gradient
    # agree exactly.
    model = tiny_llama()
    ids, attention = left_padded_batch(group_size=2, prompt_lengths=(5, 3))
    logps = token_logprobs(model, ids, attention, 5)
    with torch.no_grad():
        ref = token_logprobs(model, ids, attention, 5)
    stats = {}
    loss = grpo_loss(
        logps,
        None,
        ref if beta else None,
        torch.full((4,), 2.0),
        torch.ones(4, 5),
        beta=beta,
        stats=stats,
    )
    assert loss.item() == pytest.approx(-2.0, abs=1e-6) and stats["kl"] == 0.0


class ReplayGraph:
    """A CUDA graph's semantics on the CPU, for decode.GraphStep: capture runs nothing and returns
    the output buffer; every replay runs the captured step again on the buffers' current contents
    and writes the output in place. (On CUDA the test below runs torch.cuda.CUDAGraph itself.)"""

    replays = captures = 0

    def warm_up(self, fn):
        return fn()

    def capture(self, fn, like):
        ReplayGraph.captures += 1
        self.fn, self.out = fn, torch.empty_like(like)
        return self.out

    def replay(self):
        ReplayGraph.replays += 1
        self.out.copy_(self.fn())


@pytest.mark.parametrize(
    "device,amp",
    [("cpu", None), ("cpu", torch.bfloat16), pytest.param("cuda", torch.bfloat16, marks=CUDA)],
    ids=["fp32", "bf16-autocast", "cuda-bf16-autocast"],
)
def test_the_cuda_graph_decode_draws_the_eager_decodes_tokens(device, amp, monkeypatch):
    # --decode graphs (CUDA's default): the first step eager, then the captured step replayed from
    # its own input buffers, every row kept in the batch (finished ones write pad). From the same
    # random numbers, the tokens of the eager decode, whose finished rows leave the batch, and the
    # RNG left where it leaves it. On the CPU the graph is ReplayGraph above (the buffers, the
    # cache's write position and the fixed rows are what is checked); on CUDA, a real capture,
    # whose replays run no Python: the model's forward runs 3 times (prefill, warm-up, capture).
    if device == "cpu":
        monkeypatch.setattr(decode, "uses_graphs", lambda settings, device: settings.graphs)
        monkeypatch.setattr(decode, "CudaGraph", ReplayGraph)
    model = small_llama().to(device)
    model.lm_head.register_forward_hook(lambda m, i, out: [out[..., demo.EOS].add_(1.5)] and None)
    forwards = []
    model.model.embed_tokens.register_forward_pre_hook(lambda m, a: forwards.append(1))
    ids, mask = (x.to(device) for x in left_padded_prompts([5, 1, 8, 3], 97))
    outs = []
    for graphs in (False, True):
        settings = sampling.Sampling(temperature=0.9, max_new_tokens=16, graphs=graphs)
        torch.manual_seed(3)
        forwards.clear()
        ReplayGraph.replays = 0
        with sampling.autocast(device, amp):
            outs.append(decode.plain_decode(model, ids, mask, settings, 3, [demo.EOS], demo.PAD))
        outs.append(torch.rand(1, device=device))
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    lengths = grpo.completion_mask(outs[0], [demo.EOS]).sum(1)
    assert len(set(lengths.tolist())) >= 4 and (lengths < 16).sum() >= 6  # rows ended apart
    C = outs[2].shape[1]
    if device == "cpu":
        assert ReplayGraph.replays == C - 2  # steps 2..C-1 replayed (1: eager, the warm-up)
    else:
        assert len(forwards) == 3 and not decode.GraphStep.warned


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """--decode graphs on the CPU, through ReplayGraph (its counters from 0)."""
    monkeypatch.setattr(decode, "uses_graphs", lambda settings, device: settings.graphs)
    monkeypatch.setattr(decode, "CudaGraph", ReplayGraph)
    monkeypatch.setattr(ReplayGraph, "captures", 0)
    monkeypatch.setattr(ReplayGraph, "replays", 0)


class FailingCapture(ReplayGraph):
    """A capture the device refuses (as CUDA refuses an op that reads a value back mid-capture)."""

    def capture(self, fn, like):
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.parametrize("layers", [2, 8])
def test_the_graph_decode_captures_one_graph_per_call_whatever_the_depth(layers, graphs_on_cpu):
    # One graph per decode call, at 2 layers as at 8: the capture records the whole step, every
    # layer's kernels in it, and nothing is compiled per layer (the whole-model compile costs ~22 s
    # per layer on the CPU, docs/gpu.md). Measured on the H100 at 24 layers: 0.05 s a call.
    model = demo.tiny_llama(97, 0, num_hidden_layers=layers).eval()
    ids, mask = left_padded_prompts([3, 5], 97)
    settings = sampling.Sampling(max_new_tokens=6, graphs=True)
    for call in range(3):
        decode.plain_decode(model, ids, mask, settings, 2, [-1], demo.PAD)
        assert ReplayGraph.captures == call + 1


def test_a_capture_the_device_refuses_leaves_the_call_eager_with_one_warning(monkeypatch, capsys):
    monkeypatch.setattr(decode, "uses_graphs", lambda settings, device: settings.graphs)
    monkeypatch.setattr(decode, "CudaGraph", FailingCapture)
    monkeypatch.setattr(decode.GraphStep, "warned", False)
    model = small_llama()
    ids, mask = left_padded_prompts([5, 1, 8], 97)
    outs = []
    for graphs in (False, True, True):
        torch.manual_seed(4)
        settings = sampling.Sampling(temperature=1.0, max_new_tokens=10, graphs=graphs)
        outs.append(decode.plain_decode(model, ids, mask, settings, 2, [demo.EOS], demo.PAD))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("warning: the decode step could not be captured")
    assert "operation not permitted when stream is capturing" in err  # said once, for 2 calls


def test_the_graph_decode_of_a_lora_model_draws_the_eager_tokens(graphs_on_cpu):
    # --lora-rank: the decode runs the base model with LoRA's layers in it; under bf16 autocast the
    # graphs' twin holds every Linear of it (the base layers and the adapters) in bf16.
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    model = peft.get_peft_model(small_llama(), config).get_base_model().eval()
    with torch.no_grad():  # B = 0 at init: the adapters would change nothing
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    ids, mask = left_padded_prompts([5, 1, 8, 3], 97)
    outs = []
    for graphs in (False, True):
        torch.manual_seed(3)
        settings = sampling.Sampling(temperature=0.9, max_new_tokens=12, graphs=graphs)
        with sampling.autocast("cpu", torch.bfloat16):
            outs.append(decode.plain_decode(model, ids, mask, settings, 3, [demo.EOS], demo.PAD))
    assert torch.equal(outs[0], outs[1])
    base = small_llama()  # and the adapters did change the tokens
    torch.manual_seed(3)
    with sampling.autocast("cpu", torch.bfloat16):
        plain = decode.plain_decode(base, ids, mask, settings, 3, [demo.EOS], demo.PAD)
    assert not torch.equal(plain, outs[0])


def test_a_sliding_window_model_decodes_eagerly_under_graphs_and_says_so(
    graphs_on_cpu, monkeypatch, capsys
):
    # transformers' StaticSlidingWindowLayer picks its branch from a Python int that a replay would
    # not update (its write position would run past the window): such models stay eager
    from transformers import MistralConfig, MistralForCausalLM

    monkeypatch.setattr(decode.GraphStep, "warned", False)
    config = MistralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    assert not decode.static_layers(model) and decode.static_layers(small_llama())
    ids, mask = left_padded_prompts([5, 3], 97)
    outs = []
    for graphs in (False, True):
        torch.manual_seed(2)
        settings = sampling.Sampling(max_new_tokens=12, graphs=graphs)  # 5 + 12 > the window
        outs.append(decode.plain_decode(model, ids, mask, settings, 2, [-1], demo.PAD))
    assert torch.equal(outs[0], outs[1]) and ReplayGraph.captures == 0
    assert "sliding-window layers" in capsys.readouterr().err

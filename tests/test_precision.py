"""Tests in the precision a GPU run uses: bf16 and fp16 autocast over fp32 master weights, on CPU.

Run: python -m pytest -q tests/test_precision.py CPU autocast supports both dtypes, so every path
that runs on a GPU runs here too: the lean decode (eager and compiled), generate() and beam search,
evaluation, training steps (μ = 1 and 2, β > 0 and β = 0, LoRA, gradient checkpointing, a reward
model, torchrun with gloo), the reference model and the KV cache. Each is compared with fp32.

Tolerances. bf16 keeps 8 significant bits (a relative rounding of at most 2^-9 = 0.2% per stored
value), fp16 11 bits (2^-12 = 0.024%). Each bound below is stated where it is used, from the
measured difference and this resolution. Greedy completions of a model that is sure of its answer
(the demo's, warmed up to p = 0.9) do not depend on the precision at all: their rewards must be
equal.
"""

import copy

import pytest
import torch

import config
import data
import grpo
import rewards
import sampling
import trainer
from helpers import (
    decode_with_drawn_logprobs,
    read_metrics,
    run_tiny,
    tiny_argv,
    tiny_reward_model_dir,
    tiny_rollouts,
    torchrun,
)
from support import (
    checkpoint,
    decode,
    demo,
    models,
)

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
HAS_DYNAMO = torch._dynamo.is_dynamo_supported()


@pytest.fixture(scope="module")
def sure_model():
    """The demo's model warmed up until it answers right with probability 0.9, its tokenizer and
    task (100 problems): greedy decoding of it has wide margins between the first and second
    token."""
    model, tokenizer, problems = demo.setup(0, warmup_steps=600, target_accuracy=0.9)
    task = data.demo_task(problems)
    return model.eval(), tokenizer, task


def greedy_rollouts(model, tokenizer, task, amp, num_beams=1, group_size=1):
    settings = sampling.Sampling(temperature=0.0, max_new_tokens=6, num_beams=num_beams)
    prompts = [task.prompt(tokenizer, row["prompt"]) for row in task.eval]
    return sampling.sample_rollouts(model, tokenizer, prompts, settings, group_size, amp)


def correctness(task, rollouts):
    groups = rollouts.completion_mask.shape[0] // len(task.eval)
    answers = [row["answer"] for row in task.eval for _ in range(groups)]
    return rewards.correctness_reward(rollouts.texts, answers)


# --- generation -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("path", ["decode", "compiled", "generate", "beams"])
def test_greedy_completions_under_autocast_get_the_fp32_rewards(
    sure_model, dtype, path, monkeypatch
):
    # The crash this guards against: StaticCache takes one dtype for keys and values, and under
    # autocast with fp32 weights RoPE leaves the keys fp32 while the values come out bf16
    # (index_copy_ refused them at the first token).
    model, tokenizer, task = sure_model
    if path == "compiled":
        if not HAS_DYNAMO:
            pytest.skip("torch.compile is unavailable on this Python")
        model = copy.deepcopy(model)
        sampling.compile_model(model, "aot_eager")
    if path == "generate":  # transformers' generate(), where decode() does not run (FSDP)
        monkeypatch.setattr(decode, "uses_lean_decode", lambda model, settings: False)
    beams = 4 if path == "beams" else 1
    group = 2 if path == "beams" else 1
    expected = greedy_rollouts(model, tokenizer, task, None, beams, group)
    got = greedy_rollouts(model, tokenizer, task, LOW[dtype], beams, group)
    assert correctness(task, got) == correctness(task, expected)
    best = correctness(task, expected)[::group]  # each question's first completion (its best beam)
    assert sum(best) >= 0.9 * len(best)  # a model that is sure: mostly right


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_decode_log_probs_under_autocast_are_within_rounding_of_fp32(dtype):
    # Sampled at T = 1 (no top-k/top-p) under autocast, decode returns the log-prob each token was
    # drawn with; the fp32 model's log-probs of the same tokens differ by the rounding of the
    # compute dtype alone. Measured max |difference| on this model: 1.8e-3 (bf16) and 2.6e-4
    # (fp16), on log-probs of magnitude up to 5.1. Bound: 2e-2 for bf16 (2 units of 2^-9 relative
    # rounding on a log-prob of 5) and 3e-3 for fp16 (2 units of 2^-12).
    model = demo.tiny_llama(97, 0, num_key_value_heads=2, tie_word_embeddings=False).eval()
    torch.manual_seed(0)
    prompts = torch.randint(2, 97, (3, 7))
    mask = torch.ones_like(prompts)
    settings = sampling.Sampling(temperature=1.0, max_new_tokens=10)
    with sampling.autocast("cpu", LOW[dtype]):
        completions, drawn = decode_with_drawn_logprobs(
            model, prompts, mask, settings, 4, [demo.EOS], demo.PAD
        )
    ids = torch.cat([prompts.repeat_interleave(4, 0), completions], dim=1)
    keep = grpo.completion_mask(completions, [demo.EOS])
    attention = torch.cat([mask.repeat_interleave(4, 0), keep], dim=1)
    exact = sampling.token_logprobs(model, ids, attention, completions.shape[1], 1.0, group_size=4)
    difference = ((drawn - exact) * keep).abs().max().item()
    assert 0 < difference < {"bf16": 2e-2, "fp16": 3e-3}[dtype]


def test_the_kv_cache_is_held_in_the_compute_dtype():
    model = demo.tiny_llama(97, 0).eval()
    cache = decode.KVCache(model.config, 16, torch.bfloat16)
    with torch.no_grad(), sampling.autocast("cpu", torch.bfloat16):
        ids = torch.randint(2, 97, (2, 5))
        model(input_ids=ids, use_cache=True, **{decode.cache_keyword(model): cache})
    assert (
        {layer.keys.dtype for layer in cache.layers}
        == {layer.values.dtype for layer in cache.layers}
        == {torch.bfloat16}
    )


# --- the compiled decode: bounded shapes, weights already in the compute dtype
# ---------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DYNAMO, reason="torch.compile is unavailable on this Python")
def test_compiled_decode_reads_a_twin_in_the_compute_dtype_and_equals_the_eager_decode(sure_model):
    # The twin holds each Linear weight as autocast would cast it; everything else is the model's
    # own tensor. So decoding with the twin computes exactly what decoding with the model under
    # autocast computes (bit for bit, eager), and the compiled decode draws the same tokens with
    # log-probs within bf16 rounding: its graph sums the same bf16 products in another order over a
    # longer, masked cache (measured max difference 0.04 on log-probs up to 4; bound 0.1, about 12
    # units of 2^-9 relative on a log-prob of 4).
    model = copy.deepcopy(sure_model[0])
    prompts, mask = torch.randint(2, 26, (3, 4)), torch.ones(3, 4, dtype=torch.long)
    settings = sampling.Sampling(temperature=1.0, max_new_tokens=6)

    def decode_with(net):
        torch.manual_seed(1)
        with sampling.autocast("cpu", torch.bfloat16):
            return decode_with_drawn_logprobs(net, prompts, mask, settings, 4, [demo.EOS], demo.PAD)

    eager = decode_with(model)
    twin, pairs = decode.decode_twin(model, torch.bfloat16)
    by_twin = decode_with(twin)
    assert torch.equal(by_twin[0], eager[0]) and torch.equal(by_twin[1], eager[1])
    assert len(pairs) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the (tied) lm-head
    assert {low.dtype for low, _ in pairs} == {torch.bfloat16}
    # shared, fp32, not copied
    assert twin.model.embed_tokens.weight is model.model.embed_tokens.weight

    sampling.compile_model(model, "aot_eager")
    compiled = decode_with(model)
    assert torch.equal(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=0.1)
    twin = decode.COMPILED[id(model)].steps[torch.bfloat16][0]
    with torch.no_grad():  # an optimizer step: the next decode call copies the new weights in
        model.lm_head.weight.add_(1.0)
    decode_with(model)
    assert torch.equal(twin.lm_head.weight, model.lm_head.weight.detach().bfloat16())


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DYNAMO, reason="torch.compile is unavailable on this Python")
def test_a_compiled_run_compiles_one_decode_graph_per_planned_shape_and_keeps_one_cache_each(
    tmp_path, monkeypatch
):
    # Training calls decode with 4 prompts x G = 4 = 16 rows, evaluation with 3 questions x 2
    # samples = 6 rows and a last batch of 1 x 2 (7 questions): padded up to 6, so two shapes in
    # all, whatever the prompts' lengths.
    frames = []
    real_compile = torch.compile

    def counting(fn, **kwargs):
        if isinstance(fn, torch.nn.Module):
            return real_compile(fn, **kwargs)
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        frames.append(counter)
        return real_compile(fn, **dict(kwargs, backend=counter))

    monkeypatch.setattr(torch, "compile", counting)
    run_tiny(
        tmp_path,
        *"--steps 3 --compile aot_eager --dtype bf16 --eval-every 2 --eval-limit 7".split(),
        *"--eval-batch-size 3 --eval-samples 2".split(),
    )
    (compiled,) = [c for c in decode.COMPILED.values() if c.rows == (6, 16)]
    assert sorted(compiled.caches) == [
        (6, compiled.length, torch.bfloat16),
        (16, compiled.length, torch.bfloat16),
    ]
    # one decode step, two shapes: two compilations
    assert [counter.frame_count for counter in frames] == [2]
    assert len(compiled.caches) <= torch._dynamo.config.recompile_limit
    assert {layer.keys.dtype for c in compiled.caches.values() for layer in c.layers} == {
        torch.bfloat16
    }
    assert len(read_metrics(tmp_path)) == 3 + 3  # 3 steps, evaluations at 0, 2 and 3


# --- training steps under autocast, on the same rollouts as fp32
# ------------------------------------------------------


def one_update(dtype, mu, beta, checkpointing=False):
    """μ policy updates (plain SGD, lr 0.5) of the demo's tiny model (seed 0) on fixed rollouts
    under `dtype` autocast: ([each update's statistics]). The first update has ratio 1 (and KL 0
    in fp32); the second sees the weights the first one moved."""
    model, _ = demo.model_and_tokenizer(seed=0)
    if checkpointing:
        sampling.enable_gradient_checkpointing(model)
    amp = LOW.get(dtype)
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in [6, 5, 6, 4, 2, 1, 3, 6]])
    rollouts = tiny_rollouts(mask)
    advantages = grpo.group_advantages(torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 0]), 4)
    ref = models.reference_model(model, beta, amp, "cpu")
    ref_logps = None if ref is None else trainer.frozen_logps(ref, rollouts, 4, amp)
    updates, old = [], None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(mu):
        stats, logps = trainer.policy_update(
            model,
            optimizer,
            torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
            rollouts,
            advantages,
            old,
            ref_logps,
            objective=trainer.LossSettings(0.2, None, beta, "grpo", "token", 6, None),
            micro_batch_size=4,
            max_grad_norm=float("inf"),
            autocast_dtype=amp,
        )
        old = logps if old is None else old
        updates.append(stats)
    return updates


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize(
    "mu, beta, checkpointing",
    [(1, 0.04, False), (2, 0.04, False), (1, 0.0, False), (2, 0.04, True)],
    ids=["mu1-beta", "mu2-beta", "mu1-beta0", "mu2-checkpointing"],
)
def test_a_training_step_under_autocast_matches_fp32_within_rounding(
    dtype, mu, beta, checkpointing
):
    # Same model, rollouts and advantages; only the compute dtype differs. Measured against fp32
    # (2026-11-23):
    #   bf16: loss within 2.0e-4 (of 0.11 at the second update), KL 5.0e-5 (of 0.099), gradient
    #         norm 1.0e-3 relative, ratio 1.8e-3;
    #   fp16: loss 2.4e-5, KL 4.5e-5, gradient norm 2.6e-4 relative, ratio 1.7e-4.
    # Bounds, a few units of each dtype's relative rounding (2^-9 = 2e-3 for bf16, 2^-12 = 2.4e-4
    # for fp16) on values of order 1: loss and ratio within 5e-3 (bf16) and 1e-3 (fp16); gradient
    # norm within 5e-3 and 2e-3 relative; KL within 1e-3. At the first update π_θ = π_ref up to the
    # reference's bf16 weights: KL under 1e-5 (measured 6.2e-7), the ratio exactly 1.
    expected = one_update("fp32", mu, beta, checkpointing)
    got = one_update(dtype, mu, beta, checkpointing)
    bound = {"bf16": 5e-3, "fp16": 1e-3}[dtype]
    for update, exact in zip(got, expected):
        assert update["loss"] == pytest.approx(exact["loss"], abs=bound)
        assert update["ratio"] == pytest.approx(exact["ratio"], abs=bound)
        assert update["kl"] == pytest.approx(exact["kl"], abs=1e-3)
        assert update["grad_norm"] == pytest.approx(
            exact["grad_norm"], rel={"bf16": 5e-3, "fp16": 2e-3}[dtype]
        )
    assert got[0]["ratio"] == 1.0 and got[0]["kl"] < 1e-5
    if mu == 2:  # the second update moved: a real test of the ratio and the KL, not of zeros
        assert abs(expected[1]["loss"]) > 0.05 and expected[1]["kl"] > 0.05


def k3(ref_logps, logps):
    """Eq. 4's KL estimator, π_ref/π_θ - log(π_ref/π_θ) - 1, averaged over tokens."""
    x = ref_logps - logps
    return (x.exp() - x - 1).mean().item()


def test_the_bf16_reference_keeps_its_buffers_in_fp32_and_the_kl_floor_between_identical_models_is_low():
    # π_ref is π_θinit stored in bf16; π_θ is the same weights in fp32 under bf16 autocast. Their KL
    # per token (eq. 4's k3) is the floor the KL term starts from. The rotary embedding's inverse
    # frequencies are a buffer: cast to bf16 with the weights they would turn every position's angle
    # by up to 0.4%, and the error grows with the position. A model with sharp attention (weights
    # drawn at std 0.3) shows it; measured at positions 200-255: k3 floor 7.1e-3 with fp32 buffers,
    # 2.2e-2 with bf16 ones. Asserted: fp32 buffers give at most half the bf16-buffer floor, and
    # under 1e-2.
    model = demo.tiny_llama(97, 0, max_position_embeddings=512, initializer_range=0.3).eval()
    ref = models.reference_model(model, 0.04, torch.bfloat16, "cpu")
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in ref.buffers()} == {torch.float32}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    # what reference_model did before: buffers cast too
    all_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    torch.manual_seed(0)
    ids = torch.randint(2, 97, (4, 256))
    mask = torch.ones_like(ids)
    with sampling.autocast("cpu", torch.bfloat16):
        policy = sampling.token_logprobs(model, ids, mask, 56)
        floors = [k3(sampling.token_logprobs(r, ids, mask, 56), policy) for r in (ref, all_bf16)]
    assert floors[0] < 0.5 * floors[1] and floors[0] < 1e-2, floors


# --- the loop end to end under autocast
# -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize(
    "flags",
    [
        ["--num-iterations", "2"],
        ["--beta", "0"],
        ["--gradient-checkpointing"],
        ["--num-beams", "4"],
        ["--lora-rank", "4"],
    ],
    ids=["mu2", "beta0", "checkpointing", "beams", "lora"],
)
def test_the_loop_runs_under_autocast_with_finite_metrics_and_changes_the_weights(
    tmp_path, dtype, flags
):
    if "--lora-rank" in flags:
        pytest.importorskip("peft")
    run_tiny(
        tmp_path, "--steps", "2", "--dtype", dtype, "--eval-every", "2", "--eval-limit", "8", *flags
    )
    rows = read_metrics(tmp_path)
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2 and all(
        torch.isfinite(torch.tensor([r["loss"], r["kl"], r["grad_norm"]])).all() for r in steps
    )
    assert all(r["grad_norm"] > 0 for r in steps)
    assert "eval/correctness" in rows[-1]


@pytest.mark.slow
def test_a_reward_model_scores_in_the_compute_dtype(tmp_path):
    from rewards import from_flags
    from support.reward_model import RewardModel

    path = tiny_reward_model_dir(tmp_path)
    args = config.parse_args(
        ["--demo", "--device", "cpu", "--dtype", "bf16", "--reward-model", path]
    )
    named = from_flags(args, [], set())
    (reward_model,) = [r.fn for r in named if isinstance(r.fn, RewardModel)]
    assert {p.dtype for p in reward_model.model.parameters()} == {torch.bfloat16}
    exact = RewardModel(path, "cpu")  # fp32
    texts, prompts = ["12 + 3", "no answer at all"], ["what is 15?", "what is 15?"]
    # A one-number score of a 2-layer model: bf16 weights round it by a few units of 2^-9 relative.
    # Bound 5e-2.
    for got, want in zip(
        reward_model(texts, ["15", "15"], prompts), exact(texts, ["15", "15"], prompts)
    ):
        assert got == pytest.approx(want, rel=5e-2, abs=5e-2)
    trainer.main(tiny_argv(tmp_path / "run", "--dtype", "bf16", "--reward-model", path))
    (row,) = read_metrics(tmp_path / "run")
    assert row["rewards/tiny-rm_std"] > 0 and torch.isfinite(torch.tensor(row["loss"]))


@pytest.mark.slow
def test_one_torchrun_step_under_bf16_with_gloo(tmp_path):
    out = torchrun(
        tmp_path / "run", "--device", "cpu", "--dtype", "bf16", "--steps", "2", "--eval-every", "-1"
    )
    assert out.count("step 2/2") == 1 and "(bf16)" in out
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)


# --- memory and resume
# ----------------------------------------------------------------------------------------------


def test_gradients_are_freed_right_after_the_optimizer_step(tmp_path):
    # The next generation (the KV cache at its largest) must not hold them: 6.85 GB for
    # SmolLM2-1.7B.
    model, _ = demo.model_and_tokenizer(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = torch.ones(8, 6, dtype=torch.long)
    trainer.policy_update(
        model,
        optimizer,
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        tiny_rollouts(mask),
        grpo.group_advantages(torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 0]), 4),
        None,
        None,
        objective=trainer.LossSettings(0.2, None, 0.0, "grpo", "token", 6, None),
        micro_batch_size=4,
    )
    assert all(p.grad is None for p in model.parameters())
    assert optimizer.state  # the update happened: AdamW has its moments


@pytest.mark.slow
def test_training_state_loads_onto_the_cpu(tmp_path, monkeypatch):
    # Under torchrun every rank would otherwise load rank 0's AdamW moments onto GPU 0.
    run_tiny(tmp_path, "--steps", "1")
    seen = []
    real_load = torch.load
    monkeypatch.setattr(
        torch, "load", lambda *a, **k: seen.append(k.get("map_location")) or real_load(*a, **k)
    )
    checkpoint.load_state(str(tmp_path / "checkpoint"))
    assert seen == ["cpu"]


class FakeCuda:
    """torch.cuda's RNG functions on a machine with `count` GPUs, this process on device
    `current`."""

    def __init__(self, count, current=0):
        self.count, self.current, self.set = count, current, []

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(
            torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([self.current])
        )
        monkeypatch.setattr(
            torch.cuda, "set_rng_state", lambda state, device="cuda": self.set.append(int(state[0]))
        )


@pytest.mark.parametrize(
    "saved, gpus, current, restored",
    [
        (
            [7, 8],
            1,
            0,
            [7],
        ),  # an older checkpoint of a 2-GPU machine (every GPU's state), resumed on one GPU
        ([7, 8], 2, 1, [8]),  # ... on device 1 of two: that device's own
        ([7], 4, 3, [7]),  # saved with one GPU, resumed on device 3 of four
        (5, 1, 0, [5]),  # this checkpoint format: the process's own device's state
        (5, 0, 0, []),  # saved on a GPU, resumed on the CPU (--device may change on resume)
    ],
)
def test_the_cuda_rng_restores_on_another_gpu_count_or_on_the_cpu(
    monkeypatch, saved, gpus, current, restored
):
    fake = FakeCuda(gpus, current)
    fake.install(monkeypatch)
    state = checkpoint.rng_state()
    state["cuda"] = (
        [torch.tensor([s]) for s in saved] if isinstance(saved, list) else torch.tensor([saved])
    )
    checkpoint.set_rng_state(state)
    assert fake.set == restored


def test_the_rng_state_saves_this_process_device_alone(monkeypatch):
    FakeCuda(2, current=1).install(monkeypatch)
    assert int(checkpoint.rng_state()["cuda"][0]) == 1


# --- on a GPU, when there is one
# --------------------------------------------------------------------------------------


CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; runs on a GPU machine only"
)


@CUDA
def test_cuda_the_loop_runs_in_bf16_and_evaluates(tmp_path):
    run_tiny(tmp_path, "--device", "cuda", "--steps", "2", "--eval-every", "2", "--eval-limit", "8")
    rows = read_metrics(tmp_path)
    assert len([r for r in rows if "loss" in r]) == 2 and "eval/correctness" in rows[-1]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if "loss" in r)


@CUDA
def test_cuda_compiled_decode_with_cuda_graphs_equals_the_eager_decode(sure_model):
    model = copy.deepcopy(sure_model[0]).cuda()
    prompts, mask = (
        torch.randint(2, 26, (3, 4), device="cuda"),
        torch.ones(3, 4, dtype=torch.long, device="cuda"),
    )
    settings = sampling.Sampling(temperature=0.0, max_new_tokens=6)
    with sampling.autocast("cuda", torch.bfloat16):
        eager = decode.lean_decode(model, prompts, mask, settings, 2, [demo.EOS], demo.PAD)
        sampling.compile_model(model)
        for _ in range(3):  # compiles, records the graph, replays it
            compiled = decode.lean_decode(model, prompts, mask, settings, 2, [demo.EOS], demo.PAD)
    assert torch.equal(compiled, eager)


@CUDA
def test_cuda_a_compiled_run_trains(tmp_path):
    run_tiny(tmp_path, "--device", "cuda", "--steps", "2", "--compile")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in read_metrics(tmp_path))

"""The field's bugs as regression tests: each test keeps out a bug reported in another GRPO trainer
(TRL, verl, OpenRLHF, ms-swift, open-instruct), or pins a decision this project made where those
threads disagree. docs/field-bugs.md gives each test its thread and says how the test was checked
to fail without its guard.

Most of these bugs are normalization: a loss divided by the wrong count once micro-batches (gradient
accumulation), ranks (data parallelism) or masks enter. The invariant tested throughout: splitting
a batch over micro-batches and ranks changes no loss and no gradient, for every aggregation
(--loss-type grpo, dapo, dr_grpo) and every policy term (the clip, CISPO, SAPO, DPPO's trust-region
masks, GSPO's sequence ratio, the k2 KL estimator). Ranks are simulated in one process: each rank's
policy_update sees its own share of the rows, the all-reduced denominator and the world size, and
DDP's all-reduce is the mean of the ranks' gradients. The advantages of GDPO (--multi-reward gdpo)
and of k1 in the reward (--kl-in-reward) are checked over 2 real gloo ranks (slow), and the flags
end to end with micro-batches, μ = 2 and under torchrun.
"""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import get_scheduler

import config
import grpo
import sampling
import trainer
from helpers import (
    NO_GPU,
    assert_same_run,
    read_metrics,
    run_tiny,
    tiny_argv,
    tiny_llama,
    tiny_rollouts,
    torchrun,
    varied_reward,
)
from rewards import Reward
from support import distributed
from support.phases import NO_PHASES

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
SURROGATES = ("clip", "cispo", "sapo")
RATIO_LEVELS = ("token", "sequence")  # sequence: GSPO's ratio, one per completion
# The objectives of issue 56 (settings): the k2 estimator in eq. 3's KL term, at both ratio
# levels; DPPO's binary-TV and binary-KL masks (token ratios only: config.py refuses sequence ones),
# with π_old as the behaviour policy or ("+sampler") the sampler's log-probs of the full softmax.
OBJECTIVES = [(s, level) for s in SURROGATES + ("k2",) for level in RATIO_LEVELS] + [
    ("dppo-tv", "token"),
    ("dppo-kl", "token"),
    ("dppo-tv+sampler", "token"),
    ("dppo-kl+sampler", "token"),
]


def prefix_mask(lengths, width):
    """[N, width] int64: 1 on each row's first lengths[i] columns."""
    return torch.tensor([[int(t < n) for t in range(width)] for n in lengths])


def settings(
    loss_type, surrogate="clip", ratio_level="token", beta=0.04, max_tokens=5, dppo_scale=1 / 3
):
    """trainer.LossSettings: ε = 0.2, no ε_high, no dual clip, SAPO's default τ. surrogate: a
    --surrogate value, or "k2" (the clip with the k2 estimator); DPPO's with config.DPPO_DELTAS'
    thresholds times dppo_scale (the batches here hold a few dozen tokens: at the defaults some
    would drop none). "+sampler": the same setting (the rollouts carry the behaviour policy)."""
    surrogate = surrogate.removesuffix("+sampler")
    extra = dict(kl_estimator="k2") if surrogate == "k2" else {}
    if surrogate in config.DPPO_DELTAS:
        extra["dppo_deltas"] = (config.DPPO_DELTAS[surrogate] * dppo_scale,) * 2
    return trainer.LossSettings(
        0.2, None, beta, loss_type, ratio_level, max_tokens, None,
        "clip" if surrogate == "k2" else surrogate, **extra,
    )  # fmt: skip


def sampler_logps(old, seed=1):
    """(the sampler's log-probs of the drawn tokens, log of the mass top-k/top-p kept) [N, T] for
    the "+sampler" objectives: π_old moved by up to ±0.25 per token, and up to 0.1 cut, so that
    DPPO's b (their sum) is neither π_old nor π_θ."""
    gen = torch.Generator().manual_seed(seed)
    shape, dtype = old.shape, old.dtype
    kept = -0.1 * torch.rand(shape, generator=gen, dtype=dtype)
    drawn = old + 0.25 * (2 * torch.rand(shape, generator=gen, dtype=dtype) - 1) - kept
    return drawn.clamp(max=0), kept


def updates_without_stepping(monkeypatch):
    """Make policy_update record the gradient it would step on (all parameters, flattened into one
    vector) instead of stepping, so the weights stay put between calls. Returns the list the
    gradients are appended to."""
    grads = []

    def record(model, optimizer, scheduler, scaler, max_grad_norm, loss=0.0):
        grads.append(
            torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                    for p in model.parameters()
                ]
            )
        )
        return torch.tensor(0.0), None

    monkeypatch.setattr(trainer, "optimizer_step", record)
    return grads


def policy_update(model, rollouts, advantages, objective, micro_batch_size, old=None, ref=None):
    optimizer = trainer.build_optimizer(model, lr=0.0, weight_decay=0.0)
    return trainer.policy_update(
        model,
        optimizer,
        get_scheduler("constant", optimizer),
        rollouts,
        advantages,
        old,
        ref,
        objective=objective,
        micro_batch_size=micro_batch_size,
    )


# --------------------------------------------------------------------------------------------------
# Micro-batches and ranks: TRL #3021, PR #3231; ms-swift #10117; open-instruct PR #1137; OpenRLHF
# PR #1249; verl PR #5798.


@pytest.mark.parametrize("surrogate,ratio_level", OBJECTIVES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batch_losses_and_gradients_sum_to_the_full_batch_for_every_aggregation_and_surrogate(
    loss_type, surrogate, ratio_level
):
    # fp64 log-probs: two micro-batches of one group each, 6 and 5 tokens; ratios from 0.74 to
    # 1.35 (clipped and unclipped tokens), π_ref away from π_θ (the KL term in play)
    lengths, G = [1, 5, 3, 2], 2
    mask = prefix_mask(lengths, 5)
    gen = torch.Generator().manual_seed(0)
    logps = (-0.1 - 2 * torch.rand(4, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    old = logps.detach() + 0.3 * (2 * torch.rand(4, 5, generator=gen, dtype=torch.float64) - 1)
    ref = logps.detach() - 0.5 * torch.rand(4, 5, generator=gen, dtype=torch.float64)
    advantages = torch.tensor([0.7, -0.7, 1.2, -1.2], dtype=torch.float64)
    rollouts = SimpleNamespace(completion_mask=mask, sampler_logps=None)
    if surrogate.endswith("+sampler"):
        rollouts.sampler_logps, rollouts.log_kept = sampler_logps(old)
    objective = settings(loss_type, surrogate, ratio_level)
    whole = grpo.loss_denominator(mask, loss_type, objective.max_tokens)
    stats = {}

    def loss(rows):  # as policy_update calls it: the micro-batch's columns up to its longest
        keep = max(lengths[rows])
        loss, stats[rows.start, rows.stop] = trainer.micro_batch_loss(
            logps[rows, :keep], None, rollouts, rows, keep, advantages, old, ref, objective,
            None, whole,
        )  # fmt: skip
        return loss

    full = loss(slice(0, 4))
    if surrogate.startswith("dppo"):  # the trust region drops some of the 11 tokens, not all
        assert 0 < stats[0, 4]["dppo_dropped"] < 11
    (full_grad,) = torch.autograd.grad(full, logps)
    parts = loss(slice(0, G)) + loss(slice(G, 2 * G))
    (parts_grad,) = torch.autograd.grad(parts, logps)
    # fp64, the same terms summed in another order: equal to about 1e-16 relative; 1e-12 leaves
    # room, while a wrong denominator is off by a factor (2, or 6/11 and 5/11 for dapo)
    assert parts.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(parts_grad, full_grad, rtol=1e-12, atol=1e-15)


RANK_LENGTHS = [1, 5, 2, 2, 4, 3, 5, 5]  # rank 0: 10 tokens (6 + 4); rank 1: 17 (7 + 10)


@pytest.mark.parametrize("surrogate,ratio_level", OBJECTIVES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_two_ranks_by_two_micro_batches_give_the_one_rank_gradient_for_every_aggregation(
    monkeypatch, loss_type, surrogate, ratio_level
):
    """trainer.policy_update on helpers' tiny Llama: 8 completions (4 groups of 2) on one rank
    in one micro-batch, against the same 8 on 2 simulated ranks, each in 2 micro-batches of one
    group. Each rank's denominator is the all-reduced one and its loss is multiplied by the world
    size; DDP then averages the ranks' gradients."""
    model = tiny_llama()
    rollouts = tiny_rollouts(prefix_mask(RANK_LENGTHS, 5), group_size=2)
    with torch.no_grad():
        now = sampling.token_logprobs(
            model, rollouts.input_ids, rollouts.attention_mask, 5, group_size=2
        )
    # π_old and π_ref a fixed way off π_θ: ratios from 0.74 to 1.35, clipped and not
    shift = torch.tensor([0.3, -0.2, 0.1, -0.3, 0.25] * 8).view(8, 5)
    old, ref = now - shift, now + shift.flip(1)
    if surrogate.endswith("+sampler"):  # DPPO's b: the sampler's, carried by the rollouts' rows
        rollouts.sampler_logps, rollouts.log_kept = sampler_logps(old)
    advantages = torch.tensor([0.9, -0.9, 0.4, -0.4, 1.3, -1.3, 0.6, -0.6])
    # the untrained model gives every token p ≈ 0.01, so |p - b| ≤ 0.006: DPPO's δ at 1/75 and
    # 1/200 of its defaults (TV 0.002, KL 2.5e-4) drop some tokens here
    scale = {"dppo-tv": 1 / 75, "dppo-kl": 1 / 200}.get(surrogate.removesuffix("+sampler"), 1)
    objective = settings(loss_type, surrogate, ratio_level, dppo_scale=scale)
    grads = updates_without_stepping(monkeypatch)

    whole = policy_update(model, rollouts, advantages, objective, 8, old, ref)[0]
    if surrogate.startswith("dppo"):  # the trust region drops some of the 27 tokens, not all
        assert 0 < whole["dppo_dropped"] < 1
    whole_denominator = grpo.loss_denominator(
        rollouts.completion_mask, loss_type, objective.max_tokens
    )
    monkeypatch.setattr(distributed, "world", lambda: 2)
    # the denominator's all-reduce (one number) gives every rank's sum; the statistics' all-reduce
    # (many numbers) this rank's own, summed below
    monkeypatch.setattr(
        distributed,
        "all_sum",
        lambda values: [whole_denominator] if len(values) == 1 else [float(v) for v in values],
    )
    losses = []
    for rank in range(2):
        rows = slice(4 * rank, 4 * rank + 4)
        share = sampling.select_groups(rollouts, [2 * rank, 2 * rank + 1])
        stats = policy_update(
            model, share, advantages[rows], objective, 2, old[rows], ref[rows]
        )[0]  # fmt: skip
        losses.append(stats["loss"])
    ddp = (grads[1] + grads[2]) / 2  # DDP's all-reduce: the mean over ranks
    # fp32, forwards over other batch shapes and sums in another order: the largest difference
    # measured over the 36 cases (18 before issue 56's k2 and DPPO joined, the same) is 6e-8, 2e-7
    # of the gradient's largest entry (0.14 to 0.47).
    # atol: 1e-5 of the largest entry, 50 times that; a wrong scale is off by a factor (2, 4, or
    # a ratio of token counts such as 10/27)
    torch.testing.assert_close(ddp, grads[0], rtol=0, atol=1e-5 * grads[0].abs().max().item())
    # and the logged loss, the all-reduced sum of the ranks' losses, is the one-rank loss
    assert sum(losses) == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)


# --------------------------------------------------------------------------------------------------
# Issue 56's advantages across ranks and its flags end to end: GDPO's last normalization is the
# whole batch's (every rank's rewards gathered, as TRL gathers them); k1 in the reward is each
# completion's own, its logged KL every rank's. Then each flag with micro-batches, μ = 2 and
# torchrun.

# two reward functions' values for RANK_LENGTHS' 8 completions (4 groups of 2)
ISSUE_56_REWARDS = torch.tensor(
    [[1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0, 0.5, 4.0, 1.0, 1.5]]
).T
ISSUE_56_WEIGHTS = [1.0, 0.5]


def issue_56_advantages(rank=0, world=1):
    """This rank's share (rank r: groups 2r and 2r + 1; one process: all 4) of the advantages of
    trainer.advantages_of under --multi-reward gdpo (ISSUE_56_REWARDS, weights 1 and 0.5) and under
    --kl-in-reward (β = 0.5 on their weighted total; π_θ helpers' tiny Llama, π_ref another one),
    with the penalized rewards and what trainer.reward_with_kl logs."""
    rollouts = tiny_rollouts(prefix_mask(RANK_LENGTHS, 5), group_size=2)
    rows = slice(4 * rank, 4 * rank + 4)
    if world > 1:
        rollouts = sampling.select_groups(rollouts, [2 * rank, 2 * rank + 1])
    table = ISSUE_56_REWARDS[rows] if world > 1 else ISSUE_56_REWARDS
    task = SimpleNamespace(
        rewards=[Reward(name, None, w) for name, w in zip("ab", ISSUE_56_WEIGHTS)]
    )
    s = SimpleNamespace(
        group_size=2, scale_rewards="group", multi_reward="gdpo", reward_kl_beta=0.5,
        micro_batch_size=2, autocast_dtype=None, shared_prompt=True,
    )  # fmt: skip
    run = SimpleNamespace(settings=s, model=tiny_llama(), phases=NO_PHASES)
    per_fn = {"a": table[:, 0], "b": table[:, 1]}
    gdpo = trainer.advantages_of(run, task, rollouts, None, per_fn, {})
    ref = sampling.frozen_logps(tiny_llama(seed=1), rollouts, 2)
    total, logged = (table.double() * torch.tensor(ISSUE_56_WEIGHTS).double()).sum(1), {}
    penalized = trainer.reward_with_kl(run, rollouts, total, ref, logged)
    s.multi_reward = "sum"
    kl = trainer.advantages_of(run, task, rollouts, penalized, per_fn, {})
    return dict(gdpo=gdpo, kl=kl, total=total, penalized=penalized, logged=logged)


def issue_56_worker(rank, world, init_file, out_dir):
    """One gloo rank of the test below: its share's issue_56_advantages, saved."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.save(issue_56_advantages(rank, world), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes
def test_gdpo_and_kl_in_reward_advantages_over_two_gloo_ranks_are_the_one_process_ones(
    tmp_path, monkeypatch
):
    with monkeypatch.context() as m:  # as test_distributed's: the spawned ranks see no GPU
        for name, value in NO_GPU.items():
            m.setenv(name, value)
        torch.multiprocessing.spawn(
            issue_56_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2
        )
    alone = issue_56_advantages()
    # not vacuous: GDPO is not eq. 3's advantage of the weighted total, the KL moves the rewards
    assert (alone["gdpo"] - grpo.group_advantages(alone["total"], 2)).abs().max() > 0.1
    assert (alone["penalized"] - alone["total"]).abs().min() > 1e-3
    for rank in range(2):
        got, rows = torch.load(tmp_path / f"rank{rank}.pt"), slice(4 * rank, 4 * rank + 4)
        # GDPO: the same float32 rewards, gathered, through the same float64 statistics: equal
        assert torch.equal(got["gdpo"], alone["gdpo"][rows])
        # and not what one rank's rewards alone give (a per-rank batch normalization)
        own = grpo.gdpo_advantages(ISSUE_56_REWARDS[rows], ISSUE_56_WEIGHTS, 2)
        assert not torch.allclose(own, got["gdpo"], atol=1e-3)
        # k1 in the reward: π_θ's forward over one group per micro-batch on both sides (fp32: the
        # same shapes, so 1e-6 is rounding's room); the KL logged is both ranks' tokens'
        torch.testing.assert_close(got["penalized"], alone["penalized"][rows], rtol=0, atol=1e-6)
        torch.testing.assert_close(got["kl"], alone["kl"][rows], rtol=0, atol=1e-5)
        for key in ("kl", "kl_penalty"):
            assert got["logged"][key] == pytest.approx(alone["logged"][key], rel=1e-5)


def two_reward_run(out_dir, *extra):
    """helpers.run_tiny with two rewards, varied_reward's and a second on another scale (weights 1
    and 0.5), for --multi-reward gdpo."""
    args = config.parse_args(tiny_argv(out_dir, "--overlong-buffer", "1", *extra))
    task, model, tokenizer = trainer.setup(args)
    second = Reward("tens", lambda c, a: [10.0 * (len(x) % 3) for x in c], 0.5)
    task = dataclasses.replace(task, rewards=[task.rewards[0]._replace(fn=varied_reward), second])
    return trainer.train(args, task, model, tokenizer)


# DPPO's δ small enough to act in the second update (the first, against the sampler's own numbers,
# drops nothing in fp32), as the untrained demo's p ≈ 0.02 moves by ~1e-3 in one update
ISSUE_56_RUNS = {
    "dppo-tv, k1 in the reward": "--surrogate dppo-tv --dppo-delta-low 2e-4 --kl-in-reward",
    "dppo-kl, gdpo, k2": "--surrogate dppo-kl --dppo-delta-low 1e-6 --multi-reward gdpo "
    "--kl-estimator k2",
}


@pytest.mark.slow  # end-to-end runs
@pytest.mark.parametrize("flags", list(ISSUE_56_RUNS), ids=list(ISSUE_56_RUNS))
def test_issue_56_flags_at_mu_2_give_the_same_step_in_micro_batches_of_one_group(tmp_path, flags):
    """The demo's step (16 completions, μ = 2: the second update against π_old, DPPO's b the
    sampler's log-probs) in 4 micro-batches of one group each and in one of all 16: the same
    metrics (the two updates' mean loss, KL, gradient norm, shares) up to fp32 rounding. Not the
    weights: AdamW's first steps move a parameter by about lr whatever its gradient's size, so a
    gradient of rounding's size makes a difference of lr's. (In one step π_θ is still π_ref: k1 in
    the reward is 0 here; the gloo test above has it away from 0.)"""
    argv = [*ISSUE_56_RUNS[flags].split(), "--num-iterations", "2", "--reward-weights", "1,0.5"]
    for micro in ("4", "16"):
        two_reward_run(tmp_path / micro, *argv, "--micro-batch-size", micro)
    (parts,), (whole,) = (read_metrics(tmp_path / m) for m in ("4", "16"))
    keys = ["loss", "kl", "grad_norm", "dppo_dropped"] + ["kl_penalty"] * ("k1" in flags)
    assert 0.1 < whole["dppo_dropped"] < 0.5  # the second update's mask acts (measured 0.34-0.37)
    for key in keys:  # fp32 sums in another order: 1e-5 relative leaves room
        assert parts[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), (key, parts, whole)


@pytest.mark.slow  # torchrun, 2 gloo ranks
def test_issue_56_flags_run_under_torchrun_and_log_once(tmp_path):
    """trainer.py --demo on 2 ranks with every issue-56 flag that combines (two rewards for GDPO:
    helpers' varied_reward and the overlong penalty), μ = 2 and micro-batches of one group: the
    ranks agree on every collective (one log, its options' shares), and --kl-in-reward's run too."""
    common = ["--steps", "2", "--demo-warmup-steps", "0", "--eval-every", "-1"]
    common += ["--num-iterations", "2", "--micro-batch-size", "8", "--batch-size", "2"]
    common += ["--gradient-accumulation-steps", "1"]
    gdpo = ["--surrogate", "dppo-kl", "--multi-reward", "gdpo", "--kl-estimator", "k2"]
    gdpo += ["--reward-fn", "helpers:varied_reward", "--overlong-buffer", "2"]
    for name, flags in (("gdpo", gdpo), ("kl", ["--surrogate", "dppo-tv", "--kl-in-reward"])):
        torchrun(tmp_path / name, *common, *flags)
        rows = [r for r in read_metrics(tmp_path / name) if "loss" in r]
        assert [r["step"] for r in rows] == [1, 2]  # one log: rank 0's
        for row in rows:
            assert math.isfinite(row["loss"]) and 0 <= row["dppo_dropped"] < 1
            assert ("kl_penalty" in row) == (name == "kl")


# --------------------------------------------------------------------------------------------------
# What each aggregation means: TRL #3187, #5375; verl #2776, #3741, PR #5417.


@pytest.mark.parametrize(
    "loss_type,expected", [("grpo", 0.0), ("dapo", 1 / 3), ("dr_grpo", 1 / 6)], ids=LOSS_TYPES
)
def test_each_aggregation_has_its_documented_value_on_two_groups_of_lengths_1_3_and_1_1(
    loss_type, expected
):
    """At μ = 1 and β = 0 each token's term is its advantage, so the loss is a weighted sum of the
    advantages (+1, -1, +1, -1) whose weights are the aggregation: grpo 1/N Σ_i 1/|o_i| Σ_t (the
    paper: each completion weighs the same): -(1 - 1 + 1 - 1)/4 = 0; dapo Σ_{i,t} / Σ_i |o_i| over
    the whole batch (one token mean, not one per group): -(1 - 3 + 1 - 1)/6 = 1/3; dr_grpo
    Σ_{i,t} / (N · max_tokens): -(1 - 3 + 1 - 1)/(4 · 3) = 1/6. The readings reported as bugs give
    grpo 1/3 (a token mean), dapo 1/4 (a token mean per group, then the mean over groups) and
    dr_grpo 2/3 (a sum over completions, no 1/N)."""
    mask = prefix_mask([1, 3, 1, 1], 3)
    logps = torch.zeros(4, 3, dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    loss = grpo.grpo_loss(
        logps, None, None, advantages, mask, beta=0.0, loss_type=loss_type, max_tokens=3
    )
    # fp64: a few additions and one division of small integers
    assert loss.item() == pytest.approx(expected, abs=1e-15)


# --------------------------------------------------------------------------------------------------
# A group of one: OpenRLHF PR #1250 (dr_grpo with one sample per prompt: every advantage 0).


@pytest.mark.parametrize(
    "extra", [[], ["--loss-type", "dr_grpo", "--scale-rewards", "none"]], ids=["grpo", "dr_grpo"]
)
def test_a_group_of_one_is_refused_before_any_model_loads_with_the_reason(tmp_path, extra):
    with pytest.raises(
        config.UserError,
        match=r"--num-generations must be at least 2 \(got 1\).* no learning signal",
    ):
        config.parse_args(tiny_argv(tmp_path / "run", "--num-generations", "1", *extra))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_refuse_a_group_of_one_for_every_scale(scale):
    # each reward would be its own group's mean: every advantage exactly 0
    with pytest.raises(ValueError, match="group_size must be at least 2"):
        grpo.group_advantages(torch.tensor([1.0, 0.0, 3.0]), 1, scale=scale)


# --------------------------------------------------------------------------------------------------
# A completion with no token in the loss (cut off under --mask-truncated, or every token forced
# by a tool): OpenRLHF PR #1239, TRL #6369.


@pytest.mark.parametrize(
    "scale,expected",
    [
        ("none", [65.0, -34.0, -31.0]),
        # std of (100, 1, 4) = sqrt((65² + 34² + 31²) / 2) = sqrt(3171)
        ("group", [d / (math.sqrt(3171) + 1e-4) for d in (65.0, -34.0, -31.0)]),
    ],
    ids=["none", "group"],
)
def test_a_completion_with_no_tokens_in_the_loss_keeps_its_reward_in_its_groups_statistics(
    scale, expected
):
    """The decision: a completion out of the loss is still one of the G samples of π_old for its
    prompt, so its reward stays in its group's mean and std; the baseline of its siblings is the
    group's, not that of the completions that fit the budget. OpenRLHF PR #1239 took the other
    way (the sibling leaves the statistics: here the other two would get -1.5 and +1.5)."""
    mask = prefix_mask([0, 2, 3], 4)  # the first completion: no token in the loss
    run = SimpleNamespace(
        settings=SimpleNamespace(group_size=3, scale_rewards=scale, multi_reward="sum")
    )
    advantages = trainer.advantages_of(
        run, None, tiny_rollouts(mask, group_size=3), torch.tensor([100.0, 1.0, 4.0]), {}, {}
    )
    # fp32: a mean, a difference and one division (1e-6 relative)
    assert advantages.tolist() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("out_of_the_loss", ["cut off", "all forced"])
@pytest.mark.parametrize(
    "loss_type,expected",
    [
        ("grpo", -(0.5 + 1 - 1) / 4),  # 1/N Σ_i: the masked completion still one of the N
        ("dapo", -(0.5 * 2 + 1 * 3 - 1 * 1) / 6),  # its 4 tokens out of the denominator too
        ("dr_grpo", -(0.5 * 2 + 1 * 3 - 1 * 1) / (4 * 4)),  # N · max_tokens: a constant
    ],
    ids=LOSS_TYPES,
)
def test_a_completion_with_no_tokens_in_the_loss_adds_nothing_to_the_loss_or_the_token_count(
    monkeypatch, loss_type, expected, out_of_the_loss
):
    """trainer.policy_update at μ = 1 and β = 0, where each token's term is its advantage:
    completions of 2, 4, 3 and 1 tokens with advantages 0.5, -0.5, 1 and -1, the second out of
    the loss: cut off by the budget and masked as train() masks it under --mask-truncated, or
    every token of it forced by a tool, as the decode marks them. Its attention mask (its length
    as generated) is unchanged either way. Its advantage can be anything: the loss and the
    gradient stay."""
    grads = updates_without_stepping(monkeypatch)
    model = tiny_llama()
    rollouts = tiny_rollouts(prefix_mask([2, 4, 3, 1], 4), group_size=2)
    if out_of_the_loss == "cut off":
        rollouts.truncated = torch.tensor([False, True, False, False])
        rollouts.completion_mask[rollouts.truncated] = 0  # as train() does under --mask-truncated
    else:
        rollouts.forced = torch.zeros(4, 4, dtype=torch.bool)
        rollouts.forced[1], rollouts.completion_mask[1] = True, 0  # forced: attended, not trained
    objective = settings(loss_type, beta=0.0, max_tokens=4)
    losses = [
        policy_update(model, rollouts, torch.tensor([0.5, a, 1.0, -1.0]), objective, 2)[0]["loss"]
        for a in (-0.5, 50.0)
    ]
    # fp32: the sums are exact (halves and small integers); each micro-batch's division rounds
    # once (6e-8 relative), and the two add
    assert losses[0] == pytest.approx(expected, rel=1e-6)
    assert losses[1] == losses[0] and torch.equal(grads[1], grads[0])


# --------------------------------------------------------------------------------------------------
# Statistics over each completion's own tokens: OpenRLHF PR #1250 (masked_normalize broadcasting
# along the wrong axis).


def test_per_completion_statistics_reduce_over_each_row_on_a_square_batch():
    """N = T = 3, where a statistic reduced over the wrong axis broadcasts without an error."""
    mask = prefix_mask([1, 2, 3], 3)
    # GSPO: s_i = exp(mean of completion i's own log-ratios): exp(0.1), exp(-0.1), exp(0.3)
    log_ratio = torch.tensor(
        [[0.1, 0.7, -0.9], [0.2, -0.4, 0.8], [0.3, 0.0, 0.6]], dtype=torch.float64
    )
    logps = torch.full((3, 3), -1.0, dtype=torch.float64, requires_grad=True)
    old = logps.detach() - log_ratio
    advantages = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    stats = {}
    loss = grpo.grpo_loss(
        logps, old, None, advantages, mask, epsilon=10.0, beta=0.0, loss_type="dapo",
        ratio_level="sequence", stats=stats,
    )  # fmt: skip
    loss.backward()
    s = torch.tensor([0.1, -0.1, 0.3], dtype=torch.float64).exp()
    # ε = 10 clips nothing: the loss is -Σ_i |o_i| s_i Â_i / 6, so d/dlog π_{i,t} = -s_i Â_i / 6
    # on completion i's tokens (fp64: 1e-12)
    torch.testing.assert_close(
        logps.grad, -(s * advantages)[:, None] / 6 * mask, rtol=1e-12, atol=0
    )
    assert stats["ratio"] == pytest.approx((s * torch.tensor([1, 2, 3])).sum().item(), rel=1e-12)
    # DeepSeek-V3.2's off-policy mask: each completion's own mean gap (0.8, 0.2, 0.9) against
    # δ = 0.5, and its own advantage's sign
    gap = torch.tensor([[0.8, 5.0, 5.0], [0.3, 0.1, 5.0], [0.9, 0.9, 0.9]])
    keep = grpo.off_policy_mask(
        torch.tensor([-1.0, -1.0, 1.0]), torch.zeros(3, 3), gap, mask, threshold=0.5
    )
    assert keep.tolist() == [[0.0], [1.0], [1.0]]
    # group statistics: over each group's own G = 2 rewards
    rewards = torch.tensor([0.0, 1.0, 5.0, 9.0])
    assert grpo.group_advantages(rewards, 2, scale="none").tolist() == [-0.5, 0.5, -2.0, 2.0]


# --------------------------------------------------------------------------------------------------
# The KL term: TRL #4967 (k1 in the reward against k3 in the loss), PR #6503
# (use_bias_correction_kl).


def test_k3_value_and_gradient_at_ratios_half_one_two_match_the_closed_form():
    """k3 = ρ - log ρ - 1 with ρ = π_ref/π_θ (eq. 4). With x = log π_θ, log ρ = log π_ref - x, so
    dk3/dx = -ρ + 1: the gradient is 1 - ρ. At ρ = 0.5, 1, 2: k3 = ln 2 - 1/2, 0, 1 - ln 2 and
    dk3/dx = 1/2, 0, -1. Here β = 1 and Â = 0 (no policy term) over 3 tokens under dapo, so the
    loss is Σ k3 / 3 and d loss/dx = (1 - ρ)/3. A k1 term (log π_θ/π_ref) would give ln 2, 0,
    -ln 2 and a constant gradient 1/3; k3 times the ratio π_θ/π_old (TRL's bias correction, here
    --kl-bias-correction, off by default) adds k3/3 to each gradient even on-policy, where that
    ratio is 1 (test_grpo.py has that option's worked example)."""
    rho = torch.tensor([[0.5, 1.0, 2.0]], dtype=torch.float64)
    logps = torch.tensor([[-1.2, -0.7, -2.3]], dtype=torch.float64, requires_grad=True)
    stats = {}
    loss = grpo.grpo_loss(
        logps, None, logps.detach() + rho.log(), torch.zeros(1, dtype=torch.float64),
        torch.ones(1, 3), beta=1.0, loss_type="dapo", stats=stats,
    )  # fmt: skip
    loss.backward()
    k3 = [math.log(2) - 0.5, 0.0, 1 - math.log(2)]
    # fp64: one exp and one log per token (1e-16 relative); 1e-12 leaves room
    assert loss.item() == pytest.approx(sum(k3) / 3, rel=1e-12)
    assert stats["kl"] == pytest.approx(0.5, rel=1e-12)  # (ln 2 - 1/2) + 0 + (1 - ln 2)
    torch.testing.assert_close(
        logps.grad,
        torch.tensor([[1 / 6, 0.0, -1 / 3]], dtype=torch.float64),
        rtol=1e-12,
        atol=1e-15,
    )


# --------------------------------------------------------------------------------------------------
# Groups whose rewards are all equal: TRL PR #7068, PR #6365.


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_group_with_equal_rewards_gets_exactly_zero_advantage_and_no_nan_under_every_scale(scale):
    """(r - mean)/(std + ε) is not 0 for 8 rewards of 0.1 in fp32: their mean rounds to 0.1 minus
    7e-9, and 7e-9/(0 + 1e-4) is 7e-5; without ε, 8 rewards of 1.0 give 0/0 = NaN."""
    spread = torch.arange(8.0)
    for rewards in (torch.cat([torch.full((8,), 0.1), torch.ones(8), spread]), torch.ones(16)):
        advantages = grpo.group_advantages(rewards, 8, scale=scale)
        assert torch.isfinite(advantages).all()
        assert torch.equal(advantages[:16], torch.zeros(16))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_group_with_equal_rewards_adds_no_policy_gradient_but_keeps_its_kl_and_its_count(
    loss_type,
):
    """The decisions: eq. 3 as written. A group whose rewards are all equal has Â = 0, so its
    policy term passes no gradient; its KL term still pulls π_θ toward π_ref (β > 0), and its
    completions stay in the denominator (1/G Σ_i; dapo's token count). TRL PR #7068 masks such
    groups out of the KL term, and PR #6365 out of the denominator; --dynamic-sampling (DAPO) is
    the way here to keep them out of a step altogether."""
    advantages = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.1, 0.1]), 2).double()
    assert advantages[0] > 0 and advantages[2:].tolist() == [0.0, 0.0]
    mask = prefix_mask([2, 3, 1, 3], 3)
    logps = torch.tensor([[-1.0, -2.0, -0.5]] * 4, dtype=torch.float64, requires_grad=True)
    ref = logps.detach() - 0.3

    def loss(rows, beta):
        return grpo.grpo_loss(
            logps[rows], None, ref[rows], advantages[rows], mask[rows], beta=beta,
            loss_type=loss_type,
        )  # fmt: skip

    (no_kl,) = torch.autograd.grad(loss(slice(0, 4), 0.0), logps)
    assert torch.equal(no_kl[2:], torch.zeros(2, 3))
    (with_kl,) = torch.autograd.grad(loss(slice(0, 4), 0.04), logps)
    assert (with_kl[2:][mask[2:].bool()] != 0).all()
    # the equal group's completions count: 4 of 4 sequences (grpo), 9 of 9 tokens (dapo)
    share = {"grpo": 2 / 4, "dapo": 5 / 9}[loss_type]
    # fp64: the same sums, one division more (1e-16 relative)
    assert loss(slice(0, 4), 0.0).item() == pytest.approx(
        loss(slice(0, 2), 0.0).item() * share, rel=1e-12
    )


# --------------------------------------------------------------------------------------------------
# Resume after a step that made no update: TRL #7274 (one dropped group pins the saved resume
# position).


@pytest.mark.slow  # two end-to-end runs each (docs/tests.md: such tests run in the slow lane)
@pytest.mark.parametrize("skip", ["no spread", "non-finite loss"])
def test_resume_after_a_step_without_update_goes_on_from_the_next_batch_exactly(
    tmp_path, monkeypatch, skip
):
    """Step 1 makes no update (--dynamic-sampling finds no group with reward spread, or its loss is
    NaN); step 2 does. Run for 1 step, then resumed to 2, the run logs and saves what the
    uninterrupted run does: the data position is the step, not a count of updates or of groups
    trained on."""
    argv = ["--steps", "2", "--save-every", "1", "--lr-scheduler", "constant"]
    real_loss = grpo.grpo_loss

    def first_step_skipped():
        """This process's first step makes no update; the reward to pass to run_tiny."""
        calls = []
        if skip == "no spread":

            def equal_in_step_1(completions, answers):  # --max-resample 0: one call a step
                calls.append(1)
                if len(calls) == 1:
                    return [1.0] * len(completions)
                return varied_reward(completions, answers)

            return equal_in_step_1

        def nan_in_step_1(*args, **kwargs):  # tiny_argv: 2 micro-batches a step
            calls.append(1)
            return real_loss(*args, **kwargs) * (float("nan") if len(calls) <= 2 else 1.0)

        monkeypatch.setattr(grpo, "grpo_loss", nan_in_step_1)
        return varied_reward

    if skip == "no spread":
        argv += ["--dynamic-sampling", "--max-resample", "0"]
    run_tiny(tmp_path / "straight", *argv, reward=first_step_skipped())
    run_tiny(tmp_path / "resumed", *argv, "--steps", "1", reward=first_step_skipped())
    monkeypatch.setattr(grpo, "grpo_loss", real_loss)
    run_tiny(tmp_path / "resumed", *argv, "--resume", reward=varied_reward)
    first, second = read_metrics(tmp_path / "straight")
    assert first.get("skipped_no_spread", 0) + first.get("skipped_nonfinite", 0) == 1
    assert second.get("skipped_no_spread", 0) + second.get("skipped_nonfinite", 0) == 0
    assert_same_run(tmp_path / "straight", tmp_path / "resumed")

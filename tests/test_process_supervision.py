"""Process supervision (DeepSeekMath §4.1.3) end to end: a reward function's steps (character
offsets) to the completion's tokens, the group's normalization, the per-token advantages, and the
loops that use them (train.py and trainer.py alike, micro-batched or not).

The worked examples use a tokenizer whose tokens are known strings (PieceTokenizer), so each
offset's token is read off by hand; the expected advantages are computed with grpo's eps (1e-4)
in the formula, so TOL (1e-6) only absorbs float32 rounding.
"""

import dataclasses
import math

import pytest
import torch
from safetensors.torch import load_file

import config
import data
import grpo
import process_supervision
import rewards
import sampling
import train
import trainer
from helpers import TOL, read_metrics, without_time
from support import sandbox
from support.errors import UserError

EOS, PAD = 0, 1


class PieceTokenizer:
    """A tokenizer whose token k decodes to PIECES[k]: batch_decode joins the pieces, dropping EOS
    and PAD as special tokens are dropped."""

    def __init__(self, pieces):
        self.pieces = pieces

    def batch_decode(self, batch, skip_special_tokens=True):
        return ["".join(self.pieces[t] for t in ids if t not in (EOS, PAD)) for ids in batch]


# Completion 0: "ab|cde|fg|hijk|lm" then EOS: 13 characters, offsets 2, 5, 7, 11, 13 (13 at EOS).
# Completion 1: "abcd|efgh" then EOS and padding: 8 characters.
PIECES = {EOS: "", PAD: "", 2: "ab", 3: "cde", 4: "fg", 5: "hijk", 6: "lm", 7: "abcd", 8: "efgh"}
TOKENS = [[2, 3, 4, 5, 6, EOS], [7, 8, EOS, PAD, PAD, PAD]]
WITHIN = [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]


def rollouts_of(tokens, within, forced=None, group_size=2, prompt=(9, 9)):
    n = len(tokens)
    prompts = torch.tensor([list(prompt)] * n)
    within = torch.tensor(within)
    mask = within if forced is None else within * ~torch.tensor(forced)
    return sampling.Rollouts(
        torch.cat([prompts, torch.tensor(tokens)], 1),
        torch.cat([torch.ones_like(prompts), within], 1),
        mask,
        PieceTokenizer(PIECES).batch_decode([t[: sum(w)] for t, w in zip(tokens, within.tolist())]),
        group_size,
        1.0,
        forced=None if forced is None else torch.tensor(forced),
    )


def task_with(*named, prefix=""):
    """A task with these (name, fn) rewards, weight 1 each unless given as (name, fn, weight)."""
    fns = [rewards.Reward(n[0], n[1], n[2] if len(n) > 2 else 1.0) for n in named]
    return data.Task(train=[], eval=[], template=data.as_is, rewards=fns, response_prefix=prefix)


def advantages_for(task, rollouts):
    rows = [{"prompt": "q", "answer": "1"}] * (len(rollouts.texts) // rollouts.group_size)
    steps = {}
    _, per_fn = task.score(rows, rollouts.texts, rollouts.group_size, steps=steps)
    return process_supervision.advantages(task, per_fn, steps, rollouts, PieceTokenizer(PIECES))


def normalized(values, eps=1e-4):
    """(v - mean) / (Bessel std + eps) for each of the group's pooled step rewards."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return [(v - mean) / (std + eps) for v in values]


# ------------------------------------------------------------------- the worked examples
def test_two_completions_steps_5_12_and_7_give_the_advantages_computed_by_hand():
    # Completion 0: step (5, 1.0) ends at character 4, inside "cde" (token 1); step (12, 0.0) at
    # character 11, inside "lm" (token 4). Completion 1: step (7, 1.0) at character 6, inside "efgh"
    # (token 1). Pooled [1, 0, 1]: mean 2/3, Bessel std sqrt(1/3).
    def steps(completions, answers):
        return [[(5, 1.0), (12, 0.0)], [(7, 1.0)]]

    adv = advantages_for(task_with(("steps", steps)), rollouts_of(TOKENS, WITHIN))
    a, b, c = normalized([1.0, 0.0, 1.0])  # a = c = +0.577, b = -1.155
    assert adv[0].tolist() == pytest.approx([a + b, a + b, b, b, b, 0.0], abs=TOL)
    assert adv[1].tolist() == pytest.approx([c, c, 0.0, 0.0, 0.0, 0.0], abs=TOL)


def test_an_outcome_reward_beside_the_steps_is_one_more_step_at_the_last_sampled_token():
    # correctness [1, 0] (weight 2): steps at EOS (token 5 of completion 0, token 2 of
    # completion 1); the process function's weight 0.5 scales its steps. Pooled [0.5, 0, 2, 0.5, 0]
    # in the order (completion 0: steps, outcome), (completion 1: step, outcome).
    def steps(completions, answers):
        return [[(5, 1.0), (12, 0.0)], [(7, 1.0)]]

    def correctness(completions, answers):
        return [1.0, 0.0]

    task = task_with(("steps", steps, 0.5), ("correctness", correctness, 2.0))
    adv = advantages_for(task, rollouts_of(TOKENS, WITHIN))
    a, b, o0, c, o1 = normalized([0.5, 0.0, 2.0, 0.5, 0.0])
    assert adv[0].tolist() == pytest.approx([a + b + o0] * 2 + [b + o0] * 3 + [o0], abs=TOL)
    assert adv[1].tolist() == pytest.approx([c + o1] * 2 + [o1] + [0.0] * 3, abs=TOL)


def test_outcome_rewards_alone_give_exactly_the_group_advantages_on_every_token():
    def correctness(completions, answers):
        return [0.25 * i for i in range(len(completions))]

    tokens, within = TOKENS * 2, WITHIN * 2
    rollouts = rollouts_of(tokens, within, group_size=2)
    adv = process_supervision.advantages(
        task_with(("c", correctness)),
        {"c": torch.tensor(correctness(tokens, None))},
        {},
        rollouts,
        PieceTokenizer(PIECES),
    )
    expected = grpo.group_advantages(torch.tensor(correctness(tokens, None)), 2)
    assert torch.allclose(adv * torch.tensor(within), expected[:, None] * torch.tensor(within))


# ------------------------------------------------------------- characters to tokens
def test_a_step_maps_to_the_token_holding_its_last_character_and_past_the_text_to_eos():
    offsets = process_supervision.char_offsets(PieceTokenizer(PIECES), TOKENS[0])
    assert offsets == [2, 5, 7, 11, 13, 13]
    sampled = [True] * 6
    ends = {1: 0, 2: 0, 3: 1, 5: 1, 6: 2, 12: 4, 13: 5, 14: 5, 10**9: 5, 0: -1}
    assert {end: process_supervision.token_of(end, offsets, sampled) for end in ends} == ends


def test_a_step_ending_inside_the_response_prefix_reaches_no_token_but_counts_in_the_group():
    # The response prefix "<t>" (3 characters) is the prompt's: a step ending at 3 or before has no
    # token; it still shifts the group's mean and std.
    def steps(completions, answers):
        assert completions[0].startswith("<t>ab")
        return [[(2, 1.0), (3 + 5, 1.0)], [(3 + 7, 0.0)]]

    adv = advantages_for(task_with(("steps", steps), prefix="<t>"), rollouts_of(TOKENS, WITHIN))
    early, a, c = normalized([1.0, 1.0, 0.0])
    assert adv[0].tolist() == pytest.approx([a, a, 0, 0, 0, 0], abs=TOL)
    assert adv[1].tolist() == pytest.approx([c, c, 0, 0, 0, 0], abs=TOL)


def test_forced_tool_tokens_never_receive_a_step_the_last_sampled_token_before_them_does():
    # Completion 0's tokens 2 and 3 ("fg", "hijk") are a tool's result, forced in: a step ending in
    # them (characters 5-10) goes to token 1; a step past the text to EOS (sampled).
    forced = [[False, False, True, True, False, False], [False] * 6]
    offsets = process_supervision.char_offsets(PieceTokenizer(PIECES), TOKENS[0])
    sampled = [not f for f in forced[0]]
    got = [process_supervision.token_of(end, offsets, sampled) for end in (6, 8, 11, 12, 99)]
    assert got == [1, 1, 1, 4, 5]

    def steps(completions, answers):
        return [[(9, 1.0)], [(2, 0.0)]]

    adv = advantages_for(task_with(("steps", steps)), rollouts_of(TOKENS, WITHIN, forced))
    a, c = normalized([1.0, 0.0])
    assert adv[0].tolist() == pytest.approx([a, a, 0, 0, 0, 0], abs=TOL)
    assert adv[1].tolist() == pytest.approx([c, 0, 0, 0, 0, 0], abs=TOL)


def test_a_character_split_over_byte_tokens_keeps_the_offsets_nondecreasing():
    # A byte-level BPE tokenizer without merges: "é" is two tokens; the first decodes as a
    # replacement character. The offsets still end at the text's length and never decrease.
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    raw = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer, raw.decoder = byte_level, tokenizers.decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw)
    ids = tokenizer("aé=1", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5  # a, é's two bytes, =, 1
    offsets = process_supervision.char_offsets(tokenizer, ids)
    assert offsets[-1] == len("aé=1") and offsets == sorted(offsets)
    # the step "aé" (end 2) ends in é's second byte: token 2
    assert process_supervision.token_of(2, offsets, [True] * 5) == 2


# ------------------------------------------------------------------ degenerate inputs
def test_no_steps_equal_steps_and_more_steps_than_tokens_are_defined_and_finite():
    cases = {
        "no steps": ([[], []], [[0.0] * 6, [0.0] * 6]),
        "all equal": ([[(3, 1.0)], [(3, 1.0), (5, 1.0)]], [[0.0] * 6, [0.0] * 6]),
    }
    for name, (steps, expected) in cases.items():
        adv = advantages_for(task_with(("s", lambda c, a, s=steps: s)), rollouts_of(TOKENS, WITHIN))
        assert adv.tolist() == expected, name
    # 20 steps on a 6-token completion: several steps per token, and the sums stay finite
    many = [[(k, float(k % 2)) for k in range(1, 21)], [(1, 0.0)]]
    adv = advantages_for(task_with(("s", lambda c, a: many)), rollouts_of(TOKENS, WITHIN))
    assert adv.isfinite().all() and adv[0, 0] != 0


@pytest.mark.parametrize(
    "returned, said",
    [
        ([[(5, float("nan"))], []], "step 0 has reward nan"),
        ([[(5, 1e39)], []], "step 0 has reward 1e+39"),
        ([[(-1, 1.0)], []], "step 0 ends at -1"),
        ([[(True, 1.0)], []], "step 0 ends at -1"),
        ([[(2.5, 1.0)], []], "each step is a pair (end, reward)"),
        ([[(5, 1.0, 2)], []], "each step is a pair (end, reward)"),
        ([[(5, "high")], []], "each step is a pair (end, reward)"),
        ([[(5, 1.0)], 0.5], "a process reward returns a list of (end, reward) pairs"),
        ([0.5, [(5, 1.0)]], "is not a number"),
        # an outcome reward's numbers each in a list: read as steps, and said so
        ([[1.0], [0.0]], "an outcome reward returns one number per completion"),
    ],
)
def test_a_malformed_step_list_is_a_clear_error_naming_the_function(returned, said):
    task = task_with(("steps", lambda c, a: returned))
    with pytest.raises(UserError, match="reward function 'steps'") as info:
        task.score([{"prompt": "q", "answer": "1"}], ["x", "y"], 2, steps={})
    assert said in str(info.value)


def test_a_process_rewards_value_is_its_mean_step_reward_and_its_steps_are_given_back():
    steps = {}
    total, per_fn = rewards.score(
        [rewards.Reward("s", lambda c, a: [[(1, 1.0), (2, 0.0)], []], 2.0)],
        ["a", "b"],
        ["1", "1"],
        steps,
    )
    assert per_fn["s"].tolist() == [0.5, 0.0] and total.tolist() == [1.0, 0.0]
    assert steps == {"s": [[(1, 1.0), (2, 0.0)], []]} and isinstance(steps["s"], sandbox.Steps)


def test_the_trainers_options_that_read_one_reward_per_completion_refuse_a_process_reward():
    with pytest.raises(UserError, match="--scale-rewards batch: a process reward"):
        process_supervision.check_settings("batch", False)
    with pytest.raises(UserError, match="--dynamic-sampling keeps the groups"):
        process_supervision.check_settings("group", True)
    process_supervision.check_settings("group", False)


# ------------------------------------------------------------- the equations reward
def test_equation_steps_checks_each_written_equation_with_the_calculator():
    text = "23 + 45 = 68\n68 + 12 = 81\nSo the answer is 81."
    assert rewards.equation_steps([text]) == [[(12, 1.0), (25, 0.0)]]
    assert text[:12].endswith("68") and text[:25].endswith("81")
    cases = {
        "x = 5, then 5 = 5": [],  # no arithmetic before "="
        "2 * (3 + 4) = 14.0 and 7 - 9 = -2": [(18, 1.0), (33, 1.0)],
        "1 + 1 = 2 = 3 - 1": [(9, 1.0)],  # "2 = 3": no operation on the left
        "9 / 0 = 1": [(9, 0.0)],  # the calculator's error: wrong
        "3 + 4 =": [],  # no number after "="
        "": [],
    }
    for text, expected in cases.items():
        assert rewards.equation_steps([text]) == [expected], text


# ------------------------------------------------------------------- the loops
def equal_steps(completions, answers):
    """A process reward for the demo's completions: a step at every character, rewarded by the
    character's parity, so groups differ and steps end mid-completion."""
    return [[(k + 1, float(ord(ch) % 2)) for k, ch in enumerate(c)] for c in completions]


def test_process_advantages_micro_batched_give_the_whole_batchs_gradient(
    tmp_path, monkeypatch, no_warmup
):
    # One step of the demo (4 prompts x G = 4, β = 0.1) with the process reward above, as one
    # micro-batch and as four of one group each: the gradient AdamW receives is the same to 1e-6
    # relative (float32 sums taken in another order).
    real_step, grads = train.optimizer_step, {}

    def keep_gradient(run, args, sums, lr):
        grads[args.output_dir] = torch.cat([p.grad.flatten() for p in run.model.parameters()])
        return real_step(run, args, sums, lr)

    monkeypatch.setattr(train, "optimizer_step", keep_gradient)
    for name, size in (("whole", "16"), ("parts", "4")):
        train.main(demo_argv(tmp_path / name, "--beta", "0.1", "--micro-batch-size", size))
    whole, parts = grads[str(tmp_path / "whole")], grads[str(tmp_path / "parts")]
    assert whole.norm() > 0
    assert float((whole - parts).norm() / whole.norm()) < 1e-6
    assert read_metrics(tmp_path / "whole")[0]["rewards/steps"] > 0


def demo_argv(out_dir, *extra):
    """tiny_argv's run in the flags both trainers take: the demo, 4 prompts x G = 4 in 2
    micro-batches, 1 step, no evaluation (the warm-up is off: no_warmup)."""
    return [
        *["--device", "cpu", "--demo", "--output-dir", str(out_dir), "--steps", "1"],
        *"--batch-size 2 --gradient-accumulation-steps 2 --num-generations 4".split(),
        *"--num-iterations 1 --eval-every -1".split(),
        *extra,
    ]


@pytest.fixture
def no_warmup(monkeypatch):
    """The demo's model as built, not warmed up (--demo-warmup-steps 0, a flag train.py does not
    take), and its task scored by the process reward above."""
    monkeypatch.setitem(config.DEMO_DEFAULTS, "demo_warmup_steps", 0)
    monkeypatch.setattr(data, "demo_task", with_steps(data.demo_task))


def with_steps(make_task):
    def task(*args):
        t = make_task(*args)
        return dataclasses.replace(t, rewards=[rewards.Reward("steps", equal_steps, 1.0)])

    return task


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--num-iterations", "2", "--micro-batch-size", "4"]])
def test_the_reference_and_the_trainer_agree_under_process_supervision(tmp_path, no_warmup, extra):
    for name, module in (("reference", train), ("trainer", trainer)):
        module.main(demo_argv(tmp_path / name, "--steps", "2", "--beta", "0.1", *extra))
    ours, theirs = (without_time(read_metrics(tmp_path / d)) for d in ("reference", "trainer"))
    assert ours == theirs and {r["rewards/steps"] for r in ours} != {0.0}
    a, b = (
        load_file(tmp_path / d / "checkpoint" / "model.safetensors")
        for d in ("reference", "trainer")
    )
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_trainer_refuses_a_process_reward_with_batch_scaling_at_the_first_step(
    tmp_path, no_warmup, capsys
):
    with pytest.raises(SystemExit) as info:
        trainer.main(demo_argv(tmp_path / "run", "--scale-rewards", "batch"))
    assert info.value.code == 2
    assert (
        "--scale-rewards batch: a process reward's steps are normalized" in capsys.readouterr().err
    )


@pytest.mark.slow
def test_the_reference_and_the_trainer_agree_on_the_chain_task(tmp_path):
    # --task chain's own rewards (the last number and the equations, a process reward) and its
    # defaults (a constant learning rate among them), on the tiny model: the same numbers.
    from helpers import tiny_model_dir

    argv = [
        *["--device", "cpu", "--model", tiny_model_dir(tmp_path), "--task", "chain"],
        # 16: the tiny tokenizer's chain working takes 15 tokens with EOS (data.check_budget)
        *"--steps 2 --batch-size 2 --num-generations 4 --max-new-tokens 16 --eval-every -1".split(),
        *"--lr 1e-3 --seed 3".split(),
    ]
    for name, module in (("reference", train), ("trainer", trainer)):
        module.main([*argv, "--output-dir", str(tmp_path / name)])
    ours, theirs = (without_time(read_metrics(tmp_path / d)) for d in ("reference", "trainer"))
    assert ours == theirs and "rewards/equations" in ours[0]
    assert [row["lr"] for row in ours] == [1e-3, 1e-3]  # constant, as the task's defaults say


# ------------------------------------------------------------------ --task chain
def test_the_chain_tasks_rows_are_fixed_distinct_and_never_trained_on_when_held_out():
    train_rows, held_out = data.chain_rows()
    assert (len(train_rows), len(held_out)) == (4800, 200)
    assert (train_rows, held_out) == data.chain_rows()  # a pure function of the seed
    prompts = [r["prompt"] for r in train_rows + held_out]
    assert len(set(prompts)) == 5000
    assert held_out[0]["prompt"].startswith("What is ") and held_out[0]["prompt"].endswith("?")
    for row in train_rows + held_out:
        terms = [int(t) for t in row["prompt"][len("What is ") : -1].split(" + ")]
        assert len(terms) == 3 and all(10 <= t <= 30 for t in terms)
        assert row["answer"] == str(sum(terms))


def test_the_chain_task_scores_the_answer_and_each_equation_and_its_flags_say_so():
    task = data.chain_task()
    assert [r.name for r in task.rewards] == ["correctness", "equations"]
    steps = {}
    total, per_fn = task.score(
        [{"prompt": "What is 14 + 25 + 31?", "answer": "70"}],
        ["14 + 25 = 39\n39 + 31 = 71\nThe answer is 71.", data.CHAIN_EXAMPLE[1]],
        2,
        steps=steps,
    )
    assert per_fn["correctness"].tolist() == [0.0, 1.0]
    assert per_fn["equations"].tolist() == [0.5, 1.0]  # the share of its equations that hold
    assert steps["equations"] == [[(12, 1.0), (25, 0.0)], [(12, 1.0), (25, 1.0)]]
    assert total.tolist() == [0.5, 2.0]
    args = config.parse_args(["--task", "chain", "--output-dir", "unused"])
    assert (args.max_new_tokens, args.lr_scheduler, args.steps) == (64, "constant", 40)
    outcome = config.parse_args(
        ["--task", "chain", "--reward-fn", "last-number", "--output-dir", "x"]
    )
    assert rewards.from_flags(outcome, task_rewards(task))[0].fn is rewards.last_number_reward


def task_rewards(task):
    return [(r.name, r.fn) for r in task.rewards]


def test_figure5_reads_the_evaluations_and_wall_times_its_table_reports(tmp_path):
    from scripts import figure5

    line = (
        "eval on 100 questions x 8 samples: correctness {}, equations 0.3600, reward 0.5000, "
        "correctness_pass@8 {}, equations_pass@8 0.9000, correctness_maj@8 {}, equations_maj@8 0.4\n"
    )
    for name, seed, values in [
        ("base", 0, (0.15, 0.4, 0.2)),
        ("base", 1, (0.17, 0.4, 0.2)),
        ("process-s0", 0, (0.3, 0.6, 0.35)),
    ]:
        (tmp_path / f"eval-{name}-e{seed}.log").write_text("loading ...\n" + line.format(*values))
    (tmp_path / "process-s0.log").write_text("step 40/40 | ...\nwall 754.2 s\n")
    assert figure5.read_eval(tmp_path / "eval-process-s0-e0.log")["correctness_maj@8"] == 0.35
    rows = figure5.table(str(tmp_path)).splitlines()
    assert rows[2] == "| before training | | 0.1500 | 0.2000 | 0.4000 | 0.0141 | |"
    assert rows[3] == "| process supervision | 0 | 0.3000 | 0.3500 | 0.6000 |  | 12.6 min |"

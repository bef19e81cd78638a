"""Evaluation: mean accuracy, maj@k and pass@k on held-out questions, and the built-in addition
task end to end."""

import dataclasses
import json
import re
import types
from unittest import mock

import pytest
import torch

import config
import data
import evaluation
import rewards
import sampling
import trainer
from helpers import CPU, read_metrics, tiny_model_dir, write_gsm8k

# --- maj@k: the answer most of a question's k completions give, scored
# ------------------------------------------------


@pytest.mark.parametrize(
    "answers, index",
    [
        (["8", "7", "8", None], 0),  # 8 has two votes
        (["5", "6", None, None], 0),  # a tie (one vote each): the answer given first
        ([None, "6", "5", "5", "6"], 1),  # a tie at two: 6 came first
        ([None, None, "3"], 2),  # None does not vote
        ([None, None], 0),  # nobody answers: the first completion stands for the question
    ],
)
def test_majority_index_breaks_ties_by_the_first_answer_given(answers, index):
    assert evaluation.majority_index(answers) == index


def fixed_completions(texts):
    """sample_rollouts replaced: each call returns the next question group's completions as
    written here."""
    calls = iter(texts)

    def sample_rollouts(
        model, tokenizer, prompts, settings, group_size, amp=None, tools=None, rows=None
    ):
        out = [t for _ in prompts for t in next(calls)]
        return types.SimpleNamespace(
            texts=out,
            lengths=torch.full((len(out),), 3),
            tool_calls=None,
            tool_failure=None,
            environment_rewards=None,
        )

    return sample_rollouts


def test_evaluate_reports_mean_maj_and_pass_at_k_on_a_worked_example():
    # Two questions, k = 4 completions each, scored by GSM8K's correctness (the last number in
    # <answer>):
    #   "7": answers 8, 7, 8, none   -> mean 1/4, pass 1, maj: 8 (two votes) is wrong       -> 0
    #   "5": answers 5, 6, none, none -> mean 1/4, pass 1, maj: 5 and 6 tie, 5 came first -> 1
    # so accuracy 0.25, maj@4 0.5, pass@4 1.0: majority voting is right more often than one sample,
    # less than the best of four.
    task = data.Task(
        train=[],
        eval=[{"prompt": "3 + 4 =", "answer": "7"}, {"prompt": "2 + 3 =", "answer": "5"}],
        template=lambda tokenizer, text: text,
        rewards=rewards.weighted([("correctness", rewards.correctness_reward)], [1.0]),
        extract_answer=rewards.extract_answer,
    )
    completions = [
        ["<answer>8</answer>", "<answer>7</answer>", "<answer>8</answer>", "seven"],
        ["<answer>5</answer>", "<answer>6</answer>", "", "<answer>five</answer>"],
    ]
    settings = sampling.Sampling(0.7, 0, 1.0, 8)
    with mock.patch.object(sampling, "sample_rollouts", fixed_completions(completions)):
        result = evaluation.evaluate(torch.nn.Linear(1, 1), None, task, settings, 4, batch_size=1)
    assert result == {
        "correctness": 0.25,
        "reward": 0.25,
        "correctness_pass@4": 1.0,
        "reward_pass@4": 1.0,
        "correctness_maj@4": 0.5,
        "reward_maj@4": 0.5,
        # each question's 4 rewards 0, 1, 0, 0 have variance 0.75 / 3 = 0.25 (Bessel's k - 1):
        # sqrt((0.25 + 0.25) / 4) / 2 = sqrt(2) / 8; in float64, to its last bits
        "correctness_noise": pytest.approx(2**0.5 / 8, rel=1e-15),
        "reward_noise": pytest.approx(2**0.5 / 8, rel=1e-15),
    }
    # a task without an answer extractor (your own task without --extract-answer): no maj@k, the
    # rest unchanged
    task = dataclasses.replace(task, extract_answer=None)
    with mock.patch.object(sampling, "sample_rollouts", fixed_completions(completions)):
        result = evaluation.evaluate(torch.nn.Linear(1, 1), None, task, settings, 4, batch_size=1)
    assert set(result) == {
        f"{name}{at}" for name in ("correctness", "reward") for at in ("", "_pass@4", "_noise")
    }


def test_the_eval_noise_is_the_std_of_the_mean_over_evaluation_seeds():
    # 4,000 evaluations of the same 50 questions (each answered right with its own probability,
    # 0 to 1), 8 draws each: draw_noise of one evaluation estimates the std that the mean has over
    # all of them, sqrt(sum p (1 - p) / 8) / 50 = 0.0204. The std of 4,000 means is off by about
    # 1 / sqrt(2 * 4000) = 1.1% (its own sampling error), the mean of 4,000 estimates by less:
    # 3% and 2% are about 3 of those errors.
    Q, k, runs = 50, 8, 4000
    p = torch.linspace(0, 1, Q, dtype=torch.float64)
    truth = (p * (1 - p)).sum().div(k).sqrt().item() / Q
    draws = torch.rand(runs, Q, k, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tables = (draws < p[None, :, None]).float()
    means = tables.mean((1, 2))
    assert means.std().item() == pytest.approx(truth, rel=0.03)
    estimates = torch.tensor([evaluation.draw_noise(t) for t in tables])
    assert estimates.pow(2).mean().sqrt().item() == pytest.approx(truth, rel=0.02)
    # a question answered alike k times adds no noise
    assert evaluation.draw_noise(torch.ones(3, 4)) == 0.0


def test_an_extract_answer_that_raises_is_one_clear_error(tmp_path, monkeypatch):
    (tmp_path / "my_answers.py").write_text(
        "def final(completion):\n    return completion.split('=')[1]\n"
    )
    monkeypatch.chdir(tmp_path)
    from rewards import load_reward_fn

    name, fn = load_reward_fn("my_answers:final", "--extract-answer", rewards.ANSWER_EXTRACTORS)
    assert fn("1 + 1 = 2") == " 2"
    with pytest.raises(config.UserError, match=r"--extract-answer: final raised IndexError"):
        evaluation.answer_of(fn, "no equals sign")
    with pytest.raises(
        config.UserError, match="--extract-answer 'my_answers:nope'.*its functions: final"
    ):
        load_reward_fn("my_answers:nope", "--extract-answer", rewards.ANSWER_EXTRACTORS)
    assert load_reward_fn("last-number", "--extract-answer", rewards.ANSWER_EXTRACTORS)[1] is (
        rewards.last_number
    )


# --- --task addition, end to end on the tiny model
# ----------------------------------------------------------------------


@pytest.mark.slow
def test_task_addition_trains_and_reports_mean_maj_and_pass_at_k(tmp_path):
    # The demo's tiny model (its word tokenizer reads "What is 34 + 22?" mostly as <unk>: this
    # checks the plumbing, not learning; docs/results.md has the real run). 2 steps on training
    # questions; evaluations before and after on the first 4 held-out questions, k = 4.
    out = tmp_path / "run"
    seen = []
    real = sampling.sample_rollouts

    def spy(model, tokenizer, prompts, *args, **kwargs):
        seen.append(list(prompts))
        return real(model, tokenizer, prompts, *args, **kwargs)

    argv = [
        *CPU,
        *("--model", tiny_model_dir(tmp_path), "--task", "addition", "--output-dir", str(out)),
        *("--steps", "2", "--batch-size", "2", "--num-generations", "4", "--max-new-tokens", "4"),
        *"--eval-every 0 --eval-limit 4 --eval-samples 4 --eval-batch-size 4".split(),
    ]
    with mock.patch.object(sampling, "sample_rollouts", spy):
        evals = trainer.main(argv)
    assert [step for step, _ in evals] == [0, 2]
    for _, result in evals:
        assert set(result) == {
            f"{name}{at}"
            for name in ("correctness", "reward")
            for at in ("", "_pass@4", "_maj@4", "_noise")
        }
        assert 0 <= result["correctness"] <= result["correctness_pass@4"] <= 1
        assert 0 <= result["correctness_maj@4"] <= result["correctness_pass@4"]
    train_rows, held_out = data.addition_rows()
    held = {r["prompt"] + "\n" for r in held_out[:4]}
    trained = {r["prompt"] + "\n" for r in train_rows}
    # evaluation calls see the 4 held-out questions, training calls training questions only
    assert [set(p) <= held for p in seen] == [True, False, False, True]
    assert all(set(p) <= trained for p in seen[1:3])
    steps, logged = (
        read_metrics(out),
        [r for r in read_metrics(out) if "eval/correctness_maj@4" in r],
    )
    assert len(logged) == 2 and len(steps) >= 4


def test_curves_draw_maj_and_pass_at_k_beside_the_mean(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from support import report

    rows = [
        {"step": s, "reward": 0.1 * s, "rewards/correctness": 0.1 * s, "kl": 0.0} for s in (1, 2)
    ]
    rows += [
        {
            "step": s,
            "eval/correctness": m,
            "eval/correctness_maj@8": j,
            "eval/correctness_pass@8": p,
        }
        for s, m, j, p in ((0, 0.1, 0.2, 0.45), (2, 0.3, 0.4, 0.5))
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn, real = {}, Axes.plot

    def plot(self, *args, label=None, **kwargs):
        drawn[label] = list(args[1]) if len(args) > 1 else None
        return real(self, *args, label=label, **kwargs)

    with mock.patch.object(Axes, "plot", plot):
        assert report.curves(str(tmp_path)).endswith("curves.png")
    assert drawn["correctness (eval)"] == [0.1, 0.3]
    assert drawn["correctness_maj@8 (eval)"] == [0.2, 0.4]
    assert drawn["correctness_pass@8 (eval)"] == [0.45, 0.5]


# --- a long run says what it is doing
# ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_loading_evaluation_and_saving_say_what_they_are_doing(tmp_path, monkeypatch, capsys):
    # The first minutes of a 1.7B run (loading, the first evaluation over 1,319 questions, a 20 GB
    # save) used to print nothing until the first batch or the save was done. Here: 5 held-out
    # questions in batches of 2, and the announcing threshold lowered so the tiny model's save
    # counts as large.
    monkeypatch.setattr(trainer.checkpoint, "LARGE_SAVE_BYTES", 0)
    (tmp_path / "data").mkdir()
    train_file = write_gsm8k(tmp_path / "data" / "train.jsonl")
    write_gsm8k(tmp_path / "data" / "test.jsonl", n=5)
    argv = [*CPU, "--model", tiny_model_dir(tmp_path), "--data", train_file, "--steps", "1"]
    argv += ["--num-generations", "2", "--max-new-tokens", "4", "--eval-samples", "2"]
    argv += ["--eval-batch-size", "2", "--output-dir", str(tmp_path / "run")]
    trainer.main(argv)
    out = capsys.readouterr().out
    model = tiny_model_dir(tmp_path)
    assert f"loading {model} ...\n" in out
    assert re.search(rf"loaded {re.escape(str(model))}: 0\.00B parameters in \d+ s\n", out)
    assert "  eval: 5 questions x 2 samples ...\n" in out
    # one line per batch of 2 questions, the last with nothing left
    progress = re.findall(r"  eval: (\d)/5 questions, \d+s, about (\d+)s left\n", out)
    assert [done for done, _ in progress] == ["2", "4", "5"] * 2 and progress[2][1] == "0"
    assert re.search(
        r"saving a checkpoint at step 1 \(0\.0 GB\) \.\.\.\nsaved .* \(step 1\) in ", out
    )

"""trainer.py end to end on the demo's tiny model on the CPU: one step, μ = 2, β = 0, micro-batches,
gradient checkpointing, evaluation, the README's own-task example, the shortened demo and --compile
(the options, each one flag: test_options.py). Runs are fp32: where two paths must agree, the test
states its bound (1e-4 to 1e-7); TOL (1e-6) is test_grpo.py's, for the worked example of eval's
pass@k.
"""

import functools
import math
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, get_scheduler

import config
import data
import evaluation
import rewards
import sampling
import trainer
from data import build_prompt
from grpo import completion_mask
from helpers import (
    CPU,
    ROOT,
    TOL,
    read_metrics,
    run_tiny,
    tiny_argv,
    tiny_model_dir,
    tiny_rollouts,
    varied_reward,
    without_time,
    write_gsm8k,
)
from rewards import format_reward
from sampling import token_logprobs
from support import demo, models, report


def readme_block(title, language):
    """The code block that follows the README's line naming `title` (the worked example's files
    and command)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    match = re.search(rf"{re.escape(title)}[^\n]*\n+```{language}\n(.*?)```", text, re.S)
    assert match, f"README has no {language} block after {title!r}"
    return match.group(1)


# --- one step: the parameters, μ = 2, β = 0, micro-batches, gradient checkpointing, the optimizer
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_one_step_on_the_tiny_model_changes_the_parameters(tmp_path):
    run_tiny(tmp_path / "run")
    # the run's seed; no warm-up: the exact starting weights
    initial, _ = demo.model_and_tokenizer(seed=42)
    # the checkpoint loads as a model
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint")
    before, after = initial.state_dict(), trained.state_dict()
    assert all(torch.isfinite(t).all() for t in after.values())
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(changed) > len(before) // 2, changed
    row = read_metrics(tmp_path / "run")[0]
    assert row["step"] == 1 and math.isfinite(row["loss"]) and row["rewards/correctness_std"] > 0


@pytest.mark.slow
def test_mu_2_takes_old_logps_from_iteration_1_and_the_second_iteration_ratio_is_not_1(
    tmp_path, monkeypatch
):
    calls, frozen = [], []
    real_loss, real_logps = trainer.grpo.grpo_loss, trainer.frozen_logps

    def spy_loss(logps, old_logps, ref_logps, advantages, mask, **kw):
        calls.append(
            (logps.detach().clone(), None if old_logps is None else old_logps.clone(), mask.bool())
        )
        return real_loss(logps, old_logps, ref_logps, advantages, mask, **kw)

    def spy_logps(model, *a, **kw):
        frozen.append(model.training)
        return real_logps(model, *a, **kw)

    monkeypatch.setattr(trainer.grpo, "grpo_loss", spy_loss)
    monkeypatch.setattr(trainer, "frozen_logps", spy_logps)
    run_tiny(tmp_path / "run", "--num-iterations", "2")
    # one frozen forward per step: the reference; pi_old needs no pass of its own
    assert frozen == [False]
    assert len(calls) == 4  # 2 iterations x 2 micro-batches
    for first, second in zip(calls[:2], calls[2:]):
        logps1, old1, mask = first
        logps2, old2, _ = second
        assert old1 is None  # iteration 1: pi_old = sg(pi_theta), ratio exactly 1
        # iteration 2's pi_old: iteration 1's log-probs, bit for bit
        assert torch.equal(old2, logps1)
        ratio2 = torch.exp(logps2 - old2)[mask]
        assert (ratio2 - 1).abs().max() > 1e-3  # after the first update the ratio moved away from 1


def second_update_ratios(tmp_path, monkeypatch, *flags):
    """The mean ratio π_θ/π_old of each step's second update (μ = 2, lr 0: the weights never
    move), for a tiny model whose attention has dropout 0.5 as a checkpoint's config.json can set
    it (a float attribute, not a module)."""
    ratios, real_setup, real_update = [], trainer.setup, trainer.policy_update

    def setup_with_dropout(args, resume_dir=None):
        task, model, tokenizer = real_setup(args, resume_dir)
        model.config.attention_dropout = 0.5
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.5
        return task, model, tokenizer

    def spy_update(*a, **kw):
        stats, logps = real_update(*a, **kw)
        ratios.append(stats["ratio"])
        return stats, logps

    monkeypatch.setattr(trainer, "setup", setup_with_dropout)
    monkeypatch.setattr(trainer, "policy_update", spy_update)
    run_tiny(tmp_path, "--num-iterations", "2", "--lr", "0", "--steps", "2", *flags)
    return ratios[1::2]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dropout_is_off_in_the_policy_forwards_so_at_lr_0_the_ratio_is_exactly_1(
    tmp_path, monkeypatch, dtype
):
    # Without --dropout, π_old's log-probs (the first update's forward) and π_θ's (the second's)
    # come from the same network: at lr 0 the ratio is 1 bit for bit, in fp32 and under bf16
    # autocast (the same kernels on the same inputs). With --dropout, each forward draws its own
    # mask.
    assert second_update_ratios(tmp_path / "off", monkeypatch, "--dtype", dtype) == [1.0, 1.0]
    noisy = second_update_ratios(tmp_path / "on", monkeypatch, "--dtype", dtype, "--dropout")
    assert all(abs(r - 1) > 1e-3 for r in noisy), noisy


@pytest.mark.slow
def test_lora_dropout_is_off_by_default_and_on_when_asked(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    real_add_lora = models.add_lora

    def trained_lora(
        *a, **kw
    ):  # B starts at 0, which would hide the branch's dropout: as if already trained
        peft_model = real_add_lora(*a, **kw)
        torch.manual_seed(0)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.5)
        return peft_model

    monkeypatch.setattr(models, "add_lora", trained_lora)
    lora = ("--lora-rank", "4", "--lora-target-modules", "q_proj,v_proj")
    assert second_update_ratios(tmp_path / "off", monkeypatch, *lora) == [1.0, 1.0]
    # --lora-dropout asks for LoRA's dropout (the model's own stays off)
    noisy = second_update_ratios(tmp_path / "on", monkeypatch, *lora, "--lora-dropout", "0.3")
    assert all(abs(r - 1) > 1e-4 for r in noisy), noisy


def test_disable_dropout_zeroes_dropout_modules_and_float_attributes_but_not_loras():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.3))
    net.attention_dropout, net.lora_dropout, net.hidden_size = 0.2, torch.nn.Dropout(0.1), 2
    models.disable_dropout(net)
    assert (net[1].p, net.attention_dropout, net.lora_dropout.p, net.hidden_size) == (
        0.0,
        0.0,
        0.1,
        2,
    )


def test_policy_update_returns_the_logps_before_its_update_zero_past_each_micro_batch():
    model, _ = demo.model_and_tokenizer(seed=0)
    # micro-batch 1 needs 2 columns, 2 needs 4
    completion = torch.tensor([[1, 1, 0, 0]] * 4 + [[1, 1, 1, 1]] * 4)
    rollouts = tiny_rollouts(completion)
    ids = rollouts.input_ids
    expected, entropy = torch.zeros(8, 4), torch.zeros(8, 4)
    with torch.no_grad():
        expected[:4, :2], entropy[:4, :2] = token_logprobs(
            model, ids[:4, :5], torch.ones(4, 5), 2, 1.0, entropy=True
        )
        expected[4:], entropy[4:] = token_logprobs(
            model, ids[4:], torch.ones(4, 7), 4, 1.0, entropy=True
        )
    optimizer = trainer.build_optimizer(model, lr=2e-3, weight_decay=0.0)
    scheduler = get_scheduler("constant", optimizer)
    update = functools.partial(
        trainer.policy_update,
        model,
        optimizer,
        scheduler,
        rollouts,
        torch.tensor([1.0, -1.0] * 4),
        ref_logps=None,
        objective=trainer.LossSettings(0.2, None, 0.0, "grpo", "token", 4, None),
        micro_batch_size=4,
    )
    stats, old = update(old_logps=None)
    assert torch.allclose(old, expected, atol=1e-5)
    # the logged entropy: the token mean over the completion mask, of the policy before the update
    # (fp32: 1e-5)
    assert stats["entropy"] == pytest.approx(
        (entropy * completion).sum().item() / completion.sum().item(), abs=1e-5
    )
    assert (old[:4, 2:] == 0).all() and (old[:4, :2] < 0).all()
    # iteration 2: its ratio is against iteration 1's log-probs
    stats, after = update(old_logps=old)
    assert not torch.allclose(after, old, atol=1e-4) and stats["ratio"] != 1.0


def test_beta_0_loads_no_reference_model_and_skips_reference_logps(tmp_path, monkeypatch):
    made, logps_calls = [], []
    real_reference, real_logps = models.reference_model, trainer.frozen_logps
    monkeypatch.setattr(
        models, "reference_model", lambda *a, **k: made.append(real_reference(*a, **k)) or made[-1]
    )
    monkeypatch.setattr(
        trainer, "frozen_logps", lambda *a, **k: logps_calls.append(1) or real_logps(*a, **k)
    )
    run_tiny(tmp_path / "run", "--beta", "0")
    assert made == [None]  # no reference model object at all
    # beta = 0 and mu = 1: neither reference nor old log-probs are computed
    assert logps_calls == []
    assert "kl" in read_metrics(tmp_path / "run")[0]


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_micro_batch_size_does_not_change_the_gradient(tmp_path, monkeypatch, loss_type):
    grads, real_clip = [], torch.nn.utils.clip_grad_norm_

    def capture_then_clip(params, max_norm):
        params = list(params)
        grads.append([p.grad.clone() for p in params])
        return real_clip(params, max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", capture_then_clip)
    base = [
        "--loss-type",
        loss_type,
        *"--batch-size 4 --gradient-accumulation-steps 1 --beta 0.1".split(),
    ]
    run_tiny(tmp_path / "one", *base)  # one micro-batch of 16 completions
    run_tiny(tmp_path / "four", *base, "--micro-batch-size", "4")  # four micro-batches of one group
    one, four = read_metrics(tmp_path / "one")[0], read_metrics(tmp_path / "four")[0]
    assert one["reward"] == four["reward"]  # same samples
    assert math.isclose(one["loss"], four["loss"], rel_tol=1e-5, abs_tol=1e-7)
    # the normalizer at work. Summed in another order, fp32 differs by a few units in the last
    # place of each tensor's largest entries (measured: 2.2e-8 where max |g| = 0.127, about 1.5
    # ulp): atol is 1e-6 of each tensor's largest entry (about 8 ulp); a wrong normalizer is off by
    # a factor (4, or |o| over G lengths).
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * a.abs().max().item())


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_same_step(tmp_path):
    run_tiny(tmp_path / "plain", "--num-iterations", "2")
    run_tiny(tmp_path / "checkpointed", "--num-iterations", "2", "--gradient-checkpointing")
    plain, checkpointed = (
        read_metrics(tmp_path / "plain")[0],
        read_metrics(tmp_path / "checkpointed")[0],
    )
    for key in ("loss", "kl", "grad_norm"):
        assert math.isclose(plain[key], checkpointed[key], rel_tol=1e-4, abs_tol=1e-7), key


@pytest.mark.parametrize("checkpointing", [False, True])
def test_reference_logps_take_the_policys_path_under_gradient_checkpointing(
    tmp_path, monkeypatch, checkpointing
):
    calls, real = [], sampling.token_logprobs

    def spy(model, *a, group_size=1, **kw):
        calls.append((model.training, group_size))
        return real(model, *a, group_size=group_size, **kw)

    monkeypatch.setattr(sampling, "token_logprobs", spy)
    run_tiny(tmp_path / "run", *["--gradient-checkpointing"] * checkpointing)
    reference = [g for training, g in calls if not training]
    # Checkpointing: the policy's forward runs token_logprobs' plain path (no cache in training), so
    # the reference runs it too (group_size=1); without it both share each prompt's forward across
    # its group (G=4).
    assert reference == ([1, 1] if checkpointing else [4, 4])  # 2 micro-batches
    # step 1, fp32: pi_ref == pi_theta exactly
    assert read_metrics(tmp_path / "run")[0]["kl"] == 0.0


def test_adamw_is_fused_on_cpu():
    model, _ = demo.model_and_tokenizer(seed=0)
    optimizer = trainer.build_optimizer(model, lr=2e-3, weight_decay=0.0)
    assert optimizer.defaults["fused"] is True


def test_bf16_reference_is_cast_before_the_move_keeps_fp32_buffers_and_the_policy_stays_fp32(
    monkeypatch,
):
    model, _ = demo.model_and_tokenizer(seed=0)
    moves, real_to = [], torch.nn.Module.to
    monkeypatch.setattr(
        torch.nn.Module,
        "to",
        lambda self, *a, **k: (
            moves.append((a, {p.dtype for p in self.parameters()})) or real_to(self, *a, **k)
        ),
    )
    ref = models.reference_model(model, 0.04, sampling.AUTOCAST_DTYPE["bf16"], "cpu")
    # one move, parameters already bf16: no fp32 copy on the device
    assert moves == [(("cpu",), {torch.bfloat16})]
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    # the rotary inverse frequencies, as the policy's
    assert {b.dtype for b in ref.buffers()} == {torch.float32}
    assert {p.dtype for p in model.parameters()} == {torch.float32} and not ref.training


# --- eval, the response prefix, early stop, the curves, and the GSM8K path on a local model
# directory -----------------


def test_eval_only_reports_mean_rewards(tmp_path):
    result = trainer.main(
        [
            *CPU,
            *"--demo --demo-warmup-steps 0 --eval-only --eval-limit 10 --eval-samples 2".split(),
            *"--output-dir".split(),
            str(tmp_path),
        ]
    )
    # GSM8K reads each completion's answer, so maj@k too
    assert set(result) == {
        f"{name}{at}"
        for name in ("correctness", "reward")
        for at in ("", "_pass@2", "_maj@2", "_noise")
    }
    assert 0.0 <= result["correctness"] <= result["correctness_pass@2"] <= 1.0
    assert result["reward"] == result["correctness"]  # the demo's one reward function, weight 1


def test_eval_means_and_pass_at_k_worked_example():
    """3 questions x 4 samples, correct exactly at completions 0 and 5 (question 0's first and
    question 1's second): mean 2/12, pass@4 2/3; format weighted 0.5 scores 0.1 everywhere, so
    the total is correctness + 0.05. The eval noise (draw_noise) of each."""
    model, tokenizer = demo.model_and_tokenizer(seed=0)

    def hits(completions, answers):
        return [1.0 if i in (0, 5) else 0.0 for i in range(len(completions))]

    task = data.Task(
        train=[],
        eval=[{"prompt": f"{i} + 1 =", "answer": "0"} for i in range(3)],
        template=lambda tokenizer, question: question,
        rewards=rewards.weighted(
            [("correctness", hits), ("format", lambda c, a: [0.1] * len(c))], [1.0, 0.5]
        ),
    )
    result = evaluation.evaluate(
        model, tokenizer, task, sampling.Sampling(max_new_tokens=2), samples=4, batch_size=3
    )
    assert result == pytest.approx(
        {
            "correctness": 2 / 12,
            "format": 0.1,
            "reward": 2 / 12 + 0.05,
            "correctness_pass@4": 2 / 3,
            "format_pass@4": 0.1,
            "reward_pass@4": (1.05 + 1.05 + 0.05) / 3,
            # questions 0 and 1 score 1, 0, 0, 0 (variance 0.25 with k - 1), question 2 nothing:
            # sqrt(0.5 / 4) / 3; format is the same everywhere, and the total moves as correctness
            "correctness_noise": 0.125**0.5 / 3,
            "format_noise": 0.0,
            "reward_noise": 0.125**0.5 / 3,
        },
        abs=TOL,
    )


def test_greedy_eval_is_one_argmax_completion_per_question_whatever_the_seed(tmp_path, monkeypatch):
    args = config.parse_args([*CPU, "--demo", "--eval-temperature", "0", "--eval-samples", "8"])
    assert args.eval_samples == 1  # greedy: every sample of a question would be the same completion
    model, tokenizer = demo.model_and_tokenizer(seed=0)
    seen = []
    task = data.Task(
        train=[],
        eval=[{"prompt": "3 + 4 =", "answer": "7"}],
        template=lambda tokenizer, q: q,
        rewards=[rewards.Reward("seen", lambda c, a: seen.extend(c) or [0.0] * len(c), 1.0)],
    )
    settings = sampling.Sampling(temperature=0, max_new_tokens=3)
    for seed in (0, 1):
        evaluation.evaluate(model, tokenizer, task, settings, samples=1, seed=seed)
    ids = tokenizer("3 + 4 =", return_tensors="pt", add_special_tokens=False).input_ids
    for _ in range(3):  # the argmax continuation, token by token
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    expected = tokenizer.decode(
        ids[0, -3:][: int(completion_mask(ids[:, -3:], demo.EOS).sum())], skip_special_tokens=True
    )
    assert seen == [expected, expected]


def test_eval_seed_replaces_the_run_seed_for_evaluations_only(monkeypatch):
    seen = []
    for extra in ([], ["--eval-seed", "5"]):
        args = config.parse_args([*CPU, "--demo", "--seed", "3", *extra])
        seen.append(evaluation.EvalSettings.of(args).seed)
    assert seen == [3, 5]


def test_response_prefix_ends_every_prompt_and_starts_every_scored_response(tmp_path, monkeypatch):
    args = config.parse_args(tiny_argv(tmp_path, "--response-prefix", r"<think>\n"))
    # typed in a shell as "<think>\n": the escape is decoded
    assert args.response_prefix == "<think>\n"
    prompts, scored = [], []
    real_sample = sampling.sample_rollouts
    monkeypatch.setattr(
        sampling,
        "sample_rollouts",
        lambda model, tok, p, *a: prompts.extend(p) or real_sample(model, tok, p, *a),
    )
    run_tiny(
        tmp_path,
        "--response-prefix",
        r"<think>\n",
        reward=lambda completions, answers: (
            scored.extend(completions) or varied_reward(completions, answers)
        ),
    )
    assert len(prompts) == 4 and all(p.endswith(" =<think>\n") for p in prompts)
    assert len(scored) == 16 and all(c.startswith("<think>\n") for c in scored)


def test_response_prefix_counts_toward_the_format_reward():
    task = data.Task(
        train=[], eval=[], template=build_prompt, rewards=[], response_prefix="<think>\n"
    )
    assert format_reward(task.responses(["2 + 2 = 4\n</think>\n<answer>4</answer>"])) == [0.5]


@pytest.mark.parametrize(
    "typed, decoded",
    [(r"<think>\n", "<think>\n"), (r"a\tb", "a\tb"), (r"C:\\x", "C:\\x"), (r"\x", r"\x"), ("", "")],
)
def test_response_prefix_decodes_backslash_n_t_and_backslash_only(typed, decoded):
    assert config.unescape(typed) == decoded


@pytest.mark.slow
def test_stop_when_zero_std_ends_early_saves_and_evaluates(tmp_path, capsys):
    evals = run_tiny(
        tmp_path,
        *"--steps 5 --stop-when-zero-std 2 --eval-every 0 --eval-limit 2 --eval-samples 2".split(),
        reward=lambda completions, answers: [1.0] * len(completions),
    )
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "reward" in r] == [1, 2] and all(
        r["frac_zero_std"] == 1.0 for r in rows[1:3]
    )
    assert [step for step, _ in evals] == [0, 2]
    assert (
        torch.load(tmp_path / "checkpoint" / "training_state.pt", weights_only=False)["step"] == 2
    )
    assert "stopping after step 2: 2 steps in a row had no reward spread" in capsys.readouterr().out


@pytest.mark.slow
def test_curves_png_is_written_at_the_end_of_a_run_and_by_plot_flag(tmp_path):
    pytest.importorskip("matplotlib")  # optional: without it the run prints how to get the plot
    run_tiny(
        tmp_path, "--steps", "2", "--eval-every", "1", "--eval-limit", "2", "--eval-samples", "2"
    )
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png.unlink()
    assert trainer.main([*CPU, "--plot", str(tmp_path)]) == str(png) and png.stat().st_size > 10_000


def test_curves_without_matplotlib_say_how_to_get_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    run_tiny(tmp_path)
    assert report.curves(str(tmp_path)) is None
    hint = f"no plot: matplotlib is not installed (pip install matplotlib, then python trainer.py --plot {tmp_path})"
    assert capsys.readouterr().out.count(hint) == 2 and not (tmp_path / "curves.png").exists()


@pytest.mark.slow
def test_gsm8k_path_trains_and_evaluates_a_local_model_directory(tmp_path, capsys):
    model_dir = tiny_model_dir(tmp_path)
    (tmp_path / "data").mkdir()
    train_file = write_gsm8k(tmp_path / "data" / "train.jsonl")
    write_gsm8k(tmp_path / "data" / "test.jsonl", n=3)  # found beside --data: the eval split
    history = trainer.main(
        [
            *CPU,
            "--model",
            model_dir,
            "--data",
            train_file,
            *"--steps 1 --num-generations 2 --max-new-tokens 4 --eval-samples 2".split(),
            *"--sample-every 1 --output-dir".split(),
            str(tmp_path / "run"),
        ]
    )
    assert [step for step, _ in history] == [0, 1]
    assert set(history[-1][1]) == {
        f"{name}{at}"
        for name in ("correctness", "format", "reward")
        for at in ("", "_pass@2", "_maj@2", "_noise")
    }
    row = read_metrics(tmp_path / "run")[1]
    assert {"rewards/correctness", "rewards/format", "accuracy", "kl", "clip_frac", "lr"} <= set(
        row
    )
    out = capsys.readouterr().out
    # the sample and the before/after table
    assert "Question: Tom has" in out and "before" in out and "after" in out


# --- your own task end to end: the README's worked example as typed
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_readme_worked_example_trains_from_its_own_directory_as_typed(tmp_path):
    """The README's my.jsonl, my_rewards.py and command, run as a new user would:
    `python trainer.py` in the directory holding the two files, only the model swapped for the tiny
    one, the run shortened and pinned to the CPU."""
    (tmp_path / "my.jsonl").write_text(readme_block("`my.jsonl`", "json"))
    (tmp_path / "my_rewards.py").write_text(readme_block("`my_rewards.py`", "python"))
    assert len((tmp_path / "my.jsonl").read_text().splitlines()) == 5
    # "a 20-line reward file"
    assert len((tmp_path / "my_rewards.py").read_text().splitlines()) <= 21
    command = shlex.split(readme_block("Train on them", "bash").replace("\\\n", " "))
    assert command[:2] == ["python", "trainer.py"]
    argv = command[2:]
    argv[argv.index("--model") + 1] = tiny_model_dir(tmp_path)
    argv += [*"--steps 2 --num-generations 2 --max-new-tokens 6 --output-dir out".split(), *CPU]
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "trainer.py"), *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert result.returncode == 0, result.stderr
    assert "no --eval-data: this task is not GSM8K, so there is no evaluation" in result.stdout
    steps = read_metrics(tmp_path / "out")
    assert [row["step"] for row in steps] == [1, 2]
    weights = argv[argv.index("--reward-weights") + 1].split(",")
    weights = dict(zip(["exact", "mentions", "brevity"], map(float, weights)))
    # the total is the weighted sum, in the order the functions were given (float32 sums: 1e-6)
    for row in steps:
        assert row["reward"] == pytest.approx(
            sum(w * row[f"rewards/{n}"] for n, w in weights.items()), abs=1e-6
        )
        assert "accuracy" not in row  # no correctness reward in this task


# --- the demo
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_shortened_demo_raises_the_reward_far_beyond_seed_noise(tmp_path):
    # 80 GRPO steps instead of the demo's 150 (~20 s on 2 cores). Noise, measured on this CPU:
    #  - one model evaluated under 10 eval seeds: reward 0.112 +- 0.014 (std), so the before/after
    #    difference of an unchanged model would have a std of ~0.02;
    #  - the reward after the warm-up ("before") over seeds 0-7 and 42: 0.07 to 0.13.
    # Gains after 80 steps over those 9 seeds: +0.11 (seed 6, the slowest) to +0.40 (seed 42, this
    # test), mean +0.30. A threshold of +0.10 is 5 noise standard deviations above zero and below
    # every measured gain.
    history = trainer.main(
        [
            *CPU,
            *"--demo --steps 80 --eval-every 0 --sample-every 0 --output-dir".split(),
            str(tmp_path),
        ]
    )
    before, after = history[0][1]["correctness"], history[-1][1]["correctness"]
    assert 0.05 <= before <= 0.2
    assert after - before >= 0.10, (before, after)


@pytest.mark.slow
def test_shortened_lora_demo_learns_and_its_final_save_loads_without_peft(tmp_path):
    # python trainer.py --demo --lora-rank 8 --lr 1e-2, shortened to 80 steps (~10 s). Measured on
    # this CPU with LoRA's dropout off (the default since 2026-11-23): +0.35 for seed 42 (this
    # test); the full 150 steps gave +0.415, +0.59, +0.52 for seeds 0, 1, 2 and +0.43 for 42. The
    # threshold +0.10 is 5 noise standard deviations (~0.02, as above) above zero.
    pytest.importorskip("peft")
    history = trainer.main(
        [
            *CPU,
            *"--demo --lora-rank 8 --lr 1e-2 --steps 80 --eval-every 0 --sample-every 0".split(),
            *"--output-dir".split(),
            str(tmp_path),
        ]
    )
    before, after = history[0][1]["correctness"], history[-1][1]["correctness"]
    assert after - before >= 0.10, (before, after)
    # the merged model, no peft involved
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")
    assert not any("lora" in name for name, _ in model.named_parameters())


# --- --compile
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    not torch._dynamo.is_dynamo_supported(), reason="torch.compile is unavailable on this Python"
)
def test_compile_trains_as_the_eager_run_does(tmp_path):
    # --compile with the aot_eager backend traces the decode step and the log-prob forwards into
    # graphs (what inductor would compile) and runs them op by op: it checks the graphs, not the
    # speed. The compiled decode keeps every row to the end (fixed shapes) but draws the same
    # uniforms per row, so both runs sample the same completions and their rewards and lengths are
    # equal; losses, KL and gradient norms agree to 1e-5 (fp32, the same ops in traced order).
    run_tiny(tmp_path / "eager", "--steps", "2", "--num-iterations", "2")
    run_tiny(
        tmp_path / "compiled", "--steps", "2", "--num-iterations", "2", "--compile", "aot_eager"
    )
    eager, compiled = (without_time(read_metrics(tmp_path / d)) for d in ("eager", "compiled"))
    assert len(eager) == len(compiled) == 2
    same = [k for k in eager[0] if "reward" in k or "len" in k]
    for e, c in zip(eager, compiled):
        assert [e[k] for k in same] == [c[k] for k in same]
        for k in ("loss", "kl", "grad_norm", "entropy"):
            assert c[k] == pytest.approx(e[k], abs=1e-5), k
    # rows left the eager batch early
    assert any(e["completion_len_mean"] < e["completion_len_max"] for e in eager)

"""The options of the loop, each one flag and off by default: completions cut off by the budget
masked (--mask-truncated), DAPO's overlong reward, dynamic sampling, beam groups, and LoRA adapters
(peft, optional: those tests skip only where peft is not installed); and the flags refused for how
the run was launched (torchrun or alone) or for a --plot directory without metrics.
"""

import functools
import math
import re
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, get_scheduler

import config
import grpo
import sampling
import trainer
from data import batch_at
from helpers import (
    CPU,
    assert_same_run,
    read_metrics,
    run_tiny,
    tiny_argv,
    without_time,
)
from support import checkpoint, decode, demo, models


def half_truncated(real_generate):
    """generate() whose even rows end with EOS as their 3rd token and whose odd rows run to the
    budget without EOS."""

    def generate(model, prompt_ids, prompt_mask, settings, *a, **kw):
        # [B*G, C] completions
        rows = real_generate(model, prompt_ids, prompt_mask, settings, *a, **kw).shape[0]
        completions = torch.full((rows, settings.max_new_tokens), 10)
        completions[::2, 2], completions[::2, 3:] = demo.EOS, demo.PAD
        return completions

    return generate


def odd_answers_spread(completions, answers):
    """Groups of odd sums get rewards 0, 1, 2, 3 (always spread); groups of even sums all get 1.0
    (never)."""
    return [float(i % 4) if int(a) % 2 else 1.0 for i, a in enumerate(answers)]


# --- algorithm options: overlong handling, dynamic sampling, beams
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("flag", [False, True], ids=["default", "mask-truncated"])
def test_mask_truncated_gives_completions_without_eos_no_loss_and_logs_the_fraction(
    tmp_path, monkeypatch, flag
):
    masks, real_loss = [], grpo.grpo_loss
    monkeypatch.setattr(decode, "generate", half_truncated(decode.generate))
    monkeypatch.setattr(
        grpo, "grpo_loss", lambda *a, **kw: masks.append(a[4].clone()) or real_loss(*a, **kw)
    )
    run_tiny(tmp_path / "run", *(["--mask-truncated"] if flag else []))
    (row,) = read_metrics(tmp_path / "run")
    # lengths as generated
    assert row["frac_truncated"] == 0.5 and row["completion_len_mean"] == (3 + 6) / 2
    # per completion, over the two micro-batches (trimmed to their need)
    tokens = torch.cat([m.sum(1) for m in masks])
    assert tokens[::2].tolist() == [3] * 8 and tokens[1::2].tolist() == [0 if flag else 6] * 8


@pytest.mark.slow
def test_mask_truncated_with_every_completion_cut_off_changes_no_weight(tmp_path, monkeypatch):
    real_generate = decode.generate
    monkeypatch.setattr(
        decode, "generate", lambda *a, **kw: (real_generate(*a, **kw), torch.full((16, 6), 10))[1]
    )
    run_tiny(tmp_path / "run", "--mask-truncated", "--seed", "42")
    (row,) = read_metrics(tmp_path / "run")
    assert row["loss"] == 0.0 and row["grad_norm"] == 0.0 and row["frac_truncated"] == 1.0
    initial, _ = demo.model_and_tokenizer(seed=42)  # the run's starting weights (no warm-up)
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint").state_dict()
    assert all(torch.equal(after[k], v) for k, v in initial.state_dict().items())


@pytest.mark.slow
def test_overlong_buffer_is_one_more_reward_weighted_last_and_fed_the_token_counts(tmp_path):
    # With the buffer as long as the budget (6), the penalty is -length/6 for every completion, so
    # its mean is -(mean length)/6; float32 means: 1e-6.
    trainer.main(
        tiny_argv(
            tmp_path / "run",
            *"--reward-fn format --overlong-buffer 6 --reward-weights 1.0,0.5".split(),
        )
    )
    (row,) = read_metrics(tmp_path / "run")
    assert row["rewards/overlong"] == pytest.approx(-row["completion_len_mean"] / 6, abs=1e-6)
    assert row["reward"] == pytest.approx(
        row["rewards/format"] + 0.5 * row["rewards/overlong"], abs=1e-6
    )
    with pytest.raises(config.UserError, match=re.escape("(format, overlong): 2 numbers, got 1")):
        trainer.setup(
            config.parse_args(
                tiny_argv(
                    tmp_path / "x",
                    *"--reward-fn format --overlong-buffer 6 --reward-weights 1.0".split(),
                )
            )
        )


@pytest.mark.slow
def test_dynamic_sampling_keeps_groups_with_spread_and_samples_more_prompts_until_the_batch_is_full(
    tmp_path,
):
    run_tiny(tmp_path / "run", "--dynamic-sampling", "--seed", "3", reward=odd_answers_spread)
    (row,) = read_metrics(tmp_path / "run")
    problems = demo.setup(3, 0, 0.1)[2]
    # what the step must have done: batches of 4 prompts, stream k for the k-th extra call
    odd, calls = (
        0,
        0,
    )
    while odd < 4 and calls <= 3:
        odd += sum(int(r["answer"]) % 2 for r in batch_at(problems, 4, 3, 0, stream=calls))
        calls += 1
    assert calls > 1  # this seed's first batch is short of groups with spread
    assert (row["dynamic_calls"], row["dynamic_groups"]) == (calls, 4)
    assert row["dynamic_dropped"] == 4 * calls - odd and row["frac_zero_std"] == 0.0
    assert row["reward"] == 1.5 and row["skipped_no_spread"] == 0  # kept: 0, 1, 2, 3 in each group


@pytest.mark.slow
def test_dynamic_sampling_with_no_spread_anywhere_skips_the_update_and_says_so(tmp_path, capsys):
    run_tiny(
        tmp_path / "run",
        *"--dynamic-sampling --max-resample 2 --seed 42".split(),
        reward=lambda c, a: [1.0] * len(c),
    )
    (row,) = read_metrics(tmp_path / "run")
    assert (row["skipped_no_spread"], row["dynamic_calls"], row["dynamic_groups"]) == (1, 3, 0)
    assert row["dynamic_dropped"] == 12  # 3 calls x 4 groups
    assert "SKIPPED the update: no group had reward spread" in capsys.readouterr().out
    initial, _ = demo.model_and_tokenizer(seed=42)
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint").state_dict()
    # beta > 0, but no update at all
    assert all(torch.equal(after[k], v) for k, v in initial.state_dict().items())


@pytest.mark.slow
def test_dynamic_sampling_resumes_exactly(tmp_path):
    argv = "--dynamic-sampling --steps 3 --seed 3 --save-every 1 --lr-scheduler constant".split()
    run_tiny(tmp_path / "straight", *argv, reward=odd_answers_spread)
    # the later --steps wins
    run_tiny(tmp_path / "resumed", *argv, "--steps", "1", reward=odd_answers_spread)
    run_tiny(tmp_path / "resumed", *argv, "--resume", reward=odd_answers_spread)
    assert without_time(read_metrics(tmp_path / "resumed")) == without_time(
        read_metrics(tmp_path / "straight")
    )


@pytest.mark.slow
def test_num_beams_makes_each_group_the_g_best_beams_of_one_beam_search(tmp_path):
    from transformers import GenerationConfig

    model, tokenizer = demo.model_and_tokenizer(seed=0)
    prompts = ["3 + 4 =", "1 + 1 =", "5 + 2 ="]
    rollouts = sampling.sample_rollouts(
        model, tokenizer, prompts, sampling.Sampling(0.9, 50, 0.9, 5, None, 4), 2
    )
    ids, mask = sampling.tokenize_prompts(tokenizer, prompts, "cpu")
    # plain beam search: the sampling flags play no part
    expected = model.generate(
        input_ids=ids,
        attention_mask=mask,
        generation_config=GenerationConfig(
            num_beams=4,
            num_return_sequences=2,
            do_sample=False,
            max_new_tokens=5,
            eos_token_id=[demo.EOS],
            pad_token_id=demo.PAD,
        ),
    )
    assert torch.equal(rollouts.input_ids, expected)
    pairs = rollouts.input_ids[:, ids.shape[1] :].view(3, 2, -1)
    assert all(not torch.equal(pair[0], pair[1]) for pair in pairs)  # a group's beams differ
    run_tiny(tmp_path / "run", "--num-beams", "4")
    (row,) = read_metrics(tmp_path / "run")
    assert math.isfinite(row["loss"]) and row["entropy"] > 0
    with pytest.raises(
        config.UserError, match="--num-beams \\(2\\) must be at least --num-generations \\(4\\)"
    ):
        config.parse_args(tiny_argv(tmp_path / "x", "--num-beams", "2"))


# --- LoRA (peft, optional: these tests skip only where peft is not installed)
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("targets", ["q_proj,v_proj", "q_proj,v_proj,lm_head"])
def test_lora_trains_the_adapters_only_against_the_base_with_adapters_off_and_saves_a_merged_model(
    tmp_path, monkeypatch, targets
):
    pytest.importorskip("peft")
    copies, refs, real_logps = [], [], trainer.frozen_logps
    monkeypatch.setattr(models, "reference_model", lambda *a, **k: copies.append(1))
    monkeypatch.setattr(
        trainer,
        "frozen_logps",
        lambda model, *a, **k: refs.append(model) or real_logps(model, *a, **k),
    )
    calls, real_head = [], sampling._LinearLogprobs

    class Counting:
        apply = staticmethod(lambda *a: calls.append(1) or real_head.apply(*a))

    monkeypatch.setattr(sampling, "_LinearLogprobs", Counting)
    run_tiny(
        tmp_path / "run",
        *"--lora-rank 4 --steps 2 --seed 42 --lora-target-modules".split(),
        targets,
    )
    # no second copy
    assert copies == [] and len(refs) == 2 and type(refs[0]).__name__ == "PeftModelForCausalLM"
    # the chunked lm-head path runs unless the head is adapted
    assert bool(calls) == (targets == "q_proj,v_proj")
    initial, _ = demo.model_and_tokenizer(seed=42)
    # no peft needed to load it
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint")
    changed = {
        k for k, v in initial.state_dict().items() if not torch.equal(merged.state_dict()[k], v)
    }
    suffixes = tuple(f"{t}.weight" for t in targets.split(","))
    # only the targets (a tied head: untied on save)
    assert changed and all(k.endswith(suffixes) for k in changed)
    import peft

    base, _ = demo.model_and_tokenizer(seed=42)
    adapted = peft.PeftModel.from_pretrained(
        base, str(tmp_path / "run" / "checkpoint" / "adapter")
    ).eval()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    # W + scale·B·A in fp32, merged vs applied as adapters: equal up to summation order (~1e-7).
    torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_lora_periodic_checkpoints_hold_the_adapter_and_resume_exactly(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    argv = "--lora-rank 4 --steps 3 --save-every 1 --lr-scheduler constant --seed 42".split()
    saves, real_save = [], checkpoint.save
    monkeypatch.setattr(
        checkpoint, "save", lambda *a, **k: saves.append(k["merge"]) or real_save(*a, **k)
    )
    run_tiny(tmp_path / "straight", *argv)
    # adapters every step; the merged model only when the run ends
    assert saves == [
        False,
        False,
        True,
    ]
    run_tiny(tmp_path / "resumed", *argv, "--steps", "1")
    run_tiny(tmp_path / "resumed", *argv, "--resume")
    assert_same_run(tmp_path / "straight", tmp_path / "resumed")


def test_lora_without_peft_or_with_a_missing_module_is_one_clear_error(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    with pytest.raises(config.UserError, match="LoRA: .*--lora-target-modules no_such_proj"):
        run_tiny(tmp_path / "a", "--lora-rank", "4", "--lora-target-modules", "no_such_proj")
    monkeypatch.setitem(sys.modules, "peft", None)  # as if it were not installed
    with pytest.raises(
        config.UserError, match="--lora-rank needs peft, which is not installed: pip install peft"
    ):
        run_tiny(tmp_path / "b", "--lora-rank", "4")


def test_max_grad_norm_0_means_no_clipping():
    # As HF Trainer and TRL read it: the update is AdamW's own, and the norm is still reported.
    def step(max_grad_norm):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        model.weight.grad, model.bias.grad = torch.full((1, 3), 100.0), torch.full((1,), 100.0)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = get_scheduler("constant", optimizer)
        before = model.weight.detach().clone()
        norm, skipped = trainer.optimizer_step(model, optimizer, scheduler, None, max_grad_norm)
        return (model.weight.detach() - before), norm, skipped

    unclipped, norm, skipped = step(0.0)
    assert skipped is None and float(norm) == pytest.approx(200.0)  # sqrt(4 * 100^2)
    assert torch.equal(unclipped, torch.full((1, 3), -100.0))  # SGD at lr 1: the raw gradient
    clipped, _, _ = step(1.0)
    torch.testing.assert_close(clipped, torch.full((1, 3), -0.5))  # scaled by 1 / 200


# --- flags checked against the launch (torchrun sets WORLD_SIZE) and --plot's directory
# ------------


def refusal(argv):
    """The message config.parse_args(argv) refuses argv with."""
    with pytest.raises(config.UserError) as e:
        config.parse_args(argv)
    return str(e.value)


def test_launched_world_size_is_torchruns_world_size_else_1(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert config.launched_world_size() == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert config.launched_world_size() == 4


def test_dynamic_sampling_runs_alone_and_is_refused_under_torchrun(tmp_path, monkeypatch):
    argv = tiny_argv(tmp_path, "--dynamic-sampling")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert config.parse_args(argv).dynamic_sampling
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert refusal(argv) == (
        "--dynamic-sampling does not run under torchrun yet: ranks would refill their batches with "
        "different numbers of generate calls and micro-batches. Run it in one process."
    )


def test_fsdp_needs_torchrun_and_refuses_lora_but_resumes(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    alone = "--fsdp shards the model over processes: start it with torchrun --nproc-per-node N."
    assert refusal(tiny_argv(tmp_path, "--fsdp")) == alone
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc-per-node 1
    assert refusal(tiny_argv(tmp_path, "--fsdp")) == alone
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert config.parse_args(tiny_argv(tmp_path, "--fsdp")).fsdp
    assert config.parse_args(tiny_argv(tmp_path, "--resume", "--lora-rank", "4")).lora_rank == 4
    # --resume reads FSDP2's sharded AdamW state (test_distributed.py's test_fsdp_*)
    assert config.parse_args(tiny_argv(tmp_path, "--fsdp", "--resume")).resume
    assert refusal(tiny_argv(tmp_path, "--fsdp", "--lora-rank", "4")) == (
        "--fsdp does not train LoRA adapters yet; use DDP (no --fsdp) for --lora-rank."
    )


def test_plot_needs_a_directory_holding_metrics_jsonl(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert refusal([*CPU, "--plot", str(run)]) == (
        f"--plot {run}: there is no metrics.jsonl in it. Pass a run's --output-dir."
    )
    assert refusal([*CPU, "--plot", str(tmp_path / "missing")]).startswith("--plot ")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert config.parse_args([*CPU, "--plot", str(run)]).plot == str(run)


@pytest.mark.parametrize("flag", ["--sapo-tau-pos", "--sapo-tau-neg"])
def test_sapo_tau_below_1e_6_is_refused_and_at_1e_6_the_loss_and_gradient_are_finite(flag):
    # 1e-30 was accepted: SAPO's term σ(τ (r - 1)) · 4/τ · Â holds the constant 2/τ · Â, which
    # swamps float32's digits below 1e-6, and is inf (gradients NaN) below ~1e-38
    argv = [*CPU, "--demo", "--surrogate", "sapo", "--output-dir", "/tmp/x", flag]
    for tiny in ("1e-30", "9e-7", "0"):
        with pytest.raises(config.UserError) as refused:
            config.parse_args([*argv, tiny])
        assert str(refused.value).startswith(f"{flag} must be a finite number > 0, at least 1e-6")
    args = config.parse_args([*argv, "1e-6"])
    logps = torch.tensor([[-1.0, -2.0], [-1.5, -0.5]], requires_grad=True)
    loss = grpo.grpo_loss(
        logps,
        logps.detach() + torch.tensor([[0.1, -0.2], [0.0, 0.3]]),
        None,
        torch.tensor([1.0, -1.0]),
        torch.ones(2, 2),
        beta=0,
        surrogate=functools.partial(
            grpo.sapo_objective, tau_pos=args.sapo_tau_pos, tau_neg=args.sapo_tau_neg
        ),
    )
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logps.grad).all()


def test_decode_auto_is_fused_where_the_decode_loop_runs_on_cuda_and_eager_elsewhere(capsys):
    import argparse

    def resolved(**flags):
        base = dict(device="cuda", decode="auto", compile=None, fsdp=False, num_beams=1)
        args = argparse.Namespace(**{**base, **flags})
        config.resolve_decode(args)
        return args.decode

    assert resolved() == "fused"  # measured faster than graphs on the fifth lease (docs/gpu.md)
    assert resolved(device="cpu") == "eager"  # on the CPU nothing changes
    # --compile compiles its own decode step; --fsdp and beam search decode in generate()
    assert resolved(compile="inductor") == "eager"
    assert resolved(fsdp=True) == "eager" and resolved(num_beams=4) == "eager"
    # the fall-back is said, in one line (the compiled decode is --compile's own choice: not said)
    assert capsys.readouterr().out.splitlines() == [
        "decode: eager, not fused: with --fsdp transformers' generate() decodes",
        "decode: eager, not fused: with --num-beams transformers' generate() decodes",
    ]
    assert resolved(decode="eager") == "eager"  # the way to turn it off
    assert resolved(decode="graphs") == "graphs"
    said = {}
    for flags in (dict(device="cpu"), dict(compile="inductor"), dict(fsdp=True)):
        with pytest.raises(config.UserError) as stop:
            resolved(decode="graphs", **flags)
        said[next(iter(flags))] = str(stop.value)
    assert "needs a CUDA device" in said["device"]
    assert "does not combine with --compile" in said["compile"]
    assert "--fsdp" in said["fsdp"] and all("\n" not in s for s in said.values())
    assert config.parse_args([*CPU, "--demo", "--output-dir", "x"]).decode == "eager"


@pytest.mark.parametrize("entry", ["train", "trainer"])
def test_no_gradient_checkpointing_is_a_flag_of_both_files_and_off_on_the_cpu(entry, tmp_path):
    import train

    argv = [*CPU, "--demo", "--output-dir", str(tmp_path)]
    parse = (lambda a: train.parse_args(a)[1]) if entry == "train" else config.parse_args
    assert parse([*argv]).gradient_checkpointing is False  # unset, on the CPU: off
    assert parse([*argv, "--gradient-checkpointing"]).gradient_checkpointing is True
    assert parse([*argv, "--no-gradient-checkpointing"]).gradient_checkpointing is False


# --- issue 56's flags: DPPO (--surrogate dppo-tv|dppo-kl), GDPO (--multi-reward gdpo), the KL's
# estimator and place (--kl-estimator, --kl-in-reward); each bad combination one line
# ------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dppo-delta-low", "0.1"], "--dppo-delta-low does nothing with --surrogate clip: drop it"),
        (["--surrogate", "sapo", "--dppo-delta-high", "0.1"], "--dppo-delta-high does nothing with --surrogate sapo"),
        (["--surrogate", "dppo-tv", "--delta", "2"], "--delta does nothing with --surrogate dppo-tv"),
        (["--surrogate", "dppo-kl", "--epsilon-high", "0.28"], "--epsilon-high does nothing with --surrogate dppo-kl"),
        (["--surrogate", "dppo-kl", "--dppo-delta-low", "0"], "--dppo-delta-low must be a finite number > 0, got 0.0."),
        (["--surrogate", "dppo-tv", "--dppo-delta-high", "nan"], "--dppo-delta-high must be a finite number > 0"),
        (
            ["--surrogate", "dppo-tv", "--dppo-delta-high", "1"],
            "--dppo-delta-high 1 drops nothing with --surrogate dppo-tv: p and b are probabilities, "
            "so |p - b| stays below 1. Give a value below 1 (verl's examples use 0.15).",
        ),
        (
            ["--surrogate", "dppo-kl", "--ratio-level", "sequence"],
            "--surrogate dppo-kl drops each token by its own probability; with --ratio-level sequence "
            "every token's term carries its whole completion's ratio, so a dropped token would still "
            "move through the others'. Use --ratio-level token.",
        ),
        (
            ["--surrogate", "dppo-tv", "--num-beams", "4"],
            "--surrogate dppo-tv at --num-iterations 1 needs the sampler's log-probs as its behaviour "
            "policy (pi_old is pi_theta there: the trust region would drop nothing), and with "
            "--num-beams transformers' generate() decodes, which does not keep them. Give "
            "--num-iterations 2 or more (pi_old is then the behaviour policy), or drop --num-beams.",
        ),
        (
            ["--kl-in-reward", "--beta", "0"],
            "--kl-in-reward subtracts beta times each completion's KL from its reward; at --beta 0 "
            "there is nothing to subtract: give --beta > 0, or drop --kl-in-reward.",
        ),
        (
            ["--kl-estimator", "k2", "--beta", "0"],
            "--kl-estimator k2 chooses the loss's KL estimator; at --beta 0 there is no KL term: drop "
            "--kl-estimator.",
        ),
        (
            ["--kl-estimator", "k2", "--kl-in-reward"],
            "--kl-estimator k2 chooses the loss's KL estimator; with --kl-in-reward the KL is k1 in the "
            "reward and the loss has no KL term: drop --kl-estimator.",
        ),
        (
            ["--kl-bias-correction", "--kl-in-reward"],
            "--kl-bias-correction multiplies the loss's k3 by the ratio (DeepSeek-V3.2's eq. 7, for "
            "k3); with --kl-in-reward the loss has no KL term to correct. Drop --kl-bias-correction "
            "(--no-kl-bias-correction under --preset).",
        ),
        (
            ["--kl-bias-correction", "--kl-estimator", "k2"],
            "--kl-bias-correction multiplies the loss's k3 by the ratio (DeepSeek-V3.2's eq. 7, for "
            "k3); k2's gradient is already the reverse KL's, and r * k2's would be that of E[k2], not "
            "of the KL. Drop --kl-bias-correction (--no-kl-bias-correction under --preset).",
        ),
        (
            ["--multi-reward", "gdpo", "--scale-rewards", "batch"],
            "--scale-rewards batch does not combine with --multi-reward gdpo: GDPO divides each reward "
            "by its group's std, then the weighted sum by the batch's. Drop one of them.",
        ),
        (
            ["--multi-reward", "gdpo", "--dynamic-sampling"],
            "--dynamic-sampling does not combine with --multi-reward gdpo: it keeps the groups whose "
            "total rewards differ, and GDPO's advantages come from each reward's own spread, which "
            "the total does not show. Drop one of them.",
        ),
        (
            ["--multi-reward", "gdpo", "--kl-in-reward"],
            "--kl-in-reward does not combine with --multi-reward gdpo: it subtracts the KL from the "
            "weighted total reward, which GDPO never forms (each reward is normalized on its own). "
            "Drop one of them.",
        ),
    ],
)  # fmt: skip
def test_issue_56_flags_that_cannot_work_are_refused_in_one_line_before_any_model_loads(
    tmp_path, extra, message
):
    said = refusal(tiny_argv(tmp_path, *extra))
    assert said.startswith(message) and "\n" not in said


def test_dppo_at_mu_1_under_fsdp_is_refused_and_at_mu_2_runs_against_pi_old(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = tiny_argv(tmp_path, "--surrogate", "dppo-kl", "--fsdp")
    assert "with --fsdp transformers' generate() decodes" in refusal(argv)
    args = config.parse_args([*argv, "--num-iterations", "2"])
    # generate() keeps no sampler log-probs: DPPO's behaviour policy is π_old
    assert not trainer.rollout_sampling(args).keep_logps


def test_the_kl_bias_correction_a_preset_set_is_refused_with_k2_naming_the_preset(tmp_path):
    argv = [*CPU, "--preset", "trl", "--beta", "0.04", "--kl-estimator", "k2"]
    said = refusal([*argv, "--output-dir", str(tmp_path)])
    assert said.startswith("--kl-bias-correction multiplies the loss's k3 by the ratio")
    assert "(--preset trl (TRL 1.16 GRPOConfig's defaults) set: " in said and "\n" not in said
    args = config.parse_args([*argv, "--no-kl-bias-correction", "--output-dir", str(tmp_path)])
    assert trainer.LossSettings.of(args).kl_estimator == "k2"


def test_issue_56_flags_reach_the_settings_of_the_loss_the_advantages_and_the_decode(tmp_path):
    def parsed(*extra):
        args = config.parse_args(tiny_argv(tmp_path, *extra))
        return trainer.LossSettings.of(args), trainer.Settings.of(args)

    loss, run = parsed()  # the defaults: eq. 3 as the paper has it
    assert (loss.surrogate, loss.dppo_deltas, loss.kl_estimator) == ("clip", (), "k3")
    assert loss.beta == 0.04
    assert (run.multi_reward, run.reward_kl_beta, run.sampling.keep_logps) == ("sum", 0.0, False)
    # DPPO: its thresholds (verl's examples' where not given; a low one alone sets both), and the
    # decode keeps the sampler's log-probs, its behaviour policy
    for surrogate, deltas in (("dppo-tv", (0.15, 0.15)), ("dppo-kl", (0.05, 0.05))):
        loss, run = parsed("--surrogate", surrogate)
        assert loss.dppo_deltas == deltas and run.sampling.keep_logps
        assert trainer.policy_term(loss) is grpo.dppo_objective
    loss, _ = parsed("--surrogate", "dppo-tv", "--dppo-delta-low", "0.1")
    assert loss.dppo_deltas == (0.1, 0.1)
    loss, _ = parsed("--surrogate", "dppo-kl", "--dppo-delta-low", ".1", "--dppo-delta-high", ".2")
    assert loss.dppo_deltas == (0.1, 0.2)
    # μ > 1 under beam search: no sampler log-probs, π_old is b
    _, run = parsed("--surrogate", "dppo-tv", "--num-beams", "4", "--num-iterations", "2")
    assert not run.sampling.keep_logps
    loss, _ = parsed("--kl-estimator", "k2")
    assert (loss.kl_estimator, loss.beta) == ("k2", 0.04)
    # k1 in the reward: the demo's β moves to the reward, the loss has none
    loss, run = parsed("--kl-in-reward")
    assert (loss.beta, run.reward_kl_beta) == (0.0, 0.04)
    _, run = parsed("--multi-reward", "gdpo")
    assert run.multi_reward == "gdpo"


def test_gdpo_with_one_reward_is_refused_when_the_task_is_loaded_and_runs_with_two(tmp_path):
    # --task addition scores one reward (correctness); --overlong-buffer adds a second
    argv = [*CPU, "--task", "addition", "--output-dir", str(tmp_path), "--multi-reward", "gdpo"]
    with pytest.raises(config.UserError) as stop:
        trainer.load_task(config.parse_args(argv))
    assert str(stop.value) == (
        "--multi-reward gdpo normalizes each reward in its group before summing them; with one "
        "reward (correctness) that is eq. 3's advantage normalized once more over the batch. Add a "
        "reward (--reward-fn, --reward-model, --overlong-buffer), or drop --multi-reward."
    )
    task = trainer.load_task(config.parse_args([*argv, "--overlong-buffer", "8"]))
    assert [r.name for r in task.rewards] == ["correctness", "overlong"]


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(multi_reward="gdpo"), "--multi-reward gdpo normalizes each reward function's one number"),
        (dict(kl_in_reward=True), "--kl-in-reward subtracts beta times the KL from each completion's"),
    ],
)  # fmt: skip
def test_gdpo_and_kl_in_reward_with_a_process_reward_are_refused_at_its_first_steps(
    settings, message
):
    # A process reward is known once it returns steps (the first step's scoring): trainer.
    # advantages_of checks then, as for --scale-rewards and --dynamic-sampling.
    import process_supervision

    with pytest.raises(config.UserError) as stop:
        process_supervision.check_settings(**settings)
    said = str(stop.value)
    assert said.startswith(message) and "return one number per completion" in said
    assert "\n" not in said

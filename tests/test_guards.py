"""What stops a run before it does harm: weights that became non-finite (never saved), running out
of memory on the CPU, a generation budget beyond the model's context, a second signal; and
--eval-only --resume evaluating the checkpoint, not the initial model. Every run is the demo's tiny
model on the CPU (helpers.tiny_argv).
"""

import json
import os
import signal
import time
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

import evaluation
import trainer
from helpers import CPU, read_metrics, run_tiny, tiny_argv, tiny_model_dir, varied_reward
from support import checkpoint, models, signals

# --- weights that are not finite
# --------------------------------------------------------------------------------------------------


def clipping_that_hides_nan(at_call):
    """clip_grad_norm_ as --max-grad-norm nan made it behave: the gradients multiplied by NaN,
    the norm it returns (measured before clipping) finite. Faulty from its `at_call`-th call on."""
    real, calls = torch.nn.utils.clip_grad_norm_, []

    def clip(parameters, max_norm, *a, **kw):
        parameters = list(parameters)
        norm = real(parameters, max_norm, *a, **kw)
        calls.append(norm)
        if len(calls) >= at_call:
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(float("nan"))
        return norm

    return clip


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_weights_made_non_finite_behind_a_finite_gradient_norm_stop_the_run_and_are_never_saved(
    tmp_path, monkeypatch, capsys, dtype
):
    # Steps 1 and 2 are saved (--save-every 1); step 3's update writes NaN into the weights while
    # every check before it (loss, gradient norm) sees finite numbers. The run stops with one
    # paragraph and exit code 2, and the checkpoint on disk is step 2's, byte for byte.
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clipping_that_hides_nan(at_call=3))
    saved = {}
    real_save = trainer.checkpoint.save

    def keep_a_copy(output_dir, *a, **kw):
        path = real_save(output_dir, *a, **kw)
        with open(os.path.join(path, "model.safetensors"), "rb") as f:
            saved["weights"] = f.read()
        return path

    monkeypatch.setattr(trainer.checkpoint, "save", keep_a_copy)
    with pytest.raises(SystemExit) as exit_info:
        trainer.main(tiny_argv(tmp_path, "--steps", "4", "--save-every", "1", "--dtype", dtype))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "made the weights non-finite" in err and "--resume continues from it" in err
    state = torch.load(tmp_path / "checkpoint" / "training_state.pt", weights_only=True)
    assert state["step"] == 2 and len(read_metrics(tmp_path)) == 2
    with open(tmp_path / "checkpoint" / "model.safetensors", "rb") as f:
        assert f.read() == saved["weights"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nonfinite_weights_sees_nan_and_inf_in_any_tensor_and_huge_finite_weights_pass():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    assert checkpoint.nonfinite_weights(model) == ([], False)
    with torch.no_grad():
        model[1].weight[0, 2] = (
            3e38  # a sum of squares would overflow here; the largest |w| does not
        )
    assert checkpoint.nonfinite_weights(model) == ([], False)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with torch.no_grad():
            model[0].bias[1] = bad
        assert checkpoint.nonfinite_weights(model) == (["0.bias"], True)
    model[0].requires_grad_(
        False
    )  # frozen weights (LoRA's base) do not change in an update: not checked after one
    assert checkpoint.nonfinite_weights(model, trainable_only=True) == ([], False)


# --- out of memory
# --------------------------------------------------------------------------------------------------


def test_cpu_out_of_memory_gets_the_paragraph_cuda_gets(tmp_path, monkeypatch, capsys):
    # The RuntimeError torch's CPU allocator really raises (1 PiB cannot be allocated), inside the
    # first step.
    def allocate_too_much(*a, **kw):
        torch.empty(2**50, dtype=torch.uint8)

    monkeypatch.setattr(trainer.sampling, "sample_rollouts", allocate_too_much)
    with pytest.raises(SystemExit) as exit_info:
        trainer.main(tiny_argv(tmp_path))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.startswith("error: the CPU (RAM) ran out of memory.")
    assert "--micro-batch-size" in err and "--gradient-checkpointing" in err


def test_other_runtime_errors_are_not_taken_for_out_of_memory(tmp_path, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("a bug, not memory")

    monkeypatch.setattr(trainer.sampling, "sample_rollouts", broken)
    with pytest.raises(RuntimeError, match="a bug, not memory"):
        trainer.main(tiny_argv(tmp_path))


# --- the context
# --------------------------------------------------------------------------------------------------


def test_max_new_tokens_beyond_the_context_is_refused_before_the_weights_load(
    tmp_path, monkeypatch, capsys
):
    # The tiny model's context is 512 tokens (helpers.tiny_model_dir). Before: the prompt was cut to
    # nothing, and the first forward raised a reshape error from inside the model.
    model_dir = tiny_model_dir(tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "a b", "answer": "c"}) + "\n" for _ in range(4)))
    monkeypatch.setattr(
        AutoModelForCausalLM, "from_pretrained", lambda *a, **kw: pytest.fail("weights loaded")
    )
    argv = [*CPU, "--model", str(model_dir), "--data", str(rows), "--prompt-field", "prompt"]
    argv += [
        "--answer-field",
        "answer",
        "--reward-fn",
        "format",
        "--output-dir",
        str(tmp_path / "r"),
    ]
    for extra, expected in [
        (["--max-new-tokens", "512"], "at most 511."),
        (
            ["--max-new-tokens", "400", "--max-prompt-length", "200"],
            "--max-new-tokens 400 + --max-prompt-length 200 do not fit",
        ),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            trainer.main(argv + extra)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "512 tokens" in err and expected in err


def test_the_demo_checks_its_own_context(tmp_path, capsys):
    # the demo's model: 512 positions
    with pytest.raises(SystemExit) as exit_info:
        trainer.main(tiny_argv(tmp_path, "--max-new-tokens", "600"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert (
        "--max-new-tokens 600 + a prompt do not fit the demo's model's context of 512 tokens" in err
    )


def test_check_context_accepts_the_largest_budget_that_fits():
    config = type("Config", (), {"max_position_embeddings": 100})()
    models.check_context(99, None, config, "m")
    models.check_context(60, 40, config, "m")
    with pytest.raises(models.UserError):
        models.check_context(61, 40, config, "m")


# --- --eval-only --resume
# --------------------------------------------------------------------------------------------------


def evaluated_logits(monkeypatch, argv):
    """The logits of the model trainer.main hands to the evaluation, on fixed tokens."""
    seen = {}

    def spy(model, tokenizer, task, settings, amp=None):
        with torch.no_grad():
            seen["logits"] = model(torch.arange(2, 12)[None]).logits
        return {}

    monkeypatch.setattr(evaluation, "evaluate_with", spy)
    trainer.main(argv)
    return seen["logits"]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_eval_only_resume_evaluates_the_checkpoint_not_the_initial_model(
    tmp_path, monkeypatch, lora
):
    # Before, --eval-only ignored --resume and silently evaluated the initial model.
    if lora:
        pytest.importorskip("peft")
    flags = ("--lora-rank", "4", "--lr", "1e-2") if lora else ()
    run_tiny(tmp_path, "--steps", "2", *flags)
    with torch.no_grad():
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")(
            torch.arange(2, 12)[None]
        ).logits
    initial = evaluated_logits(monkeypatch, tiny_argv(tmp_path, "--eval-only", *flags))
    resumed = evaluated_logits(monkeypatch, tiny_argv(tmp_path, "--eval-only", "--resume", *flags))
    # Full: the checkpoint's own weights, the same logits to the bit. LoRA: --model with the adapter
    # on, W x + B A x, against the checkpoint's merged (W + B A) x: the same up to fp32 rounding
    # (|logits| ~ 1: 1e-5 is ~100 ulps).
    assert (
        torch.equal(resumed, saved)
        if not lora
        else torch.allclose(resumed, saved, rtol=0, atol=1e-5)
    )
    assert (initial - saved).abs().max() > 1e-3


# --- a second signal
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "gap, code, saved_at", [(0.1, 143, 2), (1.3, 143, 1)], ids=["same", "second"]
)
def test_a_second_signal_within_a_second_is_the_same_request_later_it_stops_at_once(
    tmp_path, gap, code, saved_at
):
    # Inside step 2's reward: SIGTERM, then SIGINT `gap` seconds later. 0.1 s: one request delivered
    # twice (as Ctrl-C under torchrun is: the terminal's, then torchrun's forwarded copy), so step 2
    # finishes and is saved (143: the first signal's code). 1.3 s (beyond SAME_REQUEST_S = 1): a
    # second request, the run stops at once, inside the reward, before step 2's update: the
    # checkpoint holds step 1 and --resume redoes step 2. Either way the exit code is the first
    # signal's: the scheduler's SIGTERM, not the Ctrl-C that hurried it.
    calls = []

    def reward(completions, answers):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(gap)
            os.kill(os.getpid(), signal.SIGINT)
        return varied_reward(completions, answers)

    with pytest.raises(signals.Stopped) as info:
        with signals.STOPS:
            run_tiny(tmp_path, "--steps", "4", "--save-every", "0", reward=reward)
    assert info.value.exit_code == code
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, saved_at + 1))
    assert (
        torch.load(tmp_path / "checkpoint" / "training_state.pt", weights_only=True)["step"]
        == saved_at
    )


def test_a_second_signal_during_an_optimizer_update_waits_for_it_and_the_step_counts_as_done(
    tmp_path, monkeypatch
):
    # The second signal lands right after AdamW's step, before the schedule's: before, Stopped left
    # the update applied but the step saved as not done (step 1, step-start RNG), so --resume
    # applied it twice. Now the update (weights, AdamW, schedule) completes first, and the step is
    # saved as done.
    monkeypatch.setattr(
        signals.StopRequests, "SAME_REQUEST_S", 0.0
    )  # a second signal, however soon
    real_build, steps = trainer.build_optimizer, []

    def build(*a):
        optimizer = real_build(*a)
        real_step = optimizer.step

        def step(self, *args, **kwargs):
            out = real_step(*args, **kwargs)
            steps.append(1)
            if len(steps) == 2:  # step 2's update: the request came in its reward
                os.kill(os.getpid(), signal.SIGINT)
            return out

        optimizer.step = types.MethodType(step, optimizer)  # a method: the LR scheduler wraps it
        return optimizer

    def reward(completions, answers):
        if len(steps) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return varied_reward(completions, answers)

    monkeypatch.setattr(trainer, "build_optimizer", build)
    with pytest.raises(signals.Stopped) as info:
        with signals.STOPS:
            run_tiny(tmp_path, "--steps", "4", "--save-every", "0", reward=reward)
    assert info.value.exit_code == 143  # the first signal's (SIGTERM), not the Ctrl-C's
    state = torch.load(tmp_path / "checkpoint" / "training_state.pt", weights_only=True)
    assert state["step"] == 2 and state["scheduler"]["last_epoch"] == 2
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # step 2 done: its row too


@pytest.mark.slow
@pytest.mark.parametrize("stop_at_update", [5, 6, 7])
def test_a_second_signal_after_an_update_of_mu_4_logs_the_step_saves_it_and_keeps_the_first_code(
    tmp_path, monkeypatch, stop_at_update
):
    # μ = 4: SIGTERM in step 2's rewards (a request), then Ctrl-C inside step 2's update number
    # stop_at_update - 4 (AdamW's step 5, 6 or 7 of the run). The update in progress finishes with
    # its statistics, the rest of μ is skipped, and the step counts as done: its metrics row is
    # written (before: rows 1, 3, 4 after --resume, a gap), the checkpoint holds it, and the exit
    # code is SIGTERM's 143 (before: 130). --resume then continues with step 3: rows 1-4.
    monkeypatch.setattr(signals.StopRequests, "SAME_REQUEST_S", 0.0)
    real_build, steps = trainer.build_optimizer, []

    def build(*a):
        optimizer = real_build(*a)
        real_step = optimizer.step

        def step(self, *args, **kwargs):
            steps.append(1)
            if len(steps) == stop_at_update:
                os.kill(os.getpid(), signal.SIGINT)
            return real_step(*args, **kwargs)

        optimizer.step = types.MethodType(step, optimizer)
        return optimizer

    def reward(completions, answers):
        if len(steps) == 4:  # step 2's rewards, after step 1's 4 updates
            os.kill(os.getpid(), signal.SIGTERM)
        return varied_reward(completions, answers)

    monkeypatch.setattr(trainer, "build_optimizer", build)
    argv = ["--steps", "4", "--save-every", "0", "--num-iterations", "4"]
    with pytest.raises(signals.Stopped) as info:
        with signals.STOPS:
            run_tiny(tmp_path, *argv, reward=reward)
    assert info.value.exit_code == 143
    state = torch.load(tmp_path / "checkpoint" / "training_state.pt", weights_only=True)
    assert state["step"] == 2 and state["scheduler"]["last_epoch"] == stop_at_update
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    run_tiny(tmp_path, *argv, "--resume")
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_a_signal_just_after_the_end_of_step_check_is_handled_at_the_next_step_end(
    tmp_path, monkeypatch
):
    # The SIGTERM arrives after step 2's check, with no evaluation due: before, the check before the
    # (skipped) evaluation raised it outside the step, and steps 1-2 were lost unsaved. Now step 3
    # finishes and is saved.
    real_check, ends = signals.STOPS.raise_if_requested, []

    def check(saved):
        real_check(saved)
        ends.append(1)
        if len(ends) == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(signals.STOPS, "raise_if_requested", check)
    with pytest.raises(signals.Stopped) as info:
        with signals.STOPS:
            run_tiny(tmp_path, "--steps", "5", "--save-every", "0")
    assert info.value.exit_code == 143
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    state = torch.load(tmp_path / "checkpoint" / "training_state.pt", weights_only=True)
    assert state["step"] == 3


def test_a_lora_run_stopped_on_a_step_it_saves_anyway_leaves_the_merged_model(tmp_path):
    # --save-every 1: step 2 is saved by the periodic save, which was not the run's last (adapter
    # only) before.
    pytest.importorskip("peft")
    calls = []

    def reward(completions, answers):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return varied_reward(completions, answers)

    with pytest.raises(signals.Stopped):
        with signals.STOPS:
            run_tiny(
                tmp_path, "--steps", "4", "--save-every", "1", "--lora-rank", "4", reward=reward
            )
    assert (tmp_path / "checkpoint" / "adapter").is_dir()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")  # without peft
    assert not any("lora" in name for name, _ in model.named_parameters())


def test_a_directory_without_a_checkpoint_is_not_offered_resume(tmp_path, capsys):
    # A run that crashed before its first save (out of memory in step 1) leaves metrics.jsonl alone:
    # --resume, which the refusal used to offer, would fail with "no checkpoint".
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/correctness": 0.1}\n')
    with pytest.raises(SystemExit):
        trainer.main(tiny_argv(tmp_path))
    err = capsys.readouterr().err
    assert "already holds a run (metrics.jsonl with 1 row, the last at step 0)" in err
    assert "--resume to continue" not in err and "(it has no checkpoint to --resume from)" in err


@pytest.mark.slow
def test_eval_only_resume_of_an_adapter_only_checkpoint_asks_for_the_lora_flags(tmp_path, capsys):
    pytest.importorskip("peft")
    run_tiny(tmp_path, "--steps", "1", "--lora-rank", "4")
    for name in (
        "config.json",
        "model.safetensors",
    ):  # as a periodic save leaves it: the adapter alone
        os.remove(tmp_path / "checkpoint" / name)
    with pytest.raises(SystemExit) as exit_info:
        trainer.main(tiny_argv(tmp_path, "--eval-only", "--resume"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "holds a LoRA adapter, not a whole model" in err and "--lora-rank" in err


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_an_evaluation_stops_it_at_once_with_a_line_saying_what_is_saved(
    tmp_path, monkeypatch, capsys, signum, code
):
    # Training is saved before every evaluation, so a signal inside one stops at once. It used to
    # exit 130/143 with no message at all; now one line says where it stopped and what is saved.
    real, calls = evaluation.evaluate, []

    def evaluate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the evaluation after step 2 (the first one is before training)
            os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    with pytest.raises(signals.Stopped) as info:
        with signals.STOPS:
            run_tiny(tmp_path, "--steps", "4", "--eval-every", "2", "--eval-limit", "2")
    assert info.value.exit_code == code
    assert checkpoint.load_state(str(tmp_path / "checkpoint"))["step"] == 2
    err = capsys.readouterr().err
    name = signal.Signals(signum).name
    assert (
        f"{name}: stopping during the evaluation at step 2; training is saved up to step 2" in err
    )

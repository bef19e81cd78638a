"""Faults: resume after ctrl-c, a crash or SIGKILL (bit-identical weights and metrics), checkpoints
under a full disk and torn renames, non-finite losses, gradients and rewards, degenerate batches,
and bad input (one-paragraph errors, exit code 2).
"""

import errno
import math
import os
import random
import signal
import subprocess
import sys
import time

import huggingface_hub
import pytest
import torch
from transformers import AutoModelForCausalLM

import config
import evaluation
import grpo
import rewards
import trainer
from helpers import (
    CPU,
    ROOT,
    read_metrics,
    run_tiny,
    tiny_argv,
    tiny_model_dir,
    varied_reward,
    wait_for,
    without_time,
    write_gsm8k,
)
from support import checkpoint, decode, demo, errors, models, signals

FAULT_ARGV = [
    *CPU,
    *"--demo --demo-warmup-steps 0 --batch-size 2 --gradient-accumulation-steps 2".split(),
    *"--num-generations 4 --num-iterations 2 --save-every 1 --eval-every 4 --eval-limit 4".split(),
    *"--eval-samples 2 --sample-every 0".split(),
]


# The interrupted runs' environment: GRPO_SAVE_PAUSE widens the moments inside a save (a step and
# its save: ~0.5 s).
FAULT_ENV = dict(os.environ, GRPO_SAVE_PAUSE="0.2", HF_HUB_OFFLINE="1")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """straight_run(steps): the output directory of FAULT_ARGV run uninterrupted for `steps`
    steps, run once per step count for all the tests here that compare an interrupted run against
    it."""
    runs = {}

    def straight(steps):
        if steps not in runs:
            runs[steps] = tmp_path_factory.mktemp("straight") / "run"
            assert train_subprocess(runs[steps], FAULT_ENV, steps) == 0
        return runs[steps]

    return straight


def train_subprocess(out_dir, env, steps, kill_after=None, signum=signal.SIGKILL):
    """python trainer.py FAULT_ARGV in a fresh process (with --resume when out_dir has a
    checkpoint, else --overwrite: a kill before the first save may leave metrics rows).
    kill_after: send it `signum` (SIGKILL unless told) that many seconds after its first line
    about training ("GRPO: ..."), unless it finished first."""
    argv = [*FAULT_ARGV, "--steps", str(steps), "--output-dir", str(out_dir)]
    argv += ["--resume"] if checkpoint.find_last(str(out_dir)) else ["--overwrite"]
    log, started = (
        f"{out_dir}.log",
        lambda: open(log).read().count("GRPO:") if os.path.exists(log) else 0,
    )
    before = started()
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "trainer.py"), *argv],
        cwd=ROOT,
        env=env,
        stdout=open(log, "a"),
        stderr=subprocess.STDOUT,
    )
    if kill_after is not None:
        wait_for(lambda: started() > before, proc, 'its first line about training ("GRPO: ...")')
        time.sleep(kill_after)  # a random moment of its training, the tests' point: not a marker's
        proc.send_signal(signum)
    return proc.wait()


def nan_loss_in_steps(monkeypatch, steps):
    """grpo_loss returns NaN (through the graph, so the gradients are NaN too) during the given
    1-based steps."""
    real, calls = grpo.grpo_loss, []

    def loss(*args, **kwargs):
        calls.append(1)
        out = real(*args, **kwargs)
        # 2 micro-batches per step
        return out * float("nan") if (len(calls) + 1) // 2 in steps else out

    monkeypatch.setattr(grpo, "grpo_loss", loss)


def bad_input_cases(tmp_path):
    good = write_gsm8k(tmp_path / "good.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q", "answer": \n')
    return {
        "one generation": (["--num-generations", "1"], ["--num-generations", "at least 2"]),
        "unknown model": (
            ["--model", "no-such-model-anywhere", "--data", good, "--eval-every", "-1"],
            ["could not load model", "Tried", "no-such-model-anywhere"],
        ),
        "missing model dir": (["--model", "./no/such/dir", "--data", good], ["not a directory"]),
        "missing data": (["--data", str(tmp_path / "missing.jsonl")], ["no such file"]),
        "malformed data": (["--data", str(bad)], [f"{bad}:2"]),
        "micro-batch not whole groups": (
            ["--micro-batch-size", "12"],
            ["multiple of --num-generations (8)"],
        ),
        "eval limit 0": (["--eval-limit", "0"], ["--eval-limit must be at least 1"]),
        "negative early stop": (
            ["--stop-when-zero-std", "-1"],
            ["--stop-when-zero-std must be at least 0"],
        ),
        "plot without metrics": (["--plot", str(tmp_path)], ["no metrics.jsonl"]),
        "negative seed": (["--seed", "-1"], ["--seed must be at least 0, got -1"]),
        "output dir is a file": (
            ["--data", good, "--output-dir", good],
            ["is a file, not a directory"],
        ),
        "nothing to resume": (tiny_argv(tmp_path / "empty", "--resume"), ["no checkpoint"]),
        "unknown reward module": (
            ["--data", good, "--eval-every", "-1", "--reward-fn", "no_such_rewards:f"],
            ["no_such_rewards.py"],
        ),
        "too many weights": (
            ["--data", good, "--eval-every", "-1", "--reward-weights", "1,1,1"],
            ["one weight per reward", "got 3"],
        ),
        "prompt field, no data": (["--prompt-field", "text"], ["pass it with --data PATH"]),
        "fewer rows than a step": (
            [
                "--data",
                write_gsm8k(tmp_path / "three.jsonl", n=3),
                *"--eval-every -1 --model".split(),
                tiny_model_dir(tmp_path),
            ],
            ["a step takes 4 prompts", "has 3 rows"],
        ),
        "fsdp alone": (
            ["--fsdp"],
            ["--fsdp shards the model over processes: start it with torchrun"],
        ),
    }


# --- resume: the same run as the uninterrupted one, or a clear refusal
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "crash"])
def test_resumed_run_logs_the_same_metrics_as_the_uninterrupted_one(tmp_path, monkeypatch, how):
    argv = "--steps 4 --num-iterations 2 --eval-every 2 --eval-limit 4 --eval-samples 2".split()
    run_tiny(tmp_path / "straight", *argv)

    # Interrupted at step 3: by Ctrl-C (which saves a checkpoint itself), or by a crash after the
    # step-2 checkpoint.
    real_score, scored = rewards.score, []

    def interrupt_at_step_3(reward_fns, completions, *a, **kw):
        # a training step's 4 prompts x G = 4 (an evaluation scores 4 x 2)
        scored.append(len(completions) == 16)
        if sum(scored) == 3 and scored[-1]:
            raise KeyboardInterrupt if how == "ctrl-c" else RuntimeError("simulated crash")
        return real_score(reward_fns, completions, *a, **kw)

    monkeypatch.setattr(rewards, "score", interrupt_at_step_3)
    interrupted = [*argv, "--save-every", "2" if how == "crash" else "0"]
    with pytest.raises(KeyboardInterrupt if how == "ctrl-c" else RuntimeError):
        run_tiny(tmp_path / "resumed", *interrupted)
    assert checkpoint.load_state(checkpoint.find_last(str(tmp_path / "resumed")))["step"] == 2
    monkeypatch.setattr(rewards, "score", real_score)
    run_tiny(tmp_path / "resumed", *interrupted, "--resume")

    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    # eval rows at 0, 2, 4 and the four steps
    assert [r["step"] for r in straight] == [
        0,
        1,
        2,
        2,
        3,
        4,
        4,
    ]
    # exact: losses, rewards, KL, grad norms, evals
    assert without_time(resumed) == without_time(straight)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "crash"])
@pytest.mark.parametrize("at_step", [2, 4], ids=["periodic-eval", "final-eval"])
def test_an_evaluation_cut_short_keeps_the_training_and_resume_redoes_only_that_evaluation(
    tmp_path, monkeypatch, how, at_step
):
    argv = ["--steps", "4", "--eval-every", "2", "--eval-limit", "4", "--eval-samples", "2"]
    run_tiny(tmp_path / "straight", *argv)
    real_evaluate, evaluated = evaluation.evaluate, []

    def cut_short(*a, **kw):
        evaluated.append(1)
        if len(evaluated) == 1 + at_step // 2:  # evaluations at steps 0, 2, 4
            raise (
                KeyboardInterrupt
                if how == "ctrl-c"
                else RuntimeError("simulated crash in the evaluation")
            )
        return real_evaluate(*a, **kw)

    monkeypatch.setattr(evaluation, "evaluate", cut_short)
    with pytest.raises(KeyboardInterrupt if how == "ctrl-c" else RuntimeError):
        # --save-every 0: the only checkpoints are the ones before evaluations
        run_tiny(tmp_path / "cut", *argv)
    assert checkpoint.load_state(checkpoint.find_last(str(tmp_path / "cut")))["step"] == at_step
    monkeypatch.setattr(evaluation, "evaluate", real_evaluate)
    evals = run_tiny(tmp_path / "cut", *argv, "--resume")
    assert [step for step, _ in evals] == [0, 2, 4]
    assert without_time(read_metrics(tmp_path / "cut")) == without_time(
        read_metrics(tmp_path / "straight")
    )


@pytest.mark.slow
def test_resume_with_model_set_to_the_checkpoint_itself_keeps_policy_and_reference_apart(tmp_path):
    model_dir = tiny_model_dir(tmp_path)
    data_file = write_gsm8k(tmp_path / "train.jsonl")
    argv = [
        *CPU,
        "--data",
        data_file,
        *"--num-generations 2 --max-new-tokens 4 --eval-every -1 --sample-every 0".split(),
        *"--output-dir".split(),
        str(tmp_path / "run"),
        *"--beta 0.1".split(),
    ]
    trainer.main(["--model", model_dir, "--steps", "1", *argv])
    resumed = str(tmp_path / "run" / "checkpoint")
    # the reference: the checkpoint's weights
    trainer.main(["--model", resumed, "--steps", "2", "--resume", *argv])
    rows = read_metrics(tmp_path / "run")
    assert (
        [r["step"] for r in rows] == [1, 2]
        and math.isfinite(rows[1]["grad_norm"])
        and rows[1]["kl"] == 0.0
    )


@pytest.mark.slow
def test_resume_skips_a_metrics_line_cut_short_by_a_kill(tmp_path, capsys):
    run_tiny(tmp_path / "run", "--steps", "2", "--save-every", "1")
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        # a kill in the middle of a write, after the last checkpoint
        f.write('{"step": 3, "loss": 0.1')
    run_tiny(tmp_path / "run", "--steps", "3", "--save-every", "1", "--resume")
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    assert "skipping a line cut short" in capsys.readouterr().err


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_gives_bit_identical_weights_and_metrics(
    tmp_path, straight_run
):
    """Kills (GRPO_KILLS of them, default 3; `GRPO_KILLS=40 python -m pytest -q -k sigkill` for a
    longer run) land anywhere: in a step, an evaluation, a metrics line, or inside a save
    (GRPO_SAVE_PAUSE widens its moments)."""
    env = FAULT_ENV
    rng, kills = (
        random.Random(int(os.environ.get("GRPO_FAULT_SEED", "0"))),
        int(os.environ.get("GRPO_KILLS", "3")),
    )
    # each kill comes within 1.5 s (at most 3 steps) of its process starting to train
    steps = 4 * kills
    straight_dir = straight_run(steps)
    codes = [
        train_subprocess(tmp_path / "killed", env, steps, kill_after=rng.uniform(0.1, 1.5))
        for _ in range(kills)
    ]
    assert codes == [-9] * kills  # each one really was killed, before the run could finish
    assert train_subprocess(tmp_path / "killed", env, steps) == 0  # the last resume runs to the end
    straight, killed = straight_dir / "checkpoint", tmp_path / "killed" / "checkpoint"
    assert (killed / "model.safetensors").read_bytes() == (
        straight / "model.safetensors"
    ).read_bytes()
    assert without_time(read_metrics(tmp_path / "killed")) == without_time(
        read_metrics(straight_dir)
    )
    assert checkpoint.load_state(str(killed))["step"] == steps


@pytest.mark.slow
def test_sigint_sigterm_sighup_at_random_moments_stop_at_a_step_end_and_resume_bit_identically(
    tmp_path, straight_run
):
    """Ctrl-C and a scheduler's SIGTERM or SIGHUP, at random moments of a μ = 2 run (inside a
    step between its two updates, inside a save, in an evaluation): the step under way finishes
    and is saved, the process exits with 128 + the signal's number, and --resume continues to the
    same weights and metrics as a run never stopped. Before, an interrupt between the μ updates
    saved the step as done with half its updates."""
    env = FAULT_ENV
    rng = random.Random(int(os.environ.get("GRPO_FAULT_SEED", "0")))
    signals = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    steps = 4 * len(signals)
    straight_dir = straight_run(steps)
    codes = [
        train_subprocess(tmp_path / "stopped", env, steps, rng.uniform(0.1, 1.5), signum)
        for signum in signals
    ]
    assert codes == [130, 143, 129]
    log = open(f"{tmp_path / 'stopped'}.log").read()
    assert "Traceback" not in log
    assert train_subprocess(tmp_path / "stopped", env, steps) == 0
    straight, stopped = straight_dir / "checkpoint", tmp_path / "stopped" / "checkpoint"
    assert (stopped / "model.safetensors").read_bytes() == (
        straight / "model.safetensors"
    ).read_bytes()
    assert without_time(read_metrics(tmp_path / "stopped")) == without_time(
        read_metrics(straight_dir)
    )


# FAULT_ARGV without the flags only trainer.py takes (the demo's warm-up runs: a few seconds)
REFERENCE_FAULT_ARGV = [
    a for a in FAULT_ARGV if a not in ("--demo-warmup-steps", "--sample-every", "0")
]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["trainer.py", "train.py"])
@pytest.mark.parametrize("signum", [None, signal.SIGHUP], ids=["pipe closed", "terminal hung up"])
def test_output_nobody_reads_any_more_loses_no_training(tmp_path, signum, script):
    """`python trainer.py | head` closes the pipe after its lines: every later write fails (EPIPE).
    An ssh session that drops hangs up the terminal: SIGHUP, then every write fails (EIO).
    Before, the first failing print ended the run with a traceback and no save. Now the output is
    dropped and training goes on: with the pipe closed the run ends as usual (exit 0, every step
    saved and logged); on a hangup the step under way finishes, is saved and the run exits with
    129, ready for --resume. train.py, the reference, alike."""
    out = tmp_path / "run"
    fault_argv = FAULT_ARGV if script == "trainer.py" else REFERENCE_FAULT_ARGV
    argv = [*fault_argv, "--steps", "6", "--save-every", "0", "--output-dir", str(out)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, script), *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    for line in proc.stdout:
        if line.startswith(b"GRPO:"):
            break
    proc.stdout.close()  # the reader is gone
    if signum is not None:
        # after step 1's metrics row: in a step, not the evaluation before training (that one stops
        # at once)
        log = out / "metrics.jsonl"
        wait_for(lambda: log.exists() and '"loss"' in log.read_text(), proc, "step 1 was logged")
        proc.send_signal(signum)
    code = proc.wait()
    steps = [r["step"] for r in read_metrics(out) if "loss" in r]
    saved = checkpoint.load_state(str(out / "checkpoint"))["step"]
    if signum is None:
        assert (code, steps, saved) == (0, [1, 2, 3, 4, 5, 6], 6)
    else:
        # the signal came during step 2 at the earliest; the stop saves the step it finished
        assert code == 129 and 2 <= saved <= 6 and steps == list(range(1, saved + 1))


@pytest.mark.slow
def test_a_signal_inside_a_step_lets_the_step_finish_and_a_second_stops_at_once(tmp_path, capsys):
    # In-process: the first SIGTERM arrives inside step 3's rewards (a reward function sends it), so
    # step 3 finishes, is saved and the run stops with exit code 143; no metrics row is lost or
    # half-written.
    sent = []

    def reward(completions, answers):
        if len(sent) == 2:  # step 3's call (one a step)
            os.kill(os.getpid(), signal.SIGTERM)
        sent.append(1)
        return varied_reward(completions, answers)

    with pytest.raises(signals.Stopped) as info:
        with signals.STOPS:
            run_tiny(tmp_path, "--steps", "5", "--save-every", "0", reward=reward)
    assert info.value.exit_code == 143
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 3]
    assert checkpoint.load_state(str(tmp_path / "checkpoint"))["step"] == 3
    err = capsys.readouterr().err
    assert "SIGTERM: finishing this step, then saving and exiting" in err
    assert "SIGTERM: saving a checkpoint at step 3 before exiting" in err
    assert signal.getsignal(signal.SIGTERM) is not signals.STOPS.handle  # handlers restored
    assert signals.STOPS.signum is None  # and the request forgotten: the next run starts clean
    run_tiny(tmp_path / "next", "--steps", "1")


@pytest.mark.slow
def test_resume_refuses_flags_that_differ_from_the_checkpoints_and_names_them(tmp_path):
    run_tiny(tmp_path, "--steps", "1")
    with pytest.raises(
        config.UserError,
        match="--resume: flags differ from the checkpoint's \\(--beta was 0.04, "
        "now 0.1; --lr was 0.002, now 0.001\\)",
    ):
        run_tiny(tmp_path, "--steps", "2", "--resume", "--lr", "1e-3", "--beta", "0.1")
    # these may change
    run_tiny(tmp_path, "--steps", "2", "--resume", "--save-every", "3", "--sample-every", "1")
    assert checkpoint.load_state(str(tmp_path / "checkpoint"))["step"] == 2
    # and so may the memory's choices (the same numbers): checkpointing, and how the decode runs
    run_tiny(tmp_path, "--steps", "3", "--resume", "--gradient-checkpointing", "--decode", "eager")
    assert checkpoint.load_state(str(tmp_path / "checkpoint"))["step"] == 3


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_trained_from_another_model(tmp_path, capsys):
    other = tmp_path / "other-model"
    demo.tiny_llama(len(demo.WORDS), 0, hidden_size=32, intermediate_size=64).save_pretrained(other)
    demo.word_tokenizer(demo.WORDS).save_pretrained(other)
    train_file = write_gsm8k(tmp_path / "train.jsonl")
    argv = [
        *CPU,
        "--data",
        train_file,
        *"--steps 1 --num-generations 2 --max-new-tokens 4 --eval-every -1 --output-dir".split(),
        str(tmp_path / "run"),
    ]
    trainer.main(["--model", tiny_model_dir(tmp_path), *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        trainer.main(["--model", str(other), *argv, "--resume"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"holds a different model than --model {other}" in err
    assert "(hidden_size 64 vs 32, intermediate_size 128 vs 64)" in err


# --- checkpoints on disk: a full disk, fsync, atomic replacement
# --------------------------------------------------------------------------------------------------


def test_a_full_disk_during_save_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch):
    real_save, calls = torch.save, []

    def save(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:  # the second checkpoint's training_state.pt
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(
        errors.SaveFailed,
        match="No space left on device. Nothing was replaced: the previous "
        "checkpoint, .*checkpoint, is intact",
    ):
        run_tiny(tmp_path, "--steps", "3", "--save-every", "1")
    assert checkpoint.load_state(str(tmp_path / "checkpoint"))["step"] == 1
    # no checkpoint.tmp left behind
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoint",
        "metrics.jsonl",
    ]
    AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")  # loadable


def test_checkpoint_files_and_directories_are_fsynced_before_and_after_the_renames(
    tmp_path, monkeypatch
):
    model, tokenizer = demo.model_and_tokenizer(seed=0)
    events, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(
        os,
        "fsync",
        lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd),
    )
    monkeypatch.setattr(
        os, "replace", lambda a, b: events.append(("replace", str(a), str(b))) or real_replace(a, b)
    )
    final = checkpoint.save(str(tmp_path), model, tokenizer, {"step": 1})
    rename = events.index(("replace", final + ".tmp", final))
    synced_before = {path for kind, path, *_ in events[:rename] if kind == "fsync"}
    files = {os.path.join(final + ".tmp", name) for name in os.listdir(final)}
    # every file, then the directory
    assert files | {final + ".tmp"} <= synced_before and len(files) >= 4
    assert ("fsync", str(tmp_path)) in events[rename:]  # the rename itself reaches the disk


def test_checkpoint_is_replaced_atomically_and_a_crash_between_renames_keeps_the_old_one(tmp_path):
    model, tokenizer = demo.model_and_tokenizer(seed=0)
    out = str(tmp_path)
    checkpoint.save(out, model, tokenizer, {"step": 1})
    checkpoint.save(out, model, tokenizer, {"step": 2})
    assert sorted(os.listdir(out)) == ["checkpoint"]  # no .tmp or .old left behind
    assert checkpoint.load_state(checkpoint.find_last(out))["step"] == 2
    # as if killed mid-swap
    os.replace(os.path.join(out, "checkpoint"), os.path.join(out, "checkpoint.old"))
    assert checkpoint.find_last(out).endswith("checkpoint.old")


def test_a_save_interrupted_between_its_renames_is_said_with_what_resume_does(tmp_path, capsys):
    # A second Ctrl-C (or a kill) between save's two renames leaves checkpoint.old and
    # checkpoint.tmp, no checkpoint. Resume went on from checkpoint.old without a word.
    model, tokenizer = demo.model_and_tokenizer(seed=0)
    out = str(tmp_path)
    checkpoint.save(out, model, tokenizer, {"step": 1})
    os.replace(os.path.join(out, "checkpoint"), os.path.join(out, "checkpoint.old"))
    os.makedirs(os.path.join(out, "checkpoint.tmp"))
    capsys.readouterr()
    assert checkpoint.find_last(out) == os.path.join(out, "checkpoint.old")
    assert capsys.readouterr().err == (
        f"a save was interrupted between its renames ({out}/checkpoint.old and {out}/checkpoint.tmp "
        f"are left, no checkpoint): continuing from {out}/checkpoint.old at step 1, the last "
        f"complete save; {out}/checkpoint.tmp is not used (the next save replaces it)\n"
    )
    assert checkpoint.find_last(out, quiet=True) and capsys.readouterr().err == ""
    # the next save puts the directory right: checkpoint alone
    checkpoint.save(out, model, tokenizer, {"step": 2})
    assert sorted(os.listdir(out)) == ["checkpoint"]


# --- non-finite losses, gradients and rewards; degenerate batches
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_nan_loss_skips_the_update_weights_and_adamw_unchanged_and_logs_why(
    tmp_path, monkeypatch
):
    initial = {k: v.clone() for k, v in demo.model_and_tokenizer(seed=42)[0].state_dict().items()}
    nan_loss_in_steps(monkeypatch, steps={1})
    run_tiny(tmp_path, "--steps", "1")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint").state_dict()
    assert all(torch.equal(saved[k], v) for k, v in initial.items())
    state = checkpoint.load_state(str(tmp_path / "checkpoint"))
    # AdamW never stepped
    assert state["optimizer"]["state"] == {} and state["scheduler"]["last_epoch"] == 0
    row = read_metrics(tmp_path)[0]
    assert row["skipped_nonfinite"] == 1 and row["skip_reason"] == "non-finite loss"


def test_a_non_finite_gradient_norm_skips_the_update(tmp_path, monkeypatch):
    monkeypatch.setattr(
        torch.nn.utils, "clip_grad_norm_", lambda *a, **k: torch.tensor(float("inf"))
    )
    run_tiny(tmp_path, "--steps", "1")
    assert read_metrics(tmp_path)[0]["skip_reason"] == "non-finite gradient norm"
    assert checkpoint.load_state(str(tmp_path / "checkpoint"))["optimizer"]["state"] == {}


@pytest.mark.slow
def test_max_nonfinite_skips_in_a_row_stop_the_run_and_save_the_last_good_weights(
    tmp_path, monkeypatch
):
    nan_loss_in_steps(monkeypatch, steps={2, 3, 4})
    with pytest.raises(config.UserError, match="2 optimizer updates in a row were skipped"):
        run_tiny(tmp_path, "--steps", "5", "--max-nonfinite", "2")
    rows = read_metrics(tmp_path)
    # step 3's skip stopped the run before its log line
    assert [r["skipped_nonfinite"] for r in rows] == [
        0,
        1,
    ]
    # step 3 applied no update: the checkpoint is the end of step 2 (the last metrics row), with the
    # RNG as it was then, so --resume redoes step 3
    assert checkpoint.load_state(str(tmp_path / "checkpoint"))["step"] == 2
    after_step_1 = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint").state_dict()
    monkeypatch.undo()
    run_tiny(tmp_path / "one", "--steps", "1")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "checkpoint").state_dict()
    # skipped updates changed nothing
    assert all(torch.equal(after_step_1[k], v) for k, v in reference.items())


@pytest.mark.parametrize(
    "bad, message",
    [
        (float("nan"), "returned nan for completion 3"),
        (float("inf"), "returned inf for completion 3"),
        ("short", "must return one number per completion (16)"),
    ],
)
def test_a_reward_that_is_not_finite_stops_the_run_naming_the_function_and_saves(
    tmp_path, bad, message
):
    def reward(completions, answers):
        return (
            [1.0] * 15 if bad == "short" else [0.0, 1.0, 0.0, bad] + [0.0] * (len(completions) - 4)
        )

    with pytest.raises(config.UserError, match="reward function 'correctness' ") as info:
        run_tiny(tmp_path, reward=reward)
    assert message in str(info.value)
    # before any update: redo step 1
    assert checkpoint.load_state(str(tmp_path / "checkpoint"))["step"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["eos_first", "no_eos", "all_groups_zero_std"])
def test_degenerate_batches_never_crash_or_give_nan(tmp_path, monkeypatch, case):
    real_generate = decode.generate

    def degenerate(model, prompt_ids, prompt_mask, settings, *a, **kw):
        # [B*G, C] completions
        out = real_generate(model, prompt_ids, prompt_mask, settings, *a, **kw)
        if case == "eos_first":  # every completion is just EOS (then padding)
            out[:, 0] = demo.EOS
            out[:, 1:] = demo.PAD
        elif case == "no_eos":  # every completion runs to the token budget without EOS
            out = torch.full((out.shape[0], settings.max_new_tokens), 10)
        return out

    monkeypatch.setattr(decode, "generate", degenerate)
    reward = (lambda c, a: [1.0] * len(c)) if case == "all_groups_zero_std" else varied_reward
    run_tiny(tmp_path / "run", "--steps", "2", "--num-iterations", "2", reward=reward)
    rows = read_metrics(tmp_path / "run")
    assert all(math.isfinite(r[k]) for r in rows for k in ("loss", "kl", "grad_norm", "reward_std"))
    if case == "all_groups_zero_std":
        assert all(r["frac_zero_std"] == 1.0 for r in rows)
    if case == "eos_first":
        assert all(r["completion_len_max"] == 1 for r in rows)
    if case == "no_eos":
        assert all(r["completion_len_mean"] == 6 for r in rows)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint")
    assert all(torch.isfinite(p).all() for p in model.parameters())


# --- model names and bad input
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, resolved",
    [
        ("SmolLM2-1.7B-Instruct", "HuggingFaceTB/SmolLM2-1.7B-Instruct"),
        ("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        ("SmolLM2-360M", "HuggingFaceTB/SmolLM2-360M"),
        ("HuggingFaceTB/SmolLM2-1.7B-Instruct", "HuggingFaceTB/SmolLM2-1.7B-Instruct"),
        ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
        (
            "SmolLM2-7B",
            "SmolLM2-7B",
        ),  # not a SmolLM2 size: left alone (and then fails to load with a clear error)
    ],
)
def test_short_names_resolve_to_huggingfacetb_and_hub_ids_pass_through(name, resolved):
    assert models.resolve_model_name(name) == resolved


def test_an_existing_local_directory_wins_over_the_short_name(tmp_path, monkeypatch):
    (tmp_path / "SmolLM2-135M").mkdir()
    monkeypatch.chdir(tmp_path)
    assert models.resolve_model_name("SmolLM2-135M") == "SmolLM2-135M"


@pytest.mark.parametrize(
    "case",
    [
        "one generation",
        "unknown model",
        "missing model dir",
        "missing data",
        "malformed data",
        "micro-batch not whole groups",
        "eval limit 0",
        "negative early stop",
        "plot without metrics",
        "negative seed",
        "output dir is a file",
        "nothing to resume",
        "unknown reward module",
        "too many weights",
        "prompt field, no data",
        "fewer rows than a step",
        "fsdp alone",
    ],
)
def test_bad_input_gets_a_one_paragraph_error_and_exit_code_2(tmp_path, monkeypatch, capsys, case):
    # never reach for the network
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    argv, expected = bad_input_cases(tmp_path)[case]
    capsys.readouterr()  # building the cases (a saved model) may print: only main's output counts
    with pytest.raises(SystemExit) as exit_info:
        # a case's own --output-dir wins
        trainer.main([*CPU, "--output-dir", str(tmp_path / "run")] + argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.strip().count("\n") == 0
    for text in expected:
        assert text in err


@pytest.mark.slow  # a subprocess or the worker process: over a second
def test_plot_of_a_metrics_line_that_is_a_json_array_exits_2_with_one_paragraph(tmp_path):
    # The old report.py command line printed this paragraph but exited 1; trainer.py --plot, the
    # only command line left, exits 2 as for any bad input.
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n[1, 2]\n')
    done = subprocess.run(
        [sys.executable, "trainer.py", "--plot", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {tmp_path / 'metrics.jsonl'}:2 is not a JSON object")
    assert "Traceback" not in done.stderr


def test_cuda_out_of_memory_names_micro_batch_size_and_gradient_checkpointing(
    tmp_path, monkeypatch, capsys
):
    def oom(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(trainer, "setup", oom)
    with pytest.raises(SystemExit) as exit_info:
        trainer.main([*CPU, "--demo", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert (
        exit_info.value.code == 2
        and "--micro-batch-size" in err
        and "--gradient-checkpointing" in err
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag, value, expected",
    [
        (
            "--max-grad-norm",
            "nan",
            "--max-grad-norm must be a finite number >= 0 (0: no clipping), got nan",
        ),
        ("--max-grad-norm", "-1", "--max-grad-norm must be a finite number >= 0"),
        ("--lr", "inf", "--lr must be a finite number >= 0, got inf"),
        ("--lr", "-1", "--lr must be a finite number >= 0, got -1.0"),
        ("--weight-decay", "nan", "--weight-decay must be a finite number >= 0"),
        ("--temperature", "inf", "--temperature must be a finite number > 0"),
        (
            "--eval-temperature",
            "nan",
            "--eval-temperature must be a finite number >= 0 (0: greedy)",
        ),
        ("--top-p", "0", "--top-p must be a finite number in (0, 1]"),
        ("--top-p", "1.5", "--top-p must be a finite number in (0, 1]"),
        ("--epsilon-high", "-1", "--epsilon-high must be a finite number > 0"),
        ("--beta", "nan", "--beta must be a finite number >= 0"),
        ("--lora-alpha", "nan", "--lora-alpha must be a finite number > 0"),
        ("--delta", "inf", "--delta must be a finite number > 1"),
        ("--warmup-steps", "-1", "--warmup-steps must be at least 0, got -1"),
        ("--top-k", "-5", "--top-k must be at least 0, got -5"),
        ("--eval-every", "-5", "--eval-every must be at least -1, got -5"),
        ("--save-every", "-1", "--save-every must be at least 0, got -1"),
        ("--sample-every", "-1", "--sample-every must be at least 0, got -1"),
        ("--demo-warmup-steps", "-1", "--demo-warmup-steps must be at least 0, got -1"),
        (
            "--reward-timeout",
            "1e12",
            "--reward-timeout must be a finite number in [0, 1e6] seconds",
        ),
        ("--seed", "4294967296", "--seed must be below 2**32"),
        ("--reward-weights", "1,nan", "--reward-weights must be finite numbers"),
        ("--compile", "bogus", "--compile 'bogus' is not a torch.compile backend"),
    ],
)
def test_numeric_flags_refuse_nan_inf_and_out_of_range_before_any_model_loads(
    flag, value, expected, monkeypatch, capsys
):
    # Each used to run (NaN weights, a reversed gradient, no learning) or end in a traceback, some
    # after the model had loaded. Now: one paragraph, exit code 2, and no model is loaded.
    monkeypatch.setattr(models, "load_model", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        trainer.main([*CPU, "--model", "SmolLM2-135M", flag, value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert expected in err

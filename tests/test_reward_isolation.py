"""Reward functions isolated from the run around them (issue 24, item 7; support/sandbox.py): each
gets its own copy of its arguments; whatever it raises (sys.exit, any BaseException but
KeyboardInterrupt) is a reward error; values beyond float32's range are refused by name;
--reward-timeout stops one that hangs. A reward error saves a checkpoint and exits with code 2 and
one paragraph on stderr.

The runs here are real tiny runs through trainer.main on your own JSONL task (helpers.own_task_argv:
4 prompts x G=2 a step), with the reward function loaded by --reward-fn from a module written into
the test's directory.
"""

import json
import signal
import sys
import threading
import time

import pytest
import torch

import config
import data
import rewards
import trainer
from helpers import own_task_argv, read_metrics, tiny_reward_model_dir, write_rows
from support import checkpoint, signals

MODULE = "isolation_rewards"

REWARDS = """
import json, sys, time

class Boom(BaseException):
    pass

entered = []

def quits(completions, answers):
    sys.exit(0)

def booms(completions, answers):
    raise Boom("not an Exception")

def enter():  # the function runs in the worker process: the time it was entered, in a file
    with open("entered.txt", "a") as f:
        f.write(f"{time.time()}\\n")

def sleeps(completions, answers):
    enter()
    time.sleep(3600)

def spins(completions, answers):
    enter()
    while True:
        pass

seen = {"mutates": [], "looks": []}

def mutates(completions, answers, prompts, tags, completion_lengths):
    seen["mutates"].append(json.loads(json.dumps([completions, answers, prompts, tags, completion_lengths])))
    json.dump(seen, open("seen.json", "w"))  # the function runs in the worker process
    completions.reverse()
    completions[0] = "changed"
    for column in (answers, tags):
        for value in column:
            value.append("junk")
    prompts.clear()
    completion_lengths[:] = [0] * len(completion_lengths)
    return [0.0] * len(answers)

def looks(completions, answers, prompts, tags, completion_lengths):
    seen["looks"].append(json.loads(json.dumps([completions, answers, prompts, tags, completion_lengths])))
    json.dump(seen, open("seen.json", "w"))
    return [float(len(c) % 3) for c in completions]
"""


def user_module(tmp_path, monkeypatch):
    """REWARDS as ./isolation_rewards.py, in the working directory tmp_path (--reward-fn's)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{MODULE}.py").write_text(REWARDS)
    monkeypatch.delitem(sys.modules, MODULE, raising=False)


class Hung(BaseException):
    """The safety alarm went off: the run did not stop on its own (as before --reward-timeout)."""


@pytest.fixture
def safety_alarm():
    """A SIGALRM timer of the test's own, 30 s, so that a run that would hang fails instead (Hung);
    a run well under it takes a few seconds. The reward's time limit must put it back: the test
    checks it is still pending after."""

    def hung(signum, frame):
        raise Hung

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    yield hung
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


def stopped_run(argv, capsys):
    """trainer.main(argv), which must exit with code 2 and one paragraph, no traceback: that one."""
    with pytest.raises(SystemExit) as exit_info:
        trainer.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err[-2000:]
    return err


@pytest.mark.parametrize(
    "fn, raised",
    [("quits", "SystemExit: 0 (isolation_rewards.py:10)"), ("booms", "Boom: not an Exception")],
)
def test_a_reward_function_that_calls_sys_exit_or_raises_a_base_exception_saves_and_exits_2_naming_it(
    tmp_path, monkeypatch, capsys, fn, raised
):
    # before: sys.exit(0) ended the run with code 0, no message, no checkpoint; Boom was a traceback
    user_module(tmp_path, monkeypatch)
    err = stopped_run(own_task_argv(tmp_path, "--reward-fn", f"{MODULE}:{fn}"), capsys)
    assert f"error: reward function {fn!r} raised {raised}" in err
    assert "on a batch of 8 completions; called on completion 0 alone it raises too" in err
    # saved before any update: --resume redoes step 1
    assert checkpoint.load_state(str(tmp_path / "run" / "checkpoint"))["step"] == 0


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), signals.Stopped(signal.SIGTERM)])
def test_ctrl_c_and_a_signals_stop_inside_a_reward_function_pass_through_untouched(interrupt):
    calls = []

    def interrupted(completions, answers):
        calls.append(completions)
        raise interrupt

    with pytest.raises(KeyboardInterrupt) as info:
        rewards.score(
            rewards.weighted([("interrupted", interrupted)], [1.0]), ["a", "b"], ["1", "2"]
        )
    # the same exception, and no per-completion search after it (one call)
    assert info.value is interrupt and len(calls) == 1


@pytest.mark.slow
def test_each_reward_function_gets_its_own_copy_of_every_argument_and_later_steps_see_the_data_unchanged(
    tmp_path, monkeypatch
):
    # `mutates` reverses and overwrites the completions, appends to every list-valued answer and
    # field, clears the prompts and zeroes the lengths; `looks`, called after it on the same batch,
    # and both functions at step 2 must see what they would have without it. Before: all of it
    # leaked.
    user_module(tmp_path, monkeypatch)
    rows = [{"prompt": f"{i} + 1 =", "answer": [str(i + 1)], "tags": [f"tag{i}"]} for i in range(4)]
    argv = own_task_argv(
        tmp_path,
        "--data",
        write_rows(tmp_path / "lists.jsonl", rows),
        "--reward-fn",
        f"{MODULE}:mutates",
        "--reward-fn",
        f"{MODULE}:looks",
        *"--steps 2".split(),
    )
    trainer.main(argv)
    seen = json.loads((tmp_path / "seen.json").read_text())  # written in the worker process
    assert len(seen["mutates"]) == len(seen["looks"]) == 2  # one call each per step
    for step in range(2):
        assert seen["looks"][step] == seen["mutates"][step]
        completions, answers, prompts, tags, lengths = seen["looks"][step]
        # each step scores the 4 rows, G = 2 completions each, with the data's answers and fields
        assert len(completions) == len(prompts) == len(lengths) == 8 and all(n > 0 for n in lengths)
        by_prompt = {row["prompt"]: row for row in rows}
        assert answers == [by_prompt[p]["answer"] for p in prompts]
        assert tags == [by_prompt[p]["tags"] for p in prompts]
    # the rewards logged are `looks`'s of the unchanged completions
    assert [row["rewards/looks"] for row in read_metrics(tmp_path / "run")] == [
        pytest.approx(sum(len(c) % 3 for c in seen["looks"][step][0]) / 8) for step in range(2)
    ]


def test_a_task_scored_twice_keeps_its_rows_and_each_completion_gets_its_own_answer():
    def appends(completions, answers, notes):
        for answer, note in zip(answers, notes, strict=True):
            answer.append("junk")
            note["seen"] = True
        return [float(len(a)) for a in answers]

    train_rows = [{"prompt": "p", "answer": ["7"], "fields": {"notes": {"k": 1}}}]
    task = data.Task(
        train=train_rows,
        eval=[],
        template=lambda tokenizer, q: q,
        rewards=rewards.weighted([("appends", appends)], [1.0]),
    )
    before = json.loads(json.dumps(train_rows))
    for _ in range(2):
        total, _ = task.score(train_rows, ["a", "b", "c"], G=3)
        # G = 3 copies of the row's answer, one each: each had one element when the function got it
        assert total.tolist() == [2.0, 2.0, 2.0]
    assert train_rows == before


@pytest.mark.parametrize("value", [1e39, -1e39, 3.5e38])
def test_a_reward_beyond_float32s_range_is_refused_by_name(value):
    # finite as a Python float, inf in float32: it used to pass the finite check, and blame --lr
    def huge(completions, answers):
        return [0.0, value]

    with pytest.raises(config.UserError) as info:
        rewards.score(rewards.weighted([("huge", huge)], [1.0]), ["a", "b"], ["1", "2"])
    assert str(info.value).startswith(
        f"reward function 'huge' returned {value} for completion 1, beyond the range of float32 (±3.403e+38)"
    )
    # the largest float32, and the float just above it that float32 rounds down to it, are accepted
    largest = torch.finfo(torch.float32).max
    for v in (
        largest,
        largest * (1 + 2**-26),
    ):  # a quarter of float32's last step above it: rounds down
        total, _ = rewards.score(rewards.weighted([("big", lambda c, a: [v])], [1.0]), ["a"], ["1"])
        assert total.tolist() == [largest]


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["sleeps", "spins"])
def test_a_hung_reward_function_stops_the_run_at_the_reward_timeout_saves_and_exits_2(
    tmp_path, monkeypatch, capsys, safety_alarm, fn
):
    # time.sleep(3600) and a pure-Python busy loop: before --reward-timeout, both hung the run
    user_module(tmp_path, monkeypatch)
    argv = own_task_argv(tmp_path, "--reward-fn", f"{MODULE}:{fn}", "--reward-timeout", "1")
    err = stopped_run(argv, capsys)
    stopped_after = time.time() - float((tmp_path / "entered.txt").read_text().split()[0])
    assert (
        f"error: reward function {fn!r} (--reward-fn {MODULE}:{fn}) did not return within 1 s "
        "(--reward-timeout) on a batch of 8 completions, and its worker process was killed"
    ) in err
    assert "--reward-timeout SECONDS (0: no limit)" in err
    # 1 s, the worker killed (SIGTERM ends both at once), then the checkpoint of a tiny model
    # (well under a second); 4 s of slack for a busy CPU. The limit runs from the trainer's send,
    # and the function starts (writes entered.txt) only once the worker has read and unpickled the
    # call: on a loaded machine that is tens of milliseconds later (CI saw 0.998 s from entry to
    # the end), so the lower bound allows 0.1 s of it
    assert 0.9 <= stopped_after < 5.0, stopped_after
    assert checkpoint.load_state(str(tmp_path / "run" / "checkpoint"))["step"] == 0
    # the test's own alarm untouched (the worker's limit is kept from outside, without SIGALRM)
    assert signal.getsignal(signal.SIGALRM) is safety_alarm
    assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] < 30.0


@pytest.mark.slow
def test_the_reward_timeout_applies_to_evaluation_too(tmp_path, monkeypatch, capsys, safety_alarm):
    user_module(tmp_path, monkeypatch)
    argv = own_task_argv(tmp_path, "--reward-fn", f"{MODULE}:sleeps", "--reward-timeout", "1")
    err = stopped_run([*argv, "--eval-only", "--eval-data", str(tmp_path / "my.jsonl")], capsys)
    assert (
        f"error: reward function 'sleeps' (--reward-fn {MODULE}:sleeps) did not return within 1 s "
        "(--reward-timeout)"
    ) in err


@pytest.mark.slow
def test_the_search_for_the_completion_a_function_fails_on_stops_at_the_time_limit(safety_alarm):
    # raises on the batch, hangs on each completion alone: the one-at-a-time search must not hang
    def batch_fails_alone_hangs(completions, answers):
        if len(completions) > 1:
            raise ValueError("not on batches")
        time.sleep(3600)

    reward = rewards.Reward("picky", batch_fails_alone_hangs, 1.0, timeout=0.5)
    start = time.monotonic()
    with pytest.raises(config.UserError) as info:
        rewards.score([reward], ["a", "b"], ["1", "2"])
    assert time.monotonic() - start < 3.0  # 0.5 s, and 2.5 s of slack for a loaded machine
    assert (
        "reward function 'picky' raised ValueError: not on batches (test_reward_isolation.py:"
        in str(info.value)
    )
    assert (
        "calling it on each completion alone to find the one it fails on ran out of time; the batch's "
        "first completion began: 'a'." in str(info.value)
    )


@pytest.mark.slow
def test_a_function_that_catches_the_alarm_or_runs_off_the_main_thread_is_refused_once_it_returns_late():
    # in the main thread: the alarm is caught (a bare except), then the function returns too late
    def swallows(completions, answers):
        try:
            time.sleep(0.5)
        except BaseException:
            time.sleep(0.1)
        return [1.0] * len(completions)

    slow = rewards.Reward("swallows", swallows, 1.0, timeout=0.2)
    with pytest.raises(config.UserError, match=r"'swallows' did not return within 0.2 s"):
        rewards.score([slow], ["a"], ["1"])
    # off the main thread no alarm is set (the SIGALRM handler stays as it is): refused on return
    errors, handler = [], signal.getsignal(signal.SIGALRM)

    def score_in_a_thread():
        try:
            rewards.score([slow._replace(fn=lambda c, a: time.sleep(0.4) or [1.0])], ["a"], ["1"])
        except config.UserError as e:
            errors.append(str(e))

    thread = threading.Thread(target=score_in_a_thread)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "did not return within 0.2 s" in errors[0]
    assert signal.getsignal(signal.SIGALRM) is handler
    # 0: no limit
    total, _ = rewards.score([slow._replace(timeout=0.0)], ["a"], ["1"])
    assert total.tolist() == [1.0]


@pytest.mark.slow
def test_a_timer_of_your_own_that_expires_during_a_reward_call_goes_off_right_after_it():
    fired, done = [], []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(time.monotonic()))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)

        def slowish(completions, answers):
            time.sleep(0.3)  # the reward's own alarm replaces the 0.1 s timer meanwhile
            done.append(time.monotonic())
            return [1.0]

        rewards.score([rewards.Reward("slowish", slowish, 1.0, timeout=5.0)], ["a"], ["1"])
        time.sleep(0.1)
        # once, right after the function: re-armed with 1 microsecond as the call ends (0.1 s slack)
        assert len(fired) == 1 and done[0] <= fired[0] < done[0] + 0.1
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_reward_timeout_flag_reaches_every_reward_function_and_model(tmp_path):
    args = config.parse_args(
        own_task_argv(
            tmp_path,
            *"--reward-fn format --reward-model".split(),
            tiny_reward_model_dir(tmp_path),
            *"--reward-timeout 7".split(),
        )
    )
    assert [(r.name, r.timeout) for r in rewards.from_flags(args, [])] == [
        ("format", 7.0),
        ("tiny-rm", 7.0),
    ]
    default = config.parse_args(own_task_argv(tmp_path))
    assert [
        r.timeout for r in rewards.from_flags(default, [("format", rewards.format_reward)])
    ] == [rewards.DEFAULT_TIMEOUT]
    assert default.reward_timeout == rewards.DEFAULT_TIMEOUT == 600.0


def test_a_reward_function_that_sets_its_own_alarm_as_math_verify_does_still_works():
    # math_verify's timeout: its own SIGALRM handler and signal.alarm around each parse, then
    # alarm(0) and the handler put back. Run in the main thread (no worker thread, where
    # signal.signal raises), it works as it would alone.
    class ParseTimeout(Exception):
        pass

    def own_alarm(completions, answers):
        def handler(signum, frame):
            raise ParseTimeout

        previous = signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        try:
            while True:  # a parse that takes too long: its own alarm ends it
                pass
        except ParseTimeout:
            return [0.5] * len(completions)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    # What was armed before is armed after: nothing, or a timer of the test runner's own
    # (pytest-timeout's signal method arms one per test), still counting down.
    handler = signal.getsignal(signal.SIGALRM)
    before, _ = signal.getitimer(signal.ITIMER_REAL)
    total, _ = rewards.score(
        [rewards.Reward("own_alarm", own_alarm, 1.0, timeout=5.0)], ["a"], ["1"]
    )
    assert total.tolist() == [0.5]
    assert signal.getsignal(signal.SIGALRM) is handler
    after, interval = signal.getitimer(signal.ITIMER_REAL)
    assert interval == 0.0
    if before == 0.0:
        assert after == 0.0
    else:  # restored, less the time the call took (well under a second)
        assert before - 1.0 < after <= before

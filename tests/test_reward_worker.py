"""User code in a worker process (support/worker.py): --reward-fn and --extract-answer
MODULE:FUNCTION that hang, ignore every signal, exit the process, fill memory or parse the
trainer's flags at import time. Each run ends by itself, with one paragraph naming the function;
training so far is saved, and --resume with a function that no longer fails ends bit-identical to a
run that never failed."""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, assert_same_run, own_task_argv, read_metrics, wait_for
from support import checkpoint, worker

# Each fails at step 2 while ./fail exists (so --resume, with it gone, scores as `steady`).
MODULE = """
import os, time
def failing():
    return os.path.exists("fail") and os.path.exists("step1-done")
def steady(completions, answers):
    if os.path.exists("fail"):
        open("step1-done", "w").close()
    return [float(len(c) % 3) for c in completions]
def stubborn(completions, answers):
    if failing():
        open("hung", "w").close()  # the marker: the call that hangs has begun
        while True:
            try:
                time.sleep(3600)
            except BaseException:
                pass
    return steady(completions, answers)
def exits(completions, answers):
    if failing():
        os._exit(0)
    return steady(completions, answers)
def greedy(completions, answers):
    if failing():
        hoard = bytearray(64 * 2**30)
    return steady(completions, answers)
"""


def train_py(tmp_path, *argv, sigterm_at=None):
    """python trainer.py ARGV in tmp_path (where my_rewards.py is); SIGTERM as soon as the file
    `sigterm_at` exists in tmp_path (the marker its reward function writes). Returns (exit code,
    stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "trainer.py"), *argv],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if sigterm_at is not None:
        wait_for((tmp_path / sigterm_at).exists, proc, f"its reward function wrote {sigterm_at}")
        proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=300)[1]
    return proc.returncode, err, time.monotonic() - start


def failing_then_resumed(tmp_path, fn, *extra, sigterm_at=None):
    """A 3-step run whose reward `fn` fails at step 2, then --resume with it no longer failing;
    compared with a run that never failed. Returns (exit code, stderr) of the failing run."""
    (tmp_path / "my_rewards.py").write_text(MODULE)
    (tmp_path / "fail").touch()
    argv = own_task_argv(tmp_path, "--reward-fn", f"my_rewards:{fn}", "--steps", "3", *extra)
    code, err, seconds = train_py(tmp_path, *argv, sigterm_at=sigterm_at)
    print(f"{fn}: exit {code} after {seconds:.1f} s")
    assert checkpoint.load_state(str(tmp_path / "run" / "checkpoint"))["step"] == 1
    (tmp_path / "fail").unlink()
    assert train_py(tmp_path, *argv, "--resume")[0] == 0, "resume"
    straight = [*argv, "--output-dir", str(tmp_path / "straight")]
    assert train_py(tmp_path, *straight)[0] == 0
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1, 2, 3]
    assert_same_run(tmp_path / "straight", tmp_path / "run")
    return code, err


@pytest.mark.slow
def test_a_reward_that_catches_baseexception_forever_is_killed_at_the_timeout_and_exits_2(tmp_path):
    code, err = failing_then_resumed(tmp_path, "stubborn", "--reward-timeout", "2")
    assert code == 2 and "Traceback" not in err
    assert (
        "error: reward function 'stubborn' (--reward-fn my_rewards:stubborn) did not return within "
        "2 s (--reward-timeout)" in err
    )


@pytest.mark.slow
def test_sigterm_while_waiting_on_a_hung_reward_stops_at_once_saved_and_exits_143(tmp_path):
    # SIGTERM once `stubborn` has begun the call that hangs (it writes ./hung): before, 1 s after
    # step 1's reward, which under load came before step 2's call began
    code, err = failing_then_resumed(tmp_path, "stubborn", sigterm_at="hung")
    assert code == 143
    assert "SIGTERM: stopping at once, during a call to the worker process (ended)" in err


@pytest.mark.slow
def test_os_exit_inside_a_reward_exits_2_naming_it(tmp_path):
    code, err = failing_then_resumed(tmp_path, "exits")
    assert code == 2
    assert (
        "error: reward function 'exits' (--reward-fn my_rewards:exits) ended its worker process: "
        "it exited with code 0" in err
    )


@pytest.mark.slow
def test_a_huge_allocation_under_the_memory_limit_exits_2_naming_it(tmp_path):
    code, err = failing_then_resumed(tmp_path, "greedy", "--reward-memory", "2")
    assert code == 2
    assert "error: reward function 'greedy' raised MemoryError" in err


@pytest.mark.slow  # a subprocess or the worker process: over a second
def test_argparse_at_import_is_one_paragraph_naming_the_flag_and_module(tmp_path, monkeypatch):
    (tmp_path / "cli_rewards.py").write_text(
        "import argparse\nargparse.ArgumentParser().parse_args()\ndef f(c, a):\n    return c\n"
    )
    argv = own_task_argv(tmp_path, "--reward-fn", "cli_rewards:f")
    code, err, _ = train_py(tmp_path, *argv)
    assert code == 2
    assert (
        "error: --reward-fn cli_rewards:f: importing cli_rewards for --reward-fn raised "
        "SystemExit(2)" in err
    )


@pytest.mark.slow  # a subprocess or the worker process: over a second
def test_an_extractor_that_hangs_is_stopped_at_the_timeout_and_named(tmp_path):
    (tmp_path / "hangs.py").write_text(
        "import time\ndef answer(completion):\n    while True:\n        try:\n"
        "            time.sleep(3600)\n        except BaseException:\n            pass\n"
    )
    w = worker.Worker()
    try:
        fn = w.load("hangs:answer", "--extract-answer", str(tmp_path))
        fn.timeout = 1.0
        import evaluation
        from support.errors import UserError

        start = time.monotonic()
        with pytest.raises(
            UserError, match="--extract-answer hangs:answer did not return within 1 s"
        ):
            evaluation.answer_of(fn, "7")
        assert time.monotonic() - start < 1.0 + worker.TERM_GRACE_S + 2
        assert w.process is None  # ended
    finally:
        w.close()


def test_a_signal_while_a_call_is_being_sent_stops_at_once_as_one_during_the_call(tmp_path, capsys):
    # The trainer counts as waiting on the worker from the send on: the child may begin the call
    # (and a hung one write its marker, test_sigterm_while_waiting_...) as soon as it is sent.
    # Before, a signal between the send and the wait was a request for the step's end, so the run
    # went on waiting on the call it had just sent.
    from support import signals

    (tmp_path / "quick.py").write_text("def f(c, a):\n    return [1.0] * len(c)\n")
    w = worker.Worker()
    try:
        fn = w.load("quick:f", "--reward-fn", str(tmp_path))
        send = w.send

        def signalled_send(message):
            if message[0] == "call":
                os.kill(os.getpid(), signal.SIGTERM)
            send(message)

        w.send = signalled_send
        with pytest.raises(signals.Stopped) as info:
            with signals.STOPS:
                fn(["a"], ["1"])
        assert info.value.exit_code == 143 and w.process is None  # the child ended
        err = capsys.readouterr().err
        assert "SIGTERM: stopping at once, during a call to the worker process (ended)" in err
        assert signals.STOPS.signum is None  # forgotten: the next run starts clean
    finally:
        w.close()


def test_the_worker_keeps_order_coerces_values_and_restarts_after_a_kill(tmp_path):
    (tmp_path / "vals.py").write_text(
        "import decimal\ndef mixed(c, a):\n    return (x for x in [True, 2, decimal.Decimal('0.5')])\n"
    )
    from rewards import Reward
    from support import sandbox

    w = worker.Worker()
    try:
        fn = w.load("vals:mixed", "--reward-fn", str(tmp_path))
        r = Reward("mixed", fn, 1.0, 5.0)
        assert sandbox.call_reward(r, ["a", "b", "c"], [1, 2, 3], {}).tolist() == [1.0, 2.0, 0.5]
        w.process.kill()
        w.process.wait()
        assert sandbox.call_reward(r, ["a", "b", "c"], [1, 2, 3], {}).tolist() == [1.0, 2.0, 0.5]
    finally:
        w.close()


@pytest.mark.slow  # a subprocess that imports the trainer: seconds
def test_a_worker_left_open_ends_with_the_program_without_a_traceback():
    # a program that keeps a started worker to its end (a script that builds a task with --env, a
    # notebook): the worker is ended at exit, and nothing is printed. Before, the worker's __del__
    # ran after the interpreter had cleared support/worker.py's globals, and every such exit printed
    # "Exception ignored in: <function Worker.__del__ ...> ... 'NoneType' object has no attribute
    # 'close'". The shop task's environment starts the worker as the trainer builds the task.
    program = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import config, tools, trainer\n"
        "task = trainer.load_task(config.parse_args(['--model', 'unused', '--task', 'shop']))\n"
        "print(task.tools.environment.cls.worker.process.pid)\n"
    )
    done = subprocess.run([sys.executable, "-c", program, ROOT], capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    # ended and reaped before the program's exit (close() waits for it), not left to notice alone
    assert not os.path.exists(f"/proc/{int(done.stdout)}")

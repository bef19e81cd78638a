"""The worker process (support/worker.py) and the process's own limits: --reward-memory checked
before any model loads and never above the hard address-space limit the trainer runs under (a
cluster's ulimit -v), for --reward-fn, --extract-answer and --tool alike; and the worker's end: it
dies with the trainer, however the trainer ends, and a tool that forks neither keeps the worker's
pipe open (a death seen as a hang) nor outlives the worker's end."""

import os
import resource
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import config
from helpers import CPU, ROOT
from support import worker
from support.errors import UserError

# A hard address-space limit below --reward-memory's default of 32 GiB, as `ulimit -v 16000000`
# (KiB) sets it: both limits, soft and hard.
LOWERED = 16_000_000 * 1024


def lowered_limit():
    """preexec_fn: the child's hard (and soft) RLIMIT_AS at LOWERED, as ulimit -v sets it."""
    resource.setrlimit(resource.RLIMIT_AS, (LOWERED, LOWERED))


@pytest.mark.parametrize("value", ["1e30", "1e10", "-1", "0.01", "1e-9", "nan", "inf"])
def test_reward_memory_out_of_range_is_one_line_before_any_model_loads(value):
    with pytest.raises(UserError) as refused:
        config.parse_args([*CPU, "--demo", "--reward-memory", value, "--output-dir", "/tmp/x"])
    message = str(refused.value)
    assert message.startswith("--reward-memory must be a finite number of GiB in [1, 1048576]")
    assert "\n" not in message and "0 for no limit" in message


def test_reward_memory_that_is_not_a_number_is_one_line_and_exit_2(capsys):
    # argparse's own refusal, without the usage of every flag before it
    with pytest.raises(SystemExit) as stop:
        config.parse_args([*CPU, "--demo", "--reward-memory", "abc"])
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(
        ": error: argument --reward-memory: invalid float value: 'abc' (--help lists the flags)."
    )


@pytest.mark.parametrize("value", ["0", "1", "32", "1048576"])
def test_reward_memory_in_range_or_0_is_taken(value):
    args = config.parse_args([*CPU, "--demo", "--reward-memory", value, "--output-dir", "/tmp/x"])
    assert args.reward_memory == float(value)


LIMITS = """
import resource

def address_space(*args):
    return repr(resource.getrlimit(resource.RLIMIT_AS))
"""


@pytest.mark.slow  # a subprocess or the worker process: over a second
def test_under_a_lower_hard_limit_each_worker_takes_it_and_the_run_says_so_once(tmp_path):
    # the trainer's side alone (no model): two workers, as --reward-fn and --extract-answer (or
    # --tool) each start one, under a hard limit of 15.26 GiB
    (tmp_path / "limits.py").write_text(LIMITS)
    script = textwrap.dedent(
        """
        import os
        from support.worker import Worker

        for flag in ("--reward-fn", "--extract-answer", "--tool"):
            fn = Worker(32.0).load("limits:address_space", flag, os.getcwd())
            print(flag, fn())
        fn = Worker(2.0).load("limits:address_space", "--reward-fn", os.getcwd())
        print("2 GiB", fn())
        fn = Worker(0).load("limits:address_space", "--reward-fn", os.getcwd())
        print("none", fn())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=ROOT),
        preexec_fn=lowered_limit,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    note = (
        "--reward-memory 32 GiB is above this process's hard address-space limit (15.26 GiB: "
        "ulimit -v, or the cluster's): the worker process gets 15.26 GiB"
    )
    assert done.stdout.splitlines() == [
        note,
        f"--reward-fn ({LOWERED}, {LOWERED})",
        f"--extract-answer ({LOWERED}, {LOWERED})",
        f"--tool ({LOWERED}, {LOWERED})",
        f"2 GiB ({2 * 2**30}, {2 * 2**30})",  # below the hard limit: asked for, taken
        f"none ({LOWERED}, {LOWERED})",  # 0: no limit of its own; the inherited one stands
    ]


@pytest.mark.slow
def test_the_demo_trains_under_a_lowered_hard_limit_with_each_kind_of_worker(tmp_path):
    # ulimit -v 16000000, as SLURM sets it: --reward-fn, --extract-answer and --tool by import
    # path each start a worker (each used to end in "ValueError: not allowed to raise maximum
    # limit"); the run trains, and says once which limit the workers got.
    (tmp_path / "limits.py").write_text(
        LIMITS + "\ndef limited(completions, answers):\n"
        "    open('reward-limit', 'w').write(address_space())\n"
        "    return [float(len(c) % 3) for c in completions]\n"
    )
    argv = [*CPU, "--demo", "--demo-warmup-steps", "0", "--tool", "support.calculator:calculator"]
    argv += ["--reward-fn", "rewards:last_number_reward", "--reward-fn", "limits:limited"]
    argv += ["--extract-answer", "rewards:last_number", "--steps", "2", "--eval-every", "-1"]
    argv += "--batch-size 2 --gradient-accumulation-steps 2 --num-generations 4".split()
    argv += ["--sample-every", "0", "--output-dir", str(tmp_path / "run")]
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "trainer.py"), *argv],
        cwd=tmp_path,
        preexec_fn=lowered_limit,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    said = [line for line in done.stdout.splitlines() if line.startswith("--reward-memory")]
    assert said == [
        "--reward-memory 32 GiB is above this process's hard address-space limit (15.26 GiB: "
        "ulimit -v, or the cluster's): the worker process gets 15.26 GiB"
    ]
    assert (tmp_path / "reward-limit").read_text() == f"({LOWERED}, {LOWERED})"
    assert "step 2/2" in done.stdout


# --------------------------------------------------------------------------------------------------
# The worker's end.

FORKS = """
import os, signal, time

def write_pid(directory, name, pid):
    with open(os.path.join(directory, name + ".tmp"), "w") as f:
        f.write(str(pid))
    os.rename(os.path.join(directory, name + ".tmp"), os.path.join(directory, name))

def forked_child(directory):
    # a child of the tool, holding the worker's pipes as any fork does; its pid in a file
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
        os._exit(0)
    write_pid(directory, "grandchild.pid", pid)

def hangs(directory):
    # the worker's pid (the marker that the tool runs), then a hang deaf to SIGTERM
    forked_child(directory)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    write_pid(directory, "worker.pid", os.getpid())
    while True:
        time.sleep(1)

def dies(directory):
    forked_child(directory)
    os._exit(3)
"""


def gone(pid):
    """Whether process `pid` has ended (a zombie awaiting its reaper counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(condition, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def clean_up(directory):
    """Whatever a failed test left: the worker's process group (it leads its own), the tool's
    child."""
    for name, kill in (("worker.pid", os.killpg), ("grandchild.pid", os.kill)):
        if (directory / name).exists():
            try:
                kill(int((directory / name).read_text()), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")


@pytest.mark.slow  # a subprocess or the worker process: over a second
@needs_proc
def test_sigkill_of_the_trainer_during_a_hung_tool_ends_the_worker(tmp_path):
    (tmp_path / "forks.py").write_text(FORKS)
    trainer_like = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os\nfrom support.worker import Worker\n"
            "fn = Worker(0).load('forks:hangs', '--tool', os.getcwd())\n"
            "fn.call((os.getcwd(),), {}, 0)\n",
        ],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    try:
        # the marker: the tool is running (and hung) in the worker
        assert wait_until(lambda: (tmp_path / "worker.pid").exists(), 60)
        pid = int((tmp_path / "worker.pid").read_text())
        trainer_like.kill()
        trainer_like.wait()
        assert wait_until(lambda: gone(pid), 10), "the worker outlived the trainer's SIGKILL"
    finally:
        trainer_like.kill()
        clean_up(tmp_path)


@needs_proc
def test_a_tool_that_forks_then_dies_is_named_at_once_and_its_child_ends_with_the_worker(
    tmp_path,
):
    # the forked child keeps the worker's pipe open: end-of-file never comes, and the wait had no
    # end (no time limit) or named a timeout; now the worker's death is seen and named
    (tmp_path / "forks.py").write_text(FORKS)
    w = worker.Worker(0)
    try:
        fn = w.load("forks:dies", "--tool", str(tmp_path))
        start = time.monotonic()
        with pytest.raises(worker.WorkerFailed, match="it exited with code 3"):
            fn.call((str(tmp_path),), {}, 0)
        assert time.monotonic() - start < 10
        assert w.process is None  # ended, with its process group
        child = int((tmp_path / "grandchild.pid").read_text())
        assert wait_until(lambda: gone(child), 10), "the tool's child outlived the worker's end"
    finally:
        w.close()
        clean_up(tmp_path)


@pytest.mark.slow  # a subprocess or the worker process: over a second
@needs_proc
def test_a_hung_tool_past_its_timeout_is_ended_with_the_children_it_forked(tmp_path):
    (tmp_path / "forks.py").write_text(FORKS)
    w = worker.Worker(0)
    try:
        fn = w.load("forks:hangs", "--tool", str(tmp_path))
        with pytest.raises(worker.WorkerTimeout, match="did not return within 1 s"):
            fn.call((str(tmp_path),), {}, 1.0)
        pid = int((tmp_path / "worker.pid").read_text())
        child = int((tmp_path / "grandchild.pid").read_text())
        assert wait_until(lambda: gone(pid) and gone(child), 10)
    finally:
        w.close()
        clean_up(tmp_path)

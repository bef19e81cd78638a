"""A newcomer's first hour: the README's --demo commands run as typed, in the order printed, in one
working directory; runs without --output-dir get a directory each, and --resume without it finds the
last run like it; the benchmark against TRL, run without TRL, says how to get it.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest

import config
from helpers import ROOT, torchrun_env
from support import rundir

SHORT = ["--steps", "2", "--demo-warmup-steps", "10"]  # each command's run, kept short
SHORT_REFERENCE = ["--steps", "2"]  # train.py takes no --demo-warmup-steps


def readme_demo_commands():
    """Every command in the README's code blocks that runs `train.py --demo` or `trainer.py --demo`,
    in order, as typed:
    the part after `pip install ... &&`, without the trailing comment."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    commands = []
    for line in (line for block in blocks for line in block.splitlines()):
        command = line.split(" #")[0].split("&&")[-1].strip()
        if "train.py --demo" in command or "trainer.py --demo" in command:
            commands.append(shlex.split(command))
    return commands


def as_run_here(command):
    """A README command run from another working directory: train.py and trainer.py by their
    paths in the repository, python as this interpreter, torchrun as its module."""
    program, rest = (
        command[0],
        [os.path.join(ROOT, a) if a in ("train.py", "trainer.py") else a for a in command[1:]],
    )
    if program == "python":
        return [sys.executable, *rest]
    if program == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *rest]
    raise AssertionError(f"a README --demo command starts with {program}")


def test_the_readme_has_its_demo_commands_where_the_walk_expects_them():
    commands = readme_demo_commands()
    assert [c[0] for c in commands] == ["python"] * 5 + ["torchrun"]
    assert commands[0] == ["python", "train.py", "--demo"]  # the quickstart's, first


@pytest.mark.slow
def test_every_readme_demo_command_runs_as_typed_in_order_in_one_directory(tmp_path):
    # Before: the second command into the quickstart's fixed runs/demo-seed42 was refused (exit 2).
    env = {**torchrun_env(), "OMP_NUM_THREADS": "1"}
    for command in readme_demo_commands():
        done = subprocess.run(
            as_run_here(command) + (SHORT_REFERENCE if "train.py" in command else SHORT),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, (command, done.stderr[-2000:])
    runs = sorted(os.listdir(tmp_path / "runs"))
    assert len(runs) == 6 and all(re.fullmatch(r"demo(-lora)?-\d{8}-\d{6}(-\d+)?", r) for r in runs)


def test_a_new_run_gets_a_new_directory_and_a_suffix_when_the_second_is_taken(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    args = config.parse_args(["--demo", "--device", "cpu"])
    assert re.fullmatch(r"runs/demo-\d{8}-\d{6}", args.output_dir)
    now = 1764060000.0  # any fixed time: the name is the local date and time of it
    first = rundir.new_run_dir(args, now)
    os.makedirs(first)
    second = rundir.new_run_dir(args, now)
    os.makedirs(second)
    assert second == first + "-2" and rundir.new_run_dir(args, now) == first + "-3"
    lora = config.parse_args(["--task", "addition", "--lora-rank", "4", "--model", "org/Name"])
    assert re.fullmatch(r"runs/Name-addition-lora-\d{8}-\d{6}", lora.output_dir)


@pytest.mark.slow
def test_resume_without_output_dir_continues_the_last_run_like_this_one(
    tmp_path, monkeypatch, capsys
):
    import trainer

    monkeypatch.chdir(tmp_path)
    demo = ["--demo", "--device", "cpu", "--eval-every", "-1", *SHORT]
    trainer.main(demo)
    trainer.main([*demo, "--seed", "7"])  # another seed: not like the runs below
    trainer.main(demo)
    # the newest: a --tool run of the demo, which a resume without --tool must not take (it did,
    # matching only demo, model, task, LoRA rank and seed, then failed on the other vocabulary)
    trainer.main([*demo, "--tool", "calculator"])
    first, other, last, tool = sorted(os.listdir("runs"))  # by time (a second apart, or -2)
    capsys.readouterr()
    trainer.main([*demo, "--resume"])  # the run as it finished: nothing to train, said so
    out = capsys.readouterr().out
    steps = SHORT[SHORT.index("--steps") + 1]
    assert f"--resume: continuing runs/{last}, the last run of demo with these flags" in out
    assert (
        f"the run is complete ({steps} of {steps} steps): nothing to train; pass --steps N" in out
    )
    trainer.main([*demo, "--resume", "--steps", "3"])
    out = capsys.readouterr().out
    assert f"--resume: continuing runs/{last}, the last run of demo with these flags" in out
    assert "resumed from" in out and f"output runs/{last}" in out
    # the header's second line: what the run trains and evaluates on
    assert (
        "data: train 100 rows from the demo's 100 problems; held-out 100 rows from the demo's 100 "
        "problems (the ones it trains on)\n"
    ) in out
    with pytest.raises(SystemExit) as info:
        trainer.main([*demo, "--resume", "--seed", "8"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "error: --resume: no run like this one (demo, seed 8, these flags) with a checkpoint in "
        "runs/. Runs of the same model whose flags differ (those named): "
    )
    assert f"runs/{other} (--seed)" in err and f"runs/{tool} (--seed, " in err
    assert "--tool" in err.split(f"runs/{tool} (")[1].split(")")[0]
    assert err.endswith(
        "Pass the --output-dir of the run to continue (with its flags), or drop --resume to start "
        "a new one.\n"
    )
    assert err.count("\n") == 1


@pytest.mark.slow
def test_under_torchrun_a_user_error_is_said_once_and_every_rank_exits_with_2(tmp_path):
    # Before: one paragraph per rank, and the rank torchrun stopped first exited with -15 (SIGTERM).
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [os.path.join(ROOT, "trainer.py"), "--demo", "--data", "rows.jsonl"],
        cwd=tmp_path,
        env=torchrun_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert done.stderr.count("error: --demo brings its own task; drop --data") == 1
    # torchrun's own report: each rank's exit code
    assert sorted(re.findall(r"exitcode\s+: (-?\d+)", done.stderr)) == ["2", "2"]


# scripts.bench's main, called here in-process: --threads 0 leaves this process's torch threads be
NO_THREADS = ["--threads", "0"]


@pytest.mark.parametrize("flag", ["--vs-trl", "--parity"])
@pytest.mark.parametrize("bench_python", ["this python, without trl", "a path that is not there"])
def test_the_benchmark_against_trl_without_trl_is_one_paragraph_and_exit_2_before_any_worker(
    tmp_path, monkeypatch, capsys, flag, bench_python
):
    # Before (issue 43): ModuleNotFoundError: No module named 'trl' and a worker's traceback.
    from scripts import bench

    if bench_python.startswith("this python"):
        if (
            subprocess.run([sys.executable, "-c", "import trl"], capture_output=True).returncode
            == 0
        ):
            pytest.skip("trl is installed here: this Python would run TRL's side")
        python = sys.executable
    else:
        python = str(tmp_path / "no-such-venv" / "bin" / "python")
    monkeypatch.setenv("BENCH_PYTHON", python)
    started = []
    monkeypatch.setattr(bench, "run_worker", lambda a, name, *extra: started.append(name))
    monkeypatch.setattr(sys, "argv", ["bench.py", flag, "--config", "tiny", *NO_THREADS])
    with pytest.raises(SystemExit) as info:
        bench.main()
    assert info.value.code == 2 and started == []  # before any worker
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} needs TRL, which runs in its own environment")
    assert err.count("\n") == 1 and "Traceback" not in err  # one paragraph
    assert f"BENCH_PYTHON={python}" in err or f"BENCH_PYTHON={python!r}" in err
    assert "`python -m venv benchvenv && benchvenv/bin/pip install torch==2.13.0 " in err
    assert "transformers==5.23.0 numpy trl==1.16.0`" in err
    assert "then pass it: `BENCH_PYTHON=benchvenv/bin/python python -m scripts.bench " in err
    # the commands are the module docstring's, and its pins are requirements.txt's
    assert all(f"    {line}\n" in bench.__doc__ for line in bench.TRL_VENV)
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pins = re.findall(r"^((?:torch|transformers)==\S+)$", f.read(), re.M)
    assert len(pins) == 2 and all(pin in bench.TRL_VENV[1] for pin in pins)


def test_the_benchmark_against_trl_goes_on_where_bench_python_imports_trl(tmp_path, monkeypatch):
    # a stand-in for benchvenv/bin/python whose `import trl` succeeds: the check lets the run go on
    from scripts import bench

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("BENCH_PYTHON", str(fake))

    class Started(Exception):
        pass

    def run_worker(a, name, *extra):
        raise Started(name)

    monkeypatch.setattr(bench, "run_worker", run_worker)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--parity", *NO_THREADS])
    with pytest.raises(Started, match="parity"):
        bench.main()

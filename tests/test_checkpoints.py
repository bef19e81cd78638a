"""The output directory and the files in it: one run per directory (a refusal naming it and the ways
on, --overwrite, a lock while a run is live that a killed run does not leave held), a full disk in
any write (the errors the libraries really raise: a file size limit in process, a small tmpfs where
the test can mount one), a read-only directory, damaged checkpoints and metrics.jsonl on --resume,
and a save refusing non-finite weights.
"""

import contextlib
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers.modeling_utils
from transformers.tokenization_utils_tokenizers import TokenizersBackend

import config
import trainer
from helpers import CPU, ROOT, read_metrics, tiny_argv, without_time
from support import checkpoint, report
from support.errors import UserError


def run_main(out_dir, *extra):
    """trainer.main on tiny_argv's demo run, --save-every 1: the exit code (0 when it returned) and
    the run's result."""
    try:
        return 0, trainer.main(tiny_argv(out_dir, "--save-every", "1", *extra))
    except SystemExit as e:
        return e.code, None


def one_paragraph(capsys):
    """stderr of a refused run: asserted to be one "error: " paragraph, no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def no_model_may_load(monkeypatch):
    """trainer.setup (the data, the rewards, then the model) fails the test if called."""
    monkeypatch.setattr(trainer, "setup", lambda *a: pytest.fail("the model was loaded"))


def snapshot(directory):
    """{relative path: bytes} of every file under `directory`."""
    files = [Path(root, name) for root, _, names in os.walk(directory) for name in names]
    return {str(file.relative_to(directory)): file.read_bytes() for file in files}


def step_of(path):
    return checkpoint.load_state(str(path))["step"]


# --- one run per output directory
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_fresh_run_into_a_directory_holding_a_run_is_refused_naming_it_before_the_model_loads(
    tmp_path, monkeypatch, capsys
):
    """The same command typed twice into one --output-dir used to truncate the first run's
    metrics.jsonl at start and replace its checkpoint at the first save."""
    run = tmp_path / "run"
    assert run_main(run, "--steps", "2")[0] == 0
    before = snapshot(run)
    no_model_may_load(monkeypatch)
    capsys.readouterr()
    assert run_main(run, "--steps", "2")[0] == 2
    assert one_paragraph(capsys) == (
        f"error: --output-dir {run} already holds a run (metrics.jsonl with 2 rows, the last at step 2; checkpoint/ "
        "at step 2), and a fresh run would replace it. Pass --resume to continue that run, another --output-dir to "
        "start a new one beside it, or --overwrite to delete it and start over."
    )
    assert snapshot(run) == before  # untouched, and no .lock left behind
    # checkpoint.old alone (a kill between a save's two renames) is a run too
    os.replace(run / "checkpoint", run / "checkpoint.old")
    (run / "metrics.jsonl").write_text("")
    assert run_main(run)[0] == 2
    assert "already holds a run (checkpoint.old/ at step 2)" in one_paragraph(capsys)


@pytest.mark.slow
def test_overwrite_removes_the_earlier_run_before_the_model_loads_so_a_ctrl_c_leaves_no_mix(
    tmp_path, monkeypatch, capsys
):
    """Before, the old checkpoint stayed until the new run's first save while metrics.jsonl was
    truncated at start: a Ctrl-C in between left the old weights beside the new run's log. Now
    the old files go before the model loads."""
    run = tmp_path / "run"
    assert run_main(run, "--steps", "1")[0] == 0
    shutil.copytree(run / "checkpoint", run / "checkpoint.old")
    (run / "checkpoint.tmp").mkdir()
    assert (run / "curves.png").exists()
    # the trackers' state too: a later --resume --report-to would otherwise continue the overwritten
    # run's
    (run / "tensorboard").mkdir()
    (run / "wandb_run_id").write_text("old-run\n")

    def ctrl_c_while_the_model_loads(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "setup", ctrl_c_while_the_model_loads)
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        run_main(run, "--overwrite")
    assert os.listdir(run) == []  # the earlier run's files, and the lock
    assert capsys.readouterr().out == (
        f"--overwrite: removed the earlier run in {run} (metrics.jsonl with 1 row, the last at step 1; checkpoint/ "
        "at step 1; checkpoint.old/ at step 1)\n"
    )
    monkeypatch.undo()
    assert run_main(run, "--steps", "1")[0] == 0  # nothing left to refuse
    assert [row["step"] for row in read_metrics(run)] == [1]


@pytest.mark.slow
def test_a_live_run_holds_its_directory_and_a_killed_one_blocks_nothing(tmp_path, capsys):
    """A second process into a live run's directory (fresh or --resume) is refused naming the
    holder; --eval-only and --plot write no run and take no lock. SIGKILL leaves .lock behind,
    but the kernel dropped the flock: --resume goes on."""
    run = tmp_path / "run"
    live = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "trainer.py"),
            *tiny_argv(run, "--steps", "100000", "--save-every", "1"),
        ],
        cwd=ROOT,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in live.stdout:  # until its first checkpoint is saved
            if line.startswith("saved "):
                break
        else:
            pytest.fail(f"the live run ended before its first save (exit code {live.wait()})")
        holder = f"pid {live.pid} on {socket.gethostname()}, since "
        for extra in ([], ["--resume"]):
            assert run_main(run, *extra)[0] == 2
            err = one_paragraph(capsys)
            assert f"error: --output-dir {run} is in use: a run is live there ({holder}" in err
            assert (
                f"holds {run}/.lock). Wait for it to end" in err
                and "or pass another --output-dir" in err
            )
        assert run_main(run, "--eval-only", "--eval-limit", "2", "--eval-samples", "1")[0] == 0
        assert trainer.main(["--device", "cpu", "--plot", str(run)]) in (
            str(run / "curves.png"),
            None,
        )
        assert (run / ".lock").read_text().startswith(holder)  # still the live run's
    finally:
        live.kill()
        live.wait()
    assert live.returncode == -signal.SIGKILL and (run / ".lock").exists()
    step = step_of(checkpoint.find_last(str(run)))
    assert run_main(run, "--resume", "--steps", str(step + 1))[0] == 0
    assert step_of(run / "checkpoint") == step + 1
    assert not (run / ".lock").exists()  # a run that ends removes it


@pytest.mark.parametrize("case", ["a file in the way", "read-only directory"])
def test_an_output_dir_that_cannot_be_written_is_refused_before_the_model_loads(
    tmp_path, monkeypatch, capsys, case
):
    if case == "a file in the way":
        (tmp_path / "file").write_text("not a directory")
        run, reason = tmp_path / "file" / "run", "Not a directory"
    else:
        if os.geteuid() == 0:
            pytest.skip(
                "running as root: permission bits do not stop root, so chmod cannot make a read-only directory"
            )
        run, reason = tmp_path / "read-only", "Permission denied"
        run.mkdir(mode=0o555)
    no_model_may_load(monkeypatch)
    assert run_main(run)[0] == 2
    err = one_paragraph(capsys)
    assert (
        err.startswith(f"error: --output-dir {run} cannot be written to ({reason}")
        and "Pass a directory" in err
    )


# --- a full disk in any write
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def file_size_limit(nbytes):
    """RLIMIT_FSIZE for this process: the kernel fails any write past `nbytes` of a file (EFBIG,
    File too large), as a full disk fails it (ENOSPC), inside the real libraries, without root.
    Python ignores SIGXFSZ, so the write returns the error instead of killing the process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


# the writer that fails: (its module or class, its name, the part of a checkpoint, what the error
# says)
WRITES = {
    "weights (safetensors)": (
        transformers.modeling_utils,
        "safe_save_file",
        "the weights",
        "SafetensorError: Error while serializing: I/O error: File too large (os error 27)",
    ),
    "training_state.pt (torch.save)": (torch, "save", "training_state.pt", "RuntimeError: "),
    "tokenizer files": (TokenizersBackend, "save_pretrained", "the tokenizer", "File too large"),
    "metrics line": (report, "write_log", None, "File too large"),
}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 3-step run the full-disk tests' resumed runs must equal."""
    run = tmp_path_factory.mktemp("straight") / "run"
    assert run_main(run, "--steps", "3")[0] == 0
    return run


@pytest.mark.slow
@pytest.mark.parametrize("what", list(WRITES))
def test_a_full_disk_in_any_write_is_one_paragraph_and_the_previous_checkpoint_stands(
    tmp_path, monkeypatch, capsys, straight, what
):
    """The second call of the writer (step 2's checkpoint, or step 2's metrics line) runs out of
    room: torch.save raised RuntimeError and safetensors SafetensorError, not OSError, so the run
    ended in a traceback; so did a metrics line. Now: one paragraph, exit code 2, step 1's
    checkpoint byte for byte, no checkpoint.tmp, no torn line, and --resume gives the
    uninterrupted run."""
    owner, name, part, words = WRITES[what]
    real, calls, kept = getattr(owner, name), [], {}
    run = tmp_path / "run"

    def runs_out_of_room(*args, **kwargs):
        calls.append(1)
        if len(calls) != 2:
            return real(*args, **kwargs)
        kept.update(snapshot(run / "checkpoint"))
        room = os.path.getsize(run / "metrics.jsonl") + 10 if what == "metrics line" else 100
        with file_size_limit(room):
            return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, runs_out_of_room)
    assert run_main(run, "--steps", "3")[0] == 2
    err = one_paragraph(capsys)
    assert words in err
    if what == "metrics line":
        assert err.startswith(
            f"error: could not write {run}/metrics.jsonl: File too large. The run stopped"
        )
        # the part of step 2's line that was written has been cut off again
        assert [row["step"] for row in read_metrics(run)] == [1]
    else:
        assert err.startswith(
            f"error: could not write a checkpoint into {run}/checkpoint.tmp ({part}): "
        )
        assert (
            f"Nothing was replaced: the previous checkpoint, {run}/checkpoint, is intact (step 1)"
            in err
        )
    assert snapshot(run / "checkpoint") == kept and step_of(run / "checkpoint") == 1
    assert sorted(os.listdir(run)) == ["checkpoint", "metrics.jsonl"]
    monkeypatch.undo()
    assert run_main(run, "--steps", "3", "--resume")[0] == 0
    assert without_time(read_metrics(run)) == without_time(read_metrics(straight))
    assert (
        snapshot(run / "checkpoint")["model.safetensors"]
        == snapshot(straight / "checkpoint")["model.safetensors"]
    )


def in_a_small_filesystem(tmp_path, size_kib, command, read_only=False):
    """Run `command` (a shell line; $MNT is the mount point) with a tmpfs of `size_kib` KiB
    mounted at $MNT, in a mount namespace of its own (unshare: as an unprivileged user where user
    namespaces are allowed, the mount vanishes with the process). Skips the test where no such
    filesystem can be mounted, saying why."""
    mnt = tmp_path / "mnt"
    mnt.mkdir(exist_ok=True)
    options = f"size={size_kib}k" + (",ro" if read_only else "")
    if shutil.which("unshare") is None:
        pytest.skip("no unshare command: cannot mount a small filesystem for this test")
    probe = subprocess.run(
        [
            *"unshare --map-root-user --mount sh -c".split(),
            f'mount -t tmpfs -o {options} tmpfs "{mnt}"',
        ],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here (unshare --map-root-user --mount): {probe.stderr.strip()}"
        )
    script = f'mount -t tmpfs -o {options} tmpfs "$MNT" && {command}'
    return subprocess.run(
        ["unshare", "--map-root-user", "--mount", "sh", "-c", script],
        cwd=ROOT,
        env=dict(os.environ, HF_HUB_OFFLINE="1", MNT=str(mnt)),
        capture_output=True,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize("fails", ["model.safetensors", "training_state.pt"])
def test_a_real_full_filesystem_keeps_the_previous_checkpoint(tmp_path, straight, fails):
    """A tmpfs with room for one checkpoint and a part of the next: the second save runs out of
    space (ENOSPC) in safetensors or in torch.save. The run ends in one paragraph, exit code 2,
    step 1's checkpoint whole."""
    page = os.sysconf("SC_PAGE_SIZE")
    pages = {
        name: math.ceil(len(data) / page)
        for name, data in snapshot(straight / "checkpoint").items()
    }
    weights, state = pages["model.safetensors"], pages["training_state.pt"]
    small = sum(pages.values()) - weights - state
    # a checkpoint, metrics.jsonl and .lock; then room for half the weights, or for all but half the
    # training state
    room = weights // 2 if fails == "model.safetensors" else weights + small + state // 2
    train_py = " ".join(
        [sys.executable, os.path.join(ROOT, "trainer.py"), *tiny_argv("$MNT/run", "--steps", "3")]
    )
    result = in_a_small_filesystem(
        tmp_path,
        (sum(pages.values()) + 2 + room) * page // 1024,
        f'{train_py} --save-every 1; code=$?; cp -a "$MNT/run" "{tmp_path}/after"; exit $code',
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    err = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in result.stderr and len(err) == 1
    part, words = (
        (
            "the weights",
            "SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)",
        )
        if fails == "model.safetensors"
        else ("training_state.pt", "RuntimeError: ")
    )
    assert err[0].startswith(
        f"error: could not write a checkpoint into {tmp_path}/mnt/run/checkpoint.tmp ({part}): "
    )
    assert (
        words in err[0] and " MiB free there. Free space (or pass another --output-dir)" in err[0]
    )
    assert (
        f"Nothing was replaced: the previous checkpoint, {tmp_path}/mnt/run/checkpoint, is intact (step 1)"
        in err[0]
    )
    after = tmp_path / "after"
    assert sorted(os.listdir(after)) == ["checkpoint", "metrics.jsonl"]
    assert (
        checkpoint.verify(str(after / "checkpoint")) is None and step_of(after / "checkpoint") == 1
    )


@pytest.mark.slow
def test_a_read_only_filesystem_is_refused_before_the_model_loads(tmp_path):
    train_py = " ".join([sys.executable, os.path.join(ROOT, "trainer.py"), *tiny_argv("$MNT/run")])
    result = in_a_small_filesystem(tmp_path, 64, train_py, read_only=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.startswith(
        f"error: --output-dir {tmp_path}/mnt/run cannot be written to (Read-only file"
    )
    assert "demo:" not in result.stdout  # the demo's model was never built


# --- damaged checkpoints and metrics.jsonl on --resume
# --------------------------------------------------------------------------------------------------


def cut_in_half(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    "training_state.pt cut short": (
        "training_state.pt",
        cut_in_half,
        "training_state.pt is cut short or damaged",
    ),
    "model.safetensors cut short": (
        "model.safetensors",
        cut_in_half,
        "model.safetensors is cut short (",
    ),
    "config.json garbage": (
        "config.json",
        lambda path: path.write_text("\x00\x00garbage"),
        "config.json is not valid JSON",
    ),
    "LoRA adapter cut short": (
        "adapter/adapter_model.safetensors",
        cut_in_half,
        "adapter/adapter_model.safetensors is cut short (",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_is_one_paragraph_or_resume_falls_back_to_a_whole_checkpoint_old(
    tmp_path, monkeypatch, capsys, case
):
    """Each used to be a traceback on --resume (torch.load, safetensors, AutoConfig or peft).
    verify() reads headers, not tensors: cheap for a 14 GB training_state.pt."""
    name, damage, problem = DAMAGE[case]
    lora = ["--lora-rank", "2"] if name.startswith("adapter/") else []
    run = tmp_path / "run"
    assert run_main(run, "--steps", "1", *lora)[0] == 0
    shutil.copytree(run / "checkpoint", tmp_path / "step-1")
    assert run_main(run, "--steps", "2", "--resume", *lora)[0] == 0
    damage(run / "checkpoint" / name)
    with monkeypatch.context() as patch:
        no_model_may_load(patch)
        capsys.readouterr()
        assert run_main(run, "--steps", "3", "--resume", *lora)[0] == 2
        err = one_paragraph(capsys)
    assert err.startswith(f"error: {run}/checkpoint is damaged: {problem}")
    assert "and there is no checkpoint.old to fall back to. This run cannot continue from it" in err
    # a whole checkpoint.old: the run goes on from it, and says so in one line
    os.replace(tmp_path / "step-1", run / "checkpoint.old")
    assert run_main(run, "--steps", "3", "--resume", *lora)[0] == 0
    out, err = capsys.readouterr()
    assert f"{run}/checkpoint is damaged: {problem}" in err
    assert f"; using {run}/checkpoint.old, the checkpoint before it\n" in err
    assert f"resumed from {run}/checkpoint.old at step 1" in out
    assert [row["step"] for row in read_metrics(run)] == [1, 2, 3] and step_of(
        run / "checkpoint"
    ) == 3
    assert checkpoint.verify(str(run / "checkpoint")) is None
    assert sorted(os.listdir(run)) == ["checkpoint", "curves.png", "metrics.jsonl"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "line, problem",
    [
        ("[1, 2]", 'is not a JSON object with an integer "step"'),
        ('{"step": 1, "loss', "is not JSON"),
    ],
    ids=["not an object", "torn in the middle"],
)
def test_a_damaged_line_of_metrics_jsonl_on_resume_is_one_paragraph_naming_it(
    tmp_path, capsys, line, problem
):
    """A non-object line was a traceback on --resume, and a torn line in the middle (not the
    last: a kill tears only the last) was skipped silently."""
    run = tmp_path / "run"
    assert run_main(run, "--steps", "2")[0] == 0
    rows = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text(rows[0] + line + "\n" + rows[1])
    capsys.readouterr()
    assert run_main(run, "--steps", "3", "--resume")[0] == 2
    assert one_paragraph(capsys).startswith(f"error: {run}/metrics.jsonl:2 {problem}")


# --- non-finite weights are never saved
# --------------------------------------------------------------------------------------------------


def test_a_save_with_non_finite_weights_replaces_nothing_and_names_the_checkpoint_that_stands(
    tmp_path, monkeypatch, capsys
):
    """NaN in one weight (whatever put it there: the optimizer guard checks the updates) at step
    2's save: the save is refused on every rank, step 1's checkpoint stays byte for byte, and the
    way out does not try again."""
    run, real, calls, kept = tmp_path / "run", checkpoint.save_run, [], {}

    def nan_before_the_second_save(run_, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            kept.update(snapshot(run / "checkpoint"))
            with torch.no_grad():
                run_.model.get_input_embeddings().weight[3, 1] = float("nan")
        return real(run_, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_run", nan_before_the_second_save)
    assert run_main(run, "--steps", "3")[0] == 2
    assert one_paragraph(capsys) == (
        "error: the weights after step 2 are not finite (NaN or inf in model.embed_tokens.weight), so no checkpoint "
        f"was written: nothing was replaced, the previous checkpoint, {run}/checkpoint, is intact (step 1). "
        "--resume continues from it; lower --lr or set --max-grad-norm if it happens again."
    )
    assert len(calls) == 2 and snapshot(run / "checkpoint") == kept
    assert sorted(os.listdir(run)) == ["checkpoint", "metrics.jsonl"]


def poison(directory, tensor="model.embed_tokens.weight"):
    """NaN in one weight of a checkpoint's model.safetensors, its headers and sizes unchanged."""
    from safetensors.torch import load_file, save_file

    path = str(directory / "model.safetensors")
    weights = load_file(path)
    weights[tensor][3, 1] = float("nan")
    save_file(weights, path, metadata={"format": "pt"})


def test_a_checkpoint_with_non_finite_weights_or_adamw_state_is_refused_at_load(tmp_path, capsys):
    """Such a checkpoint was loaded as it was; its first update then stopped the run, blaming
    --lr. Now it is refused on --resume, naming the tensor (and on --eval-only --resume)."""
    run = tmp_path / "run"
    assert run_main(run, "--steps", "1")[0] == 0
    shutil.copytree(run / "checkpoint", tmp_path / "whole")
    poison(run / "checkpoint")
    capsys.readouterr()
    assert run_main(run, "--steps", "2", "--resume")[0] == 2
    err = one_paragraph(capsys)
    assert err.startswith(
        f"error: --resume: {run}/checkpoint holds non-finite weights (NaN or inf in "
        "model.embed_tokens.weight), so it is not used: training would stop at its first update, "
        "whatever --lr"
    )
    assert run_main(run, "--eval-only", "--resume")[0] == 2
    assert "holds non-finite weights (NaN or inf in model.embed_tokens.weight)" in one_paragraph(
        capsys
    )
    # whole weights, NaN in AdamW's first moment of one of them
    shutil.rmtree(run / "checkpoint")
    shutil.copytree(tmp_path / "whole", run / "checkpoint")
    state_file = run / "checkpoint" / "training_state.pt"
    state = torch.load(state_file, weights_only=True)
    state["optimizer"]["state"][0]["exp_avg"].view(-1)[0] = float("inf")
    torch.save(state, state_file)
    assert run_main(run, "--steps", "2", "--resume")[0] == 2
    assert "holds non-finite AdamW state (NaN or inf in model.embed_tokens.weight (exp_avg))" in (
        one_paragraph(capsys)
    )
    assert read_metrics(run)[-1]["step"] == 1  # nothing trained, nothing logged


def test_raising_steps_on_resume_stretches_the_lr_schedule_instead_of_logging_lr_0(
    tmp_path, capsys
):
    """A linear schedule over 1 step ends at lr 0, which the optimizer kept on --resume --steps 3:
    step 2 ran (and logged) lr 0. Now the schedule is the new run's, at the restored count."""
    run = tmp_path / "run"
    assert run_main(run, "--steps", "1")[0] == 0  # the demo's lr 2e-3, linear, μ = 1
    capsys.readouterr()
    assert run_main(run, "--steps", "3", "--resume")[0] == 0
    lrs = [row["lr"] for row in read_metrics(run)]
    assert lrs == pytest.approx([2e-3, 2e-3 * 2 / 3, 2e-3 / 3])
    assert (
        "--steps 3 (the checkpoint's: 1): the linear schedule runs over 3 updates now; the next "
        "update's learning rate is 0.00133" in capsys.readouterr().out
    )


def test_the_time_limits_a_stop_message_says_to_raise_may_change_on_resume():
    # "make the tool faster or raise --tool-timeout, then --resume" (tools.tool_failure): the
    # resumed run must not then be refused for its flags
    argv = [*CPU, "--demo", "--tool", "calculator", "--output-dir", "/tmp/x"]
    saved = vars(config.parse_args([*argv, "--tool-timeout", "2"]))
    raised = ["--tool-timeout", "60", "--reward-timeout", "900", "--reward-memory", "64"]
    checkpoint.check_same_flags(saved, config.parse_args([*argv, *raised, "--resume"]))
    with pytest.raises(UserError, match="--max-tool-calls was 4, now 5"):
        checkpoint.check_same_flags(saved, config.parse_args([*argv, "--max-tool-calls", "5"]))


def test_a_start_that_fails_after_claiming_its_directory_leaves_no_empty_directory(
    tmp_path, monkeypatch, capsys
):
    """A reward function that does not import fails after the output directory is claimed: the
    runs/<name>/ it created (and runs/ itself) used to stay behind, empty."""
    monkeypatch.chdir(tmp_path)
    argv = [*CPU, "--demo", "--demo-warmup-steps", "0", "--reward-fn", "no_such_module:f"]
    for out in ([], ["--output-dir", "new/nested"], ["--output-dir", "there"]):
        (tmp_path / "there").mkdir(exist_ok=True)  # was there before: stays
        with pytest.raises(SystemExit) as stop:
            trainer.main(argv + out)
        assert stop.value.code == 2
        assert "there is no module 'no_such_module'" in one_paragraph(capsys)
        assert sorted(os.listdir(tmp_path)) == ["there"] and os.listdir(tmp_path / "there") == []

"""--report-to: tiny demo runs (trainer.main, or helpers.run_tiny where a crash is needed) read back
from what each tracker wrote, with no network. TensorBoard: its event files through both of
TensorBoard's loaders, the classic EventAccumulator and the default fast one (the Rust data server
`tensorboard --logdir` starts), each listing every metrics.jsonl field as a scalar at its step with
its value as a float32 (the flags and the samples as text; resume continuing the step axis, what a
crash logged past its checkpoint purged; --overwrite starting afresh). W&B in offline mode: its run
file (history, summary, config), the samples table, the run a resume continues. Then rank 0 alone
reporting, the missing package said before any model loads, and a tracker failing to start or
mid-run.
"""

import glob
import json
import math
import os
import shutil
import struct
import sys
import time

import numpy as np
import pytest

import config
import rewards
import trainer
from helpers import read_metrics, run_tiny, tiny_argv
from support import checkpoint, distributed, report, trackers

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")


def main(out_dir, *extra):
    """trainer.main on tiny_argv's demo run (4 prompts x G = 4 per step) with `extra`; SystemExit's
    code, else 0."""
    try:
        trainer.main(tiny_argv(out_dir, *extra))
    except SystemExit as e:
        return e.code
    return 0


def saved_flags(out_dir):
    """The flags the run's last checkpoint saved, as JSON values: what the trackers hold as the
    run's config."""
    state = checkpoint.load_state(os.path.join(out_dir, "checkpoint"))
    return json.loads(json.dumps(state["args"], default=str))


def rows_by_step(out_dir):
    """metrics.jsonl's rows merged by step (a step's training row and its evaluation row),
    without "step"."""
    merged = {}
    for row in read_metrics(out_dir):
        merged.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k != "step"})
    return merged


# --- TensorBoard
# --------------------------------------------------------------------------------------------------


def tensorboard_events(log_dir):
    """{tag: [(step, value)]} of the event files in log_dir as TensorBoard's Python loader
    (--load_fast=false) reads them (its plugin event accumulator: restarts purged): numbers as
    floats, texts as strings. The texts are read here; the scalars through both loaders
    (scalars_by_loader)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})  # 0: keep every event
    events.Reload()
    out = {}
    for tag in events.Tags()["tensors"]:
        for event in events.Tensors(tag):
            value = tensor_util.make_ndarray(event.tensor_proto)
            value = value.item().decode() if value.dtype == object else float(value)
            out.setdefault(tag, []).append((event.step, value))
    return out


def classic_scalars(log_dir):
    """{tag: [(step, value)]} of the scalars in log_dir as TensorBoard's classic EventAccumulator
    reads them (Tags()["scalars"], Scalars(tag); restarts purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    events.Reload()
    return {
        tag: [(event.step, event.value) for event in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def fast_loader_scalars(log_dir, tags, timeout=30):
    """{tag: [(step, value)]} of the scalars in log_dir (NaN as "nan": comparable) as `tensorboard
    --logdir` shows them with its default settings (--load_fast=auto): TensorBoard's own ingester
    starts its Rust data server (the tensorboard_data_server binary) on log_dir, loading it once,
    and the tags its data provider lists (list_scalars) are read (read_scalars). The server loads
    in the background: polled until it lists `tags` and two reads agree, `timeout` seconds at most
    (then what it shows is returned, for the test's assertion to say). A server that cannot start
    here skips the test, saying why."""
    from tensorboard import context
    from tensorboard.data import server_ingester
    from tensorboard.util import grpc_util

    # no binary for this platform, one that exits or never answers, one it cannot execute (OSError)
    cannot_start = (
        server_ingester.NoDataServerError,
        server_ingester.DataServerStartupError,
        OSError,
    )
    try:
        ingester = server_ingester.SubprocessServerDataIngester(
            server_ingester.get_server_binary(),
            str(log_dir),
            reload_interval=0,  # load once: the files are complete
            channel_creds_type=grpc_util.ChannelCredsType.LOCAL,
            samples_per_plugin={"scalars": 0},  # 0: every point, none downsampled
        )
        ingester.start()
    except cannot_start as e:
        pytest.skip(
            "TensorBoard's default loader (its Rust data server) cannot run here, so what it shows "
            f"is not checked: {type(e).__name__}: {e}"
        )
    provider, ctx = ingester.data_provider, context.RequestContext()
    try:
        deadline, last = time.monotonic() + timeout, None
        while True:
            listed = provider.list_scalars(ctx, experiment_id="", plugin_name="scalars")
            read = provider.read_scalars(
                ctx, experiment_id="", plugin_name="scalars", downsample=10**6
            )
            shown = {  # NaN as "nan": equal to itself, so that two reads can agree
                run: comparable(
                    {tag: [(p.step, p.value) for p in read[run][tag]] for tag in run_tags}
                )
                for run, run_tags in listed.items()
            }
            settled = shown == last and set(tags) <= set().union(*shown.values())
            if settled or time.monotonic() > deadline:
                break
            last = shown
            time.sleep(0.1)
    finally:
        # the server exits when its stdin closes (--die-after-stdin), a pipe the ingester keeps
        ingester._stdin_handle.close()
    assert len(shown) == 1, f"one run (the event files of log_dir itself), not {list(shown)}"
    [scalars] = shown.values()
    return scalars


def scalars_by_loader(log_dir, tags):
    """{"classic": ..., "fast": ...}: the scalars of log_dir as each of TensorBoard's loaders reads
    them (classic_scalars, fast_loader_scalars), the values as written_as_float32 gives them."""
    classic = classic_scalars(log_dir)
    fast = fast_loader_scalars(log_dir, tags)
    return {"classic": comparable(classic), "fast": fast}


def written_as_float32(points_by_tag):
    """{tag: [(step, value)]} with each value as TensorBoard stores it: the float32 nearest to it
    (a simple_value). That is what each loader must give back exactly; it is within a relative
    2**-24 (6e-8) of the metrics.jsonl value, integers exact up to 2**24. NaN as the string "nan",
    so that NaN compares equal to NaN."""
    return comparable(
        {
            tag: [(step, float(np.float32(float(value)))) for step, value in points]
            for tag, points in points_by_tag.items()
        }
    )


def comparable(points_by_tag):
    """points_by_tag with NaN values as the string "nan" (equal to itself)."""
    return {
        tag: [(step, "nan" if math.isnan(value) else value) for step, value in points]
        for tag, points in points_by_tag.items()
    }


def uncode(markdown):
    """The text of a Markdown code block indented by four spaces (trackers.code_block)."""
    return "\n".join(line[4:] for line in markdown.splitlines())


@pytest.mark.slow
def test_tensorboard_holds_every_metrics_field_at_its_step_the_flags_and_each_groups_samples(
    tmp_path, capsys
):
    out = tmp_path / "run"
    argv = ["--steps", "3", "--eval-every", "0", "--eval-limit", "4", "--eval-samples", "2"]
    assert main(out, *argv, "--sample-every", "2", "--report-to", "tensorboard") == 0
    printed = capsys.readouterr().out
    events = tensorboard_events(out / "tensorboard")

    # every field of every row (all numbers here), under its own name, at its step, as a scalar
    # that TensorBoard's classic loader lists and reads with the row's value as a float32
    expected = {}
    for step, row in rows_by_step(out).items():
        for name, value in row.items():
            assert isinstance(value, (int, float)), name
            expected.setdefault(name, []).append((step, value))
    expected = written_as_float32(expected)
    assert comparable(classic_scalars(out / "tensorboard")) == expected
    assert set(events) == set(expected) | {"flags/text_summary", "samples/text_summary"}
    assert [step for step, _ in expected["eval/reward"]] == [0, 3]
    first_run = shutil.copytree(out / "tensorboard", tmp_path / "first-run")  # for the fast loader

    # the run's flags, as its checkpoint saved them
    [(step, text)] = events["flags/text_summary"]
    assert step == 0 and json.loads(uncode(text)) == saved_flags(out)

    # step 2's sample: the first group's G = 4 completions with their rewards, the printed one first
    [(step, text)] = events["samples/text_summary"]
    assert step == 2 and text.count("**completion ") == 4
    reward = float(
        printed.split("--- sample at step 2: reward ")[1].split(",")[0]
    )  # the demo's: 0 or 1
    first_printed = printed.split("[completion]\n")[1].split("\n---")[0]
    assert f"**completion 1**, reward {reward:.4g}\n\n" + trackers.code_block(first_printed) in text

    # --overwrite: a fresh run, fresh events (the earlier run's are gone)
    assert main(out, "--overwrite", "--report-to", "tensorboard") == 0
    assert len(os.listdir(out / "tensorboard")) == 1
    [row] = read_metrics(out)
    fresh = written_as_float32(
        {name: [(1, value)] for name, value in row.items() if name != "step"}
    )
    assert scalars_by_loader(out / "tensorboard", fresh) == {"classic": fresh, "fast": fresh}

    # the first run's scalars as `tensorboard --logdir` shows them by default (its fast loader):
    # the same tags, steps and float32 values
    assert fast_loader_scalars(first_run, expected) == expected


def test_tensorboard_keeps_text_fields_as_text_and_shows_any_completion_as_written(tmp_path):
    args = config.parse_args(tiny_argv(tmp_path / "run", "--report-to", "tensorboard"))
    tracker = trackers.TensorBoard(args, str(tmp_path / "run"), None)
    tracker.log(
        {"step": 1, "loss": float("nan"), "skipped_nonfinite": 1, "skip_reason": "non-finite loss"}
    )
    odd = ["", "``` | <b>\n    indented", "ok"]
    tracker.log_samples(1, [dict(prompt="q", completion=c, reward=0.5, answer="7") for c in odd])
    tracker.close()
    events = tensorboard_events(tmp_path / "run" / "tensorboard")
    assert events["skip_reason/text_summary"] == [(1, "non-finite loss")]
    # the numbers are scalars, both loaders showing them (NaN as NaN); the text is no scalar
    expected = {"loss": [(1, "nan")], "skipped_nonfinite": [(1, 1.0)]}
    assert scalars_by_loader(tmp_path / "run" / "tensorboard", expected) == {
        "classic": expected,
        "fast": expected,
    }
    [(_, text)] = events["samples/text_summary"]
    blocks = text.split("\n\n")[1::2]  # the prompt's code block, then each completion's
    assert [uncode(b) for b in blocks] == ["q", "(empty)", *odd[1:]]


def crash_at_training_step(monkeypatch, n):
    """rewards.score raises in the n-th training step (tiny_argv's steps score 16 completions): a
    crash, no save."""
    real, steps = rewards.score, []

    def score(reward_fns, completions, *a, **kw):
        steps.append(len(completions) == 16)
        if sum(steps) == n and steps[-1]:
            raise RuntimeError("simulated crash")
        return real(reward_fns, completions, *a, **kw)

    monkeypatch.setattr(rewards, "score", score)
    return real


@pytest.mark.slow
def test_resume_continues_the_tensorboard_step_axis_and_purges_what_a_crash_logged_past_its_checkpoint(
    tmp_path, monkeypatch
):
    out, argv = tmp_path / "run", ["--steps", "4", "--save-every", "2", "--sample-every", "1"]
    real_score = crash_at_training_step(monkeypatch, 4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_tiny(out, *argv, "--report-to", "tensorboard")
    # logged: steps 1 to 3; saved: step 2
    assert [row["step"] for row in read_metrics(out)] == [1, 2, 3]
    crashed_step_3 = read_metrics(out)[2]
    assert [step for step, _ in classic_scalars(out / "tensorboard")["reward"]] == [1, 2, 3]

    monkeypatch.setattr(rewards, "score", real_score)
    run_tiny(out, *argv, "--report-to", "tensorboard", "--resume")
    events = tensorboard_events(out / "tensorboard")
    rows = read_metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    # each step once in both loaders: the crashed run's step 3 purged, the resumed run's in its
    # place (step_time differs between the two)
    expected = written_as_float32(
        {name: [(row["step"], row[name]) for row in rows] for name in rows[0] if name != "step"}
    )
    crashed = written_as_float32({"step_time": [(3, crashed_step_3["step_time"])]})
    assert expected["step_time"][2] != crashed["step_time"][0]
    assert scalars_by_loader(out / "tensorboard", expected) == {
        "classic": expected,
        "fast": expected,
    }
    assert [step for step, _ in events["samples/text_summary"]] == [1, 2, 3, 4]
    # each session's flags at the step it started from
    assert [step for step, _ in events["flags/text_summary"]] == [0, 2]
    assert json.loads(uncode(events["flags/text_summary"][1][1]))["resume"] is True


# --- W&B
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline and quiet, everything it writes under tmp_path (WANDB_DIR unset: the run's own
    default)."""
    for name, value in dict(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_CONSOLE="off",
        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
        WANDB_ARTIFACT_DIR=str(tmp_path / "wandb-artifacts"),
    ).items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)


def wandb_records(path):
    """The records of an offline W&B run file (run-<id>.wandb), as protobuf Records: W&B's 7-byte
    header, then LevelDB's log format: 32 KiB blocks of chunks (crc32, length, type: 1 whole, 2
    first, 3 middle, 4 last), a block's tail shorter than a chunk header left as padding."""
    from wandb.proto import wandb_internal_pb2

    block, header = 32 * 1024, 7
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    records, pos, pending = [], header, b""
    while pos + header <= len(data):
        if block - pos % block < header:
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + header])
        pending += data[pos + header : pos + header + length]
        pos += header + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def items(updates):
    """W&B's key/value_json items as a dict (nested keys joined with dots)."""
    return {".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in updates}


def offline_run(wandb_dir):
    """The one offline run under wandb_dir/wandb: its run record, history {step: row} and final
    summary."""
    [path] = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    records = wandb_records(path)
    kinds = [r.WhichOneof("record_type") for r in records]
    [run] = [r.run for r, kind in zip(records, kinds) if kind == "run"]
    history, summary = {}, {}
    for record, kind in zip(records, kinds):
        if kind == "history":
            row = items(record.history.item)
            history[row.pop("_step")] = row
        if kind == "summary":
            summary.update(items(record.summary.update))
    assert kinds[-1] == "exit"
    return run, history, summary, os.path.dirname(path)


def without_wandb_keys(row):
    return {k: v for k, v in row.items() if not k.startswith(("_", "samples."))}


@pytest.mark.slow
def test_wandb_offline_run_holds_every_row_the_flags_and_samples_and_resume_continues_it(
    tmp_path, monkeypatch, wandb_offline
):
    out = tmp_path / "run"
    argv = ["--eval-every", "0", "--eval-limit", "4", "--eval-samples", "2", "--sample-every", "1"]
    assert main(out, "--steps", "2", *argv, "--report-to", "wandb") == 0
    run, history, summary, run_dir = offline_run(out)
    run_id = (out / "wandb_run_id").read_text().strip()
    assert run.run_id == run_id and run.project == "grpo" and run.display_name == "run"
    assert run_dir.endswith(run_id)

    # the history: every metrics.jsonl row at its step (training and evaluation rows of a step in
    # one)
    expected = rows_by_step(out)
    assert {step: without_wandb_keys(row) for step, row in history.items()} == expected
    # the summary: each name's last value; the config: the flags
    last = {name: value for row in expected.values() for name, value in row.items()}
    assert without_wandb_keys(summary) == last
    config_items = items(run.config.update)
    config_items.pop("_wandb")
    assert config_items == saved_flags(out)

    # a table of each step's first group: G = 4 completions with their rewards
    [table] = glob.glob(os.path.join(run_dir, "files", "media", "table", "samples_2_*.table.json"))
    with open(table) as f:
        table = json.load(f)
    assert table["columns"] == ["step", "prompt", "completion", "reward", "answer"]
    assert len(table["data"]) == 4 and {row[0] for row in table["data"]} == {2}
    assert history[2]["samples.nrows"] == 4

    # --resume: the same W&B run (here written where WANDB_DIR says), from the checkpoint's step on
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    os.makedirs(tmp_path / "elsewhere")
    assert main(out, "--steps", "3", *argv, "--report-to", "wandb", "--resume") == 0
    resumed, history, _, _ = offline_run(tmp_path / "elsewhere")
    assert resumed.run_id == run_id and resumed.resume
    assert (out / "wandb_run_id").read_text().strip() == run_id
    assert sorted(history) == [3]
    assert without_wandb_keys(history[3]) == rows_by_step(out)[3]

    # --overwrite: a new W&B run
    assert main(out, "--steps", "1", "--report-to", "wandb", "--overwrite") == 0
    assert (out / "wandb_run_id").read_text().strip() != run_id


def exit_code(wandb_dir):
    """The exit code W&B recorded for the one offline run under wandb_dir/wandb."""
    [path] = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    [code] = [
        r.exit.exit_code for r in wandb_records(path) if r.WhichOneof("record_type") == "exit"
    ]
    return code


@pytest.mark.slow
def test_a_run_that_crashes_is_a_failed_wandb_run_and_a_finished_one_is_not(
    tmp_path, monkeypatch, wandb_offline
):
    assert main(tmp_path / "done", "--steps", "1", "--report-to", "wandb") == 0
    assert exit_code(tmp_path / "done") == 0
    real, calls = trainer.grpo.group_advantages, []

    def crash_in_step_2(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("an unexpected crash in step 2")
        return real(*a, **kw)

    monkeypatch.setattr(trainer.grpo, "group_advantages", crash_in_step_2)
    with pytest.raises(RuntimeError, match="crash in step 2"):
        main(tmp_path / "crashed", "--steps", "3", "--report-to", "wandb")
    # the trackers are closed on the way out (Run.__exit__), W&B's run marked failed
    assert exit_code(tmp_path / "crashed") == 1


# --- rank 0 alone, the missing package, failures
# --------------------------------------------------------------------------------------------------


def test_under_torchrun_only_rank_0_starts_trackers(tmp_path, monkeypatch, wandb_offline):
    monkeypatch.setattr(distributed, "is_main", lambda: False)
    args = config.parse_args(tiny_argv(tmp_path / "run", "--report-to", "tensorboard,wandb"))
    log, _ = report.open_log(str(tmp_path / "run"), None, args)
    log.write({"step": 1, "reward": 0.5})
    report.print_sample(log, 1, 1, "prompt", ["a", "b"], [1.0, 0.0], "answer")
    assert log.trackers.live == []
    log.close()
    assert {"tensorboard", "wandb", "wandb_run_id"} & set(os.listdir(tmp_path / "run")) == set()


@pytest.mark.parametrize(
    "tracker, module, advice",
    [
        ("tensorboard", "torch.utils.tensorboard", "pip install tensorboard"),
        ("wandb", "wandb", "pip install wandb"),
        ("tensorbored", None, "Pass tensorboard, wandb, both"),
    ],
)
def test_a_missing_package_or_unknown_tracker_is_one_paragraph_before_any_model_loads(
    tmp_path, monkeypatch, capsys, tracker, module, advice
):
    if module is not None:
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed

    def no_model(*a, **kw):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(trainer, "setup", no_model)
    assert main(tmp_path / "run", "--report-to", f"{tracker},none") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --report-to") and advice in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_report_to_is_parsed_to_names_in_order_without_repeats():
    assert trackers.parse("none") == [] and trackers.parse("") == []
    assert trackers.parse(" wandb, TensorBoard ,wandb") == ["wandb", "tensorboard"]
    assert trackers.parse(["tensorboard"]) == ["tensorboard"]  # already parsed: the same


def test_a_tracker_that_cannot_start_stops_the_run_before_its_first_step(
    tmp_path, monkeypatch, capsys
):
    def refuse(self, *a):
        raise RuntimeError("no such directory")

    monkeypatch.setattr(trackers.TensorBoard, "__init__", refuse)
    assert main(tmp_path / "run", "--report-to", "tensorboard") == 2
    err = capsys.readouterr().err
    assert "error: --report-to tensorboard could not start (RuntimeError: no such directory)" in err
    assert read_metrics(tmp_path / "run") == []  # no step trained


@pytest.mark.slow
def test_a_tracker_failing_mid_run_is_said_once_and_the_training_goes_on(
    tmp_path, monkeypatch, capsys
):
    real_log, calls = trackers.TensorBoard.log, []

    def fails_at_step_2(self, row):
        calls.append(row["step"])
        if row["step"] == 2:
            raise OSError(28, "No space left on device")
        real_log(self, row)

    monkeypatch.setattr(trackers.TensorBoard, "log", fails_at_step_2)
    assert main(tmp_path / "run", "--steps", "3", "--report-to", "tensorboard") == 0
    err = capsys.readouterr().err
    assert err.count("warning: --report-to tensorboard failed") == 1
    assert "No space left on device" in err and "going on without it" in err
    assert calls == [1, 2]  # dropped after its failure
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1, 2, 3]
    assert checkpoint.load_state(checkpoint.find_last(str(tmp_path / "run")))["step"] == 3
    assert [s for s, _ in classic_scalars(tmp_path / "run" / "tensorboard")["reward"]] == [1]

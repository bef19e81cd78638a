"""Trackers: a run's metrics.jsonl, also in TensorBoard and/or Weights & Biases (--report-to
tensorboard,wandb).

    python trainer.py --demo --report-to tensorboard --output-dir runs/demo-tb
    tensorboard --logdir runs/demo-tb/tensorboard
    WANDB_MODE=offline python trainer.py --demo --report-to wandb --output-dir runs/demo-wandb
    wandb sync runs/demo-wandb/wandb/offline-*

Every row of metrics.jsonl (a training step's, an evaluation's) goes to each tracker under the same
names, at its step: the training step is the step axis. So do the run's flags (W&B: the run's
config; TensorBoard: a text "flags") and, every --sample-every steps, the step's first group of
completions with their rewards (a W&B table, a TensorBoard text, both "samples"). report.py feeds
them as it writes metrics.jsonl, which stays the record: trainer.py's loop never sees a tracker.

Both packages are optional extras, imported only when --report-to names them; a missing one is one
paragraph before any model loads (parse). A tracker that cannot start stops the run before its first
step (nothing trained yet, and it was asked for); one that fails later is said once and dropped, and
the training goes on. --resume continues the same W&B run (its id is kept in
OUTPUT_DIR/wandb_run_id) and the same TensorBoard step axis (the steps a crashed run logged after
its checkpoint are purged); a fresh run, --overwrite included, starts both afresh. Under torchrun
rank 0 alone reports. docs/logging.md has the details.
"""

import contextlib
import importlib
import json
import os
import shutil
import sys

from support import distributed
from support.errors import UserError

# --report-to's names: the module each one imports, and the package that provides it
MODULES = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
WANDB_PROJECT = "grpo"  # the W&B project when WANDB_PROJECT is not set
RUN_ID_FILE = "wandb_run_id"  # in OUTPUT_DIR: the W&B run that --resume continues


def parse(value):
    """--report-to's value (comma-separated names, or a list of them) as a list of tracker names;
    none: []. An unknown name, or a name whose package does not import, is a UserError: checked
    with the flags, before any model loads."""
    names = []
    for name in value if isinstance(value, list) else value.split(","):
        name = name.strip().lower()
        if name in ("", "none") or name in names:
            continue
        if name not in MODULES:
            raise UserError(
                f"--report-to: unknown tracker {name!r}. Pass tensorboard, wandb, both (tensorboard,wandb), "
                "or none."
            )
        names.append(name)
    for name in names:
        module, package = MODULES[name]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise UserError(
                f"--report-to {name} needs the {package} package, which does not import here ({e}). Install "
                f"it (pip install {package}), or drop {name} from --report-to: metrics.jsonl holds every "
                "metric either way."
            ) from None
    return names


def start(args, output_dir, resumed_at=None):
    """The trackers args.report_to names, started for the run in output_dir; resumed_at: the
    checkpoint's step that a resumed run continues from (None: a fresh run). Every rank calls
    this, and rank 0 alone gets trackers. One that cannot start (W&B not logged in, a directory
    not writable) is a UserError on every rank."""
    names = getattr(args, "report_to", None) or []
    started, problem = [], None
    if distributed.is_main():
        for name in names:
            try:
                started.append(STARTERS[name](args, output_dir, resumed_at))
            except Exception as e:
                problem = (
                    f"--report-to {name} could not start ({type(e).__name__}: {str(e).rstrip('.')}). "
                    + ADVICE[name]
                )
                Trackers(started).close()
                break
    if names and distributed.world() > 1:
        problem = distributed.gather_objects(problem)[0]  # rank 0's, on every rank
    if problem is not None:
        raise UserError(problem)
    return Trackers(started)


class Trackers:
    """The started trackers of a run: each call goes to each of them. One that raises is said
    once on stderr and dropped, so a tracker's failure never stops the training (metrics.jsonl
    keeps every row)."""

    def __init__(self, started):
        self.live = list(started)

    def log(self, row):
        """One metrics.jsonl row, a training step's or an evaluation's, at its "step"."""
        self.each(lambda tracker: tracker.log(row))

    def log_samples(self, step, samples):
        """Sampled completions of `step`: [{"prompt", "completion", "reward", "answer"}]."""
        self.each(lambda tracker: tracker.log_samples(step, samples))

    def close(self, failed=False):
        """failed: the run ended on an error (W&B marks it failed)."""
        self.each(lambda tracker: tracker.close(failed))
        self.live = []

    def each(self, call):
        for tracker in list(self.live):
            try:
                call(tracker)
            except Exception as e:
                self.live.remove(tracker)
                print(
                    f"warning: --report-to {tracker.name} failed ({type(e).__name__}: {e}); going on without "
                    "it (metrics.jsonl keeps every row)",
                    file=sys.stderr,
                    flush=True,
                )
                with contextlib.suppress(Exception):
                    tracker.close()


def flags(args):
    """The run's flags as plain JSON values (the checkpoint's `args`, as a tracker's config)."""
    return json.loads(json.dumps(vars(args), default=str))


class TensorBoard:
    """Event files in OUTPUT_DIR/tensorboard: each number as a scalar (a float32, the form
    `tensorboard --logdir` shows with its default settings), each text field, the flags and the
    samples as text (TensorBoard names those <name>/text_summary)."""

    name = "tensorboard"

    def __init__(self, args, output_dir, resumed_at):
        from torch.utils.tensorboard import SummaryWriter

        log_dir = os.path.join(output_dir, "tensorboard")
        if resumed_at is None and os.path.isdir(log_dir):
            shutil.rmtree(log_dir)  # a fresh run: none of an earlier run's events on its axis
        # Each session opens with a restart marker (a SessionLog.START event) at the first step it
        # logs. TensorBoard takes the first as the run's start and a later one as a restart,
        # dropping what earlier sessions logged from its step on (a crashed run logs past its
        # checkpoint): the steps a resumed run logs again appear once.
        first = 0 if resumed_at is None else resumed_at + 1
        self.writer = SummaryWriter(log_dir, purge_step=first)
        # each session's flags at the step it starts from
        self.writer.add_text(
            "flags", code_block(json.dumps(flags(args), indent=2)), resumed_at or 0
        )
        self.writer.flush()

    def log(self, row):
        step = row["step"]
        for name, value in row.items():
            if name == "step":
                continue
            if isinstance(value, (int, float)):
                # A float32 simple_value, the one scalar form both of TensorBoard's loaders
                # show: its default, fast one (the Rust data server) skips double tensors, and
                # the classic EventAccumulator keeps any tensor out of its scalars. float32 keeps
                # about 7 significant digits (relative error at most 2**-24) and integers exact
                # up to 2**24: the charts lose nothing visible, and metrics.jsonl keeps every
                # value at full precision.
                self.writer.add_scalar(name, value, step)
            else:
                self.writer.add_text(name, str(value), step)
        self.writer.flush()  # on disk at once: a crash loses no logged row

    def log_samples(self, step, samples):
        self.writer.add_text("samples", samples_markdown(samples), step)
        self.writer.flush()

    def close(self, failed=False):
        self.writer.close()


def samples_markdown(samples):
    """The samples as Markdown for TensorBoard's text tab: the prompt and its reference answer
    once, then each completion with its reward, the texts as code blocks (shown as written,
    whatever they hold)."""
    first = samples[0]
    parts = [f"**prompt** (reference answer: {first['answer']})", code_block(first["prompt"])]
    for i, sample in enumerate(samples, 1):
        parts += [
            f"**completion {i}**, reward {sample['reward']:.4g}",
            code_block(sample["completion"]),
        ]
    return "\n\n".join(parts)


def code_block(text):
    """`text` as a Markdown code block: every line indented by four spaces (no fence its text
    could close)."""
    return "\n".join("    " + line for line in text.splitlines()) or "    (empty)"


class WandB:
    """A W&B run: each row at its step (W&B's step is the training step), the flags as the run's
    config, a table of samples. W&B's own environment decides the rest: WANDB_MODE=offline (no
    network: wandb sync later), WANDB_PROJECT (else "grpo"), WANDB_ENTITY, WANDB_NAME (else the
    output directory's name), WANDB_DIR (else OUTPUT_DIR), WANDB_API_KEY."""

    name = "wandb"

    def __init__(self, args, output_dir, resumed_at):
        import wandb

        self.wandb = wandb
        id_file = os.path.join(output_dir, RUN_ID_FILE)
        # a resumed run continues the W&B run of its output directory (if it had one)
        run_id = read_run_id(id_file) if resumed_at is not None else None
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT),
            name=os.environ.get("WANDB_NAME", os.path.basename(os.path.abspath(output_dir))),
            dir=os.environ.get("WANDB_DIR", output_dir),
            config=flags(args),
            id=run_id,
            resume="allow" if run_id else None,
            reinit="create_new",  # this run's own, beside any other W&B run of the process
        )
        with open(id_file, "w") as f:
            f.write(self.run.id + "\n")
        # W&B's steps only go up: a run continued online starts after the last step it holds, which
        # may be past the checkpoint (a crashed run logs on). Those steps are not sent again (the
        # same values: resume is exact).
        self.first_step, self.skipped = self.run.starting_step, False

    def log(self, row):
        if self.sendable(row["step"]):
            self.run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def log_samples(self, step, samples):
        if self.sendable(step):
            columns = ["step", "prompt", "completion", "reward", "answer"]
            rows = [[step, *(s[c] for c in columns[1:])] for s in samples]
            self.run.log({"samples": self.wandb.Table(columns=columns, data=rows)}, step=step)

    def sendable(self, step):
        """Whether `step` is new to the W&B run (said once when it is not)."""
        if step >= self.first_step:
            return True
        if not self.skipped:
            self.skipped = True
            print(
                f"W&B run {self.run.id} holds steps up to {self.first_step - 1} already (logged before the "
                "interruption): this run's rows up to that step are not sent to it again",
                flush=True,
            )
        return False

    def close(self, failed=False):
        self.run.finish(exit_code=1 if failed else 0)


def read_run_id(path):
    """The W&B run id kept in `path`, or None when there is none."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


STARTERS = {"tensorboard": TensorBoard, "wandb": WandB}
ADVICE = {
    "tensorboard": "Check that OUTPUT_DIR/tensorboard can be written to, or drop tensorboard from --report-to.",
    "wandb": "Log in (wandb login, or WANDB_API_KEY), or set WANDB_MODE=offline to keep the run on disk and "
    "wandb sync it later; or drop wandb from --report-to.",
}

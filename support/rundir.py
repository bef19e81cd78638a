"""The output directory of a run: where a run goes without --output-dir, one run in it, and one
process at a time (train.main claims it before the model loads).

Without --output-dir each run gets a new directory, RUNS/<model or demo>-<date>-<time> (a suffix
when two start in the same second), and --resume continues the last run like it (new_run_dir,
last_run_like). Checkpoints accumulate there: remove a run's directory when done with it.

A fresh run into a directory that holds a run is refused (or, with --overwrite, the earlier run's
files are removed first); a live run holds OUTPUT_DIR/.lock, so a second process is refused while it
runs, and a directory that cannot be written is refused before anything is loaded. The files
themselves are checkpoint.py's and report.py's.
"""

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time

from support import distributed
from support.checkpoint import checkpoint_step, differing_flags, find_last, saved_flags
from support.errors import UserError, failure

LOCK = ".lock"
# What a run writes into its output directory (removed by --overwrite, the last one last: a removal
# cut short still leaves a directory that holds a run, refused without --overwrite, never a mix of
# two runs).
RUN_FILES = (
    "checkpoint.tmp",
    "checkpoint.old",
    "checkpoint",
    "curves.png",
    "tensorboard",
    "wandb_run_id",
    "metrics.jsonl.tmp",
    "metrics.jsonl",
)


RUNS = "runs"  # where runs go without --output-dir, relative to the working directory
# The flags that make two runs "alike": --resume without --output-dir continues the last such run.
SAME_RUN = ("demo", "model", "task", "lora_rank", "seed")


def run_name(args):
    """The start of a run's default directory name: demo or the model's name, then -addition for
    --task addition, -lora with --lora-rank."""
    name = "demo" if args.demo else os.path.basename(os.path.normpath(args.model))
    return (
        name
        + ("-addition" if args.task == "addition" else "")
        + ("-lora" if args.lora_rank else "")
    )


def new_run_dir(args, now=None):
    """RUNS/<run_name>-<YYYYmmdd-HHMMSS>: a directory that does not exist yet (-2, -3, ... after
    the time when it does). Not created here: train.main claims it. Under torchrun every rank
    computes one and rank 0's is used (train.main)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = os.path.join(RUNS, f"{run_name(args)}-{stamp}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def last_run_like(args):
    """--resume without --output-dir: the directory under RUNS whose last checkpoint is the newest
    among those whose flags match this run's (SAME_RUN, and every flag that may not change on
    resume: checkpoint.MAY_CHANGE_ON_RESUME's complement, so --steps may differ), said on stdout; a
    UserError when there is none, listing the runs of the same model with the flags that differ."""
    found, near = [], []
    for name in sorted(os.listdir(RUNS)) if os.path.isdir(RUNS) else []:
        path = os.path.join(RUNS, name)
        last = find_last(path, quiet=True) if os.path.isdir(path) else None
        flags = saved_flags(last) if last is not None else None
        if flags is None:
            continue
        # every flag that may not change on resume, and the run's identity (its model too)
        differ = [k for k in SAME_RUN if flags.get(k) != getattr(args, k)]
        differ += [k for k in differing_flags(flags, args) if k not in differ]
        if not differ:
            found.append((os.path.getmtime(os.path.join(last, "training_state.pt")), path))
        elif all(flags.get(k) == getattr(args, k) for k in ("demo", "model")):
            near.append(f"{path} (" + ", ".join("--" + k.replace("_", "-") for k in differ) + ")")
    if not found:
        like = f"{run_name(args)}, seed {args.seed}"
        others = (
            f" Runs of the same model whose flags differ (those named): {'; '.join(near[-5:])}."
            if near
            else ""
        )
        raise UserError(
            f"--resume: no run like this one ({like}, these flags) with a checkpoint in {RUNS}/."
            f"{others} Pass the --output-dir of the run to continue (with its flags), or drop "
            "--resume to start a new one."
        )
    path = max(found)[1]
    if os.environ.get("RANK", "0") == "0":
        print(f"--resume: continuing {path}, the last run of {run_name(args)} with these flags")
    return path


@contextlib.contextmanager
def claim_output_dir(args):
    """The output directory for this run, held until the block ends; entered before the model loads
    (train.main).

    - A directory that cannot be created or written to (read-only, a file in the way, a full disk)
      is refused.
    - A live run holds OUTPUT_DIR/.lock (flock: the kernel drops it when its process ends, however
      it ends, so a lock left by a killed run blocks nothing); a second process is refused, naming
      the holder's pid and host.
    - A fresh run (no --resume) into a directory that holds a run (metrics.jsonl with rows,
      checkpoint/ or checkpoint.old/) is refused, naming what it holds and the ways on; with
      --overwrite that run's files are removed first. --overwrite has no effect with --resume.

    - A start that fails inside the block (bad data, a reward that does not import, a model that
      does not load, Ctrl-C) leaves no empty directory behind: those this claim created (the
      output directory, runs/ too) are removed again while they are empty.

    Under torchrun rank 0 alone does this (the others write nothing), and every rank raises its
    refusal. --eval-only writes no run: nothing is claimed."""
    if args.eval_only:
        yield None
        return
    lock, refusal, created = None, None, []
    if distributed.is_main():
        created = missing_directories(args.output_dir)
        try:
            lock = OutputDirLock(args.output_dir)
            prepare_output_dir(args)
        except UserError as e:
            refusal = e
        except BaseException:
            if lock is not None:
                lock.release()
            remove_if_empty(created)
            raise
    if distributed.world() > 1:
        message = distributed.gather_objects(None if refusal is None else str(refusal))[0]
        refusal = refusal or (UserError(message) if message is not None else None)
    failed = True
    try:
        if refusal is not None:
            raise refusal
        yield lock
        failed = False
    finally:
        if lock is not None:
            lock.release()
        if failed:
            remove_if_empty(created)


def missing_directories(path):
    """The directories that creating `path` would create: `path` and its missing parents, the
    deepest first."""
    missing, path = [], os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def remove_if_empty(directories):
    """Remove each directory, the deepest first, while it is empty (and exists): a run that failed
    to start leaves nothing of its own behind."""
    for directory in directories:
        try:
            os.rmdir(directory)
        except FileNotFoundError:
            continue
        except OSError:  # not empty (a file of the run, or of someone else), or not ours to remove
            return


class OutputDirLock:
    """OUTPUT_DIR/.lock held with flock(LOCK_EX | LOCK_NB) while the run is live, with the
    holder's pid and host in it (for the message a second process gets). Released (and the file
    removed) when the run ends; a killed run's file stays behind and blocks nothing. Also the
    probe for a directory this process cannot write to."""

    def __init__(self, output_dir):
        self.path = os.path.join(output_dir, LOCK)
        self.fd = None
        try:
            os.makedirs(output_dir, exist_ok=True)
            probe_writable(output_dir)
            self.fd = self.acquire()
            os.ftruncate(self.fd, 0)
            holder = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            os.pwrite(self.fd, holder.encode(), 0)
        except OSError as e:
            self.release()
            raise UserError(
                f"--output-dir {output_dir} cannot be written to ({failure(e)}"
                + (f": {e.filename}" if getattr(e, "filename", None) else "")
                + "). Pass a directory you can write to (it is created if missing), with room for the checkpoints."
            ) from None

    def acquire(self):
        """The lock file's descriptor, locked. A run that ends removes the file while it holds
        the lock; a process that opened it just before then locks a removed file, so it checks
        that the path still names what it locked, and otherwise tries again."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise UserError(
                    f"--output-dir {os.path.dirname(self.path)} is in use: a run is live there ({holder} holds "
                    f"{self.path}). Wait for it to end (or stop it: a stopped run can be continued with --resume), "
                    "or pass another --output-dir."
                ) from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    os.close(fd)
                    raise
                print(
                    f"note: {self.path} cannot be locked on this filesystem ({e.strerror}): nothing keeps a second "
                    "run out of this directory",
                    file=sys.stderr,
                )
                return fd
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)

    def release(self):
        """Remove the lock file, then let go of the lock (in that order: see acquire)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


def probe_writable(directory):
    """OSError when no file can be created in `directory` (read-only, no permission, a read-only
    filesystem)."""
    probe = os.path.join(directory, f".write-test-{os.getpid()}")
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    os.remove(probe)


def prepare_output_dir(args):
    """A fresh run's directory must hold no run: UserError naming what it holds and the ways on,
    or, with --overwrite, that run's files removed (said in one line)."""
    held = earlier_run_in_words(args.output_dir)
    if args.resume:
        if args.overwrite:
            print("--overwrite has no effect with --resume: the run continues", file=sys.stderr)
        return
    if not held:
        return
    if not args.overwrite:
        resumable = any(entry.startswith("checkpoint") for entry in held)
        raise UserError(
            f"--output-dir {args.output_dir} already holds a run ({'; '.join(held)}), and a fresh run would replace "
            "it. Pass "
            + ("--resume to continue that run, " if resumable else "")
            + "another --output-dir to start a new one beside it, or --overwrite to delete it and start over"
            + ("" if resumable else " (it has no checkpoint to --resume from)")
            + "."
        )
    for name in RUN_FILES:
        path = os.path.join(args.output_dir, name)
        try:
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.remove(path)
        except OSError as e:
            raise UserError(
                f"--overwrite: could not remove {path} ({failure(e)}). Remove the earlier run's files "
                "yourself, or pass another --output-dir."
            ) from None
    print(
        f"--overwrite: removed the earlier run in {args.output_dir} ({'; '.join(held)})", flush=True
    )


def earlier_run_in_words(output_dir):
    """What of a run `output_dir` holds, in words: metrics.jsonl with rows, checkpoint/,
    checkpoint.old/ (empty: none). Cheap: the rows are counted, not parsed, and a checkpoint's
    step is read memory-mapped."""
    held = []
    metrics = os.path.join(output_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        with open(metrics, "rb") as f:
            lines = [line for line in f if line.strip()]
        if lines:
            try:
                last = f", the last at step {json.loads(lines[-1])['step']}"
            except (ValueError, KeyError, TypeError):
                last = ""
            held.append(f"metrics.jsonl with {len(lines)} row{'s' if len(lines) > 1 else ''}{last}")
    for name in ("checkpoint", "checkpoint.old"):
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            step = checkpoint_step(path)
            held.append(f"{name}/" + (f" at step {step}" if step is not None else ""))
    return held

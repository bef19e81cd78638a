"""Signals: what a run does when it is asked to stop.

StopRequests   SIGINT (Ctrl-C), SIGTERM and SIGHUP during train(): the step finishes, is saved, and
               the run exits with 128 + the signal's number (Stopped); during train.py's reward
               functions (in its own process), the last finished step is saved at once

(What it does when it loses its reader, a dropped ssh session or `| head`: train.py's
DevNullWhenReaderGone.)
"""

import contextlib
import io
import os
import signal
import sys
import threading
import time

from support import distributed


class Stopped(KeyboardInterrupt):
    """The run stopped at a step boundary on a signal: exit code 128 + the signal's number (130
    Ctrl-C, 143 SIGTERM, 129 SIGHUP). everywhere: every rank stops at this step (they save
    together); saved: the step is saved already."""

    def __init__(self, signum, everywhere=False, saved=False):
        super().__init__(signal.Signals(signum).name)
        self.exit_code, self.everywhere, self.saved = 128 + signum, everywhere, saved


class StopRequests:
    """SIGINT (Ctrl-C), SIGTERM and SIGHUP (what SLURM, Kubernetes and spot instances send before
    they kill a job) during train(). Inside a step the first one is a request: the step finishes,
    is saved as every step boundary can be (so --resume continues exactly), and the run exits
    with 128 + the signal's number. A second one stops at once, as Ctrl-C always did (the step
    counts as done after its first update, else is redone), unless it comes within SAME_REQUEST_S
    of the first: then it is the same request. During an evaluation (training is saved before
    every one) and the closing table, a signal stops at once. main() installs the handlers
    (`with STOPS:`, main thread only, where Python runs them) and restores them after; train()
    called from your own code keeps your handlers, and a signal does what they do."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    # A second signal within this many seconds of the first is the same request delivered twice:
    # Ctrl-C under torchrun reaches each worker from the terminal and again from torchrun, which
    # forwards the signal it gets.
    SAME_REQUEST_S = 1.0

    def __init__(self):
        self.signum, self.immediate, self.previous, self.first_at = None, False, {}, 0.0
        self.deferring, self.stop_deferred = 0, None
        # rewards.call_here's, while train.py's reward function runs: the save of the last finished
        # step (save_at_once); and the signal that saved it, "saving" while it does
        self.saver, self.saved_by = None, None

    def __enter__(self):
        self.signum, self.saved_by, self.deferring, self.stop_deferred = None, None, 0, None
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        # a request belongs to this run: train() called later, without handlers, starts clean
        self.signum, self.previous, self.saved_by = None, {}, None

    def handle(self, signum, frame):
        if self.saver is not None:  # a reward function runs in this process (train.py)
            return self.save_at_once(signum)
        again = self.signum is not None
        if self.immediate or (again and time.monotonic() - self.first_at > self.SAME_REQUEST_S):
            return self.stop(signum)
        if again:  # the same request delivered twice (SAME_REQUEST_S)
            return
        self.signum, self.first_at = signum, time.monotonic()
        print(
            f"\n{signal.Signals(signum).name}: finishing this step, then saving and exiting "
            "(again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def save_at_once(self, signum):
        """A signal while train.py calls a reward function in its own process (rewards.call_here
        sets `saver`: the save of the last finished step, as this step has not updated yet). The
        reward may never return (it hangs), so the step cannot be asked to finish:
        - the first signal saves at once, from this handler, and stops the run (Stopped, saved; exit
          128 + its number, 143 for SIGTERM). --resume redoes the step, exactly;
        - a reward that catches that Stopped and goes on gets a second signal (after
          SAME_REQUEST_S): the process exits at once (os._exit) with the first signal's code, the
          save already on disk. One that catches it and returns finishes the step, which is saved
          again at its end (the request stands).

        What the handler touches, and why that is safe: Python runs it in the main thread between
        two bytecodes of the reward function, so no code of the run runs beside it, and the reward
        holds its own copies of the batch, not the model. The weights, AdamW and the schedule are
        as the last finished step left them (the update comes after the rewards), and the saver
        writes them with the code of every step's end (checkpoint.save_run: a new directory,
        renamed into place, so a kill during the save leaves the last complete one). A signal during
        the save waits for it. Its lines go through new streams on file descriptors 1 and 2: the
        reward may have been inside a write to sys.stdout, which Python refuses to enter again.
        What it cannot do: run while the reward is inside C code that never returns to Python; only
        SIGKILL ends that, and trainer.py's reward worker (a process of its own) is the way out."""
        if self.saved_by == "saving" or (
            self.saved_by is not None and time.monotonic() - self.first_at <= self.SAME_REQUEST_S
        ):
            return  # the save finishes first; or the same request delivered twice
        if self.saved_by is not None:  # the reward swallowed the first: saved, so end here
            name = signal.Signals(signum).name
            RawLines(2).write(f"\n{name}: the reward function did not stop; exiting, saved\n")
            with contextlib.suppress(Exception):  # what the run printed before, where it can
                sys.stdout.flush()
            os._exit(128 + self.saved_by)
        self.saved_by, self.first_at = "saving", time.monotonic()
        # a request (a reward that returns ends its step); the first signal's code throughout
        signum = self.signum = self.signum or signum
        try:
            with contextlib.redirect_stdout(RawLines(1)), contextlib.redirect_stderr(RawLines(2)):
                self.saver(stopped_by=Stopped(signum, everywhere=True))
        finally:
            self.saved_by = signum  # saved, or the last complete checkpoint stands
        raise Stopped(signum, everywhere=True, saved=True)

    def stop(self, signum):
        """Stop at once: now, or at the end of the outermost deferred() block. The exit code is the
        first signal's (a SIGTERM, then a Ctrl-C: 143)."""
        signum = self.signum or signum
        if self.deferring:
            self.stop_deferred = signum
        else:
            raise Stopped(signum)

    @contextlib.contextmanager
    def deferred(self):
        """A stop at once waits for the end of this block: an optimizer update (weights, AdamW and
        schedule), or trainer.py's whole GRPO iteration (the update and its statistics, so that a
        step stopped after an update logs it: no gap in metrics.jsonl). Blocks nest."""
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
        if not self.deferring and self.stop_deferred is not None:
            signum, self.stop_deferred = self.stop_deferred, None
            raise Stopped(signum)

    @contextlib.contextmanager
    def at_once(self, during=None):
        """A signal inside this block stops at once (nothing unsaved to lose), a pending request
        too. `during`: what the block does and what is saved, for the line on stderr that says so
        ("SIGTERM: stopping during the evaluation at step 4; training is saved up to step 4")."""
        self.immediate = True
        try:
            if self.signum is not None:
                raise Stopped(self.signum)
            yield
        except Stopped as e:
            if during is not None and distributed.is_main():
                print(f"\n{e}: stopping during {during}", file=sys.stderr, flush=True)
            raise
        finally:
            self.immediate = False

    @contextlib.contextmanager
    def waiting(self):
        """A signal inside this block stops at once: the trainer waits on a worker process
        (support/worker.py), which the stop ends; a request pending from earlier in the step is
        left for the step's end, as at any other moment. Under torchrun the first signal stays a
        request (every rank must stop at the same step, and the others are not waiting with this
        one: a rank stopping alone would leave them in the next collective); a second stops at
        once, as anywhere."""
        immediate = self.immediate
        self.immediate = immediate or distributed.world() == 1
        try:
            yield
        except Stopped as e:
            print(
                f"\n{e}: stopping at once, during a call to the worker process (ended)",
                file=sys.stderr,
                flush=True,
            )
            raise
        finally:
            self.immediate = immediate

    def raise_if_requested(self, saved):
        """At a step's end: Stopped if a signal came on any rank (one all-reduce under torchrun)."""
        if distributed.all_sum([self.signum is not None])[0] > 0:
            raise Stopped(self.signum or signal.SIGTERM, everywhere=True, saved=saved)


class RawLines(io.TextIOBase):
    """Text written straight to a file descriptor, unbuffered: a signal handler's output, which
    must not enter sys.stdout's buffer if the code it interrupted was inside it. A reader that is
    gone (EPIPE, EIO) loses the text, not the save."""

    def __init__(self, fd):
        self.fd = fd

    def write(self, text):
        with contextlib.suppress(OSError):
            os.write(self.fd, text.encode(errors="replace"))
        return len(text)

    def fileno(self):
        return self.fd


# The one StopRequests of the process. Global because a signal handler is: Python runs it in the
# main thread between any two bytecodes, with no way to hand it an object the run owns.
STOPS = StopRequests()

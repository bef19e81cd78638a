"""Signals: what a run does when it is asked to stop.

StopRequests   SIGINT (Ctrl-C), SIGTERM and SIGHUP during train(): the step finishes, is saved, and
               the run exits with 128 + the signal's number (Stopped)

(What it does when it loses its reader, a dropped ssh session or `| head`: train.py's
DevNullWhenReaderGone.)
"""

import contextlib
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
        self.deferring, self.stop_deferred = False, None

    def __enter__(self):
        self.signum = None
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        # a request belongs to this run: train() called later, without handlers, starts clean
        self.signum, self.previous = None, {}

    def handle(self, signum, frame):
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

    def stop(self, signum):
        """Stop at once: now, or at the end of a deferred() block."""
        if self.deferring:
            self.stop_deferred = signum
        else:
            raise Stopped(signum)

    @contextlib.contextmanager
    def deferred(self):
        """A stop at once waits for the end of this block (an optimizer update: weights, AdamW
        and schedule)."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring, signum, self.stop_deferred = False, self.stop_deferred, None
        if signum is not None:
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


# The one StopRequests of the process. Global because a signal handler is: Python runs it in the
# main thread between any two bytecodes, with no way to hand it an object the run owns.
STOPS = StopRequests()

"""Calling one reward function in isolation from the run and from the other functions.

call_reward is how rewards.score calls each function: with its own copy of every argument
(own_copy), anything it raises turned into a UserError naming it and the completion it fails on
(only KeyboardInterrupt passes, Ctrl-C and signals.Stopped), within its time limit (time_limit),
and its return value checked: one finite float32 number per completion (as_rewards).

The time limit is kept in this process, by a SIGALRM timer in the main thread (see time_limit for
what it cannot interrupt).
"""

import contextlib
import copy
import operator
import signal
import threading
import time

from support import worker
from support.errors import UserError
from support.worker import import_function, raised_at  # noqa: F401 (sandbox.import_function)

# float32's largest finite value (torch.finfo(torch.float32).max): torch is not imported here, as
# the worker process (support/worker.py) imports this file and needs no torch
FLOAT32_MAX = 3.4028234663852886e38


def call_reward(r, completions, answers, kwargs):
    """One rewards.Reward's values [N] on the batch, each argument its own copy, within r.timeout
    seconds (the search for the failing completion included). A function loaded by import path
    (a worker.Remote) runs in the run's worker process: its copies are the pickled arguments, the
    time limit is kept from outside (the worker is killed past it), and a worker that dies is said
    by name; every other one runs here."""
    if isinstance(r.fn, worker.Remote):
        return call_in_worker(r, completions, answers, kwargs)
    try:
        with time_limit(r.timeout):
            try:
                values = r.fn(
                    own_copy(completions),
                    own_copy(answers),
                    **{k: own_copy(v) for k, v in kwargs.items()},
                )
            except NOT_REWARD_ERRORS:
                raise
            except BaseException as e:  # SystemExit too: a reward function does not end the run
                raise UserError(
                    exception_message(r.name, e, r.fn, completions, answers, kwargs)
                ) from None
            return as_rewards(r.name, values, completions)
    except RewardTimeout:
        raise UserError(
            f"reward function {r.name!r} did not return within {r.timeout:g} s (--reward-timeout) on a batch "
            f"of {len(completions)} completions; the batch's first completion began: "
            f"{(completions[0] if completions else '')[:200]!r}. Make it faster, or raise the limit with "
            "--reward-timeout SECONDS (0: no limit)."
        ) from None


def call_in_worker(r, completions, answers, kwargs):
    """call_reward for a function in the worker process (reward_in_worker runs there)."""
    first = (completions[0] if completions else "")[:200]
    try:
        values = r.fn.call(
            (r.name, completions, answers, kwargs),
            {},
            r.timeout,
            "support.sandbox:reward_in_worker",
        )
    except worker.WorkerTimeout:
        raise UserError(
            f"reward function {r.name!r} ({r.fn.flag} {r.fn.spec}) did not return within "
            f"{r.timeout:g} s (--reward-timeout) on a batch of {len(completions)} completions, and its "
            f"worker process was killed; the batch's first completion began: {first!r}. Make it "
            "faster, or raise the limit with --reward-timeout SECONDS (0: no limit)."
        ) from None
    except worker.WorkerFailed as e:
        raise UserError(
            f"reward function {r.name!r} ({r.fn.flag} {r.fn.spec}) {e} on a batch of "
            f"{len(completions)} completions; the batch's first completion began: {first!r}. A "
            "runaway allocation meets --reward-memory's limit (GiB of address space) as a "
            "MemoryError, or the kernel's out-of-memory killer (SIGKILL)."
        ) from None
    except (
        worker.RemoteError
    ) as e:  # the adapter itself failed: an argument or value that does not pickle
        raise UserError(
            f"reward function {r.name!r} ({r.fn.flag} {r.fn.spec}) could not be called in its worker "
            f"process: {e.type_name}: {e}{e.where}."
        ) from None
    return as_rewards(r.name, values, completions)


def reward_in_worker(fn, name, completions, answers, kwargs):
    """In the worker process: fn's values on the batch as floats (as_floats), or a UserError with
    call_reward's message. Its arguments are its own already (unpickled copies)."""
    try:
        values = fn(completions, answers, **kwargs)
    except BaseException as e:  # SystemExit too: a reward function does not end the run
        raise UserError(exception_message(name, e, fn, completions, answers, kwargs)) from None
    return as_floats(name, values, completions)


def own_copy(values):
    """A reward function's own copy of one argument: a new list of deep copies, so what the function
    does to it (sorting the list, appending to a list-valued answer) reaches neither the next
    function nor the rows kept for later steps. deepcopy returns strings and numbers as they are."""
    return [copy.deepcopy(v) for v in values]


class RewardTimeout(BaseException):
    """A reward function ran past its time limit. A BaseException, as KeyboardInterrupt is, so that
    a function catching Exception around each completion does not swallow it and go on."""


# What a reward function may raise that is not its own error: Ctrl-C and signals.Stopped (its
# subclass), and the time limit, which call_reward reports as such.
NOT_REWARD_ERRORS = (KeyboardInterrupt, RewardTimeout)


@contextlib.contextmanager
def time_limit(seconds):
    """RewardTimeout when the block runs longer than `seconds` (0: no limit).

    In the main thread an alarm (SIGALRM, see alarm()) interrupts the block at the limit: a Python
    loop at its next bytecode, a sleep or a blocking read at once, C code that does not return to
    Python (one long regex, one torch op) when it returns. The block runs in the calling thread, so
    thread-local state (torch's grad mode) is kept; a worker thread would lose it, and would break
    reward libraries that set alarms themselves (signal.signal works only in the main thread).

    Limits: a library that sets its own alarm inside the block (math_verify does, with signal.alarm)
    replaces ours and cancels it when done; off the main thread no signal can interrupt the block.
    There the block runs to its end and is then refused if it took longer than the limit: a slow
    function still stops the run, one that never returns hangs it."""
    start = time.monotonic()
    if (
        seconds > 0
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    ):
        with alarm(seconds):
            yield
    else:
        yield
    if seconds > 0 and time.monotonic() - start > seconds:
        raise RewardTimeout  # the function caught the alarm, a library cancelled it, or no alarm could be set


@contextlib.contextmanager
def alarm(seconds):
    """RewardTimeout raised in the main thread `seconds` after the block starts, by a SIGALRM timer
    (setitimer). The previous SIGALRM handler is put back afterwards, and a timer of your own
    pending before the block is re-armed with the time it had left (if that ran out meanwhile, it
    goes off at once). SIGINT, SIGTERM and SIGHUP (the run's own handlers, signals.StopRequests)
    are untouched."""
    armed = True  # set to False the moment the block ends: an alarm after that, during the clean-up, does nothing

    def expire(signum, frame):
        if armed:
            raise RewardTimeout

    start = time.monotonic()
    previous_delay, previous_interval = signal.getitimer(signal.ITIMER_REAL)
    previous_handler = signal.signal(signal.SIGALRM, expire)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            armed = False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0:
            left = max(previous_delay - (time.monotonic() - start), 1e-6)
            signal.setitimer(signal.ITIMER_REAL, left, previous_interval)


def exception_message(name, e, fn, completions, answers, kwargs):
    """The message for a reward function that raised on a batch. It is called again one completion
    at a time to find the one it fails on; if none fails alone, the message shows the batch's first
    completion. The search runs within what is left of the batch's time limit (call_reward): a
    function that hangs alone is not waited for."""
    first = f"the batch's first completion began: {(completions[0] if completions else '')[:200]!r}"
    try:
        i = first_failing_completion(fn, completions, answers, kwargs)
        which = (
            f"called on completion {i} alone it raises too; that completion began: {completions[i][:200]!r}"
            if i is not None
            else f"called on each completion alone it does not raise; {first}"
        )
    except RewardTimeout:
        which = f"calling it on each completion alone to find the one it fails on ran out of time; {first}"
    return (
        f"reward function {name!r} raised {type(e).__name__}: {e}{raised_at(e)} on a batch of {len(completions)} "
        f"completions; {which}. A reward function must return one float for any text, even empty or garbage."
    )


def first_failing_completion(fn, completions, answers, kwargs):
    """The index of the first completion on which fn, called on it alone (with its own copies),
    raises; None if none does."""
    for i in range(len(completions)):
        try:
            fn(
                own_copy(completions[i : i + 1]),
                own_copy(answers[i : i + 1]),
                **{k: own_copy(v[i : i + 1]) for k, v in kwargs.items()},
            )
        except NOT_REWARD_ERRORS:
            raise
        except BaseException:
            return i
    return None


class Steps(list):
    """A process reward's values (DeepSeekMath §4.1.3): for each completion, the list of its steps'
    (end, reward) pairs, end an int >= 0 (a character offset into the response: text[:end] is the
    step and all before it), reward a finite float in float32's range. as_floats returns it for a
    function that returned a list for every completion; process_supervision.py takes it from
    there."""


def as_steps(name, values, completions):
    """values, one list of (end, reward) pairs per completion, as Steps; or a UserError saying
    which completion's which step is wrong and how."""
    out = Steps()
    for i, steps in enumerate(values):
        where = f"reward function {name!r} returned steps for completion {i}"
        began = f"The completion began: {completions[i][:200]!r}"
        if not isinstance(steps, (list, tuple)):
            raise UserError(
                f"{where} but {steps!r} for another: a process reward returns a list of (end, "
                f"reward) pairs for every completion ([] for none), an outcome reward one number "
                f"for every completion. {began}"
            )
        pairs = []
        for k, step in enumerate(steps):
            try:
                end, reward = step
                end = -1 if isinstance(end, bool) else operator.index(end)  # ints, numpy ints
                reward = float(reward) if not isinstance(reward, (str, bytes)) else float("x")
            except (TypeError, ValueError):
                raise UserError(
                    f"{where}, whose step {k} is {step!r}: each step is a pair (end, reward), end "
                    f"an int (a character offset: the step is text[:end]) and reward a number (a "
                    f"list for a completion makes a process reward; an outcome reward returns one "
                    f"number per completion). {began}"
                ) from None
            if end < 0:
                raise UserError(
                    f"{where}, whose step {k} ends at {end}: a step's end is a character offset "
                    f"into the response, 0 or more. {began}"
                )
            if not abs(reward) <= FLOAT32_MAX:  # NaN, inf, or inf in float32
                raise UserError(
                    f"{where}, whose step {k} has reward {reward}: step rewards must be finite "
                    f"float32 numbers (NaN or inf would reach the weights). {began}"
                )
            pairs.append((end, reward))
        out.append(pairs)
    return out


def as_rewards(name, values, completions):
    """A reward function's return value as a float32 tensor [N], or a UserError saying what is wrong
    with it: not one number per completion, NaN or inf (as_floats), or a number beyond float32's
    range (1e39 is a finite float but inf in float32). A process reward's Steps (as_floats) are
    returned as they are."""
    import torch

    out = as_floats(name, values, completions)
    if isinstance(out, Steps):
        return out
    rewards = torch.tensor(out, dtype=torch.float32)
    # finite as Python floats, but beyond float32's range: inf here
    overflowed = (~rewards.isfinite()).nonzero().flatten().tolist()
    if overflowed:
        i = overflowed[0]
        raise UserError(
            f"reward function {name!r} returned {out[i]} for completion {i}, beyond the range of float32 "
            f"(±{FLOAT32_MAX:.4g}), in which rewards are computed: it would be inf and reach the "
            f"weights. Scale the rewards down. The completion began: {completions[i][:200]!r}"
        )
    return rewards


def as_floats(name, values, completions):
    """A reward function's return value as a list of finite Python floats, one per completion (a
    list, a tuple, a tensor, an array, a generator; numbers, bools, Decimals, 0-d tensors), or a
    UserError saying what is wrong with it. A list (or tuple) for the first completion: a process
    reward's steps, checked and returned as Steps (as_steps)."""
    n = len(completions)
    returned = values
    if hasattr(values, "reshape") and len(getattr(values, "shape", ())) > 1:
        values = values.reshape(-1)  # an array or tensor [N, 1]
    # keys, or no order: not one value per completion
    if isinstance(values, (dict, set, frozenset, str, bytes)):
        raise UserError(
            f"reward function {name!r} returned a {type(values).__name__}; it must return a list with one "
            f"number per completion ({n}), in the completions' order."
        )
    try:
        values = list(values)  # a list, a tuple, a tensor, an array, a generator
    except NOT_REWARD_ERRORS:
        raise
    except BaseException as e:  # not iterable, or a generator that raised (or called sys.exit)
        raise UserError(
            f"reward function {name!r} must return one number per completion ({n}); it returned a "
            f"{type(returned).__name__} ({type(e).__name__}: {e}{raised_at(e)}). The batch's first completion "
            f"began: {(completions[0] if completions else '')[:200]!r}"
        ) from None
    if len(values) != n:
        raise UserError(
            f"reward function {name!r} must return one number per completion ({n}); it returned "
            f"{len(values)} values: {str(values)[:200]}. The batch's first completion began: "
            f"{(completions[0] if completions else '')[:200]!r}"
        )
    if values and isinstance(values[0], (list, tuple)):
        return as_steps(name, values, completions)
    out = []
    for i, v in enumerate(values):
        try:
            # numbers, bools, 0-d tensors
            out.append(float(v) if not isinstance(v, (str, bytes)) else float("x"))
        except (TypeError, ValueError):
            raise UserError(
                f"reward function {name!r} returned {v!r} ({type(v).__name__}) for completion {i}, which "
                f"is not a number. The completion began: {completions[i][:200]!r}"
            ) from None
        if out[-1] != out[-1] or out[-1] in (float("inf"), float("-inf")):
            raise UserError(
                f"reward function {name!r} returned {v} for completion {i}: rewards must be finite "
                f"numbers (NaN or inf would reach the weights). The completion began: "
                f"{completions[i][:200]!r}"
            )
    return out

"""Rewards: GSM8K's verifiable correctness and format, DAPO's overlong penalty, your own functions loaded by
--reward-fn MODULE:FUNCTION, reward models (--reward-model), and score(), which runs them all on a batch.

The reward-function contract: a reward function is any callable

    reward(completions: list[str], answers: list, **fields) -> list[float]

with one float per completion. `completions` are the responses (the --response-prefix, then the generated text;
no prompt); `answers` are the rows' reference answers (GSM8K: the final number), in the same order. A function may
also declare keyword parameters, and then gets them as lists aligned with the completions: `prompts` (each row's
prompt as the data gives it, before the chat template), `completion_lengths` (token counts, EOS included) and any
other field of the data rows, by its name (a `**kwargs` parameter gets them all). A task (data.Task) lists such
functions with weights; train.py adds them up (total = sum of weight * reward) and logs each one separately under
its name (see REWARD_FUNCS). A function that
needs no reference, like format_reward, still takes `answers` and ignores it.

score() isolates each function: it gets its own copy of every argument, whatever it raises (sys.exit included) is
an error naming it, it must return within --reward-timeout seconds, and its values must be finite in float32.

overlong_penalty scores token lengths, not texts: overlong_reward wraps it as a function that declares
`completion_lengths` (--overlong-buffer N).

Robustness: every function here returns a float for any string (empty, 100,000 characters,
unicode, NUL bytes, unbalanced or nested tags, 100,000 digits) and never raises on model output.
Tags are found with str.find/str.rfind and numbers with one regex without nested quantifiers, so
the work grows linearly with the length of the text (no catastrophic backtracking, unlike a
pattern such as `[\\s\\D]*(\\d+)[\\s\\D]*`). Numbers are compared as decimal.Decimal, never float.
"""

import contextlib
import copy
import importlib
import inspect
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from decimal import Decimal
from typing import NamedTuple

import torch

from support.errors import UserError

THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE = "<think>", "</think>", "<answer>", "</answer>"

# A number: an optional minus sign (only when it does not follow a letter or digit, so "5-3" is
# 5 and 3, not 5 and -3), an optional "$", digits with optional thousands commas ("1,234"), and
# optional decimals. re.ASCII: digits are 0-9 only. Each part is a single quantifier, not nested.
_NUMBER = re.compile(r"((?<!\w)-)?\$?([0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(\.[0-9]+)?", re.ASCII)

# Numbers longer than this (digits and point) count as "no number": no real answer is that long,
# and it bounds the cost of Decimal on a 100,000-digit run.
MAX_NUMBER_CHARS = 50


def _number_text(match: re.Match) -> str | None:
    """Canonical text of a _NUMBER match: no "$" or commas, no trailing zeros after the point."""
    sign, digits, decimals = (
        match.group(1) or "",
        match.group(2).replace(",", ""),
        match.group(3) or "",
    )
    decimals = decimals.rstrip("0").rstrip(".")  # "18.00" -> "18", "0.50" -> "0.5"
    if len(digits) + len(decimals) > MAX_NUMBER_CHARS:
        return None
    return sign + digits + decimals


def answer_block(completion: str) -> str | None:
    """The text inside the last complete <answer>...</answer> block, or None when there is none.

    The block ends at the last "</answer>" and starts after the closest "<answer>" before it. Tags
    are plain substrings, not parsed as a tree: "<answer><answer>5</answer>" gives "5", a
    "</answer>" with no opening tag before it gives None, and an unclosed "<answer>" after the
    last "</answer>" (a truncated completion) is ignored.
    """
    if not isinstance(completion, str):
        return None
    end = completion.rfind(ANSWER_CLOSE)
    start = completion.rfind(ANSWER_OPEN, 0, max(end, 0))
    if end == -1 or start == -1:
        return None
    return completion[start + len(ANSWER_OPEN) : end]


def extract_answer(completion: str) -> str | None:
    """The last number inside the last <answer>...</answer> block, as canonical text, else None.

    Tolerates whitespace and newlines, "$", thousands commas, a trailing period, "18.00" (-> "18"),
    negative numbers and words around the number ("The answer is 42." -> "42"). Returns None when
    there is no answer block, no number in it ("forty-two"), or the last number is too long.
    """
    block = answer_block(completion)
    if block is None:
        return None
    last = None
    for last in _NUMBER.finditer(block):  # keep the last match; linear in len(block)
        pass
    return None if last is None else _number_text(last)


def last_number(completion: str) -> str | None:
    """The last number anywhere in the completion, as canonical text (as extract_answer reads numbers), else None:
    "12 + 30 = 42." -> "42". The answer of a task that asks for a number and no format (--task addition)."""
    if not isinstance(completion, str):
        return None
    last = None
    for last in _NUMBER.finditer(completion):  # keep the last match; linear in len(completion)
        pass
    return None if last is None else _number_text(last)


def _parse_reference(answer) -> Decimal | None:
    """A reference answer ("18", "1,234", "-3", "0.5", or an int) as a Decimal, or None if it is not a number."""
    match = _NUMBER.fullmatch(str(answer).strip())
    text = None if match is None else _number_text(match)
    return None if text is None else Decimal(text)


def correctness_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where the extracted answer equals the reference number (18 == "18.00" == "$18"), else 0.0."""
    return _same_number(map(extract_answer, completions), answers)


def last_number_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where the last number of the completion equals the reference number, else 0.0 (--task addition)."""
    return _same_number(map(last_number, completions), answers)


def _same_number(predictions, answers):
    rewards = []
    for predicted, answer in zip(predictions, answers, strict=True):
        reference = _parse_reference(answer)
        same = predicted is not None and reference is not None and Decimal(predicted) == reference
        rewards.append(1.0 if same else 0.0)
    return rewards


def format_reward(completions: list[str], answers: list[str] | None = None) -> list[float]:
    """0.1 per tag of <think>, </think>, <answer>, </answer> found in that order, +0.1 for a number: max 0.5.

    The tags are looked for one after another, each after the end of the previous one; the first
    tag missing stops the count. So a repeated tag earns nothing extra, tags out of order earn only
    the in-order prefix, and "<answer>5</answer>" alone earns just the number credit. The number
    credit (0.1) needs extract_answer to find a number, so an empty "<answer></answer>" gets none.
    `answers` is ignored; it is there to fit the reward-function contract.
    """
    rewards = []
    for completion in completions:
        if not isinstance(completion, str):
            rewards.append(0.0)
            continue
        found, position = 0, 0
        for tag in (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE):
            position = completion.find(tag, position)
            if position == -1:
                break
            found, position = found + 1, position + len(tag)
        if extract_answer(completion) is not None:
            found += 1
        rewards.append(found / 10)  # n / 10 is exactly the float 0.n
    return rewards


def overlong_penalty(lengths: Iterable[int], max_tokens: int, cache_tokens: int) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), per completion length.

        0                                  if len <= max - cache
        ((max - cache) - len) / cache      if max - cache < len <= max   (linear from 0 to -1)
        -1                                 if len > max

    Example, max 100 and cache 20: length 50 -> 0, 90 -> -0.5, 110 -> -1.
    """
    if not 0 < cache_tokens <= max_tokens:
        raise ValueError(
            f"need 0 < cache_tokens <= max_tokens, got cache {cache_tokens}, max {max_tokens}"
        )
    safe = max_tokens - cache_tokens
    penalties = []
    for length in lengths:
        length = float(length)  # accepts ints, floats and 0-d tensors
        if length <= safe:
            penalties.append(0.0)
        elif length <= max_tokens:
            penalties.append((safe - length) / cache_tokens)
        else:
            penalties.append(-1.0)
    return penalties


# The rewards that fit the contract, by the names train.py uses for flags and logging.
REWARD_FUNCS = {"correctness": correctness_reward, "format": format_reward}
# --extract-answer's built-ins: the answer a completion gives, for maj@k
ANSWER_EXTRACTORS = {"gsm8k": extract_answer, "last-number": last_number}


# ----------------------------------------------------------------------------------------------------------------------
# Your own rewards: --reward-fn MODULE:FUNCTION and --reward-model PATH_OR_ID, and score(), which calls them all.


def load_reward_fn(spec, flag="--reward-fn", builtins=None):
    """(name, fn) for a --reward-fn value: a built-in's short name (correctness, format) or MODULE:FUNCTION, imported
    with the working directory first on the import path (so my_rewards.py beside you works as my_rewards:brevity).
    The function is logged under its own name. Anything that cannot work is a UserError now, not at step 1.
    --extract-answer loads its function the same way (flag and builtins: its own)."""
    builtins = REWARD_FUNCS if builtins is None else builtins
    if spec in builtins:
        return spec, builtins[spec]
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise UserError(
            f"{flag} {spec!r}: expected MODULE:FUNCTION (e.g. my_rewards:brevity for the function "
            f"brevity in ./my_rewards.py) or a built-in: {', '.join(builtins)}."
        )
    if os.getcwd() not in sys.path[:1]:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name.split(".")[0] and e.name != module_name:
            raise UserError(f"{flag} {spec!r}: importing {module_name} failed: {e}.") from None
        raise UserError(
            f"{flag} {spec!r}: there is no module {module_name!r}: no {module_name.replace('.', '/')}"
            f".py in the working directory ({os.getcwd()}) or on the import path."
        ) from None
    except Exception as e:  # a syntax error in the user's file, or an error it raises when imported
        raise UserError(
            f"{flag} {spec!r}: importing {module_name} raised {type(e).__name__}: {e}{where(e)}."
        ) from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        found = sorted(
            n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
        )
        raise UserError(
            f"{flag} {spec!r}: {module_name} ({getattr(module, '__file__', '?')}) has no function "
            f"{fn_name!r}; its functions: {', '.join(found) or 'none'}."
        )
    return fn_name, fn


def check_signature(name, fn, fields):
    """UserError unless fn takes (completions, answers) and every other parameter it requires is `prompts` or a
    field of the data (`fields`)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise UserError(
            f"reward function {name!r} must take two arguments, (completions, answers), and return one "
            f"float per completion; its signature is {name}{inspect.signature(fn)}."
        )
    for p in positional[2:] + [p for p in params if p.kind == p.KEYWORD_ONLY]:
        if p.default is p.empty and p.name not in ("prompts", "completion_lengths", *fields):
            raise UserError(
                f"reward function {name!r} requires the argument {p.name!r}, which is neither `prompts`, "
                f"`completion_lengths` nor a field of the data rows (fields: "
                f"{', '.join(fields) or 'none'})."
            )


def wanted(fn, columns):
    """The columns {name: [value per completion]} that fn declares as parameters (all of them for **kwargs), except
    any named like its first two parameters (the completions and the answers, passed by position)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    first_two = [
        n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ][:2]
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in columns.items() if k not in first_two and (takes_all or k in params)}


def score(reward_fns, completions, answers, **columns):
    """Total reward [N] = sum of weight * fn(completions, answers, **the columns fn declares), and each function's
    rewards {name: [N]}. columns: prompts=[N], and any data field =[N].

    Each function is isolated from the run around it and from the other functions:
    - it gets its own copy of every argument (own_copy), so one that sorts `completions` in place or appends to a
      list-valued answer changes neither what the next function sees nor the data of later steps;
    - anything it raises, SystemExit and other BaseExceptions included, is a reward error; only KeyboardInterrupt
      (Ctrl-C, and train.Stopped for SIGTERM/SIGHUP) goes through untouched, so the run stops as it should;
    - it must return within its Reward.timeout (--reward-timeout; see time_limit);
    - it must return one finite float32 number per completion (as_rewards).
    A reward error stops the run here: a UserError naming the function, what was wrong, and the start of the
    offending completion (train.py then saves a checkpoint and exits with code 2)."""
    per_fn = {}
    for r in reward_fns:
        per_fn[r.name] = score_one(r, completions, answers, wanted(r.fn, columns))
    return sum(r.weight * per_fn[r.name] for r in reward_fns), per_fn


def score_one(r, completions, answers, kwargs):
    """One Reward's values [N] on the batch, each argument its own copy, within r.timeout seconds (search included)."""
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
                raise UserError(raised(r.name, e, r.fn, completions, answers, kwargs)) from None
            return as_rewards(r.name, values, completions)
    except RewardTimeout:
        raise UserError(
            f"reward function {r.name!r} did not return within {r.timeout:g} s (--reward-timeout) on a batch "
            f"of {len(completions)} completions; the batch's first completion began: "
            f"{(completions[0] if completions else '')[:200]!r}. Make it faster, or raise the limit with "
            "--reward-timeout SECONDS (0: no limit)."
        ) from None


def own_copy(values):
    """A reward function's own copy of one argument: a new list holding a deep copy of each value, so what the
    function does to it (sorting the list, appending to a list-valued answer) reaches neither the next function nor
    the rows the data keeps for later steps. Strings and numbers are immutable: deepcopy returns them as they are."""
    return [copy.deepcopy(v) for v in values]


class RewardTimeout(BaseException):
    """A reward function ran past its time limit. A BaseException, as KeyboardInterrupt is, so that a function that
    catches Exception around each completion does not swallow it and go on to the next one."""


# What a reward function may raise that is not its own error: Ctrl-C and train.Stopped (its subclass), and the time
# limit, which score_one reports as such.
NOT_REWARD_ERRORS = (KeyboardInterrupt, RewardTimeout)


@contextlib.contextmanager
def time_limit(seconds):
    """RewardTimeout when the block runs longer than `seconds` (0: no limit).

    In the main thread an alarm (SIGALRM, see alarm()) interrupts the block at the limit: a Python loop at its next
    bytecode, a sleep or a blocking read at once, C code that does not return to Python (one long regex, one torch
    op) when it returns. The block runs in the thread that called it, so thread-local state (torch's grad mode) is
    as it was; a worker thread would lose it, and would break reward libraries that set alarms themselves
    (signal.signal works only in the main thread).

    Limits: a library that sets its own alarm inside the block (math_verify does, with signal.alarm) replaces ours
    and cancels it when done; and off the main thread no signal can interrupt the block. There the block runs to
    its end and is then refused if it took longer than the limit: a slow function still stops the run, a function
    that never returns hangs it."""
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
    """RewardTimeout raised in the main thread `seconds` after the block starts, by a SIGALRM timer (setitimer). The
    previous SIGALRM handler is put back afterwards, and a timer of your own pending before the block is re-armed
    with the time it had left (if that ran out meanwhile, it goes off at once). SIGINT, SIGTERM and SIGHUP (the
    run's own handlers, train.StopRequests) are untouched."""
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


def raised(name, e, fn, completions, answers, kwargs):
    """The message for a reward function that raised on a batch. It is called again one completion at a time to
    find the completion it fails on; if none fails alone, the message shows the batch's first completion. The
    search runs within what is left of the batch's time limit (score_one): a function that hangs alone is not
    waited for."""
    first = f"the batch's first completion began: {(completions[0] if completions else '')[:200]!r}"
    try:
        i = first_raising(fn, completions, answers, kwargs)
        which = (
            f"called on completion {i} alone it raises too; that completion began: {completions[i][:200]!r}"
            if i is not None
            else f"called on each completion alone it does not raise; {first}"
        )
    except RewardTimeout:
        which = f"calling it on each completion alone to find the one it fails on ran out of time; {first}"
    return (
        f"reward function {name!r} raised {type(e).__name__}: {e}{where(e)} on a batch of {len(completions)} "
        f"completions; {which}. A reward function must return one float for any text, even empty or garbage."
    )


def first_raising(fn, completions, answers, kwargs):
    """The index of the first completion on which fn, called on it alone (with its own copies), raises; None if none
    does."""
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


def where(e):
    """ " (file.py:12)": where an exception was raised, for the message (a SyntaxError names its place itself)."""
    frames = traceback.extract_tb(e.__traceback__)
    if (
        isinstance(e, SyntaxError)
        or not frames
        or os.path.abspath(frames[-1].filename) == os.path.abspath(__file__)
    ):
        return ""  # a SyntaxError names its place itself; one raised here is about the value, not the user's code
    return f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"


def as_rewards(name, values, completions):
    """A reward function's return value as a float32 tensor [N], or a UserError saying what is wrong with it: not one
    number per completion, NaN or inf, or a number beyond float32's range (1e39 is a finite float but inf in
    float32)."""
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
            f"{type(returned).__name__} ({type(e).__name__}: {e}{where(e)}). The batch's first completion "
            f"began: {(completions[0] if completions else '')[:200]!r}"
        ) from None
    if len(values) != n:
        raise UserError(
            f"reward function {name!r} must return one number per completion ({n}); it returned "
            f"{len(values)} values: {str(values)[:200]}. The batch's first completion began: "
            f"{(completions[0] if completions else '')[:200]!r}"
        )
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
    rewards = torch.tensor(out, dtype=torch.float32)
    # finite as Python floats, but beyond float32's range: inf here
    overflowed = (~rewards.isfinite()).nonzero().flatten().tolist()
    if overflowed:
        i = overflowed[0]
        raise UserError(
            f"reward function {name!r} returned {out[i]} for completion {i}, beyond the range of float32 "
            f"(±{torch.finfo(torch.float32).max:.4g}), in which rewards are computed: it would be inf and reach the "
            f"weights. Scale the rewards down. The completion began: {completions[i][:200]!r}"
        )
    return rewards


# --reward-timeout's default: generous (a reward model on a CPU, or a checker that runs code, takes seconds per batch),
# but a function that hangs stops the run within minutes, saved, rather than holding its machine forever.
DEFAULT_TIMEOUT = 600.0


class Reward(NamedTuple):
    """One reward function and its weight: fn(completions, answers, ...) -> one float per completion."""

    name: str  # the name it is logged under: rewards/<name>, eval/<name>
    fn: Callable
    weight: float  # the total reward is the weighted sum of all the task's reward functions
    # seconds one call may take before it stops the run (score_one, time_limit); 0: no limit. from_flags sets it
    # from --reward-timeout.
    timeout: float = DEFAULT_TIMEOUT


def weighted(named_fns, weights, timeout=DEFAULT_TIMEOUT):
    """[Reward] from [(name, fn)] and one weight each, each with the time limit `timeout` (seconds, 0: none)."""
    return [
        Reward(name, fn, float(w), float(timeout))
        for (name, fn), w in zip(named_fns, weights, strict=True)
    ]


def from_flags(args, defaults, fields=()):
    """The run's rewards, [Reward]: --reward-fn's functions (without it the task's own `defaults`, [(name, fn)]),
    then --reward-model's models, weighted by --reward-weights in that order (every weight 1.0 without it), each
    given --reward-timeout's time limit. `fields`: the data rows' other fields, which a function may declare as
    parameters."""
    named = [load_reward_fn(spec) for spec in args.reward_fn] if args.reward_fn else list(defaults)
    names = [name for name, _ in named] + [model_name(path) for path in args.reward_model]
    names += ["overlong"] if args.overlong_buffer > 0 else []
    weights = args.reward_weights or [1.0] * len(names)
    if len(weights) != len(names):
        raise UserError(
            f"--reward-weights needs one weight per reward, in the order: reward functions, then reward "
            f"models, then the overlong penalty ({', '.join(names)}): {len(names)} numbers, got "
            f"{len(weights)}."
        )
    if "reward" in names:
        raise UserError(
            "no reward may be named 'reward': that name is the weighted total's (eval/reward). Rename the "
            "function."
        )
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UserError(
            f"two rewards would be logged under the same name ({', '.join(twice)}); each reward function "
            "and reward model may be given once, and their names must differ."
        )
    for name, fn in named:
        check_signature(name, fn, fields)
    # the compute dtype
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype, torch.float32)
    named += [
        (model_name(path), RewardModel(path, args.device, args.trust_remote_code, dtype=dtype))
        for path in args.reward_model
    ]
    if args.overlong_buffer > 0:
        named.append(("overlong", overlong_reward(args.max_new_tokens, args.overlong_buffer)))
    return weighted(named, weights, args.reward_timeout)


def overlong_reward(max_tokens, buffer):
    """--overlong-buffer: DAPO's soft overlong punishment (overlong_penalty, eq. 13) as a reward function of the
    completions' token counts, with L_max = max_tokens (the generation budget) and L_cache = buffer."""

    def overlong(completions, answers, completion_lengths):
        return overlong_penalty(completion_lengths, max_tokens, buffer)

    return overlong


def model_name(path_or_id):
    """The name a reward model is logged under: its directory's name, or the name part of a hub id."""
    return os.path.basename(os.path.normpath(path_or_id))


class RewardModel:
    """A --reward-model: a sequence classifier with one output (AutoModelForSequenceClassification, num_labels=1)
    whose score for prompt + response is the reward. It runs in batches under no_grad on the training device, in
    `dtype` (from_flags: the run's compute dtype, so bf16 on CUDA by default), frozen. Text: the model's chat template over the user prompt and the assistant
    response when its tokenizer has one, else the prompt, a newline and the response. Fits the reward contract."""

    def __init__(
        self, path_or_id, device="cpu", trust_remote_code=False, batch_size=16, dtype=torch.float32
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(
                path_or_id, trust_remote_code=trust_remote_code
            )
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path_or_id, dtype=dtype, trust_remote_code=trust_remote_code
            )
        except Exception as e:  # missing, offline, not a sequence classifier
            raise UserError(
                f"--reward-model {path_or_id!r}: could not load it as a sequence classifier "
                f"({' '.join(str(e).split())[:300]}). Pass a local directory with config.json, the "
                "weights and a tokenizer, or a hub id."
            ) from None
        if self.model.config.num_labels != 1:
            raise UserError(
                f"--reward-model {path_or_id!r} has {self.model.config.num_labels} outputs; a reward model "
                "has one, its score for the text (num_labels=1 in its config)."
            )
        self.batch_size = batch_size
        # pad with EOS (the score is read at the last non-pad token)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
            # nothing to pad with
            self.batch_size = batch_size if self.tokenizer.pad_token is not None else 1
        # keep the end of long texts
        self.tokenizer.padding_side, self.tokenizer.truncation_side = (
            "right",
            "left",
        )
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        limits = [
            n
            for n in (
                self.tokenizer.model_max_length,
                getattr(self.model.config, "max_position_embeddings", None),
            )
            if n and n < 10**9
        ]
        self.max_length = min(limits) if limits else None
        self.model.to(device).eval().requires_grad_(False)

    def text(self, prompt, response):
        if getattr(self.tokenizer, "chat_template", None) is None:
            return f"{prompt}\n{response}"
        chat = [
            {"role": "user", "content": str(prompt)},
            {"role": "assistant", "content": response},
        ]
        return self.tokenizer.apply_chat_template(chat, tokenize=False)

    @torch.no_grad()
    def __call__(self, completions, answers, prompts):
        texts = [self.text(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores = []
        for i in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[i : i + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=self.max_length is not None,
                max_length=self.max_length,
                add_special_tokens=getattr(self.tokenizer, "chat_template", None) is None,
            )
            device = next(self.model.parameters()).device
            scores += self.model(**batch.to(device)).logits[:, 0].float().tolist()
        return scores

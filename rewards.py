"""Rewards: GSM8K's verifiable correctness and format, DAPO's overlong penalty, and score(), the
weighted sum of a task's reward functions on a batch.

The reward-function contract: a reward function is any callable

    reward(completions: list[str], answers: list, **fields) -> list[float]

with one float per completion. `completions` are the responses (the --response-prefix, then the
generated text; no prompt); `answers` are the rows' reference answers (GSM8K: the final number),
in the same order. A function may also declare keyword parameters, and then gets them as lists
aligned with the completions: `prompts` (each row's prompt as the data gives it, before the chat
template), `completion_lengths` (token counts, EOS included) and any other field of the data
rows, by its name (a `**kwargs` parameter gets them all). A task (data.Task) lists such functions
with weights; score() adds them up (total = sum of weight * reward), and each is logged under its
name (see REWARD_FUNCS). A function that needs no reference, like format_reward, still takes
`answers` and ignores it. Yours come from --reward-fn MODULE:FUNCTION, and reward models from
--reward-model (from_flags, at the end of this file).

score() isolates each function (support/sandbox.py): it gets its own copy of every argument,
whatever it raises (sys.exit included) is an error naming it, it must return within
--reward-timeout seconds, and its values must be finite in float32.

overlong_penalty scores token lengths, not texts: overlong_reward wraps it as a function that
declares `completion_lengths` (--overlong-buffer N).

Robustness: every function here returns a float for any string (empty, 100,000 characters,
unicode, NUL bytes, unbalanced or nested tags, 100,000 digits) and never raises on model output.
Tags are found with str.find/str.rfind and numbers with one regex without nested quantifiers, so
the work grows linearly with the length of the text (no catastrophic backtracking, unlike a
pattern such as `[\\s\\D]*(\\d+)[\\s\\D]*`). Numbers are compared as decimal.Decimal, never float.
"""

import copy
import functools
import inspect
import os
import re
from collections.abc import Callable, Iterable
from decimal import Decimal
from typing import NamedTuple

from support import sandbox
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
    sign, digits, decimals = match.group(1) or "", match.group(2), match.group(3) or ""
    digits, decimals = digits.replace(",", ""), decimals.rstrip("0").rstrip(".")  # "18.00": "18"
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
    """The last number anywhere in the completion, as canonical text (read as extract_answer reads
    numbers), else None: "12 + 30 = 42." -> "42". The answer of a task that asks for a number and
    no format (--task addition)."""
    if not isinstance(completion, str):
        return None
    last = None
    for last in _NUMBER.finditer(completion):  # keep the last match; linear in len(completion)
        pass
    return None if last is None else _number_text(last)


# A tool's result as tools.py forces it into a completion (tools.RESULT_OPEN, tools.RESULT_CLOSE;
# a test checks they agree). Not imported: this module stays free of torch.
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"


# --tool-format hermes's result markers (support/tool_calls.FORMATS["hermes"], stripped)
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def without_results(completion: str, markers=(RESULT_OPEN, RESULT_CLOSE)) -> str:
    """The completion with every tool result taken out: each span from "<result>" to the next
    "</result>" (or to the end, where a budget cut the result), markers included; `markers`: the
    other format's pair. What is left is what the model wrote. Linear in the length of the text."""
    opening, closing = markers
    kept, position = [], 0
    while (start := completion.find(opening, position)) != -1:
        kept.append(completion[position:start])
        end = completion.find(closing, start + len(opening))
        if end == -1:
            return "".join(kept)
        position = end + len(closing)
    kept.append(completion[position:])
    return "".join(kept)


def model_answer(completion: str) -> str | None:
    """The answer the model committed to, in a completion that may call tools: the last number in
    its last complete <answer>...</answer> block (extract_answer), with the tools' results taken
    out first (without_results: both formats'), else None. The answer of --task multiplication
    --tool calculator and --task shop.

    A cut cannot corrupt it. A budget that cuts the completion before "</answer>" leaves no
    answer (None, scored 0), never a wrong one: not the operand before the cut, not the first
    digits of the product. And the tool's result is never the answer by itself: a model that
    calls the right expression and then runs out of budget, or never answers, has answered
    nothing. A result that holds "<answer>" (from a tool of your own) does not count either.
    """
    if not isinstance(completion, str):
        return None
    written = without_results(without_results(completion), (RESPONSE_OPEN, RESPONSE_CLOSE))
    return extract_answer(written)


def _parse_reference(answer) -> Decimal | None:
    """A reference answer ("18", "1,234", "-3", "0.5", an int) as a Decimal; None if no number."""
    match = _NUMBER.fullmatch(str(answer).strip())
    text = None if match is None else _number_text(match)
    return None if text is None else Decimal(text)


def correctness_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where the extracted answer equals the reference (18 == "18.00" == "$18"), else 0.0."""
    return _same_number(map(extract_answer, completions), answers)


def last_number_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where the completion's last number equals the reference, else 0.0 (--task addition)."""
    return _same_number(map(last_number, completions), answers)


def model_answer_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where the completion's model_answer equals the reference, else 0.0 (--task
    multiplication --tool calculator): a completion without a complete <answer> block of its own
    scores 0, truncated or not."""
    return _same_number(map(model_answer, completions), answers)


# --task chain's process reward (process_supervision.py): the equations a completion writes.
# An equation's left side is the run of these characters just before its "=" (on its line, after
# any earlier "="); it must hold an operator between two operands ("5 = 5" is no step).
_EXPRESSION_CHARS = frozenset("0123456789 .+-*/x×÷()")
_HAS_OPERATION = re.compile(r"[0-9)]\s*[-+*/x×÷]", re.ASCII)


def equation_steps(completions: list[str], answers: list[str] | None = None) -> list[list]:
    """A process reward: each equation "EXPRESSION = NUMBER" a completion writes is one step
    (end, reward), ending just past NUMBER, rewarded 1.0 where the calculator's value of
    EXPRESSION equals NUMBER, else 0.0 ("23 + 45 = 68" right, "68 + 12 = 81" wrong). An "=" with no
    arithmetic before it or no number after it is no step. Linear in the completion's length:
    each character is read at most twice."""
    from support.calculator import calculator

    out = []
    for text in completions:
        steps = []
        text = text if isinstance(text, str) else ""
        start = 0  # where the current equation's left side may begin
        at = text.find("=")
        while at != -1:
            left = at
            while left > start and text[left - 1] in _EXPRESSION_CHARS:
                left -= 1
            expression = text[left:at].strip()
            right_side = at + 1
            while right_side < len(text) and text[right_side] == " ":
                right_side += 1
            number = _NUMBER.match(text, right_side)
            if number is not None and _HAS_OPERATION.search(expression):
                value = _number_text(number)
                try:
                    right = value is not None and Decimal(calculator(expression)) == Decimal(value)
                except (ValueError, ArithmeticError):
                    right = False
                steps.append((number.end(), 1.0 if right else 0.0))
            start = at + 1
            at = text.find("=", start)
        out.append(steps)
    return out


def _same_number(predictions, answers):
    rewards = []
    for predicted, answer in zip(predictions, answers, strict=True):
        reference = _parse_reference(answer)
        same = predicted is not None and reference is not None and Decimal(predicted) == reference
        rewards.append(1.0 if same else 0.0)
    return rewards


def format_reward(completions: list[str], answers: list[str] | None = None) -> list[float]:
    """0.1 per tag of <think>, </think>, <answer>, </answer> found in that order, +0.1 for a number:
    max 0.5.

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
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), per length.

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


# The rewards that fit the contract, by the names trainer.py uses for flags and logging.
REWARD_FUNCS = {"correctness": correctness_reward, "format": format_reward}  # GSM8K's
# --reward-fn's built-in names: GSM8K's, --task addition's and --task chain's
BUILT_IN_REWARDS = {
    **REWARD_FUNCS,
    "last-number": last_number_reward,
    "equations": equation_steps,
}
# --extract-answer's built-ins: the answer a completion gives, for maj@k
ANSWER_EXTRACTORS = {"gsm8k": extract_answer, "last-number": last_number}


def overlong_reward(max_tokens, buffer):
    """--overlong-buffer: DAPO's soft overlong punishment (overlong_penalty, eq. 13) as a reward
    function of the completions' token counts, with L_max = max_tokens (the generation budget) and
    L_cache = buffer."""

    def overlong(completions, answers, completion_lengths):
        return overlong_penalty(completion_lengths, max_tokens, buffer)

    return overlong


# --reward-timeout's default: generous (a reward model on a CPU, or a checker that runs code, takes
# seconds per batch), but a function that hangs stops the run within minutes, saved, rather than
# holding its machine forever.
DEFAULT_TIMEOUT = 600.0


class Reward(NamedTuple):
    """A reward function and its weight: fn(completions, answers, ...) -> a float per completion."""

    name: str  # the name it is logged under: rewards/<name>, eval/<name>
    fn: Callable
    weight: float  # the total reward is the weighted sum of all the task's reward functions
    # seconds one call may take before it stops the run (sandbox.time_limit); 0: no limit.
    # from_flags sets it from --reward-timeout.
    timeout: float = DEFAULT_TIMEOUT


def weighted(named_fns, weights, timeout=DEFAULT_TIMEOUT):
    """[Reward] from [(name, fn)] and one weight each, each with the time limit `timeout` (seconds,
    0: none)."""
    return [
        Reward(name, fn, float(w), float(timeout))
        for (name, fn), w in zip(named_fns, weights, strict=True)
    ]


def score(reward_fns, completions, answers, steps=None, here=False, /, **columns):
    """Total reward [N] = sum of weight * fn(completions, answers, **the columns fn declares), and
    each function's rewards {name: [N]}. columns: prompts=[N], and any data field =[N].

    Each function is called in isolation (sandbox.call_reward), from the run and from the others:
    - it gets its own copy of every argument, so one that sorts `completions` in place or appends
      to a list-valued answer changes neither what the next function sees nor later steps' data;
    - anything it raises, SystemExit and other BaseExceptions included, is a reward error; only
      KeyboardInterrupt (Ctrl-C, and signals.Stopped for SIGTERM/SIGHUP) goes through untouched,
      so the run stops as it should;
    - it must return within its Reward.timeout (--reward-timeout);
    - it must return one finite float32 number per completion.
    A reward error stops the run here: a UserError naming the function, what was wrong, and the
    start of the offending completion (trainer.py then saves a checkpoint and exits with code 2).

    A process reward (one that returns a list of (end, reward) pairs per completion:
    process_supervision.py) counts in the total and per_fn as each completion's mean step reward
    (0 without steps: for 0/1 step rewards, the share of its steps that are right); its steps go
    to `steps` {name: sandbox.Steps}, where a dict is given (positional: a data field named
    "steps" is a column like any other)."""
    import torch

    per_fn, call = {}, functools.partial(call_here, saver=here) if here else sandbox.call_reward
    for r in reward_fns:
        per_fn[r.name] = call(r, completions, answers, declared_columns(r.fn, columns))
        if isinstance(per_fn[r.name], sandbox.Steps):
            if steps is not None:
                steps[r.name] = per_fn[r.name]
            means = [sum(v for _, v in pairs) / max(len(pairs), 1) for pairs in per_fn[r.name]]
            per_fn[r.name] = torch.tensor(means, dtype=torch.float32)
    return sum(r.weight * per_fn[r.name].double() for r in reward_fns), per_fn  # float64: finite


# --------------------------------------------------------------------------------------------------
# The run's rewards from trainer.py's flags: --reward-fn, --reward-model, --reward-weights,
# --reward-timeout and --overlong-buffer (from_flags), and --extract-answer's function
# (load_reward_fn). Whatever cannot work is a UserError now, not at step 1.


def declared_columns(fn, columns):
    """The columns {name: [value per completion]} that fn declares as parameters (all of them for
    **kwargs), except any named like its first two parameters (the completions and the answers,
    passed by position)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    first_two = [n for n, p in params.items() if p.kind in positional][:2]
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in columns.items() if k not in first_two and (takes_all or k in params)}


def call_here(r, completions, answers, columns, saver=None):
    """How train.py calls a reward function (score(..., here=saver)): in this process, on its own
    copies of the batch (as trainer.py's are), with no time limit. A signal during the call saves
    the last finished step at once (`saver`, from the signal handler: signals.save_at_once), so a
    function that hangs loses nothing, even one that swallows the signal. trainer.py's
    sandbox.call_reward adds a time limit and a worker process: a function that ends the process
    itself (os._exit) ends train.py with it, unsaved (docs/reliability.md). What it raises or
    returns wrong is the same error as there: a UserError naming the function (sandbox.as_rewards
    checks what is not one finite float32 number per completion, and turns a process reward's
    steps into sandbox.Steps)."""
    import torch

    from support.signals import STOPS  # here: the reward worker imports this file, not torch

    STOPS.saver = saver if callable(saver) else None
    try:  # each function its own copies: what one does to its lists, the next does not see
        values = r.fn(*copy.deepcopy((completions, answers)), **copy.deepcopy(columns))
    except sandbox.NOT_REWARD_ERRORS as e:
        if type(e) is KeyboardInterrupt and STOPS.previous:  # a signal's stop is Stopped
            raise UserError(
                f"reward function {r.name!r} raised KeyboardInterrupt itself (no Ctrl-C came: "
                "under train.py a Ctrl-C finishes the step); a reward function must return one "
                "float per completion."
            ) from None
        raise
    except BaseException as e:  # SystemExit too: a reward function does not end the run
        message = sandbox.exception_message(r.name, e, r.fn, completions, answers, columns)
        raise UserError(message) from None
    finally:
        STOPS.saver = None
    try:  # the common case, one finite number per completion: as as_rewards makes it, at once
        rewards = torch.as_tensor(values, dtype=torch.float32, device="cpu")
        fine = rewards.shape == (len(completions),) and bool(rewards.isfinite().all())
    except (TypeError, ValueError, RuntimeError):
        fine = False
    return rewards if fine else sandbox.as_rewards(r.name, values, completions)


def imported_here(specs):
    """train.py's --reward-fn: [Reward] of weight 1 each, from a built-in name or MODULE:FUNCTION
    imported from the working directory (called in this process, score(..., here=...);
    trainer.py's load_reward_fn runs them in a worker process with a time limit)."""
    named = [
        (spec, BUILT_IN_REWARDS[spec])
        if spec in BUILT_IN_REWARDS
        else (spec.partition(":")[2], sandbox.import_function(spec, "--reward-fn", os.getcwd()))
        for spec in specs
    ]
    check_names([name for name, _ in named])
    return weighted(named, [1.0] * len(named))


def check_names(names):
    """UserError where two rewards would share a name (their per-function values merged: one's
    dropped, the other's counted twice; the same function given twice too), or one is named
    'reward', the weighted total's name. Both entry points, before any model loads."""
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


def from_flags(args, defaults, fields=(), environment=None):
    """The run's rewards, [Reward]: --reward-fn's functions (without it the task's own
    `defaults`, [(name, fn)]), then the --env reward method's (`environment`: (its name,
    tools.environment_reward), or None), then --reward-model's models, weighted by
    --reward-weights in that order (every weight 1.0 without it), each given --reward-timeout's
    time limit. `fields`: the data rows' other fields, which a function may declare as
    parameters."""
    import torch  # here: the worker process imports rewards.py's functions, and needs no torch

    from support.reward_model import RewardModel
    from support.worker import Worker

    worker = Worker(args.reward_memory)  # started by the first function loaded by import path
    named = (
        [load_reward_fn(spec, worker=worker) for spec in args.reward_fn]
        if args.reward_fn
        else list(defaults)
    )
    named += [] if environment is None else [environment]
    names = [name for name, _ in named] + [model_name(path) for path in args.reward_model]
    names += ["overlong"] if args.overlong_buffer > 0 else []
    weights = args.reward_weights or [1.0] * len(names)
    if len(weights) != len(names):
        raise UserError(
            f"--reward-weights needs one weight per reward, in the order: reward functions, then "
            f"{'the --env reward, then ' if environment else ''}reward models, then the overlong "
            f"penalty ({', '.join(names)}): {len(names)} numbers, got "
            f"{len(weights)}."
        )
    check_names(names)
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


def check_own_task_rewards(args, task):
    """Your own task (--prompt-field/--answer-field) without --reward-fn or --reward-model would
    be scored by the task's default rewards, GSM8K's: correctness (the last number in
    <answer>...</answer> equals the answer) and format. That fits only GSM8K-shaped rows, whose
    every answer is a number (as correctness reads one: "42", "-3.5", "1,234", 42); for those it
    is said in one line. Any other answer is a UserError naming it: a run would learn from a
    reward that is 0 for every completion."""
    if args.reward_fn or args.reward_model or (args.prompt_field, args.answer_field) == (None,) * 2:
        return
    for split, flag, rows in (
        ("train", "--data", task.train),
        ("held-out", "--eval-data", task.eval),
    ):
        for i, row in enumerate(rows):
            if _parse_reference(row["answer"]) is None:
                raise UserError(
                    f"your own task has no reward function: pass --reward-fn MODULE:FUNCTION (a "
                    "function fn(completions, answers, **fields) -> one float per completion, e.g. "
                    "my_rewards:exact in ./my_rewards.py; README: Your own task) or --reward-model. "
                    "Without one the run would score it with GSM8K's rewards (correctness: the last "
                    "number in <answer>...</answer> equals the answer; format), which it does only "
                    f"when every answer is a number, and {split} row {i + 1} ({flag}) has the "
                    f"answer {str(row['answer'])[:100]!r}. To score it so anyway, pass --reward-fn "
                    "correctness,format."
                )
    if os.environ.get("RANK", "0") == "0":  # once under torchrun
        print(
            "no --reward-fn: your task is scored with GSM8K's rewards, correctness (the last "
            "number in <answer>...</answer> equals the answer: every answer is a number) and "
            "format; its prompts should ask for those tags (--system-prompt)",
            flush=True,
        )


def load_reward_fn(spec, flag="--reward-fn", builtins=None, worker=None, timeout=None):
    """(name, fn) for a --reward-fn value: a built-in's short name (BUILT_IN_REWARDS), called in
    this process, or MODULE:FUNCTION, imported in the run's worker process (`worker`, a
    support.worker.Worker; a new one if not given) with the working directory first on the import
    path (so my_rewards.py beside you works as my_rewards:brevity), and called there. The function
    is logged under its own name. --extract-answer loads its function the same way (flag and
    builtins: its own; `timeout`: its time limit per call, --reward-timeout's)."""
    from support.worker import Worker, WorkerFailed

    builtins = BUILT_IN_REWARDS if builtins is None else builtins
    if spec in builtins:
        return spec, builtins[spec]
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise UserError(
            f"{flag} {spec!r}: expected MODULE:FUNCTION (e.g. my_rewards:brevity for the function "
            f"brevity in ./my_rewards.py) or a built-in: {', '.join(builtins)}."
        )
    worker = Worker() if worker is None else worker
    try:
        remote = worker.load(spec, flag, os.getcwd())
    except WorkerFailed as e:  # it died or hung while importing
        raise UserError(f"{flag} {spec}: importing {module_name} for {flag}: {e}.") from None
    if timeout is not None:
        remote.timeout = timeout
    return fn_name, remote


def check_signature(name, fn, fields):
    """UserError unless fn takes (completions, answers) and every other parameter it requires is
    `prompts`, `completion_lengths` or a field of the data (`fields`)."""
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
        if p.default is p.empty and p.name not in (
            "prompts",
            "completion_lengths",
            "tool_calls",
            "environment_rewards",
            *fields,
        ):
            raise UserError(
                f"reward function {name!r} requires the argument {p.name!r}, which is neither `prompts`, "
                f"`completion_lengths`, `tool_calls` nor a field of the data rows (fields: "
                f"{', '.join(fields) or 'none'})."
            )


def model_name(path_or_id):
    """The name a reward model is logged under: its directory's name, or a hub id's name part."""
    return os.path.basename(os.path.normpath(path_or_id))

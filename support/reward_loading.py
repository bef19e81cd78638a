"""The run's rewards from its flags: --reward-fn, --reward-model, --reward-weights,
--reward-timeout and --overlong-buffer (from_flags), and --extract-answer's function
(load_reward_fn). Whatever cannot work is a UserError now, not at step 1.
"""

import inspect
import os

import torch

import rewards
from support.errors import UserError
from support.reward_model import RewardModel
from support.worker import Worker, WorkerFailed


def from_flags(args, defaults, fields=()):
    """The run's rewards, [rewards.Reward]: --reward-fn's functions (without it the task's own
    `defaults`, [(name, fn)]), then --reward-model's models, weighted by --reward-weights in that
    order (every weight 1.0 without it), each given --reward-timeout's time limit. `fields`: the
    data rows' other fields, which a function may declare as parameters."""
    worker = Worker(args.reward_memory)  # started by the first function loaded by import path
    named = (
        [load_reward_fn(spec, worker=worker) for spec in args.reward_fn]
        if args.reward_fn
        else list(defaults)
    )
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
        named.append(
            ("overlong", rewards.overlong_reward(args.max_new_tokens, args.overlong_buffer))
        )
    return rewards.weighted(named, weights, args.reward_timeout)


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
            if rewards._parse_reference(row["answer"]) is None:
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
    """(name, fn) for a --reward-fn value: a built-in's short name (correctness, format), called in
    this process, or MODULE:FUNCTION, imported in the run's worker process (`worker`, a
    support.worker.Worker; a new one if not given) with the working directory first on the import
    path (so my_rewards.py beside you works as my_rewards:brevity), and called there. The function
    is logged under its own name. --extract-answer loads its function the same way (flag and
    builtins: its own; `timeout`: its time limit per call, --reward-timeout's)."""
    builtins = rewards.REWARD_FUNCS if builtins is None else builtins
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

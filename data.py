"""Tasks for GRPO: what a run learns from (rows, a prompt template, reward functions), and GSM8K.

GSM8K (Cobbe et al. 2021, arXiv 2110.14168) is 7,473 train and 1,319 test grade-school word
problems. Each JSONL row is {"question": ..., "answer": "<worked solution>\\n#### <final number>"};
the data lives in the openai/grade-school-math GitHub repository (MIT license). --data and
--eval-data also take a Hugging Face dataset (the Hub's openai/gsm8k, a save_to_disk directory,
Parquet files...), read by support/hf_datasets.py; its rows are built and checked as JSONL rows are.

How trainer.py uses this file: the rows of step s are batch_at(task.train, prompts_per_step, seed,
s), a pure function of the step, so a resumed run continues with exactly the batches it would have
seen (no iterator state to save); each row's prompt (a GSM8K question) goes through
task.template, and its answer (the reference number) is repeated G times beside the G completions
that the reward functions score.
"""

import dataclasses
import functools
import json
import os
import random
import re
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import rewards
from support import hf_datasets
from support.errors import UserError


@dataclass
class Task:
    """What train() learns from. The demo, GSM8K and your own task enter the same way."""

    # Rows {"prompt": the row's own text (a GSM8K question, your task's --prompt-field), "answer":
    # the reference the reward functions compare with, and optionally "fields": {its other fields}}.
    train: list
    # Held-out rows of the same form ([] when evaluation is off).
    eval: list
    # (tokenizer, a row's prompt) -> the text around it (a chat template, say).
    template: Callable
    # [rewards.Reward]
    rewards: list
    # Written at the start of every reply, e.g. "<think>\n": the policy continues after it.
    response_prefix: str = ""
    # response -> the answer it gives (a string) or None, for maj@k in evaluation; None: no maj@k.
    extract_answer: Callable | None = None
    # Where the train and the held-out rows came from, in the user's words, for the run's header:
    # "gsm8k/train.jsonl" (a path as given), "openai/gsm8k:main@test" (a dataset and its split),
    # "GSM8K train split (downloaded to ~/.cache/grpo/gsm8k)"; "" where none were loaded.
    train_from: str = ""
    eval_from: str = ""
    # tools.Tools the completions may call mid-completion (tools.py), in training and evaluation;
    # None: none. The template's system prompt is what teaches the model their syntax.
    tools: object = None
    # row -> the shortest completion that earns the row's whole reward in the format the prompt
    # asks for: --max-new-tokens must hold it (check_budget). The generated tasks; None: unknown.
    shortest_response: Callable | None = None

    def prompt(self, tokenizer, text):
        """The text the policy continues (Algorithm 1's q): the template around a row's prompt, then
        the response prefix."""
        return self.template(tokenizer, text) + self.response_prefix

    def responses(self, completions):
        """What the reward functions score: the response prefix, then each completion (so a prefixed
        tag counts)."""
        return [self.response_prefix + c for c in completions]

    @functools.cached_property
    def field_names(self):
        """The names of the task's fields (train and held-out rows), computed once."""
        return field_names(self.train + self.eval)

    def score(
        self,
        rows,
        completions,
        G=1,
        lengths=None,
        tool_calls=None,
        steps=None,
        here=False,
        environment_rewards=None,
    ):
        """Line 8 of Algorithm 1: the total reward [N] of the G completions of each row (row 0's G
        first, as sampled) and each function's {name: [N]}. The functions see the responses (prefix
        + completion) and each row's answer, and, when they declare them, its prompt (`prompts`) and
        its other fields, G times each, each completion's token count (`completion_lengths`, from
        `lengths` [N]) and its number of tool calls (`tool_calls`, from `tool_calls` [N]; 0 each
        when the task has no tools). steps: a dict that receives a process reward's steps
        (rewards.score). here: the functions called as train.py calls them (rewards.call_here);
        a callable: the save of the last finished step, made at once on a signal during them.
        environment_rewards [N]: the --env reward method's values (the column
        `environment_rewards`, which tools.environment_reward returns)."""
        rows = [row for row in rows for _ in range(G)]
        columns = {
            name: [row.get("fields", {}).get(name) for row in rows]  # a row without a field: None
            for name in self.field_names
        }
        columns["prompts"] = [row["prompt"] for row in rows]
        if lengths is not None:
            columns["completion_lengths"] = [int(n) for n in lengths]
        calls = [0] * len(rows) if tool_calls is None else [int(n) for n in tool_calls]
        columns["tool_calls"] = calls
        if environment_rewards is not None:
            columns["environment_rewards"] = [float(v) for v in environment_rewards]
        responses, answers = self.responses(completions), [row["answer"] for row in rows]
        return rewards.score(self.rewards, responses, answers, steps, here, **columns)


def check_budget(task, tokenizer, args):
    """UserError where --max-new-tokens cannot hold the task's shortest full-reward response
    (task.shortest_response, then EOS) for its longest row: those completions would all be cut
    and score 0, and the run would train on nothing, silently. Tasks without a known minimum
    (yours, GSM8K's free-form working) pass, as do the task's rows under your --reward-fn."""
    if task.shortest_response is None or not task.train or args.reward_fn:
        return
    max_new_tokens, name = args.max_new_tokens, f"--task {args.task}"
    texts = sorted({task.shortest_response(row) for row in task.train})
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    need, longest = max((len(t) + 1, text) for t, text in zip(ids, texts, strict=True))
    if max_new_tokens < need:
        raise UserError(
            f"--max-new-tokens {max_new_tokens} cannot hold an answer of {name}: its shortest "
            f"response that earns the whole reward takes {need} tokens with EOS ({longest!r}), "
            f"so every completion would be cut and score 0. Pass --max-new-tokens {need} or more "
            "(the task's default leaves room for the working)."
        )


def field_names(rows):
    """The names of the rows' other fields: what a reward function may declare besides `prompts`."""
    return sorted({name for row in rows for name in row.get("fields", {})})


GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/{split}.jsonl"
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "grpo", "gsm8k")


class DownloadError(RuntimeError):
    """GSM8K's official split could not be downloaded (no network, say): its message says what was
    tried; what to pass instead depends on the command (data.load_rows says it)."""


# The reference answer after "####", commas removed: an integer or a decimal, maybe negative.
_GOLD = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def _download(split: str) -> str:
    """The path of the cached `{split}.jsonl`, downloaded first if it is not cached yet."""
    dest = os.path.join(CACHE_DIR, f"{split}.jsonl")
    if os.path.exists(dest):
        return dest
    url = GSM8K_URL.format(split=split)
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            payload = response.read()
    except OSError as e:  # URLError, HTTPError and socket timeouts are all OSErrors
        raise DownloadError(f"could not download GSM8K's {split} split from {url} ({e}).") from e
    # Write to a temporary file in the same directory, then rename: an interrupted download never
    # leaves a half-written file in the cache (os.replace is atomic on one file system).
    os.makedirs(CACHE_DIR, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=CACHE_DIR, prefix=f".{split}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dest


def load_gsm8k(split: str = "train", path: str | None = None) -> list[dict]:
    """GSM8K as a list of rows {"prompt": its question, "answer": str}, the answer its final number.

    `path` is a local JSONL file in GSM8K's format; without it the official `split` ("train" or
    "test") is downloaded into CACHE_DIR once and read from there afterwards (DownloadError where it
    cannot be). The answer is the text after the last "####" with commas removed ("#### 1,234" ->
    "1234"). A malformed line raises ValueError naming "file:line"; blank lines are skipped; a file
    with no rows is an error too.
    """
    if path is None:
        if split not in ("train", "test"):
            raise ValueError(f"GSM8K has splits 'train' and 'test', not {split!r}")
        path = _download(split)
    return [gsm8k_row(where, record) for where, record in read_jsonl(path)]


# The most characters a row's prompt may hold: a prompt is tokenized whole (then cut to
# --max-prompt-length's last tokens), so one 50 MB row cost minutes each time its batch came up.
# 1,000,000 characters is about 250,000 tokens of English (~4 characters a token), beyond the
# context of the models a GRPO run samples G completions of (SmolLM2: 8,192 tokens; most others
# 32k-128k), and tokenizes in about 2 s (SmolLM2's tokenizer, 2 CPU cores).
MAX_PROMPT_CHARS = 1_000_000


def check_prompt_length(where, prompt, field):
    """ValueError starting with `where` for a prompt longer than MAX_PROMPT_CHARS."""
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(
            f"{where}: the prompt ({field!r}) is {len(prompt):,} characters long, more than "
            f"{MAX_PROMPT_CHARS:,} (about 250,000 tokens, beyond any model's context here): "
            "shorten the row or leave it out"
        )


def gsm8k_row(where, record):
    """GSM8K's row {"prompt": the question, "answer": the final number} from a record (a JSONL
    line's object, a dataset's row) with a "question" string and an "answer" string ending in
    "#### <number>". A bad record raises ValueError starting with `where` ("file:line")."""
    for field in ("question", "answer"):
        if not isinstance(record.get(field), str):
            raise ValueError(f"{where}: missing string field {field!r}")
    if "####" not in record["answer"]:
        raise ValueError(f"{where}: answer has no '####' final-answer marker")
    final = record["answer"].split("####")[-1].strip().replace(",", "")
    if not _GOLD.fullmatch(final):
        raise ValueError(f"{where}: the text after '####' is not a number: {final!r}")
    check_prompt_length(where, record["question"], "question")
    return {"prompt": record["question"], "answer": final}


def load_jsonl(path: str, prompt_field: str = "prompt", answer_field: str = "answer") -> list[dict]:
    """Your own task's rows from any JSONL file, taken as they are: {"prompt": row[prompt_field] (a
    string), "answer": row[answer_field] (any JSON value), "fields": every other field}. Errors as
    in load_gsm8k."""
    return [
        own_row(where, record, prompt_field, answer_field) for where, record in read_jsonl(path)
    ]


def own_row(where, record, prompt_field, answer_field):
    """Your own task's row from a record (a JSONL line's object, a dataset's row), as it is:
    {"prompt": record[prompt_field] (a string), "answer": record[answer_field], "fields": every
    other field}. A bad record raises ValueError starting with `where`."""
    if not isinstance(record.get(prompt_field), str):
        got = (
            "missing"
            if prompt_field not in record
            else f"a {type(record[prompt_field]).__name__}, not a string"
        )
        raise ValueError(
            f"{where}: the prompt field {prompt_field!r} is {got} (fields: {', '.join(record)})"
        )
    if answer_field not in record:
        raise ValueError(f"{where}: no answer field {answer_field!r} (fields: {', '.join(record)})")
    check_prompt_length(where, record[prompt_field], prompt_field)
    others = {k: v for k, v in record.items() if k not in (prompt_field, answer_field)}
    reserved = {"prompts", "completion_lengths", "tool_calls", "environment_rewards"}
    reserved = sorted(set(others) & reserved)
    if reserved:
        raise ValueError(
            f"{where}: a field may not be named {reserved[0]!r}: reward functions get that argument "
            "from trainer.py; rename the field"
        )
    return {"prompt": record[prompt_field], "answer": record[answer_field], "fields": others}


def read_jsonl(path):
    """(where, row) for each JSON object of a JSONL file, where = "file:line". A malformed line
    raises ValueError naming file:line; blank lines are skipped; a file with no rows is an error."""
    count = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise ValueError(f"{where}: malformed JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            count += 1
            yield where, row
    if not count:
        raise ValueError(f"{path}: no rows (empty file)")


# Our wording of the template in Pramodith's GRPO trainer blog: the task, the two tags, then one
# worked example.
SYSTEM_PROMPT = """You are a helpful assistant who solves math word problems.
Think through the problem step by step inside <think> </think> tags.
Then give only the final number inside <answer> </answer> tags.

For example:
Question: Joel has 24 cookies. He gives 8 cookies to his sister and eats 4 himself. How many cookies does Joel have left?
<think>
Joel starts with 24 cookies. After giving 8 away he has 24 - 8 = 16. After eating 4 he has 16 - 4 = 12.
</think>
<answer>12</answer>"""


def build_prompt(tokenizer, question: str, system_prompt: str = SYSTEM_PROMPT) -> str:
    """GSM8K's prompt: the system prompt, then "Question: ...", in the tokenizer's chat format (see
    chat_prompt); without a chat template, the plain text ends with a line "Answer:"."""
    return chat_prompt(tokenizer, f"Question: {question}", system_prompt, plain_end="\nAnswer:\n")


def chat_prompt(tokenizer, user: str, system_prompt: str = "", plain_end: str = "\n") -> str:
    """The text the policy continues: the system prompt (none when empty) and the user's message.

    With a chat template this is `tokenizer.apply_chat_template(..., add_generation_prompt=True)`,
    so the text ends where the assistant's reply begins. A tokenizer without one (base models) gets
    plain text instead: its BOS token if it has one (prompts are tokenized without special tokens,
    so nothing else would add it), the system prompt and a blank line, the user's text, then
    `plain_end`, so the model starts its reply on a fresh line.
    """
    # a base model: its BOS first, as its pretraining saw
    if getattr(tokenizer, "chat_template", None) is None:
        system = f"{system_prompt}\n\n" if system_prompt else ""
        return f"{getattr(tokenizer, 'bos_token', None) or ''}{system}{user}{plain_end}"
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return tokenizer.apply_chat_template(
        system + [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )


# --task addition: "What is A + B?" for two-digit A, B in [10, 49], a skill SmolLM2-135M-Instruct
# has but uses unreliably (docs/results.md). All 820 unordered pairs {A, B} are shuffled with
# ADDITION_SEED: the first 200 are held out (one question each, its order drawn by the same
# generator), the other 620 are trained on in both orders (1,209 questions), so no held-out pair
# is trained on in either order.
ADDITION_SEED = 0
ADDITION_RANGE = (10, 49)
ADDITION_HELD_OUT = 200


def as_is(tokenizer, text):
    """A task's prompt as it is: no chat template (the demos' tiny models know none)."""
    return text


def demo_task(problems):
    """The offline demo's task (support/demo.py): its 100 problems, trained and evaluated on, scored
    by correctness_reward."""
    what = f"the demo's {len(problems)} problems"
    return demo_like_task(problems, problems, what, f"{what} (the ones it trains on)")


def tool_demo_task(train, held_out):
    """--demo --tool calculator's task: sums of a, b in [0, 99], some held out."""
    sums = f"{len(train)} sums a + b of a, b in [0, 99]"
    return demo_like_task(train, held_out, sums, f"{len(held_out)} other sums (never trained on)")


def demo_like_task(train, held_out, train_from, eval_from):
    return Task(
        train=train,
        eval=held_out,
        template=as_is,
        rewards=rewards.weighted([("correctness", rewards.correctness_reward)], [1.0]),
        extract_answer=rewards.extract_answer,
        train_from=train_from,
        eval_from=eval_from,
    )


def addition_rows(seed=ADDITION_SEED, low=ADDITION_RANGE[0], high=ADDITION_RANGE[1], held_out=None):
    """(train rows, held-out rows) of the addition task: {"prompt": "What is A + B?", "answer":
    "A+B"}, generated from `seed` alone (Python's random.Random), the same on every machine and
    every run."""
    held_out = ADDITION_HELD_OUT if held_out is None else held_out
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(low, high + 1) for b in range(a, high + 1)]
    rng.shuffle(pairs)

    def row(a, b):
        return {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}

    test = [row(*(pair if rng.random() < 0.5 else pair[::-1])) for pair in pairs[:held_out]]
    train = [row(x, y) for a, b in pairs[held_out:] for x, y in sorted({(a, b), (b, a)})]
    return train, test


def addition_task():
    """--task addition: the generated rows in the chat template with no system prompt, scored by the
    completion's last number (rewards.last_number_reward), which is also its answer (maj@k)."""
    train, test = addition_rows()
    generated = f"generated (--task addition, seed {ADDITION_SEED})"
    return Task(
        train=train,
        eval=test,
        template=functools.partial(chat_prompt, system_prompt=""),
        rewards=rewards.weighted([("correctness", rewards.last_number_reward)], [1.0]),
        extract_answer=rewards.last_number,
        train_from=generated,
        eval_from=f"{generated[:-1]}, pairs never trained on)",
        shortest_response=lambda row: row["answer"],  # the sum alone: its last number
    )


# --task multiplication: "What is A x B?" for A in [100, 999], B in [10, 99], which
# SmolLM2-135M-Instruct cannot do in its head (0 of 256 samples right in a pilot) but can with a
# calculator. 200 held-out questions, the rest of MULTIPLICATION_ROWS trained on; no held-out
# pair (in either order) is trained on.
MULTIPLICATION_SEED = 0
MULTIPLICATION_ROWS = 5000
# --task multiplication --tool calculator: a system prompt with the call syntax, then one worked
# exchange as earlier chat turns (tool_prompt). A pilot on SmolLM2-135M-Instruct (128 samples each,
# T = 0.7): the syntax in the system prompt alone, 0-4% of completions called the tool; with this
# exchange, 27% did and 16% were right; with an exchange that answers at once, 70% called: too
# few errors left for GRPO to show what it adds.
# The answer goes in <answer>...</answer> and only there (rewards.model_answer): a completion that
# the budget cuts before "</answer>" has no answer, never a wrong one (issue 43). With the last
# number as the answer, a cut in the restatement ("So 2824 x 984 = ") scored the operand 984.
TOOL_SYSTEM_PROMPT = (
    "You can use a calculator: write <tool>calculator EXPRESSION</tool> and the result appears as "
    "<result>VALUE</result>. Give your final answer as <answer>NUMBER</answer>."
)
TOOL_EXAMPLE = (
    "What is 12 x 34?",
    "Let me use the calculator. <tool>calculator 12*34</tool><result>408</result> So 12 x 34 = "
    "<answer>408</answer>.",
)


def tool_prompt(tokenizer, question):
    """--task multiplication --tool calculator's prompt: TOOL_SYSTEM_PROMPT, TOOL_EXAMPLE as a
    user turn and the assistant's reply, then the question; without a chat template, the same as
    plain text (chat_prompt's form)."""
    return example_prompt(TOOL_SYSTEM_PROMPT, TOOL_EXAMPLE, tokenizer, question)


def multiplication_row(a, b):
    """One row of the multiplication task: "What is A x B?" and A*B."""
    return {"prompt": f"What is {a} x {b}?", "answer": str(a * b)}


def multiplication_rows(seed=MULTIPLICATION_SEED, count=MULTIPLICATION_ROWS, held_out=200):
    """(train rows, held-out rows) of the multiplication task: {"prompt": "What is A x B?",
    "answer": "A*B"} for `count` distinct pairs drawn with Python's random.Random(seed)."""
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(100, 1000) for b in range(10, 100)], count)
    rows = [multiplication_row(a, b) for a, b in pairs]
    return rows[held_out:], rows[:held_out]


# Held-out questions with larger operands than the task's (docs/tools.md): 4-digit x 3-digit
# products, never trained on (the task's operands have 3 and 2 digits), from their own seed.
LARGER_SEED = 43


def larger_multiplication_rows(digits=(4, 3), count=200, seed=LARGER_SEED):
    """`count` distinct rows "What is A x B?" with A of digits[0] digits and B of digits[1], drawn
    with random.Random(seed): held-out questions beyond the task's operands
    (scripts/tool_heldout.py)."""
    rng, pairs = random.Random(seed), {}
    a_range, b_range = [(10 ** (d - 1), 10**d - 1) for d in digits]
    if count > (a_range[1] - a_range[0] + 1) * (b_range[1] - b_range[0] + 1):
        raise ValueError(f"fewer than {count} pairs of {digits[0]} and {digits[1]} digits")
    while len(pairs) < count:  # a dict keeps the order of the draws
        pairs.setdefault((rng.randint(*a_range), rng.randint(*b_range)))
    return [multiplication_row(a, b) for a, b in pairs]


def multiplication_task(with_tools, eval_rows=None):
    """--task multiplication: its generated rows in the chat template. with_tools: the prompt that
    shows the calculator's call and the answer's tags (tool_prompt), scored by the answer in
    <answer>...</answer> (rewards.model_answer_reward: a truncated completion scores 0, never by
    the number the cut left last); without, the question alone, scored by the completion's last
    number. eval_rows: held-out rows in place of the task's own (scripts/tool_heldout.py)."""
    train, test = multiplication_rows()
    generated = f"generated (--task multiplication, seed {MULTIPLICATION_SEED})"
    eval_from = f"{generated[:-1]}, pairs never trained on)"
    if eval_rows is not None:
        test, eval_from = eval_rows, "given (larger operands than the task's)"
    if with_tools:
        template, reward, extract = tool_prompt, rewards.model_answer_reward, rewards.model_answer
        shortest = lambda row: f"<answer>{row['answer']}</answer>"  # noqa: E731 (the call: optional)
    else:
        template = functools.partial(chat_prompt, system_prompt="")
        reward, extract = rewards.last_number_reward, rewards.last_number
        shortest = lambda row: row["answer"]  # noqa: E731
    return Task(
        train=train,
        eval=test,
        template=template,
        rewards=rewards.weighted([("correctness", reward)], [1.0]),
        extract_answer=extract,
        train_from=generated,
        eval_from=eval_from,
        shortest_response=shortest,
    )


# --task chain: "What is A + B + C?" for A, B, C in [10, 30], worked as one equation per line, each
# checked by the calculator (rewards.equation_steps, a process reward: DeepSeekMath §4.1.3) beside
# the final answer's correctness. The prompt shows one worked exchange, as the tool task's does;
# the pilot that chose it is in docs/process.md.
CHAIN_SEED = 0
CHAIN_ROWS = 5000
CHAIN_TERMS = 3
CHAIN_RANGE = (10, 30)
CHAIN_SYSTEM_PROMPT = (
    "Add the numbers one at a time. Write each addition as an equation on its own line, then the "
    "final answer."
)
CHAIN_EXAMPLE = ("What is 14 + 25 + 31?", "14 + 25 = 39\n39 + 31 = 70\nThe answer is 70.")


def chain_rows(seed=CHAIN_SEED, count=CHAIN_ROWS, held_out=200, terms=CHAIN_TERMS):
    """(train rows, held-out rows) of --task chain: {"prompt": "What is A + B + C?", "answer":
    the sum} for `count` distinct draws with random.Random(seed); no held-out question is trained
    on (the draws are distinct tuples)."""
    rng, draws = random.Random(seed), {}
    while len(draws) < count:  # a dict keeps the order of the draws
        draws.setdefault(tuple(rng.randint(*CHAIN_RANGE) for _ in range(terms)))
    rows = [{"prompt": f"What is {' + '.join(map(str, t))}?", "answer": str(sum(t))} for t in draws]
    return rows[held_out:], rows[:held_out]


def example_prompt(system_prompt, example, tokenizer, question):
    """A chat prompt with a system prompt and one worked exchange (user, assistant) before the
    question; without a chat template, the same as plain text."""
    user, reply = example
    if getattr(tokenizer, "chat_template", None) is None:
        return chat_prompt(tokenizer, question, f"{system_prompt}\n\n{user}\n{reply}")
    turns = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": user},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": question},
    ]
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


def chain_task(process=True):
    """--task chain: its generated rows in chain_prompt, scored by the final answer (the last
    number: rewards.last_number_reward) and, with process=True, each written equation
    (rewards.equation_steps, process supervision); process=False is outcome supervision alone."""
    train, test = chain_rows()
    generated = f"generated (--task chain, seed {CHAIN_SEED})"
    named = [("correctness", rewards.last_number_reward)]
    if process:
        named.append(("equations", rewards.equation_steps))
    return Task(
        train=train,
        eval=test,
        template=functools.partial(example_prompt, CHAIN_SYSTEM_PROMPT, CHAIN_EXAMPLE),
        rewards=rewards.weighted(named, [1.0] * len(named)),
        extract_answer=rewards.last_number,
        train_from=generated,
        eval_from=f"{generated[:-1]}, questions never trained on)",
        shortest_response=chain_response if process else lambda row: row["answer"],
    )


def chain_response(row):
    """--task chain's working as CHAIN_EXAMPLE shows it, for a row: one equation per line (each
    checked by rewards.equation_steps), then the answer's sentence."""
    terms, lines, total = [int(t) for t in re.findall(r"\d+", row["prompt"])], [], None
    for t in terms:
        if total is not None:
            lines.append(f"{total} + {t} = {total + t}")
        total = t if total is None else total + t
    return "\n".join([*lines, f"The answer is {total}."])


# --task shop (issue 55, item 4): each row's environment (support/shop.py) holds a small price list
# drawn for the row and shown nowhere in the prompt; the question asks for the total price of a
# basket, so the model looks up each of its items (the `price` tool) and adds them up (the
# `calculator`): two tools, three calls or more, with state in the environment. Nothing can be
# memorized: the prices are drawn per row, and the held-out rows' items are never in a training
# row. The worked example's items (tea, jam) are in neither.
SHOP_SEED = 0
SHOP_ROWS = 5000
SHOP_ITEMS = (
    "apple bread butter cheese coffee corn eggs fish flour honey milk nuts oats oil pasta peas "
    "rice salt soap soup sugar beans tuna wine"
).split()
SHOP_HELD_OUT_ITEMS = "bacon cocoa cream garlic ginger lemon mango melon olives pepper syrup yogurt"
SHOP_HELD_OUT_ITEMS = SHOP_HELD_OUT_ITEMS.split()
SHOP_PRICES = (2, 19)  # each item's price, drawn per row
SHOP_LIST = 5  # items on a row's price list: the basket's and others
SHOP_SYSTEM_PROMPT = {
    "markers": "You are a shop's assistant. You do not know its prices: look each item up with "
    '<tool>price {"item": NAME}</tool>, add them up with <tool>calculator EXPRESSION</tool>, and give '
    "the total as <answer>NUMBER</answer>.",
    "hermes": "You are a shop's assistant. You do not know its prices: look each item up with the "
    "price tool, add them up with the calculator tool, and give the total as "
    "<answer>NUMBER</answer>.",
}
SHOP_EXAMPLE_QUESTION = "What is the total price of 2 tea and 3 jam?"
SHOP_EXAMPLE_PRICES = {"tea": 4, "jam": 7, "figs": 5}  # the example's shop (tests check it)
SHOP_EXAMPLE = {
    "markers": (
        SHOP_EXAMPLE_QUESTION,
        '<tool>price {"item": "tea"}</tool><result>4</result> <tool>price {"item": "jam"}</tool>'
        "<result>7</result> <tool>calculator 2*4+3*7</tool><result>29</result> The total is "
        "<answer>29</answer>.",
    ),
    "hermes": (
        SHOP_EXAMPLE_QUESTION,
        '<tool_call>{"name": "price", "arguments": {"item": "tea"}}</tool_call><tool_response>\n4\n'
        '</tool_response>\n<tool_call>{"name": "price", "arguments": {"item": "jam"}}</tool_call>'
        '<tool_response>\n7\n</tool_response>\n<tool_call>{"name": "calculator", "arguments": '
        '{"expression": "2*4+3*7"}}</tool_call><tool_response>\n29\n</tool_response>\nThe total '
        "is <answer>29</answer>.",
    ),
}


def shop_row(rng, items):
    """One row of --task shop: a price list of SHOP_LIST of `items` at prices drawn from
    SHOP_PRICES, a basket of 2 or 3 of them (1 to 3 units each), its question and its total."""
    listed = rng.sample(items, SHOP_LIST)
    prices = {item: rng.randint(*SHOP_PRICES) for item in listed}
    basket = {item: rng.randint(1, 3) for item in listed[: rng.randint(2, 3)]}
    parts = [f"{n} {item}" for item, n in basket.items()]
    question = f"What is the total price of {', '.join(parts[:-1])} and {parts[-1]}?"
    total = sum(n * prices[item] for item, n in basket.items())
    return {
        "prompt": question,
        "answer": str(total),
        "fields": {"prices": prices, "basket": basket},
    }


def shop_rows(seed=SHOP_SEED, count=SHOP_ROWS, held_out=200):
    """(train rows, held-out rows) of --task shop, drawn with random.Random(seed): the train rows
    from SHOP_ITEMS, the held-out ones from SHOP_HELD_OUT_ITEMS (no item of one is in the other)."""
    rng = random.Random(seed)
    train = [shop_row(rng, SHOP_ITEMS) for _ in range(count)]
    return train, [shop_row(rng, SHOP_HELD_OUT_ITEMS) for _ in range(held_out)]


def shop_task(tool_format="markers"):
    """--task shop: its rows, in a prompt with the system prompt and one worked exchange in the
    call format (the tools' schemas are added to it under hermes: tools.ToolPrompt), scored by
    the answer in <answer>...</answer> with the tools' results taken out (model_answer_reward);
    the environment's reward (looked_up) joins it (support/shop.py)."""
    train, test = shop_rows()
    generated = f"generated (--task shop, seed {SHOP_SEED})"
    return Task(
        train=train,
        eval=test,
        template=functools.partial(
            example_prompt, SHOP_SYSTEM_PROMPT[tool_format], SHOP_EXAMPLE[tool_format]
        ),
        rewards=rewards.weighted([("correctness", rewards.model_answer_reward)], [1.0]),
        extract_answer=rewards.model_answer,
        train_from=generated,
        eval_from=f"{generated[:-1]}, items never trained on)",
        shortest_response=lambda row: f"<answer>{row['answer']}</answer>",
    )


def task_from_flags(args):
    """The task that --data describes, with its default rewards (rewards.from_flags applies
    --reward-fn etc.): GSM8K (rows read as GSM8K, correctness and format, data.SYSTEM_PROMPT) or,
    with --prompt-field or --answer-field, your own rows (as they are, no system prompt unless
    --system-prompt). --data is a JSONL file or a Hugging Face dataset (hf_datasets.parse_source).
    Held-out rows come from --eval-data; for GSM8K without it, from gsm8k_held_out, else the
    official test split. --task addition: its generated rows (addition_task). Where the rows came
    from: the task's train_from and eval_from (rows_from)."""
    if args.task == "addition":
        return addition_task()
    if args.task == "multiplication":
        return multiplication_task(bool(args.tool))
    if args.task == "chain":
        return chain_task()
    if args.task == "shop":
        return shop_task(args.tool_format)
    custom = args.prompt_field is not None or args.answer_field is not None
    need_train, need_eval = not args.eval_only, args.eval_only or args.eval_every >= 0
    eval_path, eval_flag = args.eval_data, "--eval-data"
    if custom:
        if args.data is None and need_train:
            raise UserError(
                "--prompt-field/--answer-field describe the rows of your own data: pass it with "
                "--data PATH (a JSONL file or a dataset)."
            )
        if eval_path is None and need_eval:
            if args.eval_only:
                raise UserError(
                    "--eval-only on your own task needs its held-out rows: --eval-data PATH."
                )
            print(
                "no --eval-data: this task is not GSM8K, so there is no evaluation. To measure on "
                "held-out rows, pass them in the same format with --eval-data (a JSONL file, or a "
                "dataset's split: ID@test).",
                flush=True,
            )
        fields = (args.prompt_field or "prompt", args.answer_field or "answer")
        prompt = functools.partial(chat_prompt, system_prompt=args.system_prompt or "")
    else:
        if eval_path is None and args.data is not None:
            eval_path = gsm8k_held_out(args.data)
            # the test split of --data itself: its messages name --data
            eval_flag = "--data" if isinstance(eval_path, hf_datasets.Source) else "--eval-data"
        fields = None
        system = SYSTEM_PROMPT if args.system_prompt is None else args.system_prompt
        prompt = functools.partial(build_prompt, system_prompt=system)
    # Where GSM8K's official split cannot be downloaded: the error ({error}), then what to pass
    # instead, for this command. A training run without --data downloads the held-out rows too:
    # both files, then, beside each other.
    copy = "{error} Offline, copy that file (on a machine with network)"
    if args.eval_data is None and need_eval:
        train_advice = (
            f"{copy} and test.jsonl from the same folder into one directory here, and pass --data "
            "DIR/train.jsonl: test.jsonl beside it is evaluated on."
        )
    else:
        train_advice = f"{copy} here and pass --data PATH."
    # --eval-only evaluates whatever the flags: no --eval-every -1 for it
    test_advice = f"{copy} here and pass --eval-data PATH" + (
        "." if args.eval_only else " (--eval-every -1: train without evaluation)."
    )
    if args.data is not None:  # say why a run with --data downloads
        test_advice = "no --eval-data, and no test file beside --data: " + test_advice
    train, train_from, held_out, eval_from = [], "", [], ""
    if need_train:
        train = load_rows("train", args.data, "--data", fields, train_advice, not args.eval_only)
        train_from = rows_from("train", args.data)
        check_some_prompt(train, train_from, fields)
    if need_eval and (eval_path or not custom):
        held_out = load_rows("test", eval_path, eval_flag, fields, test_advice, not args.eval_only)
        eval_from = rows_from("test", eval_path)
        check_some_prompt(held_out, eval_from, fields)
    return Task(
        train=train,
        eval=held_out,
        template=prompt,
        rewards=rewards.weighted(rewards.REWARD_FUNCS.items(), [1.0, 1.0]),
        extract_answer=None if custom else rewards.extract_answer,
        train_from=train_from,
        eval_from=eval_from,
    )


def check_some_prompt(rows, source, fields):
    """UserError when every row's prompt is empty (or blank): a wrong --prompt-field, or a
    column the export left empty; the batch would be tokens of the template alone, or none (a
    traceback from inside the model)."""
    if rows and not any(row["prompt"].strip() for row in rows):
        field = "question" if fields is None else fields[0]
        others = sorted({name for row in rows for name in row.get("fields", {})})
        raise UserError(
            f"every row of {source} ({len(rows)}) has an empty prompt (its {field!r} field): "
            "there is nothing to answer. "
            + (
                f"Pass the field that holds the prompts with --prompt-field (the rows' other "
                f"fields: {', '.join(others)})."
                if others
                else "Fill the prompts in."
            )
        )


def rows_from(split, path):
    """Where the rows of `split` that load_rows read from `path` came from, as the user knows it:
    the path as given, a dataset with the split it read (NAME:CONFIG@SPLIT), or GSM8K's download."""
    if path is None:
        cache = CACHE_DIR.replace(os.path.expanduser("~"), "~", 1)
        return f"GSM8K {split} split (downloaded to {cache})"
    source = path if isinstance(path, hf_datasets.Source) else hf_datasets.parse_source(path, "")
    if source is None:
        return path
    return source.name(source.split or split) if source.has_splits else source.text


def gsm8k_held_out(data):
    """GSM8K's held-out rows when --eval-data is not given: the test split of a --data that has
    splits (a Hub id, a saved DatasetDict, a folder of data files), else `test` beside --data in
    its form (test.jsonl beside a JSONL file, test.parquet beside a Parquet file, test/ beside a
    saved Dataset), named as --data is (relative where it is); None when there is none."""
    source = hf_datasets.parse_source(data, "--data")
    if source is not None and source.has_splits:
        return dataclasses.replace(source, split=None)  # no split named: held-out rows read test
    path = data if source is None else source.location
    if source is None:  # a JSONL file, as before
        beside, there = "test.jsonl", os.path.isfile
    elif source.kind == "saved":  # a directory
        beside, there = "test", os.path.isdir
    else:
        beside, there = "test" + os.path.splitext(path)[1], os.path.isfile
    beside = os.path.join(os.path.dirname(os.path.normpath(path)), beside)
    return beside if there(beside) and os.path.abspath(beside) != os.path.abspath(path) else None


def row_form(fields):
    """What each row must hold, for messages: GSM8K's (fields None) or your own task's."""
    if fields is None:
        return 'a "question" string and an "answer" string ending in "#### <number>"'
    return "the --prompt-field (a string) and the --answer-field"


def load_rows(split, path, flag, fields=None, offline="{error}", can_skip_eval=True):
    """The rows of `path` (a --data/--eval-data value, or a Source) read as GSM8K (its official
    `split` when path is None) or, with `fields` (prompt field, answer field), as your own task's.
    A JSONL file is read by read_jsonl, a Hugging Face dataset by hf_datasets.dataset_records, both
    built record by record. Any problem is a UserError naming the flag, and for a bad row its
    file:line (a dataset's: its split and row). `offline`: the message where GSM8K's split cannot be
    downloaded, around its {error}: what to do instead, for this command (task_from_flags says it);
    can_skip_eval: a training run, which a missing test split may tell to turn evaluation off
    (--eval-every -1), unlike --eval-only."""
    if isinstance(path, hf_datasets.Source) or path is None:
        source = path
    else:
        source = hf_datasets.parse_source(path, flag)
    what = "your task's" if fields is not None else "the GSM8K"
    if source is not None:
        records = hf_datasets.dataset_records(
            source, split, flag, fields, row_form(fields), can_skip_eval
        )
        if fields is None:
            build = gsm8k_row
        else:
            build = functools.partial(own_row, prompt_field=fields[0], answer_field=fields[1])
        try:
            rows = [build(where, record) for where, record in records]
            if fields is not None and all(row["answer"] is None for row in rows):
                # a CSV's empty cells come as None: as a JSONL line without the answer field
                name = records[0][0].rsplit(", row ", 1)[0]
                raise ValueError(
                    f"{name}: the answer column {fields[1]!r} is empty in every row (no answer field)"
                )
            return rows
        except ValueError as e:  # "gsm8k@train, row 12: answer has no '####' final-answer marker"
            raise UserError(
                f"could not load {what} {split} data: {e}. Each row of {flag} must have "
                f"{row_form(fields)}."
            ) from None
    form = "a JSON object with " + row_form(fields)
    if path is not None and not os.path.isfile(path):
        raise UserError(
            f"{flag} {path}: no such file or directory. Pass a JSONL file (each line {form}) or "
            "a Hugging Face dataset (a save_to_disk directory, a Parquet, CSV or JSON file, or a "
            "Hub id OWNER/NAME[:CONFIG][@SPLIT]; docs/your-task.md)."
        )
    try:
        return load_jsonl(path, *fields) if fields is not None else load_gsm8k(split, path=path)
    except ValueError as e:  # "path:12: malformed JSON (...)"
        raise UserError(
            f"could not load {what} {split} data: {e}. Each line of {flag} must be {form}."
        ) from None
    except DownloadError as e:  # no network
        raise UserError(offline.format(error=e)) from None
    except OSError as e:  # an unreadable file
        raise UserError(
            f"could not load {what} {split} data: {flag} {path}: {e.strerror or e}. Pass a "
            "readable file."
        ) from None


def batch_at(rows: list, batch_size: int, seed: int, step: int, stream: int = 0) -> list:
    """The batch of rows for global training step `step`, computed from scratch (pure function).

    Each epoch visits the rows in a fresh random order: the permutation of epoch e comes from
    numpy's generator seeded with the pair (seed, e) (seed >= 0), so it depends on nothing but
    seed, e and len(rows). An epoch is len(rows) // batch_size batches; the few rows left over at
    the end of an epoch's order are skipped for that epoch (they are elsewhere in the next shuffle).
    stream k > 0: another order of the same kind, seeded with (seed, e, k): the extra prompts
    --dynamic-sampling draws at step s in its k-th extra generate call, still a pure function of
    (seed, step, k).
    """
    if not 0 < batch_size <= len(rows):
        raise ValueError(
            f"batch_size must be between 1 and the number of rows ({len(rows)}), got {batch_size}"
        )
    batches_per_epoch = len(rows) // batch_size
    epoch, index = divmod(step, batches_per_epoch)
    order = np.random.default_rng([seed, epoch] + ([stream] if stream else [])).permutation(
        len(rows)
    )
    return [rows[i] for i in order[index * batch_size : (index + 1) * batch_size]]

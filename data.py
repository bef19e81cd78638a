"""Tasks for GRPO: what a run learns from (rows, a prompt builder, reward functions), and GSM8K.

GSM8K (Cobbe et al. 2021, arXiv 2110.14168) is 7,473 train and 1,319 test grade-school word problems.
Each JSONL row is {"question": ..., "answer": "<worked solution>\\n#### <final number>"}; the data
lives in the openai/grade-school-math GitHub repository (MIT license).

How train.py uses this file: the rows of step s are batch_at(task.train, prompts_per_step, seed, s), a pure
function of the step, so a resumed run continues with exactly the batches it would have seen (no iterator
state to save); each row's question goes through task.prompt, and its answer (the reference number) is
repeated G times beside the G completions that the reward functions score.
"""
import json
import os
import re
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class Reward(NamedTuple):
    """One reward function and its weight: fn(completions, answers) -> one float per completion (see rewards.py)."""
    name: str          # the name it is logged under: rewards/<name>, eval/<name>
    fn: Callable
    weight: float      # the total reward is the weighted sum of all the task's reward functions


@dataclass
class Task:
    """What train() learns from. The demo, GSM8K and your own task enter the same way."""
    train: list        # rows {"question": str, "answer": str}; the answer is what the reward functions compare with
    eval: list         # held-out rows of the same form ([] when evaluation is off)
    prompt: Callable   # (tokenizer, question) -> the text the policy continues
    rewards: list      # [Reward]
    response_prefix: str = ""  # written at the start of every reply, e.g. "<think>\n": the policy continues after it

    def query(self, tokenizer, question):
        """The text the policy continues: the prompt, then the response prefix."""
        return self.prompt(tokenizer, question) + self.response_prefix

    def responses(self, completions):
        """What the reward functions score: the response prefix, then each completion (so a prefixed tag counts)."""
        return [self.response_prefix + c for c in completions]


def weighted(named_fns, weights):
    """[Reward] from [(name, fn)] and one weight each."""
    return [Reward(name, fn, float(w)) for (name, fn), w in zip(named_fns, weights, strict=True)]


GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/{split}.jsonl"
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "grpo", "gsm8k")

# The reference answer after "####" once commas are removed: an integer or a decimal, maybe negative.
_GOLD = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def _download(split: str) -> str:
    """Return the path of the cached `{split}.jsonl`, downloading it first if it is not cached yet."""
    dest = os.path.join(CACHE_DIR, f"{split}.jsonl")
    if os.path.exists(dest):
        return dest
    url = GSM8K_URL.format(split=split)
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            payload = response.read()
    except OSError as e:  # URLError, HTTPError and socket timeouts are all OSErrors
        raise RuntimeError(
            f"could not download GSM8K {split!r} from {url} ({e}). On a machine without network, "
            f"pass a local copy of {split}.jsonl instead: train.py --data PATH (or load_gsm8k(path=PATH))."
        ) from e
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
    """Load GSM8K as a list of {"question": str, "answer": str}, where answer is the final number.

    `path` is a local JSONL file in GSM8K's format; without it the official `split` ("train" or
    "test") is downloaded into CACHE_DIR once and read from there afterwards. The answer is the text
    after the last "####" with commas removed ("#### 1,234" -> "1234"). A malformed line raises
    ValueError naming "file:line"; blank lines are skipped; a file with no rows is an error too.
    """
    if path is None:
        if split not in ("train", "test"):
            raise ValueError(f"GSM8K has splits 'train' and 'test', not {split!r}")
        path = _download(split)
    rows = []
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
            for field in ("question", "answer"):
                if not isinstance(row.get(field), str):
                    raise ValueError(f"{where}: missing string field {field!r}")
            if "####" not in row["answer"]:
                raise ValueError(f"{where}: answer has no '####' final-answer marker")
            final = row["answer"].split("####")[-1].strip().replace(",", "")
            if not _GOLD.fullmatch(final):
                raise ValueError(f"{where}: the text after '####' is not a number: {final!r}")
            rows.append({"question": row["question"], "answer": final})
    if not rows:
        raise ValueError(f"{path}: no rows (empty file)")
    return rows


# Our wording of the template in Pramodith's GRPO trainer blog: the task, the two tags, then one worked example.
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
    """The text the policy continues: system prompt plus "Question: ..." in the tokenizer's chat format.

    With a chat template this is `tokenizer.apply_chat_template(..., add_generation_prompt=True)`, so
    the text ends where the assistant's reply begins. A tokenizer without one (base models) gets
    plain text instead: its BOS token if it has one (prompts are tokenized without special tokens, so
    nothing else would add it), the system prompt, a blank line, "Question: ...", then a line "Answer:"
    and a newline, so the model starts its reply on a fresh line.
    """
    user = f"Question: {question}"
    if getattr(tokenizer, "chat_template", None) is None:  # a base model: its BOS first, as its pretraining saw
        return f"{getattr(tokenizer, 'bos_token', None) or ''}{system_prompt}\n\n{user}\nAnswer:\n"
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def batch_at(rows: list, batch_size: int, seed: int, step: int) -> list:
    """The batch of rows for global training step `step`, computed from scratch (pure function).

    Each epoch visits the rows in a fresh random order: the permutation of epoch e comes from
    numpy's generator seeded with the pair (seed, e) (seed >= 0), so it depends on nothing but
    seed, e and len(rows). An epoch is len(rows) // batch_size batches; the few rows left over at the end of an
    epoch's order are skipped for that epoch (they are at a different place in the next shuffle).
    """
    if not 0 < batch_size <= len(rows):
        raise ValueError(f"batch_size must be between 1 and the number of rows ({len(rows)}), got {batch_size}")
    batches_per_epoch = len(rows) // batch_size
    epoch, index = divmod(step, batches_per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(rows))
    return [rows[i] for i in order[index * batch_size : (index + 1) * batch_size]]

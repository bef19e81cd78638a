"""rewards.py: answer extraction, correctness, format, the overlong penalty, extreme inputs and
fuzz, every gold answer of the real GSM8K (where it is found beside the repository); your own
reward functions (--reward-fn, rewards.from_flags) and reward models (--reward-model,
support/reward_model.py). Logged rewards are float32 means: sums of them are compared at 1e-6.
"""

import json
import random
import re
import sys
import time
from decimal import Decimal

import numpy as np
import pytest
import torch

import config
import data
import rewards
import trainer
from data import batch_at, load_gsm8k
from helpers import own_task_argv, read_metrics, tiny_reward_model_dir, write_rows
from rewards import correctness_reward, extract_answer, format_reward, overlong_penalty
from scripts import bench
from support import checkpoint
from support.reward_model import RewardModel


def check_all_rewards(completions: list[str]) -> None:
    answers = ["42"] * len(completions)
    correctness, form = (
        correctness_reward(completions, answers),
        format_reward(completions, answers),
    )
    for c, f, completion in zip(correctness, form, completions):
        assert type(c) is float and c in (0.0, 1.0)
        assert type(f) is float and f in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
        answer = extract_answer(completion)
        assert answer is None or isinstance(answer, str)
    for r, completion in zip(rewards.model_answer_reward(completions, answers), completions):
        assert type(r) is float and r in (0.0, 1.0)
        answer = rewards.model_answer(completion)
        assert answer is None or isinstance(answer, str)


EXTREMES = [
    "",
    "x" * 100_000,
    "9" * 100_000,
    "<answer>" + "9" * 100_000 + "</answer>",
    "<think>" + "1," * 50_000 + "</think><answer>" + "-1." * 30_000 + "</answer>",
    "<answer>" + " " * 100_000 + "42</answer>",
    "<answer>" * 20_000 + "</answer>" * 20_000,
    "<answer><answer>4</answer>",
    "<think><think></answer></answer><answer>",
    "<think>日本語の推論 🤔</think><answer>４２ or ٤٢</answer>",  # non-ASCII digits are not numbers here
    "<think>\x00\x00</think><answer>\x0042\x00</answer>",
    "<answer>$-,.,$</answer>",
    "\ud800<answer>1</answer>",  # a lone surrogate
]


def write_module(tmp_path, name, source):
    """A user's reward file `name`.py in tmp_path, importable afresh (no old module cached)."""
    (tmp_path / f"{name}.py").write_text(source)
    sys.modules.pop(name, None)
    return name


RAISING_REWARDS = """
import json; seen = []                        # json: the worker process writes `seen` for the test
def picky(completions, answers, id):
    seen.append(list(completions)); json.dump(seen, open("seen.json", "w"))
    return [1.0 / (i - 3) for i in id]           # ZeroDivisionError on the completions of the row with id 3
def batch_only(completions, answers):
    if len(completions) > 1:
        raise RuntimeError("only fails on batches")
    return [0.0]
def words(completions, answers):
    return ["one"] * len(completions)
def short(completions, answers):
    return [0.0] * (len(completions) - 1)
def nothing(completions, answers):
    return None
"""


def generator_that_raises(completions, answers):
    yield 1.0
    yield 1 / 0


# --- extraction -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<answer>42</answer>", "42"),
        ("<answer>\n  42 \n</answer>", "42"),  # whitespace and newlines
        ("<answer>$42</answer>", "42"),  # dollar sign
        ("<answer>1,234</answer>", "1234"),  # thousands commas
        ("<answer>$1,234,567</answer>", "1234567"),
        ("<answer>42.</answer>", "42"),  # trailing period
        ("<answer>18.00</answer>", "18"),  # trailing zeros after the point
        ("<answer>0.50</answer>", "0.5"),
        ("<answer>-5</answer>", "-5"),  # negative
        ("<answer>The answer is 42.</answer>", "42"),  # words around the number
        ("<answer>12 + 30 = 42 cookies</answer>", "42"),  # the last number in the block
        ("<answer>5-3</answer>", "3"),  # a minus after a digit is subtraction, not a sign
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last block
    ],
)
def test_extract_answer_tolerance(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    "completion",
    [
        "The answer is 42.",  # no answer block
        "42 <answer></answer>",  # number outside the block, empty block
        "<answer>   </answer>",  # blank block
        "<answer>forty-two</answer>",  # words instead of digits
        "<answer>42",  # never closed
        "42</answer>",  # never opened
        "</answer>42<answer>",  # tags in the wrong order
        "<answer>" + "9" * 51 + "</answer>",  # longer than MAX_NUMBER_CHARS
    ],
)
def test_extract_answer_none_without_a_number_in_a_complete_block(completion):
    assert extract_answer(completion) is None


def test_extract_answer_nested_and_unclosed_tags_read_the_innermost_last_block():
    assert extract_answer("<answer>1 <answer>2</answer>") == "2"
    # a truncated last block is ignored
    assert extract_answer("<answer>1</answer> <answer>2") == "1"


# --- correctness ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion",
    [
        "<answer>18</answer>",
        "<answer>18.0</answer>",
        "<answer>18.00</answer>",
        "<answer>$18</answer>",
        "<answer>The total is $18.</answer>",
        "<think>9 + 9</think>\n<answer>\n18\n</answer>",
    ],
)
def test_correctness_18_equals_18_point_0_and_dollar_18(completion):
    assert correctness_reward([completion], ["18"]) == [1.0]


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("<answer>1235</answer>", "1234"),  # off by one
        ("<answer>12345</answer>", "1234"),  # the reference is a prefix
        ("<answer>123</answer>", "1234"),  # a prefix of the reference
        ("<answer>5</answer>", "-5"),  # the sign matters
        ("1234 <answer>0</answer>", "1234"),  # the right number outside the block
        ("<answer>1234</answer><answer></answer>", "1234"),  # the last block is empty
        ("<answer>one thousand two hundred thirty-four</answer>", "1234"),  # words
        ("The answer is 1234", "1234"),  # no block at all
    ],
)
def test_correctness_traps_score_zero(completion, answer):
    assert correctness_reward([completion], [answer]) == [0.0]


def test_correctness_reference_with_commas_negative_and_decimal():
    completions = ["<answer>1234</answer>", "<answer>-3</answer>", "<answer>.5 is 0.5</answer>"]
    assert correctness_reward(completions, ["1,234", "-3", "0.5"]) == [1.0, 1.0, 1.0]


def test_correctness_reference_that_is_not_a_number_scores_zero():
    assert correctness_reward(["<answer>1</answer>", "<answer>1</answer>"], ["one", ""]) == [
        0.0,
        0.0,
    ]


# --- format ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("just 42", 0.0),  # no tags
        ("<think>hmm", 0.1),  # partial
        ("<think>hmm</think>", 0.2),
        ("<think>hmm</think><answer>", 0.3),
        ("<think>hmm</think><answer>42</answer>", 0.5),  # full
        ("<think>a</think>\n<answer>The answer is 42.</answer>", 0.5),
        ("<think>hmm</think><answer></answer>", 0.4),  # empty answer: no number credit
        ("<think>hmm</think><answer>forty-two</answer>", 0.4),  # words: no number credit
        (
            "<think><think>a</think></think><answer>1</answer></answer>",
            0.5,
        ),  # repeats earn nothing extra
        ("<think></think>" * 5 + "<answer>1</answer>" * 5, 0.5),
        ("<answer>42</answer>", 0.1),  # no <think>: only the number credit
        ("</answer><answer></think><think>", 0.1),  # all tags, wrong order: only <think> counts
    ],
)
def test_format_reward(completion, expected):
    assert format_reward([completion]) == [expected]


def test_format_reward_ignores_answers_to_fit_the_contract():
    assert format_reward(["<think>a</think><answer>1</answer>"], ["999"]) == [0.5]


# --- overlong (DAPO eq. 13) -----------------------------------------------------------------------


def test_overlong_penalty_max_100_cache_20_lengths_50_90_110_give_0_minus_half_minus_1():
    assert overlong_penalty([50, 90, 110], max_tokens=100, cache_tokens=20) == [0.0, -0.5, -1.0]


def test_overlong_penalty_edges_80_is_0_and_100_is_minus_1():
    assert overlong_penalty([80, 100], max_tokens=100, cache_tokens=20) == [0.0, -1.0]


def test_overlong_reward_is_dapo_eq_13_of_the_token_counts():
    # 0 up to 6 tokens, then linear to -1 at 10
    overlong = rewards.overlong_reward(max_tokens=10, buffer=4)
    assert overlong(["a"] * 5, [None] * 5, completion_lengths=[1, 6, 7, 8, 10]) == [
        0.0,
        0.0,
        -0.25,
        -0.5,
        -1.0,
    ]


# --- robustness: extreme inputs and fuzz ----------------------------------------------------------


def test_rewards_on_extreme_inputs_return_floats_in_range():
    check_all_rewards(EXTREMES)
    assert extract_answer(EXTREMES[9]) is None  # full-width and Arabic-Indic digits
    assert correctness_reward(EXTREMES[-3:], ["42", "42", "1"]) == [1.0, 0.0, 1.0]


def test_fuzz_10000_random_strings_of_tags_digits_and_noise():
    pieces = [
        "<think>",
        "</think>",
        "<answer>",
        "</answer>",
        "<result>",
        "</result>",
        "<answer",
        "answer>",
        "<",
        ">",
        "/",
        "0",
        "1",
        "42",
        "9" * 60,
        *"- $ , .".split(),
        " ",
        "\n",
        "\x00",
        "é",
        "🙂",
        "\\d+",
    ]
    rng = random.Random(0)
    completions = ["".join(rng.choices(pieces, k=rng.randint(0, 60))) for _ in range(10_000)]
    check_all_rewards(completions)


# --- the real data --------------------------------------------------------------------------------


@pytest.mark.skipif(
    bench.gsm8k_file("train") is None,
    reason=f"the real GSM8K is not here: set {bench.GSM8K_ENV} to a directory holding train.jsonl and test.jsonl",
)
def test_real_gsm8k_every_gold_answer_scores_1_and_gold_plus_1_scores_0():
    rows = []
    for split, count in (("train", 7473), ("test", 1319)):
        split_rows = load_gsm8k(path=bench.gsm8k_file(split))
        assert len(split_rows) == count
        rows += split_rows
    answers = [row["answer"] for row in rows]
    right = [f"<think>...</think><answer>{a}</answer>" for a in answers]
    wrong = [f"<think>...</think><answer>{Decimal(a) + 1}</answer>" for a in answers]
    start = time.perf_counter()
    assert correctness_reward(right, answers) == [1.0] * len(rows)
    assert format_reward(right) == [0.5] * len(rows)
    assert correctness_reward(wrong, answers) == [0.0] * len(rows)
    print(f"scored {len(rows)} rows x 3 in {time.perf_counter() - start:.3f}s")


# --- your own reward functions: --reward-fn, names, weights, the arguments they declare -----------


@pytest.mark.slow
def test_acceptance_command_logs_rewards_under_the_functions_name(tmp_path, monkeypatch):
    """python trainer.py --model DIR --data my.jsonl --prompt-field prompt --answer-field answer
    --reward-fn my_rewards:exact --reward-weights 1.0 (in process, in my_rewards.py's directory)."""
    monkeypatch.chdir(tmp_path)
    write_module(
        tmp_path,
        "my_rewards_exact",
        "def exact(completions, answers):\n"
        "    return [float(c.strip() == a) for c, a in zip(completions, answers)]\n"
        "def lengthy(completions, answers):\n"
        "    return [float(len(c.split())) for c in completions]\n",
    )
    trainer.main(
        own_task_argv(
            tmp_path,
            *"--reward-fn my_rewards_exact:exact --reward-fn my_rewards_exact:lengthy".split(),
            *"--reward-weights 1.0,0.25".split(),
        )
    )
    (row,) = read_metrics(tmp_path / "run")
    assert {k for k in row if k.startswith("rewards/")} == {
        "rewards/exact",
        "rewards/exact_std",
        "rewards/lengthy",
        "rewards/lengthy_std",
    }
    assert row["reward"] == pytest.approx(
        row["rewards/exact"] + 0.25 * row["rewards/lengthy"], abs=1e-6
    )
    assert row["rewards/lengthy"] > 0  # 1 to 4 words per completion


@pytest.mark.slow
def test_built_in_rewards_keep_their_short_names_and_replace_the_pair_when_given(tmp_path):
    trainer.main(own_task_argv(tmp_path, "--reward-fn", "format", "--reward-fn", "correctness"))
    (row,) = read_metrics(tmp_path / "run")
    assert {k for k in row if k.startswith("rewards/") and not k.endswith("_std")} == {
        "rewards/format",
        "rewards/correctness",
    }
    assert row["accuracy"] == row["rewards/correctness"]
    args = config.parse_args(own_task_argv(tmp_path, "--reward-fn", "format"))
    task, _, _ = trainer.setup(args)
    assert [(r.name, r.fn, r.weight) for r in task.rewards] == [("format", format_reward, 1.0)]
    # no --reward-fn: the built-in pair, every weight 1.0
    args = config.parse_args(own_task_argv(tmp_path))
    task, _, _ = trainer.setup(args)
    assert [(r.name, r.weight) for r in task.rewards] == [("correctness", 1.0), ("format", 1.0)]


def test_reward_functions_get_prompts_and_the_rows_fields_they_declare_aligned_with_the_completions():
    seen = {}

    def declares(completions, answers, prompts, id):
        seen["declares"] = (prompts, id)
        return [0.0] * len(completions)

    def takes_all(completions, answers, **fields):
        seen["takes_all"] = fields
        return [1.0] * len(completions)

    def plain(completions, answers):
        return [2.0] * len(completions)

    rows = [
        {"prompt": "q0", "answer": 1, "fields": {"id": 7, "tag": "a"}},
        {"prompt": "q1", "answer": [2], "fields": {"id": 8}},
    ]
    task = data.Task(
        train=rows,
        eval=[],
        template=None,
        response_prefix="> ",
        rewards=rewards.weighted(
            [("declares", declares), ("takes_all", takes_all), ("plain", plain)], [1.0, 1.0, 0.5]
        ),
    )
    total, per_fn = task.score(rows, ["a", "b", "c", "d"], G=2)
    assert seen["declares"] == (["q0", "q0", "q1", "q1"], [7, 7, 8, 8])
    # a row without the field: None
    assert seen["takes_all"] == {
        "prompts": ["q0", "q0", "q1", "q1"],
        "id": [7, 7, 8, 8],
        "tag": ["a", "a", None, None],
        "tool_calls": [0, 0, 0, 0],  # no tools: none
    }
    assert total.tolist() == [2.0] * 4 and per_fn["plain"].tolist() == [2.0] * 4


def test_a_reward_function_that_needs_an_argument_the_data_lacks_is_refused_before_training(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    write_module(
        tmp_path,
        "needs_more",
        "def wants_topic(completions, answers, topic):\n    return [0.0]\n"
        "def one_arg(completions):\n    return [0.0]\n",
    )
    for fn, message in [
        (
            "wants_topic",
            "requires the argument 'topic', which is neither `prompts`, "
            "`completion_lengths`, `tool_calls` nor a field of the data rows (fields: id)",
        ),
        ("one_arg", "must take two arguments, (completions, answers)"),
    ]:
        with pytest.raises(config.UserError, match=re.escape(message)):
            trainer.setup(
                config.parse_args(own_task_argv(tmp_path, "--reward-fn", f"needs_more:{fn}"))
            )


@pytest.mark.parametrize(
    "spec, source, message",
    [
        ("brevity", None, "expected MODULE:FUNCTION (e.g. my_rewards:brevity"),
        (
            "no_such_module_here:f",
            None,
            "there is no module 'no_such_module_here': no no_such_module_here.py in the "
            "working directory",
        ),
        (
            "user_mod:missing",
            "def exact(c, a):\n    return c\n",
            "has no function 'missing'; its functions: exact",
        ),
        ("user_mod:VALUE", "VALUE = 3\n", "has no function 'VALUE'"),
        (
            "user_mod:f",
            "import numpy\nx = 1 / 0\n",
            "importing user_mod for --reward-fn raised ZeroDivisionError: division by zero "
            "(user_mod.py:2)",
        ),
        (
            "user_mod:f",
            "def f(c, a)\n",
            "(user_mod.py, line 1).",
        ),  # a SyntaxError's own text varies by Python version
        (
            "user_mod:f",
            "import no_such_dependency_xyz\n",
            "importing user_mod for --reward-fn failed: No module named 'no_such_dependency_xyz'",
        ),
    ],
)
def test_a_reward_fn_flag_that_cannot_load_is_one_clear_error(
    tmp_path, monkeypatch, spec, source, message
):
    monkeypatch.chdir(tmp_path)
    if source is not None:
        write_module(tmp_path, "user_mod", source)
    with pytest.raises(config.UserError, match=re.escape(message)):
        rewards.load_reward_fn(spec)


def test_duplicate_reward_names_and_a_wrong_number_of_weights_are_refused(tmp_path):
    argv = own_task_argv(tmp_path, "--reward-fn", "format,correctness", "--reward-weights", "1,2,3")
    with pytest.raises(
        config.UserError,
        match=re.escape(
            "one weight per reward, in the order: reward functions, then "
            "reward models, then the overlong penalty (format, "
            "correctness): 2 numbers, got 3"
        ),
    ):
        trainer.setup(config.parse_args(argv))
    with pytest.raises(config.UserError, match="logged under the same name \\(format\\)"):
        trainer.setup(
            config.parse_args(
                own_task_argv(tmp_path, "--reward-fn", "format", "--reward-fn", "format")
            )
        )


def test_a_field_missing_from_a_batch_is_none_and_reserved_names_are_refused(tmp_path):
    seen = []

    def wants_id(completions, answers, id):
        seen.append(id)
        return [0.0] * len(completions)

    rows = [
        {"prompt": "q0", "answer": 1, "fields": {"id": 7}},
        {"prompt": "q1", "answer": 2, "fields": {}},
    ]
    task = data.Task(
        train=rows,
        eval=[],
        template=None,
        rewards=rewards.weighted([("wants_id", wants_id)], [1.0]),
    )
    task.score(rows[1:], ["a"])  # a batch in which no row has the field: still passed, as None
    assert seen == [[None]]
    path = write_rows(tmp_path / "bad.jsonl", [{"prompt": "p", "answer": "a", "prompts": "x"}])
    with pytest.raises(ValueError, match="bad.jsonl:1: a field may not be named 'prompts'"):
        data.load_jsonl(path)
    with pytest.raises(config.UserError, match="no reward may be named 'reward'"):
        rewards.from_flags(config.parse_args(own_task_argv(tmp_path)), [("reward", format_reward)])


# --- reward functions that fail or return something else than numbers -----------------------------


@pytest.mark.parametrize(
    "fn, message",
    [
        (
            "picky",
            "reward function 'picky' raised ZeroDivisionError: float division by zero (user_rewards.py:5) on a "
            "batch of 8 completions; called on completion {first} alone it raises too; that completion began: "
            "{text}",
        ),
        (
            "batch_only",
            "reward function 'batch_only' raised RuntimeError: only fails on batches (user_rewards.py:8) on a "
            "batch of 8 completions; called on each completion alone it does not raise; the batch's first "
            "completion began: ",
        ),
        (
            "words",
            "reward function 'words' returned 'one' (str) for completion 0, which is not a number.",
        ),
        (
            "short",
            "reward function 'short' must return one number per completion (8); it returned 7 values",
        ),
        (
            "nothing",
            "reward function 'nothing' must return one number per completion (8); it returned a NoneType "
            "(TypeError: 'NoneType' object is not iterable).",
        ),
    ],
)
def test_a_reward_function_that_fails_saves_and_exits_2_naming_it_and_the_completion(
    tmp_path, monkeypatch, capsys, fn, message
):
    monkeypatch.chdir(tmp_path)
    write_module(tmp_path, "user_rewards", RAISING_REWARDS)
    # the id-3 row comes last
    argv = own_task_argv(tmp_path, "--reward-fn", f"user_rewards:{fn}", "--seed", "0")
    with pytest.raises(SystemExit) as exit_info:
        trainer.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    if fn == "picky":
        args = config.parse_args(argv)
        rows = batch_at(data.task_from_flags(args).train, 4, args.seed, 0)
        first = 2 * [row["fields"]["id"] for row in rows].index(3)  # G = 2 completions per row
        assert first == 6
        batch = json.loads((tmp_path / "seen.json").read_text())[0]
        message = message.format(first=first, text=repr(batch[first][:200]))
    assert f"error: {message}" in err, err[-600:]
    # saved before any update
    assert checkpoint.load_state(str(tmp_path / "run" / "checkpoint"))["step"] == 0


@pytest.mark.parametrize(
    "fn, expected",
    [
        (
            lambda c, a: np.array([[1.0], [2.0]]),
            [1.0, 2.0],
        ),  # [N, 1] arrays and tensors are flattened
        (lambda c, a: torch.tensor([[1.0], [2.0]]), [1.0, 2.0]),
        (lambda c, a: (x for x in [1.0, 2.0]), [1.0, 2.0]),  # a generator is a list
        (
            lambda c, a: {0: 1.0, 1: 2.0},
            "returned a dict; it must return a list with one number per completion (2)",
        ),
        (
            generator_that_raises,
            "returned a generator (ZeroDivisionError: division by zero (test_rewards.py:",
        ),
        (lambda c, a: 3.0, "returned a float (TypeError: 'float' object is not iterable"),
    ],
)
def test_what_a_reward_function_returns_is_a_list_of_numbers_or_one_clear_error(fn, expected):
    try:
        got = rewards.score(rewards.weighted([("f", fn)], [1.0]), ["a", "b"], ["1", "2"])[
            0
        ].tolist()
    except config.UserError as e:
        got = str(e)
    assert got == expected if isinstance(expected, list) else expected in got


def test_a_reward_failure_quotes_only_the_first_200_characters_of_the_completion():
    def fails(completions, answers):
        raise ValueError("bad")

    long = "x" * 150 + "y" * 150
    with pytest.raises(config.UserError) as info:
        rewards.score(rewards.weighted([("fails", fails)], [1.0]), [long], ["1"])
    assert repr("x" * 150 + "y" * 50) + "." in str(info.value) and "y" * 51 not in str(info.value)


# --- reward models: --reward-model ----------------------------------------------------------------


def test_a_reward_model_scores_each_text_as_it_would_alone_frozen_and_in_fp32_on_cpu(tmp_path):
    from transformers import AutoModelForSequenceClassification

    path = tiny_reward_model_dir(tmp_path)
    scorer = RewardModel(path, "cpu", batch_size=3)
    prompts = ["3 + 4 =", "1 + 1 =", "5 + 5 =", "2 + 0 ="]
    completions = ["<answer> 7", "2", "<answer> 10 </answer>", ""]
    scores = scorer(completions, [None] * 4, prompts)
    reference = AutoModelForSequenceClassification.from_pretrained(path).eval()
    alone = [
        reference(**scorer.tokenizer(f"{p}\n{c}", return_tensors="pt")).logits[0, 0].item()
        for p, c in zip(prompts, completions)
    ]
    # The same fp32 model, padded in batches of 3 vs one text at a time: equal up to summation order
    # (~1e-7).
    assert scores == pytest.approx(alone, abs=1e-5)
    assert len(set(scores)) == 4  # the texts differ, and so do their scores
    params = list(scorer.model.parameters())
    assert not scorer.model.training and not any(p.requires_grad for p in params)
    assert {p.dtype for p in params} == {torch.float32}


@pytest.mark.slow
def test_reward_model_flag_adds_a_reward_logged_under_its_name_weighted_after_the_functions(
    tmp_path,
):
    path = tiny_reward_model_dir(tmp_path)
    trainer.main(
        own_task_argv(
            tmp_path,
            *"--reward-fn correctness --reward-model".split(),
            path,
            *"--reward-weights 1.0,0.5".split(),
        )
    )
    (row,) = read_metrics(tmp_path / "run")
    assert row["reward"] == pytest.approx(
        row["rewards/correctness"] + 0.5 * row["rewards/tiny-rm"], abs=1e-6
    )
    assert row["rewards/tiny-rm_std"] > 0  # the classifier tells the completions apart
    second = tiny_reward_model_dir(tmp_path, 1, "rm2")
    args = config.parse_args(own_task_argv(tmp_path, "--reward-model", f"{path},{second}"))
    assert [r.name for r in trainer.setup(args)[0].rewards] == [
        "correctness",
        "format",
        "tiny-rm",
        "rm2",
    ]


def test_a_reward_model_must_load_as_a_classifier_with_one_output(tmp_path):
    with pytest.raises(config.UserError, match="has 2 outputs; a reward model has one"):
        RewardModel(tiny_reward_model_dir(tmp_path, num_labels=2))
    with pytest.raises(config.UserError, match="could not load it as a sequence classifier"):
        RewardModel(str(tmp_path / "no-such-model"))


# --- --task addition: the last number of the completion -------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("34 + 22 = 56", "56"),  # the last number, not the operands
        ("The answer is 56.", "56"),  # a trailing period
        ("56\n\nSo 34 + 22 is 56!", "56"),
        ("It is $1,056.00", "1056"),  # commas, a dollar sign, zero decimals
        ("-5", "-5"),
        ("fifty-six", None),  # no digits
        ("", None),
        ("<answer>56</answer>", "56"),  # tags are fine too
        ("٥٦", None),  # non-ASCII digits are not numbers here, as in extract_answer
    ],
)
def test_last_number_reads_the_last_number_anywhere(completion, expected):
    assert rewards.last_number(completion) == expected
    assert rewards.last_number_reward([completion], ["56"]) == [1.0 if expected == "56" else 0.0]


@pytest.mark.parametrize("completion", EXTREMES)
def test_last_number_never_raises_on_garbage(completion):
    answer = rewards.last_number(completion)
    assert answer is None or isinstance(answer, str)
    (reward,) = rewards.last_number_reward([completion], ["42"])
    assert type(reward) is float and reward in (0.0, 1.0)
    assert rewards.last_number_reward([completion], [None]) == [0.0]  # no reference: never right


# --- the calculator task's answer: only a complete <answer> block the model wrote -----------------

# The issue 43 completion, 56 tokens in SmolLM2's tokenizer; the old budget of 48 ended it at "= ".
CALL = "Let's use the calculator. <tool>calculator 2824*984</tool><result>2778816</result>"


@pytest.mark.parametrize(
    "completion, last, answer",
    [
        # cut in the restatement: the last number is the operand, the model has not answered
        (CALL + " So 2824 x 984 = ", "984", None),
        # cut just after the result: the last number is the tool's, not an answer the model gave
        (CALL + " So", "2778816", None),
        # cut inside the answer or its closing tag: never the first digits as an answer
        (CALL + " So 2824 x 984 = <answer>27788", "27788", None),
        (CALL + " So 2824 x 984 = <answer>2778816</ans", "2778816", None),
        # the budget cut the result itself (no "</result>"): nothing after it is the model's
        ("<tool>calculator 2824*984</tool><result>27788", "27788", None),
        # complete: the answer counts, and a cut after "</answer>" cannot change it
        (CALL + " So 2824 x 984 = <answer>2778816</answer>.", "2778816", "2778816"),
        (CALL + " So 2824 x 984 = <answer>2778816</answer>. Now 12 x", "12", "2778816"),
        # the last complete block counts; a later one the cut left open does not
        (CALL + " <answer>2778815</answer> no, <answer>27", "27", "2778815"),
        # a tool's result is not the model's answer, even one that holds the tags
        ("<tool>t x</tool><result><answer>2778816</answer></result> So", "2778816", None),
        (
            "<tool>t x</tool><result><answer>1</answer></result><answer>2778816</answer>",
            "2778816",
            "2778816",
        ),
        # no tool: the block alone
        ("<answer>2,778,816</answer>", "2778816", "2778816"),
    ],
)
def test_the_tool_tasks_answer_is_a_complete_block_the_model_wrote_so_a_cut_leaves_none(
    completion, last, answer
):
    assert rewards.last_number(completion) == last  # what the last-number reward read
    assert rewards.model_answer(completion) == answer
    expected = 1.0 if answer == "2778816" else 0.0
    assert rewards.model_answer_reward([completion], ["2778816"]) == [expected]


def test_a_truncated_completion_scores_0_with_the_tool_tasks_reward_wherever_the_cut_falls():
    """Every prefix of a right, complete completion: the last-number reward's score depends on
    where the cut falls (right after the result, inside the answer's number: 1; in the
    restatement: 0); model_answer_reward scores 0 until "</answer>" is there, then 1."""
    whole = CALL + " So 2824 x 984 = <answer>2778816</answer>."
    closed = whole.index("</answer>") + len("</answer>")
    cuts = [whole[:n] for n in range(len(whole) + 1)]
    by_model = rewards.model_answer_reward(cuts, ["2778816"] * len(cuts))
    assert by_model == [float(n >= closed) for n in range(len(whole) + 1)]
    by_last = rewards.last_number_reward(cuts[:closed], ["2778816"] * closed)
    assert 0.0 in by_last and 1.0 in by_last  # the old reward: right or wrong by where it was cut


def test_without_results_takes_out_every_result_and_a_cut_one_to_the_end():
    assert rewards.without_results("a<result>1</result>b<result>2</result>c") == "abc"
    assert rewards.without_results("a<result>1</result>b<result>2") == "ab"
    assert rewards.without_results("no results </result> here") == "no results </result> here"
    assert rewards.without_results("<result>" * 100_000) == ""  # linear: no rescan per marker


def test_the_result_markers_are_the_ones_tools_forces():
    import tools

    assert (rewards.RESULT_OPEN, rewards.RESULT_CLOSE) == (tools.RESULT_OPEN, tools.RESULT_CLOSE)


# --- train.py's in-process call (rewards.call_here) against trainer.py's (sandbox.call_reward)


def _generator():
    yield from (1.0, 0.0)


GOOD_RETURNS = {
    "floats": [1.0, 0.25],
    "ints and bools": [1, False],
    "decimals": [Decimal("0.1"), Decimal("2")],
    "numpy float64": np.array([0.1, 1e30]),
    "a tensor [N, 1]": torch.tensor([[0.5], [1.5]]),
    "a bf16 tensor": torch.tensor([0.1, 0.3], dtype=torch.bfloat16),
    "0-d tensors": [torch.tensor(0.7), torch.tensor(-2.0)],
    "a generator": "generator",
    "a tuple": (3.0, 4.0),
}
BAD_RETURNS = {
    "a NaN": [float("nan"), 1.0],
    "an inf": [1.0, float("inf")],
    "beyond float32": [1e39, 0.0],
    "too few": [1.0],
    "a string in it": ["1.0", 2.0],
    "None in it": [None, 1.0],
    "a dict": {"a": 1.0, "b": 2.0},
    "a number": 5.0,
    "a string": "10",
}


@pytest.mark.parametrize("name", GOOD_RETURNS)
def test_train_py_reads_every_good_return_value_as_trainer_py_does(name):
    # the in-process fast path (torch.as_tensor) gives the same float32 values as the sandbox's
    # float() of each, bit for bit: both round each value once, from a Python float, to float32
    value = GOOD_RETURNS[name]

    def fn(completions, answers):
        return _generator() if isinstance(value, str) else value

    reward = rewards.weighted([("f", fn)], [1.0])
    (total_here, here), (total_there, there) = (
        rewards.score(reward, ["a", "b"], ["1", "2"], None, in_process)
        for in_process in (True, False)
    )
    here, there = here["f"], there["f"]
    assert here.dtype == there.dtype == torch.float32 and here.device.type == "cpu"
    assert torch.equal(here, there), (here, there)
    # the weighted total is float64 (finite for any finite rewards and weights), on both paths
    assert total_here.dtype == total_there.dtype == torch.float64
    assert torch.equal(total_here, total_there)


def said_in_and_out_of_process(fn, completions):
    """The UserError's text for reward function fn, called as train.py calls it (in process) and
    as trainer.py does (the sandbox)."""
    reward, said = rewards.weighted([("f", fn)], [1.0]), []
    for here in (True, False):
        with pytest.raises(rewards.UserError) as e:
            rewards.score(reward, completions, ["1", "2"], None, here)
        said.append(str(e.value))
    return said


@pytest.mark.parametrize("name", BAD_RETURNS)
def test_train_py_says_what_is_wrong_with_a_return_value_as_trainer_py_does(name):
    said = said_in_and_out_of_process(lambda completions, answers: BAD_RETURNS[name], ["a", "b"])
    assert said[0] == said[1] and "reward function 'f'" in said[0]


def test_train_py_says_what_a_reward_function_raised_as_trainer_py_does():
    def fn(completions, answers):
        if "bad" in completions:
            raise ZeroDivisionError("no")
        return [1.0] * len(completions)

    said = said_in_and_out_of_process(fn, ["ok", "bad"])
    assert said[0] == said[1] and "called on completion 1 alone it raises too" in said[0]


def test_train_py_takes_a_process_rewards_steps_as_trainer_py_does():
    def steps(completions, answers):
        return [[(3, 1.0), (5, 0.0)], [(2, 1.0), (4, 1.0)]]  # rectangular: a tensor would take it

    reward = rewards.weighted([("s", steps)], [1.0])
    got = []
    for here in (True, False):
        kept = {}
        total, per_fn = rewards.score(reward, ["abcdef", "abcd"], ["1", "2"], kept, here)
        got.append((total.tolist(), per_fn["s"].tolist(), [list(p) for p in kept["s"]]))
    assert got[0] == got[1] and got[0][0] == [0.5, 1.0]


def test_train_py_refuses_two_rewards_under_one_name_as_trainer_py_does(tmp_path, monkeypatch):
    # --reward-fn a:f --reward-fn b:f merged the two in train.py: per_fn["f"] kept b's values and
    # the total counted them twice, a's never: the run trained on the wrong reward, silently
    import train

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("def f(c, a):\n    return [1.0] * len(c)\n")
    (tmp_path / "b.py").write_text("def f(c, a):\n    return [0.0] * len(c)\n")
    (tmp_path / "c.py").write_text("def reward(c, a):\n    return [0.0] * len(c)\n")
    cases = {
        "two functions, one name": ["a:f", "b:f"],
        "one function twice": ["a:f", "a:f"],
        "the total's name": ["c:reward"],
    }
    for case, specs in cases.items():
        with pytest.raises(rewards.UserError) as stop:
            rewards.imported_here(specs)
        said = str(stop.value)
        assert "\n" not in said, case
        assert ("same name (f)" in said) if "reward" not in specs[0] else ("'reward'" in said)
        argv = ["--demo", "--device", "cpu", "--output-dir", str(tmp_path / "run")]
        with pytest.raises(SystemExit) as exit_:  # train.py itself: exit 2, before any step
            train.main([*argv, *(x for spec in specs for x in ("--reward-fn", spec))])
        assert exit_.value.code == 2 and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert [r.name for r in rewards.imported_here(["a:f", "correctness"])] == ["f", "correctness"]


def test_train_py_gives_each_reward_function_its_own_copies(monkeypatch):
    # trainer.py's sandbox copies the arguments; train.py's in-process call does too: a function
    # that clears, sorts or edits its lists changes neither the next function's view nor the batch
    seen = []

    def vandal(completions, answers, prompts):
        completions.clear()
        answers.reverse()
        prompts[0] = "edited"
        return [1.0, 2.0]

    def reader(completions, answers, prompts):
        seen.append((list(completions), list(answers), list(prompts)))
        return [0.0, 0.0]

    batch = (["x", "y"], ["1", "2"], ["p", "q"])
    fns = rewards.weighted([("vandal", vandal), ("reader", reader)], [1.0, 1.0])
    total, per_fn = rewards.score(fns, batch[0], batch[1], None, True, prompts=batch[2])
    assert seen == [(["x", "y"], ["1", "2"], ["p", "q"])]
    assert batch == (["x", "y"], ["1", "2"], ["p", "q"])
    assert total.tolist() == [1.0, 2.0] and per_fn["vandal"].tolist() == [1.0, 2.0]


def test_a_keyboard_interrupt_a_reward_raises_itself_is_its_error_not_a_ctrl_c():
    from support.signals import STOPS, Stopped

    def rude(completions, answers):
        raise KeyboardInterrupt

    fns = rewards.weighted([("rude", rude)], [1.0])
    with STOPS:  # train.py's handlers: a Ctrl-C is a request, its stop a Stopped
        with pytest.raises(rewards.UserError, match="reward function 'rude' raised KeyboardInter"):
            rewards.score(fns, ["a"], ["1"], None, True)

        def stopped(completions, answers):
            raise Stopped(2)  # what a second Ctrl-C raises inside the call: it goes through

        with pytest.raises(Stopped):
            rewards.score(rewards.weighted([("s", stopped)], [1.0]), ["a"], ["1"], None, True)
    with pytest.raises(KeyboardInterrupt):  # no handlers (train() from your code): as it was
        rewards.score(fns, ["a"], ["1"], None, True)


def test_rewards_at_float32s_limit_give_finite_advantages():
    import grpo

    # float32's largest is 3.4e38: a group's sum, mean and std overflowed in float32
    big = float(torch.tensor(3.0e38))  # exactly a float32, as the reward's values become
    per = [big, -big, big, -big]
    fns = rewards.weighted([("huge", lambda c, a: per), ("also", lambda c, a: per)], [2.0, 0.5])
    total, _ = rewards.score(fns, list("abcd"), list("1234"), None, True)
    assert total.isfinite().all() and total.tolist() == [2.5 * big, -2.5 * big] * 2
    advantages = grpo.group_advantages(total, 4)
    # mean 0, Bessel std = 2.5 big * sqrt(4/3): ±sqrt(3)/2, in float32
    assert advantages.dtype == torch.float32
    assert torch.allclose(advantages, torch.tensor([1.0, -1.0] * 2) * 3**0.5 / 2, rtol=1e-6)
    for scale in ("batch", "none"):
        assert grpo.group_advantages(torch.tensor(per), 2, scale=scale).isfinite().all()

"""data.py: loading GSM8K (and its download cache), prompts and the system prompt, batches as a
pure function of seed and step, and your own task's JSONL rows and held-out rows. Files are
written under tmp_path; nothing is downloaded.
"""

import io
import json
import os
import re
import urllib.error

import pytest

import config
import data
import rewards
import sampling
import trainer
from data import SYSTEM_PROMPT, batch_at, build_prompt, load_gsm8k
from helpers import (
    CPU,
    own_task_argv,
    read_metrics,
    tiny_argv,
    tiny_model_dir,
    write_gsm8k,
    write_rows,
)
from rewards import format_reward
from support import demo
from support.errors import UserError


def gsm8k_line(question: str, answer: str) -> str:
    return json.dumps({"question": question, "answer": answer}) + "\n"


def write(tmp_path, text: str, name: str = "rows.jsonl") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# --- data.py: loading GSM8K -----------------------------------------------------------------------


def test_load_gsm8k_parses_final_numbers_with_commas_and_negatives(tmp_path):
    path = write(
        tmp_path,
        gsm8k_line("How many clips?", "48/2 = <<48/2=24>>24\n24+48 = <<24+48=72>>72\n#### 72")
        + gsm8k_line("How much money?", "She has $1,000 + $234.\n#### 1,234")
        + "\n"  # blank lines are skipped
        + gsm8k_line("What is the change in temperature?", "It falls 3 degrees.\n#### -3"),
    )
    assert load_gsm8k(path=path) == [
        {"prompt": "How many clips?", "answer": "72"},
        {"prompt": "How much money?", "answer": "1234"},
        {"prompt": "What is the change in temperature?", "answer": "-3"},
    ]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"question": "q", "answer": "#### 1"\n', "malformed JSON"),
        ('{"answer": "#### 1"}\n', "'question'"),
        ('{"question": "q"}\n', "'answer'"),
        ('{"question": "q", "answer": 7}\n', "'answer'"),
        ('["q", "#### 1"]\n', "JSON object"),
        ('{"question": "q", "answer": "no marker, 5"}\n', "####"),
        ('{"question": "q", "answer": "#### five"}\n', "not a number"),
    ],
)
def test_load_gsm8k_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = write(tmp_path, gsm8k_line("ok", "#### 1") + gsm8k_line("ok", "#### 2") + bad_line)
    with pytest.raises(ValueError, match=message) as error:
        load_gsm8k(path=path)
    assert f"{path}:3:" in str(error.value)


def test_load_gsm8k_empty_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        load_gsm8k(path=write(tmp_path, ""))


def no_network(tmp_path, monkeypatch):
    """GSM8K's download fails as it does offline (an empty cache under tmp_path)."""

    def unreachable(*args, **kwargs):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(data, "CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(data.urllib.request, "urlopen", unreachable)


def test_load_gsm8k_without_network_says_what_it_tried(tmp_path, monkeypatch):
    no_network(tmp_path, monkeypatch)
    with pytest.raises(data.DownloadError) as error:
        load_gsm8k("train")
    assert str(error.value) == (
        f"could not download GSM8K's train split from {data.GSM8K_URL.format(split='train')} "
        "(<urlopen error no route to host>)."
    )
    assert not os.path.exists(tmp_path / "cache" / "train.jsonl")  # nothing half-written is cached


def offline_error(capsys, *argv):
    """What trainer.main says, offline, for these flags: its one paragraph, after "error: "."""
    with pytest.raises(SystemExit) as stop:
        trainer.main([*CPU, *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err.removeprefix("error: ").strip()


def test_offline_each_command_gets_one_advice_that_fits_it(tmp_path, monkeypatch, capsys):
    # Offline, GSM8K's download fails: the message says what was tried, then the one thing to pass
    # instead for the command at hand, naming flags only (no function of data.py).
    no_network(tmp_path, monkeypatch)

    def tried(split):
        url, error = data.GSM8K_URL.format(split=split), "<urlopen error no route to host>"
        return f"could not download GSM8K's {split} split from {url} ({error})."

    copy = "Offline, copy that file (on a machine with network)"
    out = ["--output-dir", str(tmp_path / "run")]
    # (a) a training run without --data: train.jsonl, with test.jsonl beside it for evaluation
    assert offline_error(capsys, *out) == (
        f"{tried('train')} {copy} and test.jsonl from the same folder into one directory "
        "here, and pass --data DIR/train.jsonl: test.jsonl beside it is evaluated on."
    )
    # ... and without evaluation, train.jsonl alone
    assert offline_error(capsys, *out, "--eval-every", "-1") == (
        f"{tried('train')} {copy} here and pass --data PATH."
    )
    # (b) --eval-only without --data or --eval-data: the test split, with --eval-data (not --data,
    # and not --eval-every -1, which means nothing to --eval-only)
    eval_only = f"{tried('test')} {copy} here and pass --eval-data PATH."
    assert offline_error(capsys, "--eval-only", "--eval-limit", "200", *out) == eval_only
    # ... with a --data that has no test.jsonl beside it: why it downloaded, then the same advice
    gsm8k = write_gsm8k(tmp_path / "train.jsonl")
    beside = "no --eval-data, and no test file beside --data: "
    assert offline_error(capsys, "--eval-only", "--data", gsm8k, *out) == beside + eval_only
    # (c) a training run whose held-out rows cannot be found: no --eval-data, no test.jsonl beside
    # --data, and no network for GSM8K's own
    assert offline_error(capsys, "--data", gsm8k, *out) == (
        f"{beside}{tried('test')} {copy} here and pass --eval-data PATH (--eval-every -1: train "
        "without evaluation)."
    )
    # ... or an --eval-data that does not exist: one advice, for a training run and --eval-only
    missing = str(tmp_path / "missing.jsonl")
    for argv in (["--data", gsm8k], ["--eval-only"]):
        message = offline_error(capsys, *argv, "--eval-data", missing, *out)
        assert message.startswith(f"--eval-data {missing}: no such file or directory. Pass a JSONL")


def test_load_gsm8k_downloads_once_then_reuses_the_cache(tmp_path, monkeypatch):
    calls = []

    def fake_urlopen(url, timeout):
        calls.append(url)
        return io.BytesIO(gsm8k_line("q", "#### 1,000").encode())

    monkeypatch.setattr(data, "CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(data.urllib.request, "urlopen", fake_urlopen)
    assert load_gsm8k("test") == [{"prompt": "q", "answer": "1000"}]
    assert load_gsm8k("test") == [{"prompt": "q", "answer": "1000"}]
    assert calls == [data.GSM8K_URL.format(split="test")]
    assert os.listdir(tmp_path / "cache") == ["test.jsonl"]  # no temporary file left behind


# --- data.py: prompts and the system prompt -------------------------------------------------------


def test_system_prompt_asks_for_both_tags_and_shows_the_joel_example():
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert tag in SYSTEM_PROMPT
    assert "Joel has 24 cookies" in SYSTEM_PROMPT
    # the worked example itself earns full format credit
    assert format_reward([SYSTEM_PROMPT.split("Question:")[-1]]) == [0.5]


def test_build_prompt_uses_the_chat_template_with_generation_prompt():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
        unk_token="[UNK]",
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    prompt = build_prompt(tokenizer, "What is 2 + 3?", system_prompt="Be brief.")
    assert prompt == "<|system|>Be brief.\n<|user|>Question: What is 2 + 3?\n<|assistant|>"


def test_build_prompt_without_chat_template_falls_back_to_plain_text():
    class BaseTokenizer:
        chat_template = None

    prompt = build_prompt(BaseTokenizer(), "What is 2 + 3?", system_prompt="Be brief.")
    assert prompt == "Be brief.\n\nQuestion: What is 2 + 3?\nAnswer:\n"


def test_plain_text_prompt_starts_with_the_bos_token_id_when_the_tokenizer_has_one():
    tokenizer = demo.word_tokenizer(["<pad>", "<eos>", "<s>", "Be", "brief."], unk_token="<pad>")
    # as a base model's tokenizer has it: a special token
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    assert tokenizer.chat_template is None
    ids, _ = sampling.tokenize_prompts(
        tokenizer, [build_prompt(tokenizer, "2?", system_prompt="Be brief.")], "cpu"
    )
    assert ids[0, :3].tolist() == [2, 3, 4]  # <s> Be brief.


def test_system_prompt_takes_text_or_a_file_and_defaults_by_task(tmp_path):
    # no chat template: the plain-text prompt shows the system prompt
    tokenizer = demo.word_tokenizer(demo.WORDS)
    (tmp_path / "system.txt").write_text("Be brief.\nVery.")
    for flag, expected in [
        ([], "1 + 1 =\n"),
        (["--system-prompt", "Be brief.\\nVery."], "Be brief.\nVery.\n\n1 + 1 =\n"),
        (["--system-prompt", f"@{tmp_path / 'system.txt'}"], "Be brief.\nVery.\n\n1 + 1 =\n"),
    ]:
        task = data.task_from_flags(config.parse_args(own_task_argv(tmp_path, *flag)))
        assert task.template(tokenizer, "1 + 1 =") == expected
    gsm8k = [*CPU, "--data", write_gsm8k(tmp_path / "gsm.jsonl"), "--eval-every", "-1"]
    assert (
        data.task_from_flags(config.parse_args(gsm8k))
        .template(tokenizer, "q")
        .startswith(SYSTEM_PROMPT)
    )
    no_system = data.task_from_flags(config.parse_args([*gsm8k, "--system-prompt", ""]))
    assert no_system.template(tokenizer, "q") == "Question: q\nAnswer:\n"
    with pytest.raises(config.UserError, match="--system-prompt @.*could not read the file"):
        config.parse_args([*gsm8k, "--system-prompt", f"@{tmp_path / 'missing.txt'}"])


# --- data.py: batches, a pure function of seed and step -------------------------------------------


def test_batches_shuffle_each_epoch_and_cover_every_row_once():
    rows = list(range(10))
    batches = [batch_at(rows, 3, 0, step) for step in range(6)]  # 3 batches per epoch
    epoch0 = [row for batch in batches[:3] for row in batch]
    epoch1 = [row for batch in batches[3:] for row in batch]
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9  # no repeats within an epoch
    assert epoch0 != epoch1  # a new epoch reshuffles
    assert epoch0 != rows[:9]  # and the order is shuffled at all


def test_batches_depend_on_seed_and_step_alone_so_a_resumed_run_sees_the_same_ones():
    rows = [{"prompt": str(i), "answer": str(i)} for i in range(25)]
    straight = [batch_at(rows, 4, 7, step) for step in range(12)]
    # a fresh process, from step 5
    resumed = [batch_at(list(rows), 4, 7, step) for step in range(5, 12)]
    assert resumed == straight[5:]
    assert batch_at(rows, 4, 7, 9) == straight[9]
    assert batch_at(rows, 4, 8, 9) != straight[9]  # another seed, another order


def test_batch_at_rejects_batch_larger_than_the_data():
    with pytest.raises(ValueError):
        batch_at([1, 2], batch_size=3, seed=0, step=0)


def test_an_extra_stream_of_batches_is_another_pure_function_of_seed_and_step():
    rows = list(range(20))
    assert (
        batch_at(rows, 4, 7, 3, stream=1)
        == batch_at(rows, 4, 7, 3, stream=1)
        != batch_at(rows, 4, 7, 3)
    )
    assert batch_at(rows, 4, 7, 3, stream=0) == batch_at(rows, 4, 7, 3)


# --- your own task's data: any JSONL, its fields, its held-out rows -------------------------------


def test_any_jsonl_is_read_with_its_fields_as_they_are(tmp_path):
    path = write_rows(
        tmp_path / "rows.jsonl",
        [{"q": "Say hi", "gold": {"any": ["json"]}, "level": 3}, {"q": "Say bye", "gold": 7}],
    )
    assert data.load_jsonl(path, "q", "gold") == [
        {"prompt": "Say hi", "answer": {"any": ["json"]}, "fields": {"level": 3}},
        {"prompt": "Say bye", "answer": 7, "fields": {}},
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "p"}', "{path}:2: no answer field 'answer' (fields: prompt)"),
        ('{"answer": "a"}', "{path}:2: the prompt field 'prompt' is missing (fields: answer)"),
        (
            '{"prompt": ["p"], "answer": "a"}',
            "{path}:2: the prompt field 'prompt' is a list, not a string",
        ),
        ('{"prompt": "p", ', "{path}:2: malformed JSON"),
        ('["p", "a"]', "{path}:2: expected a JSON object, got list"),
    ],
)
def test_a_bad_row_of_your_own_jsonl_names_its_file_and_line(tmp_path, capsys, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "p", "answer": "a"}\n' + line + "\n")
    argv = own_task_argv(tmp_path)
    argv[argv.index("--data") + 1] = str(path)
    with pytest.raises(SystemExit):
        trainer.main(argv)
    assert message.format(path=path) in capsys.readouterr().err


def test_your_own_task_evaluates_on_eval_data_with_the_same_fields_and_never_downloads_gsm8k(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(
        data,
        "_download",
        lambda split: pytest.fail("downloaded GSM8K for a task that is not GSM8K"),
    )
    args = config.parse_args(own_task_argv(tmp_path, "--eval-every", "0"))
    assert data.task_from_flags(args).eval == []
    assert (
        "no --eval-data: this task is not GSM8K, so there is no evaluation"
        in capsys.readouterr().out
    )
    held_out = write_rows(
        tmp_path / "held_out.jsonl", [{"prompt": "9 + 1 =", "answer": "10", "id": 9}]
    )
    args = config.parse_args(own_task_argv(tmp_path, "--eval-every", "0", "--eval-data", held_out))
    assert data.task_from_flags(args).eval == [
        {"prompt": "9 + 1 =", "answer": "10", "fields": {"id": 9}}
    ]
    with pytest.raises(
        config.UserError, match="--eval-only on your own task needs its held-out rows"
    ):
        data.task_from_flags(config.parse_args(own_task_argv(tmp_path, "--eval-only")))


def test_the_demo_refuses_data_flags_but_takes_reward_flags(tmp_path):
    with pytest.raises(config.UserError, match="--demo brings its own task; drop --prompt-field"):
        config.parse_args([*CPU, "--demo", "--prompt-field", "q"])
    run_dir = tmp_path / "demo"
    trainer.main(tiny_argv(run_dir, "--reward-fn", "format"))
    (row,) = read_metrics(run_dir)
    assert "rewards/format" in row and "rewards/correctness" not in row


# --- --task addition: generated, deterministic, held-out pairs never trained on -------------------


def pair(row):
    a, b = row["prompt"].removeprefix("What is ").removesuffix("?").split(" + ")
    assert row["answer"] == str(int(a) + int(b))
    return frozenset((int(a), int(b)))


def test_addition_rows_are_deterministic_and_held_out_pairs_are_never_trained_on():
    train_rows, held_out = data.addition_rows()
    assert (train_rows, held_out) == data.addition_rows()  # the seed alone decides
    # 820 unordered pairs in [10, 49]: 200 held out, 620 trained on in both orders (40 doubles: one)
    assert len(held_out) == 200 and len(train_rows) == 1209
    assert len({pair(r) for r in train_rows}) == 620 and len({pair(r) for r in held_out}) == 200
    assert not {pair(r) for r in train_rows} & {pair(r) for r in held_out}  # not even as B + A
    numbers = {n for r in train_rows + held_out for n in pair(r)}
    assert min(numbers) == 10 and max(numbers) == 49
    # the first held-out questions, generated from seed 0 (pinned: a change to the generator shows)
    assert [r["prompt"] for r in held_out[:3]] == [
        "What is 34 + 22?",
        "What is 41 + 28?",
        "What is 42 + 44?",
    ]
    assert data.addition_rows(seed=1) != (train_rows, held_out)


def test_task_multiplication_with_the_calculator_reads_the_answer_tags_within_a_96_token_budget():
    """Issue 43: the tool task's prompt shows the answer in <answer> tags and its reward reads
    only those (rewards.model_answer), with a budget of 96 new tokens (48 without the tool)."""
    args = config.parse_args(
        ["--task", "multiplication", "--tool", "calculator", "--device", "cpu"]
    )
    assert args.max_new_tokens == 96  # was 48: the restatement's answer was cut
    assert config.parse_args(["--task", "multiplication", "--device", "cpu"]).max_new_tokens == 48
    task = data.task_from_flags(args)
    assert (len(task.train), len(task.eval)) == (4800, 200)
    assert [(r.name, r.fn) for r in task.rewards] == [("correctness", rewards.model_answer_reward)]
    prompt = task.prompt(demo.word_tokenizer(demo.WORDS), "What is 347 x 28?")
    assert "Give your final answer as <answer>NUMBER</answer>." in prompt
    assert "So 12 x 34 = <answer>408</answer>." in prompt and prompt.endswith("What is 347 x 28?\n")
    # the example's own reply is what the reward asks for; cut before "</answer>", it scores 0
    reply = data.TOOL_EXAMPLE[1]
    assert task.extract_answer(reply) == "408"
    assert rewards.model_answer_reward([reply, reply[: reply.index("</answer>")]], [408, 408]) == [
        1.0,
        0.0,
    ]
    # without the tool: the question alone, the last number
    plain = data.task_from_flags(config.parse_args(["--task", "multiplication", "--device", "cpu"]))
    assert [r.fn for r in plain.rewards] == [rewards.last_number_reward]


def test_larger_multiplication_rows_are_distinct_pairs_of_the_digits_asked_for():
    rows = data.larger_multiplication_rows()
    assert len(rows) == 200 and len({r["prompt"] for r in rows}) == 200
    for row in rows:
        a, b = map(int, re.fullmatch(r"What is (\d+) x (\d+)\?", row["prompt"]).groups())
        assert 1000 <= a <= 9999 and 100 <= b <= 999 and row["answer"] == str(a * b)
    assert rows[0] == {"prompt": "What is 1631 x 392?", "answer": "639352"}  # pinned: seed 43
    assert data.larger_multiplication_rows((1, 1), count=81)[-1]["prompt"].startswith("What is")
    with pytest.raises(ValueError, match="fewer than 82 pairs"):
        data.larger_multiplication_rows((1, 1), count=82)
    task = data.multiplication_task(True, eval_rows=rows)
    assert task.eval == rows and task.eval_from == "given (larger operands than the task's)"


# A real tokenizer for the budget's token counts: GRPO_SMOLLM2 names a SmolLM2 model directory
# (or a hub id in the local cache); without it, the test is skipped.
SMOLLM2 = os.environ.get("GRPO_SMOLLM2")


@pytest.mark.skipif(SMOLLM2 is None, reason="set GRPO_SMOLLM2 to a SmolLM2 model directory")
def test_the_tool_tasks_budget_fits_the_call_the_result_and_the_answer_with_room_to_spare():
    """The example's reply, with the task's largest operands and with 4 x 3 digits, EOS
    included: 53 and 61 tokens in SmolLM2's tokenizer, under the budget of 96."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    budget = config.MULTIPLICATION_TOOL_DEFAULTS["max_new_tokens"]

    def tokens(a, b):
        reply = data.TOOL_EXAMPLE[1].replace("12*34", f"{a}*{b}").replace("12 x 34", f"{a} x {b}")
        reply = reply.replace("408", str(a * b))
        return len(tokenizer(reply, add_special_tokens=False)["input_ids"]) + 1

    assert [tokens(999, 99), tokens(9999, 999)] == [53, 61]
    assert tokens(999, 99) * 1.5 < budget


def test_task_addition_builds_its_task_and_refuses_a_data_file(tmp_path):
    args = config.parse_args(["--task", "addition", "--device", "cpu"])
    assert (args.max_new_tokens, args.eval_samples, args.eval_temperature) == (48, 8, 0.7)
    task = data.task_from_flags(args)
    assert (len(task.train), len(task.eval)) == (1209, 200)
    assert [r.name for r in task.rewards] == ["correctness"]
    assert task.extract_answer("34 + 22 = 56.") == "56"
    assert task.prompt(demo.word_tokenizer(demo.WORDS), "What is 34 + 22?") == "What is 34 + 22?\n"
    with pytest.raises(config.UserError, match="--task addition generates its own rows"):
        config.parse_args(["--task", "addition", "--data", str(tmp_path / "x.jsonl")])


# --- where a run's rows came from: Task.train_from and Task.eval_from, for the run's header -----


def test_a_task_says_where_its_rows_came_from_in_the_users_words(tmp_path, monkeypatch, capsys):
    # your own JSONL, and held-out rows from --eval-data: the paths as given
    (tmp_path / "gsm8k").mkdir()
    monkeypatch.chdir(tmp_path)
    own = own_task_argv(tmp_path, "--eval-data", "held_out.jsonl", "--eval-every", "0")
    write_rows(tmp_path / "held_out.jsonl", [{"prompt": "9 + 1 =", "answer": "10"}])
    task = data.task_from_flags(config.parse_args(own))
    assert (task.train_from, task.eval_from) == (str(tmp_path / "my.jsonl"), "held_out.jsonl")
    # a GSM8K-style file with test.jsonl beside it: both named as --data was, relative here
    write_gsm8k(tmp_path / "gsm8k" / "train.jsonl")
    write_gsm8k(tmp_path / "gsm8k" / "test.jsonl", n=2)
    gsm8k = [*CPU, "--data", "gsm8k/train.jsonl"]
    task = data.task_from_flags(config.parse_args(gsm8k))
    assert (len(task.train), len(task.eval)) == (6, 2)
    assert (task.train_from, task.eval_from) == ("gsm8k/train.jsonl", "gsm8k/test.jsonl")
    # rows not loaded: nothing to name (no evaluation; --eval-only trains on nothing)
    task = data.task_from_flags(config.parse_args([*gsm8k, "--eval-every", "-1"]))
    assert (task.train_from, task.eval_from) == ("gsm8k/train.jsonl", "")
    task = data.task_from_flags(config.parse_args([*gsm8k, "--eval-only"]))
    assert (task.train, task.train_from, task.eval_from) == ([], "", "gsm8k/test.jsonl")
    # GSM8K's own splits: downloaded to the cache, which the header names with ~
    assert data.rows_from("train", None) == "GSM8K train split (downloaded to ~/.cache/grpo/gsm8k)"
    monkeypatch.setattr(data, "CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(
        data.urllib.request,
        "urlopen",
        lambda url, timeout: io.BytesIO(b'{"question": "q", "answer": "#### 1"}\n'),
    )
    task = data.task_from_flags(config.parse_args([*CPU, "--eval-only"]))
    assert task.eval_from == f"GSM8K test split (downloaded to {tmp_path / 'cache'})"
    # the addition task: generated; the demo: its 100 problems, trained and measured on
    task = data.task_from_flags(config.parse_args(["--task", "addition", "--device", "cpu"]))
    assert (task.train_from, task.eval_from) == (
        "generated (--task addition, seed 0)",
        "generated (--task addition, seed 0, pairs never trained on)",
    )
    task = data.demo_task(demo.setup(0, 0, 0.0)[2])
    assert (task.train_from, task.eval_from) == (
        "the demo's 100 problems",
        "the demo's 100 problems (the ones it trains on)",
    )
    # trainer.py's own additions to the task (its rewards, the response prefix) keep them
    task = trainer.load_task(config.parse_args(gsm8k))
    assert (task.train_from, task.eval_from) == ("gsm8k/train.jsonl", "gsm8k/test.jsonl")


# --- rows no run can use: one paragraph at load, before any model ----------------------------


def refusal(capsys, argv):
    """trainer.main's one paragraph for these flags (exit code 2), after "error: "."""
    capsys.readouterr()  # what building argv printed (own_task_argv saves a model)
    with pytest.raises(SystemExit) as stop:
        trainer.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err.removeprefix("error: ").strip()


def test_an_over_long_prompt_row_is_refused_with_its_line_not_tokenized(
    tmp_path, capsys, monkeypatch
):
    # a 50 MB prompt on line 3 was tokenized whole each time its batch came up (minutes)
    monkeypatch.setattr(trainer.models, "load_model", lambda *a, **kw: pytest.fail("model loaded"))
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "1 + 1 =", "answer": "2"}, {"prompt": "2 + 1 =", "answer": "3"}]
    rows += [{"prompt": "x" * 50_000_000, "answer": "4"}, {"prompt": "4 + 1 =", "answer": "5"}]
    write_rows(path, rows)
    argv = own_task_argv(tmp_path)
    argv[argv.index("--data") + 1] = str(path)
    assert refusal(capsys, argv).startswith(
        f"could not load your task's train data: {path}:3: the prompt ('prompt') is 50,000,000 "
        "characters long, more than 1,000,000 (about 250,000 tokens"
    )
    # GSM8K's rows, and a prompt at the bound itself
    with pytest.raises(ValueError, match=r"^f:9: the prompt \('question'\) is 1,000,001 char"):
        data.gsm8k_row("f:9", {"question": "q" * 1_000_001, "answer": "#### 1"})
    assert data.own_row("f:9", {"p": "q" * 1_000_000, "a": 1}, "p", "a")["answer"] == 1


def test_every_prompt_empty_is_one_paragraph_not_a_traceback(tmp_path, capsys):
    # the demo's tokenizer has no chat template: "" was no token at all, and the first forward
    # raised a reshape error from inside the model
    path = write_rows(
        tmp_path / "rows.jsonl", [{"prompt": " ", "answer": str(i), "text": "t"} for i in range(4)]
    )
    argv = own_task_argv(tmp_path)
    argv[argv.index("--data") + 1] = path
    assert refusal(capsys, argv) == (
        f"every row of {path} (4) has an empty prompt (its 'prompt' field): there is nothing to "
        "answer. Pass the field that holds the prompts with --prompt-field (the rows' other "
        "fields: text)."
    )
    # a batch whose prompts all tokenize to nothing, whatever the rest of the data holds
    with pytest.raises(config.UserError, match=r"every prompt of a batch \(2\) is empty once"):
        sampling.tokenize_prompts(demo.word_tokenizer(demo.WORDS), ["", "\n"], "cpu")


def test_your_own_task_without_reward_fn_is_refused_unless_every_answer_is_a_number(
    tmp_path, capsys
):
    # it used to train on GSM8K's rewards silently: 0 for every completion of a task whose
    # answers are words
    rows = [{"prompt": f"Capital of {c}?", "answer": a} for c, a in [("FR", "Paris"), ("IT", "7")]]
    argv = own_task_argv(tmp_path)
    argv[argv.index("--data") + 1] = write_rows(tmp_path / "capitals.jsonl", rows * 2)
    message = refusal(capsys, argv)
    assert message.startswith(
        "your own task has no reward function: pass --reward-fn MODULE:FUNCTION"
    )
    assert "train row 1 (--data) has the answer 'Paris'" in message
    assert message.endswith("To score it so anyway, pass --reward-fn correctness,format.")
    # a reward model, or --reward-fn (a built-in too), is a reward of its own
    for given in (["--reward-fn", "format"], ["--reward-fn", "correctness,format"]):
        task = trainer.load_task(config.parse_args(argv + given))
        assert [r.name for r in task.rewards] == given[1].split(",")
    # numbers, as GSM8K's are: its rewards, said in one line
    capsys.readouterr()
    task = trainer.load_task(config.parse_args(own_task_argv(tmp_path)))
    assert [r.name for r in task.rewards] == ["correctness", "format"]
    assert capsys.readouterr().out.startswith(
        "no --reward-fn: your task is scored with GSM8K's rewards, correctness"
    )


class CharTokenizer:
    """One token per character: the budget arithmetic below by hand."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [list(text) for text in texts]}


@pytest.mark.parametrize(
    "flags, need, longest",
    [
        # the sums of [10, 49]: 2 digits at most (49 + 49 = 98), and EOS
        (["--task", "addition"], 3, None),
        # 999 x 99 = 98901: 5 digits, and EOS
        (["--task", "multiplication"], 6, None),
        # "<answer>" 8 + 5 digits + "</answer>" 9, and EOS; the calculator's call is optional
        (["--task", "multiplication", "--tool", "calculator"], 23, None),
        # "14 + 25 = 39" 12, "\n", "39 + 31 = 70" 12, "\n", "The answer is 70." 17: 43, and EOS
        (["--task", "chain"], 44, "The answer is"),
    ],
    ids=["addition", "multiplication", "multiplication-tools", "chain"],
)
def test_a_budget_that_cannot_hold_the_tasks_answer_is_refused_in_one_line(flags, need, longest):
    # --max-new-tokens 4 on --task chain cut every completion, and every reward scored 0, silently
    # (issue 54). The shortest response earning the whole reward, in the format the prompt asks
    # for, and EOS, must fit: one token fewer is refused, naming the need; exactly it passes.
    args = config.parse_args([*flags, "--device", "cpu", "--output-dir", "x"])
    task, tokenizer = data.task_from_flags(args), CharTokenizer()
    args.max_new_tokens = need - 1
    with pytest.raises(
        UserError, match=f"--max-new-tokens {need - 1} cannot hold an answer of"
    ) as e:
        data.check_budget(task, tokenizer, args)
    assert f"takes {need} tokens with EOS" in str(e.value) and "\n" not in str(e.value)
    if longest is not None:  # the working it names
        assert longest in str(e.value)
    args.max_new_tokens = need
    data.check_budget(task, tokenizer, args)
    args.max_new_tokens, args.reward_fn = 1, ["my:own"]  # your rewards decide what fits
    data.check_budget(task, tokenizer, args)


def test_your_own_task_and_gsm8k_have_no_known_minimum_budget(tmp_path):
    path = write_gsm8k(tmp_path / "train.jsonl")
    args = config.parse_args(["--data", path, "--device", "cpu", "--output-dir", "x"])
    args.max_new_tokens, args.eval_every = 1, -1
    task = data.task_from_flags(args)
    assert task.shortest_response is None
    data.check_budget(task, CharTokenizer(), args)


@pytest.mark.parametrize("entry", ["train", "trainer"])
def test_both_entry_points_refuse_chain_at_4_new_tokens_before_training(tmp_path, capsys, entry):
    # The case, on the tiny model's tokenizer (its working takes 14 tokens, and EOS)
    import train

    module = train if entry == "train" else trainer
    argv = [*CPU, "--model", tiny_model_dir(tmp_path), "--task", "chain", "--max-new-tokens", "4"]
    capsys.readouterr()  # the model directory's writing
    with pytest.raises(SystemExit) as stop:
        module.main([*argv, "--steps", "1", "--output-dir", str(tmp_path / "out")])
    assert stop.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]  # after the weights' progress bar
    assert line.startswith("error: --max-new-tokens 4 cannot hold an answer of --task chain")
    assert "takes 15 tokens with EOS" in line  # one line, the need named
    assert not (tmp_path / "out").exists()  # refused before the run's directory


@pytest.mark.parametrize("entry", ["train", "trainer"])
def test_a_step_whose_completions_are_all_cut_warns_once(tmp_path, capsys, entry):
    # The demo at one new token: in steps 3 and 4 no completion reaches EOS (its answers take 2
    # or more), so every reward reads a cut answer. One warning for the run, not one a step; and
    # none for steps 1 and 2, where one completion of 128 ended.
    import train

    sampling.warn_all_cut.cache_clear()
    module = train if entry == "train" else trainer
    argv = [*CPU, "--demo", "--steps", "4", "--max-new-tokens", "1", "--eval-every", "-1"]
    module.main([*argv, "--output-dir", str(tmp_path)])
    cut = [r["frac_truncated"] for r in read_metrics(tmp_path)]
    assert cut == [127 / 128, 127 / 128, 1.0, 1.0]  # one of 128 ends at once in steps 1 and 2
    err = capsys.readouterr().err
    assert err.count("warning: every completion of this step was cut at --max-new-tokens 1") == 1

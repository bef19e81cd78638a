"""--data and --eval-data given a Hugging Face dataset: Parquet, CSV and JSON-array files,
save_to_disk directories (a Dataset; a DatasetDict with train/test splits), a folder laid out as a
Hub repository, and Hub ids (offline: the error says what to pass instead). Every dataset is
written here in code; nothing downloads (HF_HUB_OFFLINE=1; the datasets cache is under tmp_path).
"""

import json
import sys
import time
from unittest import mock

import pytest

import config
import data
import rewards
import sampling
import trainer
from helpers import CPU, read_metrics, tiny_model_dir
from support.errors import UserError

# Your own task's columns: the prompt, an integer answer, one more field; and the rows they make.
OWN = {"q": ["Say hi", "Say bye"], "gold": [7, 8], "level": [3, 4]}
OWN_ROWS = [
    {"prompt": "Say hi", "answer": 7, "fields": {"level": 3}},
    {"prompt": "Say bye", "answer": 8, "fields": {"level": 4}},
]
MAPPING = ("--prompt-field", "q", "--answer-field", "gold")


def gsm8k_columns(n, start=0, who="Tom"):
    """GSM8K's columns as the Hub has them: a question, a worked answer ending in "#### <n>"."""
    numbers = range(start, start + n)
    return {
        "question": [f"{who} has {i} apples and buys 2 more. How many now?" for i in numbers],
        "answer": [f"{i} + 2 = {i + 2}\n#### {i + 2:,}" for i in numbers],
    }


@pytest.fixture
def hf(tmp_path, monkeypatch):
    """The datasets library (skipped without it), its cache under tmp_path, no progress bars."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    datasets.disable_progress_bars()
    yield datasets
    datasets.enable_progress_bars()


def task(*argv):
    """The task that these flags describe (no evaluation unless they ask for it)."""
    return data.task_from_flags(config.parse_args([*CPU, "--eval-every", "-1", *argv]))


def refused(*argv):
    """The UserError paragraph that these flags get."""
    with pytest.raises(UserError) as error:
        data.task_from_flags(config.parse_args([*CPU, *argv]))
    return str(error.value)


def save_splits(hf, path, **splits):
    """A DatasetDict of {split: columns}, written by save_to_disk at `path`."""
    dataset_dict = {name: hf.Dataset.from_dict(columns) for name, columns in splits.items()}
    hf.DatasetDict(dataset_dict).save_to_disk(path)
    return str(path)


# --- the formats, read through the same field mapping -------------------------------------------


@pytest.mark.slow
def test_parquet_csv_and_json_array_files_are_read_with_the_field_mapping(hf, tmp_path):
    rows = hf.Dataset.from_dict(OWN)
    rows.to_parquet(tmp_path / "rows.parquet")
    rows.to_csv(tmp_path / "rows.csv", index=False)
    rows.to_json(tmp_path / "rows.json", lines=False)  # one JSON array
    assert (tmp_path / "rows.json").read_text().startswith("[")
    for name in ("rows.parquet", "rows.csv", "rows.json"):
        assert task("--data", str(tmp_path / name), *MAPPING).train == OWN_ROWS, name
    # the mapping takes any columns: here level is the answer, and gold another field
    parquet = str(tmp_path / "rows.parquet")
    swapped = task("--data", parquet, "--prompt-field", "q", "--answer-field", "level")
    assert swapped.train[0] == {"prompt": "Say hi", "answer": 3, "fields": {"gold": 7}}


def test_json_lines_whatever_the_files_name_stays_with_our_own_reader(hf, tmp_path):
    # to_json writes JSON Lines by default: read line by line as before, a bad line named
    path = tmp_path / "rows.json"
    hf.Dataset.from_dict(OWN).to_json(path)
    assert task("--data", str(path), *MAPPING).train == OWN_ROWS
    with open(path, "a") as f:
        f.write('{"q": "Say what", "gold": 9, \n')
    assert f"{path}:3: malformed JSON" in refused("--data", str(path), *MAPPING)


def test_save_to_disk_directories_a_dataset_and_a_datasetdict_with_splits(hf, tmp_path):
    hf.Dataset.from_dict(OWN).save_to_disk(tmp_path / "one")
    assert task("--data", str(tmp_path / "one"), *MAPPING).train == OWN_ROWS
    test = {"q": ["Say yes"], "gold": [1], "level": [5]}
    both = save_splits(hf, tmp_path / "both", train=OWN, test=test)
    held_out = [{"prompt": "Say yes", "answer": 1, "fields": {"level": 5}}]
    assert task("--data", both, *MAPPING).train == OWN_ROWS  # no @SPLIT: --data reads train
    assert task("--data", both + "@test", *MAPPING).train == held_out
    # --eval-data reads test unless a split is named
    evaluated = task("--data", both, "--eval-data", both, "--eval-every", "0", *MAPPING)
    assert (evaluated.train, evaluated.eval) == (OWN_ROWS, held_out)
    assert (evaluated.train_from, evaluated.eval_from) == (f"{both}@train", f"{both}@test")
    on_train = task("--data", both, "--eval-data", both + "@train", "--eval-every", "0", *MAPPING)
    assert on_train.eval == OWN_ROWS


# --- GSM8K recognised: its prompts, rewards and evaluation --------------------------------------


def test_a_dataset_with_gsm8ks_columns_is_read_as_gsm8k_and_evaluated_on_its_test_split(
    hf, tmp_path
):
    test = gsm8k_columns(2, start=1000, who="Ann")
    path = save_splits(hf, tmp_path / "gsm8k", train=gsm8k_columns(3), test=test)
    gsm8k = task("--data", path + "@train", "--eval-every", "0")
    question = "Tom has 2 apples and buys 2 more. How many now?"
    assert gsm8k.train[2] == {"prompt": question, "answer": "4"}
    assert gsm8k.eval == [  # "#### 1,002": the number, commas removed
        {"prompt": "Ann has 1000 apples and buys 2 more. How many now?", "answer": "1002"},
        {"prompt": "Ann has 1001 apples and buys 2 more. How many now?", "answer": "1003"},
    ]
    # GSM8K's prompt (its system prompt, then the question), rewards and answer extraction
    base_model_tokenizer = type("Base", (), {"chat_template": None})()
    prompt = gsm8k.prompt(base_model_tokenizer, question)
    assert prompt == f"{data.SYSTEM_PROMPT}\n\nQuestion: {question}\nAnswer:\n"
    assert [r.name for r in gsm8k.rewards] == ["correctness", "format"]
    assert gsm8k.extract_answer is rewards.extract_answer
    right, wrong = "<think>\n2 + 2 = 4\n</think>\n<answer>4</answer>", "<answer>5</answer>"
    total, each = gsm8k.score(gsm8k.train[2:], [right, wrong], G=2)
    assert each["correctness"].tolist() == [1.0, 0.0]
    assert each["format"].tolist() == pytest.approx([0.5, 0.1])
    assert total.tolist() == pytest.approx([1.5, 0.1])


def test_a_folder_laid_out_as_the_hubs_openai_gsm8k_is_read_as_gsm8k(hf, tmp_path):
    # The Hub repository openai/gsm8k: configs main and socratic, each a train and a test Parquet
    # file, named in its README's YAML. load_dataset reads this folder as it reads the Hub's copy.
    folder = tmp_path / "gsm8k"
    for config_name, who in (("main", "Tom"), ("socratic", "Sam")):
        (folder / config_name).mkdir(parents=True)
        for split, start in (("train", 0), ("test", 100)):
            parquet = folder / config_name / f"{split}-00000-of-00001.parquet"
            hf.Dataset.from_dict(gsm8k_columns(2, start=start, who=who)).to_parquet(parquet)
    yaml = "".join(
        f"- config_name: {c}\n  data_files:\n"
        + "".join(f"  - split: {s}\n    path: {c}/{s}-*\n" for s in ("train", "test"))
        for c in ("main", "socratic")
    )
    (folder / "README.md").write_text(f"---\nconfigs:\n{yaml}---\n# GSM8K\n")
    main = task("--data", f"{folder}:main@train", "--eval-every", "0")
    assert [(r["prompt"][:3], r["answer"]) for r in main.train] == [("Tom", "2"), ("Tom", "3")]
    assert [(r["prompt"][:3], r["answer"]) for r in main.eval] == [("Tom", "102"), ("Tom", "103")]
    assert task("--data", f"{folder}:socratic").train[0]["prompt"].startswith("Sam")
    message = refused("--data", str(folder))  # two configs: name one
    assert "Config name is missing" in message and "['main', 'socratic']" in message
    assert message.endswith(f"The form: --data {folder}:CONFIG@SPLIT.")


def test_a_hub_id_is_loaded_with_its_config_and_gsm8k_is_evaluated_on_its_test_split(
    hf, monkeypatch
):
    # The Hub's openai/gsm8k as load_dataset returns it, built here: nothing downloads
    calls = []

    def load_dataset(path, name=None):
        calls.append((path, name))
        train, test = gsm8k_columns(4), gsm8k_columns(2, start=50)
        return hf.DatasetDict(
            {"train": hf.Dataset.from_dict(train), "test": hf.Dataset.from_dict(test)}
        )

    monkeypatch.setattr(hf, "load_dataset", load_dataset)
    gsm8k = task("--data", "openai/gsm8k:main@train", "--eval-every", "0")
    assert [r["answer"] for r in gsm8k.train] == ["2", "3", "4", "5"]
    # its test split, as test.jsonl beside a JSONL file is
    assert [r["answer"] for r in gsm8k.eval] == ["52", "53"]
    assert calls == [("openai/gsm8k", "main")] * 2
    # where the rows came from, for the run's header: the source as given, and the split read
    assert (gsm8k.train_from, gsm8k.eval_from) == (
        "openai/gsm8k:main@train",
        "openai/gsm8k:main@test",
    )
    # your own task on a Hub id: the mapping applies; held-out rows only when asked for
    mine = task("--data", "openai/gsm8k:main", "--prompt-field", "question", "--eval-every", "0")
    assert mine.train[0]["answer"] == "0 + 2 = 2\n#### 2" and mine.eval == []


# --- bad input: one paragraph naming what exists ------------------------------------------------


def test_a_missing_split_names_the_splits_that_exist(hf, tmp_path):
    both = save_splits(hf, tmp_path / "both", train=OWN, validation=OWN)
    assert refused("--data", both + "@dev", *MAPPING) == (
        f"--data {both}: no split 'dev' (its splits: train, validation). Name one of them: "
        f"--data {both}@SPLIT."
    )
    assert refused("--data", both, "--eval-data", both, *MAPPING) == (
        f"--eval-data {both}: no split 'test' (its splits: train, validation). --eval-data reads "
        f"its 'test' split unless one is named: --eval-data {both}@SPLIT."
    )
    only_test = save_splits(hf, tmp_path / "only-test", test=OWN)
    assert refused("--data", only_test, *MAPPING) == (
        f"--data {only_test}: no split 'train' (its splits: test). --data reads its 'train' split "
        f"unless one is named: --data {only_test}@SPLIT."
    )
    # GSM8K is evaluated on the test split of --data: without one, say how to pick another
    splits = {"train": gsm8k_columns(2), "validation": gsm8k_columns(2)}
    no_test = save_splits(hf, tmp_path / "no-test", **splits)
    assert refused("--data", no_test) == (
        f"--data {no_test}: no split 'test' (its splits: train, validation). Without --eval-data, "
        f"GSM8K is evaluated on the 'test' split of --data: pass --eval-data {no_test}@SPLIT "
        "(--eval-every -1: train without evaluation)."
    )
    # --eval-only evaluates, whatever --eval-every says: the one way out is another split
    assert refused("--data", no_test, "--eval-only").endswith(
        f"of --data: pass --eval-data {no_test}@SPLIT."
    )
    assert len(task("--data", no_test).train) == 2  # no evaluation: no test split needed


def test_a_missing_column_names_the_columns_that_exist(hf, tmp_path):
    path = str(tmp_path / "rows.parquet")
    hf.Dataset.from_dict(OWN).to_parquet(path)
    assert refused("--data", path, "--prompt-field", "question", "--answer-field", "gold") == (
        f"--data {path}: no prompt column 'question' (columns: q, gold, level). Name the columns "
        "with --prompt-field (one of strings) and --answer-field."
    )
    assert "no answer column 'answer' (columns: q, gold, level)" in refused(
        "--data", path, "--prompt-field", "q"
    )
    # without a mapping, rows are read as GSM8K: say so
    assert refused("--data", path) == (
        f"--data {path}: no prompt column 'question' (columns: q, gold, level). Without "
        '--prompt-field/--answer-field, rows are read as GSM8K: a "question" string and an '
        '"answer" string ending in "#### <number>"; name your own columns with --prompt-field '
        "and --answer-field."
    )


def test_a_column_of_the_wrong_type_says_what_it_holds(hf, tmp_path):
    # CSV columns are typed by their values: a prompt of numbers is int64
    sums = tmp_path / "sums.csv"
    sums.write_text("q,gold\n12,3\n45,9\n")
    assert refused("--data", str(sums), *MAPPING) == (
        f"--data {sums}: the prompt column 'q' holds int64, not strings. Name the columns with "
        "--prompt-field (one of strings) and --answer-field."
    )
    lists = str(tmp_path / "lists.parquet")
    hf.Dataset.from_dict({"q": [["Say", "hi"]], "gold": [1]}).to_parquet(lists)
    assert "the prompt column 'q' holds List(Value('string')), not strings" in refused(
        "--data", lists, *MAPPING
    )
    # GSM8K's answer must be text ending in "#### <number>"; your own task's may be anything
    numbers = str(tmp_path / "numbers.parquet")
    hf.Dataset.from_dict({"question": ["q"], "answer": [4]}).to_parquet(numbers)
    assert "the answer column 'answer' holds int64, not strings" in refused("--data", numbers)


def test_a_bad_row_is_named_by_its_split_and_index(hf, tmp_path):
    columns = gsm8k_columns(3)
    columns["answer"][1] = "two plus two\n#### four"
    path = save_splits(hf, tmp_path / "gsm8k", train=columns)
    assert refused("--data", path, "--eval-every", "-1") == (
        f"could not load the GSM8K train data: {path}@train, row 1: the text after '####' is not "
        'a number: \'four\'. Each row of --data must have a "question" string and an "answer" '
        'string ending in "#### <number>".'
    )
    gap = str(tmp_path / "gap.parquet")
    hf.Dataset.from_dict({"q": ["Say hi", None], "gold": [1, 2]}).to_parquet(gap)
    assert f"{gap}, row 1: the prompt field 'q' is a NoneType, not a string" in refused(
        "--data", gap, *MAPPING
    )
    reserved = str(tmp_path / "reserved.parquet")
    hf.Dataset.from_dict({"q": ["Say hi"], "gold": [1], "prompts": [2]}).to_parquet(reserved)
    assert f"{reserved}, row 0: a field may not be named 'prompts'" in refused(
        "--data", reserved, *MAPPING
    )
    empty = str(tmp_path / "empty")
    hf.Dataset.from_dict(OWN).filter(lambda row: False).save_to_disk(empty)
    assert refused("--data", empty, *MAPPING) == f"--data {empty}: no rows (an empty dataset)."
    # an empty file: datasets itself refuses it
    (tmp_path / "empty.csv").write_text("q,gold\n")
    assert refused("--data", str(tmp_path / "empty.csv"), *MAPPING) == (
        f'--data {tmp_path / "empty.csv"}: could not load it as a dataset: Instruction "train" '
        "corresponds to no data!"
    )


def test_missing_unreadable_and_misnamed_sources(hf, tmp_path):
    for missing in (tmp_path / "missing.parquet", tmp_path / "missing-dir"):
        message = refused("--data", str(missing))
        assert message.startswith(f"--data {missing}: no such file or directory. Pass a JSONL")
        assert "a save_to_disk directory, a Parquet, CSV or JSON file, or a Hub id" in message
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    assert refused("--data", str(bad)) == (
        f"--data {bad}: could not load it as a dataset: Parquet magic bytes not found in footer. "
        "Either the file is corrupted or this is not a parquet file."
    )
    (tmp_path / "bad.csv").write_text('q,gold\n"Say hi,1\n')
    message = refused("--data", str(tmp_path / "bad.csv"), *MAPPING)
    assert "An error occurred while generating the dataset: Error tokenizing data" in message
    # a split or a config where the source has none
    rows = str(tmp_path / "rows.parquet")
    hf.Dataset.from_dict(OWN).to_parquet(rows)
    assert refused("--data", rows + "@train") == (
        f"--data {rows}@train: {rows} is one file, with no configs or splits: pass --data {rows}."
    )
    both = save_splits(hf, tmp_path / "both", train=OWN)
    assert refused("--data", both + ":main@train") == (
        f"--data {both}:main@train: {both} is a saved DatasetDict, with splits but no configs: "
        f"pass --data {both}@train."
    )


def test_a_split_saved_with_no_rows_is_one_paragraph(hf, tmp_path):
    # datasets itself raises an IndexError loading a split saved after .select([]): once a traceback
    empty = hf.Dataset.from_dict(OWN).select([])
    hf.DatasetDict(train=empty).save_to_disk(tmp_path / "empty")
    message = refused("--data", str(tmp_path / "empty"), *MAPPING)
    assert message.startswith(f"--data {tmp_path / 'empty'}: could not load it as a dataset")
    assert message.endswith("(a split with no rows?).")


def test_bad_input_through_train_main_is_one_paragraph_and_exit_code_2(hf, tmp_path, capsys):
    both = save_splits(hf, tmp_path / "both", train=OWN)
    with pytest.raises(SystemExit) as stop:
        trainer.main([*CPU, "--data", both + "@dev", *MAPPING, "--output-dir", str(tmp_path / "r")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"--data {both}: no split 'dev' (its splits: train)." in err
    assert "Traceback" not in err


def test_without_the_datasets_library_one_line_says_pip_install_datasets(tmp_path, monkeypatch):
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1")  # never opened: the import fails first
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    assert refused("--data", str(path)) == (
        f"--data {path} is read by the `datasets` library: pip install datasets"
    )
    assert refused("--data", "openai/gsm8k:main@train").endswith(": pip install datasets")
    # a JSONL file never imports it
    (tmp_path / "rows.jsonl").write_text(json.dumps({"q": "Say hi", "gold": 1}) + "\n")
    assert task("--data", str(tmp_path / "rows.jsonl"), *MAPPING).train[0]["prompt"] == "Say hi"


def test_a_hub_id_offline_fails_fast_and_says_what_to_pass_instead(hf):
    start = time.monotonic()
    message = refused("--data", "openai/gsm8k:main@train")
    assert time.monotonic() - start < 10  # HF_HUB_OFFLINE=1: no network attempt, no wait
    assert message.startswith(
        "--data openai/gsm8k:main@train (openai/gsm8k is no file or directory here, so it was "
        "looked up on the Hub): could not reach the Hugging Face Hub (Couldn't reach "
        "'openai/gsm8k' on the Hub (OfflineModeIsEnabled))"
    )
    assert message.endswith(
        "Pass a local copy instead: a directory written by save_to_disk, or Parquet/CSV/JSONL "
        'files. To make one on a machine with network: python -c "import datasets; '
        "datasets.load_dataset('openai/gsm8k', 'main').save_to_disk('gsm8k')\", then copy the "
        "directory gsm8k here and pass --data gsm8k@train."
    )


# --- end to end: a run trains and evaluates from a save_to_disk directory -----------------------


@pytest.mark.slow
def test_a_run_trains_on_the_train_split_and_evaluates_on_the_test_split_of_a_saved_dataset(
    hf, tmp_path
):
    test = gsm8k_columns(2, start=1000, who="Ann")
    path = save_splits(hf, tmp_path / "gsm8k", train=gsm8k_columns(4), test=test)
    asked, real = [], sampling.sample_rollouts

    def spy(model, tokenizer, prompts, *args, **kwargs):
        # who each prompt's question is about: Tom (train split) or Ann (test split)
        asked.append([p.rsplit("Question: ", 1)[1][:3] for p in prompts])
        return real(model, tokenizer, prompts, *args, **kwargs)

    out = tmp_path / "run"
    argv = [*CPU, "--model", tiny_model_dir(tmp_path), "--data", path, "--output-dir", str(out)]
    argv += ["--steps", "1", "--batch-size", "2", "--gradient-accumulation-steps", "1"]
    argv += ["--num-generations", "2", "--max-new-tokens", "4", "--sample-every", "0"]
    argv += ["--eval-every", "0", "--eval-samples", "2", "--eval-batch-size", "2"]
    with mock.patch.object(sampling, "sample_rollouts", spy):
        evals = trainer.main(argv)
    # evaluated before and after on Ann's 2 test questions; the step sampled 2 of Tom's
    assert asked == [["Ann", "Ann"], ["Tom", "Tom"], ["Ann", "Ann"]]
    assert [step for step, _ in evals] == [0, 1]
    assert all(0 <= result["correctness"] <= 1 for _, result in evals)
    (step,) = [row for row in read_metrics(out) if "reward" in row]
    assert step["step"] == 1 and {"rewards/correctness", "rewards/format"} <= set(step)


def test_an_answer_column_empty_in_every_row_is_refused_as_a_jsonl_without_answers(hf, tmp_path):
    # It used to train at reward 0 with no message (a CSV's empty cells are read as None); a JSONL
    # file without the answer field is refused, and so is this, in the same form.
    empty = tmp_path / "no-answers.csv"
    empty.write_text("q,gold\nSay hi,\nSay bye,\n")
    assert refused("--data", str(empty), *MAPPING) == (
        f"could not load your task's train data: {empty}: the answer column 'gold' is empty in "
        "every row (no answer field). Each row of --data must have the --prompt-field (a string) "
        "and the --answer-field."
    )
    jsonl = tmp_path / "no-answers.jsonl"
    jsonl.write_text('{"q": "Say hi"}\n')
    assert refused("--data", str(jsonl), *MAPPING).startswith(
        f"could not load your task's train data: {jsonl}:1: no answer field 'gold'"
    )
    # some answers present: the rows are taken as they are
    some = tmp_path / "some-answers.csv"
    some.write_text("q,gold\nSay hi,1\nSay bye,\n")
    assert [row["answer"] for row in task("--data", str(some), *MAPPING).train] == [1, None]

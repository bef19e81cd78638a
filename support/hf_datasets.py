"""Hugging Face datasets: what --data and --eval-data take besides JSONL.

SOURCE[:CONFIG][@SPLIT]: a Hub id OWNER/NAME (openai/gsm8k:main@train), a directory written by
save_to_disk (gsm8k@test), a folder of data files laid out as a Hub repository, or one Parquet,
CSV or JSON-array file (parse_source). Read by the `datasets` library (an optional extra, imported
only here) into records, which data.load_rows builds into rows as it does JSONL lines. Without
@SPLIT, --data reads the train split and held-out rows the test split.
"""

import contextlib
import os
import re
from dataclasses import dataclass

from support.errors import UserError

# The files that datasets reads, by suffix; JSON Lines, whatever the file's name, stays ours.
DATASET_FILES = {".parquet": "parquet", ".csv": "csv", ".json": "json"}
SOURCE_SYNTAX = re.compile(r"(?P<base>[^:@]+)(?::(?P<config>[\w.-]+))?(?:@(?P<split>[\w.-]+))?")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


@dataclass(frozen=True)
class Source:
    """A --data/--eval-data value that names a Hugging Face dataset (see parse_source)."""

    text: str  # as given, for messages
    # "file": Parquet, CSV or a JSON array; "saved": a saved Dataset, "saved-splits": a saved
    # DatasetDict; "folder": a directory of data files; "hub": a Hub id
    kind: str
    location: str  # the path, or the Hub id
    config: str | None = None
    split: str | None = None  # None: the split of the rows' role (train, or test when held out)

    @property
    def has_splits(self):
        return self.kind in ("saved-splits", "folder", "hub")

    @property
    def takes_config(self):
        return self.kind in ("folder", "hub")

    def name(self, split=None):
        """How messages name it, or one of its splits: location[:config][@split]."""
        config = f":{self.config}" if self.config else ""
        return self.location + config + (f"@{split}" if split else "")


def parse_source(text, flag):
    """The Source that a --data/--eval-data value names; None for a JSONL file, or for a missing
    path that is no Hub id (data.load_rows reads or refuses those as it always has). A value
    naming an existing path is that path, whole; otherwise SOURCE_SYNTAX takes a config and a split
    off its end. A config or a split that the source cannot have is a UserError."""
    match = SOURCE_SYNTAX.fullmatch(text)
    if os.path.exists(text) or match is None:
        base, config, split = text, None, None
    else:
        base, config, split = match.group("base", "config", "split")
    if os.path.isfile(base):
        kind = dataset_file_kind(base)
    elif os.path.isdir(base):
        kind = (
            "saved-splits"
            if os.path.isfile(os.path.join(base, "dataset_dict.json"))
            else "saved"
            if os.path.isfile(os.path.join(base, "state.json"))
            else "folder"
        )
    elif HUB_ID.fullmatch(base) and not base.lower().endswith((*DATASET_FILES, ".jsonl")):
        kind = "hub"
    else:
        return None
    source = Source(text, kind, base, config, split)
    if (config and not source.takes_config) or (split and not source.has_splits):
        what = {
            "jsonl": "a JSONL file",
            "file": "one file",
            "saved": "one saved Dataset",
            "saved-splits": "a saved DatasetDict",
        }[kind]
        has = "splits but no configs" if source.has_splits else "no configs or splits"
        keep = f"@{split}" if split and source.has_splits else ""
        raise UserError(f"{flag} {text}: {base} is {what}, with {has}: pass {flag} {base}{keep}.")
    return None if kind == "jsonl" else source


def dataset_file_kind(path):
    """Which reader a file gets: "file" (datasets) for Parquet, CSV and a .json file holding one
    JSON array; "jsonl" (data.read_jsonl: each value as it is, a bad line named) for any other."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix != ".json":
        return "file" if suffix in DATASET_FILES else "jsonl"
    try:
        with open(path, "rb") as f:
            return "file" if f.read(4096).lstrip().startswith(b"[") else "jsonl"
    except OSError:  # data.read_jsonl says what is wrong
        return "jsonl"


def dataset_records(source, split, flag, fields, row_form, can_skip_eval=True):
    """(where, record) for each record of a Hugging Face dataset, where = "NAME@SPLIT, row 12": the
    split that source names, else the one of the rows' role (`split`), checked column by column.
    `fields` as data.load_rows takes them (None: GSM8K, whose two columns alone are converted);
    `row_form`: what each row must hold (data.row_form's text), for messages; can_skip_eval: a
    training run, which may turn evaluation off (--eval-only may not)."""
    dataset, name = pick_split(open_dataset(source, flag), source, split, flag, can_skip_eval)
    check_columns(dataset, name, flag, fields, row_form)
    if len(dataset) == 0:
        raise UserError(f"{flag} {name}: no rows (an empty dataset).")
    if fields is None:  # GSM8K reads two columns: convert no others
        dataset = dataset.select_columns(["question", "answer"])
    return [(f"{name}, row {i}", record) for i, record in enumerate(dataset.to_list())]


def open_dataset(source, flag):
    """The Dataset or DatasetDict that `source` names, loaded by the `datasets` library: a file by
    its reader, a saved directory by load_from_disk, a folder or a Hub id by load_dataset (which
    reuses its cache offline)."""
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"{flag} {source.text} is read by the `datasets` library: pip install datasets"
        ) from None
    try:
        # a local read takes a second: no progress bars; a Hub download keeps them, and its warnings
        with datasets_silenced(datasets) if source.kind != "hub" else contextlib.nullcontext():
            if source.kind == "file":
                reader = DATASET_FILES[os.path.splitext(source.location)[1].lower()]
                return getattr(datasets.Dataset, f"from_{reader}")(source.location)
            if source.kind in ("saved", "saved-splits"):
                return datasets.load_from_disk(source.location)
            return datasets.load_dataset(source.location, source.config)
    except ConnectionError as e:  # HF_HUB_OFFLINE=1, or no network, and not in the cache
        raise UserError(offline_message(source, flag, e)) from None
    # IndexError: datasets' own, loading a split saved with no rows
    except (OSError, ValueError, IndexError, datasets.exceptions.DatasetsError) as e:
        why = error_chain(e) + (" (a split with no rows?)" if isinstance(e, IndexError) else "")
        why += "" if why.endswith(("!", "?")) else "."
        # a missing or unknown config: say where it goes
        form = f" The form: {flag} {source.location}:CONFIG@SPLIT." if source.takes_config else ""
        raise UserError(
            f"{flag} {source.text}: could not load it as a dataset{hub_lookup_note(source)}: {why}{form}"
        ) from None


def pick_split(loaded, source, split, flag, can_skip_eval=True):
    """(the Dataset to read, its name for messages): of a DatasetDict, the split that source names,
    else the one named `split` (the rows' role); a single Dataset as it is. A missing split is a
    UserError naming those that exist, and the flag that picks one (can_skip_eval: or, in a
    training run, --eval-every -1 for no evaluation at all)."""
    if not isinstance(loaded, dict):  # a DatasetDict is a dict of splits
        return loaded, source.name()
    chosen = source.split or split
    if chosen in loaded:
        return loaded[chosen], source.name(chosen)
    base = source.name()
    if source.split is not None:
        hint = f"Name one of them: {flag} {base}@SPLIT."
    elif flag == "--data" and split == "test":
        hint = (
            "Without --eval-data, GSM8K is evaluated on the 'test' split of --data: pass "
            f"--eval-data {base}@SPLIT"
            + (" (--eval-every -1: train without evaluation)." if can_skip_eval else ".")
        )
    else:
        hint = f"{flag} reads its {chosen!r} split unless one is named: {flag} {base}@SPLIT."
    splits = ", ".join(loaded)
    raise UserError(f"{flag} {base}: no split {chosen!r} (its splits: {splits}). {hint}")


def check_columns(dataset, name, flag, fields, row_form):
    """A UserError naming the columns that exist, for a missing prompt or answer column, or one that
    holds no strings where strings are needed (the prompt; GSM8K's answer too). `row_form`: what
    each row must hold, for the message."""
    prompt, answer = fields or ("question", "answer")
    if fields is None:
        how = (
            "Without --prompt-field/--answer-field, rows are read as GSM8K: "
            f"{row_form}; name your own columns with --prompt-field and --answer-field."
        )
    else:
        how = "Name the columns with --prompt-field (one of strings) and --answer-field."
    columns = dataset.column_names
    for role, column in (("prompt", prompt), ("answer", answer)):
        if column not in columns:
            raise UserError(
                f"{flag} {name}: no {role} column {column!r} (columns: {', '.join(columns)}). {how}"
            )
    for role, column in (("prompt", prompt), ("answer", answer))[: 1 if fields else 2]:
        feature = dataset.features[column]
        # a Value's dtype ("string", "int64"); a List's or a dict's form
        stored = getattr(feature, "dtype", None) or repr(feature)
        if stored not in ("string", "large_string"):
            raise UserError(
                f"{flag} {name}: the {role} column {column!r} holds {stored}, not strings. {how}"
            )


@contextlib.contextmanager
def datasets_silenced(datasets):
    """No progress bars, and no log lines: datasets logs a failure to read a file before raising
    it, which the UserError then says once."""
    verbosity, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def error_chain(error):
    """An exception and its causes on one line: datasets wraps a parser's error in its own."""
    parts = []
    while error is not None:
        parts.append(" ".join(str(error).split()).rstrip(".") or type(error).__name__)
        error = error.__cause__
    return ": ".join(parts)


def hub_lookup_note(source):
    """For a Hub id, which may be a mistyped local path: it is not here, so the Hub was asked."""
    if source.kind != "hub":
        return ""
    return f" ({source.location} is no file or directory here, so it was looked up on the Hub)"


def offline_message(source, flag, error):
    """What to pass instead of a Hub id when the Hub cannot be reached, and how to make it."""
    local = source.location.rsplit("/", 1)[-1]
    config = f", {source.config!r}" if source.config else ""
    split = f"@{source.split}" if source.split else ""
    return (
        f"{flag} {source.text}{hub_lookup_note(source)}: could not reach the Hugging Face Hub "
        f"({error_chain(error)}), and the dataset is not in the local cache. Pass a local copy "
        "instead: a directory written by save_to_disk, or Parquet/CSV/JSONL files. To make one "
        'on a machine with network: python -c "import datasets; datasets.load_dataset('
        f'{source.location!r}{config}).save_to_disk({local!r})", then copy the directory '
        f"{local} here and pass {flag} {local}{split}."
    )

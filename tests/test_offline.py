"""--model given a Hub id where the Hub cannot be reached: one request, then the local Hugging Face
cache alone (support/models.py's hub_unreachable and hub_offline). A model in the cache loads; one
that is not fails at once with what was tried and the fix, instead of retrying every download
(two rounds of five, about a minute). The Hub is made unreachable on any machine: HF_ENDPOINT (or
huggingface_hub's constant read from it) names a local port where nothing listens, and the cache is
a folder under tmp_path.

tests/conftest.py turns the Hub library's offline mode on for the suite: the tests of the
online-then-unreachable path turn it off for themselves (monkeypatch, or a subprocess's env).
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from huggingface_hub import constants

from helpers import ROOT, tiny_model_dir
from support import models
from support.errors import UserError

NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once
# The probe waits at most HUB_PROBE_TIMEOUT (10 s) for an answer that never comes (a dropped
# connection); a refused one, as here, fails in milliseconds. Before: 46-66 s of retries.
BOUND_S = 15
COMMIT = "0" * 40


def cached_model(cache, tmp_path, repo_id="someone/tiny"):
    """The tiny model as the Hub library's cache holds a downloaded one:
    models--OWNER--NAME/refs/main naming a snapshot with its files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(tiny_model_dir(tmp_path), repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return repo_id


def message(why, cache, cwd=None):
    """The UserError for --model SmolLM2-135M-Instruct (in directory `cwd`, the current one if
    None) where the Hub cannot be reached (`why`) and `cache` does not hold it."""
    local = os.path.join(cwd or os.getcwd(), "SmolLM2-135M-Instruct")
    cache = str(cache).replace(os.path.expanduser("~"), "~", 1)
    resolved = "HuggingFaceTB/SmolLM2-135M-Instruct"
    return (
        f"could not load model 'SmolLM2-135M-Instruct'. Tried: the local directory {local} (not "
        f"found); the Hugging Face Hub id {resolved}, but the Hub cannot be reached ({why}) and the "
        f"model is not in the local cache ({cache}). Pass a directory holding the model "
        "(config.json, the tokenizer and the "
        f"weights): --model /path/to/dir (where there is network: hf download {resolved} "
        "--local-dir DIR, then copy DIR here), or run where the Hub can be reached."
    )


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty cache under tmp_path, and the Hub at NOWHERE; offline mode as conftest set it."""
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    # as huggingface_hub derives them from HF_ENDPOINT at import
    monkeypatch.setattr(constants, "ENDPOINT", NOWHERE)
    template = constants.HUGGINGFACE_CO_URL_TEMPLATE.split("/{repo_id}")[1]
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", NOWHERE + "/{repo_id}" + template)
    return cache


def load_failing(name):
    """(load_model's UserError, seconds it took)."""
    start = time.monotonic()
    with pytest.raises(UserError) as error:
        models.load_model(name)
    return str(error.value), time.monotonic() - start


@pytest.mark.parametrize("offline_mode", [True, False], ids=["HF_HUB_OFFLINE=1", "unreachable"])
def test_a_hub_id_offline_fails_at_once_with_what_it_tried_and_the_fix(
    hub, monkeypatch, offline_mode
):
    # HF_HUB_OFFLINE=1 (conftest's): no request at all. Without it: one request, refused.
    if not offline_mode:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline_mode)
    text, seconds = load_failing("SmolLM2-135M-Instruct")
    if offline_mode:
        assert text == message("HF_HUB_OFFLINE is set", hub)
    else:  # the connection's error, as the system words it
        head, tail = message("WHY", hub).split("WHY")
        assert text.startswith(f"{head}{NOWHERE}: ") and text.endswith(tail)
        assert "refused" in text.lower()
    assert seconds < BOUND_S
    assert constants.HF_HUB_OFFLINE is offline_mode  # offline mode only for the load


@pytest.mark.parametrize("offline_mode", [True, False], ids=["HF_HUB_OFFLINE=1", "unreachable"])
def test_a_model_in_the_local_cache_still_loads_offline(
    hub, tmp_path, monkeypatch, capfd, offline_mode
):
    if not offline_mode:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline_mode)
    start = time.monotonic()
    model, tokenizer = models.load_model(cached_model(hub, tmp_path))
    assert time.monotonic() - start < BOUND_S
    assert model.config.vocab_size == len(tokenizer) and tokenizer.padding_side == "left"
    assert "Retrying" not in capfd.readouterr().err  # no lookup went back to the Hub


def test_names_that_are_no_hub_id_are_not_looked_up(hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("./missing/dir", "/abs/missing/dir", "~/missing"):
        assert models.hub_unreachable(name) is None
        text, seconds = load_failing(name)
        assert "not found" in text and "cannot be reached" not in text and seconds < BOUND_S


@pytest.mark.slow
def test_with_hf_endpoint_unreachable_a_process_fails_fast_and_a_cached_model_loads(tmp_path):
    # The environment as a user's shell sets it, read by huggingface_hub at import: HF_ENDPOINT
    # unreachable, no HF_HUB_OFFLINE (conftest's is not inherited), the cache under tmp_path.
    cache = tmp_path / "hub-cache"
    repo_id = cached_model(cache, tmp_path)
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env.update(HF_ENDPOINT=NOWHERE, HF_HUB_CACHE=str(cache), PYTHONPATH=ROOT)
    script = f"""
import json, time
from support import models
from support.errors import UserError
start = time.monotonic()
try:
    models.load_model("SmolLM2-135M-Instruct")
except UserError as e:
    error = str(e)
failed = time.monotonic() - start
models.load_model({repo_id!r})
print(json.dumps([error, failed, time.monotonic() - start - failed]))
"""
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    error, failed_s, loaded_s = json.loads(run.stdout.splitlines()[-1])
    head, tail = message("WHY", cache, cwd=ROOT).split("WHY")
    assert error.startswith(f"{head}{NOWHERE}: ") and error.endswith(tail)
    assert failed_s < BOUND_S and loaded_s < BOUND_S
    assert "Retrying" not in run.stderr

"""The transformers release installed, current (the pin) or next (CI's second lane: the fast
tests on the newest transformers): our own calls into it raise none of its deprecations.

transformers 5.24 renamed the KV cache's keyword and output field `past_key_values` to `cache`
(the old name warns at every forward, and goes in 5.40); decode.cache_keyword picks the name the
installed release takes, and every forward with a cache goes through it. deprecations_we_cause()
records what a block makes transformers say, and keeps what our calls cause:
  - a FutureWarning or DeprecationWarning reported at a line of ours (a library blaming its caller,
    as warnings.warn(stacklevel=...) does for an argument it no longer wants);
  - any FutureWarning or DeprecationWarning naming the cache's old names (past_key_values,
    cache_params): transformers' keyword deprecation is reported inside torch's Module.__call__,
    not at our line, so it is matched by name;
  - transformers' logged messages (its logger, not warnings: reading `output.past_key_values` on
    5.24 logs instead of warning) naming those old names, or saying that generation flags we
    passed are not valid. The logger says each message once per process: its memory is cleared
    first, so an earlier test cannot hide one.
Left out, on purpose: deprecations raised inside the libraries by their own code, which no
argument of ours causes and no change of ours removes (e.g. peft reading transformers'
`is_gradient_checkpointing` when it wraps a model), and UserWarnings.
"""

import contextlib
import inspect
import logging
import os
import warnings

import pytest
import torch
import transformers

import sampling
from helpers import ROOT, run_tiny, tiny_llama
from support import decode

OLD_CACHE_NAMES = ("past_key_values", "cache_params")  # what 5.24 renamed to `cache`


def ours(filename):
    """Whether a warning's reported location is a file of this repository (not an installed
    package, even in a virtual environment kept inside the checkout)."""
    path = os.path.abspath(filename)
    return path.startswith(ROOT + os.sep) and "site-packages" not in path


@contextlib.contextmanager
def deprecations_we_cause():
    """The deprecations our calls in the block make transformers raise or log (see the module's
    docstring for what is kept and why): a list, filled when the block ends."""
    found, logged = [], []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    library = logging.getLogger("transformers")  # its modules' loggers report to this one
    handler = Keep(logging.WARNING)
    once = getattr(transformers.utils.logging, "warning_once", None)
    if hasattr(once, "cache_clear"):
        once.cache_clear()
    library.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
    finally:
        library.removeHandler(handler)
    for w in caught:
        if issubclass(w.category, (FutureWarning, DeprecationWarning)) and (
            ours(w.filename) or any(name in str(w.message) for name in OLD_CACHE_NAMES)
        ):
            found.append(f"{w.category.__name__} at {w.filename}:{w.lineno}: {w.message}")
    found += [
        f"transformers logged: {message}"
        for message in logged
        if any(name in message for name in OLD_CACHE_NAMES)
        or "generation flags are not valid" in message
    ]


def test_the_cache_keyword_is_the_one_this_transformers_takes_and_returns():
    model = tiny_llama()
    key = decode.cache_keyword(model)
    assert key in inspect.signature(model.forward).parameters
    assert decode.cache_keyword(model.model) == key
    cache = decode.KVCache(model.config, 16)
    with deprecations_we_cause() as found, torch.no_grad():
        out = model(input_ids=torch.randint(2, 97, (2, 5)), use_cache=True, **{key: cache})
    assert getattr(out, key) is cache
    assert found == []


def test_decode_log_probs_and_generate_raise_no_deprecation_of_this_transformers():
    # The paths a run takes, on a tiny model: the lean decode (prefill, then steps against the
    # static cache), the shared-prompt log-probs (the prompt's cache repeated to its group), and
    # generate() (beam search) with our GenerationConfig.
    model = tiny_llama()
    torch.manual_seed(0)
    prompts = torch.randint(2, 97, (2, 5))
    mask = torch.ones_like(prompts)
    sample = sampling.Sampling(temperature=1.0, max_new_tokens=4)
    beams = sampling.Sampling(temperature=0.0, max_new_tokens=4, num_beams=2)
    with deprecations_we_cause() as found:
        completions = decode.generate(model, prompts, mask, sample, 2, [1], 0)
        decode.generate(model, prompts, mask, beams, 2, [1], 0)
        ids = torch.cat([prompts.repeat_interleave(2, 0), completions], dim=1)
        attention = torch.ones_like(ids)
        logps = sampling.token_logprobs(
            model, ids, attention, completions.shape[1], 1.0, group_size=2
        )
    assert found == []
    plain = sampling.token_logprobs(model, ids, attention, completions.shape[1], 1.0)
    torch.testing.assert_close(logps, plain)  # the cache really was passed and read back


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--num-beams", "4"]], ids=["sampling", "beams"])
def test_a_short_demo_run_raises_no_deprecation_of_this_transformers(tmp_path, flags):
    # Two steps with μ = 2 (old log-probs), β > 0 (the reference model) and an evaluation (greedy
    # lean decode); or the same through generate()'s beam search.
    extra = ["--steps", "2", "--num-iterations", "2", "--eval-every", "2", *flags]
    with deprecations_we_cause() as found:
        run_tiny(tmp_path / "run", *extra)
    assert found == []

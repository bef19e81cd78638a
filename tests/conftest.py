"""pytest's setup for tests/: the Hub is off before any test module imports transformers (tests
never download). The shared helpers are a plain module, tests/helpers.py; pytest's settings are
in pyproject.toml."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

"""The phase-timing hook: train() wraps each part of a step in `with phases.phase(name):`, so a
tool can time them (scripts/bench.py, scripts/gpu_check.py) without patching the loop's functions.

Off by default (NO_PHASES): each call returns one shared, empty context manager. A tool subclasses
Phases, overrides what it measures and passes it as train(..., phases=...). The names, in the order
a step meets them (a phase may run inside another: "optimizer" inside "update"):

  step        one training step, lines 5-11 of Algorithm 1 and its log line (not the checkpoint
              or the evaluation that may follow it)
  generate    sampling the G completions of each prompt (line 7; dynamic sampling's refills too)
  rewards     scoring them (line 8)
  reference   π_ref's log-probs of the completions, for the KL term (and π_θ's, without
              gradient, for --kl-in-reward's k1)
  update      one optimizer update of π_θ on eq. 3 (line 11): forward, backward and optimizer
  optimizer   the optimizer's part of it: clipping, AdamW, the LR schedule
  evaluation  an evaluation on held-out questions (its generate calls are not "generate")
  checkpoint  a checkpoint save
"""

import contextlib

NAMES = (
    "step",
    "generate",
    "rewards",
    "reference",
    "update",
    "optimizer",
    "evaluation",
    "checkpoint",
)
_OFF = contextlib.nullcontext()


class Phases:
    """No timing: subclass it and override phase() (and step_logged()) to measure."""

    def phase(self, name, step=None):
        """A context manager around phase `name` (one of NAMES). `step` is given where a phase
        starts a step's work or follows it: "step" (the step being made, from 1), "evaluation" and
        "checkpoint" (the steps done before them, 0 before training). The others belong to the
        current "step"."""
        return _OFF

    def step_logged(self, step, metrics):
        """After step `step`'s line of metrics.jsonl (`metrics`: that line's values)."""


NO_PHASES = Phases()

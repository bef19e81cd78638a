"""The support code: what a first reading of GRPO can skip. It imports nothing from the root,
and no two of its files import each other (tests/test_code_shape.py).

The algorithm is in the root's files (grpo.py the math, train.py the loop, trainer.py the loop with
every option, sampling.py generation and log-probs, evaluation.py, rewards.py, data.py, config.py).
Here is what a real run needs around them, one job a file:
  signals.py         Ctrl-C, SIGTERM, SIGHUP: finish the step, save, exit; a terminal that is gone
  models.py          loading a model by name or directory, LoRA adapters (peft)
  decode.py          the decode engine behind sampling.sample_groups and sample_rollouts (static KV
                     cache, compiled)
  checkpoint.py      saving, finding and restoring checkpoints (exact resume)
  rundir.py          the output directory: one run in it, the lock, --overwrite
  report.py          the progress line, metrics.jsonl, the closing table, curves.png
  trackers.py        TensorBoard and W&B (--report-to)
  distributed.py     the few things torchrun needs (DDP, FSDP2)
  reward_model.py    RewardModel: a sequence classifier as a reward function (--reward-model)
  sandbox.py         calling one reward function in isolation: own copies, errors, time limit
  worker.py          user code loaded by import path in a worker process: killed past its limit
  hf_datasets.py     Hugging Face datasets for --data and --eval-data (Hub ids, saved, Parquet)
  demo.py            the offline demo's models, warm-up and problems, built in code
  phases.py          the phase-timing hook train() calls (for scripts/bench.py and gpu_check.py)
  errors.py          the errors meant for the user: one paragraph, exit code 2
"""

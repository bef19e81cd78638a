"""The support code: what a first reading of GRPO can skip.

The algorithm is in the root's files (grpo.py the math, train.py the loop, sampling.py generation and log-probs,
rewards.py, data.py, config.py). Here is what a real run needs around them, one job a file:
  models.py       loading a model by name or directory, LoRA adapters (peft)
  decode.py       the decode engine behind sampling.sample_rollouts: static KV cache, compiled step
  checkpoint.py   saving, finding and restoring checkpoints (exact resume)
  rundir.py       the output directory: one run in it, the lock, --overwrite
  report.py       the progress line, metrics.jsonl, the closing table, curves.png
  trackers.py     TensorBoard and W&B (--report-to)
  distributed.py  the few things torchrun needs (DDP, FSDP2)
  demo.py         the offline demo: a tiny Llama and a word-level tokenizer built in code
  errors.py       UserError: bad input, said in one paragraph
"""

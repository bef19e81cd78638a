"""Shared helpers of the tests in tests/: the CPU pinning, tiny models, tiny training runs and their
metrics, data files.

Plain functions, imported as `from helpers import ...` (pyproject.toml puts the repository root and
tests/ on the import path). TOL: see test_grpo.py's docstring.
"""

import dataclasses
import json
import os
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM

import config
import grpo
import rewards
import sampling
import trainer
from support import checkpoint, decode, demo

TOL = 1e-6  # see test_grpo.py's docstring

# Every run and every flag parse here is pinned to the CPU: --device auto would pick CUDA (and bf16)
# on a machine with a GPU, and the exactness these tests check (bit-identical resume, eager ==
# compiled, gradients to 1e-6) is fp32 CPU exactness; two torchrun ranks would share one GPU.
# Subprocesses that run FSDP2 also get CUDA_VISIBLE_DEVICES="": fully_shard's default mesh is the
# machine's accelerator, whatever device the model is on.
CPU = ["--device", "cpu"]
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
TIME_FIELDS = {"step_time", "tokens_per_s", "eta_s"}
MARKER_DEADLINE_S = 600  # wait_for's default: generous, for a machine loaded by other jobs


def tiny_llama(seed=0):
    """demo.py's builder, narrower, with grouped-query attention and an untied lm-head."""
    return demo.tiny_llama(
        97,
        seed,
        hidden_size=32,
        intermediate_size=64,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ).eval()


def left_padded_batch(group_size=4, prompt_lengths=(7, 4, 2), completion_length=5, seed=0):
    """Prompts of different lengths, left-padded to P, each repeated G times, then random
    completions."""
    gen = torch.Generator().manual_seed(seed)
    b, p = len(prompt_lengths), max(prompt_lengths)
    prompt = torch.randint(3, 97, (b, p), generator=gen)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    for row, length in enumerate(prompt_lengths):
        prompt[row, : p - length], prompt_mask[row, : p - length] = 0, 0
    completion = torch.randint(3, 97, (b * group_size, completion_length), generator=gen)
    ids = torch.cat([prompt.repeat_interleave(group_size, 0), completion], dim=1)
    mask = torch.cat(
        [prompt_mask.repeat_interleave(group_size, 0), torch.ones_like(completion)], dim=1
    )
    return ids, mask


def tiny_argv(out_dir, *extra):
    """A fast demo run on the CPU: no warm-up, 4 prompts x G=4 per step in 2 micro-batches, 1
    step, no eval."""
    return [
        *CPU,
        *"--demo --demo-warmup-steps 0 --output-dir".split(),
        str(out_dir),
        *"--steps 1 --batch-size 2 --gradient-accumulation-steps 2 --num-generations 4".split(),
        *"--num-iterations 1 --eval-every -1 --sample-every 0".split(),
        *extra,
    ]


def varied_reward(completions, answers):
    """A reward that differs within every group of an untrained model's completions (their
    lengths differ), so each step has a learning signal without the demo's warm-up. Same contract
    as rewards.py."""
    return [float(len(c) % 5) for c in completions]


def run_tiny(out_dir, *extra, reward=varied_reward):
    """trainer.py with tiny_argv's flags, on the demo's task with `reward` as its reward function:
    the task is handed to train(), as your own task would be."""
    args = config.parse_args(tiny_argv(out_dir, *extra))
    resume_dir = checkpoint.find_last(args.output_dir) if args.resume else None
    task, model, tokenizer = trainer.setup(args, resume_dir)
    task = dataclasses.replace(task, rewards=[rewards.Reward("correctness", reward, 1.0)])
    return trainer.train(args, task, model, tokenizer, resume_dir)


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def without_time(rows):
    return [{k: v for k, v in row.items() if k not in TIME_FIELDS} for row in rows]


def assert_same_run(straight, resumed):
    """The resumed run logged exactly the uninterrupted one's metrics and ended with
    bit-identical weights."""
    assert without_time(read_metrics(resumed)) == without_time(read_metrics(straight))
    final = [
        AutoModelForCausalLM.from_pretrained(d / "checkpoint").state_dict()
        for d in (straight, resumed)
    ]
    assert all(torch.equal(final[0][k], v) for k, v in final[1].items())


def write_gsm8k(path, n=6):
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps(
                    {
                        "question": f"Tom has {i} apples and buys 2 more. How many now?",
                        "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}",
                    }
                )
                + "\n"
            )
    return str(path)


def tiny_model_dir(tmp_path):
    """The demo's tiny Llama + tokenizer saved as an ordinary model directory, for the GSM8K code
    path."""
    model, tokenizer = demo.model_and_tokenizer(seed=0)
    path = tmp_path / "tiny-model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_rollouts(completion_mask, group_size=4, prompt_length=3, seed=0):
    """Rollouts of random ids for the demo's vocabulary: prompts of prompt_length tokens, no
    padding."""
    torch.manual_seed(seed)
    n, c = completion_mask.shape
    prompts = torch.randint(3, 26, (n // group_size, prompt_length)).repeat_interleave(
        group_size, dim=0
    )
    ids = torch.cat([prompts, torch.randint(3, 26, (n, c))], dim=1)
    attention = torch.cat([torch.ones(n, prompt_length, dtype=torch.long), completion_mask], dim=1)
    return sampling.Rollouts(ids, attention, completion_mask, [""] * n, group_size, 1.0)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def own_task_argv(tmp_path, *extra):
    """A run on your own JSONL (4 rows, a field `id`) with the tiny model: 4 prompts x G=2, 1
    step, no eval."""
    rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1), "id": i} for i in range(4)]
    return [
        *CPU,
        "--model",
        tiny_model_dir(tmp_path),
        "--data",
        write_rows(tmp_path / "my.jsonl", rows),
        *"--prompt-field prompt --answer-field answer --output-dir".split(),
        str(tmp_path / "run"),
        *"--steps 1 --batch-size 2 --gradient-accumulation-steps 2 --num-generations 2".split(),
        *"--max-new-tokens 4 --eval-every -1 --sample-every 0 --save-every 0".split(),
        *extra,
    ]


def tiny_reward_model_dir(tmp_path, num_labels=1, name="tiny-rm"):
    """A randomly initialized Llama sequence classifier over the demo's words, saved with its
    tokenizer."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=len(demo.WORDS),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_labels=num_labels,
            pad_token_id=demo.PAD,
            eos_token_id=demo.EOS,
            bos_token_id=None,
            max_position_embeddings=256,
        )
    )
    path = tmp_path / name
    model.save_pretrained(path)
    demo.word_tokenizer(demo.WORDS).save_pretrained(path)
    return str(path)


def torchrun_command(out_dir, *argv, nproc=2):
    """python -m torch.distributed.run ... trainer.py --demo on the CPU, with `argv`."""
    return [
        sys.executable,
        *"-m torch.distributed.run --standalone --nproc-per-node".split(),
        str(nproc),
        os.path.join(ROOT, "trainer.py"),
        *CPU,
        *"--demo --output-dir".split(),
        str(out_dir),
        *"--sample-every 0".split(),
        *argv,
    ]


def torchrun_env():
    """The ranks' environment: offline, one thread, no GPU, and tests/ importable (--reward-fn
    helpers:...)."""
    tests = os.path.join(ROOT, "tests")
    path = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=path, **NO_GPU)


def torchrun(out_dir, *argv, nproc=2):
    """trainer.py --demo under torchrun with `argv`, to the end (exit code 0): its output."""
    result = subprocess.run(
        torchrun_command(out_dir, *argv, nproc=nproc),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=torchrun_env(),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def decode_with_drawn_logprobs(
    model, prompt_ids, prompt_mask, settings, group_size, eos_ids, pad_id
):
    """decode.lean_decode's [B*G, C] completions, and [B*G, C] the log-prob each token was drawn
    with (0 after EOS), as the decode records them (record=)."""
    record = {}
    completions = decode.lean_decode(
        model, prompt_ids, prompt_mask, settings, group_size, eos_ids, pad_id, record=record
    )
    return completions, record["drawn"] * grpo.completion_mask(completions, eos_ids)


def wait_for(ready, proc, what, deadline_s=MARKER_DEADLINE_S):
    """Poll `ready()` every 50 ms until it is true: a marker `proc` emits at the point a test
    interrupts it (a file its code writes, a line in its log). A test that signals a process waits
    for such a marker, not a fixed sleep, which under load can land before that point. Fails, with
    the end of proc's output where it is a pipe, if proc ends first or `deadline_s` passes (then
    proc is killed). `what` names the marker for the message."""
    deadline = time.monotonic() + deadline_s
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(
                f"the process ended (exit code {proc.returncode}) before {what}{output_of(proc)}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} within {deadline_s} s{output_of(proc)}")
        time.sleep(0.05)


def output_of(proc):
    """The last 3000 characters of an ended (or killed) proc's piped output, on a line of their own;
    "" where it has none left to read."""
    try:
        out = [o for o in proc.communicate(timeout=60) if o]
    except (subprocess.TimeoutExpired, ValueError):  # a child holds the pipe; a pipe closed
        return ""
    text = "".join(o if isinstance(o, str) else o.decode(errors="replace") for o in out)
    return f":\n{text[-3000:]}" if text else ""


def scripted(model, next_word, words):
    """Make `model` write next_word[previous word] over the word vocabulary `words` (greedy or
    sampled alike: a logit of 50 on it, 0 elsewhere; <eos> after any other word). Returns the hook
    handle; the model's own logits stay for what the hook does not touch, so the log-prob passes
    after hook.remove() see the real model."""
    ids_of = {w: i for i, w in enumerate(words)}

    def hook(module, args, kwargs, out):
        ids = kwargs["input_ids"]
        logits = torch.zeros_like(out.logits)
        nxt = [ids_of[next_word.get(words[i], "<eos>")] for i in ids[:, -1].tolist()]
        logits[torch.arange(len(ids)), -1, torch.tensor(nxt)] = 50.0
        out.logits = logits
        return out

    return model.register_forward_hook(hook, with_kwargs=True)

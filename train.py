"""GRPO as DeepSeekMath defines it (arXiv 2402.03300): Algorithm 1 with eq. 3, in one file.

    python train.py --demo                         # a tiny model learns addition: CPU, offline
    python train.py --model SmolLM2-1.7B-Instruct  # GSM8K, 200 steps, one GPU, bf16
    python train.py --model DIR --data my.jsonl --prompt-field question --answer-field answer \\
        --reward-fn my_rewards:exact               # your own task
    python train.py <the same flags> --resume      # continue from OUTPUT_DIR/checkpoint

Read it top to bottom beside the paper: the flags (Args), setup (π_θ, π_ref, AdamW, the schedule),
train() with Algorithm 1's line numbers, one GRPO update, then the log, evaluation, saving and main.
The math is grpo.py, generation and log-probs sampling.py, the rest (checkpoints, the output
directory, signals, the evaluation) support/. Beyond the paper (tools, DAPO, GSPO, CISPO, SAPO,
torchrun, trackers, reward models): trainer.py, held to the same numbers by tests/test_reference.py.
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
import typing
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
from transformers import get_scheduler, set_seed

import config
import data
import evaluation
import grpo
import process_supervision
import rewards
import sampling
from support import checkpoint, demo, memory, models, report, rundir
from support.errors import UserError
from support.signals import STOPS, Stopped


def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    """The flags, with the defaults of Pramodith's GRPO blog (--demo: config.DEMO_DEFAULTS)."""

    model: str = arg("SmolLM2-1.7B-Instruct", "a local directory, a hub id or a SmolLM2 name")
    demo: bool = arg(False, "offline demo: a tiny Llama built in code learns 1-digit addition")
    task: str = arg("gsm8k", "gsm8k | addition | multiplication | chain (process supervision)")
    data: str = arg(None, "train rows (JSONL); if not given, GSM8K's train split, downloaded")
    prompt_field: str = arg(None, "your own rows: the field holding the prompt")
    answer_field: str = arg(None, "your own rows: the field holding the reference answer")
    reward_fn: tuple = arg((), "MODULE:FUNCTION(completions, answers) -> [float]; repeatable")
    steps: int = arg(200, "M, training steps")
    batch_size: int = arg(1, "prompts per micro-batch")
    gradient_accumulation_steps: int = arg(4, "micro-batches of prompts per step")
    micro_batch_size: int = arg(None, "completions per forward/backward; if not given, batch x G")
    num_generations: int = arg(8, "G, completions per prompt (the group)")
    num_iterations: int = arg(1, "μ, GRPO iterations (AdamW steps) per batch")
    beta: float = arg(0.04, "β, the KL coefficient; 0: no π_ref at all")
    ref_update_every: int = arg(0, "K: π_ref ← π_θ every K steps (Algorithm 1, line 2); 0: never")
    epsilon: float = arg(0.2, "ε, the clip range of the ratio")
    lr: float = arg(5e-5, "AdamW learning rate (linear decay to 0; the built-in tasks: constant)")
    max_grad_norm: float = arg(1.0, "gradient clipping (global L2 norm); 0: none")
    temperature: float = arg(0.9, "sampling temperature")
    max_new_tokens: int = arg(300, "tokens per completion at most")
    lora_rank: int = arg(0, "train LoRA adapters of this rank (π_ref: adapters off); 0: all")
    device: str = arg("auto", "auto | cpu | cuda")
    dtype: str = arg("auto", "autocast dtype, weights stay fp32: auto (bf16 on CUDA) | bf16 | fp32")
    gradient_checkpointing: bool = arg(None, "recompute activations: less memory; unset: planned")
    decode: str = arg("auto", "auto (fused on CUDA) | fused | graphs | eager: how the decode runs")
    eval_every: int = arg(0, "evaluate every N steps; 0: before and after training; -1: never")
    eval_limit: int = arg(None, "evaluate on the first N held-out questions only")
    eval_samples: int = arg(8, "completions per held-out question (pass@k, maj@k)")
    save_every: int = arg(50, "checkpoint every N steps (and after the last, before evaluations)")
    output_dir: str = arg(None, "metrics.jsonl, curves.png, checkpoint/; if not given, runs/<name>")
    resume: bool = arg(False, "continue from OUTPUT_DIR/checkpoint, exactly")
    overwrite: bool = arg(False, "start over in an --output-dir that holds an earlier run")
    seed: int = arg(42, "seeds torch, numpy, random and the data order")


def parse_args(argv=None):
    """(Args, the same flags as trainer.py reads them). config.parse_args checks every value (one
    clear line for a bad one), applies --demo's defaults and fills in the device, the dtype and the
    output directory; the support functions take its namespace."""
    parser = config.ReferenceParser(
        description=__doc__.split("\n")[0],
        epilog="--reward-fn runs in this process: a function that exits it (os._exit) ends the run, "
        "unsaved. Isolated, and beyond the paper (tools, DAPO, ...): python trainer.py --help.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(Args):
        flag, kind = "--" + f.name.replace("_", "-"), (typing.get_args(f.type) or (f.type,))[0]
        if kind is bool:
            on = "store_true" if f.default is False else argparse.BooleanOptionalAction  # --no-X
            parser.add_argument(flag, action=on, help=f.metadata["help"], default=f.default)
        else:
            action, default = ("append", list(f.default)) if kind is tuple else ("store", f.default)
            kind, help = (str if kind is tuple else kind), f.metadata["help"]
            parser.add_argument(flag, type=kind, action=action, help=help, default=default)
    parser.parse_args(argv)  # --help; a flag this file does not take: one line, exit 2
    flags = config.parse_args(argv)
    if flags.dtype == "fp16":
        raise UserError("--dtype fp16 needs a loss scaler: use trainer.py, or bf16 / fp32 here.")
    flags.world_size = 1  # one process; saved with each checkpoint, as trainer.py saves it
    return Args(**{f.name: getattr(flags, f.name) for f in dataclasses.fields(Args)}), flags


# --------------------------------------------------------------------------------------------------
# Setup, in reading order: the task, π_θ, π_ref, AdamW and its schedule, a resumed run's state.


def setup(args, flags):
    """The run: the task and its rewards, the models, the optimizer, the log. The data and the
    rewards load first, so that a bad file fails in a second, not after loading a 1.7B model."""
    resume_dir = checkpoint.find_last(args.output_dir) if args.resume else None
    if args.resume and resume_dir is None:
        raise UserError(f"--resume: no checkpoint in {args.output_dir}; pass its --output-dir.")
    start = checkpoint.starting_weights(flags, resume_dir)  # π_θinit, or a checkpoint's weights
    set_seed(args.seed)
    fits = functools.partial(models.check_context, args.max_new_tokens, flags.max_prompt_length)
    if args.demo:  # a 2-layer Llama, warmed up on the task to answer right now and then
        warmup, target = flags.demo_warmup_steps, flags.demo_target_accuracy
        model, tokenizer, problems = demo.setup(args.seed, warmup, target)
        task = data.demo_task(problems)
        fits(model.config, "the demo's model")
    else:
        task = data.task_from_flags(flags)
        rewards.check_own_task_rewards(flags, task)  # your rows, GSM8K's rewards: numbers only
        name = resume_dir if start == checkpoint.FROM_CHECKPOINT else args.model
        model, tokenizer = models.load_model(name, check_config=fits)
        data.check_budget(task, tokenizer, flags)  # --max-new-tokens holds the task's answer
    if args.reward_fn:  # your functions in place of the task's (rewards.imported_here)
        task = dataclasses.replace(task, rewards=rewards.imported_here(args.reward_fn))
    dtype = sampling.AUTOCAST_DTYPE[args.dtype]
    # 1: π_θ ← π_θinit; 3: π_ref ← π_θ (a frozen copy; LoRA: the same model, adapters off)
    if args.lora_rank:
        adapter = resume_dir if start == checkpoint.MODEL_AND_ADAPTER else None
        peft = models.add_lora(model.to(args.device), flags, adapter)
        model, ref_model = peft.get_base_model(), peft if args.beta > 0 else None
    else:
        peft, fresh = None, start == checkpoint.FROM_MODEL
        ref_model = models.reference_model(model, args.beta, dtype, args.device, fresh)
    if start == checkpoint.MODEL_THEN_CHECKPOINT:  # π_ref came from --model; π_θ from here
        model = checkpoint.load_policy(resume_dir, model, flags)
    models.disable_dropout(model)  # μ > 1: π_old and π_θ must be the same function
    model.to(args.device)
    if memory.checkpointing(args, flags, model, task, tokenizer):  # as given, or CUDA's plan
        sampling.enable_gradient_checkpointing(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    try:  # AdamW on the fp32 weights, one fused kernel where torch has it
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=True)
    except (RuntimeError, ValueError):
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    updates = args.steps * args.num_iterations
    schedule = flags.lr_scheduler  # linear; constant for the built-in tasks (config.py)
    scheduler = get_scheduler(schedule, optimizer, num_warmup_steps=0, num_training_steps=updates)
    step = 0
    if resume_dir is not None:  # AdamW, the schedule and the RNG as saved; no NaN taken in
        step = checkpoint.restore(resume_dir, flags, optimizer, scheduler, None, ref_model)
        checkpoint.check_resumed_finite(model, optimizer, resume_dir)
    log, evals = report.open_log(args.output_dir, step if resume_dir else None, flags)
    columns = report.columns(report.read_metrics(args.output_dir)[0])  # curves.png's data
    report.print_header(flags, model)
    report.print_data(task, args.eval_limit)
    return SimpleNamespace(
        flags=flags, task=task, model=model, ref_model=ref_model, peft=peft, tokenizer=tokenizer,
        optimizer=optimizer, scheduler=scheduler, scaler=None, dtype=dtype, start=step, log=log,
        evals=evals, columns=columns, times=[], skipped_in_a_row=0,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Algorithm 1, iterative GRPO. The rewards are fixed functions (line 12, training the reward model,
# has nothing to do); line 2's outer loop starts a new iteration, π_ref ← π_θ, every
# --ref-update-every K steps (0, the default: one iteration, π_ref stays π_θinit).


def train(run, args):
    """Lines 4-11 for steps start..M, then the closing evaluation. Returns the evaluations."""
    task, model, tok, G = run.task, run.model, run.tokenizer, args.num_generations
    prompts_per_step = args.batch_size * args.gradient_accumulation_steps
    micro = args.micro_batch_size or args.batch_size * G  # completions per forward: whole groups
    decoding = sampling.Sampling.of(run.flags)
    shared = not args.gradient_checkpointing  # π_ref's forward as π_θ's (sampling.py)
    evaluate_if_due(run, args, run.start)
    # 4: for step = 1, ..., M
    for step in range(run.start, args.steps):
        started, rng, updates_before = time.time(), rng_now(), run.scheduler.last_epoch
        try:
            # 5: sample a batch D_b from D (a pure function of the seed and the step: resumable)
            rows = data.batch_at(task.train, prompts_per_step, args.seed, step)
            # 6: π_old ← π_θ: π_old is only used through its log-probs of 7's completions
            prompts = [task.prompt(tok, row["prompt"]) for row in rows]
            # 7: sample G outputs o_i ~ π_old(· | q) for each question q
            rollouts = sampling.sample_groups(model, tok, prompts, decoding, G, run.dtype)
            # 8: compute the rewards r_i of each o_i: [B*G], each function's {name: [B*G]}, and
            # a process reward's steps (§4.1.3): {name: [(end, reward), ...] for each o_i}
            steps = {}
            texts, lengths = rollouts.texts, rollouts.lengths
            redo = functools.partial(checkpoint.save_interrupted, run, run.flags, step, False, rng)
            reward, per_fn = task.score(rows, texts, G, lengths, steps=steps, here=redo)
            mask = rollouts.completion_mask  # [N, C]: 1 on o_i's tokens up to and including EOS
            # 9: Â_{i,t} [N, C]. Outcome supervision: (r_i - mean(r)) / std(r) over o_i's group,
            # for every token t. Process supervision (§4.1.3), where a reward returned steps: the
            # sum of the group-normalized rewards of o_i's steps that end at or after token t.
            if steps:
                advantages = process_supervision.advantages(task, per_fn, steps, rollouts, tok)
            else:
                advantages = grpo.group_advantages(reward, G)[:, None]  # [N, 1], for every t:
                advantages = advantages.to(mask.device).expand(mask.shape)  # [N, C]
            # log π_ref(o_i,t | q, o_i,<t) for the KL term [B*G, C] (β = 0: no π_ref, no KL)
            ref_logps = None
            if run.ref_model is not None:
                ref_logps = sampling.frozen_logps(run.ref_model, rollouts, micro, run.dtype, shared)
            old_logps, updates = None, []  # μ = 1: π_old = sg(π_θ), the ratio is exactly 1
            normalizer = float(grpo.loss_denominator(mask))  # N, the WHOLE batch's: 1/G Σ_i
            # 10: for GRPO iteration = 1, ..., μ
            for _ in range(args.num_iterations):
                # 11: update π_θ by maximizing eq. 3: forward and backward over micro-batches of
                # whole groups (each loss over the whole batch's normalizer, so the gradients add
                # up to the full batch's), then clip the gradient, one AdamW step, the schedule
                model.train()
                sums = dict.fromkeys(("loss", "entropy", "tokens", "kl", "clipped"), 0.0)
                logps_now = torch.zeros(mask.shape, device=mask.device)  # π_θ's, before the step
                lr = run.scheduler.get_last_lr()[0]
                run.optimizer.zero_grad(set_to_none=True)
                for part in sampling.micro_batches(len(mask), micro):
                    ids, attn, keep = sampling.micro_batch_inputs(rollouts, part)  # no pad columns
                    m, cut = mask[part, :keep], lambda x: None if x is None else x[part, :keep]
                    with sampling.autocast(ids.device, run.dtype):
                        # log π_θ(o_i,t | q, o_i,<t) with grad [n, keep], and π_θ's entropy there
                        logps, entropy = sampling.token_logprobs(
                            model, ids, attn, keep, rollouts.temperature, entropy=True, group_size=G
                        )
                        logps_now[part, :keep] = logps.detach()
                        sums["entropy"] += (entropy * m).sum().item()
                        stats = {}
                        loss = grpo.grpo_loss(  # -J(θ) of eq. 3 on this micro-batch
                            logps, cut(old_logps), cut(ref_logps), cut(advantages), m,
                            epsilon=args.epsilon, beta=args.beta, normalizer=normalizer, stats=stats,
                        )  # fmt: skip
                        loss.backward()
                    sums["loss"] += loss.item()
                    for k in ("tokens", "kl", "clipped"):
                        sums[k] += stats[k]
                updates.append(optimizer_step(run, args, sums, lr))
                if old_logps is None and args.num_iterations > 1:
                    old_logps = logps_now  # iteration 1 ran before any update: π_old's log-probs
            if args.ref_update_every and (step + 1) % args.ref_update_every == 0:
                checkpoint.reset_reference(run.ref_model, model)  # lines 2-3: π_ref ← π_θ
            log_step(run, args, step + 1, rows, rollouts, reward, per_fn, updates, started)
            saved = save_if_due(run, args, step + 1)
            if STOPS.signum is not None:  # Ctrl-C, SIGTERM, SIGHUP: the step finished, is saved
                raise Stopped(STOPS.signum, everywhere=True, saved=saved)
        except (KeyboardInterrupt, UserError) as e:  # a second Ctrl-C, a reward that raised
            updated = run.scheduler.last_epoch != updates_before  # then the step counts as done
            if updated and updates and run.columns["step"][-1:] != [step + 1]:  # with its row
                log_step(run, args, step + 1, rows, rollouts, reward, per_fn, updates, started)
            checkpoint.save_interrupted(run, run.flags, step, updated, rng, stopped_by=e)
            raise
        evaluate_if_due(run, args, step + 1)
    if len(run.evals) > 1:
        count = len(task.eval[: args.eval_limit])
        report.print_eval_table(run.evals, count, args.eval_samples, run.flags.eval_temperature)
    evals = [{"step": s, **{f"eval/{k}": v for k, v in e.items()}} for s, e in run.evals]
    report.draw(args.output_dir, run.columns, evals)  # OUTPUT_DIR/curves.png
    return run.evals


def optimizer_step(run, args, sums, lr):
    """The end of line 11: clip the gradient norm, AdamW, the schedule; a non-finite loss or norm
    skips it (no NaN in the weights; 3 in a row stop the run, saved). Its stats, per token."""
    limit = args.max_grad_norm if args.max_grad_norm > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.model.parameters(), limit))
    skipped = None if math.isfinite(sums["loss"]) else "non-finite loss"
    skipped = skipped or (None if math.isfinite(grad_norm) else "non-finite gradient norm")
    if skipped is None:
        run.optimizer.step()
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)  # frees the gradients before the next generation
    run.skipped_in_a_row = run.skipped_in_a_row + 1 if skipped else 0
    if run.skipped_in_a_row >= 3:
        raise UserError(f"3 updates in a row were skipped ({skipped}): lower --lr, check rewards")
    tokens = max(sums["tokens"], 1)
    return dict(
        loss=sums["loss"], kl=sums["kl"] / tokens, clip_frac=sums["clipped"] / tokens,
        entropy=sums["entropy"] / tokens, grad_norm=grad_norm, lr=lr, skipped=skipped,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# The log, evaluation and checkpoints.


def log_step(run, args, done, rows, rollouts, reward, per_fn, updates, started):
    """Step `done`'s metrics (those of the updates: their mean over the μ iterations): one line in
    OUTPUT_DIR/metrics.jsonl (trainer.py's fields, computed the same way), the progress line, and
    every 10 steps the first completion."""
    run.times.append(time.time() - started)
    times, steps_left = run.times, args.steps - done
    lengths, groups = rollouts.lengths.float(), reward.view(-1, args.num_generations)
    mean = lambda key: float(np.mean([u[key] for u in updates]))  # noqa: E731
    skips = [u["skipped"] for u in updates if u["skipped"]]  # non-finite loss or gradient
    m = dict(
        loss=mean("loss"), reward=reward.mean().item(), reward_std=reward.std().item(),
        **{f"rewards/{n}": r.mean().item() for n, r in per_fn.items()},
        **{f"rewards/{n}_std": r.std().item() for n, r in per_fn.items()},
        **({"accuracy": per_fn["correctness"].mean().item()} if "correctness" in per_fn else {}),
        kl=mean("kl"), clip_frac=mean("clip_frac"), entropy=mean("entropy"),
        grad_norm=mean("grad_norm"), completion_len_mean=lengths.mean().item(),
        completion_len_max=int(lengths.max()),
        frac_zero_std=(groups == groups[:, :1]).all(1).float().mean().item(),
        frac_truncated=rollouts.truncated.float().mean().item(), lr=updates[0]["lr"],
        step_time=times[-1], tokens_per_s=lengths.sum().item() / times[-1],
        eta_s=float(np.mean(times) * steps_left), skipped_nonfinite=len(skips),
        **({"skip_reason": skips[0]} if skips else {}),
    )  # fmt: skip
    row = {"step": done, **m}
    write_row(run, row)
    for key, value in row.items():  # curves.png's data
        run.columns[key].append(value)
    print(
        f"step {done}/{args.steps} | loss {m['loss']:+.4f} | reward {m['reward']:.3f} | kl "
        f"{m['kl']:.4f} | clip {m['clip_frac']:.3f} | len {m['completion_len_mean']:.0f} | "
        f"zero-std {m['frac_zero_std']:.2f} | {m['step_time']:.2f}s | eta {m['eta_s']:.0f}s"
        + (f" | SKIPPED: {m['skip_reason']}" if m["skipped_nonfinite"] else ""),
        flush=True,
    )
    if done % 10 == 0:
        first = run.task.responses(rollouts.texts)[0]
        print(f"--- step {done}, reward {reward[0]:.2f}, answer {rows[0]['answer']}:\n{first}\n---")


def write_row(run, row):
    with open(run.log.path, "a") as f:
        f.write(json.dumps(row) + "\n")


def eval_due(run, args, step):
    """Before training, every --eval-every steps, after the last step; --eval-every -1: never."""
    periodic = args.eval_every > 0 and step % args.eval_every == 0
    return args.eval_every >= 0 and len(run.task.eval) > 0 and (step in (0, args.steps) or periodic)


def evaluate_if_due(run, args, step):
    """Held-out accuracy, format, pass@k and maj@k of π_θ (support/evaluation.py), unless a
    resumed run logged this step's already. A signal during it stops at once (training is saved
    before every evaluation)."""
    if not eval_due(run, args, step) or step in dict(run.evals):
        return
    with STOPS.at_once(f"the evaluation at step {step}; training is saved up to it"):
        settings = evaluation.EvalSettings.of(run.flags)
        result = evaluation.evaluate_with(run.model, run.tokenizer, run.task, settings, run.dtype)
    run.evals.append((step, result))
    print(f"eval @ step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
    write_row(run, {"step": step, **{f"eval/{k}": v for k, v in result.items()}})


def save_if_due(run, args, done):
    """A checkpoint (support/checkpoint.py: atomic, the weights checked finite first) every
    --save-every steps, after the last step, before an evaluation, and when a signal asked to
    stop. Returns whether it saved."""
    periodic = args.save_every > 0 and done % args.save_every == 0
    stop = STOPS.signum is not None
    if not (periodic or stop or done == args.steps or eval_due(run, args, done)):
        return False
    checkpoint.save_run(run, run.flags, done, checkpoint.rng_state(), final=stop)
    return True


def rng_now():
    """torch's RNG state at a step's start, for a checkpoint saved inside it (--resume redoes)."""
    cuda = {"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}
    return dict(torch=torch.get_rng_state(), **cuda)


# --------------------------------------------------------------------------------------------------
# The command line.


def main(argv=None):
    """Flags, setup, train(). Bad input and running out of memory end with one paragraph on stderr
    and exit code 2, not a traceback; Ctrl-C and SIGTERM finish the step and save it."""
    try:
        args, flags = parse_args(argv)
        with rundir.claim_output_dir(flags):  # one live run per directory
            run = setup(args, flags)
            with STOPS:
                return train(run, args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (torch.OutOfMemoryError, MemoryError) as e:
        print(
            f"error: out of memory ({type(e).__name__}). Lower --micro-batch-size (a multiple of "
            "--num-generations), add --gradient-checkpointing, or lower --max-new-tokens; --resume "
            "continues from the last checkpoint in the output directory.",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


class DevNullWhenReaderGone:
    """stdout or stderr that outlives its reader (a dropped ssh session: EIO; `python train.py |
    head`: EPIPE): from the first failed write on, it goes to /dev/null and training goes on,
    recorded in metrics.jsonl and the checkpoints, where a failing print would end the run
    unsaved. Installed by `python train.py` and `python trainer.py`, never by main()."""

    def __init__(self, stream):
        self.stream, self.gone = stream, False

    def write(self, text):
        try:
            return len(text) if self.gone else self.stream.write(text)
        except OSError:
            return self.lost() or len(text)

    def flush(self):
        try:
            return None if self.gone else self.stream.flush()
        except OSError:
            self.lost()

    def lost(self):
        """Its file descriptor to /dev/null, with the text buffered (flushed at exit: code 120)."""
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
            self.stream.flush()
        except OSError:  # no file descriptor to point elsewhere: drop what comes
            self.gone = True

    def __getattr__(self, name):  # fileno, isatty, encoding, ...
        return getattr(self.stream, name)


if __name__ == "__main__":
    sys.stdout, sys.stderr = DevNullWhenReaderGone(sys.stdout), DevNullWhenReaderGone(sys.stderr)
    try:
        main()
    except KeyboardInterrupt as e:  # 130 for Ctrl-C; a signal's 128 + its number (Stopped)
        raise SystemExit(getattr(e, "exit_code", 130)) from None

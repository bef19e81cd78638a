"""GRPO, the training loop: Algorithm 1 of DeepSeekMath (arXiv 2402.03300), in train() below.

    python train.py --demo                                    # tiny model + synthetic task: CPU, no network, ~30 s
    python train.py --model SmolLM2-1.7B-Instruct             # the real run: GSM8K, 200 steps, one GPU
    python train.py --model DIR --data gsm8k/train.jsonl --max-new-tokens 64 --steps 3 --eval-limit 4   # CPU smoke run
    python train.py --model DIR --eval-only --eval-limit 100  # mean accuracy and format reward on the test split
    python train.py <same flags> --resume                     # continue from OUTPUT_DIR/checkpoint
    python train.py --model DIR --data my.jsonl --prompt-field prompt --answer-field answer \
        --reward-fn my_rewards:exact                          # your own task (README: Your own task)

The flags are in config.py, the math in grpo.py, generation and log-probs in sampling.py; the support code in
support/: the models (models.py), checkpoints (checkpoint.py), the progress line and metrics.jsonl (report.py).
"""

import collections
import contextlib
import dataclasses
import functools
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch
from transformers import get_scheduler, set_seed

import config
import data
import grpo
import rewards
import sampling
from support import checkpoint, decode, demo, distributed, models, report, rundir
from support.errors import UserError


def train(args, task, model, tokenizer, resume_dir=None):
    """Algorithm 1 with one outer iteration: the rewards are fixed functions, so line 12 (train the reward model)
    has nothing to do and line 3's reference stays the initial policy. Returns the evaluations [(step, {name: mean})].
    """
    # 1: π_θ ← π_θinit (on --resume, the checkpoint's weights); 3: π_ref ← π_θinit (none when β = 0).
    run = build_run(args, model, tokenizer, resume_dir)
    model, G, amp = run.model, args.num_generations, sampling.AUTOCAST_DTYPE[args.dtype]
    settings = sampling.Sampling.of(args)
    # Completions per forward/backward: whole groups.
    micro = args.micro_batch_size or args.batch_size * G
    objective = LossSettings.of(args)
    if args.compile:
        # The compiled decode's shapes, fixed for the run: at most two graphs and two KV caches.
        length = decode_length(task, tokenizer, model, settings)
        decode.plan_decode(model, decode_rows(args), length)
    report.print_header(args, model)
    # Before training (or the evaluation a crash cut short). Ctrl-C, SIGTERM, SIGHUP: see StopRequests.
    with STOPS.at_once():
        evaluate_if_due(run, task, args, run.start_step)
    times, zero_std_streak, stop, nonfinite = [], 0, False, 0
    # 4: for step = 1, ..., M
    for step in range(run.start_step, args.steps):
        t0, rng_at_start, updates = time.time(), checkpoint.rng_state(), []
        # the LR schedule steps with every applied update: whether this step changed the weights
        updates_at_start = run.scheduler.last_epoch
        try:
            # 5: sample a batch D_b from D (under torchrun, this process's share of it).
            batch = data.batch_at(task.train, prompts_per_step(args), args.seed, step)
            rows = distributed.my_share(batch)
            # 6: π_old ← π_θ. π_old is only ever used through its log-probs of the outputs of 7 (see 10).
            # q: the prompt, then any response prefix.
            prompts = [task.prompt(tokenizer, row["prompt"]) for row in rows]
            # 7: sample G outputs o_i ~ π_old(· | q) for each question q.
            rollouts = sampling.sample_rollouts(model, tokenizer, prompts, settings, G, amp)
            # 8: compute the rewards r_i of each o_i: [B*G] in all, and {name: [B*G]} per function.
            reward, per_fn = on_every_rank(task.score, rows, rollouts.texts, G, rollouts.lengths)
            # DAPO's dynamic sampling: drop groups without reward spread, sample more prompts to refill.
            dynamic = {}
            if args.dynamic_sampling:
                rows, rollouts, reward, per_fn, dynamic = fill_with_spread(
                    run, task, args, step, rows, rollouts, reward, per_fn
                )
            # No group with spread at all: no update.
            mu = 0 if dynamic.get("skipped_no_spread") else args.num_iterations
            if args.mask_truncated:
                # A completion the budget cut off gets no loss (its reward is still scored).
                rollouts.completion_mask[rollouts.truncated] = 0
            # 9: Â_i,t by group-relative advantage estimation, the same for every t of o_i: [B*G].
            advantages = grpo.group_advantages(
                distributed.gather(reward), G, scale=args.scale_rewards
            )
            advantages = distributed.my_share(advantages).to(rollouts.input_ids.device)
            # log π_ref(o_i,t | q, o_i,<t) for the KL term, from line 3's model (none when β = 0): [B*G, C].
            ref_logps = None
            if run.ref_model is not None and mu > 0:
                shared_prompt = not args.gradient_checkpointing
                ref_logps = frozen_logps(run.ref_model, rollouts, micro, amp, shared_prompt)
            # μ = 1: π_old = sg(π_θ), the ratio is exactly 1.
            old_logps = None
            # 10: for GRPO iteration = 1, ..., μ
            for iteration in range(mu):
                # 11: update π_θ by maximizing eq. 3 (one AdamW step).
                stats, logps = policy_update(
                    model,
                    run.optimizer,
                    run.scheduler,
                    rollouts,
                    advantages,
                    old_logps,
                    ref_logps,
                    objective=objective,
                    micro_batch_size=micro,
                    max_grad_norm=args.max_grad_norm,
                    amp=amp,
                    scaler=run.scaler,
                    ddp=run.ddp,
                )
                updates.append(stats)
                if old_logps is None and args.num_iterations > 1:
                    # Iteration 1 ran before any update: its log-probs are π_old's [B*G, C].
                    old_logps = logps
                nonfinite = count_nonfinite(nonfinite, stats, args.max_nonfinite)
            times.append(time.time() - t0)
            gathered = gather_for_metrics(reward, per_fn, rollouts)
            steps_left = args.steps - step - 1
            metrics = report.step_metrics(*gathered, G, updates, times, steps_left, run.scheduler)
            metrics.update(dynamic)
            log_step(run.log_path, step + 1, args, metrics, list(per_fn))
            first = task.prompt(tokenizer, rows[0]["prompt"])
            responses = task.responses(rollouts.texts)
            # the first group's G completions and rewards
            report.print_sample(args, step + 1, first, responses[:G], reward[:G], rows[0]["answer"])
            zero_std_streak, stop = count_zero_std(
                zero_std_streak, metrics["frac_zero_std"], args, step + 1
            )
            # And before every evaluation: one cut short loses no training.
            saved = save_if_due(run, task, args, step + 1, stop)
            # A signal came during this step (on any rank): stop here, at a step boundary.
            STOPS.raise_if_requested(saved)
        except (KeyboardInterrupt, UserError) as e:
            # Ctrl-C, or a run that cannot go on: keep what it learned.
            updated = run.scheduler.last_epoch != updates_at_start
            checkpoint.save_interrupted(run, args, step, updated, rng_at_start, stopped_by=e)
            raise
        if eval_due(args, task, step + 1, stop):
            with STOPS.at_once():  # training was saved just before (save_if_due)
                evaluate_if_due(run, task, args, step + 1, stop)
        if stop:
            break
    with STOPS.at_once():
        finish(run, task, args)
    return run.evals


class Stopped(KeyboardInterrupt):
    """The run stopped at a step boundary on a signal: exit code 128 + the signal's number (130 Ctrl-C, 143 SIGTERM,
    129 SIGHUP). everywhere: every rank stops at this step (they save together); saved: the step is saved already."""

    def __init__(self, signum, everywhere=False, saved=False):
        super().__init__(signal.Signals(signum).name)
        self.exit_code, self.everywhere, self.saved = 128 + signum, everywhere, saved


class StopRequests:
    """SIGINT (Ctrl-C), SIGTERM and SIGHUP (what SLURM, Kubernetes and spot instances send before they kill a job)
    during train(). Inside a step the first one is a request: the step finishes, is saved as every step boundary
    can be (so --resume continues exactly), and the run exits with 128 + the signal's number. A second one stops at
    once, as Ctrl-C always did (the step counts as done after its first update, else is redone), unless it comes
    within SAME_REQUEST_S of the first: then it is the same request. During an
    evaluation (training is saved before every one) and the closing table, a signal stops at once. main() installs
    the handlers (`with STOPS:`, main thread only, where Python runs them) and restores them after; train() called
    from your own code keeps your handlers, and a signal does what they do."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    # A second signal within this many seconds of the first is the same request delivered twice: Ctrl-C under
    # torchrun reaches each worker from the terminal and again from torchrun, which forwards the signal it gets.
    SAME_REQUEST_S = 1.0

    def __init__(self):
        self.signum, self.immediate, self.previous, self.first_at = None, False, {}, 0.0
        self.deferring, self.stop_deferred = False, None

    def __enter__(self):
        self.signum = None
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        # a request belongs to this run: train() called later, without handlers, starts clean
        self.signum, self.previous = None, {}

    def handle(self, signum, frame):
        again = self.signum is not None
        if self.immediate or (again and time.monotonic() - self.first_at > self.SAME_REQUEST_S):
            return self.stop(signum)
        if again:  # the same request delivered twice (SAME_REQUEST_S)
            return
        self.signum, self.first_at = signum, time.monotonic()
        print(
            f"\n{signal.Signals(signum).name}: finishing this step, then saving and exiting "
            "(again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def stop(self, signum):
        """Stop at once: now, or at the end of a deferred() block."""
        if self.deferring:
            self.stop_deferred = signum
        else:
            raise Stopped(signum)

    @contextlib.contextmanager
    def deferred(self):
        """A stop at once waits for the end of this block (an optimizer update: weights, AdamW and schedule)."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring, signum, self.stop_deferred = False, self.stop_deferred, None
        if signum is not None:
            raise Stopped(signum)

    @contextlib.contextmanager
    def at_once(self):
        """A signal inside this block stops at once (nothing unsaved to lose), a pending request too."""
        self.immediate = True
        try:
            if self.signum is not None:
                raise Stopped(self.signum)
            yield
        finally:
            self.immediate = False

    def raise_if_requested(self, saved):
        """At a step's end: Stopped if a signal came on any rank (one all-reduce under torchrun)."""
        if distributed.all_sum([self.signum is not None])[0] > 0:
            raise Stopped(self.signum or signal.SIGTERM, everywhere=True, saved=saved)


STOPS = StopRequests()


class OutlivesItsReader:
    """stdout or stderr that outlives whoever reads it. When an ssh session drops, the terminal hangs up: SIGHUP,
    then every write fails with EIO. When `python train.py | head` has its lines, every write fails with EPIPE. A
    failing print would end the run with a traceback and no save. Instead, from the first failed write on, the
    output goes to /dev/null and training goes on: metrics.jsonl, the checkpoints and the exit code record it all.
    Installed by `python train.py` only, never by main() called from your code."""

    def __init__(self, stream):
        self.stream, self.gone = stream, False

    def write(self, text):
        try:
            return len(text) if self.gone else self.stream.write(text)
        except OSError:
            self.lost()
            return len(text)

    def flush(self):
        try:
            if not self.gone:
                self.stream.flush()
        except OSError:
            self.lost()

    def lost(self):
        """Point the stream's file descriptor at /dev/null: its buffered text, and everything after it, goes there
        (interpreter exit flushes it too, and would otherwise fail with exit code 120)."""
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
            self.stream.flush()
        except OSError:  # no file descriptor to point elsewhere: drop what comes
            self.gone = True

    def __getattr__(self, name):  # fileno, isatty, encoding, ...
        return getattr(self.stream, name)


class EveryRankError(UserError):
    """A reward error on one rank (under torchrun), raised on every rank at the same point, so that they all save
    the step's start together (checkpoint.save_interrupted: `everywhere`) instead of waiting for one another."""

    everywhere = True


def on_every_rank(score, *args):
    """score(*args), where a UserError (a reward function that raised, hung or returned NaN) on any rank stops every
    rank here: one all-reduce under torchrun, nothing alone."""
    error = None
    try:
        result = score(*args)
    except UserError as e:
        error = e
    if distributed.all_sum([error is not None])[0] > 0:
        raise EveryRankError(
            str(error) if error else "a reward function failed in another process (see its error)"
        )
    return result


def prompts_per_step(args):
    """A step's prompts over all ranks (under torchrun each takes its share)."""
    return distributed.world() * args.batch_size * args.gradient_accumulation_steps


def decode_rows(args):
    """The rows of this process's generate calls: a training step's (its share of the prompts x G) and an evaluation
    batch's (questions x samples; a last, smaller batch is padded up to it when compiled)."""
    return [
        prompts_per_step(args) // distributed.world() * args.num_generations,
        args.eval_batch_size * args.eval_samples,
    ]


def decode_length(task, tokenizer, model, settings):
    """The KV cache length every decode call of the run fits in: its longest prompt, then max_new_tokens."""
    return (
        longest_prompt(task, tokenizer, sampling.prompt_limit(model, settings))
        + settings.max_new_tokens
    )


def longest_prompt(task, tokenizer, limit):
    """The most tokens any prompt of the run has, training and held-out rows, at most `limit` (where they are cut)."""
    prompts = [task.prompt(tokenizer, row["prompt"]) for row in task.train + task.eval]
    longest = max(tokenizer(prompts, add_special_tokens=False, return_length=True)["length"])
    return longest if limit is None else min(longest, limit)


def finish(run, task, args):
    """The closing before/after table, the trackers closed (--report-to), and curves.png."""
    if len(run.evals) > 1:
        report.print_eval_table(run.evals, len(task.eval[: args.eval_limit]), args)
    report.close_log(run.log_path)
    if distributed.is_main():
        report.curves(args.output_dir)


def gather_for_metrics(reward, per_fn, rollouts):
    """The step's rewards [N], per-function rewards and completion lengths and truncation flags [N], gathered from
    every rank (under torchrun), for the logged metrics."""
    gather = distributed.gather
    return (
        gather(reward),
        {name: gather(r) for name, r in per_fn.items()},
        gather(rollouts.lengths),
        gather(rollouts.truncated),
    )


def log_step(path, step, args, metrics, reward_names):
    if distributed.is_main():  # one metrics.jsonl
        report.log_step(path, step, args, metrics, reward_names)


@dataclass(frozen=True)
class LossSettings:
    """Eq. 3's settings: grpo.grpo_loss's keywords."""

    epsilon: float
    epsilon_high: float | None  # DAPO's clip-higher; None: epsilon
    beta: float
    loss_type: str  # grpo | dapo | dr_grpo
    ratio_level: str  # token | sequence (GSPO)
    max_tokens: int  # the generation budget: Dr. GRPO's constant
    delta: float | None  # dual clip: the ratio's cap where the advantage is negative; None: off

    @classmethod
    def of(cls, args):
        return cls(
            args.epsilon,
            args.epsilon_high,
            args.beta,
            args.loss_type,
            args.ratio_level,
            args.max_new_tokens,
            args.delta,
        )


# ----------------------------------------------------------------------------------------------------------------------
# The run: what train() builds before its first step.


@dataclass
class Run:
    """What the loop carries from step to step."""

    model: torch.nn.Module  # π_θ, fp32, on the device
    ref_model: torch.nn.Module | None  # π_ref, frozen (None when β = 0)
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: object  # fp16's GradScaler, else None
    start_step: int
    log_path: str  # OUTPUT_DIR/metrics.jsonl
    evals: list  # [(step, {reward name: mean})]
    peft: object = None  # --lora-rank: the PeftModel around `model` (saves the adapter), else None
    ddp: object = None  # under torchrun: DistributedDataParallel around the log-prob forward


def build_run(args, model, tokenizer, resume_dir=None):
    """Everything the loop needs, built in reading order: π_θ on the device (Algorithm 1's line 1: π_θinit, or on
    --resume the checkpoint's weights), π_ref = π_θinit (line 3), gradient checkpointing, torch.compile, FSDP2 or
    DDP under torchrun, AdamW, its LR schedule, fp16's loss scaler; then a resumed run's state and its log."""
    peft_model = None
    # π_θ = π_θinit + adapters; π_ref = π_θinit: the same model with its adapters off, no copy
    if args.lora_rank:
        peft_model = models.add_lora(model.to(args.device), args, resume_dir)
        model, ref_model = peft_model.get_base_model(), peft_model if args.beta > 0 else None
    else:
        ref_model = models.reference_model(
            model,
            args.beta,
            sampling.AUTOCAST_DTYPE[args.dtype],
            args.device,
            copy_model=resume_dir is None,
        )
    if (
        resume_dir is not None
        and not args.lora_rank
        and not checkpoint.policy_loaded_from_checkpoint(args, resume_dir)
    ):
        model = checkpoint.load_policy(resume_dir, model, args)
    if (
        not args.dropout
    ):  # the same network for π_old and π_θ (π_ref runs in eval mode: no dropout either)
        models.disable_dropout(model)
    model.to(args.device)
    if args.gradient_checkpointing:
        sampling.enable_gradient_checkpointing(model)
    if args.compile:  # the decode step and the log-prob forwards of π_θ (and π_ref's)
        for m in {id(m): m for m in (model, ref_model) if m is not None}.values():
            sampling.compile_model(m, args.compile)
    model.train()
    if args.fsdp:  # under torchrun: shard π_θ and π_ref over the ranks instead of replicating them
        distributed.shard_model(model)
        if ref_model is not None and ref_model is not model:
            distributed.shard_model(ref_model)
    # torchrun: DDP (it broadcasts rank 0's weights)
    ddp = None if args.fsdp else distributed.wrap(model)
    optimizer = build_optimizer(model, args.lr, args.weight_decay)
    scheduler = get_scheduler(
        args.lr_scheduler,
        optimizer,
        num_warmup_steps=args.warmup_steps,
        num_training_steps=args.steps * args.num_iterations,
    )
    # fp16 autocast needs loss scaling; bf16 and fp32 do not.
    scaler = (
        torch.amp.GradScaler("cuda") if args.dtype == "fp16" and args.device == "cuda" else None
    )
    if resume_dir is None and distributed.world() > 1:
        # each rank samples its own completions
        torch.manual_seed(args.seed + 1000 * distributed.rank())
    step = (
        0
        if resume_dir is None
        else checkpoint.restore(resume_dir, args, optimizer, scheduler, scaler)
    )
    # metrics.jsonl, and the trackers of --report-to
    log_path, evals = report.open_log(
        args.output_dir, step if resume_dir is not None else None, args
    )
    return Run(
        model,
        ref_model,
        tokenizer,
        optimizer,
        scheduler,
        scaler,
        step,
        log_path,
        evals,
        peft_model,
        ddp,
    )


def build_optimizer(model, lr, weight_decay):
    """AdamW on the fp32 parameters, fused (one kernel over all parameters) where torch has it: CUDA, and CPU."""
    # all of them, or LoRA's adapters only
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


# ----------------------------------------------------------------------------------------------------------------------
# Line 11 and the log-probs it needs.


def policy_update(
    model,
    optimizer,
    scheduler,
    rollouts,
    advantages,
    old_logps,
    ref_logps,
    *,
    objective,
    micro_batch_size,
    max_grad_norm=1.0,
    amp=None,
    scaler=None,
    ddp=None,
):
    """One optimizer update of π_θ maximizing eq. 3 on the rollouts: forward + backward over micro-batches of whole
    groups, each loss divided by the whole batch's denominator so the gradients add up to the full batch's; then
    clip, AdamW, the LR schedule. old_logps, ref_logps [N, C]: π_old's (None when μ = 1) and π_ref's (None when
    β = 0). Returns the update's statistics and the log-probs its forwards computed before the update [N, C],
    detached (0 after each micro-batch's longest completion).
    Under torchrun (ddp: the DistributedDataParallel log-prob module) the batch is every rank's: the denominator
    counts all ranks' sequences or tokens, each rank's loss is multiplied by the number of ranks (DDP averages the
    gradients: the average of world x sum_r / denominator is the global loss's gradient), and the gradients are
    all-reduced once, in the last micro-batch's backward."""
    model.train()
    mask = rollouts.completion_mask  # [N, C]
    normalizer = distributed.all_sum(
        [grpo.loss_denominator(mask, objective.loss_type, objective.max_tokens)]
    )[0]
    logprobs = ddp or functools.partial(sampling.token_logprobs, model)
    lr = scheduler.get_last_lr()[0]
    totals = dict(loss=0.0, tokens=0, kl=0.0, clipped=0, ratio=0.0, entropy=0.0)
    logps_before = torch.zeros(mask.shape, device=mask.device)  # [N, C]
    optimizer.zero_grad(set_to_none=True)
    batches = micro_batches(mask.shape[0], micro_batch_size)
    for i, rows in enumerate(batches):
        ids, attn, keep = micro_batch_inputs(rollouts, rows)
        no_sync = (
            ddp.no_sync() if ddp is not None and i < len(batches) - 1 else contextlib.nullcontext()
        )
        # FSDP2: reduce-scatter in the last micro-batch only
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(i == len(batches) - 1)
        # DDP: all-reduce in the last micro-batch's backward only
        with (
            sampling.autocast(ids.device, amp),
            no_sync,
        ):
            # [n, keep]: with grad, without
            logps, entropy = logprobs(
                ids, attn, keep, rollouts.temperature, entropy=True, group_size=rollouts.group_size
            )
            logps_before[rows, :keep] = logps.detach()
            totals["entropy"] += (entropy * mask[rows, :keep]).sum().item()
            old = None if old_logps is None else old_logps[rows, :keep]
            ref = None if ref_logps is None else ref_logps[rows, :keep]
            stats = {}
            loss = grpo.grpo_loss(
                logps,
                old,
                ref,
                advantages[rows],
                mask[rows, :keep],
                normalizer=normalizer,
                stats=stats,
                **dataclasses.asdict(objective),
            )
            # DDP averages over ranks; no division by the number of micro-batches
            scaled = loss * distributed.world()
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        totals["loss"] += loss.item()
        for k in ("tokens", "kl", "clipped", "ratio"):
            totals[k] += stats[k]
    totals = dict(zip(totals, distributed.all_sum(totals.values())))  # every rank's sums
    grad_norm, skipped = optimizer_step(
        model, optimizer, scheduler, scaler, max_grad_norm, totals["loss"]
    )
    # freed now: no generation or evaluation holds the gradients
    optimizer.zero_grad(set_to_none=True)
    tokens = max(totals["tokens"], 1)
    return dict(
        loss=totals["loss"],
        kl=totals["kl"] / tokens,
        clip_frac=totals["clipped"] / tokens,
        ratio=totals["ratio"] / tokens,
        entropy=totals["entropy"] / tokens,
        grad_norm=float(grad_norm),
        lr=lr,
        skipped=skipped,
    ), logps_before


def fill_with_spread(run, task, args, step, rows, rollouts, reward, per_fn):
    """DAPO's dynamic sampling (arXiv 2503.14476, §3.2): a group whose rewards are all equal has advantage 0 and
    teaches nothing. Drop those groups and sample more prompts (data.batch_at's stream k for the k-th extra call: a
    pure function of seed and step, so resume stays exact) until the step holds batch-size x
    gradient-accumulation-steps groups with spread, or --max-resample extra generate calls have run. Returns the
    kept groups' rows, rollouts, rewards and per-function rewards, and what to log; with no group with spread at
    all, the first call's batch and skipped_no_spread=1 (the loop then makes no update)."""
    G, want, amp = (
        args.num_generations,
        args.batch_size * args.gradient_accumulation_steps,
        sampling.AUTOCAST_DTYPE[args.dtype],
    )
    settings, parts, calls = sampling.Sampling.of(args), [(rows, rollouts, reward, per_fn)], 1

    def spread(part):  # the groups of a part whose rewards differ
        groups = part[2].view(-1, G)
        return [g for g in range(len(groups)) if not bool((groups[g] == groups[g, 0]).all())]

    while sum(len(spread(p)) for p in parts) < want and calls <= args.max_resample:
        more = data.batch_at(task.train, want, args.seed, step, stream=calls)
        extra = sampling.sample_rollouts(
            run.model,
            run.tokenizer,
            [task.prompt(run.tokenizer, r["prompt"]) for r in more],
            settings,
            G,
            amp,
        )
        parts.append((more, extra, *task.score(more, extra.texts, G, extra.lengths)))
        calls += 1
    kept = [(p, g) for p in parts for g in spread(p)][:want]
    log = dict(
        dynamic_dropped=sum(len(p[0]) - len(spread(p)) for p in parts),
        dynamic_calls=calls,
        dynamic_groups=len(kept),
        skipped_no_spread=int(not kept),
    )
    if not kept:
        return rows, rollouts, reward, per_fn, log
    rollouts = sampling.concat_rollouts([sampling.select_groups(p[1], [g]) for p, g in kept])
    rows = [p[0][g] for p, g in kept]
    reward = torch.cat([p[2].view(-1, G)[g] for p, g in kept])
    per_fn = {name: torch.cat([p[3][name].view(-1, G)[g] for p, g in kept]) for name in per_fn}
    return rows, rollouts, reward, per_fn, log


def count_zero_std(streak, frac_zero_std, args, done):
    """Steps in a row with no reward spread in any group, and whether --stop-when-zero-std ends the run at `done`."""
    streak = streak + 1 if frac_zero_std == 1 else 0
    stop = 0 < args.stop_when_zero_std <= streak and done < args.steps
    if stop:
        print(
            f"stopping after step {done}: {streak} steps in a row had no reward spread in any group "
            "(--stop-when-zero-std); docs/results.md: what to do then.",
            flush=True,
        )
    return streak, stop


def count_nonfinite(streak, stats, limit):
    """Updates in a row skipped for a non-finite loss or gradient; at `limit` a UserError, and train() saves the
    weights, the last good ones (skipped updates change nothing)."""
    streak = streak + 1 if (stats["skipped"] or "").startswith("non-finite") else 0
    if streak >= limit:
        raise UserError(
            f"{streak} optimizer updates in a row were skipped ({stats['skipped']}; --max-nonfinite "
            f"{limit}). The weights are the last good ones and are saved in the output directory. "
            "Check the rewards and the data, lower --lr, or use --dtype bf16/fp32 instead of fp16."
        )
    return streak


def optimizer_step(model, optimizer, scheduler, scaler, max_grad_norm, loss=0.0):
    """Clip the global gradient norm (returned as it was before clipping; max_grad_norm 0: no clipping), step AdamW (through fp16's loss scaler
    when there is one) and the LR schedule. A non-finite loss or gradient norm skips the update instead, so no NaN
    reaches the weights: weights, AdamW state and schedule stay as they were (fp16's scaler lowers its scale, as it
    does on any overflow). Returns (grad norm, why the update was skipped or None)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    # --max-grad-norm 0: no clipping (as HF Trainer reads it); the norm is still measured
    limit = max_grad_norm if max_grad_norm > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
    # the next policy_update zeroes the gradients first
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        if scaler is not None:
            scaler.update()
        if not math.isfinite(loss):
            return grad_norm, "non-finite loss"
        return grad_norm, "fp16 overflow" if scaler is not None else "non-finite gradient norm"
    # The weights, AdamW and the schedule move together: a second signal waits for all three (train: the schedule's
    # count says whether a step interrupted there had changed the weights).
    with STOPS.deferred():
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
    # What the checks above cannot see (a clipping or optimizer fault turning finite gradients into NaN weights)
    # stops the run here: the update cannot be undone, and nothing non-finite is ever saved.
    bad, anywhere = checkpoint.nonfinite_weights(model, trainable_only=True)
    if anywhere:
        raise checkpoint.NonFiniteWeights(
            "an optimizer update made the weights non-finite (NaN or inf"
            + (f" in {', '.join(bad[:3])}" if bad else " on another rank")
            + f") although its loss and gradient norm were finite (gradient norm {float(grad_norm):.4g}). Nothing "
            "was saved over the last checkpoint in the output directory: --resume continues from it. Check --lr, "
            "--weight-decay and --max-grad-norm."
        )
    return grad_norm, None


@torch.no_grad()
def frozen_logps(model, rollouts, micro_batch_size, amp=None, shared_prompt=True):
    """log π(o_t | q, o_<t) [N, C] of the rollouts under a frozen model, in micro-batches of whole groups; 0 after
    each micro-batch's longest completion. shared_prompt=False takes token_logprobs' plain path, as the policy's
    forward does under gradient checkpointing: π_ref and π_θ then come from the same computation. A PeftModel (LoRA)
    is π_ref with its adapters off: the base model, no second copy."""
    adapters_off = getattr(model, "disable_adapter", contextlib.nullcontext)
    net = model.get_base_model() if hasattr(model, "get_base_model") else model
    was_training = net.training
    net.eval()
    N, C = rollouts.completion_mask.shape
    out = torch.zeros(N, C, device=rollouts.completion_mask.device)
    for rows in micro_batches(N, micro_batch_size):
        ids, attn, keep = micro_batch_inputs(rollouts, rows)
        with sampling.autocast(ids.device, amp), adapters_off():
            out[rows, :keep] = sampling.token_logprobs(
                net,
                ids,
                attn,
                keep,
                rollouts.temperature,
                group_size=rollouts.group_size if shared_prompt else 1,
            )
    net.train(was_training)
    return out


def micro_batches(n, size):
    """Row slices of `size` rows (whole groups: size is a multiple of G)."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def micro_batch_inputs(rollouts, rows):
    """One micro-batch's ids and attention mask without the columns none of its rows needs: leading prompt padding
    (position ids come from the mask, so dropping all-pad columns changes nothing) and the completion columns after
    its longest completion. Returns (ids, mask, completion columns kept)."""
    ids, attn, mask = (
        rollouts.input_ids[rows],
        rollouts.attention_mask[rows],
        rollouts.completion_mask[rows],
    )
    P = rollouts.prompt_length
    first = int(attn[:, :P].any(0).nonzero()[0]) if attn[:, :P].any() else P - 1
    keep = max(1, int(mask.sum(1).max()))
    return ids[:, first : P + keep], attn[:, first : P + keep], keep


# ----------------------------------------------------------------------------------------------------------------------
# Evaluation on held-out questions.


def evaluate(model, tokenizer, task, settings, samples, limit=None, batch_size=8, seed=0, amp=None):
    """On the first `limit` held-out questions, `samples` (k) completions each: the mean of each reward function and
    of the weighted total ("reward") over all completions, and with k > 1 each one's pass@k: a question's best of its
    k rewards, averaged over questions (for a 0/1 reward such as correctness, the fraction solved at least once).
    Runs under its own RNG seeded with `seed`, so it neither perturbs nor depends on the training RNG stream. Under
    torchrun each rank takes every world-th question (its RNG seeded with seed + rank) and the tables are gathered."""
    every, chunks, t0 = task.eval[:limit], [], time.time()
    rows = every[distributed.rank() :: distributed.world()]
    if (
        len(rows) > batch_size and distributed.is_main()
    ):  # a long one says so before its first batch
        print(f"  eval: {len(every)} questions x {samples} samples ...", flush=True)
    device = next(model.parameters()).device
    with torch.random.fork_rng(
        devices=[torch.cuda.current_device()] if device.type == "cuda" else []
    ):
        torch.manual_seed(seed + distributed.rank())
        # as many calls on every rank
        for i in range(0, -(-len(every) // distributed.world()), batch_size):
            chunk = rows[i : i + batch_size]
            if not chunk and not decode.is_sharded(model):
                break
            # FSDP2: join in
            prompts = [task.prompt(tokenizer, row["prompt"]) for row in chunk or every[:1]]
            rollouts = sampling.sample_rollouts(model, tokenizer, prompts, settings, samples, amp)
            if chunk:
                total, per_fn = task.score(chunk, rollouts.texts, samples, rollouts.lengths)
                chunks.append({**per_fn, "reward": total})
                if task.extract_answer is not None and samples > 1:
                    # each question's representative completion for maj@k: [questions]
                    chunks[-1][MAJORITY] = majority_choices(
                        task, task.responses(rollouts.texts), samples
                    )
            if (
                len(rows) > batch_size and distributed.is_main()
            ):  # a progress line per generate call
                report.print_eval_progress(i + len(chunk), len(rows), time.time() - t0)
    # every rank's
    chunks = [
        c
        for part in distributed.gather_objects([{k: v.cpu() for k, v in c.items()} for c in chunks])
        for c in part
    ]
    if not chunks:
        return {}  # no questions
    # [Q, k]
    table = {
        name: torch.cat([c[name] for c in chunks]).view(len(every), samples) for name in chunks[0]
    }
    choice = table.pop(MAJORITY, None)  # [Q, k]: each row its index k times
    result = {name: r.mean().item() for name, r in table.items()}
    if samples > 1:
        result.update(
            {f"{name}_pass@{samples}": r.max(1).values.mean().item() for name, r in table.items()}
        )
    if choice is not None:
        result.update(
            {
                f"{name}_maj@{samples}": r.gather(1, choice[:, :1]).mean().item()
                for name, r in table.items()
            }
        )
    return result


MAJORITY = "__majority__"  # evaluate's table: each question's maj@k completion


def majority_choices(task, responses, k):
    """For each question (k responses each, in order): the index of the response that stands for the answer most of
    them give (maj@k, DeepSeekMath §5.2.2): [questions * k] long, each question's index k times. Answers come from task.extract_answer; a response
    without one (None) does not vote. A tie goes to the answer given first; a question where no response gives an
    answer is represented by its first response. maj@k of a reward is then that response's reward."""
    answers = [extract(task.extract_answer, r) for r in responses]
    # k copies per question, as the rewards are laid out
    return torch.tensor(
        [majority_index(answers[i : i + k]) for i in range(0, len(answers), k)]
    ).repeat_interleave(k)


def majority_index(answers):
    """The index of the first of `answers` (strings or None) that is the most frequent non-None answer: ["7", None,
    "8", "8", "7"] -> 0 (7 and 8 tie at two, 7 came first); [None, None] -> 0."""
    counts = collections.Counter(a for a in answers if a is not None)
    if not counts:
        return 0
    most = max(counts.values())
    return next(i for i, a in enumerate(answers) if a is not None and counts[a] == most)


def extract(fn, response):
    """fn(response) as a string, or None; a function that raises is the user's error, said in one line."""
    try:
        answer = fn(response)
    except Exception as e:
        raise UserError(
            f"--extract-answer: {getattr(fn, '__name__', fn)} raised {type(e).__name__}: {e} on the "
            f"completion {response[:200]!r}. It must return the answer as a string, or None."
        ) from None
    return None if answer is None else str(answer)


def eval_due(args, task, step, last=False):
    """Evaluations run before training, every --eval-every steps and at the end (the last step, or `last`: a step
    that ends the run early); --eval-every -1: never."""
    periodic = args.eval_every > 0 and step % args.eval_every == 0
    return (
        args.eval_every >= 0
        and len(task.eval) > 0
        and (step in (0, args.steps) or last or periodic)
    )


def evaluate_if_due(run, task, args, step, last=False):
    """The evaluation of `step` if one is due and not logged yet (a resumed run may have logged it)."""
    if not eval_due(args, task, step, last) or step in dict(run.evals):
        return
    result = evaluate_as_flagged(run.model, run.tokenizer, task, args)
    run.evals.append((step, result))
    print(
        f"eval @ step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()), flush=True
    )
    if distributed.is_main():
        report.write_log(
            run.log_path, {"step": step, **{f"eval/{k}": v for k, v in result.items()}}
        )


def evaluate_as_flagged(model, tokenizer, task, args):
    """evaluate() with the --eval-* flags."""
    settings = sampling.Sampling(
        args.eval_temperature, args.top_k, args.top_p, args.max_new_tokens, args.max_prompt_length
    )
    return evaluate(
        model,
        tokenizer,
        task,
        settings,
        args.eval_samples,
        args.eval_limit,
        args.eval_batch_size,
        args.seed if args.eval_seed is None else args.eval_seed,
        sampling.AUTOCAST_DTYPE[args.dtype],
    )


def save_if_due(run, task, args, done, last=False):
    """A checkpoint after step `done` every --save-every steps, after the last step (or `last`: one that ends the run
    early), and before every evaluation, so that a crash or Ctrl-C inside an evaluation loses no training."""
    periodic = args.save_every > 0 and done % args.save_every == 0
    if periodic or done == args.steps or last or eval_due(args, task, done):
        # the run's last save when a signal asked it to stop: LoRA's merged model too
        final = last or STOPS.signum is not None
        checkpoint.save_run(run, args, done, checkpoint.rng_state(), final=final)
        return True
    return False


# ----------------------------------------------------------------------------------------------------------------------
# The command line: the task and π_θinit (build_run builds the rest of a run from them).


def setup(args, resume_dir=None):
    """The task, π_θinit and its tokenizer. The data and the rewards load first: a bad file or reward function fails in
    a second, not after loading a 1.7B model. Resuming with β = 0 loads the checkpoint: no reference model needs the
    initial weights."""
    set_seed(args.seed)
    if args.demo:
        model, tokenizer, task = demo.setup(
            args.seed, args.demo_warmup_steps, args.demo_target_accuracy
        )
    else:
        task = data.task_from_flags(args)  # GSM8K, or your JSONL with --prompt-field/--answer-field
    # the task's own rewards, which --reward-fn replaces
    named = [(r.name, r.fn) for r in task.rewards]
    task = dataclasses.replace(
        task,
        response_prefix=args.response_prefix,
        rewards=rewards.from_flags(args, named, task.field_names),
        extract_answer=task.extract_answer
        if args.extract_answer is None
        else rewards.load_reward_fn(
            args.extract_answer, "--extract-answer", rewards.ANSWER_EXTRACTORS
        )[1],
    )
    if not args.eval_only and args.steps > 0 and len(task.train) < prompts_per_step(args):
        raise UserError(
            f"a step takes {prompts_per_step(args)} prompts (batch-size x gradient-accumulation-steps"
            + (" x processes" if distributed.world() > 1 else "")
            + f"), but the training data has "
            f"{len(task.train)} rows. Lower --batch-size or --gradient-accumulation-steps, or add rows."
        )
    # --eval-only --resume evaluates the checkpoint: load it in place of --model (LoRA: --model, then its adapter)
    from_checkpoint = checkpoint.policy_loaded_from_checkpoint(args, resume_dir) or (
        args.eval_only and resume_dir is not None and not args.lora_rank
    )
    fits = functools.partial(models.check_context, args.max_new_tokens, args.max_prompt_length)
    if args.demo:
        fits(model.config, "the demo's model")
    else:
        name = resume_dir if from_checkpoint else args.model
        model, tokenizer = models.load_model(name, args.trust_remote_code, check_config=fits)
    return task, model, tokenizer


def main(argv=None):
    """The command line: flags, then the task and model, then train() (or one evaluation with --eval-only). Bad input
    and running out of memory (CUDA or the CPU's) end with one paragraph on stderr and exit code 2, not a traceback."""
    try:
        args = config.parse_args(argv)
        distributed.init(args.device)  # under torchrun: join the process group; alone, nothing
        # saved with a checkpoint: --resume must use as many processes
        args.world_size = distributed.world()
        if args.world_size > 1 and args.dynamic_sampling:
            raise UserError(
                "--dynamic-sampling does not run under torchrun yet: ranks would refill their batches "
                "with different numbers of generate calls and micro-batches. Run it in one process."
            )
        if args.fsdp and args.world_size == 1:
            raise UserError(
                "--fsdp shards the model over processes: start it with torchrun --nproc-per-node N."
            )
        if args.fsdp and (args.resume or args.lora_rank):
            raise UserError(
                "--fsdp cannot --resume yet (its checkpoints hold the weights, not the sharded AdamW "
                "state) nor train LoRA adapters; use DDP (no --fsdp) for those."
            )
        if args.plot is not None:
            if not os.path.isfile(os.path.join(args.plot, "metrics.jsonl")):
                raise UserError(
                    f"--plot {args.plot}: there is no metrics.jsonl in it. Pass a run's --output-dir."
                )
            return report.curves(args.plot)
        # --eval-only --resume: evaluate the checkpoint's policy
        resume_dir = checkpoint.find_last(args.output_dir) if args.resume else None
        if args.resume and resume_dir is None:
            raise UserError(
                f"--resume: no checkpoint in {args.output_dir} (expected {args.output_dir}/checkpoint "
                "with training_state.pt). Pass the --output-dir of the run to continue, or drop --resume."
            )
        if args.eval_only and resume_dir is not None and not args.lora_rank:
            check_whole_model(resume_dir)
        # Before the model loads: one run per output directory, locked while it is live (--eval-only: no claim).
        with rundir.claim_output_dir(args):
            task, model, tokenizer = setup(args, resume_dir)
            if not args.eval_only:
                with STOPS:  # Ctrl-C, SIGTERM, SIGHUP: a step finishes and is saved first
                    return train(args, task, model, tokenizer, resume_dir)
        if resume_dir is not None:
            model = checkpoint_policy(model, args, resume_dir)
            print(f"evaluating the policy in {resume_dir}")
        result = evaluate_as_flagged(model.to(args.device), tokenizer, task, args)
        print(
            f"eval on {len(task.eval[: args.eval_limit])} questions x {args.eval_samples} samples: "
            + ", ".join(f"{k} {v:.4f}" for k, v in result.items())
        )
        return result
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        device = "CUDA" if isinstance(e, torch.OutOfMemoryError) else "the CPU (RAM)"
        print(
            f"error: {device} ran out of memory. Lower the memory per forward/backward with --micro-batch-size (in "
            "completions, a multiple of --num-generations; e.g. the group size alone), turn on "
            "--gradient-checkpointing, or lower --max-new-tokens / --num-generations / --eval-batch-size. "
            "The last checkpoint (if any) is in the output directory: add --resume to continue from it (without "
            "one, --overwrite to start over).",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def out_of_memory(e):
    """Whether an exception is an allocation failing: CUDA's OutOfMemoryError, Python's MemoryError, or the
    RuntimeError torch's CPU allocator raises ("DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(e)


def check_whole_model(resume_dir):
    """--eval-only --resume without --lora-rank needs a whole model in the checkpoint: a LoRA run's periodic
    checkpoints hold its adapter only (its last one holds the merged model too)."""
    if os.path.isdir(os.path.join(resume_dir, "adapter")) and not os.path.isfile(
        os.path.join(resume_dir, "config.json")
    ):
        raise UserError(
            f"--eval-only --resume: {resume_dir} holds a LoRA adapter, not a whole model (a --lora-rank run's "
            "checkpoint before its last). Pass the run's --lora-rank (and its other --lora-* flags) to evaluate "
            "--model with the adapter on."
        )


def checkpoint_policy(model, args, resume_dir):
    """--eval-only --resume: π_θ as the checkpoint holds it. With --lora-rank, --model with the checkpoint's adapter
    on, as in training (not merged: merging an adapter on a tied lm-head would change the input embedding too); else
    the checkpoint's own weights (setup loaded them already, except for the demo's model, which it builds in code)."""
    if args.lora_rank:
        return models.add_lora(model, args, resume_dir).get_base_model()
    if args.demo:
        return checkpoint.load_policy(resume_dir, model, args)
    return model


if __name__ == "__main__":
    sys.stdout, sys.stderr = OutlivesItsReader(sys.stdout), OutlivesItsReader(sys.stderr)
    try:
        main()
    except KeyboardInterrupt as e:  # 130 for Ctrl-C; a signal's 128 + its number (train.Stopped)
        raise SystemExit(getattr(e, "exit_code", 130)) from None

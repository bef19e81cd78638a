"""GRPO, the training loop: Algorithm 1 of DeepSeekMath (arXiv 2402.03300), in train() below.

    python trainer.py --demo                       # tiny model, synthetic task: CPU, offline, ~30 s
    python trainer.py --model SmolLM2-1.7B-Instruct  # the real run: GSM8K, 200 steps, one GPU
    python trainer.py --model DIR --eval-only --eval-limit 100  # held-out accuracy and format
    python trainer.py <same flags> --resume          # continue from OUTPUT_DIR/checkpoint
    python trainer.py --model DIR --data my.jsonl --prompt-field prompt --answer-field answer \\
        --reward-fn my_rewards:exact               # your own task (README: Your own task)

The flags are in config.py, the math in grpo.py, generation and log-probs in sampling.py; the
support code in support/ (models, checkpoints, the log, evaluation, signals).
"""

import contextlib
import dataclasses
import functools
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

# Under torchrun, the first rank to exit makes torchrun SIGTERM the others. A flag error is every
# rank's: SIGTERM waits until this rank has read its flags (main), so one still importing torch is
# not stopped before it can say so and exit with 2 (exit_every_rank_alike).
# (WORLD_SIZE read as support/distributed.launched_world reads it, which imports torch.)
if __name__ == "__main__" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

import torch
from transformers import get_scheduler, set_seed

import config
import data
import evaluation
import grpo
import process_supervision
import rewards
import sampling
import tools
from sampling import frozen_logps, micro_batch_inputs, micro_batches
from support import checkpoint, decode, demo, distributed, memory, models, report, rundir
from support.errors import NonFiniteWeights, RewardFailedSomewhere, UserError, WriteFailed
from support.phases import NO_PHASES
from support.signals import STOPS
from support.worker import Worker
from train import DevNullWhenReaderGone

# the sums policy_weights adds to grpo_loss's (grpo.STATS)
OPTION_STATS = ("entropy_dropped", "sequences", "off_policy", "dppo_dropped")


def train(args, task, model, tokenizer, resume_dir=None, phases=NO_PHASES):
    """Algorithm 1: the rewards are fixed functions, so line 12 (train the reward model) has
    nothing to do; line 3's reference stays the initial policy, or with --ref-update-every K is
    reset to π_θ every K steps (line 2's outer loop). Returns the evaluations [(step, {name:
    mean})]. `phases`: a timing hook (support/phases.py)."""
    # 1: π_θ ← π_θinit (on --resume, the checkpoint's weights); 3: π_ref ← π_θinit (none if β = 0).
    with build_run(args, task, model, tokenizer, resume_dir, phases) as run:
        s, model, G = run.settings, run.model, run.settings.group_size
        report.print_header(args, model)
        report.print_data(task, s.eval.limit)
        # Before training (or the evaluation a crash cut short). Signals: support/signals.py.
        with STOPS.at_once(evaluation_at(run.start_step)):
            evaluate_if_due(run, task, run.start_step)
        # 4: for step = 1, ..., M
        for step in range(run.start_step, args.steps):
            with saved_if_stopped(run, task, step):
                with phases.phase("step", step + 1):
                    # 5: sample a batch D_b from D (under torchrun, this process's share of it).
                    batch = data.batch_at(task.train, s.prompts_per_step, s.seed, step)
                    rows = distributed.my_share(batch)
                    # 6: π_old ← π_θ. π_old is only used through its log-probs of 7's outputs.
                    # q: the prompt, then any response prefix.
                    prompts = [task.prompt(tokenizer, row["prompt"]) for row in rows]
                    # 7: sample G outputs o_i ~ π_old(· | q) for each question q.
                    with phases.phase("generate"):
                        rollouts = sampling.sample_rollouts(
                            model, tokenizer, prompts, s.sampling, G, s.autocast_dtype, task.tools, rows
                        )  # fmt: skip
                    # 8: the rewards r_i of each o_i: [B*G], and {name: [B*G]} per function.
                    with phases.phase("rewards"):
                        reward, per_fn, steps = score_or_fail_everywhere(task, rows, rollouts)
                    # DAPO's dynamic sampling: drop groups without reward spread, sample more.
                    scored, dynamic = (rows, rollouts, reward, per_fn), {}
                    if s.dynamic_sampling:
                        scored, dynamic = dynamic_sampling(run, task, step, scored)
                    rows, rollouts, reward, per_fn = scored
                    # No group with spread at all: no update.
                    mu = 0 if dynamic.get("skipped_no_spread") else s.num_iterations
                    if s.mask_truncated:
                        # A completion the budget cut off gets no loss (its reward still counts).
                        rollouts.completion_mask[rollouts.truncated] = 0
                    # log π_ref(o_i,t | q, o_i,<t) for the KL term (none when β = 0): [B*G, C].
                    ref_logps = reference_logps(run, rollouts) if mu > 0 else None
                    # --kl-in-reward: r_i - β Σ_t log(π_θ/π_ref) (k1), its KL logged with the step.
                    penalized = reward_with_kl(run, rollouts, reward, ref_logps, dynamic)
                    # 9: Â_i,t by group-relative advantage estimation (outcome or process).
                    advantages = advantages_of(run, task, rollouts, penalized, per_fn, steps)
                    # μ = 1: π_old = sg(π_θ), the ratio is exactly 1.
                    old_logps, updates = None, []
                    run.step_log = (scored, updates, dynamic)  # logged if stopped after an update
                    # 10: for GRPO iteration = 1, ..., μ
                    for iteration in range(mu):
                        # 11: update π_θ by maximizing eq. 3 (one AdamW step). A second signal
                        # stops after it, its statistics kept (signals.py: deferred).
                        with STOPS.deferred():
                            stats, logps = run.policy_update(
                                rollouts, advantages, old_logps, ref_logps
                            )
                            updates.append(count_nonfinite(run, stats))
                        if old_logps is None and s.num_iterations > 1:
                            # Iteration 1 ran before any update: its log-probs are π_old's.
                            old_logps = logps
                    if args.ref_update_every and (step + 1) % args.ref_update_every == 0:
                        checkpoint.reset_reference(run.ref_model, run.model)  # lines 2-3
                    log_step(run, task, step + 1, scored, updates, dynamic)
                # Save when due. A signal during the step (on any rank) stops here, saved.
                stop = save_or_stop(run, task, step + 1)
            if eval_due(s, task, step + 1, stop):
                with STOPS.at_once(evaluation_at(step + 1)):  # saved by save_or_stop
                    evaluate_if_due(run, task, step + 1, stop)
            if stop:
                break
        with STOPS.at_once("the closing table and curves.png; training is saved"):
            finish(run, task)
    return run.evals


# --------------------------------------------------------------------------------------------------
# The run: its settings, decided once at startup, and what train() builds before its first step.


@dataclass(frozen=True)
class LossSettings:
    """Eq. 3's settings (grpo.grpo_loss's keywords) and the options beyond it, which
    micro_batch_loss composes around grpo_loss (policy_term, policy_weights)."""

    epsilon: float
    epsilon_high: float | None  # DAPO's clip-higher; None: epsilon
    beta: float
    loss_type: str  # grpo | dapo | dr_grpo
    ratio_level: str  # token | sequence (GSPO)
    max_tokens: int  # the generation budget: Dr. GRPO's constant
    delta: float | None  # dual clip: the ratio's cap where the advantage is negative; None: off
    surrogate: str = "clip"  # the policy term: clip (eq. 3) | cispo | sapo | dppo-tv | dppo-kl
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    top_entropy: float = 1.0  # ρ: the policy term on the top-ρ tokens by entropy; 1: all
    off_policy_threshold: float | None = None  # DeepSeek-V3.2's sequence mask; None: off
    kl_bias_correction: bool = False  # the KL term × r (DeepSeek-V3.2; TRL's default)
    kl_estimator: str = "k3"  # the KL term's: k3 (eq. 4) | k2
    dppo_deltas: tuple = ()  # --surrogate dppo-*: (δ_low, δ_high) of grpo.dppo_mask

    @classmethod
    def of(cls, args):
        default = config.DPPO_DELTAS.get(args.surrogate)
        low = default if args.dppo_delta_low is None else args.dppo_delta_low
        high = low if args.dppo_delta_high is None else args.dppo_delta_high
        return cls(
            args.epsilon,
            args.epsilon_high,
            0.0 if args.kl_in_reward else args.beta,  # --kl-in-reward: no KL term in the loss
            args.loss_type,
            args.ratio_level,
            args.max_new_tokens,
            args.delta,
            args.surrogate,
            args.sapo_tau_pos,
            args.sapo_tau_neg,
            args.top_entropy_quantile,
            args.off_policy_mask,
            args.kl_bias_correction,
            args.kl_estimator,
            (low, high) if default is not None else (),
        )


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What the loop needs of the flags, decided once at startup (Settings.of): each function the
    loop calls takes the part it uses."""

    steps: int  # M
    group_size: int  # G
    num_iterations: int  # μ
    prompts_per_step: int  # over all ranks: batch-size x gradient-accumulation-steps x processes
    micro_batch_size: int  # completions per forward/backward: whole groups
    autocast_dtype: torch.dtype | None  # the autocast (compute) dtype: bf16 or fp16; None: fp32
    start: str  # the weights π_θ starts from (checkpoint.starting_weights)
    sampling: sampling.Sampling  # the training rollouts'
    eval: evaluation.EvalSettings  # the held-out evaluations'
    loss: LossSettings
    # --sampler-correction: (mode, min, max) of grpo.sampler_weights; None: off
    correction: tuple | None
    seed: int
    scale_rewards: str  # grpo.group_advantages' scale
    multi_reward: str  # sum: eq. 3's Â of the weighted total | gdpo: grpo.gdpo_advantages
    reward_kl_beta: float  # --kl-in-reward: β of k1 in the reward (LossSettings.beta is then 0)
    mask_truncated: bool
    dynamic_sampling: bool
    max_resample: int
    max_grad_norm: float  # 0: no clipping
    max_nonfinite: int  # updates skipped in a row before the run stops
    stop_when_zero_std: int  # steps in a row without reward spread before it stops; 0: never
    eval_every: int  # -1: never; 0: before and after training only
    save_every: int  # 0: after the last step (and before every evaluation) only
    sample_every: int  # print a completion every this many steps; 0: never
    # π_ref's log-probs on the shared-prompt path, unless gradient checkpointing sends π_θ's
    # forward down the plain one (π_ref and π_θ then come from the same computation)
    shared_prompt: bool

    @classmethod
    def of(cls, args, resume_dir=None):
        G, per_rank = args.num_generations, args.batch_size * args.gradient_accumulation_steps
        return cls(
            steps=args.steps,
            group_size=G,
            num_iterations=args.num_iterations,
            prompts_per_step=distributed.world() * per_rank,
            micro_batch_size=args.micro_batch_size or args.batch_size * G,
            autocast_dtype=sampling.AUTOCAST_DTYPE[args.dtype],
            start=checkpoint.starting_weights(args, resume_dir),
            sampling=rollout_sampling(args),
            eval=evaluation.EvalSettings.of(args),
            loss=LossSettings.of(args),
            correction=(args.sampler_correction, args.sampler_ratio_min, args.sampler_ratio_max)
            if args.sampler_correction
            else None,
            seed=args.seed,
            scale_rewards=args.scale_rewards,
            multi_reward=args.multi_reward,
            reward_kl_beta=args.beta if args.kl_in_reward else 0.0,
            mask_truncated=args.mask_truncated,
            dynamic_sampling=args.dynamic_sampling,
            max_resample=args.max_resample,
            max_grad_norm=args.max_grad_norm,
            max_nonfinite=args.max_nonfinite,
            stop_when_zero_std=args.stop_when_zero_std,
            eval_every=args.eval_every,
            save_every=args.save_every,
            sample_every=args.sample_every,
            shared_prompt=not args.gradient_checkpointing,
        )


def rollout_sampling(args):
    """The training rollouts' sampling.Sampling. The decode keeps the sampler's log-probs for
    --sampler-correction and --log-mismatch, and for --surrogate dppo-*, whose behaviour policy
    they are, wherever its own loop decodes (transformers' generate(), under --fsdp or
    --num-beams, keeps none: there DPPO's behaviour policy is π_old, at μ > 1 only)."""
    settings = sampling.Sampling.of(args)
    if args.surrogate in config.DPPO_DELTAS and not (args.fsdp or args.num_beams > 1):
        settings = dataclasses.replace(settings, keep_logps=True)
    return settings


@dataclass
class Run:
    """What the loop carries from step to step. A context manager: leaving it closes the log."""

    args: object  # the flags, saved with every checkpoint and sent to the trackers
    settings: Settings
    model: torch.nn.Module  # π_θ, fp32, on the device
    ref_model: torch.nn.Module | None  # π_ref, frozen (None when β = 0)
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: object  # fp16's GradScaler, else None
    start_step: int
    log: report.MetricsLog  # OUTPUT_DIR/metrics.jsonl and the trackers of --report-to
    evals: list  # [(step, {reward name: mean})]
    phases: object  # the timing hook (support/phases.py)
    peft: object = None  # --lora-rank: the PeftModel around `model` (saves the adapter), else None
    ddp: object = None  # under torchrun: DistributedDataParallel around the log-prob forward
    step_times: list = dataclasses.field(default_factory=list)  # seconds, each step's
    step_started: float = 0.0  # time.time() at the current step's start
    nonfinite_streak: int = 0  # updates skipped in a row for a non-finite loss or gradient
    zero_std_streak: int = 0  # steps in a row with no reward spread in any group
    logged: int = 0  # the last step with its metrics row (log_step)
    step_log: tuple = ()  # the current step's (scored, updates, dynamic), for log_step

    def policy_update(self, rollouts, advantages, old_logps, ref_logps):
        """Line 11 on this run's model, optimizer and settings."""
        s = self.settings
        return policy_update(
            self.model,
            self.optimizer,
            self.scheduler,
            rollouts,
            advantages,
            old_logps,
            ref_logps,
            objective=s.loss,
            correction=s.correction,
            micro_batch_size=s.micro_batch_size,
            max_grad_norm=s.max_grad_norm,
            autocast_dtype=s.autocast_dtype,
            scaler=self.scaler,
            ddp=self.ddp,
            phases=self.phases,
        )

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        # an error ends the run failed; Ctrl-C and the signals are stops (saved, resumable)
        self.log.close(failed=kind is not None and not issubclass(kind, KeyboardInterrupt))


def build_run(args, task, model, tokenizer, resume_dir=None, phases=NO_PHASES):
    """Everything the loop needs, built in reading order: π_θ on the device (Algorithm 1's line 1:
    π_θinit, or on --resume the checkpoint's weights), π_ref = π_θinit (line 3), gradient
    checkpointing, torch.compile, FSDP2 or DDP under torchrun, AdamW, its LR schedule, fp16's loss
    scaler; then a resumed run's state and its log."""
    s, peft_model = Settings.of(args, resume_dir), None
    if args.lora_rank:
        # π_θ = π_θinit + adapters; π_ref = π_θinit: the same model with its adapters off, no copy
        adapter_from = resume_dir if s.start == checkpoint.MODEL_AND_ADAPTER else None
        peft_model = models.add_lora(model.to(args.device), args, adapter_from)
        model, ref_model = peft_model.get_base_model(), peft_model if args.beta > 0 else None
    else:
        # a fresh run copies π_θinit; a resumed one keeps it as π_ref and loads π_θ below
        fresh = s.start == checkpoint.FROM_MODEL
        ref_model = models.reference_model(
            model, args.beta, s.autocast_dtype, args.device, copy_model=fresh
        )
    if s.start == checkpoint.MODEL_THEN_CHECKPOINT:
        model = checkpoint.load_policy(resume_dir, model, args)
    if not args.dropout:  # the same network for π_old and π_θ (π_ref runs in eval mode)
        models.disable_dropout(model)
    model.to(args.device)
    if memory.checkpointing(args, args, model, task, tokenizer):  # as given, or CUDA's plan
        sampling.enable_gradient_checkpointing(model)
    s = dataclasses.replace(s, shared_prompt=not args.gradient_checkpointing)  # the plan's choice
    if args.compile:  # the decode step and the log-prob forwards of π_θ (and π_ref's)
        for m in {id(m): m for m in (model, ref_model) if m is not None}.values():
            sampling.compile_model(m, args.compile)
    model.train()
    if args.fsdp:  # under torchrun: shard π_θ and π_ref over the ranks instead of replicating
        distributed.shard_model(model)
        if ref_model is not None and ref_model is not model:
            distributed.shard_model(ref_model)
    # torchrun: DDP (it broadcasts rank 0's weights)
    ddp = None if args.fsdp else distributed.wrap(model, sampling.token_logprobs)
    optimizer = build_optimizer(model, args.lr, args.weight_decay)
    scheduler = get_scheduler(
        args.lr_scheduler,
        optimizer,
        num_warmup_steps=args.warmup_steps,
        num_training_steps=args.steps * args.num_iterations,
    )
    # fp16 autocast needs loss scaling; bf16 and fp32 do not.
    fp16_on_cuda = args.dtype == "fp16" and args.device == "cuda"
    scaler = torch.amp.GradScaler("cuda") if fp16_on_cuda else None
    if resume_dir is None and distributed.world() > 1:
        # each rank samples its own completions
        torch.manual_seed(args.seed + 1000 * distributed.rank())
    step = 0
    if resume_dir is not None:
        step = checkpoint.restore(resume_dir, args, optimizer, scheduler, scaler, ref_model, model)
        checkpoint.check_resumed_finite(model, optimizer, resume_dir)
    if args.compile:  # the compiled decode's shapes, fixed for the run: two graphs, two KV caches
        length = decode_length(task, tokenizer, model, s.sampling)
        decode.plan_decode(model, decode_rows(s), length)
    # metrics.jsonl, and the trackers of --report-to: last, as Run closes them
    log, evals = report.open_log(args.output_dir, step if resume_dir is not None else None, args)
    return Run(
        args, s, model, ref_model, tokenizer, optimizer, scheduler, scaler, step, log, evals,
        phases, peft_model, ddp,
    )  # fmt: skip


def build_optimizer(model, lr, weight_decay):
    """AdamW on the fp32 parameters, fused (one kernel over all of them) where torch has it."""
    # all of them, or LoRA's adapters only
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def decode_rows(settings):
    """The rows of this process's generate calls: a training step's (its share of the prompts x G)
    and an evaluation batch's (questions x samples; a last, smaller batch is padded up to it when
    compiled)."""
    e = settings.eval
    share = settings.prompts_per_step // distributed.world()
    return [share * settings.group_size, e.batch_size * e.samples]


def decode_length(task, tokenizer, model, settings):
    """The KV cache length every decode call of the run fits in: its longest prompt, then
    max_new_tokens."""
    limit = sampling.prompt_limit(model, settings)
    return memory.longest_prompt(task, tokenizer, limit) + settings.max_new_tokens


# --------------------------------------------------------------------------------------------------
# The parts of a step.


def score_or_fail_everywhere(task, rows, rollouts):
    """task.score on the rollouts, where a UserError (a reward function that raised, hung or
    returned NaN) on any rank stops every rank here: one all-reduce under torchrun. Returns (total
    [N], {name: [N]}, a process reward's steps {name: sandbox.Steps}, {} without one)."""
    error, result, steps = rollouts.tool_failure, None, {}
    env = rollouts.environment_rewards  # --env's reward method: a column of its own
    try:
        if error is None:
            result = task.score(
                rows,
                rollouts.texts,
                rollouts.group_size,
                rollouts.lengths,
                rollouts.tool_calls,
                steps=steps,
                **({} if env is None else {"environment_rewards": env}),
            )
    except UserError as e:
        error = e
    if distributed.all_sum([error is not None])[0] > 0:
        raise RewardFailedSomewhere(
            str(error) if error else "a reward function failed in another process (see its error)",
            own=error is not None,
        )
    return (*result, steps)


def advantages_of(run, task, rollouts, reward, per_fn, steps):
    """Line 9: Â_i,t. Outcome supervision: the group-relative advantage of each completion's
    reward [B*G] (every rank's rewards gathered: --scale-rewards batch reads the whole batch), the
    same for every t; with --multi-reward gdpo, GDPO's of each function's rewards (per_fn, weighted
    by task.rewards; gathered too: its last normalization is the batch's). Process supervision
    (§4.1.3), where a reward function returned steps: [B*G, C] per token (process_supervision.py;
    groups are whole on each rank, so each rank's own)."""
    s = run.settings
    if steps:
        kl_in_reward = s.reward_kl_beta > 0
        process_supervision.check_settings(
            s.scale_rewards, s.dynamic_sampling, s.multi_reward, kl_in_reward
        )
        adv = process_supervision.advantages(task, per_fn, steps, rollouts, run.tokenizer)
    elif s.multi_reward == "gdpo":
        table = torch.stack([per_fn[r.name] for r in task.rewards], 1)  # [B*G, K]
        weights = [r.weight for r in task.rewards]
        adv = grpo.gdpo_advantages(distributed.gather(table), weights, s.group_size)
        adv = distributed.my_share(adv)
    else:
        adv = grpo.group_advantages(distributed.gather(reward), s.group_size, scale=s.scale_rewards)
        adv = distributed.my_share(adv)
    return adv.to(rollouts.input_ids.device)


def dynamic_sampling(run, task, step, scored):
    """DAPO's dynamic sampling (arXiv 2503.14476, §3.2): a group whose rewards are all equal has
    advantage 0 and teaches nothing. Drop those groups and sample more prompts (data.batch_at's
    stream k for the k-th extra call: a pure function of seed and step, so resume stays exact)
    until the step holds batch-size x gradient-accumulation-steps groups with spread, or
    --max-resample extra generate calls have run. `scored`: (rows, rollouts, rewards,
    per-function rewards). Returns the kept groups' as the same, and what to log; with no group
    with spread at all, the first call's and skipped_no_spread=1 (the loop then makes no update)."""
    s = run.settings
    G, want, parts, calls = s.group_size, s.prompts_per_step, [scored], 1

    def spread(part):  # the groups of a part whose rewards differ
        groups = part[2].view(-1, G)
        return [g for g in range(len(groups)) if not bool((groups[g] == groups[g, 0]).all())]

    while sum(len(spread(p)) for p in parts) < want and calls <= s.max_resample:
        more = data.batch_at(task.train, want, s.seed, step, stream=calls)
        prompts = [task.prompt(run.tokenizer, r["prompt"]) for r in more]
        with run.phases.phase("generate"):
            extra = sampling.sample_rollouts(
                run.model, run.tokenizer, prompts, s.sampling, G, s.autocast_dtype, task.tools, more
            )
        with run.phases.phase("rewards"):
            parts.append((more, extra, *score_or_fail_everywhere(task, more, extra)[:2]))
        calls += 1
    kept = [(p, g) for p in parts for g in spread(p)][:want]
    log = dict(
        dynamic_dropped=sum(len(p[0]) - len(spread(p)) for p in parts),
        dynamic_calls=calls,
        dynamic_groups=len(kept),
        skipped_no_spread=int(not kept),
    )
    if not kept:
        return scored, log
    rollouts = sampling.concat_rollouts([sampling.select_groups(p[1], [g]) for p, g in kept])
    rows = [p[0][g] for p, g in kept]
    reward = torch.cat([p[2].view(-1, G)[g] for p, g in kept])
    per_fn = {name: torch.cat([p[3][name].view(-1, G)[g] for p, g in kept]) for name in scored[3]}
    return (rows, rollouts, reward, per_fn), log


def reference_logps(run, rollouts):
    """log π_ref of the rollouts' tokens [N, C], or None without a reference model (β = 0)."""
    if run.ref_model is None:
        return None
    s = run.settings
    with run.phases.phase("reference"):
        return frozen_logps(
            run.ref_model, rollouts, s.micro_batch_size, s.autocast_dtype, s.shared_prompt
        )


def reward_with_kl(run, rollouts, reward, ref_logps, logged):
    """--kl-in-reward (k1 in the reward, grpo.kl_penalty_rewards): each completion's reward less
    β Σ_t log(π_θ/π_ref) over its loss tokens, before the advantages; `reward` as it is when the
    option is off or there is no update (ref_logps None). π_θ's log-probs come from a no-grad
    forward of the policy that sampled (before any update of the step: π_old), down the path and
    micro-batches π_ref's take. Adds to `logged` (the step's metrics, every rank's tokens): kl, the
    mean k3 per token (what the loss's KL term logs), and kl_penalty, the mean β Σ_t k1
    subtracted."""
    s = run.settings
    if not s.reward_kl_beta or ref_logps is None:
        return reward
    with run.phases.phase("reference"):
        policy = frozen_logps(
            run.model, rollouts, s.micro_batch_size, s.autocast_dtype, s.shared_prompt
        )
    mask = rollouts.completion_mask.bool()
    penalized = grpo.kl_penalty_rewards(
        reward.to(policy.device), policy, ref_logps, mask, s.reward_kl_beta
    ).to(reward.device)
    x = torch.where(mask, ref_logps - policy, 0.0).double()  # log π_ref/π_θ
    k3, tokens, subtracted, completions = distributed.all_sum(  # over the ranks
        [(torch.exp(x) - x - 1).sum(), mask.sum(), (reward - penalized).sum(), reward.numel()]
    )
    logged.update(kl=k3 / max(tokens, 1), kl_penalty=subtracted / completions)
    return penalized


def count_nonfinite(run, stats):
    """An update's statistics, after counting it in the run's streak of updates skipped for a
    non-finite loss or gradient; at --max-nonfinite a UserError, and train() saves the weights:
    the last good ones (skipped updates change nothing)."""
    skipped = (stats["skipped"] or "").startswith("non-finite")
    run.nonfinite_streak = run.nonfinite_streak + 1 if skipped else 0
    limit = run.settings.max_nonfinite
    if run.nonfinite_streak >= limit:
        raise UserError(
            f"{run.nonfinite_streak} optimizer updates in a row were skipped ({stats['skipped']}; "
            f"--max-nonfinite {limit}). The weights are the last good ones and are saved in the "
            "output directory. Check the rewards and the data, lower --lr, or use --dtype "
            "bf16/fp32 instead of fp16."
        )
    return stats


# --------------------------------------------------------------------------------------------------
# The bookkeeping around a step: the log, the checkpoints, the evaluations, stopping.


@contextlib.contextmanager
def saved_if_stopped(run, task, step):
    """Ctrl-C, or a run that cannot go on (UserError), inside `step`: keep what it learned
    (checkpoint.save_interrupted), then let the exception go on."""
    run.step_started = time.time()
    rng_at_start, updates_at_start = checkpoint.rng_state(), run.scheduler.last_epoch
    try:
        yield
    except (KeyboardInterrupt, UserError) as e:
        # the LR schedule steps with every applied update: whether this step changed the weights
        updated = run.scheduler.last_epoch != updates_at_start
        # a step that updated counts as done, saved with its row (the updates made): no gap in
        # metrics.jsonl on --resume. Not where nothing is saved: a failed write, NaN weights, or
        # one rank stopping alone (checkpoint.save_interrupted)
        saved = not isinstance(e, WriteFailed) and distributed.world() == 1
        if updated and run.logged < step + 1 and saved:
            log_step(run, task, step + 1, *run.step_log)
        checkpoint.save_interrupted(run, run.args, step, updated, rng_at_start, stopped_by=e)
        raise


def log_step(run, task, done, scored, updates, dynamic):
    """Step `done`'s metrics on the progress line and in metrics.jsonl (rank 0), the first group's
    completions every --sample-every steps, and the zero-spread streak."""
    rows, rollouts, reward, per_fn = scored
    s, G, gather = run.settings, run.settings.group_size, distributed.gather
    run.step_times.append(time.time() - run.step_started)
    steps_left = run.settings.steps - done
    metrics = report.step_metrics(
        gather(reward),
        {name: gather(r) for name, r in per_fn.items()},
        gather(rollouts.lengths),
        gather(rollouts.truncated),
        G,
        updates,
        run.step_times,
        steps_left,
        run.scheduler,
    )
    metrics.update(dynamic)
    if rollouts.tool_calls is not None:
        metrics.update(
            report.tool_metrics(
                *map(gather, (rollouts.tool_calls, rollouts.tool_errors, rollouts.tool_malformed))
            )
        )
    if distributed.is_main():  # one metrics.jsonl
        beta = s.loss.beta or s.reward_kl_beta  # the KL's, in the loss or in the reward
        report.log_step(run.log, done, run.settings.steps, beta, metrics, list(per_fn))
        if metrics["frac_truncated"] == 1:
            sampling.warn_all_cut(s.sampling.max_new_tokens)
    run.logged = done
    run.phases.step_logged(done, metrics)
    first = task.prompt(run.tokenizer, rows[0]["prompt"])
    responses = task.responses(rollouts.texts)[:G]  # the first group's G completions
    report.print_sample(
        run.log, s.sample_every, done, first, responses, reward[:G], rows[0]["answer"]
    )
    run.zero_std_streak = run.zero_std_streak + 1 if metrics["frac_zero_std"] == 1 else 0


def save_or_stop(run, task, done):
    """After step `done`: whether the run ends here early (--stop-when-zero-std), a checkpoint when
    one is due (save_if_due), then Stopped if a signal came during the step on any rank. Returns
    whether the run stops here."""
    s = run.settings
    stop = 0 < s.stop_when_zero_std <= run.zero_std_streak and done < run.settings.steps
    if stop:
        print(
            f"stopping after step {done}: {run.zero_std_streak} steps in a row had no reward spread "
            "in any group (--stop-when-zero-std); docs/results.md: what to do then.",
            flush=True,
        )
    # before every evaluation too: one cut short loses no training
    saved = save_if_due(run, task, done, stop)
    STOPS.raise_if_requested(saved)
    return stop


def save_if_due(run, task, done, last=False):
    """A checkpoint after step `done` every --save-every steps, after the last step (or `last`: one
    that ends the run early), and before every evaluation, so that a crash or Ctrl-C inside an
    evaluation loses no training. Returns whether it saved."""
    s = run.settings
    periodic = s.save_every > 0 and done % s.save_every == 0
    due = eval_due(s, task, done)
    if not (periodic or done == s.steps or last or due):
        return False
    # the run's last save when a signal asked it to stop: LoRA's merged model too
    final = last or STOPS.signum is not None
    with run.phases.phase("checkpoint", done):
        checkpoint.save_run(run, run.args, done, checkpoint.rng_state(), final=final)
    return True


def eval_due(settings, task, step, last=False):
    """Evaluations run before training, every --eval-every steps and at the end (the last step, or
    `last`: a step that ends the run early); --eval-every -1: never."""
    every = settings.eval_every
    periodic = every > 0 and step % every == 0
    ends = step in (0, settings.steps) or last
    return every >= 0 and len(task.eval) > 0 and (ends or periodic)


def evaluation_at(step):
    """What an evaluation at `step` is, for the line printed when a signal stops it
    (signals.StopRequests.at_once): training is saved before every evaluation after step 0."""
    if step == 0:
        return "the evaluation before training; no step has run"
    return f"the evaluation at step {step}; training is saved up to step {step}"


def evaluate_if_due(run, task, step, last=False):
    """The evaluation of `step` if one is due and not logged yet (a resumed run may have)."""
    if not eval_due(run.settings, task, step, last) or step in dict(run.evals):
        return
    with run.phases.phase("evaluation", step):
        result = evaluation.evaluate_with(
            run.model, run.tokenizer, task, run.settings.eval, run.settings.autocast_dtype
        )
    run.evals.append((step, result))
    print(
        f"eval @ step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()), flush=True
    )
    if distributed.is_main():
        run.log.write({"step": step, **{f"eval/{k}": v for k, v in result.items()}})


def finish(run, task):
    """The closing before/after table and curves.png."""
    e = run.settings.eval
    if len(run.evals) > 1:
        count = len(task.eval[: e.limit])
        report.print_eval_table(run.evals, count, e.samples, e.sampling.temperature)
    run.log.close()  # the trackers write their last rows before the plot
    if distributed.is_main():
        report.curves(run.args.output_dir)


# --------------------------------------------------------------------------------------------------
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
    correction=None,
    max_grad_norm=1.0,
    autocast_dtype=None,
    scaler=None,
    ddp=None,
    phases=NO_PHASES,
):
    """One optimizer update of π_θ maximizing eq. 3 on the rollouts: forward and backward over
    micro-batches of whole groups, each loss divided by the whole batch's denominator so that the
    gradients add up to the full batch's; then clip, AdamW, the LR schedule. old_logps, ref_logps
    [N, C]: π_old's (None when μ = 1) and π_ref's (None when β = 0). Returns the update's
    statistics and the log-probs its forwards computed before the update [N, C], detached (0 after
    each micro-batch's longest completion).
    Under torchrun (ddp: the DistributedDataParallel log-prob module) the batch is every rank's:
    the denominator counts all ranks' sequences or tokens, and each rank's loss is multiplied by
    the number of ranks (DDP averages the gradients, all-reduced once, in the last backward).
    The sampler's log-probs, where kept: the off-policy mask's π_behavior, sampler_correction's
    π_sampler, and on the first iteration mismatch_metrics'."""
    model.train()
    mask = rollouts.completion_mask  # [N, C]
    denominator = grpo.loss_denominator(mask, objective.loss_type, objective.max_tokens)
    normalizer = distributed.all_sum([denominator])[0]
    logprobs = ddp or functools.partial(sampling.token_logprobs, model)
    lr = scheduler.get_last_lr()[0]
    totals = dict.fromkeys(("loss", "entropy", "corrected") + grpo.STATS + OPTION_STATS, 0.0)
    logps_before = torch.zeros(mask.shape, device=mask.device)  # [N, C]
    T, G = rollouts.temperature, rollouts.group_size
    with phases.phase("update"):
        optimizer.zero_grad(set_to_none=True)
        batches = micro_batches(mask.shape[0], micro_batch_size)
        for i, rows in enumerate(batches):
            ids, attn, keep = micro_batch_inputs(rollouts, rows)
            last = i == len(batches) - 1
            with sync_gradients_if(last, model, ddp), sampling.autocast(ids.device, autocast_dtype):
                # [n, keep]: with grad, without
                logps, entropy = logprobs(ids, attn, keep, T, entropy=True, group_size=G)
                logps_before[rows, :keep] = logps.detach()
                totals["entropy"] += (entropy * mask[rows, :keep]).sum().item()
                loss, stats = micro_batch_loss(
                    logps, entropy, rollouts, rows, keep, advantages, old_logps, ref_logps,
                    objective, correction, normalizer,
                )  # fmt: skip
                # DDP averages over ranks; no division by the number of micro-batches
                scaled = loss * distributed.world()
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
            totals["loss"] += loss.item()
            for k, v in stats.items():
                totals[k] += v
        totals = dict(zip(totals, distributed.all_sum(totals.values())))  # every rank's sums
        with phases.phase("optimizer"):
            grad_norm, skipped = optimizer_step(
                model, optimizer, scheduler, scaler, max_grad_norm, totals["loss"]
            )
        # freed now: no generation or evaluation holds the gradients
        optimizer.zero_grad(set_to_none=True)
    per_token = {k: v / max(totals["tokens"], 1) for k, v in totals.items()}
    # π_θ = π_old on the first iteration: the sampler-trainer mismatch
    mismatch = mismatch_metrics(logps_before, rollouts) if old_logps is None else {}
    return dict(
        loss=totals["loss"], kl=per_token["kl"], clip_frac=per_token["clipped"],
        ratio=per_token["ratio"], entropy=per_token["entropy"], grad_norm=float(grad_norm), lr=lr,
        skipped=skipped, **option_shares(totals, objective, correction), **mismatch,
    ), logps_before  # fmt: skip


def micro_batch_loss(
    logps, entropy, rollouts, rows, keep, advantages, old_logps, ref_logps, objective, correction,
    normalizer,
):  # fmt: skip
    """grpo.grpo_loss on the micro-batch `rows` (its first `keep` columns): π_θ's log-probs and
    entropies [n, keep], with the sampler's log-probs where the decode kept them (the off-policy
    mask's π_behavior; sampler_correction's π_sampler; with the mass top-k/top-p kept, DPPO's b).
    The options beyond eq. 3 are composed around it: CISPO's, SAPO's or DPPO's policy term in
    place of the clip (policy_term), the masks and the sampler correction's weights multiplying
    each token's policy term (policy_weights). Returns (loss, its statistics' sums)."""
    mask = rollouts.completion_mask[rows, :keep]
    old, ref, behavior = (
        None if x is None else x[rows, :keep]
        for x in (old_logps, ref_logps, rollouts.sampler_logps)
    )
    kept = None if behavior is None else rollouts.log_kept[rows, :keep]
    adv, o = advantages[rows] if advantages.dim() == 1 else advantages[rows, :keep], objective
    weights, stats = policy_weights(o, correction, logps, entropy, old, behavior, adv, mask, kept)
    loss = grpo.grpo_loss(
        logps, old, ref, adv, mask, epsilon=o.epsilon, epsilon_high=o.epsilon_high,
        beta=o.beta, loss_type=o.loss_type, max_tokens=o.max_tokens, normalizer=normalizer,
        ratio_level=o.ratio_level, delta=o.delta, surrogate=policy_term(o), weights=weights,
        kl_bias_correction=o.kl_bias_correction, kl_estimator=o.kl_estimator, stats=stats,
    )  # fmt: skip
    return loss, stats


def policy_term(objective):
    """grpo_loss's surrogate for --surrogate: None for eq. 3's clip, else CISPO's, SAPO's or
    DPPO's per-token term with its settings bound (ε_high: --epsilon-high, or --epsilon). DPPO's
    r Â has none: its trust region is a mask (policy_weights)."""
    if objective.surrogate in config.DPPO_DELTAS:
        return grpo.dppo_objective
    if objective.surrogate == "cispo":
        eps_high = objective.epsilon if objective.epsilon_high is None else objective.epsilon_high
        return functools.partial(grpo.cispo_objective, epsilon_high=eps_high)
    if objective.surrogate == "sapo":
        tau = dict(tau_pos=objective.sapo_tau_pos, tau_neg=objective.sapo_tau_neg)
        return functools.partial(grpo.sapo_objective, **tau)
    if objective.surrogate != "clip":
        raise ValueError(
            f"surrogate must be one of {config.SURROGATES}, got {objective.surrogate!r}"
        )
    return None


def policy_weights(
    objective, correction, logps, entropy, old, behavior, advantages, mask, log_kept=None
):
    """What multiplies each token's policy term in grpo_loss for one micro-batch: the product of
    DPPO's trust-region mask, the off-policy sequence mask, the top-ρ entropy mask and the sampler
    correction's weights, in that order, those that are on (None when none is); and the sums of
    the statistics they add (completions, completions and tokens dropped, tokens or completions
    corrected). π_old is π_θ's own log-probs, detached, when old is None (μ = 1, or the first
    iteration); π_behavior the sampler's where kept, else π_old. DPPO's b is the sampler's of the
    full tempered softmax (behavior + log_kept: the distribution π_θ's p is of, so top-k/top-p's
    cut is not taken for a divergence), else π_old's."""
    m = mask.bool()
    stats = dict(
        sequences=(m.sum(1) > 0).sum().item(), entropy_dropped=0, off_policy=0, dppo_dropped=0
    )
    factors = []  # the masks and weights that are on
    if objective.surrogate in config.DPPO_DELTAS:  # DPPO: p - b (or their binary KL) too far: 0
        pi_old = logps.detach() if old is None else old
        b = pi_old if behavior is None else behavior + log_kept
        divergence = objective.surrogate.removeprefix("dppo-")
        keep = grpo.dppo_mask(advantages, logps, b, m, *objective.dppo_deltas, divergence)
        stats["dppo_dropped"] = (m & (keep == 0)).sum().item()
        factors.append(keep)
    if objective.off_policy_threshold is not None:  # DeepSeek-V3.2: Â < 0 and far off-policy: 0
        pi_old = logps.detach() if old is None else old
        behavior_logps = pi_old if behavior is None else behavior
        keep = grpo.off_policy_mask(
            advantages, logps, behavior_logps, m, objective.off_policy_threshold
        )
        stats["off_policy"] = ((keep == 0) & m).any(1).sum().item()
        factors.append(keep)
    if objective.top_entropy < 1:  # only the top-ρ tokens by entropy
        high = grpo.high_entropy_mask(entropy, m, objective.top_entropy)
        stats["entropy_dropped"] = (m & ~high).sum().item()
        factors.append(high)
    weights, stats["corrected"] = sampler_correction(correction, logps, old, behavior, mask)
    if weights is not None:  # × π_old / π_sampler (the mismatch correction)
        factors.append(weights)
    return (functools.reduce(torch.mul, factors) if factors else None), stats


def sampler_correction(correction, logps, old, sampler, mask):
    """--sampler-correction's weights π_old / π_sampler for one micro-batch (π_old: π_θ's own
    log-probs, detached, when old is None, i.e. μ = 1 or the first iteration), and how many tokens
    (sequence modes: completions) they truncated or masked; (None, 0) when it is off."""
    if correction is None:
        return None, 0
    trainer = logps.detach() if old is None else old
    weights, hit = grpo.sampler_weights(trainer, sampler, mask, *correction)
    return weights, (hit & mask.bool() if hit.shape[1] > 1 else hit).sum().item()


def option_shares(totals, objective, correction):
    """The share of tokens (or completions) each option that is on left out or changed."""
    tokens, sequences = max(totals["tokens"], 1), max(totals["sequences"], 1)
    shares = {}
    if objective.surrogate in config.DPPO_DELTAS:
        shares["dppo_dropped"] = totals["dppo_dropped"] / tokens
    if objective.top_entropy < 1:
        shares["entropy_dropped"] = totals["entropy_dropped"] / tokens
    if objective.off_policy_threshold is not None:
        shares["off_policy_masked"] = totals["off_policy"] / sequences
    if correction is not None:  # tokens, or completions for the sequence modes
        mode = correction[0]
        name = "sampler_masked" if mode.endswith("mask") else "sampler_truncated"
        shares[name] = totals["corrected"] / (sequences if mode.startswith("sequence") else tokens)
    return shares


def mismatch_metrics(trainer_logps, rollouts):
    """The sampler-trainer numerical mismatch over every rank's sampled tokens ({} unless the
    decode kept the sampler's log-probs, or no token is in the loss): the mean k3 KL and
    the largest token ratio between π_θ's log-probs from the training forward and the decode's of
    the same distribution (the full tempered softmax: drawn + log_kept), and the truncation gap,
    the mean log of the mass top-k / top-p kept (≤ 0: a known bias, not a numerical one)."""
    if rollouts.sampler_logps is None:
        return {}
    mask = rollouts.completion_mask.bool()
    full = rollouts.sampler_logps + rollouts.log_kept
    log_r = torch.where(mask, trainer_logps - full, 0.0).double()
    k3 = torch.exp(log_r) - log_r - 1
    kept = torch.where(mask, rollouts.log_kept, 0.0).double()
    local = torch.stack([k3.sum(), mask.sum().double(), log_r.abs().max(), kept.sum()])
    every = distributed.gather(local[None]).view(-1, 4)  # [ranks, 4]
    tokens = every[:, 1].sum().item()
    if tokens == 0:  # every completion masked out (--mask-truncated): nothing to compare
        return {}
    return dict(
        mismatch_kl=every[:, 0].sum().item() / tokens,
        mismatch_max_ratio=math.exp(every[:, 2].max().item()),
        truncation_gap=every[:, 3].sum().item() / tokens,
    )


def sync_gradients_if(last, model, ddp):
    """The gradients reduced over the ranks in the last micro-batch's backward only: DDP's no_sync
    before it; FSDP2's reduce-scatter switched off before it."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(last)
    return ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext()


def optimizer_step(model, optimizer, scheduler, scaler, max_grad_norm, loss=0.0):
    """Clip the global gradient norm (returned as it was before clipping; max_grad_norm 0: no
    clipping), step AdamW (through fp16's loss scaler when there is one) and the LR schedule. A
    non-finite loss or gradient norm skips the update instead, so no NaN reaches the weights:
    weights, AdamW state and schedule stay as they were (fp16's scaler lowers its scale, as it
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
    # The weights, AdamW and the schedule move together: a second signal waits for all three (train:
    # the schedule's count says whether a step interrupted there had changed the weights).
    with STOPS.deferred():
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
    # What the checks above cannot see (a clipping or optimizer fault turning finite gradients into
    # NaN weights) stops the run here: the update cannot be undone, and nothing non-finite is ever
    # saved.
    bad, anywhere = checkpoint.nonfinite_weights(model, trainable_only=True)
    if anywhere:
        raise NonFiniteWeights(
            "an optimizer update made the weights non-finite (NaN or inf"
            + (f" in {', '.join(bad[:3])}" if bad else " on another rank")
            + f") although its loss and gradient norm were finite (gradient norm {float(grad_norm):.4g}). Nothing "
            "was saved over the last checkpoint in the output directory: --resume continues from it. Check --lr, "
            "--weight-decay and --max-grad-norm."
        )
    return grad_norm, None


# --------------------------------------------------------------------------------------------------
# The command line: the task and π_θinit (build_run builds the rest of a run from them).


def load_task(args, task=None):
    """The task the flags describe (`task`: the demo's, built with its model), with its rewards as
    --reward-fn, --reward-model, --overlong-buffer and --reward-weights make them, --extract-answer
    and --response-prefix. A step needing more rows than the data has is refused here."""
    task = task or data.task_from_flags(args)  # GSM8K, or your rows (--prompt-field, ...)
    toolbox = task.tools or tools.from_flags(args)  # --tool and --env, before the rewards
    env_reward = tools.environment_reward_of(toolbox)  # (its name, fn) or None
    if env_reward is None:
        rewards.check_own_task_rewards(
            args, task
        )  # your rows with GSM8K's rewards: only numeric answers
    # the task's own rewards, which --reward-fn replaces (and, on your own rows, --env's reward)
    named = [(r.name, r.fn) for r in task.rewards]
    if env_reward is not None and (args.prompt_field, args.answer_field) != (None, None):
        named = []
    extract = task.extract_answer
    if args.extract_answer is not None:
        # by import path: in its own worker process (support/worker.py), --reward-timeout per call
        extract = rewards.load_reward_fn(
            args.extract_answer,
            "--extract-answer",
            rewards.ANSWER_EXTRACTORS,
            Worker(args.reward_memory),
            args.reward_timeout,
        )[1]
    task = dataclasses.replace(
        task,
        response_prefix=args.response_prefix,
        rewards=rewards.from_flags(args, named, task.field_names, env_reward),
        extract_answer=extract,
        tools=toolbox,
        template=tools.prompt_template(task.template, toolbox),  # hermes: the tools listed
    )
    if toolbox is not None:
        toolbox.check_fields(task.field_names)
    if args.multi_reward == "gdpo" and len(task.rewards) < 2:
        raise UserError(
            "--multi-reward gdpo normalizes each reward in its group before summing them; with "
            f"one reward ({task.rewards[0].name}) that is eq. 3's advantage normalized once more "
            "over the batch. Add a reward (--reward-fn, --reward-model, --overlong-buffer), or drop "
            "--multi-reward."
        )
    need = Settings.of(args).prompts_per_step
    if not args.eval_only and args.steps > 0 and len(task.train) < need:
        raise UserError(
            f"a step takes {need} prompts (batch-size x gradient-accumulation-steps"
            + (" x processes" if distributed.world() > 1 else "")
            + f"), but the training data has {len(task.train)} rows. Lower --batch-size or "
            "--gradient-accumulation-steps, or add rows."
        )
    return task


def setup(args, resume_dir=None):
    """The task, π_θ's starting model and its tokenizer. The data and the rewards load first: a bad
    file or reward function fails in a second, not after loading a 1.7B model. Where π_θ starts
    from the checkpoint's model alone (checkpoint.starting_weights), that is what loads."""
    set_seed(args.seed)
    fits = functools.partial(models.check_context, args.max_new_tokens, args.max_prompt_length)
    if args.demo:
        seed, steps, target = args.seed, args.demo_warmup_steps, args.demo_target_accuracy
        if args.tool or args.env:  # the tool demo: sums beyond the tiny model's head, and tools
            model, tokenizer, (train, held_out) = demo.tool_setup(seed, steps)
            task = data.tool_demo_task(train, held_out)
        else:
            model, tokenizer, problems = demo.setup(seed, steps, target)
            task = data.demo_task(problems)
        fits(model.config, "the demo's model")
        return load_task(args, task), model, tokenizer
    task = load_task(args)
    from_checkpoint = checkpoint.starting_weights(args, resume_dir) == checkpoint.FROM_CHECKPOINT
    name = resume_dir if from_checkpoint else args.model
    model, tokenizer = models.load_model(name, args.trust_remote_code, check_config=fits)
    data.check_budget(task, tokenizer, args)  # --max-new-tokens holds the task's answer
    return task, model, tokenizer


def main(argv=None):
    """The command line: flags, then the task and model, then train() (or one evaluation with
    --eval-only). Bad input and running out of memory (CUDA or the CPU's) end with one paragraph on
    stderr and exit code 2, not a traceback."""
    try:
        args = config.parse_args(argv)
        if __name__ == "__main__":  # the flags are read: SIGTERM, held at the top, is delivered
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        distributed.init(args.device)  # under torchrun: join the process group; alone, nothing
        # saved with a checkpoint: --resume must use as many processes
        args.world_size = distributed.world()
        # a new run's directory: rank 0's choice, for every rank
        args.output_dir = distributed.gather_objects(args.output_dir)[0]
        if args.plot is not None:
            return report.curves(args.plot)
        if args.preset is not None:  # the run's first line: what --preset set
            print(config.preset_line(args), flush=True)
        # --eval-only --resume: evaluate the checkpoint's policy
        resume_dir = checkpoint.find_last(args.output_dir) if args.resume else None
        if args.resume and resume_dir is None:
            raise UserError(
                f"--resume: no checkpoint in {args.output_dir} (expected {args.output_dir}/checkpoint "
                "with training_state.pt). Pass the --output-dir of the run to continue, or drop "
                "--resume."
            )
        start = checkpoint.starting_weights(args, resume_dir)
        if args.eval_only and start in (
            checkpoint.FROM_CHECKPOINT,
            checkpoint.MODEL_THEN_CHECKPOINT,
        ):
            check_whole_model(resume_dir)
        # Before the model loads: one run per output directory, locked while it is live
        # (--eval-only: no claim).
        with rundir.claim_output_dir(args):
            task, model, tokenizer = setup(args, resume_dir)
            if not args.eval_only:
                with STOPS:  # Ctrl-C, SIGTERM, SIGHUP: a step finishes and is saved first
                    return train(args, task, model, tokenizer, resume_dir)
        return evaluate_only(args, task, model, tokenizer, resume_dir)
    except UserError as e:
        # once under torchrun: rank 0's, and a rank's own error (a reward function's) where it is
        says_it = distributed.launched_rank() == 0 or getattr(e, "own", False)
        if says_it:
            print(f"error: {e}", file=sys.stderr)
        exit_every_rank_alike(2, after_rank_0=not says_it)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        device = "CUDA" if isinstance(e, torch.OutOfMemoryError) else "the CPU (RAM)"
        print(
            f"error: {device} ran out of memory. Lower the memory per forward/backward with "
            "--micro-batch-size (in completions, a multiple of --num-generations; e.g. the group size "
            "alone), turn on --gradient-checkpointing, or lower --max-new-tokens / --num-generations "
            "/ --eval-batch-size. The last checkpoint (if any) is in the output directory: add "
            "--resume to continue from it (without one, --overwrite to start over).",
            file=sys.stderr,
        )
        exit_every_rank_alike(2)


def exit_every_rank_alike(code, after_rank_0=False):
    """SystemExit(code). Under torchrun, the first rank to exit makes torchrun SIGTERM the others:
    they ignore it from here on, so every rank prints what it has to and exits with `code`.
    after_rank_0: a rank that leaves the saying to rank 0 waits (up to a minute) for the SIGTERM
    that rank 0's exit brings; exiting first, it would have torchrun stop rank 0 before it spoke."""
    if distributed.launched_world() > 1:
        if after_rank_0:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            signal.sigtimedwait({signal.SIGTERM}, 60)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    raise SystemExit(code) from None


def evaluate_only(args, task, model, tokenizer, resume_dir):
    """--eval-only: one evaluation of --model, or with --resume of the checkpoint's policy."""
    settings = Settings.of(args, resume_dir)
    report.print_data(task, settings.eval.limit)
    if resume_dir is not None:
        model = checkpoint_policy(model, args, resume_dir, settings.start)
        checkpoint.check_resumed_finite(model, None, resume_dir)
        print(f"evaluating the policy in {resume_dir}")
    e = settings.eval
    result = evaluation.evaluate_with(
        model.to(args.device), tokenizer, task, e, settings.autocast_dtype
    )
    print(
        f"eval on {len(task.eval[: e.limit])} questions x {e.samples} samples: "
        + ", ".join(f"{k} {v:.4f}" for k, v in result.items())
    )
    return result


def out_of_memory(e):
    """Whether an exception is an allocation failing: CUDA's OutOfMemoryError, Python's
    MemoryError, or the RuntimeError torch's CPU allocator raises ("can't allocate memory")."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(e)


def check_whole_model(resume_dir):
    """--eval-only --resume without --lora-rank needs a whole model in the checkpoint: a LoRA run's
    periodic checkpoints hold its adapter only (its last one holds the merged model too)."""
    if os.path.isdir(os.path.join(resume_dir, "adapter")) and not os.path.isfile(
        os.path.join(resume_dir, "config.json")
    ):
        raise UserError(
            f"--eval-only --resume: {resume_dir} holds a LoRA adapter, not a whole model (a "
            "--lora-rank run's checkpoint before its last). Pass the run's --lora-rank (and its "
            "other --lora-* flags) to evaluate --model with the adapter on."
        )


def checkpoint_policy(model, args, resume_dir, start):
    """--eval-only --resume: π_θ as the checkpoint holds it (`start`: checkpoint.starting_weights).
    With --lora-rank, --model with the checkpoint's adapter on, as in training (not merged: merging
    an adapter on a tied lm-head would change the input embedding too); else the checkpoint's own
    weights (setup loaded them already, unless the model is built in code: the demo's)."""
    if start == checkpoint.MODEL_AND_ADAPTER:
        return models.add_lora(model, args, resume_dir).get_base_model()
    if start == checkpoint.MODEL_THEN_CHECKPOINT:
        return checkpoint.load_policy(resume_dir, model, args)
    return model


if __name__ == "__main__":
    sys.stdout, sys.stderr = DevNullWhenReaderGone(sys.stdout), DevNullWhenReaderGone(sys.stderr)
    try:
        main()
    except KeyboardInterrupt as e:  # 130 for Ctrl-C; a signal's 128 + its number (signals.Stopped)
        raise SystemExit(getattr(e, "exit_code", 130)) from None

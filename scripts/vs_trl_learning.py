"""Does our loop learn as TRL's GRPOTrainer does? The same task, prompts, reward and settings under
both; every saved model evaluated by our evaluation on the same held-out draws (issue 46).

    python -m scripts.vs_trl_learning train-ours --model M --seed S  # trainer.py; saves at 20, 40
    BENCH_PYTHON=/work/benchvenv/bin/python \\
        python -m scripts.vs_trl_learning train-trl --model M --seed S  # TRL's GRPOTrainer
    python -m scripts.vs_trl_learning evaluate --model M  # base + every checkpoint x eval seeds
    python -m scripts.vs_trl_learning report              # the table and the plot again

The full comparison (docs/results.md, "Our loop against TRL's GRPOTrainer"): SmolLM2-135M-Instruct
(a local directory or the Hub's) on --task addition with ADDITION_DEFAULTS (40 steps of 4
questions x G = 8, lr 2e-5 constant, beta 0.04, T = 0.7 without top-k/top-p, 48 new tokens), two
seeds each side, one run after the other, with the same thread count:

    M=/work/smollm2-135m                 # or SmolLM2-135M-Instruct (the Hub)
    export BENCH_PYTHON=/work/benchvenv/bin/python
    for S in 1 2; do
        python -m scripts.vs_trl_learning train-ours --model $M --seed $S --threads 2
        python -m scripts.vs_trl_learning train-trl --model $M --seed $S --threads 2
    done
    python -m scripts.vs_trl_learning evaluate --model $M --threads 2   # 9 models x 3 eval seeds

Everything goes under --root (runs/vs-trl): ours-sS/ and trl-sS/, each with run.json (wall time, CPU
time, the load average before, during and after); evals.jsonl (a line per model and eval seed, so
an interrupted `evaluate` goes on where it stopped); table.md and accuracy.png.

What each side runs:
- ours: `trainer.py --model M --task addition --seed S --steps 20 --save-every 20 --eval-every
  -1`, then the same with `--steps 40 --resume`. trainer.py keeps one checkpoint, replaced at
  every save, so step 20's model is copied to ours-sS/step-20 in between; step 40's stays in
  ours-sS/run/checkpoint. A resumed run is bit-identical to an uninterrupted one
  (tests/test_faults.py), --steps may change on resume, and the schedule is constant.
- TRL: `trl-worker` under $BENCH_PYTHON (TRL is not in requirements.txt): GRPOTrainer with the
  settings the same trainer.py flags mean (trl_config_kwargs). Its dataset is ordered step by step
  as our loop draws (data.batch_at with the run's seed) and its own shuffle is off, so its sampler
  hands it our prompts at every step. The reward function records them, and the run fails if they
  differ. The reward is our task's own scoring (Task.score). Checkpoints at steps 20 and 40
  (checkpoint-20/, checkpoint-40/) are ordinary save_pretrained directories.
- evaluate: `trainer.py --task addition --eval-only --model DIR --eval-seed E` (in this process),
  E = 0, 1, 2, on the base model and every checkpoint: 100 held-out questions x 8 samples at
  T = 0.7, the same draws for every model under the same E.

Any trainer.py flag after `--` goes to both sides, or to the evaluation (e.g. `-- --max-new-tokens
8` for a smoke run). A flag TRL has no counterpart for (UNMAPPED) is refused before anything runs.
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time

import config
from support.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ROOT = os.path.join("runs", "vs-trl")
STEPS = config.ADDITION_DEFAULTS["steps"]  # 40
SAVE_EVERY = 20
EVAL_SEEDS = (0, 1, 2)
TRAINERS = {"ours": "ours (trainer.py)", "trl": "TRL GRPOTrainer"}
METRIC = "correctness"  # --task addition's reward: the last number equals the sum

# trainer.py flags without a TRL counterpart (or not mapped here): each must keep its default.
# num_iterations 1: one update per step, as in the comparison's settings.
UNMAPPED = {
    "num_iterations": 1,
    "dynamic_sampling": False,
    "surrogate": "clip",
    "ratio_level": "token",
    "delta": None,
    "top_entropy_quantile": 1.0,
    "off_policy_mask": None,
    "sampler_correction": None,
    "log_mismatch": False,
    "num_beams": 1,
    "lora_rank": 0,
    "tool": [],
    "reward_model": [],
    "overlong_buffer": 0,
    "ref_update_every": 0,
    "response_prefix": "",
    "compile": None,
    "fsdp": False,
    "max_prompt_length": None,
    "stop_when_zero_std": 0,
    "kl_estimator": "k3",
    "kl_in_reward": False,
    "multi_reward": "sum",  # TRL's normalize_then_sum: not mapped (--task addition has one reward)
}


# --------------------------------------------------------------------------------------------------
# What both sides train on: the flags, and the prompts of each step.


def shared_flags(model, seed, steps, extra=()):
    """The trainer.py flags of one run (ours and TRL's alike): --task addition's defaults, then
    `extra`."""
    return ["--model", model, "--task", "addition", "--seed", str(seed), "--steps", str(steps)] + [
        str(x) for x in extra
    ]


def save_points(steps, every):
    """The steps whose models are saved and evaluated: every `every`, and the last."""
    return sorted({*range(every, steps + 1, every), steps}) if every > 0 else [steps]


def prompts_per_step(args):
    """Prompts per optimizer step, as trainer.Settings counts them (one process)."""
    return args.batch_size * args.gradient_accumulation_steps


def step_rows(rows, per_step, seed, steps):
    """The rows of each step 0..steps-1, as our loop draws them (trainer.train, line 5)."""
    import data

    return [data.batch_at(rows, per_step, seed, step) for step in range(steps)]


def repeat_sampler_steps(n_rows, per_step, group_size, steps):
    """The dataset indices TRL's GRPOTrainer trains on at each step, for a dataset of `n_rows` read
    in order (shuffle_dataset=False), one generation batch of `per_step` prompts per step, each
    prompt repeated `group_size` times in a row (its group), one update per batch (num_iterations
    1): read from trl/trainer/utils.py (RepeatSampler) and GRPOTrainer._get_train_sampler. Indices
    of a last, incomplete batch are dropped."""
    order = list(range(n_rows))
    batches = [order[i : i + per_step] for i in range(0, n_rows, per_step)]
    batches = [b for b in batches if len(b) == per_step][:steps]
    return [[i for i in b for _ in range(group_size)] for b in batches]


def check_mappable(args):
    """SystemExit naming every flag without a TRL counterpart that is not at its default."""
    bad = [k for k, v in UNMAPPED.items() if getattr(args, k) != v]
    if bad:
        raise SystemExit(
            "error: no TRL counterpart mapped for "
            + ", ".join(f"--{k.replace('_', '-')} {getattr(args, k)!r}" for k in bad)
            + " (scripts/vs_trl_learning.py: UNMAPPED); drop them to compare the two loops."
        )


def trl_config_kwargs(args, output_dir):
    """GRPOConfig's fields for the run trainer.py's parsed flags `args` describe, each set to what
    the flag means (TRL 1.16). TRL counts its batch in completions, ours in prompts. loss_type
    "grpo", scale_rewards "group" and use_bias_correction_kl off are ours (the paper's eq. 3),
    not TRL's defaults (docs/trl.md). Checkpoints are saved by trl_worker's callback."""
    check_mappable(args)
    G = args.num_generations
    return dict(
        output_dir=output_dir,
        seed=args.seed,
        use_cpu=args.device == "cpu",
        bf16=args.dtype == "bf16",
        fp16=args.dtype == "fp16",
        per_device_train_batch_size=args.batch_size * G,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_generations=G,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        beta=args.beta,
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high,  # None: epsilon, in both
        loss_type=args.loss_type,
        scale_rewards=args.scale_rewards,
        use_bias_correction_kl=args.kl_bias_correction,
        mask_truncated_completions=args.mask_truncated,
        disable_dropout=not args.dropout,
        num_iterations=args.num_iterations,
        learning_rate=args.lr,
        lr_scheduler_type=args.lr_scheduler,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        optim="adamw_torch_fused",  # trainer.build_optimizer: fused AdamW, torch's defaults
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        gradient_checkpointing=bool(args.gradient_checkpointing),  # unset: off (ours: off at 135M)
        max_steps=args.steps,
        shuffle_dataset=False,  # the dataset is in our loop's order already
        dataloader_num_workers=0,
        save_strategy="no",
        logging_strategy="steps",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
    )


# --------------------------------------------------------------------------------------------------
# TRL's side (runs under $BENCH_PYTHON).


def trl_worker(a):
    """TRL's GRPOTrainer on the run that trainer.py's flags `a.flags` describe, into a.out: the
    dataset in our loop's order, our task's scoring as its reward, checkpoint-N/ at each a.save_at.
    Exits non-zero if TRL trained on other prompts than ours would have, in another order."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import trainer
    from support import models

    if a.threads:
        torch.set_num_threads(a.threads)
    args = config.parse_args([*a.flags, "--eval-every", "-1", "--output-dir", a.out])
    kwargs = trl_config_kwargs(args, a.out)
    task = trainer.load_task(args)
    if task.tools is not None or any(row.get("fields") for row in task.train):
        raise SystemExit("error: a task with tools or extra fields is not mapped to TRL here")
    G, per_step = args.num_generations, prompts_per_step(args)
    steps = step_rows(task.train, per_step, args.seed, args.steps)
    model, tokenizer = models.load_model(args.model, args.trust_remote_code)
    rows = [row for batch in steps for row in batch]
    prompts = [task.prompt(tokenizer, row["prompt"]) for row in rows]
    # TRL tokenizes a text prompt with the tokenizer's special tokens, ours without: they must agree
    if (
        tokenizer(prompts[:1])["input_ids"]
        != tokenizer(prompts[:1], add_special_tokens=False)["input_ids"]
    ):
        raise SystemExit("error: this tokenizer adds special tokens to a prompt; ours does not")
    dataset = Dataset.from_dict(
        {
            "prompt": prompts,
            "question": [row["prompt"] for row in rows],
            "answer": [row["answer"] for row in rows],
        }
    )
    seen = []  # [(step, [questions, one per group])]

    def reward(prompts, completions, question, answer, completion_ids, trainer_state, **_):
        groups = [question[i : i + G] for i in range(0, len(question), G)]
        if any(len(set(g)) != 1 for g in groups):
            raise RuntimeError(f"TRL's batch is not whole groups of {G}: {question}")
        seen.append((trainer_state.global_step + 1, [g[0] for g in groups]))
        scored = [{"prompt": q, "answer": ans} for q, ans in zip(question, answer)]
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        total, _ = task.score(scored, completions, 1, lengths)
        return total.tolist()

    reward.__name__ = "+".join(r.name for r in task.rewards)
    os.makedirs(a.out, exist_ok=True)
    log = open(os.path.join(a.out, "metrics.jsonl"), "w")

    class Record(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            log.write(
                json.dumps({"step": state.global_step, "step_s": time.perf_counter() - self.t0})
            )
            log.write("\n")
            if state.global_step in a.save_at:
                control.should_save = True

        def on_log(self, args_, state, control, logs=None, **kw):
            log.write(json.dumps({"step": state.global_step, **(logs or {})}) + "\n")
            log.flush()

    grpo = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=GRPOConfig(**kwargs),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Record()],
    )
    grpo.train()
    log.close()
    want = [(s + 1, [row["prompt"] for row in batch]) for s, batch in enumerate(steps)]
    with open(os.path.join(a.out, "prompts_seen.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "questions": q}) + "\n" for s, q in seen)
    if seen != want:
        first = next((i for i, (x, y) in enumerate(zip(seen, want)) if x != y), len(want))
        raise SystemExit(
            f"error: TRL trained on other prompts than our loop draws (first difference at step "
            f"{first + 1} of {len(want)}; {len(seen)} steps seen): prompts_seen.jsonl"
        )
    missing = [s for s in a.save_at if not os.path.isdir(os.path.join(a.out, f"checkpoint-{s}"))]
    if missing:
        raise SystemExit(f"error: TRL saved no checkpoint at steps {missing}")
    info = dict(
        trl=trl.__version__,
        transformers=transformers.__version__,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        config={k: v for k, v in kwargs.items() if k != "output_dir"},
        prompts_checked=len(seen),
        **as_built(grpo, model, tokenizer),
    )
    with open(os.path.join(a.out, "trl.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"TRL: {len(seen)} steps on our loop's prompts, saved at {a.save_at}", flush=True)


def as_built(grpo, model, tokenizer):
    """What TRL's trainer actually ran with, beside ours where they must agree: AdamW's settings,
    the precision of π_θ and π_ref, gradient checkpointing, dropout, the sampling settings and the
    ids that end a completion (ours: sampling.eos_token_ids)."""
    import torch

    import sampling

    opt = getattr(grpo.optimizer, "optimizer", grpo.optimizer)  # accelerate's wrapper
    # per parameter group: the trainer sets lr and weight decay there, not in the defaults
    keys = ("lr", "betas", "eps", "weight_decay", "amsgrad", "fused")
    groups = {json.dumps({k: g.get(k) for k in keys}) for g in opt.param_groups}
    gen = grpo.generation_config
    dropouts = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    return dict(
        optimizer={"class": type(opt).__name__, "groups": [json.loads(g) for g in sorted(groups)]},
        policy_dtype=str(next(model.parameters()).dtype),
        reference_dtype=None
        if grpo.ref_model is None
        else str(next(grpo.ref_model.parameters()).dtype),
        gradient_checkpointing=bool(getattr(model, "gradient_checkpointing", False))
        or any(getattr(m, "gradient_checkpointing", False) for m in model.modules()),
        dropout_max=max(dropouts, default=0.0),
        sampling={
            k: getattr(gen, k)
            for k in ("do_sample", "temperature", "top_p", "top_k", "min_p", "max_new_tokens")
        },
        repetition_penalty=gen.repetition_penalty,
        eos_token_ids=list(grpo.eos_token_ids),
        eos_token_ids_ours=sampling.eos_token_ids(model, tokenizer),
    )


# --------------------------------------------------------------------------------------------------
# The drivers: each run timed, with the machine's load.


class LoadSampler:
    """/proc/loadavg before, every `every` seconds during, and after a block; CPU time (user +
    system) of the child processes that ended in it; wall time."""

    def __init__(self, every=15.0):
        self.every, self.samples, self.stop = every, [], threading.Event()

    def __enter__(self):
        self.before, self.t0 = loadavg(), time.time()
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.cpu0 = usage.ru_utime + usage.ru_stime
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(self.every):
            self.samples.append(loadavg()[0])

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.record = dict(
            wall_s=time.time() - self.t0,
            cpu_s=usage.ru_utime + usage.ru_stime - self.cpu0,
            load_before=self.before,
            load_after=loadavg(),
            load_during_mean_1min=statistics.mean(self.samples) if self.samples else None,
            load_during_max_1min=max(self.samples) if self.samples else None,
            cores=os.cpu_count(),
        )


def loadavg():
    """The 1, 5 and 15-minute load averages."""
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return list(os.getloadavg())


def child_env(threads):
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def run_dir(a, name):
    """ROOT/NAME-sSEED, refused if a finished run is there."""
    out = os.path.join(a.root, f"{name}-s{a.seed}")
    if os.path.exists(os.path.join(out, "run.json")):
        raise SystemExit(f"error: {out} holds a finished run (run.json); remove it to run again")
    if os.path.exists(out):
        raise SystemExit(f"error: {out} holds an unfinished run; remove it to start over")
    os.makedirs(out)
    return out


def write_run(out, trainer_name, a, checkpoints, timing, extra=None):
    record = dict(
        trainer=trainer_name,
        seed=a.seed,
        model=a.model,
        steps=a.steps,
        flags=a.flags,
        threads=a.threads or os.environ.get("OMP_NUM_THREADS"),
        checkpoints={str(s): os.path.relpath(p, out) for s, p in checkpoints.items()},
        started=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timing["started"])),
        **timing["record"],
        **(extra or {}),
    )
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record), flush=True)
    return record


def train_ours(a):
    """trainer.py to each save point in turn (--resume after the first), step N's model copied to
    ours-sS/step-N (the last one stays in run/checkpoint)."""
    out = run_dir(a, "ours")
    run, points, checkpoints = os.path.join(out, "run"), save_points(a.steps, a.save_every), {}
    started, env = time.time(), child_env(a.threads)
    with LoadSampler() as load:
        for i, point in enumerate(points):
            flags = shared_flags(a.model, a.seed, point, a.flags)
            flags += ["--save-every", str(a.save_every), "--eval-every", "-1", "--output-dir", run]
            cmd = [sys.executable, "trainer.py", *flags, *(["--resume"] if i else [])]
            print("$ " + " ".join(cmd), flush=True)
            subprocess.run(cmd, cwd=ROOT, env=env, check=True)
            saved = os.path.join(run, "checkpoint")
            if point != points[-1]:
                checkpoints[point] = os.path.join(out, f"step-{point}")
                # the model and tokenizer: AdamW's state stays behind (evaluation needs none)
                shutil.copytree(
                    saved, checkpoints[point], ignore=shutil.ignore_patterns("training_state.pt")
                )
            else:
                checkpoints[point] = saved
    steps_s = sum(r.get("step_time", 0.0) for r in read_jsonl(os.path.join(run, "metrics.jsonl")))
    timing = dict(started=started, record=load.record)
    return write_run(out, "ours", a, checkpoints, timing, dict(steps_s=steps_s))


def train_trl(a):
    """trl_worker under $BENCH_PYTHON, after checking that that Python imports trl."""
    from scripts import bench

    check_trl(bench)
    out = run_dir(a, "trl")
    points = save_points(a.steps, a.save_every)
    flags = shared_flags(a.model, a.seed, a.steps, a.flags)
    cmd = [bench.trl_python(), "-m", "scripts.vs_trl_learning", "trl-worker", "--out", out]
    cmd += ["--save-at", *map(str, points), "--threads", str(a.threads or 0), "--", *flags]
    print("$ " + " ".join(cmd), flush=True)
    started = time.time()
    with LoadSampler() as load:
        subprocess.run(cmd, cwd=ROOT, env=child_env(a.threads), check=True)
    checkpoints = {p: os.path.join(out, f"checkpoint-{p}") for p in points}
    steps_s = sum(r.get("step_s", 0.0) for r in read_jsonl(os.path.join(out, "metrics.jsonl")))
    with open(os.path.join(out, "trl.json")) as f:
        versions = {k: v for k, v in json.load(f).items() if k in ("trl", "transformers", "torch")}
    timing = dict(started=started, record=load.record)
    return write_run(out, "trl", a, checkpoints, timing, dict(steps_s=steps_s, **versions))


# --------------------------------------------------------------------------------------------------
# Evaluation: every saved model under every eval seed, by trainer.py --eval-only.


def check_trl(bench):
    """SystemExit (one paragraph, exit 2) unless $BENCH_PYTHON (else this Python) imports trl."""
    python = bench.trl_python()
    try:
        proc = subprocess.run([python, "-c", "import trl"], capture_output=True, text=True)
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    except OSError as e:
        proc, why = None, f"{type(e).__name__}: {e}"
    if proc is not None and proc.returncode == 0:
        return
    where = "BENCH_PYTHON=" if "BENCH_PYTHON" in os.environ else "BENCH_PYTHON is unset; "
    print(
        f"error: train-trl runs TRL in its own environment (TRL is not in requirements.txt), the "
        f"Python that BENCH_PYTHON names; {where}{python} cannot import trl ({why}). Make it once: "
        f"`{bench.TRL_VENV[0]} && {bench.TRL_VENV[1]}`, then `BENCH_PYTHON=benchvenv/bin/python "
        "python -m scripts.vs_trl_learning train-trl ...`.",
        file=sys.stderr,
    )
    sys.exit(2)


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def runs(root):
    """Each finished run's run.json (with its directory as "dir"), ours first, by seed."""
    found = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name, "run.json")
        if os.path.isfile(path):
            with open(path) as f:
                found.append({**json.load(f), "dir": os.path.join(root, name)})
    return sorted(found, key=lambda r: (list(TRAINERS).index(r["trainer"]), r["seed"]))


def models_to_evaluate(root, base):
    """[(trainer, seed, step, model directory)]: the base model (step 0) and every checkpoint."""
    jobs = [("base", None, 0, base)]
    for r in runs(root):
        for step, path in sorted(r["checkpoints"].items(), key=lambda kv: int(kv[0])):
            jobs.append((r["trainer"], r["seed"], int(step), os.path.join(r["dir"], path)))
    return jobs


def check_same_prompt(base_tokenizer, directory):
    """A checkpoint's tokenizer must give the held-out prompts the base model's token ids."""
    from transformers import AutoTokenizer

    import data
    from support import models

    tokenizer = models.prepare_tokenizer(AutoTokenizer.from_pretrained(directory))
    task = data.addition_task()
    texts = [task.prompt(t, task.eval[0]["prompt"]) for t in (base_tokenizer, tokenizer)]
    ids = [
        t(x, add_special_tokens=False)["input_ids"]
        for t, x in zip((base_tokenizer, tokenizer), texts)
    ]
    if ids[0] != ids[1]:
        raise SystemExit(
            f"error: {directory}'s tokenizer makes other prompts than the base model's"
        )


def evaluate(a):
    """Each model x eval seed not yet in ROOT/evals.jsonl, appended there as it finishes."""
    import torch
    from transformers import AutoTokenizer

    import trainer
    from support import models

    if a.threads:
        torch.set_num_threads(a.threads)
    path = os.path.join(a.root, "evals.jsonl")
    done = {(r["trainer"], r["seed"], r["step"], r["eval_seed"]) for r in read_jsonl(path)}
    jobs = models_to_evaluate(a.root, a.model)
    base_tokenizer = None
    if os.path.isdir(os.path.expanduser(a.model)):
        base_tokenizer = models.prepare_tokenizer(AutoTokenizer.from_pretrained(a.model))
    for name, seed, step, directory in jobs:
        if name != "base" and base_tokenizer is not None:
            check_same_prompt(base_tokenizer, directory)
        for eval_seed in a.eval_seeds:
            if (name, seed, step, eval_seed) in done:
                continue
            argv = ["--task", "addition", "--eval-only", "--model", directory]
            argv += ["--eval-seed", str(eval_seed), *a.flags]
            print(
                f"== {name} seed {seed} step {step}, eval seed {eval_seed}: {directory}", flush=True
            )
            t0 = time.time()
            result = trainer.main(argv)
            row = dict(trainer=name, seed=seed, step=step, eval_seed=eval_seed, model=directory)
            row.update(result, wall_s=time.time() - t0, load=loadavg())
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
    report(a)


# --------------------------------------------------------------------------------------------------
# The table and the plot, from evals.jsonl and the runs' run.json.


def summarize(evals, metric):
    """{trainer: {step: {"seeds": {seed: (mean over eval seeds, their std or None)}, "mean": mean
    over training seeds, "low"/"high": their range, "noise": the eval seeds' std pooled over those
    models (root mean variance; None with one eval seed)}}}. The base model is every trainer's step
    0."""
    models = {}
    for r in evals:
        if metric in r:
            models.setdefault((r["trainer"], r["seed"], r["step"]), []).append(r[metric])
    trainers = sorted({t for t, _, _ in models if t != "base"}, key=list(TRAINERS).index)
    out = {}
    for t in trainers:
        seeds = sorted({s for tt, s, _ in models if tt == t})
        steps = sorted({st for tt, _, st in models if tt == t} | {0})
        out[t] = {}
        for step in steps:
            per_seed = {}
            for s in seeds:
                values = models.get(("base", None, 0) if step == 0 else (t, s, step))
                if values:
                    sd = statistics.stdev(values) if len(values) > 1 else None
                    per_seed[s] = (statistics.mean(values), sd)
            if not per_seed:
                continue
            means = [m for m, _ in per_seed.values()]
            sds = [sd for _, sd in per_seed.values() if sd is not None]
            out[t][step] = dict(
                seeds=per_seed,
                mean=statistics.mean(means),
                low=min(means),
                high=max(means),
                noise=(statistics.mean(x * x for x in sds) ** 0.5) if sds else None,
            )
    return out


def metric_names(evals):
    """The metrics reported: mean accuracy, then maj@k and pass@k where evaluations have them."""
    keys = {k for r in evals for k in r}
    extra = sorted(
        k for k in keys if k.startswith(f"{METRIC}_maj@") or k.startswith(f"{METRIC}_pass@")
    )
    return [METRIC] + extra


def metric_label(metric):
    if metric == METRIC:
        return "mean accuracy (pass@1)"
    return metric.split("_", 1)[1]


def fmt(x, digits=4):
    return "" if x is None else f"{x:.{digits}f}"


def accuracy_table(evals, metric):
    s = summarize(evals, metric)
    steps = sorted({st for t in s for st in s[t]})
    lines = [
        f"| {metric_label(metric)} | " + " | ".join(f"step {st}" for st in steps) + " |",
        "|---|" + "---|" * len(steps),
    ]
    for t, by_step in s.items():
        seeds = sorted({seed for v in by_step.values() for seed in v["seeds"]})
        for seed in seeds:
            cells = []
            for st in steps:
                m, sd = by_step.get(st, {}).get("seeds", {}).get(seed, (None, None))
                cells.append("" if m is None else fmt(m) + ("" if sd is None else f" ± {fmt(sd)}"))
            lines.append(f"| {TRAINERS[t]}, seed {seed} | " + " | ".join(cells) + " |")
        cells = [
            f"**{fmt(v['mean'])}** ({fmt(v['low'])}–{fmt(v['high'])})" if v else ""
            for v in (by_step.get(st) for st in steps)
        ]
        lines.append(f"| **{TRAINERS[t]}, mean over seeds** (range) | " + " | ".join(cells) + " |")
    if {"ours", "trl"} <= set(s):
        cells = [
            fmt(s["ours"][st]["mean"] - s["trl"][st]["mean"])
            if st in s["ours"] and st in s["trl"]
            else ""
            for st in steps
        ]
        lines.append("| ours − TRL (means over seeds) | " + " | ".join(cells) + " |")
    noise = []
    for st in steps:
        sds = [s[t][st]["noise"] for t in s if st in s[t] and s[t][st]["noise"] is not None]
        noise.append(fmt(statistics.mean(x * x for x in sds) ** 0.5) if sds else "")
    lines.append("| eval noise: std over eval seeds (pooled) | " + " | ".join(noise) + " |")
    return "\n".join(lines)


def minutes(seconds):
    if seconds is None:
        return ""
    return f"{seconds:.1f} s" if seconds < 60 else f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def wall_table(root):
    lines = [
        "| run | wall time | in training steps | CPU time (user + sys) | threads | load avg before "
        "(1/5/15 min) | 1-min load during: mean, max | after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs(root):
        load = " / ".join(f"{x:.2f}" for x in r["load_before"])
        after = " / ".join(f"{x:.2f}" for x in r["load_after"])
        during = "not sampled (under 15 s)"
        if r["load_during_mean_1min"] is not None:
            during = f"{r['load_during_mean_1min']:.2f}, {r['load_during_max_1min']:.2f}"
        lines.append(
            f"| {TRAINERS[r['trainer']]}, seed {r['seed']} | {minutes(r['wall_s'])} | "
            f"{minutes(r.get('steps_s'))} | {minutes(r['cpu_s'])} | {r.get('threads') or ''} | "
            f"{load} | {during} | {after} |"
        )
    return "\n".join(lines)


def report(a):
    """ROOT/table.md (printed too) and ROOT/accuracy.png from evals.jsonl and the runs."""
    evals = read_jsonl(os.path.join(a.root, "evals.jsonl"))
    if not evals:
        raise SystemExit(f"error: no evaluations in {a.root}/evals.jsonl: run `evaluate` first")
    seeds = sorted({r["eval_seed"] for r in evals})
    parts = [
        f"Held-out questions: evaluated with eval seeds {', '.join(map(str, seeds))}; each cell is "
        "the mean over them ± their std (one model); step 0 is the base model.",
        *(accuracy_table(evals, m) for m in metric_names(evals)),
        "Wall time of each run (the machine's load alongside):",
        wall_table(a.root),
    ]
    text = "\n\n".join(parts) + "\n"
    with open(os.path.join(a.root, "table.md"), "w") as f:
        f.write(text)
    print(text)
    png = plot(evals, os.path.join(a.root, "accuracy.png"), training_curves(a.root))
    if png:
        print(f"wrote {png}")


# Each run's own log, per step: (our metrics.jsonl key, TRL's), and the panel's title.
CURVES = (
    ("reward", "reward", "training reward (batch mean)"),
    ("kl", "kl", "KL to the reference (per token)"),
    ("completion_len_mean", "completions/mean_length", "completion length (tokens)"),
)


def training_curves(root):
    """{trainer: {seed: {title: [(step, value)]}}} from each run's log: ours-sS/run/metrics.jsonl,
    trl-sS/metrics.jsonl (its on_log lines)."""
    out = {}
    for r in runs(root):
        log = os.path.join(r["dir"], "run", "metrics.jsonl")
        if r["trainer"] == "trl":
            log = os.path.join(r["dir"], "metrics.jsonl")
        rows = [row for row in read_jsonl(log) if "reward" in row]
        column = 0 if r["trainer"] == "ours" else 1
        out.setdefault(r["trainer"], {})[r["seed"]] = {
            c[2]: [(row["step"], row[c[column]]) for row in rows if c[column] in row]
            for c in CURVES
        }
    return out


def running_mean(values, k=5):
    return [statistics.mean(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


def plot(evals, path, curves=None):
    """Top: held-out accuracy (and maj@k, pass@k) against step: each trainer's mean over training
    seeds (thick), each seed (thin, dashed), the eval noise as a band (± the pooled std over eval
    seeds) around the mean. Below, where the runs' logs are there: their training reward, KL and
    completion length per step (mean over seeds, 5-step running mean). Returns the path, or None
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)")
        return None
    metrics, curves = metric_names(evals), curves or {}
    rows, cols = 2 if curves else 1, max(len(metrics), len(CURVES))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    colors = {t: f"C{i}" for i, t in enumerate(TRAINERS)}
    for ax, metric in zip(axes[0], metrics):
        for t, by_step in summarize(evals, metric).items():
            steps, color = sorted(by_step), colors[t]
            mean = [by_step[st]["mean"] for st in steps]
            noise = [by_step[st]["noise"] or 0.0 for st in steps]
            low, high = [m - n for m, n in zip(mean, noise)], [m + n for m, n in zip(mean, noise)]
            ax.fill_between(steps, low, high, color=color, alpha=0.18, lw=0)
            ax.plot(steps, mean, color=color, lw=2.2, marker="o", label=f"{TRAINERS[t]}: mean")
            seeds = sorted({s for st in steps for s in by_step[st]["seeds"]})
            for j, seed in enumerate(seeds):
                xs = [st for st in steps if seed in by_step[st]["seeds"]]
                ys = [by_step[st]["seeds"][seed][0] for st in xs]
                marker = "os^v"[j % 4]
                ax.plot(xs, ys, color=color, lw=0.8, alpha=0.7, ls="--", marker=marker, ms=4)
        ax.set(xlabel="step", ylim=(0, None))
        ax.set_title(f"held-out {metric_label(metric)}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("100 questions x 8 samples")
    axes[0][0].legend(fontsize=7, title="dashed: each seed; band: ± eval noise", title_fontsize=7)
    for ax, (_, _, title) in zip(axes[1] if curves else [], CURVES):
        for t, by_seed in curves.items():
            series = [dict(c[title]) for c in by_seed.values() if c[title]]
            steps = sorted(set.intersection(*(set(x) for x in series))) if series else []
            if steps:
                mean = [statistics.mean(x[st] for x in series) for st in steps]
                ax.plot(steps, running_mean(mean), color=colors[t], label=TRAINERS[t])
        ax.set(xlabel="step")
        ax.set_title(f"{title}, mean of seeds, 5-step mean", fontsize=9)
        ax.grid(alpha=0.3)
    if curves:
        axes[1][0].legend(fontsize=7)
    for ax in axes.flat:
        if not ax.has_data():
            ax.axis("off")
    fig.suptitle("--task addition: our loop and TRL's GRPOTrainer", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------
# The command line.


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    for mode in ("train-ours", "train-trl", "evaluate", "report", "trl-worker"):
        s = sub.add_parser(mode)
        if mode == "trl-worker":  # internal: train-trl runs it under $BENCH_PYTHON
            s.add_argument("--out", required=True)
            s.add_argument("--save-at", type=int, nargs="+", required=True)
            s.add_argument("--threads", type=int, default=0)
            s.add_argument("flags", nargs="*", help="trainer.py's flags of the run")
            continue
        s.add_argument("--root", default=DEFAULT_ROOT, help="where the runs and the report go")
        if mode == "report":
            continue
        s.add_argument("--model", required=True, help="a local directory or a Hub id (the base)")
        s.add_argument("--threads", type=int, default=0, help="torch threads (0: as the env says)")
        s.add_argument("flags", nargs="*", help="after --: trainer.py flags for every side")
        if mode == "evaluate":
            s.add_argument("--eval-seeds", type=int, nargs="+", default=list(EVAL_SEEDS))
        else:
            s.add_argument("--seed", type=int, required=True)
            s.add_argument("--steps", type=int, default=STEPS)
            s.add_argument("--save-every", type=int, default=SAVE_EVERY)
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    if a.mode == "trl-worker":
        return trl_worker(a)
    if a.mode in ("train-ours", "train-trl"):
        # every flag checked here, before any model loads (the TRL side parses them the same way)
        try:
            args = config.parse_args(
                shared_flags(a.model, a.seed, a.steps, a.flags) + ["--eval-only"]
            )
        except UserError as e:
            raise SystemExit(f"error: {e}") from None
        check_mappable(args)
        return (train_ours if a.mode == "train-ours" else train_trl)(a)
    if a.mode == "evaluate":
        return evaluate(a)
    return report(a)


if __name__ == "__main__":
    main()

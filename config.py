"""The command line of train.py: every flag with its default and help, and the checks that turn bad input into one
clear paragraph (UserError) instead of a traceback. `python train.py --help` prints the same list.

The defaults are the settings of Pramodith's GRPO trainer blog, whose SmolLM2-1.7B-Instruct run on GSM8K this
project sets out to reproduce; --demo swaps in DEMO_DEFAULTS.
"""

import argparse
import math
import os
import re

import torch

from support import trackers
from support.errors import UserError


def build_parser():
    p = argparse.ArgumentParser(
        description="GRPO (DeepSeekMath eq. 3) on GSM8K with a hand-written loop.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_and_grpo_flags(p)
    add_reward_flags(p)
    add_sampling_and_optimization_flags(p)
    add_run_flags(p)
    return p


def add_model_and_grpo_flags(p):
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--model",
        default="SmolLM2-1.7B-Instruct",
        help="a local directory, a Hugging Face hub id (owner/name), or a SmolLM2 short name "
        "(SmolLM2-135M, SmolLM2-360M, SmolLM2-1.7B, with or without -Instruct; -> HuggingFaceTB/...)",
    )
    g.add_argument(
        "--task",
        choices=["gsm8k", "addition"],
        default="gsm8k",
        help="gsm8k: GSM8K (or your own JSONL with --prompt-field/--answer-field); addition: the built-in "
        "two-digit addition task (data.addition_rows: generated, no download; its defaults are "
        "ADDITION_DEFAULTS)",
    )
    g.add_argument(
        "--data",
        default=None,
        help="train rows: a JSONL file, or a Hugging Face dataset as SOURCE[:CONFIG][@SPLIT] (a Hub "
        "id, a save_to_disk directory, a folder of data files, a Parquet, CSV or JSON-array file; "
        "e.g. openai/gsm8k:main@train; no @SPLIT: train; needs pip install datasets), read as GSM8K "
        "or, with --prompt-field/--answer-field, as they are; if not given, GSM8K's official train "
        "split is downloaded once (into ~/.cache/grpo)",
    )
    g.add_argument(
        "--eval-data",
        default=None,
        help="held-out rows in the same format as --data, a JSONL file or a dataset (no @SPLIT: "
        "test); if not given, for GSM8K: the test split of --data, or test.jsonl (test.parquet, "
        "test/) beside it if there is one, else the official test split (downloaded once); for "
        "your own task: no evaluation",
    )
    g.add_argument(
        "--prompt-field",
        default=None,
        help="your own task: the field of each JSONL row holding the prompt (a string); given (or "
        "--answer-field), rows are read as they are instead of as GSM8K; default then: prompt",
    )
    g.add_argument(
        "--answer-field",
        default=None,
        help="your own task: the field holding the reference answer, passed to the reward functions as it "
        "is (any JSON value); default with --prompt-field: answer",
    )
    g.add_argument(
        "--system-prompt",
        default=None,
        help="the system message, as text (\\n decoded) or @FILE; '' for none; if not given, GSM8K's "
        "prompt (data.SYSTEM_PROMPT) for GSM8K and none for your own task",
    )
    g.add_argument(
        "--response-prefix",
        default="",
        help="text written at the start of every reply, after the chat template's generation prompt, "
        'e.g. "<think>\\n" (\\n and \\t are decoded); the rewards score prefix + completion',
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers run model code shipped with the checkpoint (off: built-in architectures "
        "only)",
    )

    g = p.add_argument_group("GRPO (DeepSeekMath eq. 3)")
    g.add_argument(
        "--num-generations",
        type=int,
        default=8,
        help="G, completions sampled per prompt (the group)",
    )
    g.add_argument(
        "--beta",
        type=float,
        default=0.04,
        help="KL coefficient; 0 skips the reference model entirely (none is loaded)",
    )
    g.add_argument(
        "--epsilon",
        type=float,
        default=0.2,
        help="clip range: the ratio is clipped to [1-eps, 1+eps_high]",
    )
    g.add_argument(
        "--epsilon-high",
        type=float,
        default=None,
        help="upper clip bound (DAPO clip-higher, arXiv 2503.14476); if not given, --epsilon",
    )
    g.add_argument(
        "--loss-type",
        default="grpo",
        choices=["grpo", "dapo", "dr_grpo"],
        help="grpo: 1/G sum_i 1/|o_i| sum_t (the paper); dapo: token-level mean; "
        "dr_grpo: sum / (N * max-new-tokens) (arXiv 2503.20783)",
    )
    g.add_argument(
        "--scale-rewards",
        default="group",
        choices=["group", "batch", "none"],
        help="advantage = (r - group mean) / std of the group | of the batch | no division (Dr. GRPO)",
    )
    g.add_argument(
        "--ratio-level",
        default="token",
        choices=["token", "sequence"],
        help="token: eq. 3; sequence: one ratio per completion (GSPO, arXiv 2507.18071)",
    )
    g.add_argument(
        "--delta",
        type=float,
        default=None,
        help="dual clip: cap the ratio at delta where the advantage is negative (two-sided clipping, "
        "INTELLECT-2); must exceed 1 + epsilon-high; if not given, off",
    )
    g.add_argument(
        "--mask-truncated",
        action="store_true",
        help="completions that hit --max-new-tokens without EOS get no loss (their mask is all 0)",
    )
    g.add_argument(
        "--dynamic-sampling",
        action="store_true",
        help="DAPO: drop groups whose rewards are all equal and sample more prompts until the step holds "
        "batch-size x gradient-accumulation-steps groups with spread (at most --max-resample more "
        "generate calls)",
    )
    g.add_argument(
        "--max-resample",
        type=int,
        default=3,
        help="with --dynamic-sampling: extra generate calls per step at most",
    )
    g.add_argument(
        "--num-iterations",
        type=int,
        default=1,
        help="mu, optimizer updates per batch of samples; >1 keeps the first iteration's log-probs as "
        "pi_old's",
    )


def add_reward_flags(p):
    g = p.add_argument_group("rewards")
    g.add_argument(
        "--reward-fn",
        action="append",
        metavar="MODULE:FUNCTION",
        default=[],
        help="a reward function fn(completions, answers, **fields) -> list of floats, e.g. "
        "my_rewards:brevity (./my_rewards.py), or a built-in: correctness, format; repeatable. "
        "Given, it replaces the task's own rewards (GSM8K: correctness and format; demo: correctness)",
    )
    g.add_argument(
        "--extract-answer",
        metavar="MODULE:FUNCTION",
        default=None,
        help="for maj@k in evaluation: fn(completion) -> the answer it gives (a string) or None, e.g. "
        "my_rewards:final_answer, or a built-in: gsm8k (the last number in <answer>...</answer>), "
        "last-number. Given, it replaces the task's own (GSM8K and the demo: gsm8k; addition: last-number; "
        "your own task: none, so no maj@k)",
    )
    g.add_argument(
        "--reward-model",
        action="append",
        metavar="PATH_OR_ID",
        default=[],
        help="a sequence classifier with one output scoring prompt + response, as one more reward; "
        "repeatable or comma-separated",
    )
    g.add_argument(
        "--reward-weights",
        default=None,
        help="comma-separated weights, in the order: reward functions, then reward models, then the "
        "overlong penalty; if not given, every weight is 1.0; total reward = weighted sum",
    )
    g.add_argument(
        "--overlong-buffer",
        type=int,
        default=0,
        help="DAPO's soft overlong punishment as one more reward (rewards/overlong): 0 up to "
        "max-new-tokens - N tokens, then falling linearly to -1 at max-new-tokens; 0: off",
    )
    g.add_argument(
        "--reward-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a reward function (or reward model) that takes longer than this on one step's batch stops the "
        "run as a reward error does (checkpoint saved, exit code 2); 0: no limit",
    )


def add_sampling_and_optimization_flags(p):
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--temperature", type=float, default=0.9, help="sampling temperature for training rollouts"
    )
    g.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling (1.0 = off)")
    g.add_argument("--top-k", type=int, default=50, help="top-k sampling (0 = off)")
    g.add_argument(
        "--max-new-tokens", type=int, default=300, help="generation budget per completion"
    )
    g.add_argument(
        "--num-beams",
        type=int,
        default=1,
        help="K > 1: each group is the G best of K beams of one beam search per prompt (K >= G), not "
        "G samples; 1: sampling",
    )
    g.add_argument(
        "--max-prompt-length",
        type=int,
        default=None,
        help="a longer prompt keeps its last N tokens (with a warning); if not given, the model's context "
        "length minus --max-new-tokens",
    )

    g = p.add_argument_group("optimization")
    g.add_argument(
        "--steps",
        type=int,
        default=200,
        help="training steps; each samples batch-size x gradient-accumulation-steps prompts and makes "
        "num-iterations optimizer updates",
    )
    g.add_argument("--batch-size", type=int, default=1, help="prompts per micro-batch")
    g.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=4,
        help="micro-batches per optimizer update",
    )
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="completions per forward/backward (a multiple of G); if given, replaces batch-size*G to "
        "save memory without changing the math",
    )
    g.add_argument("--lr", type=float, default=5e-5, help="AdamW learning rate")
    g.add_argument(
        "--lr-scheduler",
        default="linear",
        choices=["linear", "cosine", "constant", "constant_with_warmup"],
        help="learning-rate schedule (transformers.get_scheduler) over steps x num-iterations updates",
    )
    g.add_argument("--warmup-steps", type=int, default=0, help="LR warmup, in optimizer updates")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="gradient clipping (global L2 norm); 0: no clipping",
    )
    g.add_argument(
        "--max-nonfinite",
        type=int,
        default=3,
        help="an update whose loss or gradient norm is NaN/inf is skipped (weights and AdamW unchanged); "
        "stop, saving the last good weights, after this many in a row",
    )

    g.add_argument(
        "--dropout",
        action="store_true",
        help="keep the model's own dropout on while training (off by default: with mu > 1, pi_old's and "
        "pi_theta's log-probs would come from different dropout masks, and the ratio would be noise)",
    )

    g = p.add_argument_group("LoRA (needs peft: pip install peft)")
    g.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train LoRA adapters of this rank instead of every weight; the reference model is the base "
        "with the adapters off (no second copy); 0: full fine-tuning",
    )
    g.add_argument(
        "--lora-alpha", type=float, default=None, help="LoRA scaling alpha; if not given, 2 x rank"
    )
    g.add_argument(
        "--lora-dropout",
        type=float,
        default=0.0,
        help="dropout on the LoRA branch (off by default: see --dropout)",
    )
    g.add_argument(
        "--lora-target-modules",
        default="q_proj,v_proj",
        help="comma-separated module names that get adapters",
    )

    g = p.add_argument_group("precision and memory")
    g.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available"
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp16", "fp32"],
        help="autocast compute dtype; parameters and AdamW state stay fp32. auto: bf16 on CUDA, fp32 on CPU",
    )
    g.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun: shard parameters, gradients and AdamW state over the processes (FSDP2, one "
        "unit per decoder layer) instead of replicating them (DDP)",
    )
    g.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in backward: less memory, ~30%% more time",
    )
    g.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="torch.compile the decode step (fixed shapes, static KV cache; CUDA graphs on a GPU) and the "
        "log-prob forwards; BACKEND: a torch.compile backend (inductor if not given; aot_eager checks "
        "the graphs without generating code)",
    )


def add_run_flags(p):
    g = p.add_argument_group("evaluation")
    g.add_argument(
        "--eval-only", action="store_true", help="evaluate --model on the test split and exit"
    )
    g.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="evaluate every N steps; 0: only before and after training; -1: never",
    )
    g.add_argument(
        "--eval-samples", type=int, default=8, help="completions sampled per test question"
    )
    g.add_argument(
        "--eval-temperature",
        type=float,
        default=0.7,
        help="sampling temperature for eval; 0: greedy, one completion per question",
    )
    g.add_argument(
        "--eval-seed",
        type=int,
        default=None,
        help="seed of the evaluation's own RNG; if not given, --seed (fix it to compare runs on the same "
        "draws)",
    )
    g.add_argument(
        "--eval-limit", type=int, default=None, help="evaluate on the first N test questions only"
    )
    g.add_argument(
        "--eval-batch-size", type=int, default=8, help="test questions per generate call"
    )

    g = p.add_argument_group("logging and checkpoints")
    g.add_argument(
        "--output-dir",
        default=None,
        help="metrics.jsonl and checkpoint/ go here; if not given, runs/<model name>[-addition][-lora]-seed<seed>. "
        "A fresh run into a directory holding one is refused (see --resume, --overwrite)",
    )
    g.add_argument(
        "--save-every",
        type=int,
        default=50,
        help="checkpoint every N steps, and always after the last step and before every evaluation after "
        "step 0 (so an evaluation that crashes loses no training); 0: only those",
    )
    g.add_argument(
        "--sample-every",
        type=int,
        default=10,
        help="print one sampled completion every N steps (with --report-to, its group of G to the "
        "trackers); 0: never",
    )
    g.add_argument(
        "--report-to",
        default="none",
        metavar="TRACKERS",
        help="also log to tensorboard (OUTPUT_DIR/tensorboard) and/or wandb (W&B; its WANDB_* environment "
        "applies, e.g. WANDB_MODE=offline), comma-separated: every metrics.jsonl field, the flags and the "
        "sampled completions (optional packages: pip install tensorboard / wandb; docs/logging.md)",
    )
    g.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoint")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start a fresh run in an --output-dir that holds an earlier run, replacing its metrics.jsonl "
        "and checkpoint (without it, such a run is refused)",
    )
    g.add_argument(
        "--seed", type=int, default=42, help="seeds torch, numpy, random and the data order"
    )
    g.add_argument(
        "--stop-when-zero-std",
        type=int,
        default=0,
        help="stop early (save, evaluate) after N steps in a row in which every group's rewards were all "
        "equal: such steps teach nothing; 0: never",
    )
    g.add_argument(
        "--plot",
        metavar="DIR",
        default=None,
        help="draw DIR/curves.png from DIR/metrics.jsonl and exit (needs matplotlib; every run also draws "
        "it at the end)",
    )

    g = p.add_argument_group("demo")
    g.add_argument(
        "--demo",
        action="store_true",
        help="offline demo: a tiny Llama and tokenizer built in code, a synthetic addition task, CPU; "
        "changes the defaults to DEMO_DEFAULTS (any flag still overrides)",
    )
    g.add_argument(
        "--demo-warmup-steps",
        type=int,
        default=400,
        help="demo only: at most this many supervised warm-up steps before GRPO",
    )
    g.add_argument(
        "--demo-target-accuracy",
        type=float,
        default=0.1,
        help="demo only: the warm-up stops once the model answers right this often",
    )


# --demo swaps in these defaults (a flag given on the command line still wins). Tuned on the 2-core CPU: 16 prompts x
# G=8 per step and mu=4 updates per batch (generation dominates a tiny model's step, so reusing samples is cheap).
# With --lora-rank the demo's adapters include the lm-head: its tiny model's answer tokens live in a frozen (tied)
# embedding that q_proj/v_proj adapters alone cannot reshape (docs/lora.md).
DEMO_DEFAULTS = dict(
    model="demo",
    steps=150,
    batch_size=8,
    gradient_accumulation_steps=2,
    num_generations=8,
    num_iterations=4,
    max_new_tokens=6,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    lr=2e-3,
    beta=0.04,
    lora_target_modules="q_proj,v_proj,lm_head",
    eval_every=50,
    eval_samples=4,
    eval_temperature=1.0,
    eval_batch_size=100,
    save_every=0,
    sample_every=50,
)


# --task addition (docs/results.md): SmolLM2-135M-Instruct on the 2-core CPU, about 20 s a step. 4 questions x G=8
# per step at T = 0.7, no top-k/top-p (the evaluation's sampling: at T = 1 most groups had no right answer at all, so no
# spread), lr 2e-5 constant. Completions are short (a sum, often a sentence around it): 48 new tokens. Evaluated
# before and after as DeepSeekMath's Figure 7 counts it: k = 8 samples per held-out question at T = 0.7 (mean
# accuracy, maj@8, pass@8), on the first 100 held-out questions, with the same draws for every training seed.
ADDITION_DEFAULTS = dict(
    steps=40,
    batch_size=4,
    gradient_accumulation_steps=1,
    num_generations=8,
    max_new_tokens=48,
    temperature=0.7,
    top_p=1.0,
    top_k=0,
    lr=2e-5,
    lr_scheduler="constant",
    beta=0.04,
    eval_every=0,
    eval_samples=8,
    eval_temperature=0.7,
    eval_seed=0,
    eval_limit=100,
    eval_batch_size=16,
    save_every=0,
)


def parse_args(argv=None):
    """Parse and check the flags, then fill in the values computed at run time (device, dtype, output dir)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.demo:
        parser.set_defaults(**DEMO_DEFAULTS)
        args = parser.parse_args(argv)
    elif args.task == "addition":
        parser.set_defaults(**ADDITION_DEFAULTS)
        args = parser.parse_args(argv)
    check(args)
    # Values computed at run time.
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "--device cuda was asked for, but torch sees no CUDA device; use --device cpu."
        )
    if args.dtype == "auto":
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.output_dir is None:  # one directory per model, task, LoRA or not, and seed
        name = "demo" if args.demo else os.path.basename(os.path.normpath(args.model))
        name += ("-addition" if args.task == "addition" else "") + (
            "-lora" if args.lora_rank else ""
        )
        args.output_dir = os.path.join("runs", f"{name}-seed{args.seed}")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise UserError(
            f"--output-dir {args.output_dir} is a file, not a directory: pass a directory (it is created "
            "if missing) for metrics.jsonl and checkpoint/."
        )
    return args


# The real-valued flags and the values each takes (NaN and inf never: they pass every "<= 0" test).
NUMBER_RANGES = [
    ("lr", lambda v: v >= 0, ">= 0"),
    ("weight_decay", lambda v: v >= 0, ">= 0"),
    ("max_grad_norm", lambda v: v >= 0, ">= 0 (0: no clipping)"),
    ("temperature", lambda v: v > 0, "> 0 (its log-probs divide the logits by it)"),
    ("eval_temperature", lambda v: v >= 0, ">= 0 (0: greedy)"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1] (1: off)"),
    ("beta", lambda v: v >= 0, ">= 0"),
    ("epsilon", lambda v: v > 0, "> 0"),
    ("epsilon_high", lambda v: v > 0, "> 0"),
    ("delta", lambda v: v > 1, "> 1"),
    ("lora_alpha", lambda v: v > 0, "> 0"),
    ("lora_dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("reward_timeout", lambda v: 0 <= v <= 1e6, "in [0, 1e6] seconds (0: no limit)"),
    ("demo_target_accuracy", lambda v: 0 <= v <= 1, "in [0, 1]"),
]
SEED_LIMIT = 2**32  # numpy's seeds (transformers.set_seed seeds numpy too)


def check_numbers(args):
    """UserError for a real-valued flag that is NaN, infinite or out of its range, and for a seed numpy refuses:
    all before any model loads."""
    for name, fits, values in NUMBER_RANGES:
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and fits(value)):
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{flag} must be a finite number {values}, got {value}.")
    for flag, value in (("--seed", args.seed), ("--eval-seed", args.eval_seed)):
        if value is not None and value >= SEED_LIMIT:
            raise UserError(f"{flag} must be below 2**32 ({SEED_LIMIT}), got {value}.")
    if args.compile:
        backends = torch.compiler.list_backends(exclude_tags=())
        if args.compile not in backends:
            raise UserError(
                f"--compile {args.compile!r} is not a torch.compile backend; this torch has "
                f"{', '.join(b for b in backends if 'TESTING' not in b)}."
            )


def check(args):
    """UserError for any flag value the run cannot use; --reward-weights becomes a list of floats."""
    check_numbers(args)
    G = args.num_generations
    if G < 2:
        raise UserError(
            f"--num-generations must be at least 2 (got {G}): GRPO's advantage compares each completion "
            "with the others of its group, so a group of one has no learning signal."
        )
    for flag, value, low in [
        ("--steps", args.steps, 0),
        ("--batch-size", args.batch_size, 1),
        ("--gradient-accumulation-steps", args.gradient_accumulation_steps, 1),
        ("--num-iterations", args.num_iterations, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--eval-samples", args.eval_samples, 1),
        ("--eval-batch-size", args.eval_batch_size, 1),
        ("--eval-limit", args.eval_limit, 1),
        ("--stop-when-zero-std", args.stop_when_zero_std, 0),
        ("--max-nonfinite", args.max_nonfinite, 1),
        ("--max-prompt-length", args.max_prompt_length, 1),
        ("--seed", args.seed, 0),
        ("--num-beams", args.num_beams, 1),
        ("--max-resample", args.max_resample, 0),
        ("--overlong-buffer", args.overlong_buffer, 0),
        ("--lora-rank", args.lora_rank, 0),
        ("--eval-seed", args.eval_seed, 0),
        ("--warmup-steps", args.warmup_steps, 0),
        ("--top-k", args.top_k, 0),
    ]:
        if value is not None and value < low:
            raise UserError(f"{flag} must be at least {low}, got {value}.")
    if args.micro_batch_size is not None and (
        args.micro_batch_size < G or args.micro_batch_size % G
    ):
        raise UserError(
            f"--micro-batch-size is counted in completions and must be a positive multiple of "
            f"--num-generations ({G}) so that each micro-batch holds whole groups; got "
            f"{args.micro_batch_size}. Try {G * max(1, args.micro_batch_size // G)}."
        )
    if args.temperature <= 0 or args.eval_temperature < 0:
        raise UserError(
            "--temperature must be > 0 (its log-probs divide the logits by it) and --eval-temperature "
            ">= 0 (0: greedy)."
        )
    if args.eval_temperature == 0:
        args.eval_samples = (
            1  # greedy decoding gives every sample of a question the same completion
        )
    if args.beta < 0 or args.epsilon <= 0:
        raise UserError(
            f"--beta must be >= 0 and --epsilon > 0, got beta={args.beta}, epsilon={args.epsilon}."
        )
    check_option_flags(args)
    # the trackers' names, each one's package imported now: a missing one is said before any model loads
    args.report_to = trackers.parse(args.report_to)
    args.response_prefix = decode_escapes(args.response_prefix)
    check_task_flags(args)
    local = os.path.abspath(os.path.expanduser(args.model))
    if not args.demo and args.model.startswith((".", "/", "~")) and not os.path.isdir(local):
        raise UserError(
            f"--model {args.model!r} looks like a local path, but {local} is not a directory. Pass the "
            "directory holding config.json and the weights, a hub id, or a SmolLM2 short name."
        )


def check_option_flags(args):
    """The algorithm options: each one's values must make sense together with the rest."""
    eps_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if args.delta is not None and args.delta <= 1 + eps_high:
        raise UserError(
            f"--delta must exceed 1 + epsilon-high ({1 + eps_high:g}), got {args.delta}: below that it "
            "would cap ratios the ordinary clip already handles."
        )
    if args.num_beams > 1 and args.num_beams < args.num_generations:
        raise UserError(
            f"--num-beams ({args.num_beams}) must be at least --num-generations ({args.num_generations}): "
            "the group is the G best beams."
        )
    if args.overlong_buffer > args.max_new_tokens:
        raise UserError(
            f"--overlong-buffer ({args.overlong_buffer}) must be at most --max-new-tokens "
            f"({args.max_new_tokens})."
        )
    if args.compile and (args.fsdp or args.lora_rank):
        raise UserError(
            "--compile compiles a whole, unadapted model: it does not combine with --fsdp or --lora-rank "
            "yet; drop one of them."
        )


def check_task_flags(args):
    """The flags that describe the task: --reward-weights becomes a list of floats (or None), --reward-fn and
    --reward-model lists of values (commas split), --system-prompt its text (@FILE read)."""
    try:
        args.reward_weights = (
            None
            if args.reward_weights is None
            else [float(w) for w in str(args.reward_weights).split(",")]
        )
    except ValueError:
        raise UserError(
            f"--reward-weights must be comma-separated numbers, got {args.reward_weights!r}."
        ) from None
    if args.reward_weights is not None and not all(map(math.isfinite, args.reward_weights)):
        raise UserError(f"--reward-weights must be finite numbers, got {args.reward_weights}.")
    args.reward_fn = [v.strip() for value in args.reward_fn for v in value.split(",") if v.strip()]
    args.reward_model = [
        v.strip() for value in args.reward_model for v in value.split(",") if v.strip()
    ]
    custom = [
        f
        for f in ("data", "eval_data", "prompt_field", "answer_field", "system_prompt")
        if getattr(args, f) is not None
    ]
    if args.demo and custom:
        raise UserError(
            f"--demo brings its own task; drop --{custom[0].replace('_', '-')} (--reward-fn and "
            "--reward-model do work with --demo)."
        )
    if args.task == "addition" and (args.demo or custom):
        drop = "--demo" if args.demo else "--" + custom[0].replace("_", "-")
        raise UserError(
            f"--task addition generates its own rows, prompts and rewards; drop {drop} (--reward-fn and "
            "--reward-model do work with it)."
        )
    if args.system_prompt is not None and args.system_prompt.startswith("@"):
        try:
            with open(os.path.expanduser(args.system_prompt[1:]), encoding="utf-8") as f:
                args.system_prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(
                f"--system-prompt {args.system_prompt}: could not read the file ({e})."
            ) from None
    elif args.system_prompt is not None:
        args.system_prompt = decode_escapes(args.system_prompt)


def decode_escapes(text):
    """Decode \\n, \\t and \\\\ as typed in a shell ("<think>\\n": the tag and a newline); nothing else."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)

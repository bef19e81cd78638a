"""The command line of trainer.py: every flag with its default and help (as
`trainer.py --help` prints them), and the checks that turn bad input into one clear paragraph
(UserError), not a traceback.

The defaults are those of Pramodith's GRPO trainer blog, whose SmolLM2-1.7B-Instruct run on GSM8K
this project sets out to reproduce; --demo and --task addition swap in their own (below).
"""

import argparse
import difflib
import functools
import math
import os
import re

import torch

from support import rundir, trackers
from support.errors import UserError


def flag(group, name, default, type=None, **kw):
    """flag(group, "--name", default, type, **kw)(help): one add_argument, the help last so that a
    long one wraps onto the next lines and the flag itself stays on one."""
    return lambda help: group.add_argument(name, default=default, type=type, help=help, **kw)


def switch(group, name, negatable=False):
    """switch(group, "--name")(help): an on/off flag, off by default. negatable: --no-name too, for
    a switch a --preset turns on."""
    action = argparse.BooleanOptionalAction if negatable else "store_true"
    return lambda help: group.add_argument(name, action=action, default=False, help=help)


class Parser(argparse.ArgumentParser):
    """argparse, whose errors (a value that is not a number, an unknown flag) are one line, exit
    code 2, as the checks below are: not the usage of every flag first."""

    def error(self, message):
        self.exit(
            2, f"{self.prog}: error: {message}{self.hint(message)} (--help lists the flags).\n"
        )

    def hint(self, message):
        """For an unknown flag: the nearest one this parser takes ("--stpes": "--steps")."""
        name = unknown_flag(message)
        flags = [f for f in self._option_string_actions if f.startswith("--")]
        near = difflib.get_close_matches(name, flags, 1) if name else []
        return f"; did you mean {near[0]}?" if near else ""


def unknown_flag(message):
    """The first flag argparse's "unrecognized arguments: ..." names (its name alone), or None."""
    unknown = re.match(r"unrecognized arguments: (\S+)", message)
    return unknown[1].split("=")[0] if unknown else None


class ReferenceParser(Parser):
    """train.py's parser: an unknown flag that trainer.py takes is said to be trainer.py's."""

    def hint(self, message):
        name = unknown_flag(message)
        if name and name in option_strings():
            return f"; {name} is trainer.py's: python trainer.py <the same flags> {name} ..."
        return super().hint(message)


def build_parser():
    p = Parser(
        description="GRPO (DeepSeekMath eq. 3) on GSM8K with a hand-written loop.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model and data")
    flag(g, "--model", "SmolLM2-1.7B-Instruct")(
        "a local directory, a Hugging Face hub id (owner/name), or a SmolLM2 short name "
        "(SmolLM2-135M, SmolLM2-360M, SmolLM2-1.7B, with or without -Instruct; -> "
        "HuggingFaceTB/...)"
    )
    flag(g, "--task", "gsm8k", choices=["gsm8k", "addition", "multiplication", "chain", "shop"])(
        "gsm8k: GSM8K (or your own JSONL with --prompt-field/--answer-field); addition: the "
        "built-in two-digit addition task (data.addition_rows: generated, no download; its "
        "defaults are ADDITION_DEFAULTS); multiplication: three-digit times two-digit numbers, "
        "the built-in task for --tool calculator (its system prompt shows the call; defaults: "
        "ADDITION_DEFAULTS); chain: sums of three numbers from 10 to 30 worked one equation per line, "
        "scored by the answer and each equation (process supervision; --reward-fn last-number: "
        "the answer alone; defaults: ADDITION_DEFAULTS, CHAIN_DEFAULTS); shop: the total price of a "
        "basket, each row's prices held by its environment (--env support.shop:Shop): look up each "
        "item, then add them up (defaults: ADDITION_DEFAULTS, SHOP_DEFAULTS)"
    )
    flag(g, "--data", None)(
        "train rows: a JSONL file, or a Hugging Face dataset as SOURCE[:CONFIG][@SPLIT] (a Hub id, "
        "a save_to_disk directory, a folder of data files, a Parquet, CSV or JSON-array file; e.g. "
        "openai/gsm8k:main@train; no @SPLIT: train; needs pip install datasets), read as GSM8K or, "
        "with --prompt-field/--answer-field, as they are; if not given, GSM8K's official train "
        "split is downloaded once (into ~/.cache/grpo)"
    )
    flag(g, "--eval-data", None)(
        "held-out rows in the same format as --data, a JSONL file or a dataset (no @SPLIT: test); "
        "if not given, for GSM8K: the test split of --data, or test.jsonl (test.parquet, test/) "
        "beside it if there is one, else the official test split (downloaded once); for your own "
        "task: no evaluation"
    )
    flag(g, "--prompt-field", None)(
        "your own task: the field of each JSONL row holding the prompt (a string); given (or "
        "--answer-field), rows are read as they are instead of as GSM8K; default then: prompt"
    )
    flag(g, "--answer-field", None)(
        "your own task: the field holding the reference answer, passed to the reward functions as "
        "it is (any JSON value); default with --prompt-field: answer"
    )
    flag(g, "--system-prompt", None)(
        "the system message, as text (\\n decoded) or @FILE; '' for none; if not given, GSM8K's "
        "prompt (data.SYSTEM_PROMPT) for GSM8K and none for your own task"
    )
    flag(g, "--response-prefix", "")(
        "text written at the start of every reply, after the chat template's generation prompt, "
        'e.g. "<think>\\n" (\\n and \\t are decoded); the rewards score prefix + completion'
    )
    switch(g, "--trust-remote-code")(
        "let transformers run model code shipped with the checkpoint (off: built-in architectures "
        "only)"
    )

    g = p.add_argument_group("GRPO (DeepSeekMath eq. 3)")
    flag(g, "--preset", None, choices=sorted(PRESETS))(
        "trl: TRL 1.16 GRPOConfig's defaults where a flag of ours means the same (TRL_PRESET: beta "
        "0, dapo, kl-bias-correction, T=1 without top-k/top-p, 512 new tokens, lr 1e-6, one "
        "prompt per update, dropout on; docs/trl.md), over the task's own defaults; a flag given "
        "still wins. The run's first line lists what it set"
    )
    flag(g, "--num-generations", 8, int)("G, completions sampled per prompt (the group)")
    flag(g, "--beta", 0.04, float)(
        "KL coefficient; 0 skips the reference model entirely (none is loaded)"
    )
    flag(g, "--ref-update-every", 0, int, metavar="K")(
        "Algorithm 1's outer loop (iterative GRPO, DeepSeekMath 4.1.4): pi_ref <- pi_theta after "
        "every K steps; 0: never (pi_ref stays the initial policy). Needs beta > 0; not with "
        "LoRA or --fsdp"
    )
    flag(g, "--epsilon", 0.2, float)("clip range: the ratio is clipped to [1-eps, 1+eps_high]")
    flag(g, "--epsilon-high", None, float)(
        "upper clip bound (DAPO clip-higher, arXiv 2503.14476); if not given, --epsilon"
    )
    flag(g, "--loss-type", "grpo", choices=["grpo", "dapo", "dr_grpo"])(
        "grpo: 1/G sum_i 1/|o_i| sum_t (the paper); dapo: token-level mean; dr_grpo: sum / (N * "
        "max-new-tokens) (arXiv 2503.20783)"
    )
    flag(g, "--scale-rewards", "group", choices=["group", "batch", "none"])(
        "advantage = (r - group mean) / std of the group | of the batch | no division (Dr. GRPO)"
    )
    flag(g, "--ratio-level", "token", choices=["token", "sequence"])(
        "token: eq. 3; sequence: one ratio per completion (GSPO, arXiv 2507.18071)"
    )
    flag(g, "--delta", None, float)(
        "dual clip: cap the ratio at delta where the advantage is negative (two-sided clipping, "
        "INTELLECT-2); must exceed 1 + epsilon-high; if not given, off"
    )
    switch(g, "--mask-truncated")(
        "completions that hit --max-new-tokens without EOS get no loss (their mask is all 0)"
    )
    switch(g, "--dynamic-sampling")(
        "DAPO: drop groups whose rewards are all equal and sample more prompts until the step "
        "holds batch-size x gradient-accumulation-steps groups with spread (at most --max-resample "
        "more generate calls)"
    )
    flag(g, "--max-resample", 3, int)(
        "with --dynamic-sampling: extra generate calls per step at most"
    )
    flag(g, "--num-iterations", 1, int)(
        "mu, optimizer updates per batch of samples; >1 keeps the first iteration's log-probs as "
        "pi_old's"
    )
    flag(g, "--surrogate", "clip", choices=SURROGATES)(
        "the policy term per token: clip: min(r A, clip(r) A) (eq. 3); cispo: sg(min(r, "
        "1+eps_high)) A log pi (MiniMax-M1, arXiv 2506.13585; --epsilon unused: no lower bound); "
        "sapo: sigmoid(tau (r-1)) 4/tau A (SAPO, arXiv 2511.20347; no clip); dppo-tv, dppo-kl: r A "
        "with no clip, on the tokens inside DPPO's trust region on the sampled token's probability "
        "p against the behaviour policy's b (arXiv 2602.04879; binary TV |p - b|, or binary KL; "
        "--dppo-delta-low/high; b: the sampler's log-probs, which the decode then keeps, else "
        "pi_old's). --loss-type still sets the aggregation (TRL pairs cispo with dapo, sapo with "
        "grpo)"
    )
    flag(g, "--sapo-tau-pos", 1.0, float)("--surrogate sapo: tau where the advantage is > 0")
    flag(g, "--sapo-tau-neg", 1.05, float)("--surrogate sapo: tau where the advantage is <= 0")
    flag(g, "--dppo-delta-low", None, float)(
        "--surrogate dppo-*: a token with negative advantage whose probability fell more than this "
        "below the behaviour policy's (TV: b - p; KL: the binary KL, p < b) gets no policy term; "
        "if not given, 0.15 (dppo-tv) or 0.05 (dppo-kl), verl's DPPO examples' (not --delta, the "
        "dual clip)"
    )
    flag(g, "--dppo-delta-high", None, float)(
        "--surrogate dppo-*: the same for a token with positive advantage whose probability rose "
        "more than this (TV: p - b; KL: the binary KL, p > b); if not given, as --dppo-delta-low's"
    )
    flag(g, "--top-entropy-quantile", 1.0, float)(
        "rho: the policy term only on the top rho of each micro-batch's tokens by entropy (Beyond "
        "the 80/20 Rule, arXiv 2506.01939, uses 0.2; ties with the threshold are kept); 1: off"
    )
    flag(g, "--off-policy-mask", None, float)(
        "DeepSeek-V3.2's off-policy sequence mask: a completion with negative advantage whose mean "
        "log(pi_behavior / pi_theta) exceeds this gets no policy term; pi_behavior is the "
        "sampler's log-probs when kept (--sampler-correction, --log-mismatch), else pi_old's (so "
        "it acts only with --num-iterations > 1); if not given, off"
    )
    switch(g, "--kl-bias-correction", negatable=True)(
        "the KL term times the ratio r = pi_theta/pi_old, not detached: DeepSeek-V3.2's unbiased KL "
        "estimate (arXiv 2512.02556, eq. 7; TRL's use_bias_correction_kl, on there by default). "
        "Changes the gradient whenever beta > 0, even at mu = 1 (r is 1, its gradient is not). "
        "For k3 only (--kl-estimator)"
    )
    flag(g, "--kl-estimator", "k3", choices=["k2", "k3"])(
        "the KL term's estimator per token, of x = log(pi_theta/pi_ref) (Schulman's "
        "'Approximating KL Divergence'): k3 = exp(-x) + x - 1 (eq. 4; its gradient is the forward "
        "KL's), k2 = x^2/2 (its gradient is the reverse KL's, KL(pi_theta || pi_ref)). The logged "
        "kl stays k3's"
    )
    switch(g, "--kl-in-reward")(
        "the KL as k1 in the reward instead of a term of the loss: each completion's reward minus "
        "beta * sum_t log(pi_theta/pi_ref) over its tokens, before the group normalization (pi_theta: "
        "a no-grad forward of the policy that sampled); the loss then has no KL term. Logged: kl "
        "(k3 per token, as the loss's) and kl_penalty (the mean beta * sum_t k1 subtracted)"
    )
    flag(
        g,
        "--sampler-correction",
        None,
        choices=["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"],
    )(
        "correct the sampler-trainer mismatch: each token's policy term times w = pi_old / "
        "pi_sampler (pi_sampler: the distribution the token was drawn from, after top-k/top-p), "
        "per token or per completion (the product), truncated to [min, max] or set to 0 outside it "
        "(TIS; TRL's vllm_importance_sampling_mode); if not given, off"
    )
    flag(g, "--sampler-ratio-min", 0.0, float)("--sampler-correction's lower bound on w")
    flag(g, "--sampler-ratio-max", 3.0, float)("--sampler-correction's upper bound on w")
    switch(g, "--log-mismatch")(
        "keep each sampled token's log-prob in the decode and log the sampler-trainer mismatch "
        "(mismatch_kl, mismatch_max_ratio) and the truncation gap of top-k/top-p (on with "
        "--sampler-correction)"
    )

    g = p.add_argument_group("rewards")
    flag(g, "--reward-fn", [], action="append", metavar="MODULE:FUNCTION")(
        "a reward function fn(completions, answers, **fields) -> list of floats, e.g. "
        "my_rewards:brevity (./my_rewards.py), or a built-in: correctness, format (GSM8K's), "
        "last-number, equations (a process reward: one step per equation written; "
        "process_supervision.py); repeatable. Given, it replaces the task's own rewards (GSM8K: "
        "correctness and format; demo: correctness; chain: last-number and equations)"
    )
    flag(g, "--extract-answer", None, metavar="MODULE:FUNCTION")(
        "for maj@k in evaluation: fn(completion) -> the answer it gives (a string) or None, e.g. "
        "my_rewards:final_answer, or a built-in: gsm8k (the last number in <answer>...</answer>), "
        "last-number. Given, it replaces the task's own (GSM8K and the demo: gsm8k; addition: "
        "last-number; your own task: none, so no maj@k)"
    )
    flag(g, "--reward-model", [], action="append", metavar="PATH_OR_ID")(
        "a sequence classifier with one output scoring prompt + response, as one more reward; "
        "repeatable or comma-separated"
    )
    flag(g, "--reward-weights", None)(
        "comma-separated weights, in the order: reward functions, then reward models, then the "
        "overlong penalty; if not given, every weight is 1.0; total reward = weighted sum"
    )
    flag(g, "--multi-reward", "sum", choices=["sum", "gdpo"])(
        "how several rewards make the advantage: sum: the weighted total, normalized in its group "
        "(eq. 3's); gdpo: each reward normalized in its group first, then weighted, summed and "
        "normalized over the whole batch (GDPO, arXiv 2601.05242; TRL's "
        "multi_objective_aggregation='normalize_then_sum'). gdpo needs two rewards or more, each "
        "one number per completion"
    )
    flag(g, "--overlong-buffer", 0, int)(
        "DAPO's soft overlong punishment as one more reward (rewards/overlong): 0 up to "
        "max-new-tokens - N tokens, then falling linearly to -1 at max-new-tokens; 0: off"
    )
    flag(g, "--reward-timeout", 600.0, float, metavar="SECONDS")(
        "a reward function (or reward model) that takes longer than this on one step's batch stops "
        "the run as a reward error does (checkpoint saved, exit code 2); 0: no limit. Functions "
        "loaded by --reward-fn/--extract-answer MODULE:FUNCTION run in a worker process, killed "
        "past it"
    )
    flag(g, "--reward-memory", 32.0, float, metavar="GB")(
        "the address space (GiB) of the worker process that runs --reward-fn and "
        "--extract-answer MODULE:FUNCTION: an allocation beyond it is a MemoryError there, which "
        "stops the run as a reward error does; 0: no limit"
    )

    g = p.add_argument_group("sampling")
    flag(g, "--temperature", 0.9, float)("sampling temperature for training rollouts")
    flag(g, "--top-p", 0.9, float)("nucleus sampling (1.0 = off)")
    flag(g, "--top-k", 50, int)("top-k sampling (0 = off)")
    flag(g, "--max-new-tokens", 300, int)("generation budget per completion")
    flag(g, "--num-beams", 1, int)(
        "K > 1: each group is the G best of K beams of one beam search per prompt (K >= G), not G "
        "samples; 1: sampling"
    )
    flag(g, "--max-prompt-length", None, int)(
        "a longer prompt keeps its last N tokens (with a warning); if not given, the model's "
        "context length minus --max-new-tokens"
    )

    g = p.add_argument_group(
        "tools (tools.py: the model writes <tool>NAME ARGS</tool>, the result is forced in)"
    )
    flag(g, "--tool", [], action="append", metavar="MODULE:FUNCTION")(
        "a tool the completions may call mid-completion: f(arguments: str) -> str, run in a worker "
        "process, or the built-in calculator (safe arithmetic); repeatable or comma-separated. "
        "The tool's result tokens are attended to but carry no loss"
    )
    flag(g, "--tool-timeout", 30.0, float, metavar="SECONDS")(
        "a --tool MODULE:FUNCTION call that takes longer stops the run (checkpoint saved, exit "
        "code 2); 0: no limit"
    )
    flag(g, "--max-tool-calls", 4, int)(
        "tool calls per completion; later call markers are left as plain text"
    )
    flag(g, "--max-tool-result-tokens", 64, int)(
        "a tool's result is cut to this many tokens (the whole completion, model and tool "
        "tokens, fits --max-new-tokens)"
    )
    flag(g, "--tool-format", "markers", choices=["markers", "hermes"])(
        "how the model calls a tool: markers, <tool>NAME ARGS</tool> (ARGS a JSON object for a "
        'typed tool) and <result>...</result> back; hermes, Qwen\'s <tool_call>{"name": NAME, '
        '"arguments": {...}}</tool_call> and <tool_response>...</tool_response> back, the tools\' '
        "JSON schemas rendered by the chat template (tools=) or into the system prompt"
    )
    flag(g, "--env", None, metavar="MODULE:CLASS")(
        "an environment: one instance of CLASS per completion, built in the worker process and "
        "reset(**the row's fields); its public typed methods are that completion's tools, and "
        "the method its reward_method names, if any, is a reward logged under that name "
        "(docs/tools.md)"
    )

    g = p.add_argument_group("optimization")
    flag(g, "--steps", 200, int)(
        "training steps; each samples batch-size x gradient-accumulation-steps prompts and makes "
        "num-iterations optimizer updates"
    )
    flag(g, "--batch-size", 1, int)("prompts per micro-batch")
    flag(g, "--gradient-accumulation-steps", 4, int)("micro-batches per optimizer update")
    flag(g, "--micro-batch-size", None, int)(
        "completions per forward/backward (a multiple of G); if given, replaces batch-size*G to "
        "save memory without changing the math"
    )
    flag(g, "--lr", 5e-5, float)("AdamW learning rate")
    schedules = ["linear", "cosine", "constant", "constant_with_warmup"]
    flag(g, "--lr-scheduler", "linear", choices=schedules)(
        "learning-rate schedule (transformers.get_scheduler) over steps x num-iterations updates"
    )
    flag(g, "--warmup-steps", 0, int)("LR warmup, in optimizer updates")
    flag(g, "--weight-decay", 0.0, float)("AdamW weight decay")
    flag(g, "--max-grad-norm", 1.0, float)("gradient clipping (global L2 norm); 0: no clipping")
    flag(g, "--max-nonfinite", 3, int)(
        "an update whose loss or gradient norm is NaN/inf is skipped (weights and AdamW "
        "unchanged); stop, saving the last good weights, after this many in a row"
    )
    switch(g, "--dropout", negatable=True)(
        "keep the model's own dropout on while training (off by default: with mu > 1, pi_old's and "
        "pi_theta's log-probs would come from different dropout masks, and the ratio would be "
        "noise)"
    )

    g = p.add_argument_group("LoRA (needs peft: pip install peft)")
    flag(g, "--lora-rank", 0, int)(
        "train LoRA adapters of this rank instead of every weight; the reference model is the base "
        "with the adapters off (no second copy); 0: full fine-tuning"
    )
    flag(g, "--lora-alpha", None, float)("LoRA scaling alpha; if not given, 2 x rank")
    flag(g, "--lora-dropout", 0.0, float)(
        "dropout on the LoRA branch (off by default: see --dropout)"
    )
    flag(g, "--lora-target-modules", "q_proj,v_proj")(
        "comma-separated module names that get adapters"
    )

    g = p.add_argument_group("precision and memory")
    flag(g, "--device", "auto", choices=["auto", "cpu", "cuda"])("auto: cuda if available")
    flag(g, "--dtype", "auto", choices=["auto", "bf16", "fp16", "fp32"])(
        "autocast compute dtype; parameters and AdamW state stay fp32. auto: bf16 on CUDA, fp32 on "
        "CPU"
    )
    switch(g, "--fsdp")(
        "under torchrun: shard parameters, gradients and AdamW state over the processes (FSDP2, "
        "one unit per decoder layer) instead of replicating them (DDP)"
    )
    g.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute activations in backward: less memory, ~30%% more time. Not given: on CUDA "
        "the run's memory plan turns it on where the card needs it (docs/gpu.md), off on the CPU",
    )
    flag(g, "--decode", "auto", choices=["auto", "graphs", "fused", "eager"])(
        "the decode step of the rollouts and evaluations: graphs, captured once per generate call "
        "as a CUDA graph and replayed for every token (no compiler); fused, its decoder layers "
        "through one torch.compile graph shared by every layer (compiled once per process), then "
        "captured as graphs is (on the CPU: compiled, not captured; Llama-layout models, others "
        "decode as graphs); eager, one kernel launch per op. auto: fused on CUDA (eager with "
        "--compile, whose decode is compiled, and where transformers' generate() decodes: --fsdp, "
        "--num-beams), eager on the CPU"
    )
    flag(g, "--compile", None, nargs="?", const="inductor", metavar="BACKEND")(
        "torch.compile the decode step (fixed shapes, static KV cache; CUDA graphs on a GPU) and "
        "the log-prob forwards; BACKEND: a torch.compile backend (inductor if not given; aot_eager "
        "checks the graphs without generating code)"
    )

    g = p.add_argument_group("evaluation")
    switch(g, "--eval-only")("evaluate --model on the test split and exit")
    flag(g, "--eval-every", 0, int)(
        "evaluate every N steps; 0: only before and after training; -1: never"
    )
    flag(g, "--eval-samples", 8, int)("completions sampled per test question")
    flag(g, "--eval-temperature", 0.7, float)(
        "sampling temperature for eval; 0: greedy, one completion per question"
    )
    flag(g, "--eval-seed", None, int)(
        "seed of the evaluation's own RNG; if not given, --seed (fix it to compare runs on the "
        "same draws)"
    )
    flag(g, "--eval-limit", None, int)("evaluate on the first N test questions only")
    flag(g, "--eval-batch-size", 8, int)("test questions per generate call")

    g = p.add_argument_group("logging and checkpoints")
    flag(g, "--output-dir", None)(
        "metrics.jsonl and checkpoint/ go here; if not given, a new directory for each run, "
        "runs/<model name or demo>[-addition][-lora]-<date>-<time> (with --resume: the last run "
        "of the same model, task, LoRA and seed). A fresh run into a directory holding one is "
        "refused (see --resume, --overwrite)"
    )
    flag(g, "--save-every", 50, int)(
        "checkpoint every N steps, and always after the last step and before every evaluation "
        "after step 0 (so an evaluation that crashes loses no training); 0: only those"
    )
    flag(g, "--sample-every", 10, int)(
        "print one sampled completion every N steps (with --report-to, its group of G to the "
        "trackers); 0: never"
    )
    flag(g, "--report-to", "none", metavar="TRACKERS")(
        "also log to tensorboard (OUTPUT_DIR/tensorboard) and/or wandb (W&B; its WANDB_* "
        "environment applies, e.g. WANDB_MODE=offline), comma-separated: every metrics.jsonl "
        "field, the flags and the sampled completions (optional packages: pip install tensorboard "
        "/ wandb; docs/logging.md)"
    )
    switch(g, "--resume")(
        "continue from OUTPUT_DIR/checkpoint (without --output-dir: the last run under runs/ "
        "of the same model, task, LoRA and seed)"
    )
    switch(g, "--overwrite")(
        "start a fresh run in an --output-dir that holds an earlier run, replacing its "
        "metrics.jsonl and checkpoint (without it, such a run is refused)"
    )
    flag(g, "--seed", 42, int)("seeds torch, numpy, random and the data order")
    flag(g, "--stop-when-zero-std", 0, int)(
        "stop early (save, evaluate) after N steps in a row in which every group's rewards were "
        "all equal: such steps teach nothing; 0: never"
    )
    flag(g, "--plot", None, metavar="DIR")(
        "draw DIR/curves.png from DIR/metrics.jsonl and exit (needs matplotlib; every run also "
        "draws it at the end)"
    )

    g = p.add_argument_group("demo")
    switch(g, "--demo")(
        "offline demo: a tiny Llama and tokenizer built in code, a synthetic addition task, CPU; "
        "changes the defaults to DEMO_DEFAULTS (any flag still overrides)"
    )
    flag(g, "--demo-warmup-steps", 400, int)(
        "demo only: at most this many supervised warm-up steps before GRPO"
    )
    flag(g, "--demo-target-accuracy", 0.1, float)(
        "demo only: the warm-up stops once the model answers right this often"
    )
    return p


# --demo swaps in these defaults (a flag given still wins), tuned on the 2-core CPU: 16 prompts x
# G=8 per step, mu=4 updates per batch (generation dominates a tiny model's step: reusing samples is
# cheap). With --lora-rank its adapters include the lm-head: the tiny model's answer tokens live in
# a frozen (tied) embedding that q_proj/v_proj adapters alone cannot reshape (docs/lora.md).
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

# --demo --tool calculator (support/demo.py): completions of up to 13 tokens, and a longer warm-up
# (copying the call's numbers and the result is what it must learn)
DEMO_TOOL_DEFAULTS = dict(max_new_tokens=16, demo_warmup_steps=800)


# --task addition (docs/results.md): SmolLM2-135M-Instruct on the 2-core CPU, about 20 s a step.
# 4 questions x G=8 per step at T = 0.7 without top-k/top-p (the evaluation's sampling: at T = 1
# most groups had no right answer, so no spread), lr 2e-5 constant, 48 new tokens (a sum, often in a
# sentence). Evaluated before and after as DeepSeekMath's Figure 7 counts it: 8 samples per
# held-out question at T = 0.7 (mean accuracy, maj@8, pass@8) on the first 100, the same draws for
# every seed.
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

# --task multiplication --tool calculator: the call, the result and the answer in its tags take 51
# to 53 tokens at the task's operands (SmolLM2's tokenizer, EOS included; 61 at 4 x 3 digits), so
# 96 leaves room to spare (docs/tools.md). 48 cut the answer (issue 43).
MULTIPLICATION_TOOL_DEFAULTS = dict(max_new_tokens=96)


# --task chain: two equations and the answer's sentence take about 30 tokens (SmolLM2's
# tokenizer); 64 leave room for a longer working.
CHAIN_DEFAULTS = dict(max_new_tokens=64)

# --task shop: its environment, and room for a basket of three (SmolLM2's tokenizer: the worked
# example's reply, two items, takes 73 tokens in the markers format and 137 in hermes, results
# included; three items about 100 and 185). The same budget in both formats.
SHOP_DEFAULTS = dict(env="support.shop:Shop", max_new_tokens=256, max_tool_calls=6)


# --preset trl: TRL 1.16.0's GRPOConfig defaults (and the TrainingArguments fields it inherits, as
# transformers 5 sets them), read from trl/trainer/grpo_config.py, each on the flag of ours that
# means the same (docs/trl.md: the table, what differs from ours and why ours are the paper's).
# Applied over the task's or the demo's defaults; a flag given on the command line still wins.
TRL_PRESET = dict(
    beta=0.0,  # beta
    loss_type="dapo",  # loss_type
    surrogate="clip",  # loss_type "dapo" is eq. 3's clipped term, aggregated per token
    epsilon=0.2,  # epsilon
    epsilon_high=None,  # epsilon_high (None: epsilon)
    delta=None,  # delta
    ratio_level="token",  # importance_sampling_level
    scale_rewards="group",  # scale_rewards
    num_iterations=1,  # num_iterations (μ)
    mask_truncated=False,  # mask_truncated_completions
    top_entropy_quantile=1.0,  # top_entropy_quantile
    off_policy_mask=None,  # off_policy_mask_threshold
    kl_bias_correction=True,  # use_bias_correction_kl
    num_generations=8,  # num_generations
    temperature=1.0,  # temperature
    top_p=1.0,  # top_p
    top_k=0,  # top_k (0: off)
    max_new_tokens=512,  # max_completion_length
    lr=1e-6,  # learning_rate
    lr_scheduler="linear",  # lr_scheduler_type
    warmup_steps=0,  # warmup_steps
    weight_decay=0.0,  # weight_decay
    max_grad_norm=1.0,  # max_grad_norm
    # per_device_train_batch_size 8 counts completions: one group of G = 8, so one prompt per
    # process per update (gradient_accumulation_steps 1, steps_per_generation = it)
    batch_size=1,
    gradient_accumulation_steps=1,
    dropout=True,  # disable_dropout=False: the model's own dropout stays on in training
)
PRESETS = {"trl": TRL_PRESET}


def parse_args(argv=None):
    """Parse and check the flags, then fill in the run-time values (device, dtype, output dir)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    builtin = args.task in ("addition", "multiplication", "chain", "shop")
    defaults = DEMO_DEFAULTS if args.demo else ADDITION_DEFAULTS if builtin else {}
    if args.demo and (args.tool or args.env):
        defaults = {**defaults, **DEMO_TOOL_DEFAULTS}
    elif args.task == "multiplication" and args.tool:
        defaults = {**defaults, **MULTIPLICATION_TOOL_DEFAULTS}
    elif args.task == "chain":
        defaults = {**defaults, **CHAIN_DEFAULTS}
    elif args.task == "shop":
        defaults = {**defaults, **SHOP_DEFAULTS}
    if args.preset is not None:  # over the task's defaults; a flag given still wins
        defaults = {**defaults, **PRESETS[args.preset]}
    if defaults:
        parser.set_defaults(**defaults)
        args = parser.parse_args(argv)
    try:
        check(args)
    except UserError as e:  # a value the preset set: say so, or nothing tells it did
        if args.preset is None:
            raise
        raise UserError(f"{e} ({preset_line(args)})") from None
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "--device cuda was asked for, but torch sees no CUDA device; use --device cpu."
        )
    if args.dtype == "auto":
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    resolve_decode(args)
    if args.gradient_checkpointing is None and args.device != "cuda":
        args.gradient_checkpointing = False  # on CUDA the memory plan decides (support/memory.py)
    if args.output_dir is None:  # a new directory for each run; --resume: the last one like it
        args.output_dir = rundir.last_run_like(args) if args.resume else rundir.new_run_dir(args)
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise UserError(
            f"--output-dir {args.output_dir} is a file, not a directory: pass a directory (it is "
            "created if missing) for metrics.jsonl and checkpoint/."
        )
    return args


def resolve_decode(args):
    """--decode auto -> fused on CUDA where the lean decode runs (measured faster than graphs on
    the fifth GPU lease: docs/gpu.md), else eager; graphs or fused asked for where it cannot run:
    a UserError."""
    generate_decodes = args.fsdp or args.num_beams > 1  # transformers' generate(), not our loop
    if args.decode == "auto":
        cuda = args.device == "cuda"
        args.decode = "fused" if cuda and not (args.compile or generate_decodes) else "eager"
        if cuda and generate_decodes and os.environ.get("RANK", "0") == "0":  # said once
            why = "--fsdp" if args.fsdp else "--num-beams"
            print(f"decode: eager, not fused: with {why} transformers' generate() decodes")
    elif args.decode in ("graphs", "fused") and (
        (args.device != "cuda" and args.decode == "graphs") or args.compile or generate_decodes
    ):  # fused runs on the CPU too: its compiled step, without a CUDA graph
        why = (
            "needs a CUDA device"
            if args.device != "cuda" and args.decode == "graphs"
            else "does not combine with --compile (its decode is compiled)"
            if args.compile
            else f"has no decode loop to {'capture' if args.decode == 'graphs' else 'compile'} "
            f"with {'--fsdp' if args.fsdp else '--num-beams'} (transformers' generate() decodes)"
        )
        raise UserError(f"--decode {args.decode} {why}; drop it (auto picks what runs).")


def preset_line(args):
    """The line a run with --preset prints first: each flag as the preset set it, then each flag
    given on the command line in its place (its value differs from the preset's). None without
    --preset."""
    if args.preset is None:
        return None
    preset = PRESETS[args.preset]
    kept = [k for k, v in preset.items() if getattr(args, k) != v]
    # the KL's bias correction is inert at β = 0 (and refused there without the preset): not said
    inert = {"kl_bias_correction"} if args.beta == 0 else set()
    set_ = [as_flag(k, v) for k, v in preset.items() if k not in kept and k not in inert]
    line = f"--preset {args.preset} (TRL 1.16 GRPOConfig's defaults) set: {' '.join(filter(None, set_))}"
    if kept:
        line += "; given, kept: " + " ".join(
            filter(None, (as_flag(k, getattr(args, k)) for k in kept))
        )
    return line


def as_flag(name, value):
    """A setting as the command line writes it, so that a line of them can be pasted back as
    flags: --name VALUE, --name for a switch that is on, --no-name for one that is off; "" for
    what the command line cannot spell and need not (None, every such flag's default; off for a
    switch without --no-name, its default)."""
    option = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        negatable = "--no-" + option[2:] in option_strings()
        return option if value else f"--no-{option[2:]}" if negatable else ""
    if value is None:
        return ""
    return f"{option} {f'{value:g}' if isinstance(value, float) else value}"


@functools.cache
def option_strings():
    return frozenset(build_parser()._option_string_actions)


# --reward-memory's range (GiB of address space for the worker process, support/worker.py). At
# least 1: the worker itself starts in about 32 MiB (Python and the standard library, measured
# under ulimit -v), but a checker that imports numpy or torch on the CPU maps about 1 GiB (torch
# 2.x fails to import below it), and address space is not memory (glibc reserves 64 MiB of it per
# thread's malloc arena): a limit below 1 GiB fails at import time, not on a runaway allocation. At
# most 2**20 (1 PiB): beyond any machine's memory, and far below what setrlimit takes (2**63
# bytes); for no limit, 0. Either way never above the process's own hard limit (the worker takes
# that one, and says so).
MIN_REWARD_MEMORY_GB, MAX_REWARD_MEMORY_GB = 1.0, float(2**20)

# --sapo-tau-pos/--sapo-tau-neg's lower bound. SAPO's term per token, σ(τ (r - 1)) · 4/τ · Â, is
# 2/τ · Â plus what depends on the ratio: in float32 (7 significant digits), at τ = 1e-6 the
# constant 2e6 leaves that part about one digit, and below it none (the logged loss is the
# constant's rounding); below about 1e-38 τ underflows and the loss and gradients are inf and NaN
# (measured: gradients exact to 1e-13 down to τ = 1e-30, inf at 1e-40). And a τ that small is a
# flat gate: the unclipped ratio, not SAPO (--surrogate clip with a wide --epsilon is that).
SAPO_TAU_MIN = 1e-6
SAPO_TAU_VALUES = "> 0, at least 1e-6 (below it SAPO's 2/tau swamps float32's digits)"

# --surrogate's policy terms (trainer.policy_term), and DPPO's thresholds where
# --dppo-delta-low/high are not given: those of verl's DPPO example runs, for binary TV and binary
# KL (docs/objectives.md).
SURROGATES = ["clip", "cispo", "sapo", "dppo-tv", "dppo-kl"]
DPPO_DELTAS = {"dppo-tv": 0.15, "dppo-kl": 0.05}

# The real-valued flags and the values each takes (never NaN or inf: they pass every "<= 0" test).
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
    ("sapo_tau_pos", lambda v: v >= SAPO_TAU_MIN, SAPO_TAU_VALUES),
    ("sapo_tau_neg", lambda v: v >= SAPO_TAU_MIN, SAPO_TAU_VALUES),
    ("dppo_delta_low", lambda v: v > 0, "> 0"),
    ("dppo_delta_high", lambda v: v > 0, "> 0"),
    ("top_entropy_quantile", lambda v: 0 <= v <= 1, "in [0, 1] (1: off)"),
    ("off_policy_mask", lambda v: v >= 0, ">= 0"),
    ("sampler_ratio_min", lambda v: v >= 0, ">= 0"),
    ("sampler_ratio_max", lambda v: v > 0, "> 0"),
    ("lora_alpha", lambda v: v > 0, "> 0"),
    ("lora_dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("reward_timeout", lambda v: 0 <= v <= 1e6, "in [0, 1e6] seconds (0: no limit)"),
    (
        "reward_memory",
        lambda v: v == 0 or MIN_REWARD_MEMORY_GB <= v <= MAX_REWARD_MEMORY_GB,
        f"of GiB in [{MIN_REWARD_MEMORY_GB:g}, {MAX_REWARD_MEMORY_GB:.0f}] (1 PiB), or 0 for no "
        "limit",
    ),
    ("tool_timeout", lambda v: 0 <= v <= 1e6, "in [0, 1e6] seconds (0: no limit)"),
    ("demo_target_accuracy", lambda v: 0 <= v <= 1, "in [0, 1]"),
]
SEED_LIMIT = 2**32  # numpy's seeds (transformers.set_seed seeds numpy too)


def check_numbers(args):
    """UserError for a real-valued flag that is NaN, infinite or out of its range, a seed numpy
    refuses, or an unknown --compile backend: all before any model loads."""
    for name, fits, values in NUMBER_RANGES:
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and fits(value)):
            option = "--" + name.replace("_", "-")
            raise UserError(f"{option} must be a finite number {values}, got {value}.")
    for option, value in (("--seed", args.seed), ("--eval-seed", args.eval_seed)):
        if value is not None and value >= SEED_LIMIT:
            raise UserError(f"{option} must be below 2**32 ({SEED_LIMIT}), got {value}.")
    if args.compile:
        backends = torch.compiler.list_backends(exclude_tags=())
        if args.compile not in backends:
            raise UserError(
                f"--compile {args.compile!r} is not a torch.compile backend; this torch has "
                f"{', '.join(b for b in backends if 'TESTING' not in b)}."
            )


def check(args):
    """UserError for any flag value the run cannot use; some flags come out in the form the run
    reads (lists, decoded text; one eval sample when greedy)."""
    check_numbers(args)
    G = args.num_generations
    if G < 2:
        raise UserError(
            f"--num-generations must be at least 2 (got {G}): GRPO's advantage compares each "
            "completion with the others of its group, so a group of one has no learning signal."
        )
    for option, value, low in [
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
        ("--ref-update-every", args.ref_update_every, 0),
        ("--eval-seed", args.eval_seed, 0),
        ("--warmup-steps", args.warmup_steps, 0),
        ("--top-k", args.top_k, 0),
        ("--eval-every", args.eval_every, -1),
        ("--save-every", args.save_every, 0),
        ("--sample-every", args.sample_every, 0),
        ("--demo-warmup-steps", args.demo_warmup_steps, 0),
        ("--max-tool-calls", args.max_tool_calls, 1),
        ("--max-tool-result-tokens", args.max_tool_result_tokens, 1),
    ]:
        if value is not None and value < low:
            raise UserError(f"{option} must be at least {low}, got {value}.")
    mbs = args.micro_batch_size
    if mbs is not None and (mbs < G or mbs % G):
        raise UserError(
            f"--micro-batch-size is counted in completions and must be a positive multiple of "
            f"--num-generations ({G}) so that each micro-batch holds whole groups; got "
            f"{mbs}. Try {G * max(1, mbs // G)}."
        )
    if args.eval_temperature == 0:  # greedy: every sample of a question the same completion
        args.eval_samples = 1
    check_option_flags(args)
    # the trackers' names, each one's package imported now: a missing one is said before any load
    args.report_to = trackers.parse(args.report_to)
    args.response_prefix = unescape(args.response_prefix)
    check_task_flags(args)
    local = os.path.abspath(os.path.expanduser(args.model))
    if not args.demo and args.model.startswith((".", "/", "~")) and not os.path.isdir(local):
        raise UserError(
            f"--model {args.model!r} looks like a local path, but {local} is not a directory. Pass "
            "the directory holding config.json and the weights, a hub id, or a SmolLM2 short name."
        )
    check_launch_flags(args)


def check_option_flags(args):
    """The algorithm options: each one's values must make sense together with the rest."""
    eps_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if args.delta is not None and args.delta <= 1 + eps_high:
        raise UserError(
            f"--delta must exceed 1 + epsilon-high ({1 + eps_high:g}), got {args.delta}: below "
            "that it would cap ratios the ordinary clip already handles."
        )
    check_objective_flags(args)
    check_reward_flags(args)
    if args.ref_update_every and (args.beta == 0 or args.lora_rank or args.fsdp):
        why = (
            "at beta 0 there is no pi_ref (no KL term) to reset"
            if args.beta == 0
            else "with LoRA, pi_ref is the base model with the adapters off: resetting it would mean "
            "merging the adapters into the base and starting fresh ones, which this run does not do"
            if args.lora_rank
            else "under --fsdp pi_ref is sharded like pi_theta, and the reset is not implemented there"
        )
        raise UserError(
            f"--ref-update-every {args.ref_update_every}: {why}. Drop --ref-update-every (pi_ref then "
            "stays the initial policy, as in one iteration of Algorithm 1)."
        )
    if args.num_beams > 1 and args.num_beams < args.num_generations:
        raise UserError(
            f"--num-beams ({args.num_beams}) must be at least --num-generations "
            f"({args.num_generations}): the group is the G best beams."
        )
    if args.overlong_buffer > args.max_new_tokens:
        raise UserError(
            f"--overlong-buffer ({args.overlong_buffer}) must be at most --max-new-tokens "
            f"({args.max_new_tokens})."
        )
    args.tool = split_commas(args.tool, "--tool")
    check_tool_flags(args)
    if (args.tool or args.env) and (args.num_beams > 1 or args.fsdp):
        tools_flag = "--tool" if args.tool else "--env"
        raise UserError(
            f"{tools_flag} needs sampled completions that the decode loop can write a tool's result "
            f"into, one token at a time; {'beam search (--num-beams)' if args.num_beams > 1 else '--fsdp'} "
            f"runs transformers' generate(), which cannot. Drop {tools_flag}, or drop "
            f"{'--num-beams' if args.num_beams > 1 else '--fsdp (DDP, without it, runs tools: each rank its own calls)'}."
        )
    if args.compile and (args.fsdp or args.lora_rank):
        raise UserError(
            "--compile compiles a whole, unadapted model: it does not combine with --fsdp or "
            "--lora-rank yet; drop one of them."
        )


def check_tool_flags(args):
    """--env and --tool-format: a value that names something, and a format with tools to call."""
    if args.env is not None and not args.env.strip():
        raise UserError(
            f"--env {args.env!r} names nothing: pass MODULE:CLASS, or drop --env (an empty shell "
            "variable, perhaps)."
        )
    if args.tool_format != "markers" and not (args.tool or args.env):
        raise UserError(
            f"--tool-format {args.tool_format} is how the model writes tool calls; without --tool "
            "or --env there is nothing to call. Add one, or drop --tool-format."
        )


def check_objective_flags(args):
    """--surrogate and the options that go with it, the sampler correction's bounds, and what
    needs the decode's log-probs."""
    dppo = args.surrogate in DPPO_DELTAS
    unused = {  # sapo and dppo-*: no clip
        "clip": [],
        "cispo": [("--delta", args.delta is not None)],
    }.get(
        args.surrogate,
        [("--delta", args.delta is not None), ("--epsilon-high", args.epsilon_high is not None)],
    )
    if args.surrogate != "sapo":
        unused += [
            ("--sapo-tau-pos", args.sapo_tau_pos != 1.0),
            ("--sapo-tau-neg", args.sapo_tau_neg != 1.05),
        ]
    if not dppo:
        unused += [
            ("--dppo-delta-low", args.dppo_delta_low is not None),
            ("--dppo-delta-high", args.dppo_delta_high is not None),
        ]
    for option, given in unused:
        if given:
            raise UserError(
                f"{option} does nothing with --surrogate {args.surrogate}: drop it (--delta belongs "
                "to clip, --epsilon-high to clip and cispo, --sapo-tau-* to sapo, --dppo-delta-* "
                "to dppo-tv and dppo-kl)."
            )
    if dppo:
        check_dppo_flags(args)
    if args.kl_bias_correction and args.beta == 0 and args.preset is None:
        raise UserError(
            "--kl-bias-correction multiplies the KL term by the ratio; at --beta 0 there is no KL "
            "term: give --beta > 0, or drop --kl-bias-correction."
        )
    check_kl_flags(args)
    bounds = (args.sampler_ratio_min, args.sampler_ratio_max)
    if args.sampler_correction is None and bounds != (0.0, 3.0):
        raise UserError(
            "--sampler-ratio-min/--sampler-ratio-max bound --sampler-correction's weights: give "
            "--sampler-correction too, or drop them."
        )
    if bounds[0] >= bounds[1]:
        raise UserError(
            f"--sampler-ratio-min ({bounds[0]:g}) must be below --sampler-ratio-max ({bounds[1]:g})."
        )
    keeps = args.sampler_correction is not None or args.log_mismatch
    if keeps and (args.num_beams > 1 or args.fsdp):
        flag_name = "--sampler-correction" if args.sampler_correction else "--log-mismatch"
        path = "beam search (--num-beams)" if args.num_beams > 1 else "--fsdp"
        raise UserError(
            f"{flag_name} needs each sampled token's log-prob from the decode loop; {path} runs "
            f"transformers' generate(), which does not keep them. Drop {flag_name} or "
            f"{'--num-beams' if args.num_beams > 1 else '--fsdp'}."
        )


def check_dppo_flags(args):
    """--surrogate dppo-tv/dppo-kl: thresholds it can reach, token ratios, and a behaviour policy
    other than pi_theta itself."""
    deltas = [
        ("--dppo-delta-low", args.dppo_delta_low),
        ("--dppo-delta-high", args.dppo_delta_high),
    ]
    for option, value in deltas:
        if args.surrogate == "dppo-tv" and value is not None and value >= 1:
            raise UserError(
                f"{option} {value:g} drops nothing with --surrogate dppo-tv: p and b are "
                "probabilities, so |p - b| stays below 1. Give a value below 1 (verl's examples "
                f"use {DPPO_DELTAS['dppo-tv']:g})."
            )
    if args.ratio_level == "sequence":
        raise UserError(
            f"--surrogate {args.surrogate} drops each token by its own probability; with "
            "--ratio-level sequence every token's term carries its whole completion's ratio, so a "
            "dropped token would still move through the others'. Use --ratio-level token."
        )
    generate = "--fsdp" if args.fsdp else "--num-beams" if args.num_beams > 1 else None
    if args.num_iterations == 1 and generate:
        raise UserError(
            f"--surrogate {args.surrogate} at --num-iterations 1 needs the sampler's log-probs as "
            "its behaviour policy (pi_old is pi_theta there: the trust region would drop nothing), "
            f"and with {generate} transformers' generate() decodes, which does not keep them. Give "
            f"--num-iterations 2 or more (pi_old is then the behaviour policy), or drop {generate}."
        )


def check_kl_flags(args):
    """--kl-estimator, --kl-in-reward and --kl-bias-correction: each needs the KL term it acts on
    (the bias correction's alone at beta 0 is check_objective_flags')."""
    if args.kl_in_reward and args.beta == 0:
        raise UserError(
            "--kl-in-reward subtracts beta times each completion's KL from its reward; at --beta 0 "
            "there is nothing to subtract: give --beta > 0, or drop --kl-in-reward."
        )
    if args.kl_estimator != "k3" and (args.beta == 0 or args.kl_in_reward):
        why = (
            "with --kl-in-reward the KL is k1 in the reward and the loss has no KL term"
            if args.kl_in_reward
            else "at --beta 0 there is no KL term"
        )
        raise UserError(
            f"--kl-estimator {args.kl_estimator} chooses the loss's KL estimator; {why}: drop "
            "--kl-estimator."
        )
    if args.kl_bias_correction and (args.kl_in_reward or args.kl_estimator != "k3"):
        why = (
            "with --kl-in-reward the loss has no KL term to correct"
            if args.kl_in_reward
            else "k2's gradient is already the reverse KL's, and r * k2's would be that of "
            "E[k2], not of the KL"
        )
        raise UserError(
            "--kl-bias-correction multiplies the loss's k3 by the ratio (DeepSeek-V3.2's eq. 7, "
            f"for k3); {why}. Drop --kl-bias-correction (--no-kl-bias-correction under --preset)."
        )


def check_reward_flags(args):
    """--multi-reward gdpo against the other options that read the rewards. (One reward function,
    known once the task's rewards are: trainer.load_task; a process reward, once one returns steps:
    process_supervision.check_settings.)"""
    if args.multi_reward != "gdpo":
        return
    for given, option, why in (
        (
            args.scale_rewards != "group",
            f"--scale-rewards {args.scale_rewards}",
            "GDPO divides each reward by its group's std, then the weighted sum by the batch's",
        ),
        (
            args.dynamic_sampling,
            "--dynamic-sampling",
            "it keeps the groups whose total rewards differ, and GDPO's advantages come from each "
            "reward's own spread, which the total does not show",
        ),
        (
            args.kl_in_reward,
            "--kl-in-reward",
            "it subtracts the KL from the weighted total reward, which GDPO never forms (each "
            "reward is normalized on its own)",
        ),
    ):
        if given:
            raise UserError(
                f"{option} does not combine with --multi-reward gdpo: {why}. Drop one of them."
            )


def check_task_flags(args):
    """The flags that describe the task: --reward-weights becomes a list of floats (or None),
    --reward-fn and --reward-model lists (commas split), --system-prompt its text (@FILE read)."""
    try:
        weights = args.reward_weights
        args.reward_weights = (
            None if weights is None else [float(w) for w in str(weights).split(",")]
        )
    except ValueError:
        raise UserError(
            f"--reward-weights must be comma-separated numbers, got {args.reward_weights!r}."
        ) from None
    if args.reward_weights is not None and not all(map(math.isfinite, args.reward_weights)):
        raise UserError(f"--reward-weights must be finite numbers, got {args.reward_weights}.")
    args.reward_fn = split_commas(args.reward_fn, "--reward-fn")
    args.reward_model = split_commas(args.reward_model, "--reward-model")
    custom = [
        f
        for f in ("data", "eval_data", "prompt_field", "answer_field", "system_prompt")
        if getattr(args, f) is not None
    ]
    if args.demo and args.model != "demo":  # DEMO_DEFAULTS' model: any other was given
        raise UserError(
            f"--demo brings its own model (a tiny Llama built in code); drop --model {args.model}, "
            "or drop --demo to train it."
        )
    if args.demo and custom:
        raise UserError(
            f"--demo brings its own task; drop --{custom[0].replace('_', '-')} (--reward-fn and "
            "--reward-model do work with --demo)."
        )
    if args.task in ("addition", "multiplication", "chain", "shop") and (args.demo or custom):
        drop = "--demo" if args.demo else "--" + custom[0].replace("_", "-")
        raise UserError(
            f"--task {args.task} generates its own rows, prompts and rewards; drop {drop} "
            "(--reward-fn and --reward-model do work with it)."
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
        args.system_prompt = unescape(args.system_prompt)


def launched_world_size():
    """How many processes the launcher started: torchrun sets WORLD_SIZE; a plain python run, 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_launch_flags(args):
    """The flags that depend on how the run was launched (alone or under torchrun), and --plot."""
    world = launched_world_size()
    if world > 1 and args.dynamic_sampling:
        raise UserError(
            "--dynamic-sampling does not run under torchrun yet: ranks would refill their batches "
            "with different numbers of generate calls and micro-batches. Run it in one process."
        )
    if args.fsdp and world == 1:
        raise UserError(
            "--fsdp shards the model over processes: start it with torchrun --nproc-per-node N."
        )
    if args.fsdp and args.lora_rank:
        raise UserError(
            "--fsdp does not train LoRA adapters yet; use DDP (no --fsdp) for --lora-rank."
        )
    if args.plot is not None and not os.path.isfile(os.path.join(args.plot, "metrics.jsonl")):
        raise UserError(
            f"--plot {args.plot}: there is no metrics.jsonl in it. Pass a run's --output-dir."
        )


def split_commas(values, flag=None):
    """The values of a repeatable flag, each also split at commas, blanks dropped. A value that
    names nothing at all (--tool '', an unset shell variable) is a UserError naming `flag`: it
    was dropped silently, and the run went on without the tool, or with the task's own rewards in
    place of --reward-fn's."""
    for value in values:
        if flag is not None and not value.replace(",", "").strip():
            raise UserError(
                f"{flag} {value!r} names nothing: pass a name (e.g. MODULE:FUNCTION), or drop "
                f"{flag} (an empty shell variable, perhaps)."
            )
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def unescape(text):
    """Decode \\n, \\t and \\\\ as typed in a shell ("<think>\\n": tag, newline), nothing else."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)

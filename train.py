"""GRPO on GSM8K: the whole training loop in one file, numbered like Algorithm 1 of DeepSeekMath (arXiv 2402.03300).

    python train.py --demo                                    # tiny model + synthetic task: CPU, no network, < 2 min
    python train.py --model SmolLM2-1.7B-Instruct             # the real run: GSM8K, 200 steps, one GPU
    python train.py --model DIR --data gsm8k/train.jsonl --max-new-tokens 64 --steps 3 --eval-limit 4   # CPU smoke run
    python train.py --model DIR --eval-only --eval-limit 100  # mean accuracy and format reward on the test split
    python train.py <same flags> --resume                     # continue from OUTPUT_DIR/checkpoint
"""
import argparse
import contextlib
import copy
import inspect
import json
import os
import random
import re
import shutil
import sys
import time

import numpy as np
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor, LogitsProcessorList,
                          get_scheduler, set_seed)

import data
import grpo
import rewards

# ----------------------------------------------------------------------------------------------------------------------
# Flags. `python train.py --help` is the reference; defaults follow seed 002's table.


def build_parser():
    p = argparse.ArgumentParser(description="GRPO (DeepSeekMath eq. 3) on GSM8K with a hand-written loop.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="SmolLM2-1.7B-Instruct",
                   help="a local directory, a Hugging Face hub id (owner/name), or a SmolLM2 short name "
                        "(SmolLM2-135M, SmolLM2-360M, SmolLM2-1.7B, with or without -Instruct; -> HuggingFaceTB/...)")
    g.add_argument("--data", default=None,
                   help="GSM8K-format train JSONL; if not given, the official train split is downloaded once "
                        "(into ~/.cache/grpo)")
    g.add_argument("--eval-data", default=None,
                   help="GSM8K-format test JSONL; if not given: test.jsonl beside --data if there is one, "
                        "else the official test split (downloaded once)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run model code shipped with the checkpoint (off: built-in architectures "
                        "only)")

    g = p.add_argument_group("GRPO (DeepSeekMath eq. 3)")
    g.add_argument("--num-generations", type=int, default=8, help="G, completions sampled per prompt (the group)")
    g.add_argument("--beta", type=float, default=0.04,
                   help="KL coefficient; 0 skips the reference model entirely (none is loaded)")
    g.add_argument("--epsilon", type=float, default=0.2, help="clip range: the ratio is clipped to [1-eps, 1+eps_high]")
    g.add_argument("--epsilon-high", type=float, default=None,
                   help="upper clip bound (DAPO clip-higher, arXiv 2503.14476); if not given, --epsilon")
    g.add_argument("--loss-type", default="grpo", choices=["grpo", "dapo", "dr_grpo"],
                   help="grpo: 1/G sum_i 1/|o_i| sum_t (the paper); dapo: token-level mean; "
                        "dr_grpo: sum / (N * max-new-tokens) (arXiv 2503.20783)")
    g.add_argument("--scale-rewards", default="group", choices=["group", "batch", "none"],
                   help="advantage = (r - group mean) / std of the group | of the batch | no division (Dr. GRPO)")
    g.add_argument("--ratio-level", default="token", choices=["token", "sequence"],
                   help="token: eq. 3; sequence: one ratio per completion (GSPO, arXiv 2507.18071)")
    g.add_argument("--num-iterations", type=int, default=1,
                   help="mu, optimizer updates per batch of samples; >1 keeps the first iteration's log-probs as "
                        "pi_old's")
    g.add_argument("--reward-weights", default="1.0,1.0",
                   help="comma-separated weight per reward function, in order: correctness,format "
                        "(demo: correctness); total reward = weighted sum")

    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.9, help="sampling temperature for training rollouts")
    g.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling (1.0 = off)")
    g.add_argument("--top-k", type=int, default=50, help="top-k sampling (0 = off)")
    g.add_argument("--max-new-tokens", type=int, default=300, help="generation budget per completion")

    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=200,
                   help="training steps; each samples batch-size x gradient-accumulation-steps prompts and makes "
                        "num-iterations optimizer updates")
    g.add_argument("--batch-size", type=int, default=1, help="prompts per micro-batch")
    g.add_argument("--gradient-accumulation-steps", type=int, default=4, help="micro-batches per optimizer update")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="completions per forward/backward (a multiple of G); if given, replaces batch-size*G to "
                        "save memory without changing the math")
    g.add_argument("--lr", type=float, default=5e-5, help="AdamW learning rate")
    g.add_argument("--lr-scheduler", default="linear", choices=["linear", "cosine", "constant", "constant_with_warmup"],
                   help="learning-rate schedule (transformers.get_scheduler) over steps x num-iterations updates")
    g.add_argument("--warmup-steps", type=int, default=0, help="LR warmup, in optimizer updates")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (global L2 norm)")

    g = p.add_argument_group("precision and memory")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
    g.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="autocast compute dtype; parameters and AdamW state stay fp32. auto: bf16 on CUDA, fp32 on CPU")
    g.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute activations in backward: less memory, ~30%% more time")

    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-only", action="store_true", help="evaluate --model on the test split and exit")
    g.add_argument("--eval-every", type=int, default=0,
                   help="evaluate every N steps; 0: only before and after training; -1: never")
    g.add_argument("--eval-samples", type=int, default=8, help="completions sampled per test question")
    g.add_argument("--eval-temperature", type=float, default=0.7, help="sampling temperature for eval")
    g.add_argument("--eval-limit", type=int, default=None, help="evaluate on the first N test questions only")
    g.add_argument("--eval-batch-size", type=int, default=8, help="test questions per generate call")

    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--output-dir", default=None,
                   help="metrics.jsonl and checkpoint/ go here; if not given, runs/<model name>-seed<seed>")
    g.add_argument("--save-every", type=int, default=50,
                   help="checkpoint every N steps (and always at the end); 0: at the end only")
    g.add_argument("--sample-every", type=int, default=10, help="print one sampled completion every N steps; 0: never")
    g.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoint")
    g.add_argument("--seed", type=int, default=42, help="seeds torch, numpy, random and the data order")

    g = p.add_argument_group("demo")
    g.add_argument("--demo", action="store_true",
                   help="offline demo: a tiny Llama and tokenizer built in code, a synthetic addition task, CPU; "
                        "changes the defaults to DEMO_DEFAULTS (any flag still overrides)")
    g.add_argument("--demo-warmup-steps", type=int, default=400,
                   help="demo only: at most this many supervised warm-up steps before GRPO")
    g.add_argument("--demo-target-accuracy", type=float, default=0.1,
                   help="demo only: the warm-up stops once the model answers right this often")
    return p


# --demo swaps in these defaults (a flag given on the command line still wins). Tuned on the 2-core CPU: 16 prompts x
# G=8 per step and mu=4 updates per batch (generation dominates a tiny model's step, so reusing samples is cheap).
DEMO_DEFAULTS = dict(model="demo", steps=150, batch_size=8, gradient_accumulation_steps=2, num_generations=8,
                     num_iterations=4, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, lr=2e-3, beta=0.04,
                     reward_weights="1.0", eval_every=50, eval_samples=4, eval_temperature=1.0, eval_batch_size=100,
                     save_every=0, sample_every=50)


class UserError(Exception):
    """Bad input. main() prints the message (one paragraph) to stderr and exits with code 2, without a traceback."""


def parse_args(argv=None):
    """Parse and check the flags, then fill in the values computed at run time (device, dtype, output dir)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.demo:
        parser.set_defaults(**DEMO_DEFAULTS)
        args = parser.parse_args(argv)
    G = args.num_generations
    if G < 2:
        raise UserError(f"--num-generations must be at least 2 (got {G}): GRPO's advantage compares each completion "
                        "with the others of its group, so a group of one has no learning signal.")
    for flag, value, low in [("--steps", args.steps, 0), ("--batch-size", args.batch_size, 1),
                             ("--gradient-accumulation-steps", args.gradient_accumulation_steps, 1),
                             ("--num-iterations", args.num_iterations, 1), ("--max-new-tokens", args.max_new_tokens, 1),
                             ("--eval-samples", args.eval_samples, 1), ("--eval-batch-size", args.eval_batch_size, 1)]:
        if value < low:
            raise UserError(f"{flag} must be at least {low}, got {value}.")
    if args.micro_batch_size is not None and (args.micro_batch_size < G or args.micro_batch_size % G):
        raise UserError(f"--micro-batch-size is counted in completions and must be a positive multiple of "
                        f"--num-generations ({G}) so that each micro-batch holds whole groups; got "
                        f"{args.micro_batch_size}. Try {G * max(1, args.micro_batch_size // G)}.")
    if args.temperature <= 0 or args.eval_temperature <= 0:
        raise UserError("--temperature and --eval-temperature must be > 0 (training samples, and its log-probs "
                        "divide the logits by the temperature).")
    if args.beta < 0 or args.epsilon <= 0:
        raise UserError(f"--beta must be >= 0 and --epsilon > 0, got beta={args.beta}, epsilon={args.epsilon}.")
    try:
        args.reward_weights = [float(w) for w in str(args.reward_weights).split(",")]
    except ValueError:
        raise UserError(f"--reward-weights must be comma-separated numbers, got {args.reward_weights!r}.") from None

    local = os.path.abspath(os.path.expanduser(args.model))
    if not args.demo and args.model.startswith((".", "/", "~")) and not os.path.isdir(local):
        raise UserError(f"--model {args.model!r} looks like a local path, but {local} is not a directory. Pass the "
                        "directory holding config.json and the weights, a hub id, or a SmolLM2 short name.")

    # Values computed at run time.
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but torch sees no CUDA device; use --device cpu.")
    if args.dtype == "auto":
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.output_dir is None:
        name = "demo" if args.demo else os.path.basename(os.path.normpath(args.model))
        args.output_dir = os.path.join("runs", f"{name}-seed{args.seed}")
    return args


# ----------------------------------------------------------------------------------------------------------------------
# Model, tokenizer, data.

SMOLLM2_SHORT = re.compile(r"smollm2-(135m|360m|1\.7b)(-instruct)?", re.IGNORECASE)


def resolve_model_name(name):
    """--model as typed -> what from_pretrained gets: a local directory as is; a SmolLM2 short name
    ("SmolLM2-1.7B-Instruct", any case) -> "HuggingFaceTB/SmolLM2-1.7B-Instruct"; anything else (a hub id) as is."""
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)
    match = SMOLLM2_SHORT.fullmatch(name.strip())
    if match:
        return f"HuggingFaceTB/SmolLM2-{match.group(1).upper()}" + ("-Instruct" if match.group(2) else "")
    return name


def load_model_and_tokenizer(args, name=None):
    """The fp32 causal LM and its tokenizer (left padding, a pad token), or a UserError saying what was tried."""
    name = name or args.model
    resolved = resolve_model_name(name)
    local = os.path.abspath(os.path.expanduser(name))
    try:
        kw = dict(trust_remote_code=args.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(resolved, **kw)
        model = AutoModelForCausalLM.from_pretrained(resolved, dtype=torch.float32, **kw)
    except Exception as e:  # OSError (missing / offline), ValueError (unknown architecture), HFValidationError, ...
        reason = " ".join(str(e).split())[:400]
        hub = "" if os.path.isdir(local) else f"; the Hugging Face hub id {resolved!r} ({reason})"
        raise UserError(
            f"could not load model {name!r}. Tried: the local directory {local} "
            f"({'exists, but loading failed: ' + reason if os.path.isdir(local) else 'not found'}){hub}. "
            "Pass a local directory holding config.json and the weights, a full hub id such as "
            "HuggingFaceTB/SmolLM2-1.7B-Instruct, or a SmolLM2 short name (SmolLM2-135M, SmolLM2-360M, SmolLM2-1.7B, "
            "each with or without -Instruct). On a machine without network, download the model elsewhere and pass its "
            "directory; models with custom code also need --trust-remote-code.") from None
    prepare_tokenizer(tokenizer)
    return model, tokenizer


def prepare_tokenizer(tokenizer):
    # Left padding: every prompt of a batch then ends at the same column, where generation starts.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def eos_token_ids(model, tokenizer):
    """The ids generation stops at: the generation config's EOS (an int or a list), else the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos)


def gsm8k_task(args):
    """Train/test rows and the reward functions for GSM8K. A task is a plain dict:
    train/eval: lists of {"question", "answer"}; prompt(tokenizer, question) -> str; rewards: [(name, fn, weight)]."""
    eval_path = args.eval_data
    if eval_path is None and args.data is not None:  # --data .../train.jsonl: use the test.jsonl beside it
        beside = os.path.join(os.path.dirname(os.path.abspath(args.data)), "test.jsonl")
        eval_path = beside if os.path.isfile(beside) and os.path.abspath(args.data) != beside else None
    need_train, need_eval = not args.eval_only, args.eval_only or args.eval_every >= 0
    train_rows = load_rows("train", args.data, "--data") if need_train else []
    eval_rows = load_rows("test", eval_path, "--eval-data") if need_eval else []
    return dict(train=train_rows, eval=eval_rows, prompt=data.build_prompt,
                rewards=reward_list(list(rewards.REWARD_FUNCS.items()), args.reward_weights))


def load_rows(split, path, flag):
    if path is not None and not os.path.isfile(path):
        raise UserError(f"{flag} {path}: no such file. Pass a GSM8K-format JSONL file (one "
                        '{"question": ..., "answer": "... #### <number>"} object per line).')
    try:
        return data.load_gsm8k(split, path=path)
    except ValueError as e:  # data.py names the file and line: "path:12: malformed JSON (...)"
        raise UserError(f"could not load the GSM8K {split} data: {e}. Each line of {flag} must be a JSON object with "
                        'a "question" string and an "answer" string ending in "#### <number>".') from None
    except (OSError, RuntimeError) as e:  # unreadable file, or no network for the download
        hint = " (or --eval-every -1 to skip evaluation)" if split == "test" else ""
        raise UserError(f"could not load the GSM8K {split} data: {e} Pass a local file with {flag} PATH{hint}."
                        ) from None


def reward_list(named_fns, weights):
    if len(weights) != len(named_fns):
        names = ",".join(n for n, _ in named_fns)
        raise UserError(f"--reward-weights needs one weight per reward function ({names}): "
                        f"{len(named_fns)} numbers, got {len(weights)}.")
    return [(name, fn, w) for (name, fn), w in zip(named_fns, weights)]


# ----------------------------------------------------------------------------------------------------------------------
# The pieces of one step (bench.py imports and times these).


def autocast(args):
    """Compute in bf16/fp16 under autocast while parameters and AdamW state stay fp32: with lr 1e-6..5e-5, updates
    to bf16 weights round away to nothing (the bug of minimal repos that train in pure bf16)."""
    if args.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=args.device, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype])


def tokenize_prompts(tokenizer, prompts, device):
    """Each prompt tokenized once, left-padded: ids and mask [B, P]. (Chat templates already hold any BOS.)"""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


class TemperatureTopKTopP(LogitsProcessor):
    """Temperature, then top-k, then top-p (nucleus) over the k survivors only, in one processor: the same
    distribution as transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper in that order (HF's
    order), without sorting the whole vocabulary at every decode step (HF's top-p sorts all V logits even after top-k
    has left 50: at V = 49,152 and 8 rows, 64 decode steps took 0.9-1.2 s with HF's three warpers and 0.12 s with
    this one, on one CPU thread). The temperature is applied here, not by HF's warper,
    because generate() runs a user's processors before its own warpers, and top-p depends on the temperature.
    top_k=0: no top-k (top-p then sorts all V, as HF does); top_p=1.0: no top-p. Scores [n, V] in, [n, V] out: the
    survivors keep their logits / temperature, every other token gets -inf."""

    def __init__(self, temperature, top_k, top_p):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def __call__(self, input_ids, scores):
        scores = scores / self.temperature                                        # as TemperatureLogitsWarper
        V = scores.shape[-1]
        k = min(self.top_k, V) if self.top_k > 0 else V
        values, indices = scores.topk(k, dim=-1)                                  # [n, k], descending
        kth = values[:, -1:]
        tied = int((scores >= kth).sum(-1).max())  # HF keeps every token tied with the k-th logit: widen to them
        if tied > k:
            values, indices = scores.topk(tied, dim=-1)
            values = values.masked_fill(values < kth, float("-inf"))
        if self.top_p < 1.0:
            # TopPLogitsWarper's lines, on the survivors: ascending order, drop the tokens whose cumulative
            # probability stays <= 1 - top_p, always keep the most likely one.
            values, indices = values.flip(-1), indices.flip(-1)                   # ascending
            cumulative = values.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= (1 - self.top_p)
            remove[..., -1:] = False
            values = values.masked_fill(remove, float("-inf"))
        return torch.full_like(scores, float("-inf")).scatter_(-1, indices, values)


def sampling_settings(args, tokenizer, eos, *, num_return_sequences, temperature, min_new_tokens=0):
    """The GenerationConfig and logits processors of a rollout, from the flags only. Everything that could change the
    sampled distribution is stated (a checkpoint's generation_config.json is ignored: e.g. Qwen2.5's
    repetition_penalty 1.05 would make the sampled tokens' probabilities differ from the ones token_logprobs
    scores, which are softmax(logits / temperature) after top-k/top-p only). Order, as in transformers:
    temperature -> top-k -> top-p, all in TemperatureTopKTopP (HF's own warpers are off).
    min_new_tokens: bench.py's fixed-length generation (EOS forbidden before that many tokens); 0 in training."""
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
        min_new_tokens=min_new_tokens or None, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
        num_return_sequences=num_return_sequences, num_beams=1, use_cache=True,
        # Off, stated for the reader (flags_only already keeps the checkpoint's values out of the call).
        repetition_penalty=1.0, no_repeat_ngram_size=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
    processors = LogitsProcessorList([TemperatureTopKTopP(temperature, args.top_k, args.top_p)])
    return config, processors


@contextlib.contextmanager
def flags_only(model):
    """generate() fills every unset (None) field of the GenerationConfig it is given from model.generation_config
    (suppress_tokens, bad_words_ids, min_p, forced_eos_token_id, ...). Set the checkpoint's one aside for the call,
    so the library defaults are all it can fall back on."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def prefill_prompts(model, prompt_ids, prompt_mask, num_generations):
    """The KV cache of every prompt but its last token, computed once per prompt ([B, P-1]) and repeated G times
    (rows group after group), or None where that cannot be done (P == 1, or a cache without
    batch_repeat_interleave). generate() expands the prompts to [B*G, P] before its prefill, so it runs each prompt
    G times: [8, 64] took 1.35 s against 0.21 s for [1, 63] on bench.py's 100m config (one CPU thread)."""
    if prompt_ids.shape[1] < 2:
        return None
    ids, attn = prompt_ids[:, :-1], prompt_mask[:, :-1]
    position_ids = (attn.long().cumsum(-1) - 1).masked_fill(attn == 0, 1)  # as generate() computes them
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    cache = model(input_ids=ids, attention_mask=attn, position_ids=position_ids, use_cache=True,
                  **keep).past_key_values                                       # no [B, P-1, V] logits
    if not hasattr(cache, "batch_repeat_interleave"):
        return None
    cache.batch_repeat_interleave(num_generations)                            # [B, ...] -> [B*G, ...]
    return cache


def generate_completions(model, tokenizer, prompt_ids, prompt_mask, args, *, num_generations=None, temperature=None,
                         min_new_tokens=0):
    """One batched generate call: G samples per prompt. Returns sequences [B*G, P+C], laid out group after group,
    so row b*G+j is prompt b's j-th sample. Sampling follows the flags only (sampling_settings). Each prompt's
    prefill runs once (prefill_prompts); generate then feeds only the last prompt token of each of the B*G rows
    before it decodes."""
    G = num_generations or args.num_generations
    eos = eos_token_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    with torch.no_grad(), autocast(args), flags_only(model):
        cache = prefill_prompts(model, prompt_ids, prompt_mask, G)
        config, processors = sampling_settings(args, tokenizer, eos, num_return_sequences=1 if cache is not None else G,
                                               temperature=temperature or args.temperature,
                                               min_new_tokens=min_new_tokens)
        if cache is not None:
            out = model.generate(input_ids=prompt_ids.repeat_interleave(G, dim=0),
                                 attention_mask=prompt_mask.repeat_interleave(G, dim=0), past_key_values=cache,
                                 generation_config=config, logits_processor=processors)
        else:  # num_return_sequences=G repeats each prompt G times in place: the same layout
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
                                 logits_processor=processors)
    model.train(was_training)
    return out


def decode_completions(tokenizer, completion_ids, mask):
    """Texts for the reward functions: each completion up to its EOS, special tokens dropped."""
    lengths = mask.sum(1).tolist()
    return tokenizer.batch_decode([ids[:n] for ids, n in zip(completion_ids.tolist(), lengths)],
                                  skip_special_tokens=True)


def score_completions(completions, answers, reward_fns):
    """Total reward [N] = sum of weight * fn(completions, answers), and each function's rewards {name: [N]}."""
    per_fn = {name: torch.tensor(fn(completions, answers), dtype=torch.float32) for name, fn, _ in reward_fns}
    total = sum(w * per_fn[name] for name, _, w in reward_fns)
    return total, per_fn


def training_batch(sequences, prompt_mask, completion_mask, advantages, num_generations):
    """The dict that compute_logps and policy_update take. input_ids [N, P+C] (prompt + completion, as generated),
    attention_mask [N, P+C] (the prompt's padding mask repeated G times, then the completion mask), completion_mask
    [N, C], advantages [N]; ref_logps and old_logps [N, C] are filled in by steps 7 and 8 (None when skipped)."""
    attention_mask = torch.cat([prompt_mask.repeat_interleave(num_generations, dim=0), completion_mask], dim=1)
    return dict(input_ids=sequences, attention_mask=attention_mask, completion_mask=completion_mask,
                advantages=advantages, ref_logps=None, old_logps=None)


def micro_batches(n, args):
    """Row slices of whole groups: batch-size prompts (x G completions) each, or --micro-batch-size completions."""
    size = args.micro_batch_size or args.batch_size * args.num_generations
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def trim(batch, rows):
    """One micro-batch's tensors without the columns no row of it needs: leading prompt padding (position ids come
    from the mask, so dropping all-pad columns changes nothing) and completion columns after its longest completion."""
    ids, attn, mask = batch["input_ids"][rows], batch["attention_mask"][rows], batch["completion_mask"][rows]
    C = mask.shape[1]
    P = ids.shape[1] - C
    first = int(attn[:, :P].any(0).nonzero()[0]) if attn[:, :P].any() else P - 1
    keep = max(1, int(mask.sum(1).max()))  # completion columns this micro-batch needs
    end = P + keep
    return ids[:, first:end], attn[:, first:end], keep


@torch.no_grad()
def compute_logps(model, batch, args):
    """Step 7: log-probs [N, C] of the sampled tokens under a frozen model (the reference), in micro-batches of whole
    groups. Zero after each micro-batch's longest completion (those tokens are masked)."""
    was_training = model.training
    model.eval()
    N, C = batch["completion_mask"].shape
    out = torch.zeros(N, C, device=batch["completion_mask"].device)
    for rows in micro_batches(N, args):
        ids, attn, keep = trim(batch, rows)
        with autocast(args):
            # Under --gradient-checkpointing the policy's forward takes token_logprobs' plain path (no KV cache in
            # training), so the reference takes it too (group_size=1): pi_ref and pi_theta then come from the same
            # computation, and the KL at step 1 is 0 in fp32, not the rounding difference of two paths.
            out[rows, :keep] = grpo.token_logprobs(
                model, ids, attn, keep, args.temperature,
                group_size=1 if args.gradient_checkpointing else args.num_generations)
    model.train(was_training)
    return out


def loss_normalizer(mask, args):
    """The whole step's denominator of eq. 3's averages, so micro-batch losses add up to the full-batch loss."""
    if args.loss_type == "grpo":
        return mask.shape[0]                        # 1/G sum_i over all N sequences (1/|o_i| is per row)
    if args.loss_type == "dapo":
        return int(mask.sum())                      # all unmasked tokens of the step
    return mask.shape[0] * args.max_new_tokens      # Dr. GRPO: N * generation budget


def policy_update(model, optimizer, scheduler, batch, args, scaler=None):
    """Step 9, one of the mu iterations: forward + backward over micro-batches of whole groups (gradients accumulate),
    then clip, AdamW step, LR schedule step. Returns the iteration's loss and statistics (floats).

    Step 8 happens here too: when mu > 1 and batch["old_logps"] is None (the first iteration), every micro-batch
    runs before the optimizer step, on pi_old's weights, so its log-probs ARE pi_old's. They are kept (detached)
    and stored in batch["old_logps"] [N, C] for iterations 2..mu: no separate forward pass."""
    model.train()
    mask = batch["completion_mask"]                 # [N, C]
    N = mask.shape[0]
    normalizer = loss_normalizer(mask, args)
    lr = scheduler.get_last_lr()[0]
    totals = dict(loss=0.0, tokens=0, kl=0.0, clipped=0, ratio=0.0)
    keep_old = batch["old_logps"] is None and args.num_iterations > 1
    old_logps = torch.zeros(mask.shape, device=mask.device) if keep_old else None  # [N, C]; 0 = masked tokens
    optimizer.zero_grad(set_to_none=True)
    for rows in micro_batches(N, args):
        ids, attn, keep = trim(batch, rows)
        old = batch["old_logps"][rows, :keep] if batch["old_logps"] is not None else None
        ref = batch["ref_logps"][rows, :keep] if batch["ref_logps"] is not None else None
        stats = {}
        with autocast(args):
            logps = grpo.token_logprobs(model, ids, attn, keep, args.temperature,
                                        group_size=args.num_generations)  # [n, keep], with grad
        if keep_old:
            old_logps[rows, :keep] = logps.detach()     # pi_old: no update has happened yet in this iteration
        loss = grpo.grpo_loss(logps, old, ref, batch["advantages"][rows], mask[rows, :keep], epsilon=args.epsilon,
                              epsilon_high=args.epsilon_high, beta=args.beta, loss_type=args.loss_type,
                              max_tokens=args.max_new_tokens, normalizer=normalizer, ratio_level=args.ratio_level,
                              stats=stats)
        (scaler.scale(loss) if scaler is not None else loss).backward()  # no division by the number of micro-batches
        totals["loss"] += loss.item()
        for k in ("tokens", "kl", "clipped", "ratio"):
            totals[k] += stats[k]
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    if keep_old:
        batch["old_logps"] = old_logps
    tokens = max(totals["tokens"], 1)
    return dict(loss=totals["loss"], kl=totals["kl"] / tokens, clip_frac=totals["clipped"] / tokens,
                ratio=totals["ratio"] / tokens, grad_norm=float(grad_norm), lr=lr)


def evaluate(model, tokenizer, task, args):
    """Mean reward of each reward function over --eval-samples completions per test question (--eval-limit questions).
    Runs under its own RNG seeded with --seed, so it neither perturbs nor depends on the training RNG stream."""
    rows = task["eval"][: args.eval_limit]
    sums = {name: 0.0 for name, _, _ in task["rewards"]}
    count = 0
    devices = [torch.cuda.current_device()] if args.device == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(args.seed)
        for i in range(0, len(rows), args.eval_batch_size):
            chunk = rows[i: i + args.eval_batch_size]
            ids, attn = tokenize_prompts(tokenizer, [task["prompt"](tokenizer, r["question"]) for r in chunk],
                                         args.device)
            out = generate_completions(model, tokenizer, ids, attn, args, num_generations=args.eval_samples,
                                       temperature=args.eval_temperature)
            completion_ids = out[:, ids.shape[1]:]
            texts = decode_completions(tokenizer, completion_ids,
                                       grpo.completion_mask(completion_ids, eos_token_ids(model, tokenizer)))
            answers = [r["answer"] for r in chunk for _ in range(args.eval_samples)]
            for name, fn, _ in task["rewards"]:
                sums[name] += sum(fn(texts, answers))
            count += len(texts)
    return {name: s / max(count, 1) for name, s in sums.items()}


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints: OUTPUT_DIR/checkpoint holds save_pretrained's model + tokenizer (loadable by
# AutoModelForCausalLM.from_pretrained) and training_state.pt (optimizer, scheduler, step, RNG states, args).


def rng_state():
    state = dict(python=random.getstate(), torch=torch.get_rng_state(),
                 numpy={k: v.tolist() if isinstance(v, np.ndarray) else v
                        for k, v in zip(("kind", "keys", "pos", "has_gauss", "cached"), np.random.get_state())})
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir, model, tokenizer, training_state):
    """Write OUTPUT_DIR/checkpoint atomically: into checkpoint.tmp, then swap it in with renames, so a crash at any
    moment leaves a complete checkpoint (the new one, or the previous one as checkpoint.old)."""
    final = os.path.join(output_dir, "checkpoint")
    tmp, old = final + ".tmp", final + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(training_state, os.path.join(tmp, "training_state.pt"))
    if os.path.isdir(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def find_checkpoint(output_dir):
    """OUTPUT_DIR/checkpoint, or checkpoint.old when a crash hit between save_checkpoint's two renames."""
    for name in ("checkpoint", "checkpoint.old"):
        path = os.path.join(output_dir, name)
        if os.path.isfile(os.path.join(path, "training_state.pt")):
            return path
    return None


def load_checkpoint(path):
    """training_state.pt of a checkpoint directory (the weights are loaded with from_pretrained)."""
    return torch.load(os.path.join(path, "training_state.pt"), weights_only=True)  # tensors and plain data only


# ----------------------------------------------------------------------------------------------------------------------
# The offline demo: a tiny Llama learns single-digit addition ("3 + 4 =" -> "<answer> 7 </answer>") from the reward.


def build_demo(args):
    """A seeded tiny Llama (2 layers, hidden 64), a word-level tokenizer built in code, and a verifiable task:
    single-digit addition, "3 + 4 =" -> "<answer> 7 </answer>", all 100 problems (the demo trains and measures on the
    same 100: it shows the reward rising, not generalization). The reward is rewards.correctness_reward, the same
    function the GSM8K run uses. A short supervised warm-up (demo_warmup) first brings the model to about
    --demo-target-accuracy; everything above that comes from GRPO.
    """
    # One thread: a model this small gains nothing from intra-op parallelism, and spinning OpenMP threads slow it
    # down many times over (measured 60x here) when other processes share the cores.
    torch.set_num_threads(1)
    model, tokenizer = demo_model_and_tokenizer(args.seed)
    problems = [{"question": f"{a} + {b} =", "answer": str(a + b)} for a in range(10) for b in range(10)]
    steps = demo_warmup(model, tokenizer, problems, args)
    print(f"demo: a {sum(p.numel() for p in model.parameters()):,}-parameter Llama; supervised warm-up stopped after "
          f"{steps} steps at p(right answer) = {demo_accuracy(model, tokenizer, problems):.3f}", flush=True)
    task = dict(train=problems, eval=problems, prompt=lambda tokenizer, question: question,
                rewards=reward_list([("correctness", rewards.correctness_reward)], args.reward_weights))
    return model, tokenizer, task


def demo_model_and_tokenizer(seed):
    """A randomly initialized (seeded) 2-layer Llama with hidden size 64, and a word-level tokenizer over the words
    "+ = <answer> </answer> 0 .. 18" (whitespace-separated; anything else is <unk>), with pad and EOS tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", "+", "=", "<answer>", "</answer>"] + [str(n) for n in range(19)]
    word_level = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    prepare_tokenizer(tokenizer)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(words), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model, tokenizer


def demo_examples(tokenizer, problems):
    """Token ids [100, 7] of the right completions "a + b = <answer> a+b </answer> <eos>" (3 prompt + 4 completion
    tokens, no padding) and labels with the prompt masked out (-100)."""
    texts = [f"{p['question']} <answer> {p['answer']} </answer> <eos>" for p in problems]
    ids = tokenizer(texts, return_tensors="pt", add_special_tokens=False)["input_ids"]
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


def demo_warmup(model, tokenizer, problems, args, batch_size=64, lr=3e-3):
    """Supervised warm-up on the right completions, stopped as soon as the model would answer right
    --demo-target-accuracy of the time (checked every 5 steps; at most --demo-warmup-steps): GRPO then starts from a
    weak but non-zero skill, as it does from a pretrained model. Returns the number of warm-up steps taken."""
    ids, labels = demo_examples(tokenizer, problems)
    gen = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(args.demo_warmup_steps):
        if step % 5 == 0 and demo_accuracy(model, tokenizer, problems) >= args.demo_target_accuracy:
            return step
        model.train()
        idx = torch.randint(len(problems), (batch_size,), generator=gen)
        loss = model(input_ids=ids[idx], labels=labels[idx]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return args.demo_warmup_steps


@torch.no_grad()
def demo_accuracy(model, tokenizer, problems):
    """The exact expected correctness of sampling at T=1 (no top-k/top-p): the mean over problems of the probability
    of writing the right completion, teacher-forced in one forward pass."""
    ids, _ = demo_examples(tokenizer, problems)
    was_training = model.training
    model.eval()
    logps = torch.log_softmax(model(input_ids=ids).logits[:, 2:-1].float(), -1)  # positions 2..5 predict tokens 3..6
    model.train(was_training)
    return logps.gather(-1, ids[:, 3:, None]).sum((1, 2)).exp().mean().item()


# ----------------------------------------------------------------------------------------------------------------------
# The loop.


# The logged fields (one line per step on stdout, the same as a JSON line in OUTPUT_DIR/metrics.jsonl):
#   loss                     grpo_loss of the whole step (mean over the mu iterations); ~beta*KL at mu=1 (seed 002's
#                            "curious case": standardized advantages average to 0, the gradient does not)
#   reward, reward_std       total (weighted) reward over the step's B*G completions
#   rewards/<fn>, _std       each reward function separately; accuracy = rewards/correctness
#   kl                       masked token mean of k3 against the reference (0 when beta = 0)
#   clip_frac                fraction of completion tokens where the clipped term is the active one
#   grad_norm                global gradient norm before clipping
#   completion_len_mean/max  completion tokens up to and including EOS
#   frac_zero_std            fraction of groups whose G rewards are all equal (advantage 0: no signal)
#   lr, step_time (s), tokens_per_s (completion tokens / step time), eta_s
# Eval lines carry eval/<fn>: the mean reward over --eval-samples completions per test question.
def log_step(step, args, metrics, log_file):
    per_fn = " ".join(f"{name} {metrics[f'rewards/{name}']:.3f}±{metrics[f'rewards/{name}_std']:.2f}"
                      for name in metrics["reward_names"])
    kl = f" | kl {metrics['kl']:.4f}" if args.beta > 0 else ""
    print(f"step {step + 1}/{args.steps} | loss {metrics['loss']:+.4f} | reward {metrics['reward']:.3f}"
          f"±{metrics['reward_std']:.2f} | {per_fn} | acc {metrics['accuracy']:.3f}{kl} | "
          f"clip {metrics['clip_frac']:.3f}"
          f" | len {metrics['completion_len_mean']:.0f}/{metrics['completion_len_max']} | zero-std "
          f"{metrics['frac_zero_std']:.2f} | lr {metrics['lr']:.2e} | {metrics['step_time']:.2f}s | "
          f"{metrics['tokens_per_s']:.0f} tok/s | eta {format_seconds(metrics['eta_s'])}", flush=True)
    row = {k: v for k, v in metrics.items() if k != "reward_names"}
    log_file.write(json.dumps({"step": step + 1, **row}) + "\n")
    log_file.flush()


def format_seconds(s):
    return f"{s / 3600:.1f}h" if s >= 3600 else f"{s / 60:.1f}m" if s >= 60 else f"{s:.0f}s"


def print_eval_table(history, count, args):
    before, after = history[0][1], history[-1][1]
    print(f"\neval on {count} questions x {args.eval_samples} samples (T={args.eval_temperature}), "
          f"step {history[0][0]} -> {history[-1][0]}")
    print(f"  {'reward':<14}{'before':>8}{'after':>8}")
    for name in before:
        print(f"  {name:<14}{before[name]:>8.4f}{after[name]:>8.4f}")


def reference_model(model, args, copy_needed=True):
    """pi_ref: a frozen copy of the initial policy (eval mode, no grad), or None when beta == 0: then the KL term is
    off, no reference model exists at all and step 7 is skipped. copy_needed=False reuses `model` itself (on resume
    the policy is loaded from the checkpoint instead).

    With --dtype bf16/fp16 the reference is stored in that dtype (it is never trained; half the memory of fp32 on
    the GPU), cast before it is moved, so no transient fp32 copy lands on the device. Its log-probs then differ from
    the fp32 policy's under autocast by rounding: the KL at step 1 is about 1e-3, not 0 (measured on SmolLM2-135M
    under CPU bf16 autocast: mean k3 1.04e-3). In fp32 (CPU) it is 0."""
    if args.beta == 0:
        return None
    ref = copy.deepcopy(model) if copy_needed else model
    ref.requires_grad_(False).eval()
    if args.dtype != "fp32":
        ref.to({"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype])
    return ref.to(args.device)


def build_optimizer(model, args):
    """AdamW on the fp32 parameters, fused (one kernel over all parameters) where torch supports it: CUDA, and CPU
    since torch 2.4 (on bench.py's 100m config, one CPU thread: 0.10 s against 0.58 s per step)."""
    kw = dict(lr=args.lr, weight_decay=args.weight_decay)
    try:
        return torch.optim.AdamW(model.parameters(), fused=True, **kw)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(model.parameters(), **kw)


def train(args):
    set_seed(args.seed)
    device = torch.device(args.device)
    checkpoint = find_checkpoint(args.output_dir) if args.resume and not args.eval_only else None
    if args.resume and not args.eval_only and checkpoint is None:
        raise UserError(f"--resume: no checkpoint in {args.output_dir} (expected {args.output_dir}/checkpoint with "
                        "training_state.pt). Pass the --output-dir of the run to continue, or drop --resume.")
    # Data first: a bad file should fail in a second, not after loading a 1.7B model.
    from_checkpoint = False
    if args.demo:
        model, tokenizer, task = build_demo(args)
    else:
        task = gsm8k_task(args)
        # Resuming with beta == 0 needs no initial weights (there is no reference model): load the checkpoint only.
        from_checkpoint = checkpoint is not None and args.beta == 0
        model, tokenizer = load_model_and_tokenizer(args, checkpoint if from_checkpoint else None)
    eval_enabled = args.eval_every >= 0 and len(task["eval"]) > 0
    n_eval = len(task["eval"][: args.eval_limit])
    if args.eval_only:
        model.to(device)
        result = evaluate(model, tokenizer, task, args)
        print(f"eval on {n_eval} questions x {args.eval_samples} samples: "
              + ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
        return result

    ref_model = reference_model(model, args, copy_needed=checkpoint is None)
    if checkpoint and not from_checkpoint:  # the policy continues from the checkpoint (the reference stays initial)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                     trust_remote_code=args.trust_remote_code)
    model.to(device)
    if args.gradient_checkpointing:
        # use_reentrant=False: torch's recommended variant. Only training-mode forwards recompute; generation and the
        # no-grad log-prob passes run in eval mode and keep their KV cache. (transformers 5 renamed the method.)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    optimizer = build_optimizer(model, args)
    scheduler = get_scheduler(args.lr_scheduler, optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=args.steps * args.num_iterations)
    # fp16 autocast needs loss scaling; bf16 and fp32 do not.
    scaler = torch.amp.GradScaler("cuda") if args.dtype == "fp16" and args.device == "cuda" else None

    os.makedirs(args.output_dir, exist_ok=True)
    start_step, eval_history = 0, []
    if checkpoint:
        state = load_checkpoint(checkpoint)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        start_step, eval_history = state["step"], state["eval_history"]
        set_rng_state(state["rng"])
        print(f"resumed from {checkpoint} at step {start_step}")
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    kept = []
    if checkpoint and os.path.isfile(metrics_path):  # drop lines logged after the checkpoint, by a run that went on
        with open(metrics_path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= start_step]
    log_file = open(metrics_path, "w")
    log_file.writelines(kept)

    def save(step, rng):
        state = dict(step=step, optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
                     scaler=scaler.state_dict() if scaler is not None else None, rng=rng,
                     eval_history=eval_history, args=vars(args))
        path = save_checkpoint(args.output_dir, model, tokenizer, state)
        print(f"saved {path} (step {step})", flush=True)

    def run_eval(step):
        result = evaluate(model, tokenizer, task, args)
        eval_history.append((step, result))
        print(f"eval @ step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()), flush=True)
        log_file.write(json.dumps({"step": step, **{f"eval/{k}": v for k, v in result.items()}}) + "\n")
        log_file.flush()

    G, eos = args.num_generations, eos_token_ids(model, tokenizer)
    prompts_per_step = args.batch_size * args.gradient_accumulation_steps
    print(f"GRPO: {sum(p.numel() for p in model.parameters()):,} parameters on {args.device} ({args.dtype}); "
          f"{args.steps} steps x {prompts_per_step} prompts x G={G}, mu={args.num_iterations}, beta={args.beta}; "
          f"output {args.output_dir}", flush=True)
    if eval_enabled and not eval_history:
        run_eval(start_step)
    batches = data.prompt_batches(task["train"], prompts_per_step, args.seed, start_step)
    step, step_rng, updates_this_step, times = start_step, rng_state(), 0, []
    try:
        for step in range(start_step, args.steps):
            t0 = time.time()
            step_rng, updates_this_step = rng_state(), 0  # for a Ctrl-C before this step's first update
            # 1. Sample a batch of prompts, each tokenized once: [B, P], left-padded.
            rows = next(batches)
            prompts = [task["prompt"](tokenizer, r["question"]) for r in rows]
            prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, device)
            # 2. pi_old <- pi_theta: pi_old is only ever used through its log-probs, taken in 8 before any update.
            # 3. Sample G outputs per prompt, in one generate call: [B*G, P+C].
            sequences = generate_completions(model, tokenizer, prompt_ids, prompt_mask, args)
            P = prompt_ids.shape[1]
            completion_ids = sequences[:, P:]                                          # [B*G, C]
            # 4. Completion mask: 1 up to and including the first EOS (never derived from the pad id).
            mask = grpo.completion_mask(completion_ids, eos)                           # [B*G, C]
            # 5. Rewards of each completion, each function kept for logging.
            texts = decode_completions(tokenizer, completion_ids, mask)
            answers = [r["answer"] for r in rows for _ in range(G)]
            total_reward, per_fn = score_completions(texts, answers, task["rewards"])  # [B*G], {name: [B*G]}
            # 6. Group-relative advantages (DeepSeekMath sec. 4.1.2): (r - group mean) / group std.
            advantages = grpo.group_advantages(total_reward, G, scale=args.scale_rewards).to(device)  # [B*G]
            batch = training_batch(sequences, prompt_mask, mask, advantages, G)
            # 7. Reference log-probs, for the KL term; skipped when beta == 0 (no reference model exists then).
            if ref_model is not None:
                batch["ref_logps"] = compute_logps(ref_model, batch, args)             # [B*G, C]
            # 8. Old log-probs pi_old. mu == 1: pi_old == pi_theta and grpo_loss uses logps.detach(). mu > 1: the first
            #    iteration of 9 runs entirely before its optimizer step, so its forward gives pi_old's log-probs;
            #    policy_update keeps them in batch["old_logps"] [B*G, C] for iterations 2..mu (no extra pass).
            # 9. mu optimizer updates on the same samples.
            updates = []
            for _ in range(args.num_iterations):
                updates.append(policy_update(model, optimizer, scheduler, batch, args, scaler))
                updates_this_step += 1

            # Logging: one line per step, the same fields in metrics.jsonl.
            times.append(time.time() - t0)
            lengths = mask.sum(1).float()
            groups = total_reward.view(-1, G)
            metrics = dict(
                loss=float(np.mean([u["loss"] for u in updates])),
                reward=total_reward.mean().item(), reward_std=total_reward.std().item(),
                **{f"rewards/{n}": r.mean().item() for n, r in per_fn.items()},
                **{f"rewards/{n}_std": r.std().item() for n, r in per_fn.items()},
                accuracy=per_fn["correctness"].mean().item() if "correctness" in per_fn else float("nan"),
                kl=float(np.mean([u["kl"] for u in updates])),
                clip_frac=float(np.mean([u["clip_frac"] for u in updates])),
                grad_norm=float(np.mean([u["grad_norm"] for u in updates])),
                completion_len_mean=lengths.mean().item(), completion_len_max=int(lengths.max()),
                frac_zero_std=(groups == groups[:, :1]).all(1).float().mean().item(),
                lr=updates[0]["lr"], step_time=times[-1], tokens_per_s=lengths.sum().item() / times[-1],
                eta_s=float(np.mean(times)) * (args.steps - step - 1), reward_names=list(per_fn))
            log_step(step, args, metrics, log_file)
            if args.sample_every > 0 and (step + 1) % args.sample_every == 0:
                print(f"--- sample at step {step + 1}: reward {total_reward[0].item():.2f}, reference answer "
                      f"{answers[0]}\n[prompt, last 300 characters]\n{prompts[0][-300:]}\n[completion]\n"
                      f"{texts[0]}\n---", flush=True)
            if eval_enabled and args.eval_every > 0 and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
                run_eval(step + 1)
            if args.save_every > 0 and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
                save(step + 1, rng_state())
    except KeyboardInterrupt:
        # Before this step's first update (e.g. inside iteration 1, while its forwards also collect pi_old's
        # log-probs), the weights and optimizer are exactly those of the end of the last step: save that, with the
        # RNG as it was then, so --resume redoes this step exactly. After an update, keep it and count the step as
        # done: a Ctrl-C inside iteration k > 1 drops that iteration's partial gradients and iterations k..mu (the
        # step made k-1 updates instead of mu, so the resumed run drifts slightly from an uninterrupted one), and
        # --resume samples the next step's batch. Fine for an interrupt; a crash resumes from the last save instead.
        done = step + 1 if updates_this_step else step
        print(f"\ninterrupted: saving a checkpoint at step {done} before exiting", file=sys.stderr, flush=True)
        save(done, rng_state() if updates_this_step else step_rng)
        log_file.close()
        raise
    if eval_enabled:
        run_eval(args.steps)
    save(args.steps, rng_state())
    log_file.close()
    if eval_enabled and len(eval_history) > 1:
        print_eval_table(eval_history, n_eval, args)
    return eval_history


def main(argv=None):
    try:
        args = parse_args(argv)
        return train(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except torch.cuda.OutOfMemoryError:
        print("error: CUDA ran out of memory. Lower the memory per forward/backward with --micro-batch-size (in "
              "completions, a multiple of --num-generations; e.g. the group size alone), turn on "
              "--gradient-checkpointing, or lower --max-new-tokens / --num-generations / --eval-batch-size. "
              "The last checkpoint (if any) is in the output directory; add --resume to continue from it.",
              file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit(130) from None

"""The run's memory plan on CUDA, decided before step 1: what each phase holds, computed from the
model and the flags, held against the card, and gradient checkpointing turned on where the card
needs it (docs/gpu.md).

The arithmetic is scripts/bench.py --memory's (within -8% and +3% of an H100's measured peaks at the
1.7B shape), from the model in hand instead of a named config: its parameters (LoRA: only the
adapters take gradients and AdamW's moments, and π_ref is the same model), the micro-batch, the
longest prompt, the evaluation's rows. The decode (eager or CUDA graphs) holds the compute-dtype
copy of the Linear weights (autocast's cache, or the graphs' twin) and the KV cache while it runs,
and gives both back after; --compile keeps its twin and its two KV caches for the whole run.

plan(...) returns the phases and the verdict; checkpointing(...) is what train.py and trainer.py
call: the flag as given, else the plan's choice, said in one line, or a UserError of one paragraph
when nothing fits.
"""

import argparse
import sys
from dataclasses import dataclass

import torch

from support import distributed
from support.errors import UserError

GB = 1e9
# Outside torch's allocator: the CUDA context (measured ~0.59 GiB on the H100), and what the
# caching allocator reserves beyond what it hands out (measured 45.30 GiB reserved for a 42.65 GiB
# allocated peak: +6.2%; 37.17 for 34.16: +8.8%).
CONTEXT_BYTES = 600 * 2**20
RESERVED_OVER_ALLOCATED = 1.09
# Autograd's saved bytes per token and layer under bf16 autocast, measured at SmolLM2-1.7B's width
# (hidden 2,048, MLP 8,192: 135.3 kB, scripts/bench.py's activation_bytes_per_token_layer), scaled
# here by hidden + MLP width; fp32 saves twice the bytes.
ACT_PER_WIDTH = 135.3e3 / (2048 + 8192)


@dataclass
class Plan:
    phases: dict  # {phase: bytes} with the flags as planned
    peak: int  # the largest phase
    budget: int  # the card's bytes for tensors: capacity / slack - context
    checkpointing: bool  # as planned

    @property
    def fits(self):
        return self.peak <= self.budget


def phases(model, args, prompt_len, checkpointing, micro=None, max_new=None, lora_rank=None):
    """{phase: bytes} a run of these flags holds on the device, computed from the model."""
    c = model.config
    amp = args.dtype in ("bf16", "fp16")
    width = 2 if amp else 4
    n = sum(p.numel() for p in model.parameters())
    linear = sum(p.numel() for m in linear_modules(model) for p in m.parameters())
    lora = args.lora_rank if lora_rank is None else lora_rank
    L, h = c.num_hidden_layers, c.hidden_size
    mlp = getattr(c, "intermediate_size", 4 * h)
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    # LoRA: the adapters' parameters where the model has them already (train.py and trainer.py
    # plan after adding them), else rank r on every Linear (an upper bound, for what_fits)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if lora and not (args.lora_rank and adapters < n):
        adapters = sum(lora * (m.in_features + m.out_features) for m in linear_modules(model))
    trained = adapters if lora else n
    G = args.num_generations
    seq = prompt_len + (max_new or args.max_new_tokens)
    rows = args.batch_size * args.gradient_accumulation_steps * G
    micro = micro or args.micro_batch_size or args.batch_size * G
    eval_rows = args.eval_batch_size * args.eval_samples
    kv_token = L * 2 * kv_heads * head_dim * width
    copy = width * linear if amp else 0
    act = ACT_PER_WIDTH * (h + mlp) * (1 if amp else 2)
    activations = micro * seq * (L * 4 * h + act) if checkpointing else micro * seq * L * act
    chunk = min(1024, micro * (max_new or args.max_new_tokens))
    V = c.vocab_size
    compiled = bool(getattr(args, "compile", None))
    static = 4 * n + 8 * trained + (width * n if args.beta > 0 and not lora else 0)
    # DDP (torchrun without --fsdp) keeps its flat gradient buckets beside the gradients
    ddp = 4 * trained if distributed.world() > 1 and not getattr(args, "fsdp", False) else 0
    if compiled:  # the twin and the two planned shapes' caches, for the whole run
        static += copy + (rows + eval_rows) * seq * kv_token
    decode = 0 if compiled else copy
    return {
        "generate": static + decode + (0 if compiled else rows * seq * kv_token),
        "reference": static + micro * prompt_len * kv_token + 2 * 4 * chunk * V,
        "policy": static
        + 4 * trained
        + ddp
        + copy
        + activations
        + 3 * 4 * chunk * V
        + width * V * h,
        "optimizer": static + 4 * trained + ddp,
        "evaluation": 0  # --eval-every -1: none
        if args.eval_every == -1
        else static + decode + (0 if compiled else eval_rows * seq * kv_token),
    }


def linear_modules(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def longest_prompt(task, tokenizer, limit):
    """The most tokens any prompt of the run has, training and held-out rows, at most `limit`
    (where they are cut)."""
    prompts = [task.prompt(tokenizer, row["prompt"]) for row in task.train + task.eval]
    longest = max(tokenizer(prompts, add_special_tokens=False, return_length=True)["length"])
    return longest if limit is None else min(longest, limit)


def card_bytes(device=None):
    """What this process may allocate on the card: its total memory times the process's memory
    fraction (torch.cuda.set_per_process_memory_fraction), as the allocator enforces it."""
    device = torch.cuda.current_device() if device is None else device
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
    return int(total * fraction)


def budget_of(card):
    return int(card / RESERVED_OVER_ALLOCATED - CONTEXT_BYTES)


def plan(model, args, prompt_len, card):
    """The phases with the flags as given; where the user left --gradient-checkpointing unset
    (None), checkpointing is turned on only where the card needs it (it costs ~30% of the
    forward + backward; nothing else the plan could give up costs less)."""
    budget = budget_of(card)
    wanted = args.gradient_checkpointing
    for on in (False, True) if wanted is None else (wanted,):
        p = phases(model, args, prompt_len, on)
        result = Plan(p, int(max(p.values())), budget, on)
        if result.fits:
            break
    return result


def what_fits(model, args, prompt_len, card):
    """Flags that would fit this card where the plan does not (with checkpointing, unless the
    user turned it off): a smaller --micro-batch-size (whole groups), fewer --max-new-tokens, or
    LoRA. [] if none of them alone does."""
    budget, on = budget_of(card), args.gradient_checkpointing is not False
    G, out = args.num_generations, []
    micro = args.micro_batch_size or args.batch_size * G
    for m in range(micro - G, 0, -G):
        if max(phases(model, args, prompt_len, on, micro=m).values()) <= budget:
            out.append(f"--micro-batch-size {m}")
            break
    for new in (256, 200, 128, 64):
        if new < args.max_new_tokens:
            if max(phases(model, args, prompt_len, on, max_new=new).values()) <= budget:
                out.append(f"--max-new-tokens {new}")
                break
    if (
        not args.lora_rank
        and max(phases(model, args, prompt_len, on, lora_rank=16).values()) <= budget
    ):
        out.append("--lora-rank 16")
    for b in (4, 2, 1):  # an evaluation of fewer questions at a time, where it is the peak
        fewer = argparse.Namespace(**{**vars(args), "eval_batch_size": b})
        if (
            b < args.eval_batch_size
            and max(phases(model, fewer, prompt_len, on).values()) <= budget
        ):
            out.append(f"--eval-batch-size {b}")
            break
    return out


def checkpointing(args, flags, model, task, tokenizer, card=None):
    """Whether this run recomputes activations: --gradient-checkpointing as given; not given, on
    CUDA the memory plan's choice (one line), on the CPU off. Where nothing fits the card: a
    UserError naming the plan's number and the flags that would fit. Sets the choice on both
    namespaces (train.py's args and the flags trainer.py reads; the checkpoint saves it). Under
    --fsdp the plan (one whole model per card) does not apply: the flag as given."""
    if (flags.device != "cuda" or getattr(flags, "fsdp", False)) and card is None:
        choice = bool(flags.gradient_checkpointing)
    else:
        prompt_len = longest_prompt(task, tokenizer, flags.max_prompt_length)
        card = card_bytes() if card is None else card
        p = plan(model, flags, prompt_len, card)
        if not p.fits and flags.gradient_checkpointing is not None:  # the user's flag wins
            print(
                f"warning: memory: the plan peaks at {p.peak / GB:.1f} GB, over the card's "
                f"{p.budget / GB:.1f} GB; running as asked (--{'' if p.checkpointing else 'no-'}"
                "gradient-checkpointing), and the plan may be pessimistic by a few percent",
                file=sys.stderr,
                flush=True,
            )
        elif not p.fits:
            fixes = what_fits(model, flags, prompt_len, card)
            raise UserError(
                f"this run needs about {p.peak / GB:.1f} GB on the device at its peak ("
                f"{max(p.phases, key=p.phases.get)}; {'with' if p.checkpointing else 'without'} "
                f"gradient checkpointing, the longest prompt {prompt_len} tokens + "
                f"{flags.max_new_tokens} new), and this card offers {p.budget / GB:.1f} GB after "
                "the CUDA context and the allocator's slack. "
                + (
                    f"These would fit, each alone: {', '.join(fixes)}."
                    if fixes
                    else "None of --micro-batch-size, --max-new-tokens or --lora-rank alone fits it: "
                    "a larger card, or a smaller model."
                )
            )
        choice = p.checkpointing
        if flags.gradient_checkpointing is None:
            print(
                f"memory: the plan peaks at {p.peak / GB:.1f} GB of the card's {p.budget / GB:.1f} "
                + (
                    "GB with gradient checkpointing (without it, it would not fit: "
                    "--no-gradient-checkpointing to insist)"
                    if choice
                    else "GB without gradient checkpointing"
                ),
                file=sys.stderr,
                flush=True,
            )
    args.gradient_checkpointing = flags.gradient_checkpointing = choice
    return choice

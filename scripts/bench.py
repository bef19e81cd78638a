"""Benchmarks: trainer.py's own pieces, timed (nanoGPT's bench.py, for GRPO). Prints a short table
last. Run from the repository root:

    python -m scripts.bench                    # --logprobs, then --step --config tiny: minutes
    python -m scripts.bench --logprobs         # a. token_logprobs vs log_softmax(logits / T).gather
    python -m scripts.bench --step --config 100m   # b. one GRPO step by phase: tiny | 100m | ...
    BENCH_PYTHON=benchvenv/bin/python python -m scripts.bench --vs-trl --config tiny   # c. vs TRL
    ... --vs-trl --config 100m --rounds 5 --real-length   # lengths uniform in [max/8, max]
    python -m scripts.bench --rollout DIR --batch-size 2 --max-new-tokens 200   # d. a real rollout
    BENCH_PYTHON=benchvenv/bin/python python -m scripts.bench --parity   # e. loss, grads = TRL's

--vs-trl and --parity need TRL, which is not in requirements.txt: install it beside the pinned
versions, in a venv:
    python -m venv benchvenv
    benchvenv/bin/pip install torch==2.13.0 transformers==5.23.0 numpy trl==1.16.0
Every measurement runs in a fresh subprocess (`python -m scripts.bench --worker ...`), so one
variant's memory never counts against another's. Models are random-weight Llamas and a word-level
tokenizer built in code: nothing is downloaded (but --rollout's GSM8K questions:
$GRPO_GSM8K_DIR/test.jsonl, else data.load_gsm8k's download).
"""

import argparse
import contextlib
import copy
import dataclasses
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import weakref

import torch
from transformers import LogitsProcessor, LogitsProcessorList, get_scheduler

import config
import data
import grpo
import rewards
import sampling
import trainer
from support import decode, demo
from support.phases import Phases

# Llama shapes. 100m: GPT-2-small-like width and depth, 108.5M parameters (37.7M of them the tied
# embedding). smollm2-135m and smollm2-1.7b: HuggingFaceTB/SmolLM2-135M- and 1.7B-Instruct's
# config.json, with random weights.
ROOT = os.path.dirname(
    os.path.dirname(os.path.abspath(__file__))
)  # the repository root: workers run from it
# A local copy of the real GSM8K, for the tools and tests that read it: a directory holding
# train.jsonl and test.jsonl, named by this environment variable. Unset, the tools download it
# (data.load_gsm8k) and the tests that need it skip.
GSM8K_ENV = "GRPO_GSM8K_DIR"


def gsm8k_file(split):
    """$GRPO_GSM8K_DIR/{split}.jsonl, or None where the variable is unset (data.load_gsm8k then
    downloads)."""
    directory = os.environ.get(GSM8K_ENV)
    return os.path.join(directory, f"{split}.jsonl") if directory else None


CONFIGS = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=2048,
    ),
    "100m": dict(
        hidden_size=768,
        intermediate_size=1536,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        vocab_size=49152,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    "smollm2-1.7b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 130000.0},
    ),
}
# Per config: prompt tokens, new tokens, timed steps per run (after one warm-up step).
SHAPES = {
    "tiny": (40, 64, 5),
    "100m": (64, 64, 2),
    "smollm2-135m": (128, 64, 2),
    "smollm2-1.7b": (128, 300, 3),
}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------------------------------
# Memory. On GPU: torch.cuda.max_memory_allocated. On CPU, torch allocates with malloc/mmap, which
# tracemalloc does not see, so we read the kernel's high-water mark of this process's resident
# memory (VmHWM in /proc/self/status) and reset it before each measured region by writing "5" to
# /proc/self/clear_refs (Linux >= 4.0). "Extra" = peak - resident memory at the start of the region.
# It counts every page the process touched (allocator slack too): an upper bound on what the region
# needed, never an underestimate.


def _status_kib(field):
    return int(re.search(rf"^{field}:\s+(\d+) kB", open("/proc/self/status").read(), re.M).group(1))


def mem_start():
    """Reset the peak; return the memory in use now (bytes)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def mem_peak():
    """The peak (bytes) since the last mem_start()."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _status_kib("VmHWM") * 1024


@contextlib.contextmanager
def phase(record, name, accumulate=False):
    """record[name] = (wall seconds, extra peak memory in bytes, CPU seconds of this process) of the
    block; with accumulate, the seconds add to those already there (the μ calls of policy_update in
    a step) and the peak is the larger.

    The CPU seconds are the second opinion on a shared machine: other people's jobs stretch the wall
    time of a phase but barely its CPU time (except for OpenMP threads spinning while they wait for
    a descheduled sibling)."""
    base = mem_start()
    t0, c0 = time.perf_counter(), time.process_time()
    yield
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    peak = mem_peak()
    wall, extra, cpu = time.perf_counter() - t0, peak - base, time.process_time() - c0
    if accumulate and name in record:
        old = record[name]
        wall, extra, cpu = old[0] + wall, max(old[1], extra), old[2] + cpu
    record[name] = (wall, extra, cpu)
    PEAK[0] = max(PEAK[0], peak)


PEAK = [0]  # the highest peak any phase() saw: the process's peak memory during the timed steps


# --------------------------------------------------------------------------------------------------
# Model, tokenizer, prompts: built in code from a seed, so every subprocess (ours or TRL's) has the
# same weights.


def build_model(name, seed=0):
    shape = dict(CONFIGS[name])
    return demo.tiny_llama(shape.pop("vocab_size"), seed, **shape)


def build_tokenizer(vocab_size):
    """Word level: "<pad>", "<eos>", then "w0", "w1", ... so a prompt of P words is exactly P
    tokens."""
    return demo.word_tokenizer(
        ["<pad>", "<eos>"] + [f"w{i}" for i in range(vocab_size - 2)], unk_token="<pad>"
    )


def build_prompts(n, length, vocab_size, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        " ".join(f"w{i}" for i in torch.randint(vocab_size - 2, (length,), generator=g).tolist())
        for _ in range(n)
    ]


def checksum(model):
    """One number that differs if any weight differs: identical initial weights in every
    subprocess."""
    with torch.no_grad():
        return sum(float((p.double() * (i + 1)).sum()) for i, p in enumerate(model.parameters()))


def forced_lengths(a):
    """[steps, B*G] completion lengths, EOS included, the same for both trainers: with
    --real-length, drawn uniformly from [max_new/8, max_new] (seed 0), as real completions vary;
    else max_new + 1 (EOS never comes: every completion is exactly max_new tokens, cut off by the
    budget). Row i of step s ends with EOS as its lengths[s, i]-th token. At least 2: a row's first
    token comes from its prompt's one prefill, shared by the group (DecodeLengths)."""
    n, rows, C = a.warmup + a.steps, a.batch_size * a.num_generations, a.max_new_tokens
    low = max(2, C // 8)
    if not a.real_length or low > C:
        return torch.full((n, rows), C + 1)
    return torch.randint(low, C + 1, (n, rows), generator=torch.Generator().manual_seed(0))


def expected_lengths(lengths, max_new):
    """The completion lengths forced lengths make: one over max_new is cut off at max_new, without
    EOS."""
    return lengths.clamp(max=max_new).tolist()


class ForcedLengths(LogitsProcessor):
    """The forced lengths in transformers' generate() (TRL's side; forced_lengths_in_decode is
    ours): EOS gets probability 0 before a row's length and 1 at it. generate() keeps rows in place,
    so row i is always row i."""

    def __init__(self, lengths, prompt_length, eos):
        self.lengths, self.prompt_length, self.eos = lengths, prompt_length, eos

    def __call__(self, input_ids, scores):
        t = input_ids.shape[1] - self.prompt_length  # completion tokens written so far
        scores[:, self.eos] = float("-inf")
        end = (self.lengths == t + 1).to(scores.device)
        scores[end] = float("-inf")
        scores[end, self.eos] = 0.0
        return scores


def force_lengths(model, lengths):
    """Every model.generate() call (TRL's, one per GRPO step) gets the next step's ForcedLengths."""
    real, calls = model.generate, iter(lengths)

    def generate(*args, **kwargs):
        processor = ForcedLengths(next(calls), kwargs["input_ids"].shape[1], demo.EOS)
        return real(*args, logits_processor=LogitsProcessorList([processor]), **kwargs)

    model.generate = generate


# --------------------------------------------------------------------------------------------------
# Workers: each runs in its own process and prints one line "RESULT {json}".


def worker_logprobs(a):
    """a. Log-probs of N=16 x C=512 completion tokens at V=49,152 through a one-layer Llama
    (SmolLM2-135M's width), so the lm-head and log-softmax dominate. --variant ours:
    sampling.token_logprobs (chunked lm-head: no [N, C, V]); naive: the logits (only the C positions
    needed), then log_softmax(logits / T).gather. --backward adds a backward."""
    model = (
        demo.tiny_llama(
            49152,
            0,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=1,
            num_attention_heads=9,
            num_key_value_heads=3,
        )
        .to(DEVICE)
        .eval()
    )
    cfg = model.config
    N, C, P, T = 16, 512, 16, 0.9
    ids = torch.randint(cfg.vocab_size, (N, P + C), device=DEVICE)
    attn = torch.ones_like(ids)
    weights = torch.randn(N, C, device=DEVICE)  # d loss / d logp, for the backward

    def ours():
        return sampling.token_logprobs(model, ids, attn, C, T)

    def naive():
        # [N, C, V]
        logits = model(input_ids=ids[:, :-1], attention_mask=attn[:, :-1], logits_to_keep=C).logits
        return (
            torch.log_softmax(logits.float() / T, dim=-1).gather(-1, ids[:, -C:, None]).squeeze(-1)
        )

    fn = ours if a.variant == "ours" else naive
    times, extras = [], []
    for _ in range(a.repeats):
        model.zero_grad(set_to_none=True)
        base = mem_start()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(a.backward):
            logp = fn()  # [N, C]
            if a.backward:
                (logp * weights).sum().backward()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        extras.append(mem_peak() - base)
    out = dict(logp=logp.detach().cpu())
    if a.backward:
        out.update(
            head=model.lm_head.weight.grad.cpu(),
            q=model.model.layers[0].self_attn.q_proj.weight.grad.cpu(),
        )
    torch.save(out, a.out)
    return dict(seconds=statistics.median(times[1:] or times), extra_bytes=max(extras))


class DecodeLengths:
    """Our side of forced lengths (ForcedLengths is TRL's), as a forward hook on the model: while on
    (forced_lengths_in_decode), it edits the next-token logits each forward of the decode returns,
    so that row i draws no EOS before its lengths[i]-th token and EOS as that token (a length over
    max_new_tokens: never). Measurement only, from outside: the decode (support/decode.py) carries
    no bench mechanism. One per model (`of`), its hook registered once and kept, so that the decode
    twin of a compiled model (a deep copy, made at its first compiled call) carries the same hook,
    a plain function over this one state.

    The rows of each forward, as the decode lays them out: the prefill's logits are per prompt,
    before the copy to its G rows (so a row can end at its first token only with its whole group:
    else ValueError); then, eager, the rows still without EOS, in order (the others left the batch);
    compiled, every planned row, padding rows after the real ones, its token counted from the KV
    cache's length (tensors only: the captured step reads no Python counter)."""

    def __init__(self):
        self.lengths = None  # [B*G] the current decode call's, on the CPU; None: off
        self.prefilled = False

    @classmethod
    def of(cls, model):
        """The model's DecodeLengths: made, and its hook registered, at the first call."""
        if model not in _DECODE_LENGTHS:
            state = _DECODE_LENGTHS[model] = cls()

            def hook(module, args, kwargs, output):  # a function: copy.deepcopy keeps it as it is
                return state.edit(kwargs, output)

            model.register_forward_hook(hook, with_kwargs=True)
        return _DECODE_LENGTHS[model]

    def start(self, model, lengths, eos):
        """On for one decode call of `model` whose rows end at `lengths` [B*G]."""
        self.lengths = torch.as_tensor(lengths, dtype=torch.long).cpu()
        if int(self.lengths.min()) < 1:
            raise ValueError(f"forced lengths must be at least 1: {self.lengths.tolist()}")
        self.eos = [eos] if isinstance(eos, int) else list(eos)
        self.padded = id(model) in decode.COMPILED  # compiled: all planned rows stay in the batch
        self.cache_key = decode.cache_keyword(model)  # the forward's KV-cache keyword
        self.prefilled, self.t = False, 1

    def stop(self):
        self.lengths = None

    def edit(self, kwargs, output):
        """The forward's output, its last position's logits edited in place; None when off."""
        if self.lengths is None:
            return None
        logits = output.logits[:, -1]  # [rows, V]
        if not self.prefilled:
            end = self.prefill(logits, kwargs)
        elif self.padded or len(logits) == self.n:
            # every row still in (compiled, CUDA graphs: always): the token these logits draw,
            # from the cache's length (prompt + tokens fed), on the device: a graph replays it
            self.t += 1
            k = kwargs[self.cache_key].get_seq_length() - self.prompt_width
            lengths = torch.cat([self.on_device, self.on_device.new_zeros(len(logits) - self.n)])
            end = lengths == k + 1
        else:
            end = self.eager_end(len(logits))
        logits.index_fill_(1, self.eos_index, float("-inf"))  # no host-to-device copy: graphs
        if end is not None:  # EOS far above the row's largest logit: drawn whatever the sampling
            boost = torch.where(end, logits.amax(-1) + 1e4, float("-inf"))
            logits[:, self.eos[0]] = boost
        return output

    def prefill(self, logits, kwargs):
        """The prefill's rows (one per prompt) that end at their first token: those whose G rows all
        do. Sets up what the later forwards of the call read."""
        B, L = len(logits), self.lengths
        if len(L) % B:
            raise ValueError(f"{len(L)} forced lengths for {B} prompts: not G per prompt")
        first = (L == 1).view(B, -1)  # [B, G]
        if (first.any(1) != first.all(1)).any():
            raise ValueError(
                "a forced length of 1 must hold for the whole group: the first token of each of a "
                f"prompt's G rows is drawn from the prompt's one prefill ({L.tolist()})"
            )
        self.n, self.prefilled = len(L), True
        device = logits.device
        self.eos_index = torch.tensor(self.eos, device=device)
        self.on_device = L.to(device)
        self.prompt_width = torch.full((), kwargs["input_ids"].shape[1], device=device)
        if not self.padded:  # eager: forward t holds the rows with lengths > t; those at t + 1 end
            width = int(L.max())
            ends = torch.zeros(width, len(L), dtype=torch.bool)
            self.rows = []
            for t in range(1, width):
                alive = L[L > t]
                ends[t, : len(alive)] = alive == t + 1
                self.rows.append(len(alive))
            self.ends = ends.to(device)
        return first[:, 0].to(device) if first.any() else None

    def eager_end(self, rows):
        """Eager forward t's rows that end at it (None: no row ends)."""
        t, self.t = self.t, self.t + 1
        if t > len(self.rows):
            return None
        if rows != self.rows[t - 1]:
            raise RuntimeError(f"decode forward {t} has {rows} rows, not {self.rows[t - 1]}")
        return self.ends[t, :rows]


_DECODE_LENGTHS = weakref.WeakKeyDictionary()  # model -> its DecodeLengths


@contextlib.contextmanager
def forced_lengths_in_decode(model, lengths, eos):
    """The next decode call of `model` inside the block (support/decode.py's, eager or compiled)
    ends row i with EOS as its lengths[i]-th token, and draws no EOS before it (DecodeLengths)."""
    forcing = DecodeLengths.of(model)
    forcing.start(model, lengths, eos)
    try:
        yield
    finally:
        forcing.stop()


class RunEnds(Exception):
    """Raised at the run's closing checkpoint: worker_ours times the steps alone."""


class TimedSteps(Phases):
    """worker_ours' timing of trainer.train's loop, through its phase hook (support/phases.py), the
    way gpu_check.PhaseTimer does: record gets one {phase: (wall s, extra peak bytes, CPU s)} per
    step, a phase's calls within it added up (phase(accumulate=True)). A step is train's "step"
    phase: data.batch_at (line 5) to its log line; its extra memory is its phases' largest. Each
    "generate" forces the next row of `lengths` (forced_lengths_in_decode). The run stops at its
    closing checkpoint (RunEnds), which it neither times nor writes: TRL's side saves nothing."""

    NAMES = {  # train's phases -> bench's names for them; the others are not timed
        "generate": "generate",
        "rewards": "rewards",
        "reference": "ref+old logps",
        "update": "policy fwd+bwd+opt",
    }

    def __init__(self, model, lengths, steps):
        self.model, self.lengths, self.steps, self.record = model, iter(lengths), steps, []

    def phase(self, name, step=None):
        if name == "step":
            return self.step()
        if name == "checkpoint" and step == self.steps:
            raise RunEnds(step)
        if name == "generate":
            return self.generate()
        if name in self.NAMES:
            return phase(self.record[-1], self.NAMES[name], accumulate=True)
        return super().phase(name, step)

    @contextlib.contextmanager
    def step(self):
        self.record.append({})
        t0, c0 = time.perf_counter(), time.process_time()
        yield
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        self.record[-1]["step"] = (wall, max(v[1] for v in self.record[-1].values()), cpu)

    @contextlib.contextmanager
    def generate(self):
        with forced_lengths_in_decode(self.model, next(self.lengths), demo.EOS):
            with phase(self.record[-1], "generate", accumulate=True):
                yield


@dataclasses.dataclass
class LengthsSeenTask(data.Task):
    """A data.Task that keeps the completion lengths of each batch it scores (its Rollouts'), for
    worker_ours to check against the forced ones."""

    scored_lengths: list = dataclasses.field(default_factory=list)

    def score(self, rows, completions, G=1, lengths=None, tool_calls=None, steps=None):
        self.scored_lengths.append(lengths.tolist())
        return super().score(rows, completions, G, lengths, tool_calls, steps)


def loop_flags(a, output_dir):
    """trainer.py's flags for the step bench.py and TRL's side both run (trl_config: the same
    settings)."""
    return [
        *("--steps", a.warmup + a.steps, "--batch-size", a.batch_size),
        *(
            "--gradient-accumulation-steps",
            1,
            "--micro-batch-size",
            a.batch_size * a.num_generations,
        ),
        *("--num-generations", a.num_generations, "--max-new-tokens", a.max_new_tokens),
        *("--temperature", a.temperature, "--top-k", a.top_k, "--top-p", a.top_p),
        *("--beta", a.beta, "--num-iterations", a.num_iterations, "--epsilon", 0.2),
        *("--loss-type", "grpo", "--scale-rewards", "group", "--lr", a.lr),
        *("--lr-scheduler", "constant", "--warmup-steps", 0, "--weight-decay", 0.0),
        *("--max-grad-norm", 1.0, "--dtype", a.dtype, "--device", DEVICE),
        "--no-gradient-checkpointing",  # as TRL's side runs (its default): the same work
        *(["--compile", a.compile] if a.compile else []),
        # CUDA graphs, not the default fused decode: DecodeLengths forces the lengths through a hook
        # on the model's forward, which FusedStep calls for the prefill only (its layers and
        # lm-head run apart); fused beside TRL needs that hook moved first
        *(["--decode", "graphs"] if DEVICE == "cuda" and not a.compile else []),
        *("--eval-every", -1, "--sample-every", 0, "--save-every", 0, "--output-dir", output_dir),
    ]


def worker_ours(a):
    """b. (and c.'s side A): trainer.train itself, a.warmup + a.steps steps on random prompts, every
    phase timed through its phase hook (TimedSteps) and the completion lengths forced as TRL's side
    forces them."""
    model = build_model(a.config)
    tokenizer = build_tokenizer(model.config.vocab_size)
    start = checksum(model)
    n, B = a.warmup + a.steps, a.batch_size
    prompts = build_prompts(n * B, a.prompt_len, model.config.vocab_size)
    task = LengthsSeenTask(
        train=[{"prompt": p, "answer": "42"} for p in prompts],
        eval=[],
        template=lambda tokenizer, question: question,  # the prompt as it is: a.prompt_len tokens
        rewards=rewards.weighted(rewards.REWARD_FUNCS.items(), [1.0] * len(rewards.REWARD_FUNCS)),
    )
    lengths = forced_lengths(a)
    timer = TimedSteps(model, lengths, n)
    with tempfile.TemporaryDirectory(prefix="bench_ours_") as tmp:
        args = config.parse_args([str(x) for x in loop_flags(a, tmp)])
        torch.manual_seed(0)
        try:
            trainer.train(args, task, model, tokenizer, phases=timer)
        except RunEnds:  # after the last step's log line
            pass
    made, record = task.scored_lengths, timer.record
    if made != [expected_lengths(row, a.max_new_tokens) for row in lengths]:
        raise RuntimeError(f"completion lengths {made} are not the forced ones {lengths.tolist()}")
    tokens = [sum(row) for row in made]
    return dict(
        checksum=start,
        tokens=statistics.median(tokens[a.warmup :]),
        first=record[0]["step"][0],
        steps=record[a.warmup :],
        peak_bytes=PEAK[0],
    )


def worker_trl(a):
    """c. side B: the same step through TRL's GRPOTrainer. Same model (same seed), tokenizer,
    prompts, G, new tokens, sampling, beta, mu, batch, lr, optimizer, clipping and precision; its
    phases timed by wrapping its methods."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    model = build_model(a.config)
    tokenizer = build_tokenizer(model.config.vocab_size)
    start = checksum(model)
    lengths = forced_lengths(a)
    force_lengths(model, lengths)
    tmp = tempfile.mkdtemp(prefix="bench_trl_")
    # TRL builds its reference model with from_pretrained(model.config._name_or_path)
    if a.beta > 0:
        model.save_pretrained(tmp)
        model.config._name_or_path = tmp
    B = a.batch_size
    n = a.warmup + a.steps
    prompts = build_prompts(n * B, a.prompt_len, model.config.vocab_size)
    dataset = Dataset.from_dict({"prompt": prompts, "answer": ["42"] * len(prompts)})

    config = trl_config(a, tmp, n)
    times, record = [], {}

    # an optimizer step: generation (when due), rewards, log-probs, loss, update
    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            times.append((time.perf_counter() - self.t0, time.process_time() - self.c0))

    trl_trainer = GRPOTrainer(
        model=model,
        reward_funcs=[trl_reward(f) for f in rewards.REWARD_FUNCS.values()],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    same_ref = trl_trainer.ref_model is None or abs(
        checksum(trl_trainer.ref_model) - start
    ) < 1e-6 * abs(start)
    generated = time_phases(trl_trainer, times, record)
    mem_start()  # peak memory from here: the training steps, as PEAK for ours
    trl_trainer.train()
    peak = mem_peak()
    shutil.rmtree(tmp, ignore_errors=True)
    if generated != [x for row in lengths for x in expected_lengths(row, a.max_new_tokens)]:
        raise RuntimeError(
            f"TRL's completion lengths {generated} are not the forced ones {lengths.tolist()}"
        )
    steps = trl_steps(times, record, n, a.num_iterations)
    tokens = statistics.median(
        sum(expected_lengths(row, a.max_new_tokens)) for row in lengths[a.warmup :]
    )
    return dict(
        checksum=start,
        same_ref=same_ref,
        tokens=tokens,
        first=steps[0]["step"][0],
        steps=steps[a.warmup :],
        peak_bytes=peak,
    )


def trl_reward(fn):
    """Our reward function as TRL calls it: fn(prompts=..., completions=..., <dataset
    columns>=...)."""

    def reward(completions, answer, **kwargs):
        return fn(completions, answer)

    reward.__name__ = fn.__name__
    return reward


def time_phases(trl_trainer, times, record):
    """Wrap TRL's generate, rewards and no-grad log-prob methods to time them (measurement only):
    record[step][phase] accumulates (wall s, CPU s). Returns the list that will hold each generated
    completion's length."""
    lengths = []

    def timed(name, fn, when=lambda: True):
        def wrapper(*args, **kwargs):
            if not when():
                return fn(*args, **kwargs)
            t0, c0 = time.perf_counter(), time.process_time()
            out = fn(*args, **kwargs)
            wall, cpu = record.setdefault(len(times), {}).get(name, (0.0, 0.0))
            record[len(times)][name] = (
                wall + time.perf_counter() - t0,
                cpu + time.process_time() - c0,
            )
            if name == "generate":
                lengths.extend(len(c) for c in out[0])
            return out

        return wrapper

    trl_trainer._generate_single_turn = timed("generate", trl_trainer._generate_single_turn)
    trl_trainer._calculate_rewards = timed("rewards", trl_trainer._calculate_rewards)
    trl_trainer._get_per_token_logps_and_entropies = timed(
        "ref+old logps",
        trl_trainer._get_per_token_logps_and_entropies,
        when=lambda: not torch.is_grad_enabled(),
    )
    return lengths


def trl_config(a, tmp, n):
    """TRL's settings for the same step as ours: same G, new tokens, sampling, beta, mu, batch, lr,
    optimizer, clipping and precision."""
    from trl import GRPOConfig

    cuda = DEVICE == "cuda"
    return GRPOConfig(
        output_dir=tmp,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        use_cpu=not cuda,
        bf16=a.dtype == "bf16",
        fp16=False,
        gradient_checkpointing=False,  # TRL defaults: bf16, on
        # TRL counts its batch in completions, not prompts
        per_device_train_batch_size=a.batch_size * a.num_generations,
        gradient_accumulation_steps=1,
        num_generations=a.num_generations,
        max_completion_length=a.max_new_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        beta=a.beta,
        num_iterations=a.num_iterations,
        epsilon=0.2,
        loss_type="grpo",
        scale_rewards="group",
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",  # ours: fused AdamW on CUDA and CPU alike (TRL's own default)
        max_steps=n * a.num_iterations,
        shuffle_dataset=False,
        dataloader_num_workers=0,
    )


def trl_steps(times, record, n, mu):
    """TRL's phases per GRPO step (generate + mu updates = mu TRL optimizer steps): {phase: [wall s,
    0, CPU s]}."""
    steps = []
    for i in range(n):
        phases = {"step": [0.0, 0, 0.0]}
        for j in range(i * mu, (i + 1) * mu):
            phases["step"][0] += times[j][0]
            phases["step"][2] += times[j][1]
            for name, (wall, cpu) in record.get(j, {}).items():
                old = phases.get(name, [0.0, 0, 0.0])
                phases[name] = [old[0] + wall, 0, old[2] + cpu]
        # The rest of the step: policy forward (with entropies) + backward + clip + AdamW, and TRL's
        # bookkeeping.
        phases["policy fwd+bwd+opt"] = [
            phases["step"][k] - sum(v[k] for p, v in phases.items() if p != "step")
            for k in range(3)
        ]
        steps.append(phases)
    return steps


# --------------------------------------------------------------------------------------------------
# The driver: runs workers in fresh subprocesses and prints the table.


# How to make the environment the TRL side runs in (the module docstring's commands, which a test
# keeps in step with these).
TRL_VENV = (
    "python -m venv benchvenv",
    "benchvenv/bin/pip install torch==2.13.0 transformers==5.23.0 numpy trl==1.16.0",
)


def trl_python():
    """The Python that runs the TRL side (--vs-trl, --parity): $BENCH_PYTHON, else this one."""
    return os.environ.get("BENCH_PYTHON", sys.executable)


def check_trl(flag):
    """Before any worker starts: exit 2 with one paragraph on stderr unless trl_python() imports
    trl. Before, the first TRL worker ended in ModuleNotFoundError and the worker's traceback."""
    python = trl_python()
    try:
        proc = subprocess.run(
            [python, "-c", "import trl"], capture_output=True, text=True, cwd=ROOT, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        why = f"BENCH_PYTHON={python!r} could not be run ({type(e).__name__}: {e})"
    else:
        if proc.returncode == 0:
            return
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        if "BENCH_PYTHON" in os.environ:
            why = f"BENCH_PYTHON={python} cannot import trl ({last})"
        else:
            why = f"BENCH_PYTHON is unset, and this Python ({python}) cannot import trl ({last})"
    example = f"{flag} --config tiny" if flag == "--vs-trl" else flag
    print(
        f"error: {flag} needs TRL, which runs in its own environment (it is not in "
        f"requirements.txt): the Python that BENCH_PYTHON names. Here {why}. Make that environment "
        f"once, TRL beside the pinned torch and transformers: `{TRL_VENV[0]} && {TRL_VENV[1]}`, "
        f"then pass it: `BENCH_PYTHON=benchvenv/bin/python python -m scripts.bench {example}`.",
        file=sys.stderr,
    )
    sys.exit(2)


def run_worker(a, name, *extra):
    flags = [
        "--worker",
        name,
        "--config",
        a.config,
        "--num-generations",
        a.num_generations,
        "--beta",
        a.beta,
        "--num-iterations",
        a.num_iterations,
        "--batch-size",
        a.batch_size,
        "--prompt-len",
        a.prompt_len,
        "--max-new-tokens",
        a.max_new_tokens,
        "--steps",
        a.steps,
        "--warmup",
        a.warmup,
        "--lr",
        a.lr,
        "--temperature",
        a.temperature,
        "--top-p",
        a.top_p,
        "--top-k",
        a.top_k,
        "--dtype",
        a.dtype,
        "--threads",
        a.threads,
        *["--real-length"] * a.real_length,
        *(["--compile", a.compile] if a.compile else []),
        *extra,
    ]
    python = trl_python() if name in ("trl", "parity") else sys.executable
    proc = subprocess.run(
        [python, "-m", "scripts.bench", *map(str, flags)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"worker {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def median_phases(steps):
    """{phase: (median wall s, max extra bytes, median CPU s)} over the timed steps."""
    return {
        k: (
            statistics.median(s[k][0] for s in steps),
            max(s[k][1] for s in steps),
            statistics.median(s[k][2] for s in steps),
        )
        for k in steps[0]
    }


def mib(b):
    return f"{b / 2**20:,.0f} MiB"


PHASES = ["generate", "rewards", "ref+old logps", "policy fwd+bwd+opt"]


def bench_logprobs(a, rows):
    rows.append(("log-probs, V=49,152, N=16 x T=512", "time", "extra memory", ""))
    results = {}
    for backward in (False, True):
        for variant in ("naive", "ours"):
            # the worker's tensors, to compare
            with tempfile.TemporaryDirectory(prefix="bench_logprobs_") as tmp:
                out = os.path.join(tmp, "out.pt")
                flags = ["--variant", variant, "--out", out, "--repeats", a.repeats] + [
                    "--backward"
                ] * backward
                results[variant, backward] = run_worker(a, "logprobs", *flags), torch.load(out)
        (naive, n_out), (ours, o_out) = results["naive", backward], results["ours", backward]
        err = max(
            (n_out[k] - o_out[k]).abs().max().item()
            / (1 if k == "logp" else n_out[k].abs().max().item())
            for k in n_out
        )
        mode = "fwd+bwd" if backward else "fwd (no grad)"
        for name, r in (("naive log_softmax", naive), ("sampling.token_logprobs", ours)):
            rows.append(
                (
                    f"log-probs {mode}: {name}",
                    f"{r['seconds']:.2f} s",
                    f"+{mib(r['extra_bytes'])}",
                    "",
                )
            )
        rows.append(
            (
                f"log-probs {mode}: ours / naive",
                f"{ours['seconds'] / naive['seconds']:.2f}x",
                f"{ours['extra_bytes'] / naive['extra_bytes']:.2f}x",
                f"max diff {err:.1e} ({'OK' if err <= 1e-5 else 'FAIL'} at 1e-5)",
            )
        )


def bench_step(a, rows):
    r = run_worker(a, "ours")
    phases = median_phases(r["steps"])
    tag = f"{a.config}{' real-length' * a.real_length} step"
    rows.append((f"{tag} (median of {a.steps})", "time", "extra memory", "CPU time, rate"))
    for name in PHASES + ["step"]:
        s, extra, cpu = phases[name]
        rate = f", {r['tokens'] / s:,.0f} tok/s" if name in ("generate", "step") else ""
        label = f"total (first step {r['first']:.1f} s)" if name == "step" else name
        rows.append((f"{tag}: {label}", f"{s:.3f} s", f"+{mib(extra)}", f"{cpu:.3f} s{rate}"))
    rows.append(
        (
            f"{tag}: generate per new token",
            f"{phases['generate'][0] / a.max_new_tokens * 1e3:.2f} ms",
            "",
            "prefill included",
        )
    )
    rows.append((f"{tag}: peak resident memory", "", mib(r["peak_bytes"]), ""))


def bench_vs_trl(a, rows):
    ratios, cpu_ratios, ours_runs, trl_runs, ours_all, trl_all = [], [], [], [], [], []
    for i in range(a.rounds):  # A B A B ...: slow drifts of the shared machine hit both sides alike
        ours, trl = run_worker(a, "ours"), run_worker(a, "trl")
        ours_all.append(ours)
        trl_all.append(trl)
        if (
            abs(ours["checksum"] - trl["checksum"]) > 1e-9 * abs(ours["checksum"])
            or not trl["same_ref"]
        ):
            sys.exit(
                "initial weights differ between our run and TRL's: the comparison would be unfair"
            )
        ours_runs.append(median_phases(ours["steps"]))
        trl_runs.append(median_phases(trl["steps"]))
        ratios.append(ours_runs[-1]["step"][0] / trl_runs[-1]["step"][0])
        cpu_ratios.append(ours_runs[-1]["step"][2] / trl_runs[-1]["step"][2])
        print(
            f"round {i + 1}: ours {ours_runs[-1]['step'][0]:.3f} s, TRL {trl_runs[-1]['step'][0]:.3f} s, "
            f"ratio {ratios[-1]:.3f} (CPU time ratio {cpu_ratios[-1]:.3f})",
            flush=True,
        )
    tag = f"{a.config}{' real-length' * a.real_length} vs TRL"
    rows.append((f"{tag} (medians)", "ours", "TRL", "ours/TRL"))
    for name in PHASES + ["step"]:
        o = statistics.median(r[name][0] for r in ours_runs)
        t = statistics.median(r.get(name, (0.0,))[0] for r in trl_runs)
        rows.append(
            (f"{tag}: {name}", f"{o:.3f} s", f"{t:.3f} s", f"{o / t:.2f}x" if t > 0 else "TRL: n/a")
        )
    rows.append(
        (
            f"{tag}: peak memory during the steps",
            mib(max(r["peak_bytes"] for r in ours_all)),
            mib(max(r["peak_bytes"] for r in trl_all)),
            "",
        )
    )
    rows.append(
        (
            f"{tag}: MEDIAN RATIO ours/TRL, {a.rounds} rounds A B",
            f"{statistics.median(ratios):.3f}",
            "",
            "per round " + " ".join(f"{x:.2f}" for x in ratios),
        )
    )
    rows.append(
        (
            f"{tag}: median CPU-time ratio",
            f"{statistics.median(cpu_ratios):.3f}",
            "",
            "per round " + " ".join(f"{x:.2f}" for x in cpu_ratios),
        )
    )


def bench_rollout(a):
    """d. sampling.sample_rollouts on a real model (fp32, CPU or GPU), every completion
    --max-new-tokens long: the median of --steps timed rollouts after --warmup."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # --threads defaults to 1 for the trainer comparisons
    torch.set_num_threads(a.threads if a.threads != 1 else 2)
    model = AutoModelForCausalLM.from_pretrained(a.rollout, dtype=torch.float32).to(DEVICE).eval()
    tokenizer = sampling.prepare_tokenizer(AutoTokenizer.from_pretrained(a.rollout))
    prompts = [
        data.build_prompt(tokenizer, row["prompt"])
        for row in data.load_gsm8k("test", path=gsm8k_file("test"))[: a.batch_size]
    ]
    settings = sampling.Sampling(
        a.temperature, a.top_k, a.top_p, a.max_new_tokens, graphs=DEVICE == "cuda"
    )  # CUDA graphs on a GPU, as bench's step decodes (loop_flags: not fused, CUDA's default)
    # an EOS after max_new tokens: never
    n = a.warmup + a.steps
    lengths = torch.full((n, a.batch_size * a.num_generations), a.max_new_tokens + 1)
    torch.manual_seed(0)
    times = []
    eos = sampling.eos_token_ids(model, tokenizer)
    for step in lengths:
        with forced_lengths_in_decode(model, step, eos):
            t0 = time.perf_counter()
            rollouts = sampling.sample_rollouts(
                model, tokenizer, prompts, settings, a.num_generations
            )
            times.append(time.perf_counter() - t0)
    tokens = int(rollouts.completion_mask.sum())
    seconds = statistics.median(times[a.warmup :])
    print(
        f"{time.strftime('%Y-%m-%d')} | {DEVICE}, {torch.get_num_threads()} threads | torch {torch.__version__} | "
        f"{a.rollout}: {a.batch_size} prompts x G={a.num_generations}, {a.max_new_tokens} new tokens, "
        f"T={a.temperature} top-k {a.top_k} top-p {a.top_p}\n"
        f"rollout: {tokens} tokens in {seconds:.2f} s (median of {a.steps}; each: "
        f"{' '.join(f'{t:.2f}' for t in times[a.warmup :])}): {tokens / seconds:,.1f} tokens/s"
    )


# --------------------------------------------------------------------------------------------------
# e. Parity with TRL's loss: the same model, batch, advantages, π_old and π_ref log-probs and
# settings through trainer.policy_update (sampling.token_logprobs + grpo.grpo_loss) and through
# GRPOTrainer.compute_loss (trl 1.16.0); the losses and the gradients of every parameter must agree.
# One tiny fp32 Llama, one batch, one process (the bench env's python, where TRL is installed; our
# side runs there too, on the same torch and transformers).
#
# The cases (parity_cases): eq. 3's clipped surrogate in every combination of loss type, β, ε_high,
# δ and ratio level; CISPO and SAPO (TRL's loss types "cispo" and "sapo"); the entropy mask (TRL's
# top_entropy_quantile); DeepSeek-V3.2's off-policy sequence mask (off_policy_mask_threshold);
# given per-token and per-completion importance weights (TRL's importance_sampling_ratio, which it
# applies on its vLLM path only); DeepSeek-V3.2's bias-corrected KL (TRL's use_bias_correction_kl:
# the KL term times the ratio), on-policy and off-policy; then gradient accumulation and
# steps_per_generation (parity_accumulation). parity_engagement and parity_options check that
# every clip, cap and mask acts on some tokens of the batch (and not on all), and that the KL's
# correction moves the gradient, so that no case passes vacuously.
#
# Tolerance: |ours - TRL| <= 1e-5 * max(1, largest |TRL value|): absolute for the losses and
# gradients here, which are of order 1 or less, relative beyond that. Both sides compute in fp32
# (rounding 6e-8) but sum in different orders (our chunked lm-head over a KV cache shared by each
# group vs TRL's tiled fused head over whole rows), so they agree to some hundred ulps of the
# largest term: a fixed absolute bound would be meaningless for values much larger than 1.
PARITY_TOL = 1e-5
# B=2 prompts of 6 and 4 tokens (left-padded) x G=4 completions of nonuniform lengths (< 12: ends
# with EOS; 12: truncated), 38 tokens in group 1 and 23 in group 2; sampled at T=0.7 (both sides
# divide the logits by it).
# GRPOConfig's settings for a parity run of TRL's trainer: on the CPU in fp32, seeded, nothing
# saved, logged or reported.
TRL_ON_CPU = dict(
    report_to="none",
    save_strategy="no",
    logging_strategy="no",
    disable_tqdm=True,
    seed=0,
    use_cpu=True,
    bf16=False,
    fp16=False,
)
PARITY_SHAPE = dict(
    vocab=256,
    group=4,
    prompt_lens=(6, 4),
    completion_lens=(12, 9, 5, 12, 3, 12, 7, 1),
    temperature=0.7,
)
# The loss_type TRL aggregates each of its surrogate loss types with (trl_loss).
TRL_AGGREGATION = dict(cispo="dapo", sapo="grpo")


def parity_batch(model):
    """The batch as both sides take it: ours a sampling.Rollouts, TRL the dict its
    _generate_and_score_completions returns (prompt/completion ids and masks, advantages, π_old's
    and π_ref's log-probs; parity_trl adds the token count). π_old = π_θ + noise (std 0.3 per token,
    plus std 0.6 per completion, so whole sequences move too) and π_ref = π_θ + noise of std 0.2:
    ratios leave [1-ε, 1+ε_high] and δ at both ratio levels, so every clip engages (see
    parity_engagement), and the KL is not 0. "weights": the given importance weights of the
    correction cases, uniform in [0.2, 3]: "token" [N, C] (1 after EOS) and "sequence" [N, 1]."""
    s, g = PARITY_SHAPE, torch.Generator().manual_seed(0)
    G, P, C = s["group"], max(s["prompt_lens"]), max(s["completion_lens"])
    prompt_ids = torch.zeros(len(s["prompt_lens"]), P, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for b, n in enumerate(s["prompt_lens"]):
        prompt_ids[b, P - n :], prompt_mask[b, P - n :] = (
            torch.randint(2, s["vocab"], (n,), generator=g),
            1,
        )
    # [N, P]
    prompt_ids, prompt_mask = (
        prompt_ids.repeat_interleave(G, 0),
        prompt_mask.repeat_interleave(G, 0),
    )
    lengths = torch.tensor(s["completion_lens"])
    completion_mask = (torch.arange(C) < lengths[:, None]).long()  # [N, C]
    # pad id 0
    completion_ids = torch.randint(2, s["vocab"], (len(lengths), C), generator=g) * completion_mask
    ended = lengths < C
    completion_ids[ended, lengths[ended] - 1] = demo.EOS
    assert torch.equal(completion_mask, grpo.completion_mask(completion_ids, demo.EOS))
    rollouts = sampling.Rollouts(
        torch.cat([prompt_ids, completion_ids], 1),
        torch.cat([prompt_mask, completion_mask], 1),
        completion_mask,
        [""] * len(lengths),
        G,
        s["temperature"],
    )
    advantages = grpo.group_advantages(torch.rand(len(lengths), generator=g), G)
    current = trainer.frozen_logps(model, rollouts, len(lengths)) * completion_mask
    noise = 0.3 * torch.randn(current.shape, generator=g) + 0.6 * torch.randn(
        len(lengths), 1, generator=g
    )
    old = (current + noise) * completion_mask
    ref = (current + 0.2 * torch.randn(current.shape, generator=g)) * completion_mask
    # drawn after everything above, which stays as it was before these cases existed
    weights = dict(
        token=torch.where(
            completion_mask.bool(), 0.2 + 2.8 * torch.rand(current.shape, generator=g), 1.0
        ),
        sequence=0.2 + 2.8 * torch.rand(len(lengths), 1, generator=g),
    )
    trl = dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=advantages,
        old_per_token_logps=old,
        ref_per_token_logps=ref,
    )
    return dict(
        rollouts=rollouts,
        advantages=advantages,
        old=old,
        ref=ref,
        current=current,
        weights=weights,
        trl=trl,
    )


def parity_engagement(batch):
    """{ratio level: {clip: the completion tokens it acts on at θ}}: ε's low clip (Â < 0), ε_high's
    high clip (Â > 0, with ε_high = ε and 0.28) and δ = 1.5's dual clip (Â < 0). A clip that acts on
    no token would go untested."""
    m, adv = batch["trl"]["completion_mask"].bool(), batch["advantages"][:, None]
    log_ratio = torch.where(m, batch["current"] - batch["old"], 0.0)
    seq = (log_ratio.sum(1, keepdim=True) / m.sum(1, keepdim=True)).expand_as(log_ratio)
    out = {}
    for level, ratio in (("token", log_ratio.exp()), ("sequence", seq.exp())):
        clips = dict(
            low=(ratio < 0.8) & (adv < 0),
            high=(ratio > 1.2) & (adv > 0),
            high_028=(ratio > 1.28) & (adv > 0),
            dual=(ratio > 1.5) & (adv < 0),
        )
        out[level] = {k: int((v & m).sum()) for k, v in clips.items()}
    return out


def parity_options(batch, cases, entropy, trl, trl_entropy):
    """What each of the newer options acts on at θ, for every value parity_cases gives it: rows of
    dict(what, text, fail), fail saying why the option's cases would test nothing (else None).
    - CISPO's cap E: the tokens whose ratio (at the case's level) exceeds E, of either advantage
      sign (CISPO caps every token's weight): it must bind on some.
    - The off-policy mask δ: the Â < 0 completions whose mean log(π_old / π_θ) exceeds δ (π_old is
      the behavior policy on both sides here): it must drop some and keep some.
    - The entropy mask ρ: the tokens kept, by ours (grpo.high_entropy_mask on our entropies
      [N, C]) and by TRL (its get_high_entropy_mask on its own, trl_entropy, from the GRPOTrainer
      trl): not all of them. Each side takes its threshold from its own entropies, so a token
      within their rounding difference of the threshold could fall on either side: the row says
      how far below each side's threshold the highest entropy our mask drops lies, and names every
      token the two sides keep differently, with both entropies.
    - The bias-corrected KL: how far it moves the gradient w.r.t. the log-probs at θ (β = 0.04,
      Â = 0: the KL term alone), off-policy and on-policy: it must move it."""
    m, adv = batch["trl"]["completion_mask"].bool(), batch["advantages"]
    log_ratio = torch.where(m, batch["current"] - batch["old"], 0.0)
    seq = log_ratio.sum(1, keepdim=True) / m.sum(1, keepdim=True)  # [N, 1]
    ratios = dict(token=log_ratio.exp(), sequence=seq.expand_as(log_ratio).exp())
    rows = []
    caps = {
        (c["ratio_level"], 1 + c["epsilon_high"]) for c in cases if c.get("surrogate") == "cispo"
    }
    for level, cap in sorted(caps, key=lambda c: (c[0] != "token", c[1])):
        capped = int(((ratios[level] > cap) & m).sum())
        rows.append(
            dict(
                what=f"CISPO cap {cap:g}, {level} ratios",
                text=f"{capped} of {int(m.sum())} tokens capped",
                fail="never binds" if capped == 0 else None,
            )
        )
    negative = adv < 0
    kl = -seq.flatten()  # mean log(π_old / π_θ) per completion
    for delta in sorted({c["off_policy_threshold"] for c in cases if "off_policy_threshold" in c}):
        dropped, of = int((negative & (kl > delta)).sum()), int(negative.sum())
        rows.append(
            dict(
                what=f"off-policy mask delta={delta:g}",
                text=f"{dropped} of {of} completions with Â < 0 dropped (their mean log(π_old/π_θ): "
                + " ".join(f"{v:.3f}" for v in kl[negative].tolist())
                + ")",
                fail="drops nothing" if dropped == 0 else "drops all" if dropped == of else None,
            )
        )
    for rho in sorted({c["top_entropy"] for c in cases if "top_entropy" in c}):
        ours = grpo.high_entropy_mask(entropy, m, rho)
        theirs = trl.get_high_entropy_mask(trl_entropy, m.long(), 1 - rho)
        text = f"{int(ours.sum())} of {int(m.sum())} tokens kept (TRL: {int(theirs.sum())})"
        if not ours.equal(m):
            # the highest entropy our mask drops, and how far below each side's threshold it is
            i, t = divmod(torch.where(m & ~ours, entropy, -1.0).argmax().item(), m.shape[1])
            below = [
                torch.quantile(e[m], 1 - rho).item() - e[i, t].item()
                for e in (entropy, trl_entropy)
            ]
            text += (
                f"; the highest dropped, completion {i} token {t}, {below[0]:.1e} below the "
                f"threshold (TRL: {below[1]:.1e})"
            )
        for i, t in (ours != theirs).nonzero().tolist():
            text += (
                f"; KEPT DIFFERENTLY: completion {i} token {t}: ours H={entropy[i, t]:.9g} "
                f"{'kept' if ours[i, t] else 'dropped'}, TRL H={trl_entropy[i, t]:.9g} "
                f"{'kept' if theirs[i, t] else 'dropped'}"
            )
        rows.append(
            dict(
                what=f"entropy mask top_entropy={rho:g}",
                text=text,
                fail="keeps every token" if ours.equal(m) else None,
            )
        )
    if any(c.get("kl_bias_correction") for c in cases):
        for what, old in (("off-policy", batch["old"]), ("on-policy", None)):
            grads = []
            for correct in (False, True):
                logps = batch["current"].clone().requires_grad_()
                zero = torch.zeros_like(batch["advantages"])
                grpo.grpo_loss(
                    logps, old, batch["ref"], zero, m, beta=0.04, kl_bias_correction=correct
                ).backward()
                grads.append(logps.grad)
            moved = (grads[1] - grads[0]).abs().max().item()
            rows.append(
                dict(
                    what=f"KL x r, {what}",
                    text=f"moves the KL's gradient w.r.t. log pi_theta by up to {moved:.2e} "
                    f"(of {grads[0].abs().max().item():.2e})",
                    fail="moves nothing" if moved == 0 else None,
                )
            )
    return rows


def named_grads(model):
    return {
        n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
    }


def parity_ours(model, batch, objective, micro, rows=slice(None), weights=None, on_policy=False):
    """Our loss and gradients on batch rows `rows` (a batch of their own), in micro-batches of
    `micro` rows: trainer.policy_update itself, with an optimizer that cannot move the weights
    (SGD at lr 0) and no clipping (max norm inf: clip_grad_norm_ multiplies by exactly 1), so the
    gradients stay in .grad.

    weights: "token" or "sequence", the batch's given importance weights w of that shape, applied
    the way a run applies --sampler-correction's: the rollouts carry sampler log-probs log π_old -
    log w (log w spread evenly over a completion's tokens for "sequence": their sum is log w_i), so
    trainer.sampler_correction's π_old / π_sampler, truncated to [0, inf] (not at all), is w.
    on_policy: no π_old (μ = 1): the ratio is π_θ / sg(π_θ), exactly 1 with a gradient."""
    r, advantages, old, ref = batch["rollouts"], batch["advantages"], batch["old"], batch["ref"]
    mask, correction, sampler = r.completion_mask, None, {}
    if weights is not None:
        w = batch["weights"][weights]
        log_w = w.log() if weights == "token" else w.log() / mask.sum(1, keepdim=True)
        correction = (f"{weights}_truncate", 0.0, float("inf"))
        sampler = dict(
            sampler_logps=((old - log_w) * mask)[rows],
            log_kept=torch.zeros(mask.shape)[rows],  # no top-k / top-p
        )
    part = sampling.Rollouts(
        r.input_ids[rows],
        r.attention_mask[rows],
        mask[rows],
        r.texts[rows],
        r.group_size,
        r.temperature,
        **sampler,
    )
    grads = {}

    class Recording(torch.optim.SGD):
        """SGD at lr 0 that keeps the gradients it steps with (the loop frees them right after the
        step)."""

        def step(self, closure=None):
            grads.update(named_grads(model))
            return super().step(closure)

    optimizer = Recording(model.parameters(), lr=0.0)
    stats, _ = trainer.policy_update(
        model,
        optimizer,
        get_scheduler("constant", optimizer),
        part,
        advantages[rows],
        None if on_policy else old[rows],
        ref[rows] if objective.beta else None,
        objective=objective,
        micro_batch_size=micro,
        correction=correction,
        max_grad_norm=float("inf"),
    )
    return stats["loss"], grads


def parity_trainer(
    model, tokenizer, tmp, case, per_device, accumulation=1, steps_per_generation=None
):
    """A GRPOTrainer around a copy of the model (TRL patches the copy's forward with its fused
    log-prob head), set as ours for the case (parity_cases: our trainer.LossSettings fields, and
    "weights"): same loss, ε, ε_high, δ, β, ratio level, temperature, max_completion_length, and
    the case's options in TRL's terms (trl_loss); every other TRL extra off.

    A case with given weights: TRL multiplies each token's policy loss by
    inputs["importance_sampling_ratio"] only when trl_trainer.use_vllm and
    trl_trainer.vllm_importance_sampling_correction, because it computes that ratio (π_old / π_vLLM)
    only on its vLLM generation path. There is no vLLM here and no generation at all: both
    attributes are set to True on the constructed trainer (use_vllm=True in the config would start
    vLLM), and parity_trl hands it the same weights ours gets; compute_loss reads use_vllm nowhere
    else."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    s = PARITY_SHAPE
    args = GRPOConfig(
        output_dir=tmp,
        **TRL_ON_CPU,
        gradient_checkpointing=False,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=steps_per_generation,
        num_generations=s["group"],
        max_completion_length=max(s["completion_lens"]),
        temperature=s["temperature"],
        beta=case["beta"],
        epsilon=0.2,
        delta=case["delta"],
        importance_sampling_level=case["ratio_level"],
        **trl_loss(case),
        num_iterations=2,  # π_old != π_θ
        use_vllm=False,
        use_liger_kernel=False,
        mask_truncated_completions=False,
        top_entropy_quantile=case.get("top_entropy", 1.0),
        entropy_coef=0.0,
        use_adaptive_entropy=False,
        off_policy_mask_threshold=case.get("off_policy_threshold"),
        use_bias_correction_kl=case.get("kl_bias_correction", False),
        cast_lm_head_to_fp32=False,
        disable_dropout=True,
    )
    # unused: no generation happens here
    dataset = Dataset.from_dict({"prompt": ["w0"] * 8, "answer": ["42"] * 8})
    trl_trainer = GRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=[trl_reward(f) for f in rewards.REWARD_FUNCS.values()],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    if case.get("weights"):  # its vLLM path's weighting, on the weights parity_trl passes
        trl_trainer.use_vllm = trl_trainer.vllm_importance_sampling_correction = True
    return trl_trainer


def trl_loss(case):
    """GRPOConfig's loss_type, epsilon_high and SAPO temperatures for the case. TRL names CISPO and
    SAPO as loss types, each with one aggregation: CISPO's is dapo's token sum, SAPO's grpo's mean
    of per-sequence means (parity_cases gives our loss_type accordingly). TRL's CISPO epsilon_high
    is the cap on the ratio itself, ours 1 + ε_high (MiniMax-M1's ε_max^IS)."""
    surrogate = case.get("surrogate", "clip")
    if surrogate != "clip" and case["loss_type"] != TRL_AGGREGATION[surrogate]:
        raise ValueError(f"TRL aggregates {surrogate} as {TRL_AGGREGATION[surrogate]} only")
    return dict(
        loss_type=case["loss_type"] if surrogate == "clip" else surrogate,
        epsilon_high=1 + case["epsilon_high"] if surrogate == "cispo" else case["epsilon_high"],
        sapo_temperature_pos=case.get("sapo_tau_pos", 1.0),
        sapo_temperature_neg=case.get("sapo_tau_neg", 1.05),
    )


def parity_trl(trl_trainer, batch, micro_rows, accumulation=1, weights=None, on_policy=False):
    """TRL's loss and gradients: compute_loss (which is _compute_loss) on each micro-batch's slice
    of the generation batch, backward after each, as Trainer.training_step does (GRPOTrainer's
    loss_is_scaled_for_ga: Trainer adds no scaling of its own). Returns the sum of the micro-batch
    losses and the accumulated gradients. weights: "token" or "sequence", the batch's given weights
    [N, C] or [N, 1] as the importance_sampling_ratio its vLLM path would compute (the trainer must
    be parity_trainer's for a case with weights). on_policy: no old_per_token_logps in the
    inputs, as TRL's generation leaves them out at μ = 1 (its loss then takes π_θ's, detached)."""
    inputs = batch["trl"]
    if on_policy:
        inputs = {k: v for k, v in inputs.items() if k != "old_per_token_logps"}
    if weights is not None:
        inputs = dict(inputs, importance_sampling_ratio=batch["weights"][weights])
    trl_trainer.model.train()
    trl_trainer.model.zero_grad(set_to_none=True)
    trl_trainer.current_gradient_accumulation_steps = (
        accumulation  # what Trainer's loop sets for each window
    )
    losses = []
    for rows in micro_rows:
        micro = {k: v[rows] for k, v in inputs.items()}
        # num_items_in_batch: the tokens of the whole generation batch (all micro-batches), as TRL
        # computes it
        micro["num_items_in_batch"] = inputs["completion_mask"].sum()
        loss = trl_trainer.compute_loss(trl_trainer.model, micro)
        loss.backward()
        losses.append(loss.item())
    return sum(losses), named_grads(trl_trainer.model)


def parity_compare(name, ours, trl, trl_scale=1.0, note=""):
    """A table row; TRL's loss and gradients times trl_scale (a deliberate normalization difference)
    must match."""
    (our_loss, our_grads), (trl_loss, trl_grads) = ours, trl
    diff = max((our_grads[k] - trl_grads[k]).abs().max().item() for k in our_grads)
    loss_ok = abs(our_loss - trl_scale * trl_loss) <= PARITY_TOL * max(1.0, abs(trl_loss))
    largest = max(trl_scale * g.abs().max().item() for g in trl_grads.values())
    grad_ok = max(
        (our_grads[k] - trl_scale * trl_grads[k]).abs().max().item() for k in our_grads
    ) <= PARITY_TOL * max(1.0, largest)
    ok = loss_ok and grad_ok
    return dict(
        case=name,
        ours=our_loss,
        trl=trl_loss,
        diff=diff,
        ok=ok,
        result=("pass" if ok else "FAIL") + (f" {note}" if note else ""),
    )


def parity_cases():
    """Every case but parity_accumulation's: dicts of our trainer.LossSettings fields (those
    left out at their defaults) and, for the given importance weights, "weights": "token" or
    "sequence".
    - eq. 3's clipped surrogate, every combination: loss type x β (KL to π_ref) x ε_high
      (clip-higher) x δ (dual clip) x ratio level;
    - CISPO (our loss_type dapo: TRL's aggregation): its cap E = 1 + ε_high x β x ratio level
      (TRL only warns about sequence level with cispo), each E binding on some tokens of this
      batch (parity_options): its token ratios reach 2.9, its sequence ratios 2.0, so a cap of 5
      would test nothing;
    - SAPO (our loss_type grpo): the temperatures (τ+, τ-) x β x ratio level;
    - the entropy mask: ρ x loss type x β (at ρ = 0.5 the threshold is a near tie: the highest
      dropped entropy lies 3 fp32 ulps below it on our side, 2 on TRL's; parity_options prints
      both);
    - the off-policy mask: δ (one dropping 3 of the 4 completions with Â < 0, one dropping 1) x
      loss type x β;
    - given weights, per token [N, C] and per completion [N, 1]: each loss type with the clip (β
      on), CISPO and SAPO;
    - the bias-corrected KL (β = 0.04, the KL term times the ratio): each loss type x ratio level,
      off-policy (π_old as above) and on-policy (no π_old: the ratio is 1, its gradient is not);
      CISPO and SAPO each way; with the dual clip, which caps the policy term's ratio but not the
      KL's; and with per-token weights, which weigh the policy term but not the KL."""
    loss_types, betas = ("grpo", "dapo", "dr_grpo"), (0.0, 0.04)
    for loss_type, beta, epsilon_high, delta, ratio_level in itertools.product(
        loss_types, betas, (None, 0.28), (None, 1.5), ("token", "sequence")
    ):
        yield parity_case(loss_type, beta, epsilon_high, delta, ratio_level)
    caps = [("token", e) for e in (1.2, 1.28, 1.5, 2.0)] + [("sequence", e) for e in (1.2, 1.5)]
    for (ratio_level, cap), beta in itertools.product(caps, betas):
        yield parity_case("dapo", beta, cap - 1, ratio_level=ratio_level, surrogate="cispo")
    temperatures = ((1.0, 1.05), (0.5, 2.0), (4.0, 0.25))
    for (tau_pos, tau_neg), beta, ratio_level in itertools.product(
        temperatures, betas, ("token", "sequence")
    ):
        yield parity_case(
            "grpo",
            beta,
            ratio_level=ratio_level,
            surrogate="sapo",
            sapo_tau_pos=tau_pos,
            sapo_tau_neg=tau_neg,
        )
    for rho, loss_type, beta in itertools.product((0.2, 0.5, 0.8), loss_types, betas):
        yield parity_case(loss_type, beta, top_entropy=rho)
    for delta, loss_type, beta in itertools.product((0.05, 0.5), loss_types, betas):
        yield parity_case(loss_type, beta, off_policy_threshold=delta)
    for weights in ("token", "sequence"):
        for loss_type in loss_types:
            yield parity_case(loss_type, 0.04, weights=weights)
        yield parity_case("dapo", 0.0, 1.28 - 1, surrogate="cispo", weights=weights)
        yield parity_case("grpo", 0.04, surrogate="sapo", weights=weights)
    corrected = dict(kl_bias_correction=True)
    for on_policy in (False, True):
        for loss_type, ratio_level in itertools.product(loss_types, ("token", "sequence")):
            yield parity_case(
                loss_type, 0.04, ratio_level=ratio_level, on_policy=on_policy, **corrected
            )
        yield parity_case(
            "dapo", 0.04, 1.28 - 1, surrogate="cispo", on_policy=on_policy, **corrected
        )
        yield parity_case("grpo", 0.04, surrogate="sapo", on_policy=on_policy, **corrected)
    yield parity_case("dapo", 0.04, 0.28, 1.5, **corrected)
    yield parity_case("dapo", 0.04, weights="token", **corrected)


def parity_case(loss_type, beta, epsilon_high=None, delta=None, ratio_level="token", **options):
    return dict(
        loss_type=loss_type,
        beta=beta,
        epsilon_high=epsilon_high,
        delta=delta,
        ratio_level=ratio_level,
        **options,
    )


def parity_objective(case, max_tokens):
    """Our settings for the case: its LossSettings fields (all its keys but "weights" and
    "on_policy")."""
    settings = {k: v for k, v in case.items() if k not in ("weights", "on_policy")}
    return trainer.LossSettings(epsilon=0.2, max_tokens=max_tokens, **settings)


def parity_name(case):
    """A table row's name: the settings of eq. 3's clipped surrogate as ours takes them, then each
    newer option the case sets (CISPO's cap with TRL's epsilon_high for it; trl_loss)."""
    eps_high = "-" if case["epsilon_high"] is None else f"{case['epsilon_high']:g}"
    name = (
        f"{case['loss_type']:<7} beta={case['beta']:<4} eps_high={eps_high:<4} "
        f"delta={case['delta'] or '-':<3} {case['ratio_level']:<8}"
    )
    surrogate, options = case.get("surrogate", "clip"), []
    if surrogate == "cispo":
        options.append(f"cispo (TRL epsilon_high={1 + case['epsilon_high']:g})")
    if surrogate == "sapo":
        tau = f"tau+={case.get('sapo_tau_pos', 1.0):g} tau-={case.get('sapo_tau_neg', 1.05):g}"
        options.append(f"sapo {tau}")
    if "top_entropy" in case:
        options.append(f"top_entropy={case['top_entropy']:g}")
    if "off_policy_threshold" in case:
        options.append(f"off_policy_threshold={case['off_policy_threshold']:g}")
    if case.get("weights"):
        shape = "[N,T]" if case["weights"] == "token" else "[N,1]"
        options.append(f"weights {shape}")
    if case.get("kl_bias_correction"):
        options.append("KL x r" + (" on-policy (no pi_old)" if case.get("on_policy") else ""))
    return f"{name} {', '.join(options)}".rstrip()


def parity_accumulation(model, tokenizer, tmp, batch):
    """Several micro-batches per generation batch, where TRL's normalizers come into play (β,
    ε_high, δ on).

    gradient_accumulation_steps=2 (steps_per_generation defaults to it): one optimizer step over two
    micro-batches of one group each. TRL divides grpo's per-micro-batch mean of per-sequence means,
    and dr_grpo's, by the number of micro-batches, and dapo's token sum by num_items_in_batch (the
    generation batch's tokens) x GAS / steps_per_gen, which is all its tokens here: the totals are
    the whole batch's, as our whole-batch normalizer gives: must match.

    steps_per_generation=2 with GAS=1: one generation feeds two optimizer steps of one group each (a
    layout our loop does not have: it updates on the whole batch). grpo and dr_grpo still match ours
    on each group taken as a batch. dapo differs by design: TRL divides each step by the generation
    batch's tokens / 2 (the average tokens per step, the same for every step of a generation), we by
    the tokens of the batch the step uses. DAPO's token-level loss (arXiv 2503.14476, eq. 8)
    normalizes by all tokens of the batch a gradient step uses (1 / Σ_i |o_i|): ours follows it; in
    TRL a step of short completions weighs less. The row passes when TRL x (its normalizer / ours) =
    ours."""
    n, tokens = len(batch["advantages"]), batch["trl"]["completion_mask"]
    halves, rows = [slice(0, n // 2), slice(n // 2, n)], []
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        case = dict(
            loss_type=loss_type, beta=0.04, epsilon_high=0.28, delta=1.5, ratio_level="token"
        )
        objective = parity_objective(case, tokens.shape[1])
        trl_trainer = parity_trainer(model, tokenizer, tmp, case, n // 2, accumulation=2)
        rows.append(
            parity_compare(
                f"{loss_type:<7} all on, GAS=2: 2 micro-batches, 1 step",
                parity_ours(model, batch, objective, n // 2),
                parity_trl(trl_trainer, batch, halves, 2),
            )
        )
        trl_trainer = parity_trainer(model, tokenizer, tmp, case, n // 2, steps_per_generation=2)
        for i, half in enumerate(halves):
            scale = (
                tokens.sum().item() / 2 / tokens[half].sum().item() if loss_type == "dapo" else 1.0
            )
            note = f"(TRL differs by design: TRL = ours x {1 / scale:.3f})" if scale != 1.0 else ""
            rows.append(
                parity_compare(
                    f"{loss_type:<7} all on, steps_per_generation=2: step {i + 1}",
                    parity_ours(model, batch, objective, n // 2, half),
                    parity_trl(trl_trainer, batch, [half]),
                    scale,
                    note,
                )
            )
    return rows


# GDPO (--multi-reward gdpo) against TRL's multi_objective_aggregation="normalize_then_sum", which
# TRL computes inline in GRPOTrainer._generate_and_score_completions: that method itself runs here
# (a real generate of the tiny model, 2 tokens per completion), its reward functions returning the
# columns of a fixed table of per-function rewards, and its "advantages" are compared with
# grpo.gdpo_advantages on the same table. The loss cases above cannot check this: both sides take
# the same precomputed advantages there.
#
# Tolerance: |ours - TRL| <= 1e-5 * max(1, largest |TRL advantage|), as PARITY_TOL. The rewards are
# float32 on both sides; ours takes the statistics in float64 (then float32), TRL in float32, so
# the two differ by TRL's rounding: a few float32 ulps of values of order 1 (each z-score, the
# weighted sum, the batch's mean and std). That holds while a reward's spread within its group is
# not tiny next to its size (float32 keeps 7 digits of r - mean): every table here keeps them
# within a factor of 10.
GDPO_TOL = PARITY_TOL


def gdpo_tables():
    """The GDPO cases: (name, per-function rewards [N, K] float32, weights, G), groups of G one
    after another. Drawn from one seed; each keeps its reward functions on different scales, or
    weighted apart, so that normalizing each first differs from normalizing the total."""
    g = torch.Generator().manual_seed(0)

    def coin(n):
        return (torch.rand(n, generator=g) < 0.5).float()

    # issue 56's worked example (grpo.gdpo_advantages' docstring): correctness and a format reward
    yield (
        "correctness 1,1,0,0 + format 0,.1,0,.1",
        torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 0.0], [0.0, 0.1]]),
        [1.0, 1.0],
        4,
    )
    length = torch.randint(20, 300, (16,), generator=g).float()
    yield (
        "0/1 correctness + a length in [20, 300)",
        torch.stack([coin(16), length], 1),
        [1.0, 1.0],
        4,
    )
    three = torch.stack(
        [coin(16), torch.rand(16, generator=g), 10 * torch.rand(16, generator=g)], 1
    )
    yield "3 rewards, weights 1, 0.5, 2", three, [1.0, 0.5, 2.0], 4
    flat = torch.stack([coin(16), torch.rand(16, generator=g)], 1)
    flat[:4, 0], flat[4:8, 1] = 1.0, 0.25  # a group where each reward in turn is all equal
    yield "a reward all equal within a group", flat, [1.0, 1.0], 4
    yield "a penalty, weights 1, -0.5", torch.stack([coin(16), length / 100], 1), [1.0, -0.5], 4
    wide = torch.stack(
        [coin(64), 100 * torch.rand(64, generator=g), torch.rand(64, generator=g)], 1
    )
    yield "8 groups of G=8, 3 rewards", wide, [2.0, 1.0, 0.5], 8


def parity_gdpo(model, tokenizer, tmp):
    """GDPO's rows: for each gdpo_tables case, TRL's advantages (its own
    _generate_and_score_completions, normalize_then_sum, the table's columns as its reward
    functions and the weights as reward_weights) against grpo.gdpo_advantages on the same table.
    Each row also says how far GDPO is from eq. 3's advantage of the weighted total
    (group_advantages), so that no case passes where the two aggregations agree anyway."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rows = []
    for name, table, weights, G in gdpo_tables():
        N, K = table.shape

        def column(k, table=table):
            def reward(completions, **kwargs):  # TRL's call: one value per completion, in order
                assert len(completions) == len(table)
                return table[:, k].tolist()

            reward.__name__ = f"reward_{k}"
            return reward

        args = GRPOConfig(
            output_dir=tmp,
            **TRL_ON_CPU,
            per_device_train_batch_size=N,  # one generation batch: the whole table
            num_generations=G,
            max_completion_length=2,
            beta=0.0,
            use_vllm=False,
            multi_objective_aggregation="normalize_then_sum",
            reward_weights=weights,
        )
        trl_trainer = GRPOTrainer(
            model=copy.deepcopy(model),
            reward_funcs=[column(k) for k in range(K)],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["w0"] * N}),
            processing_class=tokenizer,
        )
        trl_trainer.model.train()  # its "train" mode: num_generations = G
        inputs = [{"prompt": f"w{i // G} w{i // G + 1}"} for i in range(N)]  # each prompt G times
        theirs = trl_trainer._generate_and_score_completions(inputs)["advantages"]
        ours = grpo.gdpo_advantages(table.double(), weights, G)
        summed = grpo.group_advantages((table.double() * torch.tensor(weights)).sum(1), G)
        diff = (ours.double() - theirs.double()).abs().max().item()
        largest = theirs.abs().max().item()
        apart = (ours - summed).abs().max().item()
        ok = diff <= GDPO_TOL * max(1.0, largest) and apart > 0.01
        rows.append(
            dict(
                case=f"{name}, B={N // G} G={G}",
                diff=diff,
                largest=largest,
                apart=apart,
                ok=ok,
            )
        )
    return rows


def parity_model():
    """The parity cases' tiny fp32 Llama (PARITY_SHAPE's vocabulary), its word-level tokenizer
    and a temporary directory holding the model (TRL builds its reference model, beta > 0, with
    from_pretrained(_name_or_path))."""
    s = PARITY_SHAPE
    model = demo.tiny_llama(
        s["vocab"], 0, hidden_size=64, intermediate_size=128, num_hidden_layers=2
    )
    tmp = tempfile.mkdtemp(prefix="bench_parity_")
    model.save_pretrained(tmp)
    model.config._name_or_path = tmp
    return model, build_tokenizer(s["vocab"]), tmp


def worker_gdpo(a):
    """GDPO's rows alone (runs in the bench env; tests/test_vs_trl.py)."""
    import trl

    model, tokenizer, tmp = parity_model()
    rows = parity_gdpo(model, tokenizer, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    return dict(rows=rows, trl=trl.__version__)


# config.TRL_PRESET's flags against the GRPOConfig fields they stand for: name, or a function of
# the defaults (a dict) for those that are not one field's value.
TRL_PRESET_FIELDS = dict(
    beta="beta",
    loss_type="loss_type",
    surrogate=lambda d: {"cispo": "cispo", "sapo": "sapo"}.get(d["loss_type"], "clip"),
    epsilon="epsilon",
    epsilon_high="epsilon_high",
    delta="delta",
    ratio_level="importance_sampling_level",
    scale_rewards="scale_rewards",
    num_iterations="num_iterations",
    mask_truncated="mask_truncated_completions",
    top_entropy_quantile="top_entropy_quantile",
    off_policy_mask="off_policy_mask_threshold",
    kl_bias_correction="use_bias_correction_kl",
    num_generations="num_generations",
    temperature="temperature",
    top_p="top_p",
    top_k="top_k",
    max_new_tokens="max_completion_length",
    lr="learning_rate",
    lr_scheduler=lambda d: str(getattr(d["lr_scheduler_type"], "value", d["lr_scheduler_type"])),
    warmup_steps="warmup_steps",
    weight_decay="weight_decay",
    max_grad_norm="max_grad_norm",
    # per_device_train_batch_size counts completions: groups of num_generations
    batch_size=lambda d: d["per_device_train_batch_size"] / d["num_generations"],
    gradient_accumulation_steps="gradient_accumulation_steps",
    dropout=lambda d: not d["disable_dropout"],
)


def preset_against_trl():
    """Each flag of --preset trl against the installed TRL's GRPOConfig default it stands for
    (dataclass field defaults: no config is built). Returns rows of dict(what, text, fail)."""
    from trl import GRPOConfig

    defaults = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(GRPOConfig)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    rows, differ = [], []
    for name, value in config.TRL_PRESET.items():
        field = TRL_PRESET_FIELDS[name]
        theirs = field(defaults) if callable(field) else defaults[field]
        if theirs != value:
            differ.append(f"{name} {value!r} (TRL: {theirs!r})")
    rows.append(
        dict(
            what="--preset trl",
            text=f"{len(config.TRL_PRESET) - len(differ)} of {len(config.TRL_PRESET)} flags are "
            "the installed GRPOConfig's defaults" + "".join(f"; DIFFERS: {d}" for d in differ),
            fail=f"differs on {', '.join(differ)}" if differ else None,
        )
    )
    return rows


def worker_parity(a):
    """e. (runs in the bench env): the table's rows, how far TRL's per-token log-probs and
    entropies are from ours, and what each clip, cap and mask acts on."""
    import trl

    model, tokenizer, tmp = parity_model()
    batch = parity_batch(model)
    n, mask = len(batch["advantages"]), batch["trl"]["completion_mask"]
    rows, cases = [], list(parity_cases())
    for case in cases:
        trl_trainer = parity_trainer(model, tokenizer, tmp, case, n)
        weights, on_policy = case.get("weights"), case.get("on_policy", False)
        objective = parity_objective(case, mask.shape[1])
        rows.append(
            parity_compare(
                parity_name(case),
                parity_ours(model, batch, objective, n, weights=weights, on_policy=on_policy),
                parity_trl(trl_trainer, batch, [slice(None)], weights=weights, on_policy=on_policy),
            )
        )
    # TRL's per-token log-probs and entropies (its fused head at T) against ours (token_logprobs at
    # T, as policy_update calls it)
    with torch.no_grad():
        r = batch["rollouts"]
        ids, attn, C = r.input_ids, r.attention_mask, mask.shape[1]
        logps, trl_entropy = trl_trainer._get_per_token_logps_and_entropies(
            trl_trainer.model, ids, attn, C, compute_entropy=True
        )[:2]
        _, entropy = sampling.token_logprobs(
            model, ids, attn, C, r.temperature, entropy=True, group_size=r.group_size
        )
    rows += parity_accumulation(model, tokenizer, tmp, batch)
    gdpo = parity_gdpo(model, tokenizer, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    return dict(
        rows=rows,
        gdpo=gdpo,
        trl=trl.__version__,
        params=sum(p.numel() for p in model.parameters()),
        logp_diff=((logps - batch["current"]) * mask).abs().max().item(),
        entropy_diff=((trl_entropy - entropy) * mask).abs().max().item(),
        tokens=int(mask.sum()),
        engaged=parity_engagement(batch),
        options=parity_options(batch, cases, entropy, trl_trainer, trl_entropy)
        + preset_against_trl(),
    )


def bench_parity(a):
    """e. The parity table; exits 1 if any case fails, or any clip, cap or mask a case sets acts on
    nothing (a mask: or on everything), so that its cases would test nothing."""
    t0 = time.perf_counter()
    r = run_worker(a, "parity")
    s = PARITY_SHAPE
    print(
        f"{time.strftime('%Y-%m-%d')} | parity with trl {r['trl']}'s GRPOTrainer loss | torch {torch.__version__} "
        f"cpu fp32 | Llama of {r['params']:,} parameters | {len(s['prompt_lens'])} prompts x G={s['group']}, "
        f"completion lengths {list(s['completion_lens'])} ({r['tokens']} tokens), T={s['temperature']}"
    )
    print(
        f"per-token log-probs, max |ours - TRL|: {r['logp_diff']:.1e}; entropies: "
        f"{r['entropy_diff']:.1e}; tokens each clip acts on: "
        + "; ".join(
            f"{level} ratios: " + ", ".join(f"{k} {v}" for k, v in clips.items())
            for level, clips in r["engaged"].items()
        )
    )
    for option in r["options"]:
        print(f"{option['what']}: {option['text']}")
    width = max(len(row["case"]) for row in r["rows"])
    print(
        f"{'case':<{width}}  {'our loss':>12}  {'TRL loss':>12}  {'max|dgrad|':>10}  result (tol {PARITY_TOL:g})"
    )
    for row in r["rows"]:
        print(
            f"{row['case']:<{width}}  {row['ours']:>12.8f}  {row['trl']:>12.8f}  {row['diff']:>10.1e}  "
            f"{row['result']}"
        )
    failed = [row["case"] for row in r["rows"] if not row["ok"]]
    passed = len(r["rows"]) - len(failed)
    print_gdpo(r["gdpo"])
    failed += [f"GDPO {row['case']}" for row in r["gdpo"] if not row["ok"]]
    failed += [
        f"{level} {clip} clip never engages"
        for level, clips in r["engaged"].items()
        for clip, count in clips.items()
        if count == 0
    ]
    failed += [f"{o['what']} {o['fail']}" for o in r["options"] if o["fail"]]
    print(f"{passed}/{len(r['rows'])} cases pass ({time.perf_counter() - t0:.0f} s)")
    if failed:
        sys.exit(f"parity FAILED: {', '.join(failed)}")


def print_gdpo(rows):
    """GDPO's table (parity_gdpo's rows) and its count."""
    print(
        "GDPO (--multi-reward gdpo) vs TRL's normalize_then_sum, its own "
        "GRPOTrainer._generate_and_score_completions on the same per-function rewards:"
    )
    width = max(len(row["case"]) for row in rows)
    print(
        f"{'reward table':<{width}}  {'max|Â ours - Â TRL|':>19}  {'max|Â|':>7}  "
        f"{'GDPO - eq. 3':>12}  result (tol {GDPO_TOL:g})"
    )
    for row in rows:
        print(
            f"{row['case']:<{width}}  {row['diff']:>19.1e}  {row['largest']:>7.3f}  "
            f"{row['apart']:>12.3f}  {'pass' if row['ok'] else 'FAIL'}"
        )
    passed = sum(row["ok"] for row in rows)
    print(f"GDPO: {passed}/{len(rows)} reward tables agree with TRL's")


# --------------------------------------------------------------------------------------------------
# d. Memory from the architecture: what a run of trainer.py holds on the device, by part (bytes =
# count x width).


def saved_bytes(model, tokens, amp):
    """Bytes of the tensors autograd saves for backward in one forward of the decoder stack (no
    lm-head: the chunked head keeps no [T, V] logits) over `tokens` tokens, each storage counted
    once."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), sampling.autocast("cpu", amp):
        model.model(input_ids=torch.zeros(1, tokens, dtype=torch.long))
    return sum(storages.values())


def activation_bytes_per_token_layer(name, amp):
    """Measured on 1- and 2-layer models of the config at 128 and 256 tokens: the differences cancel
    the weights (and autocast's copies of them), the embedding and the final norm, leaving one
    layer's activations per token."""
    per_layers = {}
    for layers in (1, 2):
        shape = dict(CONFIGS[name], num_hidden_layers=layers)
        model = demo.tiny_llama(shape.pop("vocab_size"), 0, **shape)
        per_layers[layers] = saved_bytes(model, 256, amp) - saved_bytes(model, 128, amp)
    return (per_layers[2] - per_layers[1]) / 128


def memory_phases(a):
    """What a trainer.py run of this config holds on the device in each phase, part by part (bytes),
    computed from the architecture: {phase: [(part, bytes)]}. The phases are the loop's (generate,
    reference log-probs, policy forward + backward, optimizer) and the evaluation's. What each phase
    holds:
      - always: the fp32 weights, AdamW's two fp32 moments, the reference in the compute dtype (β >
        0) and, with --compile, the decode twin (every Linear weight in the compute dtype) and the
        KV caches of the two planned decode shapes, which the compiled step reads in place for the
        whole run;
      - generate and evaluation: the KV cache (rows x (prompt + new tokens), keys and values in the
        compute dtype) and, eager, autocast's compute-dtype copy of every Linear weight, cached for
        the whole decode;
      - reference log-probs: the prompt's KV cache repeated to the micro-batch's G rows, and the
        chunked lm-head's fp32 logits;
      - policy forward + backward: the fp32 gradients, autocast's copy of the weights, the
        micro-batch's activations and the chunked lm-head's working set;
      - optimizer: the gradients (freed right after the step: no generation holds them)."""
    c, amp = CONFIGS[a.config], sampling.AUTOCAST_DTYPE[a.dtype]
    width = 2 if amp is not None else 4
    model = build_model_meta(a.config)
    n = sum(p.numel() for p in model.parameters())
    linear = sum(
        p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()
    )
    L, h, V = c["num_hidden_layers"], c["hidden_size"], c["vocab_size"]
    # keys + values
    kv_per_token = L * 2 * c["num_key_value_heads"] * (h // c["num_attention_heads"]) * width
    seq = a.prompt_len + a.max_new_tokens
    rows, micro = (
        a.batch_size * a.accumulation * a.num_generations,
        a.batch_size * a.num_generations,
    )
    eval_rows = a.eval_batch_size * a.eval_samples
    # autocast's cast of each Linear weight, or the twin
    copy_bytes = width * linear if amp is not None else 0
    act = activation_bytes_per_token_layer(a.config, amp)
    # the fp32 residual stream per layer, then one layer recomputed
    checkpointed = micro * seq * (L * 4 * h + act)
    # rows of the chunked lm-head at a time: [chunk, V] fp32 logits
    chunk = min(1024, micro * a.max_new_tokens)
    kv = {
        "generate": (f"KV cache: {rows} rows x {seq} tokens", rows * seq * kv_per_token),
        "evaluation": (
            f"KV cache: {eval_rows} rows x {seq} tokens",
            eval_rows * seq * kv_per_token,
        ),
    }
    static = [
        ("weights, fp32", 4 * n),
        ("AdamW moments, fp32", 8 * n),
        (f"reference model, {a.dtype}", width * n if a.beta > 0 else 0),
        ("decode twin (--compile)", copy_bytes if a.compile else 0),
        # compiled, each planned shape keeps its cache for the whole run (CUDA graphs read it in
        # place)
        (
            "the compiled decode's two KV caches, kept",
            kv["generate"][1] + kv["evaluation"][1] if a.compile else 0,
        ),
    ]
    if a.compile:  # the caches are counted above, in every phase; decoding reads the twin, autocast casts nothing
        kv = {phase: ("", 0) for phase in kv}
    decode_copy = (
        "" if a.compile else f"autocast copy of the Linear weights, {a.dtype}",
        0 if a.compile else copy_bytes,
    )
    return {
        "generate": static + [decode_copy, kv["generate"]],
        "reference log-probs": static
        + [
            (
                f"prompt KV cache x G: {micro} rows x {a.prompt_len}",
                micro * a.prompt_len * kv_per_token,
            ),
            (f"lm-head: {chunk} x {V} fp32 logits, twice", 2 * 4 * chunk * V),
        ],
        "policy forward + backward": static
        + [
            ("gradients, fp32", 4 * n),
            (f"autocast copy of the weights, {a.dtype}", copy_bytes),
            (
                f"activations: {micro} rows x {seq} tokens"
                + (", checkpointed" if a.gradient_checkpointing else ""),
                checkpointed if a.gradient_checkpointing else micro * seq * L * act,
            ),
            (f"lm-head: {chunk} x {V} fp32 logits, three", 3 * 4 * chunk * V + width * V * h),
        ],
        "optimizer": static + [("gradients, fp32", 4 * n)],
        "evaluation": static + [decode_copy, kv["evaluation"]],
    }


def memory_table(a):
    """The device memory of a trainer.py run of this config, phase by phase (memory_phases), in GB
    (1e9 bytes)."""
    phases = memory_phases(a)
    n = sum(p.numel() for p in build_model_meta(a.config).parameters())
    print(
        f"{a.config}: {n:,} parameters, {a.dtype}; {a.batch_size * a.accumulation} prompts x G="
        f"{a.num_generations} per step, {a.prompt_len} + {a.max_new_tokens} tokens; evaluation "
        f"{a.eval_batch_size} questions x {a.eval_samples}" + (", --compile" if a.compile else "")
    )
    seen = set()
    for name, parts in phases.items():
        print(f"  {name}: peak {sum(b for _, b in parts) / 1e9:.2f} GB")
        for part, b in parts:
            if b and (part, b) not in seen:
                print(f"    {part:<54}{b / 1e9:>8.2f} GB")
            seen.add((part, b))
    peak = max(sum(b for _, b in parts) for parts in phases.values())
    print(
        f"  peak of the run: {peak / 1e9:.2f} GB: "
        + ("fits" if peak < 40e9 else "does not fit")
        + " a 40 GB card"
    )


def build_model_meta(name):
    """The config's model on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return build_model(name)


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--logprobs", action="store_true", help="a. chunked log-probs vs the naive log-softmax"
    )
    p.add_argument(
        "--step", action="store_true", help="b. one GRPO step of our loop, phase by phase"
    )
    p.add_argument(
        "--vs-trl",
        action="store_true",
        help="c. our step vs TRL's GRPOTrainer, alternating A B A B",
    )
    p.add_argument(
        "--parity",
        action="store_true",
        help="e. our loss and gradients vs TRL GRPOTrainer's on one batch, every setting: prints a table, "
        "exits 1 on a mismatch (needs BENCH_PYTHON)",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="d. the memory a training run needs, computed from the config (no run): prints and exits",
    )
    p.add_argument(
        "--accumulation",
        type=int,
        default=4,
        help="--memory: prompts generated per step / batch-size",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="--memory: with gradient checkpointing",
    )
    p.add_argument(
        "--eval-batch-size", type=int, default=8, help="--memory: questions per evaluation batch"
    )
    p.add_argument(
        "--eval-samples", type=int, default=8, help="--memory: completions per evaluation question"
    )
    p.add_argument("--config", default="tiny", choices=list(CONFIGS))
    p.add_argument("--num-generations", type=int, default=8, help="G")
    p.add_argument(
        "--batch-size", type=int, default=1, help="prompts per step (B); B*G completions"
    )
    p.add_argument(
        "--prompt-len", type=int, default=None, help="prompt tokens; default per config (SHAPES)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="completion tokens; default per config (SHAPES)",
    )
    p.add_argument("--beta", type=float, default=config.build_parser().get_default("beta"))
    p.add_argument("--num-iterations", type=int, default=1, help="mu")
    p.add_argument("--lr", type=float, default=config.build_parser().get_default("lr"))
    p.add_argument(
        "--temperature", type=float, default=config.build_parser().get_default("temperature")
    )
    p.add_argument("--top-p", type=float, default=config.build_parser().get_default("top_p"))
    p.add_argument("--top-k", type=int, default=config.build_parser().get_default("top_k"))
    p.add_argument(
        "--dtype", default="bf16" if DEVICE == "cuda" else "fp32", choices=["fp32", "bf16"]
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per run, after --warmup; default per config",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps per run")
    p.add_argument("--rounds", type=int, default=3, help="--vs-trl: A B pairs")
    p.add_argument(
        "--rollout",
        default=None,
        metavar="MODEL",
        help="d. completion tokens/s of one rollout of a real model (a local directory or hub id): the "
        "first --batch-size GSM8K test questions x G, --max-new-tokens each (EOS suppressed), as "
        "trainer.py samples them (--threads, default here 2)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="--step, --vs-trl: our side as trainer.py --compile runs it (torch.compile'd decode step and "
        "log-prob forwards)",
    )
    p.add_argument(
        "--real-length",
        action="store_true",
        help="--step, --vs-trl: completions end with EOS at lengths uniform in [max_new/8, max_new] "
        "(at least 2; seed 0, the same for both trainers) instead of all running to max_new",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="--logprobs: calls per variant (median of all but the first)",
    )
    # One thread by default on CPU: on a machine shared with other jobs, OpenMP threads waiting at
    # barriers for a descheduled sibling made steps up to 70x slower and unrepeatable (measured
    # here); one thread runs steadily.
    p.add_argument(
        "--threads",
        type=int,
        default=1 if DEVICE == "cpu" else 0,
        help="torch threads in every worker (both ours and TRL's); 0: torch's default (all cores)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def main():
    a = build_parser().parse_args()
    prompt_len, new_tokens, steps = SHAPES[a.config]
    a.prompt_len = a.prompt_len or prompt_len
    a.max_new_tokens = a.max_new_tokens or new_tokens
    a.steps = a.steps or steps
    if a.threads:
        torch.set_num_threads(a.threads)

    if a.memory:
        return memory_table(a)
    if a.worker:
        work = dict(
            logprobs=worker_logprobs,
            ours=worker_ours,
            trl=worker_trl,
            parity=worker_parity,
            gdpo=worker_gdpo,
        )[a.worker]
        print("RESULT " + json.dumps(work(a)), flush=True)
        return

    for flag, wanted in (("--parity", a.parity), ("--vs-trl", a.vs_trl)):
        if wanted:
            check_trl(flag)
    if a.parity:
        return bench_parity(a)
    if a.rollout:
        return bench_rollout(a)
    if not (a.logprobs or a.step or a.vs_trl):
        a.logprobs = a.step = True
    rows = []
    if a.logprobs:
        bench_logprobs(a, rows)
    if a.step:
        bench_step(a, rows)
    if a.vs_trl:
        bench_vs_trl(a, rows)
    print(
        f"\n{time.strftime('%Y-%m-%d')} | {DEVICE}, {torch.get_num_threads()} threads | torch {torch.__version__} | "
        f"{a.config}: B={a.batch_size} G={a.num_generations} prompt {a.prompt_len} + {a.max_new_tokens} new tokens, "
        f"beta={a.beta} mu={a.num_iterations} {a.dtype}"
    )
    width = max(len(r[0]) for r in rows)
    for r in rows:
        print(f"{r[0]:<{width}}  {r[1]:>12}  {r[2]:>16}  {r[3]}")


if __name__ == "__main__":
    main()

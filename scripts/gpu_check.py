"""Check the headline run, `python trainer.py --model SmolLM2-1.7B-Instruct`, on a GPU machine
without network.

    python -m scripts.gpu_check --prepare DIR   # here, once, DIR a SmolLM2 model: writes gpu_kit/
    python -m scripts.gpu_check --out $OUT/gpu_check.json   # on the GPU machine, checkout root
    python -m scripts.gpu_check --out $OUT/gpu_check_compile.json -- --compile   # train's flags
    python -m scripts.gpu_check --config tiny --device cpu -- --max-new-tokens 8 --eval-limit 4

(the last: the CPU smoke test; trainer.py's flags go after --.)

The GPU run builds the SmolLM2-1.7B architecture with random weights (time and memory do not
depend on the weights, and none can be downloaded there) and runs trainer.py's own loop with its
default flags (G = 8, 4 prompts per step, 300 new tokens, beta = 0.04, bf16 autocast over fp32
master weights) for 3 steps, with an evaluation on 16 questions before and after, on real GSM8K
prompts. It reports seconds and peak memory per phase (timed through trainer.train's phase hook,
support/phases.py), whether the run fits a 40 GB card, and decode ms/token at 32 rows, eager, CUDA
graphs, fused (--decode fused) and compiled, against the memory-bandwidth floor; --out FILE saves it
as JSON. Exit code 1 if the run or the decode timing failed (fused's failure included).

gpu_kit/ (git-ignored) travels with the checkout: SmolLM2's tokenizer (the same for every size) and
the first 64 train / 32 test rows of GSM8K (a few MiB). The run reads --data
gpu_kit/gsm8k/train.jsonl; test.jsonl beside it is the eval set.
"""

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

# the GPU machine has no network: never wait for the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from transformers import AutoTokenizer

import config
import data
import sampling
import trainer
from scripts import bench
from support import decode, demo, memory, models
from support.phases import Phases

KIT_ROWS = {"train": 64, "test": 32}
GIB = 2**30
# What nvidia-smi reports as the total memory of an A100 40GB and an H100 80GB, and a CUDA context's
# share of it (outside torch's allocator, so not in max_memory_reserved).
CARDS = {"40 GB": 40536 * 2**20, "80 GB": 81559 * 2**20}
CUDA_CONTEXT = 600 * 2**20
# trainer.py's phases (support/phases.py) -> the names this check reports them under; "step" and
# "rewards" are not timed here.
PHASES = {
    "generate": "generate",
    "reference": "reference",
    "update": "forward_backward",
    "optimizer": "optimizer",
    "evaluation": "evaluation",
    "checkpoint": "checkpoint",
}

# --------------------------------------------------------------------------------------------------
# The kit: what the GPU machine needs from outside the checkout.


def prepare_kit(smollm2_dir, gsm8k_dir, kit):
    """Write KIT/tokenizer (SmolLM2's) and KIT/gsm8k/{train,test}.jsonl (GSM8K's first rows).
    Returns its bytes."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    if getattr(tokenizer, "chat_template", None) is None:
        print(
            f"warning: the tokenizer in {smollm2_dir} has no chat template: prompts will be plain text",
            file=sys.stderr,
        )
    for part in ("tokenizer", "gsm8k"):
        shutil.rmtree(os.path.join(kit, part), ignore_errors=True)
    tokenizer.save_pretrained(os.path.join(kit, "tokenizer"))
    for split, n in KIT_ROWS.items():
        dst = os.path.join(kit, "gsm8k", f"{split}.jsonl")
        src = os.path.join(gsm8k_dir, f"{split}.jsonl") if gsm8k_dir else data._download(split)
        copied = copy_lines(src, dst, n)
        data.load_gsm8k(path=dst)  # the rows must read as GSM8K: fail here, not on the GPU machine
        print(f"{dst}: {copied} rows")
    size = tree_bytes(kit)
    print(f"kit {kit}: {size / 2**20:.2f} MiB (a checkout carries at most 64 MiB of ignored files)")
    return size


def copy_lines(src, dst, n):
    """The first n non-blank lines of src into dst, byte for byte. Returns how many were copied."""
    with open(src, "rb") as f:
        lines = [line for line in f if line.strip()][:n]
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(dst, "wb") as f:
        f.writelines(line if line.endswith(b"\n") else line + b"\n" for line in lines)
    return len(lines)


def tree_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def load_kit_tokenizer(kit):
    path = os.path.join(kit, "tokenizer")
    if not os.path.isdir(path):
        raise config.UserError(
            f"no tokenizer in {path}: build the kit first, on a machine with SmolLM2's files: "
            "python -m scripts.gpu_check --prepare SMOLLM2_DIR (then carry gpu_kit/ along)."
        )
    return sampling.prepare_tokenizer(AutoTokenizer.from_pretrained(path))


# --------------------------------------------------------------------------------------------------
# Memory and time, phase by phase.


class Meter:
    """Peak memory since the last reset: torch.cuda.max_memory_allocated on CUDA; on CPU, the
    high-water mark of this process's resident memory, as bench.py measures it (VmHWM, reset by
    writing 5 to /proc/self/clear_refs). overall and overall_reserved: the highest peaks seen across
    resets (reserved: CUDA's caching allocator)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.overall = self.overall_reserved = 0
        self.reset_peak()  # from here on: not what ran before (the bandwidth probe's buffers)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def in_use(self):
        """The memory in use now: allocated tensors on CUDA, resident memory on CPU (VmRSS)."""
        self.sync()
        if self.cuda:
            return torch.cuda.memory_allocated()
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def peak(self):
        self.sync()
        if self.cuda:
            return torch.cuda.max_memory_allocated()
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    def reset(self):
        """Fold the peak so far into the overall peaks, then start a new one."""
        self.overall = max(self.overall, self.peak())
        if self.cuda:
            self.overall_reserved = max(self.overall_reserved, torch.cuda.max_memory_reserved())
        self.reset_peak()

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


@dataclass
class Frame:
    name: str
    step: int  # the training step the phase belongs to (0: the evaluation before training)
    start: float
    inner: float = (
        0.0  # seconds spent in phases nested inside this one (the optimizer inside policy_update)
    )
    peak: int = 0


class PhaseTimer(Phases):
    """Times trainer.train's phases through its phase hook (support/phases.py: passed as
    train(..., phases=timer)), recording (phase, step, seconds, peak memory) per call of each phase
    in PHASES. A phase nested in another (the optimizer inside the update) is cut out of it: each
    phase's time and peak are its own. An evaluation's rollouts count as evaluation (train never
    reports them as generate)."""

    def __init__(self, meter):
        self.meter, self.stack, self.events, self.logged, self.step_times = meter, [], [], 0, []
        self.current = 0  # the step being made (train's "step" phase), 0 before the first

    def phase(self, name, step=None):
        if name == "step":
            self.current = step
        if name not in PHASES:
            return super().phase(name, step)
        # evaluation and checkpoint: after the steps done (0: before training); the rest: in one
        return self.timed(PHASES[name], self.current if step is None else step)

    def step_logged(self, step, metrics):
        """Counts the steps done, and keeps the loop's own time of each."""
        self.logged = step
        self.step_times.append(metrics["step_time"])

    @contextlib.contextmanager
    def timed(self, name, step):
        self.enter(name, step)
        finished = False
        try:
            yield
            finished = True
        finally:
            self.leave(finished)

    def enter(self, name, step):
        if self.stack:  # the enclosing phase's peak so far, before the reset
            self.stack[-1].peak = max(self.stack[-1].peak, self.meter.peak())
        self.meter.reset()
        self.stack.append(Frame(name, step, time.perf_counter()))

    def leave(self, finished):
        frame, peak = self.stack.pop(), self.meter.peak()  # peak() synchronizes CUDA first
        elapsed = time.perf_counter() - frame.start
        self.events.append(
            dict(
                phase=frame.name,
                step=frame.step,
                seconds=elapsed - frame.inner,
                peak_bytes=max(frame.peak, peak),
                finished=finished,
            )
        )
        if self.stack:  # the enclosing phase goes on: measure its own peak from here
            self.stack[-1].inner += elapsed
            self.meter.reset()

    def finished(self, name):
        """The steps at which a call of phase `name` returned (did not raise)."""
        return [e["step"] for e in self.events if e["phase"] == name and e["finished"]]

    def summary(self, steps):
        """{phase: {seconds, calls, per_step [steps + 1] (index 0: before training),
        peak_bytes}}."""
        out = {}
        for name in PHASES.values():
            events = [e for e in self.events if e["phase"] == name]
            per_step = [
                sum(e["seconds"] for e in events if e["step"] == s) for s in range(steps + 1)
            ]
            out[name] = dict(
                seconds=sum(e["seconds"] for e in events),
                calls=len(events),
                per_step=per_step,
                peak_bytes=max((e["peak_bytes"] for e in events), default=None),
            )
        return out


# --------------------------------------------------------------------------------------------------
# The run: trainer.py's loop on a random-weight model.


def build_model(config_name, tokenizer, device):
    """bench.CONFIGS[config_name] with random fp32 weights, built on the device (nothing to move),
    with at least the tokenizer's vocabulary and the tokenizer's EOS, pad and BOS ids, as SmolLM2's
    own configs have them."""
    shape = dict(bench.CONFIGS[config_name])
    vocab = max(shape.pop("vocab_size"), len(tokenizer))
    with torch.device(device):
        model = demo.tiny_llama(vocab, 0, **shape)
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        cfg.bos_token_id = tokenizer.bos_token_id
    return model


def run_training(args, config_name, tokenizer, timer):
    """trainer.py's run, as trainer.main makes it, on the random-weight model: the task as the flags
    make it (trainer.load_task), the model built here (checked against the context as trainer.setup
    checks a loaded one), then trainer.train with `timer` as its phase hook. Returns (model or None,
    task or None, what happened)."""
    task = model = error = None
    evals, t0 = [], time.perf_counter()
    try:
        transformers.set_seed(args.seed)
        task = trainer.load_task(args)
        model = build_model(config_name, tokenizer, args.device)
        models.check_context(args.max_new_tokens, args.max_prompt_length, model.config, config_name)
        evals = trainer.train(args, task, model, tokenizer, phases=timer)
    # the report says what failed (CUDA out of memory, ...); the traceback goes to stderr
    except Exception as e:
        traceback.print_exc()
        error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    wanted = [] if task is None else evaluations_due(args, task)
    done = timer.finished("evaluation")
    return (
        model,
        task,
        dict(
            ok=error is None and timer.logged == args.steps and done == wanted,
            error=error,
            steps_done=timer.logged,
            steps_wanted=args.steps,
            evaluations=done,
            evaluations_wanted=wanted,
            eval_results=dict(evals),
            step_times=timer.step_times,
            seconds=time.perf_counter() - t0,
            mismatch=logged_mismatch(args.output_dir),
        ),
    )


MISMATCH = ("mismatch_kl", "mismatch_max_ratio", "truncation_gap")


def logged_mismatch(output_dir):
    """Each step's sampler-trainer mismatch from the run's metrics.jsonl (trainer.py logs it with
    --log-mismatch or --sampler-correction): {name: [per step]}, {} without it."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    rows = [r for r in rows if MISMATCH[0] in r]
    return {name: [r[name] for r in rows] for name in MISMATCH} if rows else {}


def evaluations_due(args, task):
    """The steps after which trainer.py evaluates (0: before training), by trainer.eval_due."""
    settings = trainer.Settings.of(args)
    return [s for s in range(args.steps + 1) if trainer.eval_due(settings, task, s)]


def train_flags(kit, device, output_dir):
    """trainer.py's flags for the check: its defaults, but 3 steps, 16 eval questions and the kit's
    GSM8K rows."""
    return [
        "--model",
        "SmolLM2-1.7B-Instruct",
        "--data",
        os.path.join(kit, "gsm8k", "train.jsonl"),
        "--steps",
        "3",
        "--eval-limit",
        "16",
        "--output-dir",
        output_dir,
        "--device",
        device,
    ]


# --------------------------------------------------------------------------------------------------
# Decode against its floor.


def measure(fn, meter):
    """(seconds, result, peak memory) of fn()."""
    meter.reset()
    t0 = time.perf_counter()
    out = fn()
    meter.sync()
    return time.perf_counter() - t0, out, meter.peak()


def decode_check(model, tokenizer, task, args, opts, meter):
    """ms per new token of decode.generate at opts.rows rows (rows / G prompts of the kit, built as
    the loop builds them), EOS never drawn: eager, CUDA graphs (on CUDA), fused (fused_check) and
    compiled (sampling.compile_model + plan_decode), each a warm-up call, then a timed one, whose
    seconds over max_new are the ms per token (its one prefill included). generate runs under the
    run's autocast (amp), as sample_rollouts runs it."""
    G, max_new = args.num_generations, opts.max_new_tokens or args.max_new_tokens
    if opts.rows % G or opts.rows // G > len(task.train):
        raise config.UserError(
            f"--rows {opts.rows} must be a multiple of G = {G}, at most {G * len(task.train)}"
        )
    prompts = [task.prompt(tokenizer, row["prompt"]) for row in task.train[: opts.rows // G]]
    # [rows / G, P]
    ids, mask = sampling.tokenize_prompts(tokenizer, prompts, torch.device(args.device))
    settings = dataclasses.replace(sampling.Sampling.of(args), max_new_tokens=max_new)
    # an EOS after max_new tokens: never
    lengths = torch.full((opts.rows,), max_new + 1, device=ids.device)
    eos, amp = sampling.eos_token_ids(model, tokenizer), trainer.Settings.of(args).autocast_dtype

    def generate(mode="eager"):  # as sample_rollouts runs it: under the run's autocast
        with (
            sampling.autocast(ids.device, amp),
            bench.forced_lengths_in_decode(model, lengths, eos),
        ):
            how = decode_mode(settings, mode)
            return decode.generate(model, ids, mask, how, G, eos, tokenizer.pad_token_id)

    result = dict(
        rows=opts.rows,
        prompts=len(prompts),
        prompt_tokens=ids.shape[1],
        new_tokens=max_new,
        cache_length=ids.shape[1] + max_new,
    )
    decode.COMPILED.pop(id(model), None)  # eager first, also after a run with --compile
    model.zero_grad(set_to_none=True)  # the last update's gradients: not needed to decode
    measure(generate, meter)
    seconds, out, result["eager_peak_bytes"] = measure(generate, meter)
    assert out.shape == (opts.rows, max_new), (
        f"decode wrote {tuple(out.shape)}, not {opts.rows} x {max_new}"
    )
    result["eager_ms_per_token"] = 1000 * seconds / max_new
    greedy = dataclasses.replace(settings, temperature=0.0)
    if ids.is_cuda:  # --decode graphs: captured at every call
        first, out, _ = measure(lambda: generate("graphs"), meter)
        seconds, again, result["graphs_peak_bytes"] = measure(lambda: generate("graphs"), meter)
        result["graphs_first_call_seconds"] = first
        result["graphs_ms_per_token"] = 1000 * seconds / max_new
        result["graphs_capture_seconds"] = capture_seconds(model, ids, mask, settings, G, eos, amp)
        result["graphs_greedy"] = greedy_agreement(model, ids, mask, greedy, G, eos, tokenizer, amp)
    if not opts.skip_fused:  # --decode fused: compiled once per process, captured on CUDA
        how = (settings, G, eos, tokenizer, amp, opts, meter, generate)
        result.update(fused_check(model, ids, mask, *how))
    if not opts.skip_compile:
        sampling.compile_model(model, opts.compile_backend)
        decode.plan_decode(model, rows=[opts.rows], length=result["cache_length"])
        result["compile_seconds"] = measure(generate, meter)[0]  # the warm-up call compiles
        seconds, _, result["compiled_peak_bytes"] = measure(generate, meter)
        result["compiled_ms_per_token"], result["compile_backend"] = (
            1000 * seconds / max_new,
            opts.compile_backend,
        )
    return result


def decode_mode(settings, mode):
    """settings for one decode mode: "eager", "graphs" or "fused" (--decode's), whatever the run's
    flags chose."""
    return dataclasses.replace(settings, graphs=mode == "graphs", fused=mode == "fused")


def fused_check(model, ids, mask, settings, G, eos, tokenizer, amp, opts, meter, generate):
    """--decode fused, measured as graphs is: ms per token of a warm call, its compile seconds (the
    process's first fused call, which compiles the shared decoder layer, less the next: one compile
    per process, the prompt length and the rows being dynamic), on CUDA its capture seconds per
    call, and its greedy agreement with eager. The backend: --compile-backend's (inductor on CUDA;
    aot_eager on the CPU, where this is the smoke test of the check itself). A failure is reported
    beside the other modes' numbers (fused_error), not instead of them."""
    out = {"fused_backend": opts.compile_backend}
    saved, decode.FUSED_BACKEND = decode.FUSED_BACKEND, opts.compile_backend
    try:
        if decode.FusedStep.failed is not None:  # the run's decode fell back: nothing fused to time
            raise RuntimeError(f"the fused decode fell back to graphs: {decode.FusedStep.failed}")
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        first = measure(lambda: generate("fused"), meter)[0]  # compiles the shared layer
        compiled_here = torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
        seconds, tokens, out["fused_peak_bytes"] = measure(lambda: generate("fused"), meter)
        # (bench's forced lengths hook the model's forward, which fused runs for the prefill only:
        # its rows may draw EOS, but they all stay in the batch, so the timing is the same)
        rows, new = ids.shape[0] * G, settings.max_new_tokens
        assert tokens.shape == (rows, new), f"fused wrote {tuple(tokens.shape)}, not {rows} x {new}"
        out["fused_first_call_seconds"] = first
        # None: the run decoded fused first (CUDA's default), and that call compiled the layer
        out["fused_compile_seconds"] = first - seconds if compiled_here else None
        out["fused_ms_per_token"] = 1000 * seconds / settings.max_new_tokens
        if ids.is_cuda:
            out["fused_capture_seconds"] = capture_seconds(
                model, ids, mask, settings, G, eos, amp, "fused"
            )
        greedy = dataclasses.replace(settings, temperature=0.0)
        out["fused_greedy"] = greedy_agreement(
            model, ids, mask, greedy, G, eos, tokenizer, amp, "fused"
        )
    except Exception as e:  # noqa: BLE001 (said, and the other modes' numbers kept)
        traceback.print_exc()
        out["fused_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    finally:
        decode.FUSED_BACKEND = saved
    return out


def capture_seconds(model, ids, mask, settings, G, eos, amp, mode="graphs"):
    """Seconds a decode call spends capturing its graph: a 2-token call with graphs (prefill, the
    first step run outside the graph, the capture, one replay) less the same call eager (prefill,
    two steps). mode "fused": its compiled step captured (compiled already, by an earlier call)."""
    short = dataclasses.replace(settings, max_new_tokens=3)
    pad = eos[0]
    times = {}
    for captured in ("eager", mode, "eager", mode):
        how = decode_mode(short, captured)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with sampling.autocast(ids.device, amp):
            decode.generate(model, ids, mask, how, G, [-1], pad)
        torch.cuda.synchronize()
        times[captured] = time.perf_counter() - t0  # the second of each: warm
    return times[mode] - times["eager"]


def greedy_agreement(model, ids, mask, greedy, G, eos, tokenizer, amp, mode="graphs"):
    """The CUDA-graph (or fused) decode against the eager one, greedy (temperature 0), EOS never
    drawn: how many leading tokens every row shares, of how many, and the largest logit difference
    of the first steps, read by a forward hook on the lm-head of the twin and the eager model
    alike (fused runs the layers itself, not the model's forward)."""
    seen = {}

    def run(mode):
        logits = []

        def hook(module, args, output):
            if len(logits) < 16:
                logits.append(output[:, -1].float().clone())

        handle = model.get_output_embeddings().register_forward_hook(hook)
        try:
            how = decode_mode(greedy, mode)
            with sampling.autocast(ids.device, amp):
                out = decode.generate(model, ids, mask, how, G, [-1], tokenizer.pad_token_id)
        finally:
            handle.remove()
        return out, logits

    (eager, eager_logits), (graphs, graph_logits) = run("eager"), run(mode)
    same = (eager == graphs).all(0)
    agree = int(same.long().cumprod(0).sum())
    # the graph replays no Python: its hook saw the warm-up step and the capture only
    n = min(len(eager_logits), len(graph_logits), 2)
    diff = max(float((a - b).abs().max()) for a, b in zip(eager_logits[:n], graph_logits[:n]))
    seen.update(tokens_equal=agree, of=int(eager.shape[1]), max_logit_diff_first_steps=diff)
    return seen


def copy_bandwidth(device, nbytes, repeats=5):
    """Bytes per second of a device-to-device copy of nbytes (read + written), the best of
    `repeats`."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the buffers back: the run's reserved peak must not count them
    return 2 * nbytes / best


def decode_floor(model, timing, amp, bandwidth):
    """The bytes one decode step must read, in the compute dtype: every nn.Linear weight once (a
    tied lm-head counts once, as a Linear) and the whole static KV cache (its masked columns too);
    over the bandwidth, ms per token."""
    size = torch.empty((), dtype=amp or torch.float32).element_size()
    linear = {
        id(p): p.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
        for p in m.parameters()
    }
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    weights = size * sum(linear.values())
    kv = (
        size
        * timing["rows"]
        * timing["cache_length"]
        * c.num_hidden_layers
        * 2
        * c.num_key_value_heads
        * head_dim
    )
    floor = 1000 * (weights + kv) / bandwidth
    ratios = {
        f"{k}_over_floor": timing[f"{k}_ms_per_token"] / floor
        for k in ("eager", "graphs", "fused", "compiled")
        if f"{k}_ms_per_token" in timing
    }
    return dict(
        weight_bytes=weights,
        kv_bytes=kv,
        bandwidth_bytes_per_s=bandwidth,
        floor_ms_per_token=floor,
        dominant="weights" if weights >= kv else "KV cache",
        **ratios,
    )


# --------------------------------------------------------------------------------------------------
# The report.


def machine(device):
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"
    )
    return dict(
        device=name,
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        date=time.strftime("%Y-%m-%d %H:%M %Z"),
    )


def memory_verdict(meter):
    """Whether the run's peak fits each card: CUDA's reserved peak (what the allocator took from the
    card) plus the context. None on CPU, where the peak is resident host memory."""
    peak = dict(
        kind="torch.cuda.max_memory_allocated" if meter.cuda else "resident memory (VmHWM)",
        peak_bytes=meter.overall,
        reserved_peak_bytes=meter.overall_reserved if meter.cuda else None,
    )
    for card, total in CARDS.items():
        peak[f"fits_{card.replace(' ', '')}"] = (
            (meter.overall_reserved + CUDA_CONTEXT <= total) if meter.cuda else None
        )
    return peak


# gpu_check's phases -> bench.memory_phases' names for them.
MODEL_PHASES = {
    "generate": "generate",
    "reference": "reference log-probs",
    "forward_backward": "policy forward + backward",
    "optimizer": "optimizer",
    "evaluation": "evaluation",
}


def predicted_phases(args, config_name, tokenizer, task):
    """{phase: bytes}: bench.memory_phases' arithmetic for this run's flags (the longest prompt of
    the run as every prompt's length), to hold against the measured peaks. None when the run failed
    before its task was built."""
    if task is None:
        return None
    shape = argparse.Namespace(
        config=config_name,
        dtype=args.dtype,
        batch_size=args.batch_size,
        accumulation=args.gradient_accumulation_steps,
        num_generations=args.num_generations,
        prompt_len=memory.longest_prompt(task, tokenizer, None),
        max_new_tokens=args.max_new_tokens,
        beta=args.beta,
        gradient_checkpointing=args.gradient_checkpointing,
        eval_batch_size=args.eval_batch_size,
        eval_samples=args.eval_samples,
        compile=args.compile,
    )
    return {
        ours: sum(b for _, b in bench.memory_phases(shape)[theirs])
        for ours, theirs in MODEL_PHASES.items()
    }


def gib(b):
    return "-" if b is None else f"{b / GIB:.2f} GiB"


def print_run(report):
    run, phases = report["run"], report["phases"]
    status = "OK" if run["ok"] else f"FAILED ({run['error'] or 'steps or evaluations missing'})"
    print(
        f"run: {status}; {run['steps_done']} of {run['steps_wanted']} steps, evaluations at steps "
        f"{run['evaluations']} of {run['evaluations_wanted']}, {run['seconds']:.1f} s in all"
    )
    steps = range(len(next(iter(phases.values()))["per_step"]))
    print(
        f"  {'phase':<17}{'seconds':>9}{'peak':>11}   per step: "
        + "".join(f"{s:>8}" for s in steps)
    )
    for name, p in phases.items():
        print(
            f"  {name:<17}{p['seconds']:>9.2f}{gib(p['peak_bytes']):>11}              "
            + "".join(f"{s:>8.2f}" for s in p["per_step"])
        )
    print(
        f"  {'step (the loop)':<37}              {'':>8}"
        + "".join(f"{s:>8.2f}" for s in run["step_times"])
    )
    print("  (step 0: before training; evaluation and checkpoint count at the step they follow)")
    for name, values in run.get("mismatch", {}).items():  # with -- --log-mismatch
        print(f"  {name:<17}per step: " + " ".join(f"{v:.3g}" for v in values))
    mem = report["memory"]
    # scripts/bench.py --memory's arithmetic against the measured peaks, above the baseline
    if mem.get("model"):
        print(
            f"  memory above the {gib(mem['baseline_bytes'])} in use before the model, against scripts.bench --memory:"
        )
        for name, predicted in mem["model"].items():
            measured = phases[name]["peak_bytes"]
            if measured is not None:
                measured -= mem["baseline_bytes"]
                print(
                    f"    {name:<17} measured {gib(measured):>10}, computed {gib(predicted):>10} "
                    f"({measured / predicted - 1:+.0%})"
                )
    fits = ", ".join(
        f"{card}: {'yes' if mem['fits_' + card.replace(' ', '')] else 'NO'}" for card in CARDS
    )
    print(
        f"  peak {gib(mem['peak_bytes'])} ({mem['kind']})"
        + (
            f", reserved {gib(mem['reserved_peak_bytes'])}; with ~{gib(CUDA_CONTEXT)} of CUDA context it fits {fits}"
            if mem["reserved_peak_bytes"] is not None
            else "; the 40/80 GB verdict needs a GPU run"
        )
    )


def gb(b):
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"


def print_decode(report):
    d, f = report["decode"], report.get("floor")
    if d.get("skipped"):
        print("decode: skipped (--skip-decode)")
        return
    if "error" in d:
        print(f"decode: FAILED ({d['error']})")
        return
    print(
        f"decode: {d['rows']} rows ({d['prompts']} prompts x G), {d['prompt_tokens']} prompt + {d['new_tokens']} "
        f"new tokens, EOS never drawn, {report['dtype']}"
    )
    print(
        f"  eager     {d['eager_ms_per_token']:8.2f} ms/token  {f['eager_over_floor']:6.1f}x the floor"
    )
    if "graphs_ms_per_token" in d:
        g = d["graphs_greedy"]
        print(
            f"  graphs    {d['graphs_ms_per_token']:8.2f} ms/token  {f['graphs_over_floor']:6.1f}x the floor "
            f"(capture {d['graphs_capture_seconds']:.2f} s per call; first call {d['graphs_first_call_seconds']:.2f} s; "
            f"greedy: {g['tokens_equal']} of {g['of']} tokens equal to eager's, logits within "
            f"{g['max_logit_diff_first_steps']:.3g})"
        )
    if "fused_error" in d:
        print(f"  fused     FAILED ({d['fused_error']})")
    elif "fused_ms_per_token" in d:
        g = d["fused_greedy"]
        compiled = (
            f"compiled in {d['fused_compile_seconds']:.1f} s once per process"
            if d["fused_compile_seconds"] is not None
            else "compiled once per process, by the run's first decode"
        )
        capture = (
            f"capture {d['fused_capture_seconds']:.2f} s per call"
            if "fused_capture_seconds" in d
            else "not captured on the CPU"
        )
        print(
            f"  fused     {d['fused_ms_per_token']:8.2f} ms/token  {f['fused_over_floor']:6.1f}x the floor "
            f"({d['fused_backend']}, {compiled}; {capture}; "
            f"first call {d['fused_first_call_seconds']:.2f} s; greedy: {g['tokens_equal']} of {g['of']} tokens "
            f"equal to eager's, logits within {g['max_logit_diff_first_steps']:.3g})"
        )
    if "compiled_ms_per_token" in d:
        print(
            f"  compiled  {d['compiled_ms_per_token']:8.2f} ms/token  {f['compiled_over_floor']:6.1f}x the floor "
            f"({d['compile_backend']}, compiled in {d['compile_seconds']:.1f} s)"
        )
    weights, kv = f["weight_bytes"], f["kv_bytes"]
    print(
        f"  floor     {f['floor_ms_per_token']:8.2f} ms/token = {gb(weights + kv)} per token / "
        f"{f['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s (measured copy bandwidth)"
    )
    print(
        f"  bytes per token: Linear weights {gb(weights)} ({weights / (weights + kv):.0%}), KV cache {gb(kv)} "
        f"({kv / (weights + kv):.0%}): the larger part is the {f['dominant']}"
    )
    if report["dtype"] != "fp32":
        print(
            "  (eager, autocast casts each fp32 weight once per decode call and keeps the copy; the compiled "
            "decode reads its twin, refreshed once per call)"
        )


def print_report(report):
    m = report["machine"]
    print(
        f"\n===== gpu_check, {m['date']}: {m['device']} | torch {m['torch']} | transformers "
        f"{m['transformers']} | Python {m['python']}"
    )
    print(f"command: {report['command']}")
    print(
        f"model: {report['config']}, random weights, {report['parameters']:,} parameters, vocab "
        f"{report['vocab_size']} | {report['device']}, {report['dtype']}"
    )
    print(f"trainer.py {shlex.join(report['train_flags'])}")
    print(
        f"decode: {report['decode_mode']}; gradient checkpointing: {report['gradient_checkpointing']}"
        + (f"; capped at a {report['card_gb']} GB card" if report.get("card_gb") else "")
    )
    print_run(report)
    gen = report["phases"]["generate"]["per_step"][1:]
    new = report["new_tokens"]
    print(
        "  training decode ms/token (generate's seconds / new tokens, prefill included): "
        + " ".join(f"{1000 * s / new:.2f}" for s in gen)
    )
    print_decode(report)
    print(f"===== {'OK' if report['ok'] else 'FAILED'}")


# --------------------------------------------------------------------------------------------------
# The command line.


def parse(argv):
    """(this script's options, trainer.py's flags: whatever follows --)."""
    own, rest = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Flags after -- go to trainer.py.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--prepare",
        metavar="SMOLLM2_DIR",
        help="write the kit from a SmolLM2 model directory, then exit",
    )
    p.add_argument(
        "--gsm8k",
        default=os.environ.get(bench.GSM8K_ENV),
        help="with --prepare: the directory holding GSM8K's train.jsonl and test.jsonl "
        f"(default: ${bench.GSM8K_ENV}; unset: downloaded)",
    )
    p.add_argument("--kit", default=os.path.join(bench.ROOT, "gpu_kit"), help="the kit's directory")
    p.add_argument(
        "--config", default="smollm2-1.7b", choices=list(bench.CONFIGS), help="the model's shape"
    )
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="as trainer.py's --device"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="decode timing: new tokens per row; if not given, the run's --max-new-tokens (300)",
    )
    p.add_argument(
        "--rows", type=int, default=32, help="decode timing: rows per call (a multiple of G)"
    )
    p.add_argument(
        "--compile-backend",
        default=None,
        help="decode timing: torch.compile backend; if not given, inductor on CUDA, aot_eager on CPU",
    )
    p.add_argument("--skip-compile", action="store_true", help="decode timing: no --compile")
    p.add_argument("--skip-fused", action="store_true", help="decode timing: no --decode fused")
    p.add_argument("--skip-decode", action="store_true", help="no decode timing: the run alone")
    p.add_argument(
        "--card-gb",
        type=int,
        choices=[40, 80],
        help="CUDA: cap this process at a 40 or 80 GB card's memory "
        "(torch.cuda.set_per_process_memory_fraction) before the run",
    )
    p.add_argument("--out", help="also write the report as JSON to this file")
    return p.parse_args(own), rest


def check(opts, train_argv, command):
    """The run, then the decode timing: the report as a dict."""
    tokenizer = load_kit_tokenizer(opts.kit)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        flags = train_flags(os.path.abspath(opts.kit), opts.device, tmp) + train_argv
        args = config.parse_args(flags)
        device = torch.device(args.device)
        opts.compile_backend = opts.compile_backend or (
            "inductor" if device.type == "cuda" else "aot_eager"
        )
        if opts.card_gb and device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            card = CARDS[f"{opts.card_gb} GB"]
            torch.cuda.set_per_process_memory_fraction(min(1.0, card / total), device.index or 0)
        bandwidth = copy_bandwidth(device, 2 * GIB if device.type == "cuda" else 128 * 2**20)
        meter = Meter(device)
        baseline = meter.in_use()  # before the model: what the phases' peaks are measured above
        timer = PhaseTimer(meter)
        model, task, run = run_training(args, opts.config, tokenizer, timer)
        meter.reset()  # the overall peak is the run's (setup included), before the decode timing
    gc.collect()  # the run's optimizer, reference model and checkpoints are gone: free their memory for decode
    if device.type == "cuda":
        torch.cuda.empty_cache()
    report = dict(
        machine=machine(device),
        command=command,
        config=opts.config,
        device=args.device,
        dtype=args.dtype,
        train_flags=flags,
        new_tokens=args.max_new_tokens,
        run=run,
        card_gb=opts.card_gb,
        decode_mode=args.decode,
        gradient_checkpointing=args.gradient_checkpointing,
        phases=timer.summary(args.steps),
        memory=memory_verdict(meter),
    )
    report["memory"].update(
        baseline_bytes=baseline, model=predicted_phases(args, opts.config, tokenizer, task)
    )
    report.update(decode_report(model, tokenizer, task, args, opts, meter, bandwidth))
    report["ok"] = run["ok"] and not {"error", "fused_error"} & set(report["decode"])
    return report


def decode_report(model, tokenizer, task, args, opts, meter, bandwidth):
    """{decode, floor, parameters, vocab_size}; decode holds only an error when it failed (or the
    model never got built)."""
    if model is None:
        return dict(
            decode=dict(error="no model: the run failed before building it"),
            parameters=0,
            vocab_size=0,
        )
    out = dict(
        parameters=sum(p.numel() for p in model.parameters()), vocab_size=model.config.vocab_size
    )
    if opts.skip_decode:
        return dict(out, decode=dict(skipped=True))
    try:
        out["decode"] = decode_check(model, tokenizer, task, args, opts, meter)
        out["floor"] = decode_floor(
            model, out["decode"], trainer.Settings.of(args).autocast_dtype, bandwidth
        )
    except Exception as e:
        traceback.print_exc()
        out["decode"] = dict(error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    opts, train_argv = parse(argv)
    try:
        if opts.prepare:
            prepare_kit(opts.prepare, opts.gsm8k, opts.kit)
            return 0
        report = check(opts, train_argv, "python -m scripts.gpu_check " + shlex.join(argv))
    except config.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_report(report)
    if opts.out:
        os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
        with open(opts.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {opts.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""support/memory.py: the run's memory plan, decided before step 1 (issue: the defaults on a 40 GB
card). The SmolLM2-1.7B architecture on the meta device (shapes, no memory), the flags as
config.parse_args makes them, and card sizes of 24, 40 and 80 GB given to the plan: no GPU, no mock.

    python -m pytest -q tests/test_memory.py
"""

import argparse

import pytest

import config
from scripts import bench
from support import memory
from support.errors import UserError

GIB = 2**30
# What nvidia-smi reports as an A100 40GB's and an H100 80GB's total memory (scripts/gpu_check.py)
CARDS = {24: 24 * 10**9, 40: 40536 * 2**20, 80: 81559 * 2**20}
PROMPT = 260  # GSM8K's 95th-percentile prompt with SmolLM2's template (docs/gpu.md)


@pytest.fixture(scope="module")
def model():
    return bench.build_model_meta("smollm2-1.7b")


def flags(*extra):
    """The flags of a run; --gradient-checkpointing unset (None) unless given, as on CUDA (the
    CPU's config.parse_args turns an unset one off)."""
    args = config.parse_args(
        ["--model", "SmolLM2-1.7B-Instruct", "--device", "cpu", "--dtype", "bf16", *extra]
    )
    given = {"--gradient-checkpointing", "--no-gradient-checkpointing"} & set(extra)
    args.gradient_checkpointing = args.gradient_checkpointing if given else None
    return args


def test_the_plan_is_scripts_bench_memory_arithmetic_for_the_model_in_hand(model):
    # memory.phases generalises bench.memory_phases (held within -8% and +3% of the H100's measured
    # peaks) from a named config to the model and flags of the run: on the headline run's shape
    # they agree to the byte, with checkpointing and without.
    for checkpointing in (False, True):
        args = flags(*(["--gradient-checkpointing"] if checkpointing else []))
        mine = memory.phases(model, args, PROMPT, checkpointing)
        shape = argparse.Namespace(
            config="smollm2-1.7b", dtype="bf16", batch_size=1, accumulation=4,
            num_generations=8, prompt_len=PROMPT, max_new_tokens=300, beta=0.04,
            gradient_checkpointing=checkpointing, eval_batch_size=args.eval_batch_size,
            eval_samples=8, compile=None,
        )  # fmt: skip
        theirs = {k: sum(b for _, b in v) for k, v in bench.memory_phases(shape).items()}
        names = dict(zip(mine, theirs))  # the same five phases, in the same order
        # bench measures its activation bytes on 1- and 2-layer models; the plan scales the
        # measured 135.3 kB per token and layer by the width: within 0.5% of the phase
        for ours, its in names.items():
            assert mine[ours] == pytest.approx(theirs[its], rel=0.005), ours


def test_on_80_gb_the_defaults_keep_full_activations_on_40_checkpointing_and_24_gb_fits_nothing(
    model, capsys
):
    args = flags()
    assert args.gradient_checkpointing is None  # not given: the plan decides (on CUDA)
    at = {gb: memory.plan(model, args, PROMPT, card) for gb, card in CARDS.items()}
    assert at[80].fits and not at[80].checkpointing
    assert at[80].peak / 1e9 == pytest.approx(49.6, abs=0.1)  # the policy's forward + backward
    assert at[40].fits and at[40].checkpointing
    assert at[40].peak / 1e9 == pytest.approx(36.5, abs=0.1)
    # measured on the H100 capped at a 40 GB card (2026-11-27, the kit's prompts, of about this
    # length): 34.29 GiB allocated at the peak (the plan: -0.8%), 36.78 GiB reserved; the plan's
    # budget holds the reserved bytes and the CUDA context
    assert at[40].peak / (34.29 * GIB) == pytest.approx(1, abs=0.03)
    assert 36.78 / 34.29 < memory.RESERVED_OVER_ALLOCATED  # the allocator's measured slack
    assert 36.78 * GIB + memory.CONTEXT_BYTES < CARDS[40]
    assert not at[24].fits
    # the choice through checkpointing(), as train.py and trainer.py call it: one line said
    assert memory.checkpointing(args, args, model, task_of(PROMPT), None, card=CARDS[40]) is True
    assert args.gradient_checkpointing is True
    line = capsys.readouterr().err.strip()
    assert (
        line.startswith("memory: the plan peaks at 36.") and "with gradient checkpointing" in line
    )
    assert "\n" not in line
    with pytest.raises(UserError) as stop:
        memory.checkpointing(flags(), flags(), model, task_of(PROMPT), None, card=CARDS[24])
    said = str(stop.value)
    assert "this card offers 21.4 GB" in said and "\n" not in said
    # what would fit, each computed: LoRA's adapters leave no full gradients, moments or π_ref
    assert "--lora-rank 16" in said and "--micro-batch-size" not in said


def test_flags_the_user_gives_win_over_the_plan(model, capsys):
    on = flags("--gradient-checkpointing")
    assert memory.checkpointing(on, on, model, task_of(PROMPT), None, card=CARDS[80]) is True
    off = flags("--no-gradient-checkpointing")
    # over a 40 GB card's budget, but asked for: a warning line, and the run goes on as asked
    assert memory.checkpointing(off, off, model, task_of(PROMPT), None, card=CARDS[40]) is False
    assert "running as asked (--no-gradient-checkpointing)" in capsys.readouterr().err
    lora = flags("--lora-rank", "16")
    p = memory.plan(model, lora, PROMPT, CARDS[24])
    assert p.fits and p.checkpointing  # the adapters' plan fits a 24 GB card, checkpointed


def test_on_the_cpu_the_flag_alone_decides_and_nothing_is_planned(model):
    args = config.parse_args(["--model", "SmolLM2-1.7B-Instruct", "--device", "cpu"])
    assert args.gradient_checkpointing is False  # config.parse_args: off on the CPU
    assert memory.checkpointing(args, args, model, None, None) is False  # no task read, no plan


def test_a_resumed_run_may_change_the_checkpointing_and_the_decode():
    from support import checkpoint

    assert {"gradient_checkpointing", "decode"} <= checkpoint.MAY_CHANGE_ON_RESUME


class task_of:
    """A task whose longest prompt is n tokens to memory.longest_prompt, with a tokenizer stand-in
    that counts characters."""

    def __init__(self, n):
        self.train, self.eval = [{"prompt": "x" * n}], []

    def prompt(self, tokenizer, text):
        return text


def _lengths(texts, add_special_tokens=False, return_length=True):
    return {"length": [len(t) for t in texts]}


memory_longest = memory.longest_prompt


@pytest.fixture(autouse=True)
def _characters_as_tokens(monkeypatch):
    monkeypatch.setattr(
        memory,
        "longest_prompt",
        lambda task, tokenizer, limit: memory_longest(task, _lengths, limit),
    )


def test_the_plan_counts_no_evaluation_when_there_is_none_and_a_lora_models_own_adapters(model):
    none = memory.phases(model, flags("--eval-every", "-1"), PROMPT, True)
    assert none["evaluation"] == 0 and none["policy"] > 0
    peft = pytest.importorskip("peft")
    from support import demo

    small = demo.tiny_llama(97, 0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    lora = peft.get_peft_model(small, config).get_base_model()
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    args = flags("--lora-rank", "4")
    args.beta = 0.0
    got = memory.phases(lora, args, 8, False)
    n = sum(p.numel() for p in lora.parameters())
    # the optimizer phase: fp32 weights, AdamW's two moments and the gradients of the adapters
    assert got["optimizer"] == 4 * n + 8 * adapters + 4 * adapters

"""The offline demo, and the tiny models built in code that the demo, the tests and scripts/bench.py
share.

    python trainer.py --demo  # a 2-layer Llama learns 1-digit addition from the reward alone (CPU)

The task: "3 + 4 =" -> "<answer> 7 </answer>", all 100 problems, scored by
rewards.correctness_reward (the function the GSM8K run uses; data.demo_task). The demo trains and
measures on the
same 100 problems: it shows the reward rising, not generalization. A short supervised warm-up first
brings the model to about --demo-target-accuracy, so GRPO starts from a weak but non-zero skill, as
it does from a pretrained model; everything above that is GRPO's.
"""

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from support.models import prepare_tokenizer

WORDS = ["<pad>", "<eos>", "<unk>", "+", "=", "<answer>", "</answer>"] + [str(n) for n in range(19)]
PAD, EOS = 0, 1  # the ids of "<pad>" and "<eos>" in every tokenizer built here


def tiny_llama(
    vocab_size,
    seed=0,
    *,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    tie_word_embeddings=True,
    **config,
):
    """A randomly initialized fp32 Llama, the same weights for the same seed and shape; pad id 0,
    EOS id 1."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            tie_word_embeddings=tie_word_embeddings,
            pad_token_id=PAD,
            eos_token_id=EOS,
            bos_token_id=None,
            **{"max_position_embeddings": 8192, **config},
        )
    )
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = EOS, PAD
    return model.float()


def word_tokenizer(words, unk_token="<unk>"):
    """A whitespace-split word-level tokenizer over `words` (ids in list order; words[0] pads,
    words[1] ends), left-padded: a text of n known words is exactly n tokens."""
    word_level = Tokenizer(
        models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=unk_token)
    )
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, pad_token=words[PAD], eos_token=words[EOS], unk_token=unk_token
    )
    return prepare_tokenizer(tokenizer)


def model_and_tokenizer(seed):
    """The demo's policy before its warm-up: a 2-layer Llama of hidden size 64 over the demo's 26
    words."""
    return tiny_llama(len(WORDS), seed, max_position_embeddings=512), word_tokenizer(WORDS)


def setup(seed, warmup_steps, target_accuracy):
    """The demo's model (warmed up), tokenizer and problems (data.demo_task makes them a task). One
    thread: a model this small gains
    nothing from intra-op parallelism, and spinning OpenMP threads slow it down many times over
    on a shared machine."""
    torch.set_num_threads(1)
    model, tokenizer = model_and_tokenizer(seed)
    problems = [
        {"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(10) for b in range(10)
    ]
    steps = warmup(model, tokenizer, problems, seed, warmup_steps, target_accuracy)
    print(
        f"demo: a {sum(p.numel() for p in model.parameters()):,}-parameter Llama; supervised warm-up stopped after "
        f"{steps} steps at p(right answer) = {accuracy(model, tokenizer, problems):.3f}",
        flush=True,
    )
    return model, tokenizer, problems


def examples(tokenizer, problems):
    """Token ids [100, 7] of the right completions "a + b = <answer> a+b </answer> <eos>" (3
    prompt + 4 completion tokens, no padding) and labels with the prompt masked out (-100)."""
    texts = [f"{p['prompt']} <answer> {p['answer']} </answer> <eos>" for p in problems]
    ids = tokenizer(texts, return_tensors="pt", add_special_tokens=False)["input_ids"]
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


def warmup(model, tokenizer, problems, seed, max_steps, target_accuracy, batch_size=64, lr=3e-3):
    """Supervised steps on the right completions until the model would answer right
    target_accuracy of the time (checked every 5 steps; at most max_steps). Returns the number of
    steps taken."""
    ids, labels = examples(tokenizer, problems)
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(max_steps):
        if step % 5 == 0 and accuracy(model, tokenizer, problems) >= target_accuracy:
            return step
        model.train()
        idx = torch.randint(len(problems), (batch_size,), generator=gen)
        loss = model(input_ids=ids[idx], labels=labels[idx]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return max_steps


@torch.no_grad()
def accuracy(model, tokenizer, problems):
    """The exact expected correctness of sampling at T=1 (no top-k/top-p): the mean over problems
    of the probability of writing the right completion, teacher-forced in one forward pass."""
    ids, _ = examples(tokenizer, problems)
    was_training = model.training
    model.eval()
    # positions 2..5 predict tokens 3..6
    logps = torch.log_softmax(model(input_ids=ids).logits[:, 2:-1].float(), -1)
    model.train(was_training)
    return logps.gather(-1, ids[:, 3:, None]).sum((1, 2)).exp().mean().item()


# --demo --tool calculator: sums of two numbers in [0, 99], whose answers (0-198) are words of the
# vocabulary but out of reach of the tiny model's head: it can copy the calculator's result, not
# compute it. The warm-up shows the call in TOOL_SHARE of its examples and the bare answer in the
# rest, so GRPO starts from a model that calls the tool now and then; the rise in calls and
# correctness after that is GRPO's.
TOOL_WORDS = WORDS[:7] + ["<tool>", "</tool>", "<result>", "</result>", "calculator"]
TOOL_WORDS += [str(n) for n in range(199)]
TOOL_SHARE = 0.5
TOOL_HELD_OUT = 200


def tool_problems(seed=0):
    """(train, held-out) problems {"prompt": "a + b =", "answer": "a+b"}: all 10,000 pairs of
    [0, 99], TOOL_HELD_OUT of them held out."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    rows = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a, b in (pairs[i] for i in order)]
    return rows[TOOL_HELD_OUT:], rows[:TOOL_HELD_OUT]


def tool_completion(problem, call):
    """The right completion, with the calculator's call and its result, or the bare answer."""
    a, _, b, _ = problem["prompt"].split()
    answer = f"<answer> {problem['answer']} </answer> <eos>"
    if not call:
        return answer
    return f"<tool> calculator {a} + {b} </tool> <result> {problem['answer']} </result> {answer}"


def tool_examples(tokenizer, problems, call):
    """Token ids [n, 4 + length] of prompt + right completion and labels: the prompt and the
    forced result (<result> S </result>) masked out (-100), as GRPO's loss masks them."""
    texts = [f"{p['prompt']} {tool_completion(p, call)}" for p in problems]
    ids = tokenizer(texts, return_tensors="pt", add_special_tokens=False)["input_ids"]
    labels = ids.clone()
    labels[:, :4] = -100
    if call:
        labels[:, 10:13] = -100  # <result> S </result>: the tool's, not the model's
    return ids, labels


def tool_setup(seed, warmup_steps, batch_size=64, lr=3e-3):
    """--demo --tool calculator's model (warmed up: `warmup_steps` supervised steps on a mix of
    TOOL_SHARE calls and bare answers), tokenizer and (train, held-out) problems
    (data.tool_demo_task makes them a task; the calculator's tools come from the flags)."""
    torch.set_num_threads(1)
    model = tiny_llama(
        len(TOOL_WORDS), seed, hidden_size=128, intermediate_size=256, max_position_embeddings=512
    )
    tokenizer = word_tokenizer(TOOL_WORDS)
    train, held_out = tool_problems(seed)
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    with_call = tool_examples(tokenizer, train, True)
    bare = tool_examples(tokenizer, train, False)
    for _ in range(warmup_steps):
        model.train()
        calls = int((torch.rand(batch_size, generator=gen) < TOOL_SHARE).sum())
        loss = 0.0
        for (ids, labels), n in ((with_call, calls), (bare, batch_size - calls)):
            if n:
                idx = torch.randint(len(train), (n,), generator=gen)
                loss = loss + model(input_ids=ids[idx], labels=labels[idx]).loss * n / batch_size
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    print(
        f"demo: a {sum(p.numel() for p in model.parameters()):,}-parameter Llama over "
        f"{len(TOOL_WORDS)} words; {warmup_steps} supervised warm-up steps, {TOOL_SHARE:.0%} of "
        "them calling the calculator",
        flush=True,
    )
    return model, tokenizer, (train, held_out)

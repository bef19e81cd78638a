"""Generation and log-probs of a transformers causal LM: everything that touches the model's
internals.

grpo.py is the math and never sees a model; this file turns a model into what the math takes:
  sample_groups     Algorithm 1's line 7 as train.py runs it: B prompts -> B*G completions, as
                    Rollouts (sample_rollouts: the same, with trainer.py's tools and kept log-probs)
  token_logprobs    log π(o_t | q, o_<t) of given completions, at the sampling temperature, with
                    grad or without
Those come first. The decode engine they drive (static KV cache, compiled step, sampling among the
top-k / top-p survivors) is support/decode.py.
"""

import contextlib
import dataclasses
import functools
import sys
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

import grpo
from support import decode
from support.models import prepare_tokenizer  # noqa: F401 (sampling.prepare_tokenizer)


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: temperature, then top-k (0: off), then top-p (1.0: off), as
    transformers orders them, for at most max_new_tokens tokens. Temperature 0: greedy
    (evaluation only; top-k and top-p unused)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    max_prompt_length: int | None = (
        None  # longer prompts lose their first tokens; None: the context - max_new_tokens
    )
    num_beams: int = (
        1  # K > 1: the group is the G best beams of one beam search per prompt (no sampling)
    )
    # the decode keeps each sampled token's log-probs (Rollouts.sampler_logps): for
    # --sampler-correction and --log-mismatch; off, nothing is computed
    keep_logps: bool = False
    # --decode graphs: the decode step replayed as a CUDA graph (decode.GraphStep); the same
    # tokens, without a kernel launch per op
    graphs: bool = False
    # --decode fused (the default on CUDA): the decoder layers through one compiled graph
    # (decode.FusedStep), captured as a CUDA graph on CUDA; the same distribution (tokens within
    # inductor's rounding)
    fused: bool = False

    @classmethod
    def of(cls, args):
        """The training rollouts' settings, from the flags."""
        return cls(
            args.temperature,
            args.top_k,
            args.top_p,
            args.max_new_tokens,
            args.max_prompt_length,
            args.num_beams,
            args.sampler_correction is not None or args.log_mismatch,
            args.decode == "graphs",
            args.decode == "fused",
        )


@dataclass
class Rollouts:
    """One batch of samples: B prompts x G completions, group after group (row b*G + j is prompt
    b's j-th)."""

    input_ids: torch.Tensor  # [B*G, P+C] left-padded prompt, then the completion as generated
    attention_mask: torch.Tensor  # [B*G, P+C] the prompt's padding mask, then completion_mask
    completion_mask: torch.Tensor  # [B*G, C] 1 up to and including the first EOS, 0 after
    texts: list  # B*G completions decoded up to EOS, special tokens dropped
    group_size: int  # G
    temperature: float  # what they were sampled at: their log-probs are taken at it too
    truncated: torch.Tensor | None = (
        None  # [B*G] bool: no EOS within max_new_tokens (cut off by the budget)
    )
    # Tools (tools.py): [B*G, C] bool, True on the tokens a tool's result forced in (attended to,
    # out of completion_mask); [B*G] calls, errors and (of those) malformed calls per completion.
    # None without tools.
    forced: torch.Tensor | None = None
    tool_calls: torch.Tensor | None = None
    tool_errors: torch.Tensor | None = None
    tool_malformed: torch.Tensor | None = None
    # A tool that hung or died (a UserError): the caller raises it, on every rank alike
    # (train.score_or_fail_everywhere), and the run stops, saved.
    tool_failure: Exception | None = None
    # --env with a reward method: [B*G] float32, each completion's environment's reward, computed
    # while the environment lived (tools.ToolSession.finish); data.Task.score passes it on. None:
    # no such reward.
    environment_rewards: torch.Tensor | None = None
    # Sampling.keep_logps: [B*G, C] fp32 log-prob of each sampled token under the distribution it
    # was drawn from (after top-k / top-p), and the log of the probability mass those kept (0:
    # nothing cut); log π_sampler of the full tempered softmax is their sum. 0 on forced tokens
    # and after EOS. None when not kept.
    sampler_logps: torch.Tensor | None = None
    log_kept: torch.Tensor | None = None

    @property
    def prompt_length(self):
        return self.input_ids.shape[1] - self.completion_mask.shape[1]

    @property
    def lengths(self):
        """[B*G] completion tokens up to and including EOS, |o_i| (from the attention mask:
        --mask-truncated leaves it), tool results' forced tokens not counted."""
        within = self.attention_mask[:, self.prompt_length :].sum(1)
        return within if self.forced is None else within - self.forced.sum(1)


def sample_groups(model, tokenizer, prompts, settings, group_size, autocast_dtype=None):
    """Algorithm 1's line 7 as train.py runs it: the prompts (strings), tokenized once, and G
    completions of each (decode.plain_decode), as Rollouts on the model's device. The same
    rollouts as sample_rollouts without tools and kept log-probs, bit for bit."""
    device, eos, G = next(model.parameters()).device, eos_token_ids(model, tokenizer), group_size
    limit, pad = prompt_limit(model, settings), tokenizer.pad_token_id
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, device, limit)  # [B, P]
    with autocast(device, autocast_dtype):
        completions = decode.plain_decode(model, prompt_ids, prompt_mask, settings, G, eos, pad)
    mask = grpo.completion_mask(completions, eos)  # [B*G, C]: up to and including the EOS
    sequences = torch.cat([prompt_ids.repeat_interleave(G, 0), completions], 1)  # [B*G, P + C]
    attention_mask = torch.cat([prompt_mask.repeat_interleave(G, 0), mask], 1)  # [B*G, P + C]
    truncated = ~torch.isin(completions, torch.tensor(eos, device=device)).any(1)  # no EOS
    if truncated.all():
        warn_all_cut(settings.max_new_tokens)
    texts = completion_texts(tokenizer, completions, mask)
    return Rollouts(sequences, attention_mask, mask, texts, G, settings.temperature, truncated)


@functools.cache
def warn_all_cut(max_new_tokens):
    """One line on stderr (once per budget in a process) when every completion of a training step
    was cut at --max-new-tokens before its EOS: the rewards read cut answers, which in most tasks
    score 0, so the run learns nothing and says nothing else (train.py's sample_groups, trainer.py's
    log_step)."""
    print(
        f"warning: every completion of this step was cut at --max-new-tokens {max_new_tokens} "
        "(none ended): the rewards score cut answers. Raise --max-new-tokens if the task's "
        "answers need more (this warning is shown once).",
        file=sys.stderr,
        flush=True,
    )


def sample_rollouts(
    model, tokenizer, prompts, settings, group_size, autocast_dtype=None, tools=None, rows=None
):
    """The prompts (strings), tokenized once, and G completions of each: Rollouts on the model's
    device. tools (tools.Tools): the completions may call them (tools.py), their results forced
    in; rows: the data rows of the prompts, which reset each completion's environment (--env)."""
    device, limit = next(model.parameters()).device, prompt_limit(model, settings)
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, device, limit)  # [B, P]
    n = prompt_ids.shape[0] * group_size
    session = None if tools is None else tools.session(tokenizer, n, settings.max_new_tokens, rows)
    try:
        return decode_rollouts(
            model, tokenizer, settings, group_size, autocast_dtype, session, prompt_ids, prompt_mask
        )
    finally:  # the environments go, however the decode ends
        if session is not None:
            session.close()


def decode_rollouts(
    model, tokenizer, settings, group_size, autocast_dtype, session, prompt_ids, prompt_mask
):
    """sample_rollouts' decode of the tokenized prompts [B, P], and the masks of what it wrote."""
    device, eos = prompt_ids.device, eos_token_ids(model, tokenizer)
    record, pad = {} if settings.keep_logps else None, tokenizer.pad_token_id
    with autocast(device, autocast_dtype):
        completion_ids = decode.generate(  # [B*G, C]
            model, prompt_ids, prompt_mask, settings, group_size, eos, pad, session, record
        )
    C = completion_ids.shape[1]
    forced = None if session is None else session.forced[:, :C].to(device)  # [B*G, C]
    # Up to and including the first EOS the model sampled (a forced token never ends a
    # completion): what attention sees. The loss sees its sampled tokens only.
    sampled_ids = completion_ids if forced is None else completion_ids.masked_fill(forced, -1)
    within = grpo.completion_mask(sampled_ids, eos)  # [B*G, C]
    mask = within if forced is None else within * ~forced
    attention_mask = torch.cat([prompt_mask.repeat_interleave(group_size, dim=0), within], dim=1)
    truncated = ~torch.isin(sampled_ids, torch.tensor(eos, device=device)).any(1)  # [B*G]
    sequences = torch.cat([prompt_ids.repeat_interleave(group_size, dim=0), completion_ids], dim=1)
    counts, texts = {}, completion_texts(tokenizer, completion_ids, within)
    if session is not None:
        environment_rewards = session.finish(texts)  # [B*G] or None; a failure: session.failure
        counts = dict(
            forced=forced,
            tool_calls=torch.tensor(session.calls, device=device),
            tool_errors=torch.tensor(session.errors, device=device),
            tool_malformed=torch.tensor(session.malformed, device=device),
            tool_failure=session.failure,
            environment_rewards=None
            if environment_rewards is None
            else environment_rewards.to(device),
        )
    if record is not None:  # on the sampled tokens up to EOS (the decode wrote 0 elsewhere)
        counts.update(sampler_logps=record["drawn"] * mask, log_kept=record["log_kept"] * mask)
    T = settings.temperature
    return Rollouts(sequences, attention_mask, mask, texts, group_size, T, truncated, **counts)


def token_logprobs(
    model,
    input_ids,
    attention_mask,
    num_completion_tokens,
    temperature=1.0,
    *,
    group_size=1,
    chunk_size=1024,
    entropy=False,
):
    """[N, C] fp32 log π(o_t | q, o_<t) of the last C = num_completion_tokens tokens of input_ids
    [N, P + C]; with entropy=True also [N, C] H(π(· | q, o_<t)), the entropy of the distribution
    each token was drawn from (no grad).

    The logits are divided by the sampling temperature: these are the tempered softmax's
    probabilities (before any top-k / top-p truncation, as in TRL), the distribution generation
    sampled from when those are off. Position ids come from the attention mask, so left-padded rows
    see the positions generation gave them. group_size=G > 1 says rows come group after group and
    each group's G rows share one prompt (the first P columns): each prompt then runs through the
    model once and its KV cache is repeated G times, instead of recomputing it G times; gradients
    flow back through the cache. Models whose cache cannot be repeated fall back to the plain path.
    For Llama-style heads no [N, C, V] logits tensor is ever built (chunked lm-head).
    """
    n, length = input_ids.shape
    c = num_completion_tokens
    if not 0 < c < length:
        raise ValueError(
            f"num_completion_tokens must be in [1, {length - 1}] for inputs of length {length}, got {c}"
        )
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} rows cannot be split into groups of {group_size}")
    ids, attn, G, p = input_ids, attention_mask, group_size, length - c
    pos = (attn.long().cumsum(dim=1) - 1).clamp(min=0)  # position ids [N, P + C]
    targets = ids[:, -c:]  # [N, C]
    # Gradient checkpointing turns the cache off in training, so the shared-prompt path cannot run
    # there. Under FSDP2 every rank must run the same forwards: the plain path (one forward)
    # whatever its completions' length.
    if group_size > 1 and not is_checkpointing(model) and not decode.is_sharded(model):
        # Each prompt once: [B, P]. Its last position predicts every row's first completion token.
        first, head, cache = _features(model, ids[::G, :p], attn[::G, :p], pos[::G, :p], 1, True)
        if cache is not None and hasattr(cache, "batch_repeat_interleave"):
            first = first.repeat_interleave(G, dim=0)  # [N, 1, H] (or V)
            first = _logprobs(first, head, targets[:, :1], temperature, chunk_size, entropy)
            if c == 1:
                return first if entropy else first[0]
            cache.batch_repeat_interleave(G)  # [B, ...] -> [B*G, ...]
            # Completion tokens 0..C-2 predict tokens 1..C-1, attending to the cached prompt and
            # each other.
            rest, head, _ = _features(
                model, ids[:, p:-1], attn[:, :-1], pos[:, p:-1], c - 1, True, cache
            )
            rest = _logprobs(rest, head, targets[:, 1:], temperature, chunk_size, entropy)
            logps, entropies = (torch.cat(pair, dim=1) for pair in zip(first, rest))
            return (logps, entropies) if entropy else logps
    # Plain path: positions P-1 .. P+C-2 predict the C completion tokens.
    features, head, _ = _features(model, ids[:, :-1], attn[:, :-1], pos[:, :-1], c)
    logps, entropies = _logprobs(features, head, targets, temperature, chunk_size, entropy)
    return (logps, entropies) if entropy else logps


# --------------------------------------------------------------------------------------------------
# The log-probs of whole rollouts, in micro-batches of whole groups (train.py and trainer.py).


@torch.no_grad()
def frozen_logps(model, rollouts, micro_batch_size, autocast_dtype=None, shared_prompt=True):
    """log π(o_t | q, o_<t) [N, C] of the rollouts under a frozen model, in micro-batches of
    whole groups; 0 after each micro-batch's longest completion. shared_prompt=False takes
    token_logprobs' plain path, as the policy's forward does under gradient checkpointing: π_ref
    and π_θ then come from the same computation. A PeftModel (LoRA) is π_ref with its adapters
    off: the base model, no second copy."""
    adapters_off = getattr(model, "disable_adapter", contextlib.nullcontext)
    net = model.get_base_model() if hasattr(model, "get_base_model") else model
    was_training = net.training
    net.eval()
    N, C = rollouts.completion_mask.shape
    out = torch.zeros(N, C, device=rollouts.completion_mask.device)
    for rows in micro_batches(N, micro_batch_size):
        ids, attn, keep = micro_batch_inputs(rollouts, rows)
        with autocast(ids.device, autocast_dtype), adapters_off():
            G = rollouts.group_size if shared_prompt else 1
            out[rows, :keep] = token_logprobs(
                net, ids, attn, keep, rollouts.temperature, group_size=G
            )
    net.train(was_training)
    return out


def micro_batches(n, size):
    """Row slices of `size` rows (whole groups: size is a multiple of G)."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def micro_batch_inputs(rollouts, rows):
    """One micro-batch's ids and attention mask without the columns none of its rows needs:
    leading prompt padding (position ids come from the mask, so dropping all-pad columns changes
    nothing) and the completion columns after its longest completion. Returns (ids, mask,
    completion columns kept)."""
    ids, attn = rollouts.input_ids[rows], rollouts.attention_mask[rows]
    mask = rollouts.completion_mask[rows]
    P = rollouts.prompt_length
    first = int(attn[:, :P].any(0).nonzero()[0]) if attn[:, :P].any() else P - 1
    # up to the last column in the loss: with tools a completion's loss mask has holes (forced
    # tokens), so its last token in the loss is not at its count of tokens in the loss
    used = mask.any(0).nonzero()
    keep = int(used[-1]) + 1 if len(used) else 1
    return ids[:, first : P + keep], attn[:, first : P + keep], keep


# --------------------------------------------------------------------------------------------------
# Rollouts: prompts in, groups out.


def tokenize_prompts(tokenizer, prompts, device, max_length=None):
    """Each prompt tokenized once, left-padded: ids and mask [B, P]. (Chat templates already hold
    any BOS.) A prompt longer than max_length keeps its last max_length tokens (its end, where
    the reply starts), with a warning."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    if enc["input_ids"].shape[1] == 0:  # the model would have nothing to continue
        from support.errors import UserError

        raise UserError(
            f"every prompt of a batch ({len(prompts)}) is empty once tokenized: rows whose prompt "
            "is blank, with a tokenizer without a chat template (and no BOS) that makes no token "
            f"of them; the first was {prompts[0][:200]!r}. Give those rows text, or leave them out."
        )
    if max_length is not None and enc["input_ids"].shape[1] > max_length:
        cut = int((enc["attention_mask"].sum(1) > max_length).sum())
        print(
            f"warning: {cut} prompt(s) longer than {max_length} tokens lost their first tokens (the model's context "
            "minus --max-new-tokens, or --max-prompt-length)",
            file=sys.stderr,
            flush=True,
        )
        # left padding: the last columns are every prompt's end
        enc = {k: v[:, -max_length:] for k, v in enc.items()}
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def prompt_limit(model, settings):
    """The most tokens a prompt keeps: --max-prompt-length, else the model's context minus
    max_new_tokens."""
    context = getattr(model.config, "max_position_embeddings", None)
    return settings.max_prompt_length or (context - settings.max_new_tokens if context else None)


def eos_token_ids(model, tokenizer):
    """The ids generation stops at: the generation config's EOS (an int or a list), else the
    tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos)


def completion_texts(tokenizer, completion_ids, mask):
    """Texts for the reward functions: each completion up to its EOS, special tokens dropped."""
    lengths = mask.sum(1).tolist()
    return tokenizer.batch_decode(
        [ids[:n] for ids, n in zip(completion_ids.tolist(), lengths)], skip_special_tokens=True
    )


def select_groups(rollouts, groups):
    """The rollouts of the listed groups only (indices into the B groups), in that order."""
    G = rollouts.group_size
    rows = torch.tensor(
        [g * G + j for g in groups for j in range(G)],
        dtype=torch.long,
        device=rollouts.input_ids.device,
    )
    return dataclasses.replace(
        rollouts,
        input_ids=rollouts.input_ids[rows],
        attention_mask=rollouts.attention_mask[rows],
        completion_mask=rollouts.completion_mask[rows],
        texts=[rollouts.texts[i] for i in rows],
        **{
            name: None if getattr(rollouts, name) is None else getattr(rollouts, name)[rows]
            for name in (
                "truncated",
                "forced",
                "tool_calls",
                "tool_errors",
                "tool_malformed",
                "environment_rewards",
                "sampler_logps",
                "log_kept",
            )
        },
    )


def concat_rollouts(parts):
    """One Rollouts from several (of the same G and temperature): prompts left-padded to the
    longest, completions right-padded to the longest (padding is masked out: attention 0,
    completion mask 0)."""
    P = max(r.prompt_length for r in parts)
    C = max(r.completion_mask.shape[1] for r in parts)

    # [n, p + c] -> [n, P + C]: the prompt part padded on the left, the completion on the right
    def pad(r, x, value):
        p, c = r.prompt_length, r.completion_mask.shape[1]
        return torch.cat(
            [
                torch.nn.functional.pad(x[:, :p], (P - p, 0), value=value),
                torch.nn.functional.pad(x[:, p:], (0, C - c), value=value),
            ],
            dim=1,
        )

    def completions(name):  # [n, c] -> [n, C] for every part, concatenated; None if absent
        if getattr(parts[0], name) is None:
            return None
        return torch.cat(
            [
                torch.nn.functional.pad(x, (0, C - x.shape[1]))
                for x in (getattr(r, name) for r in parts)
            ]
        )

    def rows(name):  # [n] for every part, concatenated; None if absent
        return (
            None
            if getattr(parts[0], name) is None
            else torch.cat([getattr(r, name) for r in parts])
        )

    return Rollouts(
        torch.cat([pad(r, r.input_ids, 0) for r in parts]),
        torch.cat([pad(r, r.attention_mask, 0) for r in parts]),
        completions("completion_mask"),
        [t for r in parts for t in r.texts],
        parts[0].group_size,
        parts[0].temperature,
        rows("truncated"),
        forced=completions("forced"),
        tool_calls=rows("tool_calls"),
        tool_errors=rows("tool_errors"),
        tool_malformed=rows("tool_malformed"),
        environment_rewards=rows("environment_rewards"),
        sampler_logps=completions("sampler_logps"),
        log_kept=completions("log_kept"),
    )


# --------------------------------------------------------------------------------------------------
# Precision, memory and --compile.


# --dtype: the autocast compute dtype
AUTOCAST_DTYPE = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def autocast(device, dtype):
    """Compute in dtype (bf16/fp16) under autocast while parameters stay fp32; dtype None: full
    precision."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def enable_gradient_checkpointing(model):
    """Recompute activations in backward (use_reentrant=False, torch's recommended variant). Only
    training-mode forwards recompute; generation and the no-grad log-prob passes keep their KV
    cache."""
    # transformers 5 renamed the method
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def is_checkpointing(model):
    """Whether a forward of this model recomputes activations in backward (and so runs without a
    KV cache)."""
    flag = (
        "is_activation_checkpointing"
        if hasattr(type(model), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    return bool(getattr(model, flag, False)) and model.training


def compile_model(model, backend="inductor"):
    """--compile: torch.compile the forward of the log-prob passes (dynamic shapes) now, and the
    decode step at its first call (decode.compile_decode). Weights and state dict untouched."""
    body = model.model if _plain_linear_head(model) is not None else model
    forward = torch.compile(body, backend=backend, dynamic=True)
    decode.compile_decode(model, backend, forward)
    return model


# --------------------------------------------------------------------------------------------------
# Log-probs without [N, C, V] logits for Llama-style heads.


def _features(
    model,
    input_ids,
    attention_mask,
    position_ids,
    num_positions,
    use_cache=False,
    cache=None,
):
    """Run the model; return (features of the last num_positions positions, plain lm-head or None,
    cache). The cache goes in and comes out under the name this transformers gives it
    (decode.cache_keyword).

    For plain-head models the features are final hidden states [N, k, H] (the head is applied chunk
    by chunk later); otherwise they are logits [N, k, V], asked for with logits_to_keep so no more
    are computed.
    """
    head = _plain_linear_head(model)
    key = decode.cache_keyword(model.model if head is not None else model)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    kwargs.update({key: cache, "use_cache": use_cache})
    # --compile: the same forward, compiled
    compiled = decode.compiled_forward(model)
    if head is not None:
        out = (model.model if compiled is None else compiled)(**kwargs)
        features = out.last_hidden_state[:, out.last_hidden_state.shape[1] - num_positions :]
    else:
        out = (model if compiled is None else compiled)(**kwargs, logits_to_keep=num_positions)
        features = out.logits[:, out.logits.shape[1] - num_positions :]
    return features, head, getattr(out, key, None)


def _logprobs(features, head, targets, temperature, chunk_size, with_entropy):
    """([N, k] log-probs of targets [N, k], [N, k] entropies (zeros unless with_entropy)) from
    _features' output."""
    n, k = targets.shape
    flat = features.reshape(n * k, features.shape[-1])
    t, args = targets.reshape(-1), (temperature, chunk_size, with_entropy)
    if head is not None:
        logps, entropy = _LinearLogprobs.apply(flat, head.weight, t, *args)
    else:
        logps, entropy = _chosen_logprobs(flat, t, *args)
    return logps.view(n, k), entropy.view(n, k)


# Architectures whose logits are exactly lm_head(final hidden state): no soft-capping, no logit
# scaling, no bias.
PLAIN_HEAD_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


def _plain_linear_head(model):
    """The lm-head Linear when the model's logits are exactly hidden @ Wᵀ, else None (use the
    logits path)."""
    config, head = getattr(model, "config", None), getattr(model, "lm_head", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    if getattr(model, "model", None) is None:
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    # FSDP2: only the model's own forward gathers a sharded head
    if type(head.weight).__name__ == "DTensor":
        return None
    return head


def _chosen_logprobs(logits, targets, temperature, chunk_size, with_entropy=True):
    """(log softmax(logits / temperature)[target], entropy of that softmax) for logits [M, V],
    targets [M], chunk_size rows at a time: [M] each, the entropy without grad (zeros, not computed,
    when with_entropy is False).

    The chosen logit minus the logsumexp: only a [chunk_size, V] fp32 temporary exists at a time,
    never the full fp32 [M, V] log-softmax. With grad, each chunk is recomputed in backward instead
    of keeping its fp32 copy.
    """

    def chunk_logprobs(chunk, chunk_targets):
        chunk = chunk.float() / temperature  # [chunk, V]
        return chunk.gather(-1, chunk_targets[:, None]).squeeze(-1) - torch.logsumexp(chunk, dim=-1)

    recompute = torch.is_grad_enabled() and logits.requires_grad
    out, entropy = [], []
    for s in range(0, logits.shape[0], chunk_size):
        args = (logits[s : s + chunk_size], targets[s : s + chunk_size])
        out.append(
            torch.utils.checkpoint.checkpoint(chunk_logprobs, *args, use_reentrant=False)
            if recompute
            else chunk_logprobs(*args)
        )
        if with_entropy:
            with torch.no_grad():
                entropy.append(_entropy(args[0].float() / temperature))
    if not out:
        return (logits.new_zeros(0, dtype=torch.float32),) * 2
    out = torch.cat(out)
    return out, torch.cat(entropy) if with_entropy else torch.zeros_like(out, requires_grad=False)


def _entropy(logits, lse=None):
    """H = -Σ p log p of softmax(logits [n, V]), per row: logsumexp - Σ p · logits (lse: the
    rows' logsumexp)."""
    lse = torch.logsumexp(logits, dim=-1) if lse is None else lse
    return lse - (torch.exp(logits - lse[:, None]) * logits).sum(-1)


class _LinearLogprobs(torch.autograd.Function):
    """log softmax(h Wᵀ / temperature)[target] for hidden states h [M, H] and an lm-head weight W
    [V, H], computed chunk by chunk, recomputing each chunk's logits in backward: [M, V] logits
    never exist. The entropy of each row's softmax comes with it, from the same chunks (a second
    output, without grad). Under autocast the matmuls run in the autocast dtype, as the model's
    own lm-head would, in forward and in backward alike, so backward recomputes exactly the
    logits forward saw."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy=True):
        device = hidden.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else hidden.dtype
        out = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        lse, entropy = torch.empty_like(out), torch.zeros_like(out)
        with torch.autocast(device, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            for s in range(0, h.shape[0], chunk_size):
                k = slice(s, s + chunk_size)  # this chunk's rows
                logits = (h[k] @ w.T).float() / temperature  # [chunk, V]
                lse[k] = torch.logsumexp(logits, dim=-1)
                out[k] = logits.gather(-1, targets[k, None]).squeeze(-1)
                if with_entropy:  # not for π_ref's pass, where nothing reads it
                    entropy[k] = _entropy(logits, lse[k])
        # The last chunk's logits are kept for backward, which starts with it: a batch that fits in
        # one chunk (a typical micro-batch) is never recomputed, at the cost of holding one [chunk,
        # V] block until backward.
        last = logits if h.shape[0] else None
        ctx.save_for_backward(hidden, weight, targets, lse, last)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        ctx.mark_non_differentiable(entropy)
        return out - lse, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):
        hidden, weight, targets, lse, last = ctx.saved_tensors
        size, device = ctx.chunk_size, hidden.device.type
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        fp32 = torch.float32
        grad_weight = torch.zeros_like(weight, dtype=fp32) if ctx.needs_input_grad[1] else None
        with torch.autocast(device, enabled=False):
            h, w = hidden.to(ctx.dtype), weight.to(ctx.dtype)
            starts = list(range(0, h.shape[0], size))
            for s in reversed(starts):
                k = slice(s, s + size)  # this chunk's rows
                logits = last if s == starts[-1] else (h[k] @ w.T).float() / ctx.temperature
                # d logp / d logits = onehot(target) - softmax, times the incoming gradient and
                # 1/temperature
                grad_logits = -torch.exp(logits - lse[k, None])
                grad_logits.scatter_add_(-1, targets[k, None], torch.ones_like(grad_logits[:, :1]))
                grad_logits = (grad_logits * (grad_out[k, None] / ctx.temperature)).to(ctx.dtype)
                if grad_hidden is not None:
                    grad_hidden[k] = grad_logits @ w
                if grad_weight is not None:
                    grad_weight += (grad_logits.T @ h[k]).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None

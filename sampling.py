"""Generation and log-probs of a transformers causal LM: everything that touches the model's internals.

grpo.py is the math and never sees a model; this file turns a model into what the math takes:
  sample_rollouts   B prompts -> B*G completions, by decode() (a short loop: static KV cache, each prompt prefilled
                    once, finished rows leave the batch), from the flags' settings only
  token_logprobs    log π(o_t | q, o_<t) of given completions, at the sampling temperature, with grad or without
"""

import contextlib
import copy
import dataclasses
import functools
import inspect
import itertools
import sys
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StaticCache

import grpo


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: temperature, then top-k (0: off), then top-p (1.0: off), as transformers orders
    them, for at most max_new_tokens tokens. Temperature 0: greedy (evaluation only; top-k and top-p unused)."""

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
        )


@dataclass
class Rollouts:
    """One batch of samples: B prompts x G completions, group after group (row b*G + j is prompt b's j-th)."""

    input_ids: torch.Tensor  # [B*G, P+C] left-padded prompt, then the completion as generated
    attention_mask: torch.Tensor  # [B*G, P+C] the prompt's padding mask, then completion_mask
    completion_mask: torch.Tensor  # [B*G, C] 1 up to and including the first EOS, 0 after
    texts: list  # B*G completions decoded up to EOS, special tokens dropped
    group_size: int  # G
    temperature: float  # what they were sampled at: their log-probs are taken at it too
    truncated: torch.Tensor | None = (
        None  # [B*G] bool: no EOS within max_new_tokens (cut off by the budget)
    )

    @property
    def prompt_length(self):
        return self.input_ids.shape[1] - self.completion_mask.shape[1]

    @property
    def lengths(self):
        """[B*G] completion tokens up to and including EOS (from the attention mask: --mask-truncated leaves it)."""
        return self.attention_mask[:, self.prompt_length :].sum(1)


# --dtype: the autocast compute dtype
AMP = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def autocast(device, dtype):
    """Compute in dtype (bf16/fp16) under autocast while parameters stay fp32; dtype None: full precision."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def compute_dtype(device):
    """The autocast dtype in force for this device's type (bf16, fp16), or None outside autocast."""
    kind = torch.device(device).type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def prepare_tokenizer(tokenizer):
    """Left padding, so every prompt of a batch ends at the column where generation starts, and a pad token (EOS if
    the tokenizer has none)."""
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


def enable_gradient_checkpointing(model):
    """Recompute activations in backward (use_reentrant=False, torch's recommended variant). Only training-mode
    forwards recompute; generation and the no-grad log-prob passes keep their KV cache."""
    # transformers 5 renamed the method
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def is_checkpointing(model):
    """Whether a forward of this model recomputes activations in backward (and so runs without a KV cache)."""
    flag = (
        "is_activation_checkpointing"
        if hasattr(type(model), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    return bool(getattr(model, flag, False)) and model.training


# ----------------------------------------------------------------------------------------------------------------------
# Sampling.


def tokenize_prompts(tokenizer, prompts, device, max_length=None):
    """Each prompt tokenized once, left-padded: ids and mask [B, P]. (Chat templates already hold any BOS.) A prompt
    longer than max_length keeps its last max_length tokens (its end, where the reply starts), with a warning."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
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


def survivors(scores, top_k, top_p):
    """The tokens sampling may draw after top-k, then top-p (transformers' TopKLogitsWarper and TopPLogitsWarper, in
    that order), from tempered scores [n, V], without sorting the whole vocabulary when top-k is on: (values [n, m],
    indices [n, m]), values -inf where top-p dropped a survivor; indices None when nothing is cut (m = V, as given)."""
    V = scores.shape[-1]
    if top_k <= 0 and top_p >= 1.0:
        return scores, None
    k = min(top_k, V) if top_k > 0 else V
    values, indices = scores.topk(k, dim=-1)  # [n, k], descending
    kth = values[:, -1:]
    # HF keeps every token tied with the k-th logit: widen to them
    tied = int((scores >= kth).sum(-1).max())
    if tied > k:
        values, indices = scores.topk(tied, dim=-1)
        values = values.masked_fill(values < kth, float("-inf"))
    if top_p < 1.0:
        # TopPLogitsWarper's rule, on the survivors: ascending order, drop the tokens whose cumulative
        # probability stays <= 1 - top_p, always keep the most likely one.
        values, indices = values.flip(-1), indices.flip(-1)  # ascending
        cumulative = values.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False
        values = values.masked_fill(remove, float("-inf"))
    return values, indices


class TemperatureTopKTopP(LogitsProcessor):
    """Temperature, then top-k, then top-p (survivors) as one transformers LogitsProcessor, for the paths that still
    run generate() (beam search, FSDP): the distribution of TemperatureLogitsWarper, TopKLogitsWarper and
    TopPLogitsWarper in that order. The temperature is applied here because generate() runs a user's processors
    before its own warpers, and top-p depends on it. Scores [n, V] in, [n, V] out: the survivors keep logits /
    temperature, every other token gets -inf."""

    def __init__(self, temperature, top_k, top_p):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def __call__(self, input_ids, scores):
        values, indices = survivors(scores / self.temperature, self.top_k, self.top_p)
        if indices is None:
            return values
        return torch.full_like(scores, float("-inf")).scatter_(-1, indices, values)


def sample_tokens(logits, settings, uniforms=None):
    """One token per row of logits [n, V], drawn as settings say, and its log-prob under the distribution it was drawn
    from: ([n] ids, [n] fp32 log-probs). Temperature, then top-k and top-p (survivors), then one uniform per row
    ([n, 1] in [0, 1), drawn here if not given) through the survivors' cumulative distribution (inverse-CDF
    sampling): no multinomial over the vocabulary. Temperature 0: the argmax (log-prob 0)."""
    if settings.temperature == 0:
        return logits.argmax(-1), logits.new_zeros(logits.shape[0], dtype=torch.float32)
    values, indices = survivors(
        logits.float() / settings.temperature, settings.top_k, settings.top_p
    )
    logp = values.log_softmax(dim=-1)  # [n, m]
    cdf = logp.exp().cumsum(dim=-1)
    u = torch.rand(cdf.shape[0], 1, device=cdf.device) if uniforms is None else uniforms
    u = u * cdf[:, -1:]  # in [0, total): never past the end
    # [n, 1]: first cdf > u (p > 0)
    choice = torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[1] - 1)
    token = choice if indices is None else indices.gather(-1, choice)
    return token.squeeze(-1), logp.gather(-1, choice).squeeze(-1)


def is_sharded(model):
    """Whether the model's weights are sharded over processes (FSDP2: DTensors). Every process must then run each
    forward together: generate keeps stepping (synced_gpus) until every process's rows have finished."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def generation_config(settings, eos_ids, pad_id, num_return_sequences):
    """Every setting that could change the sampled distribution, stated; temperature, top-k and top-p are off here
    (TemperatureTopKTopP applies them)."""
    return GenerationConfig(
        do_sample=settings.temperature > 0 and settings.num_beams == 1,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        num_return_sequences=num_return_sequences,
        num_beams=settings.num_beams,
        use_cache=True,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
    )


@contextlib.contextmanager
def flags_only(model):
    """generate() fills every unset field of the GenerationConfig it is given from model.generation_config
    (suppress_tokens, bad_words_ids, min_p, ...). Set the checkpoint's aside for the call, so the library defaults
    are all it can fall back on."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def lean(model, settings):
    """Whether decode() runs this model: sampling or greedy (beam search stays with generate()), whole weights (under
    FSDP2 generate() keeps the processes in lockstep), and a model transformers can run with a static cache."""
    return (
        settings.num_beams == 1
        and not is_sharded(model)
        and getattr(model, "_can_compile_fullgraph", False)
    )


def generate(
    model, prompt_ids, prompt_mask, settings, group_size, eos_ids, pad_id, amp=None, lengths=None
):
    """G completions of each prompt, group after group: [B*G, C] token ids, pad after EOS, C the longest. decode()
    where lean() allows; otherwise one generate() call (num_return_sequences=G, or the G best of K beams)."""
    was_training = model.training
    model.eval()
    with torch.no_grad(), autocast(prompt_ids.device, amp):
        if lean(model, settings):
            out = decode(
                model, prompt_ids, prompt_mask, settings, group_size, eos_ids, pad_id, lengths
            )[0]
        else:
            if lengths is not None:
                raise ValueError(
                    "forced completion lengths are decode()'s (bench.py); this model runs generate()"
                )
            beams = settings.num_beams > 1
            # 0: greedy
            processors = LogitsProcessorList(
                [TemperatureTopKTopP(settings.temperature, settings.top_k, settings.top_p)]
                if settings.temperature > 0 and not beams
                else []
            )
            with flags_only(model):
                out = model.generate(
                    input_ids=prompt_ids,
                    attention_mask=prompt_mask,
                    logits_processor=processors,
                    generation_config=generation_config(settings, eos_ids, pad_id, group_size),
                    synced_gpus=is_sharded(model),
                )[:, prompt_ids.shape[1] :]
    model.train(was_training)
    return out


class KVCache(StaticCache):
    """transformers' StaticCache (preallocated, written in place), its keys and values held in `dtype`, the compute
    dtype under autocast. With fp32 weights under autocast the rotary embedding leaves the keys in fp32 while v_proj
    gives bf16 values, and a StaticCache holds one dtype for both. Attention, an autocast op, reads both in the compute
    dtype anyway: storing them in it loses nothing and halves the cache. dtype None: as they come (fp32)."""

    def __init__(self, config, max_cache_len, dtype=None):
        super().__init__(config=config, max_cache_len=max_cache_len)
        self.compute_dtype = dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.compute_dtype is not None:
            key_states = key_states.to(self.compute_dtype)
            value_states = value_states.to(self.compute_dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


# --compile's state per model (compile_model): id(model) -> Compiled. Each entry holds its model (through the
# callables), so an id here is never reused by another model.
COMPILED = {}


@dataclass
class Compiled:
    """What torch.compile made of one model, and the decode shapes it may meet.

    The decode step is compiled for fixed shapes, one graph per (rows, cache length): `rows` and `length` are the
    planned ones (plan_decode), to which every call is padded, so a run compiles and keeps at most len(rows) graphs
    and KV caches. A call that fits no planned shape gets its own (rounded up: rows as they are, length to a
    multiple of 64), with a warning."""

    backend: object
    mode: str | None
    body: object  # the compiled forward of the log-prob passes (dynamic shapes)
    rows: tuple = ()  # planned row counts of a decode call, ascending
    length: int | None = None  # planned cache length: longest prompt + max_new_tokens
    # compute dtype -> (twin, its pairs, compiled step)
    steps: dict = dataclasses.field(default_factory=dict)
    # (rows, length, dtype) -> KVCache, written in place
    caches: dict = dataclasses.field(default_factory=dict)

    def shape(self, n, needed):
        """The (rows, cache length) a decode call of n rows needing `needed` positions runs at."""
        rows = next((r for r in self.rows if r >= n), n)
        length = (
            self.length
            if self.length is not None and needed <= self.length
            else -(-needed // 64) * 64
        )
        planned = rows in self.rows and length == self.length
        if self.rows and not planned and not any(key[:2] == (rows, length) for key in self.caches):
            print(
                f"warning: --compile: a decode call of {n} rows x {needed} positions fits none of the planned "
                f"shapes ({list(self.rows)} rows x {self.length}); compiling one more",
                file=sys.stderr,
                flush=True,
            )
        return rows, length


def compile_model(model, backend="inductor"):
    """--compile: torch.compile the forward of the log-prob passes (dynamic shapes) now, and the decode step (fixed
    shapes against a static cache; CUDA graphs on a GPU, mode "reduce-overhead") at its first call. Weights and
    state dict untouched."""
    mode = "reduce-overhead" if next(model.parameters()).is_cuda and backend == "inductor" else None
    body = model.model if _plain_linear_head(model) is not None else model
    COMPILED[id(model)] = Compiled(
        backend, mode, torch.compile(body, backend=backend, dynamic=True)
    )
    return model


def plan_decode(model, rows, length):
    """The decode shapes a compiled model will meet: each call's rows are padded up to the smallest of `rows` that
    holds them, and its cache is `length` positions long (the longest prompt + max_new_tokens). Nothing when the
    model is not compiled."""
    compiled = COMPILED.get(id(model))
    if compiled is not None:
        compiled.rows, compiled.length = tuple(sorted(set(rows))), length


def decode_twin(model, dtype):
    """The model for a compiled decode under autocast: every Linear's weight (and bias) held in the compute dtype,
    what autocast casts it to at every use, so the captured step reads it as it is instead of casting each fp32
    weight again at every token. Every other tensor (embeddings, norms, buffers) is the model's own, shared, not
    copied, so the twin computes exactly what the model computes under autocast. Costs 2 bytes per Linear parameter
    (a tied lm-head gets its own). Returns (twin, [(twin's tensor, model's)]) for refresh_twin."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    # the modules anew; every parameter and buffer is the model's own
    twin = copy.deepcopy(model, shared)
    pairs = []
    for mine, theirs in zip(twin.modules(), model.modules()):
        if isinstance(theirs, torch.nn.Linear):
            for name, p in list(theirs.named_parameters(recurse=False)):
                low = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
                setattr(mine, name, low)
                pairs.append((low, p))
    return twin.eval(), pairs


@torch.no_grad()
def refresh_twin(pairs):
    """Copy the model's current Linear weights into its decode twin, in place (the captured graphs read them at the
    same addresses): one read of the fp32 weights per decode call."""
    for low, p in pairs:
        low.copy_(p)


def compiled_decoder(model, dtype):
    """(the model decode runs, its compiled step) for a compiled model: the twin under autocast, else the model."""
    compiled = COMPILED[id(model)]
    if dtype not in compiled.steps:
        twin, pairs = decode_twin(model, dtype) if dtype is not None else (model, [])
        step = torch.compile(
            functools.partial(_decode_step, twin),
            backend=compiled.backend,
            mode=compiled.mode,
            dynamic=False,
        )
        compiled.steps[dtype] = (twin, pairs, step)
    twin, pairs, step = compiled.steps[dtype]
    refresh_twin(pairs)
    return twin, step


def _decode_step(model, token, mask, position, cache):
    """One token per row through the model against its KV cache: the next logits [n, V]."""
    return model(
        input_ids=token,
        attention_mask=mask,
        position_ids=position,
        past_key_values=cache,
        use_cache=True,
    ).logits[:, -1]


def _grouped_cache(model, prefill, group, reuse):
    """The B prompts' prefilled cache, repeated to their rows (group: each row's prompt). reuse (compiled): written in
    place into the one cache kept for this shape, so CUDA graphs find it at the same addresses at every call."""
    if reuse is None:
        prefill.reorder_cache(group)
        return prefill
    length = prefill.layers[0].max_cache_len
    dtype = prefill.compute_dtype
    cache = reuse.setdefault((len(group), length, dtype), KVCache(model.config, length, dtype))
    for layer, prompt in zip(cache.layers, prefill.layers):
        keys, values = prompt.keys[group], prompt.values[group]
        if not layer.is_initialized:
            layer.lazy_initialization(keys, values)
        layer.keys.copy_(keys)
        layer.values.copy_(values)
        layer.cumulative_length.copy_(prompt.cumulative_length)
    return cache


@torch.no_grad()
def decode(model, prompt_ids, prompt_mask, settings, group_size, eos_ids, pad_id, lengths=None):
    """The lean decode path, a short loop over the model's forward in place of generate(): ([B*G, C] completions,
    pad after EOS, C <= max_new_tokens the longest; [B*G, C] the log-prob each token was drawn with, 0 after EOS).
      - the KV cache is preallocated (KVCache) in the compute dtype and written in place, never grown by
        concatenation;
      - each prompt is prefilled once, and its cache copied to its G rows;
      - tokens are drawn among the top-k / top-p survivors only (sample_tokens);
      - a row leaves the batch (its cache rows are dropped) once it has written EOS, so finished rows cost nothing.
        Compiled (compile_model), shapes stay fixed instead: the rows are padded to a planned count (plan_decode),
        and finished rows run on, writing pad, until all are done.
    lengths: bench.py's forced completion lengths, [B*G]: row i's EOS is its lengths[i]-th token and never comes
    earlier (a length over max_new_tokens: no EOS at all). None in training."""
    (B, P), G, C, device = prompt_ids.shape, group_size, settings.max_new_tokens, prompt_ids.device
    n, dtype, compiled = B * G, compute_dtype(device), COMPILED.get(id(model))
    if compiled is None:
        net, step, R, L = model, functools.partial(_decode_step, model), n, P + C
    else:
        net, step = compiled_decoder(model, dtype)
        R, L = compiled.shape(n, P + C)  # R >= n rows, L >= P + C
    # Every completion column is 1 from the start: causal masking hides the positions not yet written.
    mask = torch.cat(
        [prompt_mask, prompt_mask.new_ones(B, C), prompt_mask.new_zeros(B, L - P - C)], dim=1
    )
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, P], as generate() has them
    prefill = KVCache(model.config, L, dtype)
    keep = (
        {"logits_to_keep": 1}
        if "logits_to_keep" in inspect.signature(net.forward).parameters
        else {}
    )
    logits = net(
        input_ids=prompt_ids,
        attention_mask=mask[:, :P],
        position_ids=positions,
        past_key_values=prefill,
        use_cache=True,
        **keep,
    ).logits[:, -1]  # [B, V]: each prompt once
    group = torch.arange(B, device=device).repeat_interleave(G)  # [B*G]: each row's prompt
    group = torch.cat([group, group.new_zeros(R - n)])  # [R]: padding rows copy row 0
    cache = _grouped_cache(net, prefill, group, None if compiled is None else compiled.caches)
    logits, mask, position = logits[group], mask[group], positions[group, -1:] + 1
    completions = torch.full((R, C), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(R, C, device=device)
    rows = torch.arange(R, device=device)  # the rows still in the batch
    done = torch.arange(R, device=device) >= n  # compiled: rows past their EOS (padding: all)
    eos = torch.tensor(eos_ids, device=device)
    for t in range(C):
        if lengths is not None:  # bench.py: EOS where it says
            logits[:, eos] = float("-inf")
        # Uniforms for every real row, used by the rows still in: compiled or not, a run draws the same samples.
        uniforms = torch.cat(
            [torch.rand(n, 1, device=device), torch.zeros(R - n, 1, device=device)]
        )
        token, logp = sample_tokens(logits, settings, uniforms[rows])
        if lengths is not None:
            forced = torch.cat([lengths, lengths.new_zeros(R - n)])
            token = torch.where(forced[rows] == t + 1, eos[0], token)
        completions[rows, t] = token.masked_fill(done, pad_id)
        logps[rows, t] = logp.masked_fill(done, 0.0)
        ended = torch.isin(token, eos)
        if compiled is not None:
            done |= ended
        elif ended.any():  # they leave the batch
            stay = (~ended).nonzero().squeeze(1)
            rows, token, mask, position, done = (
                rows[stay],
                token[stay],
                mask[stay],
                position[stay],
                done[stay],
            )
            cache.reorder_cache(stay)
        if t == C - 1 or rows.numel() == 0 or bool(done.all()):
            break
        logits = step(token[:, None], mask, position, cache)
        position = position + 1
    return completions[:n, : t + 1], logps[:n, : t + 1]


def decode_completions(tokenizer, completion_ids, mask):
    """Texts for the reward functions: each completion up to its EOS, special tokens dropped."""
    lengths = mask.sum(1).tolist()
    return tokenizer.batch_decode(
        [ids[:n] for ids, n in zip(completion_ids.tolist(), lengths)], skip_special_tokens=True
    )


def prompt_limit(model, settings):
    """The most tokens a prompt keeps: --max-prompt-length, else the model's context minus max_new_tokens."""
    context = getattr(model.config, "max_position_embeddings", None)
    return settings.max_prompt_length or (context - settings.max_new_tokens if context else None)


def sample_rollouts(model, tokenizer, prompts, settings, group_size, amp=None, lengths=None):
    """The prompts (strings), tokenized once, and G completions of each: Rollouts on the model's device. lengths:
    bench.py's forced completion lengths (decode()); None in training."""
    device = next(model.parameters()).device
    eos = eos_token_ids(model, tokenizer)
    # [B, P]
    prompt_ids, prompt_mask = tokenize_prompts(
        tokenizer, prompts, device, prompt_limit(model, settings)
    )
    # [B*G, C]
    completion_ids = generate(
        model,
        prompt_ids,
        prompt_mask,
        settings,
        group_size,
        eos,
        tokenizer.pad_token_id,
        amp,
        lengths,
    )
    mask = grpo.completion_mask(completion_ids, eos)  # [B*G, C]
    attention_mask = torch.cat([prompt_mask.repeat_interleave(group_size, dim=0), mask], dim=1)
    truncated = ~torch.isin(completion_ids, torch.tensor(eos, device=device)).any(1)  # [B*G]
    sequences = torch.cat([prompt_ids.repeat_interleave(group_size, dim=0), completion_ids], dim=1)
    return Rollouts(
        sequences,
        attention_mask,
        mask,
        decode_completions(tokenizer, completion_ids, mask),
        group_size,
        settings.temperature,
        truncated,
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
        truncated=None if rollouts.truncated is None else rollouts.truncated[rows],
    )


def concat_rollouts(parts):
    """One Rollouts from several (of the same G and temperature): prompts left-padded to the longest, completions
    right-padded to the longest (padding is masked out: attention 0, completion mask 0)."""
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

    return Rollouts(
        torch.cat([pad(r, r.input_ids, 0) for r in parts]),
        torch.cat([pad(r, r.attention_mask, 0) for r in parts]),
        torch.cat(
            [
                torch.nn.functional.pad(r.completion_mask, (0, C - r.completion_mask.shape[1]))
                for r in parts
            ]
        ),
        [t for r in parts for t in r.texts],
        parts[0].group_size,
        parts[0].temperature,
        torch.cat([r.truncated for r in parts]),
    )


# ----------------------------------------------------------------------------------------------------------------------
# Log-probs: log π(o_t | q, o_<t) of the sampled tokens, without [N, C, V] logits for Llama-style heads.


def _chosen_logprobs(logits, targets, temperature, chunk_size, with_entropy=True):
    """(log softmax(logits / temperature)[target], entropy of that softmax) for logits [M, V], targets [M], chunk_size
    rows at a time: [M] each, the entropy without grad (zeros, not computed, when with_entropy is False).

    The chosen logit minus the logsumexp: only a [chunk_size, V] fp32 temporary exists at a time, never the full
    fp32 [M, V] log-softmax. With grad, each chunk is recomputed in backward instead of keeping its fp32 copy.
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
    """H = -Σ p log p of softmax(logits [n, V]), per row: logsumexp - Σ p · logits (lse: the rows' logsumexp)."""
    lse = torch.logsumexp(logits, dim=-1) if lse is None else lse
    return lse - (torch.exp(logits - lse[:, None]) * logits).sum(-1)


class _LinearLogprobs(torch.autograd.Function):
    """log softmax(h Wᵀ / temperature)[target] for hidden states h [M, H] and an lm-head weight W [V, H],
    computed chunk by chunk, recomputing each chunk's logits in backward: [M, V] logits never exist. The entropy of
    each row's softmax comes with it, from the same chunks (a second output, without grad).
    Under autocast the matmuls run in the autocast dtype, as the model's own lm-head would, in forward and in
    backward alike, so backward recomputes exactly the logits forward saw."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy=True):
        device = hidden.device.type
        dtype = (
            torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        )
        out = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        lse, entropy = torch.empty_like(out), torch.zeros_like(out)
        with torch.autocast(device, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            for s in range(0, h.shape[0], chunk_size):
                logits = (h[s : s + chunk_size] @ w.T).float() / temperature  # [chunk, V]
                lse[s : s + chunk_size] = torch.logsumexp(logits, dim=-1)
                out[s : s + chunk_size] = logits.gather(
                    -1, targets[s : s + chunk_size, None]
                ).squeeze(-1)
                if with_entropy:  # not for π_ref's pass, where nothing reads it
                    entropy[s : s + chunk_size] = _entropy(logits, lse[s : s + chunk_size])
        # The last chunk's logits are kept for backward, which starts with it: a batch that fits in one chunk (a
        # typical micro-batch) is never recomputed, at the cost of holding one [chunk, V] block until backward.
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
        grad_weight = (
            torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        )
        with torch.autocast(device, enabled=False):
            h, w = hidden.to(ctx.dtype), weight.to(ctx.dtype)
            starts = list(range(0, h.shape[0], size))
            for s in reversed(starts):
                logits = (
                    last if s == starts[-1] else (h[s : s + size] @ w.T).float() / ctx.temperature
                )
                # d logp / d logits = onehot(target) - softmax, times the incoming gradient and 1/temperature
                grad_logits = -torch.exp(logits - lse[s : s + size, None])
                grad_logits.scatter_add_(
                    -1, targets[s : s + size, None], torch.ones_like(grad_logits[:, :1])
                )
                grad_logits = (grad_logits * (grad_out[s : s + size, None] / ctx.temperature)).to(
                    ctx.dtype
                )
                if grad_hidden is not None:
                    grad_hidden[s : s + size] = grad_logits @ w
                if grad_weight is not None:
                    grad_weight += (grad_logits.T @ h[s : s + size]).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


# Architectures whose logits are exactly lm_head(final hidden state): no soft-capping, no logit scaling, no bias.
PLAIN_HEAD_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


def _plain_linear_head(model):
    """The lm-head Linear when the model's logits are exactly hidden @ Wᵀ, else None (use the logits path)."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    if (
        getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES
        or not isinstance(head, torch.nn.Linear)
        or head.bias is not None
        or getattr(model, "model", None) is None
    ):
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    # FSDP2: only the model's own forward gathers a sharded head
    if type(head.weight).__name__ == "DTensor":
        return None
    return head


def _features(
    model,
    input_ids,
    attention_mask,
    position_ids,
    num_positions,
    use_cache=False,
    past_key_values=None,
):
    """Run the model; return (features of the last num_positions positions, plain lm-head or None, cache).

    For plain-head models the features are final hidden states [N, k, H] (the head is applied chunk by chunk
    later); otherwise they are logits [N, k, V], asked for with logits_to_keep so no more are computed.
    """
    head = _plain_linear_head(model)
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
    )
    # --compile: the same forward, compiled
    compiled = getattr(COMPILED.get(id(model)), "body", None)
    if head is not None:
        out = (model.model if compiled is None else compiled)(**kwargs)
        features = out.last_hidden_state[:, out.last_hidden_state.shape[1] - num_positions :]
    else:
        out = (model if compiled is None else compiled)(**kwargs, logits_to_keep=num_positions)
        features = out.logits[:, out.logits.shape[1] - num_positions :]
    return features, head, getattr(out, "past_key_values", None)


def _logprobs(features, head, targets, temperature, chunk_size, with_entropy):
    """([N, k] log-probs of targets [N, k], [N, k] entropies (zeros unless with_entropy)) from _features' output."""
    n, k = targets.shape
    flat = features.reshape(n * k, features.shape[-1])
    if head is not None:
        logps, entropy = _LinearLogprobs.apply(
            flat, head.weight, targets.reshape(-1), temperature, chunk_size, with_entropy
        )
    else:
        logps, entropy = _chosen_logprobs(
            flat, targets.reshape(-1), temperature, chunk_size, with_entropy
        )
    return logps.view(n, k), entropy.view(n, k)


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
    """[N, C] fp32 log π(o_t | q, o_<t) of the last C = num_completion_tokens tokens of input_ids [N, P + C]; with
    entropy=True also [N, C] H(π(· | q, o_<t)), the entropy of the distribution each token was drawn from (no grad).

    The logits are divided by the sampling temperature: these are the tempered softmax's probabilities (before
    any top-k / top-p truncation, as in TRL), the distribution generation sampled from when those are off.
    Position ids come from the attention mask, so left-padded rows see the positions generation gave them.
    group_size=G > 1 says rows come group after group and each group's G rows share one prompt (the first
    P columns): each prompt then runs through the model once and its KV cache is repeated G times, instead of
    recomputing it G times; gradients flow back through the cache. Models whose cache cannot be repeated fall
    back to the plain path. For Llama-style heads no [N, C, V] logits tensor is ever built (chunked lm-head).
    """
    n, length = input_ids.shape
    c = num_completion_tokens
    if not 0 < c < length:
        raise ValueError(
            f"num_completion_tokens must be in [1, {length - 1}] for inputs of length {length}, got {c}"
        )
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} rows cannot be split into groups of {group_size}")
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # [N, P + C]
    targets = input_ids[:, -c:]  # [N, C]
    p = length - c
    # Gradient checkpointing turns the cache off in training, so the shared-prompt path cannot run there.
    # Under FSDP2 every rank must run the same forwards: the plain path (one forward) whatever its completions' length.
    if group_size > 1 and not is_checkpointing(model) and not is_sharded(model):
        # Each prompt once: [B, P]. Its last position predicts every row's first completion token.
        first, head, cache = _features(
            model,
            input_ids[::group_size, :p],
            attention_mask[::group_size, :p],
            position_ids[::group_size, :p],
            1,
            use_cache=True,
        )
        if cache is not None and hasattr(cache, "batch_repeat_interleave"):
            # [N, 1] each
            first = _logprobs(
                first.repeat_interleave(group_size, dim=0),
                head,
                targets[:, :1],
                temperature,
                chunk_size,
                entropy,
            )
            if c == 1:
                return first if entropy else first[0]
            cache.batch_repeat_interleave(group_size)  # [B, ...] -> [B*G, ...]
            # Completion tokens 0..C-2 predict tokens 1..C-1, attending to the cached prompt and each other.
            rest, head, _ = _features(
                model,
                input_ids[:, p:-1],
                attention_mask[:, :-1],
                position_ids[:, p:-1],
                c - 1,
                use_cache=True,
                past_key_values=cache,
            )
            rest = _logprobs(rest, head, targets[:, 1:], temperature, chunk_size, entropy)
            logps, entropies = (torch.cat(pair, dim=1) for pair in zip(first, rest))
            return (logps, entropies) if entropy else logps
    # Plain path: positions P-1 .. P+C-2 predict the C completion tokens.
    features, head, _ = _features(
        model, input_ids[:, :-1], attention_mask[:, :-1], position_ids[:, :-1], c
    )
    logps, entropies = _logprobs(features, head, targets, temperature, chunk_size, entropy)
    return (logps, entropies) if entropy else logps

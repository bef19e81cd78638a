"""The decode engine behind sampling.sample_groups (plain_decode) and sampling.sample_rollouts
(lean_decode): G completions of each prompt, fast.

lean_decode  a short loop over the model's forward: a static KV cache written in place (KVCache),
             each prompt prefilled once and its cache copied to its G rows, tokens drawn among the
             top-k / top-p survivors by one uniform per row, finished rows leaving the batch
generate     lean_decode() where it can run, else transformers' generate() (beam search, FSDP2)
plain_decode lean_decode without the trainer's options (tools, kept log-probs, --compile): what
             train.py runs, the same tokens
graphs       the decode step captured as a CUDA graph, replayed for every token (GraphStep), with
             no compiler
fused        the decoder layers through one compiled graph shared by every layer (FusedStep), that
             step captured as graphs is: the default on CUDA (on the CPU compiled, not captured)
--compile    the decode step compiled for a few planned shapes (plan_decode), reading a twin of the
             model whose Linear weights are already in the compute dtype (decode_twin)
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
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StaticCache
from transformers.modeling_outputs import CausalLMOutputWithPast


@torch.no_grad()
def plain_decode(model, prompt_ids, prompt_mask, settings, group_size, eos_ids, pad_id):
    """G completions of each prompt as train.py draws them: [B*G, C] token ids, pad after EOS, C
    the longest. lean_decode() without the trainer's options (no tools, no kept log-probs, not
    compiled), spelled out: the same tokens from the same random numbers, bit for bit
    (tests/test_sampling.py). Each prompt is prefilled once into a preallocated KV cache, copied to
    its G rows; each step draws one token per row (sample_tokens: temperature, top-k, top-p), and a
    row that wrote EOS leaves the batch. A model without a static cache goes to generate(), and so
    do the CUDA-graph decodes (--decode graphs, and fused, CUDA's default: its GraphStep)."""
    if not uses_lean_decode(model, settings) or settings.graphs or settings.fused:  # via generate()
        return generate(model, prompt_ids, prompt_mask, settings, group_size, eos_ids, pad_id)
    (B, P), G, C, device = prompt_ids.shape, group_size, settings.max_new_tokens, prompt_ids.device
    n, key, was_training = B * G, cache_keyword(model), model.training
    model.eval()
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, C)], dim=1)  # causal: 1 from the start
    pos = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, P], as generate() has them
    cache = KVCache(model.config, P + C, compute_dtype(device))
    inputs = dict(input_ids=prompt_ids, attention_mask=mask[:, :P], position_ids=pos)
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        inputs["logits_to_keep"] = 1  # [B, 1, V], not [B, P, V]
    logits = model(**inputs, use_cache=True, **{key: cache}).logits[:, -1]  # [B, V]
    group = torch.arange(B, device=device).repeat_interleave(G)  # [B*G]: each row's prompt
    cache.reorder_cache(group)  # each prompt's cache copied to its G rows
    logits, mask, pos = logits[group], mask[group], pos[group, -1:] + 1
    completions = torch.full((n, C), pad_id, dtype=torch.long, device=device)
    rows = torch.arange(n, device=device)  # the rows still in the batch
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    for t in range(C):
        uniforms = torch.rand(n, 1, device=device)  # one per row, used by the rows still in
        token = sample_tokens(logits, settings, uniforms[rows])[0]  # [rows]
        completions[rows, t] = token
        ended = torch.isin(token, eos)
        if ended.any():  # they leave the batch, and their cache rows with them
            stay = (~ended).nonzero().squeeze(1)
            rows, token, mask, pos = (x[stay] for x in (rows, token, mask, pos))
            cache.reorder_cache(stay)
        if t == C - 1 or rows.numel() == 0:
            break
        inputs = dict(input_ids=token[:, None], attention_mask=mask, position_ids=pos)
        logits = model(**inputs, use_cache=True, **{key: cache}).logits[:, -1]  # [rows, V]
        pos = pos + 1
    model.train(was_training)
    return completions[:, : t + 1]


def generate(
    model, prompt_ids, prompt_mask, settings, group_size, eos_ids, pad_id, tools=None, record=None
):
    """G completions of each prompt, group after group: [B*G, C] token ids, pad after EOS, C the
    longest. lean_decode() where uses_lean_decode() allows; otherwise one generate() call
    (num_return_sequences=G, or the G best of K beams). In the autocast the caller set up, if any
    (sampling.sample_rollouts: the run's compute dtype). tools: a tools.ToolSession, whose results
    lean_decode forces into the rows that call a tool; record: a dict lean_decode fills with each
    sampled token's log-probs (generate() can do neither: a UserError)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        if uses_lean_decode(model, settings):
            out = lean_decode(
                model, prompt_ids, prompt_mask, settings, group_size, eos_ids, pad_id, tools, record
            )
        elif tools is not None or record is not None:
            from support.errors import UserError

            what = (
                "--tool needs the lean decode (support/decode.py) to write a tool's result into a "
                "completion"
                if tools is not None
                else "--sampler-correction and --log-mismatch need the lean decode "
                "(support/decode.py) to keep each sampled token's log-prob"
            )
            raise UserError(
                f"{what}, and this model cannot take it: transformers cannot run it with a static "
                "cache. Drop the flag, or use a model that can (Llama, Qwen, Mistral, ...)."
            )
        else:
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


def uses_graphs(settings, device):
    """Whether lean_decode() replays its step as a CUDA graph (GraphStep): --decode graphs, or
    --decode fused (its compiled step captured; the default on CUDA, config.py), and a CUDA
    device."""
    graphs = settings.graphs or settings.fused
    return graphs and torch.device(device).type == "cuda"


def static_layers(model):
    """Whether every layer of this model's static cache keeps its state on the device, as a CUDA
    graph needs (StaticLayer: the write position is a tensor). A sliding-window layer picks its
    branch from a Python int (transformers' StaticSlidingWindowLayer), which a replay would not
    update: those models decode eagerly, said once."""
    if not any(getattr(layer, "is_sliding", False) for layer in KVCache(model.config, 1).layers):
        return True
    if not GraphStep.warned:
        GraphStep.warned = True
        print(
            "warning: this model's KV cache has sliding-window layers, whose position a CUDA graph "
            "cannot replay: decoding eagerly",
            file=sys.stderr,
            flush=True,
        )
    return False


def uses_lean_decode(model, settings):
    """Whether lean_decode() runs this model: sampling or greedy (beam search stays with
    generate()), whole weights (under FSDP2 generate() keeps the processes in lockstep), and a
    model transformers can run with a static cache."""
    static = getattr(model, "_can_compile_fullgraph", False)  # transformers' static-cache models
    return settings.num_beams == 1 and not is_sharded(model) and static


@torch.no_grad()
def lean_decode(
    model, prompt_ids, prompt_mask, settings, group_size, eos_ids, pad_id, tools=None, record=None
):
    """The lean decode path, a short loop over the model's forward in place of generate():
    [B*G, C] completions, pad after EOS, C <= max_new_tokens the longest.
      - the KV cache is preallocated (KVCache) in the compute dtype and written in place, never
        grown by concatenation;
      - each prompt is prefilled once, and its cache copied to its G rows;
      - tokens are drawn among the top-k / top-p survivors only (sample_tokens);
      - a row leaves the batch (its cache rows are dropped) once it has written EOS, so finished
        rows cost nothing. Compiled (compile_model), shapes stay fixed instead: the rows are
        padded to a planned count (plan_decode), and finished rows run on, writing pad, until all
        are done. With CUDA graphs (settings.graphs, on CUDA: GraphStep) the rows stay fixed too,
        at n, and the step is captured once per call and replayed for every later token.
    tools (a tools.ToolSession): a row with tool-result tokens queued takes the next one instead of
    its sample (forced tokens are data, not new shapes); a forced token never ends a row; after
    each step the session looks for calls in what the rows sampled and queues their results.
    record (a dict): filled with "drawn" [B*G, C], each sampled token's fp32 log-prob under the
    distribution it was drawn from (after temperature, top-k and top-p), and "log_kept" [B*G, C],
    the log of the probability mass top-k / top-p left (0: nothing cut); so log π_sampler of the
    full tempered softmax is drawn + log_kept. 0 on forced tokens and after EOS. Off (None): not
    computed."""
    (B, P), G, C, device = prompt_ids.shape, group_size, settings.max_new_tokens, prompt_ids.device
    n, dtype, compiled = B * G, compute_dtype(device), COMPILED.get(id(model))
    fused = compiled is None and uses_fused(model, settings, device)
    graphed = compiled is None and uses_graphs(settings, device) and static_layers(model)
    if compiled is not None:
        net, step = compiled_decoder(model, dtype)
        R, L = compiled.shape(n, P + C)  # R >= n rows, L >= P + C
    elif graphed or fused:  # the twin and the graph live for this call only: memory goes back after
        net, R, L = model if dtype is None else decode_twin(model, dtype)[0], n, P + C
        step = FusedStep(net) if fused else None  # fused: the compiled layers, captured on CUDA
        step = GraphStep(net, dtype, step) if graphed else step
    else:
        net, R, L = model, n, P + C
        step = functools.partial(_decode_step, model, key=cache_keyword(model))
    fixed = compiled is not None or graphed or fused  # every row stays, finished or not
    # Every completion column is 1 from the start: causal masking hides the positions not yet
    # written.
    mask = torch.cat(
        [prompt_mask, prompt_mask.new_ones(B, C), prompt_mask.new_zeros(B, L - P - C)], dim=1
    )
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, P], as generate() has them
    prefill = KVCache(model.config, L, dtype)
    inputs = dict(input_ids=prompt_ids, attention_mask=mask[:, :P], position_ids=positions)
    if "logits_to_keep" in inspect.signature(net.forward).parameters:
        inputs["logits_to_keep"] = 1
    # [B, V]: each prompt once
    logits = net(**inputs, use_cache=True, **{cache_keyword(net): prefill}).logits[:, -1]
    group = torch.arange(B, device=device).repeat_interleave(G)  # [B*G]: each row's prompt
    group = torch.cat([group, group.new_zeros(R - n)])  # [R]: padding rows copy row 0
    cache = _grouped_cache(net, prefill, group, None if compiled is None else compiled.caches)
    logits, mask, pos = logits[group], mask[group], positions[group, -1:] + 1
    completions = torch.full((R, C), pad_id, dtype=torch.long, device=device)
    rows = torch.arange(R, device=device)  # the rows still in the batch
    done = torch.arange(R, device=device) >= n  # compiled: rows past their EOS (padding: all)
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    if record is not None:
        drawn, log_kept = torch.zeros(R, C, device=device), torch.zeros(R, C, device=device)
    for t in range(C):
        # Uniforms for every real row, used by the rows still in: compiled or not, a run draws the
        # same samples.
        drawn_now = torch.rand(n, 1, device=device)
        uniforms = torch.cat([drawn_now, drawn_now.new_zeros(R - n, 1)])
        token, logp, kept = sample_tokens(logits, settings, uniforms[rows], record is not None)
        forced = None
        if tools is not None:  # rows with a tool result to write take its next token instead
            token, forced = tools.force(rows, token, t)
        if record is not None:  # a sampled token's log-probs; 0 on forced and finished rows
            sampled = ~done if forced is None else ~done & ~forced
            drawn[rows, t] = torch.where(sampled, logp, 0.0)
            log_kept[rows, t] = torch.where(sampled, kept, 0.0)
        completions[rows, t] = token.masked_fill(done, pad_id)
        ended = torch.isin(token, eos) if forced is None else torch.isin(token, eos) & ~forced
        if tools is not None:  # calls closed at this step run now, their results queued
            tools.observe(rows, token, forced, done | ended, t)
        if fixed:
            done |= ended
        elif ended.any():  # they leave the batch
            stay = (~ended).nonzero().squeeze(1)
            rows, token, mask, pos, done = (x[stay] for x in (rows, token, mask, pos, done))
            cache.reorder_cache(stay)
        if t == C - 1 or rows.numel() == 0 or bool(done.all()):
            break
        logits = step(token[:, None], mask, pos, cache)
        pos = pos + 1
    if record is not None:
        record.update(drawn=drawn[:n, : t + 1], log_kept=log_kept[:n, : t + 1])
    return completions[:n, : t + 1]


def sample_tokens(logits, settings, uniforms=None, mass=False):
    """One token per row of logits [n, V], drawn as settings say, and its log-prob under the
    distribution it was drawn from: ([n] ids, [n] fp32 log-probs, [n] the log of the probability
    mass top-k / top-p kept of the tempered softmax, or None unless `mass`). Temperature, then
    top-k and top-p (top_k_then_top_p), then one uniform per row ([n, 1] in [0, 1), drawn here if
    not given) through the survivors' cumulative distribution (inverse-CDF sampling): no
    multinomial over the vocabulary. Temperature 0: the argmax (log-prob 0)."""
    n = logits.shape[0]
    if settings.temperature == 0:
        zeros = logits.new_zeros(n, dtype=torch.float32)
        return logits.argmax(-1), zeros, zeros if mass else None
    scores = logits.float() / settings.temperature
    values, indices = top_k_then_top_p(scores, settings.top_k, settings.top_p)
    logp = values.log_softmax(dim=-1)  # [n, m]
    cdf = logp.exp().cumsum(dim=-1)
    u = torch.rand(cdf.shape[0], 1, device=cdf.device) if uniforms is None else uniforms
    u = u * cdf[:, -1:]  # in [0, total): never past the end
    # [n, 1]: first cdf > u (p > 0)
    choice = torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[1] - 1)
    token = choice if indices is None else indices.gather(-1, choice)
    kept = None
    if mass:  # log Σ_survivors p: 0 when nothing was cut
        whole = indices is None
        kept = scores.new_zeros(n) if whole else values.logsumexp(-1) - scores.logsumexp(-1)
    return token.squeeze(-1), logp.gather(-1, choice).squeeze(-1), kept


def top_k_then_top_p(scores, top_k, top_p):
    """The tokens sampling may draw after top-k, then top-p (transformers' TopKLogitsWarper and
    TopPLogitsWarper, in that order), from tempered scores [n, V], without sorting the whole
    vocabulary when top-k is on: (values [n, m], indices [n, m]), values -inf where top-p dropped
    a survivor; indices None when nothing is cut (m = V, as given)."""
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
        # TopPLogitsWarper's rule, on the survivors: ascending order, drop the tokens whose
        # cumulative probability stays <= 1 - top_p, always keep the most likely one.
        values, indices = values.flip(-1), indices.flip(-1)  # ascending
        cumulative = values.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False
        values = values.masked_fill(remove, float("-inf"))
    return values, indices


class TemperatureTopKTopP(LogitsProcessor):
    """Temperature, then top-k, then top-p (top_k_then_top_p) as one transformers
    LogitsProcessor, for the paths that still run generate() (beam search, FSDP): the
    distribution of TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper in that order.
    The temperature is applied here because generate() runs a user's processors before its own
    warpers, and top-p depends on it. Scores [n, V] in, [n, V] out: the survivors keep logits /
    temperature, every other token gets -inf."""

    def __init__(self, temperature, top_k, top_p):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def __call__(self, input_ids, scores):
        values, indices = top_k_then_top_p(scores / self.temperature, self.top_k, self.top_p)
        if indices is None:
            return values
        return torch.full_like(scores, float("-inf")).scatter_(-1, indices, values)


class KVCache(StaticCache):
    """transformers' StaticCache (preallocated, written in place), its keys and values held in
    `dtype`, the compute dtype under autocast. With fp32 weights under autocast the rotary
    embedding leaves the keys in fp32 while v_proj gives bf16 values, and a StaticCache (before
    transformers 5.24) holds one dtype for both. Attention, an autocast op, reads both in the
    compute dtype anyway: storing them in it loses nothing and halves the cache. dtype None: as
    they come (fp32)."""

    def __init__(self, config, max_cache_len, dtype=None):
        super().__init__(config=config, max_cache_len=max_cache_len)
        self.compute_dtype = dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.compute_dtype is not None:
            key_states = key_states.to(self.compute_dtype)
            value_states = value_states.to(self.compute_dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _grouped_cache(model, prefill, group, reuse):
    """The B prompts' prefilled cache, repeated to their rows (group: each row's prompt). reuse
    (compiled): written in place into the one cache kept for this shape, so CUDA graphs find it
    at the same addresses at every call."""
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


def _decode_step(model, token, mask, position, cache, *, key):
    """One token per row through the model against its KV cache: the next logits [n, V]. key:
    cache_keyword(model), bound once outside the compiled step."""
    inputs = dict(input_ids=token, attention_mask=mask, position_ids=position, use_cache=True)
    return model(**inputs, **{key: cache}).logits[:, -1]


class GraphStep:
    """_decode_step as a CUDA graph, for one decode call (--decode graphs), or another step given
    (--decode fused, CUDA's default: FusedStep, compiled in the warm-up step, then captured).
    The eager decode of a 1.7B model is bound by its kernel launches, not by the bytes it reads
    (docs/gpu.md: 10x the bandwidth floor); replaying the step's kernels as one graph removes the
    launches, and needs no compiler: capturing is one more forward's worth of Python.

    Its first call is the decode's first step, run eagerly (on a side stream, as capture wants:
    cuBLAS and the allocator set up outside it); then the same step is captured, reading its
    token and positions from buffers of its own (the mask, fixed for the call: its own) and writing
    its logits into one. Every later
    call copies its inputs into those buffers and replays: the same kernels on the same KV cache,
    whose write position (StaticCache's cumulative_length) is a tensor the graph advances itself.
    Nothing of the step may read a value back to the CPU; transformers' static-cache decode does
    not (it is what torch.compile captures). Autocast's cast cache is off inside (a captured cast
    must not read a cached copy that autocast frees when its region ends); the twin's weights are
    already in the compute dtype, so nothing is cast per token anyway.

    A capture that fails (an op of the model that cannot be captured) leaves the call eager, with
    one warning per process. The graph, its memory pool and its buffers go when the call ends."""

    warned = False  # one warning per process for a failed capture

    def __init__(self, net, dtype, step=None):
        self.step = step or functools.partial(_decode_step, net, key=cache_keyword(net))
        self.dtype, self.graph = dtype, None
        self.inputs = self.logits = None

    def __call__(self, token, mask, position, cache):
        if self.logits is not None:  # captured: replay on this token (the mask never changes)
            for buffer, value in zip(self.inputs, (token, position)):
                buffer.copy_(value)
            self.graph.replay()
            return self.logits
        if self.graph is False:  # the capture failed: eager for the rest of the call
            return self.step(token, mask, position, cache)
        self.graph = self.graph or CudaGraph()
        with self.autocast(token.device):
            logits = self.graph.warm_up(lambda: self.step(token, mask, position, cache))
            self.inputs = [token.clone(), position.clone()]  # the mask: the call's own, fixed
            try:
                capture = lambda: self.step(self.inputs[0], mask, self.inputs[1], cache)  # noqa: E731
                self.logits = self.graph.capture(capture, logits)
            except torch.OutOfMemoryError:  # the run's own paragraph, not a fallback
                raise
            except Exception as e:  # noqa: BLE001 (whatever the capture refused: decode eagerly)
                self.graph, self.logits = False, None
                if not GraphStep.warned:
                    GraphStep.warned = True
                    print(
                        f"warning: the decode step could not be captured as a CUDA graph "
                        f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); decoding "
                        "eagerly (--decode eager says so up front)",
                        file=sys.stderr,
                        flush=True,
                    )
        return logits

    def autocast(self, device):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.dtype, cache_enabled=False)


# --decode fused: the torch.compile backend of the one compiled decoder layer (tests may set a
# counting backend), and the model types whose forward is embed_tokens, rotary_emb, the layers,
# norm and lm_head, nothing else (Gemma scales its embeddings, Cohere and Granite their logits:
# not these).
FUSED_BACKEND = "inductor"
FUSED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def fused_layout(model):
    """Whether FusedStep can run this model: a decoder of FUSED_TYPES (a LoRA model's base model
    too) whose layers are all of one class and all full attention, under sdpa or eager attention
    (the mask FusedStep builds is theirs)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config, body = inner.config, getattr(inner, "model", None)
    parts = ("embed_tokens", "rotary_emb", "layers", "norm")
    if config.model_type not in FUSED_TYPES or body is None or not hasattr(inner, "lm_head"):
        return False
    if not all(hasattr(body, part) for part in parts) or len(body.layers) == 0:
        return False
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    alike = len({type(layer) for layer in body.layers}) == 1 and kinds == {"full_attention"}
    return alike and config._attn_implementation in ("sdpa", "eager")


def uses_fused(model, settings, device):
    """Whether lean_decode() runs FusedStep (--decode fused): a model fused_layout() takes, with
    a static cache a CUDA graph can replay (static_layers(), which says so itself where not). A
    model of another layout decodes as --decode graphs would (eagerly on the CPU), said once."""
    if not settings.fused or FusedStep.failed is not None or not static_layers(model):
        return False
    if fused_layout(model):
        return True
    if not FusedStep.warned:
        FusedStep.warned = True
        cuda = torch.device(device).type == "cuda"
        print(
            f"warning: the fused decode runs the decoder layers of {'/'.join(FUSED_TYPES)} models "
            f"whose layers are all alike (sdpa or eager attention), not this "
            f"{type(model).__name__}: decoding {'with CUDA graphs' if cuda else 'eagerly'}",
            file=sys.stderr,
            flush=True,
        )
    return False


class LayerCache:
    """One layer's part of a KVCache, as that layer's attention sees it: update() writes this
    StaticLayer whatever layer_idx the attention passes, so the compiled layer reads no index, and
    one graph serves every layer (transformers' attention indexes the cache by self.layer_idx, a
    constant dynamo would specialize on: one graph per layer)."""

    def __init__(self, layer, dtype):
        self.layer, self.dtype = layer, dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.dtype is not None:  # as KVCache.update: held in the compute dtype
            key_states, value_states = key_states.to(self.dtype), value_states.to(self.dtype)
        return self.layer.update(key_states, value_states, *args, **kwargs)


def _layer_step(layer, hidden, mask, embeddings, cache, position, key):
    """One decoder layer on one token per row: what FusedStep compiles, once for every layer. key:
    the name the layer takes its cache under (cache_keyword)."""
    out = layer(
        hidden,
        attention_mask=mask,
        position_ids=position,
        use_cache=True,
        position_embeddings=embeddings,
        **{key: cache},
    )
    return out[0] if isinstance(out, tuple) else out


@functools.cache
def fused_layer(backend):
    """_layer_step compiled (the process's one, per backend): no CUDA graphs of its own (GraphStep
    captures the whole step), the rows and the cache length dynamic (FusedStep marks them), so one
    graph serves every layer, every call and every prompt length. fullgraph: a graph break raises
    while tracing, before any of the layer runs (without it dynamo would run the part before the
    break, the cache written, then compile the rest: a failure there could not be redone)."""
    return torch.compile(_layer_step, backend=backend, dynamic=None, fullgraph=True)


class FusedStep:
    """_decode_step with the decoder layers in a loop of our own (--decode fused): the embedding,
    the rotary embedding, each layer through fused_layer() (one compiled graph for all: each layer
    gets its LayerCache), the final norm and the lm-head. Inductor fuses each layer's small kernels
    (RMSNorm's, rotary's, the MLP's activation and product, the residual adds), which a CUDA graph
    of the eager step replays one by one (docs/gpu.md: 3.2x the bandwidth floor).

    The 4-D attention mask is built here from the call's 2-D mask [R, L] and the cache's write
    position (StaticLayer.cumulative_length, a device tensor: no host read, so GraphStep can
    capture the step): a row attends to the columns its 2-D mask keeps (a left-padded prompt's pad
    columns are 0) up to the column this token is written to, as transformers' create_causal_mask
    builds it (bool for sdpa; 0 or the dtype's min, added, for eager attention). The rows and the
    cache length are marked dynamic, so a new prompt length or row count compiles nothing."""

    warned = False  # one warning per process for a model of another layout
    failed = None  # why the one compile failed (said once): the process decodes as graphs does

    def __init__(self, net):
        self.net = net.get_base_model() if hasattr(net, "get_base_model") else net
        self.additive = self.net.config._attn_implementation == "eager"
        self.layer, self.key = fused_layer(FUSED_BACKEND), cache_keyword(net)
        self.layers_run = 0  # of this step's layers, run so far

    def __call__(self, token, mask, position, cache):
        """The fused step; where the compile fails (inductor needs Triton and a C compiler on
        CUDA), this step and every later one of the process run eagerly, said in one line. Dynamo
        raises its errors (TorchDynamoException) before the first layer runs: nothing of the cache
        is written yet, so the eager step redoes it from the start. Any other error is raised."""
        if FusedStep.failed is None:
            try:
                return self.fused(token, mask, position, cache)
            except torch._dynamo.exc.TorchDynamoException as e:
                if self.layers_run:  # past the compile: the cache is partly written
                    raise
                FusedStep.failed = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
                print(
                    f"warning: the fused decode could not be compiled ({FusedStep.failed}); "
                    "decoding as --decode graphs does (which says so up front)",
                    file=sys.stderr,
                    flush=True,
                )
        return _decode_step(self.net, token, mask, position, cache, key=self.key)

    def fused(self, token, mask, position, cache):
        body = self.net.model
        hidden = body.embed_tokens(token)  # [R, 1, H]
        columns = torch.arange(mask.shape[1], device=mask.device)
        write = cache.layers[0].cumulative_length  # where this token goes, the same for every row
        allowed = (mask.bool() & (columns <= write))[:, None, None, :]  # [R, 1, 1, L]
        if self.additive:
            low = torch.finfo(hidden.dtype).min
            allowed = torch.zeros_like(allowed, dtype=hidden.dtype).masked_fill_(~allowed, low)
        embeddings = body.rotary_emb(hidden, position)
        dynamic(hidden, position, *embeddings)
        dynamic(allowed, dims=(0, 3))
        self.layers_run = 0
        for layer, part in zip(body.layers, cache.layers):
            dynamic(part.keys, part.values, dims=(0, 2))
            part = LayerCache(part, cache.compute_dtype)
            hidden = self.layer(layer, hidden, allowed, embeddings, part, position, self.key)
            self.layers_run += 1
        return self.net.lm_head(body.norm(hidden))[:, -1]  # [R, V]


def dynamic(*tensors, dims=(0,)):
    """Mark these dimensions of these tensors dynamic for dynamo (the rows, the cache length): a
    hint, which a graph that needs a fixed size may still specialize."""
    for tensor in tensors:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


class CudaGraph:
    """What GraphStep needs of torch.cuda: a warm-up on a side stream, a capture (which runs
    nothing: fn's kernels are recorded, its output tensors are the graph's), and replays."""

    def warm_up(self, fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def capture(self, fn, like):
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (NCCL's watchdog under torchrun) do not break
        # the capture. (torch.cuda.graph also empties the allocator's cache on entry: a cost per
        # decode call, docs/gpu.md)
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            return fn()

    def replay(self):
        self.graph.replay()


def cache_keyword(model):
    """The name under which this model's forward takes its KV cache, and its output returns it:
    "cache" from transformers 5.24 (where "past_key_values" is deprecated, to be removed in 5.40,
    and warns at every call), "past_key_values" before. Read off the forward's signature (through
    torch.compile's wrapper and PEFT's); a forward taking only **kwargs: the name in transformers'
    own output class. Every forward with a cache, and every read of one, goes through this."""
    inner = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PeftModel
    parameters = inspect.signature(inner.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    fields = {field.name for field in dataclasses.fields(CausalLMOutputWithPast)}
    return "cache" if "cache" in fields else "past_key_values"


# --compile's state per model (sampling.compile_model): id(model) -> Compiled. The process's one
# registry, and global on purpose: the state follows the model object without becoming part of it
# (an attribute would travel with copy.deepcopy, the twin's and π_ref's, and a compiled module into
# the state dict). Each entry holds its model (through its callables), so no other model reuses an
# id here.
COMPILED = {}


@dataclass
class Compiled:
    """What torch.compile made of one model, and the decode shapes it may meet.

    The decode step is compiled for fixed shapes, one graph per (rows, cache length): `rows` and
    `length` are the planned ones (plan_decode), to which every call is padded, so a run compiles
    and keeps at most len(rows) graphs and KV caches. A call that fits no planned shape gets its
    own (rounded up: rows as they are, length to a multiple of 64), with a warning."""

    backend: object
    mode: str | None
    forward: object = None  # the log-prob passes' compiled forward (sampling.compile_model)
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


def compile_decode(model, backend="inductor", forward=None):
    """--compile: the decode step of this model is compiled at its first call, for fixed shapes
    against a static cache (CUDA graphs on a GPU: mode "reduce-overhead"); `forward`, the log-prob
    passes' compiled forward, is kept with it. Weights and state dict untouched."""
    mode = "reduce-overhead" if next(model.parameters()).is_cuda and backend == "inductor" else None
    COMPILED[id(model)] = Compiled(backend, mode, forward)


def compiled_forward(model):
    """The log-prob passes' compiled forward of `model` (--compile), or None."""
    compiled = COMPILED.get(id(model))
    return None if compiled is None else compiled.forward


def plan_decode(model, rows, length):
    """The decode shapes a compiled model will meet: each call's rows are padded up to the
    smallest of `rows` that holds them, and its cache is `length` positions long (the longest
    prompt + max_new_tokens). Nothing when the model is not compiled."""
    compiled = COMPILED.get(id(model))
    if compiled is not None:
        compiled.rows, compiled.length = tuple(sorted(set(rows))), length


def compiled_decoder(model, dtype):
    """(the model decode runs, its compiled step) for a compiled model: the twin under autocast,
    else the model."""
    compiled = COMPILED[id(model)]
    if dtype not in compiled.steps:
        twin, pairs = decode_twin(model, dtype) if dtype is not None else (model, [])
        step = torch.compile(
            functools.partial(_decode_step, twin, key=cache_keyword(twin)),
            backend=compiled.backend,
            mode=compiled.mode,
            dynamic=False,
        )
        compiled.steps[dtype] = (twin, pairs, step)
    twin, pairs, step = compiled.steps[dtype]
    refresh_twin(pairs)
    return twin, step


def decode_twin(model, dtype):
    """The model for a compiled decode under autocast: every Linear's weight (and bias) held in
    the compute dtype, what autocast casts it to at every use, so the captured step reads it as
    it is instead of casting each fp32 weight again at every token. Every other tensor
    (embeddings, norms, buffers) is the model's own, shared, not copied, so the twin computes
    exactly what the model computes under autocast. Costs 2 bytes per Linear parameter (a tied
    lm-head gets its own). Returns (twin, [(twin's tensor, model's)]) for refresh_twin."""
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
    """Copy the model's current Linear weights into its decode twin, in place (the captured
    graphs read them at the same addresses): one read of the fp32 weights per decode call."""
    for low, p in pairs:
        low.copy_(p)


def compute_dtype(device):
    """The autocast dtype in force for this device's type (bf16, fp16), or None outside autocast."""
    kind = torch.device(device).type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def is_sharded(model):
    """Whether the model's weights are sharded over processes (FSDP2: DTensors). Every process
    must then run each forward together: generate keeps stepping (synced_gpus) until every
    process's rows have finished."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def generation_config(settings, eos_ids, pad_id, num_return_sequences):
    """Every setting that could change the sampled distribution, stated; temperature, top-k and
    top-p are off here (TemperatureTopKTopP applies them)."""
    sample = settings.temperature > 0 and settings.num_beams == 1
    return GenerationConfig(
        do_sample=sample,
        temperature=1.0,
        top_k=0 if sample else None,  # unused unless sampling: set, generate() warns it is ignored
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
    """generate() fills every unset field of the GenerationConfig it is given from
    model.generation_config (suppress_tokens, bad_words_ids, min_p, ...). Set the checkpoint's
    aside for the call, so the library defaults are all it can fall back on."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved

"""The models of a run: π_θinit loaded by name or directory, the frozen reference π_ref
(Algorithm 1's lines 1 and 3), and LoRA adapters (peft, optional)."""

import contextlib
import copy
import os
import re
import time
import urllib.parse

import torch
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from support.errors import UserError

SMOLLM2_SHORT = re.compile(r"smollm2-(135m|360m|1\.7b)(-instruct)?", re.IGNORECASE)


def resolve_model_name(name):
    """--model as typed -> what from_pretrained gets: a local directory as is; a SmolLM2 short
    name ("SmolLM2-1.7B-Instruct", any case) -> "HuggingFaceTB/SmolLM2-1.7B-Instruct"; anything
    else (a hub id) as is."""
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)
    match = SMOLLM2_SHORT.fullmatch(name.strip())
    if match:
        return f"HuggingFaceTB/SmolLM2-{match.group(1).upper()}" + (
            "-Instruct" if match.group(2) else ""
        )
    return name


def load_model(name, trust_remote_code=False, check_config=None):
    """The fp32 causal LM and its tokenizer (left padding, a pad token), or a UserError saying
    what was tried. check_config(config, name): called on its config.json before the weights load
    (a UserError stops there). A Hub id is first asked for once (hub_unreachable): where the Hub
    cannot be reached, the model loads from the local Hugging Face cache alone, at once, instead of
    retrying each download, or fails with offline_message."""
    resolved = resolve_model_name(name)
    local = os.path.abspath(os.path.expanduser(name))
    t0 = time.time()
    # minutes for a large model (a first download, then reading the weights): never look hung
    print(f"loading {resolved} ...", flush=True)
    offline = None if os.path.isdir(local) else hub_unreachable(resolved)
    kw = dict(trust_remote_code=trust_remote_code, local_files_only=offline is not None)
    try:
        # offline: the cache alone (not every lookup passes local_files_only on: offline mode too)
        with hub_offline() if offline is not None else contextlib.nullcontext():
            tokenizer = AutoTokenizer.from_pretrained(resolved, **kw)
            model_config = AutoConfig.from_pretrained(resolved, **kw)
            if check_config is not None:
                check_config(model_config, name)
            model = AutoModelForCausalLM.from_pretrained(
                resolved, config=model_config, dtype=torch.float32, **kw
            )
    except UserError:
        raise
    except Exception as e:  # OSError (missing / offline), ValueError (unknown architecture), HFValidationError, ...
        reason = " ".join(str(e).split())[:400]
        if offline is not None:
            raise UserError(offline_message(name, resolved, local, offline, reason)) from None
        hub = "" if os.path.isdir(local) else f"; the Hugging Face hub id {resolved!r} ({reason})"
        raise UserError(
            f"could not load model {name!r}. Tried: the local directory {local} "
            f"({'exists, but loading failed: ' + reason if os.path.isdir(local) else 'not found'}){hub}. "
            "Pass a local directory holding config.json and the weights, a full hub id such as "
            "HuggingFaceTB/SmolLM2-1.7B-Instruct, or a SmolLM2 short name (SmolLM2-135M, SmolLM2-360M, SmolLM2-1.7B, "
            "each with or without -Instruct). On a machine without network, download the model elsewhere and pass its "
            "directory; models with custom code also need --trust-remote-code."
        ) from None
    count = sum(p.numel() for p in model.parameters())
    print(
        f"loaded {resolved}: {count / 1e9:.2f}B parameters in {time.time() - t0:.0f} s", flush=True
    )
    return model, prepare_tokenizer(tokenizer)


def prepare_tokenizer(tokenizer):
    """Left padding, so every prompt of a batch ends at the column where generation starts, and a
    pad token (EOS if the tokenizer has none)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def hub_unreachable(repo_id):
    """Why the Hugging Face Hub cannot serve `repo_id` (for messages), or None where it answers.
    One request for its config.json's metadata, without retries (timeout HUB_PROBE_TIMEOUT s):
    offline, the loaders would otherwise retry every file five times, a minute in all, before
    failing. HF_HUB_OFFLINE=1 (the Hub library's offline mode): no request at all. A name that is
    no valid Hub id: None, from_pretrained refuses it at once."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError:  # a path, say: no Hub id
        return None
    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    url = hf_hub_url(repo_id, "config.json")  # on HF_ENDPOINT, as every download of the load
    try:
        get_hf_file_metadata(url, timeout=HUB_PROBE_TIMEOUT)
    except HfHubHTTPError:  # the Hub answered (404: no such model, 401: a gated one...)
        return None
    except Exception as e:  # no answer: no DNS, a refused connection, a timeout, a proxy's error
        host = "{0.scheme}://{0.netloc}".format(urllib.parse.urlsplit(url))
        return f"{host}: {' '.join(str(e).split()) or type(e).__name__}"
    return None


@contextlib.contextmanager
def hub_offline():
    """The Hugging Face Hub library's offline mode (HF_HUB_OFFLINE=1, which it reads once, at
    import) for the block: every request it would make fails at once, and files come from the
    local cache. transformers asks the same switch (huggingface_hub.is_offline_mode)."""
    before, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


# Seconds hub_unreachable waits for the Hub's answer: its own default for metadata requests.
HUB_PROBE_TIMEOUT = 10


def offline_message(name, resolved, local, why, reason):
    """What a Hub id that could not load with the Hub unreachable (`why`) tried, and the fix.
    `reason`: the loader's error, from the local cache."""
    cache = constants.HF_HUB_CACHE.replace(os.path.expanduser("~"), "~", 1)
    cached = isinstance(try_to_load_from_cache(resolved, "config.json"), str)
    where = (
        f"loading it from the local cache ({cache}) failed: {reason}"
        if cached
        else f"the model is not in the local cache ({cache})"
    )
    return (
        f"could not load model {name!r}. Tried: the local directory {local} (not found); the "
        f"Hugging Face Hub id {resolved}, but the Hub cannot be reached ({why}) and {where}. Pass "
        "a directory holding the model (config.json, the tokenizer and the weights): --model "
        f"/path/to/dir (where there is network: hf download {resolved} --local-dir DIR, then "
        "copy DIR here), or run where the Hub can be reached."
    )


def check_context(max_new_tokens, max_prompt_length, config, name):
    """UserError when --max-new-tokens (with --max-prompt-length, if given) leaves no room for
    the prompt in the model's context (max_position_embeddings): prompts would be cut to nothing
    and the first forward would fail."""
    context = getattr(config, "max_position_embeddings", None)
    prompt = max_prompt_length or 1  # at least one prompt token before the completion
    if context is not None and max_new_tokens + prompt > context:
        given = f"--max-new-tokens {max_new_tokens}" + (
            f" + --max-prompt-length {max_prompt_length}" if max_prompt_length else " + a prompt"
        )
        raise UserError(
            f"{given} do not fit {name}'s context of {context} tokens (max_position_embeddings in its config). "
            f"Lower --max-new-tokens to at most {context - prompt}"
            + (" or --max-prompt-length" if max_prompt_length else "")
            + "."
        )


def reference_model(model, beta, dtype, device, copy_model=True):
    """π_ref: a frozen copy of the initial policy (eval mode, no grad), or None when β = 0 (no KL
    term, no reference model at all). copy_model=False freezes `model` itself (on --resume the
    policy is loaded from the checkpoint). Its parameters are stored in the autocast dtype, if
    any: it is never trained. Its buffers (the rotary embedding's inverse frequencies) stay fp32,
    as the policy's do: in bf16 they would turn every position's rotation angle by up to 0.4% and
    raise the KL floor between identical models. Cast before the move: no fp32 copy on the
    device."""
    if beta == 0:
        return None
    ref = copy.deepcopy(model) if copy_model else model
    ref.requires_grad_(False).eval()
    if dtype is not None:
        for p in ref.parameters():
            p.data = p.data.to(dtype)
    return ref.to(device)


def disable_dropout(model):
    """Turn off the model's own dropout, in place: every torch.nn.Dropout (p = 0) and every float
    attribute whose name ends in "dropout" (Llama, Qwen2 and others keep attention dropout as a
    float, `attention_dropout`, that they pass to the attention kernel in training mode, not as a
    module). With μ > 1, π_old's log-probs and π_θ's would otherwise come from different dropout
    masks, and the ratio of eq. 3 would be noise even before any update. peft's LoRA dropout is
    left as --lora-dropout set it (its default is 0). The saved config.json is not touched."""
    for name, module in model.named_modules():
        if "lora_dropout" in name:
            continue
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for attr, value in vars(module).items():
            if attr.endswith("dropout") and isinstance(value, float):
                setattr(module, attr, 0.0)


def add_lora(model, args, resume_dir=None):
    """--lora-rank: the PeftModel with LoRA adapters on --lora-target-modules (every other weight
    frozen), or, on --resume, with the checkpoint's adapter. peft is imported only here: it stays
    optional."""
    try:
        import peft
    except ImportError:
        raise UserError(
            "--lora-rank needs peft, which is not installed: pip install peft"
        ) from None
    targets = [t.strip() for t in args.lora_target_modules.split(",") if t.strip()]
    config = peft.LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha or 2 * args.lora_rank,
        lora_dropout=args.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    try:
        if resume_dir is not None:
            return peft.PeftModel.from_pretrained(
                model, os.path.join(resume_dir, "adapter"), is_trainable=True
            )
        return peft.get_peft_model(model, config)
    except (ValueError, RuntimeError, OSError) as e:  # no such module; an adapter for another model
        raise UserError(
            f"LoRA: {' '.join(str(e).split())[:300]} (--lora-target-modules {args.lora_target_modules}"
            + (f"; the adapter in {resume_dir}/adapter" if resume_dir else "")
            + ")."
        ) from None

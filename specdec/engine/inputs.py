"""What ``LLM`` is given, checked: the speculative config, the target, the tokenizer, prompts.

Each function raises TypeError/ValueError naming the argument, e.g.
``as_prompt_list("def f(x):") == ["def f(x):"]`` (one prompt, as in vLLM) and
``as_prompt_list(5)`` -> ``TypeError: prompts=5: must be a str, a list of token ids, a
{'prompt': str} / {'prompt_token_ids': [...]} dict, or a list of those``.
"""

import copy
import dataclasses
import json
from pathlib import Path

import torch

from specdec.checks import check_token_ids
from specdec.config import SpeculativeConfig
from specdec.distributed import TPContext
from specdec.engine.sequence import SamplingParams
from specdec.models import checkpoint
from specdec.models.layers.parallel import ExpertPlacement, shard_from
from specdec.models.registry import load_model

TARGET_METHODS = ("forward", "compute_logits", "kv_cache_spec")
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "default" / "target"


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """None, a SpeculativeConfig, a vLLM-style dict or its JSON -> a private SpeculativeConfig
    (the engine fills in defaults; the caller's object is never changed)."""
    if value is None:
        return None
    if isinstance(value, SpeculativeConfig):  # built anew: its fields checked again, as they
        return dataclasses.replace(copy.deepcopy(value))  # may have been set after it was made
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config={value!r} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise TypeError(f"speculative_config={value!r}: must be None, a dict, its JSON str or "
                        "a SpeculativeConfig")
    return SpeculativeConfig.from_dict(copy.deepcopy(value))


def load_target(model, target, tokenizer, dtype: torch.dtype, device: torch.device,
                tp: TPContext | None = None, experts: ExpertPlacement = ExpertPlacement()):
    """-> (target, tokenizer, model folder or None): ``target`` if given, else loaded from
    ``model`` (default: the embedded model) with the folder's tokenizer.json. ``tp`` (size >
    1) or ``experts`` (this rank's routed experts): this rank's shard (a folder: only its
    slices and experts are read; ``target``: sliced from it)."""
    tp = tp or TPContext()
    sharded = tp.size > 1 or experts.size > 1
    if model is not None and not isinstance(model, (str, Path)):
        raise TypeError(f"model={model!r}: must be a folder path (str or Path) or None")
    if target is not None:
        if not all(callable(getattr(target, m, None)) for m in TARGET_METHODS):
            raise TypeError(f"target={target!r}: must be a target model (with "
                            f"{', '.join(TARGET_METHODS)}; see specdec.models) or None")
        check_target_dtype(target, dtype)
        if sharded:
            target = shard_from(target, tp, experts)
    else:
        model = Path(model) if model is not None else DEFAULT_MODEL
        target = load_model(model, dtype=dtype, device=device, tp=tp, experts=experts)
        if tokenizer is None:
            tokenizer = checkpoint.load_tokenizer(model)
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)
    if tokenizer is not None and not (callable(getattr(tokenizer, "encode", None))
                                      and callable(getattr(tokenizer, "decode", None))):
        raise TypeError(f"tokenizer={tokenizer!r}: must be a folder holding tokenizer.json "
                        "(str or Path), a tokenizer with encode() and decode() (e.g. a "
                        "tokenizers.Tokenizer), or None")
    return target, tokenizer, (Path(model) if model is not None else None)


def load_tokenizer(path: str | Path):
    """``tokenizer=`` given as a path: a folder holding ``tokenizer.json`` (as vLLM's
    ``tokenizer=`` names a tokenizer folder), or that file itself."""
    file = Path(path)
    file = file / checkpoint.TOKENIZER_NAME if file.is_dir() else file
    if not file.is_file():
        raise ValueError(f"tokenizer={str(path)!r}: no {checkpoint.TOKENIZER_NAME} there; give "
                         "a folder holding one, the file, or a tokenizer object")
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for every parse error
        raise ValueError(f"tokenizer={str(path)!r}: {file} is not a readable tokenizer "
                         f"({e})") from None


def checkpoint_dtype(model) -> str | None:
    """The ``torch_dtype`` (transformers 5: ``dtype``) of the folder's config.json (default:
    the embedded model), e.g. "bfloat16"; None when it names none or cannot be read (loading
    the folder then says why)."""
    try:
        config = checkpoint.load_config(Path(model) if model is not None else DEFAULT_MODEL)
    except (ValueError, TypeError, OSError):
        return None
    value = config.get("torch_dtype") or config.get("dtype")
    return str(value).removeprefix("torch.") if value is not None else None


def main_dtype(target, default: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype of most of ``target``'s floating-point parameter elements."""
    numel: dict[torch.dtype, int] = {}
    for p in target.parameters():
        if p.is_floating_point():
            numel[p.dtype] = numel.get(p.dtype, 0) + p.numel()
    return max(numel, key=numel.get, default=default)


def check_target_dtype(target, dtype: torch.dtype) -> None:
    """Raise ValueError unless most of ``target``'s floating-point parameter elements are in
    ``dtype`` (the KV cache and the step buffers are; a few float32 router weights may stay)."""
    main = main_dtype(target, dtype)
    if main != dtype:
        raise ValueError(f"target: its parameters are {main}, dtype={dtype}: they must match "
                         f"(pass target.to({dtype}) or dtype={main})")


def as_prompt_list(prompts) -> list:
    """A str, a list of int token ids or a prompt dict is one prompt; a list/tuple of those
    is many."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts={prompts!r}: must be a str, a list of token ids, a "
                        "{'prompt': str} / {'prompt_token_ids': [...]} dict, or a list of those")
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]
    return list(prompts)


PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt / TokensPrompt


def unpack_prompt(name: str, prompt):
    """vLLM's prompt dicts -> what they hold: ``{"prompt": "x"}`` -> ``"x"``,
    ``{"prompt_token_ids": [1, 2]}`` -> ``[1, 2]``; anything else is returned as it is."""
    if not isinstance(prompt, dict):
        return prompt
    if len(prompt) != 1 or next(iter(prompt)) not in PROMPT_KEYS:
        raise ValueError(f"{name}: a prompt dict holds one key, 'prompt' (a str, vLLM's "
                         "TextPrompt) or 'prompt_token_ids' (a list of ints, TokensPrompt); "
                         f"got keys {sorted(map(str, prompt))}")
    (key, value), = prompt.items()
    if key == "prompt" and not isinstance(value, str):
        raise TypeError(f"{name}['prompt']={value!r}: must be a str")
    if key == "prompt_token_ids" and isinstance(value, str):
        raise TypeError(f"{name}['prompt_token_ids']={value!r}: must be a list of ints")
    return value


def encode_prompt(name: str, prompt, tokenizer, vocab_size: int) -> list[int]:
    """One prompt (a str, token ids, or a dict: ``unpack_prompt``) -> its token ids, each in
    ``[0, vocab_size)``, at least one."""
    prompt = ids = unpack_prompt(name, prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise TypeError(f"{name} is a str but the model has no tokenizer.json; pass token "
                            "ids (list[int])")
        ids = tokenizer.encode(prompt).ids
    ids = check_token_ids(name, ids, vocab_size)
    if not ids:
        raise ValueError(f"{name}={prompt!r} is empty: give at least one token")
    return ids


def sampling_params_per_prompt(n: int, sampling_params, kwargs: dict) -> list[SamplingParams]:
    """One SamplingParams per prompt from ``LLM.generate``'s arguments (see there): one for
    all, one per prompt, or built from the keyword arguments ``kwargs`` (None: not given)."""
    given = {k: v for k, v in kwargs.items() if v is not None}
    if isinstance(sampling_params, int):  # generate(prompts, 8): the older max_tokens form
        if "max_tokens" in given:
            raise TypeError("max_tokens given twice: positionally and as a keyword")
        given["max_tokens"] = sampling_params
        sampling_params = None
    if sampling_params is None:
        return [SamplingParams(**given)] * n
    if given:
        raise TypeError(f"give sampling_params or the keyword arguments "
                        f"{sorted(given)}, not both")
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, (list, tuple)):
        for i, p in enumerate(sampling_params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}]={p!r}: must be a SamplingParams")
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {n} "
                             "prompts: give one per prompt, or a single SamplingParams")
        return list(sampling_params)
    raise TypeError(f"sampling_params={sampling_params!r}: must be a SamplingParams, a list "
                    "of them (one per prompt), or None")

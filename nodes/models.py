"""Models and tokenizers: the embedded `builtin:tiny-lm` and any Hugging Face causal LM.

`builtin:<name>` (see `flowgraph.builtin_models`) is built on first use: a byte-level
BPE tokenizer trained here on a generated corpus, and a LlamaForCausalLM with seeded
random weights (`tiny-tied`: its LM head is its input embedding). Both are written
once with `save_pretrained` to `$FLOWGRAPH_CACHE/builtin/<name>` (default
`~/.cache/flowgraph/builtin/<name>`) and reloaded from there, so every process and
every executor sees the same weights and no machine needs a download. The cache is
built in a private temporary folder and published by an atomic rename: two processes
building at once both succeed, and a reader never sees a half-written folder.

Any other path goes to `from_pretrained` (a local folder or a hub id). A hub id is
looked up once, before `from_pretrained` (`_hub_source`): where the hub does not answer
(no network, `HF_HUB_OFFLINE`), its cached copy loads, or one error says so — never
Hugging Face's retries of every file, a minute and more before the same failure.

Notation: V vocabulary size (`vocab_size` of the config).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from flowgraph.builtin_models import (
    BUILTIN_MODELS,
    BUILTIN_PREFIX,
    TRAINED_BUILTINS,
    recipe_hash,
)
from flowgraph.errors import FlowgraphError
from flowgraph.paths import HUB_ID
from flowgraph.runs import export_command, is_run_dir, trained_lm

__all__ = [
    "CACHE_ENV",
    "SPECIAL_TOKENS",
    "build_tiny_tokenizer",
    "builtin_dir",
    "check_model_path",
    "load_model",
    "load_tokenizer",
]

CACHE_ENV = "FLOWGRAPH_CACHE"
"""Environment variable naming the cache root (default `~/.cache/flowgraph`)."""

SPECIAL_TOKENS = {
    "pad_token": "<|pad|>",
    "bos_token": "<|bos|>",
    "eos_token": "<|eos|>",
}
"""Special tokens of the built-in tokenizer; ids 0, 1, 2 in this order."""

_ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# One role token per message keeps an arithmetic prompt at ~6 tokens (P=16 fits).
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<|eos|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_SEED = 0
_WORDS = (
    "the of and to a in is it you that he was for on are with as I his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been "
    "now find any new work part take get place made live where after back little only round "
    "man year came show every good me give our under name very through just form sentence "
    "great think say help low line differ turn cause much mean before move right boy old too "
    "same tell does set three want air well also play small end put home read hand port "
    "large spell add even land here must big high such follow act why ask men change went "
    "light kind off need house picture try us again animal point mother world near build "
    "self earth father head stand own page should country found answer school grow study "
    "still learn plant cover food sun four between state keep eye never last let thought "
    "city tree cross farm hard start might story saw far sea draw left late run while press "
    "close night real life few north open seem together next white children begin got walk "
    "example ease paper group always music those both mark often letter until mile river car "
    "feet care second book carry took science eat room friend began idea fish mountain stop "
    "once base hear horse cut sure watch color face wood main enough plain girl usual young "
    "ready above ever red list though feel talk bird soon body dog family direct pose leave "
    "song measure door product black short numeral class wind question happen complete ship "
    "area half rock order fire south problem piece told knew pass since top whole king space "
    "heard best hour better true during hundred five remember step early hold west ground "
    "interest reach fast verb sing listen six table travel less morning ten simple several "
    "plus minus equals sum total result solve step therefore so"
)


def builtin_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """The folder holding `builtin:<name>`: `<cache root>/builtin/<name>` (a trained
    built-in: `<name>-<recipe hash>`)."""
    root = cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "flowgraph"
    folder = f"{name}-{recipe_hash(name)}" if name in TRAINED_BUILTINS else name
    return Path(root).expanduser() / "builtin" / folder


def _corpus() -> list[str]:
    """Digits, arithmetic and common English words, in a fixed order."""
    sums = [f"{a}+{b}={a + b}" for a in range(20) for b in range(20)]
    diffs = [f"{a}-{b}={a - b}" for a in range(20) for b in range(a + 1)]
    words = _WORDS.split()
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    return [*sums, *diffs, *lines, *(f"{w} {w.capitalize()}." for w in words), "#### 42"]


def build_tiny_tokenizer(cache_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE of `builtin:tiny-lm` (deterministic, < 1 s).

    Digits are split one per token (as LLaMA does), so every number spells the same way
    and `12` is two tokens; the BPE merges learn words and operators. Saved into
    `cache_dir` when one is given.
    """
    size = int(BUILTIN_MODELS["tiny-lm"]["vocab_size"])
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=[*SPECIAL_TOKENS.values(), *_ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, **SPECIAL_TOKENS)
    tok.add_special_tokens({"additional_special_tokens": list(_ROLE_TOKENS)})
    tok.chat_template = _CHAT_TEMPLATE
    if cache_dir is not None:
        tok.save_pretrained(cache_dir)
    return tok


def _build_builtin(name: str, target: Path) -> None:
    """Write tokenizer + seeded random model into `target` (a fresh folder)."""
    config: dict[str, Any] = dict(BUILTIN_MODELS[name])  # Hugging Face config kwargs
    if config.pop("model_type") != "llama":
        raise FlowgraphError(f"builtin:{name}: only llama configs can be built")
    tok = build_tiny_tokenizer(target)
    llama = LlamaConfig(
        **config,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    # fork_rng: the same weights for every caller, without touching the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = LlamaForCausalLM(llama)
    # transformers writes a model only on rank 0 of an initialized process group; an fsdp
    # rank or Ray worker building the cache (a node's first run) is any rank, and would
    # publish a folder holding the tokenizer alone
    model.should_save_on_this_rank = lambda is_main_process: True  # type: ignore[method-assign]
    model.save_pretrained(target)


def _ensure_builtin(name: str, cache_dir: str | Path | None, build: bool = True) -> Path:
    """Return the cached folder of `builtin:<name>`, building it once if needed. A
    trained built-in is trained by the executors before a run
    (`flowgraph.compilers.builtin_training`), not here: without `build`, the path it will have."""
    if name not in BUILTIN_MODELS and name not in TRAINED_BUILTINS:
        known = ", ".join(BUILTIN_PREFIX + n for n in (*BUILTIN_MODELS, *TRAINED_BUILTINS))
        raise FlowgraphError(f"unknown built-in model `{BUILTIN_PREFIX}{name}`; known: {known}")
    final = builtin_dir(name, cache_dir)
    if (final / "config.json").exists() or (not build and name in TRAINED_BUILTINS):
        return final
    if name in TRAINED_BUILTINS:
        raise FlowgraphError(
            f"`{BUILTIN_PREFIX}{name}` is trained on first use by `flowgraph run` (the SFT "
            f"graph of flowgraph.builtin_models.SFT_RECIPE) and is not in {final.parent} "
            f"yet: run a graph that uses it, or call "
            f"flowgraph.compilers.builtin_training.ensure_builtin({name!r})")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        _build_builtin(name, tmp)
        os.rename(tmp, final)  # atomic; fails if another process published first
    except OSError:
        if not (final / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final




def _resolve(path: str, cache_dir: str | Path | None, build: bool = True) -> str:
    """A loadable folder or hub id; a missing local path fails here, before any loading."""
    if path.startswith(BUILTIN_PREFIX):
        return str(_ensure_builtin(path[len(BUILTIN_PREFIX) :], cache_dir, build))
    if is_run_dir(path):  # `flowgraph run` loads its checkpoint (`from_run_dirs`), not this
        raise FlowgraphError(f"`{path}` is a flowgraph run dir, not a model folder (a run "
                             "loads its newest checkpoint's model); here, export it and give "
                             f"that folder: {export_command(path, trained_lm(path).name)}")
    if Path(path).expanduser().exists():
        return str(Path(path).expanduser())
    if not HUB_ID.match(path):
        builtins = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)
        raise FlowgraphError(
            f"model path `{path}` does not exist; give an existing local folder, a hub id "
            f"(`org/name`) or a built-in model ({builtins})"
        )
    return _hub_source(path)


HUB_PROBE_TIMEOUT_S = 5.0
"""How long the one look at the hub waits before it calls the hub unreachable."""


def _hub_source(hub_id: str) -> str:
    """What `from_pretrained` loads for `hub_id`: the id itself where the hub answers
    (it downloads, or checks its cache is current); where the hub does not answer, the
    cached snapshot's folder, or one error with the offline hint. One request decides:
    `from_pretrained` itself retries each file five times with back-off (~70 s for a
    tokenizer and its model) before it says the same."""
    from huggingface_hub import constants, get_session, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else None
    if why is None:
        try:
            get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
            return hub_id
        # refused, unreachable, no DNS, timed out, a bad proxy: the client's own error
        # types (httpx, httpx2 or requests, by huggingface_hub's version)
        except Exception as exc:
            why = f"{constants.ENDPOINT} does not answer ({type(exc).__name__}: {exc})"
    try:
        return snapshot_download(hub_id, local_files_only=True)
    except LocalEntryNotFoundError:
        raise FlowgraphError(
            f"model `{hub_id}` is no local folder, so it names a Hugging Face hub model, "
            f"and it is not in this machine's hub cache ({constants.HF_HUB_CACHE}); "
            f"{why}. Download it where there is a network (`hf download {hub_id}`, or "
            "`save_pretrained` to a folder) and copy the cache or the folder here, then "
            "give that folder's path — or set HF_ENDPOINT to a mirror this machine "
            "reaches") from None


def check_model_path(path: str, cache_dir: str | Path | None = None) -> None:
    """Fail fast, before anything loads, when `path` names no model (a trained built-in
    is not trained here)."""
    _resolve(path, cache_dir, build=False)


def load_model(
    path: str,
    *,
    dtype: torch.dtype | None = None,
    trainable: bool = False,
    cache_dir: str | Path | None = None,
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """A causal LM: `train()` with gradients if `trainable`, else frozen in `eval()`."""
    source = _resolve(path, cache_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or torch.float32,
                                                     attn_implementation=attn_implementation)
    except (OSError, ValueError) as exc:  # no such hub id, offline, or not a model folder
        raise FlowgraphError(f"cannot load model `{path}`: {exc}") from exc
    model.train(trainable)
    model.requires_grad_(trainable)
    return model


def load_tokenizer(path: str, cache_dir: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a model path; a missing pad token falls back to EOS. A trained
    built-in's tokenizer is its base's (training leaves it as it was), so reading one
    (`flowgraph check --data`) needs no training."""
    name = path.removeprefix(BUILTIN_PREFIX)
    if path.startswith(BUILTIN_PREFIX) and name in TRAINED_BUILTINS:
        path = BUILTIN_PREFIX + TRAINED_BUILTINS[name][0]
    source = _resolve(path, cache_dir)
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise FlowgraphError(f"cannot load the tokenizer of `{path}`: {exc}") from exc
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok

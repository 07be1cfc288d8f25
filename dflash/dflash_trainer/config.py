"""Run configuration: TOML sections mapped onto dataclasses; unknown keys and wrong types are errors.

`--config embedded` is the bundled default (configs/embedded.toml): a tiny target and data that
the trainer builds itself. `--set section.key=value` overrides any field from the command line.

Every field is checked against its declared type (an int is not a float, a bool is only true or
false, a list of ints holds ints) and against the range or choices its `Rule` declares, and
every problem is reported at once, each with the key that has it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

CONFIG_DIR = Path(__file__).parent / "configs"
DTYPE_NAMES = ("bfloat16", "float16", "float32")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Rule:
    """What a field allows beyond its type: ge/gt/le bound numbers (each element of a list), choices
    lists the allowed strings, path marks a filesystem path (a leading ~ expanded on loading; stored absolute
    or relative to the run dir)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] = ()
    path: bool = False


PATH = Rule(path=True)
POSITIVE = Rule(gt=0)
AT_LEAST_1 = Rule(ge=1)
AT_LEAST_2 = Rule(ge=2)
NOT_NEGATIVE = Rule(ge=0)
FRACTION = Rule(ge=0, le=1)
ADAM_BETA = Rule(ge=0, le=0.9999)  # 1 would divide AdamW's bias correction by zero
DTYPE = Rule(choices=DTYPE_NAMES)

# Upper bounds on counts of work: far above any real run, low enough that a typo (train.steps = 1e23, a
# context of 10^12 tokens) is refused before a start that could never finish.
MAX_STEPS = 100_000_000  # optimizer steps, and step intervals
MAX_TOKENS = 1 << 20  # tokens of one sequence: a context, a bucket, tokens to generate
MAX_ROWS = 65_536  # rows of a micro-batch, micro-batches per step, anchors per sequence
MAX_LAYERS = 1024  # layers of a model (and a layer index)
MAX_BLOCK = 1024  # tokens of one drafted block
MAX_PROCESSES = 4096  # ranks, worker processes, requests in flight
MAX_PROMPTS = 10_000_000  # prompts to evaluate or answer
MAX_SEED = 2**32 - 1  # a seed (anchors draw from seed * 1_000_003 + index: it must stay a 64-bit integer)
STEPS = Rule(ge=1, le=MAX_STEPS)
ROWS = Rule(ge=1, le=MAX_ROWS)
TOKENS = Rule(ge=2, le=MAX_TOKENS)
NEW_TOKENS = Rule(ge=1, le=MAX_TOKENS)
PROCESSES = Rule(ge=1, le=MAX_PROCESSES)
PROMPTS = Rule(ge=1, le=MAX_PROMPTS)
SEED = Rule(ge=0, le=MAX_SEED)

# What train.moments_dtype may be (AdamW's moments: fp32, or bf16 beside fp32 masters).
MOMENTS_DTYPE_NAMES = ("float32", "bfloat16")
# Where train.report_to may send the run's figures (infra/metrics.py), and the package (module and pip name
# alike) each needs: none of them but tensorboard is a dependency of the trainer.
TRACKER_NAMES = ("none", "tensorboard", "wandb", "mlflow")
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def missing_trackers(report_to: list[str]) -> list[tuple[str, str]]:
    """(tracker, its pip command) for each tracker named that is not installed."""
    import importlib.util

    return [(name, f"pip install {TRACKER_PACKAGES[name]}") for name in report_to
            if name in TRACKER_PACKAGES and importlib.util.find_spec(TRACKER_PACKAGES[name]) is None]

# What target.quantization may be (target/fp8.py: the target's decoder layers as FP8-dynamic GEMMs).
TARGET_QUANTIZATIONS = ("none", "fp8")

@dataclass
class TargetConfig:
    path: Annotated[str, PATH] = ""  # HF directory or hub id of the target; "embedded" builds the tiny one
    dtype: Annotated[str, DTYPE] = "bfloat16"  # the dtype the frozen target's weights and features run in
    # fp8: the decoder layers' GEMMs in FP8 (weights per channel, activations per token, as vLLM serves
    # *-FP8-dynamic checkpoints): features as an FP8-served target computes them, faster (target/fp8.py)
    quantization: Annotated[str, Rule(choices=TARGET_QUANTIZATIONS)] = "none"
    # Run the modelling code the target's directory ships (a family transformers lacks): opt-in, recorded
    trust_remote_code: bool = False


# What drafter.kind may be: z-lab's DFlash (DFlashDraftModel), DFlash 2 (DFlash2DraftModel) and speculators'
# DSpark (DSparkDraftModel).
DRAFTER_KINDS = ("dflash", "dflash2", "dspark")
# drafter settings only DFlash 2 reads: refused beside another kind, where they would silently do nothing.
DFLASH2_SETTINGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_loss_weight")
# and those only DSpark reads, alike
DSPARK_SETTINGS = ("markov_rank", "markov_head_type", "confidence_head_with_markov", "confidence_loss_weight")
KIND_SETTINGS = {"dflash2": (DFLASH2_SETTINGS, "a DFlash 2 setting"), "dspark": (DSPARK_SETTINGS, "a DSpark setting")}


@dataclass
class DrafterConfig:
    # dflash: full-attention Qwen3 layers, hard-label CE; dflash2: each layer convolved (grouped dynamic causal
    # convolutions around attention and the MLP) and a candidate selector re-ranking each position's top-k
    kind: Annotated[str, Rule(choices=DRAFTER_KINDS)] = "dflash"
    num_layers: Annotated[int, Rule(ge=1, le=MAX_LAYERS)] = 5  # decoder layers of the drafter
    block_size: Annotated[int, Rule(ge=2, le=MAX_BLOCK)] = 16  # tokens per block: one known token, then block_size - 1 drafted
    mask_token_id: Annotated[int | None, NOT_NEGATIVE] = None  # None: the tokenizer's mask token
    target_layer_ids: Annotated[list[int] | None, Rule(ge=0, le=MAX_LAYERS - 1)] = None  # None: the published rule
    intermediate_size: Annotated[int | None, Rule(ge=1, le=1 << 24)] = None  # MLP width; None: the target's
    gamma: Annotated[float | None, POSITIVE] = None  # None: 7 for B=16 (paper)
    # The block's embeddings unscaled (none: as vLLM and SGLang serve a drafter and SpecForge and speculators train
    # one; on Gemma 3 270M it gave 18% and 32% more tau than target, docs/performance.md) or scaled as the target
    # scales its own (target: Gemma's sqrt(hidden), Granite's multiplier; written to the drafter's config, which
    # only z-lab's package applies: docs/serving.md). The logit scales always follow the target
    embedding_scale: Annotated[str, Rule(choices=("target", "none"))] = "none"
    init_from: Annotated[str | None, PATH] = None  # an existing drafter directory to continue from
    # dflash2: causal taps of each convolution within a block (z-lab's conv_kernel_size)
    conv_kernel_size: Annotated[int, Rule(ge=1, le=MAX_BLOCK)] = 2
    # dflash2: hidden channels sharing one per-token kernel; must divide the hidden size
    conv_group_size: Annotated[int, Rule(ge=1, le=1 << 16)] = 16
    selector_rank: Annotated[int, Rule(ge=1, le=1 << 16)] = 256  # dflash2: rank of the selector's codebooks
    selector_top_k: Annotated[int, Rule(ge=1, le=1 << 16)] = 16  # dflash2: candidates re-ranked per position
    # dflash2: weight of the selector's CE beside the unary CE (speculators' selector_loss_alpha)
    selector_loss_weight: Annotated[float, NOT_NEGATIVE] = 1.0
    # dspark: rank of the Markov head's logit bias markov_w2(markov_w1[previous token]) (speculators' markov_rank)
    markov_rank: Annotated[int, Rule(ge=1, le=1 << 16)] = 256
    # dspark: vanilla, the bias alone; gated, gated by the position's hidden state (speculators' rnn head, whose
    # state starts at the anchor's slot, is not trained here)
    markov_head_type: Annotated[str, Rule(choices=("vanilla", "gated"))] = "vanilla"
    # dspark: the confidence head reads the previous token's Markov embedding beside the hidden state
    confidence_head_with_markov: bool = True
    # dspark: weight of the confidence head's BCE against each position's acceptance (speculators'
    # confidence_head_alpha)
    confidence_loss_weight: Annotated[float, NOT_NEGATIVE] = 1.0


@dataclass
class DataConfig:
    train: Annotated[list[str], PATH] = field(default_factory=list)  # training data: files, globs or hub datasets
    eval: Annotated[list[str], PATH] = field(default_factory=list)  # held-out data for tau; empty: split from train
    max_length: Annotated[int, TOKENS] = 3072  # tokens per training row; longer rows are cut
    # tokens: each row is padded to the next bucket (one compiled shape each); the last >= max_length
    context_buckets: Annotated[list[int], TOKENS] = field(default_factory=lambda: [512, 1024, 2048, 3072])
    num_proc: Annotated[int | None, PROCESSES] = None  # processes tokenizing the data; None: this process alone
    features_dir: Annotated[str | None, PATH] = None  # offline mode: features dumped with --dump-features
    # An assistant turn's reasoning text (reasoning_content / reasoning / thinking): keep passes it to the chat
    # template as reasoning_content (rendered where the template renders it), drop leaves it out
    reasoning: Annotated[str, Rule(choices=("keep", "drop"))] = "keep"


@dataclass
class ParallelConfig:
    target_ranks: Annotated[int, Rule(ge=0, le=MAX_PROCESSES)] = 0  # processes running the frozen target (torchrun --nproc-per-node = T + D)
    drafter_ranks: Annotated[int, PROCESSES] = 1  # processes training the drafter
    # GPUs per target: the target ranks form groups of target_tp, each holding one target sharded with tensor
    # parallelism (for targets larger than one GPU); target_ranks must be a multiple of it
    target_tp: Annotated[int, PROCESSES] = 1
    # ddp: a full copy per drafter rank; fsdp: split across them (distributed/sharding.py)
    drafter_sharding: Annotated[str, Rule(choices=("ddp", "fsdp"))] = "ddp"
    prefetch: Annotated[int, Rule(ge=1, le=1024)] = 2  # micro-batches in flight per target -> drafter pair
    isolate_gpus: bool = True  # each worker sees its GPU as cuda:0: one compile cache for all ranks


@dataclass
class TrainConfig:
    steps: Annotated[int, STEPS] = 1000  # optimizer steps of the run
    # passes over data.train instead of train.steps (not both): steps = ceil(epochs x floor(usable rows /
    # micro_batch) / (grad_accum x drafter ranks)): an epoch is the whole micro-batches its rows fill (the
    # last partial one is left out, a new shuffle each epoch), printed at the start and recorded as train.steps
    epochs: Annotated[float | None, POSITIVE] = None
    micro_batch: Annotated[int, ROWS] = 1  # rows per micro-batch on each drafter rank
    grad_accum: Annotated[int, ROWS] = 1  # micro-batches per optimizer step on each drafter rank
    num_anchors: Annotated[int, ROWS] = 512  # blocks (random anchor positions) trained per row
    lr: Annotated[float, POSITIVE] = 6e-4  # peak learning rate of AdamW
    warmup_ratio: Annotated[float, FRACTION] = 0.04  # fraction of the steps spent warming the lr up linearly
    min_lr_ratio: Annotated[float, FRACTION] = 0.0  # the lr the cosine decay ends at, as a fraction of lr
    weight_decay: Annotated[float, NOT_NEGATIVE] = 0.0  # AdamW's decoupled weight decay
    adam_beta1: Annotated[float, ADAM_BETA] = 0.9  # AdamW's first-moment decay
    adam_beta2: Annotated[float, ADAM_BETA] = 0.95  # AdamW's second-moment decay (torch's default: 0.999)
    max_grad_norm: Annotated[float, POSITIVE] = 1.0  # gradients are clipped to this global L2 norm
    seed: Annotated[int, SEED] = 0  # seeds the drafter's init, the data order and the anchors
    dtype: Annotated[str, DTYPE] = "bfloat16"  # drafter parameters; the optimizer keeps fp32 masters
    # AdamW's two moments; bfloat16 halves their memory and the update's moment traffic (fp32 math and
    # masters still); needs low-precision parameters and no FSDP sharding (docs/configuration.md)
    moments_dtype: Annotated[str, Rule(choices=MOMENTS_DTYPE_NAMES)] = "float32"
    attention: Annotated[str, Rule(choices=("auto", "flex", "sdpa"))] = "auto"  # auto: flex on CUDA, sdpa on CPU
    # The loss per scored block position is a weighted sum of three terms: loss_ce, the cross-entropy on the
    # data's token; loss_kl, the KL divergence from the target's distribution to the drafter's; loss_tv, their
    # total variation (one minus the chance that speculative sampling accepts the drafted token). DSpark's
    # 0.1 CE + 0.9 TV is loss_ce = 0.1, loss_tv = 0.9. KL and TV read the target's logits at every block
    # position: the target then runs all its layers, and dumped features must hold its final hidden states
    loss_ce: Annotated[float, NOT_NEGATIVE] = 1.0
    loss_kl: Annotated[float, NOT_NEGATIVE] = 0.0  # weight of KL(target || drafter); see loss_ce
    loss_tv: Annotated[float, NOT_NEGATIVE] = 0.0  # weight of the total variation between the two; see loss_ce
    # How the block positions are weighted: exp-decay, exp(-(k-1)/drafter.gamma) by slot k (DFlash); dpace,
    # D-PACE's adaptive weights from the drafter's confidence in each slot's token (speculators' dpace): a slot
    # weighs as much as the run of accepted tokens it can still start
    position_weighting: Annotated[str, Rule(choices=("exp-decay", "dpace"))] = "exp-decay"
    dpace_alpha: Annotated[float, FRACTION] = 0.5  # D-PACE's confidence smoothing (position_weighting = dpace)
    loss_chunk_rows: Annotated[int, Rule(ge=1, le=1 << 24)] = 2048  # token rows per chunk of the LM head + CE
    compile_layers: bool = True  # flex backend: compile each drafter layer whole (fused norms/RoPE/SwiGLU), and the norms after fc and at the end
    log_every: Annotated[int, STEPS] = 10  # steps between progress lines and metrics
    checkpoint_every: Annotated[int, Rule(ge=0, le=MAX_STEPS)] = 500  # steps; 0: none (the final drafter is always saved)
    keep_last: Annotated[int, Rule(ge=1, le=10_000)] = 3  # checkpoints kept; older ones are removed
    compile_cache_dir: Annotated[str | None, PATH] = None  # compile cache; None: ~/.cache/dflash-trainer/compile-cache, shared by all runs
    # where the run's figures go (each an optional package but tensorboard): tensorboard (OUTPUT/tb), wandb,
    # mlflow (MLFLOW_TRACKING_URI), several at once, or ["none"]; dflash-eval --run logs to the same runs
    report_to: Annotated[list[str], Rule(choices=TRACKER_NAMES)] = field(default_factory=lambda: ["tensorboard"])
    wandb_project: str | None = None  # the W&B project when report_to has wandb (else WANDB_PROJECT, else wandb's)


@dataclass
class EvalConfig:
    prompts: Annotated[int, PROMPTS] = 16  # held-out prompts tau is measured on
    max_new_tokens: Annotated[int, NEW_TOKENS] = 128  # tokens decoded per prompt when measuring tau
    # tau before training: teacher-forced (an estimate from per-slot accuracy on held-out data, seconds) or
    # decode (speculative decoding of eval.prompts prompts, as after training: minutes at real shapes)
    before_training: Annotated[str, Rule(choices=("teacher-forced", "decode"))] = "teacher-forced"


# A hub repository a drafter is pushed to: "org/name" (a user's or an organisation's).
HUB_REPO = r"^[A-Za-z0-9][\w.-]*/[\w.-]+$"


@dataclass
class PublishConfig:
    # a hub repository ("org/name") the published drafter directory is uploaded to after training, every file in
    # it; huggingface_hub's own login (hf auth login, or HF_TOKEN) authorises it
    push_to: str | None = None
    private: bool = False  # a repository the push creates is private (an existing one keeps its visibility)


@dataclass
class RunConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    output_dir: Annotated[str, PATH] = "runs/default"  # the run directory: checkpoints, drafter/, summary.json

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def path_keys(cls=RunConfig, prefix: str = "") -> list[str]:
    """The dotted keys of every field that holds a filesystem path."""
    keys = []
    for f, hint, rule in _fields(cls):
        if dataclasses.is_dataclass(hint):
            keys += path_keys(hint, f"{prefix}{f.name}.")
        elif rule.path:
            keys.append(prefix + f.name)
    return keys


# ---- type and range checks ---------------------------------------------------------------------

def _fields(cls) -> list[tuple[dataclasses.Field, object, Rule]]:
    """(field, declared type, its Rule) for each field of a config dataclass."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        hint, rule = hints[f.name], Rule()
        if typing.get_origin(hint) is Annotated:
            hint, rule = typing.get_args(hint)[0], typing.get_args(hint)[1]
        out.append((f, hint, rule))
    return out


class _Mismatch(Exception):
    pass


def _optional(hint) -> tuple[object, bool]:
    """(the type inside `X | None`, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return inner[0], len(inner) < len(typing.get_args(hint))
    return hint, False


def _coerce(value, hint):
    """value as `hint` (an int is a fine float; a bool is never a number), or _Mismatch."""
    hint, nullable = _optional(hint)
    if value is None and nullable:
        return None
    if typing.get_origin(hint) is list:
        if not isinstance(value, list):
            raise _Mismatch
        return [_coerce(v, typing.get_args(hint)[0]) for v in value]
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise _Mismatch
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    raise _Mismatch


_NAMES = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("a string", "strings"),
          bool: ("true or false", "booleans")}
_EXAMPLES = {int: "[64, 128]", str: '["train.jsonl"]'}


def _describe(hint) -> str:
    hint, nullable = _optional(hint)
    if typing.get_origin(hint) is list:
        item = typing.get_args(hint)[0]
        text = f"a list of {_NAMES[item][1]}" + (f", e.g. {_EXAMPLES[item]}" if item in _EXAMPLES else "")
    else:
        text = _NAMES[hint][0]
    return text + (" (or null)" if nullable else "")


def _shown(value) -> str:
    return json.dumps(value, default=str) if not isinstance(value, dict) else "a table"


def _range_problem(value, rule: Rule) -> str | None:
    each = " (each element)" if isinstance(value, list) else ""
    for v in value if isinstance(value, list) else [value]:
        if v is None:
            continue
        if rule.choices and v not in rule.choices:
            return "must be one of " + ", ".join(rule.choices)
        if rule.ge is not None and v < rule.ge:
            return f"must be >= {rule.ge}{each}"
        if rule.gt is not None and v <= rule.gt:
            return f"must be > {rule.gt}{each}"
        if rule.le is not None and v > rule.le:
            return f"must be <= {rule.le}{each}"
    return None


def check_value(value, hint, rule: Rule) -> tuple[object, str | None]:
    """(value as its declared type, None), or (None, what is wrong with it): the one check every config key and
    every numeric command-line flag goes through (a finite number of the right type, within the rule's range; a
    path that is there: neither null where one is required nor an empty string)."""
    nullable = _optional(hint)[1]
    if value is None and not nullable:  # `--set key=null` on a key that must have a value
        return None, f"cannot be unset: give {'a path' if rule.path else describe_rule(hint, rule)}"
    try:
        typed = _coerce(value, hint)
    except _Mismatch:
        finite = " (finite)" if isinstance(value, float) and not math.isfinite(value) else ""
        return None, f"must be {_describe(hint)}{finite}"
    if rule.path and (problem := _path_problem(typed, nullable)) is not None:
        return None, problem
    if (problem := _range_problem(typed, rule)) is not None:
        return None, problem
    return typed, None


def _path_problem(value, nullable: bool) -> str | None:
    """An empty path: "" would name the working directory (an output_dir) or nothing at all (a data file)."""
    if isinstance(value, list):
        if any(not v.strip() for v in value):
            return "holds an empty path: give a file, glob or dataset name in each element (or leave it out)"
        return None
    if isinstance(value, str) and not value.strip():
        return "is empty: give a path" + (", or null (leave the key out) for none" if nullable else "")
    return None


def describe_rule(hint, rule: Rule) -> str:
    """What a value may be, in words: "an integer, >= 1 and <= 100000000"."""
    bounds = [f"{word} {_number(bound)}" for word, bound in ((">=", rule.ge), (">", rule.gt), ("<=", rule.le))
              if bound is not None]
    text = _describe(hint) + (", " + " and ".join(bounds) if bounds else "")
    return text + (": one of " + ", ".join(rule.choices) if rule.choices else "")


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def setting(key: str) -> tuple[object, Rule]:
    """(declared type, Rule) of a dotted config key, e.g. "train.steps"; KeyError when there is none."""
    cls, *parents = RunConfig, *key.split(".")[:-1]
    for name in parents:
        cls = {f.name: hint for f, hint, _ in _fields(cls)}[name]
    found = {f.name: (hint, rule) for f, hint, rule in _fields(cls)}
    return found[key.rsplit(".", 1)[-1]]


def _section_name(where: str) -> str:
    return f"[{where}]" if where else "the top level (no section)"


def _unknown_key(key: str, known: list[str], where: str) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r} {'in' if where else 'at'} {_section_name(where)}{hint}; known keys: {', '.join(known)}"


def _expand_user(value):
    """~ and ~user at the start of a path, once for every reader of the config (the checks, transformers,
    the stored config.json); hub ids and globs pass unchanged."""
    if isinstance(value, list):
        return [_expand_user(v) for v in value]
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


def _build(cls, values: dict, where: str, problems: list[str]):
    fields = _fields(cls)
    known = [f.name for f, _, _ in fields]
    problems += [_unknown_key(key, known, where) for key in values if key not in known]
    kwargs = {}
    for f, hint, rule in fields:
        if f.name not in values:
            continue
        key, value = f"{where}.{f.name}" if where else f.name, values[f.name]
        if dataclasses.is_dataclass(hint):
            if isinstance(value, dict):
                kwargs[f.name] = _build(hint, value, key, problems)
            else:
                problems.append(f"{key} = {_shown(value)}: must be a table ([{key}] with its keys)")
            continue
        typed, problem = check_value(value, hint, rule)
        if problem is not None:
            problems.append(f"{key} = {_shown(value)}: {problem}")
            continue
        kwargs[f.name] = _expand_user(typed) if rule.path else typed
    return cls(**kwargs)


# ---- loading -----------------------------------------------------------------------------------

def _hint_for(keys: list[str]):
    """The declared type of a dotted key, or None when the key is unknown (reported by _build)."""
    hint = RunConfig
    for key in keys:
        if not dataclasses.is_dataclass(hint):
            return None
        hint = {f.name: h for f, h, _ in _fields(hint)}.get(key)
    return hint


def _parse_value(raw: str, hint):
    """A --set value as its field expects it: strings need no quotes; numbers and lists are JSON."""
    inner, _ = _optional(hint)
    if raw == "null":  # unset: refused by name where the key must have a value (check_value)
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        if inner is float:
            try:
                return float(raw)  # .5, 1e-3 spelled loosely
            except ValueError:
                pass
        return raw
    if inner is str and not isinstance(value, str):
        return raw  # a path or name that happens to look like a number
    return value


def _apply_override(values: dict, text: str) -> None:
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    keys = key.strip().split(".")
    node = values
    for i, k in enumerate(keys[:-1]):
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {text!r}: {'.'.join(keys[: i + 1])} is a value, not a section")
    node[keys[-1]] = _parse_value(raw, _hint_for(keys))


def _leaves(values: dict, prefix: str = ""):
    """(dotted key, value) of every leaf of a nested dict."""
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def given_keys(config: RunConfig) -> set[str]:
    """The dotted keys the config file, --set or a flag set explicitly; for a config not made by load_config,
    the keys whose value differs from the default."""
    recorded = getattr(config, "_given_keys", None)
    if recorded is not None:
        return set(recorded)
    defaults = dict(_leaves(RunConfig().to_dict()))
    return {key for key, value in _leaves(config.to_dict()) if value != defaults.get(key)}


def config_path(source: str) -> Path:
    """The file `--config SOURCE` reads: a bundled config's name first, then a path; ConfigError where none is."""
    path = CONFIG_DIR / f"{source}.toml" if (CONFIG_DIR / f"{source}.toml").is_file() else Path(source)
    if path.is_dir():
        raise ConfigError(f"config {source!r} is a directory: give a TOML file (e.g. {path / 'run.toml'}) or a "
                          "bundled config name")
    if not path.is_file():
        bundled = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
        raise ConfigError(f"config {source!r} not found: give a TOML file or one of {bundled}")
    return path


def _read_values(source: str | None) -> tuple[dict, str]:
    """The config file's values and its name for errors; no source: none (every key at its default)."""
    if source is None:
        return {}, "defaults"
    path = config_path(source)
    try:
        return tomllib.loads(path.read_text()), path.name
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read: {exc}") from exc


def load_config(source: str | None, overrides: list[str] = (), flags: dict[str, str] | None = None, *,
                whole_run: bool = True, checks: typing.Callable[[RunConfig], list[str]] | None = None) -> RunConfig:
    """The config file (None: the defaults) with --set overrides, then flags ({"--output-dir": "output_dir=runs/x"}:
    a command-line flag that sets one key, named as itself in the errors). whole_run: also the checks a training
    run needs (a target, data); a command that reads a few keys (dflash-eval, the benches) leaves them out.
    checks: what else to ask of the config (the inputs are there: run.loading.input_problems), its problems said
    in the same message. Every problem is said at once; a check's problem that names a key whose value was
    already refused is left out (that key's value is not known)."""
    values, name = _read_values(source)
    flags = flags or {}
    command_line: dict = {}
    for text in [*overrides, *flags.values()]:
        _apply_override(values, text)
        _apply_override(command_line, text)
    problems: list[str] = []
    train = values.get("train")
    given = command_line.get("train") if isinstance(command_line.get("train"), dict) else {}
    if isinstance(train, dict):  # train.steps on the command line replaces the file's train.epochs, and vice versa
        for chosen, other in (("steps", "epochs"), ("epochs", "steps")):
            if given.get(chosen) is not None and other not in given:
                train.pop(other, None)
    if isinstance(train, dict) and "steps" in train and train.get("epochs") is not None:
        problems.append(f"train.steps = {train['steps']} and train.epochs = {train['epochs']} are both given: keep one "
                        "(epochs derives the steps from the data)")
    config = _build(RunConfig, values, "", problems)
    refused = {problem.split(" ", 1)[0] for problem in problems if " = " in problem.split(":", 1)[0]}  # "key = value: ..."
    later = (semantic_problems(config) if whole_run else []) + (checks(config) if checks else [])
    problems += [problem for problem in later if not any(_names_key(problem, key) for key in refused)]
    if problems:
        given = (["--set"] if overrides else []) + list(flags)
        where = name + (" with " + ", ".join(given) if given else "")
        raise ConfigError(f"invalid config ({where}):\n  - " + "\n  - ".join(problems))
    config._given_keys = frozenset(key for key, _ in _leaves(values))  # not a field: what was set explicitly (given_keys)
    return config


def publish_problems(publish: PublishConfig) -> list[str]:
    if publish.push_to is not None and not re.match(HUB_REPO, publish.push_to):
        return [(f"publish.push_to = {json.dumps(publish.push_to)} is no hub repository: give one as org/name "
                 "(your user name or an organisation, then the repository's name)")]
    return []


def tracker_problems(train: TrainConfig) -> list[str]:
    """train.report_to: "none" alone or not at all, each tracker once, and each one installed."""
    report_to = train.report_to
    if "none" in report_to and len(report_to) > 1:
        return [(f"train.report_to = {json.dumps(report_to)}: \"none\" reports nowhere, and the others report "
                 "somewhere: keep one of the two")]
    if len(set(report_to)) != len(report_to):
        return [f"train.report_to = {json.dumps(report_to)} names a tracker twice: name each once"]
    problems = [f"train.report_to names {name}, which is not installed: {install} (or leave {name} out of "
                "train.report_to)" for name, install in missing_trackers(report_to)]
    if train.wandb_project and "wandb" not in report_to:
        problems.append(f"train.wandb_project = {json.dumps(train.wandb_project)} names a W&B project, and "
                        f"train.report_to = {json.dumps(report_to)} does not report to wandb: add \"wandb\" to "
                        "train.report_to, or leave train.wandb_project out")
    return problems


def _names_key(problem: str, key: str) -> bool:
    """The problem's text names the dotted key (data.train, not data.train_x)."""
    return any(not (rest[:1].isalnum() or rest[:1] == "_") for rest in problem.split(key)[1:])


def semantic_problems(c: RunConfig) -> list[str]:
    """What the fields' types and ranges cannot say alone."""
    problems = []
    if not c.target.path:
        problems.append("target.path is empty: give the target model directory (or 'embedded')")
    if not c.data.context_buckets or sorted(c.data.context_buckets) != c.data.context_buckets:
        problems.append("data.context_buckets must be a non-empty ascending list")
    elif c.data.max_length > c.data.context_buckets[-1]:
        problems.append(f"data.max_length {c.data.max_length} exceeds the largest context bucket "
                        f"{c.data.context_buckets[-1]}: raise the bucket or lower data.max_length")
    problems += step_problems(c)
    if c.target.path != "embedded" and not c.data.train and not c.data.features_dir:
        problems.append("data.train is empty: list JSONL files (or a hub dataset name)")
    if c.target.quantization == "fp8" and c.target.dtype != "bfloat16":
        problems.append(f"target.quantization = fp8 needs target.dtype = bfloat16 (the FP8 GEMMs write bf16 "
                        f"features), and target.dtype is {c.target.dtype}: set target.dtype = bfloat16, or "
                        "target.quantization = none")
    return problems + parallel_problems(c) + tracker_problems(c.train) + publish_problems(c.publish)


def step_problems(c: RunConfig) -> list[str]:
    """The drafter step's settings together (the drafter's kind and taps, the loss, the optimizer): what
    dflash-train and `make bench` both refuse."""
    problems = kind_problems(c)
    if c.drafter.target_layer_ids is not None and not c.drafter.target_layer_ids:
        problems.append("drafter.target_layer_ids is empty: list target layers, or leave it out for the "
                        "published rule")
    return problems + train_problems(c)


def train_problems(c: RunConfig) -> list[str]:
    """The train section's combinations: the loss's weights, the moments' dtype."""
    problems = []
    if c.train.loss_ce + c.train.loss_kl + c.train.loss_tv == 0:
        problems.append("train.loss_ce, train.loss_kl and train.loss_tv are all 0, so the loss is 0 and nothing "
                        "trains: give at least one a positive weight (the default is loss_ce = 1)")
    if c.train.moments_dtype != "float32":
        # Only the one-pass update stores moments apart from the fp32 masters (model/optim.py).
        if c.train.dtype == "float32":
            problems.append(f"train.moments_dtype = {c.train.moments_dtype} needs low-precision parameters, and "
                            "train.dtype is float32 (the parameters are their own fp32 masters, stepped by "
                            "torch's AdamW): set train.dtype = bfloat16, or train.moments_dtype = float32")
        if c.parallel.drafter_sharding == "fsdp" and c.parallel.drafter_ranks > 1:
            problems.append(f"train.moments_dtype = {c.train.moments_dtype} cannot go with "
                            "parallel.drafter_sharding = fsdp (torch's AdamW steps the sharded masters and keeps "
                            "the moments in fp32): use drafter_sharding = ddp, or train.moments_dtype = float32")
    return problems


def kind_problems(c: RunConfig) -> list[str]:
    """A DFlash 2 or DSpark setting beside another kind would do nothing: refused, not ignored."""
    defaults, problems = DrafterConfig(), []
    for kind, (names, what) in KIND_SETTINGS.items():
        if c.drafter.kind == kind:
            continue
        stray = [f"drafter.{n}" for n in names if getattr(c.drafter, n) != getattr(defaults, n)]
        if stray:
            one = len(stray) == 1
            problems.append(f"{', '.join(stray)} {'is ' + what if one else 'are ' + what.removeprefix('a ') + 's'}, "
                            f'and drafter.kind is {c.drafter.kind}: set drafter.kind = "{kind}", or remove '
                            f'{"it" if one else "them"}')
    if c.drafter.kind == "dspark" and c.train.position_weighting == "dpace":
        problems.append('train.position_weighting = "dpace" and drafter.kind = "dspark": DSpark\'s confidence '
                        'head and loss weigh positions by exp-decay (as speculators does): set '
                        'train.position_weighting = "exp-decay"')
    return problems


def parallel_problems(c: RunConfig) -> list[str]:
    """The parallel section's combinations (the target's heads are checked against target_tp once its
    config.json is read: target_tp.check_tp_shape)."""
    p, problems = c.parallel, []
    if p.target_tp > 1:
        if p.target_ranks == 0 and not c.data.features_dir:
            problems.append(f"parallel.target_tp = {p.target_tp} needs target ranks, and target_ranks is 0 (one "
                            "process holds the whole target): run under torchrun with --target-gpus "
                            f"{p.target_tp} (or a multiple of it), or set parallel.target_tp = 1")
        elif p.target_ranks % p.target_tp:
            fits = sorted({max(p.target_tp, p.target_ranks // p.target_tp * p.target_tp),
                           -(-p.target_ranks // p.target_tp) * p.target_tp})
            problems.append(f"parallel.target_ranks = {p.target_ranks} is not a multiple of parallel.target_tp = "
                            f"{p.target_tp} (each group of {p.target_tp} target GPUs holds one target): give "
                            f"--target-gpus {' or '.join(map(str, fits))}, or another target_tp")
        if c.data.features_dir:
            problems.append(f"parallel.target_tp = {p.target_tp} shards the target across target ranks, and "
                            "data.features_dir (offline mode) has none: set parallel.target_tp = 1")
    return problems


# ---- a drafter's config.json: its values as the drafter settings allow them ---------------------

# A published drafter's config.json key -> the setting that decides it.
DRAFTER_FILE_KEYS = {
    "num_hidden_layers": "drafter.num_layers",
    "block_size": "drafter.block_size",
    "dflash_config.target_layer_ids": "drafter.target_layer_ids",
    "dflash_config.mask_token_id": "drafter.mask_token_id",
    "intermediate_size": "drafter.intermediate_size",
    **{f"dflash_config.{name}": f"drafter.{name}" for name in DFLASH2_SETTINGS + DSPARK_SETTINGS
       if not name.endswith("_loss_weight")},
}


def _dig(values: dict, dotted: str):
    for key in dotted.split("."):
        values = values.get(key) if isinstance(values, dict) else None
    return values


def drafter_file_problems(raw: dict) -> list[str]:
    """What a drafter's config.json holds that its setting would refuse (block_size 0, a negative layer id),
    each with the key it has; keys it lacks are the caller's to judge."""
    problems = []
    for key, setting_key in DRAFTER_FILE_KEYS.items():
        value = _dig(raw, key)
        if value is None:
            continue
        hint, rule = setting(setting_key)
        if check_value(value, hint, rule)[1] is not None or value == []:
            problems.append(f"{key} = {_shown(value)} (must be {describe_rule(hint, rule)}, as {setting_key})")
    return problems


def read_drafter_file(directory: Path, flag: str) -> dict:
    """directory/config.json of a DFlash drafter, its values checked; ConfigError naming `flag` (the setting
    or option that gave the directory), the file and the fix."""
    config_file = Path(directory) / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{flag} {directory}: {config_file} cannot be read ({exc}): give a drafter directory "
                          "(a run's OUTPUT/drafter or OUTPUT/checkpoints/step-N)") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("dflash_config"), dict):
        raise ConfigError(f"{flag} {directory}: {config_file} has no dflash_config, so it is not a DFlash drafter "
                          "(a target model's directory?): give a drafter directory (a run's OUTPUT/drafter or "
                          "OUTPUT/checkpoints/step-N)")
    if problems := drafter_file_problems(raw):
        raise ConfigError(f"{flag} {directory}: {config_file} holds values no drafter can have: "
                          + "; ".join(problems) + ". The file was edited or damaged: copy it again from where the "
                          "drafter came from")
    return raw


def check_init_from(c: RunConfig) -> None:
    """drafter.init_from fixes the drafter's shape: a drafter setting given explicitly (the config file, --set)
    that says otherwise is refused with every difference listed, never silently overridden."""
    if not c.drafter.init_from:
        return
    raw = read_drafter_file(Path(c.drafter.init_from), "drafter.init_from")
    given = given_keys(c)
    values = dataclasses.asdict(c.drafter)
    conflicts = []
    for key, setting_key in DRAFTER_FILE_KEYS.items():
        name = setting_key.removeprefix("drafter.")
        if setting_key in given and values[name] is not None and _dig(raw, key) != values[name]:
            conflicts.append(f"{setting_key} = {_shown(values[name])}, the drafter in it has "
                             f"{_shown(_dig(raw, key))} ({key})")
    names = raw.get("architectures") or []
    kind = "dflash2" if "DFlash2DraftModel" in names else "dspark" if "DSparkDraftModel" in names else "dflash"
    if "drafter.kind" in given and c.drafter.kind != kind:
        conflicts.append(f"drafter.kind = {_shown(c.drafter.kind)}, the drafter in it is {_shown(kind)} "
                         f"(architectures {_shown(raw.get('architectures'))})")
    if conflicts:
        raise ConfigError(f"drafter.init_from {c.drafter.init_from} continues that drafter as it is, and the config "
                          "sets its shape otherwise:\n  - " + "\n  - ".join(conflicts) + "\nRemove these settings "
                          "(or set them to the drafter's values), or leave drafter.init_from out to build a new drafter")

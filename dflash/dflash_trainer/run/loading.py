"""What every role loads: the target (or the embedded default), its tokenizer, the data, the initial drafter, and the
drafter step the config sets (the train loop's and the benchmark's)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from dflash_run.jobs import REGENERATE

from ..config import ConfigError, RunConfig, read_drafter_file
from ..data.features import FeatureShards, target_fingerprint
from ..data.held_out import overlapping, split_by_prompt
from ..data.prompts import check_chat_template
from ..data.rows import (
    DataError,
    MicroBatches,
    check_sources,
    load_rows,
    local_files,
    pretokenized,
    tokenize_dataset,
)
from ..distributed import parallel
from ..infra.console import console
from ..infra.dtypes import DTYPES
from ..infra.hub import remote_code_hint
from ..model.drafter import (
    DFLASH2_DEFAULTS,
    DSPARK_DEFAULTS,
    IDENTITY_SCALES,
    DFlashDrafter,
    DrafterShape,
    build_target_layer_ids,
    drafter_config,
)
from ..model.loss import Objective
from ..model.optim import MasterWeightAdamW, warmup_cosine
from ..target.fp8 import check_fp8_device, check_not_prequantized
from ..target.frozen import (
    FrozenTarget,
    attention_implementation,
    borrowed_scales,
    check_supported_target,
    meta_skeleton,
    text_config,
)
from ..target.tensor_parallel import check_tp_shape
from .step import DrafterStep

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase



def check_target(path: str) -> None:
    """target.path names a model directory, or a hub id while the hub is reachable (checked in seconds)."""
    from ..infra import hub

    if path == "embedded":
        return
    local = Path(path)  # a leading ~ is expanded by load_config
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(f"target.path {path}: the directory has no config.json; give a Hugging Face model "
                              "directory (config.json, tokenizer files, weights)")
        return
    if local.exists():
        raise ConfigError(f"target.path {path} is a file; give the target model's directory")
    if hub.looks_like_hub_id(path) and hub.cached_model(path):
        return
    if reason := hub.unavailable_reason(path):
        raise ConfigError(f"target.path {path!r}: {reason}; give the target model's directory")


def resolve_init_from(cfg: RunConfig) -> None:
    """drafter.init_from given as a hub id: from here on its snapshot in the local hub cache (downloaded when
    the hub answers, read from the cache when it does not), as a target's hub id resolves."""
    from ..infra import hub

    init = cfg.drafter.init_from
    if not init or Path(init).exists() or not hub.looks_like_hub_id(init):
        return
    try:
        cfg.drafter.init_from = str(hub.local_model(init, "drafter.init_from"))
    except hub.HubError as exc:
        raise ConfigError(str(exc)) from None
    if os.environ.get("RANK", "0") == "0":
        console.print(f"drafter.init_from {init}: the hub's drafter, from {cfg.drafter.init_from}", markup=False,
                      soft_wrap=True)


def check_inputs(cfg: RunConfig) -> None:
    """Before anything loads: the target, the drafter to start from (a hub id resolved to its local snapshot) and
    the data files are there, and the hub answers where the drafter is to be pushed; every problem found said at
    once (ConfigError)."""
    if problems := input_problems(cfg):
        raise ConfigError(problems[0] if len(problems) == 1 else "the run's inputs cannot be used:\n  - "
                          + "\n  - ".join(problems))


def input_problems(cfg: RunConfig) -> list[str]:
    """What keeps the target, drafter.init_from and the data from being used, one message per input: each input is
    checked whatever the others hold, so a config with several problems has them all said in one go (load_config
    takes this as its `checks`). The checks that read the target's config.json run once its directory passed."""
    problems: list[str] = []

    def check(step, *args) -> bool:
        try:
            step(*args)
        except (ConfigError, DataError) as exc:
            problems.append(str(exc))
            return False
        return True

    from ..infra import hub

    target_found = check(check_target, cfg.target.path)
    check(resolve_init_from, cfg)
    if cfg.publish.push_to and (problem := hub.push_problem(cfg.publish.push_to, "publish.push_to")):
        problems.append(problem)  # said now, not after the training it would follow
    init = cfg.drafter.init_from
    if init and not (Path(init) / "config.json").is_file():
        problems.append(f"drafter.init_from {init}: not a drafter directory (no config.json in {Path(init).absolute()})")
        init = None
    features = cfg.data.features_dir
    if features and not (Path(features) / "meta.json").is_file():
        problems.append(f"data.features_dir {features}: no meta.json in {Path(features).absolute()}; dump features "
                        f"first with --dump-features {features}")
    if not features:
        check(check_sources, cfg.data.train)
        check(check_sources, cfg.data.eval)
    if target_found and cfg.target.path != "embedded":
        check(_check_target_config, cfg, init, bool(features))
    return problems


def _check_target_config(cfg: RunConfig, init: str | None, offline: bool) -> None:
    """The family, from config.json and the model class alone; drafter.init_from drafts for it."""
    config = target_config(cfg)
    check_supported_target(config, f"target.path {cfg.target.path}", cfg.target.trust_remote_code)
    check_tp_shape(config, cfg.parallel.target_tp, cfg.target.path)  # N splits the heads evenly
    if init and (problem := family_problem(read_drafter_file(Path(init), "drafter.init_from"), config,
                                           cfg.target.trust_remote_code)):
        raise ConfigError(f"drafter.init_from {init} drafts for another target family: {problem}. Continue a "
                          f"drafter of this target's family, or leave drafter.init_from out to build a new one")
    _CHECKED_CONFIGS[(cfg.target.path, cfg.target.trust_remote_code)] = config  # read_target_files takes it
    if not offline and cfg.target.quantization == "fp8":  # from config.json alone
        check_not_prequantized(config, f"target.path {cfg.target.path}")


def unfinished_regenerations(sources: list[str]) -> list[str]:
    """What to say of data files in a dflash-regenerate output that is not finished: no summary.json, or a shard
    written after it (a later run that was stopped or failed). Training on it is allowed, and said."""
    notes = []
    for where in sorted({Path(name).parent for name in local_files(sources)}):
        if not (where / REGENERATE.marks[0]).is_file():  # regenerate.json: not a regeneration's output
            continue
        summary = where / REGENERATE.result
        shards = list(where.glob("part-*.jsonl"))
        newest = max((shard.stat().st_mtime for shard in shards), default=0.0)
        if not summary.is_file() or newest > summary.stat().st_mtime:
            why = f"no {summary.name}" if not summary.is_file() else f"shards newer than its {summary.name}"
            notes.append(f"note: data.train reads {where}, a regeneration that has not finished ({len(shards)} "
                         f"shards, {why}): the prompts not answered yet are not trained on. Run the same "
                         "dflash-regenerate command again to finish it (it resumes), then train")
    return notes


# The target config check_inputs read, by (path, trust_remote_code): the start reads config.json once.
_CHECKED_CONFIGS: dict[tuple[str, bool], PretrainedConfig] = {}


def target_config(cfg: RunConfig):
    """The target's config.json (no weights): enough for the drafter's shape."""
    from transformers import AutoConfig

    return _from_target_dir(cfg, AutoConfig, "read the model config")


# The files a Hugging Face tokenizer is saved as (fast, SentencePiece, BPE and WordPiece vocabularies, Mistral's):
# a model directory with none of them holds no tokenizer, and transformers would build an empty one from its
# config.json (one token, no chat template, no mask token) rather than refuse.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tekken.json")


def check_tokenizer_files(path: str, where: str) -> None:
    """A local target directory holds its tokenizer (`where`: the setting or flag that gave it, for the message)."""
    local = Path(path)
    if local.is_dir() and not any((local / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{where} {path}: the directory has no tokenizer (none of {', '.join(TOKENIZER_FILES)}), "
                          "and the target's own tokenizer renders the data and names the mask token. Save it "
                          "there (AutoTokenizer.from_pretrained(MODEL_ID).save_pretrained(DIR)), or copy the "
                          "tokenizer files from where the model came from")


def load_tokenizer(cfg: RunConfig):
    """The target's tokenizer, refused when the directory has none or when it cannot render the run's chat data."""
    from transformers import AutoTokenizer

    check_tokenizer_files(cfg.target.path, "target.path")
    tokenizer = _from_target_dir(cfg, AutoTokenizer, "load its tokenizer")
    check_chat_data(cfg, tokenizer)
    return tokenizer


def check_chat_data(cfg: RunConfig, tokenizer) -> None:
    """Chat rows are rendered with the target's chat template: a tokenizer without one is refused (DataError, as
    dflash-regenerate and dflash-eval refuse it) before the target loads, unless every data source is
    pre-tokenized (input_ids + loss_mask, e.g. regenerated answers) or the features were dumped already."""
    if getattr(tokenizer, "chat_template", None) or cfg.data.features_dir:
        return
    for key, sources in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval)):
        if sources and not pretokenized(load_rows(sources)):
            try:
                check_chat_template(tokenizer, cfg.target.path)
            except DataError as exc:
                raise DataError(f"{exc}; or give {key} as pre-tokenized rows (input_ids + loss_mask, as "
                                "dflash-regenerate writes them), which need no chat template") from None


def _from_target_dir(cfg: RunConfig, auto_class, what: str):
    try:
        return auto_class.from_pretrained(cfg.target.path, trust_remote_code=cfg.target.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"target.path {cfg.target.path}: cannot {what} ({exc})"
                          + remote_code_hint(exc, "--set target.trust_remote_code=true")) from exc


@dataclass(frozen=True)
class TargetFiles:
    """The target's config and tokenizer (no weights), read once per start and handed to what needs them:
    the resume check, the drafter's shape, the data."""

    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None  # None on a rank that needs none (read_target_files)


def read_target_files(cfg: RunConfig, ctx: parallel.Context) -> TargetFiles:
    # Drafter ranks fed by target ranks or disk need the tokenizer only to look up a mask token.
    mask_lookup = cfg.drafter.mask_token_id is None and not cfg.drafter.init_from
    needs_tokenizer = ctx.is_target or ctx.colocated or mask_lookup
    config = _CHECKED_CONFIGS.pop((cfg.target.path, cfg.target.trust_remote_code), None) or target_config(cfg)
    return TargetFiles(config, load_tokenizer(cfg) if needs_tokenizer else None)


def mask_token_id(cfg: RunConfig, tokenizer) -> int:
    if cfg.drafter.mask_token_id is not None:
        return cfg.drafter.mask_token_id
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id
    raise ConfigError("the tokenizer has no mask token: set drafter.mask_token_id to a reserved row of the "
                      "target embedding (Qwen3: 151669)")


def drafter_config_for(cfg: RunConfig, target_config, tokenizer):
    """The drafter's config (a Qwen3Config in the published format) without building the drafter:
    target ranks need only its target_layer_ids."""
    d = cfg.drafter
    if d.init_from:
        from transformers import Qwen3Config

        return Qwen3Config.from_pretrained(d.init_from)
    check_tap_points(cfg, target_config)
    borrowed = borrowed_scales(target_config, trust_remote_code=cfg.target.trust_remote_code)
    if d.embedding_scale == "none":  # the block's embeddings unscaled, as vLLM and SGLang serve a drafter
        borrowed = {**borrowed, "input_embedding_scale": IDENTITY_SCALES["input_embedding_scale"]}
    try:
        return drafter_config(target_config, DrafterShape(
            num_layers=d.num_layers, block_size=d.block_size, mask_token_id=mask_token_id(cfg, tokenizer),
            target_layer_ids=tuple(d.target_layer_ids) if d.target_layer_ids else None,
            intermediate_size=d.intermediate_size, **kind_shape(cfg),
        ), borrowed)
    except ValueError as exc:  # layer ids or mask token outside the target
        raise ConfigError(f"drafter: {exc}") from exc


def kind_shape(cfg: RunConfig) -> dict:
    """DrafterShape's kind and the kind's own settings (DFlash 2's, DSpark's), as drafter.* sets them."""
    d = cfg.drafter
    return {"kind": d.kind, **{name: getattr(d, name) for name in (*DFLASH2_DEFAULTS, *DSPARK_DEFAULTS)}}


def family_problem(drafter: dict, target_config, trust_remote_code: bool = False) -> str | None:
    """Why a drafter (its config.json) was trained for another target family than target_config's, or None.

    The family its config records (target_model_type, the target's text model_type); a drafter that records
    none (older ones, other trainers') still carries the scales its target applied to the embedding and logits
    it borrows (dflash_config: Gemma's sqrt(hidden) embedding scale, soft-capped logits, ...): one the target
    does not apply is another family's. Shapes can match across families; these cannot be served together."""
    family = getattr(text_config(target_config), "model_type", None)
    recorded = drafter.get("target_model_type")
    if isinstance(recorded, str) and family and recorded != family:
        return (f"it was trained for a {recorded} target (target_model_type in its config.json), and this target "
                f"is {family}")
    if recorded:
        return None
    dflash = drafter.get("dflash_config") if isinstance(drafter.get("dflash_config"), dict) else {}
    scales = borrowed_scales(target_config, trust_remote_code=trust_remote_code)
    differ = [f"{key} = {dflash[key]} (this target: {scales[key]})" for key, identity in IDENTITY_SCALES.items()
              if dflash.get(key, identity) != identity and dflash[key] != scales[key]]
    if differ:
        return (f"its dflash_config applies {', '.join(differ)}: the embedding and logit scales of the target family "
                f"it was trained for, which this {family} target does not apply")
    return None


def tap_example(num_target_layers: int, num_ids: int) -> list[int]:
    """Distinct layers of a target with `num_target_layers` layers, at most `num_ids` of them, evenly spaced over
    layers 1..T-1 (the first layer's output is close to the embedding, as the published rule skips it): a
    drafter.target_layer_ids a small target can give."""
    layers = list(range(1, num_target_layers)) or [0]
    count = max(1, min(num_ids, len(layers)))
    if count == 1:
        return [layers[len(layers) // 2]]
    return sorted({layers[round(i * (len(layers) - 1) / (count - 1))] for i in range(count)})


def check_tap_points(cfg: RunConfig, target_config) -> None:
    """The layers the drafter taps lie in the target: the published rule (drafter.num_layers ids spaced over
    layers 1..T-3) needs a target of 4 layers or more for two ids, and explicit ids must be layers of it. Refused
    with a drafter.target_layer_ids the target can give."""
    layers = text_config(target_config).num_hidden_layers
    d = cfg.drafter
    example = tap_example(layers, d.num_layers if d.target_layer_ids is None else len(d.target_layer_ids))
    fix = (f"set drafter.target_layer_ids to layers of the target (0..{layers - 1}), e.g. --set "
           f"drafter.target_layer_ids=[{','.join(map(str, example))}] (as many as you like: drafter.num_layers "
           "need not match)")
    if d.target_layer_ids is None and d.num_layers > 1 and layers < 4:
        raise ConfigError(f"drafter.num_layers = {d.num_layers}: the drafter taps {d.num_layers} target layers by the "
                          f"published rule (spaced over layers 1..T-3, which needs a target of 4 layers or more), and "
                          f"target {cfg.target.path} has {layers}: {fix}")
    if d.target_layer_ids is not None and (outside := [i for i in d.target_layer_ids if i >= layers]):
        raise ConfigError(f"drafter.target_layer_ids = {list(d.target_layer_ids)}: {outside} are not layers of target "
                          f"{cfg.target.path}, which has {layers}: {fix}")


def repeated_taps_note(cfg: RunConfig, target_config) -> list[str]:
    """A note where the published rule taps a layer more than once: drafter.num_layers ids spaced over layers
    1..T-3 of a target with fewer than num_layers + 3 layers repeat some (T = 6, 5 ids: 1, 2, 2, 2, 3). It
    trains, as z-lab's rule gives it, but a repeated layer adds no information: distinct ids are said."""
    d = cfg.drafter
    layers = text_config(target_config).num_hidden_layers
    if d.init_from or d.target_layer_ids is not None or d.num_layers < 2 or layers < 4:
        return []
    ids = build_target_layer_ids(layers, d.num_layers)
    if len(set(ids)) == len(ids):
        return []
    distinct = tap_example(layers, d.num_layers)
    return [(f"note: drafter.num_layers = {d.num_layers} taps target layers {ids} by the published rule (spaced over "
             f"layers 1..{layers - 3} of this {layers}-layer target): a repeated layer adds nothing. Distinct ones: "
             f"--set drafter.target_layer_ids=[{','.join(map(str, distinct))}]")]


def new_drafter(cfg: RunConfig, target_config, tokenizer, device="cpu", initialise: bool = True,
                config=None) -> DFlashDrafter:
    """The initial drafter, built on `device`: the same weights on every rank (DDP also broadcasts rank
    0's) and in every run with the same seed on the same kind of device. initialise=False: allocated
    only, for a run that loads a checkpoint next (drafter.init_from's weights are not read either: the
    checkpoint's replace them). config: drafter_config_for's answer, where the caller has it already."""
    if cfg.drafter.init_from and initialise:
        return DFlashDrafter.from_pretrained(cfg.drafter.init_from).to(device)
    if config is None:
        config = drafter_config_for(cfg, target_config, tokenizer)
    if not initialise:
        return DFlashDrafter.empty(config, device)
    return DFlashDrafter.initialised(config, device, cfg.train.seed)


def loss_objective(cfg: RunConfig) -> Objective:
    """The loss's terms and weights (train.loss_ce, loss_kl, loss_tv) and its position weighting."""
    t = cfg.train
    return Objective(ce=t.loss_ce, kl=t.loss_kl, tv=t.loss_tv,
                     dpace_alpha=t.dpace_alpha if t.position_weighting == "dpace" else None)


def new_optimizer(cfg: RunConfig, drafter: DFlashDrafter):
    """AdamW on fp32 masters as train.* sets it, and its LR schedule (warm-up, then cosine over train.steps)."""
    train = cfg.train
    optimizer = MasterWeightAdamW(drafter.parameters(), lr=train.lr, weight_decay=train.weight_decay,
                                  betas=(train.adam_beta1, train.adam_beta2),
                                  max_grad_norm=train.max_grad_norm, moments_dtype=DTYPES[train.moments_dtype])
    scheduler = warmup_cosine(optimizer.opt, train.steps, int(train.warmup_ratio * train.steps), train.min_lr_ratio)
    return optimizer, scheduler


def drafter_step(cfg: RunConfig, drafter: DFlashDrafter, embed: torch.Tensor, head: torch.Tensor, optimizer,
                 scheduler, backend: str, *, model=None, gradient_sync=None, shard_compiles: bool = True) -> DrafterStep:
    """The one drafter step as the config sets it (train.*, drafter.gamma, the kind's loss weights): the train
    loop's, and the one `make bench` times. model / gradient_sync: the sharding's wrapper and its gradient sync;
    shard_compiles: whether that sharding lets the layers compile whole."""
    train = cfg.train
    return DrafterStep(drafter, embed, head, optimizer, num_anchors=train.num_anchors, gamma=cfg.drafter.gamma,
                       chunk_rows=train.loss_chunk_rows, backend=backend,
                       compiled_layers=backend == "flex" and train.compile_layers and shard_compiles,
                       vocab_size=drafter.config.vocab_size, model=model, gradient_sync=gradient_sync,
                       scheduler=scheduler, objective=loss_objective(cfg),
                       selector_loss_weight=cfg.drafter.selector_loss_weight,
                       confidence_loss_weight=cfg.drafter.confidence_loss_weight)


def load_target(cfg: RunConfig, layer_ids: list[int], device, config=None) -> FrozenTarget:
    """config: the target's config, where the caller has read it already."""
    from transformers import AutoModelForCausalLM

    if cfg.target.quantization == "fp8":  # refused before 16 GB are read, not after
        check_fp8_device(torch.device(device))  # here, not in check_inputs: CUDA starts only after parallel.init
    trust = cfg.target.trust_remote_code
    attention = attention_implementation(meta_skeleton(config if config is not None else target_config(cfg), trust))
    model = AutoModelForCausalLM.from_pretrained(cfg.target.path, dtype=DTYPES[cfg.target.dtype],
                                                 attn_implementation=attention, trust_remote_code=trust).to(device)
    target = FrozenTarget(model, layer_ids, quantization=cfg.target.quantization)
    console.print(f"target: {target.describe()}", soft_wrap=True)
    if target.quantized_linears:
        console.print(f"target: {target.quantized_linears} linears of its decoder layers as FP8-dynamic GEMMs "
                      "(target.quantization = fp8); the embedding and LM head as they are", soft_wrap=True)
    return target


def training_rows(cfg: RunConfig, tokenizer, quiet: bool = False):
    """(the rows of data.train the run trains on, the rows held out of them for evaluation: None where data.eval
    gives the evaluation set). One rule for load_data and for train.epochs' count; quiet: say nothing (the
    refusals and the split are said when the data loads)."""
    train_ds = tokenize_dataset(load_rows(cfg.data.train), tokenizer, cfg.data.max_length, cfg.data.num_proc,
                                cfg.data.reasoning, **({"say": lambda _: None} if quiet else {}))
    if cfg.data.eval:
        return train_ds, None
    train_ds, eval_ds, distinct, dropped = split_by_prompt(train_ds, cfg.train.seed)
    if not quiet:
        console.print(f"held out {len(eval_ds)} of {distinct} distinct training prompts for evaluation"
                      + (f" (and {dropped} repeated rows of them)" if dropped else ""))
    return train_ds, eval_ds


def load_data(cfg: RunConfig, tokenizer) -> tuple[MicroBatches, MicroBatches | None, list[list[int]]]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_ds, eval_ds = training_rows(cfg, tokenizer)
    if eval_ds is None:
        eval_ds = tokenize_dataset(load_rows(cfg.data.eval), tokenizer, cfg.data.max_length, cfg.data.num_proc,
                                   cfg.data.reasoning)
        if shared := overlapping(train_ds, eval_ds):
            console.print(f"[yellow]warning:[/] {shared} of {len(eval_ds)} data.eval rows have a prompt that data.train "
                          "also has: tau on them is not held out. Remove them from one of the two")
    stream = MicroBatches(train_ds, cfg.train.micro_batch, cfg.data.context_buckets, pad, cfg.train.seed)
    eval_stream = MicroBatches(eval_ds, min(cfg.train.micro_batch, len(eval_ds)), cfg.data.context_buckets, pad,
                               cfg.train.seed)
    prompts = [prompt_of(eval_ds[i]) for i in range(min(cfg.eval.prompts, len(eval_ds)))]
    return stream, eval_stream, prompts


def compiled_buckets(cfg: RunConfig, stream: MicroBatches, say: bool = True) -> list[int]:
    """The context buckets the compile step compiles where this rank reads the data: those some training row
    falls in (the only shapes its micro-batches take), so a short dataset does not wait for the compile of
    buckets no row reaches (10-30 s each cold on an H200). Evaluation runs outside the strict compile stance
    (before the compile step, or after leave_run_phase), so its rows need none. say: print the ones skipped
    (where a compile step runs)."""
    return _say_skipped(cfg, stream.buckets_used(), "no training row falls in", say)


def feature_buckets(cfg: RunConfig, shards: FeatureShards, target_config, layer_ids: list[int],
                    lead: bool = True, compiles: bool = True) -> list[int]:
    """Check that dumped features fit this run, and return their context buckets (the lengths the micro-batches
    were padded to). lead: this rank prints the notes (one drafter rank does); compiles: a compile step runs. Features of another target would train the drafter against another model's embedding
    and head; another micro-batch size or other buckets would take a shape the compile step never compiled
    and stop the run at that step: each is refused here, before anything is written."""
    tc = text_config(target_config)
    fix = f"or dump the features again with this config (--dump-features {shards.root})"
    dumped, ours = shards.meta.get("target_config"), target_fingerprint(tc)
    if dumped and (differ := [k for k in ours if dumped.get(k) != ours[k]]):
        raise ConfigError(f"{shards.root} holds features of another target ({shards.meta['target']}: "
                          + ", ".join(f"{k} {dumped.get(k)}" for k in differ) + f"; {cfg.target.path} has "
                          + ", ".join(f"{k} {ours[k]}" for k in differ) + f"): set target.path to the dumped "
                          f"target {fix}")
    if list(shards.meta["target_layer_ids"]) != list(layer_ids):
        raise ConfigError(f"{shards.root} holds features of target layers {shards.meta['target_layer_ids']} but the "
                          f"drafter taps {list(layer_ids)}: set drafter.target_layer_ids = "
                          f"{shards.meta['target_layer_ids']} {fix}")
    if loss_objective(cfg).needs_target and not shards.has_target_hidden:
        raise ConfigError(f"{shards.root} holds no final hidden states of the target, which train.loss_kl and "
                          "train.loss_tv compare the drafter with: dump the features again with this loss set "
                          f"(--dump-features with the same --set train.loss_*), or set train.loss_kl = 0 and "
                          "train.loss_tv = 0 (with a positive train.loss_ce) to train on these")
    if lead and Path(shards.meta["target"]).expanduser().resolve() != Path(cfg.target.path).expanduser().resolve():
        console.print(f"note: {shards.root} was dumped from {shards.meta['target']}; this run reads the embedding "
                      f"and head of {cfg.target.path}, a model of the same shape", markup=False, soft_wrap=True)
    shapes = shards.shapes()
    width = len(layer_ids) * tc.hidden_size
    if bad := sorted({w for *_, w in shapes if w != width}):
        raise ConfigError(f"{shards.root} holds features {bad[0]} wide, and {cfg.target.path} ({tc.hidden_size} "
                          f"hidden x {len(shards.meta['target_layer_ids'])} tapped layers) gives {width}: set "
                          f"target.path to the dumped target ({shards.meta['target']}) {fix}")
    rows = sorted({r for r, *_ in shapes})
    lengths = sorted({n for _, n, _ in shapes})
    if rows != [cfg.train.micro_batch]:
        raise ConfigError(f"{shards.root} holds micro-batches of {', '.join(map(str, rows))} rows, but "
                          f"train.micro_batch = {cfg.train.micro_batch}: set train.micro_batch = {rows[0]} {fix}")
    if outside := [n for n in lengths if n not in cfg.data.context_buckets]:
        raise ConfigError(f"{shards.root} holds micro-batches of context length {', '.join(map(str, outside))}, "
                          f"which data.context_buckets {list(cfg.data.context_buckets)} lacks: set "
                          f"data.context_buckets = {lengths} {fix}")
    return _say_skipped(cfg, lengths, "no dumped micro-batch has", lead and compiles)


def _say_skipped(cfg: RunConfig, used: list[int], why: str, say: bool) -> list[int]:
    if say and (unused := [b for b in cfg.data.context_buckets if b not in used]):
        console.print(f"context buckets: compiling {', '.join(map(str, used))}; {why} "
                      f"{', '.join(map(str, unused))} (data.context_buckets)")
    return used


def prompt_of(row: dict) -> list[int]:
    """The prompt part of a tokenized row: everything before the first supervised token."""
    return row["input_ids"][: row["loss_mask"].index(1)]


def attention_backend(cfg: RunConfig, device: torch.device) -> str:
    if cfg.train.attention != "auto":
        return cfg.train.attention
    return "flex" if device.type == "cuda" else "sdpa"  # flex_attention has no backward on CPU

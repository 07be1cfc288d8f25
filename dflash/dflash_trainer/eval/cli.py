"""dflash-eval: judge a drafter the way it will be served: tau per prompt set, speedup, a figure.

    dflash-eval --drafter DIR --target PATH --prompts FILE_OR_DATASET... --out DIR
                [--max-new-tokens N] [--limit N] [--temperature 0 [T ...]] [--seed N] [--name NAME=SOURCE ...]
    dflash-eval --run OUTPUT        # a training run: its drafter, target and held-out prompts

Every prompt is decoded twice at each temperature: by speculative decoding (decoding/speculative.py, the loop the
trainer's tau uses) and by the target alone. At temperature 0 (greedy, the default) the outputs must be equal
token for token (greedy speculative decoding is lossless); a divergence is an error unless the target's two
candidates were within rounding of each other (a near tie, reported). At a temperature > 0 both sample, seeded
(--seed): speculative sampling's output is distributed as the target's own (tests/test_speculative_sampling.py
checks it), so the two outputs differ and only tau and the speeds are compared. Inputs are all checked before
anything runs, and nothing is written to --out unless the evaluation completes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_run.jobs import EVAL, other_job_problem

from ..infra.gc_pause import gc_paused

with gc_paused():  # torch's and transformers' imports, a fifth faster: infra/gc_pause.py
    import torch

    from .. import cli_args
    from ..config import (
        MAX_SEED,
        TARGET_QUANTIZATIONS,
        ConfigError,
        RunConfig,
        drafter_file_problems,
        given_keys,
    )
    from ..data.prompt_sets import PromptSet, load_prompt_set, name_sources
    from ..decoding.fast import FastDecoding
    from ..decoding.speculative import AcceptanceStats, Sampling, stop_token_ids
    from ..infra import storage
    from ..infra.console import console, plain_output_off_a_terminal
    from ..infra.dtypes import DTYPES
    from ..infra.hub import remote_code_hint
    from ..infra.metrics import PlainProgress, say_progress
    from ..infra.stop_signal import exit_code as stop_exit_code
    from ..infra.stop_signal import signal_name_of
    from ..model.drafter import DFLASH2_DEFAULTS, DSPARK_DEFAULTS
    from ..run import checkpoint as ckpt
    from ..run import model_card
    from ..run import run_dir as run_dir_lib
    from ..run.evaluate import EVAL_PROMPTS_FILE
    from ..run.loading import check_target, check_tokenizer_files, family_problem
    from ..target.fp8 import check_fp8_device, check_not_prequantized
    from ..target.frozen import FrozenTarget, attention_implementation, check_supported_target, meta_skeleton
    from .report import SetResult, build_report, plot, table, tracker_scalars, write_json, write_requests


# A divergence between speculative and target-only decoding is a near tie when the target's logits for the two
# tokens differ by less than this share of the largest logit: the rounding a one-token forward and a block
# forward can disagree by in that dtype (bf16 keeps 8 significant bits, and the error grows over the layers).
TIE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# Above this the softmax is all but uniform over the vocabulary: no serving setting, a typo (70 for 0.7).
MAX_TEMPERATURE = 10.0


class EvalError(ValueError):
    """Input dflash-eval cannot use, with what to change."""


class OutputMismatch(RuntimeError):
    """Speculative decoding produced something target-only greedy decoding did not."""


@dataclass
class Plan:
    """What one evaluation runs on, every input checked."""

    drafter_dir: Path
    target_path: str
    out: Path
    device: torch.device
    target_dtype: torch.dtype
    drafter_dtype: torch.dtype
    target_quantization: str
    max_new_tokens: int
    limit: int | None
    tie_tolerance: float
    drafter_config: dict
    tokenizer: object
    sets: list[PromptSet] = field(default_factory=list)
    trust_remote_code: bool = False
    batch_size: int = 1
    temperatures: list[float] = field(default_factory=lambda: [0.0])  # each evaluated in turn; 0: greedy
    seed: int = 0  # sampling's generator (temperatures > 0)


EVAL_FP8_SETTING = ("--target-quantization fp8", "give --target-quantization none")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-eval", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", type=cli_args.directory,
                   help="the drafter: a directory (this trainer's OUTPUT/drafter, a checkpoint, z-lab's) or a hub id")
    cli_args.key_flag(p, "--target", "target.path", "the target model: a Hugging Face directory or hub id")
    p.add_argument("--prompts", nargs="+", default=[], metavar="FILE_OR_DATASET",
                   type=cli_args.file_or_dataset,
                   help="prompt sources, one prompt set each: JSONL files or hub datasets (owner/name[:config][@split])")
    p.add_argument("--name", action="append", default=[], metavar="NAME=SOURCE", type=cli_args.named_source,
                   help="name a prompt set (the source is added when --prompts lacks it); default: the file name")
    p.add_argument("--out", help="where eval.json, requests.jsonl and eval.png go (default with --run: OUTPUT/eval)")
    p.add_argument("--run", metavar="OUTPUT", type=cli_args.directory,
                   help="a training run's output dir: its drafter (or latest checkpoint), "
                   "target, held-out prompts and eval settings are the defaults")
    cli_args.key_flag(p, "--max-new-tokens", "eval.max_new_tokens",
                      "tokens to generate per prompt (default 256 unless --config or --set gives it; --run: the run's)")
    p.add_argument("--limit", type=cli_args.PROMPTS, help="the first N usable prompts of each set (default: all)")
    p.add_argument("--temperature", type=cli_args.number(ge=0, le=MAX_TEMPERATURE), nargs="+", default=[0.0],
                   metavar="T", help="decoding temperatures, each evaluated in turn (default 0: greedy, outputs "
                   "checked against the target's; > 0: speculative sampling, seeded, tau per temperature)")
    p.add_argument("--seed", type=cli_args.integer(ge=0, le=MAX_SEED), default=0,
                   help="seed of the sampling at temperatures > 0 (default 0): the same seed, the same outputs")
    cli_args.key_flag(p, "--dtype", "target.dtype", "target dtype, and the drafter's unless train.dtype is given "
                      "(auto, the default: bfloat16 on CUDA, float32 on CPU; --run: the run's)", choices=["auto", *DTYPES])
    cli_args.key_flag(p, "--target-quantization", "target.quantization", "the target's decoder GEMMs: none, or fp8 "
                      "as an FP8-dynamic target is served (default none; --run: the run's)", choices=TARGET_QUANTIZATIONS)
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    cli_args.key_flag(p, "--trust-remote-code", "target.trust_remote_code",
                      "run the modelling code the target's directory ships (--run: the run's)", action="store_true")
    p.add_argument("--batch-size", type=cli_args.ROWS, default=1,
                   help="prompts decoded together, each verify step checking a block of each (default 1: the "
                        "speedup one request sees; more: the throughput of a batched server)")
    p.add_argument("--bench", action="store_true",
                   help="no drafter, no prompts: time target-only decoding and the verify step at a model shape "
                        "with random weights (--preset; bench/decoding.py) and print the figures")
    p.add_argument("--preset", default="qwen3-8b", help="--bench: the model shape (qwen3-8b, or tiny on a CPU)")
    p.add_argument("--tie-tolerance", type=cli_args.number(ge=0, le=1),
                   help="near-tie threshold, a share of the largest logit (default by dtype: fp32 1e-4, bf16 3e-2)")
    cli_args.add_config_flags(p)
    cli_args.add_log_format_flag(p)
    return p


# The flags that set one run-config key each: --config / --set give the same keys.
KEY_FLAGS = {"--target": "target.path", "--dtype": "target.dtype", "--target-quantization": "target.quantization",
             "--trust-remote-code": "target.trust_remote_code", "--max-new-tokens": "eval.max_new_tokens"}


# ---- checking the inputs (nothing is written) ------------------------------------------------------

def _config_json(directory: Path, missing: str) -> dict:
    """directory/config.json, or EvalError(missing) when there is none."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise EvalError(missing)
    try:
        value = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise EvalError(f"{config_file} cannot be read ({exc}): it is damaged; copy it again from where the "
                        "directory came from") from None
    if not isinstance(value, dict):
        raise EvalError(f"{config_file} is not a JSON object: it is damaged; copy it again from where it came from")
    return value


def run_defaults(run_dir: Path) -> dict:
    """The drafter, target, prompts and settings of a training run's output directory."""
    cfg = _config_json(run_dir, f"--run {run_dir}: no config.json there, so it is not a training run's output "
                       "directory (the trainer's --output-dir); give --drafter, --target and --prompts instead")
    drafter = run_dir / "drafter"
    if not (drafter / "config.json").is_file():
        drafter = _run_checkpoint(run_dir)
    try:
        return _run_settings(cfg, run_dir, drafter)
    except (KeyError, TypeError) as exc:
        raise EvalError(f"--run {run_dir}: its config.json lacks {exc} (written by another version of the trainer?): "
                        "give --drafter, --target and --prompts instead") from None


def _run_checkpoint(run_dir: Path) -> Path:
    """A run without its published drafter: its newest intact checkpoint, said on the console (and which newer
    ones are damaged), since tau then measures a drafter mid-training."""
    found = ckpt.inspect(run_dir / "checkpoints")
    if found.resume_from is None:
        damaged = "".join(f"; {p.name} is damaged ({problem})" for p, problem in found.damaged)
        raise EvalError(f"--run {run_dir}: no drafter yet (neither {run_dir / 'drafter'} nor an intact checkpoint "
                        f"under {run_dir / 'checkpoints'}{damaged}): wait for the first checkpoint, or give --drafter")
    newer = [f"{p.name} is damaged ({problem})" for p, problem in found.damaged
             if (ckpt.step_of(p) or 0) > (found.resume_step or 0)]
    console.print(f"--run {run_dir}: no published drafter (drafter/) yet: evaluating the checkpoint "
                  f"{found.resume_from.name}" + (f", the newest intact one ({'; '.join(newer)})" if newer else ""),
                  markup=False, soft_wrap=True)
    return found.resume_from


def _run_settings(cfg: dict, run_dir: Path, drafter: Path) -> dict:
    recorded = run_dir / EVAL_PROMPTS_FILE
    defaults = {"drafter": str(drafter), "target": run_dir_lib.resolve_stored(cfg["target"]["path"], run_dir),
                "max_new_tokens": cfg["eval"]["max_new_tokens"],
                "target_dtype": cfg["target"]["dtype"], "drafter_dtype": cfg["train"]["dtype"],
                "target_quantization": cfg["target"].get("quantization", "none"),  # older runs: none
                "trust_remote_code": cfg["target"].get("trust_remote_code", False),
                "block_size": cfg["drafter"].get("block_size")}
    if recorded.is_file():  # exactly the prompts the run's tau was measured on
        defaults["names"] = [f"held-out={recorded}"]
    elif cfg["data"]["eval"]:
        defaults["names"] = [f"held-out={src}" for src in run_dir_lib.resolve_stored(cfg["data"]["eval"][:1], run_dir)]
        defaults["limit"] = cfg["eval"]["prompts"]
    else:
        defaults["missing_prompts"] = (
            f"--run {run_dir} holds no held-out prompts ({EVAL_PROMPTS_FILE} is written when a run with a target "
            "ends; an offline run, or one still training, has none) and its data.eval is empty: give --prompts "
            "FILE_OR_DATASET")
    return defaults


def check_drafter_dir(path: Path) -> dict:
    """The drafter's config.json, refused when it is not a DFlash drafter this evaluation implements."""
    raw = _config_json(path, f"--drafter {path}: no config.json. Point it at a drafter directory: a training run's "
                       "OUTPUT/drafter, a checkpoint OUTPUT/checkpoints/step-N, or a z-lab drafter")
    config_file = path / "config.json"
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict):
        raise EvalError(f"{config_file} has no dflash_config (mask_token_id, target_layer_ids): not a DFlash drafter. "
                        "Point --drafter at the drafter directory, not the target or the run directory")
    if "DFlash2DraftModel" in (raw.get("architectures") or []):
        lacking = [k for k in DFLASH2_DEFAULTS if dflash.get(k) is None]
        if lacking:
            raise EvalError(f"{config_file} is a DFlash 2 drafter and lacks dflash_config {lacking}: add them as "
                            "z-lab's DFlash 2 drafters have them (defaults "
                            + ", ".join(f"{k} {v}" for k, v in DFLASH2_DEFAULTS.items() if k in lacking) + ")")
    if "DSparkDraftModel" in (raw.get("architectures") or []):
        lacking = [k for k in DSPARK_DEFAULTS if dflash.get(k) is None]
        if lacking:
            raise EvalError(f"{config_file} is a DSpark drafter and lacks dflash_config {lacking}: add them as this "
                            "trainer publishes them (speculators' defaults "
                            + ", ".join(f"{k} {v}" for k, v in DSPARK_DEFAULTS.items() if k in lacking) + ")")
    missing = [k for k in ("mask_token_id", "target_layer_ids") if dflash.get(k) is None] + \
        (["block_size"] if raw.get("block_size") is None else [])
    if missing:
        raise EvalError(f"{config_file} lacks {missing}: add them (dflash_config.mask_token_id, "
                        "dflash_config.target_layer_ids and a top-level block_size, as z-lab's drafters have)")
    if problems := drafter_file_problems(raw):  # block_size 0, a negative layer id: what no drafter setting allows
        raise EvalError(f"{config_file} holds values no drafter can have: {'; '.join(problems)}. The file was edited "
                        "or damaged: copy it again from where the drafter came from")
    layer_types = set(raw.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"} or raw.get("is_causal"):
        raise EvalError(f"{path}: drafter layers {sorted(layer_types)} (sliding-window or causal drafter attention) "
                        "are not implemented by dflash-eval, which drafts with full attention over the block")
    return raw


def text_config(target_config):
    """The decoder's config of a target's (a multimodal target nests it)."""
    return target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config


def check_fits(raw: dict, drafter_dir: Path, target_config, target: str) -> None:
    """The drafter was built for this target: hidden size, tapped layers, vocabulary, context."""
    tc = text_config(target_config)
    layers, ids = tc.num_hidden_layers, list(raw["dflash_config"]["target_layer_ids"])
    fix = f"evaluate it against the target it was trained for (see {drafter_dir / 'config.json'})"
    problems = []
    if raw.get("hidden_size") != tc.hidden_size:
        problems.append(f"its hidden size is {raw.get('hidden_size')}, the target's {tc.hidden_size}")
    if raw.get("num_target_layers") not in (None, layers):
        problems.append(f"it was trained for a target with {raw['num_target_layers']} layers, this one has {layers}")
    if any(not 0 <= i < layers for i in ids):
        problems.append(f"its target_layer_ids {ids} are not all layers of the target's {layers}")
    if raw.get("vocab_size") not in (None, tc.vocab_size):
        problems.append(f"its vocabulary has {raw['vocab_size']} tokens, the target's {tc.vocab_size}")
    if not 0 <= raw["dflash_config"]["mask_token_id"] < tc.vocab_size:
        problems.append(f"its mask_token_id {raw['dflash_config']['mask_token_id']} is not a row of the target's "
                        f"embedding ({tc.vocab_size})")
    if problems:
        raise EvalError(f"drafter {drafter_dir} does not fit target {target}: " + "; ".join(problems) + f". {fix}")
    context = getattr(tc, "max_position_embeddings", None)
    if context is not None and raw["block_size"] > context:
        raise EvalError(f"drafter {drafter_dir}: block size {raw['block_size']} is above target {target}'s context of "
                        f"{context} tokens: no block fits. Use a drafter with a smaller block_size")


def check_out_writable(out: Path) -> None:
    """--out takes files and holds no other job's output: found before the evaluation, not after it (nothing is
    created)."""
    if problem := other_job_problem(out, EVAL):
        raise EvalError(problem)
    try:
        storage.check_can_create(out, "--out")
    except ValueError as exc:
        raise EvalError(str(exc)) from None


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@dataclass
class Settings:
    """What the flags, the run config (--config, --set) and --run's recorded run say, merged: explicit keys
    first, then the run's, then dflash-eval's own defaults."""

    drafter: str | None
    target: str | None
    out: str | None
    max_new_tokens: int
    limit: int | None
    target_dtype: str | None  # None: by the device
    drafter_dtype: str | None  # None: the target's
    quantization: str
    trust_remote_code: bool
    names: list[str]
    run_drafter: str | None = None  # the drafter --run found, and the block size the run trained with
    run_block_size: int | None = None
    missing_prompts: str | None = None  # why --run gave no prompts (and none were given)


def settings(args, cfg: RunConfig) -> Settings:
    run = run_defaults(Path(args.run)) if args.run else {}
    own_prompts = bool(args.prompts or args.name)
    # --dtype (target.dtype) sets the drafter's too, as the run's pair does when it is not given
    dtypes = (None, None) if "target.dtype" in given_keys(cfg) else (run.get("target_dtype"), run.get("drafter_dtype"))
    return Settings(
        drafter=args.drafter or run.get("drafter"), target=cli_args.chosen(cfg, "target.path", run.get("target")),
        out=args.out or (str(Path(args.run) / "eval") if args.run else None),
        max_new_tokens=cli_args.chosen(cfg, "eval.max_new_tokens", run.get("max_new_tokens", 256)),
        limit=args.limit if args.limit is not None else (None if own_prompts else run.get("limit")),
        target_dtype=cli_args.chosen(cfg, "target.dtype", dtypes[0]),
        drafter_dtype=cli_args.chosen(cfg, "train.dtype", dtypes[1]),
        quantization=cli_args.chosen(cfg, "target.quantization", run.get("target_quantization", "none")),
        trust_remote_code=cli_args.chosen(cfg, "target.trust_remote_code", run.get("trust_remote_code", False)),
        names=args.name if own_prompts else run.get("names", []),
        run_drafter=run.get("drafter"), run_block_size=run.get("block_size"),
        missing_prompts=None if own_prompts else run.get("missing_prompts"))


def check_request(args, s: Settings) -> None:
    """What the command line asks for, before any file is read: the three inputs, greedy decoding, --out."""
    missing = [flag for flag, v in (("--drafter", s.drafter), ("--target", s.target), ("--out", s.out)) if not v]
    if missing:
        raise EvalError(f"missing {', '.join(missing)}: give them, or --run OUTPUT for a training run's")
    if s.missing_prompts:
        raise EvalError(s.missing_prompts)
    if len(set(args.temperature)) != len(args.temperature):
        raise EvalError(f"--temperature {' '.join(f'{t:g}' for t in args.temperature)}: a temperature is given twice; "
                        "give each once")
    out = Path(s.out)
    if out.exists() and not out.is_dir():
        raise EvalError(f"--out {out} is a file: give a directory")
    check_out_writable(out)


def pick_device(name: str | None) -> torch.device:
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as exc:
        raise EvalError(f"--device {name}: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EvalError(f"--device {device}: no CUDA GPU is visible; use --device cpu")
    return device


def check_fp8(target_dtype: torch.dtype, device: torch.device) -> None:
    if target_dtype != torch.bfloat16:
        raise EvalError(f"--target-quantization fp8 needs a bf16 target (the FP8 GEMMs write bf16), and the "
                        f"target's dtype is {str(target_dtype).removeprefix('torch.')}: add --dtype bfloat16")
    try:
        check_fp8_device(device, setting=EVAL_FP8_SETTING)
    except ConfigError as exc:
        raise EvalError(str(exc)) from None


def check_drafter(s: Settings) -> tuple[Path, dict]:
    """The drafter's directory (a hub id: its snapshot in the local hub cache) and config.json; a note when it
    holds another block size than the run trained."""
    from ..infra import hub

    try:
        drafter_dir = hub.local_model(s.drafter, "--drafter")
    except hub.HubError as exc:
        raise EvalError(str(exc)) from None
    raw = check_drafter_dir(drafter_dir)
    trained = s.run_block_size if s.drafter == s.run_drafter else None
    if trained is not None and raw["block_size"] != trained:
        console.print(f"note: {drafter_dir / 'config.json'} says block_size {raw['block_size']}, and the run trained "
                      f"with {trained} (drafter.block_size): evaluating at {raw['block_size']}, as its config says",
                      markup=False, soft_wrap=True)
    return drafter_dir, raw


def load_target_files(target: str, trust: bool):
    """The target's config and tokenizer (no weights), refused when the decoding loop cannot serve its family."""
    from transformers import AutoConfig, AutoTokenizer

    try:  # a missing directory, or a hub id while the hub is unreachable: refused in seconds, not after retries
        check_target(target)
        check_tokenizer_files(target, "--target")  # transformers would build an empty tokenizer instead
    except ConfigError as exc:
        raise EvalError(str(exc).replace("target.path", "--target", 1)) from None
    try:
        target_config = AutoConfig.from_pretrained(target, trust_remote_code=trust)
        tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=trust)
    except (OSError, ValueError) as exc:
        raise EvalError(f"--target {target}: cannot load its config and tokenizer ({exc})"
                        f"{remote_code_hint(exc, '--trust-remote-code')}. Give the target's Hugging Face directory "
                        "(config.json, tokenizer, weights) or a reachable hub id") from exc
    try:  # a family the decoding loop cannot serve: refused before its weights are read
        check_supported_target(target_config, f"--target {target}", trust)
    except ConfigError as exc:
        raise EvalError(str(exc)) from None
    return target_config, tokenizer


def check_target_fits(s: Settings, raw: dict, drafter_dir: Path, target_config) -> int:
    """The drafter fits the target, an fp8 target is no prequantized one; the target's context, in tokens."""
    check_fits(raw, drafter_dir, target_config, s.target)
    if problem := family_problem(raw, target_config, s.trust_remote_code):  # shapes can match across families
        raise EvalError(f"drafter {drafter_dir} does not fit target {s.target}: {problem}. Evaluate it against a "
                        f"target of the family it was trained for (see {drafter_dir / 'config.json'})")
    if s.quantization == "fp8":
        try:
            check_not_prequantized(target_config, f"--target {s.target}", setting=EVAL_FP8_SETTING)
        except ConfigError as exc:
            raise EvalError(str(exc)) from None
    context = getattr(text_config(target_config), "max_position_embeddings", None) or 1 << 30
    if s.max_new_tokens >= context:
        raise EvalError(f"--max-new-tokens {s.max_new_tokens} leaves no room for a prompt in the target's context of "
                        f"{context} tokens: lower it")
    return context


def plan(args, cfg: RunConfig | None = None) -> Plan:
    """Every input checked and every prompt tokenized, before any model weight is read."""
    s = settings(args, cfg if cfg is not None else cli_args.run_config(args, KEY_FLAGS, whole_run=False))
    check_request(args, s)
    device = pick_device(args.device)
    target_dtype = DTYPES[s.target_dtype] if s.target_dtype else _dtype("auto", device)
    drafter_dtype = DTYPES[s.drafter_dtype] if s.drafter_dtype else target_dtype
    if s.quantization == "fp8":
        check_fp8(target_dtype, device)
    drafter_dir, raw = check_drafter(s)
    target_config, tokenizer = load_target_files(s.target, s.trust_remote_code)
    context = check_target_fits(s, raw, drafter_dir, target_config)
    vocab = text_config(target_config).vocab_size
    sets = [load_prompt_set(name, source, tokenizer, s.target, s.limit, context - s.max_new_tokens, vocab)
            for name, source in name_sources(args.prompts, s.names)]
    tolerance = args.tie_tolerance if args.tie_tolerance is not None else TIE_TOLERANCE[target_dtype]
    return Plan(drafter_dir, s.target, Path(s.out), device, target_dtype, drafter_dtype, s.quantization,
                s.max_new_tokens, s.limit, tolerance, raw, tokenizer, sets, s.trust_remote_code, args.batch_size,
                list(args.temperature), args.seed)


def load_models(p: Plan):
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..model.drafter import DFlashDrafter

    try:
        drafter = DFlashDrafter.from_pretrained(p.drafter_dir)
    except (ValueError, RuntimeError, OSError, SafetensorError) as exc:  # key or shape mismatch, a cut-short file
        weights = p.drafter_dir / "model.safetensors"
        raise EvalError(f"--drafter {p.drafter_dir}: cannot load its weights from {weights} ({exc}): the file is "
                        "missing, cut short or from another model; copy the drafter directory again (or give "
                        "another checkpoint)") from None
    drafter = drafter.to(device=p.device, dtype=p.drafter_dtype).eval()
    try:  # the attention implementation the trainer chose for this family (target.attention_implementation)
        attention = attention_implementation(meta_skeleton(AutoConfig.from_pretrained(
            p.target_path, trust_remote_code=p.trust_remote_code), p.trust_remote_code))
        model = AutoModelForCausalLM.from_pretrained(p.target_path, dtype=p.target_dtype, attn_implementation=attention,
                                                     trust_remote_code=p.trust_remote_code).to(p.device)
    except (OSError, ValueError) as exc:  # no weights beside the config, a model class transformers lacks
        raise EvalError(f"--target {p.target_path}: cannot load the model ({exc})") from exc
    return drafter, FrozenTarget(model, drafter.target_layer_ids, quantization=p.target_quantization)


# ---- decoding ------------------------------------------------------------------------------------

def _timed(device: torch.device, fn, *args):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    result = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - t0


@torch.inference_mode()
def compare(target: FrozenTarget, prompt_len: int, spec: list[int], ref: list[int], tolerance: float) -> dict | None:
    """None when equal; a near tie's description; OutputMismatch for any other divergence."""
    if spec == ref:
        return None
    at = next((i for i, (a, b) in enumerate(zip(spec, ref, strict=False)) if a != b), min(len(spec), len(ref)))
    if at >= min(len(spec), len(ref)):
        raise OutputMismatch(f"speculative decoding stopped after {len(spec) - prompt_len} tokens, target-only "
                             f"decoding after {len(ref) - prompt_len}, with the same tokens up to there")
    device = target.embed_weight.device
    logits = target.model(torch.tensor([ref[:at]], device=device), logits_to_keep=1).logits[0, -1].float()
    gap = abs(float(logits[ref[at]] - logits[spec[at]]))
    allowed = tolerance * float(logits.abs().max())
    where = {"position": at - prompt_len, "target_only_token": ref[at], "speculative_token": spec[at],
             "logit_gap": gap, "tolerance": allowed}
    if gap > allowed:
        raise OutputMismatch(f"generated token {at - prompt_len}: speculative decoding gave {spec[at]}, target-only "
                             f"greedy decoding {ref[at]}, and the target prefers {ref[at]} by {gap:.4g} logits "
                             f"(more than rounding, {allowed:.4g})")
    return where


@dataclass
class Samplers:
    """One temperature's decoding: None for greedy, else the speculative and the target-only loop's seeded
    sampling (each its own generator, so the speculative outputs do not depend on the baseline's)."""

    temperature: float
    speculative: Sampling | None = None
    target_only: Sampling | None = None

    @classmethod
    def at(cls, temperature: float, seed: int, device: torch.device) -> Samplers:
        if temperature == 0:
            return cls(0.0)
        return cls(temperature, Sampling(temperature, seed, device), Sampling(temperature, seed, device))

    @property
    def sampled(self) -> bool:
        return self.speculative is not None


def _decode_batch(p: Plan, loops: FastDecoding, batch: list[list[int]], stop: set[int], samplers: Samplers):
    """Speculative and target-only decoding of one batch, each timed without the recording of a new shape."""
    def timed(fn, sampling):
        setup = loops.setup_s
        result, seconds = _timed(p.device, lambda: fn(batch, p.max_new_tokens, stop, sampling=sampling))
        return result, seconds - (loops.setup_s - setup)

    specs, spec_s = timed(loops.speculative, samplers.speculative)
    refs, ref_s = timed(loops.greedy, samplers.target_only)
    return specs, spec_s, refs, ref_s


def _check_request(p: Plan, target: FrozenTarget, prompts: PromptSet, rid, prompt, spec, ref) -> dict | None:
    try:
        return compare(target, len(prompt), spec.tokens, ref, p.tie_tolerance)
    except OutputMismatch as exc:
        raise OutputMismatch(f"prompt set {prompts.name!r}, request {rid}: {exc}. Greedy speculative decoding "
                             "must reproduce the target's own output; this is a bug in the decoding loop, or the "
                             "drafter and target disagree on the tokenizer (report it)") from None


def evaluate_set(p: Plan, loops: FastDecoding, target: FrozenTarget, prompts: PromptSet, stop: set[int],
                 requests: list[dict], samplers: Samplers) -> SetResult:
    from tqdm import tqdm

    result = SetResult(prompts.name, prompts.source, len(prompts.prompts), prompts.skipped,
                       AcceptanceStats(loops.drafter.block_size), sampled=samplers.sampled)
    label = prompts.name + (f" T={samplers.temperature:g}" if samplers.sampled or len(p.temperatures) > 1 else "")
    # A terminal shows a bar per set; a log gets a plain line at the first prompt, every 30 s and at the last.
    said = PlainProgress(len(prompts.prompts), in_flight=p.batch_size)  # an ETA once a batch is done
    pairs = list(zip(prompts.ids, prompts.prompts, strict=True))
    bar = tqdm(total=len(pairs), desc=label, leave=False, disable=True if said.enabled else None)
    for start in range(0, len(pairs), p.batch_size):
        batch = pairs[start : start + p.batch_size]
        specs, spec_s, refs, ref_s = _decode_batch(p, loops, [prompt for _, prompt in batch], stop, samplers)
        result.speculative_s += spec_s
        result.target_only_s += ref_s
        for (rid, prompt), spec, ref in zip(batch, specs, refs, strict=True):
            # Sampled outputs differ from the target-only ones by design: only greedy outputs are compared.
            tie = None if samplers.sampled else _check_request(p, target, prompts, rid, prompt, spec, ref)
            _record(p, result, requests, prompts.name, rid, prompt, spec, ref, tie, samplers.temperature)
        bar.update(len(batch))
        done = start + len(batch)
        if said.due(done):
            say_progress(f"eval: {label} {done}/{said.total} prompts | tau {result.stats.tau:.2f} | "
                         f"{said.timing(done)}", set=prompts.name, temperature=samplers.temperature, done=done,
                         total=said.total, tau=result.stats.tau)
    bar.close()
    return result


def _record(p: Plan, result: SetResult, requests: list[dict], set_name: str, rid, prompt, spec, ref, tie,
            temperature: float) -> None:
    new = len(spec.tokens) - len(prompt)
    result.stats.add(spec.accept_lengths, new, spec.confidence)
    result.target_only_tokens += len(ref) - len(prompt)
    if result.sampled:
        equal = None  # not compared: both sample
    elif tie is None:
        result.outputs_equal += 1
        equal = True
    else:
        result.near_ties.append({"id": rid, **tie})
        equal = False
    requests.append({
        "set": set_name, "id": rid, "temperature": temperature, "prompt_tokens": len(prompt), "new_tokens": new,
        "accept_lengths": spec.accept_lengths,
        "tau": sum(spec.accept_lengths) / max(1, len(spec.accept_lengths)), "equal_to_target_only": equal,
        "output_ids": spec.tokens[len(prompt):], "output": p.tokenizer.decode(spec.tokens[len(prompt):]),
    })


def evaluate(p: Plan) -> tuple[dict, list[dict]]:
    drafter, target = load_models(p)
    stop = stop_token_ids(target.model, p.tokenizer)
    loops = FastDecoding(target, drafter, p.batch_size, log=lambda line: console.print(line, markup=False))
    if p.device.type == "cuda":  # kernels, allocator and cuBLAS handles warm before anything is timed
        first = p.sets[0].prompts[: p.batch_size]
        for sampled in sorted({t > 0 for t in p.temperatures}):  # greedy and sampled steps are recorded apart
            sampling = Sampling(1.0, p.seed, p.device) if sampled else None  # a throwaway generator
            loops.speculative(first, p.max_new_tokens, stop, sampling=sampling)
            loops.greedy(first, p.max_new_tokens, stop, sampling=sampling)
    requests: list[dict] = []
    results = {}
    for temperature in p.temperatures:  # one generator pair per temperature: each reproducible on its own
        samplers = Samplers.at(temperature, p.seed, p.device)
        results[temperature] = [evaluate_set(p, loops, target, s, stop, requests, samplers) for s in p.sets]
    meta = {
        "drafter": str(p.drafter_dir), "target": p.target_path,
        "device": torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else "cpu",
        "dtype": str(p.target_dtype).removeprefix("torch."), "drafter_dtype": str(p.drafter_dtype).removeprefix("torch."),
        "target_quantization": p.target_quantization, "target_attention": target.attention,
        "block_size": drafter.block_size, "max_new_tokens": p.max_new_tokens, "limit": p.limit, "seed": p.seed,
        "stop_token_ids": sorted(stop), "torch": torch.__version__, "batch_size": p.batch_size,
        "decoding": loops.describe(),
    }
    return build_report(meta, results, drafter.block_size), requests


def bench(args, cfg: RunConfig) -> int:
    """--bench: bench/decoding.py's figures at --preset's shape (no drafter, prompts or --out are read)."""
    from ..bench import decoding as eval_bench

    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        new_tokens = cli_args.chosen(cfg, "eval.max_new_tokens", 128)
        return eval_bench.main(args.preset, args.batch_size, new_tokens, device,
                               _dtype(cli_args.chosen(cfg, "target.dtype", "auto"), device))
    except (ValueError, RuntimeError) as exc:
        cli_args.say_error(console, f"--bench: {exc}")
        return 2


def write_results(p: Plan, report: dict, requests: list[dict]) -> int:
    """eval.json, requests.jsonl and eval.png in --out, the table on the terminal (even when writing fails)."""
    try:
        with storage.explained(f"writing the results to --out {p.out}", p.out,
                               "Free space or make it writable, then run again (or give another --out)"):
            p.out.mkdir(parents=True, exist_ok=True)
            write_json(p.out / "eval.json", report)
            write_requests(p.out / "requests.jsonl", requests)
            plot(report, p.out / "eval.png")
    except storage.StorageError as exc:
        console.print(table(report))  # the numbers on the terminal at least
        cli_args.say_error(console, str(exc))
        return cli_args.FAULT
    console.print(table(report))
    console.print(f"eval.json, requests.jsonl and eval.png in {p.out}", markup=False)
    update_card(p, report)
    return 0


def update_card(p: Plan, report: dict) -> None:
    """The drafter's model card (a published drafter's README.md) gets this evaluation's tau per prompt set."""
    rows = [model_card.TauRow(name, r["prompts"], r["tau"]) for name, r in report["sets"].items()]
    source = (f"measured by dflash-eval ({report['device']}, target in {report['dtype']}, greedy, up to "
              f"{report['max_new_tokens']} new tokens)")
    try:
        if model_card.update_tau(p.drafter_dir, rows, source):
            console.print(f"tau per prompt set written into {p.drafter_dir / model_card.CARD}", markup=False)
    except OSError as exc:  # the results are written; the card is a copy of them
        console.print(f"note: the model card {p.drafter_dir / model_card.CARD} was left as it was ({exc})",
                      markup=False)


def log_to_run(run_dir: Path, drafter_dir: Path, report: dict) -> None:
    """--run: the results into the tracker runs the training run logged to (OUTPUT/trackers.json), at the step
    of the drafter evaluated (a checkpoint's, else the run's last), beside tau before and after training."""
    from ..infra.metrics import Metrics

    recorded = run_dir_lib.recorded_summary(run_dir)
    step = ckpt.step_of(drafter_dir.resolve())
    if step is None:
        step = recorded["steps"] if isinstance(recorded, dict) else 0
    with storage.explained(f"logging the results to the trackers of --run {run_dir}", run_dir,
                           "The results are in --out; free space or make the run writable to log them there too"):
        metrics = Metrics.of_run(run_dir, lambda line: console.print(line, markup=False))
        metrics.scalars(tracker_scalars(report), step)
        metrics.close()


def print_settings(args, cfg: RunConfig) -> None:
    """--print-config: the run config as this evaluation would use it (the flags, --config / --set, then --run's
    recorded settings, then dflash-eval's defaults, a dtype resolved by the device), as TOML on stdout, with
    dflash-eval's own inputs (the drafter, prompt sets, --out) as comments after it."""
    s = settings(args, cfg)
    target_dtype = s.target_dtype or str(_dtype("auto", pick_device(args.device))).removeprefix("torch.")
    # Only the keys an evaluation reads (the drafter's shape is its config.json's): a run config of its own.
    values = {"target": {"path": s.target, "dtype": target_dtype, "quantization": s.quantization,
                         "trust_remote_code": s.trust_remote_code},
              "train": {"dtype": s.drafter_dtype or target_dtype}, "eval": {"max_new_tokens": s.max_new_tokens}}
    sets = name_sources(args.prompts, s.names) if args.prompts or s.names else []
    own = {"--drafter": s.drafter, "--prompts": " ".join(f"{name}={source}" for name, source in sets) or None,
           "--out": s.out, "--limit": s.limit, "--batch-size": args.batch_size,
           "--temperature": " ".join(f"{t:g}" for t in args.temperature), "--seed": args.seed}
    lines = [f"# {flag} {value}" if value is not None else f"# {flag} is unset" for flag, value in own.items()]
    read = f" and --run {args.run}" if args.run else ""
    print(f"# The run-config keys dflash-eval reads, merged: flags, --config / --set{read}, its defaults "
          "(train.dtype: the drafter's)\n" + cli_args.config_toml(values).lstrip("\n")
          + f"\n# dflash-eval's own inputs (its flags{read}):\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    plain_output_off_a_terminal()  # before anything loads or saves a checkpoint
    args = cli_args.parse(parser(), argv)
    if isinstance(args, int):  # a bad flag, said by argparse (2), or --help (0)
        return args
    cli_args.use_log_format(args, "eval")
    try:
        cfg = cli_args.run_config(args, KEY_FLAGS, whole_run=False)
        if args.print_config:  # what this evaluation would use, --run's recorded settings included
            print_settings(args, cfg)
            return 0
    except cli_args.bad_input_errors(EvalError) as exc:
        cli_args.say_error(console, str(exc))
        return cli_args.BAD_INPUT
    if args.bench:
        return bench(args, cfg)
    try:
        p = plan(args, cfg)
        report, requests = evaluate(p)
    except KeyboardInterrupt as exc:  # SIGTERM / Ctrl-C: the results are written only at the end (write_results)
        name = signal_name_of(exc)
        console.print(f"stopped by {name} before the evaluation finished: nothing was written; run the same command "
                      "again to evaluate", soft_wrap=True)
        return stop_exit_code(name)
    except (*cli_args.bad_input_errors(EvalError), storage.StorageError) as exc:
        cli_args.say_error(console, str(exc))
        return cli_args.exit_code(exc, EvalError)
    except OutputMismatch as exc:
        cli_args.say_error(console, str(exc),
                           bold="error: speculative output differs from target-only greedy decoding:")
        return cli_args.FAULT
    code = write_results(p, report, requests)
    if args.run and code == 0:
        try:
            log_to_run(Path(args.run), p.drafter_dir, report)
        except storage.StorageError as exc:
            cli_args.say_error(console, str(exc))
            return cli_args.FAULT
    return code


if __name__ == "__main__":
    sys.exit(main())

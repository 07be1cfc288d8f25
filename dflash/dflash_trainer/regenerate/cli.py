"""dflash-regenerate: the target writes the training answers, resumably.

    dflash-regenerate --target PATH --data FILE_OR_DATASET... --out DIR            # engine hf, this machine
    torchrun --nproc-per-node G -m dflash_trainer.regenerate --target ... --out DIR  # data-parallel, G GPUs
    dflash-regenerate --engine openai --endpoint http://host:8000/v1 --model NAME --concurrency 128 \\
        --target PATH --data ... --out DIR                                           # a serving engine

The output, DIR/part-*.jsonl, is what data.train takes. Running the same command again skips what is
answered and finishes the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..infra.gc_pause import gc_paused

with gc_paused():  # torch's and transformers' imports, a fifth faster: infra/gc_pause.py
    from rich.markup import escape

    from .. import cli_args
    from ..config import DTYPE_NAMES, ConfigError, RunConfig
    from ..data.prompts import check_chat_template
    from ..data.rows import DataError, load_rows
    from ..decoding.speculative import stop_token_ids
    from ..infra.console import console, plain_output_off_a_terminal
    from ..infra.hub import remote_code_hint
    from ..infra.stop_signal import exit_code as stop_exit_code
    from ..infra.stop_signal import signal_name_of
    from ..infra.storage import StorageError
    from ..run.loading import check_target
    from ..target.frozen import check_supported_target
    from .driver import Stopped, StopSignal, World, run_chunks
    from .engine_openai import EndpointError
    from .plan import TOOL_CALLS_KEPT, check_plan, describe_skips, make_plan
    from .sampling import Sampling
    from .shards import FINGERPRINT, OutputDir, target_content_hash
    from .summary import collect, print_table


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-regenerate", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    cli_args.key_flag(p, "--target", "target.path", "the target model directory (its tokenizer renders the prompts; "
                      "required, here or in --config)")
    p.add_argument("--data", nargs="+", metavar="FILE_OR_DATASET", type=cli_args.file_or_dataset,
                   help="what data.train takes: JSONL files or globs (messages / conversations / prompt rows), "
                        "or one hub dataset name (required)")
    p.add_argument("--out", help="output directory: part-*.jsonl shards and summary.json (required)")
    cli_args.add_config_flags(p)
    p.add_argument("--engine", choices=("hf", "openai"), default="hf",
                   help="hf: the target in this process (default); openai: an OpenAI-compatible server")
    g = p.add_argument_group("sampling (part of every answer's resume key)")
    g.add_argument("--max-new-tokens", type=cli_args.NEW_TOKENS, default=2048)
    g.add_argument("--temperature", type=cli_args.number(ge=0, le=100), default=0.0,
                   help="0: greedy (default); > 0 samples, seeded")
    g.add_argument("--top-p", type=cli_args.number(gt=0, le=1), default=1.0)
    g.add_argument("--seed", type=cli_args.SEED, default=0)
    g.add_argument("--turns", choices=("last", "all"), default="last",
                   help="last: answer the final user turn; all: every assistant turn, in order, each prompt "
                        "holding the target's own earlier answers")
    g.add_argument("--chat-template-kwargs", type=json_object, default={}, metavar="JSON",
                   help='passed to the chat template, e.g. \'{"enable_thinking": false}\' for Qwen3 without thinking')
    g.add_argument("--stop-token", action="append", metavar="TOKEN",
                   help="a token that ends an answer (repeatable; default: the target's EOS tokens); engine openai "
                        "sends it as the request's `stop`")
    d = p.add_argument_group("input and output")
    d.add_argument("--limit", type=cli_args.PROMPTS, help="only the first N source rows")
    d.add_argument("--split", default="train", help="dataset split (hub datasets)")
    d.add_argument("--shard-size", type=cli_args.PROMPTS, default=1024,
                   help="prompts per shard: a killed run loses at most the shard in progress")
    h = p.add_argument_group("engine hf")
    h.add_argument("--batch-size", type=cli_args.ROWS, default=256,
                   help="most prompts per generate call (fewer when the KV cache would not fit)")
    cli_args.key_flag(h, "--dtype", "target.dtype", "the target's dtype; auto (the default unless --config or --set "
                      "gives it): bfloat16 on a GPU, float32 on the CPU", choices=("auto", *DTYPE_NAMES))
    h.add_argument("--no-compile", action="store_true", help="GPU: decode eagerly (no static-cache CUDA graphs)")
    cli_args.key_flag(p, "--trust-remote-code", "target.trust_remote_code",
                      "run the modelling and tokenizer code the target's directory ships", action="store_true")
    o = p.add_argument_group("engine openai")
    o.add_argument("--endpoint", help="the server's base URL, e.g. http://localhost:8000/v1")
    o.add_argument("--model", help="the served model name (default: the server's only model)")
    o.add_argument("--concurrency", type=cli_args.PROCESSES, default=64, help="requests in flight")
    o.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    o.add_argument("--request-timeout", type=cli_args.SECONDS, default=600.0, help="seconds per request")
    o.add_argument("--retries", type=cli_args.integer(ge=0, le=100), default=5,
                   help="retries per request (connection errors, timeouts, 408, 429, 5xx)")
    o.add_argument("--retry-backoff", type=cli_args.number(ge=0, le=3600), default=1.0,
                   help="backoff in s: the first retry at once, then 2x, 4x, ... this (at most 120 s) plus up to "
                        "this much random jitter; a 429 / 503 with Retry-After waits what the server says")
    o.add_argument("--extra-body", type=json_object, default={}, metavar="JSON",
                   help='extra request fields, e.g. \'{"stop_token_ids": [151645]}\' for vLLM (return_token_ids '
                        'is asked for by itself where the server gives it; naming it here decides it)')
    cli_args.add_log_format_flag(p)
    return p


# The flags that set one run-config key each: --config / --set give the same keys.
KEY_FLAGS = {"--target": "target.path", "--dtype": "target.dtype", "--trust-remote-code": "target.trust_remote_code"}


def apply_config(args) -> RunConfig:
    """The run config merged (--config < --set < --target, --dtype, --trust-remote-code), its keys written back
    to args: a training config's target serves its regeneration too."""
    cfg = cli_args.run_config(args, KEY_FLAGS, whole_run=False)
    args.target = cli_args.chosen(cfg, "target.path", None)
    args.dtype = cli_args.chosen(cfg, "target.dtype", "auto")
    args.trust_remote_code = cfg.target.trust_remote_code
    return cfg


def check_args(args) -> list[str]:
    problems = [f"{flag} is missing: {fix}" for flag, value, fix in (
        ("--target", args.target, "give the target model directory (or --config with target.path)"),
        ("--data", args.data, "give the JSONL files or hub dataset to answer"),
        ("--out", args.out, "give the output directory")) if not value]
    problems += Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed, args.turns).problems()
    for name in ("shard_size", "batch_size", "concurrency"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.limit is not None and args.limit < 1:
        problems.append("--limit must be >= 1")
    if args.retries < 0:
        problems.append("--retries must be >= 0")
    if args.engine == "openai" and not args.endpoint:
        problems.append("--engine openai needs --endpoint (the server's base URL, e.g. http://localhost:8000/v1)")
    if args.engine == "hf" and args.endpoint:
        problems.append("--endpoint is for --engine openai")
    return problems


def load_tokenizer(target: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:  # a missing directory, or a hub id while the hub is unreachable: refused in seconds, not after retries
        check_target(target)
    except ConfigError as exc:
        raise DataError(str(exc).replace("target.path", "--target", 1)) from None
    try:
        return AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    except Exception as exc:  # not a model directory, unreachable hub
        raise DataError(f"--target {target}: cannot load its tokenizer ({exc.__class__.__name__}: {exc})"
                        f"{remote_code_hint(exc, '--trust-remote-code')}; give the target model's directory "
                        "(config.json, tokenizer files)") from exc


def target_config(target: str, trust_remote_code: bool = False):
    """The target's config.json (no weights); None where there is none to read (engine openai: the server
    knows its own model)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(target, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if hint := remote_code_hint(exc, "--trust-remote-code"):  # not "no config": code not allowed to run
            raise DataError(f"--target {target}: cannot read its config ({exc}){hint}") from exc
        return None


def context_of(config) -> int | None:
    """The target's context in tokens (max_position_embeddings of its text config); None: no limit known."""
    if config is None:
        return None
    return getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)


def max_context(target: str, trust_remote_code: bool = False) -> int | None:
    return context_of(target_config(target, trust_remote_code))


def check_family(config, target: str, trust_remote_code: bool) -> None:
    """The trainer's one check of the target's family (a decoder-only causal LM it can draft for), before
    anything is written: answers a drafter could not train on are not worth generating."""
    if config is not None:
        check_supported_target(config, f"--target {target}", trust_remote_code)


def make_engine(args, tokenizer, sampling: Sampling, device, log):
    if args.engine == "openai":
        from .engine_openai import OpenAIEngine

        stop = stop_token_ids(_generation_config(args.target), tokenizer, args.stop_token)
        engine = OpenAIEngine(args.endpoint, args.model, tokenizer, sampling, stop, args.concurrency,
                              args.request_timeout, args.retries, args.retry_backoff, args.api_key, args.extra_body,
                              args.chat_template_kwargs, args.stop_token)
        log(f"engine openai: {engine.url}, model {engine.check()!r}, {args.concurrency} requests in flight")
        if why := engine.probe_token_ids():
            log(f"[yellow]warning:[/] {engine.url} does not send the generated token ids: {escape(why)}. Each "
                "answer's ids are its text re-tokenized, which may differ from the tokens the target generated "
                "(rows record regen.answer_ids = retokenized; the summary counts them)")
        return engine
    from .engine_hf import HFEngine, load_target

    model = load_target(args.target, device, args.dtype, args.trust_remote_code)
    stop = stop_token_ids(model, tokenizer, args.stop_token)
    if not stop:
        log("[yellow]warning:[/] the target names no EOS token: every answer runs to --max-new-tokens "
            "(give --stop-token)")
    return HFEngine(model, tokenizer, sampling, stop, args.batch_size, compile=False if args.no_compile else None,
                    log=log)


def _generation_config(target: str):
    """The target's generation config (its EOS ids), without loading its weights."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(target)
    except OSError:  # no generation_config.json: the tokenizer's EOS decides
        return None


def read_plan(args, tokenizer, sampling: Sampling):
    """(rows, plan, the target's context): the target's family checked, the source rows planned, before
    anything is written."""
    config = target_config(args.target, args.trust_remote_code)
    check_family(config, args.target, args.trust_remote_code)
    rows = load_rows(args.data, split=args.split, flags="--data")
    context = context_of(config)
    plan = make_plan(rows, tokenizer, sampling, args.chat_template_kwargs, args.limit, context)
    check_plan(plan, args.data, f"--target {args.target}")
    return rows, plan, context


def say_plan(plan, log) -> None:
    """The rows skipped and the turns kept as they were, with their first row numbers."""
    if plan.skipped:
        log(f"skipped rows: {escape(describe_skips(plan))}")
    if plan.kept.rows:
        log(f"{plan.kept.turns[TOOL_CALLS_KEPT]:,} {TOOL_CALLS_KEPT} in {plan.kept.rows[TOOL_CALLS_KEPT]:,} rows "
            f"({plan.kept.rows_named(TOOL_CALLS_KEPT)})")


def run(args) -> dict | None:
    with StopSignal() as stop:
        return _run(args, stop)


def _run(args, stop: StopSignal) -> dict | None:
    problems = check_args(args)
    if problems:
        raise DataError("invalid arguments:\n  - " + "\n  - ".join(problems))
    world = World.from_env()
    if args.engine == "openai" and world.size > 1:
        raise DataError("engine openai runs in one process (the server batches); raise --concurrency instead of "
                        "starting it under torchrun")
    device = world.start()
    lead = world.rank == 0

    def log(*parts):
        if lead:
            console.print(*parts)

    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed, args.turns)
    tokenizer = load_tokenizer(args.target, args.trust_remote_code)
    check_chat_template(tokenizer, args.target)
    rows, plan, context = read_plan(args, tokenizer, sampling)
    out = OutputDir(args.out, world.rank)
    out.check_writable()  # before the weights load, which takes minutes for a large target
    engine = make_engine(args, tokenizer, sampling, device, log)

    target_id = str(Path(args.target).resolve()) if Path(args.target).exists() else args.target
    manifest = {"target": target_id, FINGERPRINT: target_content_hash(args.target), "sampling": sampling.as_dict(),
                "chat_template_kwargs": args.chat_template_kwargs}
    out.lock()
    out.check_or_create(manifest)
    if lead and out.clean_partial():
        log("removed the half-written shard of an earlier run that was killed")
    if lead and plan.rows_read == len(rows) and (stale := out.drop_answers_not_in({j.key for j in plan.jobs})):
        log(f"dropped {stale:,} answer{'s' if stale != 1 else ''} in {escape(args.out)} to prompts no longer in "
            "--data (edited or removed since they were answered): an edited prompt is answered anew")
    world.barrier()
    done = out.done_keys()  # the one read of the shards there; the summary counts them from it
    world.barrier()  # every process has read them before any writes one: none is counted twice
    answered = sum(j.key in done for j in plan.jobs)
    log(f"{len(plan.jobs):,} prompts from {plan.rows_read:,} rows ({sum(plan.skipped.values()):,} skipped); "
        f"{answered:,} already answered in {args.out}, {len(plan.jobs) - answered:,} to go"
        + (f" over {world.size} processes" if world.size > 1 else ""))
    say_plan(plan, log)
    stats = None
    try:
        stats = run_chunks(engine, rows, tokenizer, plan, out, world, sampling, args.chat_template_kwargs, context,
                           args.shard_size, done, log, stop)
        # a signal here (waiting on the other processes) stops this one; the summary is the next run's
        summary = summarize(args, world, engine, plan, out, stats, sampling, target_id)
    except Stopped as exc:
        if s := exc.stats or stats:
            where = f" (rank {world.rank} of {world.size})" if world.size > 1 else ""
            now = f"; {answered + s.rows:,} of {len(plan.jobs):,} prompts are answered in {args.out}" \
                if world.size == 1 else ""
            exc.note = f"this run{where} answered {s.rows:,} prompts and wrote {s.shards} shard(s){now}"
        world.stop()
        raise
    stop.interruptible = False  # the run is done: a signal now changes nothing
    world.barrier()
    world.stop()
    return summary


def summarize(args, world: World, engine, plan, out: OutputDir, stats, sampling: Sampling, target_id: str):
    """summary.json and the table (lead process; None elsewhere). One collective, which waits for every
    process: what each did and the rows it wrote (the summary reads no shard again)."""
    gathered = world.gather((stats, out.added))
    if world.rank != 0:
        return None
    runs, added = [s for s, _ in gathered], [a for _, a in gathered]
    summary = collect(sum(added, out.found), shards=len(out.shards()), engine=args.engine, target=target_id,
                      model=getattr(engine, "model", None) if args.engine == "openai" else None,
                      sampling=sampling.as_dict(), chat_kwargs=args.chat_template_kwargs, plan_skipped=plan.skipped,
                      rows_read=plan.rows_read, runs=runs, world=world.size,
                      skipped_rows=plan.skips.first_rows, not_regenerated=plan.kept.as_dict(with_turns=True))
    out.write_summary(summary)
    print_table(summary, args.out)
    return summary


def main(argv: list[str] | None = None) -> int:
    plain_output_off_a_terminal()  # before anything loads or saves a checkpoint
    args = cli_args.parse(parser(), argv)
    if isinstance(args, int):
        return args
    cli_args.use_log_format(args, "regenerate")
    try:
        cfg = apply_config(args)
        if args.print_config:
            cli_args.print_config(cfg)
            return 0
        run(args)
    except (DataError, EndpointError, StorageError, ConfigError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        return cli_args.exit_code(exc, EndpointError)  # a full disk is a fault at run time (1), as in train and eval
    except Stopped as exc:  # SIGTERM or Ctrl-C while answering: a clean stop, what is answered written
        if exc.note:
            console.print(f"stopped by {exc.signal_name}: {exc.note}. Run the same command to resume")
            return 0
        return _interrupted(exc)
    except KeyboardInterrupt as exc:  # start-up, or a second signal (infra/stop_signal.py)
        return _interrupted(exc)
    return 0


def _interrupted(exc: KeyboardInterrupt) -> int:
    """A signal before the answering started (nothing written), or a second one (at once): one line, 130 / 143."""
    name = signal_name_of(exc)
    if getattr(exc, "second", False):
        console.print(f"stopped at once by a second {name}: the shards written are kept (a shard being written is "
                      "not); run the same command to resume")
    else:
        console.print(f"stopped by {name} before answering: no prompt was answered in this run; run the same command "
                      "to start again")
    return stop_exit_code(name)


if __name__ == "__main__":
    sys.exit(main())

"""The embedded default's assets: a tokenizer, a tiny Qwen3 target and its training data.

Everything is built on this machine from the corpus shipped in `assets/tiny_chat.jsonl`, with
fixed seeds, so `make train` needs no model hub and no network. The target is a small Qwen3
trained for a few seconds on the corpus (so its greedy answers resemble it); its answers are then
regenerated, as the real recipe does, and the drafter is trained to predict them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from .config import RunConfig
from .data.held_out import distinct_prompts
from .data.rows import normalise_messages
from .distributed import parallel
from .infra.console import console
from .regenerate import regenerate_rows
from .regenerate.engine_hf import HFEngine
from .regenerate.sampling import Sampling

CORPUS = Path(__file__).parent / "assets" / "tiny_chat.jsonl"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TARGET_SHAPE = {
    "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 512, "tie_word_embeddings": False,
}


def read_corpus(path: Path = CORPUS) -> list[list[dict]]:
    return [normalise_messages(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def build_tokenizer(texts: list[str], vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", mask_token="<|mask|>",
        chat_template=CHAT_TEMPLATE,
    )


def _pretrain(model, tokenizer, conversations, steps: int, seed: int) -> None:
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        pick = torch.randint(len(ids), (32,), generator=g).tolist()
        width = max(len(ids[i]) for i in pick)
        batch = torch.full((32, width), tokenizer.pad_token_id)
        labels = torch.full((32, width), -100)
        for r, i in enumerate(pick):
            batch[r, : len(ids[i])] = torch.tensor(ids[i])
            labels[r, : len(ids[i])] = torch.tensor(ids[i])
        loss = model(input_ids=batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def build_embedded(out_dir: Path, pretrain_steps: int = 150, seed: int = 0, max_new_tokens: int = 48) -> dict:
    """Target dir + train/eval JSONL under `out_dir` (reused when already there)."""
    out_dir = Path(out_dir)
    target_dir, data_dir = out_dir / "target", out_dir / "data"
    done = out_dir / "assets.json"
    if done.is_file():
        return _resolved(json.loads(done.read_text()), out_dir)
    conversations = read_corpus()
    torch.manual_seed(seed)
    tokenizer = build_tokenizer([m["content"] for c in conversations for m in c])
    config = Qwen3Config(vocab_size=len(tokenizer), **TARGET_SHAPE,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen3ForCausalLM(config)
    _pretrain(model, tokenizer, conversations, pretrain_steps, seed)
    model.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    # One row per distinct prompt (the corpus repeats some): the eval rows are then held out for real.
    distinct = distinct_prompts(conversations)
    sampling = Sampling(max_new_tokens=max_new_tokens)
    engine = HFEngine(model, tokenizer, sampling, stop_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")])
    answered = regenerate_rows(engine, [{"messages": c} for c in distinct], tokenizer, sampling)
    rows = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in answered]
    data_dir.mkdir(parents=True, exist_ok=True)
    held_out = len(rows) // 10
    for name, part in (("eval", rows[:held_out]), ("train", rows[held_out:])):
        with open(data_dir / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    assets = {  # relative to out_dir: the run can be resumed from any directory, or moved
        "target": "target",
        "train": "data/train.jsonl",
        "eval": "data/eval.jsonl",
        "mask_token_id": tokenizer.mask_token_id,
    }
    done.write_text(json.dumps(assets, indent=2))
    return _resolved(assets, out_dir)


def _resolved(assets: dict, out_dir: Path) -> dict:
    """Paths under out_dir. Older assets.json files held them relative to the directory the run was
    started from; the layout is fixed, so they resolve the same way."""
    layout = {"target": "target", "train": "data/train.jsonl", "eval": "data/eval.jsonl"}
    return {**assets, **{key: str(out_dir / rel) for key, rel in layout.items()}}


def resolve_target(cfg: RunConfig, ctx: parallel.Context) -> RunConfig:
    """The embedded default builds its own target and data under the run directory (rank 0 builds).
    Data the config names is used as given: only empty data.train / data.eval get the embedded data."""
    if cfg.target.path != "embedded":
        return cfg
    where = Path(cfg.output_dir) / "embedded"
    if ctx.rank == 0:
        console.print("[bold]embedded default[/]: building the tiny target, tokenizer and data (cached)")
        build_embedded(where)
    ctx.barrier()
    assets = build_embedded(where)  # cached: reads assets.json
    cfg.target.path = assets["target"]
    if not cfg.data.features_dir and not cfg.data.train:
        cfg.data.train = [assets["train"]]
        cfg.data.eval = cfg.data.eval or [assets["eval"]]
    return cfg


def main(argv: list[str] | None = None) -> int:
    """python -m dflash_trainer.embedded DIR: build the embedded default's target and data in DIR (the recipe
    chain's first stage on the embedded default; the trainer builds the same under its run directory)."""
    import argparse

    from . import cli_args

    ap = argparse.ArgumentParser(prog="python -m dflash_trainer.embedded", description=main.__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the directory: DIR/target, DIR/data (kept: a second build reuses them)")
    ap.add_argument("--pretrain-steps", type=cli_args.STEPS, default=150, help="the target's training steps")
    ap.add_argument("--max-new-tokens", type=cli_args.NEW_TOKENS, default=48, help="the length of its answers")
    a = ap.parse_args(argv)
    print(f"embedded default: building the tiny target, its tokenizer and data in {a.out} (cached)", flush=True)
    assets = build_embedded(a.out, a.pretrain_steps, max_new_tokens=a.max_new_tokens)
    print(f"embedded default: target {assets['target']}, data {assets['train']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

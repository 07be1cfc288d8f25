"""Distributed training on CPU with gloo: target ranks feed drafter ranks (torchrun), offline mode.

The strongest check is equality: the role split changes who computes what, never the result. A run
with 1 target + 2 drafter ranks consumes the same micro-batches per step as one process with
grad_accum = 2, with the same anchors; the step-normalised loss must match. A run stopped part-way
and resumed trains on the same micro-batches as one that was not.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dflash_run.procs import torchrun_workers
from dflash_trainer.config import load_config
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.run import checkpoint as ckpt
from dflash_trainer.train import run

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overrides(tiny_target, out):
    return [
        f"target.path={tiny_target['target']}", f"data.train={json.dumps([tiny_target['train']])}",
        f"data.eval={json.dumps([tiny_target['eval']])}", f"output_dir={out}", "train.steps=4",
        "train.micro_batch=4", "train.num_anchors=8", "train.log_every=1", "eval.prompts=2",
        "eval.max_new_tokens=8", "data.context_buckets=[64, 128, 256]",  # no row reaches 256
    ]


def torchrun(nproc: int, args: list[str], timeout=420) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", "dflash_trainer.train", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    # A session of its own: a run that hangs past the timeout is killed with its workers, not just torchrun.
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            raise
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def colocated_accum2(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("colocated")
    return run(load_config("embedded", overrides(tiny_target, out) + ["train.grad_accum=2"]))


def test_one_target_two_drafters_match_one_process(tiny_target, tmp_path, colocated_accum2):
    out = tmp_path / "t1d2"
    sets = [x for o in overrides(tiny_target, out) for x in ("--set", o)]
    proc = torchrun(3, ["--config", "embedded", *sets, "--target-gpus", "1", "--drafter-gpus", "2"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["drafter_ranks"] == 2 and summary["target_ranks"] == 1
    assert summary["losses"] == pytest.approx(colocated_accum2["losses"], rel=1e-4)
    assert summary["tau_before"] == pytest.approx(colocated_accum2["tau_before"])  # same initial drafter
    assert "transfer" in summary["time_split_s"] and "target done" in proc.stderr
    # the drafter ranks, which never read the data, take the buckets its rows fall in from the target rank
    assert summary["context_buckets_used"] == colocated_accum2["context_buckets_used"]
    assert 256 not in summary["context_buckets_used"]
    # what `dflash-eval --run` reads: the held-out prompts tau was measured on, and the target's attention
    assert summary["target_attention"] == colocated_accum2["target_attention"]
    recorded = (out / "eval_prompts.jsonl").read_text()
    assert summary["eval_prompts"] == str(out / "eval_prompts.jsonl")
    assert recorded == Path(colocated_accum2["eval_prompts"]).read_text()  # the same held-out prompts
    from tests.helpers.trackers import scalars_in

    logged = scalars_in(out / "tb")  # the target rank's tau reaches the tracker the lead drafter rank opened
    assert logged["eval/tau_after"] == [(summary["steps"], pytest.approx(summary["tau_after"]))]
    assert len(logged["train/loss"]) == len(summary["losses"])


def test_a_loss_against_the_target_takes_its_final_states_from_the_target_rank(tiny_target, tmp_path):
    """train.loss_tv: the target rank sends its final hidden states beside the features; the losses are those
    of one process with the same loss."""
    tv = ["train.loss_ce=0.1", "train.loss_tv=0.9"]
    colocated = run(load_config("embedded", overrides(tiny_target, tmp_path / "colocated") + tv
                                + ["train.grad_accum=2"]))
    out = tmp_path / "t1d2"
    sets = [x for o in overrides(tiny_target, out) + tv for x in ("--set", o)]
    torchrun(3, ["--config", "embedded", *sets, "--target-gpus", "1", "--drafter-gpus", "2"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["losses"] == pytest.approx(colocated["losses"], rel=1e-4)
    assert summary["first_loss"] < 2.0  # 0.9 TV + 0.1 CE, not the CE alone


def test_two_targets_one_drafter(tiny_target, tmp_path, colocated_accum2):
    out = tmp_path / "t2d1"
    sets = [x for o in overrides(tiny_target, out) + ["train.grad_accum=2"] for x in ("--set", o)]
    torchrun(3, ["--config", "embedded", *sets, "--target-gpus", "2", "--drafter-gpus", "1"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["losses"] == pytest.approx(colocated_accum2["losses"], rel=1e-4)


def test_two_nodes_through_torchrun_rendezvous(tiny_target, tmp_path, colocated_accum2):
    """Two torchrun agents (two "machines" on this host) meet at a static rendezvous: node 0 runs the
    target ranks 0-1, node 1 the drafter ranks 2-3, so every feature crosses between nodes and the lead
    drafter (rank 2) is local rank 0 of the second node."""
    out = tmp_path / "nodes"
    sets = [x for o in overrides(tiny_target, out) for x in ("--set", o)]
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=2",
         "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "dflash_trainer.train", "--config", "embedded",
         *sets, "--target-gpus", "2", "--drafter-gpus", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for node in (0, 1)]
    results = [p.communicate(timeout=420) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stdout[-2000:] + stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["drafter_ranks"] == 2 and summary["target_ranks"] == 2
    assert summary["losses"] == pytest.approx(colocated_accum2["losses"], rel=1e-4)
    # rank 0 (a target rank, node 0) measures tau of the saved drafter and prints the summary: it reads
    # what the lead drafter wrote on node 1, so output_dir must be storage both nodes see
    assert "target done" in results[0][1] and "DFlash training summary" in results[0][1]
    assert "2 drafter rank(s)" in " ".join(results[1][1].split())  # rich wraps lines


def test_offline_dump_then_two_drafters(tiny_target, tmp_path, colocated_accum2):
    feats, out = tmp_path / "features", tmp_path / "offline"
    sets = [x for o in overrides(tiny_target, out) for x in ("--set", o)]
    torchrun(2, ["--config", "embedded", *sets, "--dump-features", str(feats), "--dump-batches", "8"])
    assert json.loads((feats / "meta.json").read_text())["micro_batches"] == 8
    torchrun(2, ["--config", "embedded", *sets, "--set", f"data.features_dir={feats}",
                 "--target-gpus", "0", "--drafter-gpus", "2"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["losses"] == pytest.approx(colocated_accum2["losses"], rel=1e-4)
    assert "disk" in summary["time_split_s"]
    assert summary["context_buckets_used"] == colocated_accum2["context_buckets_used"]  # from the shards
    # One drafter started by hand (no torchrun), as on a one-GPU machine: grad_accum = 2 takes the same
    # micro-batches per step as the two ranks did.
    one = tmp_path / "one"
    sets = [x for o in overrides(tiny_target, one) + ["train.grad_accum=2"] for x in ("--set", o)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "dflash_trainer.train", "--config", "embedded", *sets,
                           "--set", f"data.features_dir={feats}"], capture_output=True, text=True, timeout=300,
                          env=dict(env, OMP_NUM_THREADS="1"), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    alone = json.loads((one / "summary.json").read_text())
    assert alone["losses"] == pytest.approx(colocated_accum2["losses"], rel=1e-4)


def test_offline_fsdp_drafters_match_one_process_and_resume(tiny_target, tmp_path, colocated_accum2):
    """parallel.drafter_sharding = fsdp: the drafter split across 2 drafter ranks (FSDP2 on gloo) trains
    the same losses, writes whole checkpoints (gathered), and a resume from one continues identically."""
    feats, out = tmp_path / "features", tmp_path / "fsdp"
    sets = [x for o in overrides(tiny_target, out) + ["train.checkpoint_every=2", "train.keep_last=3",
                                                      "parallel.drafter_sharding=fsdp"] for x in ("--set", o)]
    torchrun(2, ["--config", "embedded", *sets, "--dump-features", str(feats), "--dump-batches", "8"])
    offline = [*sets, "--set", f"data.features_dir={feats}", "--target-gpus", "0", "--drafter-gpus", "2"]
    proc = torchrun(2, ["--config", "embedded", *offline])
    assert "2 drafter rank(s) (fsdp)" in " ".join(proc.stderr.split())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["losses"] == pytest.approx(colocated_accum2["losses"], rel=1e-4)
    # the checkpoint holds the whole drafter (a plain HF directory) and the fp32 masters + AdamW state
    from dflash_trainer.model.drafter import DFlashDrafter
    from dflash_trainer.run.checkpoint import load_train_state

    step2 = out / "checkpoints" / "step-00000002"
    whole = DFlashDrafter.from_pretrained(step2)
    assert whole.num_params() == DFlashDrafter.from_pretrained(out / "drafter").num_params()
    assert set(load_train_state(step2)["optimizer"]["fsdp_full"]) == {"masters", "adamw"}
    # resume from step 2 (as after a crash there): steps 3-4 repeat exactly
    import shutil

    shutil.rmtree(out / "checkpoints" / "step-00000004")
    torchrun(2, ["--config", "embedded", *offline, "--resume"])
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["losses"] == pytest.approx(summary["losses"][2:], rel=1e-5)


def test_bad_split_is_refused_before_anything_starts(tiny_target, tmp_path):
    sets = [x for o in overrides(tiny_target, tmp_path / "bad") for x in ("--set", o)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           "-m", "dflash_trainer.train", "--config", "embedded", *sets, "--target-gpus", "2", "--drafter-gpus", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0
    assert "target ranks (2) + drafter ranks (1) = 3, but the world has 2 processes" in proc.stderr


def test_a_failing_drafter_rank_ends_the_whole_run_with_its_error(tiny_target, tmp_path):
    """A drafter rank that raises mid-run (here: the loss turns non-finite) must not leave the run
    hanging with the target rank still sending: the error is printed and torchrun stops every rank."""
    sets = [x for o in overrides(tiny_target, tmp_path / "fail") + ["train.steps=8", "train.lr=1e30",
                                                                     "train.warmup_ratio=0"]
            for x in ("--set", o)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           "-m", "dflash_trainer.train", "--config", "embedded", *sets, "--target-gpus", "1", "--drafter-gpus", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode != 0
    assert "lower train.lr or check the data" in proc.stdout + proc.stderr



def test_a_stopped_run_with_target_ranks_resumes_where_it_stopped(tiny_target, tmp_path):
    """1 target + 1 drafter rank, stopped as the supervisor stops a run (SIGTERM to torchrun's process group)
    once the first checkpoint is written, then --resume with the same layout: it starts at the stop's step,
    trains on the micro-batches an uninterrupted run trains on from there (the same per-step losses, so the
    target rank's data position continued), reaches the last step and publishes a drafter that loads."""
    steps, out = 32, tmp_path / "stopped"
    settings = overrides(tiny_target, out) + [f"train.steps={steps}", "train.checkpoint_every=2", "train.keep_last=2"]
    args = ["--config", "embedded", *[x for o in settings for x in ("--set", o)], "--target-gpus", "1",
            "--drafter-gpus", "1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           "-m", "dflash_trainer.train", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while not ckpt.list_checkpoints(out / "checkpoints") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in torchrun_workers(proc.pid):  # as dflash-run's stop: the workers, not torchrun
        os.kill(pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    kept = ckpt.list_checkpoints(out / "checkpoints")
    at, latest = kept[-1] if kept else (None, None)
    assert at is not None and 2 <= at < steps, (kept, stderr[-4000:])
    assert f"stopped at step {at}" in " ".join(stderr.split()), stderr[-4000:]
    assert not (out / "summary.json").exists() and not (out / "drafter").exists()
    assert ckpt.load_train_state(latest)["data_position"] == at  # micro-batches consumed: grad_accum 1, D = 1

    resumed = torchrun(2, [*args, "--resume"])
    assert f"at step {at}" in " ".join(resumed.stderr.split()), resumed.stderr[-4000:]
    assert "no checkpoint under" not in resumed.stderr
    summary = json.loads((out / "summary.json").read_text())
    straight = run(load_config("embedded", overrides(tiny_target, tmp_path / "straight") + [f"train.steps={steps}"]))
    assert summary["steps"] == steps and summary["target_ranks"] == 1
    assert summary["losses"] == pytest.approx(straight["losses"][at:], rel=1e-4)  # steps at+1 .. steps
    assert ckpt.list_checkpoints(out / "checkpoints")[-1][0] == steps
    assert summary["tau_before"] == pytest.approx(straight["tau_before"])  # the same initial drafter
    published = DFlashDrafter.from_pretrained(out / "drafter").state_dict()
    reference = DFlashDrafter.from_pretrained(tmp_path / "straight" / "drafter").state_dict()
    assert published.keys() == reference.keys()
    for name, weight in published.items():
        assert torch.allclose(weight, reference[name], rtol=1e-3, atol=1e-5), name
    # `make train` once more (--auto-resume): the finished run is reported, once (rank 0), and left as it is
    files = {p: p.lstat().st_mtime_ns for p in out.rglob("*")}
    again = torchrun(2, [*args, "--auto-resume"])
    assert " ".join(again.stderr.split()).count(f"{out} holds a finished run") == 1, again.stderr[-3000:]
    assert {p: p.lstat().st_mtime_ns for p in out.rglob("*")} == files


def test_dflash2_drafters_train_the_same_split_by_ddp_and_fsdp(tiny_target, tmp_path):
    """drafter.kind = dflash2 on 2 drafter ranks, replicated (DDP) and sharded (FSDP2, the selector its own
    unit): the losses of one process with grad_accum = 2."""
    kind = ["drafter.kind=dflash2", "drafter.selector_rank=16", "drafter.selector_top_k=8"]
    alone = run(load_config("embedded", overrides(tiny_target, tmp_path / "alone") + kind + ["train.grad_accum=2"]))
    feats = tmp_path / "features"
    for sharding in ("ddp", "fsdp"):
        out = tmp_path / sharding
        sets = [x for o in overrides(tiny_target, out) + kind + [f"parallel.drafter_sharding={sharding}"]
                for x in ("--set", o)]
        if not feats.exists():
            torchrun(2, ["--config", "embedded", *sets, "--dump-features", str(feats), "--dump-batches", "8"])
        torchrun(2, ["--config", "embedded", *sets, "--set", f"data.features_dir={feats}", "--target-gpus", "0",
                     "--drafter-gpus", "2"])
        summary = json.loads((out / "summary.json").read_text())
        assert summary["losses"] == pytest.approx(alone["losses"], rel=1e-4), sharding


def test_dspark_drafters_train_the_same_split_by_ddp_and_fsdp(tiny_target, tmp_path):
    """drafter.kind = dspark on 2 drafter ranks, replicated (DDP) and sharded (FSDP2, the Markov and confidence
    heads in the drafter's own unit, gathered through the loss): the losses of one process with grad_accum = 2."""
    kind = ["drafter.kind=dspark", "drafter.markov_rank=16"]
    alone = run(load_config("embedded", overrides(tiny_target, tmp_path / "alone") + kind + ["train.grad_accum=2"]))
    feats = tmp_path / "features"
    for sharding in ("ddp", "fsdp"):
        out = tmp_path / sharding
        sets = [x for o in overrides(tiny_target, out) + kind + [f"parallel.drafter_sharding={sharding}"]
                for x in ("--set", o)]
        if not feats.exists():
            torchrun(2, ["--config", "embedded", *sets, "--dump-features", str(feats), "--dump-batches", "8"])
        torchrun(2, ["--config", "embedded", *sets, "--set", f"data.features_dir={feats}", "--target-gpus", "0",
                     "--drafter-gpus", "2"])
        summary = json.loads((out / "summary.json").read_text())
        assert summary["losses"] == pytest.approx(alone["losses"], rel=1e-4), sharding

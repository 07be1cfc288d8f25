"""Target -> drafter feature hand-off over gloo with 2-3 real processes, and the role split."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from dflash_trainer.distributed.transport import (
    FeatureReceiver,
    FeatureSender,
    Roles,
    TransportError,
    setup_transport,
)


def make_batch(i: int) -> dict[str, torch.Tensor]:
    """Micro-batch i, rebuilt bit for bit on the drafter side; S changes with i like bucketed lengths."""
    gen = torch.Generator().manual_seed(1000 + i)
    seq = 8 + 4 * (i % 3)
    return {
        "features": torch.randn(1, seq, 6, generator=gen).to(torch.bfloat16),
        "input_ids": torch.randint(0, 50_000, (1, seq), generator=gen),
        "loss_mask": torch.rand(1, seq, generator=gen) > 0.3,
        "hidden_fp32": torch.randn(2, seq, 3, generator=gen)[:, :, ::2],  # non-contiguous on purpose
        "weight": torch.tensor(float(i)),  # 0-dim
    }


def _worker(rank, world, targets, drafters, num_batches, prefetch, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        roles = Roles.from_world(world, targets, drafters)
        groups = setup_transport(roles)
        if roles.is_target(rank):
            sender = FeatureSender(roles, rank, groups, prefetch=prefetch, timeout_s=60)
            sent = [sender.send(make_batch(i)) for i in roles.batches_for_target(rank, num_batches)]
            sender.close(num_batches)
            result = {"role": "target", "sent": sent}
        else:
            receiver = FeatureReceiver(roles, rank, groups, device="cpu", prefetch=prefetch, timeout_s=60)
            received = []
            for batch in receiver:
                expected = make_batch(receiver.last_index)
                assert list(batch) == list(expected)
                for name, tensor in expected.items():
                    assert batch[name].dtype == tensor.dtype, name
                    assert torch.equal(batch[name], tensor), (name, receiver.last_index)
                received.append(receiver.last_index)
            assert receiver.next() is None  # stays ended
            total = torch.tensor([len(received)])
            dist.all_reduce(total, group=groups.drafters)  # the drafter group, as for the loss weight
            result = {"role": "drafter", "received": received, "drafter_total": int(total)}
        dist.barrier()
        (out_dir / f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_world(tmp_path, targets, drafters, num_batches, prefetch):
    world = targets + drafters
    tmp.spawn(
        _worker,
        args=(world, targets, drafters, num_batches, prefetch, str(tmp_path / "init"), tmp_path),
        nprocs=world,
        join=True,
    )
    return {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)}


# Each world is a process per rank that imports torch: test-fast keeps the one with two drafters; the others
# (1+1, 2+1, and 2+1 with a run shorter than the prefetch) are slow tests.
@pytest.mark.parametrize(
    ("targets", "drafters", "num_batches", "prefetch"),
    [pytest.param(1, 1, 5, 2, marks=pytest.mark.slow), pytest.param(2, 1, 7, 3, marks=pytest.mark.slow),
     (1, 2, 6, 1), pytest.param(2, 1, 1, 3, marks=pytest.mark.slow)],
    ids=["T1-D1", "T2-D1", "T1-D2", "T2-D1-shorter-than-prefetch"],
)
def test_hand_off_is_exact_and_follows_the_schedule(tmp_path, targets, drafters, num_batches, prefetch):
    results = run_world(tmp_path, targets, drafters, num_batches, prefetch)
    roles = Roles.from_world(targets + drafters, targets, drafters)
    for rank, result in results.items():
        if roles.is_target(rank):
            assert result["sent"] == list(roles.batches_for_target(rank, num_batches))
        else:
            d = roles.drafter_index(rank)
            assert result["received"] == list(roles.batches_for_drafter(d, num_batches))
            assert result["drafter_total"] == num_batches


def test_schedule_arithmetic():
    roles = Roles.from_world(5, 2, 3)
    assert roles.target_ranks == (0, 1) and roles.drafter_ranks == (2, 3, 4)
    assert [roles.producer_of(i) for i in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [roles.consumer_of(i) for i in range(6)] == [2, 3, 4, 2, 3, 4]
    assert list(roles.batches_for_target(1, 10)) == [1, 3, 5, 7, 9]
    assert list(roles.batches_for_drafter(2, 10)) == [2, 5, 8]
    assert roles.role(0) == "target" and roles.role(4) == "drafter" and roles.drafter_index(3) == 1
    # Stop headers cover exactly the first `prefetch` positions of each drafter at or past the end.
    for end in range(9):
        for d in range(3):
            owed = sorted(i for t in range(2) for i in roles.stop_positions(t, d, end, prefetch=2))
            first = [i for i in range(d, 40, 3) if i >= end][:2]
            assert owed == first, (end, d)


def test_bad_splits_are_explained():
    with pytest.raises(ValueError, match=r"\(2\) \+ drafter ranks \(1\) = 3, but the world has 4"):
        Roles.from_world(4, 2, 1)
    with pytest.raises(ValueError, match="drafter_ranks >= 1"):
        Roles.from_world(2, 2, 0)
    with pytest.raises(ValueError, match="T = 0 is offline"):
        Roles.from_world(2, -1, 3)
    offline = Roles.from_world(2, 0, 2)
    assert offline.offline and offline.drafter_ranks == (0, 1)
    with pytest.raises(ValueError, match="offline mode"):
        offline.producer_of(0)
    with pytest.raises(ValueError, match="is a drafter rank"):
        Roles.from_world(3, 1, 2).target_index(2)


def test_header_limits_are_explained():
    from dflash_trainer.distributed.transport import KIND_BATCH, _decode_header, _encode_header

    batch = make_batch(4)
    header = _decode_header(_encode_header(KIND_BATCH, 4, -1, 2, batch), src=0)
    assert [name for name, _, _ in header.specs] == list(batch)
    assert [shape for _, _, shape in header.specs] == [tuple(t.shape) for t in batch.values()]
    with pytest.raises(ValueError, match="longer than 32"):
        _encode_header(KIND_BATCH, 0, -1, 2, {"x" * 33: torch.zeros(1)})
    with pytest.raises(ValueError, match="cannot be sent"):
        _encode_header(KIND_BATCH, 0, -1, 2, {"c": torch.zeros(1, dtype=torch.complex64)})
    with pytest.raises(TransportError, match="not a dflash feature header"):
        _decode_header(torch.zeros(len(_encode_header(KIND_BATCH, 0, -1, 2, {})), dtype=torch.int64), src=3)


def test_sender_close_with_a_different_stream_length_is_explained():
    sender = FeatureSender(Roles.from_world(3, 1, 2), 0, groups=None, prefetch=2)
    with pytest.raises(TransportError, match="sent 0 micro-batches but a stream of 5 gives it 5"):
        sender.close(5)  # raises before anything is sent
    with pytest.raises(ValueError, match="prefetch must be >= 1"):
        FeatureSender(Roles.from_world(2, 1, 1), 0, groups=None, prefetch=0)


def _nccl_worker(rank, init_file, out_dir):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        roles = Roles.from_world(2, 1, 1)
        groups = setup_transport(roles)  # headers on gloo, data on the default NCCL group
        if roles.is_target(rank):
            sender = FeatureSender(roles, rank, groups, prefetch=2, timeout_s=120)
            for i in roles.batches_for_target(0, 6):
                sender.send({k: v.cuda() for k, v in make_batch(i).items()})
            sender.close(6)
        else:
            receiver = FeatureReceiver(roles, rank, groups, device="cuda", prefetch=2, timeout_s=120)
            for batch in receiver:
                for name, tensor in make_batch(receiver.last_index).items():
                    assert torch.equal(batch[name].cpu(), tensor), name
            assert receiver.num_received == 6
        (out_dir / f"{rank}.ok").write_text("ok")
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_hand_off_on_two_gpus(tmp_path):
    tmp.spawn(_nccl_worker, args=(str(tmp_path / "init"), tmp_path), nprocs=2, join=True)
    assert (tmp_path / "0.ok").exists() and (tmp_path / "1.ok").exists()

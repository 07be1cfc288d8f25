"""Feature hand-off from target ranks to drafter ranks over torch.distributed point-to-point.

Ranks 0..T-1 run the frozen target; ranks T..T+D-1 train the drafter. The target ranks form G = T / N
groups of N (parallel.target_tp; N = 1: every target rank is a group of its own), each holding one target
sharded across its ranks (target/tensor_parallel.py). Global micro-batch i is produced by target group i % G, whose first
rank sends it, and consumed by drafter i % D, so both sides know the whole schedule without talking.

Each micro-batch is a dict of tensors ({"features": [b, S, K*H], "input_ids": [b, S], "loss_mask":
[b, S], ...}; shapes may change per batch, e.g. with bucketed S). It travels as:
- a fixed-size int64 header (names, dtypes, shapes) on a gloo group: a CPU tensor, so reading it never
  synchronizes the GPU, and a channel of its own, so headers can be received ahead of the data;
- the tensors themselves on the data group (NCCL on CUDA tensors, gloo on CPU tensors in tests).
Messages between one (target, drafter) pair are matched in posting order, and both sides post in
ascending i, so no tags are needed (NCCL ignores them anyway).

Prefetch: a sender keeps at most P batches in flight; a receiver keeps the headers of its next P
batches posted and starts receiving a batch's tensors as soon as its header is in (a small thread
only waits on the posted header receives: gloo reports completion only through a blocking wait). End of stream: every
target sends stop headers for exactly the positions the drafters have posted receives for (the first P
positions at or past the end), so no receive is left dangling on either side.
"""

from __future__ import annotations

import math
import queue
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import ConfigError

__all__ = [
    "FeatureReceiver",
    "FeatureSender",
    "Roles",
    "TransportError",
    "TransportGroups",
    "setup_transport",
]

# Header layout (int64 words).
MAGIC = 0x44464C48  # "DFLH"
VERSION = 1
KIND_BATCH, KIND_STOP = 1, 2
MAX_TENSORS = 8
MAX_DIMS = 6
NAME_BYTES = 32
_FIXED_WORDS = 8  # magic, version, kind, index, end, prefetch, n_tensors, reserved
_SLOT_WORDS = NAME_BYTES // 8 + 2 + MAX_DIMS  # name, dtype code, ndim, dims
HEADER_WORDS = _FIXED_WORDS + MAX_TENSORS * _SLOT_WORDS
_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


class TransportError(RuntimeError):
    """The two sides of the hand-off disagree (schedule, end of stream, prefetch depth, header)."""


def _first_at_or_after(start: int, residue: int, modulus: int) -> int:
    """The smallest i >= start with i % modulus == residue (a resumed run starts mid-schedule)."""
    return start + (residue - start) % modulus


@dataclass(frozen=True)
class Roles:
    """Which global rank is a target and which a drafter: targets first, then drafters."""

    world_size: int
    num_targets: int  # target ranks (GPUs)
    num_drafters: int
    target_tp: int = 1  # target ranks per target group

    @classmethod
    def from_world(cls, world_size: int, target_ranks: int, drafter_ranks: int, target_tp: int = 1) -> Roles:
        """The split of the world; ConfigError (the run's settings, exit 2) when it does not fit."""
        if target_ranks < 0 or drafter_ranks < 1:
            raise ConfigError(
                f"need target_ranks >= 0 and drafter_ranks >= 1, got T={target_ranks}, D={drafter_ranks} "
                "(T = 0 is offline mode: drafters read dumped features)."
            )
        if target_tp < 1 or target_ranks % target_tp:
            raise ConfigError(
                f"target ranks ({target_ranks}) must be a multiple of parallel.target_tp ({target_tp}): each group "
                f"of {target_tp} holds one target; give --target-gpus as a multiple of {target_tp}."
            )
        if target_ranks + drafter_ranks != world_size:
            raise ConfigError(
                f"target ranks ({target_ranks}) + drafter ranks ({drafter_ranks}) = "
                f"{target_ranks + drafter_ranks}, but the world has {world_size} processes; launch "
                f"torchrun with --nproc-per-node (x nodes) = T + D, or change --target-gpus/--drafter-gpus."
            )
        return cls(world_size, target_ranks, drafter_ranks, target_tp)

    @property
    def target_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.num_targets))

    @property
    def drafter_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.num_targets, self.world_size))

    @property
    def num_target_groups(self) -> int:
        """Targets producing features: groups of target_tp ranks, each holding one (sharded) target."""
        return self.num_targets // self.target_tp

    def target_group_ranks(self, g: int) -> tuple[int, ...]:
        return tuple(range(g * self.target_tp, (g + 1) * self.target_tp))

    def sends_features(self, rank: int) -> bool:
        """The first rank of each target group sends the group's features; the others only compute."""
        return self.is_target(rank) and rank % self.target_tp == 0

    @property
    def offline(self) -> bool:
        return self.num_targets == 0

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} processes")

    def is_target(self, rank: int) -> bool:
        self._check_rank(rank)
        return rank < self.num_targets

    def is_drafter(self, rank: int) -> bool:
        return not self.is_target(rank)

    def role(self, rank: int) -> str:
        return "target" if self.is_target(rank) else "drafter"

    def target_index(self, rank: int) -> int:
        """The index of the target group the rank belongs to (its rank when target_tp = 1)."""
        if not self.is_target(rank):
            raise ValueError(f"rank {rank} is a drafter rank, not a target rank ({self})")
        return rank // self.target_tp

    def drafter_index(self, rank: int) -> int:
        if not self.is_drafter(rank):
            raise ValueError(f"rank {rank} is a target rank, not a drafter rank ({self})")
        return rank - self.num_targets

    def producer_of(self, i: int) -> int:
        """Global rank that sends micro-batch i: the first rank of the target group producing it."""
        if self.offline:
            raise ValueError("offline mode (0 target ranks): micro-batches come from dumped features")
        return (i % self.num_target_groups) * self.target_tp

    def consumer_of(self, i: int) -> int:
        """Global rank of the drafter that consumes micro-batch i."""
        return self.num_targets + i % self.num_drafters

    def batches_for_target(self, t: int, num_batches: int, start: int = 0) -> range:
        """Micro-batch ids target group t produces, in order (t = target_index(rank)), from `start` on."""
        groups = self.num_target_groups
        if not 0 <= t < groups:
            raise ValueError(f"target index {t} is outside 0..{groups - 1}")
        return range(_first_at_or_after(start, t, groups), num_batches, groups)

    def batches_for_drafter(self, d: int, num_batches: int, start: int = 0) -> range:
        """Micro-batch ids drafter index d consumes, in order (d = drafter_index(rank)), from `start` on."""
        if not 0 <= d < self.num_drafters:
            raise ValueError(f"drafter index {d} is outside 0..{self.num_drafters - 1}")
        return range(_first_at_or_after(start, d, self.num_drafters), num_batches, self.num_drafters)

    def stop_positions(self, t: int, d: int, end: int, prefetch: int) -> list[int]:
        """Positions past the end for which target group t owes drafter d a stop header.

        Drafter d keeps its next `prefetch` headers posted, so when it meets the end it has posted the
        first `prefetch` positions of its schedule at or past `end`; each producer answers its own.
        """
        first = max(0, math.ceil((end - d) / self.num_drafters))
        positions = (d + k * self.num_drafters for k in range(first, first + prefetch))
        return [i for i in positions if i % self.num_target_groups == t]


@dataclass
class TransportGroups:
    """Process groups of the hand-off; create them on every rank, in the same order."""

    header: dist.ProcessGroup  # gloo, every rank
    data: dist.ProcessGroup | None  # None: the default group
    drafters: dist.ProcessGroup | None  # the drafter ranks (DDP, loss-weight all-reduce); None on targets
    target_group: dist.ProcessGroup | None = None  # this rank's target group (target_tp > 1); else None


def setup_transport(roles: Roles, data_group: dist.ProcessGroup | None = None) -> TransportGroups:
    """Create the header group, the drafter group and the target groups. Collective: every rank must call it."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first (torchrun).")
    if dist.get_world_size() != roles.world_size:
        raise ValueError(f"{roles} does not match the initialized world of {dist.get_world_size()} ranks")
    rank = dist.get_rank()
    header = dist.new_group(backend="gloo")
    drafters = dist.new_group(ranks=list(roles.drafter_ranks))
    if not roles.is_drafter(rank):
        drafters = None
    target_group = None
    if roles.target_tp > 1:  # every rank creates every group, in the same order (new_group is collective)
        for g in range(roles.num_target_groups):
            group = dist.new_group(ranks=list(roles.target_group_ranks(g)))
            if rank in roles.target_group_ranks(g):
                target_group = group
    return TransportGroups(header=header, data=data_group, drafters=drafters, target_group=target_group)


def _encode_header(kind: int, index: int, end: int, prefetch: int, batch: Mapping[str, torch.Tensor]):
    words = [0] * HEADER_WORDS
    words[:7] = [MAGIC, VERSION, kind, index, end, prefetch, len(batch)]
    if len(batch) > MAX_TENSORS:
        raise ValueError(f"a micro-batch may hold at most {MAX_TENSORS} tensors, got {len(batch)}")
    for slot, (name, tensor) in enumerate(batch.items()):
        raw = name.encode("ascii")
        if len(raw) > NAME_BYTES:
            raise ValueError(f"tensor name {name!r} is longer than {NAME_BYTES} ASCII bytes")
        if tensor.dtype not in _DTYPE_CODE:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be sent; use one of {_DTYPES}")
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"{name}: {tensor.dim()} dims, at most {MAX_DIMS} can be sent")
        base = _FIXED_WORDS + slot * _SLOT_WORDS
        words[base : base + NAME_BYTES // 8] = struct.unpack(f"<{NAME_BYTES // 8}q", raw.ljust(NAME_BYTES, b"\0"))
        words[base + NAME_BYTES // 8] = _DTYPE_CODE[tensor.dtype]
        words[base + NAME_BYTES // 8 + 1] = tensor.dim()
        dims = base + NAME_BYTES // 8 + 2
        words[dims : dims + tensor.dim()] = list(tensor.shape)
    return torch.tensor(words, dtype=torch.int64)


@dataclass
class _Header:
    kind: int
    index: int
    end: int
    prefetch: int
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]]


def _decode_header(header: torch.Tensor, src: int) -> _Header:
    words = header.tolist()
    if words[0] != MAGIC or words[1] != VERSION:
        raise TransportError(
            f"rank {src} sent a header that is not a dflash feature header (magic {words[0]:#x}, version "
            f"{words[1]}): both sides must run the same dflash_trainer and post receives in schedule order."
        )
    specs = []
    for slot in range(words[6]):
        base = _FIXED_WORDS + slot * _SLOT_WORDS
        name = struct.pack(f"<{NAME_BYTES // 8}q", *words[base : base + NAME_BYTES // 8]).rstrip(b"\0")
        dtype = _DTYPES[words[base + NAME_BYTES // 8]]
        ndim = words[base + NAME_BYTES // 8 + 1]
        dims = base + NAME_BYTES // 8 + 2
        specs.append((name.decode("ascii"), dtype, tuple(words[dims : dims + ndim])))
    return _Header(words[2], words[3], words[4], words[5], specs)


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    # bool travels as bytes: not every backend reduces or sends torch.bool.
    tensor = tensor.contiguous()
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def _wait_all(works: list, timeout_s: float, what: str, poll: bool) -> None:
    """Wait for works. poll=True (NCCL): Work.wait() there only makes the current stream wait, so poll
    is_completed() to really block the CPU. poll=False (gloo): a gloo p2p work reports completion only
    through wait(), which blocks up to the group's timeout."""
    if poll:
        deadline = time.monotonic() + timeout_s
        while not all(w.is_completed() for w in works):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not complete within {timeout_s:.0f}s; is the peer rank alive?")
            time.sleep(1e-4)
    for w in works:
        w.wait()


@dataclass
class _InFlight:
    index: int
    header_work: object
    data_works: list
    on_cuda: bool
    keep_alive: list = field(default_factory=list)  # buffers must outlive their isend


class FeatureSender:
    """Target side: send(batch) posts the next scheduled micro-batch; close(num_batches) ends the stream."""

    def __init__(
        self, roles: Roles, rank: int, groups: TransportGroups, prefetch: int = 2, timeout_s: float = 1800.0,
        start: int = 0,
    ):
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if not roles.sends_features(rank):
            raise ValueError(f"rank {rank} does not send features: only the first rank of a target group does")
        self.roles, self.rank, self.groups = roles, rank, groups
        self.t = roles.target_index(rank)
        self.prefetch, self.timeout_s = prefetch, timeout_s
        self.start = start
        self.next_index = _first_at_or_after(start, self.t, roles.num_target_groups)
        self.num_sent = 0
        self.closed = False
        self._inflight: deque[_InFlight] = deque()

    def send(self, batch: Mapping[str, torch.Tensor]) -> int:
        """Post micro-batch `next_index` to its drafter; returns its id. Blocks only past `prefetch`."""
        if self.closed:
            raise TransportError("send() after close(): the stop headers have already gone out")
        index, dst = self.next_index, self.roles.consumer_of(self.next_index)
        header = _encode_header(KIND_BATCH, index, -1, self.prefetch, batch)
        tensors = [_wire(t) for t in batch.values()]
        header_work = dist.isend(header, dst, group=self.groups.header)
        data_works = [dist.isend(t, dst, group=self.groups.data) for t in tensors]
        on_cuda = any(t.is_cuda for t in tensors)
        self._inflight.append(_InFlight(index, header_work, data_works, on_cuda, [header, *tensors]))
        self.next_index += self.roles.num_target_groups
        self.num_sent += 1
        while len(self._inflight) > self.prefetch:
            self._retire()
        return index

    def _retire(self) -> None:
        done = self._inflight.popleft()
        what = f"target rank {self.rank}: micro-batch {done.index}"
        _wait_all(done.data_works, self.timeout_s, what, poll=done.on_cuda)
        _wait_all([done.header_work], self.timeout_s, what, poll=False)

    def flush(self) -> None:
        while self._inflight:
            self._retire()

    def close(self, num_batches: int) -> None:
        """Send the stop headers for a stream of num_batches global micro-batches and wait for everything.

        Every target must pass the same num_batches, and must have sent exactly its share of it.
        """
        expected = len(self.roles.batches_for_target(self.t, num_batches, self.start))
        if self.num_sent != expected:
            raise TransportError(
                f"target rank {self.rank} sent {self.num_sent} micro-batches but a stream of {num_batches} "
                f"gives it {expected}; every target must iterate roles.batches_for_target(t, {num_batches})."
            )
        works, keep = [], []
        for d in range(self.roles.num_drafters):
            for index in self.roles.stop_positions(self.t, d, num_batches, self.prefetch):
                header = _encode_header(KIND_STOP, index, num_batches, self.prefetch, {})
                works.append(dist.isend(header, self.roles.consumer_of(index), group=self.groups.header))
                keep.append(header)
        self.closed = True
        self.flush()
        _wait_all(works, self.timeout_s, f"target rank {self.rank}: stop headers", poll=False)


@dataclass
class _Pending:
    index: int
    src: int
    header: torch.Tensor
    header_work: object
    arrived: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    decoded: _Header | None = None
    tensors: dict[str, torch.Tensor] | None = None
    works: list = field(default_factory=list)


class _HeaderWaiter:
    """Waits for the posted header receives, in order, off the main thread.

    A gloo p2p work reports completion only through a blocking wait(), so without this the receiver could
    not tell that a later header is in and start its data early. The thread only waits on works the main
    thread posted: it never posts, compiles or traces anything.
    """

    def __init__(self) -> None:
        self._todo: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dflash-header-wait", daemon=True)
        self._thread.start()

    def submit(self, pending: _Pending) -> None:
        self._todo.put(pending)

    def stop(self) -> None:
        self._todo.put(None)

    def _run(self) -> None:
        while (pending := self._todo.get()) is not None:
            try:
                pending.header_work.wait()
            except Exception as err:  # noqa: BLE001 - handed to the main thread, which raises it
                pending.error = err
            pending.arrived.set()


class FeatureReceiver:
    """Drafter side: next() returns the next scheduled micro-batch as a dict, or None at the end."""

    def __init__(
        self,
        roles: Roles,
        rank: int,
        groups: TransportGroups,
        device: torch.device | str,
        prefetch: int = 2,
        timeout_s: float = 1800.0,
        start: int = 0,
    ):
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if roles.offline:
            raise ValueError("offline mode (0 target ranks) has no feature hand-off; read dumped features")
        self.roles, self.rank, self.groups = roles, rank, groups
        self.d = roles.drafter_index(rank)
        self.device = torch.device(device)
        self.prefetch, self.timeout_s = prefetch, timeout_s
        self.num_received = 0
        self.last_index: int | None = None
        self.end: int | None = None
        self.start = start
        self._next_to_post = _first_at_or_after(start, self.d, roles.num_drafters)
        self._pending: deque[_Pending] = deque()
        self._waiter = _HeaderWaiter()
        for _ in range(prefetch):
            self._post_header()

    def _post_header(self) -> None:
        index, src = self._next_to_post, self.roles.producer_of(self._next_to_post)
        header = torch.empty(HEADER_WORDS, dtype=torch.int64)
        pending = _Pending(index, src, header, dist.irecv(header, src, group=self.groups.header))
        self._pending.append(pending)
        self._waiter.submit(pending)
        self._next_to_post += self.roles.num_drafters

    def _await_header(self, p: _Pending) -> None:
        if not p.arrived.wait(self.timeout_s):
            raise TimeoutError(
                f"drafter rank {self.rank}: no header for micro-batch {p.index} from rank {p.src} within "
                f"{self.timeout_s:.0f}s; is the target rank alive and following the same schedule?"
            )
        if p.error is not None:
            what = f"receiving the header of micro-batch {p.index} from rank {p.src} failed"
            raise TransportError(what) from p.error

    def _start_data(self, p: _Pending) -> None:
        """Decode p's header (which has arrived) and post the receives for its tensors."""
        p.decoded = h = _decode_header(p.header, p.src)
        if h.index != p.index:
            raise TransportError(
                f"drafter rank {self.rank} expected micro-batch {p.index} from rank {p.src} but got "
                f"{h.index}: the two sides follow different schedules (same --target-gpus/--drafter-gpus?)."
            )
        if h.prefetch != self.prefetch:
            raise TransportError(
                f"rank {p.src} sends with prefetch {h.prefetch}, drafter rank {self.rank} receives with "
                f"{self.prefetch}; both sides must use the same prefetch depth."
            )
        if h.kind != KIND_BATCH:
            return
        p.tensors = {}
        for name, dtype, shape in h.specs:
            wire_dtype = torch.uint8 if dtype == torch.bool else dtype
            buf = torch.empty(shape, dtype=wire_dtype, device=self.device)
            p.works.append(dist.irecv(buf, p.src, group=self.groups.data))
            p.tensors[name] = buf.view(torch.bool) if dtype == torch.bool else buf

    def next(self) -> dict[str, torch.Tensor] | None:
        """The next micro-batch of this drafter's schedule (its id is then `last_index`); None at the end.

        On CUDA the returned tensors are ready for the current stream (it waits for the receive); the
        CPU does not block on the data.
        """
        if self.end is not None:
            return None
        front = self._pending[0]
        if front.decoded is None:
            self._await_header(front)
            self._start_data(front)
        if front.decoded.kind == KIND_STOP:
            self._finish(front.decoded.end)
            return None
        # Start the data of later batches whose headers are already in, in order (per-pair FIFO).
        for later in list(self._pending)[1:]:
            if later.decoded is None:
                if not later.arrived.is_set():
                    break
                self._await_header(later)
                self._start_data(later)
            if later.decoded.kind == KIND_STOP:
                break
        _wait_all(front.works, self.timeout_s, f"drafter rank {self.rank}: micro-batch {front.index}", False)
        self._pending.popleft()
        self._post_header()
        self.num_received += 1
        self.last_index = front.index
        return front.tensors

    def _finish(self, end: int) -> None:
        expected = len(self.roles.batches_for_drafter(self.d, end, self.start))
        if self.num_received != expected:
            raise TransportError(
                f"drafter rank {self.rank} received {self.num_received} micro-batches but the stream ends "
                f"at {end}, which gives it {expected}."
            )
        for p in self._pending:  # the other posted headers must all be stops: collect them
            if p.decoded is None:
                self._await_header(p)
                p.decoded = _decode_header(p.header, p.src)
            if p.decoded.kind != KIND_STOP or p.decoded.end != end:
                raise TransportError(
                    f"targets disagree on the end of the stream: rank {p.src} sent micro-batch/stop "
                    f"{p.decoded.index} (end {p.decoded.end}) after another target ended it at {end}."
                )
        self._pending.clear()
        self._waiter.stop()
        self.end = end

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while (batch := self.next()) is not None:
            yield batch

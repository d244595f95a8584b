"""The encoder on its own (tiercheck/engine/save/encode.py): what each job is encoded as, against
what, in which order, and what a failure leaves behind -- with stand-ins for the schedule, the
journal and the tier lanes (each records what the encoder told it), and real blobs, decoded here to
check them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Literal, cast

import pytest
import torch

from tiercheck.codec import BlobMeta
from tiercheck.codec.decode.decoder import decode
from tiercheck.codec.encode.plan import Planner
from tiercheck.codec.options import CodecOptions
from tiercheck.consistency.manifest import Abort, Begin
from tiercheck.engine.jobs import Holder, Job
from tiercheck.engine.options import TierEncoding
from tiercheck.engine.results import SaveHandle, SaveStats
from tiercheck.engine.save.encode import Encoder
from tiercheck.errors import StateChanged, TierWriteFailed
from tiercheck.tiers.base import Buffer

Kind = Literal["base", "delta"]


class _Codec:
    """The codec options, which fail to be read while :attr:`broken` (an encoding that fails)."""

    def __init__(self) -> None:
        self.broken = False
        self._real = CodecOptions()

    def __getattr__(self, name: str) -> Any:
        if self.broken:
            raise OSError(f"the codec broke reading {name!r}")
        return getattr(self._real, name)


class _Lane:
    """A tier's lane as the encoder sees it: takes every blob offered, in the order offered."""

    def __init__(self, name: str, offers: list[tuple[str, int, bytes, BlobMeta]]) -> None:
        self.name = name
        self.offers = offers

    def offer(self, job: Job, parts: list[Buffer], meta: BlobMeta, *, views: bool) -> bool:
        blob = b"".join(memoryview(p).cast("B").tobytes() for p in parts)
        self.offers.append((self.name, job.version, blob, meta))
        if views and job.holder is not None:
            job.holder.acquire()  # as the real lane holds the memory its parts view
        return True


class _Schedule:
    """The schedule as the encoder tells it what happened, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def occupy(self, job: Job) -> None:
        self.calls.append(("occupy", job.version))

    async def release(self, job: Job) -> None:
        self.calls.append(("release", job.version))

    def base_in_memory(self, version: int) -> None:
        self.calls.append(("base_in_memory", version))

    def base_failed(self, version: int) -> None:
        self.calls.append(("base_failed", version))

    def base_unconfirmed(self, version: int) -> None:
        self.calls.append(("base_unconfirmed", version))


class _Journal:
    def __init__(self) -> None:
        self.records: list[Any] = []

    def log(self, *records: Any) -> None:
        self.records.extend(records)


class _Rig:
    """An encoder over tiers named by ``targets``, and what each stand-in recorded."""

    def __init__(self, cpu: ThreadPoolExecutor, targets: dict[str, TierEncoding]) -> None:
        self.targets = targets
        self.codec = _Codec()
        self.offers: list[tuple[str, int, bytes, BlobMeta]] = []
        self.schedule = _Schedule()
        self.journal = _Journal()
        #: Versions whose staged memory was given back (their holder's last drop).
        self.released: list[int] = []
        self.planner = Planner()
        options: Any = SimpleNamespace(
            job=SimpleNamespace(topology=SimpleNamespace(rank=0, world_size=1)),
            encode=SimpleNamespace(codec=self.codec),
        )
        pipes: Any = {n: SimpleNamespace(name=n, lane=_Lane(n, self.offers)) for n in targets}
        self.encoder = Encoder(
            options, cast(Any, self.journal), cpu, pipes, cast(Any, self.schedule)
        )

    def job(
        self,
        version: int,
        kind: Kind,
        base: int | None,
        state: dict[str, Any],
        previous: Job | None = None,
    ) -> Job:
        """A job as the engine launches it: staged in a buffer of its own, after ``previous``."""
        flat = self.planner.flatten(state)
        payload = torch.empty(flat.layout.payload_nbytes, dtype=torch.uint8)
        flat.write(payload)
        stats = SaveStats(version, kind, raw_bytes=flat.layout.payload_nbytes)
        job = Job(
            version=version,
            kind=kind,
            base_version=base,
            targets=dict(self.targets),
            handle=SaveHandle(version, list(self.targets), stats),
            started=time.perf_counter(),
            layout=flat.layout,
        )
        job.staged_in(payload, Holder(lambda: self.released.append(version)))
        job.launch(previous)
        return job

    async def encode(self, *jobs: Job) -> None:
        """Start ``jobs`` in the order given and wait until every encoding task is over."""
        for job in jobs:
            self.encoder.start(job)
        await asyncio.wait_for(asyncio.gather(*list(self.encoder.tasks)), 10)

    def offered(self, version: int) -> BlobMeta:
        """The blob of ``version`` offered to the first tier (each tier is offered one)."""
        return self._offer(version)[3]

    def blob(self, version: int) -> bytes:
        return self._offer(version)[2]

    def _offer(self, version: int) -> tuple[str, int, bytes, BlobMeta]:
        mine = [o for o in self.offers if o[1] == version]
        assert sorted(o[0] for o in mine) == sorted(self.targets)
        return mine[0]


@pytest.fixture
def cpu() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2, thread_name_prefix="test-encode") as pool:
        yield pool


def _state(step: int) -> dict[str, Any]:
    w = torch.linspace(0, 1, 4096, dtype=torch.float32)
    w[:step] += 0.5  # a few values change from one step to the next
    return {"w": w, "n": torch.tensor([step]), "step": step}


def _payload(state: dict[str, Any]) -> torch.Tensor:
    flat = Planner().flatten(state)
    out = torch.empty(flat.layout.payload_nbytes, dtype=torch.uint8)
    flat.write(out)
    return out


async def test_a_delta_is_encoded_against_the_base_held_in_memory(
    cpu: ThreadPoolExecutor,
) -> None:
    rig = _Rig(cpu, {"persistent": "packed"})
    base = rig.job(0, "base", None, _state(0))
    delta = rig.job(1, "delta", 0, _state(3), previous=base)
    await rig.encode(base, delta)
    held = rig.encoder.base
    assert held is not None
    assert held.raw.version == 0
    assert rig.offered(0).base is None
    ref = rig.offered(1).base
    assert ref is not None
    assert (ref.version, ref.raw_digest) == (0, held.raw.raw_digest)
    # The delta decodes, against that base, to the delta's own state.
    decoded_base = decode(rig.blob(0))
    decoded = decode(rig.blob(1), base=decoded_base)
    assert torch.equal(decoded.payload, _payload(_state(3)))
    assert Begin(1, 0, "delta", 0) in rig.journal.records
    assert ("base_in_memory", 0) in rig.schedule.calls
    assert ("base_in_memory", 1) not in rig.schedule.calls
    # The delta's memory is given back once it is encoded; the base's stays held for the
    # deltas after it, until it is let go (or the next base replaces it).
    assert rig.released == [1]
    rig.encoder.drop_base()
    assert rig.released == [1, 0]


async def test_the_next_base_replaces_the_held_one(cpu: ThreadPoolExecutor) -> None:
    rig = _Rig(cpu, {"persistent": "packed"})
    first = rig.job(0, "base", None, _state(0))
    second = rig.job(1, "base", None, _state(1), previous=first)
    await rig.encode(first, second)
    held = rig.encoder.base
    assert held is not None
    assert held.raw.version == 1
    assert rig.released == [0]
    assert rig.offered(1).base is None


async def test_a_delta_whose_base_is_not_held_is_encoded_as_a_base(
    cpu: ThreadPoolExecutor, caplog: pytest.LogCaptureFixture
) -> None:
    rig = _Rig(cpu, {"persistent": "packed"})
    # Nothing held (the base failed, or a restore let it go).
    orphan = rig.job(3, "delta", 2, _state(3))
    with caplog.at_level(logging.WARNING, logger="tiercheck"):
        await rig.encode(orphan)
    assert (orphan.kind, orphan.handle.stats.kind, orphan.base_version) == ("base", "base", 2)
    assert rig.offered(3).base is None
    assert decode(rig.blob(3)).version == 3
    assert "base 2 of version 3 is unavailable; encoding it as a base" in caplog.text
    assert ("base_in_memory", 3) in rig.schedule.calls
    # The manifest is told what the blob is: a base (it said "delta on 2" before the blob was).
    (begun,) = [r for r in rig.journal.records if isinstance(r, Begin) and r.version == 3]
    assert (begun.kind, begun.base) == ("base", None)
    # Another base held than the one planned: the same.
    stray = rig.job(5, "delta", 4, _state(5), previous=orphan)
    await rig.encode(stray)
    assert (stray.kind, stray.handle.stats.kind) == ("base", "base")
    assert rig.offered(5).base is None


async def test_jobs_are_encoded_in_launch_order(cpu: ThreadPoolExecutor) -> None:
    rig = _Rig(cpu, {"persistent": "packed"})
    base = rig.job(0, "base", None, _state(0))
    delta = rig.job(1, "delta", 0, _state(2), previous=base)
    # The delta's task starts first; it waits for the job launched before it.
    rig.encoder.start(delta)
    await asyncio.sleep(0.05)
    assert rig.offers == []
    assert not delta.encoded.is_set()
    await rig.encode(base)
    assert [v for _, v, _, _ in rig.offers] == [0, 1]
    ref = rig.offered(1).base
    assert delta.kind == "delta"
    assert ref is not None
    assert ref.version == 0
    assert delta.previous is None, "an encoded job lets go of the one before it"


async def test_a_failed_encoding_fails_the_version_everywhere_and_frees_its_slot_and_memory(
    cpu: ThreadPoolExecutor, caplog: pytest.LogCaptureFixture
) -> None:
    rig = _Rig(cpu, {"persistent": "packed", "peer": "packed"})
    rig.codec.broken = True
    base = rig.job(0, "base", None, _state(0))
    with caplog.at_level(logging.ERROR, logger="tiercheck"):
        await rig.encode(base)
    assert rig.offers == []
    for name in ("persistent", "peer"):
        result = base.results[name].result()
        assert result.written is None
        assert isinstance(result.error, TierWriteFailed)
        assert "version 0 could not be encoded" in str(result.error)
        assert isinstance(result.error.__cause__, OSError)
    assert sorted(rig.schedule.calls) == [("base_failed", 0), ("occupy", 0), ("release", 0)]
    assert rig.released == [0]
    assert rig.encoder.base is None
    assert base.encoded.is_set()
    assert next(r for r in rig.journal.records if isinstance(r, Abort)).version == 0
    assert "encoding version 0 failed" in caplog.text
    # The delta planned on it is encoded as a base once the codec works again.
    rig.codec.broken = False
    delta = rig.job(1, "delta", 0, _state(1), previous=base)
    await rig.encode(delta)
    assert delta.kind == "base"
    assert rig.offered(1).base is None


async def test_an_overlapped_snapshot_found_changed_fails_the_version_everywhere(
    cpu: ThreadPoolExecutor,
) -> None:
    rig = _Rig(cpu, {"persistent": "packed", "peer": "packed"})
    base = rig.job(0, "base", None, _state(0))
    verdict: concurrent.futures.Future[None] = concurrent.futures.Future()
    base.confirmed = verdict  # an overlapped save, not confirmed yet
    rig.encoder.start(base)
    await asyncio.wait_for(base.encoded.wait(), 10)
    # Encoded (and its slot free) while the caller has not confirmed it yet.
    assert ("release", 0) in rig.schedule.calls
    assert not any(f.done() for f in base.results.values())
    verdict.set_exception(StateChanged("changed between save and the fence"))
    await asyncio.wait_for(asyncio.gather(*list(rig.encoder.tasks)), 10)
    for name in ("persistent", "peer"):
        error = base.results[name].result().error
        assert isinstance(error, TierWriteFailed)
        assert isinstance(error.__cause__, StateChanged)
    assert ("base_unconfirmed", 0) in rig.schedule.calls

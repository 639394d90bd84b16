"""Tensor parallelism: the target's ranks, one process each, driven by the engine's step.

The engine (rank 0, in the caller's process) starts ranks 1..N-1 itself (``spawn``), joins them
in a gloo process group (the all-reduces of the sharded target, ``models.tensor_parallel``),
and builds its own shard. Every rank builds the same worker around its shard, its own KV store
(both tiers, sized per rank: a rank holds 1/N of the KV heads), history source, staging ring,
copy thread and host attention; the draft model is replicated on each. The scheduler runs once,
in the engine: each step's plan (plain data) goes to every rank over a queue before rank 0
runs it, every rank runs the same step (the all-reduces keep them in step), and only rank 0's
output is read. Tokens agree across ranks because every rank sees the same all-reduced logits
and draws from generators seeded alike.

A rank that dies or stops answering makes the next all-reduce fail after ``rank_timeout_s()``
(gloo's timeout: 30 s, or ``SPECSTREAM_RANK_TIMEOUT_S``), which fails that step's requests with
the error and marks the group broken: every later step fails at once, naming the rank
(``/health`` reports the engine's error).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch.distributed as dist

from specstream.config import EngineConfig
from specstream.engine.contract import StepOutput, StepPlan
from specstream.models.config import ModelConfig
from specstream.models.tensor_parallel import Shard, check_shardable

if TYPE_CHECKING:
    from specstream.engine.exec.worker import Worker

log = logging.getLogger(__name__)
RANK_TIMEOUT_S = 30.0  # an all-reduce waits this long for a missing rank (the default)
_START_TIMEOUT_S = 300.0  # ranks import torch and load their shards before the group forms


class RankFailure(RuntimeError):
    """A rank of the tensor-parallel group died or stopped answering."""


class RankGroup:
    """Ranks 1..N-1 as the engine sees them: their processes and the queues of their steps."""

    def __init__(self, model: str | Path, config: EngineConfig) -> None:
        if dist.is_initialized():
            raise RuntimeError("tensor_parallel_size > 1: this process already belongs to a "
                               "torch.distributed group (one tensor-parallel engine per "
                               "process)")
        self.size = config.tensor_parallel_size
        if config.device.startswith("cuda"):
            raise ValueError("tensor_parallel_size > 1 runs gloo ranks on cpu only: NCCL ranks "
                             "with a CUDA device each are not built yet")
        check_shardable(ModelConfig.from_dir(Path(model)), self.size)  # before any process
        timeout_s = rank_timeout_s()
        ctx = mp.get_context("spawn")
        address = f"tcp://127.0.0.1:{_free_port()}"
        self.queues: list[Any] = [ctx.Queue() for _ in range(1, self.size)]
        self.procs = [ctx.Process(target=rank_main, args=(r, str(model), config, address, q),
                                  daemon=True, name=f"specstream-rank-{r}")
                      for r, q in enumerate(self.queues, start=1)]
        for p in self.procs:
            p.start()
        self.broken: str | None = None
        try:
            dist.init_process_group("gloo", init_method=address, rank=0, world_size=self.size,
                                    timeout=timedelta(seconds=_START_TIMEOUT_S))
        except BaseException:
            self.close()
            raise
        # from now on a missing rank fails a collective after rank_timeout_s()
        self.group = dist.new_group(list(range(self.size)),
                                    timeout=timedelta(seconds=timeout_s))

    def failure(self) -> str | None:
        """Why the group cannot run a step (a rank exited, or stopped answering); None."""
        if self.broken is None:
            dead = [p.name for p in self.procs if not p.is_alive()]
            if dead:
                self.broken = f"{', '.join(dead)} exited"
        return self.broken

    def send(self, message: tuple[Any, ...]) -> None:
        """``message`` to every rank; raises RankFailure where one is gone."""
        if self.failure() is not None:
            raise RankFailure(f"the tensor-parallel group is broken: {self.broken}")
        for q in self.queues:
            q.put(message)

    def driving(self, worker: Worker) -> DrivingWorker:
        return DrivingWorker(worker, self)

    def close(self) -> None:
        for q, p in zip(self.queues, self.procs):
            if p.is_alive():
                q.put(("stop",))
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


class DrivingWorker:
    """Rank 0's worker: each step goes to the other ranks first, then runs here."""

    def __init__(self, worker: Worker, ranks: RankGroup) -> None:
        self.worker, self.ranks = worker, ranks

    def __getattr__(self, name: str) -> Any:  # host, verifier, ...: rank 0's
        return getattr(self.worker, name)

    def run(self, plan: StepPlan, link_bps: float = 0.0) -> StepOutput:
        self.ranks.send(("run", plan, link_bps))
        try:
            return self.worker.run(plan, link_bps)
        except Exception as exc:
            dead = [p.name for p in self.ranks.procs if not p.is_alive()]
            if dead or "timed out" in str(exc).lower():  # gloo: a rank left or hangs
                self.ranks.broken = f"{', '.join(dead)} exited" if dead else \
                    f"a rank stopped answering ({exc})"
                raise RankFailure(f"the tensor-parallel group is broken: "
                                  f"{self.ranks.broken}") from exc
            raise

    def writeback(self, moves: dict[str, list[tuple[int, int]]]) -> dict[str, str]:
        self.ranks.send(("writeback", moves))
        return self.worker.writeback(moves)


def rank_main(rank: int, model: str, config: EngineConfig, address: str, inbox: Any) -> None:
    """A rank's process: its shard of the engine, running the steps the engine sends."""
    from specstream.engine.llm_engine import LLMEngine  # the engine imports this module

    dist.init_process_group("gloo", init_method=address, rank=rank,
                            world_size=config.tensor_parallel_size,
                            timeout=timedelta(seconds=_START_TIMEOUT_S))
    group = dist.new_group(list(range(config.tensor_parallel_size)),
                           timeout=timedelta(seconds=rank_timeout_s()))
    engine = LLMEngine(model, config, shard=Shard(rank, config.tensor_parallel_size, group))
    parent = mp.parent_process()
    try:
        while True:
            try:
                message = inbox.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return
                continue
            if message[0] == "stop":
                return
            try:
                if message[0] == "run":
                    engine.worker.run(message[1], message[2])
                else:
                    engine.worker.writeback(message[1])
            except Exception:  # rank 0 fails the same step and reports it
                log.exception("rank %d: step failed", rank)
    finally:
        engine.close()
        dist.destroy_process_group()
    leave_cleanly()


def leave_cleanly() -> NoReturn:
    """End a rank's process after a clean stop, without the interpreter's teardown: there a
    thread torch left joinable aborted the process now and then ("terminate called without an
    active exception"), after its group was destroyed and its work done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_timeout_s() -> float:
    """How long a collective waits for a missing rank: ``SPECSTREAM_RANK_TIMEOUT_S`` (the ranks
    inherit the engine's environment), else ``RANK_TIMEOUT_S``."""
    raw = os.environ.get("SPECSTREAM_RANK_TIMEOUT_S")
    try:
        value = float(raw) if raw else RANK_TIMEOUT_S
    except ValueError:
        raise ValueError(f"SPECSTREAM_RANK_TIMEOUT_S={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"SPECSTREAM_RANK_TIMEOUT_S={raw!r} must be positive")
    return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

"""The engine's own scheduling objects, built for the simulator without a model or a device.

The replay (``replay.py``) drives the real ``specstream.engine.sched.scheduler.Scheduler`` over the
real ``KVManager``, laid out by the real ``RuntimeLayout``: admission, reservations, chunked
prefill, the two ping-pong groups, the ``fill`` residency (``residency_targets``), promotions
and write-backs are the engine's code, not a copy. What the simulator supplies is what the
engine would learn from its model folder: the target's layer count and KV bytes per token
(``Geometry``), and the ``EngineConfig`` the run used (``engine_config``: a bench JSON's
settings go through the bench's own ``BenchSettings.engine_kwargs``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any

from specstream.bench.runner import BenchSettings
from specstream.config import EngineConfig
from specstream.engine.contract import StepPlan
from specstream.engine.layout import RuntimeLayout
from specstream.engine.meter import StepMeter
from specstream.engine.sched.scheduler import Scheduler
from specstream.kvcache.manager import KVManager
from specstream.models.config import ModelConfig

SIMULATED_DRAFT = "(simulated draft)"  # a draft_model name for configs that need one
# What a run recorded before a setting existed ran with, where the engine's default has moved
# since: two groups throughout (before they could merge); q drafts every round in chains (before
# "auto" and trees: an absent "speculative_policy"; a None one is the auto default of its day).
# Host attention is off unless the run names it, absent or None: the engine's own default
# depends on the cores of the machine that runs the replay, not of the one that ran the bench
# (where a run attended on the host, the replay is told so, with the host's measured costs:
# replay.setups, shared_replay.py).
RECORDED_BEFORE = {"merge_groups": False, "speculative_policy": "fixed", "speculative_topk": 1}


@dataclass(frozen=True)
class Geometry:
    """What the engine's layout reads of the target model."""

    num_layers: int
    kv_bytes_per_token: int  # target KV (K and V), all layers, in the KV dtype
    max_model_len: int = 1 << 20

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.kv_bytes_per_token % (2 * self.num_layers):
            raise ValueError(f"KV bytes per token ({self.kv_bytes_per_token}) must be a "
                             f"multiple of 2 x layers ({self.num_layers})")

    def model_config(self) -> ModelConfig:
        """A stand-in ModelConfig with this geometry (one KV head; 1-byte elements, so that
        ``kv_bytes_per_token(1)`` is the KV bytes whatever the KV dtype is)."""
        return ModelConfig(
            family="qwen3", vocab_size=8, hidden_size=8, num_layers=self.num_layers,
            num_heads=1, num_kv_heads=1,
            head_dim=self.kv_bytes_per_token // (2 * self.num_layers), intermediate_size=8,
            max_position_embeddings=self.max_model_len)


def engine_config(settings: dict[str, Any], mode: str, **overrides: Any) -> EngineConfig:
    """The EngineConfig ``specstream bench`` ran ``mode`` with, from its JSON ``settings``
    (through ``BenchSettings.engine_kwargs``, as the bench itself builds it); ``overrides``
    replace EngineConfig fields (e.g. ``drafting="sequential"`` for an ablation)."""
    known = {f.name for f in fields(BenchSettings)}
    settings = {**RECORDED_BEFORE, **settings}
    if settings.get("host_attention") is None:
        settings["host_attention"] = "off"
    s = BenchSettings(**{k: v for k, v in settings.items() if k in known and v is not None})
    kw = {**s.engine_kwargs(mode), **overrides}
    kw.pop("link_gbps", None)  # the link is the simulator's; the schedule does not read it
    if kw.get("proposer") == "draft" and not kw.get("draft_model"):
        kw["draft_model"] = SIMULATED_DRAFT
    return EngineConfig(**kw)


@dataclass
class EngineObjects:
    layout: RuntimeLayout
    scheduler: Scheduler
    meter: StepMeter

    @property
    def kv(self) -> KVManager:
        return self.scheduler.kv

    def link_bytes(self, plan: StepPlan) -> int:
        """The history bytes ``plan`` moves over the link, read before the step runs by the
        engine's own ``StepMeter.residency``: a block several of its requests read (a shared
        prefix) once, as the engine's rounds move it; what the host attends excluded."""
        return self.meter.residency(plan)[2]


def build(config: EngineConfig, geometry: Geometry) -> EngineObjects:
    """Layout, KV manager and scheduler as ``LLMEngine.__init__`` builds them."""
    layout = RuntimeLayout.build(config, geometry.model_config(), 1, frozenset())
    scheduler = Scheduler.for_layout(config, layout)
    # the meter's residency reads only the store's block geometry; no tensors are allocated
    store = SimpleNamespace(block_size=layout.block_size, block_bytes=layout.block_bytes,
                            cfg=SimpleNamespace(num_layers=geometry.num_layers))
    meter = StepMeter(None, store, scheduler.kv, None, None, None)  # type: ignore[arg-type]
    return EngineObjects(layout, scheduler, meter)

"""Memory pools: reading host RAM, and what one pool lets a model use under the Policy.

``MemoryPool`` itself (kind, id, total and free bytes) is the contract's
(``contract.sizing``), because backends report their GPU pools in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

import psutil  # no stubs in the venv (ignore_missing_imports); one call, typed below

from contract.sizing import MemoryPool, ModelFacts, compute_overhead_bytes, host_overhead_bytes, kv_cache_bytes

from .policy import Policy
from .reasons import REASON_MEMORY, REASON_RESERVE, REASON_USER_LIMIT

__all__ = ["Budget", "MemoryPool", "Share", "pool_budget", "read_host_pool"]


def read_host_pool() -> MemoryPool:
    """Host RAM now: psutil's ``available`` (reclaimable page cache counts as free) and ``total``."""
    vm = psutil.virtual_memory()
    return MemoryPool(kind="cpu", id="host", total_bytes=int(vm.total), free_bytes=int(vm.available), name="host RAM")


@dataclass(frozen=True)
class Budget:
    """What one pool lets the model use, and which limit set it."""

    pool: MemoryPool
    credit: int
    reserve: int
    headroom: int
    user_limit: int
    usable: int
    #: "user_limit" when the --mem-max cap is below the physical budget, else "memory"
    limit: str

    @property
    def physical(self) -> int:
        return self.pool.free_bytes + self.credit - self.reserve - self.headroom


def pool_budget(pool: MemoryPool, policy: Policy, credit: int) -> Budget:
    """The pool's usable bytes: free + credit − reserve − headroom, capped by --mem-max."""
    avail = pool.free_bytes + credit
    headroom = int(avail * policy.headroom_fraction)
    physical = avail - policy.reserve_bytes - headroom
    if policy.user_limit_bytes and policy.user_limit_bytes < physical:
        usable, limit = policy.user_limit_bytes, REASON_USER_LIMIT
    else:
        usable, limit = physical, REASON_MEMORY
    return Budget(pool, credit, policy.reserve_bytes, headroom, policy.user_limit_bytes, usable, limit)


class Share(NamedTuple):
    """A pool's part of the model: ``fraction`` of weights and KV, and which overheads."""

    budget: Budget
    fraction: Fraction
    host_overhead: bool
    compute_overhead: bool

    def need(self, facts: ModelFacts, n_ctx: int) -> int:
        b = math.ceil(self.fraction * (facts.weights_bytes + kv_cache_bytes(facts, n_ctx)))
        if self.host_overhead:
            b += host_overhead_bytes(facts, n_ctx)
        if self.compute_overhead:
            b += compute_overhead_bytes(facts, n_ctx)
        return b

    def fits(self, facts: ModelFacts, n_ctx: int) -> bool:
        return self.need(facts, n_ctx) <= self.budget.usable

    def reason(self, facts: ModelFacts, target: int) -> str:
        """The limit that stops ``target`` fitting in this pool (see ``modeld.capacity``)."""
        if self.budget.limit == REASON_USER_LIMIT:
            return REASON_USER_LIMIT
        if self.budget.reserve:
            without_reserve = self.budget.physical + self.budget.reserve
            if self.budget.user_limit:
                without_reserve = min(without_reserve, self.budget.user_limit)
            if self.need(facts, target) <= without_reserve:
                return REASON_RESERVE
        return REASON_MEMORY

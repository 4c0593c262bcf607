"""Ray Serve request routers for the engine deployment (``RequestRouterConfig.request_router_class``).

``CacheAwareRouter`` sends a request to the replica most likely to hold its prompt prefix and its
compiled constraint: the request's affinity key (``keys.affinity_key``, passed as the ``routing_key``
keyword of the replica call) picks a replica by rendezvous hashing, so a key keeps its replica while
replicas come and go, and only the keys of a dead replica move. When that replica is far busier than
the least loaded one (more than ``imbalance_threshold`` requests), or full, the request goes to the
least loaded replica instead. Requests without a key go to the least loaded replica.

Ray Serve ranks: ``choose_replicas`` returns lists of replicas, most preferred first; Ray probes the
replicas of a rank for their queue length and takes the shortest queue among those that accept.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

DEFAULT_IMBALANCE_THRESHOLD = 8


def _kwarg(pending_request: Optional[PendingRequest], name: str) -> Optional[str]:
    if pending_request is None:
        return None
    value = pending_request.kwargs.get(name)
    return value if isinstance(value, str) and value else None


def _candidates(candidates: list[RunningReplica], pending_request: Optional[PendingRequest]) -> list[RunningReplica]:
    """Without the ``exclude_replica`` one (a retry after it answered 503), unless it is the only one."""
    excluded = _kwarg(pending_request, "exclude_replica")
    kept = [r for r in candidates if r.replica_id.unique_id != excluded]
    return kept or candidates


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """Replica ids by descending rendezvous score for ``key`` (highest random weight hashing)."""
    def score(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{key}|{replica_id}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=score, reverse=True)


class CacheAwareRouter(RequestRouter):
    """Affinity by prompt prefix and constraint, falling back to the least loaded replica."""

    def initialize_state(self, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD, **kwargs) -> None:
        self.imbalance_threshold = imbalance_threshold

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> list[list[RunningReplica]]:
        candidate_replicas = _candidates(candidate_replicas, pending_request)
        key = _kwarg(pending_request, "routing_key")
        if key is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = rendezvous_order(key, list(by_id))
        preferred = by_id[order[0]]
        if self._overloaded(preferred, candidate_replicas):
            return [candidate_replicas]
        return [[preferred], [by_id[replica_id] for replica_id in order[1:]]]

    def _overloaded(self, preferred: RunningReplica, candidates: list[RunningReplica]) -> bool:
        """The preferred replica's queue exceeds the shortest known queue by more than the threshold."""
        cache = self.replica_queue_len_cache
        preferred_len = cache.get(preferred.replica_id)
        if preferred_len is None:
            return False
        known = [length for length in (cache.get(r.replica_id) for r in candidates) if length is not None]
        return preferred_len - min(known) > getattr(self, "imbalance_threshold", DEFAULT_IMBALANCE_THRESHOLD)


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn (the baseline ``scaleout`` benchmark compares against)."""

    def initialize_state(self, **kwargs) -> None:
        self._turn = itertools.count()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> list[list[RunningReplica]]:
        candidate_replicas = _candidates(candidate_replicas, pending_request)
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        start = next(self._turn) % len(ordered)
        return [[ordered[start]], ordered[start + 1:] + ordered[:start]]


ROUTERS = {
    "cache": f"{__name__}:CacheAwareRouter",
    "round-robin": f"{__name__}:RoundRobinRouter",
}

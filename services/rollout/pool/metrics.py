"""Prometheus metrics of the engine pool (physarum_rollout_*), in a registry of their own that the manager's REST
API serves at /metrics: engines by state, per-engine load and health, scale events, health checks, weight syncs."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class PoolMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.desired = Gauge("physarum_rollout_engines_desired", "desired number of engines the pool launches",
                             registry=r)
        self.engines = Gauge("physarum_rollout_engines", "engines of the pool by state", ["state"], registry=r)
        self.load = Gauge("physarum_rollout_engine_load", "requests in flight on an engine, as the router counts them",
                          ["engine"], registry=r)
        self.healthy = Gauge("physarum_rollout_engine_healthy", "1 if the engine's last health check passed",
                             ["engine"], registry=r)
        self.scale_events = Counter("physarum_rollout_scale_events_total", "pool events by kind", ["kind"],
                                    registry=r)
        self.health_checks = Counter("physarum_rollout_health_checks_total", "/health_generate checks by result",
                                     ["result"], registry=r)
        self.join_seconds = Histogram("physarum_rollout_engine_join_seconds",
                                      "from answering /health to serving, by how the weights came", ["mode"],
                                      buckets=SECONDS_BUCKETS, registry=r)
        self.weight_syncs = Counter("physarum_rollout_weight_syncs_total", "trainer weight syncs by result",
                                    ["result"], registry=r)
        self.weight_sync_seconds = Histogram("physarum_rollout_weight_sync_seconds", "duration of a weight sync",
                                             buckets=SECONDS_BUCKETS, registry=r)
        self.weight_sync_bytes = Counter("physarum_rollout_weight_sync_bytes_total",
                                         "bytes broadcast to engines by successful weight syncs", registry=r)

    def forget_engine(self, name: str) -> None:
        for gauge in (self.load, self.healthy):
            try:
                gauge.remove(name)
            except KeyError:
                pass

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

"""Tenant label values are capped (SPEC, "Metrics"): a header must not grow the series count."""

from __future__ import annotations

from proxy.metrics import MAX_TENANT_LABELS, OTHER_TENANT, Metrics


def test_tenants_beyond_the_cap_share_other():
    metrics = Metrics()
    route = metrics.for_route("r")
    labels = [route.tenant(f"t{i}").label for i in range(MAX_TENANT_LABELS + 50)]
    assert labels[:MAX_TENANT_LABELS] == [f"t{i}" for i in range(MAX_TENANT_LABELS)]
    assert set(labels[MAX_TENANT_LABELS:]) == {OTHER_TENANT}
    route.tenant("t0").input_tokens.inc(3)
    route.tenant("t120").input_tokens.inc(2)
    route.tenant("t130").input_tokens.inc(5)
    tenants = {s.labels["tenant"] for f in metrics.registry.collect() for s in f.samples
               if s.name == "sluice_tokens_total"}
    assert len(tenants) == MAX_TENANT_LABELS + 1
    assert metrics.registry.get_sample_value(
        "sluice_tokens_total", {"route": "r", "tenant": OTHER_TENANT, "direction": "input"}) == 7

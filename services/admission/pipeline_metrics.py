"""Admission's view of its pipelines as Prometheus series: routable or not, breaker state, what it has in
flight on each, and how often each breaker opened (registered by main.py when --metrics-port is on)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.admission.breaker import CLOSED, HALF_OPEN, OPEN
from services.admission.pipelines import Pipelines
from tether.telemetry.metrics import PREFIX


class PipelinesCollector(Collector):
    def __init__(self, pipelines: Pipelines) -> None:
        self.pipelines = pipelines

    def collect(self) -> Iterator[Metric]:
        # plain reads of the loop's state: each value is atomic under the GIL
        up = GaugeMetricFamily(PREFIX + "pipeline_up", "1 while the pipeline's load reports say it serves "
                               "admission's model", labels=["pipeline"])
        breaker = GaugeMetricFamily(PREFIX + "pipeline_breaker_state", "The pipeline's circuit breaker: 1 for its "
                                    "current state (closed, open, half_open)", labels=["pipeline", "state"])
        in_flight = GaugeMetricFamily(PREFIX + "pipeline_requests_in_flight", "Requests admission has routed to "
                                      "the pipeline and not seen end", labels=["pipeline"])
        opens = CounterMetricFamily(PREFIX + "pipeline_breaker_opens", "Times the pipeline's circuit breaker "
                                    "opened", labels=["pipeline"])
        for link in list(self.pipelines.links.values()):
            up.add_metric([link.address], int(link.serving))
            for state in (CLOSED, OPEN, HALF_OPEN):
                breaker.add_metric([link.address, state], int(link.breaker.state == state))
            in_flight.add_metric([link.address], link.in_flight)
            opens.add_metric([link.address], link.breaker.opens)
        yield from (up, breaker, in_flight, opens)

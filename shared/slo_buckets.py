"""Histogram buckets of the latency metrics, gateway and worker alike, chosen around the SLOs
the alert rules read (deploy/prometheus/alerts.yml) and the spread measured on a real stack.

Why this matters: `histogram_quantile` interpolates linearly inside the bucket the quantile
falls in, so a quantile is only as good as the bucket edges near it. With TTFT buckets jumping
from 1 s to 2.5 s, a load whose every TTFT was <= 1.30 s read p95 = 2.13 s (20 % of requests in
(1, 2.5], interpolated over the whole bucket) and `LLMTTFTSLOBreach` (p95 > 2 s) fired with
nothing wrong; TTLT buckets 5 -> 10 s read p95 = 9.6 s for a longest request of 6.2 s.
So: an edge AT every alert threshold (TTFT 0.5 s for the drift/jump alerts and 2 s for the
SLO, inter-chunk gap 0.5 s, cancel 1 s), edges every 0.25-0.5 s from 0.5 s to 3 s where
interactive TTFT lives, and a geometric spread below and above. One family shares one layout
on both sides (gateway_ttft_seconds and worker_time_to_first_token_seconds), so the two can be
compared bucket for bucket. tests/test_alerts.py checks that the promtool tests use these edges
and that a healthy load under the SLO does not fire the alert.

About 20 buckets a histogram: each edge is one series per replica, so the cost is a few
hundred series per process, not per request.
"""

from __future__ import annotations

# time to first (meaningful) token, and the worker's queue time: 25 ms ... 10 s, then a tail
TTFT_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5,
                3.0, 4.0, 5.0, 7.5, 10.0, 30.0, 60.0)
# time to last token (end to end): 0.25 s ... 2 min, 1 s steps where typical answers end
TTLT_BUCKETS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.5, 15.0, 20.0, 30.0, 45.0, 60.0,
                90.0, 120.0, 300.0, 600.0)
# gaps between chunks, and time per output token: milliseconds (a 40 ms flush, 5-50 ms steps)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0)
# a cancel reaching the engine (a step boundary away): ms, with an edge at the 1 s alert
CANCEL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)

"""Prometheus metrics under vLLM's names, so that dashboards and alerts written for vLLM work unchanged.

Exposed (label ``model_name``): ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` and
``vllm:e2e_request_latency_seconds`` (histograms, vLLM's buckets), ``vllm:num_requests_running`` /
``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` (gauges, 1 = full), ``vllm:prefix_cache_queries`` /
``vllm:prefix_cache_hits`` (counters, in tokens), ``vllm:prompt_tokens`` / ``vllm:generation_tokens`` and
``vllm:request_success`` by ``finished_reason``, ``vllm:spec_decode_num_draft_tokens`` /
``vllm:spec_decode_num_accepted_tokens`` (counters). Corral's own: ``corral:grammar_compile_seconds``,
``corral:jump_forward_tokens`` (accepted draft tokens the grammar forced), ``corral:sequence_forward_passes``
(the steps that produced each sequence's tokens, summed: over ``vllm:generation_tokens``, the forward passes
per output token), and
the gauges ``corral:num_requests_in_flight`` (admitted, from arrival to end: what ``max_in_flight`` bounds) and
``corral:num_requests_compiling`` (constraints queued or compiling).

The text format is written here (it is a dozen lines) rather than pulling in ``prometheus_client``. Times are
taken when the engine thread hands an output over, so they include scheduling but not the network; the first
token's is the engine's own first-token time (a request nobody streams hands over its finished output alone, and
the tokens after the first count as spread evenly up to then).
"""

import threading
from bisect import bisect_left

from corral import native

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * (len(buckets) + 1), 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {running}')
        return out + [f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {self.count}"]


class _Timing:
    __slots__ = ("arrival", "last", "num_tokens")

    def __init__(self, arrival: float):
        self.arrival, self.last, self.num_tokens = arrival, None, 0


class ServerMetrics:
    """Collects from the engine thread (``on_output``, ``on_stats``) and the event loop; renders on demand."""

    def __init__(self, model_name: str):
        self.labels = f'model_name="{model_name}"'
        self.ttft, self.itl = Histogram(_TTFT_BUCKETS), Histogram(_ITL_BUCKETS)
        self.e2e, self.compile = Histogram(_E2E_BUCKETS), Histogram(_COMPILE_BUCKETS)
        self.prompt_tokens = self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.stats = None
        self.decode_step: str | None = None  # native | torch, set by the server once the engine is built
        self.decode_burst: int | None = None  # the most tokens a native call decodes per sequence, set with it
        self.deterministic: bool | None = None  # EngineConfig.deterministic, set with it
        self._timings: dict[str, _Timing] = {}
        self._lock = threading.Lock()

    def on_arrival(self, request_id: str, now: float) -> None:
        with self._lock:
            self._timings[request_id] = _Timing(now)

    def on_compile(self, seconds: float) -> None:
        with self._lock:
            self.compile.observe(seconds)

    def on_output(self, output, now: float) -> None:
        with self._lock:
            timing = self._timings.get(output.request_id)
            if timing is None:
                return
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            if output.delta:  # its token_ids are the new ones alone
                num_tokens += timing.num_tokens
            new = num_tokens - timing.num_tokens
            if new > 0:
                self.generation_tokens += new
                if timing.last is None:  # the first token came at the engine's first-token time
                    first = output.metrics.first_token_time
                    timing.last = first if first is not None and timing.arrival <= first <= now else now
                    self.ttft.observe(timing.last - timing.arrival)
                    self.prompt_tokens += len(output.prompt_token_ids)
                    new -= 1
                if new > 0:  # the rest (all of them in a request's only, final output) came evenly since
                    self.itl.observe((now - timing.last) / new, new)
                timing.last, timing.num_tokens = now, num_tokens
            if output.finished:
                del self._timings[output.request_id]
                self.e2e.observe(now - timing.arrival)
                for c in output.outputs:
                    reason = c.finish_reason or "abort"
                    self.finished[reason] = self.finished.get(reason, 0) + 1

    def on_abandoned(self, request_id: str) -> None:
        """The client left; an aborted request may never produce a final output."""
        with self._lock:
            if self._timings.pop(request_id, None) is not None:
                self.finished["abort"] = self.finished.get("abort", 0) + 1

    def on_stats(self, stats) -> None:
        self.stats = stats

    def render(self, num_in_flight: int = 0, num_compiling: int = 0) -> str:
        with self._lock:
            return "\n".join(self._lines(num_in_flight, num_compiling)) + "\n"

    def _lines(self, num_in_flight: int, num_compiling: int) -> list[str]:
        lab, out = self.labels, []

        def metric(name: str, kind: str, help_text: str, rows: list[str]) -> None:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *rows])

        metric("corral:num_requests_in_flight", "gauge", "Requests admitted and not ended (compiling, waiting or "
               "running).", [f"{{{lab}}} {num_in_flight}"])
        metric("corral:num_requests_compiling", "gauge", "Constraints queued or compiling.",
               [f"{{{lab}}} {num_compiling}"])
        paths = native.status()
        metric("corral:native_info", "gauge", "Which paths run: the CORRAL_NATIVE mode, the mask path, the CPU "
               "kernels, the quantized products, the decode step, the most tokens its calls decode per sequence "
               "and whether every query takes the decode kernel (always 1).",
               [f'{{{lab},mode="{paths["mode"]}",mask_path="{paths["mask_path"]}",kernels="{paths["kernels"]}",'
                f'qmatmul="{paths["qmatmul"] or "none"}",decode_step="{self.decode_step or "none"}",'
                f'decode_burst="{self.decode_burst or "none"}",'
                f'deterministic="{"none" if self.deterministic is None else str(self.deterministic).lower()}"}} 1'])

        running, waiting, usage, queries, hits = stats_numbers(self.stats)
        metric("vllm:num_requests_running", "gauge", "Requests in the running batch.", [f"{{{lab}}} {running}"])
        metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", [f"{{{lab}}} {waiting}"])
        metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage; 1 means full.", [f"{{{lab}}} {usage}"])
        metric("vllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.",
               [f"_total{{{lab}}} {queries}"])
        metric("vllm:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.",
               [f"_total{{{lab}}} {hits}"])
        drafted, accepted, forced, passes = draft_numbers(self.stats)
        metric("vllm:spec_decode_num_draft_tokens", "counter", "Draft tokens checked by the model (jump-forward, "
               "prompt lookup and a draft model).", [f"_total{{{lab}}} {drafted}"])
        metric("vllm:spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.",
               [f"_total{{{lab}}} {accepted}"])
        metric("corral:jump_forward_tokens", "counter", "Accepted draft tokens from spans the grammar forced.",
               [f"_total{{{lab}}} {forced}"])
        model_drafted, model_accepted, model_forwards = (getattr(self.stats, name, 0) for name in (
            "num_model_draft_tokens", "num_model_accepted_tokens", "num_draft_model_forwards"))
        metric("corral:draft_model_tokens", "counter", "Draft tokens from a draft model (counted in the draft "
               "tokens too).", [f"_total{{{lab}}} {model_drafted}"])
        metric("corral:draft_model_accepted_tokens", "counter", "Of the draft model's tokens, accepted.",
               [f"_total{{{lab}}} {model_accepted}"])
        metric("corral:draft_model_forward_passes", "counter", "The draft model's forward passes.",
               [f"_total{{{lab}}} {model_forwards}"])
        bursts, burst_tokens = (getattr(self.stats, name, 0) for name in ("num_burst_steps", "num_burst_tokens"))
        metric("corral:decode_bursts", "counter", "Steps whose native call decoded several tokens per sequence.",
               [f"_total{{{lab}}} {bursts}"])
        metric("corral:decode_burst_tokens", "counter", "The tokens those calls decoded past each sequence's first.",
               [f"_total{{{lab}}} {burst_tokens}"])
        metric("corral:sequence_forward_passes", "counter", "Per sequence, the steps that produced its output "
               "tokens, summed (generation tokens less accepted draft tokens).", [f"_total{{{lab}}} {passes}"])
        metric("vllm:prompt_tokens", "counter", "Prefilled prompt tokens.", [f"_total{{{lab}}} {self.prompt_tokens}"])
        metric("vllm:generation_tokens", "counter", "Generated tokens.",
               [f"_total{{{lab}}} {self.generation_tokens}"])
        metric("vllm:request_success", "counter", "Finished requests by finish reason.",
               [f'_total{{{lab},finished_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())])
        for name, hist, text in (("vllm:time_to_first_token_seconds", self.ttft, "Time to first token."),
                                 ("vllm:inter_token_latency_seconds", self.itl, "Time between output tokens."),
                                 ("vllm:e2e_request_latency_seconds", self.e2e, "End-to-end request latency."),
                                 ("corral:grammar_compile_seconds", self.compile, "Grammar compilation time, "
                                                                                  "cache hits included.")):
            metric(name, "histogram", text, hist.lines(name, lab))
        return _prefix_names(out)


def _prefix_names(lines: list[str]) -> list[str]:
    """Rows written as suffixes (``{...} v`` or ``_total{...} v``) get the name of the metric above them."""
    out, name = [], ""
    for line in lines:
        if line.startswith("# TYPE "):
            name = line.split()[2]
        out.append(name + line if line.startswith(("_", "{")) else line)
    return out


def draft_numbers(stats) -> tuple[int, int, int, int]:
    """(draft tokens, accepted, jump-forward accepted, sequence forward passes) from ``EngineStats``."""
    if stats is None:
        return 0, 0, 0, 0
    drafted, accepted = getattr(stats, "num_draft_tokens", 0), getattr(stats, "num_accepted_tokens", 0)
    return drafted, accepted, getattr(stats, "num_forced_tokens", 0), getattr(stats, "num_generated_tokens", 0) - accepted


def stats_numbers(stats) -> tuple[int, int, float, int, int]:
    """(running, waiting, KV usage in [0, 1], prefix-cache queries, prefix-cache hits) from ``EngineStats``."""
    if stats is None:
        return 0, 0, 0.0, 0, 0
    used = getattr(stats, "num_kv_blocks_used", 0)
    total = getattr(stats, "num_kv_blocks_total", 0) or 1
    return (getattr(stats, "num_running", 0), getattr(stats, "num_waiting", 0), used / total,
            getattr(stats, "prefix_cache_queries", 0), getattr(stats, "prefix_cache_hits", 0))

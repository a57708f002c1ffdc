"""The Prometheus text: cumulative histogram buckets, and counters driven by engine outputs."""

from types import SimpleNamespace

from corral.api.metrics import Histogram, ServerMetrics


def test_histogram_buckets_are_cumulative_and_le_inclusive():
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        h.observe(value)
    assert h.lines("m", 'model_name="x"') == [
        'm_bucket{model_name="x",le="0.1"} 2', 'm_bucket{model_name="x",le="1.0"} 3',
        'm_bucket{model_name="x",le="+Inf"} 4', 'm_sum{model_name="x"} 3.65', 'm_count{model_name="x"} 4']


def _output(request_id, num_tokens, finished, reason=None, first_token_time=None, delta=False):
    completion = SimpleNamespace(token_ids=list(range(num_tokens)), finish_reason=reason)
    return SimpleNamespace(request_id=request_id, outputs=[completion], finished=finished, prompt_token_ids=[1] * 7,
                           metrics=SimpleNamespace(first_token_time=first_token_time), delta=delta)


def test_a_final_only_output_times_its_first_token_by_the_engine_and_spreads_the_rest():
    m = ServerMetrics("x")
    m.on_arrival("r", 10.0)
    m.on_output(_output("r", 5, True, "length", first_token_time=10.4), 11.2)  # the request's only output
    assert (m.ttft.count, round(m.ttft.sum, 6)) == (1, 0.4)
    assert m.itl.count == 4 and abs(m.itl.sum - 0.8) < 1e-9  # four tokens over 0.8 s
    assert (m.e2e.count, round(m.e2e.sum, 6)) == (1, 1.2)
    assert (m.prompt_tokens, m.generation_tokens) == (7, 5)


def test_outputs_drive_ttft_itl_e2e_and_token_counters():
    m = ServerMetrics("x")
    m.on_arrival("r", 10.0)
    m.on_output(_output("r", 1, False), 10.5)  # first token after 0.5 s
    m.on_output(_output("r", 3, False), 11.5)  # two tokens in 1 s: 0.5 s each
    m.on_output(_output("r", 4, True, "stop"), 11.7)
    m.on_arrival("gone", 12.0)
    m.on_abandoned("gone")
    assert (m.ttft.count, m.ttft.sum) == (1, 0.5)
    assert m.itl.count == 3 and abs(m.itl.sum - 1.2) < 1e-9
    assert (m.e2e.count, round(m.e2e.sum, 6)) == (1, 1.7)
    assert (m.prompt_tokens, m.generation_tokens, m.finished) == (7, 4, {"stop": 1, "abort": 1})
    m.on_stats(SimpleNamespace(num_running=2, num_waiting=1, num_kv_blocks_used=5, num_kv_blocks_total=20,
                               prefix_cache_queries=100, prefix_cache_hits=40))
    text = m.render()
    for row in ('vllm:num_requests_running{model_name="x"} 2', 'vllm:num_requests_waiting{model_name="x"} 1',
                'vllm:kv_cache_usage_perc{model_name="x"} 0.25', 'vllm:prefix_cache_queries_total{model_name="x"} 100',
                'vllm:prefix_cache_hits_total{model_name="x"} 40', 'vllm:generation_tokens_total{model_name="x"} 4',
                'vllm:request_success_total{model_name="x",finished_reason="abort"} 1',
                'vllm:time_to_first_token_seconds_count{model_name="x"} 1', '# TYPE vllm:e2e_request_latency_seconds histogram'):
        assert row in text.splitlines(), row


def test_delta_outputs_count_their_new_tokens_alone():
    m = ServerMetrics("x")
    m.on_arrival("r", 10.0)
    m.on_output(_output("r", 1, False, delta=True), 10.5)
    m.on_output(_output("r", 2, False, delta=True), 11.5)  # two more tokens in 1 s
    m.on_output(_output("r", 1, True, "stop", delta=True), 11.7)
    assert (m.ttft.count, m.ttft.sum) == (1, 0.5)
    assert m.itl.count == 3 and abs(m.itl.sum - 1.2) < 1e-9
    assert (m.generation_tokens, m.finished) == (4, {"stop": 1})

//! The engine's Prometheus metrics: load, KV blocks, the prefix cache, tokens, and the
//! latencies clients feel (time to first token, time between tokens).

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Seconds over which `tpc_generation_tokens_per_second` counts tokens.
const RATE_WINDOW: Duration = Duration::from_secs(10);

/// Every metric the engine keeps, registered in one registry.
pub struct Metrics {
    pub registry: Arc<Registry>,
    pub running: IntGauge,
    pub waiting: IntGauge,
    pub kv_blocks_in_use: IntGauge,
    pub kv_blocks_total: IntGauge,
    pub prefix_queried_tokens: IntCounter,
    pub prefix_hit_tokens: IntCounter,
    prefix_hit_rate: prometheus::Gauge,
    pub prompt_tokens_computed: IntCounter,
    pub generation_tokens: IntCounter,
    pub preemptions: IntCounter,
    pub finished: IntCounterVec,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    tokens_per_second: prometheus::Gauge,
    recent: VecDeque<(Instant, u64)>,
}

/// Latency buckets, seconds: 1 ms to 60 s.
fn latency_buckets() -> Vec<f64> {
    vec![
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ]
}

fn register<M: prometheus::core::Collector + Clone + 'static>(registry: &Registry, m: M) -> M {
    // Names are fixed and distinct: registering cannot fail but for a bug, and a metric
    // missing from /metrics is no reason to stop serving.
    let _ = registry.register(Box::new(m.clone()));
    m
}

impl Metrics {
    /// The metrics of a lone engine, in a registry of their own.
    pub fn new() -> Metrics {
        Metrics::in_registry(Arc::new(Registry::new()), None)
    }

    /// The metrics of one engine among data-parallel replicas (labelled with its index), in
    /// the registry they share.
    pub fn in_registry(registry: Arc<Registry>, replica: Option<usize>) -> Metrics {
        let opts = |name: &str, help: &str| {
            let o = Opts::new(name, help);
            match replica {
                Some(r) => o.const_label("replica", r.to_string()),
                None => o,
            }
        };
        let gauge = |name: &str, help: &str| {
            let m = IntGauge::with_opts(opts(name, help)).expect("a valid metric name");
            register(&registry, m)
        };
        let counter = |name: &str, help: &str| {
            let m = IntCounter::with_opts(opts(name, help)).expect("a valid metric name");
            register(&registry, m)
        };
        let float = |name: &str, help: &str| {
            let m = prometheus::Gauge::with_opts(opts(name, help)).expect("a valid metric name");
            register(&registry, m)
        };
        let histogram = |name: &str, help: &str| {
            let o = HistogramOpts::from(opts(name, help)).buckets(latency_buckets());
            register(
                &registry,
                Histogram::with_opts(o).expect("a valid histogram"),
            )
        };
        Metrics {
            running: gauge("tpc_requests_running", "Requests in the running batch."),
            waiting: gauge("tpc_requests_waiting", "Requests waiting to be scheduled."),
            kv_blocks_in_use: gauge("tpc_kv_blocks_in_use", "KV-cache blocks read by a request."),
            kv_blocks_total: gauge("tpc_kv_blocks_total", "KV-cache blocks in the pool."),
            prefix_queried_tokens: counter(
                "tpc_prefix_cache_queried_tokens_total",
                "Prompt tokens looked up in the prefix cache.",
            ),
            prefix_hit_tokens: counter(
                "tpc_prefix_cache_hit_tokens_total",
                "Prompt tokens whose keys and values came from the prefix cache.",
            ),
            prefix_hit_rate: float(
                "tpc_prefix_cache_hit_rate",
                "Hit tokens over queried tokens since the start.",
            ),
            prompt_tokens_computed: counter(
                "tpc_prompt_tokens_computed_total",
                "Prompt tokens run through the model (prefix-cache hits are not).",
            ),
            generation_tokens: counter("tpc_generation_tokens_total", "Tokens generated."),
            preemptions: counter(
                "tpc_preemptions_total",
                "Requests preempted (to be recomputed) when the KV pool ran out.",
            ),
            finished: register(
                &registry,
                IntCounterVec::new(
                    opts("tpc_requests_finished_total", "Requests ended, by reason."),
                    &["reason"],
                )
                .expect("a valid metric"),
            ),
            time_to_first_token: histogram(
                "tpc_time_to_first_token_seconds",
                "From a request's arrival to its first generated token.",
            ),
            inter_token_latency: histogram(
                "tpc_inter_token_latency_seconds",
                "Between consecutive generated tokens of a request.",
            ),
            tokens_per_second: float(
                "tpc_generation_tokens_per_second",
                "Tokens generated per second over the last 10 seconds.",
            ),
            recent: VecDeque::new(),
            registry,
        }
    }

    /// Records a prefix-cache lookup of `queried` prompt tokens that found `hit`.
    pub fn prefix_lookup(&mut self, queried: usize, hit: usize) {
        self.prefix_queried_tokens.inc_by(queried as u64);
        self.prefix_hit_tokens.inc_by(hit as u64);
        let q = self.prefix_queried_tokens.get();
        if q > 0 {
            self.prefix_hit_rate
                .set(self.prefix_hit_tokens.get() as f64 / q as f64);
        }
    }

    /// Records `tokens` generated by the step that ended `now`.
    pub fn generated(&mut self, tokens: usize, now: Instant) {
        self.generation_tokens.inc_by(tokens as u64);
        self.recent.push_back((now, tokens as u64));
        while self
            .recent
            .front()
            .is_some_and(|&(t, _)| now.duration_since(t) > RATE_WINDOW)
        {
            self.recent.pop_front();
        }
        let total: u64 = self.recent.iter().map(|&(_, n)| n).sum();
        let span = self
            .recent
            .front()
            .map_or(RATE_WINDOW, |&(t, _)| now.duration_since(t))
            .max(Duration::from_millis(100));
        self.tokens_per_second
            .set(total as f64 / span.as_secs_f64());
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::Encoder;

    #[test]
    fn every_metric_is_in_the_text_format() {
        let mut m = Metrics::new();
        m.prefix_lookup(10, 4);
        m.generated(3, Instant::now());
        m.time_to_first_token.observe(0.02);
        m.finished.with_label_values(&["stop"]).inc();
        let mut out = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&m.registry.gather(), &mut out)
            .unwrap();
        let text = String::from_utf8(out).unwrap();
        for name in [
            "tpc_requests_running",
            "tpc_requests_waiting",
            "tpc_kv_blocks_in_use",
            "tpc_kv_blocks_total",
            "tpc_prefix_cache_hit_rate 0.4",
            "tpc_prompt_tokens_computed_total",
            "tpc_generation_tokens_total 3",
            "tpc_time_to_first_token_seconds_bucket",
            "tpc_inter_token_latency_seconds_count",
            "tpc_generation_tokens_per_second",
            "tpc_requests_finished_total{reason=\"stop\"} 1",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
    }

    #[test]
    fn replicas_share_one_registry_under_their_own_label() {
        let registry = Arc::new(Registry::new());
        let a = Metrics::in_registry(registry.clone(), Some(0));
        let b = Metrics::in_registry(registry.clone(), Some(1));
        a.generation_tokens.inc_by(2);
        b.generation_tokens.inc_by(5);
        let mut out = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&registry.gather(), &mut out)
            .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("tpc_generation_tokens_total{replica=\"0\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("tpc_generation_tokens_total{replica=\"1\"} 5"),
            "{text}"
        );
    }
}

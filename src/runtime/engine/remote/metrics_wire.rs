//! A replica's gathered Prometheus metric families as bytes, so that the front's `/metrics`
//! lists every replica's engine (each family's metrics carry their `replica` label).

use super::wire::{Reader, Writer};
use super::LinkError;
use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType, Quantile,
    Summary,
};

/// A family's type on the wire; untyped families (the engine makes none, and the client
/// library is retiring them) do not travel.
fn kind(t: MetricType) -> Option<u8> {
    match t {
        MetricType::COUNTER => Some(0),
        MetricType::GAUGE => Some(1),
        MetricType::SUMMARY => Some(2),
        MetricType::HISTOGRAM => Some(4),
        MetricType::UNTYPED => None,
    }
}

pub(super) fn write_families(w: &mut Writer, families: &[MetricFamily]) {
    let typed: Vec<(&MetricFamily, u8)> = families
        .iter()
        .filter_map(|f| Some((f, kind(f.get_field_type())?)))
        .collect();
    w.usize(typed.len());
    for (f, k) in typed {
        w.str(f.name());
        w.str(f.help());
        let t = f.get_field_type();
        w.u8(k);
        w.usize(f.get_metric().len());
        for m in f.get_metric() {
            write_metric(w, t, m);
        }
    }
}

fn write_metric(w: &mut Writer, t: MetricType, m: &Metric) {
    w.usize(m.get_label().len());
    for l in m.get_label() {
        w.str(l.name());
        w.str(l.value());
    }
    match t {
        MetricType::COUNTER => w.f64(m.get_counter().get_value()),
        MetricType::GAUGE => w.f64(m.get_gauge().get_value()),
        MetricType::UNTYPED => {}
        MetricType::HISTOGRAM => {
            let h = m.get_histogram();
            w.u64(h.get_sample_count());
            w.f64(h.get_sample_sum());
            w.usize(h.get_bucket().len());
            for b in h.get_bucket() {
                w.f64(b.upper_bound());
                w.u64(b.cumulative_count());
            }
        }
        MetricType::SUMMARY => {
            let s = m.get_summary();
            w.u64(s.sample_count());
            w.f64(s.sample_sum());
            w.usize(s.get_quantile().len());
            for q in s.get_quantile() {
                w.f64(q.quantile());
                w.f64(q.value());
            }
        }
    }
}

pub(super) fn read_families(r: &mut Reader<'_>) -> Result<Vec<MetricFamily>, LinkError> {
    // A family takes at least its two string lengths, a kind and a count.
    let n = r.count(25)?;
    (0..n)
        .map(|_| {
            let mut f = MetricFamily::default();
            f.set_name(r.str()?);
            f.set_help(r.str()?);
            let t = match r.u8()? {
                0 => MetricType::COUNTER,
                1 => MetricType::GAUGE,
                2 => MetricType::SUMMARY,
                4 => MetricType::HISTOGRAM,
                k => return Err(r.bad(format!("metric type {k}"))),
            };
            f.set_field_type(t);
            let metrics = r.count(16)?;
            let metrics = (0..metrics)
                .map(|_| read_metric(r, t))
                .collect::<Result<_, _>>()?;
            f.set_metric(metrics);
            Ok(f)
        })
        .collect()
}

fn read_metric(r: &mut Reader<'_>, t: MetricType) -> Result<Metric, LinkError> {
    let labels = r.count(16)?;
    let labels = (0..labels)
        .map(|_| {
            let mut l = LabelPair::default();
            l.set_name(r.str()?);
            l.set_value(r.str()?);
            Ok(l)
        })
        .collect::<Result<Vec<_>, LinkError>>()?;
    let mut m = Metric::from_label(labels);
    match t {
        MetricType::COUNTER => {
            let mut c = Counter::default();
            c.set_value(r.f64()?);
            m.set_counter(c);
        }
        MetricType::GAUGE => {
            let mut g = Gauge::default();
            g.set_value(r.f64()?);
            m.set_gauge(g);
        }
        MetricType::UNTYPED => {}
        MetricType::HISTOGRAM => {
            let mut h = Histogram::default();
            h.set_sample_count(r.u64()?);
            h.set_sample_sum(r.f64()?);
            let n = r.count(16)?;
            let buckets = (0..n)
                .map(|_| {
                    let mut b = Bucket::default();
                    b.set_upper_bound(r.f64()?);
                    b.set_cumulative_count(r.u64()?);
                    Ok(b)
                })
                .collect::<Result<Vec<_>, LinkError>>()?;
            h.set_bucket(buckets);
            m.set_histogram(h);
        }
        MetricType::SUMMARY => {
            let mut s = Summary::default();
            s.set_sample_count(r.u64()?);
            s.set_sample_sum(r.f64()?);
            let n = r.count(16)?;
            let quantiles = (0..n)
                .map(|_| {
                    let mut q = Quantile::default();
                    q.set_quantile(r.f64()?);
                    q.set_value(r.f64()?);
                    Ok(q)
                })
                .collect::<Result<Vec<_>, LinkError>>()?;
            s.set_quantile(quantiles);
            m.set_summary(s);
        }
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::engine::metrics::Metrics;
    use std::sync::Arc;

    #[test]
    fn an_engines_metrics_come_back_in_the_text_format_unchanged() {
        let mut metrics = Metrics::in_registry(Arc::new(prometheus::Registry::new()), Some(3));
        metrics.generation_tokens.inc_by(17);
        metrics.kv_blocks_in_use.set(4);
        metrics.time_to_first_token.observe(0.02);
        metrics.time_to_first_token.observe(3.0);
        metrics.finished.with_label_values(&["stop"]).inc();
        metrics.generated(5, std::time::Instant::now());
        let families = metrics.registry.gather();
        let mut w = Writer::default();
        write_families(&mut w, &families);
        let mut r = Reader::new(&w.0, "metrics");
        let back = read_families(&mut r).unwrap();
        r.end().unwrap();
        let text = |f: &[MetricFamily]| {
            let mut out = String::new();
            prometheus::TextEncoder::new()
                .encode_utf8(f, &mut out)
                .unwrap();
            out
        };
        assert_eq!(text(&back), text(&families));
        assert!(text(&back).contains("tpc_generation_tokens_total{replica=\"3\"} 22"));
        // Cut short anywhere, it is an error.
        for cut in 0..w.0.len() {
            let mut r = Reader::new(&w.0[..cut], "metrics");
            assert!(read_families(&mut r).and_then(|_| r.end()).is_err());
        }
    }
}

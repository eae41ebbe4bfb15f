//! Job-labelled metric series, kept apart from the rest so they can be
//! removed and capped.
//!
//! In: every metric the agent records, through the process-global recorder
//! ([`Router`], installed by [`crate::api::metrics_http::install`]). Gauges and
//! counters with a `job` label (the goodput gauges, the straggler gauges)
//! go to [`JobSeries`]; everything else to the Prometheus recorder. Out: the
//! job series rendered at each scrape after the others ([`render`]). Never:
//! more than `metrics.max_job_series` job series at once (a series past the
//! cap is not recorded, and counted in
//! `warden_metrics_job_series_dropped_total`), or a series of a job the
//! goodput task no longer exports (it calls [`retain`] each flush).
//!
//! Why: the Prometheus recorder keeps every series it ever saw and has no
//! way to remove one, so each job id ever seen stayed on `/metrics` forever
//! (issue 29: 3,000 register/close cycles left 38,766 job series).
//! Histograms never carry a job label; one that did would go to the
//! Prometheus recorder and stay.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};
use metrics_util::registry::{AtomicStorage, Registry};

/// The label that makes a series a job's.
pub const JOB_LABEL: &str = "job";

/// The job series, once a recorder is installed.
static JOBS: OnceLock<Arc<JobSeries>> = OnceLock::new();

/// Where job-labelled gauges and counters live: a registry that can remove.
#[derive(Debug)]
pub struct JobSeries {
    registry: Registry<Key, AtomicStorage>,
    /// `metrics.max_job_series`.
    max: usize,
    /// Series held now (recounted exactly by [`JobSeries::retain`]; between
    /// two, it may count a racing registration twice, which errs on the
    /// side of the cap).
    held: AtomicUsize,
    /// Series not recorded because the cap was reached.
    dropped: AtomicU64,
}

impl JobSeries {
    /// An empty set holding at most `max` series.
    pub fn new(max: usize) -> Self {
        Self {
            registry: Registry::atomic(),
            max,
            held: AtomicUsize::new(0),
            dropped: AtomicU64::new(0),
        }
    }

    /// Room for one more series, or None (counted) past the cap.
    fn room(&self) -> bool {
        if self.held.load(Ordering::Relaxed) >= self.max {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.held.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// The gauge of `key`, or a gauge that records nothing past the cap.
    pub fn gauge(&self, key: &Key) -> Gauge {
        if let Some(g) = self.registry.get_gauge(key) {
            return Gauge::from_arc(g);
        }
        if !self.room() {
            return Gauge::noop();
        }
        self.registry
            .get_or_create_gauge(key, |g| Gauge::from_arc(g.clone()))
    }

    /// The counter of `key`, or one that records nothing past the cap.
    pub fn counter(&self, key: &Key) -> Counter {
        if let Some(c) = self.registry.get_counter(key) {
            return Counter::from_arc(c);
        }
        if !self.room() {
            return Counter::noop();
        }
        self.registry
            .get_or_create_counter(key, |c| Counter::from_arc(c.clone()))
    }

    /// Keeps the series of the jobs `keep` says yes to; removes the rest.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        let kept = |k: &Key| job_of(k).is_some_and(&keep);
        self.registry.retain_gauges(|k, _| kept(k));
        self.registry.retain_counters(|k, _| kept(k));
        let mut n = 0;
        self.registry.visit_gauges(|_, _| n += 1);
        self.registry.visit_counters(|_, _| n += 1);
        self.held.store(n, Ordering::Relaxed);
    }

    /// Series held now.
    pub fn len(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// True when no job series is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The series in the Prometheus text format: copied into a recorder of
    /// their own, made for this scrape, which renders and escapes them.
    pub fn render(&self) -> String {
        static META: Metadata<'static> =
            Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));
        let out = PrometheusBuilder::new().build_recorder();
        self.registry.visit_gauges(|k, g| {
            out.register_gauge(k, &META)
                .set(f64::from_bits(g.load(Ordering::Acquire)));
        });
        self.registry.visit_counters(|k, c| {
            out.register_counter(k, &META)
                .absolute(c.load(Ordering::Acquire));
        });
        out.handle().render()
    }
}

/// The job a series belongs to, if it has a job label.
fn job_of(key: &Key) -> Option<&str> {
    key.labels()
        .find(|l| l.key() == JOB_LABEL)
        .map(|l| l.value())
}

/// The process-global recorder: job series to [`JobSeries`], the rest to
/// Prometheus.
#[derive(Debug)]
pub struct Router {
    prom: PrometheusRecorder,
    jobs: Arc<JobSeries>,
}

impl Router {
    /// A router in front of `prom`, holding at most `max_job_series` job
    /// series; the set becomes the one [`retain`] and [`render`] reach.
    pub fn new(prom: PrometheusRecorder, max_job_series: usize) -> Self {
        let jobs = JOBS
            .get_or_init(|| Arc::new(JobSeries::new(max_job_series)))
            .clone();
        Self { prom, jobs }
    }
}

impl Recorder for Router {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prom.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prom.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prom.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        if job_of(key).is_some() {
            return self.jobs.counter(key);
        }
        self.prom.register_counter(key, metadata)
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        if job_of(key).is_some() {
            return self.jobs.gauge(key);
        }
        self.prom.register_gauge(key, metadata)
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        self.prom.register_histogram(key, metadata)
    }
}

/// Keeps only the series of the jobs `keep` says yes to (no-op before a
/// recorder is installed).
pub fn retain(keep: impl Fn(&str) -> bool) {
    if let Some(j) = JOBS.get() {
        j.retain(keep);
    }
}

/// The job series as Prometheus text, and the count of series dropped at
/// the cap so far (empty and 0 before a recorder is installed).
pub fn render() -> (String, u64) {
    JOBS.get().map_or((String::new(), 0), |j| {
        (j.render(), j.dropped.load(Ordering::Relaxed))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &'static str, job: &str) -> Key {
        Key::from_parts(name, vec![metrics::Label::new("job", job.to_owned())])
    }

    #[test]
    fn capped_removed_and_rendered_escaped() {
        let s = JobSeries::new(3);
        s.gauge(&key("warden_goodput_ratio", "a")).set(0.5);
        s.gauge(&key("warden_goodput_ratio", "b\"\\")).set(0.25);
        s.counter(&key("warden_x_total", "a")).increment(2);
        // Past the cap: nothing is recorded, the drop is counted.
        s.gauge(&key("warden_goodput_ratio", "c")).set(1.0);
        assert_eq!(s.len(), 3);
        assert_eq!(s.dropped.load(Ordering::Relaxed), 1);
        // The same series again takes no room.
        s.gauge(&key("warden_goodput_ratio", "a")).set(0.75);
        assert_eq!(s.len(), 3);
        let text = s.render();
        assert!(
            text.contains("warden_goodput_ratio{job=\"a\"} 0.75"),
            "{text}"
        );
        assert!(
            text.contains(r#"warden_goodput_ratio{job="b\"\\"} 0.25"#),
            "{text}"
        );
        assert!(text.contains("warden_x_total{job=\"a\"} 2"), "{text}");
        assert!(!text.contains("job=\"c\""), "{text}");
        // Removed: gone from the text, and room again.
        s.retain(|j| j == "b\"\\");
        assert_eq!(s.len(), 1);
        let text = s.render();
        assert!(!text.contains("job=\"a\""), "{text}");
        s.gauge(&key("warden_goodput_ratio", "c")).set(1.0);
        assert!(s.render().contains("job=\"c\""));
    }
}

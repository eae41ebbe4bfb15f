//! A group leader's batches: the reports its members send within
//! `straggler.relay_batch_window` passed on to the aggregator in one
//! `ReportBatchToAggregator` call, so the aggregator answers one call per
//! batch rather than one per member (issue 30: at 4,096 hosts four fifths of
//! the aggregator's CPU went to the calls themselves, TLS, HTTP/2 and
//! tonic, not to aggregating).
//!
//! In: a member's report, decoded and authorized by the edge
//! (`api::aggregate`), with the hosts to try ([`Hop`]s, the same plan a
//! single relay takes). Out: that report's own answer, or [`RelayError`].
//! The first report of a job opens its batch; the batch goes when the
//! window closes, or at once when it reaches [`MAX_BATCH`] reports or
//! [`MAX_BATCH_BYTES`]. Along the plan, within one `straggler.peer_timeout`:
//! a host that answers hands each report its item; one that fails is
//! skipped for the next; an older one (UNIMPLEMENTED) gets each report
//! alone ([`relay`]); this agent itself, when every host of group 0 is
//! down, aggregates them in place.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prost::Message;
use tokio::sync::oneshot;
use warden_proto::v1 as pb;

use super::call::{RELAY_FAILED, RpcFailed, call_batch};
use super::relay::{Decoded, RelayError, here, relay};
use super::tonic_aggregator::client_of;
use crate::exchange::Exchange;
use crate::exchange::routes::Hop;
use warden_core::detect::sdc::aggregate::MAX_SETTLED;

/// The most reports one batch carries (and the most an aggregator takes in
/// one call).
pub const MAX_BATCH: usize = 4096;

/// A batch goes once its reports' encoded size passes this, well within the
/// Peer service's message limit (`peer_link::channel::MAX_MESSAGE`, 32 MiB).
pub const MAX_BATCH_BYTES: usize = 8 << 20;

/// One member's report waiting in a batch, and where its answer goes.
struct Waiting {
    req: pb::AggregateReport,
    decoded: Decoded,
    answer: oneshot::Sender<Result<pb::AggregateAnswer, RelayError>>,
}

/// A job's open batch: its reports, their encoded size, the plan its first
/// report brought, and its number (the window's timer takes only its own
/// batch, not one opened after a full one went).
struct Open {
    number: u64,
    plan: Vec<Hop>,
    waiting: Vec<Waiting>,
    bytes: usize,
}

/// The open batches of a leader's jobs.
#[derive(Debug, Default)]
pub struct Batches {
    open: Mutex<OpenBatches>,
}

#[derive(Default)]
struct OpenBatches {
    next: u64,
    by_job: HashMap<String, Open>,
}

impl std::fmt::Debug for OpenBatches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenBatches")
            .field("jobs", &self.by_job.len())
            .finish()
    }
}

impl Batches {
    /// Puts a member's report of `job` into the job's open batch (opening
    /// one, with `plan`, when none is) and waits for its answer: at most
    /// `straggler.relay_batch_wait()` for the batch to go, then one
    /// `straggler.peer_timeout` along the plan.
    pub async fn submit(
        ex: &Arc<Exchange>,
        batches: &Arc<Batches>,
        job: String,
        plan: Vec<Hop>,
        req: pb::AggregateReport,
        decoded: Decoded,
    ) -> Result<pb::AggregateAnswer, RelayError> {
        let (tx, rx) = oneshot::channel();
        let bytes = req.encoded_len();
        let waiting = Waiting {
            req,
            decoded,
            answer: tx,
        };
        let (opened, full) = {
            let mut open = batches
                .open
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let next = open.next;
            let mut opened = None;
            let batch = open.by_job.entry(job.clone()).or_insert_with(|| {
                opened = Some(next);
                Open {
                    number: next,
                    plan,
                    waiting: Vec::new(),
                    bytes: 0,
                }
            });
            batch.waiting.push(waiting);
            batch.bytes += bytes;
            let full = batch.waiting.len() >= MAX_BATCH || batch.bytes >= MAX_BATCH_BYTES;
            if opened.is_some() {
                open.next += 1;
            }
            let full = full.then(|| open.by_job.remove(&job)).flatten();
            (opened, full)
        };
        if let Some(batch) = full {
            tokio::spawn(send(ex.clone(), batch));
        } else if let Some(number) = opened {
            let (ex, batches) = (ex.clone(), batches.clone());
            tokio::spawn(async move {
                tokio::time::sleep(ex.relay_batch_wait).await;
                let batch = {
                    let mut open = batches
                        .open
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    match open.by_job.get(&job) {
                        Some(b) if b.number == number => open.by_job.remove(&job),
                        _ => None,
                    }
                };
                if let Some(batch) = batch {
                    send(ex, batch).await;
                }
            });
        }
        rx.await.unwrap_or_else(|_| {
            Err(RelayError::NoneAnswered(format!(
                "{RELAY_FAILED}: the batch was dropped (the agent is stopping)"
            )))
        })
    }
}

/// Sends `batch` along its plan within one `straggler.peer_timeout`, and
/// hands each report its answer.
async fn send(ex: Arc<Exchange>, batch: Open) {
    let deadline = tokio::time::Instant::now() + ex.relay_limit;
    let routes = &ex.routes;
    let mut errors = Vec::new();
    let Open { plan, waiting, .. } = batch;
    metrics::histogram!("warden_straggler_relay_batch_reports").record(waiting.len() as f64);
    let batch = pb::AggregateBatch {
        reports: waiting
            .iter()
            .map(|w| pb::AggregateReport {
                relayed: true,
                ..w.req.clone()
            })
            .collect(),
        shared_steps: true,
    };
    for (i, hop) in plan.iter().enumerate() {
        let Some(mut client) = hop.link.as_deref().and_then(client_of) else {
            metrics::counter!("warden_straggler_relays_total", "result" => "here")
                .increment(waiting.len() as u64);
            for w in waiting {
                let _ = w.answer.send(here(&ex, w.decoded));
            }
            return;
        };
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let err = match call_batch(&mut client, batch.clone(), left).await {
            Ok(mut answer) if answer.items.len() == waiting.len() => {
                metrics::counter!("warden_straggler_relays_total", "result" => "ok")
                    .increment(waiting.len() as u64);
                routes.note_answered(&hop.addr);
                let items = std::mem::take(&mut answer.items);
                for (w, item) in waiting.into_iter().zip(items) {
                    let _ = w.answer.send(item_outcome(item, &w.req, &answer));
                }
                return;
            }
            Ok(answer) => format!(
                "answered {} items for a batch of {} reports",
                answer.items.len(),
                waiting.len()
            ),
            Err(RpcFailed::Refused(s)) if s.code() == tonic::Code::Unimplemented => {
                // An agent older than batches: each report alone, from
                // this host on, in what is left of the limit.
                let rest: Vec<Hop> = plan[i..].to_vec();
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                for w in waiting {
                    let (ex, rest) = (ex.clone(), rest.clone());
                    tokio::spawn(async move {
                        let answer = relay(&ex, rest, w.req, w.decoded, left).await;
                        let _ = w.answer.send(answer);
                    });
                }
                return;
            }
            Err(e) => e.to_string(),
        };
        routes.note_failed(&hop.addr, err.clone(), "this group leader");
        errors.push(format!("{}: {err}", hop.addr));
        if tokio::time::Instant::now() >= deadline {
            break;
        }
    }
    metrics::counter!("warden_straggler_relays_total", "result" => "failed")
        .increment(waiting.len() as u64);
    let failed = format!("{RELAY_FAILED}: {}", errors.join("; "));
    for w in waiting {
        let _ = w.answer.send(Err(RelayError::NoneAnswered(failed.clone())));
    }
}

/// One report's item of the aggregator's answer, its jobs' statistics and
/// its settled steps put back from the ones the batch shares. An item that
/// names more than its report asked for, or a shared entry that is not
/// there, is that member's INTERNAL (one index must not make the leader
/// copy a shared entry without bound).
fn item_outcome(
    item: pb::AggregateBatchItem,
    req: &pb::AggregateReport,
    answer: &pb::AggregateBatchAnswer,
) -> Result<pb::AggregateAnswer, RelayError> {
    let bad = |message: String| RelayError::Aggregator {
        code: tonic::Code::Internal as i32,
        message,
    };
    match item.outcome {
        Some(pb::aggregate_batch_item::Outcome::Answer(mut a)) => {
            if item.jobs.len() > req.jobs.len() {
                return Err(bad(format!(
                    "the aggregator's answer names {} job statistics for a report of {} jobs",
                    item.jobs.len(),
                    req.jobs.len()
                )));
            }
            for &i in &item.jobs {
                let Some(stats) = usize::try_from(i).ok().and_then(|i| answer.jobs.get(i)) else {
                    return Err(bad(format!(
                        "the aggregator's answer names job statistics {i} of {}",
                        answer.jobs.len()
                    )));
                };
                a.jobs.push(stats.clone());
            }
            if item.values.len() > a.values.len() {
                return Err(bad(format!(
                    "the aggregator's answer names steps of {} jobs for {} jobs of values",
                    item.values.len(),
                    a.values.len()
                )));
            }
            for (refs, job) in item.values.into_iter().zip(a.values.iter_mut()) {
                if refs.steps.len() > MAX_SETTLED {
                    return Err(bad(format!(
                        "the aggregator's answer names {} settled steps of job {:?}; at most \
                         {MAX_SETTLED}",
                        refs.steps.len(),
                        job.job_id
                    )));
                }
                for i in refs.steps {
                    let shared = usize::try_from(i)
                        .ok()
                        .and_then(|i| answer.steps.get(i))
                        .filter(|s| s.job_id == job.job_id);
                    let Some(step) = shared.and_then(|s| s.step.clone()) else {
                        return Err(bad(format!(
                            "the aggregator's answer names step {i} of {} for job {:?}, \
                             which is not there",
                            answer.steps.len(),
                            job.job_id
                        )));
                    };
                    job.steps.push(step);
                }
            }
            Ok(a)
        }
        Some(pb::aggregate_batch_item::Outcome::Error(e)) => Err(RelayError::Aggregator {
            code: e.code,
            message: e.message,
        }),
        None => Err(bad(
            "the aggregator's answer for this report was empty".to_owned()
        )),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use tokio_util::sync::CancellationToken;
    use tonic::transport::{Channel, Endpoint};
    use tonic::{Request, Response, Status};
    use warden_core::detect::sdc::aggregate::SdcAggregator;
    use warden_core::detect::straggler::aggregate::Aggregator;
    use warden_proto::v1::peer_client::PeerClient;
    use warden_proto::v1::peer_server::{Peer, PeerServer};

    use super::super::tonic_aggregator::{TonicAggregator, TonicAggregatorDial};
    use super::super::wire::report_from_pb;
    use crate::exchange::routes::{Dial, Routes};
    use crate::tls::PeerTls;

    /// An aggregator on the wire, as an agent older than batches or a
    /// newer one answers: counts the calls of each kind and the reports.
    #[derive(Default)]
    pub(crate) struct Aggregating {
        /// Answers ReportBatchToAggregator (an agent that knows it).
        pub(crate) batches: bool,
        /// Refuses reports of this host, alone.
        pub(crate) refuse: String,
        /// Plays a group leader: takes a member's own reports (not
        /// relayed), and answers one it was told to refuse as a leader
        /// whose aggregator refused it.
        pub(crate) leader: bool,
        /// Answers this host's report naming a shared step not there.
        pub(crate) bad_step: String,
        pub(crate) singles: AtomicUsize,
        pub(crate) batch_calls: AtomicUsize,
        pub(crate) batch_reports: AtomicUsize,
    }

    fn answer(host: &str) -> pb::AggregateAnswer {
        pb::AggregateAnswer {
            host: format!("agg, for {host}"),
            // Its values' job; the steps are shared in a batch's answer.
            values: vec![pb::JobStepStats {
                job_id: "j".into(),
                steps: Vec::new(),
            }],
            ..Default::default()
        }
    }

    /// The service, sharing its counts with the test.
    struct Served(Arc<Aggregating>);

    #[tonic::async_trait]
    impl Peer for Served {
        async fn exchange_straggler_summaries(
            &self,
            _: Request<pb::StragglerSummaries>,
        ) -> Result<Response<pb::StragglerSummaries>, Status> {
            Err(Status::unimplemented("not here"))
        }

        async fn report_to_aggregator(
            &self,
            req: Request<pb::AggregateReport>,
        ) -> Result<Response<pb::AggregateAnswer>, Status> {
            self.0.singles.fetch_add(1, Ordering::SeqCst);
            let r = req.into_inner();
            if self.0.leader {
                if r.host == self.0.refuse {
                    return Err(Status::permission_denied(format!(
                        "{}: not {}'s to relay",
                        super::super::call::AGGREGATOR_REFUSED,
                        r.host
                    )));
                }
                return Ok(Response::new(answer(&r.host)));
            }
            if r.host == self.0.refuse {
                // As an agent refuses a report for its own sake.
                return Err(Status::resource_exhausted(
                    super::super::call::report_refused("this aggregator already keeps 1024 jobs"),
                ));
            }
            assert!(r.relayed, "a relayed report is marked");
            Ok(Response::new(answer(&r.host)))
        }

        async fn report_batch_to_aggregator(
            &self,
            req: Request<pb::AggregateBatch>,
        ) -> Result<Response<pb::AggregateBatchAnswer>, Status> {
            if !self.0.batches {
                return Err(Status::unimplemented("an older agent"));
            }
            let req = req.into_inner();
            assert!(req.shared_steps, "a leader takes the steps shared");
            let reports = req.reports;
            self.0.batch_calls.fetch_add(1, Ordering::SeqCst);
            self.0
                .batch_reports
                .fetch_add(reports.len(), Ordering::SeqCst);
            // The job's statistics once, each taken report pointing at them.
            let jobs = vec![pb::JobStats {
                job_id: "j".into(),
                hosts: u32::try_from(reports.len()).unwrap(),
                ..Default::default()
            }];
            let items = reports
                .into_iter()
                .map(|r| {
                    if r.host == self.0.refuse {
                        pb::AggregateBatchItem {
                            outcome: Some(pb::aggregate_batch_item::Outcome::Error(
                                pb::BatchItemError {
                                    code: tonic::Code::PermissionDenied as i32,
                                    message: format!("not {}'s to relay", r.host),
                                },
                            )),
                            jobs: Vec::new(),
                            values: Vec::new(),
                        }
                    } else {
                        let step = if r.host == self.0.bad_step { 1 } else { 0 };
                        pb::AggregateBatchItem {
                            outcome: Some(pb::aggregate_batch_item::Outcome::Answer(answer(
                                &r.host,
                            ))),
                            jobs: vec![0],
                            values: vec![pb::StepRefs { steps: vec![step] }],
                        }
                    }
                })
                .collect();
            // One settled step, shared.
            let steps = vec![pb::SharedStep {
                job_id: "j".into(),
                step: Some(pb::StepStats {
                    step: 7,
                    ..Default::default()
                }),
            }];
            Ok(Response::new(pb::AggregateBatchAnswer {
                items,
                jobs,
                steps,
            }))
        }

        async fn push_shard(
            &self,
            _: Request<tonic::Streaming<pb::ShardChunk>>,
        ) -> Result<Response<pb::PushShardResponse>, Status> {
            Err(Status::unimplemented("not here"))
        }

        type FetchShardStream =
            tokio_stream::wrappers::ReceiverStream<Result<pb::ShardChunk, Status>>;

        async fn fetch_shard(
            &self,
            _: Request<pb::FetchShardRequest>,
        ) -> Result<Response<Self::FetchShardStream>, Status> {
            Err(Status::unimplemented("not here"))
        }

        async fn list_shards(
            &self,
            _: Request<pb::ListShardsRequest>,
        ) -> Result<Response<pb::ListShardsResponse>, Status> {
            Err(Status::unimplemented("not here"))
        }

        async fn collect_holdings(
            &self,
            _: Request<pb::HoldingsAsk>,
        ) -> Result<Response<pb::Holdings>, Status> {
            Err(Status::unimplemented("not here"))
        }
    }

    /// Serves `agg` on 127.0.0.2 (plain TCP); a hop to it.
    pub(crate) async fn serve(agg: Arc<Aggregating>) -> Hop {
        let listener = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(PeerServer::new(Served(agg)))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        hop(&addr)
    }

    pub(crate) fn hop(addr: &str) -> Hop {
        let channel: Channel = Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_lazy();
        Hop {
            addr: addr.to_owned(),
            link: Some(Arc::new(TonicAggregator {
                client: PeerClient::new(channel),
            })),
            relays: false,
        }
    }

    /// An address nobody listens on: a port bound, then closed.
    pub(crate) fn down() -> String {
        std::net::TcpListener::bind("127.0.0.2:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .to_string()
    }

    /// A leader's exchange: host `leader`, no peers of its own.
    pub(crate) fn exchange(dir: &std::path::Path) -> Arc<Exchange> {
        let registry =
            crate::ranks::registry::Registry::new(&dir.join("slots"), &dir.join("state"), 8)
                .unwrap();
        Arc::new(Exchange {
            host: "leader".into(),
            sdc_enabled: true,
            verdict_wait: Duration::from_secs(1),
            aggregator: Mutex::new(Aggregator::new(Duration::from_secs(30))),
            sdc_aggregator: Mutex::new(SdcAggregator::new(Duration::from_secs(30), 2)),
            routes: Routes::new(
                "",
                &[],
                0,
                Dial {
                    checkpoints: None,
                    dial: Arc::new(TonicAggregatorDial {
                        peer_tls: PeerTls::Insecure,
                        seen: Arc::default(),
                        peer_timeout: Duration::from_secs(5),
                    }),
                },
            ),
            relay_batch_wait: Duration::from_millis(50),
            relay_limit: Duration::from_secs(5),
            hang_board: Arc::new(crate::hang::verdict::HangBoard::new(
                "leader".into(),
                Duration::from_secs(30),
                Duration::from_secs(2),
            )),
            peer_values: Arc::default(),
            registry: crate::ranks::registry::SharedRegistry::new(registry),
            shutdown: CancellationToken::new(),
        })
    }

    fn member(host: &str) -> (pb::AggregateReport, Decoded) {
        let req = pb::AggregateReport {
            host: host.into(),
            relative_threshold: 1.06,
            z_threshold: 4.0,
            jobs: vec![pb::JobSketches {
                job_id: "j".into(),
                sections: vec![pb::SectionSketch {
                    section: "forward".into(),
                    keys: vec![4000],
                    counts: vec![2],
                }],
                scores: Vec::new(),
            }],
            ..Default::default()
        };
        let decoded = report_from_pb(req.clone()).unwrap();
        (req, decoded)
    }

    /// Three members' reports, submitted together, go in one call; each
    /// member gets its own item, and one refused alone gets its status;
    /// one whose item names a shared step that is not there is told so.
    #[tokio::test]
    async fn reports_of_one_window_go_in_one_call_and_each_gets_its_item() {
        let dir = tempfile::tempdir().unwrap();
        let ex = exchange(dir.path());
        let batches = Arc::new(Batches::default());
        let agg = Arc::new(Aggregating {
            batches: true,
            refuse: "m3".into(),
            bad_step: "m4".into(),
            ..Default::default()
        });
        let plan = vec![serve(agg.clone()).await];
        let submit = |h: &str| {
            let (req, decoded) = member(h);
            Batches::submit(&ex, &batches, "j".into(), plan.clone(), req, decoded)
        };
        let (a, b, c, d) = tokio::join!(submit("m1"), submit("m2"), submit("m3"), submit("m4"));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.host, "agg, for m1");
        assert_eq!(b.host, "agg, for m2");
        // The statistics the batch shares, put back into each answer.
        for x in [&a, &b] {
            assert_eq!(x.jobs.len(), 1, "{x:?}");
            assert_eq!(
                (x.jobs[0].job_id.as_str(), x.jobs[0].hosts),
                ("j", 4),
                "{x:?}"
            );
            // The settled step the batch shares, put back as well.
            assert_eq!(x.values.len(), 1, "{x:?}");
            let steps: Vec<u64> = x.values[0].steps.iter().map(|s| s.step).collect();
            assert_eq!(steps, [7], "{x:?}");
        }
        let Err(RelayError::Aggregator { code, message }) = d else {
            panic!("{d:?}")
        };
        assert_eq!(code, tonic::Code::Internal as i32);
        assert!(message.contains("names step 1 of 1"), "{message}");
        assert_eq!(
            c.unwrap_err(),
            RelayError::Aggregator {
                code: tonic::Code::PermissionDenied as i32,
                message: "not m3's to relay".into()
            }
        );
        assert_eq!(agg.batch_calls.load(Ordering::SeqCst), 1);
        assert_eq!(agg.batch_reports.load(Ordering::SeqCst), 4);
        assert_eq!(agg.singles.load(Ordering::SeqCst), 0);
    }

    /// An aggregator older than batches (UNIMPLEMENTED) gets each report of
    /// the batch alone, and every member its answer.
    #[tokio::test]
    async fn an_older_aggregator_gets_each_report_alone() {
        let dir = tempfile::tempdir().unwrap();
        let ex = exchange(dir.path());
        let batches = Arc::new(Batches::default());
        let agg = Arc::new(Aggregating::default());
        let plan = vec![serve(agg.clone()).await];
        let submit = |h: &str| {
            let (req, decoded) = member(h);
            Batches::submit(&ex, &batches, "j".into(), plan.clone(), req, decoded)
        };
        let (a, b) = tokio::join!(submit("m1"), submit("m2"));
        assert_eq!(a.unwrap().host, "agg, for m1");
        assert_eq!(b.unwrap().host, "agg, for m2");
        assert_eq!(agg.singles.load(Ordering::SeqCst), 2);
    }

    /// Every host before the leader's group down: the batch is aggregated
    /// at the leader itself, and the failure is named for the next.
    #[tokio::test]
    async fn with_the_aggregator_down_the_leader_aggregates_the_batch_itself() {
        let dir = tempfile::tempdir().unwrap();
        let ex = exchange(dir.path());
        let batches = Arc::new(Batches::default());
        let plan = vec![
            hop(&down()),
            Hop {
                addr: String::new(),
                link: None,
                relays: false,
            },
        ];
        let submit = |h: &str| {
            let (req, decoded) = member(h);
            Batches::submit(&ex, &batches, "j".into(), plan.clone(), req, decoded)
        };
        let (a, b) = tokio::join!(submit("m1"), submit("m2"));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.host, "leader");
        // Both reports reached the leader's own aggregate.
        assert_eq!(b.jobs[0].hosts, 2, "{b:?}");
    }

    /// No host answers and none is this agent: every member is told the
    /// relay failed (the leader itself is up).
    #[tokio::test]
    async fn with_no_host_answering_each_member_is_told_the_relay_failed() {
        let dir = tempfile::tempdir().unwrap();
        let ex = exchange(dir.path());
        let batches = Arc::new(Batches::default());
        let down = down();
        let (req, decoded) = member("m1");
        let err = Batches::submit(&ex, &batches, "j".into(), vec![hop(&down)], req, decoded)
            .await
            .unwrap_err();
        let RelayError::NoneAnswered(said) = err else {
            panic!("{err:?}")
        };
        assert!(said.starts_with(RELAY_FAILED), "{said}");
        assert!(said.contains(&down), "{said}");
    }
}

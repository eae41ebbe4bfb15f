//! A peer agent from before CollectHoldings, for the mixed-version tests
//! (issue 30): it serves `warden.v1.Peer` on an address of its own,
//! forwards every call an older agent answers (shards pushed, fetched and
//! listed; straggler exchange and aggregator reports) to a real agent, and
//! answers CollectHoldings UNIMPLEMENTED, as a tonic server without the
//! method does. Or one from after CollectHoldings but before an ask could
//! name several ranks ([`Before::RankSpans`]): it forwards the ask without
//! them and answers for its first rank alone, saying nothing of the others,
//! as such an agent does. Plain TCP: the peers it stands between run with
//! `api.insecure = true` (it cannot present their certificates).

use tokio::net::TcpListener;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status, Streaming};
use warden_proto::v1 as pb;
use warden_proto::v1::peer_client::PeerClient;
use warden_proto::v1::peer_server::{Peer, PeerServer};

/// Which agent the stand-in is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Before {
    /// Before CollectHoldings.
    Collector,
    /// Before an ask named several ranks (`HoldingsAsk.ranks`).
    RankSpans,
}

/// The stand-in; dropped, it stops serving.
pub struct OldPeer {
    /// `ip:port` it serves on.
    pub addr: String,
    /// The CollectHoldings asks for the job's view (group 0) it took,
    /// refused or passed on; a collector's asks for its group not counted.
    job_asks: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for OldPeer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl OldPeer {
    /// Serves on `ip` (a loopback address of its own, a free port),
    /// forwarding to the agent at `backend` (`ip:port`).
    pub async fn start(ip: &str, backend: &str) -> Self {
        Self::from_before(Before::Collector, ip, backend).await
    }

    /// [`OldPeer::start`], as the agent from before `before`.
    pub async fn from_before(before: Before, ip: &str, backend: &str) -> Self {
        let listener = TcpListener::bind(format!("{ip}:0"))
            .await
            .expect("the old peer's listener");
        let addr = listener.local_addr().expect("its address").to_string();
        let channel = Channel::from_shared(format!("http://{backend}"))
            .expect("the backend's endpoint")
            .connect_lazy();
        let job_asks = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let forward = Forward(PeerClient::new(channel), before, job_asks.clone());
        let task = tokio::spawn(async move {
            let _ = Server::builder()
                .add_service(PeerServer::new(forward))
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await;
        });
        Self {
            addr,
            job_asks,
            task,
        }
    }

    /// How many asks for the job's view (CollectHoldings, group 0) it took
    /// so far.
    pub fn job_asks(&self) -> usize {
        self.job_asks.load(std::sync::atomic::Ordering::SeqCst)
    }
}

struct Forward(
    PeerClient<Channel>,
    Before,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
);

impl Forward {
    fn client(&self) -> PeerClient<Channel> {
        self.0.clone()
    }
}

#[tonic::async_trait]
impl Peer for Forward {
    async fn exchange_straggler_summaries(
        &self,
        r: Request<pb::StragglerSummaries>,
    ) -> Result<Response<pb::StragglerSummaries>, Status> {
        self.client()
            .exchange_straggler_summaries(r.into_inner())
            .await
    }

    async fn report_to_aggregator(
        &self,
        r: Request<pb::AggregateReport>,
    ) -> Result<Response<pb::AggregateAnswer>, Status> {
        self.client().report_to_aggregator(r.into_inner()).await
    }

    async fn report_batch_to_aggregator(
        &self,
        r: Request<pb::AggregateBatch>,
    ) -> Result<Response<pb::AggregateBatchAnswer>, Status> {
        self.client()
            .report_batch_to_aggregator(r.into_inner())
            .await
    }

    async fn push_shard(
        &self,
        r: Request<Streaming<pb::ShardChunk>>,
    ) -> Result<Response<pb::PushShardResponse>, Status> {
        // A stream that fails ends the forwarded one early: the agent
        // refuses the incomplete replica, as it would the sender's reset.
        let chunks = r.into_inner().map_while(Result::ok);
        self.client().push_shard(chunks).await
    }

    type FetchShardStream = Streaming<pb::ShardChunk>;

    async fn fetch_shard(
        &self,
        r: Request<pb::FetchShardRequest>,
    ) -> Result<Response<Self::FetchShardStream>, Status> {
        self.client().fetch_shard(r.into_inner()).await
    }

    async fn list_shards(
        &self,
        r: Request<pb::ListShardsRequest>,
    ) -> Result<Response<pb::ListShardsResponse>, Status> {
        self.client().list_shards(r.into_inner()).await
    }

    async fn collect_holdings(
        &self,
        r: Request<pb::HoldingsAsk>,
    ) -> Result<Response<pb::Holdings>, Status> {
        if r.get_ref().group == 0 {
            self.2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        if self.1 == Before::Collector {
            return Err(Status::unimplemented(
                "Method not found: warden.v1.Peer/CollectHoldings",
            ));
        }
        // It reads `rank` alone (field 6 unknown to it), and answers that
        // rank's holders, with no `answered` (field 4).
        let mut ask = r.into_inner();
        ask.ranks.clear();
        let (job, rank) = (ask.group == 0, ask.rank);
        let mut h = self.client().collect_holdings(ask).await?.into_inner();
        h.answered.clear();
        if job {
            for s in &mut h.steps {
                s.ranks.retain(|x| x.rank == rank);
            }
        }
        Ok(Response::new(h))
    }
}

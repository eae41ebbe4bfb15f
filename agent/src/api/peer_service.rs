//! The `warden.v1.Peer` service as served: summaries from older agents
//! (`api::stragglers`), the aggregator's report (`api::aggregate`) and the
//! shards' moves between agents (`api::ckpt`), each call handed to the
//! module of its stage. PushShard and FetchShard go through
//! [`crate::peer_link::ckpt::wire`]'s framing (the shard's bytes never copied between
//! the socket's buffers and the file); every other call through tonic's
//! generated server.
//!
//! Why a module of its own: the service names every stage it serves, and
//! no stage names another through it (the checkpoint calls and the
//! straggler exchange had imported each other through the service's home).

use std::sync::Arc;

use tonic::{Request, Response, Status};
use warden_proto::v1 as pb;
use warden_proto::v1::peer_server::Peer;

pub(super) mod authorized;

use authorized::Authorized;

use super::observe::observed;
use super::peer_auth::Caller;
use crate::peer_link::{channel, ckpt::wire};
use crate::state::AgentState;
use crate::tls::accept::PeerInfo;

/// `warden.v1.Peer`: takes a peer's summaries, answers with ours.
#[derive(Debug, Clone)]
pub struct PeerService {
    state: Arc<AgentState>,
}

impl PeerService {
    /// A service answering from `state`'s straggler detector.
    pub fn new(state: Arc<AgentState>) -> Self {
        Self { state }
    }
}

/// Every Peer call's frame, written once: records it ([`observed`]: its
/// count by status and its duration, under `call`), then [`frame`]s it.
async fn serve<T: NamesJob, R, Fut>(
    state: &AgentState,
    call: &'static str,
    req: Request<T>,
    body: impl FnOnce(Caller, Option<std::net::SocketAddr>, Authorized<T>) -> Fut,
) -> Result<Response<R>, Status>
where
    Fut: std::future::Future<Output = Result<R, Status>>,
{
    observed(call, frame(state, req, body)).await
}

/// What a Peer request names as its job, checked as its stage checks it
/// (INVALID_ARGUMENT naming the field, before any rule, as the stage would
/// answer); `Ok("")`: none to authorize for (its stage checks what it
/// names). A trait of the message's type, so that the frame authorizes
/// each call for the job its own message names, and an [`Authorized`]
/// request is one whose own job was checked.
trait NamesJob {
    fn job(&self) -> Result<&str, Status>;
}

impl NamesJob for pb::FetchShardRequest {
    fn job(&self) -> Result<&str, Status> {
        super::ckpt::fetch_job(self)
    }
}

impl NamesJob for pb::ListShardsRequest {
    fn job(&self) -> Result<&str, Status> {
        super::ckpt::list_job(self)
    }
}

impl NamesJob for pb::HoldingsAsk {
    fn job(&self) -> Result<&str, Status> {
        super::ckpt::collect_job(self)
    }
}

/// Messages that name no one job in themselves: a summary's or a report's
/// hosts and jobs, and a pushed replica's (in its first chunk), are checked
/// by their stages.
macro_rules! names_no_job {
    ($($t:ty),* $(,)?) => {
        $(impl NamesJob for $t {
            fn job(&self) -> Result<&str, Status> {
                Ok("")
            }
        })*
    };
}

names_no_job!(
    pb::StragglerSummaries,
    pb::AggregateReport,
    pb::AggregateBatch,
    tonic::Streaming<pb::ShardChunk>,
);

impl<B> NamesJob for wire::Reader<B> {
    fn job(&self) -> Result<&str, Status> {
        Ok("")
    }
}

/// A call's frame, unrecorded: names its caller from the connection
/// ([`Caller::of`]: a proved peer, an unauthenticated one, or the local
/// socket) and its remote address, authorizes the caller for the job the
/// request names ([`member`]), then runs `body` with them and the request.
/// What a call asks beyond one job (a pushed replica's job and origin, in
/// its first chunk; a summary's or a relayed report's hosts and jobs) its
/// stage checks; a handler only names the stage.
async fn frame<T: NamesJob, R, Fut>(
    state: &AgentState,
    req: Request<T>,
    body: impl FnOnce(Caller, Option<std::net::SocketAddr>, Authorized<T>) -> Fut,
) -> Result<Response<R>, Status>
where
    Fut: std::future::Future<Output = Result<R, Status>>,
{
    let info = req.extensions().get::<PeerInfo>();
    let (caller, remote) = (Caller::of(info), info.and_then(|i| i.remote));
    let req = req.into_inner();
    member(state, &caller, &req)?;
    body(caller, remote, Authorized::new(req))
        .await
        .map(Response::new)
}

/// Rule `job-member` for the job `req` names: a proved peer reads a job's
/// shards only as one of the job's peers here. In the order the stages
/// answered in before the frame held the rule: with no tier, the stage's
/// UNAVAILABLE; a job or step that cannot be, INVALID_ARGUMENT; then the
/// rule.
fn member<T: NamesJob>(state: &AgentState, caller: &Caller, req: &T) -> Result<(), Status> {
    let Ok(ck) = state.checkpoints.as_ref() else {
        // A request that names a job is about the tier, which is not
        // here: refused as its stage would, so that no [`Authorized`]
        // request for a job exists without the rule having run.
        return match req.job() {
            Ok("") => Ok(()),
            _ => super::ckpt::tier(state).map(|_| ()),
        };
    };
    let job = req.job()?;
    if job.is_empty() {
        return Ok(());
    }
    super::peer_auth::job_member(caller, job, |n| ck.peers.is_member_name(job, n))
}

impl PeerService {
    /// PushShard, whichever framing carried it (tonic's stream or
    /// [`wire`]'s): its job is in its first chunk, so the stage checks
    /// the caller's membership there.
    async fn push(
        &self,
        req: Request<impl wire::ChunkSource + NamesJob + Send>,
    ) -> Result<Response<pb::PushShardResponse>, Status> {
        serve(
            &self.state,
            "PushShard",
            req,
            |caller, _, body| async move {
                super::ckpt::push_shard(&self.state, &caller, body.into_inner()).await
            },
        )
        .await
    }

    /// FetchShard, whichever framing carried it, unrecorded (each entry
    /// records it under "FetchShard", the hand-framed one with its
    /// request's decoding).
    async fn fetch(
        &self,
        req: Request<pb::FetchShardRequest>,
    ) -> Result<Response<ChunkStream>, Status> {
        frame(&self.state, req, |_, _, r| async move {
            super::ckpt::fetch_shard(&self.state, r).await
        })
        .await
    }
}

/// A shard's chunks as FetchShard streams them.
type ChunkStream = tokio_stream::wrappers::ReceiverStream<Result<pb::ShardChunk, Status>>;

#[tonic::async_trait]
impl Peer for PeerService {
    async fn exchange_straggler_summaries(
        &self,
        req: Request<pb::StragglerSummaries>,
    ) -> Result<Response<pb::StragglerSummaries>, Status> {
        serve(
            &self.state,
            "ExchangeStragglerSummaries",
            req,
            |caller, _, r| async move {
                super::stragglers::exchange(&self.state, &caller, r.into_inner())
            },
        )
        .await
    }

    async fn report_to_aggregator(
        &self,
        req: Request<pb::AggregateReport>,
    ) -> Result<Response<pb::AggregateAnswer>, Status> {
        serve(
            &self.state,
            "ReportToAggregator",
            req,
            |caller, remote, r| async move {
                super::aggregate::report_to_aggregator(&self.state, &caller, remote, r.into_inner())
                    .await
            },
        )
        .await
    }

    async fn report_batch_to_aggregator(
        &self,
        req: Request<pb::AggregateBatch>,
    ) -> Result<Response<pb::AggregateBatchAnswer>, Status> {
        serve(
            &self.state,
            "ReportBatchToAggregator",
            req,
            |caller, remote, r| async move {
                super::aggregate::report_batch_to_aggregator(
                    &self.state,
                    &caller,
                    remote,
                    r.into_inner(),
                )
                .await
            },
        )
        .await
    }

    async fn push_shard(
        &self,
        req: Request<tonic::Streaming<pb::ShardChunk>>,
    ) -> Result<Response<pb::PushShardResponse>, Status> {
        self.push(req).await
    }

    type FetchShardStream = ChunkStream;

    async fn fetch_shard(
        &self,
        req: Request<pb::FetchShardRequest>,
    ) -> Result<Response<Self::FetchShardStream>, Status> {
        observed("FetchShard", self.fetch(req)).await
    }

    async fn list_shards(
        &self,
        req: Request<pb::ListShardsRequest>,
    ) -> Result<Response<pb::ListShardsResponse>, Status> {
        serve(&self.state, "ListShards", req, |caller, _, r| async move {
            super::ckpt::list_shards(&self.state, &caller, r).await
        })
        .await
    }

    async fn collect_holdings(
        &self,
        req: Request<pb::HoldingsAsk>,
    ) -> Result<Response<pb::Holdings>, Status> {
        serve(
            &self.state,
            "CollectHoldings",
            req,
            |caller, _, r| async move {
                super::ckpt::collect_holdings(&self.state, &caller, r).await
            },
        )
        .await
    }
}

/// `warden.v1.Peer` as served: PushShard and FetchShard framed by
/// [`crate::peer_link::ckpt::wire`] (the shard's bytes never copied between the
/// socket's buffers and the file), every other call by tonic's generated
/// server. Same methods, same messages on the wire.
#[derive(Debug, Clone)]
pub struct PeerRoutes {
    grpc: pb::peer_server::PeerServer<PeerService>,
    service: PeerService,
}

impl PeerRoutes {
    /// The service for `state`.
    pub fn new(state: Arc<AgentState>) -> Self {
        Self {
            grpc: pb::peer_server::PeerServer::new(PeerService::new(state.clone()))
                .max_decoding_message_size(channel::MAX_MESSAGE)
                .max_encoding_message_size(channel::MAX_MESSAGE),
            service: PeerService::new(state),
        }
    }
}

impl tonic::server::NamedService for PeerRoutes {
    const NAME: &'static str = "warden.v1.Peer";
}

type HttpResponse = http::Response<tonic::body::Body>;

impl tower::Service<http::Request<tonic::body::Body>> for PeerRoutes {
    type Response = HttpResponse;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<HttpResponse, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let service = self.service.clone();
        // On the Unix socket the Peer service is for admins only: it moves
        // any job's shards, and a local rank saves and restores its own
        // through the Agent calls.
        if let Some(peer) = req.extensions().get::<super::caller::LocalPeer>()
            && !service.state.authz.is_admin(peer)
        {
            let call = req.uri().path().rsplit('/').next().unwrap_or("").to_owned();
            let refusal = Status::permission_denied(format!(
                "{call} refused for {peer}: the warden.v1.Peer service on the Unix socket is for admins only (rule: {})",
                crate::access::authz::Rule::Admin.describe()
            ));
            return Box::pin(async move { Ok(refusal.into_http()) });
        }
        // PushShard and FetchShard framed by [`wire`], then served by the
        // same methods (and frame) as tonic's.
        match req.uri().path() {
            wire::PUSH_PATH => Box::pin(async move {
                let req = req.map(|body| wire::Reader::new(body, channel::MAX_MESSAGE));
                let r = service
                    .push(Request::from_http(req))
                    .await
                    .and_then(|a| wire::WireAnswer::ok(a.get_ref()));
                Ok(match r {
                    Ok(a) => wire::response(tonic::body::Body::new(a)),
                    Err(s) => s.into_http(),
                })
            }),
            wire::FETCH_PATH => Box::pin(async move {
                let r = observed("FetchShard", async {
                    let (parts, body) = req.into_parts();
                    let mut body = wire::Reader::new(body, channel::MAX_MESSAGE);
                    let ask = body
                        .decode::<pb::FetchShardRequest>()
                        .await?
                        .ok_or_else(|| Status::invalid_argument("FetchShard: no request"))?;
                    service
                        .fetch(Request::from_http(http::Request::from_parts(parts, ask)))
                        .await
                })
                .await;
                Ok(match r {
                    Ok(chunks) => wire::response(tonic::body::Body::new(wire::ChunkBody::new(
                        chunks.into_inner(),
                        wire::Ending::Trailers,
                    ))),
                    Err(s) => s.into_http(),
                })
            }),
            _ => {
                let mut grpc = self.grpc.clone();
                Box::pin(async move { grpc.call(req).await })
            }
        }
    }
}

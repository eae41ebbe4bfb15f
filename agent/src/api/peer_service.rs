//! The `warden.v1.Peer` service as served: summaries from older agents
//! (`api::stragglers`), the aggregator's report (`api::aggregate`) and the
//! shards' moves between agents (`api::ckpt`), each call handed to the
//! module of its stage. PushShard and FetchShard go through
//! [`crate::ckpt::wire`]'s framing (the shard's bytes never copied between
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

use super::observe::observed;
use super::peer_auth::Caller;
use crate::ckpt::{peers, wire};
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
/// count by status and its duration, under `call`), names its caller from
/// the connection ([`Caller::of`]: a proved peer, an unauthenticated one,
/// or the local socket) and its remote address, then runs `body` with them
/// and the request. Each stage's module authorizes the caller against what
/// the request asks (a host speaks only for itself, a job's member only
/// for its job); a handler only names the stage.
async fn serve<T, R, Fut>(
    call: &'static str,
    req: Request<T>,
    body: impl FnOnce(Caller, Option<std::net::SocketAddr>, T) -> Fut,
) -> Result<Response<R>, Status>
where
    Fut: std::future::Future<Output = Result<R, Status>>,
{
    observed(call, async move {
        let info = req.extensions().get::<PeerInfo>();
        let (caller, remote) = (Caller::of(info), info.and_then(|i| i.remote));
        body(caller, remote, req.into_inner())
            .await
            .map(Response::new)
    })
    .await
}

#[tonic::async_trait]
impl Peer for PeerService {
    async fn exchange_straggler_summaries(
        &self,
        req: Request<pb::StragglerSummaries>,
    ) -> Result<Response<pb::StragglerSummaries>, Status> {
        // The legacy exchange reads the whole request (its peer's
        // certificate and address) itself.
        observed("ExchangeStragglerSummaries", async {
            super::stragglers::exchange(&self.state, req)
        })
        .await
    }

    async fn report_to_aggregator(
        &self,
        req: Request<pb::AggregateReport>,
    ) -> Result<Response<pb::AggregateAnswer>, Status> {
        serve("ReportToAggregator", req, |caller, remote, r| async move {
            super::aggregate::report_to_aggregator(&self.state, &caller, remote, r).await
        })
        .await
    }

    async fn report_batch_to_aggregator(
        &self,
        req: Request<pb::AggregateBatch>,
    ) -> Result<Response<pb::AggregateBatchAnswer>, Status> {
        serve(
            "ReportBatchToAggregator",
            req,
            |caller, remote, r| async move {
                super::aggregate::report_batch_to_aggregator(&self.state, &caller, remote, r).await
            },
        )
        .await
    }

    async fn push_shard(
        &self,
        req: Request<tonic::Streaming<pb::ShardChunk>>,
    ) -> Result<Response<pb::PushShardResponse>, Status> {
        serve("PushShard", req, |caller, _, body| async move {
            super::ckpt::push_shard(&self.state, &caller, body).await
        })
        .await
    }

    type FetchShardStream = tokio_stream::wrappers::ReceiverStream<Result<pb::ShardChunk, Status>>;

    async fn fetch_shard(
        &self,
        req: Request<pb::FetchShardRequest>,
    ) -> Result<Response<Self::FetchShardStream>, Status> {
        serve("FetchShard", req, |caller, _, r| async move {
            super::ckpt::fetch_shard(&self.state, &caller, r).await
        })
        .await
    }

    async fn list_shards(
        &self,
        req: Request<pb::ListShardsRequest>,
    ) -> Result<Response<pb::ListShardsResponse>, Status> {
        serve("ListShards", req, |caller, _, r| async move {
            super::ckpt::list_shards(&self.state, &caller, r).await
        })
        .await
    }

    async fn collect_holdings(
        &self,
        req: Request<pb::HoldingsAsk>,
    ) -> Result<Response<pb::Holdings>, Status> {
        serve("CollectHoldings", req, |caller, _, r| async move {
            super::ckpt::collect_holdings(&self.state, &caller, r).await
        })
        .await
    }
}

/// `warden.v1.Peer` as served: PushShard and FetchShard framed by
/// [`crate::ckpt::wire`] (the shard's bytes never copied between the
/// socket's buffers and the file), every other call by tonic's generated
/// server. Same methods, same messages on the wire.
#[derive(Debug, Clone)]
pub struct PeerRoutes {
    grpc: pb::peer_server::PeerServer<PeerService>,
    state: Arc<AgentState>,
}

impl PeerRoutes {
    /// The service for `state`.
    pub fn new(state: Arc<AgentState>) -> Self {
        Self {
            grpc: pb::peer_server::PeerServer::new(PeerService::new(state.clone()))
                .max_decoding_message_size(peers::MAX_MESSAGE)
                .max_encoding_message_size(peers::MAX_MESSAGE),
            state,
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
        let state = self.state.clone();
        // On the Unix socket the Peer service is for admins only: it moves
        // any job's shards, and a local rank saves and restores its own
        // through the Agent calls.
        if let Some(peer) = req.extensions().get::<super::caller::LocalPeer>()
            && !state.authz.is_admin(peer)
        {
            let call = req.uri().path().rsplit('/').next().unwrap_or("").to_owned();
            let refusal = Status::permission_denied(format!(
                "{call} refused for {peer}: the warden.v1.Peer service on the Unix socket is for admins only (rule: {})",
                crate::access::authz::Rule::Admin.describe()
            ));
            return Box::pin(async move { Ok(refusal.into_http()) });
        }
        let caller = Caller::of(req.extensions().get::<crate::tls::accept::PeerInfo>());
        match req.uri().path() {
            wire::PUSH_PATH => Box::pin(async move {
                let body = wire::Reader::new(req.into_body(), peers::MAX_MESSAGE);
                let r = super::observe::observed(
                    "PushShard",
                    super::ckpt::push_shard(&state, &caller, body),
                )
                .await
                .and_then(|a| wire::WireAnswer::ok(&a));
                Ok(match r {
                    Ok(a) => wire::response(tonic::body::Body::new(a)),
                    Err(s) => s.into_http(),
                })
            }),
            wire::FETCH_PATH => Box::pin(async move {
                let r = super::observe::observed("FetchShard", async {
                    let mut body = wire::Reader::new(req.into_body(), peers::MAX_MESSAGE);
                    let ask = body
                        .decode::<pb::FetchShardRequest>()
                        .await?
                        .ok_or_else(|| Status::invalid_argument("FetchShard: no request"))?;
                    super::ckpt::fetch_shard(&state, &caller, ask).await
                })
                .await;
                Ok(match r {
                    Ok(chunks) => wire::response(tonic::body::Body::new(wire::ChunkBody::new(
                        chunks,
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

//! The checkpoint calls at the edge: BeginShard, CommitShard, Restore and
//! ListCheckpoints on warden.v1.Agent; PushShard, FetchShard, ListShards
//! and CollectHoldings on warden.v1.Peer.
//!
//! In: requests, checked here (the error names the field); a Peer call's
//! caller is authorized for the job it names by the Peer service's frame
//! ([`super::peer_service`]: FetchShard, ListShards and CollectHoldings
//! take its [`Authorized`] request, which nothing else can make), a
//! push's for the job and origin in its first chunk here.
//! Out: calls on [`crate::ckpt`] (the commits in [`crate::ckpt::commit`],
//! the restore in [`crate::ckpt::restore`]), its errors turned into gRPC
//! statuses: a bad name is
//! INVALID_ARGUMENT, a full tier RESOURCE_EXHAUSTED, a step nobody holds
//! NOT_FOUND, a copy that fails its checksum DATA_LOSS.

use std::sync::Arc;
use std::time::Instant;

use tonic::Status;
use warden_proto::v1 as pb;

use super::peer_auth::{self, Caller};
use super::peer_service::authorized::Authorized;
use crate::ckpt::commit::{self, CommitError};
use crate::ckpt::layout::{ShardKey, check_job_id, check_step};
use crate::ckpt::peer_pages::PageError;
use crate::ckpt::peerset::PeerSpec;
use crate::ckpt::restore::{self, RestoreError};
use crate::ckpt::tier::{Owner, TierError};
use crate::ckpt::{Checkpoints, IncomingError};
use crate::peer_link::channel;
use crate::peer_link::ckpt::wire::{self, ChunkSource};
use crate::state::AgentState;

/// The checkpoint tier, or UNAVAILABLE saying why there is none.
pub fn tier(state: &AgentState) -> Result<Arc<Checkpoints>, Status> {
    state
        .checkpoints
        .clone()
        .map_err(|why| Status::unavailable(format!("checkpoint tier on {}: {why}", state.host)))
}

fn status(e: TierError) -> Status {
    match e {
        TierError::BadJobId(_) | TierError::Invalid(_) => Status::invalid_argument(e.to_string()),
        TierError::Full { .. } | TierError::TooManyInFlight { .. } => {
            Status::resource_exhausted(e.to_string())
        }
        TierError::Fs(ref f) if f.is_not_found() => Status::not_found(e.to_string()),
        TierError::Fs(warden_core::fsafe::FsError::Io { .. }) | TierError::Io { .. } => {
            Status::internal(e.to_string())
        }
        // A symlink, another owner, a FIFO...: refused, saying which path.
        TierError::Fs(_) => Status::permission_denied(e.to_string()),
    }
}

/// A job id that can name a directory, else INVALID_ARGUMENT saying why.
fn job(job_id: &str) -> Result<(), Status> {
    check_job_id(job_id).map_err(|e| Status::invalid_argument(e.to_string()))
}

fn key(job_id: &str, step: u64, rank: u32) -> Result<ShardKey, Status> {
    job(job_id)?;
    check_step(step).map_err(|e| Status::invalid_argument(e.to_string()))?;
    Ok(ShardKey {
        job_id: job_id.to_owned(),
        step,
        rank,
    })
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, TierError> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("checkpoint task: {e}")))?
        .map_err(status)
}

/// The caller's compilation cache folder in the tier (ClaimJob), or why
/// there is none ([`crate::ckpt::user_cache`]).
pub async fn user_cache(
    state: &Arc<AgentState>,
    peer: &super::caller::LocalPeer,
) -> Result<String, String> {
    let ck = tier(state).map_err(|s| s.message().to_owned())?;
    let owner = Owner {
        uid: peer.uid,
        gid: peer.gid,
    };
    crate::ckpt::user_cache::dir(&ck, owner)
        .await
        .map(|p| p.display().to_string())
        .map_err(|e| e.to_string())
}

/// BeginShard: room made, staging file created by the agent and handed to
/// `owner`, the calling rank (its socket's peer credentials).
pub async fn begin_shard(
    state: &Arc<AgentState>,
    req: pb::BeginShardRequest,
    owner: Option<Owner>,
) -> Result<pb::BeginShardResponse, Status> {
    let ck = tier(state)?;
    let k = key(&req.job_id, req.step, req.rank)?;
    let max_world = state.config.ranks.max_world_size;
    if req.rank >= max_world {
        return Err(Status::invalid_argument(format!(
            "rank {} is not below ranks.max_world_size {max_world}",
            req.rank
        )));
    }
    let size = req.size_bytes;
    let (path, token) = blocking(move || ck.tier.begin(&k, size, owner)).await?;
    Ok(pb::BeginShardResponse {
        staging_path: path.display().to_string(),
        token,
    })
}

/// CommitShard: the staged file renamed into place, hashed, synced and its
/// manifest written durably before the answer: "committed" means the shard
/// survives the agent's death (and, on disk, a power cut). Replication and
/// upload follow off the rank's time.
pub async fn commit_shard(
    state: &Arc<AgentState>,
    req: pb::CommitShardRequest,
) -> Result<pb::CommitShardResponse, Status> {
    let ck = tier(state)?;
    let k = key(&req.job_id, req.step, req.rank)?;
    if req.world_size == 0 || req.rank >= req.world_size {
        return Err(Status::invalid_argument(format!(
            "world_size {} must be above rank {}",
            req.world_size, req.rank
        )));
    }
    let max_world = state.config.ranks.max_world_size;
    if req.world_size > max_world {
        return Err(Status::invalid_argument(format!(
            "world_size {} is above ranks.max_world_size {max_world}",
            req.world_size
        )));
    }
    let stall_ms = req.stall_ns as f64 / 1e6;
    let path = commit::own_shard(
        ck,
        state.events.clone(),
        k,
        req.token,
        req.size_bytes,
        req.world_size,
        stall_ms,
    )
    .await
    .map_err(|e| match e {
        CommitError::Tier(e) => status(e),
        CommitError::Task(_) => Status::internal(e.to_string()),
    })?;
    Ok(pb::CommitShardResponse {
        path: path.display().to_string(),
    })
}

/// The ranks of `job` registered on this host (at most one past what one
/// collector ask names: more, and each restore asks for its own rank).
/// They restore at once at a restart, and share one gather.
fn registered_ranks(state: &AgentState, job: &str) -> Vec<u32> {
    let key = |rank| warden_core::rank::RankKey {
        job: job.to_owned(),
        rank,
    };
    let reg = state.ranks.lock();
    reg.ranks
        .range(key(0)..=key(u32::MAX))
        .map(|(k, _)| k.rank)
        .take(crate::ckpt::holdings::MAX_VIEW_RANKS + 1)
        .collect()
}

/// Restore: the nearest valid copy of the rank's shard, in the local tier,
/// handed to `owner` (the calling rank) so that it can open the path.
pub async fn restore(
    state: &Arc<AgentState>,
    req: pb::RestoreRequest,
    owner: Option<Owner>,
) -> Result<pb::RestoreResponse, Status> {
    let ck = tier(state)?;
    job(&req.job_id)?;
    check_step(req.step).map_err(|e| Status::invalid_argument(e.to_string()))?;
    let max_world = state.config.ranks.max_world_size;
    if req.rank >= max_world {
        return Err(Status::invalid_argument(format!(
            "rank {} is not below ranks.max_world_size {max_world}",
            req.rank
        )));
    }
    let started = Instant::now();
    let beside = registered_ranks(state, &req.job_id);
    let rank = (req.rank, beside.as_slice());
    match restore::for_rank(&state.events, &ck, &req.job_id, rank, req.step, owner).await {
        Ok(None) => Ok(pb::RestoreResponse::default()),
        Ok(Some(r)) => Ok(pb::RestoreResponse {
            found: true,
            step: r.step,
            path: r.path.display().to_string(),
            size_bytes: r.manifest.size_bytes,
            xxh3: r.manifest.hash().unwrap_or(0),
            tier: r.holder.tier().to_owned(),
            source: r.source,
            skipped: r.skipped,
            duration: prost_types::Duration::try_from(started.elapsed()).ok(),
        }),
        Err(e @ RestoreError::NoSuchStep { .. }) => Err(Status::not_found(e.to_string())),
        Err(e @ RestoreError::NoValidCopy { .. }) => Err(Status::data_loss(e.to_string())),
        // ABORTED, not UNAVAILABLE: the agent answered, after asking the
        // holders twice itself (3x `peer_timeout` the second time); the
        // client reconnects and calls again on UNAVAILABLE (the agent
        // restarted), which would double the wait for the same answer.
        // gRPC's own guide: ABORTED is "retry at a higher level", here a
        // restart of the job (rule `exception.ckpt_holders_unreachable`).
        Err(e @ RestoreError::Unreachable { .. }) => Err(Status::aborted(e.to_string())),
        Err(RestoreError::HandOver(e)) => Err(status(e)),
        Err(e @ RestoreError::Task(_)) => Err(Status::internal(e.to_string())),
    }
}

/// ListCheckpoints: steps and where each shard's copies are.
pub async fn list_checkpoints(
    state: &Arc<AgentState>,
    req: pb::ListCheckpointsRequest,
) -> Result<pb::ListCheckpointsResponse, Status> {
    use crate::ckpt::listing::{Detail, MAX_SCOPE_RANKS, Scope};
    let ck = tier(state)?;
    if !req.job_id.is_empty() {
        job(&req.job_id)?;
    }
    if req.ranks.len() > MAX_SCOPE_RANKS {
        return Err(Status::invalid_argument(format!(
            "ListCheckpoints: {} ranks asked for, at most {MAX_SCOPE_RANKS}",
            req.ranks.len()
        )));
    }
    // An unknown detail (a newer client's) is taken as the default, which
    // is bounded; never as every shard.
    let detail = match pb::ListDetail::try_from(req.detail) {
        Ok(pb::ListDetail::Summary) => Detail::Summary,
        Ok(pb::ListDetail::All) => Detail::All,
        Ok(pb::ListDetail::Unspecified) | Err(_) => Detail::Default,
    };
    let scope = Scope {
        detail,
        ranks: (!req.ranks.is_empty()).then(|| req.ranks.into_iter().collect()),
    };
    Ok(super::convert::checkpoints(
        crate::ckpt::listing::of_job(&ck, &req.job_id, &scope).await,
    ))
}

/// SetCheckpointPeers: a launcher's view of the job's other agents, one
/// page at a time ([`crate::ckpt::job_peers`]).
pub async fn set_checkpoint_peers(
    state: &Arc<AgentState>,
    req: pb::SetCheckpointPeersRequest,
) -> Result<pb::SetCheckpointPeersResponse, Status> {
    use crate::ckpt::job_peers::{self, Budgets, PeersPage, SetPeers, SetPeersError};
    let ck = tier(state)?;
    job(&req.job_id)?;
    let page = PeersPage {
        job: req.job_id,
        list_id: req.list_id,
        page: req.page,
        pages: req.pages,
        peers: req
            .peers
            .into_iter()
            .map(|p| PeerSpec {
                addr: p.addr,
                domain: p.domain,
                host: p.host,
                identity: p.identity,
                place: usize::try_from(p.place).unwrap_or(usize::MAX),
            })
            .collect(),
        self_place: req.self_place,
        self_addr: req.self_addr,
        job_hosts: req.job_hosts,
        ring_by_place: req.ring_by_place,
        replicas: req.replicas,
    };
    let budgets = Budgets {
        api: &state.config.api,
        straggler: &state.config.straggler,
        strangers: state.stranger_connections(),
    };
    match job_peers::set(&ck, budgets, page) {
        Ok(SetPeers::More) => Ok(pb::SetCheckpointPeersResponse::default()),
        Ok(SetPeers::Set { targets, warning }) => Ok(pb::SetCheckpointPeersResponse {
            targets,
            warning: warning.unwrap_or_default(),
        }),
        Err(e) => {
            let message = format!("SetCheckpointPeers: {e}");
            Err(match e {
                SetPeersError::Page(PageError::Full { .. }) => Status::resource_exhausted(message),
                SetPeersError::Page(PageError::OutOfOrder { .. }) => {
                    Status::failed_precondition(message)
                }
                SetPeersError::Page(PageError::TooManyPages(_) | PageError::Beyond { .. })
                | SetPeersError::PlacePastList { .. }
                | SetPeersError::TooManyHosts { .. }
                | SetPeersError::PlacePastOrder { .. }
                | SetPeersError::PeerSet(_) => Status::invalid_argument(message),
            })
        }
    }
}

/// PushShard: a peer's replica, checked before it is committed.
pub async fn push_shard(
    state: &Arc<AgentState>,
    caller: &Caller,
    mut stream: impl ChunkSource + Send,
) -> Result<pb::PushShardResponse, Status> {
    let ck = tier(state)?;
    let first = stream
        .next_chunk()
        .await?
        .ok_or_else(|| Status::invalid_argument("PushShard: empty stream"))?;
    let info = first
        .info
        .ok_or_else(|| Status::invalid_argument("PushShard: the first chunk has no info"))?;
    let m = wire::manifest_of(&info).map_err(Status::invalid_argument)?;
    let k = m.key();
    // Checked on the first chunk, before anything touches the tier.
    peer_auth::job_member(caller, &k.job_id, |n| ck.peers.is_member_name(&k.job_id, n))?;
    crate::ckpt::accept::replica(&ck, caller.identity(), &k.job_id, &m.origin)
        .map_err(|r| Status::permission_denied(r.to_string()))?;
    commit::replica(ck, state.events.clone(), m, first.data, stream)
        .await
        .map_err(|e| match e {
            IncomingError::Tier(e) => status(e),
            IncomingError::Fill(e) if e.starts_with("corrupt") => Status::data_loss(e),
            IncomingError::Fill(e) => Status::aborted(e),
            IncomingError::Task(e) => Status::internal(e),
        })?;
    Ok(pb::PushShardResponse {
        host: state.host.clone(),
        stored: true,
    })
}

/// The job a FetchShard names, its key checked as [`fetch_shard`] checks
/// it (the Peer frame authorizes the caller for it).
pub fn fetch_job(req: &pb::FetchShardRequest) -> Result<&str, Status> {
    key(&req.job_id, req.step, req.rank)?;
    Ok(&req.job_id)
}

/// The job a ListShards names ("": every job, each shard then shown only
/// to a member of its job), checked as [`list_shards`] checks it.
pub fn list_job(req: &pb::ListShardsRequest) -> Result<&str, Status> {
    if !req.job_id.is_empty() {
        job(&req.job_id)?;
    }
    Ok(&req.job_id)
}

/// The job a CollectHoldings names, checked as [`collect_holdings`]
/// checks it.
pub fn collect_job(req: &pb::HoldingsAsk) -> Result<&str, Status> {
    job(&req.job_id)?;
    Ok(&req.job_id)
}

/// FetchShard: a committed shard streamed back, to a caller the Peer
/// frame authorized for its job.
pub async fn fetch_shard(
    state: &Arc<AgentState>,
    req: Authorized<pb::FetchShardRequest>,
) -> Result<tokio_stream::wrappers::ReceiverStream<Result<pb::ShardChunk, Status>>, Status> {
    let req = req.into_inner();
    let ck = tier(state)?;
    let k = key(&req.job_id, req.step, req.rank)?;
    let (ck2, k2) = (ck.clone(), k.clone());
    let host = state.host.clone();
    let (file, m) = blocking(move || ck2.tier.open_data(&k2))
        .await
        .map_err(|s| match s.code() {
            tonic::Code::InvalidArgument | tonic::Code::NotFound => {
                Status::not_found(format!("{k} is not held by {host}"))
            }
            _ => s,
        })?;
    let path = ck.tier.layout().data(&k);
    Ok(channel::chunk_stream(m, file, path, ck.cfg.chunk_bytes, 0))
}

/// ListShards: what this agent holds, to a caller the Peer frame
/// authorized for the job it names (if any).
pub async fn list_shards(
    state: &Arc<AgentState>,
    caller: &Caller,
    req: Authorized<pb::ListShardsRequest>,
) -> Result<pb::ListShardsResponse, Status> {
    // Its job, if any, checked by the frame ([`list_job`]).
    let req = req.into_inner();
    let ck = tier(state)?;
    let ck2 = ck.clone();
    let job = req.job_id.clone();
    let shards = tokio::task::spawn_blocking(move || {
        ck2.tier
            .list(if job.is_empty() { None } else { Some(&job) })
    })
    .await
    .map_err(|e| Status::internal(e.to_string()))?;
    // A listing of everything shows a peer only the jobs it is a member of.
    let shards = shards.iter().filter(|m| match caller.identity() {
        None => true,
        Some(id) => ck.peers.is_member_name(&m.job_id, id),
    });
    Ok(pb::ListShardsResponse {
        host: state.host.clone(),
        shards: shards.map(wire::info).collect(),
    })
}

/// CollectHoldings: a restore's view of a job through the collector
/// ([`crate::ckpt::collect`]), asked by one of the job's peers.
pub async fn collect_holdings(
    state: &Arc<AgentState>,
    caller: &Caller,
    req: Authorized<pb::HoldingsAsk>,
) -> Result<pb::Holdings, Status> {
    let req = req.into_inner();
    use crate::ckpt::collect::{self, Collected};
    use crate::peer_link::ckpt::collect_wire;
    // Its job checked by the frame ([`collect_job`]).
    let ck = tier(state)?;
    let ask = collect_wire::ask_from_pb(req)
        .map_err(|e| Status::invalid_argument(format!("CollectHoldings: {e}")))?;
    let peer = caller.identity().unwrap_or_default();
    match collect::answer(&ck, ask, peer).await {
        Ok(Collected::Job(v)) => Ok(collect_wire::view_to_pb(&v)),
        Ok(Collected::Group(h)) => Ok(collect_wire::holdings_to_pb(&h)),
        Err(e @ collect::CollectError::Busy { .. }) => {
            Err(Status::resource_exhausted(format!("CollectHoldings: {e}")))
        }
        // The asker falls back to asking every host, as for an old agent.
        Err(e @ collect::CollectError::OldCollectors(_)) => {
            Err(Status::unimplemented(format!("CollectHoldings: {e}")))
        }
        Err(e) => Err(Status::invalid_argument(format!("CollectHoldings: {e}"))),
    }
}

//! Who may do what on the Unix socket: the rules of docs/security.md.
//!
//! In: the kernel's word on the caller ([`LocalPeer`]) and the call. Out:
//! allowed, or PERMISSION_DENIED naming the rule that refused. Never: trust
//! anything the caller says about itself; never decide on a request that
//! did not come over the Unix socket.
//!
//! Three kinds of caller:
//! - **admins**: root, the agent's own uid (the launcher's embedded agent
//!   runs as its user), and members of `api.admin_group`. They may do
//!   everything, Uncordon included.
//! - **a job's owner**: the uid that first used the job on this agent (its
//!   launcher, or its first rank to register). Ranks save, restore and report
//!   only for jobs their uid owns; a launcher stops, restarts, hands peers to
//!   and closes only its own jobs. The uid is the principal because the
//!   kernel makes it one: a user can already signal, trace and read the
//!   memory of its own processes, so telling two of its jobs apart would
//!   protect nothing.
//! - **everyone who can open the socket** (its mode and group): the read
//!   calls; ClaimJob for a job no other uid owns (refused to admins too
//!   while another uid holds it: a launcher must never run a job whose
//!   decisions another user can make); WatchIncidents about its own jobs
//!   only (the stream a launcher carries out).
//!
//! Owners are persisted in the state directory, so an agent restart does not
//! let a stranger claim a running job (and be handed its checkpoint
//! replicas). A claim lapses when its launcher closes the job, or after
//! [`OWNER_IDLE`] without use. The file (mode 0600) is reached through
//! [`warden_core::fsafe`]: read with `O_NOFOLLOW` relative to the state
//! directory's descriptor, replaced through a random new name renamed over
//! it; a symlink at its name is refused (logged), never read nor written
//! through.
//!
//! Damaged state fails closed: an owners file that exists but cannot be
//! read or does not parse (truncated by a full disk, edited by hand, a
//! symlink) holds claims nobody can read any more, so no claim is
//! trusted and none is made: every call that needs a job's owner is
//! refused for non-admins (FAILED_PRECONDITION, naming the file and what
//! an admin does), the file is never overwritten (it is the evidence), and
//! component `state/job_owners` is DEGRADED with the same words. Admins
//! still act (without claiming). The file is read again, at most once a
//! second, on the next call that needs it: once an admin has repaired it
//! (valid JSON) or removed it (every job is then claimed afresh by its
//! next caller), claims resume without a restart.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tonic::Status;

use super::peer::LocalPeer;
use warden_core::events::health_reporter::Reporter;
use warden_core::fsafe::{self, Dir, FsError};
use warden_core::health::{ComponentReport, Reason, ReasonKind, Status as Health};

/// The component that says whether job claims are open.
pub const COMPONENT: &str = "state/job_owners";
/// The least time between two reads of a damaged owners file.
const RECHECK: Duration = Duration::from_secs(1);

/// Mode of the job owners file.
const OWNERS_MODE: u32 = 0o600;

/// A claim on a job unused for this long is forgotten (at the next claim).
pub const OWNER_IDLE: Duration = Duration::from_secs(7 * 24 * 3600);
/// Jobs one non-admin uid may own at once on this agent: a bound on what a
/// caller can make the agent remember.
pub const MAX_JOBS_PER_UID: usize = 256;
/// The longest job id the agent takes anywhere.
pub const MAX_JOB_ID: usize = 128;
/// Jobs the agent remembers owners of.
pub const MAX_JOBS: usize = 4096;

/// The rule a call falls under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Anyone who can open the socket.
    Read,
    /// Admins only.
    Admin,
    /// The job's owner, or an admin.
    JobOwner,
    /// An admin, or the owner of a job known here (a launcher's
    /// pre-restart health gate); with a job named, its owner or an admin.
    AdminOrAnyOwner,
    /// Anyone who can open the socket, about a job no other uid owns: the
    /// caller becomes its owner. Refused for admins too when another uid
    /// holds the job: a launcher must never run a job whose decisions
    /// another user can make (an admin releases the job first).
    Claim,
    /// Anyone who can open the socket, about the jobs its uid owns: a
    /// job owned by another uid is refused, and a stream carries only the
    /// caller's own jobs (a launcher acts on what it is sent).
    Owned,
}

impl Rule {
    /// How the rule reads in a refusal.
    pub fn describe(self) -> &'static str {
        match self {
            Rule::Read => "any caller that can open the socket",
            Rule::Admin => "admins only: root, the agent's uid, or a member of api.admin_group",
            Rule::JobOwner => {
                "the job's owner (the uid that first used the job on this agent) or an admin"
            }
            Rule::AdminOrAnyOwner => {
                "an admin, or the owner of a job on this agent (a launcher gating its own restart); with a job named, that job's owner or an admin"
            }
            Rule::Claim => "a job no other uid owns on this agent (admins included)",
            Rule::Owned => "the caller's own jobs (the uid that owns them on this agent)",
        }
    }
}

/// What a call needs, by method name: the table docs/security.md prints.
pub fn rule_of(method: &str) -> Rule {
    match method {
        "GetNodeHealth" | "WatchHealth" | "ListEvents" | "WatchEvents" | "GetAgentInfo"
        | "GetRanks" | "GetIncidents" | "GetStragglers" | "ListCheckpoints" | "GetGoodput" => {
            Rule::Read
        }
        "WatchIncidents" => Rule::Owned,
        "ClaimJob" => Rule::Claim,
        "RegisterRank" | "DeregisterRank" | "ReportException" | "Control" | "AckControl"
        | "BeginShard" | "CommitShard" | "Restore" | "StopRanks" | "ReportJobStop"
        | "RequestRestart" | "SetCheckpointPeers" | "CloseGoodput" => Rule::JobOwner,
        "RunHealthGate" => Rule::AdminOrAnyOwner,
        // Uncordon, ReleaseJob, and anything not listed (a new call is admin-only until
        // someone decides otherwise).
        _ => Rule::Admin,
    }
}

/// One job's owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Owner {
    uid: u32,
    /// Unix seconds of the last call that used the claim.
    used: u64,
}

/// The agent's authorization state: who admins are, and who owns each job.
#[derive(Debug)]
pub struct Authz {
    agent_uid: u32,
    admin_gid: Option<u32>,
    owners: Mutex<BTreeMap<String, Owner>>,
    /// The owners file's directory (opened once) and its name there; None:
    /// the directory was refused, owners are held in memory only.
    file: Option<(Dir, String)>,
    /// The owners file (for messages).
    path: PathBuf,
    /// Why the owners file cannot be trusted (damaged, unreadable,
    /// refused), and when it was last read; None: claims are open.
    damaged: Mutex<Option<(String, std::time::Instant)>>,
    /// Whether `damaged` is set, read without its lock by [`Authz::save`]
    /// (called with the owners locked; `damaged` is taken before them).
    closed: std::sync::atomic::AtomicBool,
    /// Where the `state/job_owners` component is reported, once attached.
    health: std::sync::OnceLock<Reporter>,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Authz {
    /// The rules for an agent running as `agent_uid`, with `admin_gid` (from
    /// `api.admin_group`), keeping owners in `path` (loaded now; a file that
    /// does not parse, or is refused as a symlink, is set aside with a
    /// warning: owners are then claimed afresh). `path`'s directory is the
    /// agent's (the state dir: created as needed, a symlink or another
    /// user's refused, and then owners are held in memory only).
    pub fn new(agent_uid: u32, admin_gid: Option<u32>, path: PathBuf) -> Self {
        let file = match fsafe::parent_of(&path, fsafe::STATE_DIR_MODE) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!(error = %e,
                    "job owners' directory refused or unusable; owners are held in memory only");
                None
            }
        };
        let (owners, damaged) = match file.as_ref().map(|(dir, name)| load(dir, name)) {
            None => (BTreeMap::new(), None),
            Some(Ok(o)) => (o, None),
            Some(Err(why)) => {
                tracing::error!(path = %path.display(), error = %why,
                    "job owners file is damaged: job claims are refused until an admin repairs or removes it");
                (BTreeMap::new(), Some((why, std::time::Instant::now())))
            }
        };
        Self {
            agent_uid,
            admin_gid,
            owners: Mutex::new(owners),
            file,
            path,
            closed: std::sync::atomic::AtomicBool::new(damaged.is_some()),
            damaged: Mutex::new(damaged),
            health: std::sync::OnceLock::new(),
        }
    }

    /// Reports component `state/job_owners` through `reporter` from now
    /// on: at once while claims are refused (an agent whose file reads
    /// adds no component), and OK once an admin has repaired it.
    pub fn attach_health(&self, reporter: Reporter) {
        let _ = self.health.set(reporter);
        let damaged = self
            .damaged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some();
        if damaged {
            self.report();
        }
    }

    fn report(&self) {
        let Some(r) = self.health.get() else { return };
        let why = self
            .damaged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|(w, _)| w.clone());
        let mut c = ComponentReport {
            id: COMPONENT.into(),
            kind: "state".into(),
            labels: BTreeMap::from([("path".to_owned(), self.path.display().to_string())]),
            status_override: None,
            reasons: Vec::new(),
        };
        if let Some(why) = why {
            c.reasons.push(Reason {
                status: Health::Degraded,
                kind: ReasonKind::Judged,
                signal: "state.damaged".into(),
                value: String::new(),
                threshold: String::new(),
                window: String::new(),
                since: SystemTime::now(),
                message: self.damage_message(&why),
            });
        }
        r.apply(c);
    }

    /// What a refused caller and `warden health` are told.
    fn damage_message(&self, why: &str) -> String {
        format!(
            "job owners file {} is damaged ({why}): job claims are refused until an admin \
             repairs it (valid JSON, as the agent writes it) or removes it (every job is then \
             claimed afresh by its next caller); the agent reads it again on the next call",
            self.path.display()
        )
    }

    /// Why claims are refused, if they are: reads a damaged file again
    /// (at most once per [`RECHECK`]) and lifts the refusal once it reads
    /// or is gone.
    fn refusal(&self) -> Option<String> {
        let why = {
            let mut d = self.damaged.lock().unwrap_or_else(|p| p.into_inner());
            let (why, at) = d.as_mut()?;
            if at.elapsed() < RECHECK {
                return Some(self.damage_message(why));
            }
            *at = std::time::Instant::now();
            let (dir, name) = self.file.as_ref()?;
            match load(dir, name) {
                Ok(owners) => {
                    *self.lock() = owners;
                    *d = None;
                    self.closed
                        .store(false, std::sync::atomic::Ordering::Release);
                    None
                }
                Err(now) => {
                    *why = now;
                    Some(why.clone())
                }
            }
        };
        match why {
            Some(why) => Some(self.damage_message(&why)),
            None => {
                tracing::info!(path = %self.path.display(),
                    "job owners file repaired or removed by an admin: job claims resume");
                self.report();
                None
            }
        }
    }

    /// Root, the agent's own uid, or a member of the admin group.
    pub fn is_admin(&self, p: &LocalPeer) -> bool {
        p.uid == 0 || p.uid == self.agent_uid || self.admin_gid.is_some_and(|g| p.in_group(g))
    }

    /// The owner of `job`, if claimed.
    pub fn owner(&self, job: &str) -> Option<u32> {
        self.lock().get(job).map(|o| o.uid)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Owner>> {
        self.owners.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks `call` (under [`rule_of`]) for `peer`; `job` is the job the
    /// call is about, for [`Rule::JobOwner`]: claimed for the caller when
    /// nobody owns it yet (an empty job is left to the call to refuse).
    pub fn check(&self, peer: &LocalPeer, call: &str, job: &str) -> Result<(), Status> {
        let rule = rule_of(call);
        let admin = self.is_admin(peer);
        let deny = |why: String| {
            Err(Status::permission_denied(format!(
                "{call} refused for {peer}: {why} (rule: {})",
                rule.describe()
            )))
        };
        if matches!(rule, Rule::JobOwner | Rule::AdminOrAnyOwner | Rule::Claim)
            && let Some(why) = self.refusal()
        {
            if admin {
                tracing::debug!(job, caller = %peer, call, "admin acts while job claims are refused");
                return Ok(());
            }
            return Err(Status::failed_precondition(format!(
                "{call} refused for {peer}: {why}"
            )));
        }
        match rule {
            Rule::Read => Ok(()),
            Rule::Admin if admin => Ok(()),
            Rule::Admin => deny("the caller is not an admin".into()),
            Rule::AdminOrAnyOwner if admin => Ok(()),
            Rule::AdminOrAnyOwner if !job.is_empty() => {
                check_job_id(call, job)?;
                match self.owner(job) {
                    Some(uid) if uid == peer.uid => {
                        self.touch(job);
                        Ok(())
                    }
                    Some(uid) => deny(owned_by(job, uid)),
                    None => deny(format!(
                        "nobody owns job {job:?} on this agent; a gate's verdict is attached only to a job the caller owns"
                    )),
                }
            }
            Rule::AdminOrAnyOwner => {
                if self.lock().values().any(|o| o.uid == peer.uid) {
                    Ok(())
                } else {
                    deny("the caller is not an admin and owns no job here".into())
                }
            }
            Rule::Owned if job.is_empty() => Ok(()),
            Rule::Owned => {
                check_job_id(call, job)?;
                match self.owner(job) {
                    Some(uid) if uid != peer.uid => deny(owned_by(job, uid)),
                    _ => Ok(()),
                }
            }
            Rule::Claim if job.is_empty() => Err(Status::invalid_argument(format!(
                "{call}: job_id is required"
            ))),
            Rule::Claim => {
                check_job_id(call, job)?;
                match self.claim(job, peer.uid, admin) {
                    Ok(()) => Ok(()),
                    Err(Refusal::Owned(uid)) => deny(owned_by(job, uid)),
                    Err(Refusal::TooMany(n)) => Err(too_many(call, peer, n)),
                }
            }
            Rule::JobOwner if job.is_empty() => Ok(()),
            Rule::JobOwner => {
                check_job_id(call, job)?;
                match self.claim(job, peer.uid, admin) {
                    Ok(()) => Ok(()),
                    Err(Refusal::Owned(uid)) if admin => {
                        tracing::debug!(job, owner = uid, caller = %peer, call, "admin acts on a job it does not own");
                        Ok(())
                    }
                    Err(Refusal::Owned(uid)) => deny(owned_by(job, uid)),
                    Err(Refusal::TooMany(n)) => Err(too_many(call, peer, n)),
                }
            }
        }
    }

    /// Whether records of `job` may go to a stream of `uid`'s
    /// ([`Rule::Owned`]): only while `uid` owns the job, so no decision of a
    /// job another user holds reaches a launcher, even one whose claim
    /// lapsed or was released mid-run.
    pub fn owns(&self, uid: u32, job: &str) -> bool {
        self.owner(job) == Some(uid)
    }

    /// Refreshes the claim on `job` (its last use is now).
    fn touch(&self, job: &str) {
        if let Some(o) = self.lock().get_mut(job) {
            o.used = now_unix();
        }
    }

    /// Claims `job` for `uid` when nobody owns it (or refreshes the claim).
    fn claim(&self, job: &str, uid: u32, admin: bool) -> Result<(), Refusal> {
        let now = now_unix();
        let mut owners = self.lock();
        if let Some(o) = owners.get_mut(job) {
            if o.uid != uid {
                return Err(Refusal::Owned(o.uid));
            }
            o.used = now;
            return Ok(());
        }
        let idle = OWNER_IDLE.as_secs();
        owners.retain(|_, o| now.saturating_sub(o.used) < idle);
        let mine = owners.values().filter(|o| o.uid == uid).count();
        if !admin && mine >= MAX_JOBS_PER_UID {
            return Err(Refusal::TooMany(mine));
        }
        if owners.len() >= MAX_JOBS {
            // The least recently used claim of anyone goes first.
            if let Some(oldest) = owners
                .iter()
                .min_by_key(|(_, o)| o.used)
                .map(|(j, _)| j.clone())
            {
                owners.remove(&oldest);
            }
        }
        owners.insert(job.to_owned(), Owner { uid, used: now });
        self.save(&owners);
        Ok(())
    }

    /// Forgets the owner of `job` (its launcher closed it, or an admin
    /// released it); returns the owner it had.
    pub fn release(&self, job: &str) -> Option<u32> {
        let mut owners = self.lock();
        let had = owners.remove(job).map(|o| o.uid);
        if had.is_some() {
            self.save(&owners);
        }
        had
    }

    /// ReleaseJob as a use case: an admin (`by`) forgets `job`'s owner, and
    /// when it had one, the release is logged and published
    /// (`job.released`, Warning: a claim taken away by hand is worth an
    /// operator's look). Returns the owner it had.
    pub fn release_by_admin(
        &self,
        events: &warden_core::events::EventBus,
        job: &str,
        by: &LocalPeer,
    ) -> Option<u32> {
        let had = self.release(job);
        if let Some(owner) = had {
            tracing::warn!(job, owner, by = %by, "job owner released by an admin");
            events.publish(
                warden_core::events::NewEvent::new(
                    warden_core::events::Severity::Warning,
                    "job.released",
                    format!("job/{job}"),
                    format!("the claim of uid {owner} on job {job} was released by {by}"),
                )
                .with("job", job)
                .with("owner", owner.to_string())
                .with("by", by.to_string()),
            );
        }
        had
    }

    /// Writes the owners; a failure is logged: claims then hold until the
    /// agent restarts.
    fn save(&self, owners: &BTreeMap<String, Owner>) {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            // The damaged file is the evidence: never written over.
            return;
        }
        if let Err(e) = self.write_owners(owners) {
            tracing::warn!(error = %e,
                "cannot persist job owners; claims hold until the agent restarts");
        }
    }

    /// Replaces the owners file (mode 0600) with `owners`: a new file under
    /// a random name, synced, renamed over it ([`Dir::replace`]); a symlink
    /// at its name is refused.
    fn write_owners(&self, owners: &BTreeMap<String, Owner>) -> Result<(), FsError> {
        let Some((dir, name)) = &self.file else {
            return Err(FsError::Io {
                what: "writing",
                path: self.path.display().to_string(),
                source: std::io::Error::other("its directory was refused or unusable"),
            });
        };
        let body = serde_json::to_vec(owners).map_err(|e| FsError::Io {
            what: "encoding",
            path: self.path.display().to_string(),
            source: std::io::Error::other(e),
        })?;
        dir.replace(name, &body, OWNERS_MODE)
    }
}

/// A job id the rules take: at most [`MAX_JOB_ID`] bytes, no control
/// characters.
fn check_job_id(call: &str, job: &str) -> Result<(), Status> {
    if job.len() > MAX_JOB_ID || job.chars().any(char::is_control) {
        return Err(Status::invalid_argument(format!(
            "{call}: job_id must be at most {MAX_JOB_ID} bytes without control characters"
        )));
    }
    Ok(())
}

/// The refusal's words for a job another uid owns, with the way out.
fn owned_by(job: &str, uid: u32) -> String {
    let name = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
        .map(|u| format!(" ({})", u.name))
        .unwrap_or_default();
    format!(
        "job {job:?} on this agent belongs to uid {uid}{name}; pick another job id (--rdzv-id), or an admin can release it with `warden release-job {job}`"
    )
}

fn too_many(call: &str, peer: &LocalPeer, n: usize) -> Status {
    Status::resource_exhausted(format!(
        "{call} refused for {peer}: it already owns {n} jobs on this agent, the most one uid may (jobs are released when their launcher closes them)"
    ))
}

/// The owners in `dir/name`: none when the file does not exist; an error
/// saying why when it exists but cannot be trusted.
fn load(dir: &Dir, name: &str) -> Result<BTreeMap<String, Owner>, String> {
    match dir.read(name) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map_err(|e| format!("{} bytes that do not parse: {e}", bytes.len())),
        Err(e) if e.is_not_found() => Ok(BTreeMap::new()),
        Err(e) => Err(e.to_string()),
    }
}

/// Why a claim was refused.
#[derive(Debug)]
enum Refusal {
    /// Another uid owns the job.
    Owned(u32),
    /// The uid owns too many jobs already.
    TooMany(usize),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(uid: u32, gid: u32, groups: &[u32]) -> LocalPeer {
        LocalPeer {
            uid,
            gid,
            pid: Some(4242),
            groups: groups.to_vec(),
        }
    }

    fn authz(dir: &tempfile::TempDir) -> Authz {
        Authz::new(990, Some(77), dir.path().join("owners.json"))
    }

    #[test]
    fn the_table_covers_every_agent_call() {
        // Every method of warden.v1.Agent has a rule, and only Uncordon is
        // admin-only among them.
        use prost::Message;
        let set =
            prost_types::FileDescriptorSet::decode(warden_proto::v1::FILE_DESCRIPTOR_SET).unwrap();
        let agent = set
            .file
            .iter()
            .flat_map(|f| &f.service)
            .find(|s| s.name() == "Agent")
            .expect("warden.v1.Agent in the descriptors");
        let methods: Vec<&str> = agent.method.iter().map(|m| m.name()).collect();
        assert!(methods.len() > 20, "{methods:?}");
        let admin_only: Vec<&str> = methods
            .into_iter()
            .filter(|m| rule_of(m) == Rule::Admin)
            .collect();
        assert_eq!(admin_only, vec!["Uncordon", "ReleaseJob"]);
    }

    #[test]
    fn admins_are_root_the_agent_and_the_admin_group() {
        let dir = tempfile::tempdir().unwrap();
        let a = authz(&dir);
        assert!(a.is_admin(&peer(0, 0, &[])));
        assert!(a.is_admin(&peer(990, 1, &[])));
        assert!(a.is_admin(&peer(1000, 77, &[])));
        assert!(a.is_admin(&peer(1000, 1000, &[5, 77])));
        assert!(!a.is_admin(&peer(1000, 1000, &[5])));
        let e = a.check(&peer(1000, 1000, &[]), "Uncordon", "").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("admins only"), "{}", e.message());
        assert!(a.check(&peer(1000, 77, &[]), "Uncordon", "").is_ok());
    }

    #[test]
    fn an_admins_release_forgets_the_owner_and_says_who_released_whose_claim() {
        let dir = tempfile::tempdir().unwrap();
        let a = authz(&dir);
        let events = warden_core::events::EventBus::new(16);
        let alice = peer(1001, 1001, &[]);
        let root = peer(0, 0, &[]);
        a.check(&alice, "BeginShard", "job-a").unwrap();
        assert_eq!(a.release_by_admin(&events, "job-a", &root), Some(1001));
        assert_eq!(a.owner("job-a"), None);
        let (said, _) = events.list(0, 16);
        let e = said
            .iter()
            .find(|e| e.kind == "job.released")
            .expect("job.released published");
        assert_eq!(e.subject, "job/job-a");
        assert!(
            e.message.contains("uid 1001") && e.message.contains("uid 0"),
            "{}",
            e.message
        );
        let ev: std::collections::BTreeMap<_, _> = e.evidence.iter().cloned().collect();
        assert_eq!(ev.get("owner").map(String::as_str), Some("1001"));
        // Nothing to release: nothing said.
        assert_eq!(a.release_by_admin(&events, "job-a", &root), None);
        let (said, _) = events.list(0, 16);
        assert_eq!(said.iter().filter(|e| e.kind == "job.released").count(), 1);
    }

    #[test]
    fn the_first_user_of_a_job_owns_it_and_strangers_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let a = authz(&dir);
        let alice = peer(1001, 1001, &[]);
        let mallory = peer(1002, 1002, &[]);
        a.check(&alice, "SetCheckpointPeers", "job-a").unwrap();
        a.check(&alice, "BeginShard", "job-a").unwrap();
        let e = a.check(&mallory, "Restore", "job-a").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("belongs to uid 1001"),
            "{}",
            e.message()
        );
        assert!(e.message().contains("job's owner"), "{}", e.message());
        // Reads are open; an admin acts on any job without taking it over.
        a.check(&mallory, "GetRanks", "job-a").unwrap();
        a.check(&peer(0, 0, &[]), "StopRanks", "job-a").unwrap();
        assert_eq!(a.owner("job-a"), Some(1001));
        // A stranger cannot record a stop of another's job.
        let e = a.check(&mallory, "ReportJobStop", "job-a").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        a.check(&alice, "ReportJobStop", "job-a").unwrap();
        // The health gate: an owner of some job, or an admin.
        a.check(&alice, "RunHealthGate", "").unwrap();
        assert!(a.check(&mallory, "RunHealthGate", "").is_err());
        // With a job named: that job's owner (or an admin) only.
        a.check(&alice, "RunHealthGate", "job-a").unwrap();
        a.check(&mallory, "BeginShard", "job-m").unwrap();
        let e = a.check(&mallory, "RunHealthGate", "job-a").unwrap_err();
        assert!(
            e.message().contains("belongs to uid 1001"),
            "{}",
            e.message()
        );
        assert!(a.check(&mallory, "RunHealthGate", "nobody's").is_err());
        assert_eq!(a.owner("nobody's"), None, "a gate claims nothing");
        a.check(&peer(0, 0, &[]), "RunHealthGate", "job-a").unwrap();
    }

    #[test]
    fn a_claim_is_refused_to_everyone_while_another_uid_holds_the_job() {
        let dir = tempfile::tempdir().unwrap();
        let a = authz(&dir);
        let alice = peer(1001, 1001, &[]);
        let mallory = peer(1002, 1002, &[]);
        let root = peer(0, 0, &[]);
        a.check(&mallory, "ClaimJob", "train-43").unwrap();
        for who in [&alice, &root] {
            let e = a.check(who, "ClaimJob", "train-43").unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied);
            assert!(
                e.message().contains("belongs to uid 1002")
                    && e.message().contains("warden release-job train-43"),
                "{}",
                e.message()
            );
        }
        // WatchIncidents of another's job is refused; of one's own, allowed.
        assert!(a.check(&alice, "WatchIncidents", "train-43").is_err());
        a.check(&mallory, "WatchIncidents", "train-43").unwrap();
        assert!(a.owns(1002, "train-43") && !a.owns(1001, "train-43"));
        // Released by an admin: the next claim takes it.
        assert!(a.check(&mallory, "ReleaseJob", "").is_err());
        assert_eq!(a.release("train-43"), Some(1002));
        a.check(&alice, "ClaimJob", "train-43").unwrap();
        assert_eq!(a.owner("train-43"), Some(1001));
        assert!(a.check(&alice, "ClaimJob", "").is_err());
    }

    #[test]
    fn owners_survive_a_restart_and_are_released_on_close() {
        let dir = tempfile::tempdir().unwrap();
        authz(&dir)
            .check(&peer(1001, 1, &[]), "RegisterRank", "j")
            .unwrap();
        let again = authz(&dir);
        assert_eq!(again.owner("j"), Some(1001));
        assert!(again.check(&peer(1002, 1, &[]), "Restore", "j").is_err());
        again.release("j");
        assert_eq!(authz(&dir).owner("j"), None);
    }

    #[test]
    fn an_owners_file_that_is_a_symlink_is_neither_read_nor_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target.json");
        let theirs = format!(r#"{{"j":{{"uid":1001,"used":{}}}}}"#, now_unix());
        std::fs::write(&target, &theirs).unwrap();
        let path = dir.path().join("owners.json");
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let a = authz(&dir);
        assert_eq!(a.owner("j"), None, "the link was not read");
        // Claims fail closed; writing is refused too, naming the file.
        let e = a
            .check(&peer(1002, 1, &[]), "RegisterRank", "j")
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(e.message().contains("symlink"), "{}", e.message());
        assert_eq!(a.owner("j"), None);
        let e = a.write_owners(&a.lock()).unwrap_err().to_string();
        assert!(
            e.contains("symlink") && e.contains(&path.display().to_string()),
            "{e}"
        );
        assert_eq!(std::fs::read_to_string(&target).unwrap(), theirs);
        assert!(path.is_symlink());
    }

    /// A truncated owners file: nobody's claim is trusted, the file is
    /// kept as it is, admins still act, and claims resume once an admin
    /// repairs it, each job back with its owner.
    #[test]
    fn a_damaged_owners_file_fails_closed_until_an_admin_repairs_it() {
        let dir = tempfile::tempdir().unwrap();
        let alice = peer(1001, 1, &[]);
        let mallory = peer(1002, 1, &[]);
        authz(&dir).check(&alice, "RegisterRank", "j").unwrap();
        let path = dir.path().join("owners.json");
        let whole = std::fs::read(&path).unwrap();
        std::fs::write(&path, &whole[..whole.len() / 2]).unwrap();
        let a = authz(&dir);
        for (who, call) in [
            (&mallory, "RegisterRank"),
            (&alice, "BeginShard"),
            (&mallory, "RunHealthGate"),
        ] {
            let e = a.check(who, call, "j").unwrap_err();
            assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{call}");
            assert!(
                e.message().contains(&path.display().to_string())
                    && e.message().contains("repairs it")
                    && e.message().contains("removes it"),
                "{}",
                e.message()
            );
        }
        assert!(
            a.check(&mallory, "GetRanks", "j").is_ok(),
            "reads stay open"
        );
        a.check(&peer(0, 0, &[]), "StopRanks", "j").unwrap();
        assert_eq!(a.owner("j"), None, "an admin acts without claiming");
        assert_eq!(
            std::fs::read(&path).unwrap(),
            &whole[..whole.len() / 2],
            "kept as evidence"
        );
        // The admin puts the whole file back: claims resume, with alice's.
        std::fs::write(&path, &whole).unwrap();
        if let Some((_, at)) = a.damaged.lock().unwrap().as_mut() {
            *at -= RECHECK;
        }
        a.check(&alice, "BeginShard", "j").unwrap();
        assert!(a.check(&mallory, "Restore", "j").is_err());
        assert_eq!(a.owner("j"), Some(1001));
    }

    #[test]
    fn the_owners_file_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        authz(&dir)
            .check(&peer(1001, 1, &[]), "RegisterRank", "j")
            .unwrap();
        let meta = std::fs::symlink_metadata(dir.path().join("owners.json")).unwrap();
        assert!(meta.is_file());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temporary file left: {names:?}");
    }

    #[test]
    fn one_uid_cannot_claim_without_bound() {
        let dir = tempfile::tempdir().unwrap();
        let a = authz(&dir);
        let p = peer(1001, 1, &[]);
        for i in 0..MAX_JOBS_PER_UID {
            a.check(&p, "BeginShard", &format!("j{i}")).unwrap();
        }
        let e = a.check(&p, "BeginShard", "one-more").unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
    }
}

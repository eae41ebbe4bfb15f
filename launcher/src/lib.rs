//! `warden run` (the launcher that owns a job's worker processes on this
//! node, in place of torchrun) and coordination across hosts through etcd
//! ([`coord`]).
//!
//! Crate `warden-launcher`: above the agent (`warden-agent`, which it
//! embeds when no wardend answers) and the core; below the CLI. wardend
//! does not link it, nor etcd-client.
//!
//! In: torchrun's command line ([`args::RunArgs`]) and the training
//! command. Out: the workers, each in a process group of its own with the
//! environment PyTorch expects ([`env`]), their output prefixed on the
//! console and kept per rank and attempt ([`output`]), in-job restarts on
//! the agent's decisions behind a pre-restart gate ([`gate`]), and an exit
//! status a scheduler can act on ([`exit`]). What to do about each exit,
//! decision, deadline, signal and round is decided by a pure state machine
//! ([`machine`]); [`supervise`] is its executor. A notice of a coming
//! stop (SIGTERM with `--term-grace`, a worker's exit 85) ends the job with
//! 85 once the workers saved; [`notice_ckpt`] says where that save went.
//! A JAX program (`--jax`, or one found to import jax) also gets what
//! `jax.distributed.initialize()` reads ([`jax`]). The job's compilation
//! caches live in the agent's tier ([`compile_cache`]) and travel to the
//! job's other hosts as a checkpoint blob ([`cache_share`]).
//!
//! The agent: the host's wardend when one answers (default socket or
//! `$WARDEN_SOCKET`), else one embedded in this process on a private socket
//! ([`agent`]): one host needs nothing else installed. Across hosts the
//! [`hosts::AcrossHosts`] seam takes the job-wide part: with
//! `--rdzv-backend etcd` the launchers agree on every round through etcd
//! ([`etcd`], on `crate::coord`); with `--rdzv-backend c10d` across nodes
//! and no `--node-rank`, through torchrun's own rendezvous run by torch
//! ([`c10d`]). With etcd, node rank 0's launcher hosts each round's
//! TCPStore in a process of its own ([`round_store`]), so the store that
//! the workers' `warden.heal` groups meet on outlives every worker.
//!
//! # Layout
//! - [`args`], [`torchrun_flags`], [`nproc`]: the command line, torchrun's
//!   flags and how each is taken, `--nproc-per-node`'s words.
//! - [`machine`]: the launcher's decisions, pure, replayed from scenarios;
//!   [`supervise`]: its executor.
//! - [`spawn`], [`env`], [`output`], [`standby`], [`reported_imports`],
//!   [`zero_code`]: the workers: their processes, environment, output, warm
//!   standby interpreters, what they imported, what the agent is told of
//!   workers without a client.
//! - [`agent`], [`connect`]: the agent (the host's wardend or an embedded
//!   one) and how it is reached.
//! - [`gate`], [`heal_ready`], [`exit`]: before a respawn; which workers a
//!   live replica can heal; the exit statuses.
//! - [`rule_stop`]: a stop by one of the launcher's own rules (88, 87), as
//!   its agent is told it; a leaf the machine, the hosts' seam and the
//!   cordon-share rule share.
//! - [`hosts`], [`etcd`], [`coord`], [`c10d`], [`round_store`], [`jax`]:
//!   across hosts: the seam, the etcd coordinator on `coord`, torch's c10d
//!   rendezvous, the round's store, JAX's variables.
//! - [`notice_ckpt`], [`compile_cache`], [`cache_share`]: where a notice's
//!   save went; the compilation caches and their copy to other hosts.
//! - [`job_goodput`], [`goodput_view`]: a job's goodput across hosts and as
//!   people read it.
//!
//! Never: reap a worker before the agent read its status (it reads the
//! zombie); act on a `restart_in_process` decision (the agent carries it
//! out through the ranks' clients); leave a process of the job behind
//! (workers are session leaders, the launcher a child subreaper, and the
//! stop sweeps every process of their sessions); loop on a failure the
//! agent calls a user error.

pub mod agent;
pub mod args;
pub mod c10d;
pub mod cache_share;
pub mod compile_cache;
pub mod connect;
pub mod coord;
pub mod env;
pub mod etcd;
pub mod exit;
pub mod gate;
pub mod goodput_view;
pub mod heal_ready;
pub mod hosts;
pub mod jax;
pub mod job_goodput;
pub mod machine;
pub mod notice_ckpt;
pub mod nproc;
pub mod output;
pub mod reported_imports;
pub mod round_store;
pub mod rule_stop;
pub mod spawn;
pub mod standby;
pub mod supervise;
pub mod torchrun_flags;
pub mod zero_code;

use std::path::PathBuf;

pub use args::RunArgs;

use crate::connect::Target;

/// Why `warden run` could not run the job (before or around the workers).
#[derive(Debug, thiserror::Error)]
pub enum LauncherError {
    /// The arguments cannot be followed.
    #[error(transparent)]
    Args(#[from] args::ArgsError),
    /// No agent to work with.
    #[error(transparent)]
    Agent(#[from] agent::AgentError),
    /// The log directory cannot be made.
    #[error("cannot create the log directory {dir}: {source}")]
    LogDir {
        /// The directory.
        dir: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Signal handlers could not be installed.
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    /// Another user owns the job id on this host's agent.
    #[error("{0}")]
    JobOwned(String),
    /// The job could not be joined in etcd.
    #[error("cannot join the job in etcd: {0}")]
    Join(crate::coord::CoordError),
    /// torch's c10d rendezvous could not be started.
    #[error("cannot start torch's c10d rendezvous: {0}")]
    C10d(crate::hosts::AcrossHostsError),
    /// The etcd TLS or authentication flags cannot be followed.
    #[error(transparent)]
    EtcdAccess(#[from] crate::coord::etcd_flags::EtcdFlagsError),
}

impl LauncherError {
    /// The launcher's exit status for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            LauncherError::Args(_) | LauncherError::EtcdAccess(_) => exit::EXIT_USAGE,
            LauncherError::JobOwned(_) => exit::EXIT_JOB_OWNED,
            _ => exit::EXIT_LAUNCHER_ERROR,
        }
    }
}

/// Runs `warden run`: returns the launcher's exit status (see [`exit`]).
/// `target` is where a wardend would answer (the CLI's `--socket`, else
/// `$WARDEN_SOCKET`, else the default path).
pub async fn run(args: RunArgs, target: &Target) -> i32 {
    let (console, thread) = output::Console::start(args.quiet);
    let code = match run_job(args, target, &console).await {
        Ok(code) => code,
        Err(e) => {
            console.say(format!("error: {e}"));
            e.exit_code()
        }
    };
    drop(console);
    thread.join();
    code
}

async fn run_job(
    mut args: RunArgs,
    target: &Target,
    console: &output::Console,
) -> Result<i32, LauncherError> {
    let nvml = std::env::var("WARDEN_NVML_LIBRARY")
        .ok()
        .filter(|l| !l.is_empty())
        .unwrap_or_else(|| "libnvidia-ml.so.1".to_owned());
    args.resolve(
        || nproc::nvml_gpus(&nvml),
        nproc::cpus_online,
        nproc::torch_xpus,
    )?;
    args.validate()?;
    // The agent's own logs only when asked for (RUST_LOG): the console
    // belongs to the workers and the launcher's story.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    // Before anything starts: a signal from now on is forwarded, not fatal.
    let mut signals = supervise::Signals::install().map_err(LauncherError::Signals)?;
    if let Err(e) = spawn::become_subreaper() {
        console.say(format!(
            "cannot become a child subreaper ({e}): orphans of the workers go to init and are found by their session only"
        ));
    }
    let etcd = args.is_etcd();
    let c10d = args.is_c10d_rounds();
    // Across hosts the id must be the same everywhere: no `<host>-<random>`.
    let job_id = match args.job_id.as_deref() {
        Some(id) => id.to_owned(),
        None if etcd || args.nnodes.max > 1 => {
            let id = shared_job_id(
                &args,
                std::env::var("WARDEN_JOB_ID").ok(),
                std::env::var("SLURM_JOB_ID").ok(),
            );
            console.say(format!(
                "job id {id} (no --rdzv-id: the same on every host of the job; docs/operations.md, \"Job ids\")"
            ));
            id
        }
        None => job_id(None),
    };
    args::valid_job_id(&job_id)?;
    if etcd && !args::valid_key_segment(&job_id) {
        return Err(args::ArgsError::EtcdJobId(job_id).into());
    }
    // The etcd files and password before anything starts: a bad one stops
    // the launcher here, named, with no agent or worker started.
    let etcd_access = if etcd {
        args.etcd
            .check_endpoints("--rdzv-endpoint", &args.etcd_endpoints())?;
        let access = args.etcd.access()?;
        if access.tls.is_none() && access.auth.is_some() {
            console.say(
                "warning: the etcd password goes over plain HTTP (no --etcd-cacert): anyone on the path can read it",
            );
        }
        access
    } else {
        crate::coord::EtcdAccess::default()
    };
    let log_root = args
        .log_dir
        .clone()
        .unwrap_or_else(default_log_dir)
        .join(sanitize(&job_id));
    // The launcher's own (0700, not a symlink, not another user's): with a
    // shared --log-dir nobody else can plant a link where a log goes.
    let logs = output::LogRoot::open(&log_root).map_err(|e| LauncherError::LogDir {
        dir: log_root.display().to_string(),
        source: std::io::Error::other(e),
    })?;
    let link = agent::AgentLink::open(
        args.agent,
        target,
        args.agent_config.as_deref(),
        &log_root.join("agent-state"),
    )
    .await?;
    console.say(link.describe());
    // Before anything of the job starts: the job id must be this user's on
    // the agent, or the decisions about it are someone else's.
    let cache_root = match agent::claim(&link.client, &job_id, console).await {
        Ok(dir) => dir,
        Err(e) => {
            link.close().await;
            return Err(e);
        }
    };
    let compile_cache = compile_cache_for(
        cache_root,
        &job_id,
        (args.compile_cache_max_gib, args.compile_cache_user_max_gib),
        console,
    );
    let compile_share = match &compile_cache {
        Some(c) => share_compile_cache(c, &job_id, &link, console).await,
        None => None,
    };
    let fallback_budget = args
        .max_restarts
        .unwrap_or(link.config.policy.unknown.budget);
    let (master_addr, master_port) = if etcd || c10d {
        (String::new(), args.master_port)
    } else {
        args.endpoint()?
    };
    let c10d_cfg = if c10d {
        Some(c10d::config(&args, &job_id)?)
    } else {
        None
    };
    let place = if let Some(c) = &c10d_cfg {
        format!("on this host, {}", c.describe())
    } else if etcd {
        format!(
            "on this host, node rank from the job's rounds (--nnodes {}:{}, etcd at {})",
            args.nnodes.min,
            args.nnodes.max,
            args.etcd_endpoints().join(",")
        )
    } else {
        format!("on node {} of {}", args.node_rank(), args.nnodes.max)
    };
    console.say(format!(
        "job {job_id}: {} worker{} {place}: {}; restarts: {}",
        args.nproc_per_node,
        if args.nproc_per_node == 1 { "" } else { "s" },
        args.argv().join(" "),
        match args.max_restarts {
            Some(k) => format!("at most {k} (--max-restarts)"),
            None => format!(
                "the agent's policy budgets decide ({} for failures it cannot diagnose)",
                fallback_budget
            ),
        }
    ));
    let job = supervise::Job {
        id: job_id,
        argv: args.argv(),
        cwd: std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/")),
        log_root,
        logs: std::sync::Arc::new(logs),
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes.max,
        node_rank: args.node_rank(),
        role: args.role.clone(),
        torchrun: args.torchrun.clone(),
        master_addr,
        master_port,
        max_restarts: args.max_restarts,
        fallback_budget,
        max_no_progress: (args.max_no_progress_restarts > 0)
            .then_some(args.max_no_progress_restarts),
        stop_grace: args.stop_grace,
        term_grace: args.term_grace,
        decision_timeout: args.decision_timeout,
        teardown_timeout: args.teardown_timeout,
        gpu_release_timeout: args.gpu_release_timeout,
        standby: args.standby_plan(),
        jax: args.jax_job(),
        compile_cache,
        compile_share: compile_share.clone(),
        // A lost host is seen after its lease TTL and the others' rejoin
        // grace (the TTL again, `etcd::config`), its round written within
        // a few writer places (0.5 s each): four TTLs and 10 s of margin.
        // On one host, a second death's heal waits for the first's
        // (`supervise::LOCAL_HEAL_PEER_WAIT`).
        heal_peer_wait: Some(if etcd {
            args.rdzv_lease_ttl * 4 + std::time::Duration::from_secs(10)
        } else {
            supervise::LOCAL_HEAL_PEER_WAIT
        }),
        // Across hosts, node rank 0's launcher hosts each round's store
        // (`round_store`), with the job's own interpreter (torch's server).
        round_store_python: if etcd {
            standby::Entry::of(&args.argv()).map(|e| e.python)
        } else {
            None
        },
    };
    // Asked for (`--standby`, or `--standbys` above 0) but none kept: the
    // command is the cause (`--standbys 0` asks for none).
    let asked = (args.standby || args.standbys.is_some()) && args.standbys != Some(0);
    if asked && job.standby.is_none() {
        console.say(
            "--standby/--standbys: no standby interpreters: the command is not a Python entrypoint \
             (script.py, -m MODULE, PYTHON script.py)",
        );
    }
    let mut job_wide = None;
    let publishing = tokio_util::sync::CancellationToken::new();
    let mut publisher = None;
    // The hosts of this host's last round across hosts (etcd), read at the
    // end by the job-wide goodput.
    let mut last_round = None;
    let summary = if etcd {
        if !args.rdzv_conf.ignored.is_empty() {
            console.say(format!(
                "--rdzv-conf: ignored (not used by warden): {}",
                args.rdzv_conf.ignored.join(", ")
            ));
        }
        if args.node_rank.is_some() {
            console
                .say("--node-rank is ignored with --rdzv-backend etcd: the job's rounds assign it");
        }
        let mut cfg = etcd::config(&args, &job.id, etcd_access.clone());
        job_wide = Some(job_goodput::GoodputHome {
            endpoints: cfg.endpoints.clone(),
            access: etcd_access,
            prefix: cfg.prefix.clone(),
            job: job.id.clone(),
            host: cfg.host.clone(),
        });
        match etcd::ckpt_peer(&link.config.checkpoint, &link.tcp, &cfg.addr) {
            Ok(mut p) => {
                // The agent's TLS identity is its host name (its node
                // certificate must carry it first), so the other hosts'
                // agents can bind this address to that certificate.
                if link.config.api.tls_files().is_some() {
                    p.identity = link.config.host_name();
                }
                console.say(format!(
                    "checkpoint replicas: the job's other hosts send theirs to this host's agent at {}{}",
                    p.addr,
                    if p.domain.is_empty() { String::new() } else { format!(" (domain {})", p.domain) }
                ));
                cfg.ckpt_peer = Some(p);
                cfg.ckpt_ring_by_place = link.takes(warden_agent::RING_BY_PLACE);
                cfg.ckpt_replicas = link
                    .takes(warden_agent::JOB_REPLICAS)
                    .then(|| u32::try_from(link.config.checkpoint.replicas).unwrap_or(u32::MAX));
            }
            Err(why) => console.say(format!(
                "checkpoint replicas: this host's agent takes none from the job's other hosts: {why}"
            )),
        }
        console.say(format!(
            "joining job {} in etcd at {} ({}) as host {} (address {}{}, lease TTL {})",
            job.id,
            cfg.endpoints.join(","),
            cfg.access.describe(),
            cfg.host,
            cfg.addr,
            if cfg.spare { ", a standby spare" } else { "" },
            humantime::format_duration(cfg.lease_ttl)
        ));
        let joined = tokio::select! {
            j = etcd::EtcdCoordinator::join(
                cfg,
                args.rdzv_conf.join_timeout(),
                etcd::CordonCap::from_args(&args),
            ) => j,
            sig = signals.recv() => {
                link.close().await;
                return Ok(exit::signalled(sig));
            }
        };
        let coordinator = match joined {
            Ok(c) => c,
            Err(e) => {
                link.close().await;
                return Err(LauncherError::Join(e));
            }
        };
        console.say(coordinator.describe());
        last_round = Some(coordinator.round_hosts());
        if let Some(jw) = &job_wide {
            publisher = Some(job_goodput::keep_published(
                jw.clone(),
                link.client.clone(),
                publishing.clone(),
            ));
        }
        supervise::run(job, &link, coordinator, console.clone(), &mut signals).await
    } else if let Some(cfg) = c10d_cfg {
        if !cfg.ignored.is_empty() {
            console.say(format!(
                "--rdzv-conf: ignored (neither warden nor torch's c10d rendezvous reads them): {}",
                cfg.ignored.join(", ")
            ));
        }
        let log = job.log_root.join("rendezvous.log");
        let cwd = job.log_root.clone();
        match c10d::C10dCoordinator::start(cfg, &log, &cwd, console.clone()) {
            Ok(coordinator) => {
                supervise::run(job, &link, coordinator, console.clone(), &mut signals).await
            }
            Err(e) => {
                link.close().await;
                return Err(LauncherError::C10d(e));
            }
        }
    } else {
        supervise::run(job, &link, hosts::LocalOnly, console.clone(), &mut signals).await
    };
    publishing.cancel();
    // The live copies end before the final report is written: a copy read
    // from etcd after it (a retry learning the key's revision anew) would
    // otherwise replace it.
    if let Some(p) = publisher {
        p.abort();
        let _ = p.await;
    }
    console.raw(summary.render());
    if let Some(share) = compile_share {
        share.end(console).await;
    }
    let mine = goodput(&link, &summary, console).await;
    if let Some(jw) = &job_wide {
        // A host that leaves alone (a node fault, a signal) does not hold
        // its exit for the others' reports.
        let wait = summary.exit_code != exit::EXIT_NODE_FAULT && summary.exit_code < 128;
        job_goodput::finish(
            jw,
            mine.as_ref(),
            std::path::Path::new(&summary.log_dir),
            console,
            wait,
            &last_round.map(|r| r.borrow().clone()).unwrap_or_default(),
        )
        .await;
    }
    if let Some(path) = &args.summary_json {
        let written = serde_json::to_vec_pretty(&summary)
            .map_err(std::io::Error::other)
            .and_then(|json| std::fs::write(path, json));
        if let Err(e) = written {
            console.say(format!("cannot write {}: {e}", path.display()));
        }
    }
    link.close().await;
    Ok(summary.exit_code)
}

/// The file, next to the per-rank logs, that holds the job's goodput
/// breakdown when it ends (`warden goodput --json`'s form of one job).
pub const GOODPUT_FILE: &str = "goodput.json";

/// Closes the job's goodput ledger at the agent, prints the breakdown and
/// writes it as JSON next to the per-rank logs; returns it. An agent that
/// cannot answer costs the job nothing: the launcher says so and goes on.
async fn goodput(
    link: &agent::AgentLink,
    summary: &exit::RunSummary,
    console: &output::Console,
) -> Option<warden_proto::v1::JobGoodput> {
    let mut client = link.client.clone();
    let req = warden_proto::v1::CloseGoodputRequest {
        job_id: summary.job.clone(),
    };
    let answer =
        tokio::time::timeout(std::time::Duration::from_secs(5), client.close_goodput(req)).await;
    let job = match answer {
        Ok(Ok(r)) => r.into_inner().jobs.into_iter().next(),
        Ok(Err(e)) => {
            console.say(format!("no goodput breakdown: {}", e.message()));
            return None;
        }
        Err(_) => {
            console.say("no goodput breakdown: the agent did not answer CloseGoodput within 5 s");
            return None;
        }
    };
    let job = job?;
    let path = std::path::Path::new(&summary.log_dir).join(GOODPUT_FILE);
    show_goodput(&job, &path, "goodput breakdown", console);
    Some(job)
}

/// Prints a job's goodput breakdown as a table and writes it as JSON to
/// `path` (`what` names it in the line that says where).
fn show_goodput(
    job: &warden_proto::v1::JobGoodput,
    path: &std::path::Path,
    what: &str,
    console: &output::Console,
) {
    console.raw(crate::goodput_view::render(job));
    let written = serde_json::to_vec_pretty(&crate::goodput_view::job_json(job))
        .map_err(std::io::Error::other)
        .and_then(|json| std::fs::write(path, json));
    match written {
        Ok(()) => console.say(format!("{what} written to {}", path.display())),
        Err(e) => console.say(format!("cannot write {}: {e}", path.display())),
    }
}

/// `--rdzv-id`, else `$WARDEN_JOB_ID`, else `<host>-<16 random hex>`: an
/// id nobody can guess, so nobody can claim it at the agent before this
/// launcher does (docs/security.md, "Job ids").
fn job_id(given: Option<&str>) -> String {
    if let Some(id) = given {
        return id.to_owned();
    }
    if let Ok(id) = std::env::var("WARDEN_JOB_ID")
        && !id.is_empty()
    {
        return id;
    }
    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "localhost".into());
    let random = warden_core::fsafe::random_name("")
        .map(|r| r.chars().take(16).collect::<String>())
        .unwrap_or_else(|_| format!("{:x}", std::process::id()));
    format!("{host}-{random}")
}

/// A multi-host job's id when `--rdzv-id` is not given, the same on every
/// host of the job: `$WARDEN_JOB_ID`; else the scheduler's job id
/// (`slurm-<SLURM_JOB_ID>`); else `job-<16 hex>` of the rendezvous
/// endpoint, the node count and the command (the same line started on
/// every host, as torchrun's users do). Guessable, unlike a single node's
/// random id: on a shared node another user who takes it first at the
/// agent makes this launcher exit 89 (docs/security.md, "Job ids").
fn shared_job_id(
    args: &RunArgs,
    warden_job_id: Option<String>,
    slurm_job_id: Option<String>,
) -> String {
    if let Some(id) = warden_job_id.filter(|j| !j.is_empty()) {
        return id;
    }
    if let Some(id) = slurm_job_id.filter(|j| !j.is_empty() && args::valid_key_segment(j)) {
        return format!("slurm-{id}");
    }
    let mut text = format!(
        "{}\n{}:{}\n{}",
        args.rdzv_endpoint.as_deref().unwrap_or(""),
        args.nnodes.min,
        args.nnodes.max,
        args.rdzv_backend.as_deref().unwrap_or("static"),
    );
    for a in args.argv() {
        text.push('\n');
        text.push_str(&a);
    }
    format!("job-{:016x}", xxhash_rust::xxh3::xxh3_64(text.as_bytes()))
}

/// `$XDG_STATE_HOME/warden/runs`, else `~/.local/state/warden/runs`, else
/// `/tmp/warden-<uid>/runs`.
fn default_log_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("warden/runs");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(h).join(".local/state/warden/runs");
    }
    PathBuf::from(format!(
        "/tmp/warden-{}/runs",
        nix::unistd::geteuid().as_raw()
    ))
}

/// The job's compilation cache shared with its other hosts through the
/// agent's checkpoint tier ([`cache_share`]): restored now when this
/// host's folder holds nothing, before any worker starts. None (said) when
/// the job's id leaves no room for the reserved one.
async fn share_compile_cache(
    cache: &compile_cache::CompileCache,
    job_id: &str,
    link: &agent::AgentLink,
    console: &output::Console,
) -> Option<std::sync::Arc<cache_share::CacheShare>> {
    let Some(blob_job) = cache_share::blob_job(&sanitize(job_id)) else {
        console.say(format!(
            "warning: the compilation cache is not shared with other hosts: job id {job_id:?} leaves no room for the suffix {:?} in 128 characters",
            cache_share::SUFFIX
        ));
        return None;
    };
    // Claimed as the job is: a blob under an id another user holds (one
    // who squatted it to plant compiled code) is never restored, and this
    // user's is never written there.
    if let Err(e) = agent::claim(&link.client, &blob_job, console).await {
        console.say(format!(
            "warning: the compilation cache is not shared with other hosts: {e}"
        ));
        return None;
    }
    let share = std::sync::Arc::new(cache_share::CacheShare::new(
        cache.clone(),
        blob_job,
        link.socket.clone(),
    ));
    cache_share::restore_and_say(&share, console, false).await;
    Some(share)
}

/// A job id as a directory name.
/// The job's compilation caches in the agent's tier, bounded at once and
/// every minute while the job runs; None (said) when the agent gave no
/// folder or it cannot be used, or with `--compile-cache-max-gib 0`.
fn compile_cache_for(
    root: Option<PathBuf>,
    job_id: &str,
    (max_gib, user_max_gib): (f64, f64),
    console: &output::Console,
) -> Option<compile_cache::CompileCache> {
    let root = root?;
    if max_gib <= 0.0 {
        return None;
    }
    let max_bytes = (max_gib * f64::from(1u32 << 30)) as u64;
    let user_max_gib = user_max_gib.max(max_gib);
    let user_max_bytes = (user_max_gib * f64::from(1u32 << 30)) as u64;
    match compile_cache::CompileCache::prepare(&root, &sanitize(job_id), max_bytes, user_max_bytes)
    {
        Ok(c) => {
            console.say(format!(
                "compilation caches (torch.compile, Triton, XLA) in {} (at most {max_gib} GiB for this job, {user_max_gib} GiB for all this user's jobs)",
                c.dir().display()
            ));
            let kept = c.clone();
            tokio::spawn(async move {
                let mut every = tokio::time::interval(std::time::Duration::from_secs(60));
                loop {
                    every.tick().await;
                    let c = kept.clone();
                    if let Ok(e) = tokio::task::spawn_blocking(move || c.evict()).await
                        && e.removed > 0
                    {
                        tracing::info!(
                            removed = e.removed,
                            bytes = e.removed_bytes,
                            before = e.before,
                            truncated = e.truncated,
                            "compilation cache bounded"
                        );
                    }
                }
            });
            Some(c)
        }
        Err(e) => {
            console.say(format!(
                "warning: no compilation cache in the tier ({}: {e}); the workers use their frameworks' defaults",
                root.display()
            ));
            None
        }
    }
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Wrap {
        #[command(flatten)]
        run: RunArgs,
    }

    fn args(line: &[&str]) -> RunArgs {
        Wrap::try_parse_from(std::iter::once("run").chain(line.iter().copied()))
            .map(|w| w.run)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The same line on two hosts (only --node-rank differs) gives one job
    /// id; another endpoint or command, another id; the scheduler's id
    /// wins over the hash, `$WARDEN_JOB_ID` over both.
    #[test]
    fn a_multi_host_job_id_is_the_same_on_every_host() {
        let line = |rank: &'static str| {
            args(&[
                "--nnodes",
                "2",
                "--node-rank",
                rank,
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                "10.0.0.1:29400",
                "train.py",
                "--lr",
                "1",
            ])
        };
        let (a, b) = (line("0"), line("1"));
        let id = shared_job_id(&a, None, None);
        assert_eq!(id, shared_job_id(&b, None, None));
        assert!(id.starts_with("job-") && id.len() == 20, "{id}");
        assert!(args::valid_key_segment(&id));
        let other = args(&[
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            "10.0.0.1:29400",
            "train.py",
            "--lr",
            "2",
        ]);
        assert_ne!(shared_job_id(&other, None, None), id);
        assert_eq!(shared_job_id(&a, None, Some("4242".into())), "slurm-4242");
        assert_eq!(
            shared_job_id(&a, Some("mine".into()), Some("4242".into())),
            "mine"
        );
    }
}

//! The `warden` command: an operator's client of the agent's API.
//!
//! Readable tables by default, `--json` for scripts. When no agent answers,
//! the error names the socket (or address) that was tried.
//!
//! Output goes through [`outln!`] and [`out!`], never `println!`: a reader
//! that closes the pipe early (`warden ckpt ls | head`) makes the write
//! fail with `BrokenPipe`, which `main` turns into a quiet exit
//! ([`is_broken_pipe`]) where `println!` would panic.
//!
//! # Layout
//! - [`views`]: how API answers are shown (tables for people, JSON for
//!   scripts); [`incidents`], [`stragglers`], [`ckpt`], [`goodput`]: the
//!   commands that read them.
//! - [`goodput_plan`]: `warden goodput plan`, the planner crate on a scenario.
//! - [`plugin`]: `warden health --plugin`, for node-problem-detector.
//! - [`demo`]: `warden demo`, the README's first command; [`toy_rank`]: the
//!   toy training rank it runs, linked with the real client.
//! - `connect` and `etcd_flags`: the launcher's, shared.

/// `println!` that returns the write's `io::Result` instead of panicking;
/// the text goes through [`printable`] first.
macro_rules! outln {
    () => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock())
    }};
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let text = format!($($arg)*);
        writeln!(std::io::stdout().lock(), "{}", $crate::printable(&text))
    }};
}

/// `print!` that returns the write's `io::Result` instead of panicking;
/// the text goes through [`printable`] first.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let text = format!($($arg)*);
        write!(std::io::stdout().lock(), "{}", $crate::printable(&text))
    }};
}

/// `s` with every control character but newline and tab written out as an
/// escape (`\x1b`, `\u{202e}`), so nothing in it acts on the terminal.
/// What the CLI prints carries text that ranks and peers wrote (exception
/// messages, evidence values, host names): an escape sequence there could
/// rewrite the screen, hide lines or set the terminal's title, and a bidi
/// override could make a line read differently from what it holds. JSON
/// output is unchanged by it: serde_json escapes control characters itself.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    escape_where(s, acts_on_terminal)
}

/// `s` on one line: [`printable`], and newlines escaped too (for one
/// field of a one-line record, so a value cannot forge the next record).
pub fn one_line(s: &str) -> std::borrow::Cow<'_, str> {
    escape_where(s, |c| c == '\n' || acts_on_terminal(c))
}

/// `s` with each character `escape` picks written as its Rust escape.
fn escape_where(s: &str, escape: impl Fn(char) -> bool) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(&escape) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if escape(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A control character (C0 but newline and tab, DEL, C1) or a bidi
/// embedding, override or isolate.
fn acts_on_terminal(c: char) -> bool {
    (c.is_control() && c != '\n' && c != '\t')
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

pub mod ckpt;
pub use warden_launcher::connect;
pub mod demo;
pub use warden_launcher::coord::etcd_flags;
pub mod goodput;
pub mod goodput_plan;
pub mod incidents;
pub mod plugin;
pub mod stragglers;
pub mod toy_rank;
pub mod views;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use tokio_stream::StreamExt;
use warden_proto::v1 as pb;

pub use connect::Target;

/// Whether `e` is, anywhere in its chain, a write to a pipe whose reader
/// has gone (`warden ... | head`): the reader chose to stop, so the command
/// ends quietly and successfully, as `grep` or `ripgrep` do.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// The warden CLI.
#[derive(Debug, Parser)]
#[command(
    name = "warden",
    version,
    about = "Ask the local warden agent about the node and its jobs"
)]
pub struct Cli {
    /// The agent's Unix socket [default: $WARDEN_SOCKET, else the agent's default path]
    #[arg(long, global = true, conflicts_with = "addr")]
    pub socket: Option<PathBuf>,
    /// Refused: the agent's TCP port serves only its peer agents (mutual
    /// TLS). Kept so that old scripts get a message saying what to use.
    #[arg(long, global = true, hide = true)]
    pub addr: Option<String>,
    /// Machine-readable output (one JSON document; NDJSON for streams).
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The agent's version, uptime, host, endpoints and configuration.
    Info {
        /// Also print the effective configuration.
        #[arg(long)]
        config: bool,
    },
    /// The node's health: one row per component with its worst reason.
    Health {
        /// Act as a node-problem-detector custom plugin: one line of at
        /// most 80 bytes on stdout, nothing on stderr, exit 0 healthy (OK,
        /// UNKNOWN, DEGRADED), 1 problem (FAILED or cordoned), 2 the agent
        /// could not be asked (within 4 s).
        #[arg(long)]
        plugin: bool,
    },
    /// Recent events; with --follow, keep streaming new ones.
    Events {
        /// Keep the stream open and print events as they happen.
        #[arg(long, short = 'f')]
        follow: bool,
        /// Only events after this id (resume where you left off).
        #[arg(long)]
        after: Option<u64>,
        /// Show at most this many recent events before following.
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// The training ranks this agent watches: state, step, section, heartbeat
    /// age, step-time percentiles, and the hang threshold in force.
    Ranks {
        /// Only this job.
        #[arg(long)]
        job: Option<String>,
    },
    /// Incidents (crash, hang, hardware, straggler): each with its fault
    /// class, confidence, the decision taken and the chain of evidence.
    Incidents {
        /// Only this job.
        #[arg(long)]
        job: Option<String>,
        /// At most this many, the newest (0: all the agent retains).
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Every piece of evidence (with event ids), the rule that decided,
        /// and superseded decisions.
        #[arg(long, short = 'v', visible_alias = "verbose")]
        evidence: bool,
    },
    /// Run the pre-restart health gate now: `dcgmi diag -r LEVEL` where
    /// dcgmi is installed, else the fast NVML check. Exit 0 passed, 1 failed
    /// (the failure is also an incident that takes the node out).
    Diag {
        /// dcgmi diag level: 1 quick, 2 medium (~2 min), 3 long (~15 min),
        /// 4 extended [default: the agent's dcgm.gate_level].
        #[arg(long, short = 'r')]
        level: Option<u32>,
        /// The job about to restart here, for the incident a failure opens.
        #[arg(long)]
        job: Option<String>,
    },
    /// Forget who owns a job id on this agent (admins only): a claim a
    /// user squatted, or one left by a job that ended without closing its
    /// ledger. The next user of the id owns it.
    ReleaseJob {
        /// The job id.
        job: String,
    },
    /// Lift the cordon a decision put on this node (after repair).
    Uncordon {
        /// Why (kept in the agent's event, with who ran the command).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Straggler scores of the ranks this agent watches and, through its
    /// peers, of the rest of their jobs: the slowest compute section of each
    /// rank against the job's median, and why a flagged rank is slow.
    Stragglers {
        /// Only this job.
        #[arg(long)]
        job: Option<String>,
        /// Only flagged ranks.
        #[arg(long)]
        flagged: bool,
    },
    /// Checkpoints in the agent's tier, its peers' and the durable store.
    Ckpt {
        /// What to do.
        #[command(subcommand)]
        cmd: CkptCommand,
    },
    /// Where each job's accelerator time went: productive step time and
    /// badput by cause (start-up, checkpoint save and restore, detection,
    /// restart, lost progress, stragglers, data wait, idle), with
    /// percentages and the top causes; `warden goodput plan` simulates a
    /// job's failures and recoveries to pick a checkpoint interval and a
    /// spares count.
    Goodput(goodput::GoodputArgs),
    /// Start wardend on its embedded defaults in a scratch directory with two
    /// toy training ranks, one of which hangs: show health, the hang event
    /// with its evidence, and the ranks.
    Demo {
        /// Stop after this long instead of waiting for Ctrl-C ("10s", "1m").
        #[arg(long, value_parser = humantime::parse_duration)]
        duration: Option<std::time::Duration>,
    },
    /// A toy training rank (what `warden demo` runs).
    #[command(hide = true)]
    ToyRank(toy_rank::ToyRank),
    /// Launch a training job on this node (torchrun's flags): workers with
    /// PyTorch's environment, per-rank logs, in-job restarts on the agent's
    /// decisions, and an exit status that tells the scheduler what happened.
    /// Uses the local wardend, or embeds one when none runs.
    Run(Box<warden_launcher::RunArgs>),
}

/// Entry point of the `warden` binary.
pub fn main() -> Result<()> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(run(cli))
}

async fn run(cli: Cli) -> Result<()> {
    let target = Target::from_args(cli.socket.clone(), cli.addr.clone());
    match cli.command {
        Command::Info { config } => {
            let mut c = target.connect().await?;
            let info = c
                .get_agent_info(pb::GetAgentInfoRequest {})
                .await
                .with_context(|| format!("GetAgentInfo from {target}"))?
                .into_inner();
            views::print_info(&info, cli.json, config)?;
        }
        Command::Health { plugin: true } => {
            // NPD reads the exit status: 0 healthy, 1 problem, 2 unknown.
            std::process::exit(plugin::run(&target).await.into());
        }
        Command::Health { plugin: false } => {
            let mut c = target.connect().await?;
            let health = c
                .get_node_health(pb::GetNodeHealthRequest {})
                .await
                .with_context(|| format!("GetNodeHealth from {target}"))?
                .into_inner();
            views::print_health(&health, cli.json)?;
        }
        Command::Events {
            follow,
            after,
            limit,
        } => {
            let mut c = target.connect().await?;
            let listed = c
                .list_events(pb::ListEventsRequest {
                    after_id: after.unwrap_or(0),
                    limit,
                })
                .await
                .with_context(|| format!("ListEvents from {target}"))?
                .into_inner();
            let mut last = after.unwrap_or(0);
            for e in &listed.events {
                views::print_event(e, cli.json)?;
                last = last.max(e.id);
            }
            if follow {
                let mut stream = c
                    .watch_events(pb::WatchEventsRequest {
                        after_id: Some(last),
                    })
                    .await
                    .with_context(|| format!("WatchEvents from {target}"))?
                    .into_inner();
                while let Some(e) = stream.next().await {
                    let e = e.with_context(|| format!("event stream from {target}"))?;
                    views::print_event(&e, cli.json)?;
                }
                anyhow::bail!("the agent at {target} closed the event stream (it stopped?)");
            }
        }
        Command::Ranks { job } => {
            let mut c = target.connect().await?;
            let ranks = c
                .get_ranks(pb::GetRanksRequest {
                    job_id: job.unwrap_or_default(),
                })
                .await
                .with_context(|| format!("GetRanks from {target}"))?
                .into_inner();
            views::print_ranks(&ranks, cli.json)?;
        }
        Command::Incidents {
            job,
            limit,
            evidence,
        } => {
            let mut c = target.connect().await?;
            let incidents = c
                .get_incidents(pb::GetIncidentsRequest {
                    job_id: job.clone().unwrap_or_default(),
                    limit,
                })
                .await
                .with_context(|| format!("GetIncidents from {target}"))?
                .into_inner();
            incidents::print_incidents(&incidents, job.as_deref(), cli.json, evidence)?;
        }
        Command::Diag { level, job } => {
            let mut c = target.connect().await?;
            let r = c
                .run_health_gate(pb::RunHealthGateRequest {
                    level: level.unwrap_or(0),
                    job_id: job.unwrap_or_default(),
                })
                .await
                .with_context(|| format!("RunHealthGate at {target}"))?
                .into_inner();
            views::print_gate(&r, cli.json)?;
            if !r.passed {
                std::process::exit(1);
            }
        }
        Command::ReleaseJob { job } => {
            let mut c = target.connect().await?;
            let r = c
                .release_job(pb::ReleaseJobRequest {
                    job_id: job.clone(),
                })
                .await
                .with_context(|| format!("ReleaseJob at {target}"))?
                .into_inner();
            if cli.json {
                println!(
                    "{}",
                    serde_json::json!({"job": job, "released": r.released, "owner_uid": r.owner_uid})
                );
            } else if r.released {
                println!("job {job:?}: the claim of uid {} released", r.owner_uid);
            } else {
                println!("job {job:?} had no owner on this agent");
            }
        }
        Command::Uncordon { reason } => {
            let mut c = target.connect().await?;
            let answer = c
                .uncordon(pb::UncordonRequest {
                    reason: incidents::uncordon_reason(reason.as_deref()),
                })
                .await
                .with_context(|| format!("Uncordon at {target}"))?
                .into_inner();
            incidents::print_uncordon(&answer, cli.json)?;
        }
        Command::Stragglers { job, flagged } => {
            let mut c = target.connect().await?;
            let r = c
                .get_stragglers(pb::GetStragglersRequest {
                    job_id: job.unwrap_or_default(),
                    flagged_only: flagged,
                })
                .await
                .with_context(|| format!("GetStragglers from {target}"))?
                .into_inner();
            stragglers::print_stragglers(&r, cli.json)?;
        }
        Command::Ckpt {
            cmd:
                CkptCommand::Ls {
                    job,
                    shards,
                    summary,
                    rank,
                },
        } => {
            // Every shard of a large job is megabytes (about 100 bytes a
            // shard): taken whole when asked for by name.
            let mut c = target
                .connect()
                .await?
                .max_decoding_message_size(ckpt::MAX_LISTING_BYTES);
            // Ranks named are listed whatever their number of steps.
            let detail = if summary {
                pb::ListDetail::Summary
            } else if shards || !rank.is_empty() {
                pb::ListDetail::All
            } else {
                pb::ListDetail::Unspecified
            };
            let r = c
                .list_checkpoints(pb::ListCheckpointsRequest {
                    job_id: job.unwrap_or_default(),
                    detail: detail.into(),
                    ranks: rank.clone(),
                })
                .await
                .with_context(|| format!("ListCheckpoints from {target}"))?
                .into_inner();
            ckpt::print_list(&ckpt::only_ranks(r, &rank), cli.json)?;
        }
        Command::Goodput(args) => match &args.cmd {
            None => goodput::run(&target, &args, cli.json).await?,
            Some(goodput::GoodputCmd::Plan(plan)) => goodput_plan::run(plan, cli.json)?,
        },
        Command::Demo { duration } => demo::run(duration, cli.json).await?,
        Command::ToyRank(opts) => toy_rank::run(&opts),
        Command::Run(args) => std::process::exit(warden_launcher::run(*args, &target).await),
    }
    Ok(())
}

/// `warden ckpt` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum CkptCommand {
    /// Steps, whether each is complete for every rank, and where each
    /// shard's copies live (local tier, peers, durable store). Past 1,024
    /// shards in all, each step's counts alone, unless --shards or --rank.
    Ls {
        /// Only this job.
        #[arg(long)]
        job: Option<String>,
        /// Every shard, however many (a large job's listing is megabytes).
        #[arg(long, conflicts_with = "summary")]
        shards: bool,
        /// Each step's counts alone: ranks with a copy, bytes, copies, the
        /// ranks missing.
        #[arg(long)]
        summary: bool,
        /// Only this rank's shards (repeatable); the counts still cover
        /// every rank.
        #[arg(long, value_name = "R")]
        rank: Vec<u32>,
    },
}

#[cfg(test)]
mod printable_tests {
    use super::{one_line, printable};

    #[test]
    fn escapes_and_overrides_are_written_out_and_text_is_kept() {
        let hostile = "CUDA error\x1b]0;pwned\x07\x1b[2J\r\u{202e}gpj.exe\u{9b}31m";
        let shown = printable(hostile);
        assert!(!shown.chars().any(|c| c.is_control()), "{shown}");
        assert_eq!(
            shown,
            "CUDA error\\u{1b}]0;pwned\\u{7}\\u{1b}[2J\\r\\u{202e}gpj.exe\\u{9b}31m"
        );
        assert_eq!(
            printable("plain text\n\tnext line é"),
            "plain text\n\tnext line é"
        );
        assert_eq!(one_line("a\nfake line"), "a\\nfake line");
    }
}

//! torchrun's options beyond the rendezvous: how each is taken by
//! `warden run` (issue 33). Every option of torch 2.15's `torchrun` is
//! accepted with torchrun's meaning, mapped to warden's equivalent where
//! warden has a better one, or refused with exit 2 naming it where it
//! cannot apply; none is ever taken for the program (docs/operations.md,
//! "torchrun's options").
//!
//! The console and the logs: warden always writes every rank's stdout and
//! stderr to its log files (torchrun's `--tee 3` with `--log-dir`) and
//! copies them to the console. `--redirects` takes a rank's streams off the
//! console (files only), `--tee` puts them back, `--local-ranks-filter`
//! keeps only those local ranks on the console, and
//! `--log-line-prefix-template` replaces the console's `[rank N] ` prefix.

use std::collections::BTreeSet;

/// Which of a rank's standard streams an option names (torchrun's `Std`:
/// 0 none, 1 stdout, 2 stderr, 3 both).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StdStreams {
    /// Standard output.
    pub stdout: bool,
    /// Standard error.
    pub stderr: bool,
}

impl StdStreams {
    fn of(n: u8) -> Option<Self> {
        (n <= 3).then_some(Self {
            stdout: n & 1 != 0,
            stderr: n & 2 != 0,
        })
    }

    /// Whether `stream` is named.
    pub fn has(self, stream: crate::output::Stream) -> bool {
        match stream {
            crate::output::Stream::Stdout => self.stdout,
            crate::output::Stream::Stderr => self.stderr,
        }
    }
}

/// `--redirects` / `--tee`: one value for every local rank (`3`), or per
/// local rank (`0:3,1:2`; the ranks not named: none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StdSpec {
    /// The same for every local rank.
    All(StdStreams),
    /// Per local rank.
    Ranks(Vec<(u32, StdStreams)>),
}

impl StdSpec {
    /// The streams named for local rank `local`.
    pub fn of(&self, local: u32) -> StdStreams {
        match self {
            Self::All(s) => *s,
            Self::Ranks(v) => v
                .iter()
                .find(|(r, _)| *r == local)
                .map(|(_, s)| *s)
                .unwrap_or_default(),
        }
    }
}

fn parse_std(s: &str) -> Result<StdSpec, String> {
    let bad =
        || format!("{s:?}: give 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or LOCAL_RANK:N,...");
    let num = |v: &str| {
        v.trim()
            .parse::<u8>()
            .ok()
            .and_then(StdStreams::of)
            .ok_or_else(bad)
    };
    if !s.contains(':') {
        return num(s).map(StdSpec::All);
    }
    s.split(',')
        .map(|kv| {
            let (r, v) = kv.split_once(':').ok_or_else(bad)?;
            Ok((r.trim().parse::<u32>().map_err(|_| bad())?, num(v)?))
        })
        .collect::<Result<Vec<_>, String>>()
        .map(StdSpec::Ranks)
}

fn parse_ranks(s: &str) -> Result<BTreeSet<u32>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .map(|r| {
            r.parse::<u32>()
                .map_err(|_| format!("{s:?}: give local ranks, comma-separated (0,1,2)"))
        })
        .collect()
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    s.trim()
        .parse::<f64>()
        .ok()
        .filter(|x| x.is_finite() && *x >= 0.0)
        .ok_or_else(|| format!("{s:?} is not a number of seconds"))
}

/// The signals the launcher forwards to its workers.
pub const FORWARDED: [&str; 4] = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"];

/// torchrun's options about the workers' processes, the console and the
/// logs.
#[derive(Debug, Clone, Default, PartialEq, clap::Args)]
pub struct TorchrunFlags {
    /// torchrun's --redirects: these streams go to the rank's log files
    /// only, not the console (`3`, or `0:3,1:2` per local rank).
    #[arg(short = 'r', long, value_parser = parse_std)]
    pub redirects: Option<StdSpec>,
    /// torchrun's --tee: these streams go to the log files and the console
    /// (warden's default for every stream; undoes --redirects).
    #[arg(short = 't', long, value_parser = parse_std)]
    pub tee: Option<StdSpec>,
    /// Only these local ranks' output on the console (the log files keep
    /// every rank's), comma-separated.
    #[arg(long = "local-ranks-filter", alias = "local_ranks_filter", value_parser = parse_ranks)]
    pub local_ranks_filter: Option<BTreeSet<u32>>,
    /// The console prefix of each worker line: `${role_name}`,
    /// `${local_rank}`, `${rank}` and `${hostname}` are replaced (default
    /// `[rank ${rank}] `).
    #[arg(long = "log-line-prefix-template", alias = "log_line_prefix_template")]
    pub log_line_prefix_template: Option<String>,
    /// Worker stdout lines containing any of these (comma-separated; `,,`
    /// for a comma) are also written to `filtered_stdout.log` in the
    /// attempt's log directory.
    #[arg(long = "duplicate-stdout-filters", alias = "duplicate_stdout_filters")]
    pub duplicate_stdout_filters: Option<String>,
    /// The same for stderr, to `filtered_stderr.log`.
    #[arg(long = "duplicate-stderr-filters", alias = "duplicate_stderr_filters")]
    pub duplicate_stderr_filters: Option<String>,
    /// torchrun's polling interval: taken and not needed (warden waits on
    /// each worker's exit, no polling).
    #[arg(long = "monitor-interval", alias = "monitor_interval", value_parser = parse_seconds)]
    pub monitor_interval: Option<f64>,
    /// torchrun's multiprocessing start method: taken; a script or module
    /// entrypoint is its own process either way (as under torchrun).
    #[arg(long = "start-method", alias = "start_method", value_parser = ["spawn", "fork", "forkserver"])]
    pub start_method: Option<String>,
    /// torchrun's event handler: `null` (its default) only; warden's own
    /// events are the agent's (`warden events`).
    #[arg(long = "event-log-handler", alias = "event_log_handler")]
    pub event_log_handler: Option<String>,
    /// torchrun's --run-path: the script runs in the worker's interpreter,
    /// as warden runs every `.py` script.
    #[arg(long = "run-path", alias = "run_path")]
    pub run_path: bool,
    /// This node's address for the other nodes (torchrun's --local-addr):
    /// warden's --advertise-addr.
    #[arg(long = "local-addr", alias = "local_addr")]
    pub local_addr: Option<String>,
    /// torchrun's log-spec plug-in: refused (warden writes its own
    /// per-rank logs under --log-dir).
    #[arg(long = "logs-specs", alias = "logs_specs")]
    pub logs_specs: Option<String>,
    /// torchrun's NUMA binding: refused (bind in the command, e.g. with
    /// `numactl`).
    #[arg(long = "numa-binding", alias = "numa_binding")]
    pub numa_binding: Option<String>,
    /// Signals passed on to the workers: warden forwards SIGTERM, SIGINT,
    /// SIGHUP and SIGQUIT (torchrun's default); a list naming others is
    /// refused.
    #[arg(long = "signals-to-handle", alias = "signals_to_handle")]
    pub signals_to_handle: Option<String>,
    /// Seconds between SIGTERM and SIGKILL when workers are stopped:
    /// warden's --stop-grace.
    #[arg(long = "shutdown-timeout", alias = "shutdown_timeout", value_parser = parse_seconds)]
    pub shutdown_timeout: Option<f64>,
    /// torchrun's virtual local rank: refused (warden's workers see their
    /// real LOCAL_RANK).
    #[arg(long = "virtual-local-rank", alias = "virtual_local_rank")]
    pub virtual_local_rank: bool,
    /// torchrun's shell completion script: refused.
    #[arg(long = "print-completion")]
    pub print_completion: Option<String>,
}

impl TorchrunFlags {
    /// The options that cannot apply, each named with why; `Ok` when none
    /// was given.
    pub fn refused(&self) -> Result<(), String> {
        if let Some(h) = &self.event_log_handler
            && h != "null"
        {
            return Err(format!(
                "--event-log-handler {h}: only `null` (torchrun's default) applies; warden's events are the agent's (`warden events`)"
            ));
        }
        if let Some(s) = &self.logs_specs {
            return Err(format!(
                "--logs-specs {s}: warden writes its own per-rank logs (--log-dir); a torchrun log-spec plug-in cannot apply"
            ));
        }
        if let Some(n) = &self.numa_binding {
            return Err(format!(
                "--numa-binding {n}: not done by warden; bind in the command (`numactl --cpunodebind=N ...`)"
            ));
        }
        if self.virtual_local_rank {
            return Err(
                "--virtual-local-rank: not done by warden; its workers see their real LOCAL_RANK"
                    .into(),
            );
        }
        if let Some(shell) = &self.print_completion {
            return Err(format!(
                "--print-completion {shell}: warden has no completion script"
            ));
        }
        if let Some(list) = &self.signals_to_handle {
            for sig in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                if !FORWARDED.contains(&sig) {
                    return Err(format!(
                        "--signals-to-handle: {sig} is not one warden forwards ({})",
                        FORWARDED.join(", ")
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether local rank `local`'s `stream` goes to the console.
    pub fn on_console(&self, local: u32, stream: crate::output::Stream) -> bool {
        if let Some(keep) = &self.local_ranks_filter
            && !keep.contains(&local)
        {
            return false;
        }
        let redirected = self
            .redirects
            .as_ref()
            .is_some_and(|r| r.of(local).has(stream));
        let teed = self.tee.as_ref().is_some_and(|t| t.of(local).has(stream));
        !redirected || teed
    }

    /// The console prefix of a worker's lines.
    pub fn prefix(&self, role: &str, local: u32, rank: u32, hostname: &str) -> String {
        match &self.log_line_prefix_template {
            None => format!("[rank {rank}] "),
            Some(t) => t
                .replace("${role_name}", role)
                .replace("${local_rank}", &local.to_string())
                .replace("${rank}", &rank.to_string())
                .replace("${hostname}", hostname),
        }
    }

    /// The filters of `stream`'s duplicate file (`,,` is a comma).
    pub fn duplicate_filters(&self, stream: crate::output::Stream) -> Vec<String> {
        let given = match stream {
            crate::output::Stream::Stdout => &self.duplicate_stdout_filters,
            crate::output::Stream::Stderr => &self.duplicate_stderr_filters,
        };
        let Some(given) = given else {
            return Vec::new();
        };
        given
            .replace(",,", "\u{0}")
            .split(',')
            .map(|f| f.replace('\u{0}', ","))
            .filter(|f| !f.is_empty())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::Stream;

    #[test]
    fn redirects_tee_and_the_filter_decide_the_console() {
        let mut f = TorchrunFlags {
            redirects: Some(parse_std("3").unwrap()),
            ..TorchrunFlags::default()
        };
        assert!(!f.on_console(0, Stream::Stdout));
        f.tee = Some(parse_std("0:1").unwrap());
        assert!(f.on_console(0, Stream::Stdout));
        assert!(!f.on_console(0, Stream::Stderr));
        assert!(!f.on_console(1, Stream::Stdout));
        let f = TorchrunFlags {
            tee: Some(parse_std("3").unwrap()),
            local_ranks_filter: Some(parse_ranks("0").unwrap()),
            ..TorchrunFlags::default()
        };
        assert!(f.on_console(0, Stream::Stderr));
        assert!(!f.on_console(1, Stream::Stdout));
        assert!(TorchrunFlags::default().on_console(7, Stream::Stderr));
        assert!(parse_std("4").is_err());
        assert!(parse_std("0:9").is_err());
    }

    #[test]
    fn the_prefix_template_and_duplicate_filters_read_as_torchruns() {
        let f = TorchrunFlags {
            log_line_prefix_template: Some(
                "${hostname}:${role_name}${local_rank}/${rank}: ".into(),
            ),
            duplicate_stdout_filters: Some("loss,,step,apple".into()),
            ..TorchrunFlags::default()
        };
        assert_eq!(f.prefix("trainer", 1, 9, "h1"), "h1:trainer1/9: ");
        assert_eq!(f.duplicate_filters(Stream::Stdout), ["loss,step", "apple"]);
        assert!(f.duplicate_filters(Stream::Stderr).is_empty());
        assert_eq!(TorchrunFlags::default().prefix("r", 0, 3, "h"), "[rank 3] ");
    }

    #[test]
    fn options_that_cannot_apply_are_refused_by_name() {
        let cases: Vec<(TorchrunFlags, &str)> = vec![
            (
                TorchrunFlags {
                    numa_binding: Some("node".into()),
                    ..TorchrunFlags::default()
                },
                "--numa-binding",
            ),
            (
                TorchrunFlags {
                    logs_specs: Some("x".into()),
                    ..TorchrunFlags::default()
                },
                "--logs-specs",
            ),
            (
                TorchrunFlags {
                    virtual_local_rank: true,
                    ..TorchrunFlags::default()
                },
                "--virtual-local-rank",
            ),
            (
                TorchrunFlags {
                    signals_to_handle: Some("SIGTERM,SIGUSR1".into()),
                    ..TorchrunFlags::default()
                },
                "SIGUSR1",
            ),
            (
                TorchrunFlags {
                    event_log_handler: Some("console".into()),
                    ..TorchrunFlags::default()
                },
                "--event-log-handler",
            ),
        ];
        for (f, name) in cases {
            let e = f.refused().unwrap_err();
            assert!(e.contains(name), "{e}");
        }
        let ok = TorchrunFlags {
            signals_to_handle: Some("SIGTERM,SIGINT,SIGHUP".into()),
            event_log_handler: Some("null".into()),
            monitor_interval: Some(0.1),
            start_method: Some("spawn".into()),
            ..TorchrunFlags::default()
        };
        assert_eq!(ok.refused(), Ok(()));
    }
}

//! `wardend`: the node agent. Parses arguments, loads the config, sets up
//! logs and runs [`warden_agent::daemon::run`]; maps failures to exit codes
//! that systemd and operators can act on (see docs/operations.md).

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use warden_agent::config::Config;

/// Exit code for a configuration error (sysexits EX_CONFIG); the unit file
/// lists it in RestartPreventExitStatus so systemd does not loop on it.
const EXIT_CONFIG: u8 = 78;
/// Exit code when another agent already serves the socket (EX_TEMPFAIL).
const EXIT_ALREADY_RUNNING: u8 = 75;
/// Exit code for any other failure to start or run.
const EXIT_FAILURE: u8 = 1;

/// warden's node-local resiliency agent.
#[derive(Debug, Parser)]
#[command(name = "wardend", version)]
struct Args {
    /// Configuration file (TOML). Without it, the embedded defaults are used.
    #[arg(long, short = 'c', env = "WARDEN_CONFIG")]
    config: Option<PathBuf>,
    /// Validate FILE and exit: 0 when it is valid, 78 with the reason if not.
    #[arg(long, value_name = "FILE", conflicts_with = "config")]
    check_config: Option<PathBuf>,
    /// Print the effective configuration (defaults filled in) and exit.
    #[arg(long)]
    print_config: bool,
    /// Play a scenario of simulated GPUs, NVLinks and TPU chips and their
    /// faults (see examples/scenarios/): sets `simulated.scenario`; a bad
    /// scenario exits 78.
    #[arg(long, value_name = "FILE", env = "WARDEN_SIMULATE")]
    simulate: Option<PathBuf>,
    /// Scenario seconds per wall second (sets `simulated.speed`, over the
    /// scenario's own `speed`).
    #[arg(long, value_name = "X", env = "WARDEN_SIMULATE_SPEED", requires = "simulate", value_parser = parse_speed)]
    simulate_speed: Option<f64>,
}

/// A playback speed: a number in (0, 10000].
fn parse_speed(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 10_000.0 => Ok(x),
        _ => Err(format!("{s:?} is not a speed in (0, 10000]")),
    }
}

/// `config` with `--simulate` and `--simulate-speed` filled into its
/// `[simulated]` section (the path made absolute: the agent's printed
/// config is read elsewhere), and the scenario it names, from the flags or
/// the file, read and checked: a bad one stops the start (exit 78) as a
/// bad config does, naming the file or the scenario's key.
fn simulated(mut config: Config, args: &Args) -> Result<Config, String> {
    if let Some(path) = &args.simulate {
        let path = std::path::absolute(path)
            .map_err(|e| format!("cannot resolve {}: {e}", path.display()))?;
        config.simulated.scenario = path.display().to_string();
        config.simulated.speed = args.simulate_speed;
    }
    config
        .simulated
        .load()
        .map_err(|e| format!("simulated.scenario = {:?}: {e}", config.simulated.scenario))?;
    Ok(config)
}

/// Lets glibc's malloc keep multi-megabyte buffers for reuse: checkpoint
/// transfers allocate and free a few MiB per chunk (HTTP/2 receive buffers,
/// read buffers), and by default glibc maps each one afresh or hands freed
/// memory back to the kernel, so every chunk page-faulted its memory in
/// again (4x fewer page faults with this, measured on the checkpoint_tiers
/// bench). At most 128 MiB of freed memory stays with an arena before it
/// is returned. `GLIBC_TUNABLES` still overrides both.
fn keep_large_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("GLIBC_TUNABLES").is_none() {
        // SAFETY: mallopt only changes allocator parameters; it is called
        // before any other thread exists, and bad values are refused (it
        // returns 0), never undefined behaviour.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 128 << 20);
        }
    }
}

fn main() -> ExitCode {
    // The DCGM helper: the library runs in this child process, never in the
    // agent (see warden_agent::sources::dcgm::helper).
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == "--dcgm-helper")
    {
        let code = warden_agent::sources::dcgm::helper::main();
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    keep_large_buffers();
    let args = Args::parse();
    if let Some(path) = &args.check_config {
        // The scenario too, from the file or the flags (a unit's
        // `ExecStartPre` check sees what its `ExecStart` will play).
        let checked = Config::from_file(path)
            .map_err(|e| format!("invalid config: {e}"))
            .and_then(|c| simulated(c, &args).map_err(|e| format!("invalid scenario: {e}")));
        return match checked {
            Ok(_) => {
                // Written, not println!: `wardend --check-config f | head -0`
                // must not panic on the closed pipe; the verdict is the status.
                let _ = writeln!(std::io::stdout().lock(), "{}: ok", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("wardend: {e}");
                ExitCode::from(EXIT_CONFIG)
            }
        };
    }
    let (config, source) = match &args.config {
        Some(path) => match Config::from_file(path) {
            Ok(c) => (c, path.display().to_string()),
            Err(e) => {
                eprintln!("wardend: invalid config: {e}");
                return ExitCode::from(EXIT_CONFIG);
            }
        },
        None => (Config::default(), "embedded defaults".to_owned()),
    };
    let config = match simulated(config, &args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("wardend: invalid scenario: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if args.print_config {
        return match std::io::stdout()
            .lock()
            .write_all(config.to_toml().as_bytes())
        {
            // `wardend --print-config | head`: the reader has what it wanted.
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                eprintln!("wardend: cannot write the config: {e}");
                ExitCode::from(EXIT_FAILURE)
            }
            _ => ExitCode::SUCCESS,
        };
    }
    warden_agent::telemetry::init(&config.log);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("wardend")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the async runtime");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    match runtime.block_on(warden_agent::daemon::run(config, source)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One plain line on stderr: journald keeps it, and it reads the
            // same whatever the log format.
            eprintln!("wardend: {e}");
            if e.is_already_running() {
                ExitCode::from(EXIT_ALREADY_RUNNING)
            } else {
                ExitCode::from(EXIT_FAILURE)
            }
        }
    }
}

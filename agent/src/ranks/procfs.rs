//! What the kernel says about a rank's process: alive, state, CPU time,
//! threads, wchan, when it started (the goodput ledger's launch time), and
//! (while it is a zombie) its exit status.

/// Facts from `/proc/<pid>/stat` and `/proc/<pid>/wchan`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcFacts {
    /// One-letter state: R running, S sleeping, D uninterruptible (I/O,
    /// driver), T stopped, Z zombie...
    pub state: char,
    /// The parent's pid (whose descendant a rank registered by its
    /// launcher must be).
    pub ppid: u32,
    /// User + system CPU time in clock ticks.
    pub cpu_ticks: u64,
    /// Number of threads.
    pub threads: u64,
    /// The kernel function it sleeps in, if any ("0" or empty when running).
    pub wchan: String,
    /// The waitpid-style status, meaningful only for a zombie.
    pub exit_status: Option<i32>,
}

impl ProcFacts {
    /// A person's name for the state letter.
    pub fn state_name(&self) -> &'static str {
        match self.state {
            'R' => "running",
            'S' => "sleeping",
            'D' => "uninterruptible sleep (I/O or driver)",
            'T' | 't' => "stopped",
            'Z' => "zombie (exited)",
            'X' => "dead",
            'I' => "idle",
            _ => "unknown",
        }
    }
}

/// Parses the text of `/proc/<pid>/stat`. The command name may hold spaces
/// and parentheses, so fields are counted from the last ')'.
pub fn parse_stat(text: &str) -> Option<ProcFacts> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state) of proc(5).
    let field = |n: usize| fields.get(n - 3).copied();
    let num = |n: usize| field(n).and_then(|f| f.parse::<u64>().ok());
    Some(ProcFacts {
        state: field(3)?.chars().next()?,
        ppid: field(4)?.parse().ok()?,
        cpu_ticks: num(14)? + num(15)?,
        threads: num(20)?,
        wchan: String::new(),
        exit_status: field(52).and_then(|f| f.parse::<i32>().ok()),
    })
}

/// Reads the facts of `pid`; None when the process is gone (or reaped).
pub fn read(pid: u32) -> Option<ProcFacts> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut facts = parse_stat(&text)?;
    facts.wchan = std::fs::read_to_string(format!("/proc/{pid}/wchan"))
        .map(|w| w.trim().to_owned())
        .unwrap_or_default();
    Some(facts)
}

/// The process state ("T (stopped)") from `/proc/<pid>/stat` alone: what
/// the scan reads of every rank that stopped stepping, for the job-wide
/// hang verdict. None when the process is gone.
pub fn state(pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f = parse_stat(&text)?;
    Some(format!("{} ({})", f.state, f.state_name()))
}

/// Whether a process with this pid exists (zombies included).
pub fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The scheduler's accounting of a process's main thread
/// (`/proc/<pid>/schedstat`): how long it ran, and how long it was
/// runnable but waited for a CPU. The straggler detector reads the wait's
/// growth to tell host CPU contention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedStat {
    /// Time on a CPU, nanoseconds.
    pub on_cpu_ns: u64,
    /// Time runnable but waiting for a CPU (run_delay), nanoseconds.
    pub run_delay_ns: u64,
    /// Times it was scheduled.
    pub timeslices: u64,
}

/// Parses the text of `/proc/<pid>/schedstat` ("on_cpu run_delay slices").
pub fn parse_schedstat(text: &str) -> Option<SchedStat> {
    let mut f = text.split_whitespace().map(|v| v.parse::<u64>().ok());
    Some(SchedStat {
        on_cpu_ns: f.next()??,
        run_delay_ns: f.next()??,
        timeslices: f.next()??,
    })
}

/// Reads the main thread's schedstat; None when the process is gone or the
/// kernel keeps no schedstats.
pub fn schedstat(pid: u32) -> Option<SchedStat> {
    parse_schedstat(&std::fs::read_to_string(format!("/proc/{pid}/schedstat")).ok()?)
}

/// The host's 1-minute load average (`/proc/loadavg`).
pub fn loadavg() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Splits a waitpid status into (exit code, signal).
pub fn decode_status(status: i32) -> (Option<i32>, Option<i32>) {
    let sig = status & 0x7f;
    if sig == 0 {
        (Some((status >> 8) & 0xff), None)
    } else {
        (None, Some(sig))
    }
}

/// When process `pid` started, as CLOCK_MONOTONIC nanoseconds: its launch.
/// None when /proc cannot say.
pub fn process_start_ns(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = text.get(text.rfind(')')? + 1..)?;
    // Fields after the command: state is field 3, starttime field 22.
    let ticks: u64 = after.split_whitespace().nth(19)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .ok()
        .filter(|h| *h > 0)?;
    let boot_ns = ticks.checked_mul(1_000_000_000)? / hz;
    // starttime counts from boot including suspend (CLOCK_BOOTTIME).
    let mut boot = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut boot) } != 0 {
        return None;
    }
    let boot_now =
        u64::try_from(boot.tv_sec).ok()? * 1_000_000_000 + u64::try_from(boot.tv_nsec).ok()?;
    let mono = warden_core::goodput::mono_now();
    Some(boot_ns.saturating_sub(boot_now.saturating_sub(mono)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_own_start_is_in_the_past() {
        let start = process_start_ns(std::process::id()).unwrap();
        let now = warden_core::goodput::mono_now();
        assert!(
            start <= now && now - start < 3_600_000_000_000,
            "{start} {now}"
        );
    }

    #[test]
    fn parses_stat_with_odd_comm() {
        let line = "1234 (py (rank) 0) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0 100 1000000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0 0 0 0 0 0 0 0 256";
        let f = parse_stat(line).unwrap();
        assert_eq!(f.state, 'S');
        assert_eq!(f.cpu_ticks, 300);
        assert_eq!(f.threads, 7);
        assert_eq!(f.exit_status, Some(256));
        assert_eq!(decode_status(256), (Some(1), None));
        assert_eq!(decode_status(9), (None, Some(9)));
    }

    #[test]
    fn parses_schedstat_and_reads_our_own() {
        let s = parse_schedstat("123456 7890 42\n").unwrap();
        assert_eq!(
            s,
            SchedStat {
                on_cpu_ns: 123456,
                run_delay_ns: 7890,
                timeslices: 42
            }
        );
        assert!(parse_schedstat("1 2").is_none());
        if let Some(own) = schedstat(std::process::id()) {
            assert!(own.on_cpu_ns > 0);
        }
        assert!(loadavg().is_some_and(|l| l >= 0.0));
    }

    #[test]
    fn reads_own_process() {
        let f = read(std::process::id()).unwrap();
        assert!(f.threads >= 1);
        assert!(alive(std::process::id()));
        assert!(parse_stat("garbage").is_none());
    }
}

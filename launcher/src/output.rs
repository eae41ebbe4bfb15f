//! Worker output: each line copied to the console with its rank as prefix
//! (`[rank 3] ...`, stdout to stdout, stderr to stderr) and, unprefixed, to
//! the rank's log file of the attempt
//! (`<log-dir>/<job>/attempt_<n>/rank_<r>.{stdout,stderr}.log`).
//!
//! The console is written by a thread of its own through a bounded queue:
//! a console that stops reading (a paused pager, a full pipe) must not stall
//! the supervisor or the embedded agent; lines it cannot take are dropped
//! from the console only, counted, and said so. The log files get every byte.
//!
//! The log tree is the launcher's own ([`LogRoot`]): `<log-dir>/<job>` and
//! each `attempt_<n>` are directories of the launcher's user, mode 0700,
//! never a symlink (a shared `--log-dir` such as `/tmp/runs` is fine), and
//! each log file is created `O_CREAT | O_EXCL | O_NOFOLLOW` relative to its
//! directory's descriptor. A link or another user's file planted at a log's
//! name is refused with a message naming it, never written through; the
//! launcher's own file from an earlier run of the same job id is replaced.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use tokio::io::{AsyncRead, AsyncReadExt};
use warden_core::fsafe::{self, Dir, FsError};

/// Longest line kept whole; a longer run without a newline (a progress
/// bar) is cut into lines of this size.
const MAX_LINE: usize = 64 * 1024;
/// Console lines queued before further ones are dropped from the console.
const CONSOLE_QUEUE: usize = 8192;

/// Which console stream a line goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

impl Stream {
    /// `stdout` or `stderr`, as in the log file names.
    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// The launcher's console: worker lines and the launcher's own messages,
/// written in order by one thread.
#[derive(Debug, Clone)]
pub struct Console {
    tx: SyncSender<(Stream, Vec<u8>)>,
    dropped: Arc<AtomicU64>,
    quiet: bool,
}

/// Joins the console thread once every [`Console`] is gone.
#[derive(Debug)]
pub struct ConsoleThread(Option<std::thread::JoinHandle<()>>);

impl Console {
    /// Starts the console thread. With `quiet`, worker lines go to the log
    /// files only; the launcher's own messages still show.
    pub fn start(quiet: bool) -> (Self, ConsoleThread) {
        let (tx, rx) = sync_channel(CONSOLE_QUEUE);
        let handle = std::thread::Builder::new()
            .name("warden-console".into())
            .spawn(move || write_console(&rx))
            .ok();
        (
            Self {
                tx,
                dropped: Arc::new(AtomicU64::new(0)),
                quiet,
            },
            ConsoleThread(handle),
        )
    }

    /// A message of the launcher's own, on stderr (`[warden] ...`); waits
    /// for room rather than dropping it.
    pub fn say(&self, msg: impl AsRef<str>) {
        let mut line = Vec::new();
        for l in msg.as_ref().lines() {
            line.extend_from_slice(b"[warden] ");
            line.extend_from_slice(l.as_bytes());
            line.push(b'\n');
        }
        let _ = self.tx.send((Stream::Stderr, line));
    }

    /// Lines written to stderr as they are (the summary).
    pub fn raw(&self, text: impl AsRef<str>) {
        let _ = self
            .tx
            .send((Stream::Stderr, text.as_ref().as_bytes().to_vec()));
    }

    fn worker_line(&self, stream: Stream, line: Vec<u8>) {
        if self.quiet {
            return;
        }
        match self.tx.try_send((stream, line)) {
            Ok(()) | Err(TrySendError::Disconnected(_)) => {}
            Err(TrySendError::Full(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Worker lines the console could not take (they are in the log files).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

impl ConsoleThread {
    /// Waits until everything queued is written (call after dropping every
    /// [`Console`]).
    pub fn join(mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.join();
        }
    }
}

fn write_console(rx: &Receiver<(Stream, Vec<u8>)>) {
    while let Ok((stream, bytes)) = rx.recv() {
        // A console that went away (a closed pipe) is no reason to stop the
        // job: the log files keep everything.
        let _ = match stream {
            Stream::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(&bytes).and_then(|()| out.flush())
            }
            Stream::Stderr => std::io::stderr().lock().write_all(&bytes),
        };
    }
}

/// Longest traceback kept for a report (its end: the innermost frames).
const MAX_TRACEBACK: usize = 16 * 1024;

/// The last error a worker printed on its stderr: a Python traceback's
/// exception, or a C++ exception that ended the process (`terminate called
/// after throwing an instance of 'gloo::IoException'` and its `what():`).
/// For a script that never imports warden, this is what the launcher can
/// tell the agent about why it died (ReportException on its behalf).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Traceback {
    /// The exception's type as printed (`RuntimeError`,
    /// `torch.distributed.DistBackendError`, `gloo::IoException`).
    pub exception_type: String,
    /// Its message's first line.
    pub message: String,
    /// The traceback's lines, the type line last (clipped to its end).
    pub text: String,
}

/// Finds tracebacks in a worker's stderr, line by line; keeps the last
/// complete one (of chained exceptions, the last printed: the one that
/// ended the process).
#[derive(Debug, Default)]
pub struct TracebackScan {
    /// Lines of the traceback being read (after its header).
    open: Option<Vec<String>>,
    /// A C++ `terminate called after throwing` waiting for its `what():`.
    terminate: Option<String>,
    last: Option<Traceback>,
}

impl TracebackScan {
    /// Reads one line (without its newline).
    pub fn line(&mut self, line: &str) {
        let line = line.trim_end_matches(['\r', '\n']);
        // torch.distributed prefixes an uncaught exception's lines with the
        // rank (`[rank0]: Traceback ...`).
        let line = strip_rank_prefix(line);
        if line.starts_with("Traceback (most recent call last):") {
            self.open = Some(vec![line.to_owned()]);
            return;
        }
        if let Some(lines) = self.open.as_mut() {
            if line.starts_with(char::is_whitespace) || line.is_empty() {
                lines.push(line.to_owned());
                return;
            }
            let mut lines = self.open.take().unwrap_or_default();
            if let Some((ty, msg)) = exception_line(line) {
                lines.push(line.to_owned());
                self.last = Some(Traceback {
                    exception_type: ty.to_owned(),
                    message: msg.to_owned(),
                    text: clip_tail(&lines.join("\n"), MAX_TRACEBACK),
                });
            }
            return;
        }
        if let Some(rest) = line.strip_prefix("terminate called after throwing an instance of '") {
            self.terminate = Some(rest.trim_end_matches('\'').to_owned());
            return;
        }
        if let Some(ty) = self.terminate.take()
            && let Some(what) = line.trim_start().strip_prefix("what():")
        {
            self.last = Some(Traceback {
                exception_type: ty.clone(),
                message: what.trim().to_owned(),
                text: format!("terminate called after throwing an instance of '{ty}'\n{line}"),
            });
        }
    }

    /// The last complete traceback read.
    pub fn last(&self) -> Option<&Traceback> {
        self.last.as_ref()
    }
}

/// `line` without torch's `[rankN]: ` prefix.
fn strip_rank_prefix(line: &str) -> &str {
    line.strip_prefix("[rank")
        .and_then(|r| r.split_once("]: "))
        .filter(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .map_or(line, |(_, rest)| rest)
}

/// `Type: message` (or a bare `Type`) when `line` ends a traceback: a
/// dotted Python name first.
fn exception_line(line: &str) -> Option<(&str, &str)> {
    let (ty, msg) = match line.split_once(": ") {
        Some((t, m)) => (t, m),
        None => (line.strip_suffix(':').unwrap_or(line), ""),
    };
    let name_ok = !ty.is_empty()
        && ty.split('.').all(|part| {
            part.chars()
                .next()
                .is_some_and(|c| c.is_alphabetic() || c == '_')
                && part.chars().all(|c| c.is_alphanumeric() || c == '_')
        });
    name_ok.then_some((ty, msg))
}

fn clip_tail(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    s[start..].to_owned()
}

/// Where a stderr pump announces each traceback it completes (the last
/// one stays for the worker's exit watch to read).
pub type TracebackSink = tokio::sync::watch::Sender<Option<Traceback>>;

/// Where a worker stream's lines go besides its log file.
#[derive(Debug, Clone)]
pub struct Copies {
    /// The console prefix (`[rank 3] `, or torchrun's template).
    pub prefix: String,
    /// The console; `None`: this stream is kept off it (torchrun's
    /// `--redirects`, `--local-ranks-filter`).
    pub console: Option<Console>,
    /// The attempt's duplicate file and the filters a line must contain
    /// one of to be copied there (torchrun's `--duplicate-*-filters`).
    pub duplicate: Option<(SharedLog, Vec<String>)>,
}

/// Copies `reader` (a worker's stdout or stderr) to `file` (its log, None
/// when it was refused: the console only) and, prefixed, to the console
/// and the duplicate file when `copies` says so, line by line, until the
/// pipe closes (the worker and everything that inherited the pipe are
/// gone). With `sink`, each traceback the lines complete is left there
/// (the last one wins).
pub async fn pump(
    mut reader: impl AsyncRead + Unpin,
    stream: Stream,
    copies: Copies,
    file: Option<File>,
    sink: Option<TracebackSink>,
) {
    let mut scan = sink.as_ref().map(|_| TracebackScan::default());
    let mut log = file.map(std::io::BufWriter::new);
    let mut buf = vec![0u8; 16 * 1024];
    let mut line: Vec<u8> = Vec::new();
    loop {
        let n = match reader.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &buf[..n];
        if let Some(f) = log.as_mut() {
            // The file gets the bytes as written, flushed per read so a
            // `tail -f` follows the worker.
            let _ = f.write_all(chunk).and_then(|()| f.flush());
        }
        for &b in chunk {
            line.push(b);
            if b == b'\n' || line.len() >= MAX_LINE {
                scan_line(scan.as_mut(), sink.as_ref(), &line);
                emit(&copies, stream, &mut line);
            }
        }
    }
    if !line.is_empty() {
        scan_line(scan.as_mut(), sink.as_ref(), &line);
        line.push(b'\n');
        emit(&copies, stream, &mut line);
    }
    if let Some(mut f) = log {
        let _ = f.flush();
    }
}

fn scan_line(scan: Option<&mut TracebackScan>, sink: Option<&TracebackSink>, line: &[u8]) {
    let (Some(scan), Some(sink)) = (scan, sink) else {
        return;
    };
    let before = scan.last().cloned();
    scan.line(&String::from_utf8_lossy(line));
    if scan.last() != before.as_ref() {
        sink.send_replace(scan.last().cloned());
    }
}

fn emit(copies: &Copies, stream: Stream, line: &mut Vec<u8>) {
    if line.last() != Some(&b'\n') {
        line.push(b'\n');
    }
    let mut out = Vec::with_capacity(copies.prefix.len() + line.len());
    out.extend_from_slice(copies.prefix.as_bytes());
    out.append(line);
    if let Some((file, filters)) = &copies.duplicate {
        let text = String::from_utf8_lossy(&out);
        if filters.iter().any(|f| text.contains(f.as_str()))
            && let Ok(mut f) = file.lock()
        {
            let _ = f.write_all(&out).and_then(|()| f.flush());
        }
    }
    if let Some(console) = &copies.console {
        console.worker_line(stream, out);
    }
}

/// The log file of local rank `rank`'s `stream` in `attempt_dir`.
pub fn log_file(attempt_dir: &Path, rank: u32, stream: Stream) -> PathBuf {
    attempt_dir.join(log_name(rank, stream))
}

fn log_name(rank: u32, stream: Stream) -> String {
    format!("rank_{rank}.{}.log", stream.as_str())
}

/// Mode of the launcher's log directories: its user's alone.
const LOG_DIR_MODE: u32 = 0o700;
/// Mode of a log file.
const LOG_FILE_MODE: u32 = 0o600;

/// `<log-dir>/<job>`, opened as the launcher's own directory.
#[derive(Debug)]
pub struct LogRoot {
    dir: Dir,
}

/// Why a log directory or file was refused.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// The directory or file is not the launcher's (a symlink, another
    /// user's, a directory others may write...).
    #[error("{0}")]
    Refused(#[from] FsError),
    /// Something already at a log file's name that is not the launcher's
    /// own earlier log.
    #[error(
        "{path} exists and {why}: a file planted where a log goes is refused, never written through"
    )]
    Planted {
        /// The log file's path.
        path: String,
        /// What is there.
        why: String,
    },
}

impl LogRoot {
    /// Creates (mode 0700) or opens `path`, which must be a directory of
    /// the launcher's user and not a symlink; its parents (`--log-dir`)
    /// are created as needed and followed as the system resolves them.
    pub fn open(path: &Path) -> Result<Self, LogError> {
        Ok(Self {
            dir: Dir::ensure(path, LOG_DIR_MODE)?,
        })
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The directory of attempt `n` (`attempt_<n>`, mode 0700), created
    /// in this one through its descriptor; an existing one must be the
    /// launcher's and not a symlink.
    pub fn attempt(&self, n: u32) -> Result<AttemptLogs, LogError> {
        Ok(AttemptLogs {
            dir: self.dir.sub(&format!("attempt_{n}"), LOG_DIR_MODE, true)?,
            filtered: Default::default(),
        })
    }
}

/// One attempt's log directory, open.
#[derive(Debug)]
pub struct AttemptLogs {
    dir: Dir,
    /// `filtered_stdout.log` and `filtered_stderr.log` (torchrun's
    /// `--duplicate-*-filters`), shared by the attempt's ranks, made on
    /// first use; `None` inside when it could not be made.
    filtered: [std::sync::OnceLock<Option<SharedLog>>; 2],
}

/// A log file several ranks' pumps write whole lines to.
pub type SharedLog = Arc<std::sync::Mutex<File>>;

impl AttemptLogs {
    /// Its path.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Creates local rank `rank`'s `stream` log (mode 0600) with
    /// `O_CREAT | O_EXCL | O_NOFOLLOW`. Something already there is
    /// replaced only when it is the launcher's own regular file with one
    /// link (an earlier run of the same job id, or a replaced rank's);
    /// anything else is refused.
    pub fn create(&self, rank: u32, stream: Stream) -> Result<File, LogError> {
        self.create_named(&log_name(rank, stream))
    }

    /// The attempt's `filtered_<stream>.log`, made on first use (a failure
    /// is said once, by the caller, and the duplicates are not written).
    pub fn filtered(&self, stream: Stream) -> Result<SharedLog, String> {
        let i = match stream {
            Stream::Stdout => 0,
            Stream::Stderr => 1,
        };
        let mut error = None;
        let made = self.filtered[i].get_or_init(|| {
            self.create_named(&format!("filtered_{}.log", stream.as_str()))
                .map(|f| Arc::new(std::sync::Mutex::new(f)))
                .map_err(|e| error = Some(e.to_string()))
                .ok()
        });
        made.clone()
            .ok_or_else(|| error.unwrap_or_else(|| "it could not be created".into()))
    }

    fn create_named(&self, name: &str) -> Result<File, LogError> {
        let name = name.to_owned();
        match self.dir.create_new(&name, LOG_FILE_MODE) {
            Err(FsError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::AlreadyExists => {}
            r => return Ok(r?),
        }
        let path = self.dir.path().join(&name).display().to_string();
        let st = self.dir.stat(&name)?;
        let planted = |why: String| LogError::Planted {
            path: path.clone(),
            why,
        };
        if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
            return Err(planted("is a symlink".into()));
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(planted("is not a regular file".into()));
        }
        if st.st_uid != fsafe::me() {
            return Err(planted(format!(
                "is owned by uid {}, not by the launcher's uid {}",
                st.st_uid,
                fsafe::me()
            )));
        }
        if st.st_nlink != 1 {
            return Err(planted(format!("has {} hard links", st.st_nlink)));
        }
        // The launcher's own earlier log: its name goes, then a new file.
        self.dir.remove(&name)?;
        Ok(self.dir.create_new(&name, LOG_FILE_MODE)?)
    }
}

/// The last `lines` lines of `file` (for a diagnosis: what the rank said
/// before it died).
pub fn tail(file: &Path, lines: usize) -> Vec<String> {
    let Ok(text) = std::fs::read(file) else {
        return Vec::new();
    };
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lines_are_prefixed_and_files_hold_the_raw_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rank_0.stdout.log");
        let (tx, rx) = sync_channel(16);
        let console = Console {
            tx,
            dropped: Arc::new(AtomicU64::new(0)),
            quiet: false,
        };
        let input: &[u8] = b"one\ntwo\npartial";
        let dup = dir.path().join("filtered_stdout.log");
        let copies = Copies {
            prefix: "[rank 0] ".into(),
            console: Some(console),
            duplicate: Some((
                Arc::new(std::sync::Mutex::new(File::create(&dup).unwrap())),
                vec!["tw".into(), "zzz".into()],
            )),
        };
        pump(
            input,
            Stream::Stdout,
            copies,
            Some(File::create(&file).unwrap()),
            None,
        )
        .await;
        assert_eq!(std::fs::read_to_string(&dup).unwrap(), "[rank 0] two\n");
        let got: Vec<String> = rx
            .try_iter()
            .map(|(_, l)| String::from_utf8(l).unwrap())
            .collect();
        assert_eq!(
            got,
            ["[rank 0] one\n", "[rank 0] two\n", "[rank 0] partial\n"]
        );
        assert_eq!(std::fs::read(&file).unwrap(), input);
        assert_eq!(tail(&file, 2), ["two", "partial"]);
    }

    #[test]
    fn a_planted_log_link_is_refused_and_an_earlier_log_replaced() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let root = LogRoot::open(&dir.path().join("job")).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(root.path()), 0o700);
        let attempt = root.attempt(0).unwrap();
        assert_eq!(mode(attempt.path()), 0o700);
        // A link where a log goes: refused, its target untouched.
        let victim = dir.path().join("victim.txt");
        std::fs::write(&victim, "precious").unwrap();
        let log = attempt.path().join("rank_0.stdout.log");
        std::os::unix::fs::symlink(&victim, &log).unwrap();
        let e = attempt.create(0, Stream::Stdout).unwrap_err().to_string();
        assert!(
            e.contains("symlink") && e.contains("rank_0.stdout.log"),
            "{e}"
        );
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert!(log.is_symlink());
        // A hard link to another file: refused too.
        let err = attempt.path().join("rank_0.stderr.log");
        std::fs::hard_link(&victim, &err).unwrap();
        let e = attempt.create(0, Stream::Stderr).unwrap_err().to_string();
        assert!(e.contains("hard links"), "{e}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        // The launcher's own earlier log (a rerun of the job id): replaced.
        let mine = attempt.path().join("rank_1.stdout.log");
        std::fs::write(&mine, "old run").unwrap();
        let mut f = attempt.create(1, Stream::Stdout).unwrap();
        f.write_all(b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&mine).unwrap(), "new");
        assert_eq!(mode(&mine), 0o600);
        // A log root that is a symlink is refused.
        let link = dir.path().join("linked");
        std::os::unix::fs::symlink(dir.path().join("job"), &link).unwrap();
        assert!(
            LogRoot::open(&link)
                .unwrap_err()
                .to_string()
                .contains("symlink")
        );
    }

    #[test]
    fn the_last_traceback_of_a_chain_is_kept() {
        let text = "\
step 7
Traceback (most recent call last):
  File \"t.py\", line 3, in <module>
    raise KeyError('x')
KeyError: 'x'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File \"t.py\", line 5, in <module>
    dist.all_reduce(t)
    ~~~~~~~~~~~~~~~^^^
torch.distributed.DistBackendError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242
more of the message
";
        let mut scan = TracebackScan::default();
        for l in text.lines() {
            scan.line(l);
        }
        // The same, as torch.distributed prints it (every line prefixed).
        let mut prefixed = TracebackScan::default();
        for l in text.lines() {
            prefixed.line(&format!("[rank12]: {l}"));
        }
        assert_eq!(prefixed.last(), scan.last());
        let t = scan.last().unwrap();
        assert_eq!(t.exception_type, "torch.distributed.DistBackendError");
        assert!(
            t.message
                .ends_with("Connection closed by peer [127.0.0.1]:4242"),
            "{t:?}"
        );
        assert!(
            t.text.starts_with("Traceback (most recent call last):"),
            "{t:?}"
        );
        assert!(
            t.text.contains("dist.all_reduce(t)") && !t.text.contains("KeyError"),
            "{t:?}"
        );
    }

    #[test]
    fn a_cpp_terminate_is_an_exception_and_prose_is_not() {
        let mut scan = TracebackScan::default();
        for l in [
            "Traceback (most recent call last):",
            "  File \"x.py\", line 1, in <module>",
            "this is not an exception line, just prose",
        ] {
            scan.line(l);
        }
        assert_eq!(scan.last(), None);
        scan.line("terminate called after throwing an instance of 'gloo::IoException'");
        scan.line("  what():  [pair.cc:589] Read error [127.0.0.1]:1: Connection reset by peer");
        let t = scan.last().unwrap();
        assert_eq!(t.exception_type, "gloo::IoException");
        assert!(t.message.starts_with("[pair.cc:589] Read error"), "{t:?}");
        // "terminate called without an active exception" names nothing.
        let mut scan = TracebackScan::default();
        scan.line("terminate called without an active exception");
        assert_eq!(scan.last(), None);
    }
}

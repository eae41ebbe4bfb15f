//! Worker output: each line copied to the console with its rank as prefix
//! (`[rank 3] ...`, stdout to stdout, stderr to stderr) and, unprefixed, to
//! the rank's log file of the attempt
//! (`<log-dir>/<job>/attempt_<n>/rank_<r>.{stdout,stderr}.log`).
//!
//! The console is written by a thread of its own through a bounded queue:
//! a console that stops reading (a paused pager, a full pipe) must not stall
//! the supervisor or the embedded agent; lines it cannot take are dropped
//! from the console only, counted, and said so. The log files get every byte.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use tokio::io::{AsyncRead, AsyncReadExt};

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

/// Copies `reader` (a worker's stdout or stderr) to `file` and, prefixed
/// with `prefix`, to the console, line by line, until the pipe closes (the
/// worker and everything that inherited the pipe are gone).
pub async fn pump(
    mut reader: impl AsyncRead + Unpin,
    stream: Stream,
    prefix: String,
    file: PathBuf,
    console: Console,
) {
    let mut log = match std::fs::File::create(&file) {
        Ok(f) => Some(std::io::BufWriter::new(f)),
        Err(e) => {
            console.say(format!(
                "cannot write {}: {e}; this output goes to the console only",
                file.display()
            ));
            None
        }
    };
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
                emit(&console, stream, &prefix, &mut line);
            }
        }
    }
    if !line.is_empty() {
        line.push(b'\n');
        emit(&console, stream, &prefix, &mut line);
    }
    if let Some(mut f) = log {
        let _ = f.flush();
    }
}

fn emit(console: &Console, stream: Stream, prefix: &str, line: &mut Vec<u8>) {
    if line.last() != Some(&b'\n') {
        line.push(b'\n');
    }
    let mut out = Vec::with_capacity(prefix.len() + line.len());
    out.extend_from_slice(prefix.as_bytes());
    out.append(line);
    console.worker_line(stream, out);
}

/// The log file of local rank `rank`'s `stream` in `attempt_dir`.
pub fn log_file(attempt_dir: &Path, rank: u32, stream: Stream) -> PathBuf {
    attempt_dir.join(format!("rank_{rank}.{}.log", stream.as_str()))
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
        pump(
            input,
            Stream::Stdout,
            "[rank 0] ".into(),
            file.clone(),
            console,
        )
        .await;
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
}

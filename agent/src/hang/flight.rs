//! A rank's torch flight recorder, asked for over its `Control` stream and
//! read back, bounded in time and in memory.
//!
//! In: a rank (its key) and how long to wait. Out: where each of its
//! process groups stands ([`warden_core::detect::flight_recorder::PgPosition`]),
//! or why there is nothing: "no flight-recorder dump within 2s" (a rank
//! frozen with SIGSTOP, or stuck holding the GIL, never answers, and that is
//! an answer too), the client's own reason (torch.distributed not
//! initialised, the recorder off), or a refused dump.
//! Never: read a path the rank chose, or walk anything a rank could have
//! made. For each request the agent creates one file itself
//! (`O_CREAT | O_EXCL`, 0600, a random name) directly in its stack-dump
//! directory (`<slot_dir>/stacks`, 0711, the agent's: a rank can create,
//! rename or remove nothing there), hands the file to the rank's uid
//! (`fchown` through the descriptor), keeps that descriptor, and reads the
//! dump through it once the rank has taken the file's write bits off (its
//! "done"). Afterwards it removes that one name, which it made. No
//! directory is ever handed over, so there is no tree to walk (a rank once
//! built a 30,000-deep chain of directories in the one it was handed, and
//! the agent's recursive removal overflowed its stack). A dump over
//! [`MAX_DUMP_BYTES`] is refused from its size, unread; one within it is
//! parsed on a blocking thread under the parser's caps (entries and groups
//! counted while read). Not wired into the hang path here: the caller
//! decides when to ask.

use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use warden_core::detect::flight_recorder::{self, MAX_DUMP_BYTES, PgPosition};

use crate::act::in_process::{self, Handles};
use crate::ranks::RankKey;
use crate::ranks::registry::RankState;

/// How often the file is looked at while waiting.
const POLL: Duration = Duration::from_millis(20);

/// Asks `key`'s client to dump its flight recorder and reads the dump,
/// waiting at most `wait` for it. `handles` are in-process restarts'
/// (the registry, for the rank's registration and stack-dump directory,
/// and the ranks' `Control` streams), nothing more.
pub async fn request_dump(
    handles: &Handles,
    key: &RankKey,
    wait: Duration,
) -> Result<Vec<PgPosition>, String> {
    let (generation, file, name, path) = {
        let reg = handles.registry.lock();
        let e = reg
            .ranks
            .get(key)
            .ok_or_else(|| format!("{key} is not registered with this agent"))?;
        if !matches!(e.state, RankState::Running | RankState::Hung) {
            return Err(format!("{key} is {}, not running", e.state.as_str()));
        }
        let (file, name) = make_file(reg.stacks(), key, e.owner)?;
        let path = reg.stacks().path().join(&name);
        (e.generation, file, name, path)
    };
    let seq = in_process::ask_dump(&handles.restarts, key, generation, path.clone());
    let out = wait_and_read(file, &path, wait).await;
    in_process::end_dump(&handles.restarts, key, seq);
    // The one name the agent made (the rank can neither rename nor replace
    // it: the directory is the agent's).
    if let Err(e) = handles.registry.lock().stacks().remove(&name) {
        tracing::warn!(rank = %key, error = %e, "cannot remove the flight-recorder file");
    }
    out
}

/// The request's file: a random name nobody could plant anything at
/// beforehand, created exclusively (0600) in the agent's own directory and
/// handed to the rank's uid, so its client can write it in place.
fn make_file(
    stacks: &warden_core::fsafe::Dir,
    key: &RankKey,
    owner: Option<warden_core::fsafe::Owner>,
) -> Result<(std::fs::File, String), String> {
    let prefix = format!("{}-{}.fr.", sanitize(&key.job), key.rank);
    let (file, name) = stacks
        .create_random(&prefix, 0o600)
        .map_err(|e| format!("cannot create a flight-recorder file: {e}"))?;
    let path = stacks.path().join(&name);
    if let Some(o) = owner.filter(|o| o.uid != warden_core::fsafe::me() && o.uid != 0)
        && let Err(e) = warden_core::fsafe::give(&file, &path, o)
    {
        let _ = stacks.remove(&name);
        return Err(format!(
            "cannot hand {} to the rank's uid {}: {e}",
            path.display(),
            o.uid
        ));
    }
    Ok((file, name))
}

/// Waits until the rank marks the file complete (its write bits off) and
/// reads it through the agent's own descriptor.
async fn wait_and_read(
    file: std::fs::File,
    path: &std::path::Path,
    wait: Duration,
) -> Result<Vec<PgPosition>, String> {
    let deadline = Instant::now() + wait;
    loop {
        let meta = file
            .metadata()
            .map_err(|e| format!("cannot inspect {}: {e}", path.display()))?;
        if meta.mode() & 0o222 == 0 {
            let path = path.to_owned();
            return tokio::task::spawn_blocking(move || read(file, meta.len(), &path))
                .await
                .map_err(|e| format!("reading the flight-recorder dump failed: {e}"))?;
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "no flight-recorder dump within {}",
                humantime::format_duration(wait)
            ));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Refuses a dump over the cap from its size (unread), else reads it (at
/// most one byte over the cap: the rank may still be writing) and parses
/// it; a client that could not dump says why in
/// `{"warden_unavailable": "..."}`.
fn read(mut f: std::fs::File, len: u64, path: &std::path::Path) -> Result<Vec<PgPosition>, String> {
    let cap = MAX_DUMP_BYTES as u64;
    if len > cap {
        return Err(flight_recorder::FlightRecorderError::TooLarge {
            len: usize::try_from(len).unwrap_or(usize::MAX),
            max: MAX_DUMP_BYTES,
        }
        .to_string());
    }
    f.seek(SeekFrom::Start(0))
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0).saturating_add(1));
    f.take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if let Some(why) = unavailable(&bytes) {
        return Err(format!("no flight-recorder dump: {why}"));
    }
    flight_recorder::parse(&bytes).map_err(|e| e.to_string())
}

/// The client's reason for writing no dump, if the file is one.
fn unavailable(bytes: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Why {
        warden_unavailable: String,
    }
    if bytes.len() > 4096 {
        return None;
    }
    let w: Why = serde_json::from_slice(bytes).ok()?;
    Some(warden_slot::truncate_utf8(&w.warden_unavailable, 512).to_owned())
}

fn sanitize(s: &str) -> String {
    let s: String = s
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const RANK0: &[u8] = include_bytes!(
        "../../../tests/fixtures/flight_recorder/gloo_rank0_waiting_in_all_reduce.json"
    );

    use std::path::PathBuf;
    use std::sync::Arc;

    use crate::config::Config;
    use crate::ranks::registry::RegisterRequest;
    use crate::state::AgentState;
    use tokio_stream::StreamExt;
    use warden_proto::v1 as pb;

    fn agent() -> (tempfile::TempDir, Arc<AgentState>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = Config::default();
        cfg.api.socket = dir.path().join("w.sock").display().to_string();
        cfg.agent.state_dir = dir.path().join("state").display().to_string();
        let state = Arc::new(AgentState::new(cfg, "test".into()).expect("state"));
        (dir, state)
    }

    /// Registers rank `rank` of job "j" as this process; its generation.
    fn register(state: &AgentState, rank: u32) -> (RankKey, u64, PathBuf) {
        let reg = state
            .registry()
            .register(&RegisterRequest::for_test("j", rank, 2), 0)
            .expect("register");
        let key = RankKey {
            job: "j".into(),
            rank,
        };
        (key, reg.generation, reg.stack_dump_path)
    }

    /// The rank's side, as the Python client does it: the request off the
    /// `Control` stream, the dump written in place and marked done.
    #[tokio::test]
    async fn a_rank_answers_on_its_control_stream_and_the_dump_is_parsed() {
        let (_dir, state) = agent();
        let (key, generation, stack) = register(&state, 0);
        let mut stream = crate::api::control::control(
            &state,
            pb::ControlRequest {
                job_id: "j".into(),
                global_rank: 0,
                generation,
            },
        )
        .await
        .expect("control stream");
        let stack2 = stack.clone();
        let rank = tokio::spawn(async move {
            let stack = stack2;
            let m = stream
                .next()
                .await
                .expect("a message")
                .expect("not an error");
            assert_eq!(m.kind, pb::control_message::Kind::DumpFlightRecorder as i32);
            let path = PathBuf::from(&m.flight_recorder_path);
            warden_client::flight::check_path(&path, Some(&stack)).expect("an agreed path");
            warden_client::flight::write_dump(&path, RANK0).expect("write");
            path
        });
        let p = request_dump(&state.in_process(), &key, Duration::from_secs(30))
            .await
            .expect("a dump");
        assert_eq!(p[0].pg, "0:default_pg");
        assert_eq!(p[0].pending.as_deref(), Some("gloo:all_reduce #5"));
        let path = rank.await.expect("rank task");
        assert!(!path.exists(), "the request's file is removed");
        let left: Vec<_> = std::fs::read_dir(path.parent().expect("stacks"))
            .expect("ls")
            .flatten()
            .map(|e| e.path())
            .filter(|p| p != &stack)
            .collect();
        assert!(left.is_empty(), "only the stack-dump file stays: {left:?}");
    }

    /// A rank that never answers (frozen, or its client without the
    /// handler) is an answer within the wait; a stream opened later does
    /// not deliver the stale request.
    #[tokio::test]
    async fn a_silent_rank_is_an_answer_and_its_request_is_withdrawn() {
        let (_dir, state) = agent();
        let (key, generation, _) = register(&state, 1);
        let e = request_dump(&state.in_process(), &key, Duration::from_millis(300))
            .await
            .expect_err("nobody answers");
        assert_eq!(e, "no flight-recorder dump within 300ms");
        let dumps =
            in_process::subscribe_dumps(&state.in_process(), &key, generation).expect("subscribe");
        assert!(dumps.borrow().is_none(), "withdrawn");
        let e = request_dump(
            &state.in_process(),
            &RankKey {
                job: "j".into(),
                rank: 9,
            },
            Duration::from_millis(10),
        )
        .await
        .expect_err("unknown");
        assert!(e.contains("not registered"), "{e}");
    }

    /// A file the agent made, as `make_file` does, and its path.
    fn made(t: &tempfile::TempDir) -> (std::fs::File, PathBuf) {
        let dir = warden_core::fsafe::Dir::ensure(&t.path().join("stacks"), 0o711).expect("dir");
        let key = RankKey {
            job: "j".into(),
            rank: 0,
        };
        let (f, name) = make_file(&dir, &key, None).expect("file");
        (f, dir.path().join(name))
    }

    #[tokio::test]
    async fn a_dump_marked_done_is_read_through_the_agents_descriptor() {
        let t = tempfile::tempdir().expect("tempdir");
        let (f, path) = made(&t);
        warden_client::flight::write_dump(&path, RANK0).expect("write");
        let p = wait_and_read(f, &path, Duration::from_secs(5))
            .await
            .expect("read");
        assert_eq!(p[0].pending.as_deref(), Some("gloo:all_reduce #5"));
    }

    #[tokio::test]
    async fn a_dump_not_marked_done_is_no_answer_within_the_wait() {
        let t = tempfile::tempdir().expect("tempdir");
        let (f, path) = made(&t);
        std::fs::write(&path, RANK0).expect("write, never marked done");
        let t0 = Instant::now();
        let e = wait_and_read(f, &path, Duration::from_millis(200))
            .await
            .expect_err("not done");
        assert_eq!(e, "no flight-recorder dump within 200ms");
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    }

    #[tokio::test]
    async fn a_huge_file_is_refused_unread_and_bad_json_by_its_field() {
        let t = tempfile::tempdir().expect("tempdir");
        let (f, path) = made(&t);
        let w = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open");
        w.set_len(MAX_DUMP_BYTES as u64 * 4).expect("sparse");
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o400))
            .expect("done");
        let e = wait_and_read(f, &path, Duration::from_secs(5))
            .await
            .expect_err("huge");
        assert!(e.contains("over the"), "{e}");
        let (f, path) = made(&t);
        warden_client::flight::write_dump(&path, b"{\"pg_status\": 7}").expect("write");
        let e = wait_and_read(f, &path, Duration::from_secs(5))
            .await
            .expect_err("bad json");
        assert!(e.contains("pg_status"), "{e}");
    }

    #[tokio::test]
    async fn the_clients_reason_is_passed_on() {
        let t = tempfile::tempdir().expect("tempdir");
        let (f, path) = made(&t);
        warden_client::flight::write_dump(
            &path,
            br#"{"warden_unavailable": "torch.distributed is not initialised"}"#,
        )
        .expect("write");
        let e = wait_and_read(f, &path, Duration::from_secs(5))
            .await
            .expect_err("unavailable");
        assert_eq!(
            e,
            "no flight-recorder dump: torch.distributed is not initialised"
        );
    }
}

//! A rank's torch flight recorder, asked for over its `Control` stream and
//! read back, bounded in time.
//!
//! In: a rank (its key) and how long to wait. Out: where each of its
//! process groups stands ([`warden_core::detect::flight_recorder::PgPosition`]),
//! or why there is nothing: "no flight-recorder dump within 2s" (a rank
//! frozen with SIGSTOP, or stuck holding the GIL, never answers, and that is
//! an answer too), the client's own reason (torch.distributed not
//! initialised, the recorder off), or a refused file.
//! Never: read a path the rank chose. The agent makes a fresh directory for
//! each request inside its stack-dump directory (`<slot_dir>/stacks`, 0711,
//! the agent's), hands it to the rank's uid, names the file in it, reads it
//! only as a plain file of one link (never through a symlink), at most
//! [`MAX_DUMP_BYTES`] + 1 bytes, and removes the directory afterwards. Not
//! wired into the hang path here: the caller decides when to ask.

use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use warden_core::detect::flight_recorder::{self, MAX_DUMP_BYTES, PgPosition};

use super::RankKey;
use super::registry::RankState;
use crate::act::in_process::{self, Handles};

/// How often the file is looked for while waiting.
const POLL: Duration = Duration::from_millis(20);
/// The file's name in the request's directory.
const FILE: &str = "flight_recorder.json";

/// Asks `key`'s client to dump its flight recorder and reads the dump,
/// waiting at most `wait` for it. `handles` are in-process restarts'
/// (the registry, for the rank's registration and stack-dump directory,
/// and the ranks' `Control` streams), nothing more.
pub async fn request_dump(
    handles: &Handles,
    key: &RankKey,
    wait: Duration,
) -> Result<Vec<PgPosition>, String> {
    let (generation, stacks, owner) = {
        let reg = handles.registry.lock();
        let e = reg
            .ranks
            .get(key)
            .ok_or_else(|| format!("{key} is not registered with this agent"))?;
        if !matches!(e.state, RankState::Running | RankState::Hung) {
            return Err(format!("{key} is {}, not running", e.state.as_str()));
        }
        let stacks = e
            .stack_dump_path
            .parent()
            .map(Path::to_path_buf)
            .ok_or_else(|| format!("{key} has no stack-dump directory"))?;
        (e.generation, stacks, e.owner)
    };
    let dir = make_dir(&stacks, key, owner)?;
    let path = dir.join(FILE);
    let seq = in_process::ask_dump(&handles.restarts, key, generation, path.clone());
    let out = wait_and_read(&path, wait).await;
    in_process::end_dump(&handles.restarts, key, seq);
    // Whatever the rank left there (a planted link is removed, never
    // followed).
    if let Err(e) = std::fs::remove_dir_all(&dir) {
        tracing::warn!(rank = %key, dir = %dir.display(), error = %e, "cannot remove the flight-recorder directory");
    }
    out
}

/// A fresh directory for one request: a random name nobody could plant
/// anything at beforehand, 0700, handed to the rank's uid so its client
/// can write a temporary file and rename it.
fn make_dir(
    stacks: &Path,
    key: &RankKey,
    owner: Option<warden_core::fsafe::Owner>,
) -> Result<PathBuf, String> {
    let prefix = format!("{}-{}.fr.", sanitize(&key.job), key.rank);
    let name = warden_core::fsafe::random_name(&prefix)
        .map_err(|e| format!("cannot name a flight-recorder directory: {e}"))?;
    let dir = stacks.join(name);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    if let Some(o) = owner.filter(|o| o.uid != warden_core::fsafe::me() && o.uid != 0) {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(&dir)
            .map_err(|e| format!("cannot open {}: {e}", dir.display()))?;
        if let Err(e) = warden_core::fsafe::give(&f, &dir, o) {
            let _ = std::fs::remove_dir(&dir);
            return Err(format!(
                "cannot hand {} to the rank's uid {}: {e}",
                dir.display(),
                o.uid
            ));
        }
    }
    Ok(dir)
}

/// Waits for `path` to appear (the client renames a complete file into
/// place) and parses it.
async fn wait_and_read(path: &Path, wait: Duration) -> Result<Vec<PgPosition>, String> {
    let deadline = Instant::now() + wait;
    loop {
        match warden_core::fsafe::open_leaf(path) {
            Ok((f, _)) => return read(f, path),
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(format!("flight-recorder dump refused: {e}")),
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

/// Reads at most one byte over the cap (so an oversized file is refused,
/// not cut) and parses it; a client that could not dump says why in
/// `{"warden_unavailable": "..."}`.
fn read(f: std::fs::File, path: &Path) -> Result<Vec<PgPosition>, String> {
    let mut bytes = Vec::new();
    f.take(MAX_DUMP_BYTES as u64 + 1)
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
    Some(warden_client::slot::truncate_utf8(&w.warden_unavailable, 512).to_owned())
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
    /// `Control` stream, the dump written to a temporary name and renamed.
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
        let rank = tokio::spawn(async move {
            let m = stream
                .next()
                .await
                .expect("a message")
                .expect("not an error");
            assert_eq!(m.kind, pb::control_message::Kind::DumpFlightRecorder as i32);
            let path = PathBuf::from(&m.flight_recorder_path);
            warden_client::flight::check_path(&path, Some(&stack)).expect("an agreed path");
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, RANK0).expect("write");
            std::fs::rename(&tmp, &path).expect("rename");
            path
        });
        let p = request_dump(&state.in_process(), &key, Duration::from_secs(30))
            .await
            .expect("a dump");
        assert_eq!(p[0].pg, "0:default_pg");
        assert_eq!(p[0].pending.as_deref(), Some("gloo:all_reduce #5"));
        let path = rank.await.expect("rank task");
        assert!(
            !path.parent().expect("dir").exists(),
            "the request's directory is removed"
        );
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

    #[tokio::test]
    async fn a_dump_renamed_into_place_is_read() {
        let t = tempfile::tempdir().expect("tempdir");
        let path = t.path().join(FILE);
        let tmp = t.path().join("tmp");
        std::fs::write(&tmp, RANK0).expect("write");
        std::fs::rename(&tmp, &path).expect("rename");
        let p = wait_and_read(&path, Duration::from_secs(5))
            .await
            .expect("read");
        assert_eq!(p[0].pending.as_deref(), Some("gloo:all_reduce #5"));
    }

    #[tokio::test]
    async fn nothing_written_is_an_answer_within_the_wait() {
        let t = tempfile::tempdir().expect("tempdir");
        let t0 = Instant::now();
        let e = wait_and_read(&t.path().join(FILE), Duration::from_millis(200))
            .await
            .expect_err("nothing there");
        assert_eq!(e, "no flight-recorder dump within 200ms");
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    }

    #[tokio::test]
    async fn a_planted_symlink_is_never_followed() {
        let t = tempfile::tempdir().expect("tempdir");
        let secret = t.path().join("secret");
        std::fs::write(&secret, RANK0).expect("write");
        let path = t.path().join(FILE);
        std::os::unix::fs::symlink(&secret, &path).expect("symlink");
        let e = wait_and_read(&path, Duration::from_secs(5))
            .await
            .expect_err("a symlink");
        assert!(e.contains("refused"), "{e}");
        // A hard link to someone else's file: two links, refused too.
        std::fs::remove_file(&path).expect("rm");
        std::fs::hard_link(&secret, &path).expect("link");
        let e = wait_and_read(&path, Duration::from_secs(5))
            .await
            .expect_err("a hard link");
        assert!(e.contains("refused"), "{e}");
    }

    #[tokio::test]
    async fn a_huge_file_and_bad_json_are_refused() {
        let t = tempfile::tempdir().expect("tempdir");
        let path = t.path().join(FILE);
        let f = std::fs::File::create(&path).expect("create");
        f.set_len(MAX_DUMP_BYTES as u64 * 4).expect("sparse");
        let e = wait_and_read(&path, Duration::from_secs(5))
            .await
            .expect_err("huge");
        assert!(e.contains("over the"), "{e}");
        std::fs::write(&path, b"{\"pg_status\": 7}").expect("write");
        let e = wait_and_read(&path, Duration::from_secs(5))
            .await
            .expect_err("bad json");
        assert!(e.contains("pg_status"), "{e}");
    }

    #[tokio::test]
    async fn the_clients_reason_is_passed_on() {
        let t = tempfile::tempdir().expect("tempdir");
        let path = t.path().join(FILE);
        std::fs::write(
            &path,
            br#"{"warden_unavailable": "torch.distributed is not initialised"}"#,
        )
        .expect("write");
        let e = wait_and_read(&path, Duration::from_secs(5))
            .await
            .expect_err("unavailable");
        assert_eq!(
            e,
            "no flight-recorder dump: torch.distributed is not initialised"
        );
    }
}

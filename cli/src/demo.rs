//! `warden demo`: the README's first command. Starts the real `wardend` on
//! its embedded defaults with a scratch runtime directory, waits for systemd's
//! READY=1 on a notify socket of its own (the same signal systemd waits for),
//! shows health and info, starts two toy training ranks (this binary again,
//! linked with the real client), one of which hangs in "backward", follows
//! the events until the agent reports the hang, and shows the ranks. With
//! `--duration` it keeps following until then; Ctrl-C stops it any time.

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio_stream::StreamExt;
use warden_proto::v1 as pb;

use super::{Target, views};

struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the demo.
pub async fn run(duration: Option<Duration>, as_json: bool) -> Result<()> {
    let exe = std::env::current_exe().context("cannot find the warden executable")?;
    let exe = exe.as_path();
    let wardend = exe.with_file_name("wardend");
    if !wardend.exists() {
        bail!(
            "{} not found: build both binaries first (cargo build --release)",
            wardend.display()
        );
    }
    let dir = std::env::temp_dir().join(format!("warden-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let scratch = Scratch(dir.clone());
    let notify_path = dir.join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path)
        .with_context(|| format!("cannot bind {}", notify_path.display()))?;
    notify.set_read_timeout(Some(Duration::from_millis(200)))?;

    eprintln!(
        "starting {} (embedded defaults, runtime directory {})",
        wardend.display(),
        dir.display()
    );
    let mut child = tokio::process::Command::new(&wardend)
        .env("RUNTIME_DIRECTORY", &dir)
        .env("STATE_DIRECTORY", dir.join("state"))
        .env("NOTIFY_SOCKET", &notify_path)
        // The demo shows the API's view; the agent's own log lines would
        // interleave with it (RUST_LOG set by the user still wins).
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("cannot start {}", wardend.display()))?;

    let deadline = Instant::now() + Duration::from_secs(30);
    let mut buf = [0u8; 4096];
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("wardend exited before it was ready ({status}); see its log above");
        }
        if Instant::now() > deadline {
            bail!("wardend did not report READY=1 within 30s");
        }
        match notify.recv(&mut buf) {
            Ok(n)
                if String::from_utf8_lossy(&buf[..n])
                    .lines()
                    .any(|l| l == "READY=1") =>
            {
                break;
            }
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e).context("reading the notify socket"),
        }
    }
    let target = Target::Unix(dir.join(warden_client::paths::SOCKET_NAME));
    eprintln!("wardend is ready (READY=1 received); asking it over {target}\n");
    eprintln!("$ warden health");
    let mut c = target.connect().await?;
    let health = c
        .get_node_health(pb::GetNodeHealthRequest {})
        .await?
        .into_inner();
    views::print_health(&health, as_json)?;
    eprintln!("\n$ warden info");
    let info = c
        .get_agent_info(pb::GetAgentInfoRequest {})
        .await?
        .into_inner();
    views::print_info(&info, as_json, false)?;
    let socket = target_path(&target);
    let mut ranks = Vec::new();
    for rank in 0..2u32 {
        let mut cmd = tokio::process::Command::new(exe);
        cmd.args(["toy-rank", "--step-ms", "60"]);
        if rank == 1 {
            cmd.args(["--hang-at", "40"]);
        }
        ranks.push(
            cmd.env(warden_client::paths::SOCKET_ENV, &socket)
                .env("WARDEN_JOB_ID", "demo")
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .kill_on_drop(true)
                .spawn()
                .context("cannot start a toy rank")?,
        );
    }
    eprintln!(
        "\nstarted 2 toy training ranks of job \"demo\" (60 ms steps); rank 1 will hang in \"backward\" at step 40"
    );
    eprintln!(
        "\n$ warden events --follow   (Ctrl-C to stop; from another shell: WARDEN_SOCKET={socket} warden ranks)"
    );
    let mut stream = c
        .watch_events(pb::WatchEventsRequest { after_id: Some(0) })
        .await?
        .into_inner();
    let stop = async {
        match duration {
            Some(d) => tokio::time::sleep(d).await,
            None => tokio::time::sleep(Duration::from_secs(120)).await,
        }
    };
    tokio::pin!(stop);
    let mut saw_hang = false;
    loop {
        tokio::select! {
            () = &mut stop => break,
            _ = tokio::signal::ctrl_c() => break,
            e = stream.next() => match e {
                Some(Ok(e)) => {
                    views::print_event(&e, as_json)?;
                    if e.kind == "rank.hang" {
                        saw_hang = true;
                    }
                    // The hang's diagnosis and decision close the story.
                    if saw_hang && e.kind == "incident.decided" && duration.is_none() {
                        break;
                    }
                }
                _ => break,
            },
        }
    }
    eprintln!("\n$ warden ranks");
    let listed = c
        .get_ranks(pb::GetRanksRequest::default())
        .await?
        .into_inner();
    views::print_ranks(&listed, as_json)?;
    eprintln!("\n$ warden incidents");
    let incidents = c
        .get_incidents(pb::GetIncidentsRequest::default())
        .await?
        .into_inner();
    super::incidents::print_incidents(&incidents, None, as_json, false)?;
    if !saw_hang {
        eprintln!("\n(no hang was reported before the demo stopped)");
    }
    drop(ranks);
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    eprintln!(
        "\nwardend stopped ({})",
        match status {
            Ok(Ok(s)) => s.to_string(),
            _ => "did not stop in 10s; killed".into(),
        }
    );
    drop(scratch);
    Ok(())
}

fn target_path(t: &Target) -> String {
    match t {
        Target::Unix(p) => p.display().to_string(),
        Target::Tcp(a) => a.clone(),
    }
}

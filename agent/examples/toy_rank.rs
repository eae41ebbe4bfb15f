//! A toy training rank linked with the Rust client: steps with forward,
//! backward and optimizer sections, and faults on request. Used to try the
//! agent by hand and in benchmarks.
//!
//! `toy_rank [STEPS] [STEP_MS] [hang-at=N] [exit-at=N:CODE]`; rank, world
//! size and job come from RANK / WORLD_SIZE / WARDEN_JOB_ID as under a launcher.

use std::time::Duration;

use warden_client::Client;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let steps: u64 = args.first().and_then(|s| s.parse().ok()).unwrap_or(50);
    let step_ms: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(20);
    let opt = |name: &str| {
        args.iter()
            .find_map(|a| a.strip_prefix(&format!("{name}=")).map(str::to_owned))
    };
    let hang_at: Option<u64> = opt("hang-at").and_then(|s| s.parse().ok());
    let exit_at: Option<(u64, i32)> = opt("exit-at").and_then(|s| {
        let (a, b) = s.split_once(':')?;
        Some((a.parse().ok()?, b.parse().ok()?))
    });
    let client = Client::connect();
    eprintln!("toy_rank: connected={} ", client.is_connected());
    let third = Duration::from_millis(step_ms / 3);
    for step in 0..steps {
        client.step_begin(step);
        {
            let _f = client.section("forward");
            std::thread::sleep(third);
        }
        {
            let _b = client.section("backward");
            if hang_at == Some(step) {
                eprintln!("toy_rank: hanging in backward at step {step}");
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
            std::thread::sleep(third);
        }
        {
            let _o = client.section("optimizer");
            std::thread::sleep(third);
        }
        client.step_end(step);
        if let Some((at, code)) = exit_at
            && at == step
        {
            eprintln!("toy_rank: exiting with {code} at step {step}");
            std::process::exit(code);
        }
    }
    client.close();
}

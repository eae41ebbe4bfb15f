//! A toy training rank linked with the real client: steps made of forward,
//! backward and optimizer sections, with a fault on request. `warden demo`
//! runs two of them (the `warden` binary re-executing itself), and
//! `examples/toy_rank.rs` is the same loop for benchmarks and by hand.

use std::time::Duration;

use warden_client::Client;

/// What the toy rank does.
#[derive(Debug, Clone, clap::Args)]
pub struct ToyRank {
    /// Steps to run.
    #[arg(long, default_value_t = 1000)]
    pub steps: u64,
    /// Duration of one step, in milliseconds.
    #[arg(long, default_value_t = 50)]
    pub step_ms: u64,
    /// Hang forever inside "backward" at this step.
    #[arg(long)]
    pub hang_at: Option<u64>,
    /// Exit with this code at --exit-step.
    #[arg(long, requires = "exit_step")]
    pub exit_code: Option<i32>,
    /// The step at which to exit with --exit-code.
    #[arg(long)]
    pub exit_step: Option<u64>,
    /// Make one section slower by this factor (1.3: 30% slower), as a
    /// straggler's would be.
    #[arg(long, default_value_t = 1.0)]
    pub slow_factor: f64,
    /// The section --slow-factor applies to ("forward", "backward",
    /// "optimizer").
    #[arg(long, default_value = "forward")]
    pub slow_section: String,
}

/// Runs the loop; rank, world size and job come from the environment.
pub fn run(opts: &ToyRank) {
    let client = Client::connect();
    let third = Duration::from_millis(opts.step_ms / 3);
    let factor = if opts.slow_factor.is_finite() && opts.slow_factor > 0.0 {
        opts.slow_factor
    } else {
        1.0
    };
    let of = |section: &str| {
        if section == opts.slow_section {
            third.mul_f64(factor)
        } else {
            third
        }
    };
    for step in 0..opts.steps {
        client.step_begin(step);
        {
            let _f = client.section("forward");
            std::thread::sleep(of("forward"));
        }
        {
            let _b = client.section("backward");
            if opts.hang_at == Some(step) {
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
            std::thread::sleep(of("backward"));
        }
        {
            let _o = client.section("optimizer");
            std::thread::sleep(of("optimizer"));
        }
        client.step_end(step);
        if let (Some(code), Some(at)) = (opts.exit_code, opts.exit_step)
            && at == step
        {
            std::process::exit(code);
        }
    }
    client.close();
}

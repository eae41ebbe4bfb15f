//! A toy training rank linked with the Rust client, for trying the agent by
//! hand: `cargo run --example toy_rank -- --steps 100 --hang-at 20`; rank,
//! world size and job come from RANK / WORLD_SIZE / WARDEN_JOB_ID as under
//! a launcher. The loop is `warden_cli::toy_rank`.

use clap::Parser;

#[derive(Debug, Parser)]
struct Args {
    #[command(flatten)]
    toy: warden_cli::toy_rank::ToyRank,
}

fn main() {
    warden_cli::toy_rank::run(&Args::parse().toy);
}
